//! A shard's copies: which role each copy has, and every transition between roles, written
//! down once (docs/CLUSTER.md, "Replicas", has the same table). Each transition is a new
//! [`ShardAssignment`] that a node writes with a compare-and-swap of the whole record
//! ([`crate::ShardSwap::expected`]), so two nodes that decide from the same record cannot both
//! land, and nothing is decided from a record that changed since it was read.
//!
//! | from | to | who | when | epoch |
//! |---|---|---|---|---|
//! | (none) | catching-up replica | placement coordinator | the shard has fewer copies than its replication factor (a new collection, re-replication, the first step of a move) | same |
//! | catching-up replica | in-sync replica | primary | the replica has durably appended everything the primary acknowledged (Patroni's rule) | same |
//! | in-sync replica | catching-up replica | primary | the replica failed to answer a shipped entry within the bound, BEFORE any write is acknowledged without it | same |
//! | in-sync replica | primary | placement coordinator | the primary's registration is gone from etcd (its lease lapsed) | next |
//! | primary | catching-up replica | (the promotion above) | the old primary returns: it cuts its log back to what the new primary holds, then catches up | next |
//! | replica | (none) | placement coordinator | the copy is surplus (the last step of a move) or its node was forgotten | same |
//!
//! The in-sync set only changes by these compare-and-swaps, so a promotion (which requires the
//! candidate to be in it) can only pick a copy that held every acknowledged write at the moment
//! of the swap.

use std::collections::BTreeMap;

use crate::map::{ClusterState, ShardAssignment};

/// The role of one node's copy of a shard, as a shard's record says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CopyRole {
    /// The owner: assigns sequence numbers, ships entries, acknowledges writes.
    Primary,
    /// Holds every acknowledged write; may be promoted.
    InSyncReplica,
    /// Follows the primary but may lack acknowledged writes: never promoted, never waited for.
    CatchingUp,
}

/// Why a shard refuses writes, with what a client is told.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TooFewInSync {
    /// Copies in sync, the primary included.
    pub in_sync: u32,
    pub min_in_sync: u32,
}

impl std::fmt::Display for TooFewInSync {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} of the shard's copies are in sync, and writes need {}",
            self.in_sync, self.min_in_sync
        )
    }
}

impl ShardAssignment {
    /// The role of `node`'s copy, if it has one.
    pub fn role_of(&self, node: &str) -> Option<CopyRole> {
        if self.owner == node {
            Some(CopyRole::Primary)
        } else if self.in_sync_replicas.iter().any(|n| n == node) {
            Some(CopyRole::InSyncReplica)
        } else if self.replicas.iter().any(|n| n == node) {
            Some(CopyRole::CatchingUp)
        } else {
            None
        }
    }

    /// Every node that holds a copy: the owner first, then the replicas.
    pub fn copies(&self) -> impl Iterator<Item = &str> {
        std::iter::once(self.owner.as_str()).chain(self.replicas.iter().map(String::as_str))
    }

    /// The copies in sync, the owner first.
    pub fn in_sync(&self) -> impl Iterator<Item = &str> {
        std::iter::once(self.owner.as_str()).chain(self.in_sync_replicas.iter().map(String::as_str))
    }

    /// Copies in sync, the owner included.
    pub fn n_in_sync(&self) -> u32 {
        1 + self.in_sync_replicas.len() as u32
    }

    /// Whether the shard may take writes with `min_in_sync` copies required.
    pub fn check_in_sync(&self, min_in_sync: u32) -> Result<(), TooFewInSync> {
        if self.n_in_sync() >= min_in_sync {
            Ok(())
        } else {
            Err(TooFewInSync {
                in_sync: self.n_in_sync(),
                min_in_sync,
            })
        }
    }

    /// A new replica on `node`, catching up (not in sync). `None` if `node` holds a copy.
    pub fn with_replica(&self, node: &str) -> Option<ShardAssignment> {
        if self.role_of(node).is_some() {
            return None;
        }
        let mut next = self.clone();
        next.replicas.push(node.to_owned());
        next.given_up.retain(|n| n != node);
        Some(next)
    }

    /// `node`'s replica joins the in-sync set. `None` unless it is a catching-up replica.
    pub fn with_in_sync(&self, node: &str) -> Option<ShardAssignment> {
        if self.role_of(node) != Some(CopyRole::CatchingUp) {
            return None;
        }
        let mut next = self.clone();
        next.in_sync_replicas.push(node.to_owned());
        Some(next)
    }

    /// `node`'s replica leaves the in-sync set (it stays a replica and catches up). `None`
    /// unless it is an in-sync replica.
    pub fn without_in_sync(&self, node: &str) -> Option<ShardAssignment> {
        if self.role_of(node) != Some(CopyRole::InSyncReplica) {
            return None;
        }
        let mut next = self.clone();
        next.in_sync_replicas.retain(|n| n != node);
        Some(next)
    }

    /// `node`'s replica is dropped. `None` unless it is a replica.
    pub fn without_replica(&self, node: &str) -> Option<ShardAssignment> {
        match self.role_of(node) {
            Some(CopyRole::InSyncReplica | CopyRole::CatchingUp) => {
                let mut next = self.clone();
                next.replicas.retain(|n| n != node);
                next.in_sync_replicas.retain(|n| n != node);
                Some(next)
            }
            _ => None,
        }
    }

    /// Failover: the in-sync replica `candidate` becomes the primary at the next epoch; the old
    /// primary stays a replica, out of the in-sync set (when it returns it cuts its log back to
    /// what the new primary holds and catches up). `None` unless `candidate` is in sync and the
    /// shard is serving (a fenced shard is in a move's hand-over, which settles it).
    pub fn promoted(&self, candidate: &str) -> Option<ShardAssignment> {
        if self.role_of(candidate) != Some(CopyRole::InSyncReplica) || !self.takes_writes() {
            return None;
        }
        let mut next = self.clone();
        next.replicas.retain(|n| n != candidate);
        next.replicas.push(self.owner.clone());
        next.in_sync_replicas.retain(|n| n != candidate);
        next.owner = candidate.to_owned();
        next.epoch = self.epoch + 1;
        next.create_on = None;
        Some(next)
    }
}

/// A failover the placement coordinator should try: the shard's primary is dead to the
/// cluster and an in-sync replica is alive.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedPromotion {
    pub collection: String,
    pub uid: u64,
    pub shard: u32,
    /// The record the promotion is decided from: the swap lands only if it is unchanged.
    pub from: ShardAssignment,
    /// The record to write.
    pub to: ShardAssignment,
    /// The dead primary: the swap also requires its registration to be absent in the store.
    pub dead_primary: String,
}

/// Every failover the state calls for: each serving shard whose primary is not alive and that
/// has an alive in-sync replica gets that replica promoted (the one that is primary of the
/// fewest shards, ties by node id, so a dead node's shards spread over the survivors). A shard
/// with no alive in-sync replica gets nothing: promoting a copy that may lack acknowledged
/// writes would lose them, so it waits for a copy that has them.
pub fn plan_promotions(state: &ClusterState) -> Vec<PlannedPromotion> {
    let mut primaries: BTreeMap<&str, usize> = state.nodes.keys().map(|n| (&**n, 0)).collect();
    for map in state.collections.values() {
        for shard in &map.shards {
            if let Some(n) = primaries.get_mut(shard.owner.as_str()) {
                *n += 1;
            }
        }
    }
    let mut planned = Vec::new();
    for (name, map) in &state.collections {
        for (shard_idx, shard) in map.shards.iter().enumerate() {
            if state.is_alive(&shard.owner) || !shard.takes_writes() {
                continue;
            }
            let candidate = shard
                .in_sync_replicas
                .iter()
                .filter(|n| state.is_alive(n))
                .min_by_key(|n| (primaries.get(n.as_str()).copied().unwrap_or(0), n.as_str()));
            let Some(candidate) = candidate else {
                continue;
            };
            let Some(to) = shard.promoted(candidate) else {
                continue;
            };
            if let Some(n) = primaries.get_mut(candidate.as_str()) {
                *n += 1;
            }
            planned.push(PlannedPromotion {
                collection: name.clone(),
                uid: map.def.uid,
                shard: shard_idx as u32,
                from: shard.clone(),
                to,
                dead_primary: shard.owner.clone(),
            });
        }
    }
    planned
}

/// Refuses a replication factor the cluster cannot place: more copies than live nodes (two
/// copies of a shard never share a node), or a `min_in_sync` above it. Returns the effective
/// `(replication_factor, min_in_sync)`: 0 means the default (`default_factor`, and
/// `replication_factor - 1` but at least 1).
pub fn replication_settings(
    replication_factor: u32,
    min_in_sync: u32,
    default_factor: u32,
    live_nodes: usize,
) -> Result<(u32, u32), String> {
    let factor = if replication_factor == 0 {
        default_factor.max(1)
    } else {
        replication_factor
    };
    if factor as usize > live_nodes {
        return Err(format!(
            "replication_factor {factor} needs {factor} live nodes, and the cluster has \
             {live_nodes}"
        ));
    }
    let min = if min_in_sync == 0 {
        factor.saturating_sub(1).max(1)
    } else {
        min_in_sync
    };
    if min > factor {
        return Err(format!(
            "min_in_sync {min} is above replication_factor {factor}"
        ));
    }
    Ok((factor, min))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::map::{CollectionDef, CollectionMap, NodeInfo, ShardKey};

    fn shard(owner: &str, replicas: &[&str], in_sync: &[&str]) -> ShardAssignment {
        ShardAssignment {
            replicas: replicas.iter().map(|n| (*n).to_owned()).collect(),
            in_sync_replicas: in_sync.iter().map(|n| (*n).to_owned()).collect(),
            ..ShardAssignment::serving(owner, 5)
        }
    }

    #[test]
    fn transitions_follow_the_table_and_refuse_everything_else() {
        let s = shard("n1", &["n2", "n3"], &["n2"]);
        assert_eq!(s.role_of("n1"), Some(CopyRole::Primary));
        assert_eq!(s.role_of("n2"), Some(CopyRole::InSyncReplica));
        assert_eq!(s.role_of("n3"), Some(CopyRole::CatchingUp));
        assert_eq!(s.role_of("n4"), None);
        assert_eq!(s.n_in_sync(), 2);
        assert_eq!(s.in_sync().collect::<Vec<_>>(), ["n1", "n2"]);
        assert_eq!(s.copies().collect::<Vec<_>>(), ["n1", "n2", "n3"]);

        // Joining: only a catching-up replica; leaving: only an in-sync one.
        let joined = s.with_in_sync("n3").unwrap();
        assert_eq!(joined.n_in_sync(), 3);
        assert_eq!(joined.epoch, s.epoch, "in-sync changes keep the epoch");
        assert!(s.with_in_sync("n2").is_none());
        assert!(s.with_in_sync("n1").is_none());
        assert!(s.with_in_sync("n4").is_none());
        let left = s.without_in_sync("n2").unwrap();
        assert_eq!(left.role_of("n2"), Some(CopyRole::CatchingUp));
        assert!(s.without_in_sync("n3").is_none());
        assert!(s.without_in_sync("n1").is_none());

        // Adding and dropping replicas.
        assert!(s.with_replica("n2").is_none());
        assert!(s.with_replica("n1").is_none());
        let added = s.with_replica("n4").unwrap();
        assert_eq!(added.role_of("n4"), Some(CopyRole::CatchingUp));
        let dropped = s.without_replica("n2").unwrap();
        assert_eq!(dropped.role_of("n2"), None);
        assert_eq!(dropped.n_in_sync(), 1);
        assert!(s.without_replica("n1").is_none());

        // Promotion: only an in-sync replica of a serving shard, at the next epoch; the old
        // primary is a catching-up replica.
        let p = s.promoted("n2").unwrap();
        assert_eq!(p.owner, "n2");
        assert_eq!(p.epoch, s.epoch + 1);
        assert_eq!(p.role_of("n1"), Some(CopyRole::CatchingUp));
        assert_eq!(p.role_of("n3"), Some(CopyRole::CatchingUp));
        assert_eq!(p.n_in_sync(), 1);
        assert!(
            s.promoted("n3").is_none(),
            "a catching-up copy is never promoted"
        );
        assert!(s.promoted("n1").is_none());
        assert!(s.fenced_for("n4").promoted("n2").is_none());
    }

    #[test]
    fn writes_need_min_in_sync_copies() {
        let s = shard("n1", &["n2", "n3"], &["n2"]);
        assert!(s.check_in_sync(2).is_ok());
        let refused = s.check_in_sync(3).unwrap_err();
        assert_eq!(refused.in_sync, 2);
        assert_eq!(
            refused.to_string(),
            "2 of the shard's copies are in sync, and writes need 3"
        );
    }

    #[test]
    fn forget_gives_up_the_replicas_copies_too() {
        let s = shard("n1", &["n2"], &["n2"]);
        let given = s.given_up_to("n3", "dir-n3");
        assert_eq!(given.given_up, vec!["n1".to_owned(), "n2".to_owned()]);
        assert!(given.replicas.is_empty() && given.in_sync_replicas.is_empty());
        // A node given up that is added back as a replica holds a fresh copy.
        let back = given.with_replica("n2").unwrap();
        assert_eq!(back.given_up, vec!["n1".to_owned()]);
    }

    fn state(alive: &[&str], shards: Vec<ShardAssignment>) -> ClusterState {
        let mut state = ClusterState::default();
        for n in alive {
            state.nodes.insert(
                (*n).to_owned(),
                NodeInfo {
                    node_id: (*n).to_owned(),
                    address: String::new(),
                    incarnation: String::new(),
                },
            );
        }
        state.collections.insert(
            "c".into(),
            CollectionMap {
                def: CollectionDef {
                    name: "c".into(),
                    uid: 9,
                    n_shards: shards.len() as u32,
                    shard_key: ShardKey::User,
                    config: serde_json::Value::Null,
                    replication_factor: 3,
                    min_in_sync: 2,
                },
                shards,
            },
        );
        state
    }

    #[test]
    fn a_dead_primary_is_replaced_by_an_alive_in_sync_replica_only() {
        let shards = vec![
            shard("n1", &["n2", "n3"], &["n2", "n3"]),
            shard("n1", &["n2", "n3"], &["n3"]),
            shard("n1", &["n2", "n3"], &[]),
            shard("n2", &["n1", "n3"], &["n1"]),
            shard("n1", &["n2"], &["n2"]).fenced_for("n3"),
        ];
        // n1 dead: shard 0 and 1 promoted, shard 2 (no in-sync replica) waits, shard 3 is
        // n2's, shard 4 is fenced (a move settles it).
        let planned = plan_promotions(&state(&["n2", "n3"], shards.clone()));
        let promoted: Vec<(u32, &str)> = planned
            .iter()
            .map(|p| (p.shard, p.to.owner.as_str()))
            .collect();
        // Shard 0 could go to n2 or n3: n3 is primary of fewer shards (n2 has shard 3).
        assert_eq!(promoted, [(0, "n3"), (1, "n3")]);
        for p in &planned {
            assert_eq!(p.dead_primary, "n1");
            assert_eq!(p.uid, 9);
            assert_eq!(p.from, shards[p.shard as usize]);
            assert_eq!(p.to.epoch, p.from.epoch + 1);
        }
        // Only dead in-sync replicas: nothing.
        assert!(plan_promotions(&state(&["n2"], vec![shards[1].clone()])).is_empty());
        // Everyone alive: nothing.
        assert!(plan_promotions(&state(&["n1", "n2", "n3"], shards)).is_empty());
    }

    #[test]
    fn replication_settings_refuse_what_cannot_be_placed() {
        assert_eq!(replication_settings(0, 0, 2, 3), Ok((2, 1)));
        assert_eq!(replication_settings(0, 0, 1, 1), Ok((1, 1)));
        assert_eq!(replication_settings(3, 0, 2, 3), Ok((3, 2)));
        assert_eq!(replication_settings(3, 3, 2, 3), Ok((3, 3)));
        assert_eq!(
            replication_settings(4, 0, 2, 3).unwrap_err(),
            "replication_factor 4 needs 4 live nodes, and the cluster has 3"
        );
        assert_eq!(
            replication_settings(2, 3, 2, 3).unwrap_err(),
            "min_in_sync 3 is above replication_factor 2"
        );
    }
}
