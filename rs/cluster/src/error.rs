//! The one error type of the cluster crate.

/// What can go wrong talking to the coordination store or routing to shards.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClusterError {
    /// Another live node is registered under this node id (and is not this data directory's
    /// previous process).
    #[error("node id {node_id:?} is already registered by a live node: {detail}")]
    DuplicateNode { node_id: String, detail: String },
    /// The coordination store (etcd) cannot be reached or refused a request. Retriable.
    #[error("coordination store unavailable: {0}")]
    StoreUnavailable(String),
    /// A value in the store does not decode (written by a newer or broken tarn).
    #[error("coordination store holds a bad value at {key}: {reason}")]
    BadValue { key: String, reason: String },
    /// The store broke the history the node holds it to (etcd wiped, replaced, or restored from
    /// an older backup under the running node): the node is fenced. Not retriable.
    #[error("the cluster's store broke its history, this node is fenced: {0}")]
    HistoryBroken(String),
}

pub type Result<T, E = ClusterError> = std::result::Result<T, E>;
