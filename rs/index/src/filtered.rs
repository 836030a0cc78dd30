//! Filtered search's strategy, shared by both segment kinds. Per tenant partition the exact set
//! of matching live slots is known before any vector is read (`AttributeIndex::matching` minus
//! the tombstones), so the choice between an exact scan of the matches and a graph search is
//! made on an exact count, and the answer is never short: a search returns
//! `min(k, matching live documents)` hits, whichever way it went.
//!
//! One function ([`plan`]) makes the choice, so that a measured crossover or a better filtered
//! traversal (ACORN-style two-hop expansion, issue 28) replaces it in one place.

use crate::attribute_index::SlotSet;
use crate::flat_graph::Candidate;
use crate::search::exact_top_k;

/// A partition whose filter matches at most this many live documents is searched by an exact
/// scan of its matches (recall 1.0). Measured (docs/BENCHMARKS.md, "Filtered search", minilm
/// 384-d): at 1% and 10% selectivity the chosen path runs at the exact scan's speed, at 50% the
/// graph search is 2.65x the scan, and filters averaging 2,941 matches (a mix of both paths)
/// gain 1.27x over scanning: the switch sits where neither path loses much.
pub const FILTER_EXACT_SCAN_MAX_MATCHES: usize = 2048;

/// The widest beam a filtered graph search is given (`ef` scaled by `1 / selectivity` is
/// capped here, or at the request's own `ef` if that is larger).
const FILTERED_MAX_EF: usize = 4096;

/// How one partition's filtered search runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FilteredPlan {
    /// Exact scan of the matching live slots.
    ExactScan,
    /// Graph search accepting only matching live slots, with this beam width; falls back to
    /// the exact scan if it comes back with fewer than `min(k, matches)` hits.
    Graph { ef: usize },
}

/// Chooses how to search one partition whose filter matches `n_matches` of its `n_live` live
/// documents:
/// - the exact scan when the request asks for it, the partition has no graph, or the matches
///   are at most [`FILTER_EXACT_SCAN_MAX_MATCHES`];
/// - otherwise a graph search whose beam is widened to cover the selectivity
///   `s = n_matches / n_live`: `ef / s`, capped at 4,096 (or the request's `ef`). A search that
///   only accepts matches visits about `ef / s` nodes to collect `ef` of them, so when that
///   exceeds `n_matches` the exact scan of the matches is the cheaper of the two and is chosen.
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
    let widened = ((ef as f64 / selectivity).ceil() as usize)
        .min(FILTERED_MAX_EF.max(ef))
        .max(ef);
    let expected_visits = widened as f64 / selectivity;
    if expected_visits >= n_matches as f64 {
        return FilteredPlan::ExactScan;
    }
    FilteredPlan::Graph { ef: widened }
}

/// Runs a partition's filtered search: `matches` are its matching live slots (`n_matches` of
/// them); `graph_search(ef)` is the graph search that accepts only those slots (called for
/// [`FilteredPlan::Graph`] only), `distance` measures a slot against the query. Returns at
/// most `k` candidates, nearest first, and always `min(k, n_matches)`.
pub(crate) fn filtered_top_k(
    matches: &SlotSet,
    n_matches: usize,
    k: usize,
    plan: FilteredPlan,
    graph_search: impl FnOnce(usize) -> Vec<Candidate>,
    distance: impl Fn(u32) -> f32,
) -> Vec<Candidate> {
    if n_matches == 0 || k == 0 {
        return Vec::new();
    }
    if let FilteredPlan::Graph { ef } = plan {
        let candidates = graph_search(ef);
        if candidates.len() >= k.min(n_matches) {
            return candidates;
        }
        tracing::debug!(
            found = candidates.len(),
            n_matches,
            k,
            "filtered graph search came back short; scanning the matches"
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

    #[test]
    fn plan_widens_the_beam_by_selectivity_and_prefers_the_scan_when_cheaper() {
        // Half the documents match: the beam doubles.
        assert_eq!(
            plan(500_000, 1_000_000, 10, 64, true, false),
            FilteredPlan::Graph { ef: 128 }
        );
        // Everything matches: the request's own ef (at least k).
        assert_eq!(
            plan(10_000, 10_000, 100, 64, true, false),
            FilteredPlan::Graph { ef: 100 }
        );
        // 1%: ef 6,400 capped at 4,096, about 409,600 visits; cheaper than 10,000 matches? No.
        assert_eq!(
            plan(10_000, 1_000_000, 10, 64, true, false),
            FilteredPlan::ExactScan
        );
        // 1% of 100 million: the graph.
        assert_eq!(
            plan(1_000_000, 100_000_000, 10, 64, true, false),
            FilteredPlan::Graph { ef: 4096 }
        );
    }

    #[test]
    fn a_short_graph_answer_falls_back_to_the_exact_scan() {
        let mut matches = SlotSet::empty(10);
        for slot in [1, 4, 7] {
            matches.insert(slot);
        }
        let distance = |slot: u32| (slot as f32 - 4.0).abs();
        let short = |_ef: usize| {
            vec![Candidate {
                distance: 0.0,
                node: 4,
            }]
        };
        let found = filtered_top_k(
            &matches,
            3,
            2,
            FilteredPlan::Graph { ef: 8 },
            short,
            distance,
        );
        assert_eq!(found.iter().map(|c| c.node).collect::<Vec<_>>(), vec![4, 1]);
        let scan = filtered_top_k(
            &matches,
            3,
            5,
            FilteredPlan::ExactScan,
            |_| Vec::new(),
            distance,
        );
        assert_eq!(scan.len(), 3);
        assert!(filtered_top_k(
            &matches,
            0,
            5,
            FilteredPlan::ExactScan,
            |_| Vec::new(),
            distance
        )
        .is_empty());
    }
}
