//! The hand-over of a replicated shard's primary to an in-sync replica: the coordinator's fence
//! ([`hand_over`]), the old primary's drain and promotion ([`start_handovers`],
//! [`hand_over_as_primary`]), and lifting the fence on any failure ([`lift_handover`]).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tarn_cluster::{HandoverStep, PlannedHandover, ShardAssignment, ShardName};

use super::HANDOVER_LIMIT;
use crate::cluster::ClusterNode;
use crate::faults::fail_point;
use crate::status::ApiError;

// A replicated shard's primary handed over to an in-sync replica.
//
// 1. The coordinator fences the shard for the replica B ([`hand_over`]): (A, e, serving) ->
//    (A, e, fenced, moving to B), a swap of the whole record. The epoch stays, so that A's
//    replication at e goes on shipping to the replicas, and B does not lift the fence as a
//    move's taker would (B holds a copy: `ShardAssignment::is_replica_handover`).
// 2. A sees the fence ([`start_handovers`]), takes the shard's write gate exclusively (the
//    writes that passed their epoch check before finish; later ones find the fence, ABORTED,
//    and routers retry), syncs its log to its last entry L, and waits until every in-sync
//    replica has L durable (one that does not within the bound leaves the in-sync set first,
//    as at any write). Its log and the in-sync replicas' are then the same, entry for entry.
// 3. A reads the record (linearizably) and, if it is still the fence with B in sync, swaps it
//    for (B, e + 1, serving) with A an in-sync replica on its data directory. Nothing is cut
//    from A's log when it follows B.
// 4. Any failure lifts the fence by a swap of the whole record: (A, e + 1, serving) — done by A,
//    by the coordinator when A or B is dead or past the limit. The copy of a draining A then
//    leaves as any replica on a draining node does ([`rereplicate`]).

/// How long a primary's hand-over to its in-sync replica may take on the old primary, from
/// seeing the fence to the promotion (draining its writes, its replicas taking its last
/// entries); past it the fence is lifted.
const REPLICA_HANDOVER_LIMIT: Duration = Duration::from_secs(10);

/// Carries out one planned step of a hand-over (the coordinator's side): a new replica (the
/// primary seeds it; the next rounds wait until it is in sync), a surplus replica dropped, or
/// the fence, after which it waits for the old primary's promotion of the replica (at most
/// [`HANDOVER_LIMIT`], and only while both nodes are alive; else it lifts the fence).
pub(crate) async fn hand_over(
    node: &Arc<ClusterNode>,
    planned: &PlannedHandover,
) -> Result<(), ApiError> {
    let name = ShardName {
        collection: planned.collection.clone(),
        uid: planned.uid,
        shard: planned.shard,
    };
    let swap = tarn_cluster::ShardSwap::whole_record(&name, &planned.from, &planned.to);
    let landed = node
        .store()
        .compare_and_set_shard(&swap)
        .await
        .map_err(|e| ApiError::ClusterStore(e.to_string()))?;
    if !landed {
        return Err(ApiError::StaleShardMap(format!(
            "shard {} of collection '{}' changed before its primary could be handed over",
            planned.shard, planned.collection
        )));
    }
    let local = name.local_name();
    // The next round plans from a view that has this change.
    node.wait_for_view(Duration::from_secs(2), |s| {
        s.assignment(&name) != Some(&planned.from)
    })
    .await;
    let to = match &planned.step {
        HandoverStep::AddReplica(on) => {
            tracing::info!(shard = %local, primary = %planned.from.owner, replica = %on,
                draining = planned.draining,
                "hand-over: a new replica first (it takes over once in sync)");
            return Ok(());
        }
        HandoverStep::DropReplica(node_id) => {
            tracing::info!(shard = %local, replica = %node_id,
                "hand-over: a surplus replica leaves (every other copy is in sync)");
            return Ok(());
        }
        HandoverStep::Fence(to) => to,
    };
    let fenced_at = Instant::now();
    tracing::info!(shard = %local, primary = %planned.from.owner, to = %to,
        draining = planned.draining, "hand-over: fenced; the primary drains and promotes");
    let epoch = planned.to.epoch;
    // Settled (promoted, or the fence lifted), or one of the two nodes died (then the fence is
    // lifted here at once, and the shard fails over if it must).
    node.wait_for_view(HANDOVER_LIMIT, |s| {
        s.assignment(&name).is_none_or(|a| a.epoch > epoch)
            || !s.is_alive(&planned.from.owner)
            || !s.is_alive(to)
    })
    .await;
    let write_pause = fenced_at.elapsed();
    match node.state().assignment(&name) {
        Some(a) if a.epoch > epoch && a.owner == *to => {
            node.moves.finished.fetch_add(1, Ordering::Relaxed);
            node.moves
                .last_write_pause_us
                .store(write_pause.as_micros() as u64, Ordering::Relaxed);
            tracing::info!(shard = %local, from = %planned.from.owner, primary = %to,
                epoch = a.epoch, write_pause_ms = write_pause.as_secs_f64() * 1e3,
                "hand-over: the replica is the shard's primary");
            Ok(())
        }
        Some(a) if a.epoch > epoch => Err(ApiError::StaleShardMap(format!(
            "the hand-over of shard {} of collection '{}' to node {to} was abandoned (now \
             node {}'s at epoch {})",
            planned.shard, planned.collection, a.owner, a.epoch
        ))),
        None => Err(ApiError::NotFound(planned.collection.clone())),
        Some(_) => {
            lift_handover(node, &name, epoch).await;
            Err(ApiError::Unavailable(format!(
                "the hand-over of shard {} of collection '{}' to node {to} was not done (a node \
                 died, or past {} s); its fence is lifted",
                planned.shard,
                planned.collection,
                HANDOVER_LIMIT.as_secs()
            )))
        }
    }
}

/// Starts the old primary's part of a hand-over ([`hand_over_as_primary`]) for every shard
/// this node's view shows it primary of and fenced for a hand-over to a replica, one task per
/// shard; a hand-over that fails lifts its fence.
pub(crate) fn start_handovers(node: &Arc<ClusterNode>) {
    let state = node.state();
    for (shard, a, map) in state.shards_led_by(&node.node_id) {
        if !a.is_replica_handover() {
            continue;
        }
        let local = shard.local_name();
        if node.handing_over.insert(local.clone(), ()).is_some() {
            continue;
        }
        let (node, fence, min_in_sync) = (Arc::clone(node), a.clone(), map.def.min_in_sync);
        tokio::spawn(async move {
            let outcome = tokio::time::timeout(
                REPLICA_HANDOVER_LIMIT,
                hand_over_as_primary(&node, &shard, &fence, min_in_sync),
            )
            .await;
            let error = match outcome {
                Ok(Ok(())) => None,
                Ok(Err(error)) => Some(error.to_string()),
                Err(_) => Some(format!(
                    "not done within {} s",
                    REPLICA_HANDOVER_LIMIT.as_secs()
                )),
            };
            if let Some(error) = error {
                tracing::warn!(shard = %local, %error, "hand-over failed; lifting its fence");
                lift_handover(&node, &shard, fence.epoch).await;
            }
            node.handing_over.remove(&local);
        });
    }
}

/// The old primary's part of a hand-over (steps 2 and 3 above): drains its writes, makes sure
/// every in-sync replica holds its whole log, and promotes the fence's replica with this copy
/// in sync, by a swap of the whole record as read linearizably.
async fn hand_over_as_primary(
    node: &Arc<ClusterNode>,
    shard: &ShardName,
    fence: &ShardAssignment,
    min_in_sync: u32,
) -> Result<(), ApiError> {
    let local = shard.local_name();
    let saw_fence = Instant::now();
    let since_fence = || saw_fence.elapsed().as_secs_f64() * 1e3;
    // Every write that passed its epoch check before this node saw the fence holds the gate
    // shared until it is acknowledged or fails; later writes find the fence and are refused.
    let gate = node.gate(&local);
    let _writes_held = gate.write().await;
    let drained_ms = since_fence();
    let collection = node.registry.get_shard(&local)?;
    let last = collection.sync_wal().await?;
    // The replication at the fence's epoch (the shard's, unchanged) ships what the replicas
    // lack; a replica without `last` within the bound leaves the in-sync set first.
    if let Some(replication) = node
        .replication_for_write(shard, fence, min_in_sync, &collection)
        .await?
    {
        replication.replicate(node, last).await?;
    }
    let replicated_ms = since_fence();
    fail_point("moves::fail_handover")?;
    let record = node
        .store()
        .read_shard(&shard.collection, shard.uid, shard.shard)
        .await
        .map_err(|e| ApiError::ClusterStore(e.to_string()))?;
    let current = match record {
        tarn_cluster::ShardRecord::Assigned(a)
            if a.owner == node.node_id && a.epoch == fence.epoch =>
        {
            a
        }
        other => {
            return Err(ApiError::StaleShardMap(format!(
                "the hand-over's fence is gone (now {other:?})"
            )))
        }
    };
    let promoted = current
        .handed_to_replica(&node.incarnation)
        .ok_or_else(|| {
            ApiError::StaleShardMap(format!(
                "the hand-over's replica is no longer in sync ({current:?})"
            ))
        })?;
    let swap = tarn_cluster::ShardSwap::whole_record(shard, &current, &promoted);
    let landed = node
        .store()
        .compare_and_set_shard(&swap)
        .await
        .map_err(|e| ApiError::ClusterStore(e.to_string()))?;
    if !landed {
        return Err(ApiError::StaleShardMap(
            "the shard's record changed during the hand-over".to_owned(),
        ));
    }
    tracing::info!(shard = %local, primary = %promoted.owner, epoch = promoted.epoch,
        last_seq_no = last, drained_ms, replicated_ms, promoted_ms = since_fence(),
        "hand-over: writes drained, every in-sync replica holds the log; the replica is the \
         primary and this copy an in-sync replica");
    // The view follows before the gate opens, so that no pass of reconciliation starts this
    // hand-over again from the fence.
    node.wait_for_view(Duration::from_secs(1), |s| {
        s.assignment(shard)
            .is_none_or(|a| a.epoch >= promoted.epoch)
    })
    .await;
    Ok(())
}

/// Lifts a hand-over's fence at `epoch` (not a later hand-over's): the old primary serves the
/// shard again at the next epoch, its copies as they are (one swap of the whole record as read
/// linearizably, so that a replica that left the in-sync set under the fence is not put back).
/// Logged, not returned.
pub(crate) async fn lift_handover(node: &ClusterNode, shard: &ShardName, epoch: u64) {
    let local = shard.local_name();
    let record = node
        .store()
        .read_shard(&shard.collection, shard.uid, shard.shard)
        .await;
    let current = match record {
        Ok(tarn_cluster::ShardRecord::Assigned(a))
            if a.is_replica_handover() && a.epoch == epoch =>
        {
            a
        }
        Ok(_) => return,
        Err(error) => {
            tracing::warn!(shard = %local, %error, "could not lift a hand-over's fence yet");
            return;
        }
    };
    let back = current.fence_lifted();
    let swap = tarn_cluster::ShardSwap::whole_record(shard, &current, &back);
    match node.store().compare_and_set_shard(&swap).await {
        Ok(true) => {
            tracing::info!(shard = %local, primary = %back.owner, epoch = back.epoch,
                "hand-over abandoned; the fence is lifted")
        }
        Ok(false) => {}
        Err(error) => {
            tracing::warn!(shard = %local, %error, "could not lift a hand-over's fence yet")
        }
    }
}
