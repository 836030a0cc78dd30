//! The operations on this node's own collections (a user collection, or a shard it owns), as
//! the gRPC handlers and the cluster router both use them: each write takes a write slot, is
//! logged, replicated to a shard's in-sync replicas and acknowledged only while this node still
//! owns the shard.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tarn_collection::{FieldSelection, SearchRequest};
use tarn_proto::v1 as pb;
use tokio::sync::Semaphore;

use crate::convert;
use crate::router::Router;
use crate::status::ApiError;

/// How long a search waits for `min_seq_no` when the client set no deadline.
const DEFAULT_MIN_SEQ_WAIT: Duration = Duration::from_secs(30);

impl Router {
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

    /// [`Router::logged_write`] for writes that log zero or more entries and answer more
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
        let (seq_no, answer) = match write(collection, durability).await {
            Ok(written) => written,
            Err(error) => {
                // A primary whose copy refuses writes for good (its WAL poisoned by an fsync
                // error) hands its replicated shard to an in-sync replica instead of keeping a
                // lease that holds every write of the shard back.
                if let (Some(cluster), Some(shard_write)) = (&self.cluster, &gate) {
                    if let Some(replication) = &shard_write.replication {
                        if let Some(why) = shard_write.collection.write_error() {
                            replication.step_down(
                                cluster,
                                format!("this primary's copy refuses writes: {why}"),
                            );
                        }
                    }
                }
                return Err(error);
            }
        };
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
}

/// The filter of a remove by filter, which lists no documents.
pub fn removal_filter(
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
pub type StoredDocument = (u128, Vec<f32>, Option<pb::Attributes>);

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

/// The operations on this node's own collections (a user collection, or a shard it owns), as
/// the handlers and the cluster router both use them.
impl Router {
    pub async fn local_insert(
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
    pub async fn local_remove_matching(
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
            for seq in futures_util::future::join_all(removes).await {
                last_seq = last_seq.max(seq?);
            }
            Ok((last_seq, (last_seq, n_removed)))
        })
        .await
    }

    /// Appends fields to a local collection. On a shard (a router's call), fields it already
    /// declares with the same type are skipped, so a retried AddFields completes where an
    /// earlier one stopped; the rest must be new.
    pub async fn local_add_fields(
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

    pub async fn local_remove(
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
    pub async fn local_search(
        &self,
        name: &str,
        search: SearchRequest,
        deadline: Option<Duration>,
    ) -> Result<Vec<tarn_collection::SearchHit>, ApiError> {
        self.local_search_at(name, search, deadline, 0).await
    }

    /// [`Router::local_search`] for a read token whose position (`search.min_seq`) was
    /// acknowledged at `token_epoch` (0: none): a copy of a cluster shard answers only if its
    /// map of the shard is at that epoch or later (waiting a moment for it) and the entry it
    /// holds at that position was not written at an older epoch (a deposed primary's entry at
    /// the same number); otherwise UNAVAILABLE, and the router reads another copy.
    pub async fn local_search_at(
        &self,
        name: &str,
        search: SearchRequest,
        deadline: Option<Duration>,
        token_epoch: u64,
    ) -> Result<Vec<tarn_collection::SearchHit>, ApiError> {
        let collection = self.resolve(name).await?;
        // The token's position first: a filter on a field the token's write follows (an
        // `AddFields` before it) is checked against the schema as of that write, not against a
        // copy that has not yet applied it.
        self.await_position(name, &collection, search.min_seq, token_epoch, deadline)
            .await?;
        collection.validate_search(&search)?;
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

    /// The BM25 statistics of `search`'s text query over a local collection (the first phase of
    /// a cluster's full-text search), once the position it asks for is applied.
    pub async fn local_text_stats_at(
        &self,
        name: &str,
        search: SearchRequest,
        deadline: Option<Duration>,
        token_epoch: u64,
    ) -> Result<tarn_collection::TextStats, ApiError> {
        let collection = self.resolve(name).await?;
        self.await_position(name, &collection, search.min_seq, token_epoch, deadline)
            .await?;
        let Some(text) = &search.text else {
            return Err(ApiError::invalid("text", "statistics need a text query"));
        };
        Ok(collection.text_stats(&search.user_ids, text)?)
    }

    /// Waits (a little less than `deadline`) until `collection` has applied position `min_seq`
    /// (0: nothing to wait for), then, for a read token's position acknowledged at
    /// `token_epoch` (0: none), checks the copy may answer for it ([`Router::check_token_epoch`]).
    async fn await_position(
        &self,
        name: &str,
        collection: &tarn_collection::Collection,
        min_seq: u64,
        token_epoch: u64,
        deadline: Option<Duration>,
    ) -> Result<(), ApiError> {
        if min_seq == 0 {
            return Ok(());
        }
        collection
            .wait_applied(min_seq, min_seq_wait(deadline))
            .await?;
        if token_epoch > 0 {
            self.check_token_epoch(name, collection, min_seq, token_epoch)
                .await?;
        }
        Ok(())
    }

    /// See [`Router::local_search_at`].
    async fn check_token_epoch(
        &self,
        name: &str,
        collection: &tarn_collection::Collection,
        seq: u64,
        token_epoch: u64,
    ) -> Result<(), ApiError> {
        let (Some(cluster), Some((shard, _))) =
            (&self.cluster, tarn_cluster::ShardName::parse(name))
        else {
            return Ok(());
        };
        let at_least = |s: &tarn_cluster::ClusterState| {
            s.assignment(&shard).is_some_and(|a| a.epoch >= token_epoch)
        };
        if !at_least(&cluster.state()) {
            cluster
                .wait_for_view(Duration::from_millis(500), at_least)
                .await;
        }
        let view_epoch = cluster.state().assignment(&shard).map_or(0, |a| a.epoch);
        let starts = if view_epoch < token_epoch {
            Vec::new()
        } else {
            let copy = collection.clone();
            tokio::task::spawn_blocking(move || copy.epoch_starts())
                .await
                .map_err(|e| ApiError::Internal(e.to_string()))??
        };
        match token_epoch_refusal(view_epoch, &starts, seq, token_epoch) {
            Some(why) => Err(ApiError::Unavailable(format!(
                "shard {} of collection '{}': {why}; read another copy",
                shard.shard, shard.collection
            ))),
            None => Ok(()),
        }
    }

    /// The stored documents among `doc_ids` of one tenant: (doc, vector, the values `output`
    /// selects), once
    /// position `min_seq` acknowledged at `token_epoch` is visible, as for
    /// [`Router::local_search_at`].
    #[allow(clippy::too_many_arguments)]
    pub async fn local_get(
        &self,
        name: &str,
        user_id: u128,
        doc_ids: &[u128],
        output: &FieldSelection,
        min_seq: u64,
        token_epoch: u64,
        deadline: Option<Duration>,
    ) -> Result<Vec<StoredDocument>, ApiError> {
        let collection = self.resolve(name).await?;
        self.await_position(name, &collection, min_seq, token_epoch, deadline)
            .await?;
        Ok(collection
            .get_selected(user_id, doc_ids, output)?
            .into_iter()
            .map(|(doc_id, vector, attributes)| {
                (doc_id, vector, convert::attributes_to_wire(&attributes))
            })
            .collect())
    }

    /// The number of live documents of `user_ids` matching `filter` in a local collection, once
    /// `min_seq` is visible (as `local_get`).
    pub async fn local_count(
        &self,
        name: &str,
        user_ids: &[u128],
        filter: Option<&tarn_collection::Filter>,
        min_seq: u64,
        token_epoch: u64,
        deadline: Option<Duration>,
    ) -> Result<u64, ApiError> {
        let collection = self.resolve(name).await?;
        self.await_position(name, &collection, min_seq, token_epoch, deadline)
            .await?;
        Ok(collection.count(user_ids, filter)?)
    }

    /// One page of a scroll of a local collection (`Collection::scroll`), once `min_seq` is
    /// visible (as `local_get`).
    pub async fn local_scroll(
        &self,
        name: &str,
        request: &pb::ScrollRequest,
        min_seq: u64,
        token_epoch: u64,
        deadline: Option<Duration>,
    ) -> Result<pb::ScrollResponse, ApiError> {
        let collection = self.resolve(name).await?;
        self.await_position(name, &collection, min_seq, token_epoch, deadline)
            .await?;
        let filter = request.filter.as_ref().map(convert::filter).transpose()?;
        let after = convert::scroll_after(&request.cursor)?;
        let output = convert::get_selection(&request.output_fields, request.with_payload);
        let page = collection.scroll(
            &convert::ids(&request.user_ids),
            filter.as_ref(),
            after,
            convert::scroll_limit(request.limit),
            &output,
            request.with_vectors,
        )?;
        Ok(pb::ScrollResponse {
            docs: page
                .docs
                .into_iter()
                .map(|(user_id, doc_id, vector, values)| pb::Document {
                    doc_id: Some(convert::u128_to_id(doc_id)),
                    user_id: Some(convert::u128_to_id(user_id)),
                    vector,
                    attributes: convert::attributes_to_wire(&values),
                })
                .collect(),
            next_cursor: convert::scroll_cursor(page.next),
        })
    }

    pub async fn local_info(&self, name: &str) -> Result<pb::CollectionInfo, ApiError> {
        let collection = self.resolve(name).await?;
        Ok(convert::collection_info(
            name,
            collection.config(),
            collection.schema().fields(),
            &collection.stats(),
        ))
    }

    pub async fn local_flush(&self, name: &str) -> Result<u64, ApiError> {
        let collection = self.resolve(name).await?;
        // A flush holds a write slot like a write: it waits on the WAL and a checkpoint, and
        // under overload it is refused the same way.
        let _permit = self.write_permit()?;
        Ok(collection.flush().await?)
    }
}

/// Why a copy whose map is at `view_epoch`, and whose log's epochs begin at `starts` ((epoch,
/// first position) pairs), may not answer for a read token's write at position `seq`
/// acknowledged at `token_epoch`: its map is behind the token (it may be a deposed copy that
/// never saw the write's epoch), or its entry at `seq` was written at an older epoch (a
/// deposed primary's entry at the same number, not the token's write). `None`: it may.
fn token_epoch_refusal(
    view_epoch: u64,
    starts: &[(u64, u64)],
    seq: u64,
    token_epoch: u64,
) -> Option<String> {
    if view_epoch < token_epoch {
        return Some(format!(
            "this copy's map is at epoch {view_epoch}, behind the read token's write (epoch \
             {token_epoch})"
        ));
    }
    let written_at = tarn_cluster::EpochHistory::from_starts(starts.to_vec())
        .ok()
        .and_then(|history| history.epoch_of(seq));
    written_at.filter(|at| *at < token_epoch).map(|written_at| {
        format!(
            "this copy's entry at position {seq} was written at epoch {written_at}, before the \
             read token's write (epoch {token_epoch}): it is not that write"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::token_epoch_refusal;

    /// A read token's write at position 12, acknowledged at epoch 3, is vouched for only by a
    /// copy whose map has reached epoch 3 and whose entry 12 was written at epoch 3 or later:
    /// a deposed primary (map at epoch 2, or its own entry 12 written at epoch 2 that the new
    /// primary never had) refuses, so that the router reads another copy.
    #[test]
    fn a_copy_answers_for_a_token_only_at_its_epoch_with_the_same_write() {
        // Epoch 1 from position 1, epoch 3 from 10: entry 12 is the token's write.
        let promoted = [(1, 1), (3, 10)];
        assert_eq!(token_epoch_refusal(3, &promoted, 12, 3), None);
        assert_eq!(token_epoch_refusal(4, &promoted, 12, 3), None);
        // A map behind the token's epoch.
        let behind = token_epoch_refusal(2, &promoted, 12, 3).unwrap();
        assert!(behind.contains("epoch 2, behind"), "{behind}");
        // The deposed primary's log: epoch 2 from 5, so its entry 12 is its own, unacknowledged
        // write at the same number; its map has caught up meanwhile.
        let deposed = [(1, 1), (2, 5)];
        let other_write = token_epoch_refusal(3, &deposed, 12, 3).unwrap();
        assert!(other_write.contains("written at epoch 2"), "{other_write}");
        // A token of an older tarn (no epoch) is not checked by epoch.
        assert_eq!(token_epoch_refusal(3, &deposed, 12, 0), None);
    }
}
