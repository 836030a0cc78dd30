//! The one error type of the index crate.

use std::path::PathBuf;

pub type Result<T, E = IndexError> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum IndexError {
    /// A file operation failed.
    #[error("index {op} failed on {}: {source}", path.display())]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A sealed-segment or tombstone file is damaged or not tarn's.
    #[error("damaged index file {}: {reason}", path.display())]
    Corrupt { path: PathBuf, reason: String },
    /// A malformed byte layout (wrapped into `Corrupt` with the path by file readers).
    #[error("malformed index data: {0}")]
    Format(String),
    /// Input a caller handed in that cannot be indexed (lengths that disagree, a vector that is
    /// not finite or, under cosine, has no direction).
    #[error("invalid index input: {0}")]
    InvalidInput(String),
    /// A file written for another dimension or metric.
    #[error("index file {} does not match the collection: {reason}", path.display())]
    Mismatch { path: PathBuf, reason: String },
}

impl IndexError {
    pub(crate) fn io(op: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        IndexError::Io {
            op,
            path: path.into(),
            source,
        }
    }
}
