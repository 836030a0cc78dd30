//! Time to reopen a collection whose WAL holds 100,000 and 1,000,000 entries after its last
//! checkpoint (one 128-d vector per entry, as single-vector inserts leave it), i.e. the replay
//! cost after a crash at the worst point. Checkpoint triggers are pushed out of reach so the WAL
//! really holds every entry; the WAL is written with `Written` durability and synced once
//! (reopen cost does not depend on how the entries were synced).
//!
//! Not a criterion bench: each figure is one expensive run. `cargo bench -p tarn-benches --bench
//! reopen [-- --json] [-- --sizes 100000,1000000]`.

#![allow(clippy::unwrap_used)] // a benchmark that fails should stop loudly

use std::time::Instant;

use tarn_collection::{Collection, CollectionConfig, MetricName};
use tarn_wal::Durability;

const DIM: usize = 128;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.iter().any(|a| a == "--list") {
        return;
    }
    let json = args.iter().any(|a| a == "--json");
    let sizes: Vec<usize> = args
        .iter()
        .position(|a| a == "--sizes")
        .and_then(|i| args.get(i + 1))
        .map(|s| s.split(',').map(|n| n.parse().expect("--sizes")).collect())
        .unwrap_or_else(|| vec![100_000, 1_000_000]);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    if !json {
        println!("| WAL entries after the checkpoint | WAL bytes | write | open (replay) | replayed entries/s |");
        println!("|---|---|---|---|---|");
    }
    for n in sizes {
        let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
        let path = dir.path().join("c");
        let mut config = CollectionConfig::new(DIM, MetricName::Cosine);
        config.checkpoint_wal_bytes = u64::MAX / 2;
        config.checkpoint_mutable_bytes = u64::MAX / 2;
        config.checkpoint_interval_ms = 24 * 3600 * 1000;
        // Writing must not wait for the graph: only the log and the replay are measured.
        config.max_unindexed = usize::MAX / 2;
        let written = Instant::now();
        {
            let c = Collection::create(&path, config).unwrap();
            rt.block_on(async {
                let mut state = 0x9E37_79B9_7F4A_7C15u64;
                let mut tasks = tokio::task::JoinSet::new();
                for i in 0..n {
                    let v: Vec<f32> = (0..DIM)
                        .map(|_| {
                            // xorshift: cheap, seeded, deterministic
                            state ^= state << 13;
                            state ^= state >> 7;
                            state ^= state << 17;
                            (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5
                        })
                        .collect();
                    let c = c.clone();
                    tasks.spawn(async move {
                        c.insert(&[i as u128], &[0], &v, Some(Durability::Written))
                            .await
                            .unwrap()
                    });
                    while tasks.len() >= 512 {
                        tasks.join_next().await.unwrap().unwrap();
                    }
                }
                while let Some(done) = tasks.join_next().await {
                    done.unwrap();
                }
            });
            assert_eq!(c.stats().checkpoint_seq, 0, "a checkpoint ran");
            c.close();
        }
        let write_s = written.elapsed().as_secs_f64();
        let wal_bytes: u64 = std::fs::read_dir(path.join("wal"))
            .unwrap()
            .map(|e| e.unwrap().metadata().unwrap().len())
            .sum();
        let start = Instant::now();
        let c = Collection::open(&path).unwrap();
        let open_s = start.elapsed().as_secs_f64();
        assert_eq!(c.stats().n_documents as usize, n);
        drop(c);
        if json {
            println!(
                "{{\"bench\":\"reopen\",\"wal_entries\":{n},\"wal_bytes\":{wal_bytes},\
                 \"write_s\":{write_s:.3},\"open_s\":{open_s:.4}}}"
            );
        } else {
            println!(
                "| {n} | {:.0} MB | {write_s:.1} s | {open_s:.2} s | {:.0} |",
                wal_bytes as f64 / 1e6,
                n as f64 / open_s
            );
        }
    }
}
