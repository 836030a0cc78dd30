//! The one error type of the log crate.

use std::io;
use std::path::PathBuf;
use std::sync::Arc;

/// Result alias used throughout `tarn-wal`.
pub type Result<T, E = WalError> = std::result::Result<T, E>;

/// Everything that can go wrong in the log.
///
/// The type is `Clone` so that the error a write-group leader hits can be handed to every member
/// of the group unchanged: I/O errors are kept behind an `Arc`.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum WalError {
    /// A file operation failed. `op` names the step (`"write"`, `"fdatasync"`, ...).
    #[error("WAL {op} failed on {}: {source}", path.display())]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: Arc<io::Error>,
    },
    /// An earlier write or fdatasync failed. The log refuses every later append and sync, because
    /// after a failed fdatasync the kernel may have dropped the dirty pages: retrying could report
    /// data durable that never reached the disk. Reopen the log to recover what is durable.
    #[error(
        "WAL is poisoned by an earlier failure and refuses writes until reopened: {first_error}"
    )]
    Poisoned {
        first_error: Arc<str>,
        /// The first error was the disk being full: every later refusal is out-of-space too.
        out_of_space: bool,
    },
    /// Damage that is not a torn tail: inside a sealed segment, or followed by valid entries, or a
    /// missing range of sequence numbers. Opening with [`crate::RecoveryMode::SalvagePrefix`] keeps
    /// everything before it.
    #[error("WAL damaged in {} at byte {offset}: {reason}", path.display())]
    Corrupt {
        path: PathBuf,
        offset: u64,
        reason: String,
    },
    /// A payload larger than [`crate::WalConfig::max_entry_bytes`].
    #[error("WAL entry of {len} bytes exceeds the maximum of {max} bytes")]
    EntryTooLarge { len: usize, max: usize },
    /// Replay asked for entries that truncation already deleted.
    #[error(
        "WAL entries from {requested} were truncated; the oldest entry left is {first_available}"
    )]
    Truncated {
        requested: u64,
        first_available: u64,
    },
    /// Replay asked for entries past the last one appended.
    #[error("WAL entries up to {requested} were requested; the log ends at {last_appended}")]
    BeyondEnd { requested: u64, last_appended: u64 },
    /// [`crate::Wal::create_at`] was given a directory that is not empty.
    #[error("cannot create a WAL in {}: the directory is not empty", path.display())]
    NotEmpty { path: PathBuf },
    /// The log was closed (its writer thread has stopped).
    #[error("WAL is closed")]
    Closed,
    /// A configuration value out of range.
    #[error("invalid WAL configuration: {0}")]
    InvalidConfig(String),
}

impl WalError {
    pub(crate) fn io(op: &'static str, path: impl Into<PathBuf>, source: io::Error) -> Self {
        WalError::Io {
            op,
            path: path.into(),
            source: Arc::new(source),
        }
    }

    /// The error as a client may see it: like `Display`, without server file paths (log the
    /// error itself for those).
    pub fn client_message(&self) -> String {
        match self {
            WalError::Io { op, source, .. } => format!("WAL {op} failed: {source}"),
            WalError::Corrupt { offset, reason, .. } => {
                format!("WAL damaged at byte {offset}: {reason}")
            }
            WalError::NotEmpty { .. } => {
                "cannot create a WAL: the directory is not empty".to_owned()
            }
            WalError::Poisoned { .. }
            | WalError::EntryTooLarge { .. }
            | WalError::Truncated { .. }
            | WalError::BeyondEnd { .. }
            | WalError::Closed
            | WalError::InvalidConfig(_) => self.to_string(),
        }
    }

    /// True when the error comes from the disk being full (`ENOSPC` or `EDQUOT`).
    pub fn is_out_of_space(&self) -> bool {
        match self {
            WalError::Poisoned { out_of_space, .. } => *out_of_space,
            WalError::Io { source, .. } => matches!(
                source.raw_os_error(),
                Some(code) if code == rustix::io::Errno::NOSPC.raw_os_error()
                    || code == rustix::io::Errno::DQUOT.raw_os_error()
            ),
            _ => false,
        }
    }
}
