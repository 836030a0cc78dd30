//! Index settings.

use crate::metric::Metric;
use crate::quantized::Quantization;

/// HNSW build and search parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HnswParams {
    /// Links per node (hnsw_rs's `max_nb_connection`), 2 to 128.
    pub m: usize,
    /// Candidate list size while building.
    pub ef_construction: usize,
    /// Default candidate list size while searching.
    pub ef_search: usize,
}

impl Default for HnswParams {
    fn default() -> Self {
        HnswParams {
            m: 16,
            ef_construction: 200,
            ef_search: 64,
        }
    }
}

/// What a segment needs to know about its collection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IndexConfig {
    pub dimension: usize,
    pub metric: Metric,
    pub hnsw: HnswParams,
    /// A tenant partition is searched exactly until it holds this many vectors; past it, the
    /// mutable segment builds an hnsw_rs graph and sealed segments keep a graph.
    pub graph_threshold: usize,
    /// What sealed partitions with a graph walk on: full vectors, or quantized codes rescored
    /// on the full vectors (`quantized.rs`).
    pub quantization: Quantization,
    /// Sealed partitions that walk quantized codes leave their full vectors in the segment
    /// file and read only the candidates they rescore (`cold.rs`); without quantization it
    /// changes nothing.
    pub vectors_on_disk: bool,
}

impl IndexConfig {
    pub fn new(dimension: usize, metric: Metric) -> Self {
        IndexConfig {
            dimension,
            metric,
            hnsw: HnswParams::default(),
            graph_threshold: 1024,
            quantization: Quantization::None,
            vectors_on_disk: false,
        }
    }
}
