//! The routed reads: search (hits merged by score into `top_k`, partial results on request) and
//! get, each spread over a shard's in-sync copies and honouring a read token.

use super::*;

impl Router {
    pub async fn routed_search(
        &self,
        cluster: &ClusterNode,
        mut request: pb::SearchRequest,
        deadline: Option<Duration>,
        api_key: Option<&str>,
    ) -> Result<pb::SearchResponse, ApiError> {
        let map = cluster.map(&request.collection).await?;
        if request.text.is_some() && !request.vector.is_empty() {
            return self
                .routed_hybrid(cluster, request, deadline, api_key, &map)
                .await;
        }
        let user_ids = convert::ids(&request.user_ids);
        // A full-text search over several shards scores with the statistics of all of them
        // (summed in a first phase), so that it ranks as one node holding every shard would.
        let spans_shards = fanout::search_shards(&map.def, &user_ids).len() > 1;
        if let Some(text) = request
            .text
            .as_ref()
            .filter(|t| !t.stats_only && t.stats.is_none())
        {
            if spans_shards {
                let first_phase = pb::SearchRequest {
                    text: Some(pb::TextQuery {
                        stats_only: true,
                        ..text.clone()
                    }),
                    ..request.clone()
                };
                let stats = Box::pin(self.routed_search(cluster, first_phase, deadline, api_key))
                    .await?
                    .text_stats;
                if let Some(text) = request.text.as_mut() {
                    text.stats = Some(stats.unwrap_or_default());
                }
            }
        }
        let stats_only = request.text.as_ref().is_some_and(|t| t.stats_only);
        // Checked for its structure here; every shard checks it against the fields and filters.
        let filter = request.filter.as_ref().map(convert::filter).transpose()?;
        let timeout = fanout::forward_deadline(deadline);
        // A partial search answers in time with what came: each shard gets the deadline but a
        // reserve, and one whose copies did not answer within it (a stopped or hung node still
        // registered) is listed in `missing_shards` as an unreachable one is.
        let timeout = if request.allow_partial {
            timeout.saturating_sub((timeout / 10).min(PARTIAL_RESERVE))
        } else {
            timeout
        };
        let top_k = request.top_k;
        let shards = fanout::search_shards(&map.def, &user_ids);
        let token = read_positions(&map, &request.read_token, request.min_seq_no, &shards)?;
        let parts = shards.into_iter().map(|shard| (shard, ())).collect();
        let answers = self
            .fan_out("Search", parts, |shard, ()| {
                let (min_seq, min_seq_epoch) = shard_position(&token, shard, request.min_seq_no);
                let (vector, users, map) = (request.vector.clone(), user_ids.clone(), &map);
                let (filter, request, token) = (&filter, &request, &token);
                let call = move |target, map: Arc<CollectionMap>| {
                    let (vector, users) = (vector.clone(), users.clone());
                    async move {
                        not_given_up(&map, token, shard)?;
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
                                    output: convert::search_selection(
                                        &request.output_fields,
                                        request.with_payload,
                                    ),
                                    text: convert::text_query(&request.text),
                                    hybrid: Default::default(),
                                };
                                if stats_only {
                                    let stats = self
                                        .local_text_stats_at(
                                            &name,
                                            search,
                                            Some(timeout),
                                            min_seq_epoch,
                                        )
                                        .await?;
                                    return Ok((
                                        Vec::new(),
                                        Some(convert::text_stats_to_wire(&stats)),
                                    ));
                                }
                                let hits = self
                                    .local_search_at(&name, search, Some(timeout), min_seq_epoch)
                                    .await?;
                                Ok((convert::search_hits(hits), None))
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
                                        output_fields: request.output_fields.clone(),
                                        with_payload: request.with_payload,
                                        text: request.text.clone(),
                                        ..Default::default()
                                    }),
                                    min_seq_epoch,
                                };
                                let response = client
                                    .search(cluster.node_request(search, api_key, timeout))
                                    .await
                                    .map_err(|s| fanout::forwarded_status(&map, shard, s))?
                                    .into_inner();
                                Ok((response.hits, response.text_stats))
                            }
                        }
                    }
                };
                self.on_shard(cluster, map, shard, Access::Spread, timeout, call)
            })
            .await;
        let mut results = Vec::new();
        let mut missing_shards = Vec::new();
        // A (tenant, document) lives on one shard: its values are looked up by that pair
        // after the merge.
        let mut values = std::collections::HashMap::new();
        let mut stats: Option<tarn_collection::TextStats> = None;
        for (shard, answer) in answers {
            match answer {
                Ok((_, Some(shard_stats))) if stats_only => {
                    let shard_stats = convert::text_stats(&shard_stats);
                    let sum = stats.get_or_insert_with(|| tarn_collection::TextStats {
                        doc_freqs: vec![0; shard_stats.doc_freqs.len()],
                        ..Default::default()
                    });
                    if sum.doc_freqs.len() != shard_stats.doc_freqs.len() {
                        return Err(ApiError::Internal(format!(
                            "shard {shard} analysed the query into {} terms, another into {}",
                            shard_stats.doc_freqs.len(),
                            sum.doc_freqs.len()
                        )));
                    }
                    sum.add(&shard_stats);
                }
                Ok((hits, _)) => results.push(fanout::shard_hits(hits.into_iter().map(|hit| {
                    let doc_id = hit.doc_id.as_ref().map_or(0, convert::id_to_u128);
                    let user_id = hit.user_id.as_ref().map_or(0, convert::id_to_u128);
                    if let Some(attributes) = hit.attributes {
                        values.insert((user_id, doc_id), attributes);
                    }
                    (doc_id, user_id, hit.score)
                }))),
                Err(ApiError::ShardUnavailable { .. } | ApiError::DeadlineExceeded(_))
                    if request.allow_partial =>
                {
                    missing_shards.push(shard)
                }
                Err(error) => return Err(error),
            }
        }
        if stats_only {
            return Ok(pb::SearchResponse {
                text_stats: stats.as_ref().map(convert::text_stats_to_wire),
                missing_shards,
                ..Default::default()
            });
        }
        // BM25 scores are higher-is-better whatever the metric.
        let hits = match request.text {
            Some(_) => tarn_cluster::merge_top_k(results, top_k as usize, true),
            None => fanout::merge(&map.def, results, top_k as usize),
        };
        Ok(pb::SearchResponse {
            hits: convert::hits(hits.into_iter().map(|h| {
                let attributes = values.remove(&(h.user_id, h.doc_id));
                (h.doc_id, h.user_id, h.score, attributes)
            })),
            missing_shards,
            text_stats: None,
        })
    }

    /// A hybrid search: each side searched over every shard and merged globally (as a search
    /// with only that side), then fused here with the single node's function, so a cluster
    /// and one node give the same answer on the same data.
    async fn routed_hybrid(
        &self,
        cluster: &ClusterNode,
        request: pb::SearchRequest,
        deadline: Option<Duration>,
        api_key: Option<&str>,
        map: &CollectionMap,
    ) -> Result<pb::SearchResponse, ApiError> {
        let hybrid = convert::hybrid(request.fusion.as_ref())?;
        hybrid.validate()?;
        let top_k = request.top_k as usize;
        let depth = hybrid.depth_for(top_k) as u32;
        let vector_side = pb::SearchRequest {
            text: None,
            fusion: None,
            top_k: depth,
            ..request.clone()
        };
        let text_side = pb::SearchRequest {
            vector: Vec::new(),
            fusion: None,
            top_k: depth,
            ..request
        };
        let (vector, text) = tokio::join!(
            Box::pin(self.routed_search(cluster, vector_side, deadline, api_key)),
            Box::pin(self.routed_search(cluster, text_side, deadline, api_key)),
        );
        let (vector, text) = (vector?, text?);
        let mut values = std::collections::HashMap::new();
        let mut side = |hits: Vec<pb::Hit>| -> Vec<(u128, u128, f32)> {
            hits.into_iter()
                .map(|hit| {
                    let doc_id = hit.doc_id.as_ref().map_or(0, convert::id_to_u128);
                    let user_id = hit.user_id.as_ref().map_or(0, convert::id_to_u128);
                    if let Some(attributes) = hit.attributes {
                        values.insert((user_id, doc_id), attributes);
                    }
                    (user_id, doc_id, hit.score)
                })
                .collect()
        };
        let vector_hits = side(vector.hits);
        let text_hits = side(text.hits);
        let higher = fanout::higher_is_better(&map.def);
        let fused = tarn_collection::fuse(&vector_hits, higher, &text_hits, &hybrid, top_k);
        let mut missing_shards = vector.missing_shards;
        missing_shards.extend(text.missing_shards);
        missing_shards.sort_unstable();
        missing_shards.dedup();
        Ok(pb::SearchResponse {
            hits: fused
                .into_iter()
                .map(|hit| pb::Hit {
                    doc_id: Some(convert::u128_to_id(hit.doc_id)),
                    user_id: Some(convert::u128_to_id(hit.user_id)),
                    score: hit.score,
                    attributes: values.remove(&(hit.user_id, hit.doc_id)),
                    vector_side: hit.vector.map(convert::side_to_wire),
                    text_side: hit.text.map(convert::side_to_wire),
                })
                .collect(),
            missing_shards,
            text_stats: None,
        })
    }

    /// The stored documents among `doc_ids` of `user_id` (`request` names the collection and
    /// the read token or position to wait for).
    pub async fn routed_get(
        &self,
        cluster: &ClusterNode,
        request: &pb::GetRequest,
        user_id: u128,
        doc_ids: &[u128],
        deadline: Option<Duration>,
        api_key: Option<&str>,
    ) -> Result<Vec<crate::local::StoredDocument>, ApiError> {
        let map = cluster.map(&request.collection).await?;
        let timeout = fanout::forward_deadline(deadline);
        let parts: Vec<_> = fanout::split(&map.def, doc_ids, &[user_id]);
        let shards: Vec<u32> = parts.iter().map(|(shard, _)| *shard).collect();
        let token = read_positions(&map, &request.read_token, request.min_seq_no, &shards)?;
        let answers = self
            .fan_out("Get", parts, |shard, (docs, _)| {
                let part_docs: Vec<u128> = docs.iter().map(|&i| doc_ids[i]).collect();
                let (min_seq, min_seq_epoch) = shard_position(&token, shard, request.min_seq_no);
                let (map, token) = (&map, &token);
                let call = move |target, map: Arc<CollectionMap>| {
                    let part_docs = part_docs.clone();
                    async move {
                        not_given_up(&map, token, shard)?;
                        match target {
                            Target::Local(name) => {
                                let output = convert::get_selection(
                                    &request.output_fields,
                                    request.with_payload,
                                );
                                self.local_get(
                                    &name,
                                    user_id,
                                    &part_docs,
                                    &output,
                                    min_seq,
                                    min_seq_epoch,
                                    Some(timeout),
                                )
                                .await
                            }
                            Target::Remote(mut client, shard_ref) => {
                                self.count_forwarded("Get");
                                let get = pb::ShardGetRequest {
                                    shard: Some(shard_ref),
                                    request: Some(pb::GetRequest {
                                        user_id: Some(convert::u128_to_id(user_id)),
                                        doc_ids: convert::to_ids(&part_docs),
                                        min_seq_no: min_seq,
                                        output_fields: request.output_fields.clone(),
                                        with_payload: request.with_payload,
                                        ..Default::default()
                                    }),
                                    min_seq_epoch,
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
}

impl Router {
    /// Counts over every shard holding the tenants' documents (one for a tenant-keyed
    /// collection), each read from an in-sync copy once the token's position is visible there,
    /// and sums: a (tenant, document) pair lives on one shard.
    pub async fn routed_count(
        &self,
        cluster: &ClusterNode,
        request: &pb::CountRequest,
        deadline: Option<Duration>,
        api_key: Option<&str>,
    ) -> Result<u64, ApiError> {
        let map = cluster.map(&request.collection).await?;
        let user_ids = convert::ids(&request.user_ids);
        // Checked for its structure here; every shard checks it against its fields.
        let filter = request.filter.as_ref().map(convert::filter).transpose()?;
        let timeout = fanout::forward_deadline(deadline);
        let shards = fanout::search_shards(&map.def, &user_ids);
        let token = read_positions(&map, &request.read_token, request.min_seq_no, &shards)?;
        let parts = shards.into_iter().map(|shard| (shard, ())).collect();
        let answers = self
            .fan_out("Count", parts, |shard, ()| {
                let (min_seq, min_seq_epoch) = shard_position(&token, shard, request.min_seq_no);
                let (map, token, filter, users) = (&map, &token, &filter, &user_ids);
                let call = move |target, map: Arc<CollectionMap>| async move {
                    not_given_up(&map, token, shard)?;
                    match target {
                        Target::Local(name) => {
                            self.local_count(
                                &name,
                                users,
                                filter.as_ref(),
                                min_seq,
                                min_seq_epoch,
                                Some(timeout),
                            )
                            .await
                        }
                        Target::Remote(mut client, shard_ref) => {
                            self.count_forwarded("Count");
                            let count = pb::ShardCountRequest {
                                shard: Some(shard_ref),
                                request: Some(pb::CountRequest {
                                    user_ids: convert::to_ids(users),
                                    filter: request.filter.clone(),
                                    min_seq_no: min_seq,
                                    ..Default::default()
                                }),
                                min_seq_epoch,
                            };
                            Ok(client
                                .count(cluster.node_request(count, api_key, timeout))
                                .await
                                .map_err(|s| fanout::forwarded_status(&map, shard, s))?
                                .into_inner()
                                .count)
                        }
                    }
                };
                self.on_shard(cluster, map, shard, Access::Spread, timeout, call)
            })
            .await;
        let mut count = 0;
        for (_, answer) in answers {
            count += answer?;
        }
        Ok(count)
    }
}

impl Router {
    /// One page of a scroll over every shard holding the tenants' documents: each shard gives
    /// its first `limit` documents after the cursor (read from an in-sync copy once the token's
    /// position is visible there); the page is the first `limit` of them all in (user_id,
    /// doc_id) order, and more follow when any shard had more.
    pub async fn routed_scroll(
        &self,
        cluster: &ClusterNode,
        request: &pb::ScrollRequest,
        deadline: Option<Duration>,
        api_key: Option<&str>,
    ) -> Result<pb::ScrollResponse, ApiError> {
        let map = cluster.map(&request.collection).await?;
        let user_ids = convert::ids(&request.user_ids);
        // Checked here so that a bad one is named once; every shard checks the rest.
        convert::scroll_after(&request.cursor)?;
        request.filter.as_ref().map(convert::filter).transpose()?;
        let limit = convert::scroll_limit(request.limit);
        let timeout = fanout::forward_deadline(deadline);
        let shards = fanout::search_shards(&map.def, &user_ids);
        let token = read_positions(&map, &request.read_token, request.min_seq_no, &shards)?;
        let parts = shards.into_iter().map(|shard| (shard, ())).collect();
        let answers = self
            .fan_out("Scroll", parts, |shard, ()| {
                let (min_seq, min_seq_epoch) = shard_position(&token, shard, request.min_seq_no);
                let (map, token) = (&map, &token);
                let shard_request = pb::ScrollRequest {
                    min_seq_no: min_seq,
                    read_token: Vec::new(),
                    ..request.clone()
                };
                let call = move |target, map: Arc<CollectionMap>| {
                    let shard_request = shard_request.clone();
                    async move {
                        not_given_up(&map, token, shard)?;
                        match target {
                            Target::Local(name) => {
                                self.local_scroll(
                                    &name,
                                    &shard_request,
                                    min_seq,
                                    min_seq_epoch,
                                    Some(timeout),
                                )
                                .await
                            }
                            Target::Remote(mut client, shard_ref) => {
                                self.count_forwarded("Scroll");
                                let scroll = pb::ShardScrollRequest {
                                    shard: Some(shard_ref),
                                    request: Some(pb::ScrollRequest {
                                        collection: String::new(),
                                        ..shard_request
                                    }),
                                    min_seq_epoch,
                                };
                                Ok(client
                                    .scroll(cluster.node_request(scroll, api_key, timeout))
                                    .await
                                    .map_err(|s| fanout::forwarded_status(&map, shard, s))?
                                    .into_inner())
                            }
                        }
                    }
                };
                self.on_shard(cluster, map, shard, Access::Spread, timeout, call)
            })
            .await;
        // A shard with more stopped at its cursor: past the nearest such stop, a shard's
        // documents were not looked at, so the page ends there at the latest.
        let mut docs = Vec::new();
        let mut stop: Option<(u128, u128)> = None;
        for (_, answer) in answers {
            let page = answer?;
            let at = convert::scroll_after(&page.next_cursor).map_err(|e| {
                ApiError::Internal(format!("a shard answered a scroll with a bad cursor: {e}"))
            })?;
            if let Some(at) = at {
                stop = Some(stop.map_or(at, |s| s.min(at)));
            }
            docs.extend(page.docs);
        }
        let pair = |d: &pb::Document| {
            (
                d.user_id.as_ref().map_or(0, convert::id_to_u128),
                d.doc_id.as_ref().map_or(0, convert::id_to_u128),
            )
        };
        docs.sort_by_key(pair);
        if let Some(stop) = stop {
            docs.retain(|d| pair(d) <= stop);
        }
        let next = if docs.len() > limit {
            docs.truncate(limit);
            docs.last().map(pair)
        } else {
            stop
        };
        Ok(pb::ScrollResponse {
            docs,
            next_cursor: convert::scroll_cursor(next),
        })
    }
}

/// What a partial search keeps of its deadline for merging and answering after the shards'
/// share (a tenth of it, at most this).
const PARTIAL_RESERVE: Duration = Duration::from_millis(500);

/// A read's token checked against the collection it reads (`map`): decoded, from this
/// collection, `min_seq_no` only for a one-shard collection, and no position of `shards` from
/// before its shard was given up.
fn read_positions(
    map: &CollectionMap,
    read_token: &[u8],
    min_seq_no: u64,
    shards: &[u32],
) -> Result<ReadPositions, ApiError> {
    let token = if read_token.is_empty() {
        ReadPositions::default()
    } else {
        let token =
            ReadPositions::decode(read_token).map_err(|e| ApiError::invalid("read_token", e))?;
        if token.uid != map.def.uid {
            return Err(ApiError::invalid(
                "read_token",
                format!("the token is not from collection '{}'", map.def.name),
            ));
        }
        token
    };
    if min_seq_no > 0 && map.def.n_shards > 1 {
        return Err(ApiError::invalid(
            "min_seq_no",
            "a collection of several shards reads its writes with read_token",
        ));
    }
    for &shard in shards {
        not_given_up(map, &token, shard)?;
    }
    Ok(token)
}

/// Refuses a token whose position on `shard` is from before the shard's data began in `map`
/// (it was given up since, `tarn cluster forget`): it names a log that is gone, and no later
/// write may be taken to satisfy it. Checked on the map a read starts with and again on each
/// map a retry refreshes to (a router whose map predated the forget).
fn not_given_up(map: &CollectionMap, token: &ReadPositions, shard: u32) -> Result<(), ApiError> {
    let (Some(position), Some(assignment)) = (token.get(shard), map.shards.get(shard as usize))
    else {
        return Ok(());
    };
    if position.seq > 0 && position.epoch > 0 && position.epoch < assignment.data_since {
        return Err(ApiError::Unsupported(format!(
            "read_token: shard {shard} of collection '{}' was given up (tarn cluster \
             forget) at epoch {} after the token's write (epoch {}): that write is lost \
             and the token can never be satisfied; read without it",
            map.def.name, assignment.data_since, position.epoch
        )));
    }
    Ok(())
}

/// The position a read of `shard` waits for (the later of the token's and `min_seq_no`) and
/// the epoch the token's write there was acknowledged at when the token sets it (0: none; the
/// copy checks it, `Router::local_search_at`).
fn shard_position(token: &ReadPositions, shard: u32, min_seq_no: u64) -> (u64, u64) {
    let min_seq = token.position(shard).max(min_seq_no);
    let epoch = token
        .get(shard)
        .filter(|p| p.seq == min_seq)
        .map_or(0, |p| p.epoch);
    (min_seq, epoch)
}

#[cfg(test)]
mod tests {
    use tarn_cluster::{CollectionDef, ShardAssignment, ShardKey, TokenPosition};

    use super::*;

    /// A map of one collection (uid 1) with two shards, shard 0's data begun at `data_since`.
    fn map_given_up_at(data_since: u64) -> CollectionMap {
        let mut given_up = ShardAssignment::serving("n2", 6);
        given_up.data_since = data_since;
        CollectionMap {
            def: CollectionDef {
                name: "docs".into(),
                uid: 1,
                n_shards: 2,
                shard_key: ShardKey::Doc,
                config: serde_json::Value::Null,
                replication_factor: 1,
                min_in_sync: 1,
            },
            shards: vec![given_up, ShardAssignment::serving("n1", 3)],
        }
    }

    /// A token from before a `forget` is refused on the map that shows the forget, whether the
    /// read started on it or a retry refreshed to it (the read's closures check each map they
    /// are called with); a later token, or another shard's position, passes.
    #[test]
    fn a_token_from_before_its_shard_was_given_up_is_refused_on_any_map_showing_it() {
        let token = ReadPositions {
            uid: 1,
            positions: vec![
                TokenPosition {
                    shard: 0,
                    seq: 40,
                    epoch: 4,
                },
                TokenPosition {
                    shard: 1,
                    seq: 9,
                    epoch: 3,
                },
            ],
        };
        let before_forget = map_given_up_at(0);
        let after_forget = map_given_up_at(5);
        assert!(not_given_up(&before_forget, &token, 0).is_ok());
        let error = not_given_up(&after_forget, &token, 0).unwrap_err();
        assert!(
            matches!(&error, ApiError::Unsupported(m) if m.contains("given up")),
            "{error:?}"
        );
        assert!(not_given_up(&after_forget, &token, 1).is_ok());
        let later = ReadPositions {
            uid: 1,
            positions: vec![TokenPosition {
                shard: 0,
                seq: 2,
                epoch: 6,
            }],
        };
        assert!(not_given_up(&after_forget, &later, 0).is_ok());
        assert!(read_positions(&after_forget, &token.encode(), 0, &[0]).is_err());
        assert!(read_positions(&after_forget, &token.encode(), 0, &[1]).is_ok());
    }
}
