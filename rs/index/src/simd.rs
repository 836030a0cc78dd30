//! Distance kernels chosen at run time for the CPU at hand (AVX-512F, AVX2+FMA, or portable
//! code the compiler vectorises for the x86-64 baseline), and a cache prefetch hint.
//!
//! This is the one module of tarn that uses `unsafe`: `std::arch` intrinsics and `madvise`
//! need it. Each `unsafe` block says why it is sound; the kernels are checked against a naive
//! sum at every length from 0 to 200 on every CPU the tests run on. Why hand-written and not a
//! crate: simsimd, the well-kept crate for this, is a C library (a C build step, an FFI call per
//! distance, `f64` results) and prefetching has no stable safe API at all; these kernels are
//! about 150 lines. `benches/search_kernels.rs` measures each set against the portable one.
#![allow(unsafe_code)]

use std::sync::LazyLock;

/// A distance kernel over two slices of equal length.
pub type Kernel = fn(&[f32], &[f32]) -> f32;

/// The dot product of `f32` weights and unsigned integer codes packed in bytes: over the first
/// `min(weights, codes)` values, where the bytes hold 8, 2 or 1 codes each by the kernel
/// (`dot_u1`, `dot_u4`, `dot_u8`). Quantized vectors (`quantized.rs`, `rabitq.rs`) keep their
/// codes so; the query's weights carry whatever scaling the codes need.
pub type CodeKernel = fn(&[f32], &[u8]) -> f32;

/// One set of distance kernels.
#[derive(Debug, Clone, Copy)]
pub struct Kernels {
    pub name: &'static str,
    pub dot: Kernel,
    pub l2_squared: Kernel,
    /// One byte per code (int8 codes; RaBitQ codes of 5 to 8 bits).
    pub dot_u8: CodeKernel,
    /// Two codes per byte, the low nibble first (RaBitQ codes of 2 to 4 bits).
    pub dot_u4: CodeKernel,
    /// Eight one-bit codes per byte, the lowest bit first: the sum of the weights whose bit is
    /// set (1-bit RaBitQ codes).
    pub dot_u1: CodeKernel,
}

static KERNELS: LazyLock<Kernels> = LazyLock::new(detect);

/// The kernels in use: the fastest this CPU supports, detected once, unless the environment
/// variable `TARN_SIMD` names another supported set (`portable`, `avx2+fma`, `avx512f`; for
/// benchmarks and for ruling the kernels out when debugging).
#[inline]
pub fn kernels() -> &'static Kernels {
    &KERNELS
}

fn detect() -> Kernels {
    if let Ok(wanted) = std::env::var("TARN_SIMD") {
        if let Some(table) = supported().into_iter().find(|t| t.name == wanted) {
            return table;
        }
    }
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            return x86::AVX512;
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            return x86::AVX2;
        }
    }
    PORTABLE
}

/// Kernels for any CPU: eight independent accumulators, which the compiler vectorises for the
/// baseline instruction set.
pub(crate) const PORTABLE: Kernels = Kernels {
    name: "portable",
    dot: portable_dot,
    l2_squared: portable_l2_squared,
    dot_u8: portable_dot_u8,
    dot_u4: portable_dot_u4,
    dot_u1: portable_dot_u1,
};

fn portable_dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0.0f32; 8];
    let mut chunks_a = a.chunks_exact(8);
    let mut chunks_b = b.chunks_exact(8);
    for (x, y) in (&mut chunks_a).zip(&mut chunks_b) {
        for j in 0..8 {
            acc[j] += x[j] * y[j];
        }
    }
    let tail: f32 = chunks_a
        .remainder()
        .iter()
        .zip(chunks_b.remainder())
        .map(|(x, y)| x * y)
        .sum();
    acc.iter().sum::<f32>() + tail
}

fn portable_dot_u8(a: &[f32], codes: &[u8]) -> f32 {
    let n = a.len().min(codes.len());
    let (a, codes) = (&a[..n], &codes[..n]);
    let mut acc = [0.0f32; 8];
    let mut chunks_a = a.chunks_exact(8);
    let mut chunks_c = codes.chunks_exact(8);
    for (x, c) in (&mut chunks_a).zip(&mut chunks_c) {
        for j in 0..8 {
            acc[j] += x[j] * c[j] as f32;
        }
    }
    let tail: f32 = chunks_a
        .remainder()
        .iter()
        .zip(chunks_c.remainder())
        .map(|(x, c)| x * *c as f32)
        .sum();
    acc.iter().sum::<f32>() + tail
}

fn portable_dot_u4(a: &[f32], codes: &[u8]) -> f32 {
    let n = a.len().min(codes.len() * 2);
    let a = &a[..n];
    let mut acc = [0.0f32; 8];
    let mut chunks_a = a.chunks_exact(8);
    for (x, c) in (&mut chunks_a).zip(codes.chunks_exact(4)) {
        for j in 0..4 {
            acc[2 * j] += x[2 * j] * (c[j] & 15) as f32;
            acc[2 * j + 1] += x[2 * j + 1] * (c[j] >> 4) as f32;
        }
    }
    let done = n - chunks_a.remainder().len();
    let tail: f32 = (done..n)
        .map(|i| a[i] * ((codes[i / 2] >> (4 * (i % 2))) & 15) as f32)
        .sum();
    acc.iter().sum::<f32>() + tail
}

fn portable_dot_u1(a: &[f32], bits: &[u8]) -> f32 {
    let n = a.len().min(bits.len() * 8);
    let a = &a[..n];
    let mut acc = [0.0f32; 8];
    let mut chunks_a = a.chunks_exact(8);
    for (x, byte) in (&mut chunks_a).zip(bits) {
        for j in 0..8 {
            // The weight's bits, or 0: a mask the compiler keeps in vector lanes.
            let keep = 0u32.wrapping_sub(((byte >> j) & 1) as u32);
            acc[j] += f32::from_bits(x[j].to_bits() & keep);
        }
    }
    let done = n - chunks_a.remainder().len();
    let tail: f32 = (done..n)
        .map(|i| a[i] * ((bits[i / 8] >> (i % 8)) & 1) as f32)
        .sum();
    acc.iter().sum::<f32>() + tail
}

fn portable_l2_squared(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0.0f32; 8];
    let mut chunks_a = a.chunks_exact(8);
    let mut chunks_b = b.chunks_exact(8);
    for (x, y) in (&mut chunks_a).zip(&mut chunks_b) {
        for j in 0..8 {
            let d = x[j] - y[j];
            acc[j] += d * d;
        }
    }
    let tail: f32 = chunks_a
        .remainder()
        .iter()
        .zip(chunks_b.remainder())
        .map(|(x, y)| (x - y) * (x - y))
        .sum();
    acc.iter().sum::<f32>() + tail
}

/// Hints the CPU to start loading the first `lines` 64-byte cache lines of `data` (16 `f32` or
/// `u32` per line). Never faults, whatever the address; a no-op off x86-64.
#[inline(always)]
pub(crate) fn prefetch<T>(data: &[T], lines: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let lines = lines.min(std::mem::size_of_val(data).div_ceil(64));
        let start = data.as_ptr().cast::<i8>();
        for line in 0..lines {
            // SAFETY: SSE is part of the x86-64 baseline, so the intrinsic's target feature is
            // always present; a prefetch is a hint that never faults and reads nothing into the
            // program, and the pointer stays within `data`'s bytes.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(start.add(line * 64)) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (data, lines);
    }
}

/// An empty vector with room for `capacity` values whose memory the kernel is asked to back
/// with transparent huge pages (2 MiB) where it allows them (`madvise`): a graph search touches
/// vectors all over a large array, and with 4 KiB pages nearly every touch misses the TLB.
pub(crate) fn huge_page_vec(capacity: usize) -> Vec<f32> {
    let vec: Vec<f32> = Vec::with_capacity(capacity);
    let bytes = capacity * 4;
    const HUGE: usize = 2 << 20;
    if bytes >= 2 * HUGE {
        let start = vec.as_ptr() as usize;
        let page = 4096;
        let aligned = start.div_ceil(page) * page;
        let len = (start + bytes - aligned) / page * page;
        // SAFETY: the range lies inside this vector's own allocation, which nothing else uses;
        // MADV_HUGEPAGE only changes how the kernel backs the pages, never their contents.
        let _ = unsafe {
            rustix::mm::madvise(aligned as *mut _, len, rustix::mm::Advice::LinuxHugepage)
        };
    }
    vec
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::Kernels;

    // The safe wrappers below are reachable only through these tables, and `detect` hands a
    // table out only after `is_x86_feature_detected!` confirmed every feature it needs.
    pub(super) const AVX2: Kernels = Kernels {
        name: "avx2+fma",
        dot: dot_avx2,
        l2_squared: l2_avx2,
        dot_u8: dot_u8_avx2,
        dot_u4: dot_u4_avx2,
        dot_u1: dot_u1_avx2,
    };
    pub(super) const AVX512: Kernels = Kernels {
        name: "avx512f",
        dot: dot_avx512,
        l2_squared: l2_avx512,
        dot_u8: dot_u8_avx512,
        dot_u4: dot_u4_avx512,
        dot_u1: dot_u1_avx512,
    };

    fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
        // SAFETY: only reachable through AVX2, handed out after AVX2 and FMA were detected.
        unsafe { dot_avx2_impl(a, b) }
    }

    fn l2_avx2(a: &[f32], b: &[f32]) -> f32 {
        // SAFETY: as for `dot_avx2`.
        unsafe { l2_avx2_impl(a, b) }
    }

    fn dot_avx512(a: &[f32], b: &[f32]) -> f32 {
        // SAFETY: only reachable through AVX512, handed out after AVX-512F was detected.
        unsafe { dot_avx512_impl(a, b) }
    }

    fn l2_avx512(a: &[f32], b: &[f32]) -> f32 {
        // SAFETY: as for `dot_avx512`.
        unsafe { l2_avx512_impl(a, b) }
    }

    fn dot_u8_avx2(a: &[f32], codes: &[u8]) -> f32 {
        // SAFETY: as for `dot_avx2`.
        unsafe { dot_u8_avx2_impl(a, codes) }
    }

    fn dot_u8_avx512(a: &[f32], codes: &[u8]) -> f32 {
        // SAFETY: as for `dot_avx512`.
        unsafe { dot_u8_avx512_impl(a, codes) }
    }

    fn dot_u4_avx2(a: &[f32], codes: &[u8]) -> f32 {
        // SAFETY: as for `dot_avx2`.
        unsafe { dot_u4_avx2_impl(a, codes) }
    }

    fn dot_u4_avx512(a: &[f32], codes: &[u8]) -> f32 {
        // SAFETY: as for `dot_avx512`.
        unsafe { dot_u4_avx512_impl(a, codes) }
    }

    fn dot_u1_avx2(a: &[f32], bits: &[u8]) -> f32 {
        // SAFETY: as for `dot_avx2`.
        unsafe { dot_u1_avx2_impl(a, bits) }
    }

    fn dot_u1_avx512(a: &[f32], bits: &[u8]) -> f32 {
        // SAFETY: as for `dot_avx512`.
        unsafe { dot_u1_avx512_impl(a, bits) }
    }

    /// Horizontal sum of eight lanes.
    #[target_feature(enable = "avx2")]
    fn sum256(v: __m256) -> f32 {
        let low = _mm256_castps256_ps128(v);
        let high = _mm256_extractf128_ps::<1>(v);
        let s = _mm_add_ps(low, high);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps::<0b01>(s, s));
        _mm_cvtss_f32(s)
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn dot_avx2_impl(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        // SAFETY (all loads): every offset read is below `n`, the length of both slices.
        while i + 32 <= n {
            for (j, acc) in acc.iter_mut().enumerate() {
                let x = unsafe { _mm256_loadu_ps(pa.add(i + 8 * j)) };
                let y = unsafe { _mm256_loadu_ps(pb.add(i + 8 * j)) };
                *acc = _mm256_fmadd_ps(x, y, *acc);
            }
            i += 32;
        }
        while i + 8 <= n {
            let x = unsafe { _mm256_loadu_ps(pa.add(i)) };
            let y = unsafe { _mm256_loadu_ps(pb.add(i)) };
            acc[0] = _mm256_fmadd_ps(x, y, acc[0]);
            i += 8;
        }
        let sum = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        let mut total = sum256(sum);
        for j in i..n {
            total += a[j] * b[j];
        }
        total
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn l2_avx2_impl(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        // SAFETY (all loads): every offset read is below `n`, the length of both slices.
        while i + 32 <= n {
            for (j, acc) in acc.iter_mut().enumerate() {
                let x = unsafe { _mm256_loadu_ps(pa.add(i + 8 * j)) };
                let y = unsafe { _mm256_loadu_ps(pb.add(i + 8 * j)) };
                let d = _mm256_sub_ps(x, y);
                *acc = _mm256_fmadd_ps(d, d, *acc);
            }
            i += 32;
        }
        while i + 8 <= n {
            let x = unsafe { _mm256_loadu_ps(pa.add(i)) };
            let y = unsafe { _mm256_loadu_ps(pb.add(i)) };
            let d = _mm256_sub_ps(x, y);
            acc[0] = _mm256_fmadd_ps(d, d, acc[0]);
            i += 8;
        }
        let sum = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        let mut total = sum256(sum);
        for j in i..n {
            let d = a[j] - b[j];
            total += d * d;
        }
        total
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn dot_u8_avx2_impl(a: &[f32], codes: &[u8]) -> f32 {
        let n = a.len().min(codes.len());
        let (pa, pc) = (a.as_ptr(), codes.as_ptr());
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        // SAFETY (all loads): every offset read is below `n`, the length of both slices; each
        // code load reads 8 bytes (`_mm_loadl_epi64`) starting at `i + 8 * j`.
        while i + 32 <= n {
            for (j, acc) in acc.iter_mut().enumerate() {
                let c = unsafe { _mm_loadl_epi64(pc.add(i + 8 * j).cast()) };
                let c = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(c));
                let x = unsafe { _mm256_loadu_ps(pa.add(i + 8 * j)) };
                *acc = _mm256_fmadd_ps(x, c, *acc);
            }
            i += 32;
        }
        while i + 8 <= n {
            let c = unsafe { _mm_loadl_epi64(pc.add(i).cast()) };
            let c = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(c));
            let x = unsafe { _mm256_loadu_ps(pa.add(i)) };
            acc[0] = _mm256_fmadd_ps(x, c, acc[0]);
            i += 8;
        }
        let sum = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        let mut total = sum256(sum);
        for j in i..n {
            total += a[j] * codes[j] as f32;
        }
        total
    }

    #[target_feature(enable = "avx512f")]
    unsafe fn dot_u8_avx512_impl(a: &[f32], codes: &[u8]) -> f32 {
        let n = a.len().min(codes.len());
        let (pa, pc) = (a.as_ptr(), codes.as_ptr());
        let mut acc = [_mm512_setzero_ps(); 4];
        let mut i = 0;
        // SAFETY (all loads): every offset read is below `n`, the length of both slices; each
        // code load reads 16 bytes starting at `i + 16 * j`.
        while i + 64 <= n {
            for (j, acc) in acc.iter_mut().enumerate() {
                let c = unsafe { _mm_loadu_si128(pc.add(i + 16 * j).cast()) };
                let c = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(c));
                let x = unsafe { _mm512_loadu_ps(pa.add(i + 16 * j)) };
                *acc = _mm512_fmadd_ps(x, c, *acc);
            }
            i += 64;
        }
        while i + 16 <= n {
            let c = unsafe { _mm_loadu_si128(pc.add(i).cast()) };
            let c = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(c));
            let x = unsafe { _mm512_loadu_ps(pa.add(i)) };
            acc[0] = _mm512_fmadd_ps(x, c, acc[0]);
            i += 16;
        }
        let sum = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
        let mut total = _mm512_reduce_add_ps(sum);
        for j in i..n {
            total += a[j] * codes[j] as f32;
        }
        total
    }

    /// Sixteen nibbles in value order (low nibble of byte 0, its high nibble, then byte 1...)
    /// from the low 8 bytes of `packed`, one per byte.
    #[target_feature(enable = "avx2")]
    fn unpack_nibbles(packed: __m128i) -> __m128i {
        let low_nibbles = _mm_set1_epi8(0x0f);
        let low = _mm_and_si128(packed, low_nibbles);
        let high = _mm_and_si128(_mm_srli_epi16::<4>(packed), low_nibbles);
        _mm_unpacklo_epi8(low, high)
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn dot_u4_avx2_impl(a: &[f32], codes: &[u8]) -> f32 {
        let n = a.len().min(codes.len() * 2);
        let (pa, pc) = (a.as_ptr(), codes.as_ptr());
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        // SAFETY (all loads): every weight read is below `n <= a.len()`; each code load reads 8
        // bytes from byte `i / 2`, which the loop bound keeps within `n / 2 <= codes.len()`.
        while i + 32 <= n {
            for pair in 0..2 {
                let c = unsafe { _mm_loadl_epi64(pc.add(i / 2 + 8 * pair).cast()) };
                let c = unpack_nibbles(c);
                let low = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(c));
                let high = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128::<8>(c)));
                let x = unsafe { _mm256_loadu_ps(pa.add(i + 16 * pair)) };
                let y = unsafe { _mm256_loadu_ps(pa.add(i + 16 * pair + 8)) };
                acc[2 * pair] = _mm256_fmadd_ps(x, low, acc[2 * pair]);
                acc[2 * pair + 1] = _mm256_fmadd_ps(y, high, acc[2 * pair + 1]);
            }
            i += 32;
        }
        let sum = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        let mut total = sum256(sum);
        for j in i..n {
            total += a[j] * ((codes[j / 2] >> (4 * (j % 2))) & 15) as f32;
        }
        total
    }

    #[target_feature(enable = "avx512f")]
    unsafe fn dot_u4_avx512_impl(a: &[f32], codes: &[u8]) -> f32 {
        let n = a.len().min(codes.len() * 2);
        let (pa, pc) = (a.as_ptr(), codes.as_ptr());
        let mut acc = [_mm512_setzero_ps(); 4];
        let mut i = 0;
        // SAFETY (all loads): every weight read is below `n <= a.len()`; each code load reads 8
        // bytes from byte `i / 2 + 8 * j`, which the loop bound keeps within `n / 2`.
        while i + 64 <= n {
            for (j, acc) in acc.iter_mut().enumerate() {
                let c = unsafe { _mm_loadl_epi64(pc.add(i / 2 + 8 * j).cast()) };
                let c = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(unpack_nibbles(c)));
                let x = unsafe { _mm512_loadu_ps(pa.add(i + 16 * j)) };
                *acc = _mm512_fmadd_ps(x, c, *acc);
            }
            i += 64;
        }
        while i + 16 <= n {
            let c = unsafe { _mm_loadl_epi64(pc.add(i / 2).cast()) };
            let c = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(unpack_nibbles(c)));
            let x = unsafe { _mm512_loadu_ps(pa.add(i)) };
            acc[0] = _mm512_fmadd_ps(x, c, acc[0]);
            i += 16;
        }
        let sum = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
        let mut total = _mm512_reduce_add_ps(sum);
        for j in i..n {
            total += a[j] * ((codes[j / 2] >> (4 * (j % 2))) & 15) as f32;
        }
        total
    }

    /// Eight lanes, each all ones where its bit of `word` is set: lane `j` takes bit
    /// `8 * byte + j` (`byte` in 0..4).
    #[target_feature(enable = "avx2")]
    fn bit_lanes(word: __m256i, byte: usize) -> __m256 {
        let shift = 31 - 8 * byte as i32;
        let shifts = _mm256_setr_epi32(
            shift,
            shift - 1,
            shift - 2,
            shift - 3,
            shift - 4,
            shift - 5,
            shift - 6,
            shift - 7,
        );
        // The lane's bit moved to the sign, then spread over the lane.
        _mm256_castsi256_ps(_mm256_srai_epi32::<31>(_mm256_sllv_epi32(word, shifts)))
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn dot_u1_avx2_impl(a: &[f32], bits: &[u8]) -> f32 {
        let n = a.len().min(bits.len() * 8);
        let (pa, pb) = (a.as_ptr(), bits.as_ptr());
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        // SAFETY (all loads): every weight read is below `n <= a.len()`; each 4-byte load of
        // bits starts at byte `i / 8` with `i + 32 <= n <= 8 * bits.len()`.
        while i + 32 <= n {
            let word = unsafe { pb.add(i / 8).cast::<i32>().read_unaligned() };
            let word = _mm256_set1_epi32(word);
            for (j, acc) in acc.iter_mut().enumerate() {
                let x = unsafe { _mm256_loadu_ps(pa.add(i + 8 * j)) };
                *acc = _mm256_add_ps(*acc, _mm256_and_ps(x, bit_lanes(word, j)));
            }
            i += 32;
        }
        while i + 8 <= n {
            let word = _mm256_set1_epi32(bits[i / 8] as i32);
            let x = unsafe { _mm256_loadu_ps(pa.add(i)) };
            acc[0] = _mm256_add_ps(acc[0], _mm256_and_ps(x, bit_lanes(word, 0)));
            i += 8;
        }
        let sum = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        let mut total = sum256(sum);
        for j in i..n {
            if (bits[j / 8] >> (j % 8)) & 1 == 1 {
                total += a[j];
            }
        }
        total
    }

    #[target_feature(enable = "avx512f")]
    unsafe fn dot_u1_avx512_impl(a: &[f32], bits: &[u8]) -> f32 {
        let n = a.len().min(bits.len() * 8);
        let (pa, pb) = (a.as_ptr(), bits.as_ptr());
        let mut acc = [_mm512_setzero_ps(); 4];
        let mut i = 0;
        // Each set bit selects its weight through an AVX-512 lane mask: 16 weights per 2 bytes.
        // SAFETY (all loads): every weight read is below `n <= a.len()` (the last, partial load
        // is masked to the lanes below `n`, and masked-off lanes are never read); each 8-byte
        // load of bits starts at byte `i / 8` with `i + 64 <= n <= 8 * bits.len()`, and single
        // bytes are read through bounds-checked indexing.
        while i + 64 <= n {
            let word = unsafe { pb.add(i / 8).cast::<u64>().read_unaligned() }.to_le();
            for (j, acc) in acc.iter_mut().enumerate() {
                let x = unsafe { _mm512_loadu_ps(pa.add(i + 16 * j)) };
                *acc = _mm512_mask_add_ps(*acc, (word >> (16 * j)) as u16, *acc, x);
            }
            i += 64;
        }
        while i < n {
            let left = n - i;
            let lanes: u16 = if left >= 16 {
                u16::MAX
            } else {
                (1 << left) - 1
            };
            let low = bits[i / 8] as u16;
            let high = if left > 8 { bits[i / 8 + 1] as u16 } else { 0 };
            let mask = (low | (high << 8)) & lanes;
            let x = unsafe { _mm512_maskz_loadu_ps(mask, pa.add(i)) };
            acc[0] = _mm512_add_ps(acc[0], x);
            i += 16;
        }
        let sum = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
        _mm512_reduce_add_ps(sum)
    }

    #[target_feature(enable = "avx512f")]
    unsafe fn dot_avx512_impl(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let mut acc = [_mm512_setzero_ps(); 4];
        let mut i = 0;
        // SAFETY (all loads): every offset read is below `n`, the length of both slices.
        while i + 64 <= n {
            for (j, acc) in acc.iter_mut().enumerate() {
                let x = unsafe { _mm512_loadu_ps(pa.add(i + 16 * j)) };
                let y = unsafe { _mm512_loadu_ps(pb.add(i + 16 * j)) };
                *acc = _mm512_fmadd_ps(x, y, *acc);
            }
            i += 64;
        }
        while i + 16 <= n {
            let x = unsafe { _mm512_loadu_ps(pa.add(i)) };
            let y = unsafe { _mm512_loadu_ps(pb.add(i)) };
            acc[0] = _mm512_fmadd_ps(x, y, acc[0]);
            i += 16;
        }
        let sum = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
        let mut total = _mm512_reduce_add_ps(sum);
        for j in i..n {
            total += a[j] * b[j];
        }
        total
    }

    #[target_feature(enable = "avx512f")]
    unsafe fn l2_avx512_impl(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let mut acc = [_mm512_setzero_ps(); 4];
        let mut i = 0;
        // SAFETY (all loads): every offset read is below `n`, the length of both slices.
        while i + 64 <= n {
            for (j, acc) in acc.iter_mut().enumerate() {
                let x = unsafe { _mm512_loadu_ps(pa.add(i + 16 * j)) };
                let y = unsafe { _mm512_loadu_ps(pb.add(i + 16 * j)) };
                let d = _mm512_sub_ps(x, y);
                *acc = _mm512_fmadd_ps(d, d, *acc);
            }
            i += 64;
        }
        while i + 16 <= n {
            let x = unsafe { _mm512_loadu_ps(pa.add(i)) };
            let y = unsafe { _mm512_loadu_ps(pb.add(i)) };
            let d = _mm512_sub_ps(x, y);
            acc[0] = _mm512_fmadd_ps(d, d, acc[0]);
            i += 16;
        }
        let sum = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
        let mut total = _mm512_reduce_add_ps(sum);
        for j in i..n {
            let d = a[j] - b[j];
            total += d * d;
        }
        total
    }

    /// Every table this CPU can run, for tests and benchmarks.
    pub(super) fn supported() -> Vec<Kernels> {
        let mut tables = Vec::new();
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            tables.push(AVX2);
        }
        if std::arch::is_x86_feature_detected!("avx512f") {
            tables.push(AVX512);
        }
        tables
    }
}

/// Every kernel set this CPU can run, portable first.
pub fn supported() -> Vec<Kernels> {
    #[allow(unused_mut)]
    let mut tables = vec![PORTABLE];
    #[cfg(target_arch = "x86_64")]
    tables.extend(x86::supported());
    tables
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(a: &[f32], b: &[f32]) -> (f64, f64) {
        let dot = a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
        let l2 = a
            .iter()
            .zip(b)
            .map(|(x, y)| (*x as f64 - *y as f64).powi(2))
            .sum();
        (dot, l2)
    }

    #[test]
    fn every_kernel_matches_a_naive_sum_at_every_length() {
        let tables = supported();
        assert_eq!(tables[0].name, "portable");
        for n in 0..200 {
            let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let b: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos() * 2.0).collect();
            let (dot, l2) = naive(&a, &b);
            for table in &tables {
                let got_dot = (table.dot)(&a, &b) as f64;
                let got_l2 = (table.l2_squared)(&a, &b) as f64;
                assert!((got_dot - dot).abs() < 1e-3, "{} dot n={n}", table.name);
                assert!((got_l2 - l2).abs() < 1e-3, "{} l2 n={n}", table.name);
            }
        }
        // Offsets that are not multiples of any vector width.
        let a: Vec<f32> = (0..500).map(|i| i as f32 / 500.0).collect();
        for table in &tables {
            let (dot, l2) = naive(&a[3..390], &a[7..394]);
            assert!(((table.dot)(&a[3..390], &a[7..394]) as f64 - dot).abs() < 1e-2);
            assert!(((table.l2_squared)(&a[3..390], &a[7..394]) as f64 - l2).abs() < 1e-3);
        }
    }

    #[test]
    fn every_code_kernel_matches_a_naive_sum_at_every_length() {
        for n in 0..300 {
            let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let codes: Vec<u8> = (0..n).map(|i| (i * 97 % 256) as u8).collect();
            let naive: f64 = a
                .iter()
                .zip(&codes)
                .map(|(x, c)| *x as f64 * *c as f64)
                .sum();
            for table in supported() {
                let got = (table.dot_u8)(&a, &codes) as f64;
                assert!(
                    (got - naive).abs() < 1e-4 * (1.0 + naive.abs()),
                    "{} n={n}: {got} against {naive}",
                    table.name
                );
            }
        }
    }

    /// `dot_u1` and `dot_u4` against plain sums, at every length and with codes longer than
    /// the weights (the kernels stop at the weights' end, ignoring the padding bits).
    #[test]
    fn every_packed_code_kernel_matches_a_naive_sum_at_every_length() {
        for n in 0..300usize {
            let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let values: Vec<u8> = (0..n).map(|i| (i * 97 % 256) as u8).collect();
            // Unused high bits of the last byte set, to check they are ignored.
            let mut bits = vec![0u8; n.div_ceil(8)];
            let mut nibbles = vec![0u8; n.div_ceil(2)];
            for (i, v) in values.iter().enumerate() {
                bits[i / 8] |= (v & 1) << (i % 8);
                nibbles[i / 2] |= (v & 15) << (4 * (i % 2));
            }
            if n % 8 != 0 {
                *bits.last_mut().expect("n > 0") |= 0xff << (n % 8);
            }
            if n % 2 == 1 {
                *nibbles.last_mut().expect("n > 0") |= 0xf0;
            }
            let naive_u1: f64 = (0..n).map(|i| a[i] as f64 * (values[i] & 1) as f64).sum();
            let naive_u4: f64 = (0..n).map(|i| a[i] as f64 * (values[i] & 15) as f64).sum();
            for table in supported() {
                let got = (table.dot_u1)(&a, &bits) as f64;
                assert!(
                    (got - naive_u1).abs() < 1e-4 * (1.0 + naive_u1.abs()),
                    "{} dot_u1 n={n}: {got} against {naive_u1}",
                    table.name
                );
                let got = (table.dot_u4)(&a, &nibbles) as f64;
                assert!(
                    (got - naive_u4).abs() < 1e-4 * (1.0 + naive_u4.abs()),
                    "{} dot_u4 n={n}: {got} against {naive_u4}",
                    table.name
                );
                // Fewer weights than codes: only the weights' length counts.
                let m = n / 2;
                let naive_u1: f64 = (0..m).map(|i| a[i] as f64 * (values[i] & 1) as f64).sum();
                let got = (table.dot_u1)(&a[..m], &bits) as f64;
                assert!((got - naive_u1).abs() < 1e-4 * (1.0 + naive_u1.abs()));
                let naive_u4: f64 = (0..m).map(|i| a[i] as f64 * (values[i] & 15) as f64).sum();
                let got = (table.dot_u4)(&a[..m], &nibbles) as f64;
                assert!((got - naive_u4).abs() < 1e-4 * (1.0 + naive_u4.abs()));
            }
        }
    }

    #[test]
    fn prefetch_accepts_any_slice() {
        prefetch::<f32>(&[], 4);
        prefetch(&[1.0f32; 3], 4);
        prefetch(&[1.0f32; 1000], 100);
        prefetch(&[7u32; 33], 3);
    }
}
