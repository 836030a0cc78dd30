//! The node's side of its shards' replication: starting a shard's replication at a new epoch
//! (under the shard's write gate), finding it for a write, stopping the ones this node no
//! longer leads, stepping down from all of them at a graceful shutdown, and the replicas'
//! figures for metrics.

use super::*;
use crate::epochs::begin_epoch;

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

    /// Whether this node runs the replication of `shard` at `epoch`.
    pub(crate) fn replicating(&self, shard: &ShardName, epoch: u64) -> bool {
        self.replication
            .get(&shard.local_name())
            .is_some_and(|r| r.epoch == epoch)
    }

    /// Starts the replication of `shard` at `assignment`'s epoch if it is not running, with the
    /// shard's write gate held exclusively (waiting at most [`EPOCH_DRAIN_LIMIT`]): the epoch's
    /// first sequence number is recorded once no write of an earlier epoch, and no batch of an
    /// earlier primary, is still landing in the copy. Called before a write takes the gate
    /// shared; a write that finds the replication still missing starts it under the shared
    /// gate ([`Self::replication_for_write`]).
    pub(crate) async fn begin_replication(
        self: &Arc<Self>,
        shard: &ShardName,
        assignment: &ShardAssignment,
        min_in_sync: u32,
        collection: &Collection,
    ) -> Result<(), ApiError> {
        let local = shard.local_name();
        if self.replicating(shard, assignment.epoch) || assignment.one_copy(min_in_sync) {
            return Ok(());
        }
        let gate = self.gate(&local);
        let Ok(_writes_held) = tokio::time::timeout(EPOCH_DRAIN_LIMIT, gate.write()).await else {
            return Err(ApiError::Unavailable(format!(
                "shard {} of collection '{}': writes of an earlier epoch are still in flight on \
                 node {}; retry",
                shard.shard, shard.collection, self.node_id
            )));
        };
        if !self.replicating(shard, assignment.epoch) {
            self.replication_of(shard, assignment, min_in_sync, collection)
                .await?;
        }
        Ok(())
    }

    /// At a graceful shutdown's start: hands every replicated shard this node is primary of to
    /// an in-sync replica ([`ShardReplication::step_down`]), so that the shards take writes
    /// elsewhere while this node finishes its requests in flight and closes, instead of
    /// refusing them until its lease lapses. Waits at most `limit` for this node's view to
    /// show every hand-over (a shard with no in-sync replica alive stays, and is unavailable
    /// once the node is gone, as before).
    pub async fn step_down_all(self: &Arc<Self>, limit: Duration) {
        let led: Vec<Arc<ShardReplication>> = self
            .replication
            .iter()
            .map(|r| Arc::clone(r.value()))
            .collect();
        if led.is_empty() {
            return;
        }
        tracing::info!(
            shards = led.len(),
            "shutting down: handing this node's primaries to in-sync replicas"
        );
        for replication in &led {
            replication.step_down(self, "this node is shutting down".to_owned());
        }
        let node_id = self.node_id.clone();
        let handed = |s: &tarn_cluster::ClusterState| {
            led.iter().all(|r| {
                s.assignment(&r.shard)
                    .is_none_or(|a| a.owner != node_id || a.epoch != r.epoch)
            })
        };
        self.wait_for_view(limit, handed).await;
    }

    /// Starts the replication of every shard this node is primary of that has replicas, so a
    /// returning or promoted-over copy is probed, cut back if it must be, and caught up without
    /// waiting for the next write (a new primary records its epoch here too).
    pub(crate) async fn start_replications(self: &Arc<Self>, state: &tarn_cluster::ClusterState) {
        for (shard, assignment, map) in state.shards_led_by(&self.node_id) {
            if assignment.replicas.is_empty() {
                // One copy: what it logs is committed once durable here.
                if let Ok(collection) = self.registry.get_shard(&shard.local_name()) {
                    collection.release_uncommitted();
                }
                continue;
            }
            if !assignment.takes_writes() {
                continue;
            }
            let local = shard.local_name();
            let existing = replication_at(self, &shard, assignment.epoch);
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
                .begin_replication(&shard, assignment, map.def.min_in_sync, &collection)
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
        let existing = replication_at(self, shard, assignment.epoch);
        let mut start_hold = None;
        let replication = match existing {
            Some(r) => r,
            None if assignment.one_copy(min_in_sync) => {
                // One copy: every entry it logs is committed once durable here.
                collection.release_uncommitted();
                return Ok(None);
            }
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
                // A copy that kept no bound (it had no replicas: all it holds was acknowledged
                // by itself alone) starts held at its last entry.
                collection.hold_uncommitted(collection.last_seq_no());
                let committed = collection
                    .visible_seq()
                    .unwrap_or_else(|| collection.last_seq_no());
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
                    commit: watch::channel(committed).0,
                    acks: Arc::new(tokio::sync::Notify::new()),
                    committer: StdMutex::new(None),
                    followers: StdMutex::new(Vec::new()),
                    changing: tokio::sync::Mutex::new(()),
                    join_backoff: DashMap::new(),
                    joining: std::sync::atomic::AtomicBool::new(false),
                    stepping_down: std::sync::atomic::AtomicBool::new(false),
                    deposed: watch::channel(false).0,
                });
                let committer = tokio::spawn(run_committer(
                    Arc::downgrade(&r),
                    Arc::downgrade(self),
                    Arc::clone(&r.acks),
                ));
                *r.committer.lock().unwrap_or_else(|p| p.into_inner()) = Some(committer);
                // Another write may have started it meanwhile: one replication per epoch.
                let entry = self
                    .replication
                    .entry(local)
                    .or_insert_with(|| Arc::clone(&r));
                if entry.epoch == assignment.epoch {
                    Arc::clone(entry.value())
                } else {
                    drop(entry);
                    if let Some(before) =
                        self.replication.insert(shard.local_name(), Arc::clone(&r))
                    {
                        if before.epoch < r.epoch {
                            before.deposed.send_replace(true);
                        }
                    }
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
            let keep = state.assignment(&r.shard).is_some_and(|a| {
                a.epoch < r.epoch || (a.owner == self.node_id && a.epoch == r.epoch)
            });
            if !keep {
                r.deposed.send_replace(true);
            }
            keep
        });
    }
}
