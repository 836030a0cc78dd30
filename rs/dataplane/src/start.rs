//! A node's start in cluster mode: [`ClusterNode::join`] registers it (`cluster/`) and starts
//! the tasks that act on its view of the map: reconciliation of its local copies
//! (`reconcile.rs`) and the placement coordinator (`coordinator/`). The data plane's layers
//! meet here, above all of them, so that `cluster/` (membership and the view) depends on none
//! of the parts that use it.

use std::sync::Arc;

use tarn_cluster::ClusterStore;

use crate::cluster::{ClusterNode, JoinOptions};
use crate::registry::Registry;

impl ClusterNode {
    /// Joins: registers this node under a lease (refused if a live node has the id; a
    /// registration carrying `incarnation`, this data directory's token, is this directory's
    /// previous process and is taken over at once), starts watching the shard map, and starts
    /// reconciliation and the placement coordinator.
    ///
    /// A data directory that belongs to a cluster joins only the etcd that holds that
    /// cluster's id.
    pub async fn join(
        store: Arc<dyn ClusterStore>,
        options: JoinOptions,
        registry: Arc<Registry>,
    ) -> anyhow::Result<Arc<ClusterNode>> {
        let node = ClusterNode::register(store, options, registry).await?;
        tokio::spawn(crate::reconcile::reconcile(Arc::downgrade(&node)));
        tokio::spawn(crate::coordinator::coordinate(Arc::downgrade(&node)));
        Ok(node)
    }
}
