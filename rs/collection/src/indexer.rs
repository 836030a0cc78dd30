//! The indexing thread, which moves stored vectors into the mutable segment's graphs, and the
//! thread pools that graph work runs in (the indexer's, and the checkpoint's builds).

use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};

use crate::collection::Shared;

/// Wakes the indexing thread, which moves stored vectors into the mutable segment's graphs.
#[derive(Debug, Default)]
pub(crate) struct IndexerSignal {
    pending: parking_lot::Mutex<bool>,
    wake: parking_lot::Condvar,
    stop: std::sync::atomic::AtomicBool,
}

impl IndexerSignal {
    pub(crate) fn kick(&self) {
        let mut pending = self.pending.lock();
        if !*pending {
            *pending = true;
            self.wake.notify_one();
        }
    }

    pub(crate) fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        let _pending = self.pending.lock();
        self.wake.notify_all();
    }
}

/// The indexing thread: whenever kicked, indexes the current mutable segment's pending tail in
/// batches (hnsw_rs inserts in parallel) until nothing is pending.
pub(crate) fn run_indexer(shared: Arc<Shared>) {
    loop {
        {
            let mut pending = shared.indexer.pending.lock();
            while !*pending && !shared.indexer.stop.load(Ordering::Acquire) {
                shared.indexer.wake.wait(&mut pending);
            }
            if shared.indexer.stop.load(Ordering::Acquire) {
                return;
            }
            *pending = false;
        }
        while in_index_pool(|| index_batch(&shared)) > 0 {
            // Tests arm it with `panic` to kill this thread (`tests/thread_failure.rs`); after
            // a batch that indexed something, so an idle collection never reaches it.
            fail::fail_point!("indexer::batch");
            if shared.indexer.stop.load(Ordering::Acquire) {
                return;
            }
        }
    }
}

/// One batch of the mutable segment's tail into its graphs, unless a checkpoint is about to
/// seal the tail with tarn's builder (ingestion starts one past `seal_unindexed`: see
/// `IngestWorker::check_unindexed`), which is several times faster than hnsw_rs inserts.
/// Returns how many slots it handled.
fn index_batch(shared: &Shared) -> usize {
    let mutable = Arc::clone(&shared.segments().mutable);
    if shared.checkpoint_seals_tail.load(Ordering::Relaxed)
        && mutable.n_unindexed() >= shared.config.seal_unindexed
    {
        return 0;
    }
    mutable.index_pending(INDEX_BATCH)
}

/// Vectors per indexing batch: large enough for parallel inserts to pay, small enough that a
/// checkpoint or shutdown does not wait long for the indexer.
pub(crate) const INDEX_BATCH: usize = 256;

/// Runs the indexer's batches in a pool of all cores but one (at least one thread). In rayon's
/// global pool a burst of writes had hnsw_rs inserting on every core (about 0.7 ms of CPU per
/// 128-d vector at ef_construction 200, more than a core's worth at 1,400 inserts/s on 2
/// cores), and the threads that answer requests waited for a core after each of their
/// wake-ups (`perf sched`: 0.1 ms on average, 5 ms at worst). With one core left to them,
/// durable inserts went up 1.12x from one client and 1.27x from 64 (medians of 8 alternating
/// rounds, `scripts/bench-insert-ab.sh`). The cost, a slower indexer under a sustained load, is
/// bounded: past `max_unindexed` ingestion itself indexes with every core (see `apply`), and
/// the unindexed tail is searched exactly meanwhile. Its threads run at `INDEX_NICE`.
pub(crate) fn in_index_pool<R: Send>(work: impl FnOnce() -> R + Send) -> R {
    static POOL: OnceLock<Option<rayon::ThreadPool>> = OnceLock::new();
    in_pool(&POOL, "tarn-index", |cores| cores - 1, INDEX_NICE, work)
}

/// The index pool's nice value (the request threads' is 0): when both cores are busy, a woken
/// request thread gets a core ahead of the indexer, which has a quarter of a busy core's time
/// instead of half. Background work below foreground work, as databases run compaction; not
/// lower, because the indexer holds the mutable segment's graph locks that searches read (the
/// idle class starved it while it held one: a 106 ms stall). Measured
/// (docs/benchmarks/history-of-runs.md, "What a request costs, and what changed for it"):
/// 64 clients 1.15x (8 alternating rounds); `scripts/soak.sh 600` search p99 30.6 / 46.9 ms in
/// the first / last third (36 / 90 before).
const INDEX_NICE: i32 = 5;

pub(crate) fn in_pool<R: Send>(
    pool: &OnceLock<Option<rayon::ThreadPool>>,
    name: &'static str,
    threads_for_cores: fn(usize) -> usize,
    nice: i32,
    work: impl FnOnce() -> R + Send,
) -> R {
    let pool = pool.get_or_init(|| {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads_for_cores(cores).max(1))
            .thread_name(move |i| format!("{name}-{i}"))
            .start_handler(move |_| {
                if nice != 0 {
                    // Linux keeps a nice value per thread: this one only.
                    let thread = rustix::process::Pid::from_raw(
                        rustix::thread::gettid().as_raw_nonzero().get(),
                    );
                    if let Err(error) = rustix::process::setpriority_process(thread, nice) {
                        tracing::warn!(%error, name, nice, "could not lower the pool's priority");
                    }
                }
            })
            .build()
            .map_err(|error| tracing::warn!(%error, name, "no thread pool; using the shared one"))
            .ok()
    });
    match pool {
        Some(pool) => pool.install(work),
        None => work(),
    }
}
