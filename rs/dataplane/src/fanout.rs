//! The router's fan-out, as pure functions (`routing/` calls them): a request split by shard
//! ([`split`], [`search_shards`]), the shards' hits merged ([`merge`]), their positions made a
//! read token ([`read_token`]), another node's errors named by shard ([`forwarded`]), and the
//! deadline a forwarded call gets ([`forward_deadline`]).

use std::collections::BTreeMap;
use std::time::Duration;

use tarn_client::Code;
use tarn_cluster::{
    merge_top_k, shard_for, CollectionDef, CollectionMap, ReadPositions, ShardHit, ShardKey,
};
use tarn_collection::{CollectionConfig, MetricName};

use crate::status::ApiError;

/// How long a forwarded call may take when the client set no deadline.
const DEFAULT_FORWARD_DEADLINE: Duration = Duration::from_secs(30);

/// One shard's part of a request: the indexes of its documents in the request, and its tenants.
pub type ShardPart = (Vec<usize>, Vec<u128>);

/// Splits (doc ids x user ids) by shard: for each shard concerned, in shard order, the indexes
/// of its documents in the request and its tenants. USER: each tenant's shard gets every
/// document; DOC: each document's shard gets every tenant. No tenant listed means tenant 0.
pub fn split(def: &CollectionDef, doc_ids: &[u128], user_ids: &[u128]) -> Vec<(u32, ShardPart)> {
    let users: Vec<u128> = if user_ids.is_empty() {
        vec![0]
    } else {
        user_ids.to_vec()
    };
    let mut by_shard: BTreeMap<u32, ShardPart> = BTreeMap::new();
    match def.shard_key {
        ShardKey::User => {
            for user in users {
                let entry = by_shard.entry(shard_for(user, def.n_shards)).or_default();
                entry.1.push(user);
            }
            for entry in by_shard.values_mut() {
                entry.0 = (0..doc_ids.len()).collect();
            }
        }
        ShardKey::Doc => {
            for (i, doc) in doc_ids.iter().enumerate() {
                let entry = by_shard.entry(shard_for(*doc, def.n_shards)).or_default();
                entry.0.push(i);
            }
            for entry in by_shard.values_mut() {
                entry.1 = users.clone();
            }
        }
    }
    by_shard.into_iter().collect()
}

/// The shards a search over `user_ids` touches: the tenants' shards (USER), or all (DOC).
pub fn search_shards(def: &CollectionDef, user_ids: &[u128]) -> Vec<u32> {
    match def.shard_key {
        ShardKey::Doc => (0..def.n_shards).collect(),
        ShardKey::User => {
            let mut shards: Vec<u32> = if user_ids.is_empty() {
                vec![shard_for(0, def.n_shards)]
            } else {
                user_ids
                    .iter()
                    .map(|u| shard_for(*u, def.n_shards))
                    .collect()
            };
            shards.sort_unstable();
            shards.dedup();
            shards
        }
    }
}

/// Whether higher scores are better for the collection's metric.
pub fn higher_is_better(def: &CollectionDef) -> bool {
    serde_json::from_value::<CollectionConfig>(def.config.clone())
        .map_or(true, |c| c.metric != MetricName::L2)
}

/// The forward deadline: what the client has left, or the default.
pub fn forward_deadline(client_deadline: Option<Duration>) -> Duration {
    client_deadline.unwrap_or(DEFAULT_FORWARD_DEADLINE)
}

/// A remote error, with the shard it came from when the owner could not be reached or did not
/// answer in time.
pub fn forwarded(map: &CollectionMap, shard: u32, error: tarn_client::Error) -> ApiError {
    if error.code() == Code::DeadlineExceeded {
        // The router names the copy it asked (`routing/mod.rs`, `on_shard`).
        return ApiError::DeadlineExceeded(format!(
            "shard {shard} of collection '{}' did not answer within the deadline ({})",
            map.def.name,
            error.message()
        ));
    }
    if error.code() == Code::Unavailable {
        return ApiError::ShardUnavailable {
            collection: map.def.name.clone(),
            shard,
            node: map.shards[shard as usize].owner.clone(),
            why: error.message().to_owned(),
        };
    }
    ApiError::Forwarded(error)
}

/// Another node's refusal or failure, as [`forwarded`] (a transport failure is the node being
/// unreachable; a deadline is the caller's).
pub fn forwarded_status(map: &CollectionMap, shard: u32, status: tonic::Status) -> ApiError {
    forwarded(map, shard, tarn_client::Error::from(status))
}

/// Converts hits of either path into the merge's type.
pub fn shard_hits(hits: impl IntoIterator<Item = (u128, u128, f32)>) -> Vec<ShardHit> {
    hits.into_iter()
        .map(|(doc_id, user_id, score)| ShardHit {
            doc_id,
            user_id,
            score,
        })
        .collect()
}

/// The merged top-k of shard results.
pub fn merge(def: &CollectionDef, results: Vec<Vec<ShardHit>>, top_k: usize) -> Vec<ShardHit> {
    merge_top_k(results, top_k, higher_is_better(def))
}

/// A read token for positions in `map`'s shards: (shard, sequence number, the epoch the write
/// was acknowledged at: that of the map its successful attempt was routed by).
pub fn read_token(map: &CollectionMap, positions: Vec<(u32, u64, u64)>) -> Vec<u8> {
    let mut token = ReadPositions {
        uid: map.def.uid,
        positions: Vec::new(),
    };
    token.merge(&ReadPositions {
        uid: map.def.uid,
        positions: positions
            .into_iter()
            .map(|(shard, seq, epoch)| tarn_cluster::TokenPosition { shard, epoch, seq })
            .collect(),
    });
    token.encode()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn def(shard_key: ShardKey, n_shards: u32) -> CollectionDef {
        CollectionDef {
            name: "c".into(),
            uid: 1,
            n_shards,
            shard_key,
            config: serde_json::Value::Null,
            replication_factor: 1,
            min_in_sync: 1,
        }
    }

    #[test]
    fn requests_split_by_tenant_or_by_document_and_lose_nothing() {
        let docs: Vec<u128> = (0..100).collect();
        let users: Vec<u128> = (0..20).collect();
        // USER: every part holds every document; each tenant lands on its own shard once.
        let parts = split(&def(ShardKey::User, 8), &docs, &users);
        let mut tenants: Vec<u128> = parts.iter().flat_map(|(_, (_, u))| u.clone()).collect();
        tenants.sort_unstable();
        assert_eq!(tenants, users);
        for (shard, (doc_idx, part_users)) in &parts {
            assert_eq!(doc_idx.len(), docs.len());
            assert!(part_users.iter().all(|u| shard_for(*u, 8) == *shard));
        }
        // No tenant: tenant 0's shard.
        let parts = split(&def(ShardKey::User, 8), &docs, &[]);
        assert_eq!(parts.len(), 1);
        assert_eq!(parts[0].0, shard_for(0, 8));
        assert_eq!(parts[0].1 .1, vec![0]);
        // DOC: every document once, on its own shard, with every tenant.
        let parts = split(&def(ShardKey::Doc, 8), &docs, &users);
        let mut seen: Vec<usize> = parts.iter().flat_map(|(_, (d, _))| d.clone()).collect();
        seen.sort_unstable();
        assert_eq!(seen, (0..100).collect::<Vec<_>>());
        for (shard, (doc_idx, part_users)) in &parts {
            assert!(doc_idx.iter().all(|&i| shard_for(docs[i], 8) == *shard));
            assert_eq!(part_users, &users);
        }
        assert!(parts.windows(2).all(|w| w[0].0 < w[1].0), "in shard order");
    }

    #[test]
    fn searches_touch_the_tenants_shards_or_all() {
        let user = def(ShardKey::User, 16);
        assert_eq!(search_shards(&user, &[]), vec![shard_for(0, 16)]);
        let shards = search_shards(&user, &[1, 2, 3, 1]);
        let mut want: Vec<u32> = [1u128, 2, 3].iter().map(|u| shard_for(*u, 16)).collect();
        want.sort_unstable();
        want.dedup();
        assert_eq!(shards, want);
        assert_eq!(
            search_shards(&def(ShardKey::Doc, 4), &[7]),
            vec![0, 1, 2, 3]
        );
    }
}
