//! The state of one shard's replication on its primary ([`ShardReplication`]) and what a
//! replica has acknowledged ([`Acked`]): the types the node keeps (`cluster/`'s replication
//! map) and `replica_set/`'s files work on. It imports nothing of the data plane, so that
//! `cluster/` can name it without importing `replica_set/`, which imports `cluster/`.

use std::sync::Arc;
use std::sync::Mutex as StdMutex;
use std::time::{Duration, Instant};

use dashmap::DashMap;
use tarn_cluster::{ShardAssignment, ShardName};
use tarn_collection::Collection;
use tarn_proto::v1 as pb;
use tokio::sync::watch;

/// What a replica has acknowledged: its last durable entry, and the data directory (its
/// token, empty when unknown) that answered.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Acked {
    pub seq: u64,
    pub incarnation: String,
}

/// One shard's replication, on its primary, at one epoch.
pub(crate) struct ShardReplication {
    pub(crate) shard: ShardName,
    pub(crate) epoch: u64,
    pub(crate) min_in_sync: u32,
    pub(crate) collection: Collection,
    /// This copy's epoch history, this epoch's start included (recorded before the first
    /// entry of the epoch was appended): shipped with every entry batch.
    pub(crate) history: Vec<pb::EpochStart>,
    /// This epoch's first sequence number. A new follower holds the log from it while its
    /// replica is away: a deposed primary that comes back needs everything from there (it
    /// holds the rest), and this primary never learnt its position.
    pub(crate) epoch_first_seq: u64,
    /// The shard's record as this primary last knew it: its own swaps land here at once (the
    /// view follows later); changes by others are taken from the view.
    pub(crate) record: StdMutex<ShardAssignment>,
    /// The highest sequence number writers want on the replicas.
    pub(crate) wanted: watch::Sender<u64>,
    /// Per replica node: the last sequence number it has durable, and from which directory.
    pub(crate) acked: DashMap<String, watch::Receiver<Acked>>,
    /// The highest entry durable here and on every in-sync replica (acknowledged by the
    /// directory recorded for its copy): no failover cuts it. This copy makes entries visible
    /// up to it, and the followers tell the replicas ([`ShardReplication::advance_commit`]).
    pub(crate) commit: watch::Sender<u64>,
    /// Followers notify it after each acknowledgement; the committer task then advances the
    /// commit.
    pub(crate) acks: Arc<tokio::sync::Notify>,
    pub(crate) committer: StdMutex<Option<tokio::task::JoinHandle<()>>>,
    pub(crate) followers: StdMutex<Vec<(String, tokio::task::JoinHandle<()>)>>,
    /// Serialises this shard's in-sync changes.
    pub(crate) changing: tokio::sync::Mutex<()>,
    /// A join is under way (one at a time).
    pub(crate) joining: std::sync::atomic::AtomicBool,
    /// This primary is handing the shard to a replica because its copy failed (once).
    pub(crate) stepping_down: std::sync::atomic::AtomicBool,
    /// Per replica whose last join failed: when the next may be tried, and the wait after
    /// another failure.
    pub(crate) join_backoff: DashMap<String, (Instant, Duration)>,
    /// Set once this node's view shows the shard at another epoch or primary: the writes still
    /// waiting on this replication fail at once (none can be acknowledged at this epoch), so
    /// they let the shard's gate go and the copy can follow its new primary.
    pub(crate) deposed: watch::Sender<bool>,
}

impl Drop for ShardReplication {
    fn drop(&mut self) {
        for (_, task) in self
            .followers
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .drain(..)
        {
            task.abort();
        }
        if let Some(committer) = self
            .committer
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            committer.abort();
        }
    }
}

impl std::fmt::Debug for ShardReplication {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardReplication")
            .field("shard", &self.shard.local_name())
            .field("epoch", &self.epoch)
            .finish()
    }
}
