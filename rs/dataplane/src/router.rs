//! [`Router`]: the data plane's entry point for the gRPC layer. It holds what a call needs below
//! the service: the local collections ([`Registry`]), the write slots, the metrics the data plane
//! records and, in cluster mode, this node's [`ClusterNode`]. Its methods are this node's own
//! collections' operations (`local.rs`) and the cluster's routed ones (`routing/`).

use std::sync::Arc;

use prometheus::{Histogram, HistogramVec, IntCounter, IntCounterVec};
use tokio::sync::Semaphore;

use crate::cluster::{ClusterNode, ShardWrite};
use crate::registry::Registry;
use crate::status::ApiError;

/// The metrics the data plane records; the server registers them and hands clones here.
#[derive(Debug, Clone)]
pub struct RouterMetrics {
    /// Insert/remove: from handing the operation to the WAL to its acknowledgement.
    pub append_ack: Histogram,
    /// Cluster mode: calls a router sent to another node, by RPC.
    pub forwarded: IntCounterVec,
    /// Cluster mode: a routed call from start to its merged answer, by RPC.
    pub fan_out: HistogramVec,
    /// Cluster mode: shard calls sent again after the shard's owner or state changed.
    pub retried_on_moved_shard: IntCounter,
}

/// This node's data plane: local collections, and in cluster mode the router over the shards.
#[derive(Debug)]
pub struct Router {
    pub registry: Arc<Registry>,
    /// Cluster mode: this node's membership and view of the shard map.
    pub cluster: Option<Arc<ClusterNode>>,
    /// Bounds writes waiting for their WAL group; past it, RESOURCE_EXHAUSTED.
    write_slots: Arc<Semaphore>,
    max_inflight_writes: usize,
    pub(crate) metrics: RouterMetrics,
}

impl Router {
    pub fn new(
        registry: Arc<Registry>,
        cluster: Option<Arc<ClusterNode>>,
        max_inflight_writes: usize,
        metrics: RouterMetrics,
    ) -> Router {
        Router {
            registry,
            cluster,
            write_slots: Arc::new(Semaphore::new(max_inflight_writes)),
            max_inflight_writes,
            metrics,
        }
    }

    /// The cluster router for a call naming `collection`, unless this node serves the call
    /// itself: single-node mode, or a shard address sent by a router.
    pub fn cluster_for(&self, collection: &str) -> Option<&Arc<ClusterNode>> {
        self.cluster
            .as_ref()
            .filter(|_| tarn_cluster::ShardName::parse(collection).is_none())
    }

    /// The local collection a call names: a user collection, or (cluster mode) a shard
    /// address, served only at the epoch it names.
    pub async fn resolve(&self, name: &str) -> Result<tarn_collection::Collection, ApiError> {
        if let (Some(cluster), Some((shard, Some(epoch)))) =
            (&self.cluster, tarn_cluster::ShardName::parse(name))
        {
            return cluster.local_copy(&self.registry, &shard, epoch).await;
        }
        self.registry.get(name)
    }

    /// [`Router::resolve`] for a write: a shard address is served only while the shard
    /// takes writes, and the shard's write gate is held until the write is acknowledged.
    pub(crate) async fn resolve_for_write(
        &self,
        name: &str,
    ) -> Result<(tarn_collection::Collection, Option<ShardWrite>), ApiError> {
        if let (Some(cluster), Some((shard, Some(epoch)))) =
            (&self.cluster, tarn_cluster::ShardName::parse(name))
        {
            let write = cluster.local_shard_for_write(&shard, epoch).await?;
            return Ok((write.collection.clone(), Some(write)));
        }
        Ok((self.registry.get(name)?, None))
    }

    pub(crate) fn write_permit(&self) -> Result<tokio::sync::OwnedSemaphorePermit, ApiError> {
        Arc::clone(&self.write_slots)
            .try_acquire_owned()
            .map_err(|_| ApiError::Overloaded(self.max_inflight_writes))
    }
}
