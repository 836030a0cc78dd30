//! The `tarn.v1.Tarn` gRPC service.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tarn_collection::SearchRequest;
use tarn_proto::v1 as pb;
use tarn_proto::v1::tarn_server::Tarn;
use tokio::sync::Semaphore;
use tonic::{Request, Response, Status};

use crate::auth::{Access, ApiKeys};
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
        let collection = self.registry.get(collection)?;
        let durability = convert::durability(durability)?;
        let _permit = self.write_permit()?;
        let append_started = Instant::now();
        let seq_no = write(collection, durability).await?;
        self.metrics
            .append_ack
            .observe(append_started.elapsed().as_secs_f64());
        Ok(seq_no)
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
            let name = request.into_inner().collection;
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
            let (name, collection, info) =
                snapshots::restore_from_stream(&self.registry, request.into_inner()).await?;
            Ok(pb::RestoreSnapshotResponse {
                collection: Some(convert::collection_info(
                    &name,
                    collection.config(),
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
            let request = request.into_inner();
            let config = convert::collection_config(&request)?;
            let collection = self.registry.create(&request.name, config).await?;
            Ok(pb::CreateCollectionResponse {
                collection: Some(convert::collection_info(
                    &request.name,
                    collection.config(),
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
            self.registry
                .drop_collection(&request.get_ref().name)
                .await?;
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
        let result =
            self.keys
                .check(&request, Access::Read)
                .map(|()| pb::ListCollectionsResponse {
                    names: self.registry.names(),
                });
        self.observe("ListCollections", started, result)
    }

    async fn get_collection(
        &self,
        request: Request<pb::GetCollectionRequest>,
    ) -> RpcResult<pb::GetCollectionResponse> {
        let started = Instant::now();
        let result = (|| {
            self.keys.check(&request, Access::Read)?;
            let name = &request.get_ref().name;
            let collection = self.registry.get(name)?;
            Ok(pb::GetCollectionResponse {
                collection: Some(convert::collection_info(
                    name,
                    collection.config(),
                    &collection.stats(),
                )),
            })
        })();
        self.observe("GetCollection", started, result)
    }

    async fn insert(&self, request: Request<pb::InsertRequest>) -> RpcResult<pb::InsertResponse> {
        let started = Instant::now();
        let result = async {
            self.keys.check(&request, Access::Write)?;
            let request = request.into_inner();
            let doc_ids = convert::ids(&request.doc_ids);
            let user_ids = convert::ids(&request.user_ids);
            let seq_no = self
                .logged_write(
                    &request.collection,
                    request.durability,
                    |collection, durability| async move {
                        collection
                            .insert(&doc_ids, &user_ids, &request.vectors, durability)
                            .await
                    },
                )
                .await?;
            Ok(pb::InsertResponse {
                seq_no,
                n_inserted: (request.doc_ids.len() * request.user_ids.len().max(1)) as u64,
            })
        }
        .await;
        self.observe("Insert", started, result)
    }

    async fn remove(&self, request: Request<pb::RemoveRequest>) -> RpcResult<pb::RemoveResponse> {
        let started = Instant::now();
        let result = async {
            self.keys.check(&request, Access::Write)?;
            let request = request.into_inner();
            let doc_ids = convert::ids(&request.doc_ids);
            let user_ids = convert::ids(&request.user_ids);
            let seq_no = self
                .logged_write(
                    &request.collection,
                    request.durability,
                    |collection, durability| async move {
                        collection.remove(&doc_ids, &user_ids, durability).await
                    },
                )
                .await?;
            Ok(pb::RemoveResponse { seq_no })
        }
        .await;
        self.observe("Remove", started, result)
    }

    async fn search(&self, request: Request<pb::SearchRequest>) -> RpcResult<pb::SearchResponse> {
        let started = Instant::now();
        let result = async {
            self.keys.check(&request, Access::Read)?;
            // Answer DEADLINE_EXCEEDED a little before the client's deadline, so that the
            // status is ours and not the transport's cancellation.
            let wait = client_deadline(&request).map_or(DEFAULT_MIN_SEQ_WAIT, |d| {
                d.saturating_sub(
                    (d / 5).clamp(Duration::from_millis(20), Duration::from_millis(200)),
                )
            });
            let request = request.into_inner();
            let collection = self.registry.get(&request.collection)?;
            let search = SearchRequest {
                user_ids: convert::ids(&request.user_ids),
                vector: request.vector,
                top_k: request.top_k as usize,
                ef: request.ef as usize,
                exact: request.exact,
                min_seq: request.min_seq_no,
            };
            collection.validate_search(&search)?;
            if search.min_seq > 0 {
                collection.wait_applied(search.min_seq, wait).await?;
            }
            // A graph search takes a fraction of a millisecond: it runs on this worker, since
            // handing it to another thread and back costs two thread wake-ups, more than the
            // search itself here (measured: docs/BENCHMARKS.md, "through gRPC"). An exact
            // search scans every vector of the tenants (milliseconds): off the workers.
            let hits = if search.exact {
                tokio::task::spawn_blocking(move || collection.search(&search))
                    .await
                    .map_err(|e| ApiError::Internal(e.to_string()))??
            } else {
                collection.search(&search)?
            };
            Ok(pb::SearchResponse {
                hits: hits
                    .into_iter()
                    .map(|h| pb::Hit {
                        doc_id: Some(convert::u128_to_id(h.doc_id)),
                        user_id: Some(convert::u128_to_id(h.user_id)),
                        score: h.score,
                    })
                    .collect(),
            })
        }
        .await;
        self.metrics.search.observe(started.elapsed().as_secs_f64());
        self.observe("Search", started, result)
    }

    async fn get(&self, request: Request<pb::GetRequest>) -> RpcResult<pb::GetResponse> {
        let started = Instant::now();
        let result = (|| {
            self.keys.check(&request, Access::Read)?;
            let request = request.get_ref();
            let collection = self.registry.get(&request.collection)?;
            if request.doc_ids.len() > 10_000 {
                return Err(ApiError::invalid("doc_ids", "at most 10000 per call"));
            }
            let user_id = request.user_id.as_ref().map_or(0, convert::id_to_u128);
            let docs = collection
                .get(user_id, &convert::ids(&request.doc_ids))
                .into_iter()
                .map(|(doc_id, vector)| pb::Document {
                    doc_id: Some(convert::u128_to_id(doc_id)),
                    user_id: Some(convert::u128_to_id(user_id)),
                    vector,
                })
                .collect();
            Ok(pb::GetResponse { docs })
        })();
        self.observe("Get", started, result)
    }

    async fn flush(&self, request: Request<pb::FlushRequest>) -> RpcResult<pb::FlushResponse> {
        let started = Instant::now();
        let result = async {
            self.keys.check(&request, Access::Write)?;
            let collection = self.registry.get(&request.get_ref().collection)?;
            let flushed_seq_no = collection.flush().await?;
            Ok(pb::FlushResponse { flushed_seq_no })
        }
        .await;
        self.observe("Flush", started, result)
    }
}
