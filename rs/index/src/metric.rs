//! Metrics, distance kernels, and the map between internal distances and user-facing scores.
//!
//! Internally every search minimises a non-negative distance (hnsw_rs asserts that distances
//! are not negative): cosine `1 - dot` on unit vectors (clamped at 0: rounding can push a dot product of unit
//! vectors above 1, which would trip hnsw_rs's assertion), L2 the squared Euclidean distance, and
//! dot product a strictly decreasing, positive map of the dot product (so HNSW orders candidates
//! exactly as by `-dot`). Scores are what users see: cosine similarity and dot product (higher is
//! better), Euclidean distance (lower is better).

/// How vectors are compared.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Metric {
    /// Cosine similarity; vectors are stored normalised to unit length.
    Cosine,
    /// Euclidean distance.
    L2,
    /// Inner product.
    Dot,
}

impl Metric {
    pub fn code(self) -> u8 {
        match self {
            Metric::Cosine => 1,
            Metric::L2 => 2,
            Metric::Dot => 3,
        }
    }

    pub fn from_code(code: u8) -> Option<Metric> {
        match code {
            1 => Some(Metric::Cosine),
            2 => Some(Metric::L2),
            3 => Some(Metric::Dot),
            _ => None,
        }
    }

    /// True when a higher score is better (cosine, dot), false for L2.
    pub fn higher_is_better(self) -> bool {
        !matches!(self, Metric::L2)
    }

    /// The internal distance between a query and a stored vector (lower is closer).
    #[inline]
    pub fn distance(self, a: &[f32], b: &[f32]) -> f32 {
        match self {
            Metric::Cosine => (1.0 - dot(a, b)).max(0.0),
            Metric::L2 => l2_squared(a, b),
            Metric::Dot => dot_to_distance(dot(a, b)),
        }
    }

    /// The user-facing score for an internal distance.
    pub fn score(self, distance: f32) -> f32 {
        match self {
            Metric::Cosine => 1.0 - distance,
            Metric::L2 => distance.sqrt(),
            Metric::Dot => distance_to_dot(distance),
        }
    }

    /// Prepares a vector for storage or search: unit length for cosine, unchanged otherwise.
    /// Returns false when a cosine vector has zero length (it has no direction).
    pub fn prepare(self, vector: &mut [f32]) -> bool {
        if self != Metric::Cosine {
            return true;
        }
        let norm = dot(vector, vector).sqrt();
        if norm == 0.0 || !norm.is_finite() {
            return false;
        }
        vector.iter_mut().for_each(|x| *x /= norm);
        true
    }
}

/// Strictly decreasing, positive, continuous: `1 - dot` for dot <= 0, `1 / (1 + dot)` above.
#[inline]
pub(crate) fn dot_to_distance(dot: f32) -> f32 {
    if dot <= 0.0 {
        1.0 - dot
    } else {
        1.0 / (1.0 + dot)
    }
}

fn distance_to_dot(distance: f32) -> f32 {
    if distance >= 1.0 {
        1.0 - distance
    } else {
        1.0 / distance - 1.0
    }
}

/// Dot product, with the fastest kernel this CPU supports (`simd.rs`).
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    (crate::simd::kernels().dot)(a, b)
}

/// Squared Euclidean distance, with the fastest kernel this CPU supports (`simd.rs`).
#[inline]
pub fn l2_squared(a: &[f32], b: &[f32]) -> f32 {
    (crate::simd::kernels().l2_squared)(a, b)
}

/// hnsw_rs's distance trait, evaluated with tarn's kernels and clamping.
#[derive(Debug, Clone, Copy)]
pub(crate) struct HnswDistance(pub(crate) Metric);

impl hnsw_rs::prelude::Distance<f32> for HnswDistance {
    fn eval(&self, va: &[f32], vb: &[f32]) -> f32 {
        self.0.distance(va, vb)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernels_match_naive_sums() {
        let a: Vec<f32> = (0..37).map(|i| (i as f32 * 0.37).sin()).collect();
        let b: Vec<f32> = (0..37).map(|i| (i as f32 * 0.11).cos()).collect();
        let naive_dot: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
        let naive_l2: f32 = a.iter().zip(&b).map(|(x, y)| (x - y) * (x - y)).sum();
        assert!((dot(&a, &b) - naive_dot).abs() < 1e-4);
        assert!((l2_squared(&a, &b) - naive_l2).abs() < 1e-4);
    }

    #[test]
    fn distances_are_non_negative_and_scores_round_trip() {
        let mut unit = vec![0.6f32, 0.8];
        assert!(Metric::Cosine.prepare(&mut unit));
        // A dot product of a unit vector with itself can round above 1: clamped, never negative.
        assert!(Metric::Cosine.distance(&unit, &unit) >= 0.0);
        assert!(!Metric::Cosine.prepare(&mut [0.0, 0.0]));
        for dot_value in [-50.0f32, -1.0, 0.0, 0.5, 3.0, 1000.0] {
            let distance = dot_to_distance(dot_value);
            assert!(distance > 0.0);
            let back = distance_to_dot(distance);
            assert!(
                (back - dot_value).abs() <= 1e-3 * dot_value.abs().max(1.0),
                "{dot_value} {back}"
            );
        }
        // Strictly decreasing in the dot product.
        assert!(dot_to_distance(2.0) < dot_to_distance(1.0));
        assert!(dot_to_distance(-1.0) < dot_to_distance(-2.0));
        assert_eq!(
            Metric::L2.score(Metric::L2.distance(&[0.0, 0.0], &[3.0, 4.0])),
            5.0
        );
    }
}
