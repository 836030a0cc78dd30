//! What a node does with a local copy of a shard that its view of the map does not give it: the
//! one rule that may delete shard data in cluster mode. A copy is dropped only on positive
//! evidence read from the store linearizably ([`crate::ClusterStore::read_shard`]): the
//! collection was dropped (a tombstone), or another node owns the shard and holds its data (it
//! took it by a confirmed move). Anything else — the map has no record of the shard (an empty,
//! foreign or restored-from-backup etcd), the record cannot be read, the shard's data was given
//! up by `forget` — sets the copy aside, or leaves it in place: never deleted on the map's
//! silence.

use crate::map::{ShardAssignment, ShardName};

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

/// What to do with a local copy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CopyFate {
    /// The copy is this node's shard (or is being handed to it): serve or keep it.
    Keep,
    /// Delete it: the reason, for the log.
    Drop(String),
    /// Move it aside, out of service, where an operator can import or drop it: the reason.
    SetAside(String),
}

/// The fate of `node_id`'s local copy of `shard`, given its record read linearizably.
pub fn fate_of_copy(node_id: &str, shard: &ShardName, record: &ShardRecord) -> CopyFate {
    let what = format!("shard {} of collection '{}'", shard.shard, shard.collection);
    match record {
        ShardRecord::Dropped => CopyFate::Drop(format!("{what}: the collection was dropped")),
        ShardRecord::Unknown => CopyFate::SetAside(format!(
            "{what}: the cluster's store has no record of this collection (an etcd that lost \
             it, or one restored from an older backup?)"
        )),
        ShardRecord::Assigned(a) if a.role_of(node_id).is_some() => CopyFate::Keep,
        ShardRecord::Assigned(a) if a.moving_to.as_deref() == Some(node_id) => CopyFate::Keep,
        ShardRecord::Assigned(a) if a.given_up.iter().any(|n| n == node_id) => {
            CopyFate::SetAside(format!(
                "{what}: its data on this node was given up (`tarn cluster forget`) and node {} \
                 serves it since epoch {}",
                a.owner, a.epoch
            ))
        }
        ShardRecord::Assigned(a) => CopyFate::Drop(format!(
            "{what}: node {} holds it at epoch {} and this node is none of its copies (the data \
             was taken by a move, or this replica was dropped)",
            a.owner, a.epoch
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_are_dropped_only_on_positive_evidence() {
        let shard = ShardName {
            collection: "docs".into(),
            uid: 7,
            shard: 3,
        };
        let keep = |r: ShardRecord| assert_eq!(fate_of_copy("n1", &shard, &r), CopyFate::Keep);
        let drops = |r: ShardRecord| {
            assert!(
                matches!(fate_of_copy("n1", &shard, &r), CopyFate::Drop(_)),
                "{r:?}"
            )
        };
        let aside = |r: ShardRecord| {
            assert!(
                matches!(fate_of_copy("n1", &shard, &r), CopyFate::SetAside(_)),
                "{r:?}"
            )
        };
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
}
