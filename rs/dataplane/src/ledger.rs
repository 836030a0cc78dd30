//! What a data directory has held in cluster mode, kept across restarts in
//! `<data_dir>/CLUSTER_LEDGER` (JSON, replaced atomically and synced): the highest etcd revision
//! the node acted on, the highest epoch at which it held a role in each local copy's record,
//! and the shards whose copies it deleted, with the epoch of the record that let it, or set
//! aside, with the epoch it held them at. It is the node's memory of etcd's history: a record
//! older than what the ledger says (etcd restored from an older backup) never makes the node
//! drop a copy (`tarn_cluster::fate_of_copy` sets it aside), a shard whose copy was deleted
//! here (or set aside here by reconciliation) is never started empty here again by a record no
//! newer than that, and a store behind the ledger's revision fences the node
//! (`ClusterStore::guard_history`) or keeps it from starting.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use parking_lot::Mutex;

/// The file, in the data directory.
pub(crate) const LEDGER_FILE: &str = "CLUSTER_LEDGER";

#[derive(Debug, Default, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
struct LedgerState {
    /// The highest etcd revision the node acted on.
    revision: i64,
    /// The newest write under the cluster's prefix in the state the node acted on: an etcd
    /// that holds another write at its revision has another history, even past `revision`.
    #[serde(default)]
    witness: Option<tarn_cluster::HistoryWitness>,
    /// By local shard name: the highest epoch at which this directory held a role in the
    /// shard's record (owner, replica, or the taker of a move).
    held: BTreeMap<String, u64>,
    /// Local shard names whose copy was deleted here, with the epoch of the record that let it
    /// (`u64::MAX`: the collection was dropped), or set aside here, with the highest epoch it
    /// was held at.
    dropped: BTreeMap<String, u64>,
    /// Local shard names whose copy a seed from the primary is filling (or left unfinished):
    /// such a copy holds nothing of its own, and the next seed deletes it instead of setting
    /// it aside.
    #[serde(default)]
    seeding: std::collections::BTreeSet<String>,
}

/// The ledger of one data directory (see the module's comment).
#[derive(Debug)]
pub(crate) struct CopyLedger {
    path: PathBuf,
    state: Mutex<LedgerState>,
    /// Serialises writers of the file (the state lock is not held across I/O).
    writing: Mutex<()>,
}

impl CopyLedger {
    /// Opens the ledger of `data_dir` (empty when there is none yet). A ledger that cannot be
    /// read is an error naming the file: starting without it could forget what etcd's history
    /// was.
    pub(crate) fn open(data_dir: &Path) -> anyhow::Result<CopyLedger> {
        let path = data_dir.join(LEDGER_FILE);
        let state = match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| {
                anyhow::anyhow!(
                    "{} cannot be read ({e}): restore it from a backup of the data directory, \
                     or move it away to start without this node's memory of etcd's history",
                    path.display()
                )
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => LedgerState::default(),
            Err(e) => anyhow::bail!("reading {}: {e}", path.display()),
        };
        Ok(CopyLedger {
            path,
            state: Mutex::new(state),
            writing: Mutex::new(()),
        })
    }

    /// The highest etcd revision the node acted on (0: none).
    pub(crate) fn revision(&self) -> i64 {
        self.state.lock().revision
    }

    /// The newest write the node acted on (`None`: none, or the history started again).
    pub(crate) fn witness(&self) -> Option<tarn_cluster::HistoryWitness> {
        self.state.lock().witness.clone()
    }

    /// The highest epoch at which this directory held a role in `local`'s record (0: none).
    pub(crate) fn held_epoch(&self, local: &str) -> u64 {
        self.state.lock().held.get(local).copied().unwrap_or(0)
    }

    /// Whether a record at `epoch` may have this directory start `local` empty: no copy of it
    /// was deleted here on a record at that epoch or later.
    pub(crate) fn may_start_empty(&self, local: &str, epoch: u64) -> bool {
        self.state
            .lock()
            .dropped
            .get(local)
            .is_none_or(|dropped_at| epoch > *dropped_at)
    }

    /// Records that the node acted on the store's state at `revision`, whose newest write is
    /// `witness`, holding each copy in `held` at its epoch; writes the file (blocking: call
    /// off the async workers) when anything grew.
    pub(crate) fn note_held(
        &self,
        revision: i64,
        witness: Option<tarn_cluster::HistoryWitness>,
        held: impl IntoIterator<Item = (String, u64)>,
    ) -> std::io::Result<()> {
        self.change(|state| {
            let mut grew = revision > state.revision;
            state.revision = state.revision.max(revision);
            if let Some(witness) = witness {
                if state
                    .witness
                    .as_ref()
                    .is_none_or(|w| witness.mod_revision > w.mod_revision)
                {
                    state.witness = Some(witness);
                    grew = true;
                }
            }
            for (local, epoch) in held {
                let slot = state.held.entry(local).or_default();
                if epoch > *slot {
                    *slot = epoch;
                    grew = true;
                }
            }
            grew
        })
    }

    /// Whether `local`'s copy is a seed's, unfinished.
    pub(crate) fn is_seeding(&self, local: &str) -> bool {
        self.state.lock().seeding.contains(local)
    }

    /// Records that a seed starts filling `local`'s copy (`true`) or finished it (blocking).
    pub(crate) fn note_seeding(&self, local: &str, seeding: bool) -> std::io::Result<()> {
        self.change(|state| {
            if seeding {
                state.seeding.insert(local.to_owned())
            } else {
                state.seeding.remove(local)
            }
        })
    }

    /// Forgets the revision seen (blocking): etcd's history starts again (a new cluster, or a
    /// rollback the operator accepted). Held epochs and drops stay.
    pub(crate) fn restart_history(&self) -> std::io::Result<()> {
        self.change(|state| {
            let witness = state.witness.take().is_some();
            std::mem::take(&mut state.revision) != 0 || witness
        })
    }

    /// Records, before it is deleted, that `local`'s copy is deleted here on a record at
    /// `epoch` read at `revision` (blocking).
    pub(crate) fn note_dropped(
        &self,
        local: &str,
        revision: i64,
        epoch: u64,
    ) -> std::io::Result<()> {
        self.change(|state| {
            state.revision = state.revision.max(revision);
            state.held.remove(local);
            let slot = state.dropped.entry(local.to_owned()).or_default();
            *slot = (*slot).max(epoch);
            true
        })
    }

    /// Records that `local`'s copy left this directory's service (set aside): its held epoch
    /// goes with it, and, as for a drop, a record no newer than that epoch never has this
    /// directory start the shard empty again (an etcd restored from an older backup names
    /// this directory, at the old epoch, as where the shard is created: its data is in the
    /// set-aside copy, not in an empty one) (blocking).
    pub(crate) fn note_set_aside(&self, local: &str) -> std::io::Result<()> {
        self.change(|state| {
            let Some(held) = state.held.remove(local) else {
                return false;
            };
            let slot = state.dropped.entry(local.to_owned()).or_default();
            *slot = (*slot).max(held);
            true
        })
    }

    /// Applies `f` to a copy of the state and, when it says the state changed, writes the file
    /// and then publishes the new state.
    fn change(&self, f: impl FnOnce(&mut LedgerState) -> bool) -> std::io::Result<()> {
        let _writing = self.writing.lock();
        let mut next = self.state.lock().clone();
        if !f(&mut next) {
            return Ok(());
        }
        write_atomically(&self.path, &serde_json::to_vec(&next)?)?;
        *self.state.lock() = next;
        Ok(())
    }
}

/// Replaces `path` with `bytes`: a synced temporary file renamed over it, then the directory
/// synced.
fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let staging = path.with_extension("tmp");
    let mut file = std::fs::File::create(&staging)?;
    file.write_all(bytes)?;
    file.sync_all()?;
    std::fs::rename(&staging, path)?;
    if let Some(dir) = path.parent() {
        std::fs::File::open(dir)?.sync_all()?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ledger_only_grows_and_survives_a_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = CopyLedger::open(dir.path()).unwrap();
        assert_eq!((ledger.revision(), ledger.held_epoch("c.1.0")), (0, 0));
        let witness = |at| Some(tarn_cluster::HistoryWitness::of(b"/tarn/k", b"v", at));
        ledger
            .note_held(
                40,
                witness(39),
                [("c.1.0".to_owned(), 3), ("c.1.1".to_owned(), 1)],
            )
            .unwrap();
        // An older view lowers nothing.
        ledger
            .note_held(12, witness(11), [("c.1.0".to_owned(), 2)])
            .unwrap();
        ledger.note_dropped("c.1.1", 41, 5).unwrap();
        let reopened = CopyLedger::open(dir.path()).unwrap();
        assert_eq!(reopened.revision(), 41);
        assert_eq!(reopened.witness(), witness(39));
        assert_eq!(reopened.held_epoch("c.1.0"), 3);
        assert_eq!(reopened.held_epoch("c.1.1"), 0);
        // Started empty again only by a record newer than the drop's (a shard given up to
        // this node by forget), never by an older one (etcd restored from a backup).
        assert!(reopened.may_start_empty("c.1.0", 1));
        assert!(!reopened.may_start_empty("c.1.1", 5) && !reopened.may_start_empty("c.1.1", 1));
        assert!(reopened.may_start_empty("c.1.1", 6));
        // A history started again forgets the revision, not what was held or dropped.
        reopened.restart_history().unwrap();
        let restarted = CopyLedger::open(dir.path()).unwrap();
        assert_eq!(
            (restarted.revision(), restarted.held_epoch("c.1.0")),
            (0, 3)
        );
        assert_eq!(restarted.witness(), None);
        assert!(!restarted.may_start_empty("c.1.1", 5));
        // A seed's copy stays marked until the seed finishes.
        reopened.note_seeding("c.1.2", true).unwrap();
        assert!(CopyLedger::open(dir.path()).unwrap().is_seeding("c.1.2"));
        reopened.note_seeding("c.1.2", false).unwrap();
        assert!(!CopyLedger::open(dir.path()).unwrap().is_seeding("c.1.2"));
        // A copy set aside while held at epoch 3 is never started empty here by a record of
        // epoch 3 or older.
        reopened.note_set_aside("c.1.0").unwrap();
        let set_aside = CopyLedger::open(dir.path()).unwrap();
        assert_eq!(set_aside.held_epoch("c.1.0"), 0);
        assert!(!set_aside.may_start_empty("c.1.0", 1) && !set_aside.may_start_empty("c.1.0", 3));
        assert!(set_aside.may_start_empty("c.1.0", 4));
        // A damaged ledger refuses to open, naming the file.
        std::fs::write(dir.path().join(LEDGER_FILE), b"{not json").unwrap();
        let error = CopyLedger::open(dir.path()).unwrap_err().to_string();
        assert!(error.contains(LEDGER_FILE), "{error}");
    }
}
