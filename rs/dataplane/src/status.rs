//! Every error the data plane and the gRPC services can return ([`ApiError`]), and the one place
//! that maps each to a gRPC status (here, beside the type: the server and the router's answers to
//! other nodes both need it).

use tarn_collection::{CollectionError, ErrorKind};
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
    /// Cluster mode: a node-to-node call (or a shard address) from a caller without the
    /// cluster's node credential.
    #[error("node-to-node calls are for the cluster's nodes only (they carry the cluster's node credential); client API keys cannot make them")]
    NotANode,
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
    /// Cluster mode: another node needed for the call cannot be reached.
    #[error("{0}")]
    Unavailable(String),
    /// Cluster mode: etcd cannot be reached (placement waits until it is back).
    #[error("cluster coordination unavailable: {0}")]
    ClusterStore(String),
    /// A call that did not finish within the client's deadline (or the default one).
    #[error("{0}")]
    DeadlineExceeded(String),
    #[error("internal error: {0}")]
    Internal(String),
    /// One part of a call made of several (a batch's search) failed: its error, named.
    #[error("{part}: {inner}")]
    Within { part: String, inner: Box<ApiError> },
}

impl ApiError {
    /// This error as the failure of `part` of a call made of several (`searches[3]`): the
    /// same code, the message prefixed with the part.
    pub fn within(self, part: &str) -> ApiError {
        ApiError::Within {
            part: part.to_owned(),
            inner: Box::new(self),
        }
    }

    pub fn invalid(field: &'static str, reason: impl Into<String>) -> Self {
        ApiError::InvalidArgument {
            field,
            reason: reason.into(),
        }
    }

    /// This error of a shard call, naming the node whose copy was asked (a spread read may ask
    /// a replica, not the owner): operators are sent to the copy that failed.
    pub(crate) fn naming_copy(self, node: &str) -> ApiError {
        match self {
            ApiError::ShardUnavailable {
                collection,
                shard,
                why,
                ..
            } => ApiError::ShardUnavailable {
                collection,
                shard,
                node: node.to_owned(),
                why,
            },
            ApiError::DeadlineExceeded(message) if !message.contains(" on node ") => {
                ApiError::DeadlineExceeded(format!("{message} (its copy on node {node})"))
            }
            other => other,
        }
    }
}

impl From<ApiError> for Status {
    fn from(error: ApiError) -> Status {
        let message = error.to_string();
        match error {
            ApiError::Collection(inner) => {
                // The client gets no server paths; the log keeps the full error.
                let client_message = inner.client_message();
                if client_message != message {
                    tracing::warn!(error = %message, "collection error (sent without server paths)");
                }
                let message = client_message;
                // Exhaustive on purpose: a new kind must be given its code here.
                match inner.kind() {
                    // Including a bad uploaded snapshot file: the client's input.
                    ErrorKind::InvalidArgument => Status::invalid_argument(message),
                    ErrorKind::AlreadyExists => Status::already_exists(message),
                    ErrorKind::NotFound => Status::not_found(message),
                    ErrorKind::Unavailable => Status::unavailable(message),
                    ErrorKind::OutOfSpace => Status::resource_exhausted(message),
                    ErrorKind::DeadlineExceeded => Status::deadline_exceeded(message),
                    ErrorKind::DataLoss => Status::data_loss(message),
                    ErrorKind::Internal => Status::internal(message),
                }
            }
            ApiError::NotFound(_) => Status::not_found(message),
            ApiError::AlreadyExists(_) => Status::already_exists(message),
            ApiError::InvalidArgument { .. } => Status::invalid_argument(message),
            ApiError::Overloaded(_) => {
                with_retry_after(Status::resource_exhausted(message), WRITE_RETRY_AFTER_MS)
            }
            ApiError::Unauthenticated => Status::unauthenticated(message),
            ApiError::PermissionDenied | ApiError::NotANode => Status::permission_denied(message),
            ApiError::Aborted(_) => Status::aborted(message),
            ApiError::TooManySnapshots(_) => {
                with_retry_after(Status::resource_exhausted(message), SNAPSHOT_RETRY_AFTER_MS)
            }
            ApiError::StaleShardMap(_) => Status::aborted(message),
            ApiError::Unsupported(_) => Status::failed_precondition(message),
            ApiError::ClusterStore(detail) => {
                // The detail names etcd's endpoints: for the log, not for clients.
                tracing::warn!(error = %detail, "cluster coordination store unavailable");
                Status::unavailable(
                    "cluster coordination unavailable: this node cannot reach the cluster's \
                     coordination store (etcd) now; retry",
                )
            }
            ApiError::ShardUnavailable { .. } | ApiError::Unavailable(_) => {
                Status::unavailable(message)
            }
            ApiError::Forwarded(error) => Status::new(forwarded_code(error.code()), message),
            ApiError::DeadlineExceeded(_) => Status::deadline_exceeded(message),
            ApiError::Internal(_) => Status::internal(message),
            ApiError::Within { part, inner } => {
                let status = Status::from(*inner);
                Status::with_metadata(
                    status.code(),
                    format!("{part}: {}", status.message()),
                    status.metadata().clone(),
                )
            }
        }
    }
}

/// The metadata key of the retry hint on an overload answer: milliseconds to wait before
/// trying the same call again (the Rust and Python clients read it).
pub const RETRY_AFTER_MS: &str = "retry-after-ms";
/// The hint when every write slot is taken: about one group commit and its apply.
const WRITE_RETRY_AFTER_MS: u64 = 50;
/// The hint when every snapshot or restore slot is taken: those take seconds.
const SNAPSHOT_RETRY_AFTER_MS: u64 = 1000;

fn with_retry_after(mut status: Status, millis: u64) -> Status {
    status
        .metadata_mut()
        .insert(RETRY_AFTER_MS, tonic::metadata::MetadataValue::from(millis));
    status
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clients_never_see_the_coordination_store_s_endpoints() {
        let error = ApiError::ClusterStore(
            "coordination store unavailable: etcd at http://10.0.0.5:2379: no answer in 5s".into(),
        );
        let status = Status::from(error);
        assert_eq!(status.code(), tonic::Code::Unavailable);
        assert!(
            !status.message().contains("10.0.0.5"),
            "{}",
            status.message()
        );
        assert!(status.message().contains("etcd"), "{}", status.message());
    }
}
