//! Ingestion and checkpoints. Per collection, one ingestion thread applies logged operations in
//! sequence order and freezes the mutable segment when a checkpoint is due; one checkpoint
//! thread seals frozen segments, merges and rebuilds, writes manifests, truncates the WAL and
//! deletes old files, while writes go on; one indexing thread moves stored vectors into the
//! mutable segment's graphs.
//!
//! Invariant (WAL order = apply order): the WAL's writer thread hands every acknowledged entry to
//! this worker through one bounded channel, in sequence order, before the writer's ticket
//! resolves (`IngestFeeder`). The channel being full holds up the WAL writer, which holds up every
//! writer: back-pressure instead of unbounded memory.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender};

use crate::flush::FlushReply;
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use tarn_index::{MutableSegment, SealedSegment};
use tarn_wal::{AppendObserver, Wal};

use crate::collection::Shared;
use crate::error::{CollectionError, Result};
use crate::manifest::{self, Manifest, SegmentEntry};
use crate::op;
use crate::retention::Retention;
use crate::segments::SegmentSet;

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
        while in_index_pool(|| shared.segments().mutable.index_pending(INDEX_BATCH)) > 0 {
            // Tests arm it with `panic` to kill this thread (`tests/thread_failure.rs`); after
            // a batch that indexed something, so an idle collection never reaches it.
            fail::fail_point!("indexer::batch");
            if shared.indexer.stop.load(Ordering::Acquire) {
                return;
            }
        }
    }
}

/// Vectors per indexing batch: large enough for parallel inserts to pay, small enough that a
/// checkpoint or shutdown does not wait long for the indexer.
const INDEX_BATCH: usize = 256;

pub(crate) enum IngestSignal {
    Apply {
        seq: u64,
        payload: Arc<[u8]>,
    },
    /// A flush request is queued (`flush.rs`); ingestion also looks after every signal.
    Flush,
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

/// Checkpoint bookkeeping, owned by the checkpoint thread.
pub(crate) struct CheckpointState {
    pub(crate) current: Manifest,
    /// The manifest before `current` (kept as the fallback), if any.
    pub(crate) previous: Option<Manifest>,
    /// The next manifest generation (past every one seen on disk, even damaged ones).
    pub(crate) next_generation: u64,
    /// Tombstone count of each sealed segment as of its last persisted tombstone file (or its
    /// own file, for a segment written with its tombstones). Tombstones are never cleared, so
    /// an equal count means the same set.
    pub(crate) persisted_tombstones: HashMap<u64, usize>,
}

/// What the checkpoint thread reports to ingestion after each job.
#[derive(Debug)]
pub(crate) enum JobOutcome {
    Done,
    /// The checkpoint failed; ingestion retries at the next trigger.
    Failed(String),
    /// The WAL is poisoned: the job was refused before sealing anything, and so will every
    /// later one be until the collection is reopened, so ingestion stops starting them.
    WalPoisoned,
}

/// A request to the checkpoint thread: seal every frozen segment holding operations up to
/// `seq`, and publish a checkpoint at `seq`.
pub(crate) struct CheckpointJob {
    pub(crate) seq: u64,
    pub(crate) reply: Option<FlushReply>,
}

/// Bound of the checkpoint job queue. It never fills: an automatic checkpoint starts only when
/// no job is in flight, and flush requests come one batch at a time, each after the previous
/// batch's checkpoint was answered (`flush.rs`), so at most two jobs are ever queued.
pub(crate) const CHECKPOINT_JOBS: usize = 4;

/// The ingestion thread: applies operations, decides when to checkpoint, and freezes the
/// mutable segment for the checkpoint thread. It never waits for a checkpoint (the WAL writer
/// may be waiting on it, and a checkpoint waits on the WAL writer), so writes go on while the
/// checkpoint thread seals, merges and rebuilds.
pub(crate) struct IngestWorker {
    pub(crate) shared: Arc<Shared>,
    pub(crate) applied_seq: u64,
    pub(crate) wal_bytes_since_checkpoint: u64,
    pub(crate) first_unsaved_at: Option<Instant>,
    pub(crate) n_applied: u64,
    /// The mutable segment's estimated size that triggers the next checkpoint: the configured
    /// bound, pushed one bound further after a failed checkpoint so that a failing disk is not
    /// retried on every apply.
    pub(crate) mutable_bytes_trigger: u64,
    pub(crate) jobs: Option<SyncSender<CheckpointJob>>,
    /// One message per finished job.
    pub(crate) done: Receiver<JobOutcome>,
    /// Set once the checkpoint thread reports the WAL poisoned: no automatic checkpoint starts
    /// again (it could not publish), and a flush is refused without freezing anything.
    pub(crate) checkpoints_stopped: bool,
    /// Jobs sent and not reported done. Automatic checkpoints start only when this is 0.
    pub(crate) in_flight: usize,
    pub(crate) checkpointer: Option<std::thread::JoinHandle<()>>,
}

impl IngestWorker {
    /// Runs until shutdown. Takes its state by reference so that, if it panics, the channel
    /// (and the flush replies queued in it) outlives the unwinding until the collection is
    /// marked failed (`failure::run_guarded`): a flush then sees the failure, not `Closed`.
    pub(crate) fn run(&mut self, signals: &Receiver<IngestSignal>) {
        loop {
            let deadline = self
                .first_unsaved_at
                .filter(|_| !self.checkpoints_stopped)
                .map(|at| at + self.shared.config.checkpoint_interval());
            let signal = match deadline {
                None => signals.recv().map_err(|_| RecvTimeoutError::Disconnected),
                Some(deadline) => {
                    signals.recv_timeout(deadline.saturating_duration_since(Instant::now()))
                }
            };
            self.collect_done();
            match signal {
                Ok(IngestSignal::Apply { seq, payload }) => {
                    self.apply(seq, &payload);
                    if self.in_flight == 0 && !self.checkpoints_stopped {
                        let config = &self.shared.config;
                        if self.wal_bytes_since_checkpoint >= config.checkpoint_wal_bytes {
                            self.start_checkpoint(None, "WAL size");
                        } else if self.shared.segments().mutable.estimated_bytes() as u64
                            >= self.mutable_bytes_trigger
                        {
                            self.start_checkpoint(None, "mutable segment size");
                        }
                    }
                }
                Ok(IngestSignal::Flush) => {}
                Err(RecvTimeoutError::Timeout) if self.in_flight == 0 => {
                    self.start_checkpoint(None, "age")
                }
                // A checkpoint is running; the next one is due an interval from now.
                Err(RecvTimeoutError::Timeout) => self.first_unsaved_at = Some(Instant::now()),
                Ok(IngestSignal::Shutdown) | Err(RecvTimeoutError::Disconnected) => break,
            }
            while let Some(reply) = self.shared.flushes.take_if_applied(self.applied_seq) {
                self.start_checkpoint(Some(reply), "flush");
            }
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

    fn apply(&mut self, seq: u64, payload: &[u8]) {
        // Tests arm it with `panic` to kill this thread (`tests/thread_failure.rs`).
        fail::fail_point!("ingest::apply");
        match op::decode(payload, self.shared.config.dimension) {
            Ok(operation) => {
                // The apply lock first, then the set: the checkpoint thread installs a new set
                // under the same lock.
                let mut counts = self.shared.counts.lock();
                let delta = self.shared.segments().apply(&operation, &mut counts);
                // Figures that stats read without the apply lock.
                self.shared
                    .n_documents
                    .fetch_add(delta as u64, Ordering::Relaxed);
                self.shared
                    .n_tenants
                    .store(counts.len() as u64, Ordering::Relaxed);
            }
            Err(error) => {
                // Only a bug can get here: every payload was encoded by this crate after
                // validation, and the WAL checksums it.
                self.shared.n_ingest_errors.fetch_add(1, Ordering::Relaxed);
                tracing::error!(seq, %error, "skipped an undecodable WAL entry");
            }
        }
        self.applied_seq = seq;
        self.wal_bytes_since_checkpoint += payload.len() as u64;
        self.first_unsaved_at.get_or_insert_with(Instant::now);
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
        if self.n_applied.is_multiple_of(64) {
            // Back-pressure: past the bound, ingestion helps the indexer instead of growing the
            // exactly-searched tail (and a full ingestion queue then holds writers back).
            let mutable = Arc::clone(&self.shared.segments().mutable);
            while mutable.n_unindexed() > self.shared.config.max_unindexed {
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
        if !self.checkpoints_stopped {
            let _apply = self.shared.counts.lock();
            let mut segments = self.shared.segments.write();
            if !segments.mutable.is_empty() {
                let fresh = MutableSegment::new(self.shared.config.index_config());
                *segments = Arc::new(segments.freeze(self.applied_seq, fresh));
            }
        }
        self.wal_bytes_since_checkpoint = 0;
        self.first_unsaved_at = None;
        self.mutable_bytes_trigger = self.shared.config.checkpoint_mutable_bytes;
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

    /// Takes in the checkpoint thread's reports.
    fn collect_done(&mut self) {
        while let Ok(outcome) = self.done.try_recv() {
            self.in_flight = self.in_flight.saturating_sub(1);
            if let JobOutcome::WalPoisoned = outcome {
                if !self.checkpoints_stopped {
                    tracing::error!(
                        "the WAL is poisoned: no more checkpoints until the collection is reopened"
                    );
                }
                self.checkpoints_stopped = true;
                self.first_unsaved_at = None;
            }
            if let JobOutcome::Failed(error) = outcome {
                tracing::error!(%error, "checkpoint failed; retrying at the next trigger");
                // Retry on the next trigger, not in a tight loop. The frozen segments stay
                // (searchable, and logged in the WAL) and the next checkpoint seals them.
                self.first_unsaved_at = Some(Instant::now());
                self.wal_bytes_since_checkpoint = 0;
                self.mutable_bytes_trigger = self.shared.segments().mutable.estimated_bytes()
                    as u64
                    + self.shared.config.checkpoint_mutable_bytes;
            }
        }
    }
}

/// The checkpoint thread: runs `CheckpointJob`s one at a time, in order.
pub(crate) struct Checkpointer {
    pub(crate) shared: Arc<Shared>,
    pub(crate) wal: Wal,
    pub(crate) state: CheckpointState,
    pub(crate) done: std::sync::mpsc::Sender<JobOutcome>,
}

impl Checkpointer {
    pub(crate) fn run(mut self, jobs: Receiver<CheckpointJob>) {
        for job in jobs {
            let result = if self.shared.stopping.load(Ordering::Acquire) {
                Err(CollectionError::Closed)
            } else {
                // A panic fails the collection before the job's flush is answered, so that it
                // gets the failure rather than a dropped reply.
                let seq = job.seq;
                match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    self.checkpoint(seq)
                })) {
                    Ok(result) => result,
                    Err(panic) => {
                        let failure = crate::failure::ThreadFailure {
                            thread: "checkpoint",
                            why: crate::failure::panic_message(panic.as_ref()),
                        };
                        crate::failure::mark_failed(&self.shared, &self.wal, failure.clone());
                        if let Some(reply) = job.reply {
                            reply.answer(Err(Arc::new(CollectionError::Failed(failure))));
                        }
                        return;
                    }
                }
            };
            if result.is_ok() {
                // The frozen segments and replaced sealed ones are dropped by now.
                crate::memory::release_free_memory();
                self.shared.measure_disk(&self.wal);
            }
            let outcome = match &result {
                Ok(_) => {
                    self.shared.n_checkpoints.fetch_add(1, Ordering::Relaxed);
                    JobOutcome::Done
                }
                Err(_) if self.wal.poisoned().is_some() => JobOutcome::WalPoisoned,
                Err(error) => JobOutcome::Failed(error.to_string()),
            };
            if let Some(reply) = job.reply {
                reply.answer(result.map_err(Arc::new));
            }
            let _ = self.done.send(outcome);
        }
    }

    /// Seals the frozen segments, persists tombstones, merges and rebuilds, waits until every
    /// applied operation is durable in the WAL, publishes a new manifest, installs the new
    /// segments for searches, then truncates the WAL and deletes unreferenced files. Returns
    /// the checkpoint sequence number.
    ///
    /// Sealing and merging read segments that ingestion keeps removing documents from. What
    /// they copy holds every operation up to `seq` (applied before the freeze) and maybe some
    /// later removals; those are replayed from the WAL after a crash anyway (removing twice
    /// changes nothing), which is why the WAL must be durable past them before the manifest
    /// names the files. Removals that arrive after the copy are carried over at install.
    pub(crate) fn checkpoint(&mut self, seq: u64) -> Result<u64> {
        // Tests arm it with `panic` to kill this thread (`tests/thread_failure.rs`).
        fail::fail_point!("checkpoint::start");
        if let Some(first_error) = self.wal.poisoned() {
            // Checked before sealing: the checkpoint could not publish (its WAL barrier would
            // fail), so it must not write segment files either.
            self.shared
                .n_checkpoints_refused
                .fetch_add(1, Ordering::Relaxed);
            return Err(tarn_wal::WalError::Poisoned { first_error }.into());
        }
        let dir = self.shared.dir.clone();
        let index_config = self.shared.config.index_config();
        let rebuild_fraction = self.shared.config.rebuild_tombstone_fraction;
        let set = self.shared.segments();
        let generation = self.state.next_generation;
        let mut sealed: Vec<Arc<SealedSegment>> = set.sealed.clone();
        let mut next_segment_id = self.state.current.next_segment_id;
        let mut tombstone_files: HashMap<u64, String> = self
            .state
            .current
            .segments
            .iter()
            .filter_map(|s| s.tombstones.clone().map(|t| (s.id, t)))
            .collect();
        let mut changed = false;

        // 1. Seal the frozen segments up to `seq`, oldest first.
        let to_seal: Vec<(u64, Arc<MutableSegment>)> = set
            .frozen
            .iter()
            .filter(|(frozen_seq, _)| *frozen_seq <= seq)
            .cloned()
            .collect();
        for (frozen_seq, frozen) in to_seal.iter().rev() {
            let segment = in_build_pool(|| {
                SealedSegment::seal_compacting(
                    frozen,
                    next_segment_id,
                    *frozen_seq,
                    rebuild_fraction,
                )
            });
            next_segment_id += 1;
            if segment.figures().n_slots > 0 {
                segment.write(&dir.join(manifest::segment_file_name(segment.id())))?;
                sealed.push(Arc::new(segment));
            }
            changed = true;
        }
        fail::fail_point!("checkpoint::after_seal", |_| abort_for_test());

        // 2. Merge while there are too many sealed segments; rebuild ones full of tombstones.
        SegmentSet::sort_sealed(&mut sealed);
        let mut rebuilt: Vec<u64> = Vec::new();
        while sealed.len() > self.shared.config.max_sealed_segments {
            self.check_stopping()?;
            sealed.sort_by_key(|s| s.figures().n_live);
            let (a, b) = (sealed.remove(0), sealed.remove(0));
            let merged =
                in_build_pool(|| SealedSegment::rebuild(&[&a, &b], next_segment_id, index_config));
            next_segment_id += 1;
            merged.write(&dir.join(manifest::segment_file_name(merged.id())))?;
            tracing::info!(from = ?[a.id(), b.id()], to = merged.id(), "merged sealed segments");
            rebuilt.extend([a.id(), b.id()]);
            sealed.push(Arc::new(merged));
            changed = true;
        }
        for slot in sealed.iter_mut() {
            if slot.tombstone_fraction() > rebuild_fraction {
                self.check_stopping()?;
                let fresh = in_build_pool(|| {
                    SealedSegment::rebuild(&[slot], next_segment_id, index_config)
                });
                next_segment_id += 1;
                fresh.write(&dir.join(manifest::segment_file_name(fresh.id())))?;
                tracing::info!(
                    from = slot.id(),
                    to = fresh.id(),
                    "rebuilt a segment with many tombstones"
                );
                rebuilt.push(slot.id());
                *slot = Arc::new(fresh);
                changed = true;
            }
        }
        SegmentSet::sort_sealed(&mut sealed);
        fail::fail_point!("checkpoint::after_merge", |_| abort_for_test());

        // 3. Persist tombstones that changed since their last file. A segment written in this
        //    checkpoint has its tombstones in its own file (and nobody else can reach it yet).
        let is_old = |id: u64| set.sealed.iter().any(|s| s.id() == id);
        let mut persisted: HashMap<u64, usize> = HashMap::new();
        for segment in &sealed {
            let id = segment.id();
            if !is_old(id) {
                persisted.insert(id, segment.figures().n_tombstoned);
                continue;
            }
            // Counted before encoding: the file holds at least these (tombstones only grow).
            let n_tombstoned = segment.figures().n_tombstoned;
            let previous = self.state.persisted_tombstones.get(&id).copied();
            if previous == Some(n_tombstoned) {
                persisted.insert(id, n_tombstoned);
                continue;
            }
            let name = manifest::tombstone_file_name(id, generation);
            tarn_index::fsutil::write_durably(&dir.join(&name), &segment.encode_tombstones())
                .map_err(|e| CollectionError::io("write tombstones", dir.join(&name), e))?;
            tombstone_files.insert(id, name);
            persisted.insert(id, n_tombstoned);
            changed = true;
        }
        fail::fail_point!("checkpoint::after_tombstones", |_| abort_for_test());

        let publish = changed || seq != self.state.current.checkpoint_seq;
        if publish {
            // What was copied may hold removals applied after `seq`: they must be durable
            // before a manifest names the copies (see above).
            self.check_stopping()?;
            self.wal.sync().wait()?;

            // 4. Publish the new manifest.
            let manifest = Manifest {
                format: 1,
                generation,
                checkpoint_seq: seq,
                next_segment_id,
                segments: sealed
                    .iter()
                    .map(|s| SegmentEntry {
                        id: s.id(),
                        file: manifest::segment_file_name(s.id()),
                        tombstones: tombstone_files.get(&s.id()).cloned(),
                    })
                    .collect(),
            };
            manifest::write_checked(&manifest::manifest_path(&dir, generation), &manifest)?;
            fail::fail_point!("checkpoint::after_manifest", |_| abort_for_test());
            // New snapshots read this one from now on (before anything below is deleted).
            self.shared.retention.publish(manifest.clone());
            let previous = std::mem::replace(&mut self.state.current, manifest);
            self.state.previous = Some(previous);
            self.state.next_generation = generation + 1;
            self.state.persisted_tombstones = persisted;
        }

        // 5. Searches switch to the new sealed segments.
        self.install(&set, &to_seal, sealed.clone());
        self.shared.checkpoint_seq.store(seq, Ordering::Release);
        if !publish {
            return Ok(seq);
        }

        // 6. The WAL is kept from the previous manifest on, so that it stays a valid fallback,
        //    and from wherever an open snapshot reads it (`retention.rs`). The ticket is not
        //    awaited: nothing here depends on when the files go.
        let fallback_from = self.state.previous.as_ref().map_or(0, |m| m.checkpoint_seq) + 1;
        let keep_from = self.shared.retention.wal_keep_from(fallback_from);
        drop(self.wal.truncate_before(keep_from));
        fail::fail_point!("checkpoint::after_truncate", |_| abort_for_test());

        // 7. Delete what neither the current nor the previous manifest nor a snapshot needs.
        if let Err(error) = collect_garbage(&dir, &self.state, &self.shared.retention) {
            tracing::warn!(%error, "could not delete unreferenced collection files");
        }
        tracing::info!(
            generation,
            checkpoint_seq = seq,
            n_sealed = sealed.len(),
            ?rebuilt,
            "checkpoint"
        );
        Ok(seq)
    }

    /// Replaces `to_seal` and the sealed segments of `before` with `sealed`, under the apply
    /// lock. A document removed from a replaced segment after sealing or merging copied it is
    /// removed from the copy here: a live pair is live in one segment only, and no operation
    /// adds to a frozen or sealed segment, so a copy is stale exactly when no replaced segment
    /// holds the pair any more.
    fn install(
        &self,
        before: &SegmentSet,
        to_seal: &[(u64, Arc<MutableSegment>)],
        sealed: Vec<Arc<SealedSegment>>,
    ) {
        let _apply = self.shared.counts.lock();
        let replaced: Vec<&Arc<SealedSegment>> = before
            .sealed
            .iter()
            .filter(|old| !sealed.iter().any(|s| Arc::ptr_eq(s, old)))
            .collect();
        let still_live = |user_id: u128, doc_id: u128| {
            to_seal.iter().any(|(_, f)| f.contains(user_id, doc_id))
                || replaced.iter().any(|s| s.contains(user_id, doc_id))
        };
        for segment in &sealed {
            if before.sealed.iter().any(|old| Arc::ptr_eq(old, segment)) {
                continue;
            }
            let stale: Vec<(u128, u128)> = segment
                .live_documents()
                .filter(|&(user_id, doc_id)| !still_live(user_id, doc_id))
                .collect();
            for (user_id, doc_id) in stale {
                segment.tombstone(user_id, doc_id);
            }
        }
        let current = self.shared.segments();
        let frozen = current
            .frozen
            .iter()
            .filter(|(_, f)| !to_seal.iter().any(|(_, t)| Arc::ptr_eq(f, t)))
            .cloned()
            .collect();
        *self.shared.segments.write() = Arc::new(SegmentSet {
            mutable: Arc::clone(&current.mutable),
            frozen,
            sealed,
        });
    }

    fn check_stopping(&self) -> Result<()> {
        if self.shared.stopping.load(Ordering::Acquire) {
            return Err(CollectionError::Closed);
        }
        Ok(())
    }
}

/// Runs a checkpoint's graph work (indexing what a frozen segment has left, fresh graphs for
/// compacted partitions, merges, rebuilds; hnsw_rs parallelises with rayon) in a pool of its own,
/// of half the cores (at least one). In rayon's global pool a rebuild queued the indexer's
/// batches behind it and took every core from writes and searches. (Lowering the pool's
/// priority was tried and dropped: under a sustained write load the checkpoint then barely ran,
/// and the mutable segment grew past its bound for minutes.)
fn in_build_pool<R: Send>(work: impl FnOnce() -> R + Send) -> R {
    static POOL: OnceLock<Option<rayon::ThreadPool>> = OnceLock::new();
    in_pool(&POOL, "tarn-build", |cores| cores / 2, 0, work)
}

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
/// idle class starved it while it held one: a 106 ms stall). Measured (docs/BENCHMARKS.md):
/// 64 clients 1.15x (8 alternating rounds); `scripts/soak.sh 600` search p99 30.6 / 46.9 ms in
/// the first / last third (36 / 90 before).
const INDEX_NICE: i32 = 5;

fn in_pool<R: Send>(
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

#[cfg(feature = "failpoints")]
fn abort_for_test() -> Result<u64> {
    // A fail point here simulates a crash between two checkpoint steps (tests only).
    std::process::abort()
}

#[cfg(not(feature = "failpoints"))]
#[allow(dead_code)]
fn abort_for_test() -> Result<u64> {
    unreachable!("fail points are compiled out")
}

/// Deletes segment, tombstone, temp and manifest files that neither kept manifest references
/// and no snapshot has pinned. Holds the retention lock throughout, so no pin is taken while
/// files are deleted.
pub(crate) fn collect_garbage(
    dir: &Path,
    state: &CheckpointState,
    retention: &Retention,
) -> Result<()> {
    retention.keep_pinned_files(|pinned| collect_unpinned_garbage(dir, state, pinned))
}

fn collect_unpinned_garbage(
    dir: &Path,
    state: &CheckpointState,
    pinned: &HashSet<&str>,
) -> Result<()> {
    let kept: Vec<&Manifest> = std::iter::once(&state.current)
        .chain(state.previous.as_ref())
        .collect();
    let mut keep: HashSet<String> = kept
        .iter()
        .flat_map(|m| m.files().map(str::to_owned))
        .collect();
    keep.extend(kept.iter().map(|m| Manifest::file_name(m.generation)));
    keep.extend(pinned.iter().map(|name| (*name).to_owned()));
    let mut removed: Vec<PathBuf> = Vec::new();
    for entry in
        std::fs::read_dir(dir).map_err(|e| CollectionError::io("list directory", dir, e))?
    {
        let entry = entry.map_err(|e| CollectionError::io("list directory", dir, e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let ours = name.starts_with("seg-") || name.starts_with(manifest::MANIFEST_PREFIX);
        if ours && !keep.contains(&name) {
            let path = entry.path();
            std::fs::remove_file(&path).map_err(|e| CollectionError::io("remove", &path, e))?;
            removed.push(path);
        }
    }
    if !removed.is_empty() {
        tarn_index::fsutil::sync_dir(dir)
            .map_err(|e| CollectionError::io("fsync directory", dir, e))?;
        tracing::debug!(
            n_removed = removed.len(),
            "deleted unreferenced collection files"
        );
    }
    Ok(())
}
