//! The `tarn.v1.Tarn` gRPC service: API keys, request checks and the wire answers; the data
//! work is the data plane's [`Router`] (a local collection, or the cluster's shards).

use std::sync::Arc;
use std::time::{Duration, Instant};

use tarn_collection::SearchRequest;
use tarn_dataplane::{convert, removal_filter, ApiError, Router, MAX_CONCURRENT_SNAPSHOTS};
use tarn_proto::v1 as pb;
use tarn_proto::v1::tarn_server::Tarn;
use tokio::sync::Semaphore;
use tonic::{Request, Response, Status};

use crate::auth::{Access, ApiKeys};
use crate::metrics::Metrics;

#[derive(Debug)]
pub struct TarnService {
    /// The data plane: local collections, write slots and (cluster mode) the shard router.
    pub router: Router,
    pub keys: ApiKeys,
    pub metrics: Arc<Metrics>,
    /// Bounds snapshots streaming at once; past it, RESOURCE_EXHAUSTED.
    pub snapshot_slots: Arc<Semaphore>,
    /// Bounds restores receiving at once; past it, RESOURCE_EXHAUSTED.
    pub restore_slots: Arc<Semaphore>,
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

    /// One search (a Search call's, or one of a SearchBatch's), its caller checked: routed in
    /// cluster mode, else run on a local collection.
    async fn search_one(
        &self,
        request: pb::SearchRequest,
        deadline: Option<Duration>,
        api_key: Option<&str>,
        token_epoch: u64,
    ) -> Result<pb::SearchResponse, ApiError> {
        if let Some(cluster) = self.router.cluster_for(&request.collection) {
            return self
                .router
                .routed_search(cluster, request, deadline, api_key)
                .await;
        }
        let min_seq = local_position(request.min_seq_no, &request.read_token)?;
        let search = SearchRequest {
            user_ids: convert::ids(&request.user_ids),
            vector: request.vector,
            top_k: request.top_k as usize,
            ef: request.ef as usize,
            exact: request.exact,
            min_seq,
            filter: request.filter.as_ref().map(convert::filter).transpose()?,
            output: convert::search_selection(&request.output_fields, request.with_payload),
            text: convert::text_query(&request.text),
            hybrid: convert::hybrid(request.fusion.as_ref())?,
        };
        if request.text.as_ref().is_some_and(|text| text.stats_only) {
            let stats = self
                .router
                .local_text_stats_at(&request.collection, search, deadline, token_epoch)
                .await?;
            return Ok(pb::SearchResponse {
                text_stats: Some(convert::text_stats_to_wire(&stats)),
                ..Default::default()
            });
        }
        let hits = self
            .router
            .local_search_at(&request.collection, search, deadline, token_epoch)
            .await?;
        Ok(pb::SearchResponse {
            hits: convert::search_hits(hits),
            ..Default::default()
        })
    }

    /// A read's checks (its API key; no shard address from the wire) and what it carries
    /// beside its message.
    fn read_call<T>(
        &self,
        request: Request<T>,
        collection: impl Fn(&T) -> &str,
    ) -> Result<(T, ReadCall), ApiError> {
        self.keys.check(&request, Access::Read)?;
        self.check_shard_address(&request, collection(request.get_ref()))?;
        let call = ReadCall {
            deadline: client_deadline(&request),
            api_key: crate::auth::api_key(&request),
            token_epoch: request
                .extensions()
                .get::<crate::node_service::TokenEpoch>()
                .map_or(0, |e| e.0),
        };
        Ok((request.into_inner(), call))
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
}

/// What a read carries beside its message ([`TarnService::read_call`]).
struct ReadCall {
    /// The time left before the client's deadline, if it sent one.
    deadline: Option<Duration>,
    api_key: Option<String>,
    /// The epoch a forwarded read token's position was acknowledged at (0: none).
    token_epoch: u64,
}

/// Most searches in one SearchBatch.
const MAX_BATCH_SEARCHES: usize = 1000;

/// Routed searches of one SearchBatch in flight at once.
const ROUTED_BATCH_CONCURRENCY: usize = 8;

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
    type CreateSnapshotStream = tarn_dataplane::ChunkStream;

    async fn create_snapshot(
        &self,
        request: Request<pb::CreateSnapshotRequest>,
    ) -> RpcResult<Self::CreateSnapshotStream> {
        let started = Instant::now();
        let result = async {
            self.keys.check(&request, Access::Read)?;
            self.check_shard_address(&request, &request.get_ref().collection)?;
            let name = request.into_inner().collection;
            if self.router.cluster_for(&name).is_some() {
                return Err(ApiError::Unsupported(format!(
                    "collection '{name}' is sharded over the cluster: snapshots of sharded \
                     collections are not supported yet (docs/CLUSTER.md)"
                )));
            }
            let collection = self.router.registry.get(&name)?;
            let permit = Arc::clone(&self.snapshot_slots)
                .try_acquire_owned()
                .map_err(|_| ApiError::TooManySnapshots(MAX_CONCURRENT_SNAPSHOTS))?;
            tarn_dataplane::stream_snapshot(name, collection, permit).await
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
                .map_err(|_| ApiError::TooManySnapshots(MAX_CONCURRENT_SNAPSHOTS))?;
            if let Some(cluster) = &self.router.cluster {
                let api_key = crate::auth::api_key(&request);
                let (collection, seq_no) = self
                    .router
                    .import_snapshot(cluster, request.into_inner(), api_key.as_deref())
                    .await?;
                return Ok(pb::RestoreSnapshotResponse {
                    collection: Some(collection),
                    seq_no,
                });
            }
            let (name, collection, info) =
                tarn_dataplane::restore_from_stream(&self.router.registry, request.into_inner())
                    .await?;
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
            if let Some(cluster) = &self.router.cluster {
                let map = cluster.create_collection(&request, config).await?;
                let info = self
                    .router
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
            let collection = self.router.registry.create(&request.name, config).await?;
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
            match &self.router.cluster {
                Some(cluster) => cluster.drop_collection(name).await?,
                None => self.router.registry.drop_collection(name).await?,
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
            let names = match &self.router.cluster {
                Some(cluster) => cluster.list(),
                None => self.router.registry.names(),
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
            if let Some(cluster) = self.router.cluster_for(name) {
                let map = cluster.map(name).await?;
                let info = self
                    .router
                    .routed_info(cluster, &map, api_key.as_deref(), deadline)
                    .await?;
                return Ok(pb::GetCollectionResponse {
                    collection: Some(info),
                });
            }
            Ok(pb::GetCollectionResponse {
                collection: Some(self.router.local_info(name).await?),
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
            if let Some(cluster) = self.router.cluster_for(&request.collection) {
                return self
                    .router
                    .routed_insert(cluster, request, deadline, api_key.as_deref())
                    .await;
            }
            let doc_ids = convert::ids(&request.doc_ids);
            let user_ids = convert::ids(&request.user_ids);
            let attributes = convert::attributes(&request.attributes)?;
            let seq_no = self
                .router
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
            if let Some(cluster) = self.router.cluster_for(&request.collection) {
                return self
                    .router
                    .routed_remove(cluster, request, deadline, api_key.as_deref())
                    .await;
            }
            let doc_ids = convert::ids(&request.doc_ids);
            let user_ids = convert::ids(&request.user_ids);
            if let Some(filter) = &request.filter {
                let filter = removal_filter(filter, &doc_ids)?;
                let (seq_no, n_removed) = self
                    .router
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
                .router
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
            let (
                request,
                ReadCall {
                    deadline,
                    api_key,
                    token_epoch,
                },
            ) = self.read_call(request, |r| &r.collection)?;
            self.search_one(request, deadline, api_key.as_deref(), token_epoch)
                .await
        }
        .await;
        self.metrics.search.observe(started.elapsed().as_secs_f64());
        self.observe("Search", started, result)
    }

    async fn search_batch(
        &self,
        request: Request<pb::SearchBatchRequest>,
    ) -> RpcResult<pb::SearchBatchResponse> {
        let started = Instant::now();
        let result = async {
            self.keys.check(&request, Access::Read)?;
            for search in &request.get_ref().searches {
                self.check_shard_address(&request, &search.collection)?;
            }
            let deadline = client_deadline(&request);
            let api_key = crate::auth::api_key(&request);
            let searches = request.into_inner().searches;
            if searches.is_empty() || searches.len() > MAX_BATCH_SEARCHES {
                return Err(ApiError::invalid(
                    "searches",
                    format!("1 to {MAX_BATCH_SEARCHES} searches per batch"),
                ));
            }
            let api_key = api_key.as_deref();
            let routed = searches
                .iter()
                .all(|s| self.router.cluster_for(&s.collection).is_some());
            let named = |i: usize| move |e: ApiError| e.within(&format!("searches[{i}]"));
            // One deadline for the whole batch: each search gets what is left of it.
            let left = || deadline.map(|d| d.saturating_sub(started.elapsed()));
            let mut results = Vec::with_capacity(searches.len());
            if routed {
                // Routed searches wait on other nodes: a few at a time, answered in order.
                use futures_util::{StreamExt, TryStreamExt};
                results = futures_util::stream::iter(searches.into_iter().enumerate())
                    .map(|(i, search)| async move {
                        self.search_one(search, left(), api_key, 0)
                            .await
                            .map_err(named(i))
                    })
                    .buffered(ROUTED_BATCH_CONCURRENCY)
                    .try_collect()
                    .await?;
            } else {
                // Local searches run on this worker one after another, letting its other tasks
                // run between them: a batch holds the worker no longer than one search does.
                for (i, search) in searches.into_iter().enumerate() {
                    results.push(
                        self.search_one(search, left(), api_key, 0)
                            .await
                            .map_err(named(i))?,
                    );
                    tokio::task::yield_now().await;
                }
            }
            Ok(pb::SearchBatchResponse { results })
        }
        .await;
        self.observe("SearchBatch", started, result)
    }

    async fn get(&self, request: Request<pb::GetRequest>) -> RpcResult<pb::GetResponse> {
        let started = Instant::now();
        let result = async {
            let (
                request,
                ReadCall {
                    deadline,
                    api_key,
                    token_epoch,
                },
            ) = self.read_call(request, |r| &r.collection)?;
            // The collection first (NOT_FOUND), then the request's size, as a single node always
            // answered.
            match self.router.cluster_for(&request.collection) {
                Some(cluster) => drop(cluster.map(&request.collection).await?),
                None => drop(self.router.resolve(&request.collection).await?),
            }
            if request.doc_ids.len() > 10_000 {
                return Err(ApiError::invalid("doc_ids", "at most 10000 per call"));
            }
            let user_id = request.user_id.as_ref().map_or(0, convert::id_to_u128);
            let doc_ids = convert::ids(&request.doc_ids);
            let docs = match self.router.cluster_for(&request.collection) {
                Some(cluster) => {
                    self.router
                        .routed_get(
                            cluster,
                            &request,
                            user_id,
                            &doc_ids,
                            deadline,
                            api_key.as_deref(),
                        )
                        .await?
                }
                None => {
                    let min_seq = local_position(request.min_seq_no, &request.read_token)?;
                    let output =
                        convert::get_selection(&request.output_fields, request.with_payload);
                    self.router
                        .local_get(
                            &request.collection,
                            user_id,
                            &doc_ids,
                            &output,
                            min_seq,
                            token_epoch,
                            deadline,
                        )
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

    async fn count(&self, request: Request<pb::CountRequest>) -> RpcResult<pb::CountResponse> {
        let started = Instant::now();
        let result = async {
            let (
                request,
                ReadCall {
                    deadline,
                    api_key,
                    token_epoch,
                },
            ) = self.read_call(request, |r| &r.collection)?;
            let count = match self.router.cluster_for(&request.collection) {
                Some(cluster) => {
                    self.router
                        .routed_count(cluster, &request, deadline, api_key.as_deref())
                        .await?
                }
                None => {
                    let min_seq = local_position(request.min_seq_no, &request.read_token)?;
                    let filter = request.filter.as_ref().map(convert::filter).transpose()?;
                    let user_ids = convert::ids(&request.user_ids);
                    self.router
                        .local_count(
                            &request.collection,
                            &user_ids,
                            filter.as_ref(),
                            min_seq,
                            token_epoch,
                            deadline,
                        )
                        .await?
                }
            };
            Ok(pb::CountResponse { count })
        }
        .await;
        self.observe("Count", started, result)
    }

    async fn scroll(&self, request: Request<pb::ScrollRequest>) -> RpcResult<pb::ScrollResponse> {
        let started = Instant::now();
        let result = async {
            let (
                request,
                ReadCall {
                    deadline,
                    api_key,
                    token_epoch,
                },
            ) = self.read_call(request, |r| &r.collection)?;
            match self.router.cluster_for(&request.collection) {
                Some(cluster) => {
                    self.router
                        .routed_scroll(cluster, &request, deadline, api_key.as_deref())
                        .await
                }
                None => {
                    let min_seq = local_position(request.min_seq_no, &request.read_token)?;
                    self.router
                        .local_scroll(
                            &request.collection,
                            &request,
                            min_seq,
                            token_epoch,
                            deadline,
                        )
                        .await
                }
            }
        }
        .await;
        self.observe("Scroll", started, result)
    }

    async fn flush(&self, request: Request<pb::FlushRequest>) -> RpcResult<pb::FlushResponse> {
        let started = Instant::now();
        let result = async {
            self.keys.check(&request, Access::Write)?;
            self.check_shard_address(&request, &request.get_ref().collection)?;
            let api_key = crate::auth::api_key(&request);
            let deadline = client_deadline(&request);
            let name = &request.get_ref().collection;
            let flushed_seq_no = match self.router.cluster_for(name) {
                Some(cluster) => {
                    self.router
                        .routed_flush(cluster, name, api_key.as_deref(), deadline)
                        .await?
                }
                None => self.router.local_flush(name).await?,
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
            if let Some(cluster) = self.router.cluster_for(name) {
                let info = self
                    .router
                    .routed_add_fields(cluster, name, fields, api_key.as_deref(), deadline)
                    .await?;
                return Ok(pb::AddFieldsResponse {
                    collection: Some(info),
                });
            }
            self.router.local_add_fields(name, fields).await?;
            Ok(pb::AddFieldsResponse {
                collection: Some(self.router.local_info(name).await?),
            })
        }
        .await;
        self.observe("AddFields", started, result)
    }
}

/// The position a read of a local collection (a single node's, or a shard's copy asked by a
/// router) waits for: the later of `min_seq_no` and a single-node read token's.
fn local_position(min_seq_no: u64, read_token: &[u8]) -> Result<u64, ApiError> {
    if read_token.is_empty() {
        return Ok(min_seq_no);
    }
    let token = tarn_cluster::ReadPositions::decode(read_token)
        .map_err(|e| ApiError::invalid("read_token", e))?;
    if token.uid != 0 {
        return Err(ApiError::invalid(
            "read_token",
            "this token is from a cluster collection",
        ));
    }
    Ok(min_seq_no.max(token.position(0)))
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
