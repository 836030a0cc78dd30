//! The cluster's shared state as every node sees it: live nodes, collection definitions and the
//! shard map (shard -> owner node, epoch, state). It lives in etcd ([`crate::ClusterStore`]);
//! this module only describes it and answers questions about it.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

/// Shards of a collection when `CreateCollection` asks for 0.
pub const DEFAULT_SHARDS: u32 = 8;
/// Most shards a collection may have.
pub const MAX_SHARDS: u32 = 1024;

/// A tarn node of the cluster, as registered under its lease.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeInfo {
    /// Unique in the cluster (`--node-id`).
    pub node_id: String,
    /// Where the other nodes and clients reach its gRPC service (`--advertise`).
    pub address: String,
    /// The token of the data directory the node runs on (its `INCARNATION` file, written once;
    /// the running process holds the directory's lock). A registration that carries the token
    /// of the directory a starting process has locked belongs to that directory's previous,
    /// dead process: [`crate::ClusterStore::register`] takes it over at once. Empty: unknown
    /// (a node of an older tarn), which never matches.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub incarnation: String,
}

/// What decides a document's shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ShardKey {
    /// The tenant (`user_id`): a tenant's documents are on one shard, so its searches touch one
    /// node.
    User,
    /// The document (`doc_id`): a large tenant spreads over every shard; searches fan out.
    Doc,
}

/// A sharded collection: its name, how it is split, and the configuration every shard is
/// created with (the single-node collection config, kept opaque here).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CollectionDef {
    pub name: String,
    /// This incarnation of the name: random at creation, part of every shard's local name, so a
    /// collection dropped and created again never meets the old one's shards.
    pub uid: u64,
    pub n_shards: u32,
    pub shard_key: ShardKey,
    /// The per-shard collection configuration (the server's `CollectionConfig` as JSON).
    pub config: serde_json::Value,
    /// Copies of each shard, the primary included (1 when absent: written before replicas).
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub replication_factor: u32,
    /// A shard takes writes only while at least this many copies (the primary included) are
    /// in sync (1 when absent).
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub min_in_sync: u32,
}

fn one() -> u32 {
    1
}

fn is_one(n: &u32) -> bool {
    *n == 1
}

/// Where a shard lives: its primary (`owner`, which takes its writes), the replicas that follow
/// the primary's log, and which of them are in sync (docs/CLUSTER.md, "Replicas"; the
/// transitions between copy states are in `replicas.rs`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardAssignment {
    /// The node that holds the shard's data and takes its writes.
    pub owner: String,
    /// Bumped by every change of owner and by a move's fence and its lifting (compare-and-swap
    /// in etcd); a hand-over's fence keeps it (`replicas.rs`: the primary's replication at that
    /// epoch finishes shipping). Forwarded calls carry the epoch the router believes in; the
    /// owner serves only its current one.
    pub epoch: u64,
    /// Serving, or fenced while a move hands the shard over (written before the owner changes,
    /// so an owner that restarts meanwhile still refuses writes).
    #[serde(default, skip_serializing_if = "ShardState::is_serving")]
    pub state: ShardState,
    /// While fenced: the node taking the shard.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moving_to: Option<String>,
    /// The data directory (its [`NodeInfo::incarnation`] token) that creates this shard empty
    /// when it first serves it: set when the shard starts without data (a new collection, or a
    /// shard given up by `forget`). Any other directory of the owner (wiped, replaced) holds no
    /// copy and must not invent one: the shard is unavailable until its data comes back. A
    /// shard is never created by a lookup alone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub create_on: Option<String>,
    /// Nodes whose copies of this shard were given up by `forget`: when such a node comes back
    /// it sets its copy aside (it holds acknowledged writes the shard no longer has) instead of
    /// dropping it. A node not listed here whose copy the map gives to another owner was
    /// replaced by a confirmed move, and drops it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub given_up: Vec<String>,
    /// The epoch at which the shard's current data (its log) began: its creation's, or the one
    /// `forget` gave it up at; moves carry it. A read token from an earlier epoch names
    /// positions in a log that is gone. 0: unknown (written before tokens carried epochs).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub data_since: u64,
    /// The shard's other copies, never the owner: each appends the owner's log entries at the
    /// same sequence numbers. Empty for a shard of one copy.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub replicas: Vec<String>,
    /// The replicas that hold every write the owner acknowledged (a subset of `replicas`; the
    /// owner is always in sync and is not listed). Only these may be promoted.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub in_sync_replicas: Vec<String>,
    /// The data directories (their [`NodeInfo::incarnation`] tokens) of replicas that start
    /// empty (a new collection's): as [`ShardAssignment::create_on`] for the owner. A replica
    /// added later starts from a copy of the primary's data, never empty.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub create_replicas_on: Vec<String>,
    /// The data directory (its [`NodeInfo::incarnation`] token) that holds each in-sync copy,
    /// by node: the owner's and each in-sync replica's, recorded when the copy became the
    /// primary (a new shard, a promotion, a move's flip) or joined the in-sync set, and dropped
    /// when it leaves it. A node whose live registration carries another token came back on
    /// another disk (wiped or replaced): that directory holds no copy, so the node is not in
    /// sync for this shard, whatever `in_sync_replicas` says
    /// ([`ShardAssignment::copy_replaced`], docs/CLUSTER.md, "In sync means on this disk"). A copy
    /// without an entry (a record written before tokens were recorded, or a node of an older
    /// tarn that registers none) is unknown, and its node's current registration is accepted.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub incarnations: BTreeMap<String, String>,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// A shard's state in the map.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ShardState {
    /// The owner takes writes and searches.
    #[default]
    Serving,
    /// A move is handing the shard to `moving_to`: every node refuses its writes (retryable);
    /// the owner still answers searches.
    Fenced,
}

impl ShardState {
    fn is_serving(&self) -> bool {
        *self == ShardState::Serving
    }
}

impl ShardAssignment {
    /// A serving shard of `owner` at `epoch`.
    pub fn serving(owner: impl Into<String>, epoch: u64) -> ShardAssignment {
        ShardAssignment {
            owner: owner.into(),
            epoch,
            state: ShardState::Serving,
            moving_to: None,
            create_on: None,
            given_up: Vec::new(),
            data_since: 0,
            replicas: Vec::new(),
            in_sync_replicas: Vec::new(),
            create_replicas_on: Vec::new(),
            incarnations: BTreeMap::new(),
        }
    }

    /// A new, empty shard of `owner` at `epoch`, to be created by the data directory
    /// `incarnation` (which is recorded as the one holding the primary's copy).
    pub fn created(owner: impl Into<String>, epoch: u64, incarnation: &str) -> ShardAssignment {
        let mut created = ShardAssignment {
            create_on: Some(incarnation.to_owned()),
            data_since: epoch,
            ..ShardAssignment::serving(owner, epoch)
        };
        let owner = created.owner.clone();
        created.record_incarnation(&owner, incarnation);
        created
    }

    /// The fence of a move to `to`: same owner, next epoch, writes refused everywhere.
    pub fn fenced_for(&self, to: &str) -> ShardAssignment {
        ShardAssignment {
            owner: self.owner.clone(),
            epoch: self.epoch + 1,
            state: ShardState::Fenced,
            moving_to: Some(to.to_owned()),
            create_on: None,
            given_up: self.given_up.clone(),
            data_since: self.data_since,
            replicas: self.replicas.clone(),
            in_sync_replicas: self.in_sync_replicas.clone(),
            create_replicas_on: Vec::new(),
            incarnations: self.incarnations.clone(),
        }
    }

    /// After this fence: the taker serves the shard with the data it copied (the flip), on its
    /// data directory `taker_incarnation`.
    pub fn handed_over(&self, taker_incarnation: &str) -> ShardAssignment {
        let taker = self.moving_to.clone().unwrap_or_else(|| self.owner.clone());
        let mut owned = ShardAssignment {
            given_up: self
                .given_up
                .iter()
                .filter(|n| **n != taker)
                .cloned()
                .collect(),
            data_since: self.data_since,
            replicas: self
                .replicas
                .iter()
                .filter(|n| **n != taker)
                .cloned()
                .collect(),
            in_sync_replicas: self
                .in_sync_replicas
                .iter()
                .filter(|n| **n != taker)
                .cloned()
                .collect(),
            incarnations: self
                .incarnations
                .iter()
                .filter(|(n, _)| self.in_sync_replicas.contains(n) && **n != taker)
                .map(|(n, t)| (n.clone(), t.clone()))
                .collect(),
            ..ShardAssignment::serving(taker.clone(), self.epoch + 1)
        };
        owned.record_incarnation(&taker, taker_incarnation);
        owned
    }

    /// After this fence: the owner serves the shard again (the move was abandoned).
    pub fn fence_lifted(&self) -> ShardAssignment {
        ShardAssignment {
            given_up: self.given_up.clone(),
            data_since: self.data_since,
            replicas: self.replicas.clone(),
            in_sync_replicas: self.in_sync_replicas.clone(),
            incarnations: self.incarnations.clone(),
            ..ShardAssignment::serving(self.owner.clone(), self.epoch + 1)
        }
    }

    /// The shard of the dead owner given up to `to` (data directory `incarnation`), empty.
    /// Its replicas' copies are given up too (they hold writes the empty shard lacks): each
    /// sets its copy aside, and the shard starts with no replicas.
    pub fn given_up_to(&self, to: &str, incarnation: &str) -> ShardAssignment {
        let mut given_up = self.given_up.clone();
        for node in std::iter::once(&self.owner).chain(&self.replicas) {
            if !given_up.contains(node) {
                given_up.push(node.clone());
            }
        }
        given_up.retain(|n| n != to);
        ShardAssignment {
            given_up,
            ..ShardAssignment::created(to, self.epoch + 1, incarnation)
        }
    }

    /// Whether writes may go to the owner.
    pub fn takes_writes(&self) -> bool {
        self.state == ShardState::Serving
    }
}

/// One collection's definition and shard map.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CollectionMap {
    pub def: CollectionDef,
    /// Indexed by shard number.
    pub shards: Vec<ShardAssignment>,
}

/// One write in etcd's history that a node saw: the key, the revision it was written at and a
/// checksum of its value. A node keeps the newest one it acted on (in its ledger); an etcd whose
/// history at that revision says otherwise is not the history the node saw, even when its
/// revision has since grown past the node's (restored from an older backup, then written to).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HistoryWitness {
    pub key: String,
    pub mod_revision: i64,
    /// CRC32 of the value written.
    pub value_crc32: u32,
}

impl HistoryWitness {
    /// The witness of `key` holding `value`, written at `mod_revision`.
    pub fn of(key: &[u8], value: &[u8], mod_revision: i64) -> HistoryWitness {
        HistoryWitness {
            key: String::from_utf8_lossy(key).into_owned(),
            mod_revision,
            value_crc32: crc32fast::hash(value),
        }
    }
}

/// Everything a node knows of the cluster, as of one etcd revision.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ClusterState {
    /// The etcd revision this view was read at (0 for a fresh in-memory store).
    pub revision: i64,
    /// The newest write under the cluster's prefix in this view (`None` for an in-memory
    /// store): what a node records to recognise its etcd's history later.
    pub witness: Option<HistoryWitness>,
    /// Live nodes (their lease has not lapsed), by node id.
    pub nodes: BTreeMap<String, NodeInfo>,
    /// The store revision each live node's registration was written at: a node that
    /// registered again (a restart) shows a new one.
    pub registered_at: BTreeMap<String, i64>,
    pub collections: BTreeMap<String, CollectionMap>,
    /// Nodes marked for draining (`tarn cluster drain`): placement moves their shards off and
    /// puts no new ones on them. The mark stays until cancelled, alive or not.
    pub draining: BTreeSet<String>,
    /// Collections whose definition or a shard record this tarn cannot decode (written by a
    /// newer version, or damaged), by name, with why. They are not in `collections`, and they
    /// are not absent either: calls naming them fail, and their local shards are left alone.
    pub unreadable: BTreeMap<String, String>,
    /// The last failed moves of shards, by (collection, shard), until one succeeds: the
    /// coordinator backs off by them, and status shows them.
    pub move_failures: BTreeMap<(String, u32), MoveFailure>,
}

/// A shard's failed moves ([`ClusterState::move_failures`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MoveFailure {
    /// The node that was to take the shard.
    pub to: String,
    /// Why the last attempt failed.
    pub error: String,
    /// Failed attempts in a row.
    pub failures: u32,
    /// When the last attempt failed (Unix milliseconds).
    pub at_unix_ms: u64,
}

impl MoveFailure {
    /// How long after the last failure the next attempt waits: 2 s doubling per failure in a
    /// row, at most 5 minutes.
    pub fn backoff(&self) -> std::time::Duration {
        let shift = self.failures.saturating_sub(1).min(8);
        std::time::Duration::from_secs((2u64 << shift).min(300))
    }

    /// Whether the next attempt may start at `now_unix_ms`.
    pub fn may_retry_at(&self, now_unix_ms: u64) -> bool {
        now_unix_ms >= self.at_unix_ms + self.backoff().as_millis() as u64
    }
}

impl ClusterState {
    /// Whether `node_id` is registered and its lease is alive.
    pub fn is_alive(&self, node_id: &str) -> bool {
        self.nodes.contains_key(node_id)
    }

    /// The shards of `collection` that `node_id` owns.
    pub fn shards_owned_by<'a>(
        &'a self,
        node_id: &'a str,
    ) -> impl Iterator<Item = (&'a CollectionMap, u32, &'a ShardAssignment)> + 'a {
        self.collections.values().flat_map(move |map| {
            map.shards
                .iter()
                .enumerate()
                .filter(move |(_, a)| a.owner == node_id)
                .map(move |(shard, a)| (map, shard as u32, a))
        })
    }

    /// The shards `node_id` leads (owns as primary), each as its name, its assignment and its
    /// collection's map: what a primary's background duties (hand-overs, replication) walk over.
    pub fn shards_led_by<'a>(
        &'a self,
        node_id: &'a str,
    ) -> impl Iterator<Item = (ShardName, &'a ShardAssignment, &'a CollectionMap)> + 'a {
        self.shards_owned_by(node_id)
            .map(|(map, shard, assignment)| {
                let name = ShardName {
                    collection: map.def.name.clone(),
                    uid: map.def.uid,
                    shard,
                };
                (name, assignment, map)
            })
    }

    /// The map of the collection `shard` belongs to: none when the collection is gone or is
    /// another incarnation of the name (a collection dropped and created again has a new uid).
    pub fn collection_of(&self, shard: &ShardName) -> Option<&CollectionMap> {
        self.collections
            .get(&shard.collection)
            .filter(|m| m.def.uid == shard.uid)
    }

    /// The assignment of `shard` in this state: none when its collection is gone, is another
    /// incarnation, or has no such shard.
    pub fn assignment(&self, shard: &ShardName) -> Option<&ShardAssignment> {
        self.collection_of(shard)
            .and_then(|m| m.shards.get(shard.shard as usize))
    }
}

/// The shard of a key (a `user_id` or a `doc_id`, by the collection's [`ShardKey`]): a fixed
/// 128-to-64-bit mix (the finaliser of MurmurHash3/SplitMix64 over both halves), reduced by
/// multiply-shift. Part of the on-disk contract: changing it would misplace every document.
pub fn shard_for(key: u128, n_shards: u32) -> u32 {
    fn mix(mut z: u64) -> u64 {
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    let h = mix(mix(key as u64) ^ (key >> 64) as u64);
    ((u128::from(h) * u128::from(n_shards.max(1))) >> 64) as u32
}

/// A shard's local collection on its owner: `<collection>.<uid as 16 hex digits>.<shard>`. A dot
/// is not allowed in collection names, so it never clashes with a user's collection.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ShardName {
    pub collection: String,
    pub uid: u64,
    pub shard: u32,
}

impl ShardName {
    /// The local collection's name (its directory on the owner).
    pub fn local_name(&self) -> String {
        format!("{}.{:016x}.{}", self.collection, self.uid, self.shard)
    }

    /// The name a router addresses: the local name and the epoch it believes in,
    /// `<local name>@<epoch>`. The owner serves it only at that epoch (fencing).
    pub fn address(&self, epoch: u64) -> String {
        format!("{}@{epoch}", self.local_name())
    }

    /// Parses a local name, or an address (then with its epoch).
    pub fn parse(name: &str) -> Option<(ShardName, Option<u64>)> {
        let (local, epoch) = match name.split_once('@') {
            Some((local, epoch)) => (local, Some(epoch.parse().ok()?)),
            None => (name, None),
        };
        let mut parts = local.rsplitn(3, '.');
        let shard: u32 = parts.next()?.parse().ok()?;
        let uid_hex = parts.next()?;
        let collection = parts.next()?;
        if collection.is_empty() || uid_hex.len() != 16 || shard >= MAX_SHARDS {
            return None;
        }
        let uid = u64::from_str_radix(uid_hex, 16).ok()?;
        Some((
            ShardName {
                collection: collection.to_owned(),
                uid,
                shard,
            },
            epoch,
        ))
    }
}

/// Spreads `n_shards` over `nodes` as evenly as possible (round robin over the node ids in
/// order, starting at an offset taken from the collection's name so that many small collections
/// do not all start on the first node), with `replication_factor - 1` replicas of each on the
/// nodes after its primary in that order (never two copies on one node: the factor is capped
/// at the number of nodes). Epochs start at 1; every copy is to be created empty by its node's
/// data directory ([`ShardAssignment::create_on`], [`ShardAssignment::create_replicas_on`]),
/// and every replica starts in sync (all copies are empty), with that directory recorded as
/// the one holding it ([`ShardAssignment::incarnations`]).
pub fn initial_placement(
    collection: &str,
    n_shards: u32,
    nodes: &[NodeInfo],
    replication_factor: u32,
) -> Vec<ShardAssignment> {
    let mut nodes: Vec<&NodeInfo> = nodes.iter().collect();
    nodes.sort_by(|a, b| a.node_id.cmp(&b.node_id));
    nodes.dedup_by(|a, b| a.node_id == b.node_id);
    if nodes.is_empty() {
        return Vec::new();
    }
    let offset = collection
        .bytes()
        .fold(0usize, |h, b| h.wrapping_mul(31).wrapping_add(b as usize));
    let n_copies = (replication_factor.max(1) as usize).min(nodes.len());
    (0..n_shards as usize)
        .map(|shard| {
            let node = nodes[(offset + shard) % nodes.len()];
            let replicas: Vec<&NodeInfo> = (1..n_copies)
                .map(|i| nodes[(offset + shard + i) % nodes.len()])
                .collect();
            let mut shard = ShardAssignment {
                replicas: replicas.iter().map(|n| n.node_id.clone()).collect(),
                in_sync_replicas: replicas.iter().map(|n| n.node_id.clone()).collect(),
                create_replicas_on: replicas.iter().map(|n| n.incarnation.clone()).collect(),
                ..ShardAssignment::created(node.node_id.clone(), 1, &node.incarnation)
            };
            for replica in &replicas {
                shard.record_incarnation(&replica.node_id, &replica.incarnation);
            }
            shard
        })
        .collect()
}

/// One shard to move, as the placement coordinator plans it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedMove {
    pub collection: String,
    pub shard: u32,
    /// The epoch the move was planned at (the pulling node refuses it if the map moved on).
    pub epoch: u64,
    pub from: String,
    pub to: String,
}

/// The next shard move that brings the cluster closer to its placement rule, or `None` when it
/// is there, for collections of one copy per shard (a replicated collection's primaries move by
/// hand-over: [`crate::plan_handover`]). The rule, per collection: no shard on a draining node, and the live nodes that are
/// not draining hold shard counts that differ by at most one. Only shards whose owner is alive
/// and serving move (a dead node's data is only on its disk: its shards wait for it); a
/// collection with a fenced shard (a move under way) is left alone. Draining moves come first,
/// each to the least loaded node (ties by node id), then balancing moves, from the most loaded
/// node to the least loaded.
pub fn plan_move(state: &ClusterState) -> Option<PlannedMove> {
    plan_move_skipping(state, &|_, _| false)
}

/// [`plan_move`], never planning a shard `skip` names (collection, shard): the coordinator
/// passes the shards whose moves failed and are backing off, so that one shard that cannot
/// move holds up no other.
pub fn plan_move_skipping(
    state: &ClusterState,
    skip: &dyn Fn(&str, u32) -> bool,
) -> Option<PlannedMove> {
    let takers: Vec<&String> = state
        .nodes
        .keys()
        .filter(|n| !state.draining.contains(*n))
        .collect();
    if takers.is_empty() {
        return None;
    }
    let mut balancing = None;
    for (name, map) in &state.collections {
        // A replicated collection's primaries move by hand-over to a replica instead
        // (`plan_handover`).
        if map.def.replication_factor > 1 || map.shards.iter().any(|a| !a.takes_writes()) {
            continue;
        }
        let mut load: BTreeMap<&String, usize> = takers.iter().map(|n| (*n, 0)).collect();
        for assignment in &map.shards {
            if let Some(n) = load.get_mut(&assignment.owner) {
                *n += 1;
            }
        }
        // The least loaded taker that holds no copy of the shard (a move never puts two
        // copies of a shard on one node).
        let least = |load: &BTreeMap<&String, usize>, shard: &ShardAssignment| {
            load.iter()
                .filter(|(id, _)| shard.role_of(id).is_none())
                .min_by_key(|(id, n)| (**n, **id))
                .map(|(id, _)| (*id).clone())
        };
        let planned = |shard: usize, to: String| PlannedMove {
            collection: name.clone(),
            shard: shard as u32,
            epoch: map.shards[shard].epoch,
            from: map.shards[shard].owner.clone(),
            to,
        };
        for (shard, assignment) in map.shards.iter().enumerate() {
            if skip(name, shard as u32) {
                continue;
            }
            if state.draining.contains(&assignment.owner) && state.is_alive(&assignment.owner) {
                if let Some(to) = least(&load, assignment) {
                    return Some(planned(shard, to));
                }
            }
        }
        if balancing.is_some() {
            continue;
        }
        let Some((most, most_n)) = load
            .iter()
            .max_by_key(|(id, n)| (**n, std::cmp::Reverse(**id)))
            .map(|(id, n)| ((*id).clone(), *n))
        else {
            continue;
        };
        let least_n = load.values().copied().min().unwrap_or(0);
        if most_n > least_n + 1 {
            // The highest-numbered shard of the most loaded node that can go to the least
            // loaded node holding no copy of it, among the nodes that a move makes more even
            // (two below the most loaded or more).
            let mut least_loaded: Vec<(usize, &String)> = load
                .iter()
                .filter(|(_, n)| **n + 1 < most_n)
                .map(|(id, n)| (*n, *id))
                .collect();
            least_loaded.sort();
            let least_loaded: Vec<&String> = least_loaded.into_iter().map(|(_, id)| id).collect();
            balancing = map
                .shards
                .iter()
                .enumerate()
                .rev()
                .filter(|(shard, a)| a.owner == most && !skip(name, *shard as u32))
                .find_map(|(shard, a)| {
                    least_loaded
                        .iter()
                        .find(|id| a.role_of(id).is_none())
                        .map(|to| planned(shard, (*to).clone()))
                });
        }
    }
    balancing
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_are_stable_and_spread_evenly() {
        // Fixed values: the function is part of the data's placement and must never change.
        assert_eq!(shard_for(0, 8), shard_for(0, 8));
        let fixed: Vec<u32> = [0u128, 1, 2, 7, 1 << 64, u128::MAX]
            .iter()
            .map(|k| shard_for(*k, 8))
            .collect();
        assert_eq!(fixed, vec![0, 3, 2, 5, 2, 6]);
        let mut counts = [0usize; 8];
        for key in 0..80_000u128 {
            counts[shard_for(key, 8) as usize] += 1;
        }
        for c in counts {
            assert!((9_000..11_000).contains(&c), "{counts:?}");
        }
        for n in [1, 3, 1024] {
            assert!((0..10_000u128).all(|k| shard_for(k, n) < n));
        }
    }

    #[test]
    fn initial_placement_is_even_and_deterministic() {
        let nodes: Vec<NodeInfo> = ["n3", "n1", "n2"]
            .iter()
            .map(|id| NodeInfo {
                node_id: (*id).to_owned(),
                address: String::new(),
                incarnation: format!("dir-of-{id}"),
            })
            .collect();
        let placement = initial_placement("docs", 8, &nodes, 1);
        assert_eq!(placement.len(), 8);
        let mut per_node = BTreeMap::new();
        for a in &placement {
            *per_node.entry(a.owner.clone()).or_insert(0) += 1;
            assert_eq!(a.epoch, 1);
            assert_eq!(a.create_on, Some(format!("dir-of-{}", a.owner)));
        }
        assert!(per_node.values().all(|&n| n == 2 || n == 3), "{per_node:?}");
        assert_eq!(placement, initial_placement("docs", 8, &nodes, 1));
        assert!(initial_placement("docs", 8, &[], 1).is_empty());
    }

    #[test]
    fn initial_placement_puts_each_copy_on_its_own_node() {
        let nodes: Vec<NodeInfo> = ["n1", "n2", "n3", "n4"]
            .iter()
            .map(|id| NodeInfo {
                node_id: (*id).to_owned(),
                address: String::new(),
                incarnation: format!("dir-of-{id}"),
            })
            .collect();
        for factor in [2, 3, 4] {
            let placement = initial_placement("docs", 8, &nodes, factor);
            let mut primaries = BTreeMap::new();
            let mut copies = BTreeMap::new();
            for a in &placement {
                let all: BTreeSet<&str> = a.copies().collect();
                assert_eq!(all.len(), factor as usize, "{a:?}");
                assert_eq!(a.replicas, a.in_sync_replicas, "new copies start in sync");
                let tokens: Vec<String> =
                    a.replicas.iter().map(|n| format!("dir-of-{n}")).collect();
                assert_eq!(a.create_replicas_on, tokens);
                *primaries.entry(a.owner.clone()).or_insert(0) += 1;
                for n in all {
                    *copies.entry(n.to_owned()).or_insert(0) += 1;
                }
            }
            assert!(primaries.values().all(|&n| n == 2), "{primaries:?}");
            assert!(copies.values().all(|&n| n == 2 * factor), "{copies:?}");
        }
        // Never more copies than nodes.
        let two = initial_placement("docs", 2, &nodes[..2], 3);
        assert!(two.iter().all(|a| a.replicas.len() == 1));
    }

    #[test]
    fn shard_names_round_trip() {
        let name = ShardName {
            collection: "docs".into(),
            uid: 0xabc,
            shard: 3,
        };
        assert_eq!(name.local_name(), "docs.0000000000000abc.3");
        assert_eq!(name.address(7), "docs.0000000000000abc.3@7");
        assert_eq!(
            ShardName::parse(&name.address(7)),
            Some((name.clone(), Some(7)))
        );
        assert_eq!(ShardName::parse(&name.local_name()), Some((name, None)));
        for bad in [
            "docs",
            "docs.3",
            ".0000000000000abc.3",
            "docs.0000000000000abc.x",
            "docs.0000000000000abc.5000",
            "docs.abc.3",
            "docs.0000000000000abc.3@x",
        ] {
            assert_eq!(ShardName::parse(bad), None, "{bad}");
        }
    }
}

/// A write's read token: the position each shard it touched reached, at which epoch, and the
/// collection incarnation it belongs to. Opaque to users (bytes in the API).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReadPositions {
    /// The collection incarnation ([`CollectionDef::uid`]; 0 on a single node).
    pub uid: u64,
    /// One per shard, ascending by shard.
    pub positions: Vec<TokenPosition>,
}

/// A shard's position in a read token.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TokenPosition {
    pub shard: u32,
    /// The shard's epoch when the write was acknowledged (0: unknown, a token of an older tarn
    /// or a single node). A shard whose data began later ([`ShardAssignment::data_since`]) was
    /// given up since: the position names a log that is gone.
    pub epoch: u64,
    /// The sequence number in the shard's log.
    pub seq: u64,
}

/// Tokens before epochs: (shard, seq) entries.
const TOKEN_MAGIC_V1: &[u8; 4] = b"TRT1";
/// (shard, epoch, seq) entries.
const TOKEN_MAGIC: &[u8; 4] = b"TRT2";

impl ReadPositions {
    /// Merges another write's positions in: per shard, the later (epoch, seq).
    pub fn merge(&mut self, other: &ReadPositions) {
        for p in &other.positions {
            match self.positions.binary_search_by_key(&p.shard, |q| q.shard) {
                Ok(i) => {
                    let q = &mut self.positions[i];
                    if (p.epoch, p.seq) > (q.epoch, q.seq) {
                        *q = *p;
                    }
                }
                Err(i) => self.positions.insert(i, *p),
            }
        }
    }

    /// `TRT2`, uid (u64 LE), count (u32 LE), then (shard u32 LE, epoch u64 LE, seq u64 LE) per
    /// shard.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(16 + 20 * self.positions.len());
        out.extend_from_slice(TOKEN_MAGIC);
        out.extend_from_slice(&self.uid.to_le_bytes());
        out.extend_from_slice(&(self.positions.len() as u32).to_le_bytes());
        for p in &self.positions {
            out.extend_from_slice(&p.shard.to_le_bytes());
            out.extend_from_slice(&p.epoch.to_le_bytes());
            out.extend_from_slice(&p.seq.to_le_bytes());
        }
        out
    }

    /// Decodes a token (either version); the error says what is wrong with it.
    pub fn decode(bytes: &[u8]) -> Result<ReadPositions, String> {
        let (rest, entry_len) = if let Some(rest) = bytes.strip_prefix(TOKEN_MAGIC) {
            (rest, 20)
        } else if let Some(rest) = bytes.strip_prefix(TOKEN_MAGIC_V1) {
            (rest, 12)
        } else {
            return Err("not a tarn read token".into());
        };
        if rest.len() < 12 {
            return Err("read token cut short".into());
        }
        let u64_at = |b: &[u8], at: usize| {
            b.get(at..at + 8)
                .and_then(|s| s.try_into().ok())
                .map(u64::from_le_bytes)
                .ok_or("read token cut short")
        };
        let u32_at = |b: &[u8], at: usize| {
            b.get(at..at + 4)
                .and_then(|s| s.try_into().ok())
                .map(u32::from_le_bytes)
                .ok_or("read token cut short")
        };
        let uid = u64_at(rest, 0)?;
        let n = u32_at(rest, 8)? as usize;
        let body = &rest[12..];
        if n > MAX_SHARDS as usize || body.len() != n * entry_len {
            return Err(format!(
                "read token of {} bytes does not hold {n} positions",
                bytes.len()
            ));
        }
        let mut positions: Vec<TokenPosition> = Vec::with_capacity(n);
        for entry in body.chunks_exact(entry_len) {
            let shard = u32_at(entry, 0)?;
            let (epoch, seq) = if entry_len == 20 {
                (u64_at(entry, 4)?, u64_at(entry, 12)?)
            } else {
                (0, u64_at(entry, 4)?)
            };
            if positions.last().is_some_and(|p| p.shard >= shard) {
                return Err("read token positions out of order".into());
            }
            positions.push(TokenPosition { shard, epoch, seq });
        }
        Ok(ReadPositions { uid, positions })
    }

    /// The position the token asks of `shard`, if any.
    pub fn get(&self, shard: u32) -> Option<TokenPosition> {
        self.positions
            .binary_search_by_key(&shard, |p| p.shard)
            .ok()
            .map(|i| self.positions[i])
    }

    /// The sequence number the token asks of `shard` (0: none).
    pub fn position(&self, shard: u32) -> u64 {
        self.get(shard).map_or(0, |p| p.seq)
    }
}

#[cfg(test)]
mod token_tests {
    use super::*;

    fn at(shard: u32, epoch: u64, seq: u64) -> TokenPosition {
        TokenPosition { shard, epoch, seq }
    }

    #[test]
    fn failed_moves_back_off_doubling_to_five_minutes() {
        let failure = |failures| MoveFailure {
            to: "n2".into(),
            error: "x".into(),
            failures,
            at_unix_ms: 1_000_000,
        };
        let waits: Vec<u64> = (1..=10).map(|n| failure(n).backoff().as_secs()).collect();
        assert_eq!(waits, vec![2, 4, 8, 16, 32, 64, 128, 256, 300, 300]);
        assert!(!failure(1).may_retry_at(1_001_999));
        assert!(failure(1).may_retry_at(1_002_000));
    }

    #[test]
    fn tokens_round_trip_merge_and_refuse_garbage() {
        let mut a = ReadPositions {
            uid: 9,
            positions: vec![at(1, 2, 10), at(5, 2, 3), at(7, 4, 50)],
        };
        let b = ReadPositions {
            uid: 9,
            positions: vec![at(0, 1, 4), at(5, 2, 8), at(7, 6, 2)],
        };
        a.merge(&b);
        // Per shard the later (epoch, seq): after a forget the new log's position wins.
        assert_eq!(
            a.positions,
            vec![at(0, 1, 4), at(1, 2, 10), at(5, 2, 8), at(7, 6, 2)]
        );
        assert_eq!(ReadPositions::decode(&a.encode()), Ok(a.clone()));
        assert_eq!(a.position(5), 8);
        assert_eq!(a.get(7), Some(at(7, 6, 2)));
        assert_eq!(a.position(2), 0);
        let bytes = a.encode();
        for cut in 0..bytes.len() {
            assert!(ReadPositions::decode(&bytes[..cut]).is_err(), "{cut}");
        }
        assert!(ReadPositions::decode(b"garbage-garbage-garbage").is_err());
        // A token of an older tarn (no epochs) still reads.
        let mut v1 = b"TRT1".to_vec();
        v1.extend_from_slice(&9u64.to_le_bytes());
        v1.extend_from_slice(&1u32.to_le_bytes());
        v1.extend_from_slice(&3u32.to_le_bytes());
        v1.extend_from_slice(&77u64.to_le_bytes());
        assert_eq!(
            ReadPositions::decode(&v1),
            Ok(ReadPositions {
                uid: 9,
                positions: vec![at(3, 0, 77)]
            })
        );
    }

    fn state_with(nodes: &[&str], owners: &[&str]) -> ClusterState {
        let mut state = ClusterState::default();
        for n in nodes {
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
                    uid: 1,
                    n_shards: owners.len() as u32,
                    shard_key: ShardKey::User,
                    config: serde_json::Value::Null,
                    replication_factor: 1,
                    min_in_sync: 1,
                },
                shards: owners
                    .iter()
                    .map(|o| ShardAssignment::serving(*o, 3))
                    .collect(),
            },
        );
        state
    }

    #[test]
    fn shards_led_by_names_each_shard_a_node_owns_and_no_other() {
        let state = state_with(&["n1", "n2"], &["n1", "n2", "n1"]);
        let led: Vec<(ShardName, String, u64)> = state
            .shards_led_by("n1")
            .map(|(name, assignment, map)| (name, assignment.owner.clone(), map.def.uid))
            .collect();
        let name = |shard| ShardName {
            collection: "c".into(),
            uid: 1,
            shard,
        };
        assert_eq!(
            led,
            vec![(name(0), "n1".into(), 1), (name(2), "n1".into(), 1)]
        );
        assert_eq!(state.shards_led_by("n3").count(), 0);
    }

    #[test]
    fn a_shard_name_finds_its_assignment_only_in_its_incarnation() {
        let state = state_with(&["n1", "n2"], &["n1", "n2"]);
        let name = |uid, shard| ShardName {
            collection: "c".into(),
            uid,
            shard,
        };
        assert_eq!(
            state.assignment(&name(1, 1)),
            Some(&ShardAssignment::serving("n2", 3))
        );
        assert_eq!(state.collection_of(&name(1, 5)).map(|m| m.def.uid), Some(1));
        assert_eq!(state.assignment(&name(1, 5)), None);
        assert_eq!(state.collection_of(&name(2, 0)), None);
        assert_eq!(state.assignment(&name(2, 0)), None);
        let other = ShardName {
            collection: "d".into(),
            ..name(1, 0)
        };
        assert_eq!(state.assignment(&other), None);
    }

    /// Applies planned moves until none is left (at most `limit`), as the coordinator would.
    fn settle(state: &mut ClusterState, limit: usize) -> Vec<PlannedMove> {
        let mut moves = Vec::new();
        while let Some(m) = plan_move(state) {
            assert!(moves.len() < limit, "no fixed point: {moves:?}");
            let slot =
                &mut state.collections.get_mut(&m.collection).unwrap().shards[m.shard as usize];
            assert_eq!(
                (slot.owner.as_str(), slot.epoch),
                (m.from.as_str(), m.epoch)
            );
            *slot = ShardAssignment::serving(m.to.clone(), slot.epoch + 2);
            moves.push(m);
        }
        moves
    }

    fn counts(state: &ClusterState) -> BTreeMap<String, usize> {
        let mut counts = BTreeMap::new();
        for a in &state.collections["c"].shards {
            *counts.entry(a.owner.clone()).or_default() += 1;
        }
        counts
    }

    #[test]
    fn a_joining_node_takes_its_share_and_a_balanced_cluster_stays_put() {
        let owners = ["a", "b", "c", "a", "b", "c", "a", "b"];
        let mut state = state_with(&["a", "b", "c"], &owners);
        assert_eq!(plan_move(&state), None, "3/3/2 is balanced");
        state.nodes.insert(
            "d".into(),
            NodeInfo {
                node_id: "d".into(),
                address: String::new(),
                incarnation: String::new(),
            },
        );
        let moves = settle(&mut state, 10);
        assert_eq!(moves.len(), 2, "{moves:?}");
        assert!(moves.iter().all(|m| m.to == "d"));
        assert!(
            counts(&state).values().all(|&n| n == 2),
            "{:?}",
            counts(&state)
        );
    }

    #[test]
    fn a_move_never_puts_two_copies_of_a_shard_on_one_node() {
        // Shards of a, each with a replica on d: balancing onto the new node d must pick
        // another node, or nothing.
        let owners = ["a", "a", "a", "b", "c"];
        let mut state = state_with(&["a", "b", "c", "d"], &owners);
        for shard in &mut state.collections.get_mut("c").unwrap().shards[..3] {
            *shard = shard.with_replica("d").unwrap();
        }
        let planned = plan_move(&state).unwrap();
        assert_eq!(planned.from, "a");
        assert_ne!(planned.to, "d", "{planned:?}");
        // Draining a: its shards go anywhere but d (which holds their replicas).
        state.draining.insert("a".into());
        for _ in 0..3 {
            let m = plan_move(&state).unwrap();
            assert_ne!(m.to, "d", "{m:?}");
            let slot = &mut state.collections.get_mut("c").unwrap().shards[m.shard as usize];
            *slot = ShardAssignment {
                owner: m.to.clone(),
                ..slot.fenced_for(&m.to).handed_over("")
            };
        }
        assert_eq!(counts(&state).get("a"), None);
    }

    /// A shard whose moves keep failing (backing off) holds up no other: the planner skips
    /// it and plans the next one (a drain of a node with one hot shard still moves the rest).
    #[test]
    fn a_shard_backing_off_holds_up_no_other_move() {
        let owners = ["a", "b", "c", "a", "b", "c", "a", "b"];
        let mut state = state_with(&["a", "b", "c"], &owners);
        state.draining.insert("a".into());
        let first = plan_move(&state).unwrap();
        let skip_first = |c: &str, s: u32| c == first.collection && s == first.shard;
        let next = plan_move_skipping(&state, &skip_first).unwrap();
        assert_eq!(next.from, "a");
        assert_ne!(next.shard, first.shard);
        // Every shard backing off: nothing to plan.
        assert_eq!(plan_move_skipping(&state, &|_, _| true), None);
        // Balancing skips it too.
        state.draining.clear();
        let owners = ["a", "a", "a", "a", "b", "c"];
        state = state_with(&["a", "b", "c"], &owners);
        let first = plan_move(&state).unwrap();
        let skip_first = |c: &str, s: u32| c == first.collection && s == first.shard;
        let next = plan_move_skipping(&state, &skip_first).unwrap();
        assert_ne!(next.shard, first.shard);
    }

    #[test]
    fn draining_moves_every_shard_off_and_dead_nodes_keep_theirs() {
        let owners = ["a", "b", "c", "a", "b", "c", "a", "b"];
        let mut state = state_with(&["a", "b", "c"], &owners);
        state.draining.insert("a".into());
        let moves = settle(&mut state, 10);
        assert_eq!(moves.len(), 3);
        assert!(moves.iter().all(|m| m.from == "a" && m.to != "a"));
        assert_eq!(counts(&state).get("a"), None);
        assert_eq!(counts(&state)["b"], 4);
        assert_eq!(counts(&state)["c"], 4);

        // A dead node's shards never move (its data is only on its disk), even when drained.
        let mut state = state_with(&["b", "c"], &owners);
        assert_eq!(plan_move(&state), None);
        state.draining.insert("a".into());
        assert_eq!(plan_move(&state), None);

        // Nowhere to go: every live node is draining.
        let mut state = state_with(&["a"], &owners);
        state.draining.insert("a".into());
        assert_eq!(plan_move(&state), None);
    }

    #[test]
    fn a_collection_with_a_move_under_way_is_left_alone() {
        let mut state = state_with(&["a", "b"], &["a", "a", "a", "a"]);
        let planned = plan_move(&state).unwrap();
        assert_eq!((planned.from.as_str(), planned.to.as_str()), ("a", "b"));
        let slot = &mut state.collections.get_mut("c").unwrap().shards[planned.shard as usize];
        *slot = slot.fenced_for("b");
        assert_eq!(slot.epoch, 4);
        assert!(!slot.takes_writes());
        assert_eq!(plan_move(&state), None);
    }

    #[test]
    fn assignments_written_before_moves_existed_still_read() {
        let old: ShardAssignment = serde_json::from_str(r#"{"owner":"n1","epoch":7}"#).unwrap();
        assert_eq!(old, ShardAssignment::serving("n1", 7));
        assert_eq!(
            serde_json::to_string(&old).unwrap(),
            r#"{"owner":"n1","epoch":7}"#
        );
        let fenced = old.fenced_for("n2");
        let text = serde_json::to_string(&fenced).unwrap();
        assert_eq!(
            text,
            r#"{"owner":"n1","epoch":8,"state":"fenced","moving_to":"n2"}"#
        );
        assert_eq!(
            serde_json::from_str::<ShardAssignment>(&text).unwrap(),
            fenced
        );
    }
}
