//! `tarn-wal`: a segmented, checksummed write-ahead log with group commit.
//!
//! Appends go through a write group led by a dedicated writer thread: concurrent callers' entries
//! are written with one vectored write and made durable with one `fdatasync`. Open recovers from
//! crashes: a torn tail is cut off, other damage is refused (or salvaged on request). The crate
//! knows nothing of vectors, protobuf or async runtimes; its tickets are plain futures.
//!
//! The byte layout and the recovery rules are in `docs/WAL_FORMAT.md`.

mod config;
mod entry;
mod error;
mod log_writer;
mod recovery;
mod replay;
mod segment;
mod segmented_log;
mod write_group;

pub use config::{Durability, RecoveryMode, RecoveryReport, Salvage, TailRepair, WalConfig};
pub use error::{Result, WalError};
pub use log_writer::{
    AppendObserver, Histogram, Wal, WalStats, GROUP_SIZE_BOUNDS, SYNC_SECONDS_BOUNDS,
};
pub use recovery::cut_after;
pub use replay::{Replay, ReplayPosition};
pub use write_group::{forbid_ticket_waits, Abandoned, Ticket};

/// Byte-layout constants, for tests and tools that inspect segment files.
pub mod layout {
    pub use crate::entry::ENTRY_HEADER_BYTES;
    pub use crate::segment::{segment_file_name, SEGMENT_HEADER_BYTES};
}
