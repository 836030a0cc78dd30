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
//! | in-sync replica | catching-up replica | placement coordinator, or the primary at a write | its node is registered from another data directory than the one recorded for the copy (a wiped or replaced disk) | same |
//! | in-sync replica | primary | placement coordinator | the primary's registration is gone from etcd (its lease lapsed), or comes from another data directory than the one recorded for its copy | next |
//! | primary | catching-up replica | (the promotion above) | the old primary returns: it cuts its log back to what the new primary holds (or, on a new disk, is seeded), then catches up | next |
//! | primary | primary, fenced for a hand-over | placement coordinator | the primary must move (its node drains, or primaries are unbalanced) and an in-sync replica can take over | same |
//! | primary, fenced for a hand-over | in-sync replica | old primary | it drained its writes (its gate, exclusively) and every in-sync replica holds its whole log: the fence's replica is promoted in the same swap | next |
//! | in-sync replica | primary | (the hand-over above) | | next |
//! | primary, fenced for a hand-over | primary | the old primary, or the coordinator | the hand-over failed (the replica dead or late, the old primary dead, past its limit) | next |
//! | replica | (none) | placement coordinator | the copy is surplus (the last step of a move) or its node was forgotten | same |
//!
//! The in-sync set only changes by these compare-and-swaps, so a promotion (which requires the
//! candidate to be in it) can only pick a copy that held every acknowledged write at the moment
//! of the swap.
//!
//! In sync means in sync on one disk: the record keeps, for the owner and each in-sync replica,
//! the data directory token ([`crate::NodeInfo::incarnation`]) that held the copy when it
//! became primary or joined the in-sync set ([`ShardAssignment::incarnations`]). A node that
//! comes back with the same id on another directory (its disk wiped or replaced) holds no copy:
//! it is never promoted, never read from as in sync and never counted for `min_in_sync`
//! ([`ClusterState::holds_in_sync_copy`]); a primary in that state is dead for the shard
//! ([`plan_promotions`]), and a replica leaves the in-sync set ([`plan_replaced_copies`]) and is
//! seeded again. A copy with no token recorded (a record of an older tarn) is unknown, and its
//! node's current registration is accepted: refusing it would leave every shard of an upgraded
//! cluster without failover (its replicas never rejoin while they stay in sync), and accepting
//! it keeps exactly what such a record meant before; the token is recorded at the copy's next
//! join, promotion or move.

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

/// Whether a node registered from the data directory `registered` is on another disk than the
/// one `recorded` for its copy. Unknown on either side (empty: a record of an older tarn, a
/// node of an older tarn that registers no token) is no evidence: `false`.
pub fn is_another_directory(recorded: &str, registered: &str) -> bool {
    !recorded.is_empty() && !registered.is_empty() && recorded != registered
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

    /// The data directory token recorded for `node`'s in-sync copy (the owner's included), if
    /// one was.
    pub fn incarnation_of(&self, node: &str) -> Option<&str> {
        self.incarnations.get(node).map(String::as_str)
    }

    /// Whether `node`'s copy, in sync by this record (or the primary), is gone: the node is
    /// registered from the data directory `registered`, which is not the one recorded for the
    /// copy ([`is_another_directory`]). `false` for a copy with no token recorded.
    pub fn copy_replaced(&self, node: &str, registered: &str) -> bool {
        self.incarnation_of(node)
            .is_some_and(|recorded| is_another_directory(recorded, registered))
    }

    /// Records that the data directory `incarnation` holds `node`'s copy (nothing for an empty,
    /// unknown token).
    pub(crate) fn record_incarnation(&mut self, node: &str, incarnation: &str) {
        if incarnation.is_empty() {
            self.incarnations.remove(node);
        } else {
            self.incarnations
                .insert(node.to_owned(), incarnation.to_owned());
        }
    }

    /// Copies in sync, the owner included.
    pub fn n_in_sync(&self) -> u32 {
        1 + self.in_sync_replicas.len() as u32
    }

    /// Whether the shard is kept in one copy only (no replicas, and none required with
    /// `min_in_sync`): what it logs is committed once durable on its primary, and it runs no
    /// replication.
    pub fn one_copy(&self, min_in_sync: u32) -> bool {
        self.replicas.is_empty() && min_in_sync <= 1
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
        next.incarnations.remove(node);
        Some(next)
    }

    /// `node`'s replica joins the in-sync set, its copy held by the data directory
    /// `incarnation` (the token of the process that acknowledged everything; empty: unknown,
    /// nothing recorded). `None` unless it is a catching-up replica.
    pub fn with_in_sync(&self, node: &str, incarnation: &str) -> Option<ShardAssignment> {
        if self.role_of(node) != Some(CopyRole::CatchingUp) {
            return None;
        }
        let mut next = self.clone();
        next.in_sync_replicas.push(node.to_owned());
        next.record_incarnation(node, incarnation);
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
        next.incarnations.remove(node);
        Some(next)
    }

    /// `node`'s replica is dropped. `None` unless it is a replica.
    pub fn without_replica(&self, node: &str) -> Option<ShardAssignment> {
        match self.role_of(node) {
            Some(CopyRole::InSyncReplica | CopyRole::CatchingUp) => {
                let mut next = self.clone();
                next.replicas.retain(|n| n != node);
                next.in_sync_replicas.retain(|n| n != node);
                next.incarnations.remove(node);
                Some(next)
            }
            _ => None,
        }
    }

    /// Failover: the in-sync replica `candidate` becomes the primary at the next epoch (its copy
    /// on the data directory recorded for it); the old primary stays a replica, out of the
    /// in-sync set (when it returns it cuts its log back to what the new primary holds and
    /// catches up). `None` unless `candidate` is in sync and the shard is serving (a fenced
    /// shard is in a move's hand-over, which settles it).
    pub fn promoted(&self, candidate: &str) -> Option<ShardAssignment> {
        if self.role_of(candidate) != Some(CopyRole::InSyncReplica) || !self.takes_writes() {
            return None;
        }
        let mut next = self.clone();
        next.replicas.retain(|n| n != candidate);
        next.replicas.push(self.owner.clone());
        next.in_sync_replicas.retain(|n| n != candidate);
        next.incarnations.remove(&self.owner);
        next.owner = candidate.to_owned();
        next.epoch = self.epoch + 1;
        next.create_on = None;
        Some(next)
    }

    /// The first step of a planned hand-over of the primary to its in-sync replica `to`: the
    /// shard is fenced (every node refuses its writes, routers retry) at the SAME epoch, so
    /// that the primary's replication at that epoch goes on shipping its last entries to the
    /// replicas while it drains. `None` unless the shard is serving and `to` is in sync.
    pub fn handover_fenced(&self, to: &str) -> Option<ShardAssignment> {
        if self.role_of(to) != Some(CopyRole::InSyncReplica) || !self.takes_writes() {
            return None;
        }
        Some(ShardAssignment {
            state: crate::map::ShardState::Fenced,
            moving_to: Some(to.to_owned()),
            ..self.clone()
        })
    }

    /// Whether this record is a hand-over's fence ([`ShardAssignment::handover_fenced`]): fenced
    /// for a node that holds a replica copy (a move's taker never holds a copy).
    pub fn is_replica_handover(&self) -> bool {
        !self.takes_writes()
            && self.moving_to.as_deref().is_some_and(|to| {
                matches!(
                    self.role_of(to),
                    Some(CopyRole::InSyncReplica | CopyRole::CatchingUp)
                )
            })
    }

    /// The last step of a planned hand-over, written by the old primary once it has drained
    /// its writes and every in-sync replica holds its whole log: the fence's replica is the
    /// primary at the next epoch, and the old primary an in-sync replica whose copy is held by
    /// its data directory `old_primary_incarnation` (its log is the new primary's, entry for
    /// entry). `None` unless this is a hand-over's fence whose replica is still in sync.
    pub fn handed_to_replica(&self, old_primary_incarnation: &str) -> Option<ShardAssignment> {
        let to = self.moving_to.as_deref()?;
        if self.takes_writes() || self.role_of(to) != Some(CopyRole::InSyncReplica) {
            return None;
        }
        let mut next = self.clone();
        next.state = crate::map::ShardState::Serving;
        next.moving_to = None;
        next.replicas.retain(|n| n != to);
        next.replicas.push(self.owner.clone());
        next.in_sync_replicas.retain(|n| n != to);
        next.in_sync_replicas.push(self.owner.clone());
        next.record_incarnation(&self.owner, old_primary_incarnation);
        next.owner = to.to_owned();
        next.epoch = self.epoch + 1;
        next.create_on = None;
        Some(next)
    }
}

impl ClusterState {
    /// Whether `node` holds an in-sync copy of the shard `a` that can answer and be promoted:
    /// it is the owner or an in-sync replica, it is alive, and it is registered from the data
    /// directory recorded for that copy (or none is recorded).
    pub fn holds_in_sync_copy(&self, a: &ShardAssignment, node: &str) -> bool {
        a.in_sync().any(|n| n == node)
            && self
                .nodes
                .get(node)
                .is_some_and(|info| !a.copy_replaced(node, &info.incarnation))
    }

    /// Whether `node`'s copy of the shard `a`, the owner's or an in-sync replica's, is gone:
    /// the node is registered from another data directory than the one recorded for the copy.
    pub fn copy_replaced(&self, a: &ShardAssignment, node: &str) -> bool {
        self.nodes
            .get(node)
            .is_some_and(|info| a.copy_replaced(node, &info.incarnation))
    }
}

/// A failover the placement coordinator should try: the shard's primary is dead to the
/// cluster (or back on another disk) and an in-sync replica is alive.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedPromotion {
    pub collection: String,
    pub uid: u64,
    pub shard: u32,
    /// The record the promotion is decided from: the swap lands only if it is unchanged.
    pub from: ShardAssignment,
    /// The record to write.
    pub to: ShardAssignment,
    /// The dead primary: the swap also requires that the store holds no registration of it
    /// from `dead_primary_incarnation`.
    pub dead_primary: String,
    /// The data directory recorded for the dead primary's copy: a registration of the primary
    /// from another directory (its disk wiped or replaced) holds no copy and does not stop the
    /// promotion. `None` (nothing recorded): any registration stops it.
    pub dead_primary_incarnation: Option<String>,
}

/// Every failover the state calls for: each serving shard whose primary is not alive, or is
/// registered from another data directory than the one recorded for its copy (it came back
/// on a wiped or replaced disk and holds nothing), and that has an alive in-sync replica on its
/// recorded directory ([`ClusterState::holds_in_sync_copy`]) gets that replica promoted (the
/// one that is primary of the fewest shards, ties by node id, so a dead node's shards spread
/// over the survivors). A shard with no such replica gets nothing: promoting a copy that may
/// lack acknowledged writes (or holds none) would lose them, so it waits for a copy that has
/// them.
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
            if state.holds_in_sync_copy(shard, &shard.owner) || !shard.takes_writes() {
                continue;
            }
            let candidate = shard
                .in_sync_replicas
                .iter()
                .filter(|n| state.holds_in_sync_copy(shard, n))
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
                dead_primary_incarnation: shard.incarnation_of(&shard.owner).map(str::to_owned),
            });
        }
    }
    planned
}

/// An in-sync replica whose copy is gone, to take out of the in-sync set
/// ([`plan_replaced_copies`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedLeave {
    pub collection: String,
    pub uid: u64,
    pub shard: u32,
    /// The record the change is decided from: the swap lands only if it is unchanged.
    pub from: ShardAssignment,
    /// The record to write: `replica` catching up.
    pub to: ShardAssignment,
    pub replica: String,
}

/// Every in-sync replica of a serving shard whose node is registered from another data
/// directory than the one recorded for its copy (it came back on a wiped or replaced disk):
/// each leaves the in-sync set (one per shard at a time: each swap compares the whole record).
/// Its primary's follower then finds it without a copy and seeds it, and it joins again with
/// its new directory recorded. A fenced shard is left to its move's hand-over.
pub fn plan_replaced_copies(state: &ClusterState) -> Vec<PlannedLeave> {
    let mut planned = Vec::new();
    for (name, map) in &state.collections {
        for (shard_idx, shard) in map.shards.iter().enumerate() {
            if !shard.takes_writes() {
                continue;
            }
            let replaced = shard
                .in_sync_replicas
                .iter()
                .find(|n| state.copy_replaced(shard, n));
            let Some(replica) = replaced else {
                continue;
            };
            let Some(to) = shard.without_in_sync(replica) else {
                continue;
            };
            planned.push(PlannedLeave {
                collection: name.clone(),
                uid: map.def.uid,
                shard: shard_idx as u32,
                from: shard.clone(),
                to,
                replica: replica.clone(),
            });
        }
    }
    planned
}

/// What a planned hand-over of a shard's primary does next ([`plan_handover`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HandoverStep {
    /// No in-sync replica can take the shard over: first a new replica on this node (the
    /// primary seeds it; it joins the in-sync set once it has everything, and a later round
    /// hands the shard over to it).
    AddReplica(String),
    /// Fence the shard for a hand-over to this in-sync replica
    /// ([`ShardAssignment::handover_fenced`]); its primary then drains and promotes it.
    Fence(String),
    /// Drop this node's replica: the shard has a copy more than its factor, every copy in sync
    /// (a balancing hand-over's old primary stays a replica until then).
    DropReplica(String),
}

/// One step of moving a replicated shard's primary, as the placement coordinator plans it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedHandover {
    pub collection: String,
    pub uid: u64,
    pub shard: u32,
    /// The record the step is decided from: its swap lands only if it is unchanged.
    pub from: ShardAssignment,
    /// The record to write.
    pub to: ShardAssignment,
    pub step: HandoverStep,
    /// The primary's node is draining (else the step balances primaries).
    pub draining: bool,
}

/// The next step that moves the primary of a shard of a replicated collection
/// (`replication_factor` > 1) where the placement rule wants it, or `None`. A replicated
/// shard's primary never moves by copying: one of its in-sync replicas takes over
/// ([`HandoverStep::Fence`]), and a draining node's copy, a replica from then on, leaves like
/// any replica on a draining node (add a copy elsewhere first, then drop it). The rule, per
/// collection, as `plan_move`'s for collections of one copy: no primary on a draining node
/// (first), then primary counts over the live nodes that are not draining differing by at most
/// one. A draining primary goes to its in-sync replica (alive on its recorded disk, not
/// draining) that leads the fewest of the collection's shards; with none, a new replica is
/// added first on the live node without a copy of the shard that holds the fewest copies
/// (only while the shard has at most `replication_factor` copies: one added already is waited
/// for). Balancing promotes an in-sync replica: from the node leading the most shards to a
/// replica leading two fewer or less; where no such replica exists (a node that joined holds no
/// copy), a replica is added on the node leading the fewest first, promoted once in sync, and the
/// shard's surplus copy (every copy in sync, none draining) then leaves from the node holding the
/// most copies. Shards whose primary is dead (failover settles them) are left alone, and so is a
/// collection with a fenced shard.
pub fn plan_handover(state: &ClusterState) -> Option<PlannedHandover> {
    plan_handover_skipping(state, &|_, _| false)
}

/// [`plan_handover`], never planning a step for a shard `skip` names (collection, shard): the
/// shards whose hand-overs failed and are backing off.
pub fn plan_handover_skipping(
    state: &ClusterState,
    skip: &dyn Fn(&str, u32) -> bool,
) -> Option<PlannedHandover> {
    let takers: Vec<&str> = state
        .nodes
        .keys()
        .filter(|n| !state.draining.contains(*n))
        .map(String::as_str)
        .collect();
    if takers.is_empty() {
        return None;
    }
    let mut copies: BTreeMap<&str, usize> = takers.iter().map(|n| (*n, 0)).collect();
    for map in state.collections.values() {
        for shard in &map.shards {
            for copy in shard.copies() {
                if let Some(n) = copies.get_mut(copy) {
                    *n += 1;
                }
            }
        }
    }
    let mut balancing = None;
    for (name, map) in &state.collections {
        if map.def.replication_factor <= 1 || map.shards.iter().any(|a| !a.takes_writes()) {
            continue;
        }
        let mut primaries: BTreeMap<&str, usize> = takers.iter().map(|n| (*n, 0)).collect();
        for shard in &map.shards {
            if let Some(n) = primaries.get_mut(shard.owner.as_str()) {
                *n += 1;
            }
        }
        // The in-sync replicas of a shard that may lead it, the one leading the fewest first.
        let in_sync_takers = |a: &ShardAssignment| -> Vec<(usize, String)> {
            let mut found: Vec<(usize, String)> = a
                .in_sync_replicas
                .iter()
                .filter(|n| state.holds_in_sync_copy(a, n))
                .filter_map(|n| primaries.get(n.as_str()).map(|load| (*load, n.clone())))
                .collect();
            found.sort();
            found
        };
        let planned =
            |idx: usize, step: HandoverStep, to: ShardAssignment, draining: bool| PlannedHandover {
                collection: name.clone(),
                uid: map.def.uid,
                shard: idx as u32,
                from: map.shards[idx].clone(),
                to,
                step,
                draining,
            };
        for (idx, a) in map.shards.iter().enumerate() {
            if skip(name, idx as u32)
                || !state.draining.contains(&a.owner)
                || !state.holds_in_sync_copy(a, &a.owner)
            {
                continue;
            }
            if let Some((_, to)) = in_sync_takers(a).into_iter().next() {
                if let Some(fenced) = a.handover_fenced(&to) {
                    return Some(planned(idx, HandoverStep::Fence(to), fenced, true));
                }
            }
            if a.copies().count() as u32 > map.def.replication_factor {
                continue;
            }
            let on = copies
                .iter()
                .filter(|(n, _)| a.role_of(n).is_none())
                .min_by_key(|(n, held)| (**held, **n))
                .map(|(n, _)| (*n).to_owned());
            if let Some(on) = on {
                if let Some(added) = a.with_replica(&on) {
                    return Some(planned(idx, HandoverStep::AddReplica(on), added, true));
                }
            }
        }
        if balancing.is_some() {
            continue;
        }
        let Some((most, most_n)) = primaries
            .iter()
            .max_by_key(|(n, led)| (**led, std::cmp::Reverse(**n)))
            .map(|(n, led)| ((*n).to_owned(), *led))
        else {
            continue;
        };
        let led_by_most = || {
            map.shards.iter().enumerate().rev().filter(|(idx, a)| {
                a.owner == most && state.holds_in_sync_copy(a, &a.owner) && !skip(name, *idx as u32)
            })
        };
        balancing = led_by_most().find_map(|(idx, a)| {
            let (_, to) = in_sync_takers(a)
                .into_iter()
                .find(|(load, _)| load + 1 < most_n)?;
            let fenced = a.handover_fenced(&to)?;
            Some(planned(idx, HandoverStep::Fence(to), fenced, false))
        });
        if balancing.is_some() {
            continue;
        }
        // A shard with a copy more than its factor, every copy in sync on its disk and none
        // draining (a balancing hand-over's old primary, below): its replica on the node
        // holding the most copies leaves.
        let factor = map.def.replication_factor;
        balancing = map.shards.iter().enumerate().find_map(|(idx, a)| {
            let surplus = !skip(name, idx as u32)
                && a.copies().count() as u32 > factor
                && a.copies()
                    .all(|n| copies.contains_key(n) && state.holds_in_sync_copy(a, n));
            if !surplus {
                return None;
            }
            let leaving = a
                .replicas
                .iter()
                .max_by_key(|n| (copies.get(n.as_str()).copied().unwrap_or(0), n.as_str()))?;
            let dropped = a.without_replica(leaving)?;
            Some(planned(
                idx,
                HandoverStep::DropReplica(leaving.clone()),
                dropped,
                false,
            ))
        });
        if balancing.is_some()
            || map
                .shards
                .iter()
                .any(|a| a.copies().count() as u32 > factor)
        {
            continue;
        }
        // No in-sync replica of the busiest node's shards on a node leading two fewer (a node
        // that joined holds no copy): a replica is added there first, to be promoted once in
        // sync; the old primary's copy is then the surplus above.
        let mut under: Vec<(usize, &str)> = primaries
            .iter()
            .filter(|(_, led)| **led + 1 < most_n)
            .map(|(n, led)| (*led, *n))
            .collect();
        under.sort();
        balancing = led_by_most().find_map(|(idx, a)| {
            let (_, on) = under.iter().find(|(_, n)| a.role_of(n).is_none())?;
            let added = a.with_replica(on)?;
            Some(planned(
                idx,
                HandoverStep::AddReplica((*on).to_owned()),
                added,
                false,
            ))
        });
    }
    balancing
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
        let joined = s.with_in_sync("n3", "dir-n3").unwrap();
        assert_eq!(joined.n_in_sync(), 3);
        assert_eq!(joined.epoch, s.epoch, "in-sync changes keep the epoch");
        assert!(s.with_in_sync("n2", "dir-n2").is_none());
        assert!(s.with_in_sync("n1", "dir-n1").is_none());
        assert!(s.with_in_sync("n4", "dir-n4").is_none());
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
    fn a_hand_over_fences_at_the_same_epoch_and_promotes_with_the_old_primary_in_sync() {
        let s = recorded("n1", &["n2", "n3"], &["n2"]);
        // Only to an in-sync replica of a serving shard.
        assert!(s.handover_fenced("n3").is_none(), "catching up");
        assert!(s.handover_fenced("n1").is_none());
        assert!(s.handover_fenced("n4").is_none());
        assert!(s.fenced_for("n4").handover_fenced("n2").is_none());
        let fenced = s.handover_fenced("n2").unwrap();
        assert_eq!(fenced.epoch, s.epoch, "the fence keeps the epoch");
        assert!(!fenced.takes_writes());
        assert!(fenced.is_replica_handover());
        assert!(!s.is_replica_handover());
        assert!(
            !s.fenced_for("n4").is_replica_handover(),
            "a move's taker holds no copy"
        );
        assert_eq!(
            (
                &fenced.replicas,
                &fenced.in_sync_replicas,
                &fenced.incarnations
            ),
            (&s.replicas, &s.in_sync_replicas, &s.incarnations)
        );
        // Nothing else promotes a fenced shard, and nothing but the hand-over promotes it.
        assert!(fenced.promoted("n2").is_none());
        assert!(s.handed_to_replica("dir-n1").is_none(), "not fenced");
        assert!(s.fenced_for("n4").handed_to_replica("dir-n1").is_none());

        let p = fenced.handed_to_replica("dir-n1-now").unwrap();
        assert_eq!((p.owner.as_str(), p.epoch), ("n2", s.epoch + 1));
        assert!(p.takes_writes() && p.moving_to.is_none());
        assert_eq!(p.role_of("n1"), Some(CopyRole::InSyncReplica));
        assert_eq!(p.role_of("n3"), Some(CopyRole::CatchingUp));
        assert_eq!(
            p.n_in_sync(),
            s.n_in_sync(),
            "no copy leaves the in-sync set"
        );
        assert_eq!(p.incarnation_of("n1"), Some("dir-n1-now"));
        assert_eq!(p.incarnation_of("n2"), Some("dir-n2"));
        assert_eq!(p.incarnation_of("n3"), None);
        // A replica that left the in-sync set under the fence (late) is not promoted; the
        // fence is lifted instead, keeping the copies as they are.
        let late = fenced.without_in_sync("n2").unwrap();
        assert!(late.is_replica_handover());
        assert!(late.handed_to_replica("dir-n1").is_none());
        let lifted = late.fence_lifted();
        assert_eq!((lifted.owner.as_str(), lifted.epoch), ("n1", s.epoch + 1));
        assert!(lifted.takes_writes() && lifted.in_sync_replicas.is_empty());
    }

    /// A state of one collection "c" of `factor` copies, `draining` nodes marked.
    fn state_draining(
        alive: &[&str],
        draining: &[&str],
        factor: u32,
        shards: Vec<ShardAssignment>,
    ) -> ClusterState {
        let mut s = state(alive, shards);
        s.draining = draining.iter().map(|n| (*n).to_owned()).collect();
        s.collections.get_mut("c").unwrap().def.replication_factor = factor;
        s
    }

    #[test]
    fn a_draining_primary_is_handed_to_an_in_sync_replica_or_gets_one_first() {
        // n1 draining leads shard 0 (replica n2 in sync) and shard 1 (replica n3 catching up).
        let shards = vec![
            shard("n1", &["n2"], &["n2"]),
            shard("n1", &["n3"], &[]),
            shard("n3", &["n2"], &["n2"]),
        ];
        let s = state_draining(&["n1", "n2", "n3"], &["n1"], 2, shards.clone());
        let h = plan_handover(&s).unwrap();
        assert_eq!((h.shard, &h.step), (0, &HandoverStep::Fence("n2".into())));
        assert!(h.draining);
        assert_eq!(h.from, shards[0]);
        assert_eq!(h.to, shards[0].handover_fenced("n2").unwrap());
        // Shard 0 done (n1 now its replica): shard 1 has no in-sync replica, so one is added
        // on a node without a copy of it (n2: n3 holds one).
        let mut after = shards.clone();
        after[0] = h.to.handed_to_replica("").unwrap();
        let s = state_draining(&["n1", "n2", "n3"], &["n1"], 2, after.clone());
        let h = plan_handover(&s).unwrap();
        assert_eq!(
            (h.shard, &h.step),
            (1, &HandoverStep::AddReplica("n2".into()))
        );
        assert_eq!(h.to, after[1].with_replica("n2").unwrap());
        // Added and still catching up: waited for, nothing more is added.
        after[1] = h.to.clone();
        let s = state_draining(&["n1", "n2", "n3"], &["n1"], 2, after.clone());
        assert_eq!(plan_handover(&s), None);
        // Once in sync, the shard is handed to it.
        after[1] = after[1].with_in_sync("n2", "").unwrap();
        let s = state_draining(&["n1", "n2", "n3"], &["n1"], 2, after.clone());
        let h = plan_handover(&s).unwrap();
        assert_eq!((h.shard, &h.step), (1, &HandoverStep::Fence("n2".into())));
        // The replica leading the fewest of the collection's shards takes over.
        let three = vec![
            shard("n1", &["n2", "n3"], &["n2", "n3"]),
            shard("n2", &["n1"], &["n1"]),
        ];
        let s = state_draining(&["n1", "n2", "n3"], &["n1"], 3, three);
        assert_eq!(
            plan_handover(&s).unwrap().step,
            HandoverStep::Fence("n3".into())
        );
    }

    #[test]
    fn a_hand_over_is_planned_only_where_it_can_land() {
        let shards = vec![shard("n1", &["n2"], &["n2"])];
        // Collections of one copy move by copying (`plan_move`).
        let one = state_draining(&["n1", "n2", "n3"], &["n1"], 1, shards.clone());
        assert_eq!(plan_handover(&one), None);
        // A dead primary is failover's; a draining replica is no taker, and no node is left
        // to add one on.
        let dead = state_draining(&["n2", "n3"], &["n1"], 2, shards.clone());
        assert_eq!(plan_handover(&dead), None);
        let both = state_draining(&["n1", "n2"], &["n1", "n2"], 2, shards.clone());
        assert_eq!(plan_handover(&both), None);
        // A collection with a fenced shard waits for its hand-over.
        let fenced = vec![
            shards[0].handover_fenced("n2").unwrap(),
            shard("n1", &["n2"], &["n2"]),
        ];
        let s = state_draining(&["n1", "n2", "n3"], &["n1"], 2, fenced);
        assert_eq!(plan_handover(&s), None);
        // An in-sync replica back on another disk is no taker: a new replica first.
        let on_disk = recorded("n1", &["n2"], &["n2"]);
        let mut s = state_draining(&["n1", "n2", "n3"], &["n1"], 2, vec![on_disk.clone()]);
        s.nodes.get_mut("n2").unwrap().incarnation = "dir-n2-wiped".into();
        s.nodes.get_mut("n1").unwrap().incarnation = "dir-n1".into();
        assert_eq!(
            plan_handover(&s).unwrap().step,
            HandoverStep::AddReplica("n3".into())
        );
    }

    #[test]
    fn primaries_are_balanced_by_promotion_and_a_joined_node_gets_a_copy_first() {
        // n1 leads 3 shards, n2 none, n3 one: the highest-numbered shard of n1 that has an
        // in-sync replica on a node leading two fewer or less goes to it (shard 2's replica is
        // catching up).
        let shards = vec![
            shard("n1", &["n2"], &["n2"]),
            shard("n1", &["n3"], &["n3"]),
            shard("n1", &["n2"], &[]),
            shard("n3", &["n1"], &["n1"]),
        ];
        let s = state_draining(&["n1", "n2", "n3"], &[], 2, shards.clone());
        let h = plan_handover(&s).unwrap();
        assert_eq!((h.shard, &h.step), (1, &HandoverStep::Fence("n3".into())));
        assert!(!h.draining);
        // Even (3 shards over 3 nodes, at most one apart): nothing.
        let even = vec![
            shard("n1", &["n2"], &["n2"]),
            shard("n2", &["n3"], &["n3"]),
            shard("n3", &["n1"], &["n1"]),
            shard("n1", &["n2"], &["n2"]),
        ];
        assert_eq!(
            plan_handover(&state_draining(&["n1", "n2", "n3"], &[], 2, even)),
            None
        );
        // Unbalanced, and no in-sync replica on a less loaded node (n2 joined): a replica is
        // added there first; once in sync it takes over, then the surplus copy leaves from the
        // node holding the most copies.
        let mut joined = vec![shard("n1", &["n3"], &[]), shard("n1", &["n3"], &[])];
        let s = state_draining(&["n1", "n2", "n3"], &[], 2, joined.clone());
        let h = plan_handover(&s).unwrap();
        assert_eq!(
            (h.shard, &h.step),
            (1, &HandoverStep::AddReplica("n2".into()))
        );
        joined[1] = h.to.clone();
        let s = state_draining(&["n1", "n2", "n3"], &[], 2, joined.clone());
        assert_eq!(plan_handover(&s), None, "waits for the new copy");
        joined[1] = joined[1].with_in_sync("n2", "").unwrap();
        let s = state_draining(&["n1", "n2", "n3"], &[], 2, joined.clone());
        let h = plan_handover(&s).unwrap();
        assert_eq!((h.shard, &h.step), (1, &HandoverStep::Fence("n2".into())));
        joined[1] = h.to.handed_to_replica("").unwrap();
        let s = state_draining(&["n1", "n2", "n3"], &[], 2, joined.clone());
        assert_eq!(
            plan_handover(&s),
            None,
            "a surplus copy goes once all are in sync"
        );
        joined[1] = joined[1].with_in_sync("n3", "").unwrap();
        let s = state_draining(&["n1", "n2", "n3"], &[], 2, joined.clone());
        let h = plan_handover(&s).unwrap();
        assert_eq!(
            (h.shard, &h.step),
            (1, &HandoverStep::DropReplica("n3".into()))
        );
        joined[1] = h.to.clone();
        assert_eq!(joined[1].copies().collect::<Vec<_>>(), ["n2", "n1"]);
        let s = state_draining(&["n1", "n2", "n3"], &[], 2, joined);
        assert_eq!(plan_handover(&s), None);
        // Applying the plans converges: every step moves one primary two below, so they end
        // within one of each other.
        let mut shards = vec![shard("n1", &["n2", "n3"], &["n2", "n3"]); 7];
        for _ in 0..10 {
            let s = state_draining(&["n1", "n2", "n3"], &[], 3, shards.clone());
            let Some(h) = plan_handover(&s) else { break };
            shards[h.shard as usize] = h.to.handed_to_replica("").unwrap();
        }
        let mut led: BTreeMap<&str, usize> = BTreeMap::new();
        for a in &shards {
            *led.entry(a.owner.as_str()).or_default() += 1;
        }
        assert_eq!(
            led.values().copied().collect::<Vec<_>>(),
            [3, 2, 2],
            "{led:?}"
        );
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
        let registered: Vec<(&str, &str)> = alive.iter().map(|n| (*n, "")).collect();
        state_on(&registered, shards)
    }

    /// A state whose live nodes are registered from the given data directories (node, token).
    fn state_on(registered: &[(&str, &str)], shards: Vec<ShardAssignment>) -> ClusterState {
        let mut state = ClusterState::default();
        for (n, token) in registered {
            state.nodes.insert(
                (*n).to_owned(),
                NodeInfo {
                    node_id: (*n).to_owned(),
                    address: String::new(),
                    incarnation: (*token).to_owned(),
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

    /// `shard(...)` with each in-sync copy's data directory recorded as `dir-<node>`.
    fn recorded(owner: &str, replicas: &[&str], in_sync: &[&str]) -> ShardAssignment {
        let mut s = shard(owner, replicas, in_sync);
        for n in std::iter::once(&owner).chain(in_sync) {
            s.record_incarnation(n, &format!("dir-{n}"));
        }
        s
    }

    #[test]
    fn every_transition_keeps_the_directories_of_the_in_sync_copies_only() {
        let s = recorded("n1", &["n2", "n3"], &["n2"]);
        assert_eq!(s.incarnation_of("n1"), Some("dir-n1"));
        assert_eq!(s.incarnation_of("n2"), Some("dir-n2"));
        assert_eq!(s.incarnation_of("n3"), None, "a catching-up copy has none");

        // A join records the directory of the process that acknowledged everything; an
        // unknown (empty) token records nothing.
        let joined = s.with_in_sync("n3", "dir-n3-b").unwrap();
        assert_eq!(joined.incarnation_of("n3"), Some("dir-n3-b"));
        assert_eq!(s.with_in_sync("n3", "").unwrap().incarnation_of("n3"), None);
        // Leaving, or being dropped, forgets it.
        assert_eq!(
            joined.without_in_sync("n3").unwrap().incarnation_of("n3"),
            None
        );
        assert_eq!(s.without_replica("n2").unwrap().incarnation_of("n2"), None);
        assert_eq!(
            s.without_in_sync("n2")
                .unwrap()
                .with_in_sync("n2", "dir-n2-c")
                .unwrap()
                .incarnation_of("n2"),
            Some("dir-n2-c")
        );
        // A promotion keeps the new primary's directory and forgets the old one's (it catches
        // up, and joins again with whatever directory it returns on).
        let p = s.promoted("n2").unwrap();
        assert_eq!(p.incarnation_of("n2"), Some("dir-n2"));
        assert_eq!(p.incarnation_of("n1"), None);
        // A move's flip records the taker's directory; the fence and its lifting keep all.
        let fenced = s.fenced_for("n4");
        assert_eq!(fenced.incarnations, s.incarnations);
        assert_eq!(fenced.fence_lifted().incarnations, s.incarnations);
        let moved = fenced.handed_over("dir-n4");
        assert_eq!(moved.incarnation_of("n4"), Some("dir-n4"));
        assert_eq!(moved.incarnation_of("n1"), None);
        assert_eq!(moved.incarnation_of("n2"), Some("dir-n2"));
        // A new shard, and one given up to another node, record the creating directory.
        let created = ShardAssignment::created("n5", 1, "dir-n5");
        assert_eq!(created.incarnation_of("n5"), Some("dir-n5"));
        let given = s.given_up_to("n5", "dir-n5");
        assert_eq!(given.incarnations.len(), 1);
        assert_eq!(given.incarnation_of("n5"), Some("dir-n5"));

        // The rule: only a known token that differs means another disk.
        assert!(s.copy_replaced("n2", "dir-n2-wiped"));
        assert!(!s.copy_replaced("n2", "dir-n2"));
        assert!(
            !s.copy_replaced("n2", ""),
            "a node registering no token is unknown"
        );
        assert!(
            !s.copy_replaced("n3", "anything"),
            "nothing recorded: unknown"
        );
        assert!(!shard("n1", &["n2"], &["n2"]).copy_replaced("n2", "dir-x"));
    }

    #[test]
    fn a_candidate_back_on_another_disk_is_never_promoted() {
        let s = recorded("n1", &["n2", "n3"], &["n2", "n3"]);
        // n1 dead; n2 came back on a wiped disk (same id, new token): only n3 may be promoted.
        let planned = plan_promotions(&state_on(
            &[("n2", "dir-n2-wiped"), ("n3", "dir-n3")],
            vec![s.clone()],
        ));
        assert_eq!(planned.len(), 1);
        assert_eq!(planned[0].to.owner, "n3");
        assert_eq!(
            planned[0].dead_primary_incarnation.as_deref(),
            Some("dir-n1")
        );
        // Both in-sync replicas wiped, or the only one alive wiped: nothing is promoted, the
        // shard waits for its primary rather than serve an empty copy.
        let both = state_on(
            &[("n2", "dir-n2-wiped"), ("n3", "dir-n3-wiped")],
            vec![s.clone()],
        );
        assert!(plan_promotions(&both).is_empty());
        let one = recorded("n1", &["n2"], &["n2"]);
        assert!(
            plan_promotions(&state_on(&[("n2", "dir-n2-wiped")], vec![one.clone()])).is_empty()
        );
        // On its recorded disk, it is.
        let planned = plan_promotions(&state_on(&[("n2", "dir-n2")], vec![one.clone()]));
        assert_eq!(planned.len(), 1);
        assert_eq!(planned[0].to.owner, "n2");
        assert_eq!(planned[0].to.incarnation_of("n2"), Some("dir-n2"));
        // Reads and counts follow the same rule.
        let view = state_on(
            &[("n1", "dir-n1"), ("n2", "dir-n2-wiped")],
            vec![one.clone()],
        );
        assert!(view.holds_in_sync_copy(&one, "n1"));
        assert!(!view.holds_in_sync_copy(&one, "n2"));
        assert!(view.copy_replaced(&one, "n2"));
        assert!(!view.copy_replaced(&one, "n1"));
    }

    #[test]
    fn a_primary_back_on_another_disk_is_dead_for_its_shard() {
        let s = recorded("n1", &["n2"], &["n2"]);
        // n1 is registered, but from another directory: it holds no copy, so its in-sync
        // replica is promoted, the swap allowing that registration (and only it).
        let view = state_on(&[("n1", "dir-n1-wiped"), ("n2", "dir-n2")], vec![s.clone()]);
        let planned = plan_promotions(&view);
        assert_eq!(planned.len(), 1);
        assert_eq!(planned[0].dead_primary, "n1");
        assert_eq!(
            planned[0].dead_primary_incarnation.as_deref(),
            Some("dir-n1")
        );
        assert_eq!(planned[0].to.role_of("n1"), Some(CopyRole::CatchingUp));
        assert_eq!(planned[0].to.incarnation_of("n1"), None);
        // On its own disk, or with no token known on either side, it is alive.
        for n1 in ["dir-n1", ""] {
            let view = state_on(&[("n1", n1), ("n2", "dir-n2")], vec![s.clone()]);
            assert!(plan_promotions(&view).is_empty(), "{n1:?}");
        }
        let unknown = shard("n1", &["n2"], &["n2"]);
        let view = state_on(&[("n1", "dir-n1-wiped"), ("n2", "dir-n2")], vec![unknown]);
        assert!(plan_promotions(&view).is_empty());
        // Wiped primary and wiped replica: nothing to promote.
        let view = state_on(&[("n1", "dir-n1-wiped"), ("n2", "dir-n2-wiped")], vec![s]);
        assert!(plan_promotions(&view).is_empty());
    }

    #[test]
    fn a_replica_back_on_another_disk_leaves_the_in_sync_set() {
        let shards = vec![
            recorded("n1", &["n2", "n3"], &["n2", "n3"]),
            recorded("n1", &["n2"], &["n2"]).fenced_for("n3"),
            recorded("n3", &["n2"], &[]),
            shard("n1", &["n2"], &["n2"]),
        ];
        let view = state_on(
            &[("n1", "dir-n1"), ("n2", "dir-n2-wiped"), ("n3", "dir-n3")],
            shards.clone(),
        );
        // Shard 0 only: shard 1 is fenced (its move settles it), n2 is not in sync on shard 2,
        // and shard 3 recorded no directory.
        let planned = plan_replaced_copies(&view);
        assert_eq!(planned.len(), 1, "{planned:?}");
        assert_eq!((planned[0].shard, planned[0].replica.as_str()), (0, "n2"));
        assert_eq!(planned[0].from, shards[0]);
        assert_eq!(planned[0].to, shards[0].without_in_sync("n2").unwrap());
        // A dead replica is no evidence (it may come back on its own disk).
        let view = state_on(&[("n1", "dir-n1"), ("n3", "dir-n3")], shards.clone());
        assert!(plan_replaced_copies(&view).is_empty());
        // Even with its primary dead, so that it is never promoted later.
        let view = state_on(&[("n2", "dir-n2-wiped")], shards);
        assert_eq!(plan_replaced_copies(&view).len(), 1);
    }

    #[test]
    fn records_without_directories_still_read_and_accept_the_current_registration() {
        // A record written before directories were recorded.
        let old: ShardAssignment = serde_json::from_str(
            r#"{"owner":"n1","epoch":4,"replicas":["n2"],"in_sync_replicas":["n2"]}"#,
        )
        .unwrap();
        assert!(old.incarnations.is_empty());
        let expected = ShardAssignment {
            epoch: 4,
            ..shard("n1", &["n2"], &["n2"])
        };
        assert_eq!(old, expected);
        // Unknown: whatever directory n2 is registered from, it is in sync and promotable.
        let view = state_on(&[("n2", "dir-anything")], vec![old.clone()]);
        assert!(view.holds_in_sync_copy(&old, "n2"));
        assert_eq!(plan_promotions(&view).len(), 1);
        assert!(plan_replaced_copies(&view).is_empty());
        // Written back without the field while nothing is recorded; with the field once the
        // copy joins again.
        let text = serde_json::to_string(&old).unwrap();
        assert!(!text.contains("incarnations"), "{text}");
        let rejoined = old
            .without_in_sync("n2")
            .unwrap()
            .with_in_sync("n2", "dir-n2")
            .unwrap();
        let text = serde_json::to_string(&rejoined).unwrap();
        assert!(text.contains(r#""incarnations":{"n2":"dir-n2"}"#), "{text}");
        assert_eq!(
            serde_json::from_str::<ShardAssignment>(&text).unwrap(),
            rejoined
        );
    }

    /// One node of the model: alive or not, the data directory it runs on (a wipe starts a new
    /// one) and the entries that directory holds.
    #[derive(Debug, Clone)]
    struct ModelNode {
        alive: bool,
        disk: u32,
        log: Vec<u64>,
    }

    const MODEL_NODES: [&str; 3] = ["n0", "n1", "n2"];

    fn model_token(node: usize, disk: u32) -> String {
        format!("{}-disk{disk}", MODEL_NODES[node])
    }

    fn model_index(node: &str) -> usize {
        MODEL_NODES.iter().position(|n| *n == node).unwrap()
    }

    /// The coordinator's view: the live nodes, registered from the disks they run on.
    fn model_view(nodes: &[ModelNode], record: &ShardAssignment) -> ClusterState {
        let tokens: Vec<(usize, String)> = (0..nodes.len())
            .filter(|i| nodes[*i].alive)
            .map(|i| (i, model_token(i, nodes[i].disk)))
            .collect();
        let registered: Vec<(&str, &str)> = tokens
            .iter()
            .map(|(i, t)| (MODEL_NODES[*i], t.as_str()))
            .collect();
        state_on(&registered, vec![record.clone()])
    }

    proptest::proptest! {
        /// A model of one shard of 3 copies over the real transitions and planners: writes
        /// (acknowledged once every in-sync copy has them; a copy that cannot take one leaves
        /// the in-sync set first, as the primary does), kills, restarts on the same disk,
        /// wipes (the node back at once with the same id on an empty disk, a new token: nothing
        /// probes it before the next step), coordinator rounds (`plan_promotions`, then
        /// `plan_replaced_copies`), catch-ups (a catching-up copy takes the primary's log and
        /// joins with its disk's token) and planned hand-overs of the primary to an in-sync
        /// replica (fence, drain, promotion with the old primary in sync). After every step, every node the rule counts as
        /// holding an in-sync copy (`holds_in_sync_copy`: what promotions, reads and
        /// `min_in_sync` go by) holds every acknowledged entry; so does every promoted copy.
        /// Ignoring the recorded directories fails it at the first wipe of an in-sync copy.
        #[test]
        fn model_no_copy_counted_in_sync_lacks_an_acknowledged_entry(
            ops in proptest::collection::vec((0u8..7, 0usize..3), 1..150),
        ) {
            let mut nodes = vec![ModelNode { alive: true, disk: 0, log: Vec::new() }; 3];
            let infos: Vec<NodeInfo> = (0..3)
                .map(|i| NodeInfo {
                    node_id: MODEL_NODES[i].to_owned(),
                    address: String::new(),
                    incarnation: model_token(i, 0),
                })
                .collect();
            let mut record = crate::map::initial_placement("c", 1, &infos, 3).remove(0);
            let mut acknowledged: Vec<u64> = Vec::new();
            let mut next_entry = 0u64;
            for (op, n) in ops {
                match op {
                    // A write through the primary, if it holds its copy.
                    0 | 1 => {
                        let state = model_view(&nodes, &record);
                        if !state.holds_in_sync_copy(&record, &record.owner) {
                            continue;
                        }
                        let p = model_index(&record.owner);
                        next_entry += 1;
                        nodes[p].log.push(next_entry);
                        for replica in record.in_sync_replicas.clone() {
                            if state.holds_in_sync_copy(&record, &replica) {
                                nodes[model_index(&replica)].log = nodes[p].log.clone();
                            } else {
                                record = record.without_in_sync(&replica).unwrap();
                            }
                        }
                        acknowledged.push(next_entry);
                    }
                    2 => nodes[n].alive = false,
                    3 => nodes[n].alive = true,
                    4 => {
                        nodes[n] = ModelNode { alive: true, disk: nodes[n].disk + 1, log: Vec::new() };
                    }
                    // A planned hand-over to an in-sync replica: the fence, the old primary's drain
                    // (its whole log onto every in-sync replica alive on its disk; one that is
                    // not leaves the in-sync set first, by a swap of the fenced record), then the
                    // promotion, or the fence lifted when the chosen replica left.
                    6 => {
                        let state = model_view(&nodes, &record);
                        if !state.holds_in_sync_copy(&record, &record.owner) {
                            continue;
                        }
                        let candidates: Vec<String> = record
                            .in_sync_replicas
                            .iter()
                            .filter(|r| nodes[model_index(r)].alive)
                            .cloned()
                            .collect();
                        if candidates.is_empty() {
                            continue;
                        }
                        let to = candidates[n % candidates.len()].clone();
                        let mut fenced = record.handover_fenced(&to).unwrap();
                        let p = model_index(&record.owner);
                        for replica in fenced.in_sync_replicas.clone() {
                            if state.holds_in_sync_copy(&fenced, &replica) {
                                nodes[model_index(&replica)].log = nodes[p].log.clone();
                            } else {
                                fenced = fenced.without_in_sync(&replica).unwrap();
                            }
                        }
                        record = match fenced.handed_to_replica(&model_token(p, nodes[p].disk)) {
                            Some(promoted) => {
                                let new = model_index(&promoted.owner);
                                proptest::prop_assert_eq!(
                                    &nodes[new].log, &nodes[p].log,
                                    "the new primary's log is the old one's: nothing to cut"
                                );
                                promoted
                            }
                            None => fenced.fence_lifted(),
                        };
                    }
                    _ => {
                        for planned in plan_promotions(&model_view(&nodes, &record)) {
                            proptest::prop_assert_eq!(&planned.from, &record);
                            let promoted = &nodes[model_index(&planned.to.owner)];
                            for entry in &acknowledged {
                                proptest::prop_assert!(
                                    promoted.log.contains(entry),
                                    "promoted {} lacks acknowledged entry {}", planned.to.owner, entry
                                );
                            }
                            record = planned.to;
                        }
                        if let Some(leave) = plan_replaced_copies(&model_view(&nodes, &record)).pop() {
                            record = leave.to;
                        }
                        let state = model_view(&nodes, &record);
                        if state.holds_in_sync_copy(&record, &record.owner) {
                            let p = model_index(&record.owner);
                            for replica in record.replicas.clone() {
                                let r = model_index(&replica);
                                if nodes[r].alive && record.role_of(&replica) == Some(CopyRole::CatchingUp) {
                                    nodes[r].log = nodes[p].log.clone();
                                    record = record
                                        .with_in_sync(&replica, &model_token(r, nodes[r].disk))
                                        .unwrap();
                                }
                            }
                        }
                    }
                }
                let state = model_view(&nodes, &record);
                for (i, node) in nodes.iter().enumerate() {
                    if !state.holds_in_sync_copy(&record, MODEL_NODES[i]) {
                        continue;
                    }
                    for entry in &acknowledged {
                        proptest::prop_assert!(
                            node.log.contains(entry),
                            "{} counted in sync without acknowledged entry {} ({:?})",
                            MODEL_NODES[i], entry, record
                        );
                    }
                }
            }
        }
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
