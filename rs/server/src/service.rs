//! The `tarn.v1.Tarn` gRPC service.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tarn_collection::SearchRequest;
use tarn_proto::v1 as pb;
use tarn_proto::v1::tarn_server::Tarn;
use tokio::sync::Semaphore;
use tonic::{Request, Response, Status};

use crate::auth::{Access, ApiKeys};
use crate::cluster::ClusterNode;
use crate::convert;
use crate::metrics::Metrics;
use crate::registry::Registry;
use crate::snapshots;
use crate::status::ApiError;

/// How long a search waits for `min_seq_no` when the client set no deadline.
const DEFAULT_MIN_SEQ_WAIT: Duration = Duration::from_secs(30);

#[derive(Debug)]
pub struct TarnService {
    pub registry: Arc<Registry>,
    pub keys: ApiKeys,
    pub metrics: Arc<Metrics>,
    /// Bounds writes waiting for their WAL group; past it, RESOURCE_EXHAUSTED.
    pub write_slots: Arc<Semaphore>,
    pub max_inflight_writes: usize,
    /// Bounds snapshots streaming at once; past it, RESOURCE_EXHAUSTED.
    pub snapshot_slots: Arc<Semaphore>,
    /// Bounds restores receiving at once; past it, RESOURCE_EXHAUSTED.
    pub restore_slots: Arc<Semaphore>,
    /// Cluster mode: this node's membership and view of the shard map.
    pub cluster: Option<Arc<ClusterNode>>,
}

type RpcResult<T> = Result<Response<T>, Status>;

impl TarnService {
    fn observe<T>(
        &self,
        method: &'static str,
        started: Instant,
        result: Result<T, ApiError>,
    ) -> RpcResult<T> {
        let result = result.map_err(Status::from);
        let code = match &result {
            Ok(_) => tonic::Code::Ok,
            Err(status) => status.code(),
        };
        self.metrics.observe_rpc(method, code, started.elapsed());
        if let Err(status) = &result {
            tracing::debug!(method, code = ?status.code(), message = status.message(), "request failed");
        }
        result.map(Response::new)
    }

    /// The shared part of Insert and Remove: find the collection, check the durability, take a
    /// write slot, run the write and record its append-to-acknowledgement time.
    async fn logged_write<F, Fut>(
        &self,
        collection: &str,
        durability: i32,
        write: F,
    ) -> Result<u64, ApiError>
    where
        F: FnOnce(tarn_collection::Collection, Option<tarn_wal::Durability>) -> Fut,
        Fut: std::future::Future<Output = tarn_collection::Result<u64>>,
    {
        self.logged_op(
            collection,
            durability,
            |collection, durability| async move {
                let seq_no = write(collection, durability).await?;
                Ok((seq_no, seq_no))
            },
        )
        .await
    }

    /// [`TarnService::logged_write`] for writes that log zero or more entries and answer more
    /// than a sequence number: `write` returns the last sequence number it logged (0: none)
    /// and its answer. The last entry is replicated and acknowledged as one write's.
    async fn logged_op<T, F, Fut>(
        &self,
        collection: &str,
        durability: i32,
        write: F,
    ) -> Result<T, ApiError>
    where
        F: FnOnce(tarn_collection::Collection, Option<tarn_wal::Durability>) -> Fut,
        Fut: std::future::Future<Output = Result<(u64, T), ApiError>>,
    {
        let (collection, gate) = self.resolve_for_write(collection).await?;
        let durability = convert::durability(durability)?;
        let _permit = self.write_permit()?;
        let append_started = Instant::now();
        let (seq_no, answer) = write(collection, durability).await?;
        if let (Some(cluster), Some(shard_write)) = (&self.cluster, &gate) {
            // A shard with replicas acknowledges a write once every in-sync replica has it
            // durable (a replica that does not answer in time leaves the in-sync set first).
            if let (Some(replication), true) = (&shard_write.replication, seq_no > 0) {
                replication.replicate(cluster, seq_no).await?;
            }
            // A shard's write is acknowledged only while this node surely still owns it: a
            // node cut off from etcd meanwhile answers UNAVAILABLE (the write is durable here
            // but not acknowledged: like any failed write, it may or may not be applied).
            cluster.writable()?;
        }
        self.metrics
            .append_ack
            .observe(append_started.elapsed().as_secs_f64());
        Ok(answer)
    }

    /// A shard address (`<collection>.<uid>.<shard>@<epoch>`) is for the cluster's own
    /// node-to-node calls, which come through the `Node` service (`node_service.rs`): the public
    /// API refuses it from the wire, whatever the caller's key (a client writing to a shard
    /// address would put a document where routed Get and Remove never look).
    fn check_shard_address<T>(&self, request: &Request<T>, name: &str) -> Result<(), ApiError> {
        if tarn_cluster::ShardName::parse(name).is_none() {
            return Ok(());
        }
        match request
            .extensions()
            .get::<crate::node_service::FromNodeService>()
        {
            Some(_) => Ok(()),
            None => Err(ApiError::invalid(
                "collection",
                format!(
                    "{name:?} is an internal shard name: address the collection by its own name"
                ),
            )),
        }
    }

    /// The cluster router for a call naming `collection`, unless this node serves the call
    /// itself: single-node mode, or a shard address sent by a router.
    pub(crate) fn router(&self, collection: &str) -> Option<&Arc<ClusterNode>> {
        self.cluster
            .as_ref()
            .filter(|_| tarn_cluster::ShardName::parse(collection).is_none())
    }

    /// The local collection a call names: a user collection, or (cluster mode) a shard
    /// address, served only at the epoch it names.
    pub(crate) async fn resolve(
        &self,
        name: &str,
    ) -> Result<tarn_collection::Collection, ApiError> {
        if let (Some(cluster), Some((shard, Some(epoch)))) =
            (&self.cluster, tarn_cluster::ShardName::parse(name))
        {
            return cluster.local_copy(&self.registry, &shard, epoch).await;
        }
        self.registry.get(name)
    }

    /// [`TarnService::resolve`] for a write: a shard address is served only while the shard
    /// takes writes, and the shard's write gate is held until the write is acknowledged.
    async fn resolve_for_write(
        &self,
        name: &str,
    ) -> Result<
        (
            tarn_collection::Collection,
            Option<crate::cluster::ShardWrite>,
        ),
        ApiError,
    > {
        if let (Some(cluster), Some((shard, Some(epoch)))) =
            (&self.cluster, tarn_cluster::ShardName::parse(name))
        {
            let write = cluster.local_shard_for_write(&shard, epoch).await?;
            return Ok((write.collection.clone(), Some(write)));
        }
        Ok((self.registry.get(name)?, None))
    }

    fn write_permit(&self) -> Result<tokio::sync::OwnedSemaphorePermit, ApiError> {
        Arc::clone(&self.write_slots)
            .try_acquire_owned()
            .map_err(|_| ApiError::Overloaded(self.max_inflight_writes))
    }
}

/// The time left before the client's deadline (`grpc-timeout`), if it sent one.
fn client_deadline<T>(request: &Request<T>) -> Option<Duration> {
    let value = request.metadata().get("grpc-timeout")?.to_str().ok()?;
    let (digits, unit) = value.split_at(value.len().checked_sub(1)?);
    let amount: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(amount * 3600),
        "M" => Duration::from_secs(amount * 60),
        "S" => Duration::from_secs(amount),
        "m" => Duration::from_millis(amount),
        "u" => Duration::from_micros(amount),
        "n" => Duration::from_nanos(amount),
        _ => return None,
    })
}

#[tonic::async_trait]
impl Tarn for TarnService {
    type CreateSnapshotStream = snapshots::ChunkStream;

    async fn create_snapshot(
        &self,
        request: Request<pb::CreateSnapshotRequest>,
    ) -> RpcResult<Self::CreateSnapshotStream> {
        let started = Instant::now();
        let result = async {
            self.keys.check(&request, Access::Read)?;
            self.check_shard_address(&request, &request.get_ref().collection)?;
            let name = request.into_inner().collection;
            if self.router(&name).is_some() {
                return Err(ApiError::Unsupported(format!(
                    "collection '{name}' is sharded over the cluster: snapshots of sharded \
                     collections are not supported yet (docs/CLUSTER.md)"
                )));
            }
            let collection = self.registry.get(&name)?;
            let permit = Arc::clone(&self.snapshot_slots)
                .try_acquire_owned()
                .map_err(|_| ApiError::TooManySnapshots(snapshots::MAX_CONCURRENT_SNAPSHOTS))?;
            snapshots::stream_snapshot(name, collection, permit).await
        }
        .await;
        self.observe("CreateSnapshot", started, result)
    }

    async fn restore_snapshot(
        &self,
        request: Request<tonic::Streaming<pb::RestoreSnapshotRequest>>,
    ) -> RpcResult<pb::RestoreSnapshotResponse> {
        let started = Instant::now();
        let result = async {
            self.keys.check(&request, Access::Write)?;
            let _permit = Arc::clone(&self.restore_slots)
                .try_acquire_owned()
                .map_err(|_| ApiError::TooManySnapshots(snapshots::MAX_CONCURRENT_SNAPSHOTS))?;
            if let Some(cluster) = &self.cluster {
                let api_key = crate::auth::api_key(&request);
                let (collection, seq_no) = self
                    .import_snapshot(cluster, request.into_inner(), api_key.as_deref())
                    .await?;
                return Ok(pb::RestoreSnapshotResponse {
                    collection: Some(collection),
                    seq_no,
                });
            }
            let (name, collection, info) =
                snapshots::restore_from_stream(&self.registry, request.into_inner()).await?;
            Ok(pb::RestoreSnapshotResponse {
                collection: Some(convert::collection_info(
                    &name,
                    collection.config(),
                    collection.schema().fields(),
                    &collection.stats(),
                )),
                seq_no: info.seq_no,
            })
        }
        .await;
        self.observe("RestoreSnapshot", started, result)
    }

    async fn create_collection(
        &self,
        request: Request<pb::CreateCollectionRequest>,
    ) -> RpcResult<pb::CreateCollectionResponse> {
        let started = Instant::now();
        let result = async {
            self.keys.check(&request, Access::Write)?;
            let api_key = crate::auth::api_key(&request);
            let deadline = client_deadline(&request);
            let request = request.into_inner();
            let config = convert::collection_config(&request)?;
            if let Some(cluster) = &self.cluster {
                let map = cluster.create_collection(&request, config).await?;
                let info = self
                    .routed_info(cluster, &map, api_key.as_deref(), deadline)
                    .await?;
                return Ok(pb::CreateCollectionResponse {
                    collection: Some(info),
                });
            }
            if request.shards > 1 {
                return Err(ApiError::invalid(
                    "shards",
                    "a single node holds one shard; start the server with --etcd for more",
                ));
            }
            if request.replication_factor > 1 || request.min_in_sync > 1 {
                return Err(ApiError::Unsupported(format!(
                    "replication_factor {} / min_in_sync {}: a single node holds one copy of \
                     its data (1 live node); replicas need cluster mode (--etcd)",
                    request.replication_factor, request.min_in_sync
                )));
            }
            let collection = self.registry.create(&request.name, config).await?;
            Ok(pb::CreateCollectionResponse {
                collection: Some(convert::collection_info(
                    &request.name,
                    collection.config(),
                    collection.schema().fields(),
                    &collection.stats(),
                )),
            })
        }
        .await;
        self.observe("CreateCollection", started, result)
    }

    async fn drop_collection(
        &self,
        request: Request<pb::DropCollectionRequest>,
    ) -> RpcResult<pb::DropCollectionResponse> {
        let started = Instant::now();
        let result = async {
            self.keys.check(&request, Access::Write)?;
            self.check_shard_address(&request, &request.get_ref().name)?;
            let name = &request.get_ref().name;
            match &self.cluster {
                Some(cluster) => cluster.drop_collection(name).await?,
                None => self.registry.drop_collection(name).await?,
            }
            Ok(pb::DropCollectionResponse {})
        }
        .await;
        self.observe("DropCollection", started, result)
    }

    async fn list_collections(
        &self,
        request: Request<pb::ListCollectionsRequest>,
    ) -> RpcResult<pb::ListCollectionsResponse> {
        let started = Instant::now();
        let result = self.keys.check(&request, Access::Read).map(|()| {
            let names = match &self.cluster {
                Some(cluster) => cluster.list(),
                None => self.registry.names(),
            };
            pb::ListCollectionsResponse { names }
        });
        self.observe("ListCollections", started, result)
    }

    async fn get_collection(
        &self,
        request: Request<pb::GetCollectionRequest>,
    ) -> RpcResult<pb::GetCollectionResponse> {
        let started = Instant::now();
        let result = async {
            self.keys.check(&request, Access::Read)?;
            self.check_shard_address(&request, &request.get_ref().name)?;
            let api_key = crate::auth::api_key(&request);
            let deadline = client_deadline(&request);
            let name = &request.get_ref().name;
            if let Some(cluster) = self.router(name) {
                let map = cluster.map(name).await?;
                let info = self
                    .routed_info(cluster, &map, api_key.as_deref(), deadline)
                    .await?;
                return Ok(pb::GetCollectionResponse {
                    collection: Some(info),
                });
            }
            Ok(pb::GetCollectionResponse {
                collection: Some(self.local_info(name).await?),
            })
        }
        .await;
        self.observe("GetCollection", started, result)
    }

    async fn insert(&self, request: Request<pb::InsertRequest>) -> RpcResult<pb::InsertResponse> {
        let started = Instant::now();
        let result = async {
            self.keys.check(&request, Access::Write)?;
            self.check_shard_address(&request, &request.get_ref().collection)?;
            let deadline = client_deadline(&request);
            let api_key = crate::auth::api_key(&request);
            let request = request.into_inner();
            if let Some(cluster) = self.router(&request.collection) {
                return self
                    .routed_insert(cluster, request, deadline, api_key.as_deref())
                    .await;
            }
            let doc_ids = convert::ids(&request.doc_ids);
            let user_ids = convert::ids(&request.user_ids);
            let attributes = convert::attributes(&request.attributes)?;
            let seq_no = self
                .local_insert(
                    &request.collection,
                    doc_ids,
                    user_ids,
                    request.vectors,
                    attributes,
                    request.durability,
                )
                .await?;
            Ok(pb::InsertResponse {
                seq_no,
                n_inserted: (request.doc_ids.len() * request.user_ids.len().max(1)) as u64,
                read_token: single_node_token(seq_no),
            })
        }
        .await;
        self.observe("Insert", started, result)
    }

    async fn remove(&self, request: Request<pb::RemoveRequest>) -> RpcResult<pb::RemoveResponse> {
        let started = Instant::now();
        let result = async {
            self.keys.check(&request, Access::Write)?;
            self.check_shard_address(&request, &request.get_ref().collection)?;
            let deadline = client_deadline(&request);
            let api_key = crate::auth::api_key(&request);
            let request = request.into_inner();
            if let Some(cluster) = self.router(&request.collection) {
                return self
                    .routed_remove(cluster, request, deadline, api_key.as_deref())
                    .await;
            }
            let doc_ids = convert::ids(&request.doc_ids);
            let user_ids = convert::ids(&request.user_ids);
            if let Some(filter) = &request.filter {
                let filter = removal_filter(filter, &doc_ids)?;
                let (seq_no, n_removed) = self
                    .local_remove_matching(
                        &request.collection,
                        user_ids,
                        filter,
                        request.durability,
                        deadline,
                    )
                    .await?;
                return Ok(pb::RemoveResponse {
                    seq_no,
                    read_token: single_node_token(seq_no),
                    n_removed,
                });
            }
            let seq_no = self
                .local_remove(&request.collection, doc_ids, user_ids, request.durability)
                .await?;
            Ok(pb::RemoveResponse {
                seq_no,
                read_token: single_node_token(seq_no),
                n_removed: 0,
            })
        }
        .await;
        self.observe("Remove", started, result)
    }

    async fn search(&self, request: Request<pb::SearchRequest>) -> RpcResult<pb::SearchResponse> {
        let started = Instant::now();
        let result = async {
            self.keys.check(&request, Access::Read)?;
            self.check_shard_address(&request, &request.get_ref().collection)?;
            let deadline = client_deadline(&request);
            let api_key = crate::auth::api_key(&request);
            let request = request.into_inner();
            if let Some(cluster) = self.router(&request.collection) {
                return self
                    .routed_search(cluster, request, deadline, api_key.as_deref())
                    .await;
            }
            let mut min_seq = request.min_seq_no;
            if !request.read_token.is_empty() {
                let token = tarn_cluster::ReadPositions::decode(&request.read_token)
                    .map_err(|e| ApiError::invalid("read_token", e))?;
                if token.uid != 0 {
                    return Err(ApiError::invalid(
                        "read_token",
                        "this token is from a cluster collection",
                    ));
                }
                min_seq = min_seq.max(token.position(0));
            }
            let search = SearchRequest {
                user_ids: convert::ids(&request.user_ids),
                vector: request.vector,
                top_k: request.top_k as usize,
                ef: request.ef as usize,
                exact: request.exact,
                min_seq,
                filter: request.filter.as_ref().map(convert::filter).transpose()?,
            };
            let hits = self
                .local_search(&request.collection, search, deadline)
                .await?;
            Ok(pb::SearchResponse {
                hits: convert::hits(hits.into_iter().map(|h| (h.doc_id, h.user_id, h.score))),
                missing_shards: Vec::new(),
            })
        }
        .await;
        self.metrics.search.observe(started.elapsed().as_secs_f64());
        self.observe("Search", started, result)
    }

    async fn get(&self, request: Request<pb::GetRequest>) -> RpcResult<pb::GetResponse> {
        let started = Instant::now();
        let result = async {
            self.keys.check(&request, Access::Read)?;
            self.check_shard_address(&request, &request.get_ref().collection)?;
            let deadline = client_deadline(&request);
            let api_key = crate::auth::api_key(&request);
            let request = request.into_inner();
            // The collection first (NOT_FOUND), then the request's size, as a single node always
            // answered.
            match self.router(&request.collection) {
                Some(cluster) => drop(cluster.map(&request.collection).await?),
                None => drop(self.resolve(&request.collection).await?),
            }
            if request.doc_ids.len() > 10_000 {
                return Err(ApiError::invalid("doc_ids", "at most 10000 per call"));
            }
            let user_id = request.user_id.as_ref().map_or(0, convert::id_to_u128);
            let doc_ids = convert::ids(&request.doc_ids);
            let docs = match self.router(&request.collection) {
                Some(cluster) => {
                    self.routed_get(
                        cluster,
                        &request.collection,
                        user_id,
                        &doc_ids,
                        deadline,
                        api_key.as_deref(),
                    )
                    .await?
                }
                None => {
                    self.local_get(&request.collection, user_id, &doc_ids)
                        .await?
                }
            };
            Ok(pb::GetResponse {
                docs: docs
                    .into_iter()
                    .map(|(doc_id, vector, attributes)| pb::Document {
                        doc_id: Some(convert::u128_to_id(doc_id)),
                        user_id: Some(convert::u128_to_id(user_id)),
                        vector,
                        attributes,
                    })
                    .collect(),
            })
        }
        .await;
        self.observe("Get", started, result)
    }

    async fn flush(&self, request: Request<pb::FlushRequest>) -> RpcResult<pb::FlushResponse> {
        let started = Instant::now();
        let result = async {
            self.keys.check(&request, Access::Write)?;
            self.check_shard_address(&request, &request.get_ref().collection)?;
            let api_key = crate::auth::api_key(&request);
            let deadline = client_deadline(&request);
            let name = &request.get_ref().collection;
            let flushed_seq_no = match self.router(name) {
                Some(cluster) => {
                    self.routed_flush(cluster, name, api_key.as_deref(), deadline)
                        .await?
                }
                None => self.local_flush(name).await?,
            };
            Ok(pb::FlushResponse { flushed_seq_no })
        }
        .await;
        self.observe("Flush", started, result)
    }

    async fn add_fields(
        &self,
        request: Request<pb::AddFieldsRequest>,
    ) -> RpcResult<pb::AddFieldsResponse> {
        let started = Instant::now();
        let result = async {
            self.keys.check(&request, Access::Write)?;
            self.check_shard_address(&request, &request.get_ref().collection)?;
            let api_key = crate::auth::api_key(&request);
            let deadline = client_deadline(&request);
            let request = request.into_inner();
            let fields = convert::field_specs(&request.fields)?;
            let name = &request.collection;
            if let Some(cluster) = self.router(name) {
                let info = self
                    .routed_add_fields(cluster, name, fields, api_key.as_deref(), deadline)
                    .await?;
                return Ok(pb::AddFieldsResponse {
                    collection: Some(info),
                });
            }
            self.local_add_fields(name, fields).await?;
            Ok(pb::AddFieldsResponse {
                collection: Some(self.local_info(name).await?),
            })
        }
        .await;
        self.observe("AddFields", started, result)
    }
}

/// The filter of a remove by filter, which lists no documents.
pub(crate) fn removal_filter(
    filter: &pb::Filter,
    doc_ids: &[u128],
) -> Result<tarn_collection::Filter, ApiError> {
    if !doc_ids.is_empty() {
        return Err(ApiError::invalid(
            "filter",
            "a remove takes either doc_ids or a filter, not both",
        ));
    }
    convert::filter(filter)
}

/// A document as Get answers it: its id, vector and attributes (None when it has none).
pub(crate) type StoredDocument = (u128, Vec<f32>, Option<pb::Attributes>);

/// How long a `min_seq_no` wait may take: until a little before the client's deadline, so
/// that the DEADLINE_EXCEEDED status is ours and not the transport's cancellation.
fn min_seq_wait(deadline: Option<Duration>) -> Duration {
    deadline.map_or(DEFAULT_MIN_SEQ_WAIT, |d| {
        d.saturating_sub((d / 5).clamp(Duration::from_millis(20), Duration::from_millis(200)))
    })
}

/// A filter the collection's schema refuses, as INVALID_ARGUMENT naming `filter` (the
/// engine's message already says "filter: ...").
fn filter_error(error: &tarn_collection::AttributeError) -> ApiError {
    let message = error.to_string();
    let reason = message.strip_prefix("filter: ").unwrap_or(&message);
    ApiError::invalid("filter", reason)
}

/// The read token of a single-node write: its sequence number as shard 0's position.
fn single_node_token(seq_no: u64) -> Vec<u8> {
    tarn_cluster::ReadPositions {
        uid: 0,
        positions: vec![tarn_cluster::TokenPosition {
            shard: 0,
            epoch: 0,
            seq: seq_no,
        }],
    }
    .encode()
}

/// The operations on this node's own collections (a user collection, or a shard it owns), as
/// the handlers and the cluster router both use them.
impl TarnService {
    pub(crate) async fn local_insert(
        &self,
        name: &str,
        doc_ids: Vec<u128>,
        user_ids: Vec<u128>,
        vectors: Vec<f32>,
        attributes: Vec<tarn_collection::Attributes>,
        durability: i32,
    ) -> Result<u64, ApiError> {
        self.logged_write(name, durability, |collection, durability| async move {
            collection
                .insert_with_attributes(&doc_ids, &user_ids, &vectors, &attributes, durability)
                .await
        })
        .await
    }

    /// Removes every document of `user_ids` (tenant 0 when none) matching `filter` when the
    /// request is handled: once every operation logged before it is applied, the matches are
    /// resolved to ids and logged as ordinary removes, one per tenant (a remove entry applies
    /// each of its ids to each of its tenants), so replay and replicas repeat exactly these
    /// removals. Returns the last sequence number logged (0 when nothing matched) and the
    /// number of (tenant, document) pairs removed.
    pub(crate) async fn local_remove_matching(
        &self,
        name: &str,
        user_ids: Vec<u128>,
        filter: tarn_collection::Filter,
        durability: i32,
        deadline: Option<Duration>,
    ) -> Result<(u64, u64), ApiError> {
        let wait = min_seq_wait(deadline);
        self.logged_op(name, durability, |collection, durability| async move {
            filter
                .validate(&collection.schema())
                .map_err(|error| filter_error(&error))?;
            // Read the writes acknowledged before this request: they must be applied to be
            // matched.
            let logged = collection.stats().last_appended_seq;
            collection.wait_applied(logged, wait).await?;
            let matches = collection.matching_documents(&user_ids, &filter)?;
            let n_removed = matches.len() as u64;
            let mut removes = Vec::new();
            for tenant in matches.chunk_by(|a, b| a.0 == b.0) {
                let docs: Vec<u128> = tenant.iter().map(|&(_, doc)| doc).collect();
                for part in docs.chunks(tarn_collection::MAX_PAIRS_PER_REQUEST) {
                    let (collection, user, part) = (collection.clone(), tenant[0].0, part.to_vec());
                    removes
                        .push(async move { collection.remove(&part, &[user], durability).await });
                }
            }
            // Concurrently: they share group commits.
            let mut last_seq = 0;
            for seq in crate::routing::join_all(removes).await {
                last_seq = last_seq.max(seq?);
            }
            Ok((last_seq, (last_seq, n_removed)))
        })
        .await
    }

    /// Appends fields to a local collection. On a shard (a router's call), fields it already
    /// declares with the same type are skipped, so a retried AddFields completes where an
    /// earlier one stopped; the rest must be new.
    pub(crate) async fn local_add_fields(
        &self,
        name: &str,
        fields: Vec<tarn_collection::FieldSpec>,
    ) -> Result<(), ApiError> {
        let on_shard = tarn_cluster::ShardName::parse(name).is_some();
        self.logged_op(name, 0, |collection, _| async move {
            let mut fields = fields;
            if on_shard {
                let schema = collection.schema();
                fields.retain(|spec| schema.field(&spec.name) != Some(spec));
                if fields.is_empty() {
                    return Ok((0, ()));
                }
            }
            Ok((collection.add_fields(fields).await?, ()))
        })
        .await
    }

    pub(crate) async fn local_remove(
        &self,
        name: &str,
        doc_ids: Vec<u128>,
        user_ids: Vec<u128>,
        durability: i32,
    ) -> Result<u64, ApiError> {
        self.logged_write(name, durability, |collection, durability| async move {
            collection.remove(&doc_ids, &user_ids, durability).await
        })
        .await
    }

    /// A search of one local collection; a `min_seq` wait ends a little before `deadline`.
    pub(crate) async fn local_search(
        &self,
        name: &str,
        search: SearchRequest,
        deadline: Option<Duration>,
    ) -> Result<Vec<tarn_collection::SearchHit>, ApiError> {
        let wait = min_seq_wait(deadline);
        let collection = self.resolve(name).await?;
        collection.validate_search(&search)?;
        if search.min_seq > 0 {
            collection.wait_applied(search.min_seq, wait).await?;
        }
        // A graph search of a few tenants takes a fraction of a millisecond: it runs on this
        // worker, since handing it to another thread and back costs two thread wake-ups, more
        // than the search itself (docs/benchmarks/sealed-search.md, "Through gRPC"). An exact
        // search scans every vector of its tenants, and a search naming many tenants searches
        // each of them (a small tenant by a scan): those run on the blocking pool, a bounded
        // number at a time, so that the runtime's workers stay free for writes and cheap reads
        // (the threshold is measured: docs/BENCHMARKS.md, "Heavy searches and a durable
        // writer").
        /// Searches naming at least this many tenants run off the runtime's workers.
        const HEAVY_SEARCH_TENANTS: usize = 16;
        static HEAVY_SEARCH_SLOTS: std::sync::OnceLock<Arc<Semaphore>> = std::sync::OnceLock::new();
        if !search.exact && search.user_ids.len() < HEAVY_SEARCH_TENANTS {
            return Ok(collection.search(&search)?);
        }
        // All cores but one, as for the indexer: a durable write's handler, the WAL writer and
        // ingestion always find a core.
        let slots = HEAVY_SEARCH_SLOTS.get_or_init(|| {
            let cores = std::thread::available_parallelism().map_or(1, usize::from);
            Arc::new(Semaphore::new(cores.saturating_sub(1).max(1)))
        });
        // Held by the blocking task, so a search whose caller went away still counts until it
        // ends.
        let slot = Arc::clone(slots)
            .acquire_owned()
            .await
            .map_err(|e| ApiError::Internal(e.to_string()))?;
        tokio::task::spawn_blocking(move || {
            // Tests only: hold a heavy search inside the pool (`server::heavy_search=sleep(ms)`).
            #[cfg(feature = "failpoints")]
            fail::fail_point!("server::heavy_search");
            let hits = collection.search(&search);
            drop(slot);
            hits
        })
        .await
        .map_err(|e| ApiError::Internal(e.to_string()))?
        .map_err(ApiError::from)
    }

    /// The stored documents among `doc_ids` of one tenant: (doc, vector, attributes).
    pub(crate) async fn local_get(
        &self,
        name: &str,
        user_id: u128,
        doc_ids: &[u128],
    ) -> Result<Vec<StoredDocument>, ApiError> {
        Ok(self
            .resolve(name)
            .await?
            .get_with_attributes(user_id, doc_ids)?
            .into_iter()
            .map(|(doc_id, vector, attributes)| {
                (doc_id, vector, convert::attributes_to_wire(&attributes))
            })
            .collect())
    }

    pub(crate) async fn local_info(&self, name: &str) -> Result<pb::CollectionInfo, ApiError> {
        let collection = self.resolve(name).await?;
        Ok(convert::collection_info(
            name,
            collection.config(),
            collection.schema().fields(),
            &collection.stats(),
        ))
    }

    pub(crate) async fn local_flush(&self, name: &str) -> Result<u64, ApiError> {
        let collection = self.resolve(name).await?;
        // A flush holds a write slot like a write: it waits on the WAL and a checkpoint, and
        // under overload it is refused the same way.
        let _permit = self.write_permit()?;
        Ok(collection.flush().await?)
    }
}
