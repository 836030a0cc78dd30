//! Cluster mode's data path: each `tarn.v1.Tarn` call split by shard, sent to the shards
//! concerned in parallel (this node's own shards locally, the others through `tarn-client`),
//! and the answers combined: acknowledgements into a read token, hits merged by score into
//! `top_k`, counters summed. A shard whose owner is down answers UNAVAILABLE naming the shard and
//! the node, within the call's deadline; a search may ask for partial results instead.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tarn_client::Durability;
use tarn_cluster::{CollectionMap, ReadPositions};
use tarn_collection::SearchRequest;
use tarn_proto::v1 as pb;

use crate::cluster::{ClusterNode, Target};
use crate::convert;
use crate::fanout;
use crate::router::Router;
use crate::status::ApiError;

fn wire_durability(value: i32) -> Result<Option<Durability>, ApiError> {
    Ok(match convert::durability(value)? {
        None => None,
        Some(tarn_wal::Durability::Fsync) => Some(Durability::Fsync),
        Some(tarn_wal::Durability::Written) => Some(Durability::Written),
    })
}

/// Awaits every future, concurrently, in order (a small `join_all` without another crate).
pub(crate) async fn join_all<F: std::future::Future>(
    futures: impl IntoIterator<Item = F>,
) -> Vec<F::Output> {
    let mut pinned: Vec<std::pin::Pin<Box<F>>> = futures.into_iter().map(Box::pin).collect();
    let mut out: Vec<Option<F::Output>> = (0..pinned.len()).map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (slot, future) in out.iter_mut().zip(pinned.iter_mut()) {
            if slot.is_none() {
                match future.as_mut().poll(cx) {
                    std::task::Poll::Ready(value) => *slot = Some(value),
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(())
        }
    })
    .await;
    out.into_iter().flatten().collect()
}

impl Router {
    /// Runs `call` for every (shard, part) at once and returns the answers in the parts' order;
    /// records the whole fan-out's time under `method`.
    async fn fan_out<P, T, F, Fut>(
        &self,
        method: &'static str,
        parts: Vec<(u32, P)>,
        call: F,
    ) -> Vec<(u32, Result<T, ApiError>)>
    where
        F: Fn(u32, P) -> Fut,
        Fut: std::future::Future<Output = Result<T, ApiError>>,
    {
        let started = std::time::Instant::now();
        let shards: Vec<u32> = parts.iter().map(|p| p.0).collect();
        let answers = join_all(parts.into_iter().map(|(shard, part)| call(shard, part))).await;
        self.metrics
            .fan_out
            .with_label_values(&[method])
            .observe(started.elapsed().as_secs_f64());
        shards.into_iter().zip(answers).collect()
    }

    /// Runs `call` on a shard's owner (here or remote). When the owner answers that the map
    /// moved on (ABORTED: the shard was moved, or is fenced while a move hands it over; a
    /// write is refused before anything is written), waits for this node's view of the shard to
    /// change and calls again, until `deadline`; a write never goes to a fenced shard.
    #[allow(clippy::too_many_arguments)]
    /// [`Router::on_shard`], also answering the shard's epoch in the map the successful attempt
    /// was routed by (a write's read token carries the epoch it was acknowledged at, which may
    /// be newer than the map the call started with).
    async fn on_shard_stamped<T, F, Fut>(
        &self,
        cluster: &ClusterNode,
        map: &CollectionMap,
        shard: u32,
        access: Access,
        deadline: Duration,
        call: F,
    ) -> Result<(T, u64), ApiError>
    where
        F: Fn(Target, Arc<CollectionMap>) -> Fut,
        Fut: std::future::Future<Output = Result<T, ApiError>>,
    {
        let stamped = |target, map: Arc<CollectionMap>| {
            let epoch = map.shards.get(shard as usize).map_or(0, |a| a.epoch);
            let answer = call(target, map);
            async move { answer.await.map(|value| (value, epoch)) }
        };
        self.on_shard(cluster, map, shard, access, deadline, stamped)
            .await
    }

    async fn on_shard<T, F, Fut>(
        &self,
        cluster: &ClusterNode,
        map: &CollectionMap,
        shard: u32,
        access: Access,
        deadline: Duration,
        call: F,
    ) -> Result<T, ApiError>
    where
        F: Fn(Target, Arc<CollectionMap>) -> Fut,
        Fut: std::future::Future<Output = Result<T, ApiError>>,
    {
        let until = Instant::now() + deadline;
        let mut current: Option<Arc<CollectionMap>> = None;
        let mut attempt = 0usize;
        static SPREAD: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let spread = SPREAD.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        loop {
            let map_now = current.as_deref().unwrap_or(map);
            let assignment = map_now.shards[shard as usize].clone();
            let mut copies = 1;
            let mut asked = assignment.owner.clone();
            let result = if access == Access::Write && !assignment.takes_writes() {
                Err(ApiError::StaleShardMap(format!(
                    "shard {shard} of collection '{}' is being moved to node {}: retry",
                    map.def.name,
                    assignment.moving_to.as_deref().unwrap_or("?")
                )))
            } else {
                let target = if access == Access::Spread {
                    let (target, n, node) =
                        cluster.read_target(map_now, shard, (spread, attempt)).await;
                    copies = n;
                    asked = node;
                    target
                } else {
                    cluster.target(map_now, shard).await
                };
                let target = match target {
                    Ok(target) => target,
                    Err(error) if attempt + 1 < copies && is_unreachable(&error) => {
                        attempt += 1;
                        continue;
                    }
                    Err(error) => return Err(error),
                };
                let shared = match &current {
                    Some(m) => Arc::clone(m),
                    None => Arc::new(map.clone()),
                };
                // Every shard call ends by the caller's deadline, whatever the owner does (a
                // stopped process keeps its connections open and never answers). A spread read
                // gives each copy left to try an equal share of the time left, so that a copy
                // that is stopped or hung (alive to etcd) costs a share, not the whole call.
                let left = until.saturating_duration_since(Instant::now());
                let share = if copies > attempt + 1 {
                    left / (copies - attempt) as u32
                } else {
                    left
                };
                match tokio::time::timeout(share, call(target, shared)).await {
                    Ok(result) => result.map_err(|e| e.naming_copy(&asked)),
                    Err(_) => Err(ApiError::DeadlineExceeded(format!(
                        "shard {shard} of collection '{}' on node {asked} did not answer within \
                         {:.1} s of the deadline ({:.1} s)",
                        map.def.name,
                        share.as_secs_f64(),
                        deadline.as_secs_f64()
                    ))),
                }
            };
            match result {
                // Another in-sync copy may answer a spread read: one that is unreachable, or one
                // that used up its share of the time.
                Err(error)
                    if attempt + 1 < copies
                        && (is_unreachable(&error)
                            || matches!(error, ApiError::DeadlineExceeded(_)))
                        && Instant::now() < until =>
                {
                    attempt += 1;
                }
                Err(error) if is_stale_map(&error) && Instant::now() < until => {
                    self.metrics.retried_on_moved_shard.inc();
                    cluster
                        .wait_for_shard_change(
                            &map.def.name,
                            map.def.uid,
                            shard,
                            &assignment,
                            until,
                        )
                        .await;
                    let fresh = cluster.map(&map.def.name).await?;
                    if fresh.def.uid != map.def.uid {
                        return Err(ApiError::NotFound(map.def.name.clone()));
                    }
                    current = Some(Arc::new(fresh));
                }
                other => return other,
            }
        }
    }

    /// Counts a shard call sent to another node.
    fn count_forwarded(&self, method: &'static str) {
        self.metrics.forwarded.with_label_values(&[method]).inc();
    }

    pub async fn routed_insert(
        &self,
        cluster: &ClusterNode,
        request: pb::InsertRequest,
        deadline: Option<Duration>,
        api_key: Option<&str>,
    ) -> Result<pb::InsertResponse, ApiError> {
        let map = cluster.map(&request.collection).await?;
        let doc_ids = convert::ids(&request.doc_ids);
        let user_ids = convert::ids(&request.user_ids);
        let dimension = request.vectors.len() / doc_ids.len().max(1);
        if dimension * doc_ids.len() != request.vectors.len() || doc_ids.is_empty() {
            return Err(ApiError::invalid(
                "vectors",
                format!(
                    "{} values for {} documents: expected documents x dimension",
                    request.vectors.len(),
                    doc_ids.len()
                ),
            ));
        }
        wire_durability(request.durability)?;
        // Attributes go with their documents: checked here for their number and structure,
        // by each shard against the collection's fields.
        if !request.attributes.is_empty() && request.attributes.len() != doc_ids.len() {
            return Err(ApiError::invalid(
                "attributes",
                format!(
                    "expected none or one per document ({}), got {}",
                    doc_ids.len(),
                    request.attributes.len()
                ),
            ));
        }
        let attributes = convert::attributes(&request.attributes)?;
        let timeout = fanout::forward_deadline(deadline);
        let parts = fanout::split(&map.def, &doc_ids, &user_ids);
        let answers = self
            .fan_out("Insert", parts, |shard, (docs, users)| {
                let part_docs: Vec<u128> = docs.iter().map(|&i| doc_ids[i]).collect();
                let part_vectors: Vec<f32> = docs
                    .iter()
                    .flat_map(|&i| {
                        request.vectors[i * dimension..(i + 1) * dimension]
                            .iter()
                            .copied()
                    })
                    .collect();
                let part_attributes: Vec<tarn_collection::Attributes> = match attributes.is_empty()
                {
                    true => Vec::new(),
                    false => docs.iter().map(|&i| attributes[i].clone()).collect(),
                };
                let n_pairs = (part_docs.len() * users.len()) as u64;
                let map = &map;
                let request = &request;
                async move {
                    let call = |target, map: Arc<CollectionMap>| {
                        let (part_docs, users, part_vectors, part_attributes) = (
                            part_docs.clone(),
                            users.clone(),
                            part_vectors.clone(),
                            part_attributes.clone(),
                        );
                        let docs = &docs;
                        async move {
                            match target {
                                Target::Local(name) => {
                                    self.local_insert(
                                        &name,
                                        part_docs,
                                        users,
                                        part_vectors,
                                        part_attributes,
                                        request.durability,
                                    )
                                    .await
                                }
                                Target::Remote(mut client, shard_ref) => {
                                    self.count_forwarded("Insert");
                                    let wire_attributes = match request.attributes.is_empty() {
                                        true => Vec::new(),
                                        false => docs
                                            .iter()
                                            .map(|&i| request.attributes[i].clone())
                                            .collect(),
                                    };
                                    let request = pb::ShardInsertRequest {
                                        shard: Some(shard_ref),
                                        request: Some(pb::InsertRequest {
                                            doc_ids: convert::to_ids(&part_docs),
                                            user_ids: convert::to_ids(&users),
                                            vectors: part_vectors,
                                            durability: request.durability,
                                            attributes: wire_attributes,
                                            ..Default::default()
                                        }),
                                    };
                                    Ok(client
                                        .insert(cluster.node_request(request, api_key, timeout))
                                        .await
                                        .map_err(|s| fanout::forwarded_status(&map, shard, s))?
                                        .into_inner()
                                        .seq_no)
                                }
                            }
                        }
                    };
                    let (seq, epoch) = self
                        .on_shard_stamped(cluster, map, shard, Access::Write, timeout, call)
                        .await?;
                    Ok(((seq, epoch), n_pairs))
                }
            })
            .await;
        let (positions, n_inserted) = positions_and_count(answers)?;
        Ok(pb::InsertResponse {
            seq_no: single_position(&map, &positions),
            n_inserted,
            read_token: fanout::read_token(&map, positions),
        })
    }

    pub async fn routed_remove(
        &self,
        cluster: &ClusterNode,
        request: pb::RemoveRequest,
        deadline: Option<Duration>,
        api_key: Option<&str>,
    ) -> Result<pb::RemoveResponse, ApiError> {
        let map = cluster.map(&request.collection).await?;
        let doc_ids = convert::ids(&request.doc_ids);
        let user_ids = convert::ids(&request.user_ids);
        wire_durability(request.durability)?;
        if let Some(filter) = &request.filter {
            return self
                .routed_remove_matching(cluster, &map, &request, filter, deadline, api_key)
                .await;
        }
        let timeout = fanout::forward_deadline(deadline);
        let parts = fanout::split(&map.def, &doc_ids, &user_ids);
        let answers = self
            .fan_out("Remove", parts, |shard, (docs, users)| {
                let part_docs: Vec<u128> = docs.iter().map(|&i| doc_ids[i]).collect();
                let map = &map;
                let call = move |target, map: Arc<CollectionMap>| {
                    let (part_docs, users) = (part_docs.clone(), users.clone());
                    async move {
                        match target {
                            Target::Local(name) => {
                                self.local_remove(&name, part_docs, users, request.durability)
                                    .await
                            }
                            Target::Remote(mut client, shard_ref) => {
                                self.count_forwarded("Remove");
                                let request = pb::ShardRemoveRequest {
                                    shard: Some(shard_ref),
                                    request: Some(pb::RemoveRequest {
                                        doc_ids: convert::to_ids(&part_docs),
                                        user_ids: convert::to_ids(&users),
                                        durability: request.durability,
                                        ..Default::default()
                                    }),
                                };
                                Ok(client
                                    .remove(cluster.node_request(request, api_key, timeout))
                                    .await
                                    .map_err(|s| fanout::forwarded_status(&map, shard, s))?
                                    .into_inner()
                                    .seq_no)
                            }
                        }
                    }
                };
                self.on_shard_stamped(cluster, map, shard, Access::Write, timeout, call)
            })
            .await;
        let mut positions = Vec::new();
        for (shard, answer) in answers {
            let (seq, epoch) = answer?;
            positions.push((shard, seq, epoch));
        }
        Ok(pb::RemoveResponse {
            seq_no: single_position(&map, &positions),
            read_token: fanout::read_token(&map, positions),
            n_removed: 0,
        })
    }

    /// A remove by filter: every shard the tenants' documents may be on resolves its own
    /// matches and logs their removal (`Router::local_remove_matching`); the answer counts
    /// every shard's removals.
    async fn routed_remove_matching(
        &self,
        cluster: &ClusterNode,
        map: &CollectionMap,
        request: &pb::RemoveRequest,
        filter: &pb::Filter,
        deadline: Option<Duration>,
        api_key: Option<&str>,
    ) -> Result<pb::RemoveResponse, ApiError> {
        let user_ids = convert::ids(&request.user_ids);
        let domain_filter = crate::local::removal_filter(filter, &convert::ids(&request.doc_ids))?;
        let timeout = fanout::forward_deadline(deadline);
        let parts = fanout::search_shards(&map.def, &user_ids)
            .into_iter()
            .map(|shard| (shard, ()))
            .collect();
        let answers = self
            .fan_out("Remove", parts, |shard, ()| {
                let (users, domain_filter) = (user_ids.clone(), domain_filter.clone());
                let call = move |target, map: Arc<CollectionMap>| {
                    let (users, domain_filter) = (users.clone(), domain_filter.clone());
                    async move {
                        match target {
                            Target::Local(name) => {
                                self.local_remove_matching(
                                    &name,
                                    users,
                                    domain_filter,
                                    request.durability,
                                    Some(timeout),
                                )
                                .await
                            }
                            Target::Remote(mut client, shard_ref) => {
                                self.count_forwarded("Remove");
                                let request = pb::ShardRemoveRequest {
                                    shard: Some(shard_ref),
                                    request: Some(pb::RemoveRequest {
                                        user_ids: convert::to_ids(&users),
                                        durability: request.durability,
                                        filter: Some(filter.clone()),
                                        ..Default::default()
                                    }),
                                };
                                let answer = client
                                    .remove(cluster.node_request(request, api_key, timeout))
                                    .await
                                    .map_err(|s| fanout::forwarded_status(&map, shard, s))?
                                    .into_inner();
                                Ok((answer.seq_no, answer.n_removed))
                            }
                        }
                    }
                };
                async move {
                    self.on_shard_stamped(cluster, map, shard, Access::Write, timeout, call)
                        .await
                        .map(|((seq, n), epoch)| ((seq, epoch), n))
                }
            })
            .await;
        let (positions, n_removed) = positions_and_count(answers)?;
        Ok(pb::RemoveResponse {
            seq_no: single_position(map, &positions),
            read_token: fanout::read_token(map, positions),
            n_removed,
        })
    }

    pub async fn routed_search(
        &self,
        cluster: &ClusterNode,
        request: pb::SearchRequest,
        deadline: Option<Duration>,
        api_key: Option<&str>,
    ) -> Result<pb::SearchResponse, ApiError> {
        let map = cluster.map(&request.collection).await?;
        let token = if request.read_token.is_empty() {
            ReadPositions::default()
        } else {
            let token = ReadPositions::decode(&request.read_token)
                .map_err(|e| ApiError::invalid("read_token", e))?;
            if token.uid != map.def.uid {
                return Err(ApiError::invalid(
                    "read_token",
                    format!("the token is not from collection '{}'", map.def.name),
                ));
            }
            token
        };
        if request.min_seq_no > 0 && map.def.n_shards > 1 {
            return Err(ApiError::invalid(
                "min_seq_no",
                "a collection of several shards reads its writes with read_token",
            ));
        }
        let user_ids = convert::ids(&request.user_ids);
        // Checked for its structure here; every shard checks it against the fields and filters.
        let filter = request.filter.as_ref().map(convert::filter).transpose()?;
        let timeout = fanout::forward_deadline(deadline);
        let top_k = request.top_k;
        let shards = fanout::search_shards(&map.def, &user_ids);
        // A position from before the shard's data began (it was given up since) names a log
        // that is gone: no later write may be taken to satisfy it.
        for &shard in &shards {
            let (Some(position), Some(assignment)) =
                (token.get(shard), map.shards.get(shard as usize))
            else {
                continue;
            };
            if position.seq > 0 && position.epoch > 0 && position.epoch < assignment.data_since {
                return Err(ApiError::Unsupported(format!(
                    "read_token: shard {shard} of collection '{}' was given up (tarn cluster \
                     forget) at epoch {} after the token's write (epoch {}): that write is lost \
                     and the token can never be satisfied; search without it",
                    map.def.name, assignment.data_since, position.epoch
                )));
            }
        }
        let parts = shards.into_iter().map(|shard| (shard, ())).collect();
        let answers = self
            .fan_out("Search", parts, |shard, ()| {
                let min_seq = token.position(shard).max(request.min_seq_no);
                // The epoch the token's write was acknowledged at, when the token sets the
                // position: the copy checks it (`local_search_at`).
                let min_seq_epoch = token
                    .get(shard)
                    .filter(|p| p.seq == min_seq)
                    .map_or(0, |p| p.epoch);
                let (vector, users, map) = (request.vector.clone(), user_ids.clone(), &map);
                let (filter, request) = (&filter, &request);
                let call = move |target, map: Arc<CollectionMap>| {
                    let (vector, users) = (vector.clone(), users.clone());
                    async move {
                        match target {
                            Target::Local(name) => {
                                let search = SearchRequest {
                                    user_ids: users,
                                    vector,
                                    top_k: top_k as usize,
                                    ef: request.ef as usize,
                                    exact: request.exact,
                                    min_seq,
                                    filter: filter.clone(),
                                };
                                let hits = self
                                    .local_search_at(&name, search, Some(timeout), min_seq_epoch)
                                    .await?;
                                Ok(fanout::shard_hits(
                                    hits.into_iter().map(|h| (h.doc_id, h.user_id, h.score)),
                                ))
                            }
                            Target::Remote(mut client, shard_ref) => {
                                self.count_forwarded("Search");
                                let search = pb::ShardSearchRequest {
                                    shard: Some(shard_ref),
                                    request: Some(pb::SearchRequest {
                                        user_ids: convert::to_ids(&users),
                                        vector,
                                        top_k,
                                        ef: request.ef,
                                        exact: request.exact,
                                        min_seq_no: min_seq,
                                        filter: request.filter.clone(),
                                        ..Default::default()
                                    }),
                                    min_seq_epoch,
                                };
                                let hits = client
                                    .search(cluster.node_request(search, api_key, timeout))
                                    .await
                                    .map_err(|s| fanout::forwarded_status(&map, shard, s))?
                                    .into_inner()
                                    .hits;
                                Ok(fanout::shard_hits(hits.iter().map(|h| {
                                    (
                                        h.doc_id.as_ref().map_or(0, convert::id_to_u128),
                                        h.user_id.as_ref().map_or(0, convert::id_to_u128),
                                        h.score,
                                    )
                                })))
                            }
                        }
                    }
                };
                self.on_shard(cluster, map, shard, Access::Spread, timeout, call)
            })
            .await;
        let mut results = Vec::new();
        let mut missing_shards = Vec::new();
        for (shard, answer) in answers {
            match answer {
                Ok(hits) => results.push(hits),
                Err(ApiError::ShardUnavailable { .. }) if request.allow_partial => {
                    missing_shards.push(shard)
                }
                Err(error) => return Err(error),
            }
        }
        let hits = fanout::merge(&map.def, results, top_k as usize);
        Ok(pb::SearchResponse {
            hits: convert::hits(hits.into_iter().map(|h| (h.doc_id, h.user_id, h.score))),
            missing_shards,
        })
    }

    pub async fn routed_get(
        &self,
        cluster: &ClusterNode,
        collection: &str,
        user_id: u128,
        doc_ids: &[u128],
        deadline: Option<Duration>,
        api_key: Option<&str>,
    ) -> Result<Vec<crate::local::StoredDocument>, ApiError> {
        let map = cluster.map(collection).await?;
        let timeout = fanout::forward_deadline(deadline);
        let parts = fanout::split(&map.def, doc_ids, &[user_id]);
        let answers = self
            .fan_out("Get", parts, |shard, (docs, _)| {
                let part_docs: Vec<u128> = docs.iter().map(|&i| doc_ids[i]).collect();
                let map = &map;
                let call = move |target, map: Arc<CollectionMap>| {
                    let part_docs = part_docs.clone();
                    async move {
                        match target {
                            Target::Local(name) => self.local_get(&name, user_id, &part_docs).await,
                            Target::Remote(mut client, shard_ref) => {
                                self.count_forwarded("Get");
                                let get = pb::ShardGetRequest {
                                    shard: Some(shard_ref),
                                    request: Some(pb::GetRequest {
                                        user_id: Some(convert::u128_to_id(user_id)),
                                        doc_ids: convert::to_ids(&part_docs),
                                        ..Default::default()
                                    }),
                                };
                                let docs = client
                                    .get(cluster.node_request(get, api_key, timeout))
                                    .await
                                    .map_err(|s| fanout::forwarded_status(&map, shard, s))?
                                    .into_inner()
                                    .docs;
                                Ok(docs
                                    .into_iter()
                                    .map(|d| {
                                        (
                                            d.doc_id.as_ref().map_or(0, convert::id_to_u128),
                                            d.vector,
                                            d.attributes,
                                        )
                                    })
                                    .collect())
                            }
                        }
                    }
                };
                self.on_shard(cluster, map, shard, Access::Spread, timeout, call)
            })
            .await;
        let mut docs = Vec::new();
        for (_, answer) in answers {
            docs.extend(answer?);
        }
        // In the order asked for, as a single node answers.
        let order: std::collections::HashMap<u128, usize> =
            doc_ids.iter().enumerate().map(|(i, d)| (*d, i)).collect();
        docs.sort_by_key(|(doc, _, _)| order.get(doc).copied().unwrap_or(usize::MAX));
        Ok(docs)
    }

    /// `GetCollection` of a sharded collection: every shard's counters, summed. Within the
    /// client's deadline (or [`INFO_DEADLINE`]).
    pub async fn routed_info(
        &self,
        cluster: &ClusterNode,
        map: &CollectionMap,
        api_key: Option<&str>,
        deadline: Option<Duration>,
    ) -> Result<pb::CollectionInfo, ApiError> {
        let infos = self.shard_infos(cluster, map, api_key, deadline).await?;
        let config: tarn_collection::CollectionConfig =
            serde_json::from_value(map.def.config.clone())
                .map_err(|e| ApiError::Internal(format!("bad collection config: {e}")))?;
        let mut total = convert::collection_info(
            &map.def.name,
            &config,
            &config.fields,
            &tarn_collection::CollectionStats::default(),
        );
        total.shards = map.def.n_shards;
        total.replication_factor = map.def.replication_factor;
        total.min_in_sync = map.def.min_in_sync;
        total.shard_key = match map.def.shard_key {
            tarn_cluster::ShardKey::User => pb::ShardKey::User,
            tarn_cluster::ShardKey::Doc => pb::ShardKey::Doc,
        } as i32;
        for info in infos {
            // The fields: the shards' (AddFields reaches each of them; the map keeps those the
            // collection was created with). Fields are only appended, so the longest list is
            // the most recent.
            if info.fields.len() > total.fields.len() {
                total.fields = info.fields.clone();
            }
            total.n_documents += info.n_documents;
            total.last_seq_no += info.last_seq_no;
            total.applied_seq_no += info.applied_seq_no;
            total.checkpoint_seq_no += info.checkpoint_seq_no;
            total.durable_seq_no += info.durable_seq_no;
            total.bytes_on_disk += info.bytes_on_disk;
            total.memory_bytes += info.memory_bytes;
            total.cold_bytes += info.cold_bytes;
            total.n_sealed_segments += info.n_sealed_segments;
            total.n_removed_not_compacted += info.n_removed_not_compacted;
            // USER sharding: a tenant lives on one shard, so the sum is exact. DOC sharding: a
            // tenant's documents spread over shards, so a sum counts it once per shard; the
            // largest shard's count is a lower bound that never overcounts.
            total.n_tenants = match map.def.shard_key {
                tarn_cluster::ShardKey::User => total.n_tenants + info.n_tenants,
                tarn_cluster::ShardKey::Doc => total.n_tenants.max(info.n_tenants),
            };
            total.n_unindexed += info.n_unindexed;
        }
        Ok(total)
    }

    /// Every shard's `CollectionInfo`, in shard order. Within the client's deadline (or
    /// [`INFO_DEADLINE`]).
    async fn shard_infos(
        &self,
        cluster: &ClusterNode,
        map: &CollectionMap,
        api_key: Option<&str>,
        deadline: Option<Duration>,
    ) -> Result<Vec<pb::CollectionInfo>, ApiError> {
        let deadline = deadline.unwrap_or(INFO_DEADLINE);
        let parts = (0..map.def.n_shards).map(|shard| (shard, ())).collect();
        let answers = self
            .fan_out("GetCollection", parts, |shard, ()| {
                let call = move |target, map: Arc<CollectionMap>| async move {
                    match target {
                        Target::Local(name) => self.local_info(&name).await,
                        Target::Remote(mut client, shard_ref) => {
                            self.count_forwarded("GetCollection");
                            let request = pb::ShardInfoRequest {
                                shard: Some(shard_ref),
                            };
                            client
                                .get_shard(cluster.node_request(request, api_key, deadline))
                                .await
                                .map_err(|s| fanout::forwarded_status(&map, shard, s))?
                                .into_inner()
                                .collection
                                .ok_or_else(|| {
                                    ApiError::Internal(format!(
                                        "node {} answered without the shard's info",
                                        map.shards[shard as usize].owner
                                    ))
                                })
                        }
                    }
                };
                self.on_shard(cluster, map, shard, Access::Read, deadline, call)
            })
            .await;
        answers.into_iter().map(|(_, answer)| answer).collect()
    }

    /// `AddFields` of a sharded collection: every shard appends the fields (a shard that has
    /// some of them from an interrupted earlier call skips those), like Flush reaches every
    /// shard; answers the collection's info. Refused before any shard changes for a bad list,
    /// a field every shard already declares, or one declared with another type.
    pub async fn routed_add_fields(
        &self,
        cluster: &ClusterNode,
        collection: &str,
        fields: Vec<tarn_collection::FieldSpec>,
        api_key: Option<&str>,
        deadline: Option<Duration>,
    ) -> Result<pb::CollectionInfo, ApiError> {
        if fields.is_empty() {
            return Err(ApiError::invalid("fields", "must not be empty"));
        }
        tarn_collection::Schema::new(fields.clone()).map_err(|error| {
            let message = error.to_string();
            ApiError::invalid(
                "fields",
                message.strip_prefix("schema: ").unwrap_or(&message),
            )
        })?;
        let map = cluster.map(collection).await?;
        let infos = self.shard_infos(cluster, &map, api_key, deadline).await?;
        let wire = convert::fields_to_wire(&fields);
        for spec in &wire {
            let declared: Vec<&pb::FieldSpec> = infos
                .iter()
                .filter_map(|info| info.fields.iter().find(|f| f.name == spec.name))
                .collect();
            if let Some(other) = declared.iter().find(|f| f.r#type != spec.r#type) {
                return Err(ApiError::invalid(
                    "fields",
                    format!(
                        "field {:?} is already declared as {}",
                        spec.name,
                        pb::FieldType::try_from(other.r#type).map_or("another type", |t| t
                            .as_str_name()
                            .trim_start_matches("FIELD_TYPE_"))
                    ),
                ));
            }
            if declared.len() == infos.len() {
                return Err(ApiError::invalid(
                    "fields",
                    format!("field {:?} is declared more than once", spec.name),
                ));
            }
        }
        let deadline = deadline.unwrap_or(FLUSH_DEADLINE);
        let parts = (0..map.def.n_shards).map(|shard| (shard, ())).collect();
        let answers = self
            .fan_out("AddFields", parts, |shard, ()| {
                let (map, fields, wire) = (&map, &fields, &wire);
                let call = move |target, map: Arc<CollectionMap>| async move {
                    match target {
                        Target::Local(name) => self.local_add_fields(&name, fields.clone()).await,
                        Target::Remote(mut client, shard_ref) => {
                            self.count_forwarded("AddFields");
                            let request = pb::ShardAddFieldsRequest {
                                shard: Some(shard_ref),
                                request: Some(pb::AddFieldsRequest {
                                    fields: wire.clone(),
                                    ..Default::default()
                                }),
                            };
                            client
                                .add_fields(cluster.node_request(request, api_key, deadline))
                                .await
                                .map_err(|s| fanout::forwarded_status(&map, shard, s))?;
                            Ok(())
                        }
                    }
                };
                self.on_shard(cluster, map, shard, Access::Write, deadline, call)
            })
            .await;
        for (_, answer) in answers {
            answer?;
        }
        self.routed_info(cluster, &map, api_key, Some(deadline))
            .await
    }

    /// `Flush` of a sharded collection: every shard checkpoints; the answer is the sum of their
    /// checkpointed sequence numbers. Within the client's deadline (or [`FLUSH_DEADLINE`]).
    pub async fn routed_flush(
        &self,
        cluster: &ClusterNode,
        collection: &str,
        api_key: Option<&str>,
        deadline: Option<Duration>,
    ) -> Result<u64, ApiError> {
        let deadline = deadline.unwrap_or(FLUSH_DEADLINE);
        let map = cluster.map(collection).await?;
        let parts = (0..map.def.n_shards).map(|shard| (shard, ())).collect();
        let answers = self
            .fan_out("Flush", parts, |shard, ()| {
                let map = &map;
                let call = move |target, map: Arc<CollectionMap>| async move {
                    match target {
                        Target::Local(name) => self.local_flush(&name).await,
                        Target::Remote(mut client, shard_ref) => {
                            self.count_forwarded("Flush");
                            let request = pb::ShardFlushRequest {
                                shard: Some(shard_ref),
                            };
                            Ok(client
                                .flush(cluster.node_request(request, api_key, deadline))
                                .await
                                .map_err(|s| fanout::forwarded_status(&map, shard, s))?
                                .into_inner()
                                .flushed_seq_no)
                        }
                    }
                };
                self.on_shard(cluster, map, shard, Access::Read, deadline, call)
            })
            .await;
        let mut total = 0;
        for (_, answer) in answers {
            total += answer?;
        }
        Ok(total)
    }
}

/// Whether a shard call needs a write's guarantees (never to a fenced shard).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Access {
    /// A read the shard's owner answers (its counts, a flush).
    Read,
    /// A read any in-sync copy may answer (a search, a get): spread over them, and tried on
    /// the next copy when one cannot be reached.
    Spread,
    Write,
}

/// How long `GetCollection` and `Flush` may take when the client sets no deadline.
const INFO_DEADLINE: Duration = Duration::from_secs(10);
const FLUSH_DEADLINE: Duration = Duration::from_secs(60);

/// An answer that means "the shard map moved on": retried after the map is refreshed.
/// A copy that did not answer (down, unreachable, refusing for now): another may.
fn is_unreachable(error: &ApiError) -> bool {
    match error {
        ApiError::ShardUnavailable { .. } | ApiError::Unavailable(_) => true,
        ApiError::Forwarded(e) => e.code() == tarn_client::Code::Unavailable,
        _ => false,
    }
}

fn is_stale_map(error: &ApiError) -> bool {
    match error {
        ApiError::StaleShardMap(_) => true,
        ApiError::Forwarded(e) => e.code() == tarn_client::Code::Aborted,
        _ => false,
    }
}

/// `seq_no` of a write: its shard's sequence number when the collection has one shard (so
/// `min_seq_no` keeps working there), 0 otherwise (use the read token).
/// One shard's answer to a counted write: its log position and how many pairs it wrote.
type CountedAnswer = Result<((u64, u64), u64), ApiError>;

/// The shards' answers to a counted write (insert, remove by filter): each shard's log
/// position, for the read token, and the total the shards counted; the first error fails it.
/// A write's position on one shard: (shard, sequence number, the epoch it was acknowledged at).
type Position = (u32, u64, u64);

fn positions_and_count(
    answers: Vec<(u32, CountedAnswer)>,
) -> Result<(Vec<Position>, u64), ApiError> {
    let mut positions = Vec::with_capacity(answers.len());
    let mut total = 0;
    for (shard, answer) in answers {
        let ((seq, epoch), n) = answer?;
        positions.push((shard, seq, epoch));
        total += n;
    }
    Ok((positions, total))
}

fn single_position(map: &CollectionMap, positions: &[Position]) -> u64 {
    match positions {
        [(_, seq, _)] if map.def.n_shards == 1 => *seq,
        _ => 0,
    }
}

/// Documents per insert when an import copies a snapshot into a cluster collection.
const IMPORT_BATCH: usize = 500;

impl Router {
    /// `RestoreSnapshot` in cluster mode: the way a collection that started on one node moves
    /// into a cluster. The snapshot is restored into a hidden local copy (verified as any
    /// restore), a sharded collection is created with its configuration, every live document is
    /// inserted through the router (FSYNC, batches of one tenant), and the copy is deleted. The
    /// collection exists while it fills; if the import fails it is dropped again.
    pub async fn import_snapshot(
        &self,
        cluster: &ClusterNode,
        mut stream: tonic::Streaming<pb::RestoreSnapshotRequest>,
        api_key: Option<&str>,
    ) -> Result<(pb::CollectionInfo, u64), ApiError> {
        let first = crate::snapshots::first_message(&mut stream).await?;
        let name = first.collection.clone();
        crate::registry::validate_name(&name)?;
        if cluster.state().collections.contains_key(&name) {
            return Err(ApiError::AlreadyExists(name));
        }
        let dir = self.registry.import_dir(&name)?;
        let restore = crate::snapshots::receive(&name, dir.clone(), first.data, stream).await?;
        let opened = tokio::task::spawn_blocking({
            let dir = dir.clone();
            move || -> Result<_, ApiError> {
                let info = restore.finish()?;
                let copy = tarn_collection::Collection::open(&dir)?;
                Ok((copy, info))
            }
        })
        .await
        .map_err(|e| ApiError::Internal(e.to_string()))?;
        let (copy, info) = match opened {
            Ok(opened) => opened,
            Err(error) => {
                remove_import_dir(dir).await;
                return Err(error);
            }
        };
        let request = pb::CreateCollectionRequest {
            name: name.clone(),
            shards: first.shards,
            shard_key: first.shard_key,
            ..Default::default()
        };
        let created = cluster
            .create_collection(&request, info.config.clone())
            .await;
        let copied = match &created {
            Ok(_) => self.copy_into(cluster, &name, &copy, api_key).await,
            Err(_) => Ok(0),
        };
        copy.close();
        remove_import_dir(dir).await;
        let map = created?;
        let n_copied = match copied {
            Ok(n) => n,
            Err(error) => {
                tracing::error!(collection = %name, %error, "import failed; dropping the collection");
                if let Err(drop_error) = cluster.drop_collection(&name).await {
                    tracing::error!(collection = %name, error = %drop_error, "could not drop the failed import");
                }
                return Err(error);
            }
        };
        tracing::info!(collection = %name, n_copied, seq_no = info.seq_no, "snapshot imported into the cluster");
        Ok((
            self.routed_info(cluster, &map, api_key, None).await?,
            info.seq_no,
        ))
    }

    /// `Cluster/ImportSetAside`: every live document of the set-aside copy `name` inserted
    /// into the existing cluster collection `collection` through the router (a shard's data
    /// goes back wherever its shard is now). The copy is opened in place and stays until dropped.
    pub async fn import_set_aside(
        &self,
        cluster: &ClusterNode,
        name: &str,
        collection: &str,
        api_key: Option<&str>,
    ) -> Result<u64, ApiError> {
        let map = cluster.map(collection).await?;
        let path = self.registry.set_aside_path(name)?;
        // Imported whole: its log past its checkpoint too (entries it held uncommitted).
        let copy =
            tokio::task::spawn_blocking(move || tarn_collection::Collection::open_whole(&path))
                .await
                .map_err(|e| ApiError::Internal(e.to_string()))??;
        let config: tarn_collection::CollectionConfig =
            serde_json::from_value(map.def.config.clone())
                .map_err(|e| ApiError::Internal(format!("bad collection config: {e}")))?;
        if copy.config().dimension != config.dimension {
            copy.close();
            return Err(ApiError::invalid(
                "collection",
                format!(
                    "'{collection}' holds {}-d vectors but the set-aside copy {}-d",
                    config.dimension,
                    copy.config().dimension
                ),
            ));
        }
        let copied = self.copy_into(cluster, collection, &copy, api_key).await;
        copy.close();
        let n = copied?;
        tracing::info!(set_aside = %name, %collection, n, "set-aside shard copy imported");
        Ok(n)
    }

    /// Inserts every live document of `copy` into the cluster collection `name`; returns how
    /// many. A blocking thread reads the copy; batches go through a small bounded channel.
    async fn copy_into(
        &self,
        cluster: &ClusterNode,
        name: &str,
        copy: &tarn_collection::Collection,
        api_key: Option<&str>,
    ) -> Result<u64, ApiError> {
        type Batch = (u128, Vec<u128>, Vec<f32>, Vec<pb::Attributes>);
        let (tx, mut rx) = tokio::sync::mpsc::channel::<Batch>(4);
        let reader = {
            let copy = copy.clone();
            tokio::task::spawn_blocking(move || -> Result<(), ApiError> {
                let mut batch: Option<Batch> = None;
                for document in copy.export_documents_with_attributes() {
                    let (user, doc, vector, attributes) = document?;
                    if batch
                        .as_ref()
                        .is_some_and(|b| b.0 != user || b.1.len() >= IMPORT_BATCH)
                    {
                        if let Some(full) = batch.take() {
                            if tx.blocking_send(full).is_err() {
                                return Ok(());
                            }
                        }
                    }
                    let entry =
                        batch.get_or_insert_with(|| (user, Vec::new(), Vec::new(), Vec::new()));
                    entry.1.push(doc);
                    entry.2.extend_from_slice(&vector);
                    entry
                        .3
                        .push(convert::attributes_to_wire(&attributes).unwrap_or_default());
                }
                if let Some(last) = batch {
                    let _ = tx.blocking_send(last);
                }
                Ok(())
            })
        };
        let mut n_copied = 0u64;
        while let Some((user, doc_ids, vectors, attributes)) = rx.recv().await {
            n_copied += doc_ids.len() as u64;
            // A batch of documents without attributes is sent without them.
            let attributes = match attributes.iter().all(|a| a.values.is_empty()) {
                true => Vec::new(),
                false => attributes,
            };
            let request = pb::InsertRequest {
                collection: name.to_owned(),
                doc_ids: doc_ids.into_iter().map(convert::u128_to_id).collect(),
                user_ids: vec![convert::u128_to_id(user)],
                vectors,
                durability: pb::Durability::Fsync as i32,
                attributes,
            };
            self.routed_insert(cluster, request, None, api_key).await?;
        }
        reader
            .await
            .map_err(|e| ApiError::Internal(format!("the import reader: {e}")))??;
        Ok(n_copied)
    }
}

/// Deletes an import's temporary copy (a leftover is deleted at the next start anyway).
async fn remove_import_dir(dir: std::path::PathBuf) {
    let shown = dir.display().to_string();
    match tokio::task::spawn_blocking(move || std::fs::remove_dir_all(&dir)).await {
        Ok(Ok(())) => {}
        Ok(Err(error)) if error.kind() == std::io::ErrorKind::NotFound => {}
        Ok(Err(error)) => tracing::warn!(dir = %shown, %error, "could not remove an import's copy"),
        Err(error) => tracing::warn!(dir = %shown, %error, "could not remove an import's copy"),
    }
}
