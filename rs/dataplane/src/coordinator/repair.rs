//! The coordinator's repairs of shards' copies, every round: failover ([`promote_replicas`]),
//! in-sync replicas back on a wiped disk taken out of the in-sync set
//! ([`drop_replaced_copies`]), and re-replication ([`rereplicate`]).

use std::sync::atomic::Ordering;
use std::time::Instant;

use tarn_cluster::ShardName;

use crate::cluster::ClusterNode;

/// Failover: for each shard whose primary is dead to the cluster (or back on another disk)
/// and that has an alive in-sync replica on the disk recorded for its copy
/// ([`tarn_cluster::plan_promotions`]), promotes that replica at the next epoch, in one etcd
/// transaction that lands only if the shard's record is unchanged since it was read and the
/// old primary's registration is gone from etcd itself (not only from this node's view), or
/// is still the one from another data directory than the one recorded for its copy, and the
/// candidate is registered in etcd itself from the directory recorded for its copy. Without
/// etcd nothing is promoted. Logged and counted (`tarn_failovers_total`); a swap that does not
/// land is decided again from the next view.
pub(super) async fn promote_replicas(node: &ClusterNode, state: &tarn_cluster::ClusterState) {
    // Each promotion is its own guarded swap of one shard's record: they go to etcd
    // `PROMOTIONS_IN_FLIGHT` at a time, not one after another (a dead node's hundreds of
    // primaries are promoted in a few round trips' time, not hundreds).
    let promotions = tarn_cluster::plan_promotions(state);
    let promote = |planned: tarn_cluster::PlannedPromotion| async move {
        let name = ShardName {
            collection: planned.collection.clone(),
            uid: planned.uid,
            shard: planned.shard,
        };
        let mut swap = tarn_cluster::ShardSwap::whole_record(&name, &planned.from, &planned.to);
        swap.unless_registered = Some(&planned.dead_primary);
        swap.unless_registered_from = planned.dead_primary_incarnation.as_deref();
        // And only onto a candidate registered, in etcd itself, from its recorded directory.
        let candidate = planned.to.owner.as_str();
        swap.registered = Some((
            candidate,
            planned.from.incarnation_of(candidate).unwrap_or(""),
        ));
        match node.store().compare_and_set_shard(&swap).await {
            Ok(true) => {
                node.moves.failovers.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(shard = %name.local_name(), dead = %planned.dead_primary,
                    primary = %planned.to.owner, epoch = planned.to.epoch,
                    "failover: an in-sync replica is the shard's primary");
            }
            Ok(false) => {
                tracing::debug!(shard = %name.local_name(), "failover not landed (the record changed or the primary is still registered)");
            }
            Err(error) => {
                tracing::warn!(shard = %name.local_name(), %error, "failover: etcd unavailable; retrying");
            }
        }
    };
    use futures_util::stream::StreamExt;
    futures_util::stream::iter(promotions)
        .for_each_concurrent(PROMOTIONS_IN_FLIGHT, promote)
        .await;
}

/// How many failovers' swaps the coordinator has in flight at once (etcd serializes them; the
/// bound keeps a storm from queueing thousands of requests on one connection).
const PROMOTIONS_IN_FLIGHT: usize = 32;

/// Takes out of the in-sync set every in-sync replica whose node is registered from another
/// data directory than the one recorded for its copy ([`tarn_cluster::plan_replaced_copies`]:
/// it came back on a wiped or replaced disk and holds nothing), without waiting for its
/// primary's next write or probe: one swap per shard that lands only if the record is
/// unchanged since it was read. The primary's follower then finds the node without a copy and
/// seeds it.
pub(super) async fn drop_replaced_copies(node: &ClusterNode, state: &tarn_cluster::ClusterState) {
    for planned in tarn_cluster::plan_replaced_copies(state) {
        let name = ShardName {
            collection: planned.collection.clone(),
            uid: planned.uid,
            shard: planned.shard,
        };
        let swap = tarn_cluster::ShardSwap::whole_record(&name, &planned.from, &planned.to);
        match node.store().compare_and_set_shard(&swap).await {
            Ok(true) => {
                tracing::warn!(shard = %name.local_name(), replica = %planned.replica,
                    "a replica back on another data directory left the in-sync set (its copy is gone; it is seeded again)");
            }
            Ok(false) => {}
            Err(error) => {
                tracing::warn!(shard = %name.local_name(), %error, "dropping a replaced copy from the in-sync set: etcd unavailable; retrying");
            }
        }
    }
}

/// Re-replication: a replica copy on a node dead for longer than `--replace-dead-after` is
/// replaced by a new replica on the live node (not draining, without a copy of the shard) that
/// holds the fewest copies, in one swap that lands only if the shard's record is unchanged and
/// the dead node is still unregistered in etcd. The new copy is seeded from the primary's
/// snapshot and log by the primary's follower, and joins the in-sync set once it has
/// everything. A shard with fewer copies than its replication factor (a copy given up by
/// `forget`) gets a new replica the same way. Only shards whose primary holds its copy, alive
/// on its recorded data directory, are touched (a dead primary is first replaced by failover;
/// a primary back on a wiped disk holds nothing, and its in-sync replicas are never replaced
/// while they may hold the last copy); a shard with no spare live node keeps its dead copy
/// listed.
///
/// A replica on a draining node (alive) moves the other way round, so the shard never has
/// fewer copies in sync than before: first a new replica is added on a taker (the shard has
/// one copy more than its factor meanwhile), then, once every other copy is in sync, the
/// draining node's copy is dropped from the record (and from its disk by reconciliation).
pub(super) async fn rereplicate(
    node: &ClusterNode,
    state: &tarn_cluster::ClusterState,
    dead_since: &mut std::collections::HashMap<String, Instant>,
) {
    let now = Instant::now();
    let mut holders = std::collections::BTreeSet::new();
    for map in state.collections.values() {
        for shard in &map.shards {
            holders.extend(shard.copies().map(str::to_owned));
        }
    }
    dead_since.retain(|n, _| holders.contains(n) && !state.is_alive(n));
    for holder in holders.iter().filter(|n| !state.is_alive(n)) {
        dead_since.entry(holder.clone()).or_insert(now);
    }
    let replace = |n: &str| {
        dead_since
            .get(n)
            .is_some_and(|since| now.duration_since(*since) >= node.replace_dead_after)
    };
    let mut load: std::collections::BTreeMap<String, usize> = state
        .nodes
        .keys()
        .filter(|n| !state.draining.contains(*n))
        .map(|n| (n.clone(), 0))
        .collect();
    for map in state.collections.values() {
        for shard in &map.shards {
            for copy in shard.copies() {
                if let Some(n) = load.get_mut(copy) {
                    *n += 1;
                }
            }
        }
    }
    for (name, map) in &state.collections {
        for (idx, a) in map.shards.iter().enumerate() {
            // Only while the primary holds its copy on its recorded disk: a primary back on a
            // wiped disk holds nothing, and its in-sync replicas, dead or not, may hold the
            // last copy of every acknowledged write (they wait for it, never replaced).
            if !a.takes_writes() || !state.holds_in_sync_copy(a, &a.owner) {
                continue;
            }
            // Both changes keep the epoch and compare the whole record.
            let swap_to = |new, unless_registered| tarn_cluster::ShardSwap {
                collection: name,
                uid: map.def.uid,
                shard: idx as u32,
                expected_epoch: a.epoch,
                new,
                unless_registered,
                unless_registered_from: None,
                registered: None,
                expected: Some(a),
            };
            let draining = a
                .replicas
                .iter()
                .find(|n| state.draining.contains(*n) && state.is_alive(n));
            if let Some(draining) = draining {
                let n_copies = a.copies().count() as u32;
                let others_in_sync = a
                    .copies()
                    .filter(|n| n != draining)
                    .all(|n| a.in_sync().any(|m| m == n));
                let next = if n_copies <= map.def.replication_factor.max(1) {
                    load.iter()
                        .filter(|(n, _)| a.role_of(n).is_none() && !a.given_up.contains(*n))
                        .min_by_key(|(n, copies)| (**copies, n.as_str()))
                        .and_then(|(taker, _)| a.with_replica(taker))
                } else if others_in_sync {
                    a.without_replica(draining)
                } else {
                    None
                };
                // Nothing to do for the draining copy yet (another copy is catching up, or is
                // dead and never will): a dead replica is still replaced below, so that the
                // draining copy can leave once its replacement is in sync.
                if let Some(next) = next {
                    match node
                        .store()
                        .compare_and_set_shard(&swap_to(&next, None))
                        .await
                    {
                        Ok(true) => {
                            tracing::info!(collection = %name, shard = idx, %draining,
                            replicas = ?next.replicas, "drain: a replica moves off a draining node");
                        }
                        Ok(false) => {}
                        Err(error) => {
                            tracing::warn!(collection = %name, shard = idx, %error, "drain: etcd unavailable; retrying");
                            return;
                        }
                    }
                    continue;
                }
            }
            // A dead replica is replaced; a shard with fewer copies than its factor (a copy
            // given up by `forget`) gets one more.
            let dead = a.replicas.iter().find(|n| replace(n));
            let short = a.copies().count() < map.def.replication_factor.max(1) as usize;
            if dead.is_none() && !short {
                continue;
            }
            // Never a node whose copy of the shard was given up: its copy is set aside for an
            // operator, and a seed or a log cut would destroy it.
            let Some(taker) = load
                .iter()
                .filter(|(n, _)| a.role_of(n).is_none() && !a.given_up.contains(*n))
                .min_by_key(|(n, copies)| (**copies, n.as_str()))
                .map(|(n, _)| n.clone())
            else {
                continue;
            };
            let next = match dead {
                Some(dead) => a.without_replica(dead),
                None => Some(a.clone()),
            };
            let Some(next) = next.and_then(|r| r.with_replica(&taker)) else {
                continue;
            };
            match node
                .store()
                .compare_and_set_shard(&swap_to(&next, dead.map(String::as_str)))
                .await
            {
                Ok(true) => {
                    *load.entry(taker.clone()).or_default() += 1;
                    match dead {
                        Some(dead) => {
                            tracing::warn!(collection = %name, shard = idx, %dead, %taker,
                            "re-replication: a dead node's replica is rebuilt on another node")
                        }
                        None => tracing::warn!(collection = %name, shard = idx, %taker,
                            "re-replication: a shard below its replication factor gets a copy"),
                    }
                }
                Ok(false) => {}
                Err(error) => {
                    tracing::warn!(collection = %name, shard = idx, %error, "re-replication: etcd unavailable; retrying");
                    return;
                }
            }
        }
    }
}
