//! A replicated copy's lineage: which primary epoch wrote each part of its log (the `EPOCHS`
//! file beside the WAL), and cutting a closed copy's log back to what a new primary holds.
//!
//! The history is a list of `(epoch, first sequence number)`, epochs and starts increasing
//! (the rules for extending it are `tarn_cluster::EpochHistory`'s; this crate only keeps it).
//! It is written, durably, before the first entry of a new epoch is appended to this copy, so
//! every entry in the log is covered by the start before it. Entries before the first start
//! were written before the copy kept a history (a shard with one copy): they belong to the
//! shard's one line of primaries and are shared by every copy made from it.

use std::path::Path;

use serde::{Deserialize, Serialize};
use tarn_wal::WalConfig;

use crate::collection::Collection;
use crate::error::{CollectionError, Result};
use crate::manifest::{self, Manifest};

/// The file holding a copy's epoch history (JSON with a CRC32, written durably).
pub const EPOCHS_FILE: &str = "EPOCHS";

/// The file holding the highest entry a replicated copy last knew committed (JSON with a
/// CRC32). Written by ingestion at most every [`COMMITTED_PERSIST_INTERVAL`] and at close, and
/// without a sync: it only saves a reopened copy from serving its checkpoint's older state
/// until replication raises its bound again. Lost or torn, the copy opens held at its
/// checkpoint, as without it; never trusted past the end of the log.
pub const COMMITTED_FILE: &str = "COMMITTED";

/// How often, at most, ingestion writes [`COMMITTED_FILE`] while the bound moves.
pub(crate) const COMMITTED_PERSIST_INTERVAL: std::time::Duration =
    std::time::Duration::from_millis(200);

#[derive(Debug, Default, Serialize, Deserialize)]
struct CommittedFile {
    seq: u64,
}

/// The committed position recorded in `dir` (0 when none, or unreadable).
pub(crate) fn read_committed(dir: &Path) -> u64 {
    let path = dir.join(COMMITTED_FILE);
    if !path.exists() {
        return 0;
    }
    match manifest::read_checked::<CommittedFile>(&path) {
        Ok(file) => file.seq,
        Err(error) => {
            tracing::warn!(%error, "ignoring an unreadable committed mark");
            0
        }
    }
}

/// Records `seq` as committed in `dir` (a temporary file renamed over the old one; no sync).
pub(crate) fn write_committed(dir: &Path, seq: u64) -> std::io::Result<()> {
    let tmp = dir.join(format!("{COMMITTED_FILE}.tmp"));
    std::fs::write(&tmp, manifest::encode_checked(&CommittedFile { seq }))?;
    std::fs::rename(&tmp, dir.join(COMMITTED_FILE))
}

/// Serialises writes of epoch files (each goes through one temporary file name, so two at once
/// would rename each other's away; they are rare: one per new epoch of a copy).
static WRITING: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[derive(Debug, Default, Serialize, Deserialize)]
struct EpochsFile {
    starts: Vec<(u64, u64)>,
}

/// Reads the epoch history in `dir` (empty when the copy has none yet).
fn read_starts(dir: &Path) -> Result<Vec<(u64, u64)>> {
    let path = dir.join(EPOCHS_FILE);
    if !path.exists() {
        return Ok(Vec::new());
    }
    Ok(manifest::read_checked::<EpochsFile>(&path)?.starts)
}

impl Collection {
    /// This copy's epoch history, without starts past the end of its log (written before a
    /// crash cut the entries they were for). Blocking (reads a small file).
    pub fn epoch_starts(&self) -> Result<Vec<(u64, u64)>> {
        let last = self.last_seq_no();
        let mut starts = read_starts(&self.shared().dir)?;
        starts.retain(|&(_, start)| start <= last + 1);
        Ok(starts)
    }

    /// Replaces this copy's epoch history, durably (written to a temporary file, synced,
    /// renamed, the directory synced). Blocking.
    pub fn set_epoch_starts(&self, starts: Vec<(u64, u64)>) -> Result<()> {
        self.update_epoch_starts(|_| Ok(Some(starts)))
    }

    /// Reads this copy's epoch history and replaces it with what `change` makes of it
    /// (`None`: unchanged), with no other change in between. Blocking.
    pub fn update_epoch_starts<E>(
        &self,
        change: impl FnOnce(Vec<(u64, u64)>) -> std::result::Result<Option<Vec<(u64, u64)>>, E>,
    ) -> std::result::Result<(), E>
    where
        E: From<CollectionError>,
    {
        let _writing = WRITING.lock().unwrap_or_else(|p| p.into_inner());
        let Some(starts) = change(self.epoch_starts()?)? else {
            return Ok(());
        };
        for pair in starts.windows(2) {
            if pair[1].0 <= pair[0].0 || pair[1].1 <= pair[0].1 {
                return Err(CollectionError::invalid(
                    "epochs",
                    format!("out of order: {:?} then {:?}", pair[0], pair[1]),
                )
                .into());
            }
        }
        Ok(manifest::write_checked(
            &self.shared().dir.join(EPOCHS_FILE),
            &EpochsFile { starts },
        )?)
    }
}

/// Why a log cannot be cut where asked.
#[derive(Debug, thiserror::Error)]
pub enum CutError {
    /// A checkpoint already holds entries after the cut point: the copy's index cannot be
    /// rolled back by its log alone, so it needs a fresh copy of the primary's data.
    #[error("a checkpoint of this copy holds entries up to {checkpoint_seq}, after {keep}: the copy must be rebuilt from the primary's data")]
    BelowCheckpoint { keep: u64, checkpoint_seq: u64 },
    #[error(transparent)]
    Collection(#[from] CollectionError),
}

/// Cuts the log of the collection in `dir`, which must be closed, after entry `keep`: the
/// entries after it (written by a primary that lost its place before they were acknowledged)
/// are gone, and the epoch history forgets the epochs that began after `keep`. Refused when a
/// checkpoint holds entries after `keep` (nothing is changed then). Returns how many entries
/// were cut. Blocking; reopen the collection afterwards.
pub fn cut_log_after(dir: &Path, keep: u64) -> std::result::Result<u64, CutError> {
    let mut checkpoint_seq = 0;
    for generation in manifest::list_manifests(dir)? {
        let path = manifest::manifest_path(dir, generation);
        if let Ok(manifest) = manifest::read_checked::<Manifest>(&path) {
            checkpoint_seq = checkpoint_seq.max(manifest.checkpoint_seq);
        }
    }
    if checkpoint_seq > keep {
        return Err(CutError::BelowCheckpoint {
            keep,
            checkpoint_seq,
        });
    }
    let cut = tarn_wal::cut_after(&dir.join("wal"), &WalConfig::default(), keep)
        .map_err(CollectionError::Wal)?;
    let mut starts = read_starts(dir)?;
    let before = starts.len();
    starts.retain(|&(_, start)| start <= keep);
    if starts.len() != before {
        let _writing = WRITING.lock().unwrap_or_else(|p| p.into_inner());
        manifest::write_checked(&dir.join(EPOCHS_FILE), &EpochsFile { starts })?;
    }
    // Only uncommitted entries are ever cut; a mark past the cut is lowered all the same.
    if read_committed(dir) > keep {
        write_committed(dir, keep)
            .map_err(|e| CollectionError::io("write", dir.join(COMMITTED_FILE), e))?;
    }
    Ok(cut)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{CollectionConfig, MetricName};
    use tarn_wal::Durability;

    fn config() -> CollectionConfig {
        CollectionConfig::new(4, MetricName::L2)
    }

    #[test]
    fn a_cut_keeps_the_history_and_entries_up_to_the_point_and_refuses_below_a_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c");
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let collection = Collection::create(&path, config()).unwrap();
        assert!(collection.epoch_starts().unwrap().is_empty());
        collection.set_epoch_starts(vec![(3, 1)]).unwrap();
        for doc in 0..10u128 {
            if doc == 6 {
                collection.set_epoch_starts(vec![(3, 1), (5, 7)]).unwrap();
            }
            rt.block_on(collection.insert(
                &[doc],
                &[1],
                &[doc as f32, 0.0, 0.0, 1.0],
                Some(Durability::Fsync),
            ))
            .unwrap();
        }
        assert!(collection.set_epoch_starts(vec![(5, 1), (3, 7)]).is_err());
        assert_eq!(collection.epoch_starts().unwrap(), [(3, 1), (5, 7)]);
        collection.close();
        drop(collection);

        assert_eq!(cut_log_after(&path, 5).unwrap(), 5);
        let reopened = Collection::open_whole(&path).unwrap();
        assert_eq!(reopened.last_seq_no(), 5);
        assert_eq!(reopened.epoch_starts().unwrap(), [(3, 1)]);
        assert_eq!(reopened.get(1, &[4]).unwrap().len(), 1);
        assert!(
            reopened.get(1, &[5]).unwrap().is_empty(),
            "a cut entry came back"
        );
        // A checkpoint at 5 (after a flush) refuses a cut before it, and changes nothing.
        rt.block_on(reopened.flush()).unwrap();
        reopened.close();
        drop(reopened);
        match cut_log_after(&path, 3) {
            Err(CutError::BelowCheckpoint {
                keep: 3,
                checkpoint_seq: 5,
            }) => {}
            other => panic!("expected a refusal, got {other:?}"),
        }
        let reopened = Collection::open_whole(&path).unwrap();
        assert_eq!(reopened.last_seq_no(), 5);
        assert_eq!(reopened.get(1, &[4]).unwrap().len(), 1);
    }
}
