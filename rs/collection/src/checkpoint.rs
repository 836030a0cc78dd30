//! The checkpoint thread: seals frozen segments, merges and rebuilds, writes manifests,
//! truncates the WAL and deletes old files, while writes go on (docs/CHECKPOINT.md).

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::mpsc::Receiver;
use std::sync::{Arc, OnceLock};

use tarn_index::{MutableSegment, SealedSegment};
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
        if let Some(error) = self.wal.poison_error() {
            // Checked before sealing: the checkpoint could not publish (its WAL barrier would
            // fail), so it must not write segment files either.
            self.shared
                .n_checkpoints_refused
                .fetch_add(1, Ordering::Relaxed);
            return Err(error.into());
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
