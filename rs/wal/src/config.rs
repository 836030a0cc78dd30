//! Configuration and the small public value types of the log.

use std::path::PathBuf;
use std::time::Duration;

use crate::error::{Result, WalError};

/// How an append is acknowledged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Durability {
    /// Resolve once the entry is on disk (`fdatasync` returned). Survives power loss.
    #[default]
    Fsync,
    /// Resolve once the entry is written to the operating system. Survives a crash of the
    /// process; a power loss can lose up to [`WalConfig::background_sync_interval`] of writes.
    Written,
}

/// What to do with damage that is not a torn tail.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RecoveryMode {
    /// Refuse to open ([`crate::WalError::Corrupt`]). The default: an operator decides.
    #[default]
    Strict,
    /// Keep every entry before the first damage, cut the damaged segment there and rename every
    /// later segment to `<name>.salvaged` (kept for forensics, ignored by later opens).
    SalvagePrefix,
}

/// Log settings. `Default` gives production values.
#[derive(Debug, Clone)]
pub struct WalConfig {
    /// Largest segment reservation (`fallocate`d up front). An entry never spans segments; a
    /// segment holding one entry larger than its reservation grows to fit it.
    pub segment_bytes: u64,
    /// Disk reserved (`fallocate`) for a new log's first segment; each later segment reserves
    /// twice what the one before it held, up to `segment_bytes`, so an empty or small log
    /// takes little disk and a busy one reaches full segments after a few rollovers.
    pub initial_segment_bytes: u64,
    /// Largest payload accepted by `append`.
    pub max_entry_bytes: usize,
    /// A write group closes at this many payload bytes (it always takes at least one entry).
    pub max_group_bytes: usize,
    /// A write group closes at this many entries.
    pub max_group_entries: usize,
    /// For [`Durability::Written`] appends: longest time written data stays unsynced.
    pub background_sync_interval: Duration,
    /// How open treats damage that is not a torn tail.
    pub recovery_mode: RecoveryMode,
}

impl Default for WalConfig {
    fn default() -> Self {
        WalConfig {
            segment_bytes: 64 << 20,
            // 64 KiB: a cluster collection of 1,024 shards reserves 64 MiB, not 1 GiB, at the
            // same append rate (docs/BENCHMARKS.md, "WAL segments").
            initial_segment_bytes: 64 << 10,
            max_entry_bytes: 64 << 20,
            max_group_bytes: 8 << 20,
            max_group_entries: 4096,
            background_sync_interval: Duration::from_millis(100),
            recovery_mode: RecoveryMode::Strict,
        }
    }
}

impl WalConfig {
    /// What a new segment reserves: `initial_segment_bytes`, at most a full segment, and room
    /// for the header at least.
    pub(crate) fn first_reservation(&self) -> u64 {
        self.initial_segment_bytes
            .min(self.segment_bytes)
            .max(crate::segment::SEGMENT_HEADER_BYTES)
    }

    /// What the segment after one that reserved `previous` bytes reserves.
    pub(crate) fn next_reservation(&self, previous: u64) -> u64 {
        previous
            .saturating_mul(2)
            .clamp(self.first_reservation(), self.segment_bytes)
    }

    pub(crate) fn validate(&self) -> Result<()> {
        let problem = if self.segment_bytes < 256 {
            "segment_bytes must be at least 256"
        } else if self.initial_segment_bytes == 0 {
            "initial_segment_bytes must be positive"
        } else if self.max_entry_bytes == 0 || self.max_entry_bytes > u32::MAX as usize {
            "max_entry_bytes must be between 1 and u32::MAX"
        } else if self.max_group_bytes == 0 || self.max_group_entries == 0 {
            "max_group_bytes and max_group_entries must be positive"
        } else if self.background_sync_interval.is_zero() {
            "background_sync_interval must be positive"
        } else {
            return Ok(());
        };
        Err(WalError::InvalidConfig(problem.to_owned()))
    }
}

/// What open found and repaired.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecoveryReport {
    /// Oldest sequence number still in the log (equal to `next_seq` when the log is empty).
    pub first_seq: u64,
    /// Last sequence number in the log, 0 when none was ever written.
    pub last_seq: u64,
    /// Segment files in use after recovery.
    pub n_segments: usize,
    /// A torn or corrupt tail that was cut off.
    pub torn_tail: Option<TailRepair>,
    /// Damage cut off under [`RecoveryMode::SalvagePrefix`].
    pub salvage: Option<Salvage>,
    /// Left-over `.wal.tmp` files of interrupted segment creations, deleted.
    pub removed_temp_files: Vec<PathBuf>,
    /// Files that are not the log's, left alone.
    pub ignored_files: Vec<PathBuf>,
}

/// A cut-off tail of the last segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TailRepair {
    pub path: PathBuf,
    /// Where the log now ends (the new appends go here).
    pub offset: u64,
    /// Non-zero bytes dropped after `offset` (they are overwritten with zeros).
    pub bytes_dropped: u64,
    /// How many entries those bytes appear to have held (frames with a plausible header).
    pub entries_dropped: u64,
    /// What was wrong at `offset`.
    pub reason: String,
}

/// Damage that salvage cut off.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Salvage {
    pub path: PathBuf,
    pub offset: u64,
    pub reason: String,
    /// Later segments renamed aside, whole.
    pub quarantined: Vec<PathBuf>,
}
