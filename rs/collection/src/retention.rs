//! What a checkpoint must keep for readers outside it: the files of a manifest and the WAL from
//! a sequence number on, for as long as a [`RetentionPin`] says so.
//!
//! A snapshot (and later a shard move) reads the files of one manifest and the WAL after its
//! checkpoint while checkpoints go on publishing newer manifests, truncating the WAL and
//! deleting files. Every file of a collection is immutable once written, so keeping those
//! files (and WAL segments) on disk is all a reader needs. The registry counts pins per file
//! name and per WAL start; the checkpoint thread consults it when it truncates and collects
//! garbage, and the pins go when their holders drop them. Nothing here is timed.
//!
//! Invariant: `pin_current` pins the newest published manifest under the registry's lock, and
//! the checkpoint thread publishes a manifest (`publish`) under the same lock before it computes
//! what to truncate (`wal_keep_from`) and what to delete (`keep_pinned_files`, which holds the
//! lock while it deletes). So a pin taken at any moment pins files that are still on disk and a
//! WAL start that no truncation decided before it goes past: a truncation decided earlier keeps
//! the previous manifest's WAL, which is never after the current one's.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::manifest::Manifest;

/// The registry of one open collection (in its shared state).
#[derive(Debug)]
pub(crate) struct Retention {
    state: Mutex<RetentionState>,
}

#[derive(Debug)]
struct RetentionState {
    /// The newest published manifest: what a new pin reads.
    current: Arc<Manifest>,
    /// Pins per file name (manifest, segment and tombstone files).
    files: HashMap<String, usize>,
    /// Pins per first WAL sequence number to keep.
    wal_from: BTreeMap<u64, usize>,
}

/// Keeps the files of one manifest and the WAL from `wal_from` on until dropped.
#[derive(Debug)]
pub(crate) struct RetentionPin {
    retention: Arc<Retention>,
    files: Vec<String>,
    wal_from: u64,
}

impl Retention {
    pub(crate) fn new(current: Manifest) -> Self {
        Retention {
            state: Mutex::new(RetentionState {
                current: Arc::new(current),
                files: HashMap::new(),
                wal_from: BTreeMap::new(),
            }),
        }
    }

    /// Pins the newest published manifest's files (the manifest file included, if it was ever
    /// written) and the WAL after its checkpoint; returns the manifest and the pin.
    pub(crate) fn pin_current(self: &Arc<Self>) -> (Arc<Manifest>, RetentionPin) {
        let mut state = self.state.lock();
        let manifest = Arc::clone(&state.current);
        let mut files: Vec<String> = manifest.files().map(str::to_owned).collect();
        if manifest.generation > 0 {
            files.push(Manifest::file_name(manifest.generation));
        }
        for file in &files {
            *state.files.entry(file.clone()).or_default() += 1;
        }
        let wal_from = manifest.checkpoint_seq + 1;
        *state.wal_from.entry(wal_from).or_default() += 1;
        drop(state);
        let pin = RetentionPin {
            retention: Arc::clone(self),
            files,
            wal_from,
        };
        (manifest, pin)
    }

    /// Pins the WAL from `seq` on (no files), if no truncation can have reached it yet: `seq`
    /// is after the newest manifest's checkpoint (truncation keeps the WAL from the previous
    /// manifest's), or another pin keeps the WAL from `seq` or earlier. `None` otherwise (the
    /// entries may be gone: a reader needs a snapshot).
    pub(crate) fn pin_wal_from(self: &Arc<Self>, seq: u64) -> Option<RetentionPin> {
        let mut state = self.state.lock();
        let kept = seq > state.current.checkpoint_seq
            || state
                .wal_from
                .keys()
                .next()
                .is_some_and(|&oldest| oldest <= seq);
        if !kept {
            return None;
        }
        *state.wal_from.entry(seq).or_default() += 1;
        Some(RetentionPin {
            retention: Arc::clone(self),
            files: Vec::new(),
            wal_from: seq,
        })
    }

    /// Makes `manifest` the one new pins read. Called by the checkpoint thread right after it
    /// wrote the manifest, before it truncates the WAL or deletes anything.
    pub(crate) fn publish(&self, manifest: Manifest) {
        self.state.lock().current = Arc::new(manifest);
    }

    /// Where WAL truncation may cut: `wanted`, or the oldest pinned WAL start if that is earlier.
    pub(crate) fn wal_keep_from(&self, wanted: u64) -> u64 {
        let state = self.state.lock();
        state
            .wal_from
            .keys()
            .next()
            .map_or(wanted, |&oldest| oldest.min(wanted))
    }

    /// Runs `collect` with the names of every pinned file, holding the registry's lock so that
    /// no pin is taken while files are being deleted.
    pub(crate) fn keep_pinned_files<R>(&self, collect: impl FnOnce(&HashSet<&str>) -> R) -> R {
        let state = self.state.lock();
        let pinned: HashSet<&str> = state.files.keys().map(String::as_str).collect();
        collect(&pinned)
    }

    /// Number of pins held (for tests and logs).
    pub(crate) fn n_pins(&self) -> usize {
        self.state.lock().wal_from.values().sum()
    }
}

impl RetentionPin {
    /// The first WAL sequence number this pin keeps.
    pub(crate) fn wal_from(&self) -> u64 {
        self.wal_from
    }
}

impl Drop for RetentionPin {
    fn drop(&mut self) {
        let mut state = self.retention.state.lock();
        for file in &self.files {
            if let Some(count) = state.files.get_mut(file) {
                *count -= 1;
                if *count == 0 {
                    state.files.remove(file);
                }
            }
        }
        if let Some(count) = state.wal_from.get_mut(&self.wal_from) {
            *count -= 1;
            if *count == 0 {
                state.wal_from.remove(&self.wal_from);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manifest::SegmentEntry;

    fn manifest(generation: u64, checkpoint_seq: u64, ids: &[u64]) -> Manifest {
        Manifest {
            format: 1,
            generation,
            checkpoint_seq,
            next_segment_id: 100,
            segments: ids
                .iter()
                .map(|&id| SegmentEntry {
                    id,
                    file: crate::manifest::segment_file_name(id),
                    tombstones: None,
                })
                .collect(),
        }
    }

    #[test]
    fn pins_count_per_file_and_wal_start_and_go_when_dropped() {
        let retention = Arc::new(Retention::new(manifest(3, 50, &[1, 2])));
        assert_eq!(retention.wal_keep_from(80), 80);
        let (first, pin_a) = retention.pin_current();
        let (_, pin_b) = retention.pin_current();
        assert_eq!((first.generation, pin_a.wal_from()), (3, 51));
        retention.publish(manifest(4, 70, &[2, 3]));
        let (second, pin_c) = retention.pin_current();
        assert_eq!((second.generation, pin_c.wal_from()), (4, 71));

        assert_eq!(retention.wal_keep_from(80), 51);
        assert_eq!(retention.wal_keep_from(40), 40);
        let pinned = |r: &Retention| {
            let mut names: Vec<String> =
                r.keep_pinned_files(|p| p.iter().map(|s| s.to_string()).collect());
            names.sort();
            names
        };
        assert_eq!(
            pinned(&retention),
            [
                "MANIFEST-00000000000000000003",
                "MANIFEST-00000000000000000004",
                "seg-000000000001.tseg",
                "seg-000000000002.tseg",
                "seg-000000000003.tseg",
            ]
        );
        drop(pin_a);
        assert_eq!(retention.wal_keep_from(80), 51, "pin_b still holds 51");
        assert_eq!(pinned(&retention).len(), 5);
        drop(pin_b);
        assert_eq!(retention.wal_keep_from(80), 71);
        assert_eq!(
            pinned(&retention),
            [
                "MANIFEST-00000000000000000004",
                "seg-000000000002.tseg",
                "seg-000000000003.tseg",
            ]
        );
        drop(pin_c);
        assert_eq!(retention.n_pins(), 0);
        assert!(pinned(&retention).is_empty());
    }

    #[test]
    fn the_empty_manifest_pins_no_file_and_the_whole_wal() {
        let retention = Arc::new(Retention::new(Manifest::empty()));
        let (manifest, pin) = retention.pin_current();
        assert_eq!(manifest.generation, 0);
        assert_eq!(pin.wal_from(), 1);
        assert_eq!(retention.wal_keep_from(30), 1);
        assert!(retention.keep_pinned_files(|p| p.is_empty()));
    }
}
