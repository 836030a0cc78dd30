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

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};

use crate::bitset::Bitset;
use crate::config::IndexConfig;
use crate::hnsw_graph::HnswGraph;
use crate::search::{exact_top_k, to_hits, Hit};

#[derive(Debug, Default)]
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
}

#[derive(Debug, Default)]
pub(crate) struct MutablePartition {
    pub(crate) data: RwLock<MutableData>,
    /// Held while inserting into the graph: one indexer per partition at a time.
    indexing: Mutex<()>,
}

/// The segment that ingestion writes to.
#[derive(Debug)]
pub struct MutableSegment {
    config: IndexConfig,
    partitions: RwLock<HashMap<u128, Arc<MutablePartition>>>,
    /// Slots stored over all partitions (live and superseded): what `estimated_bytes` counts.
    n_slots: AtomicUsize,
}

impl MutableSegment {
    pub fn new(config: IndexConfig) -> Self {
        MutableSegment {
            config,
            partitions: RwLock::new(HashMap::new()),
            n_slots: AtomicUsize::new(0),
        }
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
    /// version in this segment. Returns true if one was replaced. Searchable on return.
    pub fn upsert(&self, user_id: u128, doc_id: u128, vector: &[f32]) -> bool {
        debug_assert_eq!(vector.len(), self.config.dimension);
        let partition = {
            let mut partitions = self.partitions.write();
            Arc::clone(partitions.entry(user_id).or_default())
        };
        let mut data = partition.data.write();
        let slot = data.doc_ids.len() as u32;
        let replaced = data.by_doc.insert(doc_id, slot);
        if let Some(old) = replaced {
            data.tombstones.set(old as usize);
        }
        data.vectors.extend_from_slice(vector);
        data.doc_ids.push(doc_id);
        self.n_slots.fetch_add(1, Ordering::Relaxed);
        replaced.is_some()
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

    /// Nearest live documents of one tenant, nearest first.
    pub fn search(
        &self,
        user_id: u128,
        query: &[f32],
        k: usize,
        ef: usize,
        exact: bool,
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
                candidates.sort_unstable();
                // A slot being indexed right now can come from both.
                candidates.dedup_by_key(|c| c.node);
                candidates.truncate(k);
                candidates
            }
            _ => exact_top_k(data.by_doc.values().copied(), k, distance),
        };
        to_hits(user_id, candidates, &data.doc_ids)
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

    /// Bytes held: vectors, ids and maps (the hnsw_rs graph's own copy is estimated).
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
            })
            .sum()
    }
}
