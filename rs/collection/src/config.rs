//! Collection settings, persisted in `collection.json` when the collection is created.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use tarn_index::{Bm25, FieldSpec, HnswParams, IndexConfig, Metric, Quantization, Schema};
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
    /// The declared attribute fields, in declaration order (every one is indexed). Given at
    /// creation; `Collection::add_fields` appends more and rewrites `collection.json`, so this
    /// is the schema as of the last open (`Collection::schema` is the current one). Written as
    /// `[{"name": "section", "type": "keyword"}, ...]`, left out when empty; collections
    /// created before attributes existed have none.
    #[serde(default, skip_serializing_if = "Vec::is_empty", with = "fields_json")]
    pub fields: Vec<FieldSpec>,
    /// What sealed partitions with a graph walk on (fixed at creation): written as
    /// `{"kind": "int8", "rescore": 3}`, left out when none; collections created before
    /// quantization existed have none.
    #[serde(default, skip_serializing_if = "QuantizationConfig::is_none")]
    pub quantization: QuantizationConfig,
    /// Sealed partitions that walk quantized codes leave their full vectors in the segment
    /// files and read only the candidates they rescore, and Get's vectors (fixed at creation;
    /// needs `quantization`). Left out when false.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub vectors_on_disk: bool,
    /// BM25's settings for full-text search on TEXT fields (`{"k1": 1.2, "b": 0.75}`, Lucene's
    /// defaults, left out when they are the defaults).
    #[serde(default, skip_serializing_if = "Bm25Config::is_default")]
    pub bm25: Bm25Config,
}

/// BM25's settings (`tarn_index::Bm25`, which knows nothing of serde).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Bm25Config {
    /// Term-frequency saturation, from 0 to 10.
    pub k1: f64,
    /// Length normalisation, from 0 to 1.
    pub b: f64,
}

impl Default for Bm25Config {
    fn default() -> Self {
        let bm25 = Bm25::default();
        Bm25Config {
            k1: bm25.k1,
            b: bm25.b,
        }
    }
}

impl Bm25Config {
    pub fn is_default(&self) -> bool {
        *self == Bm25Config::default()
    }

    pub fn index(self) -> Bm25 {
        Bm25 {
            k1: self.k1,
            b: self.b,
        }
    }
}

/// A collection's quantization (`tarn_index::Quantization`, which knows nothing of serde).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum QuantizationConfig {
    /// Full `f32` vectors only.
    #[default]
    None,
    /// Int8 codes per dimension; `rescore` candidates per result rescored on the full vectors.
    Int8 { rescore: usize },
    /// RaBitQ codes of `bits` per dimension (1 to 8); `rescore` candidates per result
    /// rescored on the full vectors.
    Rabitq { bits: u8, rescore: usize },
}

impl QuantizationConfig {
    pub fn is_none(&self) -> bool {
        *self == QuantizationConfig::None
    }

    pub fn index(self) -> Quantization {
        match self {
            QuantizationConfig::None => Quantization::None,
            QuantizationConfig::Int8 { rescore } => Quantization::Int8 { rescore },
            QuantizationConfig::Rabitq { bits, rescore } => Quantization::Rabitq { bits, rescore },
        }
    }
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
            fields: Vec::new(),
            quantization: QuantizationConfig::None,
            vectors_on_disk: false,
            bm25: Bm25Config::default(),
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
        if let QuantizationConfig::Rabitq { bits, .. } = self.quantization {
            if !(1..=Quantization::MAX_RABITQ_BITS).contains(&bits) {
                return Err(CollectionError::invalid(
                    "quantization.bits",
                    format!(
                        "must be from 1 to {}, got {bits}",
                        Quantization::MAX_RABITQ_BITS
                    ),
                ));
            }
        }
        if let Some(rescore) = self.quantization.index().rescore() {
            if !(1..=Quantization::MAX_RESCORE).contains(&rescore) {
                return Err(CollectionError::invalid(
                    "quantization.rescore",
                    format!(
                        "must be from 1 to {} (0 = the default, {}), got {rescore}",
                        Quantization::MAX_RESCORE,
                        Quantization::DEFAULT_RESCORE
                    ),
                ));
            }
        }
        if self.vectors_on_disk && self.quantization.is_none() {
            return Err(CollectionError::invalid(
                "vectors_on_disk",
                "needs a quantization: the graph search walks the quantized codes in memory \
                 and reads only the candidates it rescores",
            ));
        }
        if !(0.0..=10.0).contains(&self.bm25.k1) {
            return Err(CollectionError::invalid(
                "bm25.k1",
                format!("must be from 0 to 10, got {}", self.bm25.k1),
            ));
        }
        if !(0.0..=1.0).contains(&self.bm25.b) {
            return Err(CollectionError::invalid(
                "bm25.b",
                format!("must be from 0 to 1, got {}", self.bm25.b),
            ));
        }
        self.schema()?;
        Ok(())
    }

    /// The declared fields as a schema; refuses invalid names, duplicates and more than 256
    /// fields, naming `fields`.
    pub fn schema(&self) -> Result<Schema> {
        Schema::new(self.fields.clone())
            .map_err(|error| CollectionError::attributes("fields", None, &error))
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
        config.quantization = self.quantization.index();
        config.vectors_on_disk = self.vectors_on_disk;
        config
    }
}

/// `fields` in JSON: a list of `{"name": ..., "type": "keyword" | "keywords" | "number" |
/// "bool"}` (`FieldSpec` lives in tarn-index, which knows nothing of serde).
mod fields_json {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};
    use tarn_index::{FieldSpec, FieldType, TextAnalyzer};

    #[derive(Serialize, Deserialize)]
    #[serde(rename_all = "lowercase")]
    enum TypeName {
        Keyword,
        Keywords,
        Number,
        Bool,
        Text,
    }

    #[derive(Serialize, Deserialize)]
    struct Field {
        name: String,
        #[serde(rename = "type")]
        field_type: TypeName,
        /// A TEXT field's analyzer options, left out when none is on.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        english_stemmer: bool,
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        english_stop_words: bool,
    }

    pub(super) fn serialize<S: Serializer>(
        fields: &[FieldSpec],
        serializer: S,
    ) -> Result<S::Ok, S::Error> {
        let fields: Vec<Field> = fields
            .iter()
            .map(|spec| Field {
                name: spec.name.clone(),
                field_type: match spec.field_type {
                    FieldType::Keyword => TypeName::Keyword,
                    FieldType::Keywords => TypeName::Keywords,
                    FieldType::Number => TypeName::Number,
                    FieldType::Bool => TypeName::Bool,
                    FieldType::Text => TypeName::Text,
                },
                english_stemmer: spec.analyzer.english_stemmer,
                english_stop_words: spec.analyzer.english_stop_words,
            })
            .collect();
        fields.serialize(serializer)
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(
        deserializer: D,
    ) -> Result<Vec<FieldSpec>, D::Error> {
        let fields = Vec::<Field>::deserialize(deserializer)?;
        Ok(fields
            .into_iter()
            .map(|field| {
                let field_type = match field.field_type {
                    TypeName::Keyword => FieldType::Keyword,
                    TypeName::Keywords => FieldType::Keywords,
                    TypeName::Number => FieldType::Number,
                    TypeName::Bool => FieldType::Bool,
                    TypeName::Text => FieldType::Text,
                };
                FieldSpec {
                    analyzer: TextAnalyzer {
                        english_stemmer: field.english_stemmer,
                        english_stop_words: field.english_stop_words,
                    },
                    ..FieldSpec::new(field.name, field_type)
                }
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tarn_index::FieldType;

    #[test]
    fn quantization_round_trips_through_json_and_bad_rescores_are_refused() {
        let mut config = CollectionConfig::new(8, MetricName::Cosine);
        config.quantization = QuantizationConfig::Int8 { rescore: 3 };
        let json = serde_json::to_string(&config).unwrap();
        assert!(
            json.contains(r#""quantization":{"kind":"int8","rescore":3}"#),
            "{json}"
        );
        let back: CollectionConfig = serde_json::from_str(&json).unwrap();
        assert_eq!(back, config);
        assert_eq!(
            back.index_config().quantization,
            Quantization::Int8 { rescore: 3 }
        );
        for rescore in [0, Quantization::MAX_RESCORE + 1] {
            config.quantization = QuantizationConfig::Int8 { rescore };
            match config.validate() {
                Err(CollectionError::InvalidArgument { field, .. }) => {
                    assert_eq!(field, "quantization.rescore")
                }
                other => panic!("{other:?}"),
            }
        }
        config.quantization = QuantizationConfig::Rabitq {
            bits: 2,
            rescore: 5,
        };
        let json = serde_json::to_string(&config).unwrap();
        assert!(
            json.contains(r#""quantization":{"kind":"rabitq","bits":2,"rescore":5}"#),
            "{json}"
        );
        let back: CollectionConfig = serde_json::from_str(&json).unwrap();
        assert_eq!(
            back.index_config().quantization,
            Quantization::Rabitq {
                bits: 2,
                rescore: 5
            }
        );
        for (bits, rescore, field) in [
            (0, 5, "quantization.bits"),
            (9, 5, "quantization.bits"),
            (1, 0, "quantization.rescore"),
            (1, 65, "quantization.rescore"),
        ] {
            config.quantization = QuantizationConfig::Rabitq { bits, rescore };
            match config.validate() {
                Err(CollectionError::InvalidArgument { field: named, .. }) => {
                    assert_eq!(named, field)
                }
                other => panic!("{other:?}"),
            }
        }
        config.quantization = QuantizationConfig::Int8 { rescore: 3 };
        config.vectors_on_disk = true;
        let json = serde_json::to_string(&config).unwrap();
        assert!(json.contains(r#""vectors_on_disk":true"#), "{json}");
        let back: CollectionConfig = serde_json::from_str(&json).unwrap();
        assert!(back.index_config().vectors_on_disk);
        config.quantization = QuantizationConfig::None;
        match config.validate() {
            Err(CollectionError::InvalidArgument { field, .. }) => {
                assert_eq!(field, "vectors_on_disk")
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn fields_round_trip_through_json_and_old_files_have_none() {
        let mut config = CollectionConfig::new(8, MetricName::L2);
        let json = serde_json::to_string(&config).unwrap();
        assert!(!json.contains("fields"), "{json}");
        let back: CollectionConfig = serde_json::from_str(&json).unwrap();
        assert!(back.fields.is_empty());
        assert!(!json.contains("quantization"), "{json}");
        assert_eq!(back.quantization, QuantizationConfig::None);
        assert!(!json.contains("vectors_on_disk"), "{json}");
        assert!(!back.vectors_on_disk);
        config.fields = vec![
            FieldSpec::new("section", FieldType::Keyword),
            FieldSpec::new("tags", FieldType::Keywords),
            FieldSpec::new("size", FieldType::Number),
            FieldSpec::new("essential", FieldType::Bool),
        ];
        let json = serde_json::to_string(&config).unwrap();
        assert!(
            json.contains(r#"{"name":"tags","type":"keywords"}"#),
            "{json}"
        );
        let back: CollectionConfig = serde_json::from_str(&json).unwrap();
        assert_eq!(back, config);
        assert_eq!(back.schema().unwrap().len(), 4);
        config.fields.push(FieldSpec::new("size", FieldType::Bool));
        match config.validate() {
            Err(CollectionError::InvalidArgument { field, reason }) => {
                assert_eq!(field, "fields");
                assert!(reason.contains("\"size\""), "{reason}");
            }
            other => panic!("{other:?}"),
        }
    }
}
