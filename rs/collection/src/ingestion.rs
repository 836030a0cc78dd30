//! The ingestion thread. Per collection, one ingestion thread applies logged operations in
//! sequence order and freezes the mutable segment when a checkpoint is due, handing the frozen
//! segment to the checkpoint thread (`checkpoint.rs`).
//!
//! Invariant (WAL order = apply order): the WAL's writer thread hands every acknowledged entry to
//! this worker through one bounded channel, in sequence order, before the writer's ticket
//! resolves (`IngestFeeder`). The channel being full holds up the WAL writer, which holds up every
//! writer: back-pressure instead of unbounded memory.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender};
use std::sync::Arc;
use std::time::Instant;

use tarn_index::{MutableSegment, Schema};
use tarn_wal::AppendObserver;

use crate::checkpoint::{CheckpointJob, JobOutcome};
use crate::collection::Shared;
use crate::flush::FlushReply;
use crate::indexer::INDEX_BATCH;
use crate::op;
use crate::triggers::CheckpointTriggers;

pub(crate) enum IngestSignal {
    Apply {
        seq: u64,
        payload: Arc<[u8]>,
    },
    /// A flush request is queued (`flush.rs`); ingestion also looks after every signal.
    Flush,
    /// The visible bound was raised (`Collection::raise_visible`); ingestion also looks at it
    /// after every signal.
    Visible,
    Shutdown,
}

/// The WAL observer that feeds the ingestion channel.
pub(crate) struct IngestFeeder(pub(crate) SyncSender<IngestSignal>);

impl AppendObserver for IngestFeeder {
    fn on_appended(&mut self, seq: u64, payload: &Arc<[u8]>) {
        let signal = IngestSignal::Apply {
            seq,
            payload: Arc::clone(payload),
        };
        if self.0.send(signal).is_err() {
            tracing::error!(
                seq,
                "ingestion has stopped; the entry is logged and will be applied at the next open"
            );
        }
    }
}

/// The ingestion thread: applies operations, decides when to checkpoint, and freezes the
/// mutable segment for the checkpoint thread. It never waits for a checkpoint (the WAL writer
/// may be waiting on it, and a checkpoint waits on the WAL writer), so writes go on while the
/// checkpoint thread seals, merges and rebuilds.
pub(crate) struct IngestWorker {
    pub(crate) shared: Arc<Shared>,
    pub(crate) applied_seq: u64,
    /// Logged entries past the visible bound (`Shared::visible`), in sequence order, waiting
    /// to be applied. The channel keeps being drained into it, so the WAL writer is never held
    /// up by entries waiting for their commit (which waits for the WAL writer's later syncs).
    pub(crate) held: VecDeque<(u64, Arc<[u8]>)>,
    /// The committed position last recorded in `COMMITTED` (`lineage::COMMITTED_FILE`), and
    /// when.
    pub(crate) committed_mark: (u64, Instant),
    pub(crate) n_applied: u64,
    /// When the next checkpoint is due (`triggers.rs`).
    pub(crate) triggers: CheckpointTriggers,
    pub(crate) jobs: Option<SyncSender<CheckpointJob>>,
    /// One message per finished job.
    pub(crate) done: Receiver<JobOutcome>,
    /// Jobs sent and not reported done. Automatic checkpoints start only when this is 0.
    pub(crate) in_flight: usize,
    pub(crate) checkpointer: Option<std::thread::JoinHandle<()>>,
    /// WAL payload bytes applied since the unindexed tail was last checked.
    pub(crate) bytes_since_unindexed_check: u64,
}

/// The unindexed tail is checked every 64 operations, or about every quarter of
/// `seal_unindexed` vectors applied but at least every this many payload bytes, whichever comes
/// first (a check reads every partition's lock: not on every apply), and after
/// `UNINDEXED_RECHECK` without a signal.
const UNINDEXED_CHECK_BYTES: u64 = 1 << 20;
const UNINDEXED_RECHECK: std::time::Duration = std::time::Duration::from_millis(20);

/// The longest pause per check while the unindexed tail is past `max_unindexed` and a
/// checkpoint is sealing the previous one.
const MAX_UNINDEXED_PAUSE_MS: u32 = 10;

impl IngestWorker {
    /// Runs until shutdown. Takes its state by reference so that, if it panics, the channel
    /// (and the flush replies queued in it) outlives the unwinding until the collection is
    /// marked failed (`failure::run_guarded`): a flush then sees the failure, not `Closed`.
    pub(crate) fn run(&mut self, signals: &Receiver<IngestSignal>) {
        // The WAL writer may be waiting on this thread (the bounded channel): see
        // docs/CHECKPOINT.md, "Who waits on whom".
        tarn_wal::forbid_ticket_waits("ingestion");
        // A tail replayed at open is checked before anything else arrives; held entries the
        // bound was raised over meanwhile are applied.
        self.check_unindexed();
        self.apply_visible();
        loop {
            // While a checkpoint is in flight or applies went unchecked, the unindexed tail is
            // looked at again after a short idle spell, so that a load's last tail (or one left
            // while a checkpoint ran) is sealed without waiting for another write.
            let recheck = (self.in_flight > 0 || self.bytes_since_unindexed_check > 0)
                .then(|| Instant::now() + UNINDEXED_RECHECK);
            let deadline = [self.triggers.deadline(), recheck, self.committed_mark_due()]
                .into_iter()
                .flatten()
                .min();
            let signal = match deadline {
                None => signals.recv().map_err(|_| RecvTimeoutError::Disconnected),
                Some(deadline) => {
                    signals.recv_timeout(deadline.saturating_duration_since(Instant::now()))
                }
            };
            self.collect_done();
            match signal {
                Ok(IngestSignal::Apply { seq, payload }) => self.held.push_back((seq, payload)),
                Ok(IngestSignal::Flush | IngestSignal::Visible) => {}
                Err(RecvTimeoutError::Timeout) => {
                    let now = Instant::now();
                    if self.triggers.deadline().is_some_and(|at| at <= now) {
                        let in_flight = self.in_flight > 0;
                        if let Some(reason) = self.triggers.deadline_passed(in_flight, now) {
                            self.start_checkpoint(None, reason.as_str());
                        }
                    }
                    self.check_unindexed();
                }
                Ok(IngestSignal::Shutdown) | Err(RecvTimeoutError::Disconnected) => break,
            }
            self.apply_visible();
            if self
                .committed_mark_due()
                .is_some_and(|at| at <= Instant::now())
            {
                self.record_committed();
            }
            while let Some(reply) = self.shared.flushes.take_if_applied(self.applied_seq) {
                self.start_checkpoint(Some(reply), "flush");
            }
        }
        if self.committed_mark_due().is_some() {
            self.record_committed();
        }
        // A flush queued now is answered `Closed` (its checkpoint would never be taken).
        self.shared.flushes.close();
        // Queued checkpoint jobs are answered `Closed`; a running one fails at its WAL barrier
        // (the WAL is closed first) and publishes nothing. The WAL holds everything.
        self.shared.stopping.store(true, Ordering::Release);
        self.jobs = None;
        if let Some(checkpointer) = self.checkpointer.take() {
            if checkpointer.join().is_err() {
                tracing::error!("the checkpoint thread panicked");
            }
        }
    }

    /// When the committed mark should be written next: `None` while it holds the bound (or
    /// the collection is not held).
    fn committed_mark_due(&self) -> Option<Instant> {
        let visible = self.shared.visible.load(Ordering::Acquire);
        let (recorded, at) = self.committed_mark;
        (visible != u64::MAX && visible > recorded)
            .then(|| at + crate::lineage::COMMITTED_PERSIST_INTERVAL)
    }

    /// Records the visible bound (what this copy knows committed) in `COMMITTED`, so that the
    /// copy reopens showing it. A failure is logged and tried again after the interval.
    fn record_committed(&mut self) {
        let visible = self.shared.visible.load(Ordering::Acquire);
        let recorded = match crate::lineage::write_committed(&self.shared.dir, visible) {
            Ok(()) => visible,
            Err(error) => {
                tracing::warn!(%error, "cannot record a copy's committed position");
                self.committed_mark.0
            }
        };
        self.committed_mark = (recorded, Instant::now());
    }

    /// Applies the held entries up to the visible bound, in order.
    fn apply_visible(&mut self) {
        let visible = self.shared.visible.load(Ordering::Acquire);
        while self.held.front().is_some_and(|(seq, _)| *seq <= visible) {
            let Some((seq, payload)) = self.held.pop_front() else {
                break;
            };
            self.apply(seq, &payload);
            let mutable_bytes = self.shared.segments().mutable.estimated_bytes() as u64;
            if let Some(reason) = self.triggers.due_by_size(mutable_bytes, self.in_flight > 0) {
                self.start_checkpoint(None, reason.as_str());
            }
        }
    }

    fn apply(&mut self, seq: u64, payload: &[u8]) {
        // Tests arm it with `panic` to kill this thread (`tests/thread_failure.rs`).
        fail::fail_point!("ingest::apply");
        match op::decode(payload, self.shared.config.dimension) {
            Ok(operation) => {
                // The apply lock first, then the set: the checkpoint thread installs a new set
                // under the same lock.
                let mut state = self.shared.apply.lock();
                let segments = self.shared.segments();
                if let op::Operation::AddFields { fields } = &operation {
                    self.shared.apply_add_fields(&segments, fields);
                }
                let delta = segments.apply(&operation, &mut state);
                // Figures that stats read without the apply lock.
                self.shared
                    .n_documents
                    .fetch_add(delta as u64, Ordering::Relaxed);
                self.shared
                    .n_tenants
                    .store(state.counts.len() as u64, Ordering::Relaxed);
            }
            Err(error) => {
                // Only a bug can get here: every payload was encoded by this crate after
                // validation, and the WAL checksums it.
                self.shared.n_ingest_errors.fetch_add(1, Ordering::Relaxed);
                tracing::error!(seq, %error, "skipped an undecodable WAL entry");
            }
        }
        self.applied_seq = seq;
        self.triggers.applied(payload.len() as u64, Instant::now());
        self.shared.applied.send_replace(seq);
        self.shared.indexer.kick();
        self.n_applied += 1;
        if self.in_flight > 0 {
            // Back-pressure on a checkpoint that cannot keep up: past twice its bound, the
            // mutable segment grows at most about 1,000 operations a second until the checkpoint
            // is done. A bounded pause, never a wait for the checkpoint thread, which may itself
            // be waiting for the WAL writer, which may be waiting for this thread.
            let bound = self
                .shared
                .config
                .checkpoint_mutable_bytes
                .saturating_mul(2);
            if self.shared.segments().mutable.estimated_bytes() as u64 > bound {
                self.collect_done();
                if self.in_flight > 0 {
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
            }
        }
        self.bytes_since_unindexed_check += payload.len() as u64;
        // About every quarter of `seal_unindexed` vectors (payload bytes stand in for them).
        let check_bytes = (self.shared.config.seal_unindexed as u64)
            .saturating_mul(self.shared.config.dimension as u64)
            .min(UNINDEXED_CHECK_BYTES);
        if self.n_applied.is_multiple_of(64) || self.bytes_since_unindexed_check >= check_bytes {
            self.check_unindexed();
        }
    }

    /// The mutable segment's vectors waiting for a graph: past `seal_unindexed` a checkpoint
    /// seals them, building their graphs with tarn's builder (ARCHITECTURE.md, "Where graphs
    /// are built"), and the indexer leaves them alone meanwhile. Past `max_unindexed` (the
    /// exactly searched tail grows faster than sealing takes it), a bounded pause per check
    /// while a checkpoint is in flight; when no checkpoint will take the tail (they fail or
    /// stopped), ingestion indexes with every core instead, and a full ingestion queue then
    /// holds writers back.
    fn check_unindexed(&mut self) {
        self.bytes_since_unindexed_check = 0;
        let mutable = Arc::clone(&self.shared.segments().mutable);
        let n_unindexed = mutable.n_unindexed();
        if let Some(reason) = self
            .triggers
            .due_by_unindexed(n_unindexed, self.in_flight > 0)
        {
            self.start_checkpoint(None, reason.as_str());
            return;
        }
        let max_unindexed = self.shared.config.max_unindexed;
        if n_unindexed <= max_unindexed {
            return;
        }
        if self.triggers.seals_unindexed(n_unindexed) {
            // Never an unbounded wait for the checkpoint thread (see `run`).
            for _ in 0..MAX_UNINDEXED_PAUSE_MS {
                self.collect_done();
                if self.in_flight == 0 {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            if let Some(reason) = self
                .triggers
                .due_by_unindexed(n_unindexed, self.in_flight > 0)
            {
                self.start_checkpoint(None, reason.as_str());
            }
        } else {
            while mutable.n_unindexed() > max_unindexed {
                if mutable.index_pending(INDEX_BATCH) == 0 {
                    break;
                }
            }
        }
    }

    /// Freezes the mutable segment (searches keep reading it; a fresh one takes new writes) and
    /// asks the checkpoint thread to seal it and publish a checkpoint at the applied sequence.
    fn start_checkpoint(&mut self, reply: Option<FlushReply>, reason: &str) {
        tracing::debug!(reason, seq = self.applied_seq, "checkpoint requested");
        if !self.triggers.stopped() {
            let _apply = self.shared.apply.lock();
            let mut segments = self.shared.segments.write();
            if !segments.mutable.is_empty() {
                let fresh = MutableSegment::with_schema(
                    self.shared.config.index_config(),
                    Schema::clone(&self.shared.schema()),
                );
                *segments = Arc::new(segments.freeze(self.applied_seq, fresh));
            }
        }
        self.triggers.started();
        self.publish_tail_owner();
        let job = CheckpointJob {
            seq: self.applied_seq,
            reply,
        };
        match self.jobs.as_ref().map(|jobs| jobs.try_send(job)) {
            Some(Ok(())) => self.in_flight += 1,
            Some(Err(std::sync::mpsc::TrySendError::Full(_))) => {
                // Cannot happen (see `CHECKPOINT_JOBS`); the flush, if any, is answered `Closed`.
                tracing::error!("the checkpoint job queue is full; no checkpoint is made");
            }
            // The checkpoint thread is gone (it panicked): the reply is dropped, so a flush
            // gets `Closed`; the frozen segment stays searchable and in the WAL.
            _ => tracing::error!("the checkpoint thread has stopped; no checkpoint is made"),
        }
    }

    /// Tells the indexer whether a checkpoint will take a tail past `seal_unindexed`.
    fn publish_tail_owner(&self) {
        let seals = self.triggers.seals_unindexed(usize::MAX);
        if !self
            .shared
            .checkpoint_seals_tail
            .swap(seals, Ordering::Relaxed)
            || seals
        {
            return;
        }
        // The indexer left a tail to checkpoints that now fail: it takes it.
        self.shared.indexer.kick();
    }

    /// Takes in the checkpoint thread's reports.
    fn collect_done(&mut self) {
        while let Ok(outcome) = self.done.try_recv() {
            self.in_flight = self.in_flight.saturating_sub(1);
            if let JobOutcome::WalPoisoned = outcome {
                if !self.triggers.stopped() {
                    tracing::error!(
                        "the WAL is poisoned: no more checkpoints until the collection is reopened"
                    );
                }
                self.triggers.stop();
            }
            if let JobOutcome::Failed(error) = outcome {
                tracing::error!(%error, "checkpoint failed; retrying at the next trigger");
                // Retry on the next trigger, not in a tight loop. The frozen segments stay
                // (searchable, and logged in the WAL) and the next checkpoint seals them.
                let mutable = Arc::clone(&self.shared.segments().mutable);
                let (bytes, n_unindexed) =
                    (mutable.estimated_bytes() as u64, mutable.n_unindexed());
                self.triggers.failed(bytes, n_unindexed, Instant::now());
            }
            self.publish_tail_owner();
        }
    }
}
