//! `tarn-collection`: a collection of tenant-owned vectors: the WAL, the segments, the
//! ingestion worker, checkpoints, and snapshots (taking, restoring, verifying). The only crate
//! that knows both the log and the index.

mod checkpoint;
mod collection;
mod config;
mod error;
mod failure;
mod flush;
mod indexer;
mod ingestion;
mod manifest;
mod memory;
mod op;
mod restore;
mod retention;
mod segments;
mod snapshot;
mod snapshot_format;
mod triggers;
mod wal_tail;

pub use collection::{
    Collection, CollectionStats, SearchHit, SearchRequest, MAX_PAIRS_PER_REQUEST,
};
pub use config::{
    CollectionConfig, DurabilityName, HnswConfig, MetricName, MAX_DIMENSION, MAX_TOP_K,
};
pub use error::{CollectionError, ErrorKind, Result};
pub use failure::ThreadFailure;
pub use restore::{remove_interrupted_restores, verify_snapshot, SnapshotRestore};
pub use snapshot::Snapshot;
pub use snapshot_format::SnapshotInfo;
pub use tarn_index::{
    AttributeError, Attributes, FieldSpec, FieldType, Filter, Schema, Value,
    FILTER_EXACT_SCAN_MAX_MATCHES,
};
pub use tarn_wal::Durability;
pub use wal_tail::WalTail;

/// Entry points for the fuzz targets in `fuzz/` (not part of the API): each decodes untrusted
/// bytes the way recovery does and reports whether they were accepted. They must never panic.
#[doc(hidden)]
pub mod fuzzing {
    /// A checkpoint manifest file's bytes (JSON with a CRC32).
    pub fn decode_manifest(bytes: &[u8]) -> bool {
        crate::manifest::decode_checked::<crate::manifest::Manifest>(bytes).is_ok()
    }

    /// A `collection.json` file's bytes (JSON with a CRC32), validated as at open.
    pub fn decode_config(bytes: &[u8]) -> bool {
        crate::manifest::decode_checked::<crate::config::CollectionConfig>(bytes)
            .is_ok_and(|c| c.validate().is_ok())
    }

    /// A snapshot file's bytes, checked as `verify_snapshot` checks them (in chunks of 61
    /// bytes, so that fields split across pushes are exercised too).
    pub fn decode_snapshot(bytes: &[u8]) -> bool {
        let mut decoder = crate::snapshot_format::SnapshotDecoder::new();
        let mut sink = crate::snapshot_format::DiscardSink;
        bytes
            .chunks(61)
            .try_for_each(|chunk| decoder.push(chunk, &mut sink))
            .and_then(|()| decoder.finish())
            .is_ok()
    }

    /// A WAL entry's payload, decoded into an operation for a collection of `dimension`.
    pub fn decode_operation(bytes: &[u8], dimension: usize) -> bool {
        crate::op::decode(bytes, dimension).is_ok()
    }
}
