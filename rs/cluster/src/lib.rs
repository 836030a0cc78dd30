//! `tarn-cluster`: cluster mode's shared state and its rules. Membership (nodes under etcd
//! leases), collection definitions and the shard map live in a [`ClusterStore`] (etcd in
//! production, [`MemoryStore`] in tests); [`map`] places shards and documents; [`merge_top_k`]
//! merges shard results. Knows nothing of WAL bytes, HNSW or protobuf; never runs a consensus,
//! election or membership protocol of its own (etcd does).

mod copies;
mod epochs;
mod error;
mod etcd;
pub mod etcd_api;
pub mod map;
mod merge;
mod replicas;
mod store;

pub use copies::{fate_of_copy, CopyEvidence, CopyFate, ShardRecord};
pub use epochs::{last_common_seq, EpochHistory};
pub use error::{ClusterError, Result};
pub use etcd::{EtcdStore, Leadership, DEFAULT_PREFIX, ELECTION_TTL, REQUEST_TIMEOUT};
pub use map::{
    initial_placement, plan_move, plan_move_skipping, shard_for, ClusterState, CollectionDef,
    CollectionMap, HistoryWitness, MoveFailure, NodeInfo, PlannedMove, ReadPositions,
    ShardAssignment, ShardKey, ShardName, ShardState, TokenPosition, DEFAULT_SHARDS, MAX_SHARDS,
};
pub use merge::{merge_top_k, ShardHit};
pub use replicas::{
    is_another_directory, plan_handover, plan_handover_skipping, plan_promotions,
    plan_replaced_copies, replication_settings, CopyRole, HandoverStep, PlannedHandover,
    PlannedLeave, PlannedPromotion, TooFewInSync,
};
pub use store::{
    ClusterIdentity, ClusterStore, Leader, Liveness, MemoryStore, Registration, ShardSwap,
    StoreIdentity,
};
