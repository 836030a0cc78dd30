//! The collection engine on real data (`../shared/data/minilm-debian`, 60,733 x 384, cosine):
//! recall@10 and single-thread queries/s of the mutable (hnsw_rs) and sealed (tarn) segments,
//! build and seal times, memory per vector, insert-to-searchable latency at 1,000 inserts/s, and
//! reopen time against WAL length and sealed size. Not a criterion bench: each figure is one
//! measured run, printed as markdown for docs/BENCHMARKS.md.
//!
//! Run: `cargo bench -p tarn-benches --bench collection_quality` (about 4 minutes).
#![allow(clippy::unwrap_used)] // a benchmark that fails should stop loudly

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tarn_collection::{Collection, CollectionConfig, MetricName};
use tarn_index::{Hit, IndexConfig, Metric, MutableSegment, SealedSegment};
use tarn_testkit::{load_minilm, minilm_dir, Minilm};

const DIM: usize = 384;

fn load(dir: &Path) -> Minilm {
    let data = load_minilm(dir).unwrap();
    assert_eq!(data.dim, DIM);
    data
}

fn recall_and_qps(data: &Minilm, search: impl Fn(&[f32]) -> Vec<Hit>) -> (f64, f64) {
    let n_queries = data.queries.len() / DIM;
    let start = Instant::now();
    let results: Vec<Vec<Hit>> = data.queries.chunks_exact(DIM).map(&search).collect();
    let qps = n_queries as f64 / start.elapsed().as_secs_f64();
    let mut found = 0usize;
    for (q, hits) in results.iter().enumerate() {
        let truth = &data.truth[q * data.truth_width..q * data.truth_width + 10];
        found += hits
            .iter()
            .filter(|h| truth.contains(&(h.doc_id as i32)))
            .count();
    }
    (found as f64 / (n_queries * 10) as f64, qps)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// Resident memory of this process, from /proc/self/statm.
fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

fn segments(data: &Minilm) {
    let config = IndexConfig::new(DIM, Metric::Cosine);
    let rss_before = rss_bytes();
    let mutable = MutableSegment::new(config);
    let n = data.base.len() / DIM;
    let start = Instant::now();
    for (i, row) in data.base.chunks_exact(DIM).enumerate() {
        let mut v = row.to_vec();
        Metric::Cosine.prepare(&mut v);
        mutable.upsert(0, i as u128, &v);
    }
    // What the collection's indexing thread does: batches of 256, hnsw_rs inserting in parallel.
    while mutable.index_pending(256) > 0 {}
    let build = start.elapsed();
    let rss_mutable = rss_bytes().saturating_sub(rss_before);
    let start = Instant::now();
    let mut sealed = SealedSegment::seal(&mutable, 1, n as u64);
    let export = start.elapsed();
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = dir.path().join("seg.tseg");
    let start = Instant::now();
    let bytes = sealed.write(&path).unwrap();
    let write = start.elapsed();
    let start = Instant::now();
    let rss_with_both = rss_bytes();
    let reopened = SealedSegment::open(&path, config).unwrap();
    let open = start.elapsed();
    let rss_sealed = rss_bytes().saturating_sub(rss_with_both);
    drop(reopened);

    println!("### Segments on minilm-debian ({n} x {DIM}, cosine, M=16, ef_construction=200)\n");
    println!(
        "Build: {:.1} s through the mutable segment (store, then index in batches of 256 with",
        build.as_secs_f64()
    );
    println!("hnsw_rs's parallel insert on both cores, as the indexing thread does). Seal: export {:.2} s + write and fsync {:.2} s", export.as_secs_f64(), write.as_secs_f64());
    println!(
        "({:.1} MB) = {:.1}% of the build time. Open of the sealed file: {:.2} s.\n",
        bytes as f64 / 1e6,
        (export + write).as_secs_f64() / build.as_secs_f64() * 100.0,
        open.as_secs_f64()
    );
    let figures = sealed.figures();
    println!(
        "Memory per vector: sealed {:.0} bytes ({:.0} beyond the raw {} bytes); mutable about {:.0} bytes (tarn's copy plus hnsw_rs's own).\n",
        figures.memory_bytes as f64 / n as f64,
        figures.index_bytes as f64 / n as f64,
        DIM * 4,
        mutable.memory_bytes() as f64 / n as f64
    );
    println!(
        "Resident memory measured (growth of the process RSS): mutable segment {:.0} bytes per vector; a sealed segment opened from its file {:.0} bytes per vector.\n",
        rss_mutable as f64 / n as f64,
        rss_sealed as f64 / n as f64
    );
    println!("| ef | mutable (hnsw_rs) recall@10 | mutable q/s | sealed (tarn) recall@10 | sealed q/s | sealed/mutable q/s |");
    println!("|---|---|---|---|---|---|");
    for ef in [32, 64, 128, 256] {
        let prepared = |q: &[f32]| {
            let mut v = q.to_vec();
            Metric::Cosine.prepare(&mut v);
            v
        };
        // Three runs each, the median q/s (the machine is noisy).
        let mut m_runs = Vec::new();
        let mut s_runs = Vec::new();
        let (mut m_recall, mut s_recall) = (0.0, 0.0);
        for _ in 0..3 {
            let (r, q) = recall_and_qps(data, |q| mutable.search(0, &prepared(q), 10, ef, false));
            m_recall = r;
            m_runs.push(q);
            let (r, q) = recall_and_qps(data, |q| {
                sealed.search(0, &prepared(q), 10, ef, false).unwrap()
            });
            s_recall = r;
            s_runs.push(q);
        }
        let (m_qps, s_qps) = (median(m_runs), median(s_runs));
        println!(
            "| {ef} | {m_recall:.3} | {m_qps:.0} | {s_recall:.3} | {s_qps:.0} | {:.2} |",
            s_qps / m_qps
        );
    }
    let (exact_recall, exact_qps) = recall_and_qps(data, |q| {
        let mut v = q.to_vec();
        Metric::Cosine.prepare(&mut v);
        sealed.search(0, &v, 10, 10, true).unwrap()
    });
    println!("| exact | | | {exact_recall:.3} | {exact_qps:.0} | |\n");
}

fn insert_to_searchable(data: &Minilm) {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let c = Collection::create(
        &dir.path().join("c"),
        CollectionConfig::new(DIM, MetricName::Cosine),
    )
    .unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let n = 10_000usize;
    let rows: Arc<Vec<f32>> = Arc::new(data.base[..n * DIM].to_vec());
    let (ack, visible) = rt.block_on(async {
        let mut ticker = tokio::time::interval(Duration::from_millis(1));
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
        let mut tasks = Vec::with_capacity(n);
        for i in 0..n {
            ticker.tick().await;
            let (c, rows) = (c.clone(), Arc::clone(&rows));
            tasks.push(tokio::spawn(async move {
                let start = Instant::now();
                let seq = c
                    .insert(&[i as u128], &[0], &rows[i * DIM..(i + 1) * DIM], None)
                    .await
                    .unwrap();
                let acked = Instant::now();
                c.wait_applied(seq, Duration::from_secs(60)).await.unwrap();
                (
                    (acked - start).as_secs_f64() * 1e3,
                    acked.elapsed().as_secs_f64() * 1e3,
                )
            }));
        }
        let mut ack = Vec::new();
        let mut visible = Vec::new();
        for t in tasks {
            let (a, v) = t.await.unwrap();
            ack.push(a);
            visible.push(v);
        }
        (ack, visible)
    });
    let (mut ack, mut visible) = (ack, visible);
    println!(
        "### Insert-to-searchable at 1,000 inserts/s ({n} single-vector inserts, 384-d, FSYNC)\n"
    );
    println!("| | p50 | p99 | max |");
    println!("|---|---|---|---|");
    println!(
        "| insert call to acknowledgement | {:.2} ms | {:.2} ms | {:.2} ms |",
        percentile(&mut ack, 0.5),
        percentile(&mut ack, 0.99),
        percentile(&mut ack, 1.0)
    );
    println!(
        "| acknowledgement to searchable | {:.2} ms | {:.2} ms | {:.2} ms |\n",
        percentile(&mut visible, 0.5),
        percentile(&mut visible, 0.99),
        percentile(&mut visible, 1.0)
    );
}

fn reopen(data: &Minilm) {
    println!("### Time to reopen a collection\n");
    println!("| WAL entries since the checkpoint | sealed vectors | open (replay) |");
    println!("|---|---|---|");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    for (n_wal, n_sealed) in [
        (0usize, 0usize),
        (10_000, 0),
        (30_000, 0),
        (0, 30_000),
        (0, 60_000),
        (10_000, 50_000),
    ] {
        let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
        let path = dir.path().join("c");
        {
            let mut config = CollectionConfig::new(DIM, MetricName::Cosine);
            config.graph_threshold = 1024;
            let c = Collection::create(&path, config).unwrap();
            rt.block_on(async {
                // Sealed part: batches of 500 per request.
                for start in (0..n_sealed).step_by(500) {
                    let end = (start + 500).min(n_sealed);
                    let ids: Vec<u128> = (start as u128..end as u128).collect();
                    c.insert(&ids, &[0], &data.base[start * DIM..end * DIM], None)
                        .await
                        .unwrap();
                }
                if n_sealed > 0 {
                    c.flush().await.unwrap();
                }
                // WAL part: one vector per entry, many writers at once.
                let mut tasks = Vec::new();
                for i in 0..n_wal {
                    let c = c.clone();
                    let v = data.base[(i % 60_000) * DIM..(i % 60_000 + 1) * DIM].to_vec();
                    tasks.push(tokio::spawn(async move {
                        c.insert(&[(1_000_000 + i) as u128], &[0], &v, None)
                            .await
                            .unwrap()
                    }));
                    if tasks.len() >= 256 {
                        for t in tasks.drain(..) {
                            t.await.unwrap();
                        }
                    }
                }
                for t in tasks {
                    t.await.unwrap();
                }
            });
        }
        let start = Instant::now();
        let c = Collection::open(&path).unwrap();
        let elapsed = start.elapsed();
        assert_eq!(c.stats().n_documents as usize, n_wal + n_sealed);
        println!("| {n_wal} | {n_sealed} | {:.2} s |", elapsed.as_secs_f64());
    }
    println!();
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let Some(dir) = minilm_dir() else {
        println!("collection_quality: SKIPPED (../shared/data/minilm-debian not found)");
        return;
    };
    let data = load(&dir);
    segments(&data);
    insert_to_searchable(&data);
    reopen(&data);
}
