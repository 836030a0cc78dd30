//! Calls on a whole sharded collection: its info (counts summed over shards), `AddFields` and
//! `Flush`, answered by every shard's owner.

use super::*;

impl Router {
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
