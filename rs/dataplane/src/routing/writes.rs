//! The routed writes: insert, remove by ids and by filter, each split by shard and acknowledged
//! with a read token of every shard's position.

use super::*;

impl Router {
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
}
