//! tarn's own parallel HNSW builder: builds the graph of a sealed partition straight from its
//! flat vectors (row `i` at `vectors[i * dim..(i + 1) * dim]`), with tarn's distance kernels,
//! into the layout the sealed format stores (`FlatGraph`). No hnsw_rs involved.
//!
//! The algorithm is hnswlib's: every node's level is drawn up front from a seeded generator
//! (`floor(-ln(u) / ln(M))`); a node is inserted by a greedy descent from the entry point to one
//! layer above its level, then, on each of its layers, a beam search of width `ef_construction`,
//! the heuristic neighbour selection (keep a candidate only if it is closer to the new node than
//! to every neighbour kept so far) of `M` neighbours, and links back from each of them (a list
//! that would exceed `2M` on layer 0 or `M` above is pruned with the same heuristic).
//!
//! Concurrency: `threads` workers take node numbers from one atomic counter. Neighbour lists
//! live in flat arrays of `AtomicU32` (a count, then the neighbours), one fixed-size block per
//! node and layer; a writer holds the node's own lock (one `parking_lot::Mutex<()>` per node),
//! and readers copy a list with relaxed loads and no lock. A list read while it is rewritten may
//! mix old and new neighbours, which is harmless for a search (every value ever stored is a valid
//! node number). Every write is a read-modify-write under the lock, so no link is ever lost. The
//! entry point and top level sit behind one mutex, held for a whole insertion only by a node that
//! raises the top level (as in hnswlib; a handful of times per build).
//!
//! A node found in a layer's lists may still be inserting itself below that layer (its lower
//! lists still empty). Starting the next layer's search from it would find nothing but itself, so
//! the descent moves only through nodes whose insertion is complete (`inserted`), and each
//! layer's search hands the next one the nearest complete node it found. (hnswlib gets the same
//! effect by making readers wait on the inserting node's lock.)
//! Each worker owns its scratch space (visited marks, heaps, buffers), reused from one insertion
//! to the next, so the inner loop does not allocate.
//!
//! Which edges a parallel build makes depends on thread timing, not its quality: recall stays
//! within a narrow band from run to run. Layer 0 of the result is made fully reachable from the
//! entry point (`FlatGraph::connect_unreachable`) before it is returned.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};

use parking_lot::Mutex;

use crate::config::HnswParams;
use crate::flat_graph::{Candidate, CsrLayer, FlatGraph};
use crate::metric::Metric;
use crate::simd::prefetch;
use crate::visited::VisitedSet;

/// The highest level a node can get (the sealed format allows 64 layers; HNSW over 2^32 nodes
/// with M >= 2 needs far fewer than 16 in all but astronomically unlikely draws).
const MAX_LEVEL: usize = 15;

/// Cache lines of a vector prefetched before its distance is computed: all of it, up to 2 KiB
/// (8 lines measured the same on minilm-debian, within this machine's noise).
const PREFETCH_LINES: usize = 32;

/// How the builder runs (the graph's shape comes from `HnswParams`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BuildConfig {
    /// Worker threads inserting at once (0 is taken as 1).
    pub threads: usize,
    /// Seed of the level assignment: the same seed gives every node the same level.
    pub seed: u64,
}

impl Default for BuildConfig {
    fn default() -> Self {
        BuildConfig {
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            seed: 0x7461_726e_6873_7721,
        }
    }
}

/// Builds an HNSW graph over the `vectors.len() / dim` rows of `vectors` (already prepared for
/// `metric`: unit length under cosine). Returns `None` when there are no rows.
pub(crate) fn build_graph(
    vectors: &[f32],
    dim: usize,
    metric: Metric,
    params: &HnswParams,
    config: &BuildConfig,
) -> Option<FlatGraph> {
    assert!(dim > 0, "dimension 0");
    let n_nodes = vectors.len() / dim;
    if n_nodes == 0 {
        return None;
    }
    assert!(
        u32::try_from(n_nodes).is_ok(),
        "{n_nodes} nodes do not fit u32 slots"
    );
    let m = params.m.max(2);
    let levels = assign_levels(n_nodes, m, config.seed);
    let links = Links::new(&levels, m);
    let shared = Shared {
        vectors: &vectors[..n_nodes * dim],
        dim,
        metric,
        m,
        ef_construction: params.ef_construction.max(m),
        levels: &levels,
        links,
        top: Mutex::new(TopOfGraph {
            entry: 0,
            max_level: levels[0] as usize,
        }),
        next_node: AtomicUsize::new(1),
        inserted: (0..n_nodes).map(|i| AtomicBool::new(i == 0)).collect(),
    };
    let threads = config.threads.clamp(1, n_nodes);
    if threads == 1 {
        shared.work();
    } else {
        std::thread::scope(|scope| {
            for _ in 1..threads {
                scope.spawn(|| shared.work());
            }
            shared.work();
        });
    }
    Some(shared.into_flat_graph())
}

/// Levels drawn from SplitMix64 (no dependency, and stable across library versions).
fn assign_levels(n_nodes: usize, m: usize, seed: u64) -> Vec<u8> {
    let mult = 1.0 / (m as f64).ln();
    let mut state = seed;
    (0..n_nodes)
        .map(|_| {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            // Uniform in (0, 1]: never 0, whose logarithm is infinite.
            let u = ((z >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
            ((-u.ln() * mult) as usize).min(MAX_LEVEL) as u8
        })
        .collect()
}

/// Every node's neighbour lists, written under the node's lock and read without it.
struct Links {
    /// Layer 0: node `i`'s block is `base[i * base_stride..(i + 1) * base_stride]`.
    base: Vec<AtomicU32>,
    base_stride: usize,
    /// Layers 1..=level of node `i`: consecutive blocks of `upper_stride` from `upper_start[i]`.
    upper: Vec<AtomicU32>,
    upper_start: Vec<usize>,
    upper_stride: usize,
    locks: Vec<Mutex<()>>,
}

impl Links {
    /// Blocks of `1 + 2M` words on layer 0 and `1 + M` above (a count, then the neighbours).
    fn new(levels: &[u8], m: usize) -> Self {
        let base_stride = 1 + 2 * m;
        let upper_stride = 1 + m;
        let mut upper_start = Vec::with_capacity(levels.len());
        let mut n_upper = 0;
        for &level in levels {
            upper_start.push(n_upper);
            n_upper += level as usize * upper_stride;
        }
        Links {
            base: (0..levels.len() * base_stride)
                .map(|_| AtomicU32::new(0))
                .collect(),
            base_stride,
            upper: (0..n_upper).map(|_| AtomicU32::new(0)).collect(),
            upper_start,
            upper_stride,
            locks: (0..levels.len()).map(|_| Mutex::new(())).collect(),
        }
    }

    #[inline]
    fn block(&self, node: u32, layer: usize) -> &[AtomicU32] {
        if layer == 0 {
            let start = node as usize * self.base_stride;
            &self.base[start..start + self.base_stride]
        } else {
            let start = self.upper_start[node as usize] + (layer - 1) * self.upper_stride;
            &self.upper[start..start + self.upper_stride]
        }
    }

    /// Starts loading `node`'s list on `layer` into the cache.
    #[inline]
    fn prefetch(&self, node: u32, layer: usize) {
        let block = self.block(node, layer);
        prefetch(block, usize::MAX);
    }

    /// Copies `node`'s neighbours on `layer` into `out`.
    #[inline]
    fn read(&self, node: u32, layer: usize, out: &mut Vec<u32>) {
        let block = self.block(node, layer);
        let count = (block[0].load(Ordering::Relaxed) as usize).min(block.len() - 1);
        out.clear();
        out.extend(block[1..=count].iter().map(|w| w.load(Ordering::Relaxed)));
    }

    /// Replaces `node`'s neighbours on `layer`; the caller holds `node`'s lock.
    fn write(&self, node: u32, layer: usize, neighbours: impl ExactSizeIterator<Item = u32>) {
        let block = self.block(node, layer);
        let count = neighbours.len().min(block.len() - 1);
        for (word, neighbour) in block[1..].iter().zip(neighbours) {
            word.store(neighbour, Ordering::Relaxed);
        }
        block[0].store(count as u32, Ordering::Relaxed);
    }
}

#[derive(Debug, Clone, Copy)]
struct TopOfGraph {
    entry: u32,
    max_level: usize,
}

/// What every worker reads (and, through the locks, writes).
struct Shared<'a> {
    vectors: &'a [f32],
    dim: usize,
    metric: Metric,
    m: usize,
    ef_construction: usize,
    levels: &'a [u8],
    links: Links,
    top: Mutex<TopOfGraph>,
    /// The next node to insert (node 0 is the initial entry point, inserted by construction).
    next_node: AtomicUsize,
    /// Set once a node's insertion is complete (all its lists written).
    inserted: Vec<AtomicBool>,
}

/// One worker's reusable buffers.
#[derive(Default)]
struct Scratch {
    visited: VisitedSet,
    /// Nodes still to expand, nearest first.
    frontier: BinaryHeap<Reverse<Candidate>>,
    /// The best `ef` found so far, farthest on top.
    found: BinaryHeap<Candidate>,
    neighbours: Vec<u32>,
    fresh: Vec<u32>,
    sorted: Vec<Candidate>,
    /// The new node's neighbours on the layer being linked.
    selected: Vec<Candidate>,
    /// A neighbour's list after pruning.
    pruned: Vec<Candidate>,
}

impl Shared<'_> {
    #[inline]
    fn vector(&self, node: u32) -> &[f32] {
        let start = node as usize * self.dim;
        &self.vectors[start..start + self.dim]
    }

    #[inline]
    fn distance(&self, query: &[f32], node: u32) -> f32 {
        self.metric.distance(query, self.vector(node))
    }

    fn work(&self) {
        let mut scratch = Scratch::default();
        let n_nodes = self.levels.len();
        loop {
            let node = self.next_node.fetch_add(1, Ordering::Relaxed);
            if node >= n_nodes {
                return;
            }
            self.insert(node as u32, &mut scratch);
        }
    }

    fn insert(&self, node: u32, scratch: &mut Scratch) {
        let level = self.levels[node as usize] as usize;
        let top_guard = self.top.lock();
        let top = *top_guard;
        // A node that raises the top level keeps the lock until it is the entry point, so that
        // no other insertion starts from an entry point whose upper layers are still empty.
        let raising = (level > top.max_level).then_some(top_guard);
        let query = self.vector(node);
        let mut nearest = Candidate {
            distance: self.distance(query, top.entry),
            node: top.entry,
        };
        for layer in (level + 1..=top.max_level).rev() {
            nearest = self.greedy(query, nearest, layer, &mut scratch.neighbours);
        }
        for layer in (0..=level.min(top.max_level)).rev() {
            self.search_layer(query, nearest, layer, self.ef_construction, scratch);
            scratch.sorted.clear();
            scratch
                .sorted
                .extend(scratch.found.drain().filter(|c| c.node != node));
            scratch.sorted.sort_unstable();
            // The next layer starts from the nearest complete node (`nearest` itself is one).
            if let Some(&closest) = scratch.sorted.iter().find(|c| self.is_inserted(c.node)) {
                nearest = closest;
            }
            self.select_neighbours(self.m, &scratch.sorted, &mut scratch.selected);
            self.link_own(node, layer, scratch);
            let selected = std::mem::take(&mut scratch.selected);
            for &neighbour in &selected {
                self.link_back(neighbour, node, layer, scratch);
            }
            scratch.selected = selected;
        }
        self.inserted[node as usize].store(true, Ordering::Release);
        if let Some(mut top) = raising {
            *top = TopOfGraph {
                entry: node,
                max_level: level,
            };
        }
    }

    #[inline]
    fn is_inserted(&self, node: u32) -> bool {
        self.inserted[node as usize].load(Ordering::Acquire)
    }

    /// Writes the new node's list on `layer` (`scratch.selected`). Its list is normally still
    /// empty there; should another insertion have linked to it already, both are kept (pruned
    /// by the heuristic if they exceed the bound).
    fn link_own(&self, node: u32, layer: usize, scratch: &mut Scratch) {
        let _own = self.links.locks[node as usize].lock();
        self.links.read(node, layer, &mut scratch.neighbours);
        scratch
            .neighbours
            .retain(|n| !scratch.selected.iter().any(|c| c.node == *n));
        if scratch.neighbours.is_empty() {
            self.links
                .write(node, layer, scratch.selected.iter().map(|c| c.node));
            return;
        }
        let max = if layer == 0 { 2 * self.m } else { self.m };
        let base = self.vector(node);
        scratch.sorted.clear();
        scratch.sorted.extend_from_slice(&scratch.selected);
        scratch
            .sorted
            .extend(scratch.neighbours.iter().map(|&n| Candidate {
                distance: self.distance(base, n),
                node: n,
            }));
        scratch.sorted.sort_unstable();
        self.select_neighbours(max, &scratch.sorted, &mut scratch.pruned);
        self.links
            .write(node, layer, scratch.pruned.iter().map(|c| c.node));
    }

    /// Greedy walk on `layer` towards `query` from `start`, through complete nodes only: the
    /// local minimum.
    fn greedy(
        &self,
        query: &[f32],
        start: Candidate,
        layer: usize,
        neighbours: &mut Vec<u32>,
    ) -> Candidate {
        let mut nearest = start;
        loop {
            let mut improved = false;
            self.links.read(nearest.node, layer, neighbours);
            for &neighbour in neighbours.iter() {
                if !self.is_inserted(neighbour) {
                    continue;
                }
                let distance = self.distance(query, neighbour);
                if distance < nearest.distance {
                    nearest = Candidate {
                        distance,
                        node: neighbour,
                    };
                    improved = true;
                }
            }
            if !improved {
                return nearest;
            }
        }
    }

    /// Beam search of width `ef` on `layer` from `entry`; leaves the result in `scratch.found`.
    fn search_layer(
        &self,
        query: &[f32],
        entry: Candidate,
        layer: usize,
        ef: usize,
        scratch: &mut Scratch,
    ) {
        let Scratch {
            visited,
            frontier,
            found,
            neighbours,
            fresh,
            ..
        } = scratch;
        visited.reset(self.levels.len());
        visited.insert(entry.node);
        frontier.clear();
        found.clear();
        frontier.push(Reverse(entry));
        found.push(entry);
        while let Some(Reverse(current)) = frontier.pop() {
            let bound = found.peek().map_or(f32::INFINITY, |c| c.distance);
            if current.distance > bound && found.len() >= ef {
                break;
            }
            // The node expanded next is most often the nearest left in the frontier.
            if let Some(Reverse(next)) = frontier.peek() {
                self.links.prefetch(next.node, layer);
            }
            self.links.read(current.node, layer, neighbours);
            fresh.clear();
            fresh.extend(neighbours.iter().copied().filter(|&n| visited.insert(n)));
            if let Some(&first) = fresh.first() {
                prefetch(self.vector(first), PREFETCH_LINES);
            }
            for (i, &neighbour) in fresh.iter().enumerate() {
                if let Some(&next) = fresh.get(i + 1) {
                    prefetch(self.vector(next), PREFETCH_LINES);
                }
                let distance = self.distance(query, neighbour);
                let bound = found.peek().map_or(f32::INFINITY, |c| c.distance);
                if found.len() < ef || distance < bound {
                    let candidate = Candidate {
                        distance,
                        node: neighbour,
                    };
                    frontier.push(Reverse(candidate));
                    found.push(candidate);
                    if found.len() > ef {
                        found.pop();
                    }
                }
            }
        }
    }

    /// hnswlib's heuristic: from `sorted` (nearest first), keep a candidate only if it is closer
    /// to the base node than to every candidate kept before it, until `max` are kept.
    fn select_neighbours(&self, max: usize, sorted: &[Candidate], selected: &mut Vec<Candidate>) {
        selected.clear();
        if sorted.len() <= max {
            selected.extend_from_slice(sorted);
            return;
        }
        for (i, candidate) in sorted.iter().enumerate() {
            if selected.len() >= max {
                break;
            }
            if let Some(next) = sorted.get(i + 1) {
                prefetch(self.vector(next.node), PREFETCH_LINES);
            }
            let vector = self.vector(candidate.node);
            let diverse = selected
                .iter()
                .all(|kept| self.distance(vector, kept.node) >= candidate.distance);
            if diverse {
                selected.push(*candidate);
            }
        }
    }

    /// Adds `new_node` to `neighbour`'s list on `layer`, pruning a full list by the heuristic.
    fn link_back(&self, neighbour: Candidate, new_node: u32, layer: usize, scratch: &mut Scratch) {
        let max = if layer == 0 { 2 * self.m } else { self.m };
        let _lock = self.links.locks[neighbour.node as usize].lock();
        self.links
            .read(neighbour.node, layer, &mut scratch.neighbours);
        if scratch.neighbours.contains(&new_node) {
            return;
        }
        if scratch.neighbours.len() < max {
            scratch.neighbours.push(new_node);
            self.links
                .write(neighbour.node, layer, scratch.neighbours.iter().copied());
            return;
        }
        let base = self.vector(neighbour.node);
        scratch.sorted.clear();
        scratch
            .sorted
            .extend(scratch.neighbours.iter().map(|&n| Candidate {
                distance: self.distance(base, n),
                node: n,
            }));
        scratch.sorted.push(Candidate {
            distance: neighbour.distance,
            node: new_node,
        });
        scratch.sorted.sort_unstable();
        self.select_neighbours(max, &scratch.sorted, &mut scratch.pruned);
        self.links
            .write(neighbour.node, layer, scratch.pruned.iter().map(|c| c.node));
    }

    fn into_flat_graph(self) -> FlatGraph {
        let top = *self.top.lock();
        let n_nodes = self.levels.len();
        let mut buffer = Vec::new();
        let mut layers = Vec::with_capacity(top.max_level + 1);
        for layer in 0..=top.max_level {
            let mut lists = vec![Vec::new(); n_nodes];
            for (node, list) in lists.iter_mut().enumerate() {
                if self.levels[node] as usize >= layer {
                    self.links.read(node as u32, layer, &mut buffer);
                    list.extend_from_slice(&buffer);
                }
            }
            if layer == 0 {
                let reconnected = FlatGraph::connect_unreachable(&mut lists, top.entry, |_| true);
                if reconnected > 0 {
                    tracing::debug!(reconnected, "builder: reconnected unreachable nodes");
                }
            }
            layers.push(CsrLayer::from_lists(&lists));
        }
        FlatGraph {
            entry: top.entry,
            layers,
        }
    }
}

#[cfg(test)]
mod tests {
    use rand::{Rng, SeedableRng};

    use super::*;
    use crate::flat_graph::reachable;

    fn random_vectors(n: usize, dim: usize, seed: u64) -> Vec<f32> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        (0..n * dim).map(|_| rng.random_range(-1.0..1.0)).collect()
    }

    fn lists(graph: &FlatGraph, layer: usize) -> Vec<Vec<u32>> {
        (0..graph.n_nodes() as u32)
            .map(|n| graph.layers[layer].neighbors(n).to_vec())
            .collect()
    }

    #[test]
    fn levels_are_seeded_and_geometric() {
        let levels = assign_levels(100_000, 16, 7);
        assert_eq!(levels, assign_levels(100_000, 16, 7));
        assert_ne!(levels, assign_levels(100_000, 16, 8));
        // P(level >= 1) = 1/M, P(level >= 2) = 1/M^2.
        let above = |l: u8| levels.iter().filter(|&&x| x >= l).count() as f64 / 1e5;
        assert!((above(1) - 1.0 / 16.0).abs() < 0.005, "{}", above(1));
        assert!((above(2) - 1.0 / 256.0).abs() < 0.001, "{}", above(2));
        assert!(levels.iter().all(|&l| l as usize <= MAX_LEVEL));
    }

    #[test]
    fn graphs_keep_the_degree_bounds_and_every_node_is_reachable() {
        let dim = 16;
        let params = HnswParams {
            m: 8,
            ef_construction: 64,
            ef_search: 64,
        };
        for (n, threads) in [(1, 1), (2, 2), (3, 4), (40, 3), (3000, 1), (3000, 4)] {
            let vectors = random_vectors(n, dim, n as u64);
            let config = BuildConfig { threads, seed: 3 };
            let graph = build_graph(&vectors, dim, Metric::L2, &params, &config).unwrap();
            let levels = assign_levels(n, params.m, config.seed);
            assert_eq!(graph.n_nodes(), n);
            assert_eq!(
                graph.layers.len(),
                *levels.iter().max().unwrap() as usize + 1
            );
            assert_eq!(
                levels[graph.entry as usize] as usize,
                graph.layers.len() - 1
            );
            let mut excess = 0;
            for (layer, csr) in graph.layers.iter().enumerate() {
                let max = if layer == 0 { 2 * params.m } else { params.m };
                for node in 0..n as u32 {
                    let neighbours = csr.neighbors(node);
                    if (levels[node as usize] as usize) < layer {
                        assert!(neighbours.is_empty(), "node {node} above its level");
                        continue;
                    }
                    // Reconnection may append orphans beyond the bound, on layer 0 only.
                    if layer == 0 {
                        excess += neighbours.len().saturating_sub(max);
                    } else {
                        assert!(neighbours.len() <= max);
                    }
                    let mut unique = neighbours.to_vec();
                    unique.sort_unstable();
                    unique.dedup();
                    assert_eq!(unique.len(), neighbours.len(), "duplicate neighbour");
                    for &other in neighbours {
                        assert_ne!(other, node, "self loop");
                        assert!(levels[other as usize] as usize >= layer);
                    }
                }
            }
            assert!(excess <= n / 100, "n={n}: {excess} links beyond 2M");
            let reached = reachable(&lists(&graph, 0), graph.entry);
            assert!(reached.iter().all(|&r| r), "n={n}: a node is unreachable");
            if n > 1 {
                // Every node links to somebody.
                assert!((0..n as u32).all(|node| !graph.layers[0].neighbors(node).is_empty()));
            }
        }
        assert!(build_graph(&[], dim, Metric::L2, &params, &BuildConfig::default()).is_none());
    }

    #[test]
    fn one_thread_builds_the_same_graph_every_time() {
        let vectors = random_vectors(1500, 8, 11);
        let params = HnswParams::default();
        let config = BuildConfig {
            threads: 1,
            seed: 5,
        };
        let first = build_graph(&vectors, 8, Metric::Cosine, &params, &config);
        let second = build_graph(&vectors, 8, Metric::Cosine, &params, &config);
        assert_eq!(first, second);
        let other_seed = build_graph(
            &vectors,
            8,
            Metric::Cosine,
            &params,
            &BuildConfig { seed: 6, ..config },
        );
        assert_ne!(first, other_seed);
    }

    #[test]
    fn the_heuristic_keeps_diverse_neighbours() {
        // On a line: 0 at 0.0; candidates 1 (1.0), 2 (1.1), 3 (-1.2). 2 is closer to 1 than to
        // 0, so it is dropped; 3 lies the other way and is kept.
        let vectors = [0.0f32, 1.0, 1.1, -1.2];
        let levels = [0u8; 4];
        let shared = Shared {
            vectors: &vectors,
            dim: 1,
            metric: Metric::L2,
            m: 2,
            ef_construction: 8,
            levels: &levels,
            links: Links::new(&levels, 2),
            top: Mutex::new(TopOfGraph {
                entry: 0,
                max_level: 0,
            }),
            next_node: AtomicUsize::new(1),
            inserted: (0..4).map(|i| AtomicBool::new(i == 0)).collect(),
        };
        let sorted: Vec<Candidate> = [(1.0f32, 1u32), (1.21, 2), (1.44, 3)]
            .iter()
            .map(|&(distance, node)| Candidate { distance, node })
            .collect();
        let mut selected = Vec::new();
        shared.select_neighbours(2, &sorted, &mut selected);
        assert_eq!(selected.iter().map(|c| c.node).collect::<Vec<_>>(), [1, 3]);
        // Room for all: no pruning.
        shared.select_neighbours(3, &sorted, &mut selected);
        assert_eq!(selected.len(), 3);
    }
}
