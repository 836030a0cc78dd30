//! The checkpoint thread: seals frozen segments, merges and rebuilds, writes manifests,
//! truncates the WAL and deletes old files, while writes go on (docs/CHECKPOINT.md).

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::mpsc::Receiver;
use std::sync::{Arc, OnceLock};

use tarn_index::{BuildConfig, MutableSegment, SealedSegment};
use tarn_wal::Wal;

use crate::collection::Shared;
use crate::error::{CollectionError, Result};
use crate::flush::FlushReply;
use crate::indexer::in_pool;
use crate::manifest::{self, Manifest, SegmentEntry};
use crate::retention::Retention;
use crate::segments::SegmentSet;

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

/// What one checkpoint carries from phase to phase.
struct CheckpointWork {
    seq: u64,
    /// The generation of the manifest this checkpoint writes.
    generation: u64,
    /// The segment set when the checkpoint began.
    before: Arc<SegmentSet>,
    /// The frozen segments holding operations up to `seq`, which phase 1 seals (newest first).
    to_seal: Vec<(u64, Arc<MutableSegment>)>,
    /// The sealed segments to install: those of `before`, less what phase 2 replaced, plus
    /// what phases 1 and 2 wrote; newest first once phase 2 is done.
    sealed: Vec<Arc<SealedSegment>>,
    next_segment_id: u64,
    /// Tombstone file of each sealed segment that has one.
    tombstone_files: HashMap<u64, String>,
    /// Tombstone counts as of the files the new manifest names (phase 3).
    persisted: HashMap<u64, usize>,
    /// Ids of the segments merged or rebuilt, for the log.
    rebuilt: Vec<u64>,
    /// Whether any file was written, i.e. whether a manifest must name it.
    changed: bool,
}

/// The settled-removal journal (`ApplyState::settled_removals`) for the length of one
/// checkpoint: on from `start` until dropped (the install takes what is left before that).
struct SettledRemovals {
    shared: Arc<Shared>,
}

impl SettledRemovals {
    fn start(shared: &Arc<Shared>) -> SettledRemovals {
        shared.apply.lock().settled_removals = Some(Vec::new());
        SettledRemovals {
            shared: Arc::clone(shared),
        }
    }
}

impl Drop for SettledRemovals {
    fn drop(&mut self) {
        self.shared.apply.lock().settled_removals = None;
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

    /// One checkpoint at `seq`: the phases of docs/CHECKPOINT.md, in order. Returns `seq`.
    ///
    /// Sealing and merging read segments that ingestion keeps removing documents from. What
    /// they copy holds every operation up to `seq` (applied before the freeze) and maybe some
    /// later removals; those are replayed from the WAL after a crash anyway (removing twice
    /// changes nothing), which is why the WAL must be durable past them before the manifest
    /// names the files. Removals that arrive after the copy are carried over at install.
    pub(crate) fn checkpoint(&mut self, seq: u64) -> Result<u64> {
        // Tests arm it with `panic` to kill this thread (`tests/thread_failure.rs`).
        fail::fail_point!("checkpoint::start");
        self.check_wal()?;
        // Records removals from frozen and sealed segments until `install` (or an error) ends it.
        let _journal = SettledRemovals::start(&self.shared);
        let mut work = self.begin(seq);
        self.seal(&mut work)?;
        fail::fail_point!("checkpoint::after_seal", |_| abort_for_test());
        self.merge_and_rebuild(&mut work)?;
        fail::fail_point!("checkpoint::after_merge", |_| abort_for_test());
        self.write_tombstones(&mut work)?;
        fail::fail_point!("checkpoint::after_tombstones", |_| abort_for_test());
        let published = self.write_manifest(&work)?;
        if published {
            fail::fail_point!("checkpoint::after_manifest", |_| abort_for_test());
        }
        self.install(&work);
        if published {
            self.truncate_wal();
            fail::fail_point!("checkpoint::after_truncate", |_| abort_for_test());
            self.collect_garbage();
            tracing::info!(
                generation = work.generation,
                checkpoint_seq = seq,
                n_sealed = work.sealed.len(),
                rebuilt = ?work.rebuilt,
                "checkpoint"
            );
        }
        Ok(seq)
    }

    /// Phase 0: refuses at once on a poisoned WAL. Checked before sealing: the checkpoint could
    /// not publish (its WAL barrier would fail), so it must not write segment files either.
    fn check_wal(&self) -> Result<()> {
        if let Some(error) = self.wal.poison_error() {
            self.shared
                .n_checkpoints_refused
                .fetch_add(1, Ordering::Relaxed);
            return Err(error.into());
        }
        Ok(())
    }

    /// The checkpoint's starting point: the segment set as it is now, and the frozen segments
    /// up to `seq` that phase 1 seals. Called with the settled-removal journal on, so that
    /// every removal from a segment copied after this point is recorded.
    fn begin(&self, seq: u64) -> CheckpointWork {
        let before = self.shared.segments();
        let to_seal = before
            .frozen
            .iter()
            .filter(|(frozen_seq, _)| *frozen_seq <= seq)
            .cloned()
            .collect();
        let tombstone_files = self
            .state
            .current
            .segments
            .iter()
            .filter_map(|s| s.tombstones.clone().map(|t| (s.id, t)))
            .collect();
        CheckpointWork {
            seq,
            generation: self.state.next_generation,
            sealed: before.sealed.clone(),
            before,
            to_seal,
            next_segment_id: self.state.current.next_segment_id,
            tombstone_files,
            persisted: HashMap::new(),
            rebuilt: Vec::new(),
            changed: false,
        }
    }

    /// Phase 1: each frozen segment up to `seq`, oldest first, becomes a sealed segment file
    /// (partitions with many dead slots get a fresh graph over their live vectors).
    fn seal(&self, work: &mut CheckpointWork) -> Result<()> {
        let rebuild_fraction = self.shared.config.rebuild_tombstone_fraction;
        for (frozen_seq, frozen) in work.to_seal.iter().rev() {
            let id = work.next_segment_id;
            let mut segment = self.timed_build(|| {
                Ok(in_build_pool(|| {
                    SealedSegment::seal_compacting(
                        frozen,
                        id,
                        *frozen_seq,
                        rebuild_fraction,
                        &build_config(),
                    )
                }))
            })?;
            work.next_segment_id += 1;
            if segment.figures().n_slots > 0 {
                self.write_segment(&mut segment)?;
                work.sealed.push(Arc::new(segment));
            }
            work.changed = true;
        }
        SegmentSet::sort_sealed(&mut work.sealed);
        Ok(())
    }

    /// Phase 2: the two smallest segments are merged while there are more than
    /// `max_sealed_segments`, or while they are of a size (`tiered_merge_due`); then a segment
    /// with more than `rebuild_tombstone_fraction` dead slots is rebuilt. Each result is a new
    /// file.
    fn merge_and_rebuild(&self, work: &mut CheckpointWork) -> Result<()> {
        let index_config = self.shared.config.index_config();
        let rebuild_fraction = self.shared.config.rebuild_tombstone_fraction;
        loop {
            work.sealed.sort_by_key(|s| s.figures().n_live);
            let sizes: Vec<usize> = work.sealed.iter().map(|s| s.figures().n_live).collect();
            if work.sealed.len() <= self.shared.config.max_sealed_segments
                && !tiered_merge_due(&sizes)
            {
                break;
            }
            self.check_stopping()?;
            let (a, b) = (work.sealed.remove(0), work.sealed.remove(0));
            let id = work.next_segment_id;
            let mut merged = self.timed_build(|| {
                SealedSegment::rebuild(&[&a, &b], id, index_config, &build_config())
            })?;
            work.next_segment_id += 1;
            self.write_segment(&mut merged)?;
            tracing::info!(from = ?[a.id(), b.id()], to = merged.id(), "merged sealed segments");
            work.rebuilt.extend([a.id(), b.id()]);
            work.sealed.push(Arc::new(merged));
            work.changed = true;
        }
        for slot in work.sealed.iter_mut() {
            if slot.tombstone_fraction() > rebuild_fraction {
                self.check_stopping()?;
                let id = work.next_segment_id;
                let mut fresh = self.timed_build(|| {
                    SealedSegment::rebuild(&[slot], id, index_config, &build_config())
                })?;
                work.next_segment_id += 1;
                self.write_segment(&mut fresh)?;
                tracing::info!(
                    from = slot.id(),
                    to = fresh.id(),
                    "rebuilt a segment with many tombstones"
                );
                work.rebuilt.push(slot.id());
                *slot = Arc::new(fresh);
                work.changed = true;
            }
        }
        SegmentSet::sort_sealed(&mut work.sealed);
        Ok(())
    }

    /// Phase 3: tombstone files for old segments whose tombstones changed since their last
    /// file. A segment written in this checkpoint has its tombstones in its own file (and
    /// nobody else can reach it yet).
    fn write_tombstones(&self, work: &mut CheckpointWork) -> Result<()> {
        let dir = &self.shared.dir;
        for segment in &work.sealed {
            let id = segment.id();
            // Counted before encoding: the file holds at least these (tombstones only grow).
            let n_tombstoned = segment.figures().n_tombstoned;
            if !work.before.sealed.iter().any(|s| s.id() == id) {
                work.persisted.insert(id, n_tombstoned);
                continue;
            }
            let previous = self.state.persisted_tombstones.get(&id).copied();
            if previous == Some(n_tombstoned) {
                work.persisted.insert(id, n_tombstoned);
                continue;
            }
            let name = manifest::tombstone_file_name(id, work.generation);
            tarn_index::fsutil::write_durably(&dir.join(&name), &segment.encode_tombstones())
                .map_err(|e| CollectionError::io("write tombstones", dir.join(&name), e))?;
            work.tombstone_files.insert(id, name);
            work.persisted.insert(id, n_tombstoned);
            work.changed = true;
        }
        Ok(())
    }

    /// Phase 4: if anything changed (or `seq` moved), waits until the WAL is durable past every
    /// applied operation (what was copied may hold removals applied after `seq`, which must not
    /// outlive a lost WAL entry), then writes the manifest of the next generation durably.
    /// Returns whether a manifest was published.
    fn write_manifest(&mut self, work: &CheckpointWork) -> Result<bool> {
        if !work.changed && work.seq == self.state.current.checkpoint_seq {
            return Ok(false);
        }
        self.check_stopping()?;
        self.wal.sync().wait()?;
        let manifest = Manifest {
            format: 1,
            generation: work.generation,
            checkpoint_seq: work.seq,
            next_segment_id: work.next_segment_id,
            segments: work
                .sealed
                .iter()
                .map(|s| SegmentEntry {
                    id: s.id(),
                    file: manifest::segment_file_name(s.id()),
                    tombstones: work.tombstone_files.get(&s.id()).cloned(),
                })
                .collect(),
        };
        let dir = &self.shared.dir;
        manifest::write_checked(&manifest::manifest_path(dir, work.generation), &manifest)?;
        // New snapshots read this one from now on (before anything below is deleted).
        self.shared.retention.publish(manifest.clone());
        let previous = std::mem::replace(&mut self.state.current, manifest);
        self.state.previous = Some(previous);
        self.state.next_generation = work.generation + 1;
        self.state.persisted_tombstones = work.persisted.clone();
        Ok(true)
    }

    /// Phase 6: deletes the WAL before the previous manifest's checkpoint, so that it stays a
    /// valid fallback, and keeps wherever an open snapshot reads it from (`retention.rs`). The
    /// ticket is not awaited: nothing here depends on when the files go.
    fn truncate_wal(&self) {
        let fallback_from = self.state.previous.as_ref().map_or(0, |m| m.checkpoint_seq) + 1;
        let keep_from = self.shared.retention.wal_keep_from(fallback_from);
        drop(self.wal.truncate_before(keep_from));
    }

    /// Phase 7: deletes what neither the current nor the previous manifest nor a snapshot
    /// needs. A failure is logged; the next checkpoint tries again.
    fn collect_garbage(&self) {
        if let Err(error) = collect_garbage(&self.shared.dir, &self.state, &self.shared.retention) {
            tracing::warn!(%error, "could not delete unreferenced collection files");
        }
    }

    /// Writes a new segment's file (with `vectors_on_disk`, its vectors are then read from
    /// there).
    fn write_segment(&self, segment: &mut SealedSegment) -> Result<()> {
        segment.write(
            &self
                .shared
                .dir
                .join(manifest::segment_file_name(segment.id())),
        )?;
        Ok(())
    }

    /// Phase 5: searches switch to the new segment set: the sealed frozen segments and the
    /// replaced sealed segments give way to `work.sealed`, under the apply lock.
    ///
    /// A document removed from a replaced segment after sealing or merging copied it must be
    /// removed from the copy too. No operation adds to a frozen or sealed segment, so a copy is
    /// stale exactly when its pair was removed from its source after the copy, and every such
    /// removal is in the settled-removal journal (on since `begin`, before anything was
    /// copied). The journal is reconciled outside the lock first, as often as it takes to get
    /// it short, and under the lock only for the few operations applied since: the work under
    /// the apply lock grows with the writes during the last reconciliation, not with the
    /// collection.
    fn install(&self, work: &CheckpointWork) {
        /// A journal shorter than this is left for the reconciliation under the lock.
        const SHORT_JOURNAL: usize = 1024;
        /// Rounds outside the lock, for a write load that keeps the journal long.
        const MAX_ROUNDS: usize = 4;
        let before = &work.before;
        let sealed = &work.sealed;
        let written: Vec<&Arc<SealedSegment>> = sealed
            .iter()
            .filter(|segment| !before.sealed.iter().any(|old| Arc::ptr_eq(old, segment)))
            .collect();
        let replaced: Vec<&Arc<SealedSegment>> = before
            .sealed
            .iter()
            .filter(|old| !sealed.iter().any(|s| Arc::ptr_eq(s, old)))
            .collect();
        let carry_over = |pairs: &[(u128, u128)]| {
            for &(user_id, doc_id) in pairs {
                let still_live = work
                    .to_seal
                    .iter()
                    .any(|(_, f)| f.contains(user_id, doc_id))
                    || replaced.iter().any(|s| s.contains(user_id, doc_id));
                if !still_live {
                    for segment in &written {
                        segment.tombstone(user_id, doc_id);
                    }
                }
            }
        };
        for _ in 0..MAX_ROUNDS {
            // Taken and restarted in one hold of the lock, so that no removal goes unrecorded.
            let pairs = std::mem::take(
                self.shared
                    .apply
                    .lock()
                    .settled_removals
                    .get_or_insert_with(Vec::new),
            );
            carry_over(&pairs);
            if pairs.len() < SHORT_JOURNAL {
                break;
            }
        }
        // Tests pause here to apply writes that only the reconciliation under the lock sees.
        fail::fail_point!("checkpoint::before_install_lock");

        let mut apply = self.shared.apply.lock();
        let locked = std::time::Instant::now();
        let pairs = apply.settled_removals.take().unwrap_or_default();
        carry_over(&pairs);
        let current = self.shared.segments();
        let frozen = current
            .frozen
            .iter()
            .filter(|(_, f)| !work.to_seal.iter().any(|(_, t)| Arc::ptr_eq(f, t)))
            .cloned()
            .collect();
        *self.shared.segments.write() = Arc::new(SegmentSet {
            mutable: Arc::clone(&current.mutable),
            frozen,
            sealed: sealed.clone(),
        });
        drop(apply);
        let held = locked.elapsed();
        self.shared
            .checkpoint_seq
            .store(work.seq, Ordering::Release);
        tracing::debug!(
            held_us = held.as_micros() as u64,
            n_carried_under_lock = pairs.len(),
            "installed a checkpoint's segments under the apply lock"
        );
    }

    /// Runs a build (sealing, a merge, a rebuild) and counts its vectors and time for the build
    /// throughput metric.
    fn timed_build(
        &self,
        build: impl FnOnce() -> tarn_index::Result<SealedSegment>,
    ) -> Result<SealedSegment> {
        let started = std::time::Instant::now();
        // Tests arm it with `panic` to crash a checkpoint in the middle of a build.
        fail::fail_point!("checkpoint::build");
        let segment = build()?;
        let micros = started.elapsed().as_micros() as u64;
        let n_slots = segment.figures().n_slots as u64;
        self.shared
            .n_vectors_built
            .fetch_add(n_slots, Ordering::Relaxed);
        self.shared
            .build_micros
            .fetch_add(micros, Ordering::Relaxed);
        Ok(segment)
    }

    fn check_stopping(&self) -> Result<()> {
        if self.shared.stopping.load(Ordering::Acquire) {
            return Err(CollectionError::Closed);
        }
        Ok(())
    }
}

/// The largest merge the size-tiered rule makes (live documents in the result); past it only
/// `max_sealed_segments` forces merges. A merge rebuilds a graph over every document of both
/// segments on the checkpoint thread (60,733 x 384 took about 7.5 s on 2 cores), so an
/// uncapped rule would hold checkpoints for hours on a large collection.
pub(crate) const TIERED_MERGE_MAX_DOCUMENTS: usize = 1_000_000;

/// Below this many live documents in the result the tiered rule merges segments of quite
/// different sizes too (the smaller at least 1/32 of the larger): a load's checkpoints grow
/// about geometrically (2.5k, 18k, 40k documents for minilm over gRPC; about 2k, 20k, 38k in
/// batches of 1,000 in-process, past a ratio of 8), which "of a size" alone never merges. Such a merge costs at most about 12 s of the builder on 2 cores at 384-d.
pub(crate) const TIERED_MERGE_FLOOR_DOCUMENTS: usize = 100_000;

/// The size-tiered merge rule: given the sealed segments' live documents in ascending order,
/// whether the two smallest should be merged: the smaller holds at least half as many as the
/// larger and the result stays within [`TIERED_MERGE_MAX_DOCUMENTS`], or at least 1/32 of it
/// and the result stays within [`TIERED_MERGE_FLOOR_DOCUMENTS`]. Each segment is searched at
/// the full `ef`, so a bulk load left in three segments searched at about a third of one
/// segment's speed (docs/BENCHMARKS.md, "Filtered search"). Modelled (the tests below): a
/// stream of 1,000-document checkpoints up to 1M documents rebuilds each document about 26
/// times (each merge at most 100,000 documents below the floor) and never holds more than 5
/// segments; merging only segments "of a size" would rebuild each about 10 times but leave a
/// load's geometric checkpoints unmerged.
pub(crate) fn tiered_merge_due(sizes: &[usize]) -> bool {
    match sizes {
        [smallest, next, ..] => {
            let merged = smallest.saturating_add(*next);
            (smallest.saturating_mul(2) >= *next && merged <= TIERED_MERGE_MAX_DOCUMENTS)
                || (smallest.saturating_mul(32) >= *next && merged <= TIERED_MERGE_FLOOR_DOCUMENTS)
        }
        _ => false,
    }
}

/// How checkpoints run tarn's builder (fresh graphs when sealing a partition whose tail hnsw_rs
/// has not indexed, or with many dead slots; merges; rebuilds): on every core, at the request
/// threads' priority, so that a load is indexed as fast as the machine allows once its writes
/// stop. (Lowering the priority of checkpoint work was tried and dropped: under a sustained
/// write load the checkpoint then barely ran, and the mutable segment grew past its bound for
/// minutes.)
fn build_config() -> BuildConfig {
    BuildConfig::default()
}

/// Runs a checkpoint's hnsw_rs work (indexing what a frozen segment has left before its graph is
/// exported; hnsw_rs parallelises with rayon) in a pool of its own, of half the cores (at least
/// one). In rayon's global pool it queued the indexer's batches behind it and took every core
/// from writes and searches.
fn in_build_pool<R: Send>(work: impl FnOnce() -> R + Send) -> R {
    static POOL: OnceLock<Option<rayon::ThreadPool>> = OnceLock::new();
    in_pool(&POOL, "tarn-build", |cores| cores / 2, 0, work)
}

#[cfg(feature = "failpoints")]
fn abort_for_test<T>() -> Result<T> {
    // A fail point here simulates a crash between two checkpoint steps (tests only).
    std::process::abort()
}

#[cfg(not(feature = "failpoints"))]
#[allow(dead_code)]
fn abort_for_test<T>() -> Result<T> {
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

#[cfg(test)]
mod tiered_tests {
    use super::{tiered_merge_due, TIERED_MERGE_MAX_DOCUMENTS};

    #[test]
    fn segments_of_a_size_merge_and_unequal_or_huge_ones_do_not() {
        assert!(!tiered_merge_due(&[]));
        assert!(!tiered_merge_due(&[1_000]));
        assert!(tiered_merge_due(&[10_000, 20_000, 30_000]));
        assert!(tiered_merge_due(&[30_000, 30_000]));
        // Below the floor 1/32 is enough (a load's geometric checkpoints).
        assert!(tiered_merge_due(&[2_500, 18_000, 40_000]));
        assert!(tiered_merge_due(&[2_000, 20_000, 38_000]));
        assert!(tiered_merge_due(&[20_500, 40_000]));
        assert!(tiered_merge_due(&[2_000, 58_000]));
        assert!(!tiered_merge_due(&[1_000, 58_000]));
        assert!(!tiered_merge_due(&[20_000, 158_000]));
        assert!(!tiered_merge_due(&[99_999, 200_001]));
        let half = TIERED_MERGE_MAX_DOCUMENTS / 2;
        assert!(tiered_merge_due(&[half, half]));
        assert!(!tiered_merge_due(&[half + 1, half + 1]));
    }

    /// Checkpoints of 1,000 documents each, merged by the rule after each: few segments, and
    /// each document rebuilt a bounded number of times.
    #[test]
    fn a_stream_of_checkpoints_keeps_a_logarithmic_number_of_segments() {
        let mut sizes: Vec<usize> = Vec::new();
        let mut rebuilt = 0usize;
        for _ in 0..1_000 {
            sizes.push(1_000);
            sizes.sort_unstable();
            while tiered_merge_due(&sizes) {
                let (a, b) = (sizes.remove(0), sizes.remove(0));
                rebuilt += a + b;
                sizes.push(a + b);
                sizes.sort_unstable();
            }
            assert!(sizes.len() <= 5, "{sizes:?}");
        }
        assert_eq!(sizes.iter().sum::<usize>(), 1_000_000);
        // About 26 rebuilds per document (the model gives 25.66): not the 500 of merging
        // everything at every checkpoint.
        assert!(rebuilt <= 27 * 1_000_000, "{rebuilt}");
    }
}
