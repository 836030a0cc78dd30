//! The `tarn.v1.Node` service: node-to-node calls only. Every call is refused without the
//! cluster's node credential (`ClusterNode::check_node`), whatever API key it carries. A
//! shard's data calls name the shard by collection, uid, shard and epoch (`ShardRef`) and are
//! served by the same handlers as clients' calls, on the shard's local collection at exactly
//! that epoch; the public `tarn.v1.Tarn` service refuses shard names from the wire (an
//! in-process marker, never sent, tells the handlers a call came through here).

use std::sync::Arc;

use tarn_cluster::ShardName;
use tarn_proto::v1 as pb;
use tarn_proto::v1::node_server::Node;
use tarn_proto::v1::tarn_server::Tarn;
use tonic::{Request, Response, Status};

use crate::service::TarnService;
use tarn_dataplane::ApiError;
use tarn_dataplane::ClusterNode;

/// Marks a request handed from the `Node` service to a `Tarn` handler in this process: only
/// such a request may name a shard address. Request extensions are never sent over the wire.
#[derive(Debug, Clone, Copy)]
pub(crate) struct FromNodeService;

/// The epoch a forwarded search's or get's read-token position was acknowledged at
/// (`ShardSearchRequest::min_seq_epoch`, `ShardGetRequest::min_seq_epoch`), handed to the `Tarn` handler beside the request.
#[derive(Debug, Clone, Copy)]
pub(crate) struct TokenEpoch(pub u64);

#[derive(Debug)]
pub struct NodeService {
    pub cluster: Option<Arc<ClusterNode>>,
    pub tarn: Arc<TarnService>,
}

/// The collection name a shard's data call runs on: its address, `<local name>@<epoch>`.
fn address(shard: Option<pb::ShardRef>) -> Result<String, ApiError> {
    let shard = shard.ok_or_else(|| ApiError::invalid("shard", "missing"))?;
    tarn_dataplane::validate_name(&shard.collection)?;
    Ok(ShardName {
        collection: shard.collection,
        uid: shard.uid,
        shard: shard.shard,
    }
    .address(shard.epoch))
}

impl NodeService {
    fn node(&self) -> Result<&Arc<ClusterNode>, Status> {
        self.cluster.as_ref().ok_or_else(|| {
            Status::failed_precondition("this server is not in a cluster (start it with --etcd)")
        })
    }

    /// Checks the node credential, and hands `message` to a `Tarn` handler as a request with
    /// the caller's metadata (its API key, its deadline) and the in-process marker.
    fn inner<M, T>(
        &self,
        request: Request<M>,
        message: impl FnOnce(M) -> Result<T, ApiError>,
    ) -> Result<Request<T>, Status> {
        self.node()?.check_node(&request)?;
        let (metadata, mut extensions, outer) = request.into_parts();
        extensions.insert(FromNodeService);
        Ok(Request::from_parts(metadata, extensions, message(outer)?))
    }

    /// A shard read's request for the `Tarn` handler: the inner request addressed to the
    /// shard (`address_to` sets its collection and clears its read token: the router sent the
    /// shard's own position in `min_seq_no`), with the epoch of that position attached.
    fn shard_read<M, T>(
        &self,
        request: Request<M>,
        min_seq_epoch: u64,
        parts: impl FnOnce(M) -> (Option<pb::ShardRef>, Option<T>),
        address_to: impl FnOnce(&mut T, String),
    ) -> Result<Request<T>, Status> {
        let mut request = self.inner(request, |m| {
            let (shard, inner) = parts(m);
            let mut inner = inner.ok_or_else(|| ApiError::invalid("request", "missing"))?;
            address_to(&mut inner, address(shard)?);
            Ok(inner)
        })?;
        request.extensions_mut().insert(TokenEpoch(min_seq_epoch));
        Ok(request)
    }
}

#[tonic::async_trait]
impl Node for NodeService {
    type ShardStreamStream =
        tokio_stream::wrappers::ReceiverStream<Result<pb::ShardStreamMessage, Status>>;

    async fn insert(
        &self,
        request: Request<pb::ShardInsertRequest>,
    ) -> Result<Response<pb::InsertResponse>, Status> {
        let request = self.inner(request, |m| {
            let mut inner = m
                .request
                .ok_or_else(|| ApiError::invalid("request", "missing"))?;
            inner.collection = address(m.shard)?;
            Ok(inner)
        })?;
        self.tarn.insert(request).await
    }

    async fn remove(
        &self,
        request: Request<pb::ShardRemoveRequest>,
    ) -> Result<Response<pb::RemoveResponse>, Status> {
        let request = self.inner(request, |m| {
            let mut inner = m
                .request
                .ok_or_else(|| ApiError::invalid("request", "missing"))?;
            inner.collection = address(m.shard)?;
            Ok(inner)
        })?;
        self.tarn.remove(request).await
    }

    async fn search(
        &self,
        request: Request<pb::ShardSearchRequest>,
    ) -> Result<Response<pb::SearchResponse>, Status> {
        let min_seq_epoch = request.get_ref().min_seq_epoch;
        let request = self.shard_read(
            request,
            min_seq_epoch,
            |m| (m.shard, m.request),
            |inner, name| {
                inner.collection = name;
                inner.read_token.clear();
            },
        )?;
        self.tarn.search(request).await
    }

    async fn get(
        &self,
        request: Request<pb::ShardGetRequest>,
    ) -> Result<Response<pb::GetResponse>, Status> {
        let min_seq_epoch = request.get_ref().min_seq_epoch;
        let request = self.shard_read(
            request,
            min_seq_epoch,
            |m| (m.shard, m.request),
            |inner, name| {
                inner.collection = name;
                inner.read_token.clear();
            },
        )?;
        self.tarn.get(request).await
    }

    async fn count(
        &self,
        request: Request<pb::ShardCountRequest>,
    ) -> Result<Response<pb::CountResponse>, Status> {
        let min_seq_epoch = request.get_ref().min_seq_epoch;
        let request = self.shard_read(
            request,
            min_seq_epoch,
            |m| (m.shard, m.request),
            |inner, name| {
                inner.collection = name;
                inner.read_token.clear();
            },
        )?;
        self.tarn.count(request).await
    }

    async fn scroll(
        &self,
        request: Request<pb::ShardScrollRequest>,
    ) -> Result<Response<pb::ScrollResponse>, Status> {
        let min_seq_epoch = request.get_ref().min_seq_epoch;
        let request = self.shard_read(
            request,
            min_seq_epoch,
            |m| (m.shard, m.request),
            |inner, name| {
                inner.collection = name;
                inner.read_token.clear();
            },
        )?;
        self.tarn.scroll(request).await
    }

    async fn get_shard(
        &self,
        request: Request<pb::ShardInfoRequest>,
    ) -> Result<Response<pb::GetCollectionResponse>, Status> {
        let request = self.inner(request, |m| {
            Ok(pb::GetCollectionRequest {
                name: address(m.shard)?,
            })
        })?;
        self.tarn.get_collection(request).await
    }

    async fn flush(
        &self,
        request: Request<pb::ShardFlushRequest>,
    ) -> Result<Response<pb::FlushResponse>, Status> {
        let request = self.inner(request, |m| {
            Ok(pb::FlushRequest {
                collection: address(m.shard)?,
            })
        })?;
        self.tarn.flush(request).await
    }

    async fn add_fields(
        &self,
        request: Request<pb::ShardAddFieldsRequest>,
    ) -> Result<Response<pb::AddFieldsResponse>, Status> {
        let request = self.inner(request, |m| {
            let mut inner = m
                .request
                .ok_or_else(|| ApiError::invalid("request", "missing"))?;
            inner.collection = address(m.shard)?;
            Ok(inner)
        })?;
        self.tarn.add_fields(request).await
    }

    async fn pull_shard(
        &self,
        request: Request<pb::PullShardRequest>,
    ) -> Result<Response<pb::PullShardResponse>, Status> {
        let cluster = self.node()?;
        cluster.check_node(&request)?;
        let response = tarn_dataplane::node::pull_shard(cluster, request.into_inner()).await?;
        Ok(Response::new(response))
    }

    async fn append_entries(
        &self,
        request: Request<pb::AppendEntriesRequest>,
    ) -> Result<Response<pb::AppendEntriesResponse>, Status> {
        let cluster = self.node()?;
        cluster.check_node(&request)?;
        let response = tarn_dataplane::node::append_entries(cluster, request.into_inner()).await?;
        Ok(Response::new(response))
    }

    async fn shard_stream(
        &self,
        request: Request<pb::ShardStreamRequest>,
    ) -> Result<Response<Self::ShardStreamStream>, Status> {
        let cluster = self.node()?;
        cluster.check_node(&request)?;
        let stream =
            tarn_dataplane::node::shard_stream(Arc::clone(cluster), request.into_inner()).await?;
        Ok(Response::new(stream))
    }
}
