//! Search results and the helpers shared by both segment kinds.

use std::collections::BinaryHeap;

use crate::flat_graph::Candidate;

/// One search result: internal distance (lower is closer; see `Metric::score`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Hit {
    pub user_id: u128,
    pub doc_id: u128,
    pub distance: f32,
}

/// Brute-force top k over `nodes`, nearest first.
pub(crate) fn exact_top_k(
    nodes: impl Iterator<Item = u32>,
    k: usize,
    distance: impl Fn(u32) -> f32,
) -> Vec<Candidate> {
    if k == 0 {
        return Vec::new();
    }
    let mut heap: BinaryHeap<Candidate> = BinaryHeap::with_capacity(k + 1);
    for node in nodes {
        let d = distance(node);
        if heap.len() < k {
            heap.push(Candidate { distance: d, node });
        } else if heap.peek().is_some_and(|worst| d < worst.distance) {
            heap.pop();
            heap.push(Candidate { distance: d, node });
        }
    }
    heap.into_sorted_vec()
}

/// Turns a partition's `(distance, slot)` candidates into hits of `user_id`.
pub(crate) fn to_hits(user_id: u128, candidates: Vec<Candidate>, doc_ids: &[u128]) -> Vec<Hit> {
    candidates
        .into_iter()
        .map(|c| Hit {
            user_id,
            doc_id: doc_ids[c.node as usize],
            distance: c.distance,
        })
        .collect()
}
