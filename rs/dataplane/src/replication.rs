//! Replication of a shard's log from its primary to its replicas (docs/CLUSTER.md, "Replicas").
//!
//! The primary's side: one [`ShardReplication`] per shard this node is primary of at one epoch,
//! with one follower task per replica. A follower reads the shard's log (a `WalTail` that keeps
//! the WAL from the replica's position on) and ships it, in order, with `Node/AppendEntries`;
//! the replica appends the entries at the same sequence numbers, syncs, and answers where its
//! log ends. A write is acknowledged once every in-sync replica has it durable
//! ([`ShardReplication::replicate`]); an in-sync replica that does not have it within
//! [`IN_SYNC_BOUND`] is first removed from the in-sync set in etcd (a compare-and-swap of the
//! whole shard record), and only then is the write acknowledged without it. A catching-up
//! replica that holds everything joins the in-sync set by the same swap, taken while the
//! shard's write gate is held exclusively so that no write is acknowledged in between
//! (Patroni's rule: it joins only with everything).
//!
//! The replica's side: [`append_entries`], which serves only the shard's primary at the epoch
//! its own view of the map gives (a primary that lost its place is refused).
//!
//! In sync means in sync on one disk: a replica answers every call with its data directory's
//! token, each acknowledgement counts only for the directory that sent it, and a join records
//! that directory for the copy (`tarn_cluster::ShardAssignment::incarnations`). A write first
//! takes out of the in-sync set any replica whose node the view shows registered from another
//! directory (back on a wiped disk: it holds nothing), so such a copy is never counted for
//! `min_in_sync` nor waited for; the placement coordinator does the same without a write.
//!
//! Epochs: each copy keeps where each epoch's entries begin in its log (`EPOCHS`,
//! `tarn_collection::Collection::update_epoch_starts`). A primary records its epoch before its
//! first entry of it ([`begin_epoch`]) and sends its history with every batch; the replica
//! records the starts among the entries it appends. A follower's first call probes the
//! replica's last entry and history; if the replica holds entries past the last position both
//! logs hold from the same epoch (`tarn_cluster::last_common_seq`: a deposed primary's
//! unacknowledged tail), it is told to cut them off before anything is shipped.
//!
//! Who waits on whom: a write waits for the followers' acknowledgements (bounded by
//! [`IN_SYNC_BOUND`] and then by one etcd swap); a follower waits for the replica's answer
//! (bounded by [`IN_SYNC_BOUND`]) and never for a write; the replica's handler waits for its own
//! WAL. Nothing waits on a write while holding a shard's gate except a join, which waits at
//! most [`JOIN_DRAIN_LIMIT`] for the replica to take the last entries.
//!
//! Lock order, one way only: a shard's write gate, then its `changing` mutex. A write holds the
//! gate (shared) and may take `changing` to swap a late replica out; a hand-over holds the gate
//! exclusively and may do the same; a join takes the gate exclusively first (giving up after
//! [`JOIN_DRAIN_LIMIT`] if writes in flight keep it) and `changing` only then. Nothing takes the
//! gate while holding `changing`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use dashmap::DashMap;
use futures_util::stream::{FuturesOrdered, StreamExt};
use std::sync::Mutex as StdMutex;
use tarn_cluster::{
    last_common_seq, EpochHistory, ShardAssignment, ShardName, ShardRecord, ShardSwap,
};
use tarn_collection::{Collection, WalTail};
use tarn_proto::v1 as pb;
use tokio::sync::watch;

use crate::cluster::ClusterNode;
use crate::status::ApiError;

/// How long a write waits for an in-sync replica before removing it from the in-sync set (and
/// how long a follower waits for one answer).
pub(crate) const IN_SYNC_BOUND: Duration = Duration::from_secs(2);
/// How long a join holds the shard's writes back at most while the replica takes the last
/// entries; past it, the join is tried again later.
const JOIN_DRAIN_LIMIT: Duration = Duration::from_millis(500);
/// A catching-up replica this close behind tries to join (the join then waits, writes held
/// back, for the rest: at most [`JOIN_DRAIN_LIMIT`]).
const JOIN_LAG_ENTRIES: u64 = 1_024;
/// How often a busy follower tries a join; after a failed one the wait doubles, up to
/// [`JOIN_BACKOFF_MAX`] (a replica that cannot take the last entries in time is not let hold
/// the writes back every second).
const JOIN_TRY_EVERY: Duration = Duration::from_secs(1);
const JOIN_BACKOFF_MAX: Duration = Duration::from_secs(30);
/// Most payload bytes shipped in one call.
const MAX_BATCH_BYTES: usize = 4 << 20;
/// How many entries a follower reads before letting checkpoints truncate what it has shipped.
const RELEASE_EVERY_ENTRIES: u64 = 4_096;
/// How much log (bytes written since it went away) a primary keeps for a replica whose calls
/// fail: one back within it catches up by log, checkpoints meanwhile notwithstanding; past it,
/// checkpoints may truncate what it lacks and it is seeded from a snapshot (PostgreSQL's
/// `max_slot_wal_keep_size`, as a fixed bound). The same bound holds for a replica that
/// answers but falls behind (out of the in-sync set): past it, it is seeded instead of pinning
/// the log from its position.
const AWAY_REPLICA_WAL_BYTES: u64 = 1 << 30;

/// [`MAX_BATCH_BYTES`], or (test builds) the `replication::max_batch_bytes` fail point's value
/// (a slow follower: one entry per batch at `return(1)`).
fn max_batch_bytes() -> usize {
    #[cfg(feature = "failpoints")]
    if let Some(Some(bytes)) = fail::eval("replication::max_batch_bytes", |arg| {
        arg.and_then(|a| a.parse::<usize>().ok())
    }) {
        return bytes;
    }
    MAX_BATCH_BYTES
}

/// [`AWAY_REPLICA_WAL_BYTES`], or (test builds) the `replication::away_wal_bytes` fail point's
/// value: the process tests of catch-up by snapshot set it to 0.
fn away_wal_bytes() -> u64 {
    #[cfg(feature = "failpoints")]
    if let Some(Some(bytes)) = fail::eval("replication::away_wal_bytes", |arg| {
        arg.and_then(|bytes| bytes.parse::<u64>().ok())
    }) {
        return bytes;
    }
    AWAY_REPLICA_WAL_BYTES
}

/// `AppendEntries` calls a follower keeps in flight to one replica: a write that arrives while
/// a batch is on its way is sent at once instead of after that batch's answer, and the
/// replica syncs one batch while it appends the next (docs/BENCHMARKS.md, "Replicas").
const PIPELINE_DEPTH: usize = 4;
/// How long a replica waits for the batches before one that arrived ahead of them (calls in
/// flight together may reach the replica's handler out of order).
const REORDER_WAIT: Duration = Duration::from_secs(1);

/// What a replica has acknowledged: its last durable entry, and the data directory (its
/// token, empty when unknown) that answered.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Acked {
    pub seq: u64,
    pub incarnation: String,
}

/// One shard's replication, on its primary, at one epoch.
pub(crate) struct ShardReplication {
    shard: ShardName,
    epoch: u64,
    min_in_sync: u32,
    collection: Collection,
    /// This copy's epoch history, this epoch's start included (recorded before the first
    /// entry of the epoch was appended): shipped with every entry batch.
    history: Vec<pb::EpochStart>,
    /// This epoch's first sequence number. A new follower holds the log from it while its
    /// replica is away: a deposed primary that comes back needs everything from there (it
    /// holds the rest), and this primary never learnt its position.
    epoch_first_seq: u64,
    /// The shard's record as this primary last knew it: its own swaps land here at once (the
    /// view follows later); changes by others are taken from the view.
    record: StdMutex<ShardAssignment>,
    /// The highest sequence number writers want on the replicas.
    wanted: watch::Sender<u64>,
    /// Per replica node: the last sequence number it has durable, and from which directory.
    acked: DashMap<String, watch::Receiver<Acked>>,
    followers: StdMutex<Vec<(String, tokio::task::JoinHandle<()>)>>,
    /// Serialises this shard's in-sync changes.
    changing: tokio::sync::Mutex<()>,
    /// A join is under way (one at a time).
    joining: std::sync::atomic::AtomicBool,
    /// This primary is handing the shard to a replica because its copy failed (once).
    stepping_down: std::sync::atomic::AtomicBool,
    /// Per replica whose last join failed: when the next may be tried, and the wait after
    /// another failure.
    join_backoff: DashMap<String, (Instant, Duration)>,
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

/// One replica's figures, for metrics.
#[derive(Debug, Clone)]
pub struct ReplicaFigures {
    pub collection: String,
    pub shard: u32,
    pub node: String,
    /// Entries the primary holds that the replica has not acknowledged durable.
    pub lag: u64,
    pub in_sync: bool,
}

impl ClusterNode {
    /// Every replica of the shards this node replicates as primary: its lag and whether it is
    /// in sync.
    pub fn replication_figures(&self) -> Vec<ReplicaFigures> {
        let mut figures = Vec::new();
        for entry in self.replication.iter() {
            let replication = entry.value();
            let last = replication.collection.last_seq_no();
            let record = replication.record().clone();
            for replica in &record.replicas {
                let acked = replication
                    .acked
                    .get(replica)
                    .map_or(0, |a| a.value().borrow().seq);
                figures.push(ReplicaFigures {
                    collection: replication.shard.collection.clone(),
                    shard: replication.shard.shard,
                    node: replica.clone(),
                    lag: last.saturating_sub(acked),
                    in_sync: record.in_sync_replicas.contains(replica),
                });
            }
        }
        figures.sort_by(|a, b| {
            (&a.collection, a.shard, &a.node).cmp(&(&b.collection, b.shard, &b.node))
        });
        figures
    }

    /// The replication of `shard` (this node its primary at `epoch`, per `assignment`), started
    /// on first use: `None` when the shard has no replicas. Takes out of the in-sync set any
    /// replica back on another data directory, then refuses a write up front when fewer copies
    /// than the collection's `min_in_sync` are in sync.
    pub(crate) async fn replication_for_write(
        self: &Arc<Self>,
        shard: &ShardName,
        assignment: &ShardAssignment,
        min_in_sync: u32,
        collection: &Collection,
    ) -> Result<Option<Arc<ShardReplication>>, ApiError> {
        let Some(replication) = self
            .replication_of(shard, assignment, min_in_sync, collection)
            .await?
        else {
            return Ok(None);
        };
        replication.drop_replaced(self).await?;
        let record = replication.record().clone();
        record.check_in_sync(min_in_sync).map_err(|why| {
            ApiError::Unavailable(format!(
                "shard {} of collection '{}' refuses writes (primary {}): {why}",
                shard.shard, shard.collection, self.node_id
            ))
        })?;
        Ok(Some(replication))
    }

    /// Starts the replication of every shard this node is primary of that has replicas, so a
    /// returning or promoted-over copy is probed, cut back if it must be, and caught up without
    /// waiting for the next write (a new primary records its epoch here too).
    pub(crate) async fn start_replications(self: &Arc<Self>, state: &tarn_cluster::ClusterState) {
        for (shard, assignment, map) in state.shards_led_by(&self.node_id) {
            if assignment.replicas.is_empty() || !assignment.takes_writes() {
                continue;
            }
            let local = shard.local_name();
            let existing = self
                .replication
                .get(&local)
                .map(|r| Arc::clone(r.value()))
                .filter(|r| r.epoch == assignment.epoch);
            if let Some(replication) = existing {
                // Replicas added or dropped since (re-replication): followers to match.
                if let Err(error) = replication.refresh(self, assignment).await {
                    tracing::warn!(shard = %local, %error, "cannot refresh a shard's replication");
                }
                continue;
            }
            let Ok(collection) = self.registry.get_shard(&local) else {
                continue;
            };
            if let Err(error) = self
                .replication_of(&shard, assignment, map.def.min_in_sync, &collection)
                .await
            {
                tracing::warn!(shard = %local, %error, "cannot start replicating a shard");
            }
        }
    }

    /// The replication of `shard` at `assignment`'s epoch, started (its epoch recorded in the
    /// copy's history, its followers started) if it was not; `None` without replicas.
    async fn replication_of(
        self: &Arc<Self>,
        shard: &ShardName,
        assignment: &ShardAssignment,
        min_in_sync: u32,
        collection: &Collection,
    ) -> Result<Option<Arc<ShardReplication>>, ApiError> {
        let local = shard.local_name();
        let existing = self
            .replication
            .get(&local)
            .map(|r| Arc::clone(r.value()))
            .filter(|r| r.epoch == assignment.epoch);
        let mut start_hold = None;
        let replication = match existing {
            Some(r) => r,
            None if assignment.replicas.is_empty() && min_in_sync <= 1 => return Ok(None),
            None => {
                // The in-sync set this primary waits for starts from etcd itself, never from a
                // view that may lag a join (the cache must hold every copy etcd lists in sync).
                let record = match node_read_shard(self, shard).await? {
                    ShardRecord::Assigned(fresh)
                        if fresh.epoch == assignment.epoch && fresh.owner == self.node_id =>
                    {
                        fresh
                    }
                    _ => {
                        return Err(ApiError::StaleShardMap(format!(
                            "shard {} of collection '{}' is no longer led by node {} at epoch {}: \
                             refresh the shard map and retry",
                            shard.shard, shard.collection, self.node_id, assignment.epoch
                        )))
                    }
                };
                let history = begin_epoch(collection, assignment.epoch).await?;
                let epoch_first_seq = history
                    .iter()
                    .rev()
                    .find(|start| start.epoch == assignment.epoch)
                    .map_or(collection.last_seq_no() + 1, |start| start.first_seq);
                // Held until the first followers have taken their own holds (below), so that
                // no checkpoint truncates the epoch's log meanwhile.
                start_hold = collection.wal_tail_from(epoch_first_seq);
                let (wanted, _) = watch::channel(collection.last_seq_no());
                let r = Arc::new(ShardReplication {
                    shard: shard.clone(),
                    epoch: assignment.epoch,
                    min_in_sync,
                    collection: collection.clone(),
                    history,
                    epoch_first_seq,
                    record: StdMutex::new(record),
                    wanted,
                    acked: DashMap::new(),
                    followers: StdMutex::new(Vec::new()),
                    changing: tokio::sync::Mutex::new(()),
                    join_backoff: DashMap::new(),
                    joining: std::sync::atomic::AtomicBool::new(false),
                    stepping_down: std::sync::atomic::AtomicBool::new(false),
                });
                // Another write may have started it meanwhile: one replication per epoch.
                let entry = self
                    .replication
                    .entry(local)
                    .or_insert_with(|| Arc::clone(&r));
                if entry.epoch == assignment.epoch {
                    Arc::clone(entry.value())
                } else {
                    drop(entry);
                    self.replication.insert(shard.local_name(), Arc::clone(&r));
                    r
                }
            }
        };
        replication.refresh(self, assignment).await?;
        drop(start_hold);
        Ok(Some(replication))
    }

    /// Stops the replication of shards this node is no longer primary of (at that epoch). A
    /// view older than the replication (a lower epoch: the replication was started from a
    /// newer one) stops nothing.
    pub(crate) fn forget_replications(&self, state: &tarn_cluster::ClusterState) {
        self.replication.retain(|_, r| {
            state.assignment(&r.shard).is_some_and(|a| {
                a.epoch < r.epoch || (a.owner == self.node_id && a.epoch == r.epoch)
            })
        });
    }
}

impl ShardReplication {
    /// The shard's record as this primary knows it (a poisoned lock still holds a whole value:
    /// every write to it is one assignment).
    fn record(&self) -> std::sync::MutexGuard<'_, ShardAssignment> {
        self.record.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes changes others made to the record (the view's, at this epoch: replicas added or
    /// dropped by the coordinator) and starts a follower for each replica that has none. A view
    /// that would take a copy out of the in-sync set this primary waits for is not trusted (it
    /// may be older than a join this primary made): the record is read again from etcd and
    /// that is taken instead. So the in-sync set waited for always holds every copy etcd lists
    /// in sync.
    async fn refresh(
        &self,
        node: &Arc<ClusterNode>,
        view: &ShardAssignment,
    ) -> Result<(), ApiError> {
        if view.epoch != self.epoch {
            return Ok(());
        }
        let drops_in_sync = self
            .record()
            .in_sync_replicas
            .iter()
            .any(|n| !view.replicas.contains(n));
        let fresh;
        let view = if drops_in_sync {
            match node_read_shard(node, &self.shard).await? {
                ShardRecord::Assigned(record) if record.epoch == self.epoch => {
                    fresh = record;
                    &fresh
                }
                // Another epoch or no record: this replication is over; nothing to take.
                _ => return Ok(()),
            }
        } else {
            view
        };
        {
            let mut record = self.record();
            if *record != *view {
                // Replicas come from the view; the in-sync set (and the directories recorded
                // for it) is this primary's own, except that a replica the view dropped is gone
                // from it too.
                let in_sync: Vec<String> = record
                    .in_sync_replicas
                    .iter()
                    .filter(|n| view.replicas.contains(n))
                    .cloned()
                    .collect();
                let incarnations = record
                    .incarnations
                    .iter()
                    .filter(|(n, _)| in_sync.contains(n))
                    .chain(view.incarnations.get_key_value(&view.owner))
                    .map(|(n, t)| (n.clone(), t.clone()))
                    .collect();
                *record = ShardAssignment {
                    in_sync_replicas: in_sync,
                    incarnations,
                    ..view.clone()
                };
            }
        }
        let replicas = self.record().replicas.clone();
        let mut followers = self.followers.lock().unwrap_or_else(|p| p.into_inner());
        followers.retain(|(n, task)| {
            let keep = replicas.contains(n);
            if !keep {
                task.abort();
            }
            keep
        });
        self.acked.retain(|n, _| replicas.contains(n));
        for replica in replicas {
            if followers.iter().any(|(n, _)| *n == replica) {
                continue;
            }
            let (acked_tx, acked_rx) = watch::channel(Acked::default());
            self.acked.insert(replica.clone(), acked_rx);
            let follower = Follower {
                node: Arc::downgrade(node),
                shard: self.shard.clone(),
                epoch: self.epoch,
                history: self.history.clone(),
                replica: replica.clone(),
                collection: self.collection.clone(),
            };
            // Until its first probe answers, the follower holds the log from the epoch's start
            // (while the log still has it): its replica may be the deposed primary.
            let held = self
                .collection
                .wal_tail_from(self.epoch_first_seq)
                .map(|tail| (tail, self.collection.wal_stats().n_bytes));
            let task = tokio::spawn(follow(follower, self.wanted.subscribe(), acked_tx, held));
            followers.push((replica, task));
        }
        Ok(())
    }

    /// Hands the shard to an in-sync replica (alive on its recorded disk) because this
    /// primary's copy refuses writes for good (`why`: its WAL is poisoned): the failover the
    /// coordinator makes for a dead primary, made by the primary itself, in one swap of the
    /// whole record that also requires the candidate's registration from its directory. Every
    /// acknowledged write is on every in-sync copy, so nothing acknowledged is lost; this copy
    /// becomes a catching-up replica (its unacknowledged tail is cut when it comes back). In a
    /// task of its own, once per replication.
    pub(crate) fn step_down(self: &Arc<Self>, node: &Arc<ClusterNode>, why: String) {
        if self
            .stepping_down
            .swap(true, std::sync::atomic::Ordering::AcqRel)
        {
            return;
        }
        let (replication, node) = (Arc::clone(self), Arc::clone(node));
        tokio::spawn(async move {
            let shard = replication.shard.local_name();
            tracing::error!(%shard, %why, "this primary's copy refuses writes: handing the shard to an in-sync replica");
            let record = match node_read_shard(&node, &replication.shard).await {
                Ok(ShardRecord::Assigned(a))
                    if a.epoch == replication.epoch && a.owner == node.node_id =>
                {
                    a
                }
                Ok(_) => return,
                Err(error) => {
                    tracing::warn!(%shard, %error, "cannot step down: etcd unavailable");
                    replication
                        .stepping_down
                        .store(false, std::sync::atomic::Ordering::Release);
                    return;
                }
            };
            let state = node.state();
            let candidate = record
                .in_sync_replicas
                .iter()
                .find(|n| state.holds_in_sync_copy(&record, n))
                .cloned();
            let Some(candidate) = candidate else {
                tracing::error!(%shard, "no in-sync replica alive to take the shard: it takes no write until this node is restarted");
                return;
            };
            let Some(promoted) = record.promoted(&candidate) else {
                return;
            };
            let mut swap = crate::moves::whole_record_swap(&replication.shard, &record, &promoted);
            swap.registered = Some((
                candidate.as_str(),
                record.incarnation_of(&candidate).unwrap_or(""),
            ));
            match node.store().compare_and_set_shard(&swap).await {
                Ok(true) => {
                    node.moves
                        .failovers
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    tracing::warn!(%shard, primary = %candidate, epoch = promoted.epoch,
                        "failover: this primary's copy failed; an in-sync replica is the shard's primary");
                }
                Ok(false) => {
                    tracing::warn!(%shard, "stepping down did not land (the record changed); trying at the next failed write");
                    replication
                        .stepping_down
                        .store(false, std::sync::atomic::Ordering::Release);
                }
                Err(error) => {
                    tracing::warn!(%shard, %error, "cannot step down: etcd unavailable");
                    replication
                        .stepping_down
                        .store(false, std::sync::atomic::Ordering::Release);
                }
            }
        });
    }

    /// Makes sure the write at `seq` is durable on every in-sync replica (acknowledged by the
    /// data directory recorded for its copy), removing from the in-sync set (in etcd, before
    /// answering) any that does not have it within [`IN_SYNC_BOUND`]; fails if fewer copies
    /// than `min_in_sync` are then left in sync (the write is in the primary's log but not
    /// acknowledged).
    pub(crate) async fn replicate(&self, node: &ClusterNode, seq: u64) -> Result<(), ApiError> {
        self.wanted.send_if_modified(|w| {
            let more = seq > *w;
            *w = (*w).max(seq);
            more
        });
        let until = tokio::time::Instant::now() + IN_SYNC_BOUND;
        loop {
            let record = self.record().clone();
            let mut late: Vec<String> = Vec::new();
            for replica in &record.in_sync_replicas {
                let Some(mut acked) = self.acked.get(replica).map(|a| a.value().clone()) else {
                    late.push(replica.clone());
                    continue;
                };
                let has_it =
                    |v: &Acked| v.seq >= seq && !record.copy_replaced(replica, &v.incarnation);
                let reached = tokio::time::timeout_at(until, acked.wait_for(has_it)).await;
                if !matches!(reached, Ok(Ok(_))) {
                    late.push(replica.clone());
                }
            }
            if late.is_empty() {
                break;
            }
            for replica in late {
                self.leave_in_sync(node, &replica, "late").await?;
            }
        }
        let record = self.record().clone();
        record.check_in_sync(self.min_in_sync).map_err(|why| {
            ApiError::Unavailable(format!(
                "shard {} of collection '{}' did not acknowledge the write (primary {}): \
                     {why}",
                self.shard.shard, self.shard.collection, node.node_id
            ))
        })
    }

    /// Takes out of the in-sync set every replica this node's view shows registered from another
    /// data directory than the one recorded for its copy (it came back on a wiped or replaced
    /// disk and holds nothing): before a write counts or waits for it.
    async fn drop_replaced(&self, node: &ClusterNode) -> Result<(), ApiError> {
        let state = node.state();
        let replaced: Vec<String> = {
            let record = self.record();
            record
                .in_sync_replicas
                .iter()
                .filter(|n| state.copy_replaced(&record, n))
                .cloned()
                .collect()
        };
        for replica in replaced {
            self.leave_in_sync(node, &replica, "back on another data directory")
                .await?;
        }
        Ok(())
    }

    /// Removes `replica` from the in-sync set by a compare-and-swap (nothing to do if it is no
    /// longer in it); `why` goes to the log.
    async fn leave_in_sync(
        &self,
        node: &ClusterNode,
        replica: &str,
        why: &str,
    ) -> Result<(), ApiError> {
        let _changing = self.changing.lock().await;
        if !self.record().in_sync_replicas.iter().any(|n| n == replica) {
            return Ok(());
        }
        self.change_record(node, |r| {
            if r.in_sync_replicas.iter().any(|n| n == replica) {
                r.without_in_sync(replica).map(Some)
            } else {
                Some(None)
            }
        })
        .await?;
        tracing::warn!(
            shard = %self.shard.local_name(),
            %replica,
            why,
            "a replica left the in-sync set (late by {:?}, back on another data directory, or its \
             copy is being replaced)",
            IN_SYNC_BOUND
        );
        Ok(())
    }

    /// Applies `change` to the shard's record by a compare-and-swap of the whole record, reading
    /// the record again (linearizably) after a lost swap. `change` answers `Some(None)` when
    /// nothing needs changing, `None` when the change no longer applies. Fails once the shard
    /// has another epoch (this node is no longer its primary).
    async fn change_record(
        &self,
        node: &ClusterNode,
        change: impl Fn(&ShardAssignment) -> Option<Option<ShardAssignment>>,
    ) -> Result<bool, ApiError> {
        let mut base = self.record().clone();
        for _ in 0..8 {
            let Some(next) = change(&base) else {
                return Ok(false);
            };
            let Some(next) = next else {
                return Ok(true);
            };
            let swap = ShardSwap {
                collection: &self.shard.collection,
                uid: self.shard.uid,
                shard: self.shard.shard,
                expected_epoch: self.epoch,
                new: &next,
                unless_registered: None,
                unless_registered_from: None,
                registered: None,
                expected: Some(&base),
            };
            let landed = node
                .store()
                .compare_and_set_shard(&swap)
                .await
                .map_err(|e| ApiError::ClusterStore(e.to_string()))?;
            if landed {
                *self.record() = next;
                return Ok(true);
            }
            let record = node
                .store()
                .read_shard(&self.shard.collection, self.shard.uid, self.shard.shard)
                .await
                .map_err(|e| ApiError::ClusterStore(e.to_string()))?;
            match record {
                ShardRecord::Assigned(fresh) if fresh.epoch == self.epoch => {
                    *self.record() = fresh.clone();
                    base = fresh;
                }
                _ => {
                    return Err(ApiError::StaleShardMap(format!(
                        "shard {} of collection '{}' has a new primary (this node's epoch {} is \
                         over): refresh the shard map and retry",
                        self.shard.shard, self.shard.collection, self.epoch
                    )))
                }
            }
        }
        Err(ApiError::Unavailable(format!(
            "shard {} of collection '{}': its record kept changing under this node's swaps",
            self.shard.shard, self.shard.collection
        )))
    }

    /// Adds `replica` to the in-sync set once it holds everything: holds the shard's writes
    /// back (its gate, exclusively), waits until the replica has the last entry (at most
    /// [`JOIN_DRAIN_LIMIT`]), swaps the record (recording the data directory that acknowledged
    /// it), lets the writes go.
    async fn join_in_sync(
        &self,
        node: &ClusterNode,
        replica: &str,
        acked: &watch::Receiver<Acked>,
    ) -> Result<bool, ApiError> {
        if self.record().role_of(replica) != Some(tarn_cluster::CopyRole::CatchingUp) {
            return Ok(false);
        }
        // The gate before `changing` (the module's lock order): a write holding the gate may
        // need `changing` to swap a late replica out. Writes in flight that keep the gate past
        // the drain limit (waiting for a late replica) make the join give up for now.
        let gate = node.gate(&self.shard.local_name());
        let Ok(_writes_held) = tokio::time::timeout(JOIN_DRAIN_LIMIT, gate.write()).await else {
            return Ok(false);
        };
        let _changing = self.changing.lock().await;
        if self.record().role_of(replica) != Some(tarn_cluster::CopyRole::CatchingUp) {
            return Ok(false);
        }
        let last = self.collection.last_seq_no();
        self.wanted.send_if_modified(|w| {
            let more = last > *w;
            *w = (*w).max(last);
            more
        });
        let mut acked = acked.clone();
        // The directory whose acknowledgement reached the last entry is the one recorded.
        let holder = tokio::time::timeout(JOIN_DRAIN_LIMIT, acked.wait_for(|v| v.seq >= last))
            .await
            .ok()
            .and_then(|r| r.ok())
            .map(|v| v.incarnation.clone());
        let Some(holder) = holder else {
            return Ok(false);
        };
        let joined = self
            .change_record(node, |r| match r.role_of(replica) {
                Some(tarn_cluster::CopyRole::CatchingUp) => {
                    r.with_in_sync(replica, &holder).map(Some)
                }
                Some(tarn_cluster::CopyRole::InSyncReplica) => Some(None),
                _ => None,
            })
            .await?;
        if joined {
            tracing::info!(shard = %self.shard.local_name(), %replica, last, incarnation = %holder,
                "a replica joined the in-sync set");
        }
        Ok(joined)
    }
}

/// The shard's record, read linearizably from etcd.
async fn node_read_shard(node: &ClusterNode, shard: &ShardName) -> Result<ShardRecord, ApiError> {
    node.store()
        .read_shard(&shard.collection, shard.uid, shard.shard)
        .await
        .map_err(|e| ApiError::ClusterStore(e.to_string()))
}

/// Records, durably, that this copy's entries from its next one on are `epoch`'s (before the
/// first of them is appended: a primary's first write at an epoch). Entries the copy holds from
/// before it kept a history are epoch 0's (a shard's one line of primaries before it had
/// replicas: every copy got them from it). Returns the history.
async fn begin_epoch(collection: &Collection, epoch: u64) -> Result<Vec<pb::EpochStart>, ApiError> {
    let collection = collection.clone();
    tokio::task::spawn_blocking(move || -> Result<Vec<pb::EpochStart>, ApiError> {
        let mut wire = Vec::new();
        collection.update_epoch_starts(|starts| -> Result<_, ApiError> {
            let mut history =
                EpochHistory::from_starts(starts.clone()).map_err(ApiError::Internal)?;
            let next = collection.last_seq_no() + 1;
            if history.starts().is_empty() && next > 1 {
                history.begin(0, 1).map_err(ApiError::Internal)?;
            }
            history.begin(epoch, next).map_err(|why| {
                ApiError::Internal(format!(
                    "shard copy {}: cannot begin epoch {epoch}: {why}",
                    collection_label(&collection)
                ))
            })?;
            wire = to_wire(history.starts());
            Ok((history.starts() != starts.as_slice()).then(|| history.starts().to_vec()))
        })?;
        Ok(wire)
    })
    .await
    .map_err(|e| ApiError::Internal(format!("recording an epoch: {e}")))?
}

fn collection_label(collection: &Collection) -> String {
    format!("(last entry {})", collection.last_seq_no())
}

fn to_wire(starts: &[(u64, u64)]) -> Vec<pb::EpochStart> {
    starts
        .iter()
        .map(|&(epoch, first_seq)| pb::EpochStart { epoch, first_seq })
        .collect()
}

/// Records in a replica's epoch history, durably and before they are appended, the epochs of
/// the primary's entries `first..=last` (by the primary's history). An entry of an epoch older
/// than the copy's latest is refused: the copy must first be cut back (the primary's probe
/// does that). So is a batch whose previous entry (`first - 1`) the copy holds at another
/// epoch than the primary's history gives it (Raft's prevLogTerm): the batch would continue a
/// deposed primary's entries, not the primary's log.
pub(crate) async fn record_epochs(
    collection: &Collection,
    primary: &EpochHistory,
    first: u64,
    last: u64,
) -> Result<(), ApiError> {
    let mut starts: Vec<(u64, u64)> = Vec::new();
    if let Some(epoch) = primary.epoch_of(first) {
        starts.push((epoch, first));
    }
    starts.extend(
        primary
            .starts()
            .iter()
            .filter(|&&(_, start)| start > first && start <= last),
    );
    if starts.is_empty() {
        return Ok(());
    }
    let previous = first
        .checked_sub(1)
        .filter(|p| *p > 0)
        .and_then(|p| Some((p, primary.epoch_of(p)?)));
    let collection = collection.clone();
    tokio::task::spawn_blocking(move || -> Result<(), ApiError> {
        collection.update_epoch_starts(|before| -> Result<_, ApiError> {
            let mut history =
                EpochHistory::from_starts(before.clone()).map_err(ApiError::Internal)?;
            if let Some((seq, theirs)) = previous {
                if let Some(mine) = history.epoch_of(seq).filter(|mine| *mine != theirs) {
                    return Err(ApiError::Unsupported(format!(
                        "entries from {first} do not continue this replica's log: its entry \
                         {seq} is of epoch {mine}, the primary's of epoch {theirs}; probe again"
                    )));
                }
            }
            for (epoch, start) in starts {
                history.begin(epoch, start).map_err(|why| {
                    ApiError::Unsupported(format!(
                        "entries from {first} do not continue this replica's log: {why}"
                    ))
                })?;
            }
            Ok((history.starts() != before.as_slice()).then(|| history.starts().to_vec()))
        })
    })
    .await
    .map_err(|e| ApiError::Internal(format!("recording epochs: {e}")))?
}

/// A history from the wire, checked.
fn from_wire(starts: &[pb::EpochStart]) -> Result<EpochHistory, ApiError> {
    EpochHistory::from_starts(starts.iter().map(|s| (s.epoch, s.first_seq)).collect())
        .map_err(|why| ApiError::invalid("epochs", why))
}

/// What a follower ships from and to.
struct Follower {
    node: std::sync::Weak<ClusterNode>,
    shard: ShardName,
    epoch: u64,
    /// The primary's epoch history.
    history: Vec<pb::EpochStart>,
    replica: String,
    collection: Collection,
}

/// A follower: ships the shard's log to `replica` for as long as this node is the shard's
/// primary at `epoch` (the task is aborted when its `ShardReplication` goes).
async fn follow(
    follower: Follower,
    mut wanted: watch::Receiver<u64>,
    acked: watch::Sender<Acked>,
    mut held: Option<(WalTail, u64)>,
) {
    let Follower {
        node,
        shard,
        epoch,
        history,
        replica,
        collection,
    } = follower;
    let mut backoff = Duration::from_millis(50);
    // `held`: a hold on the log from the replica's position while it is away (from the epoch's
    // start until it first answers), and the log's byte count when it was taken.
    // `gave_up_log`: the replica fell too far behind while connected and is seeded instead:
    // no hold is taken for it until it follows by log again.
    let mut gave_up_log = false;
    loop {
        let Some(node) = node.upgrade() else {
            return;
        };
        let link = Link {
            node: &node,
            shard: &shard,
            epoch,
            history: &history,
            replica: &replica,
        };
        match ship(
            &link,
            &collection,
            &mut wanted,
            &acked,
            &mut held,
            &mut gave_up_log,
        )
        .await
        {
            Ok(()) => return,
            Err(error) => {
                tracing::debug!(shard = %shard.local_name(), %replica, %error, "shipping to a replica failed; retrying");
            }
        }
        // The replica is away (or being seeded): keep the log from its acknowledged position
        // for it, so that it comes back by log, up to a bound of log written since.
        if held.is_none() && !gave_up_log {
            let from = acked.borrow().seq + 1;
            held = collection
                .wal_tail_from(from)
                .map(|tail| (tail, collection.wal_stats().n_bytes));
        }
        let bound = away_wal_bytes();
        if held
            .as_ref()
            .is_some_and(|(_, at)| collection.wal_stats().n_bytes.saturating_sub(*at) > bound)
        {
            tracing::warn!(shard = %shard.local_name(), %replica, bound,
                "a replica away while this primary wrote more log than it keeps for one: \
                 checkpoints may truncate what it lacks (it will be seeded from a snapshot)");
            held = None;
        }
        drop(node);
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(1));
    }
}

/// One connection's worth of shipping: probes where the replica's log ends, then sends what
/// writers want, in order, until a call fails.
async fn ship(
    link: &Link<'_>,
    collection: &Collection,
    wanted: &mut watch::Receiver<u64>,
    acked: &watch::Sender<Acked>,
    held: &mut Option<(WalTail, u64)>,
    gave_up_log: &mut bool,
) -> Result<(), ApiError> {
    let (node, shard, epoch, replica) = (link.node, link.shard, link.epoch, link.replica);
    let mut probe = link.append(0, Vec::new(), None).await?;
    link.seed_if_needed(&probe).await?;
    // KIP-101's rule: the replica keeps its log up to the last entry both logs hold from the
    // same epoch; what it holds after that was written by a primary that lost its place before
    // the entries were acknowledged (an acknowledged entry is on every in-sync copy, and only
    // an in-sync copy is promoted), so it is cut off.
    let primary_last = collection.last_seq_no();
    let keep = last_common_seq(
        &from_wire(&probe.epochs)?,
        probe.last_seq,
        &from_wire(link.history)?,
        primary_last,
    );
    if keep < probe.last_seq {
        tracing::warn!(shard = %shard.local_name(), %replica, replica_last = probe.last_seq,
            keep, "the replica holds entries this primary does not: cutting them off");
        probe = link.append(0, Vec::new(), Some(keep)).await?;
        link.seed_if_needed(&probe).await?;
    }
    let durable = probe.durable_seq.min(probe.last_seq);
    // The same directory now ends below what it acknowledged (restored from an older backup or
    // VM snapshot, or a disk that lost synced data): its copy lacks acknowledged writes, so it
    // leaves the in-sync set before anything else, and is never promoted meanwhile.
    let before = acked.borrow().clone();
    if before.incarnation == probe.incarnation && durable < before.seq {
        tracing::error!(shard = %shard.local_name(), %replica, acknowledged = before.seq, durable,
            "a replica's copy went back behind what it acknowledged (restored from an older copy?)");
        if let Some(replication) = replication_at(node, shard, epoch) {
            replication
                .leave_in_sync(
                    node,
                    replica,
                    "its copy went back behind what it acknowledged",
                )
                .await?;
        }
    }
    acked.send_replace(Acked {
        seq: durable,
        incarnation: probe.incarnation.clone(),
    });
    // A replica that registers again (its process restarted, perhaps on a copy put back from
    // an older backup) is probed again even while no write comes.
    let registered = node.state().registered_at.get(replica).copied();
    let tail = collection.wal_tail_from(probe.last_seq + 1);
    // Following by log again (or never able to): the hold kept for the replica while it was
    // away has done its work.
    *held = None;
    *gave_up_log = false;
    let Some(mut tail) = tail else {
        link.seed().await?;
        return Err(ApiError::Unavailable(format!(
            "replica {replica} ends at {} and this primary's log no longer holds what follows: \
             it is seeded from a snapshot",
            probe.last_seq
        )));
    };
    let mut since_release = 0u64;
    let mut last_join_try = Instant::now();
    // Calls sent and not answered yet, oldest first; each entry is the call and its batch's
    // entry count. Dropping them (an error returns) drops the calls.
    let mut in_flight = FuturesOrdered::new();
    loop {
        let next = tail.next_seq();
        let want = *wanted.borrow_and_update();
        let durable = tail.durable_seq();
        // What writes wait for, and whatever else is durable already. An entry appended but
        // neither durable nor waited for yet is left to its own write group's sync (syncing
        // for it here would add an fsync per batch on the primary); its write raises `wanted`
        // once it is durable.
        let pending = want >= next || durable >= next;
        if pending && in_flight.len() < PIPELINE_DEPTH {
            let up_to = want.max(durable);
            if durable < want {
                // A tail reads durable entries only: make what was written (WRITTEN) durable.
                collection.sync_wal().await?;
            }
            let (entries, back) = tokio::task::spawn_blocking(move || {
                let read = tail.read(up_to, max_batch_bytes());
                (read, tail)
            })
            .await
            .map_err(|e| ApiError::Internal(format!("reading the log to ship: {e}")))?;
            tail = back;
            let entries = entries?;
            if entries.is_empty() {
                tokio::time::sleep(Duration::from_millis(1)).await;
                continue;
            }
            let first = entries[0].0;
            let n = entries.len() as u64;
            let payloads = entries.into_iter().map(|(_, p)| p.to_vec()).collect();
            // Test builds: a primary that holds its next batch back (it dies meanwhile in tests).
            crate::moves::pause_point("replication::hold_entries").await;
            in_flight.push_back(async move { (link.append(first, payloads, None).await, n) });
            continue;
        }
        if in_flight.is_empty() {
            // Nothing to ship: wait for a write, or look again for a join now and then.
            let changed = tokio::time::timeout(Duration::from_millis(500), wanted.changed()).await;
            match changed {
                Ok(Err(_)) => return Ok(()), // the shard's replication is gone
                Ok(Ok(())) => {}
                Err(_) => {
                    // Idle for a while with entries no write waits for (their writers gave
                    // up): make them durable so that they are shipped.
                    if collection.last_seq_no() >= tail.next_seq()
                        && tail.durable_seq() < tail.next_seq()
                    {
                        collection.sync_wal().await?;
                    }
                    if node.state().registered_at.get(replica).copied() != registered {
                        return Err(ApiError::Unavailable(format!(
                            "replica {replica} registered again: probing it"
                        )));
                    }
                    // A copy out of the in-sync set on an idle shard is probed now and then:
                    // one back on a wiped disk is seeded without waiting for a write (no call
                    // would otherwise reach it).
                    if worth_probing(node, shard, epoch, replica) {
                        let probe = link.append(0, Vec::new(), None).await?;
                        link.seed_if_needed(&probe).await?;
                    }
                }
            }
            try_join(node, shard, epoch, replica, acked).await;
            continue;
        }
        // The oldest call's answer, or (room in the pipeline) a new write to send meanwhile.
        let answered = tokio::select! {
            answered = in_flight.next() => answered,
            changed = wanted.changed(), if in_flight.len() < PIPELINE_DEPTH => {
                if changed.is_err() {
                    return Ok(());
                }
                None
            }
        };
        let Some((answer, n)) = answered else {
            continue;
        };
        let answer = answer?;
        if answer.needs_seed || answer.seeding {
            // The replica lost its copy meanwhile (a restart on another disk): probe again.
            return Err(ApiError::Unavailable(format!(
                "replica {replica} has no copy to append to any more"
            )));
        }
        // Answers come in the order the calls were sent, but a later call's sync may have
        // finished first: the acknowledged position only grows, for one data directory.
        acked.send_modify(|acked| {
            if acked.incarnation == answer.incarnation {
                acked.seq = acked.seq.max(answer.durable_seq);
            } else {
                *acked = Acked {
                    seq: answer.durable_seq,
                    incarnation: answer.incarnation,
                };
            }
        });
        // Under steady writes the follower is never idle: try a join (which holds writes back
        // while the last entries go over) once close behind, at most once a second.
        if last_join_try.elapsed() >= JOIN_TRY_EVERY {
            last_join_try = Instant::now();
            try_join(node, shard, epoch, replica, acked).await;
        }
        since_release += n;
        if since_release >= RELEASE_EVERY_ENTRIES {
            tail.release_read();
            since_release = 0;
        }
        // A replica that answers but falls ever further behind (a slower disk; out of the
        // in-sync set, so writes do not wait for it) would hold this primary's log from its
        // position for good: past the bound it is seeded from a snapshot instead, and the
        // hold goes with the tail.
        let acked_seq = acked.borrow().seq;
        if let Some(behind) = too_far_behind(link, collection, acked_seq) {
            tracing::warn!(shard = %shard.local_name(), %replica, behind_bytes = behind,
                bound = away_wal_bytes(),
                "a connected replica fell further behind than the log kept for one: \
                 seeding it from a snapshot");
            drop(tail);
            drop(in_flight);
            *gave_up_log = true;
            link.seed().await?;
            return Err(ApiError::Unavailable(format!(
                "replica {replica} fell {behind} bytes of log behind: it is seeded from a snapshot"
            )));
        }
    }
}

/// The bytes of log (estimated from the average entry size) that `replica`, out of the
/// in-sync set, lacks past `acked`, if more than the log kept for one
/// ([`away_wal_bytes`]). An in-sync replica is never too far behind: writes wait for it.
fn too_far_behind(link: &Link<'_>, collection: &Collection, acked: u64) -> Option<u64> {
    let behind_entries = collection.last_seq_no().saturating_sub(acked);
    if behind_entries == 0 {
        return None;
    }
    let in_sync = replication_at(link.node, link.shard, link.epoch).is_some_and(|r| {
        r.record()
            .in_sync_replicas
            .iter()
            .any(|n| n == link.replica)
    });
    if in_sync {
        return None;
    }
    let stats = collection.wal_stats();
    let per_entry = stats.n_bytes / stats.n_entries.max(1);
    let behind = behind_entries.saturating_mul(per_entry);
    (behind > away_wal_bytes()).then_some(behind)
}

/// This node's replication of `shard` at `epoch`, if it is still its primary there.
fn replication_at(
    node: &ClusterNode,
    shard: &ShardName,
    epoch: u64,
) -> Option<Arc<ShardReplication>> {
    node.replication
        .get(&shard.local_name())
        .map(|r| Arc::clone(r.value()))
        .filter(|r| r.epoch == epoch)
}

/// Whether an idle follower should probe `replica`: its copy is out of the in-sync set
/// (catching up) as this primary knows the record, or this node's view shows it registered
/// from another data directory than the one recorded for its copy (back on a wiped disk:
/// nothing else would reach it while no write comes).
fn worth_probing(node: &ClusterNode, shard: &ShardName, epoch: u64, replica: &str) -> bool {
    replication_at(node, shard, epoch).is_some_and(|r| {
        let record = r.record().clone();
        record.role_of(replica) == Some(tarn_cluster::CopyRole::CatchingUp)
            || node.state().copy_replaced(&record, replica)
    })
}

/// Starts a join of `replica` to the in-sync set if it is catching up and has everything, in a
/// task of its own (the follower goes on shipping meanwhile: the join waits for it).
async fn try_join(
    node: &Arc<ClusterNode>,
    shard: &ShardName,
    epoch: u64,
    replica: &str,
    acked: &watch::Sender<Acked>,
) {
    let Some(replication) = replication_at(node, shard, epoch) else {
        return;
    };
    if replication.record().role_of(replica) != Some(tarn_cluster::CopyRole::CatchingUp) {
        return;
    }
    if replication
        .collection
        .last_seq_no()
        .saturating_sub(acked.borrow().seq)
        > JOIN_LAG_ENTRIES
    {
        return;
    }
    if replication
        .join_backoff
        .get(replica)
        .is_some_and(|b| Instant::now() < b.0)
    {
        return;
    }
    if replication
        .joining
        .swap(true, std::sync::atomic::Ordering::AcqRel)
    {
        return;
    }
    let receiver = acked.subscribe();
    let (node, replica, local) = (Arc::clone(node), replica.to_owned(), shard.local_name());
    tokio::spawn(async move {
        let joined = match replication.join_in_sync(&node, &replica, &receiver).await {
            Ok(joined) => joined,
            Err(error) => {
                tracing::warn!(shard = %local, %replica, %error, "a replica could not join the in-sync set");
                false
            }
        };
        if joined {
            replication.join_backoff.remove(&replica);
        } else {
            let wait = replication
                .join_backoff
                .get(&replica)
                .map_or(JOIN_TRY_EVERY, |b| (b.1 * 2).min(JOIN_BACKOFF_MAX));
            tracing::debug!(shard = %local, %replica, ?wait, "a join did not happen; the next waits");
            replication
                .join_backoff
                .insert(replica, (Instant::now() + wait, wait));
        }
        replication
            .joining
            .store(false, std::sync::atomic::Ordering::Release);
    });
}

/// A follower's link to one replica.
struct Link<'a> {
    node: &'a Arc<ClusterNode>,
    shard: &'a ShardName,
    epoch: u64,
    history: &'a [pb::EpochStart],
    replica: &'a str,
}

impl Link<'_> {
    /// One `AppendEntries` call, bounded by [`IN_SYNC_BOUND`]: entries from `first_seq`, or
    /// (none) a probe, which first cuts the replica's log after `cut_after` when given.
    async fn append(
        &self,
        first_seq: u64,
        entries: Vec<Vec<u8>>,
        cut_after: Option<u64>,
    ) -> Result<pb::AppendEntriesResponse, ApiError> {
        append(self, first_seq, entries, cut_after, false).await
    }

    /// Asks the replica to copy this primary's snapshot and tail (`seed`), after taking it out
    /// of the in-sync set (a copy being replaced is never in sync, so a promotion never picks a
    /// node whose copy is gone).
    async fn seed(&self) -> Result<(), ApiError> {
        if let Some(replication) = replication_at(self.node, self.shard, self.epoch) {
            replication
                .leave_in_sync(self.node, self.replica, "to be seeded")
                .await?;
        }
        tracing::warn!(shard = %self.shard.local_name(), replica = %self.replica,
            "the replica cannot follow by log: seeding it from a snapshot");
        append(self, 0, Vec::new(), None, true).await.map(|_| ())
    }

    /// Fails (to be retried after a pause) while the replica is being seeded, after asking for
    /// a seed if the probe says one is needed.
    async fn seed_if_needed(&self, probe: &pb::AppendEntriesResponse) -> Result<(), ApiError> {
        if probe.needs_seed {
            self.seed().await?;
        }
        if probe.needs_seed || probe.seeding {
            return Err(ApiError::Unavailable(format!(
                "replica {} is copying this primary's data",
                self.replica
            )));
        }
        Ok(())
    }
}

async fn append(
    link: &Link<'_>,
    first_seq: u64,
    entries: Vec<Vec<u8>>,
    cut_after: Option<u64>,
    seed: bool,
) -> Result<pb::AppendEntriesResponse, ApiError> {
    let (node, shard, epoch, replica) = (link.node, link.shard, link.epoch, link.replica);
    let channel = node.peer(replica).await?;
    let mut client = pb::node_client::NodeClient::new(channel)
        .max_decoding_message_size(crate::cluster::MAX_NODE_MESSAGE_BYTES)
        .max_encoding_message_size(crate::cluster::MAX_NODE_MESSAGE_BYTES);
    let request = pb::AppendEntriesRequest {
        shard: Some(pb::ShardRef {
            collection: shard.collection.clone(),
            uid: shard.uid,
            shard: shard.shard,
            epoch,
            role: pb::ShardRole::Replica as i32,
        }),
        first_seq,
        entries,
        sync: true,
        from_node: node.node_id.clone(),
        epochs: link.history.to_vec(),
        cut: cut_after.is_some(),
        cut_after: cut_after.unwrap_or(0),
        seed,
    };
    let started = Instant::now();
    let answer = client
        .append_entries(node.internal_request(request, IN_SYNC_BOUND))
        .await
        .map_err(|status| {
            ApiError::Unavailable(format!(
                "replica {replica} of shard {} did not take entries ({:?}): {}",
                shard.local_name(),
                started.elapsed(),
                status.message()
            ))
        })?;
    Ok(answer.into_inner())
}

/// The replica's side of `AppendEntries`: appends the primary's entries to this node's copy at
/// the same sequence numbers. Served only when this node's view gives the shard, at exactly
/// the request's epoch, to the sender as primary and to this node as a replica; a local copy is
/// created empty only where the map says this data directory starts it empty. Every answer
/// names this data directory (its token), the one a join records for the copy.
pub async fn append_entries(
    node: &Arc<ClusterNode>,
    request: pb::AppendEntriesRequest,
) -> Result<pb::AppendEntriesResponse, ApiError> {
    let mut answer = append_entries_here(node, request).await?;
    answer.incarnation = node.incarnation.clone();
    Ok(answer)
}

async fn append_entries_here(
    node: &Arc<ClusterNode>,
    request: pb::AppendEntriesRequest,
) -> Result<pb::AppendEntriesResponse, ApiError> {
    let shard_ref = request
        .shard
        .ok_or_else(|| ApiError::invalid("shard", "missing"))?;
    crate::registry::validate_name(&shard_ref.collection)?;
    let shard = ShardName {
        collection: shard_ref.collection.clone(),
        uid: shard_ref.uid,
        shard: shard_ref.shard,
    };
    let epoch = shard_ref.epoch;
    if node
        .state()
        .assignment(&shard)
        .is_none_or(|a| a.epoch < epoch)
    {
        // The primary's view may be a moment ahead of this node's.
        node.wait_for_view(Duration::from_millis(500), |s| {
            s.assignment(&shard).is_some_and(|a| a.epoch >= epoch)
        })
        .await;
    }
    let assignment = node
        .state()
        .assignment(&shard)
        .cloned()
        .ok_or_else(|| ApiError::NotFound(shard.collection.clone()))?;
    if assignment.epoch != epoch || assignment.owner != request.from_node {
        return Err(ApiError::StaleShardMap(format!(
            "shard {} of collection '{}' has primary {} at epoch {} here, not {} at epoch \
             {epoch}",
            shard.shard, shard.collection, assignment.owner, assignment.epoch, request.from_node
        )));
    }
    if !matches!(
        assignment.role_of(&node.node_id),
        Some(tarn_cluster::CopyRole::InSyncReplica | tarn_cluster::CopyRole::CatchingUp)
    ) {
        return Err(ApiError::StaleShardMap(format!(
            "node {} is not a replica of shard {} of collection '{}' at epoch {epoch}",
            node.node_id, shard.shard, shard.collection
        )));
    }
    let primary_history = from_wire(&request.epochs)?;
    let local = shard.local_name();
    if assignment.epoch < node.ledger.held_epoch(&local) {
        // A record older than this copy's (etcd restored from an older backup): nothing is
        // cut or appended on its word; reconciliation sets the copy aside.
        return Err(ApiError::StaleShardMap(format!(
            "shard {} of collection '{}': the record's epoch {} is older than the epoch this \
             replica held it at",
            shard.shard, shard.collection, assignment.epoch
        )));
    }
    if node.incoming.contains_key(&local) {
        return Ok(pb::AppendEntriesResponse {
            seeding: true,
            ..Default::default()
        });
    }
    if request.seed {
        crate::moves::start_seed(node, shard, request.from_node, epoch);
        return Ok(pb::AppendEntriesResponse {
            seeding: true,
            ..Default::default()
        });
    }
    let needs_seed = || pb::AppendEntriesResponse {
        needs_seed: true,
        ..Default::default()
    };
    let lock = node.copy_lock(&local);
    let mut copy = lock.lock().await;
    if request.first_seq > 1 && !request.entries.is_empty() {
        // A batch sent while earlier ones were in flight may get here first: it waits for them
        // (bounded), so batches are applied in the order they were sent.
        let until = tokio::time::Instant::now() + REORDER_WAIT;
        while node
            .registry
            .get_shard(&local)
            .is_ok_and(|c| c.last_seq_no() + 1 < request.first_seq)
            && tokio::time::Instant::now() < until
        {
            drop(copy);
            tokio::time::sleep(Duration::from_micros(200)).await;
            copy = lock.lock().await;
        }
    }
    // The view again, under the copy's lock and after any wait: a new primary's probe may have
    // been served meanwhile (its promotion seen), and nothing of an older epoch's primary is
    // taken after that.
    if node
        .state()
        .assignment(&shard)
        .is_none_or(|now| now.epoch != epoch || now.owner != request.from_node)
    {
        return Err(ApiError::StaleShardMap(format!(
            "shard {} of collection '{}' changed primary while this call waited",
            shard.shard, shard.collection
        )));
    }
    if node.registry.get_shard(&local).is_err()
        && !node.replica_starts_empty_here(&local, &assignment)
    {
        return Ok(needs_seed());
    }
    let mut collection = node.replica_copy(&shard, &assignment).await?;
    let mut cut_entries = 0;
    if request.cut && request.cut_after < collection.last_seq_no() {
        match node.registry.cut_shard_log(&local, request.cut_after).await {
            Ok(cut) => (collection, cut_entries) = cut,
            Err(error) => {
                tracing::warn!(shard = %local, %error, "this replica needs a fresh copy of the primary's data");
                return Ok(needs_seed());
            }
        }
    }
    let last = collection.last_seq_no();
    if request.entries.is_empty() {
        let history = {
            let collection = collection.clone();
            tokio::task::spawn_blocking(move || collection.epoch_starts())
                .await
                .map_err(|e| ApiError::Internal(e.to_string()))??
        };
        return Ok(pb::AppendEntriesResponse {
            last_seq: last,
            durable_seq: collection.sync_wal().await?,
            epochs: to_wire(&history),
            cut_entries,
            ..Default::default()
        });
    }
    if request.first_seq == 0 || request.first_seq > last + 1 {
        return Err(ApiError::Unsupported(format!(
            "entries from {} do not continue this replica's log, which ends at {last}",
            request.first_seq
        )));
    }
    // Entries this copy already has (sent again after a lost answer) are skipped, but only if
    // they are the same ones: written at the epoch the primary's history gives each position
    // (one primary per epoch). Entries of another epoch at those positions (a deposed
    // primary's) refuse the batch: the primary probes again, and the copy is cut back.
    let skip = (last + 1 - request.first_seq) as usize;
    if skip > 0 {
        let starts = {
            let collection = collection.clone();
            tokio::task::spawn_blocking(move || collection.epoch_starts())
                .await
                .map_err(|e| ApiError::Internal(e.to_string()))??
        };
        let own = EpochHistory::from_starts(starts).map_err(ApiError::Internal)?;
        let differs = (request.first_seq..=last).find(|seq| {
            matches!(
                (own.epoch_of(*seq), primary_history.epoch_of(*seq)),
                (Some(mine), Some(primary)) if mine != primary
            )
        });
        if let Some(seq) = differs {
            return Err(ApiError::Unsupported(format!(
                "this replica's entry {seq} is of epoch {:?}, the primary's of epoch {:?}: the \
                 copies differ there; probe again",
                own.epoch_of(seq),
                primary_history.epoch_of(seq)
            )));
        }
    }
    let entries: Vec<(u64, Arc<[u8]>)> = request
        .entries
        .into_iter()
        .enumerate()
        .skip(skip)
        .map(|(i, payload)| (request.first_seq + i as u64, Arc::from(payload)))
        .collect();
    if let Some((first, end)) = entries.first().zip(entries.last()).map(|(f, l)| (f.0, l.0)) {
        record_epochs(&collection, &primary_history, first, end).await?;
        collection
            .append_copied(entries, tarn_wal::Durability::Written)
            .await?;
    }
    let last_seq = collection.last_seq_no();
    // Synced outside the copy's lock: the next batch is appended meanwhile, and the WAL's
    // write group makes one sync of both when they meet.
    drop(copy);
    let durable = collection.sync_wal().await?;
    // Test builds: a replica slow to answer (a slow disk), which keeps it close behind but
    // never quick enough to join.
    crate::moves::pause_point("replication::answer_delay").await;
    Ok(pb::AppendEntriesResponse {
        last_seq,
        durable_seq: durable,
        cut_entries,
        ..Default::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A batch is recorded only if the entry before it is of the epoch the primary's history
    /// gives it: a copy whose last entries a deposed primary wrote refuses the new primary's
    /// next batch (the primary then probes and cuts), and takes it once they match.
    #[test]
    fn a_batch_must_continue_the_entry_before_it_at_the_primary_s_epoch() {
        let dir = tempfile::tempdir().unwrap();
        let config = tarn_collection::CollectionConfig::new(4, tarn_collection::MetricName::L2);
        let copy = Collection::create(&dir.path().join("c"), config).unwrap();
        copy.set_epoch_starts(vec![(1, 1)]).unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        // The copy holds 1..=100 at epoch 1; the primary's entries from 90 on are of epoch 2.
        let primary = EpochHistory::from_starts(vec![(1, 1), (2, 90)]).unwrap();
        let refused = rt
            .block_on(record_epochs(&copy, &primary, 101, 103))
            .unwrap_err();
        assert!(
            refused.to_string().contains("entry 100 is of epoch 1"),
            "{refused}"
        );
        assert_eq!(copy.epoch_starts().unwrap(), [(1, 1)]);
        // The primary's epoch 2 starting at 101: the batch continues the same log.
        let primary = EpochHistory::from_starts(vec![(1, 1), (2, 101)]).unwrap();
        rt.block_on(record_epochs(&copy, &primary, 101, 103))
            .unwrap();
        copy.close();
    }
}
