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
//! gate while holding `changing`. A copy's lock comes after the gate too: a replica's
//! `AppendEntries` takes the gate exclusively and then the copy's lock (a write this node took as
//! the shard's primary at an earlier epoch lands before the new primary's entries, never among
//! them), and a new epoch's replication starts with the gate held exclusively
//! ([`ClusterNode::begin_replication`]); both wait at most [`EPOCH_DRAIN_LIMIT`].
//!
//! Files: the state's definition is `replica_state.rs` (beside this directory, below
//! `cluster/`, which keeps the node's map of them); this one holds a shard's
//! [`ShardReplication`]'s behaviour (the in-sync set and its
//! transitions: a write's wait, leaving, joining, stepping down); `lifecycle.rs` the node's
//! side (starting a shard's replication at a new epoch, finding it for a write, stopping it,
//! stepping down from all at a shutdown, the figures for metrics); `ship.rs` the primary's
//! followers (one per replica: probe, cut, ship, seed, try a join); `append.rs` the replica's
//! side of `AppendEntries`; `epochs.rs` the copies' epoch histories (beginning an epoch,
//! recording a batch's epochs, the wire form).

mod append;
mod lifecycle;
mod ship;

use std::sync::Arc;
use std::time::Duration;

use dashmap::DashMap;
use std::sync::Mutex as StdMutex;
use tarn_cluster::{ShardAssignment, ShardName, ShardRecord, ShardSwap};
use tarn_collection::Collection;
use tokio::sync::watch;

use crate::cluster::ClusterNode;
use crate::status::ApiError;

pub(crate) use crate::replica_state::{Acked, ShardReplication};
pub use append::append_entries;
pub use lifecycle::ReplicaFigures;
use ship::{follow, Follower};

/// How long a write waits for an in-sync replica before removing it from the in-sync set (and
/// how long a follower waits for one answer).
pub(crate) const IN_SYNC_BOUND: Duration = Duration::from_secs(2);
/// How long a join holds the shard's writes back at most while the replica takes the last
/// entries; past it, the join is tried again later.
const JOIN_DRAIN_LIMIT: Duration = Duration::from_millis(500);
/// How long a new epoch's replication, or a replica's `AppendEntries`, waits at most for the
/// writes still in flight on the copy (of an earlier epoch: they fail once this node's view
/// moves on, see `ShardReplication::deposed`) before it answers UNAVAILABLE and is retried.
pub(crate) const EPOCH_DRAIN_LIMIT: Duration = Duration::from_secs(5);
/// A catching-up replica this close behind tries to join (the join then waits, writes held
/// back, for the rest: at most [`JOIN_DRAIN_LIMIT`]).
const JOIN_LAG_ENTRIES: u64 = 1_024;
/// How often a busy follower tries a join; after a failed one the wait doubles, up to
/// [`JOIN_BACKOFF_MAX`] (a replica that cannot take the last entries in time is not let hold
/// the writes back every second).
const JOIN_TRY_EVERY: Duration = Duration::from_secs(1);
const JOIN_BACKOFF_MAX: Duration = Duration::from_secs(30);

/// This node's replication of `shard` at `epoch`, if it is still its primary there.
pub(super) fn replication_at(
    node: &ClusterNode,
    shard: &ShardName,
    epoch: u64,
) -> Option<Arc<ShardReplication>> {
    node.replication
        .get(&shard.local_name())
        .map(|r| Arc::clone(r.value()))
        .filter(|r| r.epoch == epoch)
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
            if task.is_finished() {
                // A follower ends only when its replication does, or by a panic: its replica
                // gets a new one below rather than never being shipped to again.
                tracing::error!(shard = %self.shard.local_name(), replica = %n,
                    "a replica's follower task ended: starting another");
                return false;
            }
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
                commit: self.commit.subscribe(),
                acks: Arc::clone(&self.acks),
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
    /// primary's copy refuses writes for good (its WAL is poisoned) or this node is shutting
    /// down (`why` says which, for the log): the failover the
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
            tracing::warn!(%shard, %why, "handing the shard to an in-sync replica");
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
            let mut swap = ShardSwap::whole_record(&replication.shard, &record, &promoted);
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
                        "failover: this primary stepped down; an in-sync replica is the shard's primary");
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
        let mut deposed = self.deposed.subscribe();
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
                let reached = tokio::select! {
                    reached = tokio::time::timeout_at(until, acked.wait_for(has_it)) => reached,
                    _ = deposed.wait_for(|d| *d) => return Err(self.epoch_over()),
                };
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
        // Before the write is acknowledged, so that a read with its token finds it visible.
        self.advance_commit();
        let record = self.record().clone();
        record.check_in_sync(self.min_in_sync).map_err(|why| {
            ApiError::Unavailable(format!(
                "shard {} of collection '{}' did not acknowledge the write (primary {}): \
                     {why}",
                self.shard.shard, self.shard.collection, node.node_id
            ))
        })
    }

    /// Raises the commit to the highest entry durable here and acknowledged by every in-sync
    /// replica (by the directory recorded for its copy): this copy makes entries visible up to
    /// it, and the followers pass it on.
    fn advance_commit(&self) {
        let mut committed = self.collection.durable_seq_no();
        {
            let record = self.record();
            for replica in &record.in_sync_replicas {
                let acked = self.acked.get(replica).map_or(0, |acked| {
                    let acked = acked.value().borrow();
                    if record.copy_replaced(replica, &acked.incarnation) {
                        0
                    } else {
                        acked.seq
                    }
                });
                committed = committed.min(acked);
            }
        }
        let raised = self.commit.send_if_modified(|commit| {
            let more = committed > *commit;
            *commit = (*commit).max(committed);
            more
        });
        if raised {
            self.collection.raise_visible(committed);
        }
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
                _ => return Err(self.epoch_over()),
            }
        }
        Err(ApiError::Unavailable(format!(
            "shard {} of collection '{}': its record kept changing under this node's swaps",
            self.shard.shard, self.shard.collection
        )))
    }

    fn epoch_over(&self) -> ApiError {
        ApiError::StaleShardMap(format!(
            "shard {} of collection '{}' has a new primary (this node's epoch {} is over): \
             refresh the shard map and retry",
            self.shard.shard, self.shard.collection, self.epoch
        ))
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

/// How often the committer looks at a shard whose followers send no acknowledgements.
const COMMIT_CHECK_EVERY: Duration = Duration::from_secs(1);

/// A shard's committer, on its primary: advances the commit after each acknowledgement. When
/// entries stay uncommitted while no write waits for them (an in-sync replica died after the
/// last write; a primary's first entries of its epoch), it waits for them as a write would,
/// so a replica that does not take them leaves the in-sync set and reads find them.
async fn run_committer(
    replication: std::sync::Weak<ShardReplication>,
    node: std::sync::Weak<ClusterNode>,
    acks: Arc<tokio::sync::Notify>,
) {
    let mut stalled_at = None;
    loop {
        let acknowledged = tokio::time::timeout(COMMIT_CHECK_EVERY, acks.notified())
            .await
            .is_ok();
        let Some(replication) = replication.upgrade() else {
            return;
        };
        replication.advance_commit();
        if acknowledged {
            continue;
        }
        let (committed, durable) = (
            *replication.commit.borrow(),
            replication.collection.durable_seq_no(),
        );
        if committed >= durable {
            stalled_at = None;
            continue;
        }
        let Some(node) = node.upgrade() else {
            return;
        };
        // An in-sync copy back on another data directory holds nothing: it leaves the set at
        // once (a write would take it out first too), and the commit moves without it.
        if let Err(error) = replication.drop_replaced(&node).await {
            tracing::debug!(shard = %replication.shard.local_name(), %error,
                "cannot take a replaced copy out of the in-sync set");
        }
        replication.advance_commit();
        // Uncommitted for two looks in a row with no acknowledgement in between.
        if stalled_at != Some(committed) {
            stalled_at = Some(committed);
            continue;
        }
        if let Err(error) = replication.replicate(&node, durable).await {
            tracing::debug!(shard = %replication.shard.local_name(), %error,
                "entries no write waits for are not committed yet");
        }
    }
}

/// The shard's record, read linearizably from etcd.
async fn node_read_shard(node: &ClusterNode, shard: &ShardName) -> Result<ShardRecord, ApiError> {
    node.store()
        .read_shard(&shard.collection, shard.uid, shard.shard)
        .await
        .map_err(|e| ApiError::ClusterStore(e.to_string()))
}
