//! The public [`Wal`] handle and the log-writer thread that owns the files.
//!
//! Architecture invariants:
//! - Only the log-writer thread touches segment files for writing; callers (threads or async
//!   tasks) only queue requests and wait on tickets, so no tokio worker ever blocks on I/O.
//! - The log-writer thread is the write-group leader: each turn it takes everything queued,
//!   writes it with one vectored write, syncs once if any member needs it, then completes its
//!   appends in sequence order, hands them to the observer, and completes its barriers (`Sync`,
//!   truncation) last. Requests that arrive during the sync form the next group.
//! - Sequence numbers are handed out in queue order; the `n`-th append of a group gets the
//!   group's first sequence number plus `n`.
//! - A panic on the log-writer thread (in the log or in the observer) poisons the log and closes
//!   its queue: the group in flight is answered `Closed`, everything queued and every later
//!   request `Poisoned` naming the panic, so no ticket waits forever.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use crate::config::{Durability, RecoveryReport, WalConfig};
use crate::error::{Result, WalError};
use crate::replay::{Replay, ReplayPosition};
use crate::segmented_log::{SegmentedLog, SharedSegments};
use crate::write_group::{Abandoned, GroupBounds, GroupQueue, Member, Taken, Ticket};

impl From<Abandoned> for Result<u64> {
    fn from(_: Abandoned) -> Self {
        Err(WalError::Closed)
    }
}

#[derive(Debug)]
enum Request {
    Append {
        payload: Arc<[u8]>,
        durability: Durability,
    },
    Sync,
    TruncateBefore(u64),
}

impl Request {
    fn weight(&self) -> usize {
        match self {
            Request::Append { payload, .. } => payload.len() + crate::entry::ENTRY_HEADER_BYTES,
            Request::Sync | Request::TruncateBefore(_) => 0,
        }
    }
}

/// Sees every entry once it is acknowledged, in sequence order, on the log-writer thread: the
/// hook that lets a consumer (tarn's ingestion) apply entries in exactly the log's order. `Fsync`
/// entries are passed after their group's fdatasync, `Written` ones after the write; a group's
/// entries are passed right after their tickets resolve, and before a `Wal::sync()` barrier
/// queued behind them resolves (so once `sync()` returns, everything it covers was observed).
/// Blocking here holds up the writer thread, which pushes back on every writer: that is how a
/// bounded consumer queue applies back-pressure.
pub trait AppendObserver: Send + 'static {
    fn on_appended(&mut self, seq: u64, payload: &Arc<[u8]>);
}

/// Upper bounds (seconds) of the fdatasync latency histogram's buckets.
pub const SYNC_SECONDS_BOUNDS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
];
/// Upper bounds (entries) of the write-group size histogram's buckets.
pub const GROUP_SIZE_BOUNDS: &[f64] = &[
    1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 4096.0,
];

/// A fixed-bucket histogram snapshot: `counts[i]` observations fell at or below `bounds[i]` and
/// above the previous bound; `counts[bounds.len()]` above the last one.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Histogram {
    pub bounds: &'static [f64],
    pub counts: Vec<u64>,
    pub sum: f64,
}

#[derive(Debug)]
struct AtomicHistogram {
    bounds: &'static [f64],
    counts: Vec<AtomicU64>,
    /// Sum in millionths, to keep it in an integer atomic.
    sum_micros: AtomicU64,
}

impl AtomicHistogram {
    fn new(bounds: &'static [f64]) -> Self {
        AtomicHistogram {
            bounds,
            counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_micros: AtomicU64::new(0),
        }
    }

    fn observe(&self, value: f64) {
        let bucket = self
            .bounds
            .iter()
            .position(|b| value <= *b)
            .unwrap_or(self.bounds.len());
        self.counts[bucket].fetch_add(1, Ordering::Relaxed);
        self.sum_micros
            .fetch_add((value * 1e6) as u64, Ordering::Relaxed);
    }

    fn snapshot(&self) -> Histogram {
        Histogram {
            bounds: self.bounds,
            counts: self
                .counts
                .iter()
                .map(|c| c.load(Ordering::Relaxed))
                .collect(),
            sum: self.sum_micros.load(Ordering::Relaxed) as f64 / 1e6,
        }
    }
}

/// Counters for metrics and benchmarks.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct WalStats {
    /// Write groups the leader has processed.
    pub n_groups: u64,
    /// fdatasync calls made (group syncs, barriers and background syncs).
    pub n_syncs: u64,
    /// Entries written.
    pub n_entries: u64,
    /// Entry bytes written (headers included).
    pub n_bytes: u64,
    /// fdatasync latency, in seconds.
    pub sync_seconds: Histogram,
    /// Entries per write group.
    pub group_size: Histogram,
}

#[derive(Debug)]
struct Counters {
    n_groups: AtomicU64,
    n_syncs: AtomicU64,
    n_entries: AtomicU64,
    n_bytes: AtomicU64,
    sync_seconds: AtomicHistogram,
    group_size: AtomicHistogram,
}

impl Default for Counters {
    fn default() -> Self {
        Counters {
            n_groups: AtomicU64::new(0),
            n_syncs: AtomicU64::new(0),
            n_entries: AtomicU64::new(0),
            n_bytes: AtomicU64::new(0),
            sync_seconds: AtomicHistogram::new(SYNC_SECONDS_BOUNDS),
            group_size: AtomicHistogram::new(GROUP_SIZE_BOUNDS),
        }
    }
}

#[derive(Debug)]
struct Shared {
    queue: GroupQueue<Request, Result<u64>>,
    config: WalConfig,
    segments: SharedSegments,
    last_appended_seq: AtomicU64,
    last_durable_seq: AtomicU64,
    first_seq: AtomicU64,
    poisoned: Mutex<Option<Arc<str>>>,
    /// The poisoning error was the disk being full.
    poisoned_out_of_space: std::sync::atomic::AtomicBool,
    counters: Counters,
}

impl Shared {
    /// The error every request gets once the log is poisoned.
    fn poison_error(&self) -> Option<WalError> {
        self.poisoned().map(|first_error| WalError::Poisoned {
            first_error,
            out_of_space: self.poisoned_out_of_space.load(Ordering::Acquire),
        })
    }

    fn poisoned(&self) -> Option<Arc<str>> {
        self.poisoned
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

#[derive(Debug)]
struct Handle {
    shared: Arc<Shared>,
    writer_thread: Mutex<Option<JoinHandle<()>>>,
}

impl Handle {
    fn shut_down(&self) {
        self.shared.queue.close();
        let thread = self
            .writer_thread
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(thread) = thread {
            if thread.join().is_err() {
                tracing::error!("the WAL writer thread panicked");
            }
        }
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        self.shut_down();
    }
}

/// A write-ahead log: a directory of segment files, appended to through write groups by a
/// dedicated thread. Cloning gives another handle to the same log; the writer thread stops (after
/// draining and syncing) when the last handle is dropped or [`Wal::close`] is called.
#[derive(Debug, Clone)]
pub struct Wal {
    handle: Arc<Handle>,
}

impl Wal {
    /// Opens the log in `dir` (created if missing), recovering from whatever a crash left, and
    /// starts its writer thread. Blocking: from async code call it inside `spawn_blocking`.
    pub fn open(dir: impl AsRef<Path>, config: WalConfig) -> Result<(Wal, RecoveryReport)> {
        Self::open_inner(dir.as_ref(), config, None)
    }

    /// [`Wal::open`] with an observer that sees every acknowledged entry in order.
    pub fn open_with_observer(
        dir: impl AsRef<Path>,
        config: WalConfig,
        observer: Box<dyn AppendObserver>,
    ) -> Result<(Wal, RecoveryReport)> {
        Self::open_inner(dir.as_ref(), config, Some(observer))
    }

    /// Creates a new, empty log in `dir` (which must be missing or empty) whose first entry
    /// gets sequence number `first_seq` (at least 1), and starts its writer thread. For a log
    /// that continues another one's numbering: a collection restored from a snapshot replays
    /// the entries after its checkpoint from here, and its next write continues the source's
    /// numbers. Blocking.
    pub fn create_at(dir: impl AsRef<Path>, config: WalConfig, first_seq: u64) -> Result<Wal> {
        let dir = dir.as_ref();
        let log = SegmentedLog::create_at(dir, config.clone(), first_seq)?;
        Self::start(dir, config, log, None)
    }

    fn open_inner(
        dir: &Path,
        config: WalConfig,
        observer: Option<Box<dyn AppendObserver>>,
    ) -> Result<(Wal, RecoveryReport)> {
        let (log, report) = SegmentedLog::open(dir, config.clone())?;
        Ok((Self::start(dir, config, log, observer)?, report))
    }

    fn start(
        dir: &Path,
        config: WalConfig,
        log: SegmentedLog,
        observer: Option<Box<dyn AppendObserver>>,
    ) -> Result<Wal> {
        let shared = Arc::new(Shared {
            queue: GroupQueue::new(),
            config,
            segments: log.segments(),
            last_appended_seq: AtomicU64::new(log.last_written_seq()),
            last_durable_seq: AtomicU64::new(log.last_synced_seq()),
            first_seq: AtomicU64::new(log.first_seq()),
            poisoned: Mutex::new(None),
            poisoned_out_of_space: std::sync::atomic::AtomicBool::new(false),
            counters: Counters::default(),
        });
        let thread_shared = Arc::clone(&shared);
        let writer_thread = std::thread::Builder::new()
            .name("tarn-wal-writer".to_owned())
            .spawn(move || {
                let run =
                    std::panic::AssertUnwindSafe(|| run_writer(&thread_shared, log, observer));
                if let Err(panic) = std::panic::catch_unwind(run) {
                    writer_died(&thread_shared, panic_message(panic.as_ref()));
                }
            })
            .map_err(|e| WalError::io("spawn writer thread", dir, e))?;
        Ok(Wal {
            handle: Arc::new(Handle {
                shared,
                writer_thread: Mutex::new(Some(writer_thread)),
            }),
        })
    }

    fn shared(&self) -> &Shared {
        &self.handle.shared
    }

    fn submit(&self, request: Request) -> Ticket<Result<u64>> {
        if let Some(error) = self.shared().poison_error() {
            return Ticket::ready(Err(error));
        }
        match self.shared().queue.submit(request) {
            Ok(ticket) => ticket,
            // Closed: by `close`, or because the writer died (which poisons first).
            Err(_) => Ticket::ready(Err(self
                .shared()
                .poison_error()
                .unwrap_or(WalError::Closed))),
        }
    }

    /// Appends one entry. The ticket resolves to its sequence number once it is durable
    /// ([`Durability::Fsync`]) or written to the OS ([`Durability::Written`]). The payload is
    /// shared, not copied.
    pub fn append(&self, payload: Arc<[u8]>, durability: Durability) -> Ticket<Result<u64>> {
        let max = self.shared().config.max_entry_bytes;
        if payload.len() > max {
            return Ticket::ready(Err(WalError::EntryTooLarge {
                len: payload.len(),
                max,
            }));
        }
        self.submit(Request::Append {
            payload,
            durability,
        })
    }

    /// A barrier: resolves once every entry appended before it is durable, to the last durable
    /// sequence number.
    pub fn sync(&self) -> Ticket<Result<u64>> {
        self.submit(Request::Sync)
    }

    /// Deletes whole segments whose entries all come before `seq`; resolves to the oldest
    /// sequence number still in the log.
    pub fn truncate_before(&self, seq: u64) -> Ticket<Result<u64>> {
        self.submit(Request::TruncateBefore(seq))
    }

    /// Reads back entries from `from_seq` up to the last one appended now.
    pub fn replay(&self, from_seq: u64) -> Result<Replay> {
        self.replay_range(from_seq, self.last_appended_seq())
    }

    /// Reads back entries `from_seq..=last_seq` (every one of them appended already), with
    /// their payloads as appended: what a reader needs to re-append them elsewhere under the
    /// same sequence numbers. The replay works from the segment list as it is now; a
    /// truncation that deletes a segment it has not read yet makes it fail (`Io`), so a caller
    /// that reads while the log is truncated keeps truncation behind `from_seq` itself.
    pub fn replay_range(&self, from_seq: u64, last_seq: u64) -> Result<Replay> {
        self.replay_resuming(from_seq, last_seq, None)
    }

    /// [`Wal::replay_range`] that starts reading at `at`, where an earlier replay of this log
    /// stopped ([`Replay::position`]), when `at` is the position of `from_seq`: a reader that
    /// follows the log (a shard move's tail) then reads each entry once rather than its
    /// segment from the start on every call. Any other `at` is ignored. The entry read there
    /// is checked like any other (length, checksum, sequence number).
    pub fn replay_resuming(
        &self,
        from_seq: u64,
        last_seq: u64,
        at: Option<ReplayPosition>,
    ) -> Result<Replay> {
        let last_appended = self.last_appended_seq();
        if last_seq > last_appended {
            return Err(WalError::BeyondEnd {
                requested: last_seq,
                last_appended,
            });
        }
        let segments = self
            .shared()
            .segments
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        Replay::new(
            segments,
            from_seq,
            last_seq,
            self.shared().config.max_entry_bytes,
            at,
        )
    }

    /// The last sequence number known to be on disk (0 when none).
    pub fn last_durable_seq(&self) -> u64 {
        self.shared().last_durable_seq.load(Ordering::Acquire)
    }

    /// The last sequence number written (durable or not).
    pub fn last_appended_seq(&self) -> u64 {
        self.shared().last_appended_seq.load(Ordering::Acquire)
    }

    /// The oldest sequence number still in the log.
    pub fn first_seq(&self) -> u64 {
        self.shared().first_seq.load(Ordering::Acquire)
    }

    /// The error requests get while the log is poisoned, if it is (`Poisoned`, out-of-space
    /// when the disk was full).
    pub fn poison_error(&self) -> Option<WalError> {
        self.shared().poison_error()
    }

    /// The first error that poisoned the log, if any.
    pub fn poisoned(&self) -> Option<Arc<str>> {
        self.shared().poisoned()
    }

    pub fn stats(&self) -> WalStats {
        let c = &self.shared().counters;
        WalStats {
            n_groups: c.n_groups.load(Ordering::Relaxed),
            n_syncs: c.n_syncs.load(Ordering::Relaxed),
            n_entries: c.n_entries.load(Ordering::Relaxed),
            n_bytes: c.n_bytes.load(Ordering::Relaxed),
            sync_seconds: c.sync_seconds.snapshot(),
            group_size: c.group_size.snapshot(),
        }
    }

    /// Poisons the log from outside, for a consumer that can no longer do its part (tarn's
    /// collection when one of its threads dies): every queued and later request fails with
    /// `Poisoned { first_error: why }` (or the earlier poisoning error, if any). The group the
    /// writer holds now still completes normally; what it wrote is in the log at the next open.
    pub fn poison(&self, why: &str) {
        poison_and_drain(self.shared(), why.into());
    }

    /// Stops accepting requests, lets the writer finish what is queued and sync, and waits for
    /// it. Every handle sees the log closed afterwards. Returns the poisoning error, if any.
    pub fn close(&self) -> Result<()> {
        self.handle.shut_down();
        match self.shared().poison_error() {
            Some(error) => Err(error),
            None => Ok(()),
        }
    }
}

/// What a panic carried, as text.
fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_owned())
}

/// The log-writer thread panicked: poison the log, close the queue and answer what is queued,
/// so every waiting and later caller fails at once.
fn writer_died(shared: &Shared, why: String) {
    let first_error = format!("the WAL writer thread panicked: {why}");
    tracing::error!(error = %first_error, "WAL writer thread died; the log refuses writes until reopened");
    poison_and_drain(shared, first_error.into());
}

/// Records `first_error` (unless the log is poisoned already), closes the queue and answers
/// every queued request `Poisoned`.
fn poison_and_drain(shared: &Shared, first_error: Arc<str>) {
    let first_error = Arc::clone(
        shared
            .poisoned
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_or_insert(first_error),
    );
    for member in shared.queue.close_and_drain() {
        member.complete(Err(WalError::Poisoned {
            first_error: Arc::clone(&first_error),
            out_of_space: shared.poisoned_out_of_space.load(Ordering::Acquire),
        }));
    }
}

/// The log-writer thread: leads one write group after another until the queue closes.
fn run_writer(
    shared: &Shared,
    mut log: SegmentedLog,
    mut observer: Option<Box<dyn AppendObserver>>,
) {
    crate::write_group::forbid_ticket_waits("WAL writer");
    let bounds = GroupBounds {
        max_members: shared.config.max_group_entries,
        max_weight: shared.config.max_group_bytes,
    };
    // When written-but-unsynced data first appeared (Durability::Written appends).
    let mut unsynced_since: Option<Instant> = None;
    loop {
        let deadline = unsynced_since.map(|since| since + shared.config.background_sync_interval);
        match shared.queue.take_group(bounds, Request::weight, deadline) {
            Taken::Group(group) => {
                lead_group(shared, &mut log, group, observer.as_deref_mut());
                unsynced_since = match unsynced_since {
                    _ if !log.has_unsynced() => None,
                    None => Some(Instant::now()),
                    since => since,
                };
            }
            Taken::TimedOut => {
                background_sync(shared, &mut log);
                unsynced_since = None;
            }
            Taken::Closed => {
                if log.has_unsynced() {
                    background_sync(shared, &mut log);
                }
                return;
            }
        }
    }
}

fn background_sync(shared: &Shared, log: &mut SegmentedLog) {
    if log.poisoned().is_some() {
        return;
    }
    let started = Instant::now();
    let result = log.sync();
    shared.counters.n_syncs.fetch_add(1, Ordering::Relaxed);
    shared
        .counters
        .sync_seconds
        .observe(started.elapsed().as_secs_f64());
    publish(shared, log);
    if let Err(error) = result {
        tracing::error!(%error, "background WAL sync failed");
    }
}

/// Copies the log's positions and poison state to where handles read them.
fn publish(shared: &Shared, log: &SegmentedLog) {
    shared
        .last_appended_seq
        .store(log.last_written_seq(), Ordering::Release);
    shared
        .last_durable_seq
        .store(log.last_synced_seq(), Ordering::Release);
    shared.first_seq.store(log.first_seq(), Ordering::Release);
    if let Some(first_error) = log.poisoned() {
        if log.poisoned_out_of_space() {
            shared.poisoned_out_of_space.store(true, Ordering::Release);
        }
        let mut poisoned = shared.poisoned.lock().unwrap_or_else(|p| p.into_inner());
        poisoned.get_or_insert_with(|| Arc::clone(first_error));
    }
}

/// Writes, syncs and answers one group.
fn lead_group(
    shared: &Shared,
    log: &mut SegmentedLog,
    group: Vec<Member<Request, Result<u64>>>,
    observer: Option<&mut dyn AppendObserver>,
) {
    let payloads: Vec<&[u8]> = group
        .iter()
        .filter_map(|member| match &member.request {
            Request::Append { payload, .. } => Some(&payload[..]),
            _ => None,
        })
        .collect();
    let needs_sync = group.iter().any(|member| {
        matches!(
            member.request,
            Request::Sync
                | Request::Append {
                    durability: Durability::Fsync,
                    ..
                }
        )
    });
    let n_bytes: usize = group.iter().map(|m| m.request.weight()).sum();
    let written = if payloads.is_empty() {
        Ok(log.last_written_seq() + 1)
    } else {
        log.append(&payloads)
    };
    let outcome = written.and_then(|first_seq| {
        if needs_sync {
            shared.counters.n_syncs.fetch_add(1, Ordering::Relaxed);
            let started = Instant::now();
            log.sync()?;
            shared
                .counters
                .sync_seconds
                .observe(started.elapsed().as_secs_f64());
        }
        Ok(first_seq)
    });
    if !payloads.is_empty() {
        shared.counters.group_size.observe(payloads.len() as f64);
    }
    shared.counters.n_groups.fetch_add(1, Ordering::Relaxed);
    if outcome.is_ok() {
        shared
            .counters
            .n_entries
            .fetch_add(payloads.len() as u64, Ordering::Relaxed);
        shared
            .counters
            .n_bytes
            .fetch_add(n_bytes as u64, Ordering::Relaxed);
    }
    drop(payloads);
    publish(shared, log);

    let mut next_seq = match outcome {
        Ok(first_seq) => first_seq,
        Err(error) => {
            for member in group {
                member.complete(Err(error.clone()));
            }
            return;
        }
    };
    // Appends resolve first, then the observer sees them, then barriers (`Sync`, truncation):
    // the woken writers get a core before the consumer the observer wakes (tarn's ingestion,
    // which is not on an acknowledgement's path), and a `Sync` still resolves only after every
    // entry before it was observed (a flush relies on that). The observer keeps the log's order
    // and runs before the next group is taken, so its back-pressure is unchanged.
    let mut observed = Vec::with_capacity(if observer.is_some() { group.len() } else { 0 });
    let mut barriers = Vec::new();
    for member in group {
        match &member.request {
            Request::Append { payload, .. } => {
                if observer.is_some() {
                    observed.push((next_seq, Arc::clone(payload)));
                }
                member.complete(Ok(next_seq));
                next_seq += 1;
            }
            Request::Sync | Request::TruncateBefore(_) => barriers.push(member),
        }
    }
    if let Some(observer) = observer {
        for (seq, payload) in &observed {
            observer.on_appended(*seq, payload);
        }
    }
    drop(observed);
    for member in barriers {
        let result = match member.request {
            Request::TruncateBefore(seq) => {
                let result = log.truncate_before(seq);
                publish(shared, log);
                result
            }
            // `Sync` (appends were completed above).
            _ => Ok(log.last_synced_seq()),
        };
        member.complete(result);
    }
}
