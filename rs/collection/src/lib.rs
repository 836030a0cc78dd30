//! `tarn-collection`: a collection of tenant-owned vectors: the WAL, the segments, the
//! ingestion worker and checkpoints. The only crate that knows both the log and the index.

mod collection;
mod config;
mod error;
mod ingest;
mod manifest;
mod op;
mod segments;

pub use collection::{
    Collection, CollectionStats, SearchHit, SearchRequest, MAX_PAIRS_PER_REQUEST,
};
pub use config::{
    CollectionConfig, DurabilityName, HnswConfig, MetricName, MAX_DIMENSION, MAX_TOP_K,
};
pub use error::{CollectionError, Result};
pub use tarn_wal::Durability;
