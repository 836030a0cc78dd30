//! Collection settings, persisted in `collection.json` when the collection is created.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use tarn_index::{HnswParams, IndexConfig, Metric};
use tarn_wal::Durability;

use crate::error::{CollectionError, Result};

pub const MAX_DIMENSION: usize = 4096;
pub const MAX_TOP_K: usize = 10_000;

/// Everything fixed at creation, plus tuning that may change between opens.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CollectionConfig {
    pub dimension: usize,
    pub metric: MetricName,
    pub hnsw: HnswConfig,
    pub default_durability: DurabilityName,
    /// Tenant partitions are searched exactly up to this many vectors.
    pub graph_threshold: usize,
    /// Checkpoint once this many WAL bytes were applied since the last one.
    pub checkpoint_wal_bytes: u64,
    /// ... or once this long passed with un-checkpointed operations.
    pub checkpoint_interval_ms: u64,
    /// ... or once the mutable segment holds about this many bytes (vectors, ids and graph,
    /// superseded versions included: an upsert-heavy load fills it without the WAL growing
    /// much). Bounds the memory between checkpoints. Collections created before this setting
    /// existed get the default.
    #[serde(default = "default_checkpoint_mutable_bytes")]
    pub checkpoint_mutable_bytes: u64,
    /// Merge the smallest sealed segments while there are more than this many.
    pub max_sealed_segments: usize,
    /// Rebuild a sealed segment whose tombstoned share of slots exceeds this.
    pub rebuild_tombstone_fraction: f64,
    /// Operations queued for ingestion before writers are held back.
    pub ingest_queue: usize,
    /// Stored vectors not yet in a graph (searched exactly meanwhile) before ingestion stops to
    /// help the indexer: bounds the exact-scan cost of searches under a burst of writes.
    pub max_unindexed: usize,
    /// Checkpoint once this many stored vectors wait for a graph in the mutable segment:
    /// sealing builds their graphs with tarn's builder, several times faster than the
    /// indexer's hnsw_rs inserts (ARCHITECTURE.md, "Where graphs are built"). Collections
    /// created before this setting existed get the default.
    #[serde(default = "default_seal_unindexed")]
    pub seal_unindexed: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MetricName {
    Cosine,
    L2,
    Dot,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DurabilityName {
    Fsync,
    Written,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct HnswConfig {
    pub m: usize,
    pub ef_construction: usize,
    pub ef_search: usize,
}

impl Default for HnswConfig {
    fn default() -> Self {
        let p = HnswParams::default();
        HnswConfig {
            m: p.m,
            ef_construction: p.ef_construction,
            ef_search: p.ef_search,
        }
    }
}

fn default_checkpoint_mutable_bytes() -> u64 {
    256 << 20
}

fn default_seal_unindexed() -> usize {
    2048
}

impl CollectionConfig {
    pub fn new(dimension: usize, metric: MetricName) -> Self {
        CollectionConfig {
            dimension,
            metric,
            hnsw: HnswConfig::default(),
            default_durability: DurabilityName::Fsync,
            graph_threshold: 1024,
            checkpoint_wal_bytes: 256 << 20,
            checkpoint_interval_ms: 10 * 60 * 1000,
            checkpoint_mutable_bytes: default_checkpoint_mutable_bytes(),
            max_sealed_segments: 8,
            rebuild_tombstone_fraction: 0.2,
            ingest_queue: 4096,
            max_unindexed: 20_000,
            seal_unindexed: default_seal_unindexed(),
        }
    }

    pub fn validate(&self) -> Result<()> {
        if self.dimension == 0 || self.dimension > MAX_DIMENSION {
            return Err(CollectionError::invalid(
                "dimension",
                format!("must be from 1 to {MAX_DIMENSION}, got {}", self.dimension),
            ));
        }
        if !(2..=128).contains(&self.hnsw.m) {
            return Err(CollectionError::invalid(
                "hnsw.m",
                format!("must be from 2 to 128, got {}", self.hnsw.m),
            ));
        }
        if !(1..=4096).contains(&self.hnsw.ef_construction) {
            return Err(CollectionError::invalid(
                "hnsw.ef_construction",
                "must be from 1 to 4096",
            ));
        }
        if !(1..=MAX_TOP_K).contains(&self.hnsw.ef_search) {
            return Err(CollectionError::invalid(
                "hnsw.ef_search",
                format!("must be from 1 to {MAX_TOP_K}"),
            ));
        }
        if self.ingest_queue == 0
            || self.max_sealed_segments == 0
            || self.graph_threshold == 0
            || self.max_unindexed == 0
            || self.seal_unindexed == 0
            || self.checkpoint_mutable_bytes == 0
        {
            return Err(CollectionError::invalid(
                "config",
                "ingest_queue, max_sealed_segments, graph_threshold, max_unindexed, \
                 seal_unindexed and checkpoint_mutable_bytes must be positive",
            ));
        }
        if !(self.rebuild_tombstone_fraction > 0.0 && self.rebuild_tombstone_fraction <= 1.0) {
            return Err(CollectionError::invalid(
                "rebuild_tombstone_fraction",
                "must be in (0, 1]",
            ));
        }
        Ok(())
    }

    pub fn metric(&self) -> Metric {
        match self.metric {
            MetricName::Cosine => Metric::Cosine,
            MetricName::L2 => Metric::L2,
            MetricName::Dot => Metric::Dot,
        }
    }

    pub fn durability(&self) -> Durability {
        match self.default_durability {
            DurabilityName::Fsync => Durability::Fsync,
            DurabilityName::Written => Durability::Written,
        }
    }

    pub fn checkpoint_interval(&self) -> Duration {
        Duration::from_millis(self.checkpoint_interval_ms.max(1))
    }

    pub(crate) fn index_config(&self) -> IndexConfig {
        let mut config = IndexConfig::new(self.dimension, self.metric());
        config.hnsw = HnswParams {
            m: self.hnsw.m,
            ef_construction: self.hnsw.ef_construction,
            ef_search: self.hnsw.ef_search,
        };
        config.graph_threshold = self.graph_threshold;
        config
    }
}
