//! The mutable segment: one partition per tenant, taking ingested operations. A partition is
//! searched exactly while small and gets an hnsw_rs graph once it holds `graph_threshold` live
//! vectors.
//!
//! Storing a vector and indexing it are separate steps. `upsert` only appends to the partition
//! (microseconds), so a write is searchable as soon as it is applied; `index_pending`, called by
//! an indexing thread (and by sealing), inserts the not-yet-indexed tail into the graph in
//! parallel batches. A search combines the graph with an exact scan of that tail, so it never
//! misses a stored vector, and graph building (about 2 ms per 384-d vector at
//! ef_construction 200) never delays visibility. One writer (the collection's ingestion
//! thread), one indexer at a time per partition, any number of concurrent searches.
//!
//! Each partition also keeps its documents' attributes by slot (an [`AttributeIndex`] over the
//! segment's schema), so a filtered search knows its exact matches (`filtered.rs`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};

use crate::attribute_index::{AttributeIndex, SlotSet};
use crate::attributes::{AttributeError, Attributes, Schema};
use crate::bitset::Bitset;
use crate::config::IndexConfig;
use crate::error::Result;
use crate::filter::Filter;
use crate::filtered::{filtered_top_k, plan};
use crate::flat_graph::Candidate;
use crate::fulltext::{text_hits, TermWeights, TextStats};
use crate::hnsw_graph::HnswGraph;
use crate::search::{exact_top_k, to_hits, Hit};

#[derive(Debug)]
pub(crate) struct MutableData {
    /// Slot `i`'s vector is `vectors[i * dim..(i + 1) * dim]`; slots are never reused.
    pub(crate) vectors: Vec<f32>,
    pub(crate) doc_ids: Vec<u128>,
    /// Slots replaced by a newer version or removed.
    pub(crate) tombstones: Bitset,
    /// Live documents.
    pub(crate) by_doc: HashMap<u128, u32>,
    /// Created once the partition reaches the graph threshold.
    pub(crate) graph: Option<Arc<HnswGraph>>,
    /// Slots below this were handed to the graph (or were dead when their turn came); slots from
    /// here on are the unindexed tail, searched exactly.
    pub(crate) indexed: usize,
    /// The attributes of each slot (slots stored without any have none).
    pub(crate) attributes: AttributeIndex,
}

impl MutableData {
    fn new(schema: Schema) -> Self {
        MutableData {
            vectors: Vec::new(),
            doc_ids: Vec::new(),
            tombstones: Bitset::default(),
            by_doc: HashMap::new(),
            graph: None,
            indexed: 0,
            attributes: AttributeIndex::new(schema),
        }
    }

    /// The live slots whose attributes match `filter`, exactly.
    fn live_matches(&self, filter: &Filter) -> SlotSet {
        let n_slots = self.doc_ids.len() as u32;
        let dead = SlotSet::from_words(self.tombstones.words().to_vec());
        self.attributes
            .matching(filter, n_slots)
            .and(&dead.not(n_slots))
    }
}

#[derive(Debug)]
pub(crate) struct MutablePartition {
    pub(crate) data: RwLock<MutableData>,
    /// Held while inserting into the graph: one indexer per partition at a time.
    indexing: Mutex<()>,
}

impl MutablePartition {
    fn new(schema: Schema) -> Self {
        MutablePartition {
            data: RwLock::new(MutableData::new(schema)),
            indexing: Mutex::new(()),
        }
    }
}

/// The segment that ingestion writes to.
#[derive(Debug)]
pub struct MutableSegment {
    config: IndexConfig,
    partitions: RwLock<HashMap<u128, Arc<MutablePartition>>>,
    /// The declared attribute fields; new partitions index these. Taken after `partitions`
    /// when both are locked.
    schema: RwLock<Schema>,
    /// Slots stored over all partitions (live and superseded): what `estimated_bytes` counts.
    n_slots: AtomicUsize,
}

impl MutableSegment {
    /// A segment without attribute fields (documents can carry no attributes).
    pub fn new(config: IndexConfig) -> Self {
        MutableSegment::with_schema(config, Schema::default())
    }

    /// A segment whose documents may carry attributes of `schema`'s fields.
    pub fn with_schema(config: IndexConfig, schema: Schema) -> Self {
        MutableSegment {
            config,
            partitions: RwLock::new(HashMap::new()),
            schema: RwLock::new(schema),
            n_slots: AtomicUsize::new(0),
        }
    }

    /// The attribute fields documents may carry here.
    pub fn schema(&self) -> Schema {
        self.schema.read().clone()
    }

    /// Adopts a schema that extends the current one (fields added to the collection): every
    /// partition indexes the new fields from now on; documents stored before have no value for
    /// them. Refuses a schema that does not start with the current one, changing nothing.
    pub fn extend_schema(&self, schema: Schema) -> Result<(), AttributeError> {
        let partitions = self.partitions.write();
        let mut current = self.schema.write();
        if !schema.starts_with(&current) {
            return Err(AttributeError::SchemaMismatch {
                problem: "the new schema does not extend the segment's fields".to_string(),
            });
        }
        for partition in partitions.values() {
            partition
                .data
                .write()
                .attributes
                .extend_schema(schema.clone())?;
        }
        *current = schema;
        Ok(())
    }

    pub fn config(&self) -> &IndexConfig {
        &self.config
    }

    fn partition(&self, user_id: u128) -> Option<Arc<MutablePartition>> {
        self.partitions.read().get(&user_id).cloned()
    }

    pub(crate) fn partitions(&self) -> Vec<(u128, Arc<MutablePartition>)> {
        self.partitions
            .read()
            .iter()
            .map(|(u, p)| (*u, Arc::clone(p)))
            .collect()
    }

    /// Stores `vector` (already prepared for the metric) as `(user_id, doc_id)`, replacing a
    /// version in this segment. Returns true if one was replaced. Searchable on return. The
    /// document has no attributes.
    pub fn upsert(&self, user_id: u128, doc_id: u128, vector: &[f32]) -> bool {
        self.store(user_id, doc_id, vector, None)
            .expect("a document without attributes is always valid")
    }

    /// `upsert` with the document's attributes, which must be valid for the segment's schema
    /// ([`Schema::validate`]); if they are not, nothing is stored and the error says why.
    pub fn upsert_with_attributes(
        &self,
        user_id: u128,
        doc_id: u128,
        vector: &[f32],
        attributes: &Attributes,
    ) -> Result<bool, AttributeError> {
        self.store(user_id, doc_id, vector, Some(attributes))
    }

    fn store(
        &self,
        user_id: u128,
        doc_id: u128,
        vector: &[f32],
        attributes: Option<&Attributes>,
    ) -> Result<bool, AttributeError> {
        debug_assert_eq!(vector.len(), self.config.dimension);
        let attributes = attributes.filter(|attributes| !attributes.is_empty());
        let partition = {
            let mut partitions = self.partitions.write();
            let partition = partitions
                .entry(user_id)
                .or_insert_with(|| Arc::new(MutablePartition::new(self.schema.read().clone())));
            Arc::clone(partition)
        };
        let mut data = partition.data.write();
        if let Some(attributes) = attributes {
            data.attributes.schema().validate(attributes)?;
        }
        let slot = data.doc_ids.len() as u32;
        if let Some(attributes) = attributes {
            // Validated, and the slot is past every slot pushed: this cannot fail.
            data.attributes.push(slot, attributes)?;
        }
        let replaced = data.by_doc.insert(doc_id, slot);
        if let Some(old) = replaced {
            data.tombstones.set(old as usize);
        }
        data.vectors.extend_from_slice(vector);
        data.doc_ids.push(doc_id);
        self.n_slots.fetch_add(1, Ordering::Relaxed);
        Ok(replaced.is_some())
    }

    /// Inserts up to `max_slots` not-yet-indexed slots into their partitions' graphs (creating a
    /// graph for a partition that reached the threshold), using all cores. Returns how many
    /// slots it handled; 0 means nothing is pending.
    pub fn index_pending(&self, max_slots: usize) -> usize {
        let mut handled = 0;
        for (_, partition) in self.partitions() {
            if handled >= max_slots {
                break;
            }
            handled += self.index_partition(&partition, max_slots - handled);
        }
        handled
    }

    /// `index_pending` for one partition.
    pub(crate) fn index_partition(&self, partition: &MutablePartition, max_slots: usize) -> usize {
        let threshold = self.config.graph_threshold;
        let dim = self.config.dimension;
        {
            let _indexer = partition.indexing.lock();
            let (graph, start, end, items) = {
                let data = partition.data.read();
                if data.graph.is_none() && data.by_doc.len() < threshold {
                    return 0;
                }
                let start = data.indexed;
                let end = data.doc_ids.len().min(start.saturating_add(max_slots));
                if start >= end {
                    return 0;
                }
                let items: Vec<(Vec<f32>, usize)> = (start..end)
                    .filter(|&slot| !data.tombstones.get(slot))
                    .map(|slot| (data.vectors[slot * dim..(slot + 1) * dim].to_vec(), slot))
                    .collect();
                (data.graph.clone(), start, end, items)
            };
            let graph = match graph {
                Some(graph) => graph,
                None => {
                    let graph = Arc::new(HnswGraph::new(
                        &self.config.hnsw,
                        self.config.metric,
                        end * 2,
                    ));
                    partition.data.write().graph = Some(Arc::clone(&graph));
                    graph
                }
            };
            let refs: Vec<(&[f32], usize)> = items
                .iter()
                .map(|(v, slot)| (v.as_slice(), *slot))
                .collect();
            graph.insert_parallel(&refs);
            partition.data.write().indexed = end;
            end - start
        }
    }

    /// Slots stored but not yet in a graph, in partitions that have (or are due) one.
    pub fn n_unindexed(&self) -> usize {
        let threshold = self.config.graph_threshold;
        self.partitions
            .read()
            .values()
            .map(|p| {
                let data = p.data.read();
                if data.graph.is_some() || data.by_doc.len() >= threshold {
                    data.doc_ids.len() - data.indexed
                } else {
                    0
                }
            })
            .sum()
    }

    /// Removes `(user_id, doc_id)` from this segment; returns true if it was here.
    pub fn remove(&self, user_id: u128, doc_id: u128) -> bool {
        let Some(partition) = self.partition(user_id) else {
            return false;
        };
        let mut data = partition.data.write();
        match data.by_doc.remove(&doc_id) {
            Some(slot) => {
                data.tombstones.set(slot as usize);
                true
            }
            None => false,
        }
    }

    /// Live `(user_id, doc_id)` pairs, read partition by partition.
    pub fn live_documents(&self) -> Vec<(u128, u128)> {
        let mut out = Vec::new();
        for (user_id, partition) in self.partitions() {
            out.extend(partition.data.read().by_doc.keys().map(|d| (user_id, *d)));
        }
        out
    }

    pub fn contains(&self, user_id: u128, doc_id: u128) -> bool {
        self.partition(user_id)
            .is_some_and(|p| p.data.read().by_doc.contains_key(&doc_id))
    }

    pub fn get(&self, user_id: u128, doc_id: u128) -> Option<Vec<f32>> {
        let partition = self.partition(user_id)?;
        let data = partition.data.read();
        let slot = *data.by_doc.get(&doc_id)? as usize;
        let dim = self.config.dimension;
        Some(data.vectors[slot * dim..(slot + 1) * dim].to_vec())
    }

    /// The stored vector and the attributes of a live document (its stored values too with
    /// `stored`), read under one lock: the same version.
    pub fn get_with_attributes(
        &self,
        user_id: u128,
        doc_id: u128,
        stored: bool,
    ) -> Result<Option<(Vec<f32>, Attributes)>> {
        let Some(partition) = self.partition(user_id) else {
            return Ok(None);
        };
        let data = partition.data.read();
        let Some(&slot) = data.by_doc.get(&doc_id) else {
            return Ok(None);
        };
        let dim = self.config.dimension;
        let start = slot as usize * dim;
        Ok(Some((
            data.vectors[start..start + dim].to_vec(),
            data.attributes.document_of(slot, stored)?,
        )))
    }

    /// The attributes of a live document, without its vector; its stored values (TEXT values,
    /// payload) too with `stored`.
    pub fn document(
        &self,
        user_id: u128,
        doc_id: u128,
        stored: bool,
    ) -> Result<Option<Attributes>> {
        let Some(partition) = self.partition(user_id) else {
            return Ok(None);
        };
        let data = partition.data.read();
        match data.by_doc.get(&doc_id) {
            Some(&slot) => data.attributes.document_of(slot, stored).map(Some),
            None => Ok(None),
        }
    }

    /// The live documents of one tenant whose attributes match `filter`, in no order.
    pub fn matching_documents(&self, user_id: u128, filter: &Filter) -> Vec<u128> {
        let Some(partition) = self.partition(user_id) else {
            return Vec::new();
        };
        let data = partition.data.read();
        data.live_matches(filter)
            .iter()
            .map(|slot| data.doc_ids[slot as usize])
            .collect()
    }

    /// Nearest live documents of one tenant, nearest first.
    pub fn search(
        &self,
        user_id: u128,
        query: &[f32],
        k: usize,
        ef: usize,
        exact: bool,
    ) -> Vec<Hit> {
        self.search_filtered(user_id, query, k, ef, exact, None)
    }

    /// Nearest live documents of one tenant whose attributes match `filter` (all when `None`),
    /// nearest first: `min(k, matching live documents)` of them, always (`filtered.rs`).
    /// Validate the filter against the schema first (it recurses once per level).
    pub fn search_filtered(
        &self,
        user_id: u128,
        query: &[f32],
        k: usize,
        ef: usize,
        exact: bool,
        filter: Option<&Filter>,
    ) -> Vec<Hit> {
        let Some(partition) = self.partition(user_id) else {
            return Vec::new();
        };
        let data = partition.data.read();
        let dim = self.config.dimension;
        let metric = self.config.metric;
        let distance = |slot: u32| {
            metric.distance(
                query,
                &data.vectors[slot as usize * dim..(slot as usize + 1) * dim],
            )
        };
        if let Some(filter) = filter {
            let matches = data.live_matches(filter);
            let n_matches = matches.count();
            let graph = data.graph.as_ref();
            let plan = plan(n_matches, data.by_doc.len(), k, ef, graph.is_some(), exact);
            // hnsw_rs walks every node: the mutable graph ignores the walk.
            let graph_search = |ef: usize, _walk, _density: &mut _| {
                let Some(graph) = graph else {
                    return Vec::new();
                };
                let keep = |slot: u32| matches.contains(slot);
                let mut candidates = graph.search(query, k, ef, Some(&keep));
                let tail = matches.iter().filter(|&slot| slot as usize >= data.indexed);
                candidates.extend(exact_top_k(tail, k, distance));
                merge_candidates(candidates, k)
            };
            let n_live = data.by_doc.len();
            let candidates =
                filtered_top_k(&matches, n_matches, n_live, k, plan, graph_search, distance);
            return to_hits(user_id, candidates, &data.doc_ids);
        }
        let candidates = match (&data.graph, exact) {
            (Some(graph), false) => {
                let is_live = |slot: u32| !data.tombstones.get(slot as usize);
                let has_tombstones = data.by_doc.len() < data.doc_ids.len();
                let keep = has_tombstones.then_some(&is_live as &dyn Fn(u32) -> bool);
                let mut candidates = graph.search(query, k, ef, keep);
                // The tail not in the graph yet, exactly.
                let tail =
                    (data.indexed as u32..data.doc_ids.len() as u32).filter(|&slot| is_live(slot));
                candidates.extend(exact_top_k(tail, k, distance));
                merge_candidates(candidates, k)
            }
            _ => exact_top_k(data.by_doc.values().copied(), k, distance),
        };
        to_hits(user_id, candidates, &data.doc_ids)
    }

    /// BM25 statistics of one tenant's live documents here for the TEXT field `field` and the
    /// analysed query `terms` (`fulltext.rs`); nothing for a tenant or field not here.
    pub fn text_stats(&self, user_id: u128, field: &str, terms: &[String]) -> TextStats {
        let Some(partition) = self.partition(user_id) else {
            return TextStats::default();
        };
        let data = partition.data.read();
        let Some(column) = data.attributes.text_column(field) else {
            return TextStats::default();
        };
        column.stats(
            terms,
            &SlotSet::from_words(data.tombstones.words().to_vec()),
        )
    }

    /// The `k` live documents of one tenant with the best BM25 scores for `terms` in `field`
    /// whose attributes match `filter`, best first; `weights` come from the statistics of
    /// every segment searched. A hit's distance is its negated score.
    pub fn text_search(
        &self,
        user_id: u128,
        field: &str,
        terms: &[String],
        weights: &TermWeights,
        k: usize,
        filter: Option<&Filter>,
    ) -> Vec<Hit> {
        let Some(partition) = self.partition(user_id) else {
            return Vec::new();
        };
        let data = partition.data.read();
        let Some(column) = data.attributes.text_column(field) else {
            return Vec::new();
        };
        let matches = filter.map(|filter| data.live_matches(filter));
        let accept = |slot: u32| match &matches {
            Some(matches) => matches.contains(slot),
            None => !data.tombstones.get(slot as usize),
        };
        text_hits(user_id, column, terms, weights, k, accept, &data.doc_ids)
    }

    /// Live documents per tenant.
    pub fn live_counts(&self) -> HashMap<u128, u64> {
        self.partitions
            .read()
            .iter()
            .map(|(user, p)| (*user, p.data.read().by_doc.len() as u64))
            .filter(|(_, n)| *n > 0)
            .collect()
    }

    /// True when nothing was ever stored here.
    pub fn is_empty(&self) -> bool {
        self.partitions
            .read()
            .values()
            .all(|p| p.data.read().doc_ids.is_empty())
    }

    /// Slots stored, superseded and removed versions included (they stay until sealing).
    pub fn n_slots(&self) -> usize {
        self.n_slots.load(Ordering::Relaxed)
    }

    /// An O(1) estimate of `memory_bytes` from the slot count, for checkpoint triggers: each slot
    /// holds its vector and id here plus, once indexed, hnsw_rs's copy of the vector and its
    /// layer-0 links (about 2·M neighbours of 40 bytes each in hnsw_rs's structures).
    pub fn estimated_bytes(&self) -> usize {
        let dim = self.config.dimension;
        self.n_slots() * (2 * dim * 4 + 16 + 32 + self.config.hnsw.m * 2 * 40)
    }

    /// Of `memory_bytes`, the TEXT fields' inverted indexes.
    pub fn text_memory_bytes(&self) -> usize {
        self.partitions
            .read()
            .values()
            .map(|p| p.data.read().attributes.text_memory_bytes())
            .sum()
    }

    /// Bytes held: vectors, ids and maps (the hnsw_rs graph's own copy is estimated), and the
    /// TEXT fields' inverted indexes.
    pub fn memory_bytes(&self) -> usize {
        let dim = self.config.dimension;
        self.partitions
            .read()
            .values()
            .map(|p| {
                let data = p.data.read();
                let n = data.doc_ids.len();
                let graph_points = data.graph.as_ref().map_or(0, |g| g.n_points());
                n * (dim * 4 + 16)
                    + data.by_doc.len() * 32
                    + graph_points * (dim * 4 + self.config.hnsw.m * 2 * 40)
                    + data.attributes.text_memory_bytes()
            })
            .sum()
    }
}

/// The graph's and the exact tail's candidates: sorted, each slot once (a slot being indexed
/// right now can come from both), the nearest `k`.
fn merge_candidates(mut candidates: Vec<Candidate>, k: usize) -> Vec<Candidate> {
    candidates.sort_unstable();
    candidates.dedup_by_key(|c| c.node);
    candidates.truncate(k);
    candidates
}
