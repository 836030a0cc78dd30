//! The ingestion worker: one thread per collection that applies logged operations in sequence
//! order, and runs checkpoints (sealing, merging, manifests, WAL truncation, file GC) between
//! them, so a checkpoint never races an apply.
//!
//! Invariant (WAL order = apply order): the WAL's writer thread hands every acknowledged entry to
//! this worker through one bounded channel, in sequence order, before the writer's ticket
//! resolves (`IngestFeeder`). The channel being full holds up the WAL writer, which holds up every
//! writer: back-pressure instead of unbounded memory.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender};
use std::sync::Arc;
use std::time::Instant;

use tarn_index::{MutableSegment, SealedSegment};
use tarn_wal::{AppendObserver, Wal};

use crate::collection::Shared;
use crate::error::{CollectionError, Result};
use crate::manifest::{self, Manifest, SegmentEntry};
use crate::op;
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
        while shared.segments().mutable.index_pending(INDEX_BATCH) > 0 {
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
    Apply { seq: u64, payload: Arc<[u8]> },
    Checkpoint(tokio::sync::oneshot::Sender<Result<u64>>),
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

/// Checkpoint bookkeeping, owned by the worker.
pub(crate) struct CheckpointState {
    pub(crate) current: Manifest,
    /// The manifest before `current` (kept as the fallback), if any.
    pub(crate) previous: Option<Manifest>,
    /// The next manifest generation (past every one seen on disk, even damaged ones).
    pub(crate) next_generation: u64,
    /// Tombstone count of each sealed segment as of its last persisted tombstone file.
    pub(crate) persisted_tombstones: HashMap<u64, usize>,
}

pub(crate) struct IngestWorker {
    pub(crate) shared: Arc<Shared>,
    pub(crate) wal: Wal,
    pub(crate) state: CheckpointState,
    pub(crate) applied_seq: u64,
    pub(crate) wal_bytes_since_checkpoint: u64,
    pub(crate) first_unsaved_at: Option<Instant>,
    pub(crate) n_applied: u64,
}

impl IngestWorker {
    pub(crate) fn run(mut self, signals: Receiver<IngestSignal>) {
        loop {
            let deadline = self
                .first_unsaved_at
                .map(|at| at + self.shared.config.checkpoint_interval());
            let signal = match deadline {
                None => signals.recv().map_err(|_| RecvTimeoutError::Disconnected),
                Some(deadline) => {
                    signals.recv_timeout(deadline.saturating_duration_since(Instant::now()))
                }
            };
            match signal {
                Ok(IngestSignal::Apply { seq, payload }) => {
                    self.apply(seq, &payload);
                    if self.wal_bytes_since_checkpoint >= self.shared.config.checkpoint_wal_bytes {
                        self.checkpoint_logged("WAL size");
                    }
                }
                Ok(IngestSignal::Checkpoint(reply)) => {
                    let _ = reply.send(self.checkpoint());
                }
                Err(RecvTimeoutError::Timeout) => self.checkpoint_logged("age"),
                Ok(IngestSignal::Shutdown) | Err(RecvTimeoutError::Disconnected) => return,
            }
        }
    }

    fn apply(&mut self, seq: u64, payload: &[u8]) {
        match op::decode(payload, self.shared.config.dimension) {
            Ok(operation) => {
                let set = self.shared.segments();
                let mut counts = self.shared.counts.lock();
                set.apply(&operation, &mut counts);
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

    fn checkpoint_logged(&mut self, reason: &str) {
        if let Err(error) = self.checkpoint() {
            tracing::error!(%error, reason, "automatic checkpoint failed; retrying at the next trigger");
            // Retry on the next trigger, not in a tight loop.
            self.first_unsaved_at = Some(Instant::now());
            self.wal_bytes_since_checkpoint = 0;
        }
    }

    /// Seals the mutable segment, persists tombstones, merges and rebuilds, publishes a new
    /// manifest, then truncates the WAL and deletes unreferenced files. Returns the checkpoint
    /// sequence number.
    pub(crate) fn checkpoint(&mut self) -> Result<u64> {
        let dir = self.shared.dir.clone();
        let index_config = self.shared.config.index_config();
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

        // 1. Seal the mutable segment.
        if !set.mutable.is_empty() {
            let segment = SealedSegment::seal(&set.mutable, next_segment_id, self.applied_seq);
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
            sealed.sort_by_key(|s| s.figures().n_live);
            let (a, b) = (sealed.remove(0), sealed.remove(0));
            let merged = SealedSegment::rebuild(&[&a, &b], next_segment_id, index_config);
            next_segment_id += 1;
            merged.write(&dir.join(manifest::segment_file_name(merged.id())))?;
            tracing::info!(from = ?[a.id(), b.id()], to = merged.id(), "merged sealed segments");
            rebuilt.extend([a.id(), b.id()]);
            sealed.push(Arc::new(merged));
            changed = true;
        }
        let threshold = self.shared.config.rebuild_tombstone_fraction;
        for slot in sealed.iter_mut() {
            if slot.tombstone_fraction() > threshold {
                let fresh = SealedSegment::rebuild(&[slot], next_segment_id, index_config);
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

        // 3. Persist tombstones that changed since their last file.
        for segment in &sealed {
            let n_tombstoned = segment.figures().n_tombstoned;
            let persisted = self.state.persisted_tombstones.get(&segment.id()).copied();
            // A freshly sealed or rebuilt segment has its tombstones in its own file.
            let is_new = !self
                .state
                .current
                .segments
                .iter()
                .any(|s| s.id == segment.id());
            if is_new {
                continue;
            }
            if persisted != Some(n_tombstoned) {
                let name = manifest::tombstone_file_name(segment.id(), generation);
                tarn_index::fsutil::write_durably(&dir.join(&name), &segment.encode_tombstones())
                    .map_err(|e| CollectionError::io("write tombstones", dir.join(&name), e))?;
                tombstone_files.insert(segment.id(), name);
                changed = true;
            }
        }
        fail::fail_point!("checkpoint::after_tombstones", |_| abort_for_test());

        if !changed && self.applied_seq == self.state.current.checkpoint_seq {
            self.first_unsaved_at = None;
            self.wal_bytes_since_checkpoint = 0;
            return Ok(self.applied_seq);
        }

        // 4. Publish the new manifest.
        let manifest = Manifest {
            format: 1,
            generation,
            checkpoint_seq: self.applied_seq,
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

        // 5. Searches switch to the sealed segments and a fresh mutable one.
        let fresh = Arc::new(SegmentSet {
            mutable: Arc::new(MutableSegment::new(index_config)),
            sealed: sealed.clone(),
        });
        *self.shared.segments.write() = fresh;
        self.state.persisted_tombstones = sealed
            .iter()
            .map(|s| (s.id(), s.figures().n_tombstoned))
            .collect();
        let previous = std::mem::replace(&mut self.state.current, manifest);
        self.state.previous = Some(previous);
        self.state.next_generation = generation + 1;
        self.shared
            .checkpoint_seq
            .store(self.applied_seq, Ordering::Release);
        self.first_unsaved_at = None;
        self.wal_bytes_since_checkpoint = 0;

        // 6. The WAL is kept from the previous manifest on, so that it stays a valid fallback.
        //    The ticket is not awaited: the WAL writer may be waiting on this very thread.
        let keep_from = self.state.previous.as_ref().map_or(0, |m| m.checkpoint_seq) + 1;
        drop(self.wal.truncate_before(keep_from));
        fail::fail_point!("checkpoint::after_truncate", |_| abort_for_test());

        // 7. Delete what neither the current nor the previous manifest needs.
        if let Err(error) = collect_garbage(&dir, &self.state) {
            tracing::warn!(%error, "could not delete unreferenced collection files");
        }
        tracing::info!(
            generation,
            checkpoint_seq = self.applied_seq,
            n_sealed = sealed.len(),
            ?rebuilt,
            "checkpoint"
        );
        Ok(self.applied_seq)
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

/// Deletes segment, tombstone, temp and manifest files that neither kept manifest references.
pub(crate) fn collect_garbage(dir: &Path, state: &CheckpointState) -> Result<()> {
    let kept: Vec<&Manifest> = std::iter::once(&state.current)
        .chain(state.previous.as_ref())
        .collect();
    let mut keep: HashSet<String> = kept
        .iter()
        .flat_map(|m| m.files().map(str::to_owned))
        .collect();
    keep.extend(kept.iter().map(|m| Manifest::file_name(m.generation)));
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
