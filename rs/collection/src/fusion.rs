//! Hybrid search's fusion: a dense-vector side and a full-text side each retrieve their best
//! candidates (`Hybrid::depth` each, filters and tenants applied to both), and one ranked list
//! is made of them, by reciprocal rank fusion or by relative score fusion. A single node fuses
//! its two sides; a cluster fuses after each side's global merge, with the same function, so
//! both give the same answer on the same data.

use crate::config::MAX_TOP_K;
use crate::error::{CollectionError, Result};

/// How a hybrid search combines its sides.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum FusionMethod {
    /// Reciprocal rank fusion (Cormack et al., 2009): `Σ weight / (k + rank)` over the sides
    /// that retrieved the document, ranks from 1. Scores do not matter, only ranks.
    Rrf { k: f64 },
    /// Relative score fusion (Weaviate's): each side's scores min-max normalised to [0, 1]
    /// over its candidates (best 1, worst 0; all 1 when they are equal), then
    /// `Σ weight · normalised`.
    RelativeScore,
}

/// A hybrid search's settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Hybrid {
    pub method: FusionMethod,
    /// Candidates each side retrieves; 0: `max(top_k, Hybrid::DEFAULT_DEPTH)`.
    pub depth: usize,
    pub vector_weight: f64,
    pub text_weight: f64,
}

impl Default for Hybrid {
    fn default() -> Self {
        Hybrid {
            method: FusionMethod::Rrf {
                k: Hybrid::DEFAULT_RRF_K,
            },
            depth: 0,
            vector_weight: 1.0,
            text_weight: 1.0,
        }
    }
}

impl Hybrid {
    /// RRF's `k` unless set (the paper's, and every peer's default).
    pub const DEFAULT_RRF_K: f64 = 60.0;
    /// Candidates per side unless set (and at least `top_k`).
    pub const DEFAULT_DEPTH: usize = 100;

    /// INVALID_ARGUMENT naming `fusion.*` for a depth past the top-k limit, RRF's `k` below
    /// 1, or weights that are negative, not finite or both 0.
    pub fn validate(&self) -> Result<()> {
        if self.depth > MAX_TOP_K {
            return Err(CollectionError::invalid(
                "fusion.depth",
                format!("must be at most {MAX_TOP_K}, got {}", self.depth),
            ));
        }
        if let FusionMethod::Rrf { k } = self.method {
            if !(k.is_finite() && k >= 1.0) {
                return Err(CollectionError::invalid(
                    "fusion.rrf_k",
                    format!("must be at least 1, got {k}"),
                ));
            }
        }
        for (field, weight) in [
            ("fusion.vector_weight", self.vector_weight),
            ("fusion.text_weight", self.text_weight),
        ] {
            if !(weight.is_finite() && weight >= 0.0) {
                return Err(CollectionError::invalid(
                    field,
                    format!("must be a finite number of at least 0, got {weight}"),
                ));
            }
        }
        if self.vector_weight == 0.0 && self.text_weight == 0.0 {
            return Err(CollectionError::invalid(
                "fusion.vector_weight",
                "and fusion.text_weight cannot both be 0",
            ));
        }
        Ok(())
    }

    /// The candidates each side retrieves for a search of `top_k`.
    pub fn depth_for(&self, top_k: usize) -> usize {
        match self.depth {
            0 => top_k.max(Hybrid::DEFAULT_DEPTH),
            depth => depth,
        }
    }
}

/// A document's place on one side of a hybrid search: its rank there (from 1) and that side's
/// score (the metric's score for the vector side, BM25 for the text side).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SideRank {
    pub rank: u32,
    pub score: f32,
}

/// One fused hit: the document, its fused score and where each side had it (`None`: that
/// side did not retrieve it).
#[derive(Debug, Clone, PartialEq)]
pub struct Fused {
    pub user_id: u128,
    pub doc_id: u128,
    pub score: f32,
    pub vector: Option<SideRank>,
    pub text: Option<SideRank>,
}

impl Fused {
    /// The hits of a search with one side only, as they are (no side ranks).
    pub fn unfused(hits: Vec<(u128, u128, f32)>) -> Vec<Fused> {
        hits.into_iter()
            .map(|(user_id, doc_id, score)| Fused {
                user_id,
                doc_id,
                score,
                vector: None,
                text: None,
            })
            .collect()
    }
}

/// A side's candidates, best first: `(user, doc, score)`.
pub type SideHits = [(u128, u128, f32)];

/// Fuses the two sides' candidates (each best first, each `(user, doc)` at most once) into the
/// `top_k` best, best first; ties go to the smaller `(user, doc)`. `vector_higher_is_better` is
/// false for Euclidean distance (the vector side's scores are then distances).
pub fn fuse(
    vector: &SideHits,
    vector_higher_is_better: bool,
    text: &SideHits,
    hybrid: &Hybrid,
    top_k: usize,
) -> Vec<Fused> {
    use std::collections::HashMap;
    let mut fused: HashMap<(u128, u128), Fused> = HashMap::new();
    let sides = [
        (vector, vector_higher_is_better, hybrid.vector_weight, true),
        (text, true, hybrid.text_weight, false),
    ];
    for (hits, higher_is_better, weight, is_vector) in sides {
        let (best, worst) = hits.iter().fold((f32::NAN, f32::NAN), |(lo, hi), h| {
            (lo.min(h.2), hi.max(h.2))
        });
        let (best, worst) = match higher_is_better {
            true => (worst, best),
            false => (best, worst),
        };
        for (idx, &(user_id, doc_id, score)) in hits.iter().enumerate() {
            let rank = idx as u32 + 1;
            let contribution = match hybrid.method {
                FusionMethod::Rrf { k } => weight / (k + f64::from(rank)),
                FusionMethod::RelativeScore => {
                    let span = f64::from(best) - f64::from(worst);
                    let normalised = match span == 0.0 {
                        true => 1.0,
                        false => (f64::from(score) - f64::from(worst)) / span,
                    };
                    weight * normalised
                }
            };
            let entry = fused.entry((user_id, doc_id)).or_insert(Fused {
                user_id,
                doc_id,
                score: 0.0,
                vector: None,
                text: None,
            });
            // Accumulated in f64 through the f32 field's range: at most two terms.
            entry.score = (f64::from(entry.score) + contribution) as f32;
            let side = Some(SideRank { rank, score });
            match is_vector {
                true => entry.vector = side,
                false => entry.text = side,
            }
        }
    }
    let mut fused: Vec<Fused> = fused.into_values().collect();
    fused.sort_by(|a, b| {
        b.score
            .total_cmp(&a.score)
            .then(a.user_id.cmp(&b.user_id))
            .then(a.doc_id.cmp(&b.doc_id))
    });
    fused.truncate(top_k);
    fused
}

#[cfg(test)]
mod tests {
    use super::*;

    /// RRF and relative score fusion written out directly, for one document.
    fn reference(
        doc: u128,
        vector: &SideHits,
        vector_higher: bool,
        text: &SideHits,
        hybrid: &Hybrid,
    ) -> f64 {
        let mut total = 0.0;
        for (hits, higher, weight) in [
            (vector, vector_higher, hybrid.vector_weight),
            (text, true, hybrid.text_weight),
        ] {
            let Some(position) = hits.iter().position(|h| h.1 == doc) else {
                continue;
            };
            total += match hybrid.method {
                FusionMethod::Rrf { k } => weight / (k + position as f64 + 1.0),
                FusionMethod::RelativeScore => {
                    let scores: Vec<f64> = hits.iter().map(|h| f64::from(h.2)).collect();
                    let max = scores.iter().cloned().fold(f64::MIN, f64::max);
                    let min = scores.iter().cloned().fold(f64::MAX, f64::min);
                    let s = scores[position];
                    let norm = if max == min {
                        1.0
                    } else if higher {
                        (s - min) / (max - min)
                    } else {
                        (max - s) / (max - min)
                    };
                    weight * norm
                }
            };
        }
        total
    }

    #[test]
    fn fused_scores_match_the_reference_for_both_methods() {
        // Seeded, hand-rolled: distances ascending on the vector side, BM25 descending.
        let mut state = 7u64;
        let mut next = || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 33) as u32
        };
        for round in 0..200 {
            let n_vector = (next() % 30) as usize;
            let n_text = (next() % 30) as usize;
            let mut vector: Vec<(u128, u128, f32)> = Vec::new();
            let mut text: Vec<(u128, u128, f32)> = Vec::new();
            let mut seen = std::collections::HashSet::new();
            while vector.len() < n_vector {
                let doc = u128::from(next() % 50);
                if seen.insert(doc) {
                    vector.push((1, doc, (next() % 1000) as f32 / 10.0));
                }
            }
            seen.clear();
            while text.len() < n_text {
                let doc = u128::from(next() % 50);
                if seen.insert(doc) {
                    text.push((1, doc, (next() % 1000) as f32 / 100.0));
                }
            }
            let higher = round % 2 == 0;
            vector.sort_by(|a, b| match higher {
                true => b.2.total_cmp(&a.2),
                false => a.2.total_cmp(&b.2),
            });
            text.sort_by(|a, b| b.2.total_cmp(&a.2));
            for method in [FusionMethod::Rrf { k: 60.0 }, FusionMethod::RelativeScore] {
                let hybrid = Hybrid {
                    method,
                    depth: 0,
                    vector_weight: 0.3 + f64::from(next() % 10) / 10.0,
                    text_weight: 0.2 + f64::from(next() % 10) / 10.0,
                };
                let fused = fuse(&vector, higher, &text, &hybrid, 1000);
                let docs: std::collections::HashSet<u128> =
                    vector.iter().chain(&text).map(|h| h.1).collect();
                assert_eq!(fused.len(), docs.len(), "round {round}");
                for hit in &fused {
                    let want = reference(hit.doc_id, &vector, higher, &text, &hybrid);
                    assert!(
                        (f64::from(hit.score) - want).abs() < 1e-6,
                        "round {round} {method:?}: {} against {want}",
                        hit.score
                    );
                    let vector_rank = vector.iter().position(|h| h.1 == hit.doc_id);
                    assert_eq!(hit.vector.map(|s| s.rank as usize - 1), vector_rank);
                    let text_rank = text.iter().position(|h| h.1 == hit.doc_id);
                    assert_eq!(hit.text.map(|s| s.rank as usize - 1), text_rank);
                }
                assert!(fused.windows(2).all(|w| w[0].score > w[1].score
                    || (w[0].score == w[1].score && w[0].doc_id < w[1].doc_id)));
                let top = fuse(&vector, higher, &text, &hybrid, 5);
                assert_eq!(top[..], fused[..fused.len().min(5)]);
            }
        }
    }

    #[test]
    fn a_document_on_both_sides_beats_one_on_a_single_side_at_equal_ranks() {
        let vector = [(0, 1, 0.9), (0, 2, 0.8)];
        let text = [(0, 1, 7.0), (0, 3, 5.0)];
        let fused = fuse(&vector, true, &text, &Hybrid::default(), 10);
        let order: Vec<u128> = fused.iter().map(|f| f.doc_id).collect();
        assert_eq!(order, [1, 2, 3]);
        assert_eq!(
            fused[0].vector,
            Some(SideRank {
                rank: 1,
                score: 0.9
            })
        );
        assert_eq!(
            fused[0].text,
            Some(SideRank {
                rank: 1,
                score: 7.0
            })
        );
        assert_eq!(fused[2].vector, None);
        assert_eq!(Hybrid::default().depth_for(10), 100);
        assert_eq!(Hybrid::default().depth_for(500), 500);
    }
}
