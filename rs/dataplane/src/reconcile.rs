//! Reconciliation: this node's local shard copies kept in line with the shard map, for the life
//! of the node ([`reconcile`], started by `ClusterNode::join`). A copy the view does not give
//! this node is judged on a linearizable read of its record and dropped, set aside or kept
//! ([`ClusterNode::retire_copy`], also used by a move's pull for a copy already there); a dead
//! move's fence naming this node as taker is lifted; a new primary's replication and the old
//! primary's part of a hand-over are started; handles nothing uses any more are forgotten.

use std::sync::Arc;
use std::time::Duration;

use tarn_cluster::{ClusterState, ShardName};

use crate::cluster::ClusterNode;

/// Keeps the local shards in line with the map, for the life of the node. A local copy the
/// view does not give this node (as owner, or as the taker of a move) is judged on a
/// linearizable read of its record ([`ClusterNode::retire_copy`]): dropped only if its
/// collection was dropped or another node holds its data; set aside if the store has no record
/// of it or its data was given up; left alone if its collection's record is unreadable or etcd
/// cannot be read, or while another task holds its lock (tried again a few seconds later).
/// Copies being pulled in by a move are left alone. A fence naming this node as the taker of a
/// shard it is not copying (the move died with this process) is lifted: the old owner serves
/// the shard again at the next epoch. A hand-over's fence (it names a replica) is the old
/// primary's to settle: this node starts its part when it is that primary.
pub(crate) async fn reconcile(node: std::sync::Weak<ClusterNode>) {
    let Some(mut state) = node.upgrade().map(|n| n.state.clone()) else {
        return;
    };
    loop {
        let current = Arc::clone(&state.borrow_and_update());
        let Some(node) = node.upgrade() else {
            return;
        };
        if node.check_store_history().is_err() {
            // Fenced: nothing is judged, lifted or started until the node restarts.
            drop(node);
            if state.changed().await.is_err() {
                return;
            }
            continue;
        }
        // What this directory holds at which epoch, recorded before anything is acted on.
        let held: Vec<(String, u64)> = node
            .registry
            .shard_names()
            .into_iter()
            .filter_map(|local| {
                let (shard, _) = ShardName::parse(&local)?;
                let a = current.assignment(&shard)?;
                let mine = a.role_of(&node.node_id).is_some()
                    || a.moving_to.as_deref() == Some(&node.node_id);
                mine.then_some((local, a.epoch))
            })
            .collect();
        let revision = current.revision;
        let witness = current.witness.clone();
        if let Err(error) = node
            .note_ledger(move |ledger| ledger.note_held(revision, witness, held))
            .await
        {
            tracing::error!(%error, "cannot write the cluster ledger; local copies are judged again later");
            drop(node);
            if let Ok(Err(_)) = tokio::time::timeout(RECONCILE_RETRY, state.changed()).await {
                return;
            }
            continue;
        }
        // Test builds: acting on this view late (`cluster::reconcile=return(ms)`), as a node
        // under load would, while the map moves on.
        crate::faults::pause_point("cluster::reconcile").await;
        let mut undecided = false;
        for local in node.registry.shard_names() {
            let Some((shard, _)) = ShardName::parse(&local) else {
                continue;
            };
            if current.revision == 0 || current.unreadable.contains_key(&shard.collection) {
                continue;
            }
            // A copy the record lists is judged too when the record is older than the epoch
            // this directory held it at (etcd restored from an older backup).
            let mine = current.assignment(&shard).is_some_and(|a| {
                (a.role_of(&node.node_id).is_some()
                    || a.moving_to.as_deref() == Some(&node.node_id))
                    && a.epoch >= node.ledger.held_epoch(&local)
            });
            if mine {
                continue;
            }
            // A copy being seeded or pulled here that the map no longer gives this node (a
            // replica dropped while its seed runs): judged once the seed or pull is over, which
            // no change of the map may come to announce.
            if node.incoming.contains_key(&local) {
                undecided = true;
                continue;
            }
            // A pull holds the lock for its whole run: leave the copy to it. Other holders
            // (an append from a primary whose view still names this node, a seed) hold it
            // briefly: the copy is judged again after `RECONCILE_RETRY`, since no later change
            // of the map may come to wake this loop.
            let lock = node.copy_lock(&local);
            let Ok(_copy) = lock.try_lock() else {
                undecided = true;
                continue;
            };
            undecided |= !node.retire_copy(&local, &shard).await;
        }
        for map in current.collections.values() {
            for (shard, assignment) in map.shards.iter().enumerate() {
                let name = ShardName {
                    collection: map.def.name.clone(),
                    uid: map.def.uid,
                    shard: shard as u32,
                };
                if assignment.moving_to.as_deref() == Some(node.node_id.as_str())
                    && !assignment.is_replica_handover()
                    && !node.incoming.contains_key(&name.local_name())
                {
                    crate::transfer::lift_fence(&node, &name, assignment).await;
                }
            }
        }
        node.forget_unused_handles(&current);
        node.forget_replications(&current);
        node.start_replications(&current).await;
        crate::transfer::start_handovers(&node);
        drop(node);
        let changed = state.changed();
        if undecided {
            if let Ok(Err(_)) = tokio::time::timeout(RECONCILE_RETRY, changed).await {
                return;
            }
        } else if changed.await.is_err() {
            return;
        }
    }
}

/// How soon reconciliation tries again a copy whose record it could not read.
const RECONCILE_RETRY: Duration = Duration::from_secs(5);

impl ClusterNode {
    /// Decides, from a linearizable read of the shard's record, what becomes of a local copy
    /// the view does not give this node, and does it ([`tarn_cluster::fate_of_copy`]): drops
    /// it, sets it aside, or keeps it. The caller holds the copy's lock. `Ok(false)` when the
    /// record could not be read (nothing was done; try again later).
    pub(crate) async fn retire_copy(&self, local: &str, shard: &ShardName) -> bool {
        if self.incoming.contains_key(local) {
            return true;
        }
        if self.check_store_history().is_err() {
            return false;
        }
        let evidence = match self
            .store
            .read_copy_evidence(&shard.collection, shard.uid, shard.shard)
            .await
        {
            Ok(evidence) => evidence,
            Err(error) => {
                tracing::warn!(shard = %local, %error, "cannot read the shard's record; its local copy stays until it can be read");
                return false;
            }
        };
        // A store that lost this cluster's history judges nothing (the watch fences the node).
        let seen = self.ledger.revision();
        if evidence.cluster_id.as_deref() != Some(self.cluster_id.as_str())
            || evidence.revision < seen
        {
            tracing::error!(shard = %local, cluster_id = ?evidence.cluster_id,
                revision = evidence.revision, seen,
                "the cluster's store does not hold this cluster's history; the local copy stays as it is");
            return false;
        }
        let held = self.ledger.held_epoch(local);
        match tarn_cluster::fate_of_copy(&self.node_id, shard, held, &evidence) {
            tarn_cluster::CopyFate::Keep => true,
            tarn_cluster::CopyFate::Undecided(why) => {
                tracing::info!(shard = %local, %why, "a local copy stays out of service for now");
                false
            }
            tarn_cluster::CopyFate::Drop(why) => {
                tracing::info!(shard = %local, %why, "dropping a local shard");
                // Recorded first: a shard whose copy was deleted here is never started empty
                // here again, whatever an older record says.
                let (name, revision) = (local.to_owned(), evidence.revision);
                let epoch = match &evidence.record {
                    tarn_cluster::ShardRecord::Assigned(a) => a.epoch,
                    _ => u64::MAX,
                };
                if let Err(error) = self
                    .note_ledger(move |l| l.note_dropped(&name, revision, epoch))
                    .await
                {
                    tracing::error!(shard = %local, %error, "could not record the drop; the copy stays");
                    return false;
                }
                if let Err(error) = self.registry.drop_shard(local).await {
                    tracing::error!(shard = %local, %error, "could not drop a shard");
                    return false;
                }
                self.gates.remove(local);
                true
            }
            tarn_cluster::CopyFate::SetAside(why) => {
                tracing::warn!(shard = %local, %why, "setting a local shard aside (not deleted: `tarn cluster set-aside list`)");
                match self.registry.set_aside(local, &why).await {
                    Ok(path) => {
                        tracing::warn!(shard = %local, path = %path.display(), "local shard set aside");
                        self.gates.remove(local);
                        let name = local.to_owned();
                        if let Err(error) = self.note_ledger(move |l| l.note_set_aside(&name)).await
                        {
                            tracing::warn!(shard = %local, %error, "could not update the ledger");
                        }
                        true
                    }
                    Err(error) => {
                        tracing::error!(shard = %local, %error, "could not set a shard aside");
                        false
                    }
                }
            }
        }
    }

    /// Forgets write gates, copy locks and client connections nothing uses any more: shards
    /// neither local nor in the map, and nodes that left.
    fn forget_unused_handles(&self, state: &ClusterState) {
        let in_map = |local: &str| {
            ShardName::parse(local).is_some_and(|(shard, _)| state.collection_of(&shard).is_some())
        };
        let used = |local: &str| self.registry.get_shard(local).is_ok() || in_map(local);
        self.gates
            .retain(|local, gate| used(local) || Arc::strong_count(gate) > 1);
        self.copy_locks
            .retain(|local, lock| used(local) || Arc::strong_count(lock) > 1);
        let addresses: std::collections::HashSet<&str> =
            state.nodes.values().map(|n| n.address.as_str()).collect();
        self.peers
            .retain(|address, _| addresses.contains(address.as_str()));
    }
}
