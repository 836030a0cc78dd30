//! The placement coordinator ([`coordinate`]): one node at a time, elected in etcd, that each
//! round lifts the fences of dead takers, repairs shards' copies (`repair.rs`: failover,
//! replaced copies, re-replication) and plans the next move or hand-over with tarn-cluster's
//! pure planners (`plan_handover_skipping`, `plan_move_skipping`, around shards backing off),
//! which `steps.rs` carries out as a task of its own and records the outcome of.

mod repair;
mod steps;

use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use tarn_cluster::{HandoverStep, PlannedHandover, PlannedMove, ShardName};

use crate::cluster::ClusterNode;
use crate::transfer::{lift_fence, lift_handover};
use repair::{drop_replaced_copies, promote_replicas, rereplicate};
use steps::run_step;

/// The election of the placement coordinator.
const ELECTION: &str = "placement";

/// Runs for the life of the node: campaigns in etcd's election, and while elected, lifts the
/// fences of takers that died, promotes in-sync replicas of dead primaries, re-replicates, and
/// carries out [`plan_move`]'s moves and [`tarn_cluster::plan_handover`]'s hand-overs one at a
/// time, each as a task of its own ([`run_step`]) so that failovers never wait behind a move.
/// Several coordinators at once (an election lost without knowing) stay safe: every change is
/// a compare-and-swap on the shard's epoch or whole record.
pub(crate) async fn coordinate(node: Weak<ClusterNode>) {
    loop {
        let Some((store, node_id)) = node
            .upgrade()
            .map(|n| (Arc::clone(n.store()), n.node_id.clone()))
        else {
            return;
        };
        let leader = match store.campaign(ELECTION, &node_id).await {
            Ok(leader) => leader,
            Err(error) => {
                tracing::debug!(%error, "placement election: etcd unavailable; retrying");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        tracing::info!(%node_id, "this node is the placement coordinator");
        // Since when each node holding copies has been dead, as this coordinator saw it (a new
        // coordinator starts the clocks again: it may only wait longer).
        let mut dead_since: std::collections::HashMap<String, Instant> = Default::default();
        // The move or hand-over under way ([`run_step`]).
        let mut step_task: Option<tokio::task::JoinHandle<()>> = None;
        while leader.is_leader() {
            let Some(node) = node.upgrade() else {
                return;
            };
            // A receiver marked as having seen the state planned from, so that the wait below
            // wakes on the next change only. (Waiting on a fresh clone of the node's receiver,
            // never marked seen, returned at once every time: the loop spun a core at idle.)
            let mut watch = node.watch();
            let state = Arc::clone(&watch.borrow_and_update());
            for map in state.collections.values() {
                for (shard, a) in map.shards.iter().enumerate() {
                    let Some(taker) = &a.moving_to else {
                        continue;
                    };
                    let name = ShardName {
                        collection: map.def.name.clone(),
                        uid: map.def.uid,
                        shard: shard as u32,
                    };
                    if a.is_replica_handover() {
                        // The old primary drives a hand-over: lifted if it or the replica died.
                        if !state.is_alive(taker) || !state.is_alive(&a.owner) {
                            lift_handover(&node, &name, a.epoch).await;
                        }
                    } else if !state.is_alive(taker) {
                        lift_fence(&node, &name, a).await;
                    }
                }
            }
            promote_replicas(&node, &state).await;
            drop_replaced_copies(&node, &state).await;
            rereplicate(&node, &state, &mut dead_since).await;
            // One move or hand-over at a time, as a task of its own: the rounds above go on
            // while it runs (a move copies for up to an hour; a failover must not wait for it).
            if let Some(running) = step_task.as_mut().filter(|task| !task.is_finished()) {
                drop(node);
                tokio::select! {
                    _ = watch.changed() => {}
                    _ = running => {}
                    _ = tokio::time::sleep(Duration::from_secs(2)) => {}
                }
                continue;
            }
            step_task = None;
            // A replicated collection's primaries move by hand-over, the others by copying.
            // A shard whose moves failed waits out its backoff while the others go on (it is
            // not planned meanwhile: one shard that cannot move holds up no drain).
            let now = unix_ms();
            let backing_off = |collection: &str, shard: u32| {
                state
                    .move_failures
                    .get(&(collection.to_owned(), shard))
                    .is_some_and(|f| !f.may_retry_at(now))
            };
            let step = match tarn_cluster::plan_handover_skipping(&state, &backing_off) {
                Some(handover) => Some(Step::HandOver(Box::new(handover))),
                None => tarn_cluster::plan_move_skipping(&state, &backing_off).map(Step::Move),
            };
            let Some(step) = step else {
                drop(node);
                let _ = tokio::time::timeout(Duration::from_secs(2), watch.changed()).await;
                continue;
            };
            let (collection, shard, _, _) = step.describe();
            let failed_before = state
                .move_failures
                .get(&(collection.to_owned(), shard))
                .cloned();
            step_task = Some(tokio::spawn(run_step(node, step, failed_before)));
        }
        // A step still running finishes on its own (every change it makes is a guarded swap,
        // like a second coordinator's would be).
        tracing::warn!(%node_id, "no longer the placement coordinator");
    }
}

/// What the placement coordinator does next for one shard.
enum Step {
    /// Copy the shard to another node and flip it (a collection of one copy per shard).
    Move(PlannedMove),
    /// A step of handing a replicated shard's primary over to a replica.
    HandOver(Box<PlannedHandover>),
}

impl Step {
    /// (collection, shard, from, to), for the log and the failure record.
    fn describe(&self) -> (&str, u32, &str, &str) {
        match self {
            Step::Move(p) => (&p.collection, p.shard, &p.from, &p.to),
            Step::HandOver(p) => {
                let (HandoverStep::AddReplica(to)
                | HandoverStep::Fence(to)
                | HandoverStep::DropReplica(to)) = &p.step;
                (&p.collection, p.shard, &p.from.owner, to)
            }
        }
    }
}

/// Milliseconds since the Unix epoch (move failure records are read by every node).
fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}
