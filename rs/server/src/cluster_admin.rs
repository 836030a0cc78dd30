//! The `tarn.v1.Cluster` service: the cluster's nodes and shard placement as this node sees
//! them. A server that is not in a cluster answers FAILED_PRECONDITION.

use std::sync::Arc;

use tarn_proto::v1 as pb;
use tarn_proto::v1::cluster_server::Cluster;
use tonic::{Request, Response, Status};

use crate::auth::{Access, ApiKeys};
use crate::cluster::ClusterNode;

#[derive(Debug)]
pub struct ClusterAdmin {
    pub cluster: Option<Arc<ClusterNode>>,
    pub keys: ApiKeys,
}

impl ClusterAdmin {
    fn node(&self) -> Result<&Arc<ClusterNode>, Status> {
        self.cluster.as_ref().ok_or_else(|| {
            Status::failed_precondition("this server is not in a cluster (start it with --etcd)")
        })
    }
}

#[tonic::async_trait]
impl Cluster for ClusterAdmin {
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
        Ok(Response::new(pb::ForgetNodeResponse {
            shards: plan
                .into_iter()
                .map(|(collection, shard, new)| pb::ClusterShard {
                    collection,
                    shard,
                    node_id: new.owner,
                    epoch: new.epoch,
                    state: if request.confirm {
                        "serving"
                    } else {
                        "planned"
                    }
                    .to_owned(),
                })
                .collect(),
            applied: request.confirm,
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
            })
            .collect();
        let mut shards = Vec::new();
        for map in state.collections.values() {
            for (shard, assignment) in map.shards.iter().enumerate() {
                let alive = state.is_alive(&assignment.owner);
                if !alive && !nodes.iter().any(|n| n.node_id == assignment.owner) {
                    nodes.push(pb::ClusterNode {
                        node_id: assignment.owner.clone(),
                        address: String::new(),
                        alive: false,
                    });
                }
                shards.push(pb::ClusterShard {
                    collection: map.def.name.clone(),
                    shard: shard as u32,
                    node_id: assignment.owner.clone(),
                    epoch: assignment.epoch,
                    state: if alive { "serving" } else { "unavailable" }.to_owned(),
                });
            }
        }
        nodes.sort_by(|a, b| a.node_id.cmp(&b.node_id));
        Ok(Response::new(pb::ClusterStatusResponse {
            nodes,
            shards,
            etcd_connected: cluster.store_connected(),
        }))
    }
}
