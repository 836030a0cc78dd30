//! The `tarn.v1.Cluster` service: the cluster's nodes and shard placement as this node sees
//! them. A server that is not in a cluster answers FAILED_PRECONDITION.

use std::sync::Arc;

use tarn_proto::v1 as pb;
use tarn_proto::v1::cluster_server::Cluster;
use tonic::{Request, Response, Status};

use crate::auth::{Access, ApiKeys};
use tarn_dataplane::ApiError;
use tarn_dataplane::ClusterNode;

#[derive(Debug)]
pub struct ClusterAdmin {
    pub cluster: Option<Arc<ClusterNode>>,
    pub keys: ApiKeys,
    /// The data service (imports of set-aside copies go through its router).
    pub tarn: Arc<crate::service::TarnService>,
}

impl ClusterAdmin {
    fn node(&self) -> Result<&Arc<ClusterNode>, Status> {
        self.cluster.as_ref().ok_or_else(|| {
            Status::failed_precondition("this server is not in a cluster (start it with --etcd)")
        })
    }
}

/// A shard's new record in `ForgetNode`'s reply: serving once `applied`, else planned.
fn shard_to_wire(
    collection: String,
    shard: u32,
    new: &tarn_cluster::ShardAssignment,
    applied: bool,
) -> pb::ClusterShard {
    pb::ClusterShard {
        collection,
        shard,
        node_id: new.owner.clone(),
        epoch: new.epoch,
        state: if applied { "serving" } else { "planned" }.to_owned(),
        moving_to: String::new(),
        move_problem: String::new(),
        in_sync: new.in_sync().map(str::to_owned).collect(),
        replicas: new.replicas.clone(),
        min_in_sync: 0,
        replication_lag: Vec::new(),
    }
}

#[tonic::async_trait]
impl Cluster for ClusterAdmin {
    async fn drain(
        &self,
        request: Request<pb::DrainRequest>,
    ) -> Result<Response<pb::DrainResponse>, Status> {
        self.keys.check(&request, Access::Write)?;
        let cluster = self.node()?;
        let request = request.into_inner();
        let state = cluster.state();
        let known = state.is_alive(&request.node_id)
            || state.shards_owned_by(&request.node_id).next().is_some()
            || state.draining.contains(&request.node_id);
        if request.node_id.is_empty() || request.node_id.contains('/') {
            return Err(Status::from(ApiError::invalid(
                "node_id",
                format!("{:?} is not a node id", request.node_id),
            )));
        }
        if !known && !request.cancel {
            return Err(Status::not_found(format!(
                "node {} is not in the cluster (not alive, owns no shards)",
                request.node_id
            )));
        }
        cluster
            .set_draining(&request.node_id, !request.cancel)
            .await
            .map_err(Status::from)?;
        tracing::info!(node = %request.node_id, cancel = request.cancel, "drain requested");
        Ok(Response::new(pb::DrainResponse {
            shards_left: state.shards_owned_by(&request.node_id).count() as u32,
        }))
    }

    async fn forget_node(
        &self,
        request: Request<pb::ForgetNodeRequest>,
    ) -> Result<Response<pb::ForgetNodeResponse>, Status> {
        self.keys.check(&request, Access::Write)?;
        let cluster = self.node()?;
        let request = request.into_inner();
        let plan = cluster
            .forget(&request.node_id, request.confirm)
            .await
            .map_err(Status::from)?;
        let applied = request.confirm;
        Ok(Response::new(pb::ForgetNodeResponse {
            kept: plan
                .kept
                .into_iter()
                .map(|(collection, shard, new)| shard_to_wire(collection, shard, &new, applied))
                .collect(),
            set_aside: plan
                .set_aside
                .into_iter()
                .map(|(collection, shard, new)| shard_to_wire(collection, shard, &new, applied))
                .collect(),
            // A given-up shard starts empty: the reply lists no copies for it.
            shards: plan
                .given_up
                .into_iter()
                .map(|(collection, shard, new)| pb::ClusterShard {
                    in_sync: Vec::new(),
                    replicas: Vec::new(),
                    ..shard_to_wire(collection, shard, &new, applied)
                })
                .collect(),
            applied,
        }))
    }

    async fn status(
        &self,
        request: Request<pb::ClusterStatusRequest>,
    ) -> Result<Response<pb::ClusterStatusResponse>, Status> {
        self.keys.check(&request, Access::Read)?;
        let cluster = self.node()?;
        let state = cluster.state();
        // Nodes: the live ones, and every owner whose lease lapsed (it still owns its shards).
        let mut nodes: Vec<pb::ClusterNode> = state
            .nodes
            .values()
            .map(|n| pb::ClusterNode {
                node_id: n.node_id.clone(),
                address: n.address.clone(),
                alive: true,
                draining: state.draining.contains(&n.node_id),
            })
            .collect();
        // Replication lag is known to primaries only: this node's own shards.
        let mut lags: std::collections::HashMap<(String, u32), Vec<pb::ReplicaLag>> =
            std::collections::HashMap::new();
        for figure in cluster.replication_figures() {
            lags.entry((figure.collection, figure.shard))
                .or_default()
                .push(pb::ReplicaLag {
                    node_id: figure.node,
                    entries: figure.lag,
                    in_sync: figure.in_sync,
                });
        }
        let mut shards = Vec::new();
        for map in state.collections.values() {
            for (shard, assignment) in map.shards.iter().enumerate() {
                let alive = state.is_alive(&assignment.owner);
                if !alive && !nodes.iter().any(|n| n.node_id == assignment.owner) {
                    nodes.push(pb::ClusterNode {
                        node_id: assignment.owner.clone(),
                        address: String::new(),
                        alive: false,
                        draining: state.draining.contains(&assignment.owner),
                    });
                }
                shards.push(pb::ClusterShard {
                    collection: map.def.name.clone(),
                    shard: shard as u32,
                    node_id: assignment.owner.clone(),
                    epoch: assignment.epoch,
                    state: match (alive, assignment.state) {
                        (false, _) => "unavailable",
                        (true, tarn_cluster::ShardState::Fenced) => "fenced",
                        (true, tarn_cluster::ShardState::Serving) => "serving",
                    }
                    .to_owned(),
                    moving_to: assignment.moving_to.clone().unwrap_or_default(),
                    move_problem: state
                        .move_failures
                        .get(&(map.def.name.clone(), shard as u32))
                        .map(|f| {
                            format!(
                                "moving to {} failed {} times in a row, the last: {}",
                                f.to, f.failures, f.error
                            )
                        })
                        .unwrap_or_default(),
                    replicas: assignment.replicas.clone(),
                    in_sync: assignment.in_sync().map(str::to_owned).collect(),
                    min_in_sync: map.def.min_in_sync,
                    replication_lag: lags
                        .remove(&(map.def.name.clone(), shard as u32))
                        .unwrap_or_default(),
                });
            }
        }
        nodes.sort_by(|a, b| a.node_id.cmp(&b.node_id));
        Ok(Response::new(pb::ClusterStatusResponse {
            nodes,
            shards,
            etcd_connected: cluster.store_connected(),
            cluster_id: cluster.cluster_id.clone(),
            set_aside: cluster.registry().set_aside_list()?.len() as u32,
            unreadable: state.unreadable.keys().cloned().collect(),
        }))
    }

    async fn list_set_aside(
        &self,
        request: Request<pb::ListSetAsideRequest>,
    ) -> Result<Response<pb::ListSetAsideResponse>, Status> {
        self.keys.check(&request, Access::Read)?;
        let cluster = self.node()?;
        let shards = cluster
            .registry()
            .set_aside_list()?
            .into_iter()
            .map(|(name, reason, bytes)| pb::SetAsideShard {
                name,
                reason,
                bytes,
            })
            .collect();
        Ok(Response::new(pb::ListSetAsideResponse { shards }))
    }

    async fn drop_set_aside(
        &self,
        request: Request<pb::DropSetAsideRequest>,
    ) -> Result<Response<pb::DropSetAsideResponse>, Status> {
        self.keys.check(&request, Access::Write)?;
        let cluster = self.node()?;
        let name = request.into_inner().name;
        cluster.registry().drop_set_aside(&name).await?;
        tracing::warn!(%name, "set-aside shard copy dropped");
        Ok(Response::new(pb::DropSetAsideResponse {}))
    }

    async fn import_set_aside(
        &self,
        request: Request<pb::ImportSetAsideRequest>,
    ) -> Result<Response<pb::ImportSetAsideResponse>, Status> {
        self.keys.check(&request, Access::Write)?;
        let api_key = crate::auth::api_key(&request);
        let cluster = self.node()?;
        let request = request.into_inner();
        let n_documents = self
            .tarn
            .router
            .import_set_aside(
                cluster,
                &request.name,
                &request.collection,
                api_key.as_deref(),
            )
            .await?;
        Ok(Response::new(pb::ImportSetAsideResponse { n_documents }))
    }
}
