//! Protobuf <-> domain conversions; protobuf types stop here.

use tarn_collection::{CollectionConfig, CollectionStats, DurabilityName, HnswConfig, MetricName};
use tarn_proto::v1 as pb;
use tarn_wal::Durability;

use crate::status::ApiError;

pub fn id_to_u128(id: &pb::Id) -> u128 {
    (u128::from(id.high) << 64) | u128::from(id.low)
}

pub fn u128_to_id(value: u128) -> pb::Id {
    pb::Id {
        high: (value >> 64) as u64,
        low: value as u64,
    }
}

/// Search hits, (doc, user, score) best first, as the wire sends them.
pub fn hits(hits: impl Iterator<Item = (u128, u128, f32)>) -> Vec<pb::Hit> {
    hits.map(|(doc_id, user_id, score)| pb::Hit {
        doc_id: Some(u128_to_id(doc_id)),
        user_id: Some(u128_to_id(user_id)),
        score,
    })
    .collect()
}

pub fn to_ids(values: &[u128]) -> Vec<pb::Id> {
    values.iter().copied().map(u128_to_id).collect()
}

pub fn ids(ids: &[pb::Id]) -> Vec<u128> {
    ids.iter().map(id_to_u128).collect()
}

pub fn durability(value: i32) -> Result<Option<Durability>, ApiError> {
    match pb::Durability::try_from(value) {
        Ok(pb::Durability::Unspecified) => Ok(None),
        Ok(pb::Durability::Fsync) => Ok(Some(Durability::Fsync)),
        Ok(pb::Durability::Written) => Ok(Some(Durability::Written)),
        Err(_) => Err(ApiError::invalid(
            "durability",
            format!("unknown value {value}"),
        )),
    }
}

pub fn collection_config(
    request: &pb::CreateCollectionRequest,
) -> Result<CollectionConfig, ApiError> {
    let metric = match pb::Metric::try_from(request.metric) {
        Ok(pb::Metric::Cosine) => MetricName::Cosine,
        Ok(pb::Metric::L2) => MetricName::L2,
        Ok(pb::Metric::Dot) => MetricName::Dot,
        Ok(pb::Metric::Unspecified) => {
            return Err(ApiError::invalid("metric", "must be COSINE, L2 or DOT"))
        }
        Err(_) => {
            return Err(ApiError::invalid(
                "metric",
                format!("unknown value {}", request.metric),
            ))
        }
    };
    let mut config = CollectionConfig::new(request.dimension as usize, metric);
    if let Some(hnsw) = &request.hnsw {
        let defaults = HnswConfig::default();
        let or_default = |v: u32, d: usize| if v == 0 { d } else { v as usize };
        config.hnsw = HnswConfig {
            m: or_default(hnsw.m, defaults.m),
            ef_construction: or_default(hnsw.ef_construction, defaults.ef_construction),
            ef_search: or_default(hnsw.ef_search, defaults.ef_search),
        };
    }
    config.default_durability = match durability(request.default_durability)? {
        None | Some(Durability::Fsync) => DurabilityName::Fsync,
        Some(Durability::Written) => DurabilityName::Written,
    };
    Ok(config)
}

pub fn collection_info(
    name: &str,
    config: &CollectionConfig,
    stats: &CollectionStats,
) -> pb::CollectionInfo {
    pb::CollectionInfo {
        name: name.to_owned(),
        dimension: config.dimension as u32,
        metric: match config.metric {
            MetricName::Cosine => pb::Metric::Cosine,
            MetricName::L2 => pb::Metric::L2,
            MetricName::Dot => pb::Metric::Dot,
        } as i32,
        hnsw: Some(pb::HnswParams {
            m: config.hnsw.m as u32,
            ef_construction: config.hnsw.ef_construction as u32,
            ef_search: config.hnsw.ef_search as u32,
        }),
        default_durability: match config.default_durability {
            DurabilityName::Fsync => pb::Durability::Fsync,
            DurabilityName::Written => pb::Durability::Written,
        } as i32,
        n_documents: stats.n_documents,
        last_seq_no: stats.last_appended_seq,
        applied_seq_no: stats.applied_seq,
        checkpoint_seq_no: stats.checkpoint_seq,
        bytes_on_disk: stats.bytes_on_disk,
        durable_seq_no: stats.durable_seq,
        n_sealed_segments: stats.n_sealed_segments as u32,
        n_removed_not_compacted: stats.n_removed_not_compacted,
        n_tenants: stats.n_tenants as u32,
        n_unindexed: stats.n_unindexed,
        shards: 1,
        shard_key: pb::ShardKey::User as i32,
        replication_factor: 1,
        min_in_sync: 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip() {
        for value in [0u128, 1, u64::MAX as u128, (7u128 << 64) | 9, u128::MAX] {
            assert_eq!(id_to_u128(&u128_to_id(value)), value);
        }
    }
}
