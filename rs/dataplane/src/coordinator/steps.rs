//! Carrying out the coordinator's planned step, in a task of its own ([`run_step`]): a move
//! (asking its taker to pull the shard: [`request_move`]) or a hand-over step
//! (`crate::transfer::hand_over`), and recording its outcome in etcd (the failures the planner
//! backs off from, cleared once the shard moves).

use std::sync::Arc;
use std::time::Duration;

use tarn_cluster::PlannedMove;
use tarn_proto::v1 as pb;

use super::{unix_ms, Step};
use crate::cluster::ClusterNode;
use crate::status::ApiError;
use crate::transfer::{hand_over, peer_error, pull_shard, MOVE_LIMIT};

/// Carries out one planned step and records its outcome in etcd: a failure (counted on top of
/// the shard's earlier ones, `failed_before`, so that the coordinator backs off), or, after
/// earlier failures, that the shard moved.
pub(super) async fn run_step(
    node: Arc<ClusterNode>,
    step: Step,
    failed_before: Option<tarn_cluster::MoveFailure>,
) {
    let (collection, shard, from, to) = step.describe();
    let outcome = match &step {
        Step::Move(planned) => request_move(&node, planned).await,
        Step::HandOver(planned) => hand_over(&node, planned).await,
    };
    let failure = match &outcome {
        Ok(()) => None,
        Err(error) => {
            tracing::warn!(%collection, shard, %from, %to, %error, "planned move failed");
            Some(tarn_cluster::MoveFailure {
                to: to.to_owned(),
                error: error.to_string(),
                failures: failed_before.as_ref().map_or(0, |f| f.failures) + 1,
                at_unix_ms: unix_ms(),
            })
        }
    };
    if failure.is_none() {
        // A move to this taker went through: the failures other shards of the collection had
        // moving to it describe the cluster no more (the planner skipped them while they backed
        // off; they are planned afresh if they still need to move).
        let stale: Vec<u32> = node
            .state()
            .move_failures
            .iter()
            .filter(|((c, s), f)| c == collection && *s != shard && f.to == to)
            .map(|((_, s), _)| *s)
            .collect();
        for other in stale {
            if let Err(error) = node
                .store()
                .record_move_failure(collection, other, None)
                .await
            {
                tracing::warn!(%error, "could not clear a stale move failure");
            }
        }
    }
    if failure.is_some() || failed_before.is_some() {
        if let Err(error) = node
            .store()
            .record_move_failure(collection, shard, failure.as_ref())
            .await
        {
            // The step stays under way a little longer: the next is not planned at once from
            // a record without this outcome.
            tracing::warn!(%error, "could not record a move's outcome");
            tokio::time::sleep(Duration::from_secs(2)).await;
        }
    }
}

/// Asks the taker of a planned move to pull its shard (in-process when it is this node).
async fn request_move(node: &Arc<ClusterNode>, planned: &PlannedMove) -> Result<(), ApiError> {
    tracing::info!(collection = %planned.collection, shard = planned.shard,
        from = %planned.from, to = %planned.to, epoch = planned.epoch, "moving a shard");
    let request = pb::PullShardRequest {
        collection: planned.collection.clone(),
        shard: planned.shard,
        epoch: planned.epoch,
    };
    if planned.to == node.node_id {
        pull_shard(node, request).await?;
        return Ok(());
    }
    let channel = node.peer(&planned.to).await?;
    let mut client = pb::node_client::NodeClient::new(channel);
    let pull = client.pull_shard(node.internal_request(request, MOVE_LIMIT));
    // The step ends when the taker leaves the cluster (its lease lapsed: stopped, or cut off
    // from etcd), not at the pull's hour-long deadline: the coordinator plans the next one.
    let taker_gone = node.wait_for_view(MOVE_LIMIT, |s| !s.is_alive(&planned.to));
    tokio::select! {
        answer = pull => {
            answer.map_err(|s| peer_error(&format!("node {} pulling the shard", planned.to), s))?;
        }
        _ = taker_gone => {
            return Err(ApiError::Unavailable(format!(
                "node {} left the cluster while pulling the shard",
                planned.to
            )));
        }
    }
    Ok(())
}
