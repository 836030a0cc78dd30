//! Ingestion's longest pause while a checkpoint merges two large sealed segments (issue 20):
//! the work a checkpoint does under the apply lock must not grow with the collection.
//!
//! Loads `--docs` 128-d documents (seeded random vectors) in tenants of 1,000, half of them
//! before a first flush and half before a second; with `max_sealed_segments = 1` the second
//! flush seals the second half and merges the two into one segment of every document, then
//! installs it. Meanwhile a probe task writes one document at a time (`Durability::Written`, so
//! no fdatasync is timed) and waits until ingestion applied it; a write that waits behind the
//! apply lock shows the pause. The probe runs for two seconds before the flush as a baseline.
//!
//! Every tenant stays below `graph_threshold`, so no HNSW graph is built: the merge itself is
//! quick, and what install does per document is the same with or without graphs.
//!
//! Not a criterion bench: one expensive run. `cargo bench -p tarn-benches --bench merge_pause
//! [-- --docs 1000000]`.

#![allow(clippy::unwrap_used)] // a benchmark that fails should stop loudly

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tarn_collection::{Collection, CollectionConfig, MetricName};
use tarn_wal::Durability;

const DIM: usize = 128;
const DOCS_PER_TENANT: usize = 1_000;
/// The probe writes to tenants past every loaded one.
const PROBE_TENANT: u128 = 1 << 64;

fn main() {
    // `RUST_LOG=tarn_collection::checkpoint=debug` prints how long the install held the apply
    // lock (from the version that logs it on).
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let args: Vec<String> = std::env::args().collect();
    if args.iter().any(|a| a == "--list") {
        return;
    }
    let n_docs: usize = args
        .iter()
        .position(|a| a == "--docs")
        .and_then(|i| args.get(i + 1))
        .map_or(1_000_000, |s| s.parse().expect("--docs"));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let mut config = CollectionConfig::new(DIM, MetricName::L2);
    // Only the two flushes checkpoint.
    config.checkpoint_wal_bytes = u64::MAX / 2;
    config.checkpoint_mutable_bytes = u64::MAX / 2;
    config.checkpoint_interval_ms = 24 * 3600 * 1000;
    config.max_sealed_segments = 1;
    assert!(DOCS_PER_TENANT < config.graph_threshold);
    let c = Collection::create(&dir.path().join("c"), config).unwrap();
    let mut rng = 0x9E37_79B9_7F4A_7C15u64;
    let n_tenants = n_docs.div_ceil(DOCS_PER_TENANT);
    let loaded = Instant::now();
    rt.block_on(async {
        for tenant in 0..n_tenants {
            let ids: Vec<u128> = (0..DOCS_PER_TENANT as u128).collect();
            let vectors = random_vectors(&mut rng, DOCS_PER_TENANT);
            c.insert(&ids, &[tenant as u128], &vectors, Some(Durability::Written))
                .await
                .unwrap();
            if tenant + 1 == n_tenants / 2 {
                c.flush().await.unwrap();
            }
        }
        let seq = c.stats().last_appended_seq;
        c.wait_applied(seq, Duration::from_secs(600)).await.unwrap();
    });
    let load_s = loaded.elapsed().as_secs_f64();

    let stop = Arc::new(AtomicBool::new(false));
    let epoch = Instant::now();
    let probe = {
        let c = c.clone();
        let stop = Arc::clone(&stop);
        rt.spawn(async move {
            let mut rng = 7u64;
            // (start, write->applied ms, of which acknowledged->applied ms)
            let mut samples: Vec<(f64, f64, f64)> = Vec::new();
            let mut doc = 0u128;
            while !stop.load(Ordering::Relaxed) {
                let vector = random_vectors(&mut rng, 1);
                let start = Instant::now();
                let seq = c
                    .insert(&[doc], &[PROBE_TENANT], &vector, Some(Durability::Written))
                    .await
                    .unwrap();
                let acknowledged = Instant::now();
                c.wait_applied(seq, Duration::from_secs(60)).await.unwrap();
                let at = start.duration_since(epoch).as_secs_f64();
                samples.push((
                    at,
                    start.elapsed().as_secs_f64() * 1e3,
                    acknowledged.elapsed().as_secs_f64() * 1e3,
                ));
                doc += 1;
                tokio::time::sleep(Duration::from_micros(200)).await;
            }
            samples
        })
    };
    std::thread::sleep(Duration::from_secs(2));
    let flush_start = epoch.elapsed().as_secs_f64();
    tracing::info!("flush starts");
    rt.block_on(c.flush()).unwrap();
    let flush_end = epoch.elapsed().as_secs_f64();
    std::thread::sleep(Duration::from_millis(500));
    stop.store(true, Ordering::Relaxed);
    let samples = rt.block_on(probe).unwrap();
    let stats = c.stats();
    assert_eq!(stats.n_sealed_segments, 1, "the flush did not merge");
    assert_eq!(
        stats.n_documents as usize,
        n_tenants * DOCS_PER_TENANT + samples.len()
    );

    let mut worst: Vec<&(f64, f64, f64)> = samples.iter().collect();
    worst.sort_by(|a, b| b.1.total_cmp(&a.1));
    for (at, ms, apply_ms) in worst.iter().take(5) {
        println!(
            "pause {ms:.2} ms ({apply_ms:.2} ms of it from acknowledgement to applied) starting \
             {:.3} s after the flush began",
            at - flush_start
        );
    }
    let baseline: Vec<f64> = samples
        .iter()
        .filter(|(at, _, _)| *at < flush_start)
        .map(|(_, ms, _)| *ms)
        .collect();
    let in_flush =
        |(at, ms, _): &&(f64, f64, f64)| *at >= flush_start && at + ms / 1e3 <= flush_end + 0.1;
    let during: Vec<f64> = samples
        .iter()
        .filter(in_flush)
        .map(|(_, ms, _)| *ms)
        .collect();
    let applying: Vec<f64> = samples
        .iter()
        .filter(in_flush)
        .map(|(_, _, ms)| *ms)
        .collect();
    println!(
        "documents {}, load {load_s:.1} s, flush (seal + merge + install) {:.2} s",
        n_tenants * DOCS_PER_TENANT,
        flush_end - flush_start
    );
    for (name, mut ms) in [
        ("write->applied before the flush", baseline),
        ("write->applied during the flush", during),
        ("acknowledged->applied during the flush", applying),
    ] {
        ms.sort_by(f64::total_cmp);
        let q = |p: f64| ms[((ms.len() - 1) as f64 * p).round() as usize];
        println!(
            "probe {name}: {} writes, p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
            ms.len(),
            q(0.5),
            q(0.99),
            q(1.0)
        );
    }
    c.close();
}

/// `n` vectors of uniform values in [-0.5, 0.5), from a xorshift generator (seeded, cheap).
fn random_vectors(state: &mut u64, n: usize) -> Vec<f32> {
    (0..n * DIM)
        .map(|_| {
            *state ^= *state << 13;
            *state ^= *state >> 7;
            *state ^= *state << 17;
            (*state >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        })
        .collect()
}
