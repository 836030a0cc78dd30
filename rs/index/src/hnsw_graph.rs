//! The mutable graph: a thin wrapper over hnsw_rs, whose types never leave this module.
//! hnsw_rs allows concurrent inserts and searches (`insert_slice(&self)`), which the mutable
//! segment relies on: the ingestion thread inserts while searches run.

use hnsw_rs::prelude::Hnsw;

use crate::config::HnswParams;
use crate::flat_graph::{Candidate, CsrLayer, FlatGraph};
use crate::metric::{HnswDistance, Metric};

/// hnsw_rs's own limit on layers (its `NB_LAYER_MAX`).
const MAX_LAYERS: usize = 16;

pub(crate) struct HnswGraph {
    hnsw: Hnsw<'static, f32, HnswDistance>,
}

impl std::fmt::Debug for HnswGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HnswGraph")
            .field("n_points", &self.hnsw.get_nb_point())
            .finish()
    }
}

impl HnswGraph {
    pub(crate) fn new(params: &HnswParams, metric: Metric, expected_points: usize) -> Self {
        let hnsw = Hnsw::new(
            params.m,
            expected_points.max(1024),
            MAX_LAYERS,
            params.ef_construction,
            HnswDistance(metric),
        );
        HnswGraph { hnsw }
    }

    /// Inserts many vectors using all cores (hnsw_rs's rayon-parallel insert).
    pub(crate) fn insert_parallel(&self, items: &[(&[f32], usize)]) {
        if items.len() < 64 {
            for &(vector, slot) in items {
                self.hnsw.insert_slice((vector, slot));
            }
        } else {
            self.hnsw.parallel_insert_slice(&items.to_vec());
        }
    }

    pub(crate) fn n_points(&self) -> usize {
        self.hnsw.get_nb_point()
    }

    /// k nearest slots accepted by `keep` (all slots when `None`), nearest first. hnsw_rs's
    /// filtered search explores more (it does not stop early), so it is used only when needed.
    pub(crate) fn search(
        &self,
        query: &[f32],
        k: usize,
        ef: usize,
        keep: Option<&dyn Fn(u32) -> bool>,
    ) -> Vec<Candidate> {
        let neighbours = match keep {
            Some(keep) => {
                let filter = |id: &usize| keep(*id as u32);
                self.hnsw.search_filter(query, k, ef.max(k), Some(&filter))
            }
            None => self.hnsw.search(query, k, ef.max(k)),
        };
        neighbours
            .into_iter()
            .map(|n| Candidate {
                distance: n.distance,
                node: n.d_id as u32,
            })
            .collect()
    }

    /// Exports the graph over nodes `0..n_nodes` (a partition's slots; slots that were never
    /// inserted have no edges). Nodes for which `is_node` holds are made reachable from the
    /// entry point (see `FlatGraph::connect_unreachable`). Returns `None` for an empty graph.
    pub(crate) fn export(
        &self,
        n_nodes: usize,
        is_node: impl Fn(u32) -> bool,
    ) -> Option<(FlatGraph, usize)> {
        let indexation = self.hnsw.get_point_indexation();
        let max_level = usize::from(indexation.get_max_level_observed());
        // The entry point is the first point that reached the top layer.
        let entry = indexation
            .get_layer_iterator(max_level)
            .next()?
            .get_origin_id() as u32;
        let mut lists: Vec<Vec<Vec<u32>>> = vec![vec![Vec::new(); n_nodes]; max_level + 1];
        for point in indexation {
            let node = point.get_origin_id();
            for (layer, neighbours) in point
                .get_neighborhood_id()
                .into_iter()
                .enumerate()
                .take(max_level + 1)
            {
                lists[layer][node] = neighbours.iter().map(|n| n.d_id as u32).collect();
            }
        }
        let reconnected = FlatGraph::connect_unreachable(&mut lists[0], entry, is_node);
        let layers = lists.iter().map(|l| CsrLayer::from_lists(l)).collect();
        Some((FlatGraph { entry, layers }, reconnected))
    }
}
