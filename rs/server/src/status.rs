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
    /// Cluster mode: a forwarded call named a shard at an epoch its owner is no longer at.
    #[error("{0}")]
    StaleShardMap(String),
    /// Cluster mode: a shard's owner is down or unreachable.
    #[error("shard {shard} of collection '{collection}' is unavailable: its node {node} cannot be reached ({why})")]
    ShardUnavailable {
        collection: String,
        shard: u32,
        node: String,
        why: String,
    },
    /// Cluster mode: another node's answer, passed on with its code.
    #[error("{}", .0.message())]
    Forwarded(tarn_client::Error),
    /// A call this server cannot serve in its mode (said plainly, with what to do instead).
    #[error("{0}")]
    Unsupported(String),
    /// Cluster mode: etcd cannot be reached (placement waits until it is back).
    #[error("cluster coordination unavailable: {0}")]
    ClusterStore(String),
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
                CollectionError::Unavailable(_)
                | CollectionError::Closed
                | CollectionError::Failed(_) => Status::unavailable(message),
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
            ApiError::StaleShardMap(_) => Status::aborted(message),
            ApiError::Unsupported(_) => Status::failed_precondition(message),
            ApiError::ShardUnavailable { .. } | ApiError::ClusterStore(_) => {
                Status::unavailable(message)
            }
            ApiError::Forwarded(error) => Status::new(forwarded_code(error.code()), message),
            ApiError::Internal(_) => Status::internal(message),
        }
    }
}

/// The gRPC code of another node's answer, passed on unchanged.
fn forwarded_code(code: tarn_client::Code) -> tonic::Code {
    use tarn_client::Code as C;
    match code {
        C::Cancelled => tonic::Code::Cancelled,
        C::InvalidArgument => tonic::Code::InvalidArgument,
        C::DeadlineExceeded => tonic::Code::DeadlineExceeded,
        C::NotFound => tonic::Code::NotFound,
        C::AlreadyExists => tonic::Code::AlreadyExists,
        C::PermissionDenied => tonic::Code::PermissionDenied,
        C::ResourceExhausted => tonic::Code::ResourceExhausted,
        C::FailedPrecondition => tonic::Code::FailedPrecondition,
        C::Aborted => tonic::Code::Aborted,
        C::OutOfRange => tonic::Code::OutOfRange,
        C::Unimplemented => tonic::Code::Unimplemented,
        C::Internal => tonic::Code::Internal,
        C::Unavailable => tonic::Code::Unavailable,
        C::DataLoss => tonic::Code::DataLoss,
        C::Unauthenticated => tonic::Code::Unauthenticated,
        _ => tonic::Code::Unknown,
    }
}
