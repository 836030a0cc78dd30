//! The latency of durable appends across WAL segment rollovers (issue 20). Small segments force
//! a rollover every few dozen appends: a rollover seals the active segment (fdatasync), then
//! creates, preallocates and durably publishes the next one, all on the writer thread, while
//! the appends of its group and the ones queued behind it wait.
//!
//! `--writers` threads each append `--payload`-byte entries with `Durability::Fsync`, one at a
//! time, for `--seconds`; the report gives the latency distribution of every append and the
//! number of segments written. Run it with `--segment-bytes` at the default (64 MiB) for the
//! same load without rollovers.
//!
//! Not a criterion bench: `cargo bench -p tarn-benches --bench wal_rollover [-- --seconds 20]`.

#![allow(clippy::unwrap_used)] // a benchmark that fails should stop loudly

use std::sync::Arc;
use std::time::{Duration, Instant};

use tarn_wal::{Durability, Wal, WalConfig};

fn arg(args: &[String], name: &str, default: u64) -> u64 {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map_or(default, |s| s.parse().expect(name))
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.iter().any(|a| a == "--list") {
        return;
    }
    let seconds = arg(&args, "--seconds", 20);
    let n_writers = arg(&args, "--writers", 4) as usize;
    let payload_bytes = arg(&args, "--payload", 1024) as usize;
    let segment_bytes = arg(&args, "--segment-bytes", 64 << 10);
    // A new segment's first reservation (`WalConfig::initial_segment_bytes`); pass the segment
    // size for the whole segment reserved up front.
    let initial_segment_bytes = arg(
        &args,
        "--initial-segment-bytes",
        WalConfig::default().initial_segment_bytes,
    );
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let config = WalConfig {
        segment_bytes,
        initial_segment_bytes,
        ..WalConfig::default()
    };
    let (wal, _) = Wal::open(dir.path(), config).unwrap();
    let end = Instant::now() + Duration::from_secs(seconds);
    let writers: Vec<_> = (0..n_writers)
        .map(|writer| {
            let wal = wal.clone();
            std::thread::spawn(move || {
                let payload: Arc<[u8]> = vec![writer as u8; payload_bytes].into();
                let mut latencies = Vec::new();
                while Instant::now() < end {
                    let start = Instant::now();
                    wal.append(Arc::clone(&payload), Durability::Fsync)
                        .wait()
                        .unwrap();
                    latencies.push(start.elapsed().as_secs_f64() * 1e3);
                }
                latencies
            })
        })
        .collect();
    let mut ms: Vec<f64> = writers
        .into_iter()
        .flat_map(|w| w.join().unwrap())
        .collect();
    let stats = wal.stats();
    drop(wal);
    ms.sort_by(f64::total_cmp);
    let q = |p: f64| ms[((ms.len() - 1) as f64 * p).round() as usize];
    let n_segments = stats.n_bytes.div_ceil(segment_bytes);
    println!(
        "segment {} KiB (first reservation {} KiB), {n_writers} writers, {payload_bytes} B: {} \
         appends ({:.0}/s), about {n_segments} segments; p50 {:.3} ms, p99 {:.3} ms, p99.9 \
         {:.3} ms, max {:.3} ms",
        segment_bytes >> 10,
        initial_segment_bytes >> 10,
        ms.len(),
        ms.len() as f64 / seconds as f64,
        q(0.5),
        q(0.99),
        q(0.999),
        q(1.0)
    );
}
