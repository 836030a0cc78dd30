//! The mutable segment: one partition per tenant, taking ingested operations. A partition is
//! searched exactly while small and gets an hnsw_rs graph once it holds `graph_threshold` live
//! vectors. One writer (the collection's ingestion thread), any number of concurrent searches.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::RwLock;

use crate::bitset::Bitset;
use crate::config::IndexConfig;
use crate::hnsw_graph::HnswGraph;
use crate::search::{exact_top_k, Hit};

#[derive(Debug, Default)]
pub(crate) struct MutableData {
    /// Slot `i`'s vector is `vectors[i * dim..(i + 1) * dim]`; slots are never reused.
    pub(crate) vectors: Vec<f32>,
    pub(crate) doc_ids: Vec<u128>,
    /// Slots replaced by a newer version or removed.
    pub(crate) tombstones: Bitset,
    /// Live documents.
    pub(crate) by_doc: HashMap<u128, u32>,
    /// Built once the partition reaches the graph threshold; holds every live slot after that.
    pub(crate) graph: Option<Arc<HnswGraph>>,
}

#[derive(Debug, Default)]
pub(crate) struct MutablePartition {
    pub(crate) data: RwLock<MutableData>,
}

/// The segment that ingestion writes to.
#[derive(Debug)]
pub struct MutableSegment {
    config: IndexConfig,
    partitions: RwLock<HashMap<u128, Arc<MutablePartition>>>,
}

impl MutableSegment {
    pub fn new(config: IndexConfig) -> Self {
        MutableSegment {
            config,
            partitions: RwLock::new(HashMap::new()),
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
    /// version in this segment. Returns true if one was replaced.
    pub fn upsert(&self, user_id: u128, doc_id: u128, vector: &[f32]) -> bool {
        debug_assert_eq!(vector.len(), self.config.dimension);
        let partition = {
            let mut partitions = self.partitions.write();
            Arc::clone(partitions.entry(user_id).or_default())
        };
        let (slot, replaced, graph, build_graph) = {
            let mut data = partition.data.write();
            let slot = data.doc_ids.len() as u32;
            let replaced = data.by_doc.insert(doc_id, slot);
            if let Some(old) = replaced {
                data.tombstones.set(old as usize);
            }
            data.vectors.extend_from_slice(vector);
            data.doc_ids.push(doc_id);
            let build = data.graph.is_none() && data.by_doc.len() >= self.config.graph_threshold;
            (slot, replaced.is_some(), data.graph.clone(), build)
        };
        if let Some(graph) = graph {
            graph.insert(vector, slot);
        } else if build_graph {
            self.build_graph(&partition);
        }
        replaced
    }

    /// Builds the partition's graph from its live vectors (searches go on, exactly, meanwhile).
    fn build_graph(&self, partition: &MutablePartition) {
        let (live, vectors) = {
            let data = partition.data.read();
            let mut live: Vec<u32> = data.by_doc.values().copied().collect();
            live.sort_unstable();
            (live, data.vectors.clone())
        };
        let dim = self.config.dimension;
        let graph = HnswGraph::new(&self.config.hnsw, self.config.metric, live.len() * 2);
        let items: Vec<(&[f32], usize)> = live
            .iter()
            .map(|&slot| {
                (
                    &vectors[slot as usize * dim..(slot as usize + 1) * dim],
                    slot as usize,
                )
            })
            .collect();
        graph.insert_parallel(&items);
        tracing::debug!(
            n_points = live.len(),
            "built the graph of a mutable partition"
        );
        partition.data.write().graph = Some(Arc::new(graph));
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
        let candidates = match (&data.graph, exact) {
            (Some(graph), false) => {
                let is_live = |slot: u32| !data.tombstones.get(slot as usize);
                let has_tombstones = data.by_doc.len() < data.doc_ids.len();
                graph.search(
                    query,
                    k,
                    ef,
                    has_tombstones.then_some(&is_live as &dyn Fn(u32) -> bool),
                )
            }
            _ => exact_top_k(data.by_doc.values().copied(), k, |slot| {
                metric.distance(
                    query,
                    &data.vectors[slot as usize * dim..(slot as usize + 1) * dim],
                )
            }),
        };
        candidates
            .into_iter()
            .map(|c| Hit {
                user_id,
                doc_id: data.doc_ids[c.node as usize],
                distance: c.distance,
            })
            .collect()
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
