//! RaBitQ codes of a sealed partition's vectors: 1 to 8 bits per dimension, walked by the graph
//! search in place of the full vectors like the int8 codes of `quantized.rs` (the best
//! `k x rescore` candidates are then rescored exactly on the full vectors). The 1-bit codes are
//! RaBitQ (Gao & Long, SIGMOD 2024), 2 to 8 bits its extension (Gao et al., SIGMOD 2025).
//!
//! Encoding. Each partition has its centroid `c` (the mean of its vectors) and a random
//! orthogonal rotation `P` drawn from a seed kept in the section. A vector `x` is kept as its
//! residual's direction `o = P(x - c) / |x - c|`, quantized: codes `u[i]` in `0..2^B` stand for
//! `ȳ[i] = u[i] - (2^B - 1) / 2`, the code whose direction is nearest `o` (largest
//! `<ȳ, o> / |ȳ|`). With one bit that is `u[i] = [o[i] > 0]`, `ȳ = ±1/2`, the sign of each
//! rotated coordinate. With `B > 1`, `|ȳ[i]| = k[i] + 1/2` with `k[i] = min(floor(t |o[i]|),
//! 2^(B-1) - 1)` for the scale `t` that maximises the cosine, found by the paper's sweep over
//! the scales where some `k[i]` steps (`best_levels`; past 1,024 steps, only over a window of
//! scales around every optimum measured, which the tests compare with the full sweep).
//!
//! Estimator. For a query `q`, with `q' = P(q - c)` prepared once per search (the rotation is
//! orthogonal, so `<x - c, q - c> = |x - c| <o, q'>`), RaBitQ estimates
//! `<o, q'> ≈ <ȳ, q'> / <ȳ, o>`, unbiased, with an error that is at most
//! `ε0 · |q'| · sqrt((1 - a²) / a²) / sqrt(D - 1)`, `a = <ȳ, o> / |ȳ|`, except with a
//! probability that falls like `exp(-ε0² / 2)` (the tests use `ε0 = 3`). Every slot keeps
//! three factors beside its code: `scale = |x - c| / <ȳ, o>`, `<x - c, c>` and `|x - c|²`, so
//! that with `K = Σ q'[i] u[i]` (one `simd.rs` kernel: `dot_u1`, `dot_u4` or `dot_u8`) and the
//! per-query `h = (2^B - 1)/2 · Σ q'[i]`:
//!
//! - `<x - c, q - c> ≈ e = scale · (K - h)`;
//! - dot product: `<x, q> = <c, q> + <x - c, c> + <x - c, q - c> ≈ <c, q> + <x - c, c> + e`;
//!   cosine is `1 -` that (vectors are unit length), dot product its `dot_to_distance`;
//! - L2: `|x - q|² = |x - c|² + |q - c|² - 2 <x - c, q - c> ≈ |x - c|² + |q - c|² - 2 e`.
//!
//! A distance is one kernel call and a few multiply-adds, in the metric's internal scale
//! (clamped like `Int8Query`'s). The partition's metric is not known when it is encoded, so
//! every slot keeps what all three need.
//!
//! Layout. A slot's record is its code, then the three factors (little-endian `f32`): one bit
//! per dimension (8 per byte, the lowest bit first), 4 bits for `B` of 2 to 4 (2 per byte, the
//! low nibble first), a byte for `B` of 5 to 8. No padding beyond the last byte: at 384
//! dimensions a record is 60 bytes with 1 bit (48 of code), 204 with 2 to 4 bits, 396 with 5
//! to 8 (so 2 and 3 bits cost what 4 bits do; bit-packing them is left for later).
//!
//! Rotation. No dense `D x D` matrix (576 KiB at 384 dimensions): `ROUNDS` rounds of random
//! `±1` signs, a normalised fast Walsh-Hadamard transform of the leading `2^⌊log2 D⌋`
//! coordinates, new signs, the same transform of the trailing `2^⌊log2 D⌋` (the blocks overlap
//! when `D` is not a power of two), then a butterfly that mixes each coordinate of the first
//! half with one of the second (`(a, b) -> ((a + b), (a - b)) / √2`; the middle one of an odd
//! `D` is left alone), so that even a small overlap (1000 = 512 + 488) mixes every coordinate
//! with every other. Every step is orthogonal, codes stay `D` values long, and the signs are
//! drawn from the seed by SplitMix64 (stable, no dependency).

use crate::bytes::{ByteReader, ByteWriter};
use crate::error::{IndexError, Result};
use crate::metric::{dot, Metric};
use crate::simd::CodeKernel;

/// Rounds of the rotation (signs, two transforms and a butterfly each).
const ROUNDS: usize = 4;

/// Bytes of a record after its code: the factors `scale`, `A = <x - c, c> - scale · g` and
/// `B = |x - c|² + 2 · scale · g` (`g = <ȳ, P c>`), then the centroid's index.
const RECORD_TAIL: usize = 13;

/// The most centroids a partition has (a record names its centroid in one byte).
const MAX_CENTROIDS: usize = 256;

/// The RaBitQ codes of one partition's slots, with the centroid, the rotation and each slot's
/// factors.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct RabitqCodes {
    dimension: usize,
    bits: u8,
    /// The rotation's seed (the rotation is drawn again from it when a section is read).
    seed: u64,
    rotation: Rotation,
    /// `dimension` values per centroid.
    centroids: Vec<f32>,
    /// `|c|²` of each centroid (not stored: computed when encoded or read).
    centroid_norms: Vec<f32>,
    /// Bytes of one slot's code.
    code_bytes: usize,
    /// `code_bytes + RECORD_TAIL` bytes per slot: the code, then `scale`, `A`, `B`, and the
    /// index of the slot's centroid.
    records: Vec<u8>,
}

/// A query prepared against one partition's codes.
pub(crate) struct RabitqQuery<'a> {
    codes: &'a RabitqCodes,
    metric: Metric,
    /// `dot_u1`, `dot_u4` or `dot_u8`, by the codes' width.
    kernel: CodeKernel,
    /// `P q`.
    rotated: Vec<f32>,
    /// `(2^B - 1) / 2 · Σ (P q)[i]`: what the codes' offset adds to the kernel's sum.
    code_offset: f32,
    /// `<c, q>` of each centroid.
    centroid_dots: Vec<f32>,
    /// `|q - c|²` of each centroid.
    residual_norms: Vec<f32>,
}

impl RabitqCodes {
    /// Encodes every slot of `vectors` (`dimension` values per slot, as stored: prepared for
    /// the metric) with `bits` bits per dimension (1 to 8), the rotation drawn from `seed`:
    /// each slot against the nearest of the partition's centroids (`train_centroids`).
    pub(crate) fn encode(vectors: &[f32], dimension: usize, bits: u8, seed: u64) -> RabitqCodes {
        assert!(dimension > 0 && vectors.len().is_multiple_of(dimension));
        assert!((1..=8).contains(&bits), "RaBitQ codes of {bits} bits");
        let n_slots = vectors.len() / dimension;
        let centroids = train_centroids(vectors, dimension, seed);
        let rotation = Rotation::new(dimension, seed);
        let half_range = ((1u32 << bits) - 1) as f64 / 2.0;
        // `P c` and `Σ (P c)[i]` of each centroid, for `g = <ȳ, P c>`.
        let rotated_centroids: Vec<(Vec<f32>, f64)> = centroids
            .chunks_exact(dimension)
            .map(|c| {
                let mut rotated = c.to_vec();
                rotation.apply(&mut rotated);
                let sum = rotated.iter().map(|v| *v as f64).sum();
                (rotated, sum)
            })
            .collect();
        let code_bytes = code_bytes(dimension, bits);
        let mut records = Vec::with_capacity(n_slots * (code_bytes + RECORD_TAIL));
        let mut residual = vec![0f32; dimension];
        let mut code_values = Vec::with_capacity(dimension);
        for vector in vectors.chunks_exact(dimension) {
            let nearest = nearest_centroid(&centroids, dimension, vector);
            let centroid = &centroids[nearest * dimension..][..dimension];
            let (mut norm_squared, mut centroid_dot) = (0f64, 0f64);
            for ((r, x), c) in residual.iter_mut().zip(vector).zip(centroid) {
                *r = x - c;
                norm_squared += *r as f64 * *r as f64;
                centroid_dot += *r as f64 * *c as f64;
            }
            rotation.apply(&mut residual);
            let inner = quantize(&residual, bits, &mut code_values);
            // `inner` is `<ȳ, P(x - c)>` = `|x - c| <ȳ, o>`: positive unless `x` is `c`,
            // whose residual is 0 whatever its code.
            let scale = if inner > 0.0 {
                norm_squared / inner
            } else {
                0.0
            };
            // `g = <ȳ, P c>`: what the query's rotation against the centroid subtracts.
            let (rotated_centroid, rotated_sum) = &rotated_centroids[nearest];
            let g = code_values
                .iter()
                .zip(rotated_centroid)
                .map(|(u, c)| *u as f64 * *c as f64)
                .sum::<f64>()
                - half_range * rotated_sum;
            let start = records.len();
            records.resize(start + code_bytes, 0);
            pack(&code_values, bits, &mut records[start..]);
            for factor in [
                scale,
                centroid_dot - scale * g,
                norm_squared + 2.0 * scale * g,
            ] {
                records.extend_from_slice(&(factor as f32).to_le_bytes());
            }
            records.push(nearest as u8);
        }
        RabitqCodes {
            dimension,
            bits,
            seed,
            rotation,
            centroid_norms: centroid_norms(&centroids, dimension),
            centroids,
            code_bytes,
            records,
        }
    }

    pub(crate) fn bits(&self) -> u8 {
        self.bits
    }

    #[cfg(test)]
    pub(crate) fn n_slots(&self) -> usize {
        self.records.len() / self.stride()
    }

    fn stride(&self) -> usize {
        self.code_bytes + RECORD_TAIL
    }

    /// A slot's record: its code, then its factors.
    fn record(&self, slot: u32) -> &[u8] {
        &self.records[slot as usize * self.stride()..][..self.stride()]
    }

    pub(crate) fn memory_bytes(&self) -> usize {
        self.records.len()
            + (self.centroids.len() + self.centroid_norms.len()) * 4
            + self.rotation.signs.len() * 8
    }

    /// Prepares `query` (as searched: prepared for the metric) for `distance`: the query
    /// rotated, and its inner product with and distance to each centroid.
    pub(crate) fn query(&self, query: &[f32], metric: Metric) -> RabitqQuery<'_> {
        debug_assert_eq!(query.len(), self.dimension);
        let mut rotated = query.to_vec();
        self.rotation.apply(&mut rotated);
        let half_range = ((1u32 << self.bits) - 1) as f32 / 2.0;
        let query_norm = dot(query, query);
        let centroid_dots: Vec<f32> = self
            .centroids
            .chunks_exact(self.dimension)
            .map(|c| dot(c, query))
            .collect();
        let residual_norms = centroid_dots
            .iter()
            .zip(&self.centroid_norms)
            .map(|(cq, cc)| (query_norm - 2.0 * cq + cc).max(0.0))
            .collect();
        let kernels = crate::simd::kernels();
        RabitqQuery {
            codes: self,
            metric,
            kernel: match self.bits {
                1 => kernels.dot_u1,
                2..=4 => kernels.dot_u4,
                _ => kernels.dot_u8,
            },
            code_offset: half_range * rotated.iter().sum::<f32>(),
            rotated,
            centroid_dots,
            residual_norms,
        }
    }

    /// The section's bytes: dimension, bits, seed, the number of centroids and the centroids,
    /// then every slot's record (`n_slots` is the partition's).
    pub(crate) fn encode_section(&self) -> Vec<u8> {
        let mut out = ByteWriter::default();
        out.u32(self.dimension as u32);
        out.u8(self.bits);
        out.u64(self.seed);
        out.u32((self.centroids.len() / self.dimension) as u32);
        out.f32s(&self.centroids);
        out.bytes.extend_from_slice(&self.records);
        out.bytes
    }

    /// Reads a section written by `encode_section` for a partition of `n_slots` slots of
    /// `dimension` values; every length is checked, never trusted, and so is every factor
    /// (finite, and not negative where it cannot be) and every code (in range, padding bits 0).
    pub(crate) fn decode_section(bytes: &[u8], n_slots: usize, dimension: usize) -> Result<Self> {
        let mut input = ByteReader::new(bytes);
        let stored = input.u32("rabitq dimension")? as usize;
        if stored != dimension || dimension == 0 {
            return Err(IndexError::Format(format!(
                "rabitq codes of dimension {stored} in a segment of dimension {dimension}"
            )));
        }
        let bits = input.u8("rabitq bits")?;
        if !(1..=8).contains(&bits) {
            return Err(IndexError::Format(format!("rabitq codes of {bits} bits")));
        }
        let seed = input.u64("rabitq seed")?;
        let n_centroids = input.u32("rabitq centroid count")? as usize;
        if !(1..=MAX_CENTROIDS).contains(&n_centroids) {
            return Err(IndexError::Format(format!(
                "{n_centroids} rabitq centroids, not 1 to {MAX_CENTROIDS}"
            )));
        }
        let centroids = input.f32s(n_centroids * dimension, "rabitq centroids")?;
        if centroids.iter().any(|x| !x.is_finite()) {
            return Err(IndexError::Format("rabitq centroids are not finite".into()));
        }
        let code_bytes = code_bytes(dimension, bits);
        let stride = code_bytes + RECORD_TAIL;
        let n_bytes = n_slots
            .checked_mul(stride)
            .ok_or_else(|| IndexError::Format("rabitq record count overflows".into()))?;
        let records = input.take(n_bytes, "rabitq records")?.to_vec();
        if input.remaining() != 0 {
            return Err(IndexError::Format(
                "trailing bytes after the rabitq codes".into(),
            ));
        }
        for (slot, record) in records.chunks_exact(stride).enumerate() {
            let (code, factors) = record.split_at(code_bytes);
            let [scale, a, b] = [0, 4, 8].map(|at| f32_at(factors, at));
            if !(scale.is_finite() && a.is_finite() && b.is_finite()) || scale < 0.0 {
                return Err(IndexError::Format(format!(
                    "rabitq factors of slot {slot} are not finite, or a negative scale"
                )));
            }
            if factors[12] as usize >= n_centroids {
                return Err(IndexError::Format(format!(
                    "rabitq slot {slot} names centroid {} of {n_centroids}",
                    factors[12]
                )));
            }
            if !code_is_canonical(code, dimension, bits) {
                return Err(IndexError::Format(format!(
                    "rabitq code of slot {slot} is out of range"
                )));
            }
        }
        Ok(RabitqCodes {
            dimension,
            bits,
            seed,
            rotation: Rotation::new(dimension, seed),
            centroid_norms: centroid_norms(&centroids, dimension),
            centroids,
            code_bytes,
            records,
        })
    }
}

impl RabitqQuery<'_> {
    /// The metric's internal distance between the query and a slot's vector, estimated from
    /// its code (the same scale as `Metric::distance`).
    #[inline]
    pub(crate) fn distance(&self, slot: u32) -> f32 {
        let record = self.codes.record(slot);
        let (code, factors) = record.split_at(self.codes.code_bytes);
        let centroid = factors[12] as usize;
        // `scale · <ȳ, P q>`; with `A` and `B` it makes `<x - c, q - c>`'s estimate.
        let e = f32_at(factors, 0) * ((self.kernel)(&self.rotated, code) - self.code_offset);
        match self.metric {
            Metric::Cosine => {
                (1.0 - (self.centroid_dots[centroid] + f32_at(factors, 4) + e)).max(0.0)
            }
            Metric::L2 => (f32_at(factors, 8) + self.residual_norms[centroid] - 2.0 * e).max(0.0),
            Metric::Dot => crate::metric::dot_to_distance(
                self.centroid_dots[centroid] + f32_at(factors, 4) + e,
            ),
        }
    }

    /// A slot's record (its code, then its factors: all `distance` reads), for prefetching.
    #[inline]
    pub(crate) fn codes_of(&self, slot: u32) -> &[u8] {
        self.codes.record(slot)
    }
}

/// How many centroids a partition of `n_slots` gets: about `sqrt(n)`, so that each holds
/// about as many slots as there are centroids, at most `MAX_CENTROIDS`. A query computes its
/// inner product with every centroid (`sqrt(n)` dot products, against the graph walk's
/// hundreds of code distances), and the residuals to the nearest centroid are what the codes
/// quantize: the smaller, the smaller RaBitQ's error, which grows with `|x - c| |q - c|`.
fn n_centroids(n_slots: usize) -> usize {
    ((n_slots as f64).sqrt().round() as usize).clamp(1, MAX_CENTROIDS)
}

/// Lloyd iterations of `train_centroids`.
const KMEANS_ITERATIONS: usize = 8;
/// Training samples per centroid (a stride through the partition, not all of it).
const KMEANS_SAMPLES_PER_CENTROID: usize = 64;

/// The partition's centroids (`n_centroids` of them, `dimension` values each): k-means on a
/// stride of at most `KMEANS_SAMPLES_PER_CENTROID` samples per centroid, started from
/// samples spread by `seed`. An empty partition gets one centroid at the origin.
fn train_centroids(vectors: &[f32], dimension: usize, seed: u64) -> Vec<f32> {
    let n_slots = vectors.len() / dimension;
    if n_slots == 0 {
        return vec![0.0; dimension];
    }
    let n = n_centroids(n_slots);
    let stride = (n_slots / (n * KMEANS_SAMPLES_PER_CENTROID)).max(1);
    let samples: Vec<&[f32]> = vectors.chunks_exact(dimension).step_by(stride).collect();
    // Start from `n` distinct samples, spread over the sample by the seed.
    let offset = (seed % samples.len() as u64) as usize;
    let step = samples.len() / n;
    let mut centroids: Vec<f32> = (0..n)
        .flat_map(|i| samples[(offset + i * step) % samples.len()].iter().copied())
        .collect();
    let mut sums = vec![0f64; n * dimension];
    let mut counts = vec![0usize; n];
    for _ in 0..KMEANS_ITERATIONS {
        sums.fill(0.0);
        counts.fill(0);
        for sample in &samples {
            let nearest = nearest_centroid(&centroids, dimension, sample);
            counts[nearest] += 1;
            sums[nearest * dimension..][..dimension]
                .iter_mut()
                .zip(*sample)
                .for_each(|(s, x)| *s += *x as f64);
        }
        for (j, count) in counts.iter().enumerate() {
            // An empty cluster keeps its centroid.
            if *count > 0 {
                let centroid = &mut centroids[j * dimension..][..dimension];
                let sum = &sums[j * dimension..][..dimension];
                for (c, s) in centroid.iter_mut().zip(sum) {
                    *c = (s / *count as f64) as f32;
                }
            }
        }
    }
    centroids
}

/// The index of the centroid nearest `vector` (L2).
fn nearest_centroid(centroids: &[f32], dimension: usize, vector: &[f32]) -> usize {
    let mut best = (f32::INFINITY, 0);
    for (j, centroid) in centroids.chunks_exact(dimension).enumerate() {
        let distance = crate::metric::l2_squared(centroid, vector);
        if distance < best.0 {
            best = (distance, j);
        }
    }
    best.1
}

fn centroid_norms(centroids: &[f32], dimension: usize) -> Vec<f32> {
    centroids
        .chunks_exact(dimension)
        .map(|c| dot(c, c))
        .collect()
}

/// The little-endian `f32` at byte `at`.
#[inline]
fn f32_at(bytes: &[u8], at: usize) -> f32 {
    let mut raw = [0u8; 4];
    raw.copy_from_slice(&bytes[at..at + 4]);
    f32::from_le_bytes(raw)
}

/// Bits a code of `bits` bits is stored in: 1, 4 or 8.
fn stored_bits(bits: u8) -> usize {
    match bits {
        1 => 1,
        2..=4 => 4,
        _ => 8,
    }
}

fn code_bytes(dimension: usize, bits: u8) -> usize {
    (dimension * stored_bits(bits)).div_ceil(8)
}

/// Writes `codes` (one per dimension, each below `2^bits`) into `out` (`code_bytes` bytes, 0).
fn pack(codes: &[u8], bits: u8, out: &mut [u8]) {
    match stored_bits(bits) {
        1 => codes
            .iter()
            .enumerate()
            .for_each(|(i, u)| out[i / 8] |= u << (i % 8)),
        4 => codes
            .iter()
            .enumerate()
            .for_each(|(i, u)| out[i / 2] |= u << (4 * (i % 2))),
        _ => out.copy_from_slice(codes),
    }
}

/// Whether every code is below `2^bits` and every bit past the last dimension is 0, as `pack`
/// leaves them.
fn code_is_canonical(code: &[u8], dimension: usize, bits: u8) -> bool {
    let max = ((1u16 << bits) - 1) as u8;
    match stored_bits(bits) {
        1 => dimension.is_multiple_of(8) || code[code.len() - 1] >> (dimension % 8) == 0,
        4 => {
            code.iter().all(|byte| byte & 15 <= max && byte >> 4 <= max)
                && (dimension.is_multiple_of(2) || code[code.len() - 1] >> 4 == 0)
        }
        _ => code.iter().all(|&u| u <= max),
    }
}

/// Quantizes the rotated residual `residual` (not normalised) to one code per dimension in
/// `codes`; returns `<ȳ, residual>`.
fn quantize(residual: &[f32], bits: u8, codes: &mut Vec<u8>) -> f64 {
    codes.clear();
    if bits == 1 {
        codes.extend(residual.iter().map(|&r| (r > 0.0) as u8));
        return residual.iter().map(|r| r.abs() as f64).sum::<f64>() / 2.0;
    }
    let magnitudes: Vec<f64> = residual.iter().map(|r| r.abs() as f64).collect();
    let levels = nearest_levels(&magnitudes, bits);
    let middle = 1u32 << (bits - 1);
    let mut inner = 0f64;
    for ((r, m), k) in residual.iter().zip(&magnitudes).zip(&levels) {
        // `ȳ = ±(k + 1/2)`: `u = 2^(B-1) + k` above the middle, `2^(B-1) - 1 - k` below.
        let u = if *r >= 0.0 {
            middle + k
        } else {
            middle - 1 - k
        };
        codes.push(u as u8);
        inner += (*k as f64 + 0.5) * m;
    }
    inner
}

/// `best_levels` over every scale when that is at most `FULL_SWEEP_EVENTS` events (every
/// dimension up to 1,024 at 2 bits, 341 at 3, 146 at 4, 8 at 8), else over `SCALE_WINDOW`.
fn nearest_levels(magnitudes: &[f64], bits: u8) -> Vec<u32> {
    let max_level = (1u32 << (bits - 1)) - 1;
    if magnitudes.len() * max_level as usize <= FULL_SWEEP_EVENTS {
        best_levels(magnitudes, max_level, (0.0, f64::INFINITY))
    } else {
        best_levels(magnitudes, max_level, SCALE_WINDOW[bits as usize])
    }
}

const FULL_SWEEP_EVENTS: usize = 1024;

/// The scales `best_levels` sweeps when the full sweep is too long, by bits, as multiples of
/// `max_level / max|o|` (the scale at which the largest coordinate reaches the top level).
const SCALE_WINDOW: [(f64, f64); 9] = [
    // 0 and 1 bit: no levels to choose.
    (0.0, 0.0),
    (0.0, 0.0),
    // Around the best scales measured on Gaussian vectors (which rotated residuals are like)
    // of 8 to 3,000 dimensions, with a margin: from 1.0 to 4.4 at 2 bits, 0.67 (but 1.5
    // above 341 dimensions) to 2.8 at 3 bits, 0.71 to 1.9 at 4, 0.47 to 1.5 at 5, 0.58 to
    // 1.3 at 6, 0.71 to 1.1 at 7, 0.63 to 1.04 at 8.
    (1.0, f64::INFINITY),
    (1.0, f64::INFINITY),
    (0.5, 2.5),
    (0.4, 2.0),
    (0.5, 1.6),
    (0.6, 1.3),
    (0.6, 1.2),
];

/// The levels `k[i] = min(floor(t m[i]), max_level)` of the magnitudes `m` (not all need be
/// normalised) at the scale `t` that maximises the cosine between `k + 1/2` and `m`, among the
/// scales in `window` (multiples of `max_level / max(m)`). The cosine only changes where some
/// `k[i]` steps, at `t = (k[i] + 1) / m[i]`: those events are visited in order (sorted), each
/// updating `Σ (k + 1/2) m` and `Σ (k + 1/2)²` in constant time (Extended RaBitQ's
/// algorithm, which keeps the next event of each coordinate in a heap; sorting them all is
/// several times faster).
fn best_levels(magnitudes: &[f64], max_level: u32, window: (f64, f64)) -> Vec<u32> {
    let top = magnitudes.iter().fold(0f64, |a, &b| a.max(b));
    if top == 0.0 {
        return vec![0; magnitudes.len()];
    }
    let unit = max_level as f64 / top;
    let (t_start, t_end) = (window.0 * unit, window.1 * unit);
    let level_at = |m: f64| ((t_start * m).floor() as u32).min(max_level);
    let mut levels: Vec<u32> = magnitudes.iter().map(|&m| level_at(m)).collect();
    let mut numerator = 0f64;
    let mut squares = 0f64;
    // Every event in the window, known in advance: the scale's `f32` bits above the
    // coordinate, one `u64` (positive `f32`s order as their bits do; the rounding only changes
    // the order of near ties, and every state visited is a valid code whose cosine is computed
    // exactly), sorted.
    let mut events = Vec::with_capacity(magnitudes.len() * 2);
    for (i, (&m, &k)) in magnitudes.iter().zip(&levels).enumerate() {
        numerator += (k as f64 + 0.5) * m;
        squares += (k as f64 + 0.5) * (k as f64 + 0.5);
        if m > 0.0 {
            for level in k + 1..=max_level {
                let t = level as f64 / m;
                if t > t_end {
                    break;
                }
                events.push((((t as f32).to_bits() as u64) << 32) | i as u64);
            }
        }
    }
    events.sort_unstable();
    // The best cosine `numerator / sqrt(squares)`, compared squared and cross-multiplied.
    let (mut best_numerator, mut best_squares) = (numerator, squares);
    let mut best_steps = 0;
    for (step, key) in events.iter().enumerate() {
        let i = (key & u32::MAX as u64) as usize;
        levels[i] += 1;
        numerator += magnitudes[i];
        // `(k + 1/2)² - (k - 1/2)² = 2k`.
        squares += 2.0 * levels[i] as f64;
        if numerator * numerator * best_squares > best_numerator * best_numerator * squares {
            (best_numerator, best_squares) = (numerator, squares);
            best_steps = step + 1;
        }
    }
    let mut levels: Vec<u32> = magnitudes.iter().map(|&m| level_at(m)).collect();
    for key in &events[..best_steps] {
        levels[(key & u32::MAX as u64) as usize] += 1;
    }
    levels
}

/// A random orthogonal map of `dimension` values: `ROUNDS` rounds of signs, a normalised
/// Walsh-Hadamard transform of the leading `block` values, signs, the same of the trailing
/// `block`, and a butterfly between the two halves.
#[derive(Debug, Clone, PartialEq)]
struct Rotation {
    dimension: usize,
    /// The largest power of two not above `dimension`.
    block: usize,
    /// `2 * ROUNDS` sign vectors of `dimension` bits (a set bit flips), `words` each.
    signs: Vec<u64>,
    words: usize,
}

impl Rotation {
    fn new(dimension: usize, seed: u64) -> Rotation {
        assert!(dimension > 0);
        let words = dimension.div_ceil(64);
        let mut state = seed;
        let signs = (0..2 * ROUNDS * words)
            .map(|_| {
                state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
                let mut z = state;
                z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
                z ^ (z >> 31)
            })
            .collect();
        Rotation {
            dimension,
            block: 1 << (usize::BITS - 1 - dimension.leading_zeros()),
            signs,
            words,
        }
    }

    /// Rotates `values` in place.
    fn apply(&self, values: &mut [f32]) {
        assert_eq!(values.len(), self.dimension);
        let trailing = self.dimension - self.block;
        for signs in self.signs.chunks_exact(2 * self.words) {
            let (leading_signs, trailing_signs) = signs.split_at(self.words);
            flip_signs(values, leading_signs);
            walsh_hadamard(&mut values[..self.block]);
            flip_signs(values, trailing_signs);
            walsh_hadamard(&mut values[trailing..]);
            mix_halves(values);
        }
    }
}

/// Negates the values whose bit is set.
fn flip_signs(values: &mut [f32], signs: &[u64]) {
    let sign_byte = |k: usize| (signs[k / 8] >> (8 * (k % 8))) as u8 as usize;
    let n_full = values.len() / 8;
    let (full, rest) = values.split_at_mut(n_full * 8);
    for (k, chunk) in full.chunks_exact_mut(8).enumerate() {
        for (v, mask) in chunk.iter_mut().zip(&SIGN_MASKS[sign_byte(k)]) {
            *v = f32::from_bits(v.to_bits() ^ mask);
        }
    }
    if !rest.is_empty() {
        for (v, mask) in rest.iter_mut().zip(&SIGN_MASKS[sign_byte(n_full)]) {
            *v = f32::from_bits(v.to_bits() ^ mask);
        }
    }
}

/// For each byte of signs, the eight `f32` sign bits it flips (so flipping is a vector XOR).
static SIGN_MASKS: [[u32; 8]; 256] = {
    let mut table = [[0u32; 8]; 256];
    let mut byte = 0;
    while byte < 256 {
        let mut j = 0;
        while j < 8 {
            if (byte >> j) & 1 == 1 {
                table[byte][j] = 1 << 31;
            }
            j += 1;
        }
        byte += 1;
    }
    table
};

/// The normalised (orthogonal) fast Walsh-Hadamard transform of a power-of-two length.
fn walsh_hadamard(values: &mut [f32]) {
    let n = values.len();
    debug_assert!(n.is_power_of_two());
    let mut half = 1;
    if n >= 4 {
        // The first two stages at once, four values at a time (too short to vectorise apart).
        for v in values.chunks_exact_mut(4) {
            let (a, b, c, d) = (v[0] + v[1], v[0] - v[1], v[2] + v[3], v[2] - v[3]);
            v[0] = a + c;
            v[1] = b + d;
            v[2] = a - c;
            v[3] = b - d;
        }
        half = 4;
    }
    while half < n {
        for block in values.chunks_exact_mut(2 * half) {
            let (low, high) = block.split_at_mut(half);
            for (a, b) in low.iter_mut().zip(high) {
                let (x, y) = (*a, *b);
                *a = x + y;
                *b = x - y;
            }
        }
        half *= 2;
    }
    let norm = 1.0 / (n as f32).sqrt();
    values.iter_mut().for_each(|v| *v *= norm);
}

/// Mixes value `i` of the first half with value `i` of the second,
/// `(a, b) -> (a + b, a - b) / √2`; the middle value of an odd length is left alone.
fn mix_halves(values: &mut [f32]) {
    let half = values.len() / 2;
    let (low, high) = values.split_at_mut(values.len() - half);
    for (a, b) in low.iter_mut().zip(high) {
        let (x, y) = (*a, *b);
        *a = (x + y) * std::f32::consts::FRAC_1_SQRT_2;
        *b = (x - y) * std::f32::consts::FRAC_1_SQRT_2;
    }
}

#[cfg(test)]
mod tests {
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    use super::*;
    use crate::quantized::tests::vectors;

    fn gaussian(rng: &mut StdRng, dimension: usize) -> Vec<f32> {
        // Box-Muller.
        (0..dimension)
            .map(|_| {
                let u: f64 = rng.random_range(f64::EPSILON..1.0);
                let v: f64 = rng.random_range(0.0..1.0);
                ((-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()) as f32
            })
            .collect()
    }

    fn dot64(a: &[f32], b: &[f32]) -> f64 {
        a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum()
    }

    /// `<ȳ, v>` for codes `u` of `bits` bits.
    fn code_dot(codes: &[u8], bits: u8, v: &[f32]) -> f64 {
        let half_range = ((1u32 << bits) - 1) as f64 / 2.0;
        codes
            .iter()
            .zip(v)
            .map(|(&u, &x)| (u as f64 - half_range) * x as f64)
            .sum()
    }

    fn cosine(levels: &[u32], magnitudes: &[f64]) -> f64 {
        let numerator: f64 = levels
            .iter()
            .zip(magnitudes)
            .map(|(&k, m)| (k as f64 + 0.5) * m)
            .sum();
        let squares: f64 = levels.iter().map(|&k| (k as f64 + 0.5).powi(2)).sum();
        numerator / squares.sqrt()
    }

    #[test]
    fn rotation_preserves_norms_and_inner_products() {
        let mut rng = StdRng::seed_from_u64(1);
        for dimension in [1, 2, 7, 64, 100, 384, 1000] {
            for seed in 0..5 {
                let rotation = Rotation::new(dimension, seed);
                let a = gaussian(&mut rng, dimension);
                let b = gaussian(&mut rng, dimension);
                let (mut pa, mut pb) = (a.clone(), b.clone());
                rotation.apply(&mut pa);
                rotation.apply(&mut pb);
                let (na, nb) = (dot64(&a, &a), dot64(&b, &b));
                assert!(
                    (dot64(&pa, &pa) - na).abs() <= 1e-5 * na,
                    "D {dimension} seed {seed}: |Pa|² {} against {na}",
                    dot64(&pa, &pa)
                );
                assert!(
                    (dot64(&pa, &pb) - dot64(&a, &b)).abs() <= 1e-5 * (na * nb).sqrt(),
                    "D {dimension} seed {seed}: <Pa, Pb> {} against {}",
                    dot64(&pa, &pb),
                    dot64(&a, &b)
                );
            }
        }
        // It mixes: every coordinate ends up spread over all of them, as a random rotation
        // would spread it (no image of a basis vector keeps a large share in one place).
        for dimension in [64, 100, 384, 1000] {
            let rotation = Rotation::new(dimension, 7);
            for j in 0..dimension {
                let mut basis = vec![0f32; dimension];
                basis[j] = 1.0;
                rotation.apply(&mut basis);
                let largest = basis.iter().fold(0f32, |m, x| m.max(x * x));
                assert!(
                    largest < 40.0 / dimension as f32,
                    "D {dimension}: e{j} keeps {largest} in one coordinate"
                );
            }
        }
        // Another seed, another rotation.
        let (mut a, mut b) = (vec![1f32; 100], vec![1f32; 100]);
        Rotation::new(100, 1).apply(&mut a);
        Rotation::new(100, 2).apply(&mut b);
        assert_ne!(a, b);
    }

    /// RaBitQ's guarantee, over random rotations of fixed vectors: the estimate of `<o, q>` is
    /// unbiased, and each one is within `ε0 · sqrt((1 - a²) / a²) / sqrt(D - 1)` (`a` the
    /// cosine between the code and `o`) but for a fraction that falls like `exp(-ε0² / 2)`.
    #[test]
    fn inner_product_estimates_are_unbiased_and_within_the_bound() {
        let dimension = 128;
        let n_rotations = 1000;
        let mut rng = StdRng::seed_from_u64(2);
        for bits in [1u8, 2, 4] {
            for pair in 0..4 {
                let x = gaussian(&mut rng, dimension);
                // A query correlated with x, as a neighbour's would be, for the later pairs.
                let noise = gaussian(&mut rng, dimension);
                let weight = pair as f32 / 4.0;
                let q: Vec<f32> = x
                    .iter()
                    .zip(&noise)
                    .map(|(a, b)| weight * a + (1.0 - weight) * b)
                    .collect();
                let exact = dot64(&x, &q) / (dot64(&x, &x) * dot64(&q, &q)).sqrt();
                let (mut errors, mut bounds) = (Vec::new(), Vec::new());
                let mut codes = Vec::new();
                for seed in 0..n_rotations {
                    let rotation = Rotation::new(dimension, 1000 * pair + seed);
                    let (mut o, mut q_rotated) = (x.clone(), q.clone());
                    rotation.apply(&mut o);
                    rotation.apply(&mut q_rotated);
                    let norm = dot64(&o, &o).sqrt() as f32;
                    o.iter_mut().for_each(|v| *v /= norm);
                    let norm = dot64(&q_rotated, &q_rotated).sqrt() as f32;
                    q_rotated.iter_mut().for_each(|v| *v /= norm);
                    let inner = quantize(&o, bits, &mut codes);
                    assert!((inner - code_dot(&codes, bits, &o)).abs() < 1e-6);
                    let estimate = code_dot(&codes, bits, &q_rotated) / inner;
                    let code_norm = code_dot(&codes, bits, &codes_as_values(&codes, bits)).sqrt();
                    let a = inner / code_norm;
                    errors.push(estimate - exact);
                    bounds.push(((1.0 - a * a) / (a * a)).sqrt() / (dimension as f64 - 1.0).sqrt());
                }
                let n = n_rotations as f64;
                let mean_error = errors.iter().sum::<f64>() / n;
                let mean_bound = bounds.iter().sum::<f64>() / n;
                // The bound (ε0 = 1) is at least the standard deviation of one estimate, so 4
                // bounds over √n is 4 standard deviations of the mean.
                assert!(
                    mean_error.abs() < 4.0 * mean_bound / n.sqrt(),
                    "bits {bits} pair {pair}: mean error {mean_error}, bound {mean_bound}"
                );
                let beyond = |epsilon: f64| {
                    errors
                        .iter()
                        .zip(&bounds)
                        .filter(|(e, b)| e.abs() > epsilon * **b)
                        .count() as f64
                        / n
                };
                // A normal tail: 5.7% beyond 1.9 and 0.27% beyond 3 standard deviations.
                assert!(
                    beyond(1.9) < 0.1,
                    "bits {bits} pair {pair}: {}",
                    beyond(1.9)
                );
                assert!(
                    beyond(3.0) < 0.01,
                    "bits {bits} pair {pair}: {}",
                    beyond(3.0)
                );
            }
        }
    }

    /// The codes' values `ȳ + (2^B - 1)/2` as `f32`s, so `code_dot` of codes with them is
    /// `|ȳ|²`.
    fn codes_as_values(codes: &[u8], bits: u8) -> Vec<f32> {
        let half_range = ((1u32 << bits) - 1) as f32 / 2.0;
        codes.iter().map(|&u| u as f32 - half_range).collect()
    }

    /// Extended RaBitQ's codes: the best levels are the best among every scale's (the full
    /// sweep), and the windows of scales swept for 4 bits and more find them.
    #[test]
    fn multi_bit_codes_are_the_nearest_directions() {
        let mut rng = StdRng::seed_from_u64(3);
        for bits in 2..=8u8 {
            let max_level = (1u32 << (bits - 1)) - 1;
            for dimension in [3, 16, 128, 384, 1000] {
                for _ in 0..5 {
                    let o = gaussian(&mut rng, dimension);
                    let norm = dot64(&o, &o).sqrt();
                    let magnitudes: Vec<f64> = o.iter().map(|x| x.abs() as f64 / norm).collect();
                    let full = best_levels(&magnitudes, max_level, (0.0, f64::INFINITY));
                    let windowed = nearest_levels(&magnitudes, bits);
                    let best = cosine(&full, &magnitudes);
                    // Within 1% of the best code's distance to the vector.
                    assert!(
                        1.0 - cosine(&windowed, &magnitudes) <= (1.0 - best) * 1.01,
                        "bits {bits} D {dimension}: {} against {best}",
                        cosine(&windowed, &magnitudes)
                    );
                    assert!(full.iter().chain(&windowed).all(|&k| k <= max_level));
                    // No single step of one level, up or down, does better than the sweep.
                    for i in 0..dimension {
                        for step in [-1i64, 1] {
                            let k = full[i] as i64 + step;
                            if (0..=max_level as i64).contains(&k) {
                                let mut other = full.clone();
                                other[i] = k as u32;
                                assert!(cosine(&other, &magnitudes) <= best + 1e-12);
                            }
                        }
                    }
                }
            }
        }
        // More bits, a code nearer the vector.
        let o = gaussian(&mut rng, 384);
        let mut codes = Vec::new();
        let mut previous = 0.0;
        for bits in 1..=8u8 {
            let inner = quantize(&o, bits, &mut codes);
            let code_norm = code_dot(&codes, bits, &codes_as_values(&codes, bits)).sqrt();
            let a = inner / code_norm / dot64(&o, &o).sqrt();
            assert!(a > previous, "bits {bits}: cosine {a} after {previous}");
            previous = a;
        }
        assert!(previous > 0.9999, "8 bits: cosine {previous}");
    }

    fn prepared(metric: Metric, mut data: Vec<f32>, dimension: usize) -> Vec<f32> {
        data.chunks_exact_mut(dimension).for_each(|v| {
            metric.prepare(v);
        });
        data
    }

    /// Mean absolute error of the estimated distances of every slot to each query, over the
    /// mean exact distance; for `Dot`, of the estimated dot products over the mean `|x| |q|`
    /// (its distances are a map of the dot product, flat for large ones).
    fn relative_error(codes: &RabitqCodes, data: &[f32], queries: &[f32], metric: Metric) -> f64 {
        let dimension = codes.dimension;
        let (mut error, mut total) = (0f64, 0f64);
        for query in queries.chunks_exact(dimension) {
            let prepared = codes.query(query, metric);
            for (slot, vector) in data.chunks_exact(dimension).enumerate() {
                let exact = metric.distance(query, vector);
                let estimate = prepared.distance(slot as u32);
                if metric == Metric::Dot {
                    error += (metric.score(estimate) - metric.score(exact)).abs() as f64;
                    total += (dot64(query, query) * dot64(vector, vector)).sqrt();
                } else {
                    error += (estimate - exact).abs() as f64;
                    total += exact as f64;
                }
            }
        }
        error / total
    }

    #[test]
    fn distances_approximate_the_metric_and_more_bits_approximate_it_better() {
        let dimension = 96;
        for metric in [Metric::L2, Metric::Cosine, Metric::Dot] {
            let all = prepared(
                metric,
                tarn_testkit::clustered_vectors(1010, dimension, 10, 4),
                dimension,
            );
            let (data, queries) = all.split_at(1000 * dimension);
            let errors: Vec<f64> = (1..=8u8)
                .map(|bits| {
                    let codes = RabitqCodes::encode(data, dimension, bits, 5);
                    assert_eq!((codes.bits(), codes.n_slots()), (bits, 1000));
                    relative_error(&codes, data, queries, metric)
                })
                .collect();
            println!("{metric:?}: relative errors by bits {errors:.5?}");
            assert!(errors[0] < 0.1, "{metric:?} 1 bit: {}", errors[0]);
            for bits in 2..=8 {
                assert!(
                    errors[bits - 1] < errors[bits - 2],
                    "{metric:?}: {bits} bits no better than {}: {errors:?}",
                    bits - 1
                );
            }
            assert!(errors[3] < errors[0] / 4.0, "{metric:?}: {errors:?}");
            assert!(errors[7] < 0.002, "{metric:?} 8 bits: {errors:?}");
        }
        // A partition of one vector (its residual is 0) is exact, and so is an empty one.
        let single = RabitqCodes::encode(&[0.6, 0.8, 0.0], 3, 1, 9);
        for metric in [Metric::L2, Metric::Cosine, Metric::Dot] {
            let query = [0.0, 0.6, 0.8];
            let got = single.query(&query, metric).distance(0);
            let exact = metric.distance(&query, &[0.6, 0.8, 0.0]);
            assert!(
                (got - exact).abs() < 1e-6,
                "{metric:?}: {got} against {exact}"
            );
        }
        let empty = RabitqCodes::encode(&[], 5, 3, 9);
        assert_eq!(empty.n_slots(), 0);
        assert!(empty.memory_bytes() > 0);
    }

    #[test]
    fn recall_at_10_of_1_bit_codes_rescoring_10_per_result_is_above_0_95() {
        let (dimension, n, k, rescore) = (128, 3000, 10, 10);
        for metric in [Metric::L2, Metric::Cosine, Metric::Dot] {
            let all = prepared(
                metric,
                tarn_testkit::clustered_vectors(n + 20, dimension, 30, 6),
                dimension,
            );
            let (data, queries) = all.split_at(n * dimension);
            let codes = RabitqCodes::encode(data, dimension, 1, 7);
            let (mut rescored_recall, mut raw_recall) = (0.0, 0.0);
            for query in queries.chunks_exact(dimension) {
                // The exact top k (testkit's oracle takes the other build's `Metric`).
                let mut exact: Vec<(f32, usize)> = data
                    .chunks_exact(dimension)
                    .enumerate()
                    .map(|(slot, vector)| (metric.distance(query, vector), slot))
                    .collect();
                exact.sort_by(|a, b| a.0.total_cmp(&b.0));
                let truth: Vec<usize> = exact.iter().take(k).map(|e| e.1).collect();
                let prepared = codes.query(query, metric);
                let mut estimated: Vec<(f32, usize)> = (0..n)
                    .map(|slot| (prepared.distance(slot as u32), slot))
                    .collect();
                estimated.sort_by(|a, b| a.0.total_cmp(&b.0));
                let raw: Vec<usize> = estimated.iter().take(k).map(|e| e.1).collect();
                raw_recall += tarn_testkit::recall(&raw, &truth, k);
                let mut rescored: Vec<(f32, usize)> = estimated[..k * rescore]
                    .iter()
                    .map(|&(_, slot)| {
                        let vector = &data[slot * dimension..][..dimension];
                        (metric.distance(query, vector), slot)
                    })
                    .collect();
                rescored.sort_by(|a, b| a.0.total_cmp(&b.0));
                let found: Vec<usize> = rescored.iter().take(k).map(|e| e.1).collect();
                rescored_recall += tarn_testkit::recall(&found, &truth, k);
            }
            let n_queries = (queries.len() / dimension) as f64;
            let (rescored_recall, raw_recall) =
                (rescored_recall / n_queries, raw_recall / n_queries);
            println!(
                "{metric:?}: recall@10 {raw_recall:.3} on the codes, {rescored_recall:.3} rescored"
            );
            assert!(
                rescored_recall >= 0.95,
                "{metric:?}: recall@10 {rescored_recall} rescoring {rescore} per result"
            );
        }
    }

    #[test]
    fn sections_round_trip_and_damaged_ones_are_errors() {
        for (bits, dimension) in [
            (1u8, 13),
            (1, 16),
            (2, 7),
            (3, 8),
            (4, 9),
            (5, 5),
            (7, 6),
            (8, 11),
        ] {
            let data = vectors(30, dimension, 8);
            let codes = RabitqCodes::encode(&data, dimension, bits, 9);
            let bytes = codes.encode_section();
            let decoded = RabitqCodes::decode_section(&bytes, 30, dimension).unwrap();
            assert_eq!(decoded, codes);
            let query = vectors(1, dimension, 10);
            let (a, b) = (
                codes.query(&query, Metric::L2),
                decoded.query(&query, Metric::L2),
            );
            assert!((0..30).all(|slot| a.distance(slot) == b.distance(slot)));
            assert_eq!(
                a.codes_of(3),
                &codes.records[3 * codes.stride()..][..codes.stride()]
            );

            let decode = |bytes: &[u8]| RabitqCodes::decode_section(bytes, 30, dimension);
            assert!(RabitqCodes::decode_section(&bytes, 31, dimension).is_err());
            assert!(RabitqCodes::decode_section(&bytes, 29, dimension).is_err());
            assert!(RabitqCodes::decode_section(&bytes, 30, dimension + 1).is_err());
            assert!(RabitqCodes::decode_section(&bytes, 30, 0).is_err());
            assert!(RabitqCodes::decode_section(&bytes, usize::MAX, dimension).is_err());
            for cut in 0..bytes.len() {
                assert!(decode(&bytes[..cut]).is_err(), "cut at {cut}");
            }
            let mut longer = bytes.clone();
            longer.push(0);
            assert!(decode(&longer).is_err());
            let header = 4 + 1 + 8 + 4;
            let records = header + codes.centroids.len() * 4;
            for bad_count in [0u32, MAX_CENTROIDS as u32 + 1, u32::MAX] {
                let mut damaged = bytes.clone();
                damaged[13..17].copy_from_slice(&bad_count.to_le_bytes());
                assert!(decode(&damaged).is_err(), "{bad_count} centroids");
            }
            for bad_bits in [0u8, 9, 255] {
                let mut damaged = bytes.clone();
                damaged[4] = bad_bits;
                assert!(decode(&damaged).is_err(), "{bad_bits} bits");
            }
            for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                // A centroid, then each factor of the last slot.
                let factors = records + 29 * codes.stride() + codes.code_bytes;
                for at in [header, factors, factors + 4, factors + 8] {
                    let mut damaged = bytes.clone();
                    damaged[at..at + 4].copy_from_slice(&bad.to_le_bytes());
                    assert!(decode(&damaged).is_err(), "{bad} at {at}");
                }
                // A negative scale cannot be.
                let mut damaged = bytes.clone();
                damaged[factors..factors + 4].copy_from_slice(&(-1f32).to_le_bytes());
                assert!(decode(&damaged).is_err(), "a negative scale");
                // Nor a centroid the section does not have.
                let mut damaged = bytes.clone();
                damaged[factors + 12] = (codes.centroids.len() / dimension) as u8;
                assert!(decode(&damaged).is_err(), "a centroid past the last");
            }
            // Codes beyond their bits or set padding bits are not what an encoder wrote.
            let last_code_byte = records + codes.code_bytes - 1;
            let mut damaged = bytes.clone();
            damaged[last_code_byte] = 0xff;
            let canonical =
                bits == 8 || (bits == 4 && dimension % 2 == 0) || (bits == 1 && dimension % 8 == 0);
            assert_eq!(
                decode(&damaged).is_ok(),
                canonical,
                "bits {bits} D {dimension}"
            );
            // Whatever the damage, an error or codes, never a panic.
            let mut rng = StdRng::seed_from_u64(bits as u64);
            for _ in 0..300 {
                let mut damaged = bytes.clone();
                for _ in 0..rng.random_range(1..4) {
                    let at = rng.random_range(0..damaged.len());
                    damaged[at] = rng.random();
                }
                if let Ok(codes) = decode(&damaged) {
                    let prepared = codes.query(&query, Metric::Dot);
                    (0..30).for_each(|slot| {
                        prepared.distance(slot);
                    });
                }
            }
        }
        // An empty partition's section.
        let empty = RabitqCodes::encode(&[], 4, 1, 0);
        assert_eq!(
            RabitqCodes::decode_section(&empty.encode_section(), 0, 4).unwrap(),
            empty
        );
    }

    #[test]
    #[should_panic(expected = "RaBitQ codes of 9 bits")]
    fn nine_bits_are_refused() {
        RabitqCodes::encode(&[1.0, 2.0], 2, 9, 0);
    }

    #[test]
    #[should_panic(expected = "RaBitQ codes of 0 bits")]
    fn zero_bits_are_refused() {
        RabitqCodes::encode(&[1.0, 2.0], 2, 0, 0);
    }
}
