//! Where a shard's call is served: this node's copy, checked against its view of the map (the
//! owner's for a write, with the shard's write gate held: [`ClusterNode::local_shard_for_write`];
//! a replica's copy under the write checks: [`ClusterNode::local_copy`]), or another node's
//! through the `Node` service ([`ClusterNode::target`], [`ClusterNode::read_target`]).

use std::sync::Arc;
use std::time::Duration;

use tarn_cluster::{ClusterState, CollectionMap, ShardAssignment, ShardName};
use tarn_collection::{Collection, CollectionConfig};
use tarn_proto::v1 as pb;

use super::{unreadable, ClusterNode, ShardWrite, Target, MAX_NODE_MESSAGE_BYTES, NOT_FOUND_GRACE};
use crate::registry::Registry;
use crate::status::ApiError;

impl ClusterNode {
    /// The local collection behind a shard address for a write, with the shard's write gate
    /// held (shared) until the write is acknowledged: served only if this node owns the shard
    /// at exactly `epoch` and the shard is not fenced. The gate is taken before the check, so
    /// a hand-over that drains the gate after seeing the fence waits for every write that
    /// passed the check.
    pub(crate) async fn local_shard_for_write(
        self: &Arc<Self>,
        shard: &ShardName,
        epoch: u64,
    ) -> Result<ShardWrite, ApiError> {
        self.writable()?;
        // A new epoch's replication starts with the gate held exclusively (no write of an
        // earlier epoch lands inside it), so before this write takes the gate shared.
        let state = self.state();
        if let (Some(map), Some(a)) = (state.collection_of(shard), state.assignment(shard)) {
            if a.takes_writes()
                && a.epoch == epoch
                && a.owner == self.node_id
                && !a.one_copy(map.def.min_in_sync)
                && !self.replicating(shard, epoch)
            {
                let collection = self.local_shard(&self.registry, shard, epoch).await?;
                self.begin_replication(shard, a, map.def.min_in_sync, &collection)
                    .await?;
            }
        }
        let guard = self.gate(&shard.local_name()).read_owned().await;
        let collection = self.local_shard(&self.registry, shard, epoch).await?;
        let state = self.state();
        let map = state.collection_of(shard);
        let assignment = state.assignment(shard);
        match (map, assignment) {
            (Some(map), Some(a))
                if a.takes_writes() && a.epoch == epoch && a.owner == self.node_id =>
            {
                let replication = self
                    .replication_for_write(shard, a, map.def.min_in_sync, &collection)
                    .await?;
                // Test builds: a write held between its epoch check and its append (a process
                // stopped there, a slow scheduler).
                crate::faults::pause_point("write::checked").await;
                Ok(ShardWrite {
                    collection,
                    _gate: guard,
                    replication,
                })
            }
            (_, Some(a)) => Err(ApiError::StaleShardMap(format!(
                "shard {} of collection '{}' is being handed over to node {} (epoch {}): \
                 refresh the shard map and retry",
                shard.shard,
                shard.collection,
                a.moving_to.as_deref().unwrap_or(&a.owner),
                a.epoch
            ))),
            _ => Err(ApiError::NotFound(shard.collection.clone())),
        }
    }

    /// This node's copy of a shard it is a replica of (per `assignment`): the local one, or a
    /// new empty one where the map says this data directory starts it empty (a new
    /// collection's replicas). The caller holds the copy's lock.
    pub(crate) async fn replica_copy(
        &self,
        shard: &ShardName,
        assignment: &ShardAssignment,
    ) -> Result<Collection, ApiError> {
        let local = shard.local_name();
        if let Ok(collection) = self.registry.get_shard(&local) {
            return Ok(collection);
        }
        if !self.replica_starts_empty_here(&local, assignment) {
            return Err(ApiError::ShardUnavailable {
                collection: shard.collection.clone(),
                shard: shard.shard,
                node: self.node_id.clone(),
                why: "this replica holds no copy of it yet (it needs a copy of the primary's \
                      data)"
                    .to_owned(),
            });
        }
        let state = self.state();
        let def = &state
            .collection_of(shard)
            .ok_or_else(|| ApiError::NotFound(shard.collection.clone()))?
            .def;
        let config =
            serde_json::from_value::<CollectionConfig>(def.config.clone()).map_err(|e| {
                ApiError::Internal(format!("collection '{}' has a bad config: {e}", def.name))
            })?;
        self.registry.create_shard(&local, config).await
    }

    /// Whether this data directory may start its replica copy of `local` empty: the record
    /// lists it among the directories a new collection's replicas start on, and no copy of the
    /// shard was ever deleted here (an older record, from an etcd restored from a backup, may
    /// still list it).
    pub(crate) fn replica_starts_empty_here(
        &self,
        local: &str,
        assignment: &ShardAssignment,
    ) -> bool {
        assignment.create_replicas_on.contains(&self.incarnation)
            && self.ledger.may_start_empty(local, assignment.epoch)
    }

    /// The local collection behind a shard address, if this node owns the shard at `epoch`.
    pub async fn local_shard(
        &self,
        registry: &Registry,
        shard: &ShardName,
        epoch: u64,
    ) -> Result<Collection, ApiError> {
        let known = |s: &ClusterState| s.collection_of(shard).is_some();
        if !known(&self.state()) {
            // The router's view may be a moment ahead of this node's.
            self.wait_for_with(NOT_FOUND_GRACE, known).await;
        }
        let state = self.state();
        if let Some(why) = state.unreadable.get(&shard.collection) {
            return Err(unreadable(&shard.collection, why));
        }
        let map = state
            .collection_of(shard)
            .ok_or_else(|| ApiError::NotFound(shard.collection.clone()))?;
        let assignment = map
            .shards
            .get(shard.shard as usize)
            .ok_or_else(|| ApiError::invalid("collection", format!("no shard {}", shard.shard)))?;
        if assignment.epoch < self.ledger.held_epoch(&shard.local_name()) {
            return Err(ApiError::ShardUnavailable {
                collection: shard.collection.clone(),
                shard: shard.shard,
                node: self.node_id.clone(),
                why: format!(
                    "its record (epoch {}) is older than the epoch this node held it at (etcd \
                     restored from an older backup?): this copy is set aside, not served",
                    assignment.epoch
                ),
            });
        }
        if assignment.owner != self.node_id || assignment.epoch != epoch {
            // A shard moved off this node: its router may still think it is here.
            return Err(ApiError::StaleShardMap(format!(
                "shard {} of collection '{}' is on node {} at epoch {}, not on node {} at \
                 epoch {epoch}: refresh the shard map and retry",
                shard.shard, shard.collection, assignment.owner, assignment.epoch, self.node_id
            )));
        }
        let local = shard.local_name();
        if let Ok(collection) = registry.get_shard(&local) {
            return Ok(collection);
        }
        // Created only where the map says this data directory starts it empty: a lookup never
        // invents a shard whose data is elsewhere (or lost). A replica promoted before its copy
        // was ever created (the primary of a new collection died at once) starts it empty too:
        // its directory is one the shard's replicas start empty on, and no copy of the shard
        // was set aside here (a copy replaced by a seed leaves the in-sync set first, so a
        // promoted copy was never replaced).
        // Never where a copy of the shard was deleted before (a record from an etcd restored
        // from an older backup may still name this directory).
        let starts_empty_here = self.ledger.may_start_empty(&local, assignment.epoch)
            && (assignment.create_on.as_deref() == Some(self.incarnation.as_str())
                || (assignment.create_replicas_on.contains(&self.incarnation)
                    && !registry.has_set_aside(&local)));
        if !starts_empty_here {
            return Err(ApiError::ShardUnavailable {
                collection: shard.collection.clone(),
                shard: shard.shard,
                node: self.node_id.clone(),
                why: "this node holds no copy of it (its data directory is not the one the \
                      shard was created or copied on); bring that directory back, or give the \
                      shard up with `tarn cluster forget`"
                    .to_owned(),
            });
        }
        let def = &map.def;
        let config =
            serde_json::from_value::<CollectionConfig>(def.config.clone()).map_err(|e| {
                ApiError::Internal(format!("collection '{}' has a bad config: {e}", def.name))
            })?;
        let lock = self.copy_lock(&local);
        let _copy = lock.lock().await;
        registry.create_shard(&local, config).await
    }

    /// The local copy a read of a shard address names: the owner's ([`Self::local_shard`]), or
    /// this node's copy when it is an in-sync replica of the shard at exactly `epoch`, on the
    /// data directory recorded for its copy (routers
    /// spread searches and gets over the in-sync copies; a read token's positions are in the
    /// same log on every copy, and the read waits until this copy has applied them).
    pub async fn local_copy(
        &self,
        registry: &Registry,
        shard: &ShardName,
        epoch: u64,
    ) -> Result<Collection, ApiError> {
        // A copy of a replicated shard answers reads only while this node is surely in the
        // cluster (its lease alive, its view current): cut off from etcd it cannot know that
        // it was deposed or dropped from the in-sync set, and newer copies serve elsewhere. A
        // shard's only copy goes on serving from the last map (nothing newer exists).
        let replicated = self
            .state()
            .assignment(shard)
            .is_some_and(|a| !a.replicas.is_empty());
        if replicated {
            self.writable().map_err(|why| {
                ApiError::Unavailable(format!(
                    "shard {} of collection '{}': this copy may be behind ({why}); read from \
                     another copy",
                    shard.shard, shard.collection
                ))
            })?;
        }
        match self.local_shard(registry, shard, epoch).await {
            Err(ApiError::StaleShardMap(why)) => {
                let in_sync_here = self.state().assignment(shard).is_some_and(|a| {
                    a.epoch == epoch
                        && a.role_of(&self.node_id) == Some(tarn_cluster::CopyRole::InSyncReplica)
                        && !a.copy_replaced(&self.node_id, &self.incarnation)
                });
                let incoming = self.incoming.contains_key(&shard.local_name());
                match registry.get_shard(&shard.local_name()) {
                    Ok(copy) if in_sync_here && !incoming => Ok(copy),
                    // Listed in sync here, but no copy is open (not created yet by the
                    // primary's first call, reopened after a cut of its log, or set aside:
                    // its record is older than the epoch it was held at, after an etcd
                    // restored from a backup): the router reads another copy instead of
                    // retrying this one on a map that need not change.
                    Err(_) if in_sync_here && !incoming => Err(ApiError::ShardUnavailable {
                        collection: shard.collection.clone(),
                        shard: shard.shard,
                        node: self.node_id.clone(),
                        why: "this node holds no open copy of it now (not created yet, being \
                              reopened, or set aside: `tarn cluster set-aside list`); read \
                              another copy"
                            .to_owned(),
                    }),
                    _ => Err(ApiError::StaleShardMap(why)),
                }
            }
            other => other,
        }
    }

    /// Where a read of `shard` that any in-sync copy may answer (a search, a get) goes: this
    /// node first when it holds an in-sync copy (no hop), else the alive in-sync copies (each
    /// on the data directory recorded for it: a node back on a wiped disk holds none) from
    /// the `spread`-th on (callers pass a rotating number, plus one per failed try, so reads
    /// spread over the copies and a retry takes the next one). Also how many copies there are
    /// to try. The owner alone when it is the only one.
    pub(crate) async fn read_target(
        &self,
        map: &CollectionMap,
        shard: u32,
        (spread, attempt): (usize, usize),
    ) -> (Result<Target, ApiError>, usize, String) {
        let assignment = &map.shards[shard as usize];
        let state = self.state();
        let copies: Vec<&str> = assignment
            .in_sync()
            .filter(|n| {
                if *n == self.node_id {
                    !assignment.copy_replaced(n, &self.incarnation)
                } else {
                    state.holds_in_sync_copy(assignment, n)
                }
            })
            .collect();
        if copies.len() <= 1 || !assignment.takes_writes() {
            return (self.target(map, shard).await, 1, assignment.owner.clone());
        }
        let first = copies
            .iter()
            .position(|n| *n == self.node_id)
            .unwrap_or(spread);
        let pick = copies[(first + attempt) % copies.len()];
        let role = if pick == assignment.owner {
            pb::ShardRole::Owner
        } else {
            pb::ShardRole::Replica
        };
        (
            self.target_on(map, shard, pick, role).await,
            copies.len(),
            pick.to_owned(),
        )
    }

    /// Where a call for `shard` of `map` goes: here, or to its live owner (over the `Node`
    /// service, naming the shard at the epoch this node's map gives it).
    pub(crate) async fn target(&self, map: &CollectionMap, shard: u32) -> Result<Target, ApiError> {
        let owner = &map.shards[shard as usize].owner;
        self.target_on(map, shard, owner, pb::ShardRole::Owner)
            .await
    }

    /// A call for `shard` of `map` on the copy of `node` (this node's, or a peer's over the
    /// `Node` service, naming the shard at the epoch this node's map gives it and the copy's
    /// `role`).
    async fn target_on(
        &self,
        map: &CollectionMap,
        shard: u32,
        node: &str,
        role: pb::ShardRole,
    ) -> Result<Target, ApiError> {
        let epoch = map.shards[shard as usize].epoch;
        if node == self.node_id {
            let name = ShardName {
                collection: map.def.name.clone(),
                uid: map.def.uid,
                shard,
            }
            .address(epoch);
            return Ok(Target::Local(name));
        }
        let channel = self.peer(node).await.map_err(|e| {
            let why = match e {
                ApiError::Unavailable(why) => why,
                other => other.to_string(),
            };
            ApiError::ShardUnavailable {
                collection: map.def.name.clone(),
                shard,
                node: node.to_owned(),
                why,
            }
        })?;
        let client = pb::node_client::NodeClient::new(channel)
            .max_decoding_message_size(MAX_NODE_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_NODE_MESSAGE_BYTES);
        let shard_ref = pb::ShardRef {
            collection: map.def.name.clone(),
            uid: map.def.uid,
            shard,
            epoch,
            role: role as i32,
        };
        Ok(Target::Remote(client, shard_ref))
    }

    /// A request to another node for a client's call: the node credential, the client's own
    /// API key (the owner checks the caller's rights too), and the deadline.
    pub(crate) fn node_request<T>(
        &self,
        message: T,
        api_key: Option<&str>,
        timeout: Duration,
    ) -> tonic::Request<T> {
        let mut request = self.internal_request(message, timeout);
        if let Some(value) = api_key.and_then(|k| format!("Bearer {k}").parse().ok()) {
            request.metadata_mut().insert("authorization", value);
        }
        request
    }
}
