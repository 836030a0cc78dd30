//! `tarn-dataplane`: the cluster's data plane, below the gRPC layer. [`Router`] is what the
//! server's handlers call: this node's own collections ([`Registry`], `local.rs`) and, in cluster
//! mode, every call split by shard and sent to the shards' owners (`routing/`, `fanout.rs`)
//! through this node's [`ClusterNode`] (membership, the shard map: `cluster/`; reconciliation:
//! `reconcile.rs`), with shard moves, seeds and hand-overs (`transfer/`, asked for by the placement
//! coordinator: `coordinator/`) and replication to a shard's replicas (`replica_set/`).
//!
//! It implements no tonic service and knows no CLI: the node-to-node calls it makes and answers
//! are the `tarn.v1.Node` messages of `tarn-proto`, and the server's `Node` service hands them
//! to [`node`]'s functions. Every error is an [`ApiError`], mapped to a gRPC status in one place
//! (`status.rs`).

mod cluster;
pub mod convert;
mod coordinator;
mod epochs;
mod fanout;
mod faults;
mod ledger;
mod local;
mod reconcile;
mod registry;
mod replica_set;
mod replica_state;
mod router;
mod routing;
mod snapshots;
mod start;
mod status;
mod transfer;

pub use cluster::{ClusterConfig, ClusterNode, JoinOptions, MoveCounters, NODE_SECRET_HEADER};
pub use local::{removal_filter, StoredDocument};
pub use registry::{validate_name, Registry};
pub use replica_set::ReplicaFigures;
pub use router::{Router, RouterMetrics};
pub use snapshots::{restore_from_stream, stream_snapshot, ChunkStream, MAX_CONCURRENT_SNAPSHOTS};
pub use status::ApiError;

/// The node-to-node calls the server's `tarn.v1.Node` service hands to the data plane.
pub mod node {
    pub use crate::replica_set::append_entries;
    pub use crate::transfer::{pull_shard, shard_stream};
}
