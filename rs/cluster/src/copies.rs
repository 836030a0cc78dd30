//! What a node does with a local copy of a shard that its view of the map does not give it: the
//! one rule that may delete shard data in cluster mode. A copy is dropped only on positive
//! evidence read from the store linearizably ([`crate::ClusterStore::read_copy_evidence`]): the
//! collection was dropped (a tombstone), or the record, at least as new as any this node held
//! the copy at, lists it in no role and names another in-sync copy that is alive on the data
//! directory recorded for it (so that copy holds every acknowledged write). Anything else sets
//! the copy aside or leaves it in place: the map has no record of the shard (an empty, foreign
//! or restored-from-backup etcd), the record is older than this node's (etcd rolled back), the
//! shard's data was given up by `forget`, or no other in-sync copy is alive on its disk (this
//! may be the last copy). Never deleted on the map's silence.

use std::collections::BTreeMap;

use crate::map::{NodeInfo, ShardAssignment, ShardName};

/// A shard's record as read from the store at one revision.
// One value per linearizable read, never kept in bulk: boxing the assignment would only add an
// allocation to every read.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ShardRecord {
    /// The collection exists with the shard's uid, and this is the shard's assignment.
    Assigned(ShardAssignment),
    /// The collection of this uid was dropped (its tombstone is there).
    Dropped,
    /// Nothing is known of it: no definition with this uid, no tombstone.
    Unknown,
}

/// What a local copy is judged by, read linearizably at one revision
/// ([`crate::ClusterStore::read_copy_evidence`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CopyEvidence {
    pub record: ShardRecord,
    /// Every live node's registration, by node id.
    pub registered: BTreeMap<String, NodeInfo>,
    /// The store's revision the read was served at.
    pub revision: i64,
    /// The cluster id the store holds (`None`: none, an empty or wiped etcd).
    pub cluster_id: Option<String>,
}

/// What to do with a local copy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CopyFate {
    /// The copy is this node's shard (or is being handed to it): serve or keep it.
    Keep,
    /// Delete it: the reason, for the log.
    Drop(String),
    /// Move it aside, out of service, where an operator can import or drop it: the reason.
    SetAside(String),
    /// Leave it where it is, out of service, and judge it again later: the reason (no other
    /// in-sync copy is alive right now, but one may come back).
    Undecided(String),
}

/// The fate of `node_id`'s local copy of `shard`, given the evidence read linearizably and
/// `held_epoch`, the highest epoch at which this node's data directory held a role in the
/// shard's record (0 when unknown).
pub fn fate_of_copy(
    node_id: &str,
    shard: &ShardName,
    held_epoch: u64,
    evidence: &CopyEvidence,
) -> CopyFate {
    let what = format!("shard {} of collection '{}'", shard.shard, shard.collection);
    let a = match &evidence.record {
        ShardRecord::Dropped => {
            return CopyFate::Drop(format!("{what}: the collection was dropped"));
        }
        ShardRecord::Unknown => {
            return CopyFate::SetAside(format!(
                "{what}: the cluster's store has no record of this collection (an etcd that \
                 lost it, or one restored from an older backup?)"
            ));
        }
        ShardRecord::Assigned(a) => a,
    };
    // A record older than the epoch this directory held the shard at (etcd restored from an
    // older backup) decides nothing about this copy, even where it lists it: serving it as
    // that record says could cut entries acknowledged since.
    if a.epoch < held_epoch {
        return CopyFate::SetAside(format!(
            "{what}: its record (epoch {}) is older than epoch {held_epoch}, at which this node \
             held the shard (etcd restored from an older backup?)",
            a.epoch
        ));
    }
    if a.role_of(node_id).is_some() || a.moving_to.as_deref() == Some(node_id) {
        return CopyFate::Keep;
    }
    if a.given_up.iter().any(|n| n == node_id) {
        return CopyFate::SetAside(format!(
            "{what}: its data on this node was given up (`tarn cluster forget`) and node {} \
             serves it since epoch {}",
            a.owner, a.epoch
        ));
    }
    let holder = a.in_sync().filter(|n| *n != node_id).find(|n| {
        evidence
            .registered
            .get(*n)
            .is_some_and(|info| !a.copy_replaced(n, &info.incarnation))
    });
    if let Some(holder) = holder {
        return CopyFate::Drop(format!(
            "{what}: node {} holds it at epoch {} (in sync: {holder}) and this node is none of \
             its copies (the data was taken by a move, or this replica was dropped)",
            a.owner, a.epoch
        ));
    }
    let away: Vec<&str> = a
        .in_sync()
        .filter(|n| *n != node_id && !evidence.registered.contains_key(*n))
        .collect();
    if !away.is_empty() {
        return CopyFate::Undecided(format!(
            "{what}: this node is none of its copies, but no other in-sync copy is alive now \
             (down: {}): kept until one is back",
            away.join(", ")
        ));
    }
    CopyFate::SetAside(format!(
        "{what}: this node is none of its copies, and every in-sync copy the record lists (on \
         node {} at epoch {}) is back on another data directory: this may be the last copy",
        a.owner, a.epoch
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn alive(record: ShardRecord) -> CopyEvidence {
        let registered = ["n1", "n2", "n3"]
            .iter()
            .map(|n| {
                let info = NodeInfo {
                    node_id: (*n).to_owned(),
                    address: String::new(),
                    incarnation: format!("dir-{n}"),
                };
                ((*n).to_owned(), info)
            })
            .collect();
        CopyEvidence {
            record,
            registered,
            revision: 10,
            cluster_id: Some("c".into()),
        }
    }

    #[test]
    fn copies_are_dropped_only_on_positive_evidence() {
        let shard = ShardName {
            collection: "docs".into(),
            uid: 7,
            shard: 3,
        };
        // Every other node alive, on the directory its copies were recorded on (none here).
        let fate = |r: ShardRecord| fate_of_copy("n1", &shard, 0, &alive(r));
        let keep = |r: ShardRecord| assert_eq!(fate(r), CopyFate::Keep);
        let drops = |r: ShardRecord| assert!(matches!(fate(r.clone()), CopyFate::Drop(_)), "{r:?}");
        let aside =
            |r: ShardRecord| assert!(matches!(fate(r.clone()), CopyFate::SetAside(_)), "{r:?}");
        keep(ShardRecord::Assigned(ShardAssignment::serving("n1", 4)));
        keep(ShardRecord::Assigned(
            ShardAssignment::serving("n2", 4).fenced_for("n1"),
        ));
        drops(ShardRecord::Dropped);
        drops(ShardRecord::Assigned(ShardAssignment::serving("n2", 4)));
        // Moved n1 -> n2: the flip's record; n1's stale copy goes.
        let moved = ShardAssignment::serving("n1", 4)
            .fenced_for("n2")
            .handed_over("");
        assert_eq!(moved.owner, "n2");
        drops(ShardRecord::Assigned(moved.clone()));
        // The map lost the collection: never deleted on its silence.
        aside(ShardRecord::Unknown);
        // n1's data given up to n2 by forget: set aside, and still after later moves.
        let forgotten = ShardAssignment::serving("n1", 4).given_up_to("n2", "dir-n2");
        assert_eq!(forgotten.given_up, vec!["n1".to_owned()]);
        assert_eq!(forgotten.create_on.as_deref(), Some("dir-n2"));
        aside(ShardRecord::Assigned(forgotten.clone()));
        let moved_on = forgotten.fenced_for("n3").handed_over("");
        assert_eq!(moved_on.owner, "n3");
        assert_eq!(moved_on.create_on, None);
        aside(ShardRecord::Assigned(moved_on.clone()));
        // Moved back onto n1: n1 holds the data again, so it is no longer a given-up copy.
        let back = moved_on.fenced_for("n1").handed_over("");
        assert!(back.given_up.is_empty());
        keep(ShardRecord::Assigned(back.clone()));
        drops(ShardRecord::Assigned(back.fenced_for("n2").handed_over("")));
        // Replicas keep their copies, in sync or not; a dropped replica drops it.
        let replicated = ShardAssignment::serving("n2", 4)
            .with_replica("n1")
            .unwrap();
        keep(ShardRecord::Assigned(replicated.clone()));
        keep(ShardRecord::Assigned(
            replicated.with_in_sync("n1", "").unwrap(),
        ));
        drops(ShardRecord::Assigned(
            replicated.without_replica("n1").unwrap(),
        ));
        // Promoted away from n1 (a failover while n1 was out): n1's copy is a replica's.
        let failed_over = ShardAssignment::serving("n1", 4)
            .with_replica("n2")
            .and_then(|a| a.with_in_sync("n2", ""))
            .and_then(|a| a.promoted("n2"))
            .unwrap();
        keep(ShardRecord::Assigned(failed_over));
    }

    /// A copy the record no longer lists is deleted only while another in-sync copy is alive on
    /// its recorded directory; never from a record older than the copy's own epoch.
    #[test]
    fn a_copy_no_other_in_sync_copy_holds_is_never_dropped() {
        let shard = ShardName {
            collection: "docs".into(),
            uid: 7,
            shard: 0,
        };
        // n1 primary on dir-n1, n2 in sync: re-replication swapped n2 out for n3 while n1 came
        // back on a wiped disk (dir-new).
        let replaced = ShardAssignment::created("n1", 1, "dir-n1")
            .with_replica("n3")
            .unwrap();
        let mut evidence = alive(ShardRecord::Assigned(replaced.clone()));
        assert!(matches!(
            fate_of_copy("n2", &shard, 1, &evidence),
            CopyFate::Drop(_)
        ));
        evidence.registered.get_mut("n1").unwrap().incarnation = "dir-new".into();
        assert!(matches!(
            fate_of_copy("n2", &shard, 1, &evidence),
            CopyFate::SetAside(_)
        ));
        // The primary down: judged again later, neither dropped nor set aside.
        evidence.registered.remove("n1");
        assert!(matches!(
            fate_of_copy("n2", &shard, 1, &evidence),
            CopyFate::Undecided(_)
        ));
        // A record older than the epoch this node held the copy at (etcd rolled back): set
        // aside even though its owner is alive on its disk, and even where it lists the copy.
        let evidence = alive(ShardRecord::Assigned(replaced.clone()));
        assert!(matches!(
            fate_of_copy("n2", &shard, 3, &evidence),
            CopyFate::SetAside(_)
        ));
        assert!(matches!(
            fate_of_copy("n3", &shard, 3, &evidence),
            CopyFate::SetAside(_)
        ));
        assert_eq!(fate_of_copy("n3", &shard, 1, &evidence), CopyFate::Keep);
    }
}
