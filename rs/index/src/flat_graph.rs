//! tarn's own HNSW graph layout and search: neighbour lists as flat `u32` arrays per layer
//! (CSR: an offsets array and one neighbours array), searched with a reusable visited set and
//! heaps of plain `(distance, node)` pairs. Built by exporting an hnsw_rs graph.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use crate::bytes::{ByteReader, ByteWriter};
use crate::error::{IndexError, Result};
use crate::visited::with_visited;

/// How many neighbours ahead of the distance computation their vectors are prefetched
/// (measured: `benches/search_speed.rs`, docs/BENCHMARKS.md).
const PREFETCH_AHEAD: usize = 1;

/// One layer: node `i`'s neighbours are `neighbors[offsets[i]..offsets[i + 1]]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct CsrLayer {
    offsets: Vec<u32>,
    neighbors: Vec<u32>,
}

impl CsrLayer {
    pub(crate) fn from_lists(lists: &[Vec<u32>]) -> Self {
        let mut offsets = Vec::with_capacity(lists.len() + 1);
        let mut neighbors = Vec::with_capacity(lists.iter().map(Vec::len).sum());
        offsets.push(0);
        for list in lists {
            neighbors.extend_from_slice(list);
            offsets.push(neighbors.len() as u32);
        }
        CsrLayer { offsets, neighbors }
    }

    #[inline]
    pub(crate) fn neighbors(&self, node: u32) -> &[u32] {
        let node = node as usize;
        &self.neighbors[self.offsets[node] as usize..self.offsets[node + 1] as usize]
    }

    fn memory_bytes(&self) -> usize {
        (self.offsets.len() + self.neighbors.len()) * 4
    }
}

/// An immutable HNSW graph over nodes `0..n_nodes` (a partition's slots).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct FlatGraph {
    pub(crate) entry: u32,
    /// `layers[l]` for l in 0..=max level.
    pub(crate) layers: Vec<CsrLayer>,
}

/// A `(distance, node)` pair ordered by distance (then node, for determinism).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Candidate {
    pub(crate) distance: f32,
    pub(crate) node: u32,
}

impl Eq for Candidate {}

impl Ord for Candidate {
    fn cmp(&self, other: &Self) -> Ordering {
        self.distance
            .total_cmp(&other.distance)
            .then(self.node.cmp(&other.node))
    }
}

impl PartialOrd for Candidate {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// Which nodes a layer-0 search goes through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Walk {
    /// Every node: each neighbour is measured and may steer the search; only accepted nodes
    /// are results. Right when almost every node is accepted (tombstones, wide filters): the
    /// graph stays connected as it was built.
    All,
    /// Accepted nodes only (ACORN's two-hop expansion, Patel et al., SIGMOD 2024): a node's
    /// accepted neighbours are measured; each rejected neighbour is looked through, and its
    /// own accepted neighbours are taken instead, until `max_fresh` new nodes are found. A
    /// rejected node costs a bitmap test, not a distance, so a filter matching a fraction `s`
    /// of the nodes costs about the distances of a search over the matches alone, where
    /// [`Walk::All`] measures about `1 / s` nodes per accepted one; and the two-hop lists keep
    /// the matches connected when one hop would strand the search.
    Accepted { max_fresh: usize },
}

/// The unvisited accepted nodes among `neighbors` and, through each rejected one, among its
/// own neighbours, up to `max_fresh` of them (nearest lists first, as lists are kept nearest
/// first), marked visited. A rejected neighbour is marked visited once looked through.
fn accepted_neighbors(
    base: &CsrLayer,
    neighbors: &[u32],
    accept: &impl Fn(u32) -> bool,
    visited: &mut crate::visited::VisitedSet,
    max_fresh: usize,
    fresh: &mut Vec<u32>,
    density: &mut WalkDensity,
) {
    for &n in neighbors {
        if fresh.len() >= max_fresh {
            return;
        }
        let accepted = accept(n);
        density.count(accepted);
        if accepted && visited.insert(n) {
            fresh.push(n);
        }
    }
    for &n in neighbors {
        if accept(n) || !visited.insert(n) {
            continue;
        }
        for &m in base.neighbors(n) {
            if fresh.len() >= max_fresh {
                return;
            }
            let accepted = accept(m);
            density.count(accepted);
            if accepted && visited.insert(m) {
                fresh.push(m);
            }
        }
    }
}

/// How many of the first nodes a two-hop walk looked at were accepted: the density of matches
/// around the query, to set against the partition's (`filtered.rs` scans instead when it is
/// far lower: the walk is stranded among the few matches near the query).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct WalkDensity {
    pub(crate) looked: u64,
    pub(crate) accepted: u64,
}

/// How many looks [`WalkDensity`] counts: the first steps, around the entry (the graph's
/// nearest node to the query), before the walk can drift to where matches are dense.
const DENSITY_SAMPLE: u64 = 1024;

impl WalkDensity {
    #[inline]
    fn count(&mut self, accepted: bool) {
        if self.looked < DENSITY_SAMPLE {
            self.looked += 1;
            self.accepted += u64::from(accepted);
        }
    }

    /// Whether under `fraction` of what the walk looked at was accepted (false before it
    /// looked at anything).
    pub(crate) fn below(&self, fraction: f64) -> bool {
        self.looked > 0 && (self.accepted as f64) < fraction * self.looked as f64
    }
}

impl FlatGraph {
    pub(crate) fn n_nodes(&self) -> usize {
        self.layers.first().map_or(0, |l| l.offsets.len() - 1)
    }

    pub(crate) fn memory_bytes(&self) -> usize {
        self.layers.iter().map(CsrLayer::memory_bytes).sum()
    }

    /// Approximate k nearest accepted nodes. `distance(node)` measures a node against the
    /// query; `accept(node)` says which nodes may be results (live ones, matching a filter);
    /// `walk` says which nodes the layer-0 search goes through ([`Walk`]).
    // The search's inputs are all closures or counts of the same hot loop; a struct would only
    // rename them.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn search(
        &self,
        k: usize,
        ef: usize,
        distance: impl Fn(u32) -> f32,
        prefetch: impl Fn(u32),
        accept: impl Fn(u32) -> bool,
        walk: Walk,
        density: &mut WalkDensity,
    ) -> Vec<Candidate> {
        let n_nodes = self.n_nodes();
        if n_nodes == 0 || k == 0 {
            return Vec::new();
        }
        let ef = ef.max(k);
        // Greedy descent through the upper layers.
        let mut entry = Candidate {
            distance: distance(self.entry),
            node: self.entry,
        };
        for layer in self.layers[1..].iter().rev() {
            loop {
                let mut improved = false;
                for &neighbor in layer.neighbors(entry.node) {
                    let d = distance(neighbor);
                    if d < entry.distance {
                        entry = Candidate {
                            distance: d,
                            node: neighbor,
                        };
                        improved = true;
                    }
                }
                if !improved {
                    break;
                }
            }
        }
        // Beam search in layer 0.
        let base = &self.layers[0];
        let mut results = with_visited(n_nodes, |visited| {
            visited.insert(entry.node);
            let mut candidates: BinaryHeap<std::cmp::Reverse<Candidate>> =
                BinaryHeap::with_capacity(ef * 2);
            let mut results: BinaryHeap<Candidate> = BinaryHeap::with_capacity(ef + 1);
            let mut fresh: Vec<u32> = Vec::with_capacity(64);
            candidates.push(std::cmp::Reverse(entry));
            if accept(entry.node) {
                results.push(entry);
            }
            while let Some(std::cmp::Reverse(current)) = candidates.pop() {
                let bound = results.peek().map_or(f32::INFINITY, |c| c.distance);
                if current.distance > bound && results.len() >= ef {
                    break;
                }
                // Mark the unvisited neighbours first and start loading their vectors, so
                // that memory works while the distances are computed.
                fresh.clear();
                let neighbors = base.neighbors(current.node);
                match walk {
                    Walk::All => {
                        fresh.extend(neighbors.iter().copied().filter(|&n| visited.insert(n)))
                    }
                    Walk::Accepted { max_fresh } => accepted_neighbors(
                        base, neighbors, &accept, visited, max_fresh, &mut fresh, density,
                    ),
                }
                fresh.iter().take(PREFETCH_AHEAD).for_each(|&n| prefetch(n));
                for (i, &neighbor) in fresh.iter().enumerate() {
                    if let Some(&next) = fresh.get(i + PREFETCH_AHEAD) {
                        prefetch(next);
                    }
                    let d = distance(neighbor);
                    let bound = results.peek().map_or(f32::INFINITY, |c| c.distance);
                    if results.len() < ef || d < bound {
                        let candidate = Candidate {
                            distance: d,
                            node: neighbor,
                        };
                        candidates.push(std::cmp::Reverse(candidate));
                        if accept(neighbor) {
                            results.push(candidate);
                            if results.len() > ef {
                                results.pop();
                            }
                        }
                    }
                }
            }
            results.into_vec()
        });
        results.sort_unstable();
        results.truncate(k);
        results
    }

    /// Makes every node in `live` reachable from the entry point in layer 0. A graph built by
    /// parallel inserts (hnsw_rs's or tarn's builder) can leave a node that no other node points
    /// to; such a node is appended to the list of its first out-neighbour that is reachable (the
    /// nearest, as lists are kept nearest first), or of the entry point. One pass: the set of
    /// reached nodes only grows, so each orphan extends it by a walk from that orphan. Returns
    /// how many nodes were reconnected.
    pub(crate) fn connect_unreachable(
        lists: &mut [Vec<u32>],
        entry: u32,
        is_node: impl Fn(u32) -> bool,
    ) -> usize {
        let mut reached = vec![false; lists.len()];
        let mut stack = Vec::new();
        mark_reachable(lists, entry, &mut reached, &mut stack);
        let mut reconnected = 0;
        for orphan in 0..lists.len() as u32 {
            if reached[orphan as usize] || !is_node(orphan) {
                continue;
            }
            let parent = lists[orphan as usize]
                .iter()
                .copied()
                .find(|&p| reached[p as usize])
                .unwrap_or(entry);
            lists[parent as usize].push(orphan);
            reconnected += 1;
            mark_reachable(lists, orphan, &mut reached, &mut stack);
        }
        reconnected
    }

    pub(crate) fn write(&self, out: &mut ByteWriter) {
        out.u32(self.entry);
        out.u32(self.layers.len() as u32);
        for layer in &self.layers {
            out.u32(layer.neighbors.len() as u32);
            out.u32s(&layer.offsets);
            out.u32s(&layer.neighbors);
        }
    }

    pub(crate) fn read(input: &mut ByteReader<'_>, n_nodes: usize) -> Result<FlatGraph> {
        let entry = input.u32("graph entry")?;
        let n_layers = input.u32("graph layer count")? as usize;
        if n_layers == 0 || n_layers > 64 || entry as usize >= n_nodes {
            return Err(IndexError::Format(format!(
                "graph with {n_layers} layers and entry {entry} over {n_nodes} nodes"
            )));
        }
        let mut layers = Vec::with_capacity(n_layers);
        for _ in 0..n_layers {
            let n_edges = input.u32("graph edge count")? as usize;
            let offsets = input.u32s(n_nodes + 1, "graph offsets")?;
            let neighbors = input.u32s(n_edges, "graph neighbours")?;
            let offsets_ok = offsets.first() == Some(&0)
                && offsets.windows(2).all(|w| w[0] <= w[1])
                && offsets.last().copied() == Some(n_edges as u32);
            if !offsets_ok || neighbors.iter().any(|&n| n as usize >= n_nodes) {
                return Err(IndexError::Format(
                    "graph offsets or neighbours out of range".into(),
                ));
            }
            layers.push(CsrLayer { offsets, neighbors });
        }
        Ok(FlatGraph { entry, layers })
    }
}

/// Marks every node reachable from `start` following `lists` (not crossing marked nodes).
fn mark_reachable(lists: &[Vec<u32>], start: u32, reached: &mut [bool], stack: &mut Vec<u32>) {
    reached[start as usize] = true;
    stack.push(start);
    while let Some(node) = stack.pop() {
        for &next in &lists[node as usize] {
            if !reached[next as usize] {
                reached[next as usize] = true;
                stack.push(next);
            }
        }
    }
}

/// Nodes reachable from `entry` following `lists`.
#[cfg(test)]
pub(crate) fn reachable(lists: &[Vec<u32>], entry: u32) -> Vec<bool> {
    let mut reached = vec![false; lists.len()];
    mark_reachable(lists, entry, &mut reached, &mut Vec::new());
    reached
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A path 0 - 1 - 2 - ... - (n - 1), one layer, entered at 0.
    fn path(n: u32) -> FlatGraph {
        let lists: Vec<Vec<u32>> = (0..n)
            .map(|i| {
                let mut list = Vec::new();
                if i + 1 < n {
                    list.push(i + 1);
                }
                if i > 0 {
                    list.push(i - 1);
                }
                list
            })
            .collect();
        FlatGraph {
            entry: 0,
            layers: vec![CsrLayer::from_lists(&lists)],
        }
    }

    #[test]
    fn the_two_hop_walk_crosses_rejected_nodes_without_measuring_them() {
        // Only even nodes are accepted: in one hop they never touch, so a walk through
        // accepted nodes alone reaches them only by looking through the odd ones.
        let graph = path(200);
        let target = 150.0_f32;
        let accept = |node: u32| node.is_multiple_of(2);
        for walk in [Walk::All, Walk::Accepted { max_fresh: 32 }] {
            let measured = std::cell::RefCell::new(Vec::new());
            let distance = |node: u32| {
                measured.borrow_mut().push(node);
                (node as f32 - target).abs()
            };
            let mut density = WalkDensity::default();
            let found = graph.search(3, 300, distance, |_| {}, accept, walk, &mut density);
            let nodes: Vec<u32> = found.iter().map(|c| c.node).collect();
            assert_eq!(nodes, vec![150, 148, 152], "{walk:?}");
            let rejected_measured = measured
                .borrow()
                .iter()
                .filter(|&&node| !accept(node))
                .count();
            match walk {
                // Every node on the way is measured.
                Walk::All => assert!(rejected_measured > 50, "{rejected_measured}"),
                // None: the entry (0) is accepted, and rejected nodes are only looked through;
                // half of what it looked at was accepted.
                Walk::Accepted { .. } => {
                    assert_eq!(rejected_measured, 0);
                    assert!(density.looked > 0);
                    assert!(!density.below(0.4) && density.below(0.6), "{density:?}");
                }
            }
        }
    }

    #[test]
    fn the_two_hop_walk_takes_at_most_max_fresh_nodes_per_step_and_never_repeats_one() {
        // A star: 0 points to 1..=40 (all rejected), each of which points to 100 + itself
        // (accepted) and back to 0.
        let mut lists = vec![Vec::new(); 141];
        lists[0] = (1..=40).collect();
        for i in 1..=40u32 {
            lists[i as usize] = vec![100 + i, 0];
        }
        let graph = FlatGraph {
            entry: 0,
            layers: vec![CsrLayer::from_lists(&lists)],
        };
        let accept = |node: u32| node > 100;
        let measured = std::cell::RefCell::new(Vec::new());
        let distance = |node: u32| {
            measured.borrow_mut().push(node);
            node as f32
        };
        let found = graph.search(
            10,
            10,
            distance,
            |_| {},
            accept,
            Walk::Accepted { max_fresh: 8 },
            &mut WalkDensity::default(),
        );
        // The entry's step took 8 of the 40 accepted nodes two hops away and the accepted
        // nodes lead nowhere: the answer is short (the caller's plan then scans the matches).
        assert_eq!(found.len(), 8);
        assert!(found.iter().all(|c| accept(c.node)));
        let measured = measured.into_inner();
        let mut unique = measured.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), measured.len(), "a node measured twice");
        assert_eq!(measured.iter().filter(|&&n| accept(n)).count(), 8);
    }

    #[test]
    fn orphans_are_reconnected() {
        // 0 -> 1, 2 -> 1 (2 has no incoming edge), 3 isolated.
        let mut lists = vec![vec![1], vec![], vec![1], vec![]];
        let n = FlatGraph::connect_unreachable(&mut lists, 0, |_| true);
        assert_eq!(n, 2);
        assert!(lists[1].contains(&2));
        assert!(lists[0].contains(&3));
        assert!(reachable(&lists, 0).iter().all(|&r| r));
    }

    #[test]
    fn serialisation_round_trip_and_rejects_bad_offsets() {
        let graph = FlatGraph {
            entry: 1,
            layers: vec![
                CsrLayer::from_lists(&[vec![1, 2], vec![0], vec![0, 1]]),
                CsrLayer::from_lists(&[vec![], vec![2], vec![1]]),
            ],
        };
        let mut out = ByteWriter::default();
        graph.write(&mut out);
        let back = FlatGraph::read(&mut ByteReader::new(&out.bytes), 3).unwrap();
        assert_eq!(back, graph);
        assert!(FlatGraph::read(&mut ByteReader::new(&out.bytes), 2).is_err());
        assert!(FlatGraph::read(&mut ByteReader::new(&out.bytes[..20]), 3).is_err());
    }
}
