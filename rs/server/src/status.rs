//! Every error the service can return, and the one place that maps each to a gRPC status.

use tarn_collection::CollectionError;
use tonic::Status;

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error(transparent)]
    Collection(#[from] CollectionError),
    #[error("collection '{0}' not found")]
    NotFound(String),
    #[error("collection '{0}' already exists")]
    AlreadyExists(String),
    #[error("{field}: {reason}")]
    InvalidArgument { field: &'static str, reason: String },
    #[error("too many writes in flight ({0}); retry later")]
    Overloaded(usize),
    #[error("missing or unknown API key (send `authorization: Bearer <key>`)")]
    Unauthenticated,
    #[error("this API key is read-only")]
    PermissionDenied,
    #[error("{0}")]
    Aborted(String),
    #[error("too many snapshots or restores running ({0}); retry later")]
    TooManySnapshots(usize),
    #[error("internal error: {0}")]
    Internal(String),
}

impl ApiError {
    pub fn invalid(field: &'static str, reason: impl Into<String>) -> Self {
        ApiError::InvalidArgument {
            field,
            reason: reason.into(),
        }
    }
}

impl From<ApiError> for Status {
    fn from(error: ApiError) -> Status {
        let message = error.to_string();
        match error {
            ApiError::Collection(inner) => match inner {
                CollectionError::InvalidArgument { .. } => Status::invalid_argument(message),
                CollectionError::AlreadyExists { .. } => Status::already_exists(message),
                CollectionError::NotFound { .. } => Status::not_found(message),
                CollectionError::Unavailable(_) | CollectionError::Closed => {
                    Status::unavailable(message)
                }
                CollectionError::OutOfSpace(_) => Status::resource_exhausted(message),
                CollectionError::DeadlineExceeded { .. } => Status::deadline_exceeded(message),
                CollectionError::Corrupt(_) => Status::data_loss(message),
                // An uploaded snapshot file is bad: the client's input, not the server's data.
                CollectionError::SnapshotDamaged { .. }
                | CollectionError::SnapshotVersion { .. } => Status::invalid_argument(message),
                _ => Status::internal(message),
            },
            ApiError::NotFound(_) => Status::not_found(message),
            ApiError::AlreadyExists(_) => Status::already_exists(message),
            ApiError::InvalidArgument { .. } => Status::invalid_argument(message),
            ApiError::Overloaded(_) => Status::resource_exhausted(message),
            ApiError::Unauthenticated => Status::unauthenticated(message),
            ApiError::PermissionDenied => Status::permission_denied(message),
            ApiError::Aborted(_) => Status::aborted(message),
            ApiError::TooManySnapshots(_) => Status::resource_exhausted(message),
            ApiError::Internal(_) => Status::internal(message),
        }
    }
}
