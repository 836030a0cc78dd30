//! Collections in cluster mode: creating one (its shards placed on the live nodes) and dropping
//! one, in etcd, and forgetting a dead node ([`ClusterNode::forget`]: its shards given up or
//! kept on their other copies).

use std::collections::BTreeMap;

use tarn_cluster::{
    initial_placement, CollectionDef, CollectionMap, NodeInfo, ShardAssignment, ShardKey,
    DEFAULT_SHARDS, MAX_SHARDS,
};
use tarn_collection::CollectionConfig;
use tarn_proto::v1 as pb;

use super::{store_error, ClusterNode, DEFAULT_REPLICATION_FACTOR};
use crate::status::ApiError;

/// What `forget` does to a dead node's shards: each as (collection, shard, its new record).
#[derive(Debug, Default)]
pub struct Forgotten {
    /// Shards whose data is given up: they start empty on another node.
    pub given_up: Vec<(String, u32, ShardAssignment)>,
    /// Shards that lose nothing: another in-sync copy is (or becomes) the primary, and the
    /// node's copy is dropped from the record.
    pub kept: Vec<(String, u32, ShardAssignment)>,
    /// Shards the node held an in-sync replica of while no other in-sync copy is alive on its
    /// recorded disk (its primary is down): the node leaves the record and is listed as given
    /// up, so that its copy, should it come back, is set aside (never deleted). The shard
    /// waits for its primary.
    pub set_aside: Vec<(String, u32, ShardAssignment)>,
}

impl ClusterNode {
    /// `CreateCollection` in cluster mode: the definition and an even placement over the live
    /// nodes, written to the store in one transaction.
    pub async fn create_collection(
        &self,
        request: &pb::CreateCollectionRequest,
        config: CollectionConfig,
    ) -> Result<CollectionMap, ApiError> {
        crate::registry::validate_name(&request.name)?;
        let n_shards = match request.shards {
            0 => DEFAULT_SHARDS,
            n if n <= MAX_SHARDS => n,
            n => {
                return Err(ApiError::invalid(
                    "shards",
                    format!("{n} is over the limit of {MAX_SHARDS}"),
                ))
            }
        };
        let shard_key = match pb::ShardKey::try_from(request.shard_key) {
            Ok(pb::ShardKey::User) => ShardKey::User,
            Ok(pb::ShardKey::Doc) => ShardKey::Doc,
            Err(_) => {
                return Err(ApiError::invalid(
                    "shard_key",
                    format!("unknown value {}", request.shard_key),
                ))
            }
        };
        let nodes: Vec<NodeInfo> = self.state().nodes.values().cloned().collect();
        let default_factor = match self.default_replication_factor {
            0 => DEFAULT_REPLICATION_FACTOR.min(nodes.len().max(1) as u32),
            given => given,
        };
        let (replication_factor, min_in_sync) = tarn_cluster::replication_settings(
            request.replication_factor,
            request.min_in_sync,
            default_factor,
            nodes.len(),
        )
        .map_err(ApiError::Unsupported)?;
        let def = CollectionDef {
            name: request.name.clone(),
            uid: rand::random::<u64>() | 1,
            n_shards,
            shard_key,
            config: serde_json::to_value(&config)
                .map_err(|e| ApiError::Internal(format!("encoding the config: {e}")))?,
            replication_factor,
            min_in_sync,
        };
        let map = CollectionMap {
            shards: initial_placement(&def.name, n_shards, &nodes, def.replication_factor),
            def,
        };
        if map.shards.is_empty() {
            return Err(ApiError::Unavailable(
                "no live node to place shards on (etcd shows none registered)".into(),
            ));
        }
        if !self
            .store
            .create_collection(&map)
            .await
            .map_err(store_error)?
        {
            return Err(ApiError::AlreadyExists(request.name.clone()));
        }
        self.wait_for(|s| {
            s.collections
                .get(&map.def.name)
                .is_some_and(|m| m.def.uid == map.def.uid)
        })
        .await;
        Ok(map)
    }

    pub async fn drop_collection(&self, name: &str) -> Result<(), ApiError> {
        let map = self.collection(name)?;
        if !self
            .store
            .drop_collection(name)
            .await
            .map_err(store_error)?
        {
            return Err(ApiError::NotFound(name.to_owned()));
        }
        self.wait_for(|s| {
            s.collections
                .get(name)
                .is_none_or(|m| m.def.uid != map.def.uid)
        })
        .await;
        Ok(())
    }

    /// `ForgetNode`: hands every shard of the dead node `node_id` to the live node with the
    /// fewest shards, as an empty shard at the next epoch (compare-and-swap per shard). With
    /// `confirm` false, only the plan. Refused while the node is alive.
    pub async fn forget(&self, node_id: &str, confirm: bool) -> Result<Forgotten, ApiError> {
        let state = self.state();
        if state.is_alive(node_id) {
            return Err(ApiError::Unsupported(format!(
                "node {node_id} is alive: only a dead node's shards can be given up"
            )));
        }
        let mut load: BTreeMap<String, usize> =
            state.nodes.keys().map(|n| (n.clone(), 0)).collect();
        if load.is_empty() {
            return Err(ApiError::Unsupported(
                "no live node to take the shards".into(),
            ));
        }
        for map in state.collections.values() {
            for assignment in &map.shards {
                if let Some(n) = load.get_mut(&assignment.owner) {
                    *n += 1;
                }
            }
        }
        let mut plan = Vec::new();
        let mut kept = Vec::new();
        let mut set_aside = Vec::new();
        for (name, map) in &state.collections {
            for (shard, assignment) in map.shards.iter().enumerate() {
                let change = |new| {
                    let shard = shard as u32;
                    (name.clone(), map.def.uid, shard, assignment.clone(), new)
                };
                // An in-sync replica whose data no other in-sync copy holds alive on its disk
                // (the primary is down, or back on a wiped disk): never "no data lost".
                let another_holds = assignment
                    .in_sync()
                    .any(|n| n != node_id && state.holds_in_sync_copy(assignment, n));
                if assignment.owner != node_id
                    && assignment.in_sync().any(|n| n == node_id)
                    && !another_holds
                {
                    if let Some(mut new) = assignment.without_replica(node_id) {
                        new.given_up.push(node_id.to_owned());
                        set_aside.push(change(new));
                    }
                    continue;
                }
                // A copy another in-sync copy makes redundant loses no data: the forgotten
                // node's replica leaves the record; a primary gives way to an alive in-sync
                // replica (the promotion failover would make), which then drops it.
                let without = if assignment.owner == node_id {
                    let candidate = assignment
                        .in_sync_replicas
                        .iter()
                        .find(|n| state.holds_in_sync_copy(assignment, n));
                    candidate
                        .and_then(|c| assignment.promoted(c))
                        .and_then(|p| p.without_replica(node_id))
                } else {
                    assignment.without_replica(node_id)
                };
                if let Some(new) = without {
                    kept.push(change(new));
                    continue;
                }
                if assignment.owner != node_id {
                    continue;
                }
                let (target, n) = load
                    .iter_mut()
                    .min_by_key(|(id, n)| (**n, (*id).clone()))
                    .ok_or_else(|| ApiError::Internal("no live node".into()))?;
                *n += 1;
                let incarnation = state
                    .nodes
                    .get(target)
                    .map_or("", |n| n.incarnation.as_str());
                plan.push(change(assignment.given_up_to(target, incarnation)));
            }
        }
        if confirm {
            // Only while the node has no registration in etcd itself: a node this one's view
            // thinks dead may be alive (a lagging view, or a node cut off from etcd whose lease
            // has not lapsed yet, which still acknowledges writes).
            let swap_unless_registered = async |name: &str,
                                                uid: u64,
                                                shard: u32,
                                                expected_epoch: u64,
                                                new: &ShardAssignment,
                                                expected: Option<&ShardAssignment>|
                   -> Result<(), ApiError> {
                let swapped = self
                    .store
                    .compare_and_set_shard(&tarn_cluster::ShardSwap {
                        collection: name,
                        uid,
                        shard,
                        expected_epoch,
                        new,
                        unless_registered: Some(node_id),
                        unless_registered_from: None,
                        registered: None,
                        expected,
                    })
                    .await
                    .map_err(store_error)?;
                if !swapped {
                    return Err(ApiError::StaleShardMap(format!(
                        "shard {shard} of collection '{name}' changed meanwhile, or node \
                         {node_id} is registered again: check `tarn cluster status` and run \
                         forget again"
                    )));
                }
                Ok(())
            };
            for (name, uid, shard, from, new) in &kept {
                swap_unless_registered(name, *uid, *shard, from.epoch, new, Some(from)).await?;
                tracing::warn!(collection = %name, shard, forgotten = %node_id, owner = %new.owner, "a forgotten node's copy dropped: another in-sync copy holds the data");
            }
            for (name, uid, shard, from, new) in &set_aside {
                swap_unless_registered(name, *uid, *shard, from.epoch, new, Some(from)).await?;
                tracing::warn!(collection = %name, shard, forgotten = %node_id, owner = %new.owner, "a forgotten node's in-sync copy leaves the record and is set aside should it come back: no other in-sync copy is alive");
            }
            for (name, uid, shard, from, new) in &plan {
                swap_unless_registered(name, *uid, *shard, from.epoch, new, Some(from)).await?;
                tracing::warn!(collection = %name, shard, forgotten = %node_id, owner = %new.owner, "shard given up: its data is lost, it starts empty");
            }
            let last = plan.last().map(|p| (p.0.clone(), p.2, p.4.epoch));
            if let Some((name, shard, epoch)) = last {
                self.wait_for(|s| {
                    s.collections
                        .get(&name)
                        .is_some_and(|m| m.shards[shard as usize].epoch >= epoch)
                })
                .await;
            }
        }
        Ok(Forgotten {
            given_up: plan
                .into_iter()
                .map(|(name, _, shard, _, new)| (name, shard, new))
                .collect(),
            kept: kept
                .into_iter()
                .map(|(name, _, shard, _, new)| (name, shard, new))
                .collect(),
            set_aside: set_aside
                .into_iter()
                .map(|(name, _, shard, _, new)| (name, shard, new))
                .collect(),
        })
    }
}
