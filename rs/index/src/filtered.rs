//! Filtered search's strategy, shared by both segment kinds. Per tenant partition the exact set
//! of matching live slots is known before any vector is read (`AttributeIndex::matching` minus
//! the tombstones), so the choice between an exact scan of the matches and a graph search is
//! made on an exact count, and the answer is never short: a search returns
//! `min(k, matching live documents)` hits, whichever way it went.
//!
//! One function ([`plan`]) makes the choice between three paths, each best somewhere on
//! minilm-debian (60,733 x 384; docs/BENCHMARKS.md, "Filtered search", the crossover table):
//! - few matches: the exact scan of the matches (recall 1.0; at 5% of that collection, 3,000
//!   matches, it ran at 4,405 q/s against 3,233 for the two-hop walk at recall 0.96);
//! - a fraction `s` between 10% and 30%: the graph walked through accepted nodes only
//!   ([`Walk::Accepted`], ACORN's two-hop expansion), whose cost hardly depends on `s` (20%:
//!   2,299 q/s at recall 0.989 against 474 for walking every node and 470 for the scan);
//! - `s` of 30% and more: the graph walked through every node ([`Walk::All`]) with the beam
//!   widened by `1 / sqrt(s)` (50%: 2,041 q/s at recall 0.9924 against 1,443 at 0.9920 for the
//!   two-hop walk; widening by `1 / s` instead over-recalls: 980 q/s at 0.9988).
//!
//! Several entry points for the two-hop walk (16 or 64 matches spread over the slot order, on
//! top of the descent's entry) were measured and did not help (recall at 1%: 0.8918 with 16
//! against 0.9248 without, same ef): the walk's recall falls below about 3% selectivity
//! whatever its entry, and there the scan is both exact and faster.

use crate::attribute_index::SlotSet;
use crate::flat_graph::{Candidate, Walk, WalkDensity};
use crate::search::exact_top_k;

/// A partition whose filter matches at most this many live documents is always searched by an
/// exact scan of its matches (recall 1.0): below it no graph path costs less (the two-hop
/// walk's cost at the smallest beam, [`ACCEPTED_WALK_COST_PER_EF`] x 32, is about this).
pub const FILTER_EXACT_SCAN_MAX_MATCHES: usize = 2048;

/// The widest beam a filtered graph search is given (the widened `ef` is capped here, or at
/// the request's own `ef` if that is larger).
const FILTERED_MAX_EF: usize = 4096;

/// Below this fraction of matching documents the two-hop walk is not trusted and the exact scan
/// answers. Measured on the 1,000,000-vector Zipf set (`scripts/filtered-scale.sh`, 2026-11-26):
/// at 5% the walk kept recall 0.978-0.985 on a tag independent of the clusters but fell to
/// 0.75 on a tag of 49 of the 300 clusters asked from the others, and the density check below
/// did not catch it (the first looks around the query found matches at 1-4x the partition's
/// rate); walking every node instead ran at 16-35 q/s against the scan's 200. On minilm the walk
/// held 0.973-0.99 from 11% to 30% (correlated tags included).
const ACCEPTED_WALK_MIN_SELECTIVITY: f64 = 0.1;

/// At or above this fraction of matching documents the graph is walked through every node
/// ([`Walk::All`]); below it, through accepted nodes only ([`Walk::Accepted`]). Measured: the
/// two paths tie at 30% (size_30pct: 1,596 q/s at recall 0.9978 walking every node at ef 32,
/// 1,711 at 0.9956 for the two-hop walk at ef 64), walking every node wins at 50% and the
/// two-hop walk below 30%.
const WALK_ALL_MIN_SELECTIVITY: f64 = 0.3;

/// How many new accepted nodes one step of the two-hop walk takes at most: the base layer's
/// list length (2 M for M = 16). Measured: 16 loses recall (size_10pct 0.9710 against 0.9860
/// at ef 64), 64 costs 10-30% more time for little recall.
const ACCEPTED_MAX_FRESH: usize = 32;

/// The two-hop walk's cost per unit of beam, in exact-scan distances: its time at ef 64 against
/// the scan's on the same filters was that of scanning 2,500 (20%), 3,200 (10%), 4,100 (5%) and
/// 4,500 (3%) matches, i.e. 40-70 per unit of ef; the high end is taken, so the scan keeps
/// the ties (it is exact).
const ACCEPTED_WALK_COST_PER_EF: f64 = 64.0;

/// A two-hop walk whose first looks (around the query) found matches at under this fraction
/// of the partition's selectivity is stranded where they are rare: its answer is replaced by
/// the exact scan. A safety net, not a cure: on the 100,000-vector Zipf set at ef 16 it caught
/// 23 of 350 walks of a cluster-correlated 5% filter (`scripts/filtered-scale.sh`); most
/// walks that lost recall there had found matches at 1-4x the partition's rate, which is why
/// the walk is not used under [`ACCEPTED_WALK_MIN_SELECTIVITY`].
const SPARSE_WALK_FRACTION: f64 = 0.25;

/// How one partition's filtered search runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FilteredPlan {
    /// Exact scan of the matching live slots.
    ExactScan,
    /// Graph search accepting only matching live slots, with this beam width; falls back to
    /// the exact scan if it comes back with fewer than `min(k, matches)` hits.
    Graph { ef: usize, walk: Walk },
}

/// Chooses how to search one partition whose filter matches `n_matches` of its `n_live` live
/// documents (the fraction `s`):
/// - the exact scan when the request asks for it, the partition has no graph, or the matches
///   are at most [`FILTER_EXACT_SCAN_MAX_MATCHES`];
/// - for `s` of at least [`WALK_ALL_MIN_SELECTIVITY`], the graph walked through every node with
///   the beam widened to `ef / sqrt(s)` (capped at 4,096 or the request's `ef`), unless its
///   expected visits (`beam / s`) exceed the matches, when the scan is cheaper;
/// - from [`ACCEPTED_WALK_MIN_SELECTIVITY`] (10%) to 30%, the two-hop walk with the beam widened
///   to `ef * sqrt(0.3 / s)` (its recall falls with `s`: 0.9728 at 11% and 0.9480 at 3% at a
///   plain ef 64 on minilm), unless its cost ([`ACCEPTED_WALK_COST_PER_EF`] x beam) reaches the
///   matches', when the scan is chosen;
/// - under 10%, the exact scan.
pub(crate) fn plan(
    n_matches: usize,
    n_live: usize,
    k: usize,
    ef: usize,
    has_graph: bool,
    exact: bool,
) -> FilteredPlan {
    if exact || !has_graph || n_matches <= FILTER_EXACT_SCAN_MAX_MATCHES {
        return FilteredPlan::ExactScan;
    }
    let selectivity = (n_matches as f64 / n_live.max(n_matches).max(1) as f64).max(1e-9);
    let ef = ef.max(k);
    let widen = |factor: f64| {
        ((ef as f64 * factor).ceil() as usize)
            .min(FILTERED_MAX_EF.max(ef))
            .max(ef)
    };
    if selectivity >= WALK_ALL_MIN_SELECTIVITY {
        let beam = widen(1.0 / selectivity.sqrt());
        if beam as f64 / selectivity >= n_matches as f64 {
            return FilteredPlan::ExactScan;
        }
        return FilteredPlan::Graph {
            ef: beam,
            walk: Walk::All,
        };
    }
    if selectivity < ACCEPTED_WALK_MIN_SELECTIVITY {
        return FilteredPlan::ExactScan;
    }
    let beam = widen((WALK_ALL_MIN_SELECTIVITY / selectivity).sqrt());
    if ACCEPTED_WALK_COST_PER_EF * beam as f64 >= n_matches as f64 {
        return FilteredPlan::ExactScan;
    }
    FilteredPlan::Graph {
        ef: beam,
        walk: Walk::Accepted {
            max_fresh: ACCEPTED_MAX_FRESH,
        },
    }
}

/// Runs a partition's filtered search: `matches` are its matching live slots (`n_matches` of
/// its `n_live`); `graph_search(ef, walk, density)` is the graph search that accepts only those
/// slots (called for [`FilteredPlan::Graph`] only; a two-hop walk counts what it looked at in
/// `density`), `distance` measures a slot against the query. Returns at most `k` candidates,
/// nearest first, and always `min(k, n_matches)`: a graph answer that is short, or a two-hop
/// walk that found matches much rarer around the query than in the partition
/// ([`SPARSE_WALK_FRACTION`]), gives way to the exact scan.
pub(crate) fn filtered_top_k(
    matches: &SlotSet,
    n_matches: usize,
    n_live: usize,
    k: usize,
    plan: FilteredPlan,
    graph_search: impl FnOnce(usize, Walk, &mut WalkDensity) -> Vec<Candidate>,
    distance: impl Fn(u32) -> f32,
) -> Vec<Candidate> {
    if n_matches == 0 || k == 0 {
        return Vec::new();
    }
    if let FilteredPlan::Graph { ef, walk } = plan {
        let mut density = WalkDensity::default();
        let candidates = graph_search(ef, walk, &mut density);
        let selectivity = n_matches as f64 / n_live.max(n_matches) as f64;
        let stranded = density.below(SPARSE_WALK_FRACTION * selectivity);
        if candidates.len() >= k.min(n_matches) && !stranded {
            return candidates;
        }
        tracing::debug!(
            found = candidates.len(),
            n_matches,
            k,
            ?density,
            "filtered graph search came back short or stranded; scanning the matches"
        );
    }
    exact_top_k(matches.iter(), k, distance)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_scans_few_matches_exact_requests_and_graphless_partitions() {
        assert_eq!(
            plan(10, 1_000_000, 10, 64, true, false),
            FilteredPlan::ExactScan
        );
        assert_eq!(
            plan(
                FILTER_EXACT_SCAN_MAX_MATCHES,
                1_000_000,
                10,
                64,
                true,
                false
            ),
            FilteredPlan::ExactScan
        );
        assert_eq!(
            plan(500_000, 1_000_000, 10, 64, true, true),
            FilteredPlan::ExactScan
        );
        assert_eq!(
            plan(500_000, 1_000_000, 10, 64, false, false),
            FilteredPlan::ExactScan
        );
    }

    const ACCEPTED: Walk = Walk::Accepted {
        max_fresh: ACCEPTED_MAX_FRESH,
    };

    #[test]
    fn plan_walks_every_node_for_wide_filters_with_the_beam_widened_by_the_root() {
        // Half the documents match: 64 / sqrt(0.5) = 90.5.
        assert_eq!(
            plan(500_000, 1_000_000, 10, 64, true, false),
            FilteredPlan::Graph {
                ef: 91,
                walk: Walk::All
            }
        );
        // Everything matches: the request's own ef (at least k).
        assert_eq!(
            plan(10_000, 10_000, 100, 64, true, false),
            FilteredPlan::Graph {
                ef: 100,
                walk: Walk::All
            }
        );
        // A small partition: 117 / 0.3 = 390 visits against 2,100 matches: the graph.
        assert_eq!(
            plan(2_100, 7_000, 10, 64, true, false),
            FilteredPlan::Graph {
                ef: 117,
                walk: Walk::All
            }
        );
        // 4,096 / 0.3 visits would exceed the matches: the scan.
        assert_eq!(
            plan(3_000, 10_000, 10, 4_096, true, false),
            FilteredPlan::ExactScan
        );
    }

    #[test]
    fn plan_walks_accepted_nodes_from_10_to_30_percent_unless_the_scan_is_cheaper() {
        // 20%: 64 * sqrt(1.5) = 78.4; cost 79 * 64 = 5,056 distances against 200,000.
        assert_eq!(
            plan(200_000, 1_000_000, 10, 64, true, false),
            FilteredPlan::Graph {
                ef: 79,
                walk: ACCEPTED
            }
        );
        // 12%: 64 * sqrt(2.5) = 101.2.
        assert_eq!(
            plan(120_000, 1_000_000, 10, 64, true, false),
            FilteredPlan::Graph {
                ef: 102,
                walk: ACCEPTED
            }
        );
        // Under 10%: the scan, however many matches (the walk is not trusted there).
        assert_eq!(
            plan(50_000, 1_000_000, 10, 64, true, false),
            FilteredPlan::ExactScan
        );
        assert_eq!(
            plan(10_000, 1_000_000, 10, 64, true, false),
            FilteredPlan::ExactScan
        );
        assert_eq!(
            plan(1_000_000, 100_000_000, 10, 64, true, false),
            FilteredPlan::ExactScan
        );
        // Just under 10% of minilm's 60,733.
        assert_eq!(
            plan(6_073, 60_733, 10, 64, true, false),
            FilteredPlan::ExactScan
        );
        assert_eq!(
            plan(100_000, 1_000_000_000, 10, 64, true, false),
            FilteredPlan::ExactScan
        );
    }

    #[test]
    fn a_short_graph_answer_falls_back_to_the_exact_scan() {
        let mut matches = SlotSet::empty(10);
        for slot in [1, 4, 7] {
            matches.insert(slot);
        }
        let distance = |slot: u32| (slot as f32 - 4.0).abs();
        let short = |_ef: usize, _walk: Walk, _density: &mut WalkDensity| {
            vec![Candidate {
                distance: 0.0,
                node: 4,
            }]
        };
        let found = filtered_top_k(
            &matches,
            3,
            10,
            2,
            FilteredPlan::Graph {
                ef: 8,
                walk: Walk::All,
            },
            short,
            distance,
        );
        assert_eq!(found.iter().map(|c| c.node).collect::<Vec<_>>(), vec![4, 1]);
        let scan = filtered_top_k(
            &matches,
            3,
            10,
            5,
            FilteredPlan::ExactScan,
            |_, _, _| Vec::new(),
            distance,
        );
        assert_eq!(scan.len(), 3);
        assert!(filtered_top_k(
            &matches,
            0,
            10,
            5,
            FilteredPlan::ExactScan,
            |_, _, _| Vec::new(),
            distance
        )
        .is_empty());
    }

    #[test]
    fn a_two_hop_walk_stranded_where_matches_are_rare_falls_back_to_the_exact_scan() {
        // 3 of 10 slots match (30%); the walk answers with the wrong two.
        let mut matches = SlotSet::empty(10);
        for slot in [1, 4, 7] {
            matches.insert(slot);
        }
        let distance = |slot: u32| (slot as f32 - 4.0).abs();
        let walk = Walk::Accepted { max_fresh: 8 };
        let walked = |looked: u64, accepted: u64| {
            move |_ef: usize, _walk: Walk, density: &mut WalkDensity| {
                *density = WalkDensity { looked, accepted };
                vec![
                    Candidate {
                        distance: 3.0,
                        node: 1,
                    },
                    Candidate {
                        distance: 3.0,
                        node: 7,
                    },
                ]
            }
        };
        let plan = FilteredPlan::Graph { ef: 8, walk };
        let nodes = |found: Vec<Candidate>| found.iter().map(|c| c.node).collect::<Vec<_>>();
        // 1 in 100 accepted around the query, against 30% in the partition: stranded.
        let found = filtered_top_k(&matches, 3, 10, 2, plan, walked(100, 1), distance);
        assert_eq!(nodes(found), vec![4, 1]);
        // 1 in 10 (a third of the partition's density, above a quarter): its answer stands.
        let found = filtered_top_k(&matches, 3, 10, 2, plan, walked(100, 10), distance);
        assert_eq!(nodes(found), vec![1, 7]);
    }
}
