//! The taker's side of a shard move: `Cluster/PullShard` ([`pull_shard`]): copy the owner's
//! snapshot and tail, fence the shard once close behind, take the owner's last entries and flip
//! the shard to this node ([`flip`]), or lift the fence on any failure ([`lift_fence`]).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tarn_cluster::{ShardAssignment, ShardName};
use tarn_collection::Durability;
use tarn_proto::v1 as pb;

use super::{
    catch_up_limit, copied_batch, next_message, open_and_restore, Restored, FENCE_LAG_ENTRIES,
    HANDOVER_LIMIT, STREAM_SILENCE_LIMIT,
};
use crate::cluster::ClusterNode;
use crate::faults::{fail_point, pause_point};
use crate::status::ApiError;

/// How long a taker keeps trying to learn whether its flip landed when etcd does not say.
const FLIP_CONFIRM_LIMIT: Duration = Duration::from_secs(60);

/// Removes a shard from `incoming` (and counts the pull out) when the pull ends, however.
struct Incoming<'a> {
    node: &'a ClusterNode,
    local: String,
}

impl Drop for Incoming<'_> {
    fn drop(&mut self) {
        self.node.incoming.remove(&self.local);
        self.node.moves.in_progress.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Pulls a shard to this node (see the module documentation); answers once this node owns it
/// at a new epoch, or with why not (the old owner then still serves it).
pub async fn pull_shard(
    node: &Arc<ClusterNode>,
    request: pb::PullShardRequest,
) -> Result<pb::PullShardResponse, ApiError> {
    let map = node.map(&request.collection).await?;
    let Some(assignment) = map.shards.get(request.shard as usize).cloned() else {
        return Err(ApiError::invalid(
            "shard",
            format!(
                "collection '{}' has {} shards",
                map.def.name, map.def.n_shards
            ),
        ));
    };
    if assignment.epoch != request.epoch || !assignment.takes_writes() {
        return Err(ApiError::StaleShardMap(format!(
            "shard {} of collection '{}' is at epoch {} ({:?}), not at the planned {}",
            request.shard, map.def.name, assignment.epoch, assignment.state, request.epoch
        )));
    }
    if assignment.owner == node.node_id {
        return Err(ApiError::invalid(
            "shard",
            format!(
                "shard {} of collection '{}' is already this node's",
                request.shard, map.def.name
            ),
        ));
    }
    let shard = ShardName {
        collection: map.def.name.clone(),
        uid: map.def.uid,
        shard: request.shard,
    };
    let local = shard.local_name();
    if node.incoming.insert(local.clone(), ()).is_some() {
        return Err(ApiError::Aborted(format!(
            "shard {} of collection '{}' is already being pulled here",
            request.shard, map.def.name
        )));
    }
    node.moves.in_progress.fetch_add(1, Ordering::Relaxed);
    let _incoming = Incoming {
        node,
        local: local.clone(),
    };
    // Nothing else creates, replaces or removes the local copy while the pull runs.
    let lock = node.copy_lock(&local);
    let _copy = lock.lock().await;
    // A copy already here (left by an earlier move that failed here, or this node's copy from
    // before its data was given up): judged like any copy that is not this node's.
    if node.registry.get_shard(&local).is_ok() {
        node.incoming.remove(&local);
        let retired = node.retire_copy(&local, &shard).await;
        node.incoming.insert(local.clone(), ());
        if !retired || node.registry.get_shard(&local).is_ok() {
            return Err(ApiError::Unavailable(format!(
                "shard {} of collection '{}': this node holds a copy that cannot be retired yet",
                request.shard, map.def.name
            )));
        }
    }

    let mut fence: Option<ShardAssignment> = None;
    let outcome = copy_and_flip(node, &shard, &assignment, &mut fence).await;
    match outcome {
        Ok(response) => {
            node.moves.finished.fetch_add(1, Ordering::Relaxed);
            node.moves.last_write_pause_us.store(
                (response.write_pause_seconds * 1e6) as u64,
                Ordering::Relaxed,
            );
            tracing::info!(shard = %local, from = %assignment.owner, epoch = response.epoch,
                bytes = response.bytes, entries = response.entries,
                seconds = response.seconds, write_pause_s = response.write_pause_seconds,
                "shard moved here");
            Ok(response)
        }
        Err(error) => {
            node.moves.failed.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(shard = %local, from = %assignment.owner, %error, "shard move failed");
            if let Some(fence) = &fence {
                lift_fence(node, &shard, fence).await;
            }
            // This pull's copy goes only once a linearizable read shows the shard is not this
            // node's: after a flip whose answer was lost, the copy IS the shard, whatever this
            // node's (lagging) view says. Unread, the copy stays for reconciliation.
            match node
                .store()
                .read_shard(&shard.collection, shard.uid, shard.shard)
                .await
            {
                Ok(tarn_cluster::ShardRecord::Assigned(a)) if a.owner == node.node_id => {
                    tracing::warn!(shard = %local, epoch = a.epoch, "the move failed after its flip landed: the copy is this node's shard");
                }
                Ok(tarn_cluster::ShardRecord::Assigned(a))
                    if a.moving_to.as_deref() != Some(node.node_id.as_str()) =>
                {
                    if let Err(drop_error) = node.registry.drop_shard(&local).await {
                        tracing::error!(shard = %local, error = %drop_error, "could not drop a failed move's copy");
                    }
                }
                Ok(record) => {
                    tracing::info!(shard = %local, ?record, "a failed move's copy is left for reconciliation")
                }
                Err(read_error) => {
                    tracing::warn!(shard = %local, error = %read_error, "a failed move's copy stays until its record can be read")
                }
            }
            Err(error)
        }
    }
}

async fn copy_and_flip(
    node: &Arc<ClusterNode>,
    shard: &ShardName,
    from: &ShardAssignment,
    fence: &mut Option<ShardAssignment>,
) -> Result<pb::PullShardResponse, ApiError> {
    let started = Instant::now();
    fail_point("moves::fail_pull")?;
    // 1. The snapshot, into a copy this node does not serve yet.
    let local = shard.local_name();
    let Restored {
        mut stream,
        copy,
        info,
        mut n_bytes,
        ..
    } = open_and_restore(
        node,
        shard,
        (&from.owner, from.epoch),
        false,
        &node.moves.bytes,
    )
    .await?;
    let mut applied = info.seq_no;
    tracing::info!(shard = %local, from = %from.owner, seq_no = applied, n_bytes, "shard snapshot copied; catching up");

    // 2-5. The tail, the fence, the hand-over.
    let catch_up_started = Instant::now();
    let mut fenced_at: Option<Instant> = None;
    // How long the fence's compare-and-swap took (writes are refused from its landing on).
    let mut fence_ms = 0.0;
    let mut n_entries = 0u64;
    let last = loop {
        let limit = match fenced_at {
            Some(at) => HANDOVER_LIMIT.saturating_sub(at.elapsed()),
            None => STREAM_SILENCE_LIMIT,
        };
        let message = next_message(&mut stream, limit).await?;
        if !message.entries.is_empty() {
            let (batch, batch_bytes) = copied_batch(message.entries);
            n_bytes += batch_bytes;
            n_entries += batch.len() as u64;
            node.moves.bytes.fetch_add(batch_bytes, Ordering::Relaxed);
            applied = copy.append_copied(batch, Durability::Written).await?;
        }
        if message.handed_over {
            if applied != message.last_seq_no {
                return Err(ApiError::Internal(format!(
                    "the copy ends at {applied} but the owner's log at {}",
                    message.last_seq_no
                )));
            }
            // The owner's epoch history goes with its log, so that the copy's entries keep
            // their epochs (a replica that followed the owner compares them with this copy's
            // when this node is its primary).
            let starts: Vec<(u64, u64)> = message
                .epochs
                .iter()
                .map(|e| (e.epoch, e.first_seq))
                .collect();
            if !starts.is_empty() {
                let copy = copy.clone();
                tokio::task::spawn_blocking(move || copy.set_epoch_starts(starts))
                    .await
                    .map_err(|e| ApiError::Internal(e.to_string()))??;
            }
            break message.last_seq_no;
        }
        let behind = message.head_seq_no.saturating_sub(applied);
        if fenced_at.is_none() && behind > FENCE_LAG_ENTRIES {
            let limit = catch_up_limit();
            if catch_up_started.elapsed() > limit {
                return Err(ApiError::Aborted(format!(
                    "cannot catch up: still {behind} entries behind the owner after {:.1} s of \
                     copying (the shard takes writes faster than they can be copied); writes \
                     were never paused",
                    limit.as_secs_f64()
                )));
            }
            continue;
        }
        if fenced_at.is_none() {
            pause_point("moves::before_fence").await;
            let fence_started = Instant::now();
            let fenced = from.fenced_for(&node.node_id);
            let swapped = node
                .store()
                .compare_and_set_shard(&swap(shard, from.epoch, &fenced))
                .await
                .map_err(|e| ApiError::ClusterStore(e.to_string()))?;
            if !swapped {
                return Err(ApiError::StaleShardMap(format!(
                    "shard {} of collection '{}' changed before it could be fenced",
                    shard.shard, shard.collection
                )));
            }
            *fence = Some(fenced);
            fence_ms = fence_started.elapsed().as_secs_f64() * 1e3;
            fenced_at = Some(Instant::now());
            tracing::info!(shard = %local, from = %from.owner, "shard fenced; taking over");
            pause_point("moves::after_fence").await;
        }
    };
    // The write pause's phases, for the log: until the owner's last entry arrived, until the
    // copy was synced, until the flip landed (milliseconds from the fence).
    let since_fence = |at: Option<Instant>| at.map_or(0.0, |at| at.elapsed().as_secs_f64() * 1e3);
    let handed_over_ms = since_fence(fenced_at);
    copy.sync_wal().await?;
    let synced_ms = since_fence(fenced_at);
    let fenced = fence
        .clone()
        .ok_or_else(|| ApiError::Internal("handed over without a fence".to_owned()))?;
    let owned = fenced.handed_over(&node.incarnation);
    flip(node, shard, &fenced, &owned).await?;
    let write_pause = fenced_at.map_or(0.0, |at| at.elapsed().as_secs_f64());
    tracing::info!(shard = %shard.local_name(), fence_ms = fence_ms, handed_over_ms, synced_ms,
        flipped_ms = write_pause * 1e3, "hand-over phases");
    node.wait_for_view(Duration::from_secs(5), |s| {
        s.assignment(shard).is_some_and(|a| a.epoch >= owned.epoch)
    })
    .await;
    Ok(pb::PullShardResponse {
        epoch: fenced.epoch + 1,
        bytes: n_bytes,
        entries: n_entries,
        last_seq_no: last,
        seconds: started.elapsed().as_secs_f64(),
        write_pause_seconds: write_pause,
    })
}

/// The flip: fenced -> this node's. An answer lost on the way (etcd unreachable) is settled by
/// reading the shard back until etcd says.
async fn flip(
    node: &ClusterNode,
    shard: &ShardName,
    fenced: &ShardAssignment,
    owned: &ShardAssignment,
) -> Result<(), ApiError> {
    let store = node.store();
    let deadline = Instant::now() + FLIP_CONFIRM_LIMIT;
    loop {
        match store
            .compare_and_set_shard(&swap(shard, fenced.epoch, owned))
            .await
        {
            Ok(true) => return Ok(()),
            Ok(false) => {
                // Either an earlier attempt landed (its answer lost), or the fence was lifted:
                // etcd says which (a linearizable read, never this node's lagging view).
                let record = store
                    .read_shard(&shard.collection, shard.uid, shard.shard)
                    .await;
                match record {
                    Ok(tarn_cluster::ShardRecord::Assigned(a)) if a == *owned => return Ok(()),
                    Ok(other) => {
                        return Err(ApiError::StaleShardMap(format!(
                            "the fence of shard {} of collection '{}' was lifted before the \
                             flip (now {other:?})",
                            shard.shard, shard.collection
                        )))
                    }
                    Err(error) if Instant::now() < deadline => {
                        tracing::warn!(%error, "confirming a moved shard's flip: etcd did not answer; retrying");
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                    Err(error) => return Err(ApiError::ClusterStore(error.to_string())),
                }
            }
            Err(error) if Instant::now() < deadline => {
                tracing::warn!(%error, "flipping a moved shard: etcd did not answer; retrying");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(error) => return Err(ApiError::ClusterStore(error.to_string())),
        }
    }
}

/// A swap of `shard` (of its collection's incarnation) planned at `epoch`.
fn swap<'a>(
    shard: &'a ShardName,
    epoch: u64,
    new: &'a ShardAssignment,
) -> tarn_cluster::ShardSwap<'a> {
    tarn_cluster::ShardSwap {
        collection: &shard.collection,
        uid: shard.uid,
        shard: shard.shard,
        expected_epoch: epoch,
        new,
        unless_registered: None,
        unless_registered_from: None,
        registered: None,
        expected: None,
    }
}

/// Lifts a move's fence: the old owner serves the shard again at the next epoch. Logged, not
/// returned: a fence that stays is lifted later by the coordinator or by its taker's
/// reconciliation.
pub(crate) async fn lift_fence(node: &ClusterNode, shard: &ShardName, fence: &ShardAssignment) {
    let back = fence.fence_lifted();
    let (collection, shard_no) = (&shard.collection, shard.shard);
    match node
        .store()
        .compare_and_set_shard(&swap(shard, fence.epoch, &back))
        .await
    {
        Ok(true) => {
            tracing::info!(%collection, shard = shard_no, owner = %fence.owner, epoch = back.epoch, "move abandoned; the fence is lifted")
        }
        Ok(false) => {}
        Err(error) => {
            tracing::warn!(%collection, shard = shard_no, %error, "could not lift a move's fence yet")
        }
    }
}
