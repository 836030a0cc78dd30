//! `tarn-index`: the vector segments of a collection.
//!
//! - [`MutableSegment`]: takes ingested upserts and removes; per-tenant partitions, searched
//!   exactly while small and through an hnsw_rs graph past a threshold.
//! - [`SealedSegment`]: immutable, in tarn's own checksummed file format, searched by tarn's own
//!   HNSW loop over flat `u32` neighbour lists; only tombstones change. Sealed from a mutable
//!   segment, or built straight from [`BulkDocuments`] by tarn's own parallel HNSW builder
//!   ([`BuildConfig`], `builder.rs`).
//!
//! - Documents carry typed attributes ([`Attributes`] of a [`Schema`]'s fields), indexed per
//!   partition ([`AttributeIndex`]), so that a search with a [`Filter`] knows its exact matches
//!   and returns `min(k, matches)` hits (`filtered.rs`).
//!
//! - Sealed partitions with a graph may also keep int8 codes of their vectors ([`Quantization`],
//!   `quantized.rs`): the graph walk reads the codes, the best candidates are rescored on the
//!   full vectors.
//!
//! The crate knows nothing of the WAL or protobuf, and hnsw_rs types never leave it.

mod attribute_index;
mod attributes;
mod bitset;
mod builder;
mod bytes;
mod cold;
mod config;
mod error;
mod filter;
mod filtered;
mod flat_graph;
pub mod fsutil;
mod fulltext;
mod hnsw_graph;
mod metric;
mod mutable;
mod quantized;
mod rabitq;
mod sealed;
mod search;
pub mod simd;
mod stored;
mod visited;

pub use attribute_index::{AttributeIndex, SlotSet};
pub use attributes::{
    shown as shown_name, AttributeError, Attributes, FieldSpec, FieldType, Schema, Value,
};
pub use builder::BuildConfig;
pub use config::{HnswParams, IndexConfig};
pub use error::{IndexError, Result};
pub use filter::Filter;
pub use filtered::FILTER_EXACT_SCAN_MAX_MATCHES;
pub use fulltext::{Bm25, TermWeights, TextAnalyzer, TextStats};
pub use metric::{dot, l2_squared, Metric};
pub use mutable::MutableSegment;
pub use quantized::Quantization;
pub use sealed::{BulkAttributes, BulkDocuments, SealedSegment, SegmentFigures};
pub use search::Hit;
