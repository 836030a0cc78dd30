//! The cluster's shared state as every node sees it: live nodes, collection definitions and the
//! shard map (shard -> owner node, epoch, state). It lives in etcd ([`crate::ClusterStore`]);
//! this module only describes it and answers questions about it.

use std::collections::BTreeMap;

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
}

/// Where a shard lives. Designed to grow replicas: `owner` is the one node that takes writes
/// today; replicas will be a list beside it, under the same epoch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardAssignment {
    /// The node that holds the shard's data and takes its writes.
    pub owner: String,
    /// Bumped by every change of owner (compare-and-swap in etcd). Forwarded writes carry the
    /// epoch the router believes in; the owner accepts only its current one.
    pub epoch: u64,
}

/// One collection's definition and shard map.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CollectionMap {
    pub def: CollectionDef,
    /// Indexed by shard number.
    pub shards: Vec<ShardAssignment>,
}

/// Everything a node knows of the cluster, as of one etcd revision.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ClusterState {
    /// The etcd revision this view was read at (0 for a fresh in-memory store).
    pub revision: i64,
    /// Live nodes (their lease has not lapsed), by node id.
    pub nodes: BTreeMap<String, NodeInfo>,
    pub collections: BTreeMap<String, CollectionMap>,
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
/// do not all start on the first node). Epochs start at 1.
pub fn initial_placement(
    collection: &str,
    n_shards: u32,
    nodes: &[String],
) -> Vec<ShardAssignment> {
    let mut nodes: Vec<&String> = nodes.iter().collect();
    nodes.sort();
    nodes.dedup();
    if nodes.is_empty() {
        return Vec::new();
    }
    let offset = collection
        .bytes()
        .fold(0usize, |h, b| h.wrapping_mul(31).wrapping_add(b as usize));
    (0..n_shards as usize)
        .map(|shard| ShardAssignment {
            owner: nodes[(offset + shard) % nodes.len()].clone(),
            epoch: 1,
        })
        .collect()
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
        let nodes = vec!["n3".to_owned(), "n1".to_owned(), "n2".to_owned()];
        let placement = initial_placement("docs", 8, &nodes);
        assert_eq!(placement.len(), 8);
        let mut per_node = BTreeMap::new();
        for a in &placement {
            *per_node.entry(a.owner.clone()).or_insert(0) += 1;
            assert_eq!(a.epoch, 1);
        }
        assert!(per_node.values().all(|&n| n == 2 || n == 3), "{per_node:?}");
        assert_eq!(placement, initial_placement("docs", 8, &nodes));
        assert!(initial_placement("docs", 8, &[]).is_empty());
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

/// A write's read token: the position each shard it touched reached, and the collection
/// incarnation it belongs to. Opaque to users (bytes in the API).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReadPositions {
    /// The collection incarnation ([`CollectionDef::uid`]; 0 on a single node).
    pub uid: u64,
    /// (shard, sequence number in that shard), one per shard, ascending by shard.
    pub positions: Vec<(u32, u64)>,
}

const TOKEN_MAGIC: &[u8; 4] = b"TRT1";

impl ReadPositions {
    /// Merges another write's positions in (the later position per shard).
    pub fn merge(&mut self, other: &ReadPositions) {
        for &(shard, seq) in &other.positions {
            match self.positions.binary_search_by_key(&shard, |p| p.0) {
                Ok(i) => self.positions[i].1 = self.positions[i].1.max(seq),
                Err(i) => self.positions.insert(i, (shard, seq)),
            }
        }
    }

    /// `TRT1`, uid (u64 LE), count (u32 LE), then (shard u32 LE, seq u64 LE) per shard.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(16 + 12 * self.positions.len());
        out.extend_from_slice(TOKEN_MAGIC);
        out.extend_from_slice(&self.uid.to_le_bytes());
        out.extend_from_slice(&(self.positions.len() as u32).to_le_bytes());
        for (shard, seq) in &self.positions {
            out.extend_from_slice(&shard.to_le_bytes());
            out.extend_from_slice(&seq.to_le_bytes());
        }
        out
    }

    /// Decodes a token; the error says what is wrong with it.
    pub fn decode(bytes: &[u8]) -> Result<ReadPositions, String> {
        let rest = bytes
            .strip_prefix(TOKEN_MAGIC)
            .ok_or("not a tarn read token")?;
        if rest.len() < 12 {
            return Err("read token cut short".into());
        }
        let uid = u64::from_le_bytes(rest[..8].try_into().map_err(|_| "read token cut short")?);
        let n = u32::from_le_bytes(rest[8..12].try_into().map_err(|_| "read token cut short")?)
            as usize;
        let body = &rest[12..];
        if n > MAX_SHARDS as usize || body.len() != n * 12 {
            return Err(format!(
                "read token of {} bytes does not hold {n} positions",
                bytes.len()
            ));
        }
        let mut positions = Vec::with_capacity(n);
        for entry in body.chunks_exact(12) {
            let shard = u32::from_le_bytes(entry[..4].try_into().map_err(|_| "bad entry")?);
            let seq = u64::from_le_bytes(entry[4..].try_into().map_err(|_| "bad entry")?);
            if positions.last().is_some_and(|&(s, _)| s >= shard) {
                return Err("read token positions out of order".into());
            }
            positions.push((shard, seq));
        }
        Ok(ReadPositions { uid, positions })
    }

    /// The position the token asks of `shard` (0: none).
    pub fn position(&self, shard: u32) -> u64 {
        self.positions
            .binary_search_by_key(&shard, |p| p.0)
            .map_or(0, |i| self.positions[i].1)
    }
}

#[cfg(test)]
mod token_tests {
    use super::*;

    #[test]
    fn tokens_round_trip_merge_and_refuse_garbage() {
        let mut a = ReadPositions {
            uid: 9,
            positions: vec![(1, 10), (5, 3)],
        };
        let b = ReadPositions {
            uid: 9,
            positions: vec![(0, 4), (5, 8)],
        };
        a.merge(&b);
        assert_eq!(a.positions, vec![(0, 4), (1, 10), (5, 8)]);
        assert_eq!(ReadPositions::decode(&a.encode()), Ok(a.clone()));
        assert_eq!(a.position(5), 8);
        assert_eq!(a.position(2), 0);
        let bytes = a.encode();
        for cut in 0..bytes.len() {
            assert!(ReadPositions::decode(&bytes[..cut]).is_err(), "{cut}");
        }
        assert!(ReadPositions::decode(b"garbage-garbage-garbage").is_err());
    }
}
