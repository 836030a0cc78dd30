//! The one error type of the collection crate. The server maps each variant to one gRPC status.

use std::path::PathBuf;

use tarn_index::{AttributeError, IndexError};
use tarn_wal::WalError;

pub type Result<T, E = CollectionError> = std::result::Result<T, E>;

/// What a [`CollectionError`] means for the caller: the one classification the server maps to
/// gRPC codes. Deliberately exhaustive (no `#[non_exhaustive]`): a new kind must be mapped by
/// every match on it, with no wildcard to hide behind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The request is malformed (the caller's mistake), including a rejected snapshot file.
    InvalidArgument,
    AlreadyExists,
    NotFound,
    /// Writes are refused until a restart (poisoned WAL, a dead thread) or the collection is
    /// closed. Retriable elsewhere or later.
    Unavailable,
    /// The disk is full, wherever it was found to be (WAL, checkpoint, snapshot restore).
    OutOfSpace,
    DeadlineExceeded,
    /// Stored data is damaged.
    DataLoss,
    /// Anything else: a bug or an unexpected I/O error.
    Internal,
}

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CollectionError {
    /// The request is malformed; `field` names the offending request field.
    #[error("invalid {field}: {reason}")]
    InvalidArgument { field: &'static str, reason: String },
    /// A collection already exists in the directory given to `create`.
    #[error("a collection already exists at {}", path.display())]
    AlreadyExists { path: PathBuf },
    /// No collection in the directory given to `open`.
    #[error("no collection at {}", path.display())]
    NotFound { path: PathBuf },
    /// The write-ahead log refuses writes (poisoned by an I/O error, or closed). Retriable after a
    /// restart; nothing acknowledged is lost.
    #[error("collection unavailable for writes: {0}")]
    Unavailable(WalError),
    /// The disk is full: the write was not acknowledged.
    #[error("out of disk space: {0}")]
    OutOfSpace(WalError),
    /// A `min_seq` wait ran past its deadline.
    #[error("operation {seq} not applied within the deadline (applied so far: {applied})")]
    DeadlineExceeded { seq: u64, applied: u64 },
    /// Stored data is damaged and no valid checkpoint remains.
    #[error("collection data damaged: {0}")]
    Corrupt(String),
    #[error(transparent)]
    Wal(WalError),
    #[error(transparent)]
    Index(#[from] IndexError),
    /// A file operation on the collection's own files (config, manifests) failed.
    #[error("{op} failed on {}: {source}", path.display())]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// One of the collection's threads died (`thread` names it); the collection refuses writes
    /// until it is reopened, which recovers every acknowledged write.
    #[error("collection unavailable: {0}")]
    Failed(crate::failure::ThreadFailure),
    /// The collection was closed.
    #[error("collection is closed")]
    Closed,
    /// A snapshot file is damaged, truncated, not a tarn snapshot, or inconsistent. `what` names
    /// the part (number, kind, file name, byte offset) and the defect, with expected and found
    /// values; it never holds a server path. Nothing was restored.
    #[error("snapshot refused: {what}")]
    SnapshotDamaged { what: String },
    /// A snapshot written in a newer format than this tarn reads. Nothing was restored.
    #[error(
        "snapshot format version {found} is newer than this tarn reads (up to {supported}); \
         use a newer tarn"
    )]
    SnapshotVersion { found: u32, supported: u32 },
}

impl CollectionError {
    /// What the error means for the caller. An I/O error from a full disk is `OutOfSpace`
    /// whichever layer hit it.
    pub fn kind(&self) -> ErrorKind {
        if self.is_out_of_space() {
            return ErrorKind::OutOfSpace;
        }
        match self {
            CollectionError::InvalidArgument { .. }
            | CollectionError::SnapshotDamaged { .. }
            | CollectionError::SnapshotVersion { .. } => ErrorKind::InvalidArgument,
            CollectionError::AlreadyExists { .. } => ErrorKind::AlreadyExists,
            CollectionError::NotFound { .. } => ErrorKind::NotFound,
            CollectionError::Unavailable(_)
            | CollectionError::Closed
            | CollectionError::Failed(_) => ErrorKind::Unavailable,
            CollectionError::OutOfSpace(_) => ErrorKind::OutOfSpace,
            CollectionError::DeadlineExceeded { .. } => ErrorKind::DeadlineExceeded,
            // A damaged segment file, found by a read of vectors left on disk or at open.
            CollectionError::Corrupt(_) | CollectionError::Index(IndexError::Corrupt { .. }) => {
                ErrorKind::DataLoss
            }
            CollectionError::Wal(_) | CollectionError::Index(_) | CollectionError::Io { .. } => {
                ErrorKind::Internal
            }
        }
    }

    fn is_out_of_space(&self) -> bool {
        let io_full = |error: &std::io::Error| matches!(error.raw_os_error(), Some(code) if code == libc::ENOSPC || code == libc::EDQUOT);
        match self {
            CollectionError::OutOfSpace(_) => true,
            CollectionError::Wal(error) | CollectionError::Unavailable(error) => {
                error.is_out_of_space()
            }
            CollectionError::Io { source, .. } => io_full(source),
            CollectionError::Index(IndexError::Io { source, .. }) => io_full(source),
            _ => false,
        }
    }

    /// The error as a client may see it: it names collections' parts and request fields,
    /// never a server file path (log the error itself for those).
    pub fn client_message(&self) -> String {
        match self {
            CollectionError::AlreadyExists { .. } => "a collection already exists there".to_owned(),
            CollectionError::NotFound { .. } => "no such collection".to_owned(),
            CollectionError::Unavailable(error) => {
                format!(
                    "collection unavailable for writes: {}",
                    error.client_message()
                )
            }
            CollectionError::OutOfSpace(error) => {
                format!("out of disk space: {}", error.client_message())
            }
            CollectionError::Wal(error) => error.client_message(),
            CollectionError::Index(IndexError::Io { op, source, .. }) => {
                format!("index {op} failed: {source}")
            }
            CollectionError::Index(IndexError::Corrupt { reason, .. }) => {
                format!("damaged index file: {reason}")
            }
            CollectionError::Index(IndexError::Mismatch { reason, .. }) => {
                format!("an index file does not match the collection: {reason}")
            }
            CollectionError::Io { op, source, .. } => format!("{op} failed: {source}"),
            CollectionError::Corrupt(_) => {
                "collection data damaged (the server log names the files)".to_owned()
            }
            _ => self.to_string(),
        }
    }

    pub(crate) fn invalid(field: &'static str, reason: impl Into<String>) -> Self {
        CollectionError::InvalidArgument {
            field,
            reason: reason.into(),
        }
    }

    /// Invalid attributes, filter or fields: `field` is the request field, `context` says
    /// where in it (for example "document 3"), and the message keeps the attribute error's
    /// own naming of the attribute field and the problem.
    pub(crate) fn attributes(
        field: &'static str,
        context: Option<String>,
        error: &AttributeError,
    ) -> Self {
        let message = error.to_string();
        // The error's own prefix ("attributes: ", "filter: ", "schema: ") repeats what the
        // request field says.
        let message = ["attributes: ", "filter: ", "schema: "]
            .iter()
            .find_map(|prefix| message.strip_prefix(prefix))
            .unwrap_or(&message)
            .to_string();
        let reason = match context {
            Some(context) => format!("{context}: {message}"),
            None => message,
        };
        CollectionError::invalid(field, reason)
    }

    pub(crate) fn io(op: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        CollectionError::Io {
            op,
            path: path.into(),
            source,
        }
    }
}

impl CollectionError {
    /// A copy for each of the flushes that shared one checkpoint. Errors that hold an
    /// `io::Error` keep its kind and OS error code (so a full disk stays a full disk) and its
    /// text, not its identity.
    pub(crate) fn duplicate(&self) -> CollectionError {
        fn io_copy(error: &std::io::Error) -> std::io::Error {
            match error.raw_os_error() {
                Some(code) => std::io::Error::from_raw_os_error(code),
                None => std::io::Error::new(error.kind(), error.to_string()),
            }
        }
        match self {
            CollectionError::InvalidArgument { field, reason } => {
                CollectionError::InvalidArgument {
                    field,
                    reason: reason.clone(),
                }
            }
            CollectionError::AlreadyExists { path } => {
                CollectionError::AlreadyExists { path: path.clone() }
            }
            CollectionError::NotFound { path } => CollectionError::NotFound { path: path.clone() },
            CollectionError::Unavailable(e) => CollectionError::Unavailable(e.clone()),
            CollectionError::OutOfSpace(e) => CollectionError::OutOfSpace(e.clone()),
            CollectionError::DeadlineExceeded { seq, applied } => {
                CollectionError::DeadlineExceeded {
                    seq: *seq,
                    applied: *applied,
                }
            }
            CollectionError::Corrupt(what) => CollectionError::Corrupt(what.clone()),
            CollectionError::Wal(e) => CollectionError::Wal(e.clone()),
            CollectionError::Index(IndexError::Io { op, path, source }) => CollectionError::Io {
                op,
                path: path.clone(),
                source: io_copy(source),
            },
            CollectionError::Index(other) => CollectionError::Corrupt(other.to_string()),
            CollectionError::Io { op, path, source } => CollectionError::Io {
                op,
                path: path.clone(),
                source: io_copy(source),
            },
            CollectionError::Failed(failure) => CollectionError::Failed(failure.clone()),
            CollectionError::Closed => CollectionError::Closed,
            CollectionError::SnapshotDamaged { what } => {
                CollectionError::SnapshotDamaged { what: what.clone() }
            }
            CollectionError::SnapshotVersion { found, supported } => {
                CollectionError::SnapshotVersion {
                    found: *found,
                    supported: *supported,
                }
            }
        }
    }
}

impl From<WalError> for CollectionError {
    fn from(error: WalError) -> Self {
        if error.is_out_of_space() {
            return CollectionError::OutOfSpace(error);
        }
        match error {
            WalError::Poisoned { .. } | WalError::Closed => CollectionError::Unavailable(error),
            WalError::EntryTooLarge { len, max } => CollectionError::invalid(
                "vectors",
                format!("the request encodes to {len} bytes, over the limit of {max}"),
            ),
            // An I/O error poisons the log: later writes see `Poisoned`; report this one alike.
            WalError::Io { .. } => CollectionError::Unavailable(error),
            other => CollectionError::Wal(other),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn enospc() -> std::io::Error {
        std::io::Error::from_raw_os_error(libc::ENOSPC)
    }

    #[test]
    fn a_full_disk_is_out_of_space_in_every_layer_and_messages_hold_no_paths() {
        let path = PathBuf::from("/srv/tarn/data/c/seg-000000000007.tseg");
        let errors = [
            CollectionError::io("write segment", &path, enospc()),
            CollectionError::Index(IndexError::Io {
                op: "write",
                path: path.clone(),
                source: enospc(),
            }),
            CollectionError::from(WalError::Io {
                op: "fdatasync",
                path: path.clone(),
                source: std::sync::Arc::new(enospc()),
            }),
            // A later write to a log a full disk poisoned.
            CollectionError::from(WalError::Poisoned {
                first_error: "WAL fdatasync failed: No space left on device".into(),
                out_of_space: true,
            }),
        ];
        for error in &errors {
            assert_eq!(error.kind(), ErrorKind::OutOfSpace, "{error}");
            if !matches!(
                error,
                CollectionError::OutOfSpace(WalError::Poisoned { .. })
            ) {
                assert!(
                    error.to_string().contains("/srv/tarn"),
                    "the log keeps the path"
                );
            }
            let message = error.client_message();
            assert!(!message.contains("/srv/tarn"), "{message}");
            assert_eq!(error.duplicate().kind(), ErrorKind::OutOfSpace);
        }
        let other =
            CollectionError::io("read", &path, std::io::Error::from_raw_os_error(libc::EIO));
        assert_eq!(other.kind(), ErrorKind::Internal);
        assert!(!other.client_message().contains("/srv/tarn"));
        let not_found = CollectionError::NotFound { path: path.clone() };
        assert!(!not_found.client_message().contains("/srv/tarn"));
    }
}
