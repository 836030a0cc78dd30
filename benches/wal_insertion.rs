//! `WalInsertion/<strategy>/<N>`: N concurrent tokio tasks each durably append one entry of one
//! doc id (u128), one user id (u128) and one 128-d f32 vector (the published MuopDB benchmark).
//! Every strategy runs in the same process, on the same disk, with the same runtime (2 workers):
//!
//! - `sync-on-write`: each task writes its entry and fdatasyncs it, under one file lock;
//! - `sync-background`: tasks write; a sync thread wakes every 100 ms, syncs, and acknowledges;
//! - `sync-on-batch`: MuopDB's algorithm: fixed batches of 940; the writer that fills a batch
//!   syncs it; a follower waits up to 10 ms for that, then syncs itself;
//! - `write-group`: tarn's `Wal::append(.., Durability::Fsync)`;
//! - `floor`: no tasks: one write of all N framed entries and one fdatasync, into a preallocated
//!   file like tarn's segments (what the disk allows);
//! - `write-group-loaded/1000`: `write-group` while CPU-bound tasks keep every worker busy.
//!
//! Run: `scripts/bench-wal.sh` (prints the median table for docs/BENCHMARKS.md).
#![allow(clippy::unwrap_used)] // a benchmark that fails should stop loudly

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use tarn_wal::{Durability, Wal, WalConfig};
use tokio::runtime::Runtime;
use tokio::sync::watch;

const CONCURRENCY: [usize; 4] = [1, 10, 100, 1000];
const DIMENSION: usize = 128;

/// One insert as the collection layer will log it: doc id, user id, vector.
fn entry_payload(task_idx: usize) -> Arc<[u8]> {
    let mut bytes = Vec::with_capacity(32 + DIMENSION * 4);
    bytes.extend_from_slice(&(task_idx as u128).to_le_bytes());
    bytes.extend_from_slice(&(7u128 << 64 | task_idx as u128).to_le_bytes());
    for d in 0..DIMENSION {
        bytes.extend_from_slice(&((task_idx * DIMENSION + d) as f32 * 0.001).to_le_bytes());
    }
    bytes.into()
}

/// The same framing as tarn's entries (length, CRC32, sequence number, payload), so that the
/// baselines do the same work per entry.
fn framed(seq: u64, payload: &[u8]) -> Vec<u8> {
    let mut hasher = crc32fast::Hasher::new();
    hasher.update(&seq.to_le_bytes());
    hasher.update(payload);
    let mut bytes = Vec::with_capacity(16 + payload.len());
    bytes.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    bytes.extend_from_slice(&hasher.finalize().to_le_bytes());
    bytes.extend_from_slice(&seq.to_le_bytes());
    bytes.extend_from_slice(payload);
    bytes
}

fn runtime() -> Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn append_file(dir: &std::path::Path, name: &str) -> File {
    OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join(name))
        .unwrap()
}

/// `iters` rounds of [`run_tasks`]; the total wall time (what `iter_custom` wants).
fn task_rounds<F, Fut>(runtime: &Runtime, n: usize, iters: u64, task: F) -> Duration
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    (0..iters).map(|_| run_tasks(runtime, n, &task)).sum()
}

/// Runs `n` tasks, each running `task(idx)`, and returns the wall time until all are done.
fn run_tasks<F, Fut>(runtime: &Runtime, n: usize, task: F) -> Duration
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    runtime.block_on(async {
        let start = Instant::now();
        let handles: Vec<_> = (0..n).map(|idx| tokio::spawn(task(idx))).collect();
        for handle in handles {
            handle.await.unwrap();
        }
        start.elapsed()
    })
}

fn sync_on_write(c: &mut Criterion, runtime: &Runtime, dir: &std::path::Path) {
    let file = Arc::new(Mutex::new(append_file(dir, "sync-on-write.log")));
    let mut group = c.benchmark_group("WalInsertion/sync-on-write");
    group.sample_size(10);
    for n in CONCURRENCY {
        group.bench_function(BenchmarkId::from_parameter(n), |b| {
            b.iter_custom(|iters| {
                task_rounds(runtime, n, iters, |idx| {
                    let file = Arc::clone(&file);
                    async move {
                        let bytes = framed(idx as u64, &entry_payload(idx));
                        tokio::task::spawn_blocking(move || {
                            let mut file = file.lock().unwrap();
                            file.write_all(&bytes).unwrap();
                            file.sync_data().unwrap();
                        })
                        .await
                        .unwrap();
                    }
                })
            });
        });
    }
    group.finish();
}

/// Written bytes counted in entries; the sync thread publishes how many are durable.
struct BackgroundSynced {
    file: Mutex<(File, u64)>,
    synced: watch::Sender<u64>,
}

fn sync_background(c: &mut Criterion, runtime: &Runtime, dir: &std::path::Path) {
    let state = Arc::new(BackgroundSynced {
        file: Mutex::new((append_file(dir, "sync-background.log"), 0)),
        synced: watch::channel(0).0,
    });
    let stop = Arc::new(AtomicBool::new(false));
    let syncer = {
        let (state, stop) = (Arc::clone(&state), Arc::clone(&stop));
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(100));
                let file = state.file.lock().unwrap();
                let written = file.1;
                file.0.sync_data().unwrap();
                drop(file);
                state.synced.send_replace(written);
            }
        })
    };
    let mut group = c.benchmark_group("WalInsertion/sync-background");
    group.sample_size(10);
    for n in CONCURRENCY {
        group.bench_function(BenchmarkId::from_parameter(n), |b| {
            b.iter_custom(|iters| {
                task_rounds(runtime, n, iters, |idx| {
                    let state = Arc::clone(&state);
                    async move {
                        let bytes = framed(idx as u64, &entry_payload(idx));
                        let position = {
                            let mut file = state.file.lock().unwrap();
                            file.0.write_all(&bytes).unwrap();
                            file.1 += 1;
                            file.1
                        };
                        let mut synced = state.synced.subscribe();
                        synced.wait_for(|s| *s >= position).await.unwrap();
                    }
                })
            });
        });
    }
    group.finish();
    stop.store(true, Ordering::Relaxed);
    syncer.join().unwrap();
}

const BATCH_SIZE: u64 = 940;
const FOLLOWER_TIMEOUT: Duration = Duration::from_millis(10);

struct Batched {
    /// File, entries written, entries in the open batch.
    file: Mutex<(File, u64, u64)>,
    synced: watch::Sender<u64>,
}

impl Batched {
    /// Syncs everything written so far unless `position` is already durable.
    fn sync_through(&self, position: u64) {
        let mut file = self.file.lock().unwrap();
        if *self.synced.borrow() >= position {
            return;
        }
        let written = file.1;
        file.0.sync_data().unwrap();
        file.2 = 0;
        drop(file);
        self.synced.send_if_modified(|s| {
            let advanced = written > *s;
            *s = (*s).max(written);
            advanced
        });
    }
}

fn sync_on_batch(c: &mut Criterion, runtime: &Runtime, dir: &std::path::Path) {
    let state = Arc::new(Batched {
        file: Mutex::new((append_file(dir, "sync-on-batch.log"), 0, 0)),
        synced: watch::channel(0).0,
    });
    let mut group = c.benchmark_group("WalInsertion/sync-on-batch");
    group.sample_size(10);
    for n in CONCURRENCY {
        group.bench_function(BenchmarkId::from_parameter(n), |b| {
            b.iter_custom(|iters| {
                task_rounds(runtime, n, iters, |idx| {
                    let state = Arc::clone(&state);
                    async move {
                        let bytes = framed(idx as u64, &entry_payload(idx));
                        let (position, fills_batch) = {
                            let mut file = state.file.lock().unwrap();
                            file.0.write_all(&bytes).unwrap();
                            file.1 += 1;
                            file.2 += 1;
                            (file.1, file.2 >= BATCH_SIZE)
                        };
                        let mut synced = state.synced.subscribe();
                        let waited = if fills_batch {
                            false
                        } else {
                            tokio::time::timeout(
                                FOLLOWER_TIMEOUT,
                                synced.wait_for(|s| *s >= position),
                            )
                            .await
                            .is_ok()
                        };
                        if !waited {
                            let state = Arc::clone(&state);
                            tokio::task::spawn_blocking(move || state.sync_through(position))
                                .await
                                .unwrap();
                        }
                    }
                })
            });
        });
    }
    group.finish();
}

fn write_group(c: &mut Criterion, runtime: &Runtime, dir: &std::path::Path) {
    let (wal, _) = Wal::open(dir.join("write-group"), WalConfig::default()).unwrap();
    let mut group = c.benchmark_group("WalInsertion/write-group");
    group.sample_size(10);
    for n in CONCURRENCY {
        let before = wal.stats();
        group.bench_function(BenchmarkId::from_parameter(n), |b| {
            b.iter_custom(|iters| append_rounds(runtime, &wal, n, iters));
        });
        report_syncs(&format!("write-group/{n}"), n, &before, &wal.stats());
    }
    group.finish();
}

/// `iters` rounds of `n` tasks each appending one entry through tarn's write group.
fn append_rounds(runtime: &Runtime, wal: &Wal, n: usize, iters: u64) -> Duration {
    task_rounds(runtime, n, iters, |idx| {
        let wal = wal.clone();
        async move {
            wal.append(entry_payload(idx), Durability::Fsync)
                .await
                .unwrap();
        }
    })
}

fn report_syncs(label: &str, n: usize, before: &tarn_wal::WalStats, after: &tarn_wal::WalStats) {
    let rounds = (after.n_entries - before.n_entries) as f64 / n as f64;
    eprintln!(
        "syncs: {label}: {:.2} fdatasyncs and {:.2} groups per {n} appends",
        (after.n_syncs - before.n_syncs) as f64 / rounds,
        (after.n_groups - before.n_groups) as f64 / rounds,
    );
}

/// CPU-bound tasks in the loaded runs: twice the worker count, so a worker always has one ready.
const LOAD_TASKS: usize = 4;
/// How long a load task computes between yields. tokio's guidance is 10-100 us between awaits;
/// `write-group-loaded` uses its upper end, and `*-500us` a task that breaks it fivefold.
const LOAD_SLICES: [(&str, Duration); 2] = [
    ("", Duration::from_micros(100)),
    ("-500us", Duration::from_micros(500)),
];

/// CPU-bound tasks that hold every worker, yielding every `slice`, until dropped.
struct Load {
    stop: Arc<AtomicBool>,
}

impl Load {
    fn start(runtime: &Runtime, n_tasks: usize, slice: Duration) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        for _ in 0..n_tasks {
            let stop = Arc::clone(&stop);
            runtime.spawn(async move {
                let mut x = 1u64;
                while !stop.load(Ordering::Relaxed) {
                    let until = Instant::now() + slice;
                    while Instant::now() < until {
                        x = std::hint::black_box(
                            x.wrapping_mul(6364136223846793005).wrapping_add(1),
                        );
                    }
                    tokio::task::yield_now().await;
                }
            });
        }
        Load { stop }
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

fn write_group_loaded(c: &mut Criterion, runtime: &Runtime, dir: &std::path::Path) {
    let (wal, _) = Wal::open(dir.join("write-group-loaded"), WalConfig::default()).unwrap();
    let n = 1000;
    for (suffix, slice) in LOAD_SLICES {
        let load = Load::start(runtime, LOAD_TASKS, slice);
        let mut group = c.benchmark_group(format!("WalInsertion/write-group-loaded{suffix}"));
        group.sample_size(10);
        let before = wal.stats();
        group.bench_function(BenchmarkId::from_parameter(n), |b| {
            b.iter_custom(|iters| append_rounds(runtime, &wal, n, iters));
        });
        group.finish();
        report_syncs(
            &format!("write-group-loaded{suffix}/1000"),
            n,
            &before,
            &wal.stats(),
        );
        drop(load);
    }
}

/// What the runtime alone costs: each task hands a oneshot to another thread, which answers at
/// once (no I/O), and awaits it; unloaded and loaded. The part of `write-group-loaded` that no
/// log can remove: every caller must be polled twice by a busy scheduler.
fn handoff_floor(c: &mut Criterion, runtime: &Runtime) {
    let (to_thread, from_tasks) = std::sync::mpsc::channel::<tokio::sync::oneshot::Sender<()>>();
    let answerer = std::thread::spawn(move || {
        for reply in from_tasks {
            let _ = reply.send(());
        }
    });
    let to_thread = Arc::new(Mutex::new(to_thread));
    let mut group = c.benchmark_group("WalInsertion/handoff-floor");
    group.sample_size(10);
    let n = 1000;
    let loads = [("1000".to_owned(), None)].into_iter().chain(
        LOAD_SLICES
            .iter()
            .map(|(suffix, slice)| (format!("loaded{suffix}-1000"), Some(*slice))),
    );
    for (label, slice) in loads {
        let load = slice.map(|slice| Load::start(runtime, LOAD_TASKS, slice));
        group.bench_function(BenchmarkId::from_parameter(label), |b| {
            b.iter_custom(|iters| {
                task_rounds(runtime, n, iters, |_| {
                    let to_thread = Arc::clone(&to_thread);
                    async move {
                        let (reply, answer) = tokio::sync::oneshot::channel();
                        to_thread.lock().unwrap().send(reply).unwrap();
                        answer.await.unwrap();
                    }
                })
            });
        });
        drop(load);
    }
    group.finish();
    drop(to_thread);
    answerer.join().unwrap();
}

fn floor(c: &mut Criterion, dir: &std::path::Path) {
    const FILE_BYTES: u64 = 1 << 30;
    let mut file = OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .open(dir.join("floor.log"))
        .unwrap();
    rustix::fs::fallocate(&file, rustix::fs::FallocateFlags::empty(), 0, FILE_BYTES).unwrap();
    file.sync_all().unwrap();
    let mut offset = 0u64;
    let mut group = c.benchmark_group("WalInsertion/floor");
    group.sample_size(10);
    for n in CONCURRENCY {
        group.bench_function(BenchmarkId::from_parameter(n), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let bytes: Vec<u8> = (0..n)
                        .flat_map(|idx| framed(idx as u64, &entry_payload(idx)))
                        .collect();
                    if offset + bytes.len() as u64 > FILE_BYTES {
                        offset = 0;
                    }
                    let start = Instant::now();
                    std::os::unix::fs::FileExt::write_all_at(&file, &bytes, offset).unwrap();
                    file.sync_data().unwrap();
                    total += start.elapsed();
                    offset += bytes.len() as u64;
                }
                total
            });
        });
    }
    group.finish();
    file.flush().unwrap();
}

fn wal_insertion(c: &mut Criterion) {
    // Benchmark files go under target/ (a real disk), not /tmp (often tmpfs).
    let base = std::env::var_os("TARN_BENCH_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/bench-data")
        });
    std::fs::create_dir_all(&base).unwrap();
    let dir = tempfile::tempdir_in(&base).unwrap();
    let runtime = runtime();
    floor(c, dir.path());
    write_group(c, &runtime, dir.path());
    write_group_loaded(c, &runtime, dir.path());
    handoff_floor(c, &runtime);
    sync_on_batch(c, &runtime, dir.path());
    sync_background(c, &runtime, dir.path());
    sync_on_write(c, &runtime, dir.path());
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3));
    targets = wal_insertion
}
criterion_main!(benches);
