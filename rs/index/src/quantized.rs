//! Quantized copies of a sealed partition's vectors, walked by the graph search in place of the
//! full vectors; the best candidates are then rescored exactly on the full vectors, so the
//! distances a search returns are always the exact metric's.
//!
//! Int8 (scalar quantization, one range per dimension): dimension `d` of a vector is kept as
//! the byte `c = round((x - lo[d]) / step[d])`, `step[d] = (hi[d] - lo[d]) / 255` over the
//! partition's own minimum and maximum, so every value comes back within half a step
//! (`x̂ = lo[d] + c * step[d]`). The query stays in `f32` (asymmetric distance): with
//! `w[d] = q[d] * step[d]` computed once per search, `q · x̂ = q · lo + w · c`, one `f32 x u8`
//! dot product per vector (`simd.rs`'s `dot_u8`); L2 adds each vector's `|x̂|²`, kept beside
//! its codes. A quarter of the bytes per vector visited, and the byte-wise ranges keep
//! minilm's recall with a small rescoring list (docs/BENCHMARKS.md, "Quantized vectors").

use crate::bytes::{ByteReader, ByteWriter};
use crate::error::{IndexError, Result};
use crate::metric::{dot, Metric};
use crate::rabitq::{RabitqCodes, RabitqQuery};

/// How sealed partitions with a graph keep the vectors the graph search walks on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Quantization {
    /// Full `f32` vectors only (what every segment had before quantization existed).
    #[default]
    None,
    /// One byte per dimension, a range per dimension; `rescore` candidates per result are
    /// rescored on the full vectors.
    Int8 { rescore: usize },
    /// RaBitQ codes of `bits` bits per dimension (1 to 8, `rabitq.rs`); `rescore` candidates
    /// per result are rescored on the full vectors.
    Rabitq { bits: u8, rescore: usize },
}

impl Quantization {
    /// Candidates per result rescored on the full vectors when an int8 collection does not
    /// say: the smallest that kept recall@10 within 0.01 of `f32` at every ef measured on
    /// minilm-debian (docs/BENCHMARKS.md, "Quantized vectors").
    pub const DEFAULT_RESCORE: usize = 3;
    /// The most candidates per result a collection may ask to rescore.
    pub const MAX_RESCORE: usize = 64;
    /// The most bits per dimension of RaBitQ codes.
    pub const MAX_RABITQ_BITS: u8 = 8;

    /// Candidates per result rescored when a RaBitQ collection does not say (minilm-debian,
    /// docs/BENCHMARKS.md, "Quantized vectors"): the fewer the bits, the more candidates the
    /// codes need to keep recall@10 within 0.01 of `f32` at ef 64.
    pub fn default_rabitq_rescore(bits: u8) -> usize {
        match bits {
            0 | 1 => 6,
            2 => 4,
            _ => 3,
        }
    }

    /// The candidates per result this quantization rescores (`None`: nothing is quantized).
    pub fn rescore(self) -> Option<usize> {
        match self {
            Quantization::None => None,
            Quantization::Int8 { rescore } | Quantization::Rabitq { rescore, .. } => Some(rescore),
        }
    }
}

/// The seed of every RaBitQ rotation tarn draws (any seed gives RaBitQ's guarantee for data
/// that does not depend on it; one fixed seed makes segments reproducible).
const RABITQ_SEED: u64 = 0x7461_726e_5261_4269;

/// The quantized codes of one partition's slots.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Codes {
    Int8(Int8Codes),
    Rabitq(RabitqCodes),
}

/// A query prepared against a partition's codes.
pub(crate) enum CodesQuery<'a> {
    Int8(Int8Query<'a>),
    Rabitq(RabitqQuery<'a>),
}

impl Codes {
    /// The codes `quantization` asks for, of `vectors` (`dimension` values per slot, as
    /// stored); `None` for no quantization.
    pub(crate) fn encode(
        quantization: Quantization,
        vectors: &[f32],
        dimension: usize,
    ) -> Option<Codes> {
        match quantization {
            Quantization::None => None,
            Quantization::Int8 { .. } => Some(Codes::Int8(Int8Codes::encode(vectors, dimension))),
            Quantization::Rabitq { bits, .. } => Some(Codes::Rabitq(RabitqCodes::encode(
                vectors,
                dimension,
                bits,
                RABITQ_SEED,
            ))),
        }
    }

    /// Whether these are the codes `quantization` asks for (any codes do for `None`: a
    /// segment written with codes keeps walking them).
    pub(crate) fn serve(&self, quantization: Quantization) -> bool {
        match (self, quantization) {
            (_, Quantization::None) => true,
            (Codes::Int8(_), Quantization::Int8 { .. }) => true,
            (Codes::Rabitq(codes), Quantization::Rabitq { bits, .. }) => codes.bits() == bits,
            _ => false,
        }
    }

    /// Candidates per result rescored when the collection does not say (a segment with codes
    /// opened in a collection without quantization).
    pub(crate) fn default_rescore(&self) -> usize {
        match self {
            Codes::Int8(_) => Quantization::DEFAULT_RESCORE,
            Codes::Rabitq(codes) => Quantization::default_rabitq_rescore(codes.bits()),
        }
    }

    pub(crate) fn memory_bytes(&self) -> usize {
        match self {
            Codes::Int8(codes) => codes.memory_bytes(),
            Codes::Rabitq(codes) => codes.memory_bytes(),
        }
    }

    pub(crate) fn query(&self, query: &[f32], metric: Metric) -> CodesQuery<'_> {
        match self {
            Codes::Int8(codes) => CodesQuery::Int8(codes.query(query, metric)),
            Codes::Rabitq(codes) => CodesQuery::Rabitq(codes.query(query, metric)),
        }
    }
}

impl CodesQuery<'_> {
    /// The metric's internal distance between the query and a slot's quantized vector.
    #[inline]
    pub(crate) fn distance(&self, slot: u32) -> f32 {
        match self {
            CodesQuery::Int8(query) => query.distance(slot),
            CodesQuery::Rabitq(query) => query.distance(slot),
        }
    }

    /// What `distance` reads of a slot, for prefetching.
    #[inline]
    pub(crate) fn codes_of(&self, slot: u32) -> &[u8] {
        match self {
            CodesQuery::Int8(query) => query.codes_of(slot),
            CodesQuery::Rabitq(query) => query.codes_of(slot),
        }
    }
}

/// The int8 codes of one partition's slots, with their ranges and corrections.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Int8Codes {
    dimension: usize,
    /// Each dimension's minimum.
    lo: Vec<f32>,
    /// Each dimension's step: its range over 255 (0 for a constant dimension).
    step: Vec<f32>,
    /// `dimension` bytes per slot.
    codes: Vec<u8>,
    /// `|x̂|²` per slot (what L2 adds to `|q|² - 2 q · x̂`).
    norms: Vec<f32>,
}

/// A query prepared against one partition's codes.
pub(crate) struct Int8Query<'a> {
    codes: &'a Int8Codes,
    metric: Metric,
    /// `q[d] * step[d]`.
    weights: Vec<f32>,
    /// `q · lo`.
    offset: f32,
    /// `|q|²`.
    query_norm: f32,
}

impl Int8Codes {
    /// Trains the ranges on `vectors` (`dimension` values per slot, as stored: prepared for
    /// the metric) and encodes every slot.
    pub(crate) fn encode(vectors: &[f32], dimension: usize) -> Int8Codes {
        assert!(dimension > 0 && vectors.len().is_multiple_of(dimension));
        let mut lo = vec![f32::INFINITY; dimension];
        let mut hi = vec![f32::NEG_INFINITY; dimension];
        for vector in vectors.chunks_exact(dimension) {
            for (d, &x) in vector.iter().enumerate() {
                lo[d] = lo[d].min(x);
                hi[d] = hi[d].max(x);
            }
        }
        if vectors.is_empty() {
            lo.fill(0.0);
            hi.fill(0.0);
        }
        let step: Vec<f32> = lo.iter().zip(&hi).map(|(l, h)| (h - l) / 255.0).collect();
        let mut codes = Vec::with_capacity(vectors.len());
        let mut norms = Vec::with_capacity(vectors.len() / dimension);
        for vector in vectors.chunks_exact(dimension) {
            let start = codes.len();
            codes.extend(vector.iter().enumerate().map(|(d, &x)| {
                if step[d] > 0.0 {
                    ((x - lo[d]) / step[d]).round().clamp(0.0, 255.0) as u8
                } else {
                    0
                }
            }));
            let decoded = decode_into(&lo, &step, &codes[start..]);
            norms.push(dot(&decoded, &decoded));
        }
        Int8Codes {
            dimension,
            lo,
            step,
            codes,
            norms,
        }
    }

    #[cfg(test)]
    pub(crate) fn n_slots(&self) -> usize {
        self.norms.len()
    }

    pub(crate) fn code(&self, slot: u32) -> &[u8] {
        &self.codes[slot as usize * self.dimension..][..self.dimension]
    }

    /// The vector a slot's codes stand for.
    #[cfg(test)]
    pub(crate) fn decode(&self, slot: u32) -> Vec<f32> {
        decode_into(&self.lo, &self.step, self.code(slot))
    }

    /// Half of dimension `d`'s step: the most any value of it is off by.
    #[cfg(test)]
    pub(crate) fn max_error(&self, d: usize) -> f32 {
        self.step[d] / 2.0
    }

    pub(crate) fn memory_bytes(&self) -> usize {
        self.codes.len() + self.norms.len() * 4 + self.dimension * 8
    }

    /// Prepares `query` (as searched: prepared for the metric) for `distance`.
    pub(crate) fn query(&self, query: &[f32], metric: Metric) -> Int8Query<'_> {
        Int8Query {
            codes: self,
            metric,
            weights: query.iter().zip(&self.step).map(|(q, s)| q * s).collect(),
            offset: dot(query, &self.lo),
            query_norm: dot(query, query),
        }
    }

    /// The section's bytes: dimension, ranges, codes and norms (`n_slots` is the partition's).
    pub(crate) fn encode_section(&self) -> Vec<u8> {
        let mut out = ByteWriter::default();
        out.u32(self.dimension as u32);
        out.f32s(&self.lo);
        out.f32s(&self.step);
        out.bytes.extend_from_slice(&self.codes);
        out.f32s(&self.norms);
        out.bytes
    }

    /// Reads a section written by `encode_section` for a partition of `n_slots` slots of
    /// `dimension` values; every length is checked, never trusted.
    pub(crate) fn decode_section(bytes: &[u8], n_slots: usize, dimension: usize) -> Result<Self> {
        let mut input = ByteReader::new(bytes);
        let stored = input.u32("int8 dimension")? as usize;
        if stored != dimension {
            return Err(IndexError::Format(format!(
                "int8 codes of dimension {stored} in a segment of dimension {dimension}"
            )));
        }
        let lo = input.f32s(dimension, "int8 minimums")?;
        let step = input.f32s(dimension, "int8 steps")?;
        if lo.iter().chain(&step).any(|x| !x.is_finite()) || step.iter().any(|s| *s < 0.0) {
            return Err(IndexError::Format("int8 ranges are not finite".into()));
        }
        let n_codes = n_slots
            .checked_mul(dimension)
            .ok_or_else(|| IndexError::Format("int8 code count overflows".into()))?;
        let codes = input.take(n_codes, "int8 codes")?.to_vec();
        let norms = input.f32s(n_slots, "int8 norms")?;
        if input.remaining() != 0 {
            return Err(IndexError::Format(
                "trailing bytes after the int8 codes".into(),
            ));
        }
        Ok(Int8Codes {
            dimension,
            lo,
            step,
            codes,
            norms,
        })
    }
}

fn decode_into(lo: &[f32], step: &[f32], code: &[u8]) -> Vec<f32> {
    code.iter()
        .enumerate()
        .map(|(d, &c)| lo[d] + c as f32 * step[d])
        .collect()
}

impl Int8Query<'_> {
    /// The metric's internal distance between the query and a slot's quantized vector.
    #[inline]
    pub(crate) fn distance(&self, slot: u32) -> f32 {
        let codes = self.codes.code(slot);
        let dot = self.offset + (crate::simd::kernels().dot_u8)(&self.weights, codes);
        match self.metric {
            Metric::Cosine => (1.0 - dot).max(0.0),
            Metric::L2 => (self.query_norm - 2.0 * dot + self.codes.norms[slot as usize]).max(0.0),
            Metric::Dot => crate::metric::dot_to_distance(dot),
        }
    }

    /// Where a slot's codes start, for prefetching.
    #[inline]
    pub(crate) fn codes_of(&self, slot: u32) -> &[u8] {
        self.codes.code(slot)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    use super::*;

    /// Seeded vectors whose dimensions have different ranges (also for `rabitq.rs`'s tests).
    pub(crate) fn vectors(n: usize, dimension: usize, seed: u64) -> Vec<f32> {
        let mut rng = StdRng::seed_from_u64(seed);
        (0..n * dimension)
            .map(|i| rng.random_range(-1.0..1.0f32) * (1.0 + (i % dimension) as f32 / 8.0))
            .collect()
    }

    #[test]
    fn every_value_comes_back_within_half_a_step() {
        let dimension = 37;
        let data = vectors(500, dimension, 1);
        let codes = Int8Codes::encode(&data, dimension);
        assert_eq!(codes.n_slots(), 500);
        for (slot, vector) in data.chunks_exact(dimension).enumerate() {
            let decoded = codes.decode(slot as u32);
            for d in 0..dimension {
                let error = (decoded[d] - vector[d]).abs();
                // A rounding error of a few ulps on top of half a step.
                assert!(
                    error <= codes.max_error(d) * 1.0001 + 1e-6,
                    "slot {slot} dimension {d}: off by {error}, half a step is {}",
                    codes.max_error(d)
                );
            }
        }
        // A constant dimension is kept exactly.
        let mut data = vectors(10, 4, 2);
        data.chunks_exact_mut(4).for_each(|v| v[2] = 0.5);
        let codes = Int8Codes::encode(&data, 4);
        assert!((0..10).all(|slot| codes.decode(slot)[2] == 0.5));
    }

    #[test]
    fn code_distances_equal_the_metric_on_the_decoded_vectors() {
        let dimension = 50;
        let data = vectors(200, dimension, 3);
        let codes = Int8Codes::encode(&data, dimension);
        let query: Vec<f32> = vectors(1, dimension, 4);
        for metric in [Metric::L2, Metric::Dot, Metric::Cosine] {
            let prepared = codes.query(&query, metric);
            for slot in 0..200u32 {
                let exact = metric.distance(&query, &codes.decode(slot));
                let got = prepared.distance(slot);
                assert!(
                    (got - exact).abs() <= 1e-3 * (1.0 + exact.abs()),
                    "{metric:?} slot {slot}: {got} against {exact}"
                );
            }
        }
    }

    #[test]
    fn sections_round_trip_and_damaged_ones_are_errors() {
        let dimension = 8;
        let data = vectors(30, dimension, 5);
        let codes = Int8Codes::encode(&data, dimension);
        let bytes = codes.encode_section();
        assert_eq!(
            Int8Codes::decode_section(&bytes, 30, dimension).unwrap(),
            codes
        );
        assert!(Int8Codes::decode_section(&bytes, 31, dimension).is_err());
        assert!(Int8Codes::decode_section(&bytes, 29, dimension).is_err());
        assert!(Int8Codes::decode_section(&bytes, 30, dimension + 1).is_err());
        for cut in 0..bytes.len() {
            assert!(Int8Codes::decode_section(&bytes[..cut], 30, dimension).is_err());
        }
        let mut nan = bytes.clone();
        nan[4..8].copy_from_slice(&f32::NAN.to_le_bytes());
        assert!(Int8Codes::decode_section(&nan, 30, dimension).is_err());
        assert!(Int8Codes::decode_section(&bytes, usize::MAX, dimension).is_err());
    }
}
