//! Distance kernels and one sealed-segment search, under criterion.
//!
//! - `distance/<kernel>/{dot,l2}`: one 384-d distance with each kernel set this CPU can run
//!   (`portable` is the baseline: what the compiler makes of plain Rust for the x86-64 baseline).
//! - `sealed_search/ef64`: one top-10 query against a sealed segment of 20,000 clustered 384-d
//!   vectors (cosine, M=16, ef_construction=200), with the kernels `TARN_SIMD` selects (default:
//!   the fastest).
//!
//! Run: `cargo bench -p tarn-benches --bench search_kernels`. The minilm-debian curve against
//! hnswlib is `scripts/search-vs-hnswlib.sh`.
#![allow(clippy::unwrap_used)] // a benchmark that fails should stop loudly

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use tarn_index::{IndexConfig, Metric, MutableSegment, SealedSegment};
use tarn_testkit::clustered_vectors;

const DIM: usize = 384;

fn distances(c: &mut Criterion) {
    let data = clustered_vectors(2, DIM, 1, 7);
    let (a, b) = data.split_at(DIM);
    let mut group = c.benchmark_group("distance");
    for kernels in tarn_index::simd::supported() {
        group.bench_function(BenchmarkId::new(kernels.name, "dot"), |bench| {
            bench.iter(|| (kernels.dot)(black_box(a), black_box(b)))
        });
        group.bench_function(BenchmarkId::new(kernels.name, "l2"), |bench| {
            bench.iter(|| (kernels.l2_squared)(black_box(a), black_box(b)))
        });
    }
    group.finish();
}

fn sealed_search(c: &mut Criterion) {
    let n = 20_000;
    let config = IndexConfig::new(DIM, Metric::Cosine);
    let vectors = clustered_vectors(n + 100, DIM, 50, 11);
    let mutable = MutableSegment::new(config);
    for (i, row) in vectors[..n * DIM].chunks_exact(DIM).enumerate() {
        let mut v = row.to_vec();
        Metric::Cosine.prepare(&mut v);
        mutable.upsert(0, i as u128, &v);
    }
    let sealed = SealedSegment::seal(&mutable, 1, n as u64);
    let queries: Vec<Vec<f32>> = vectors[n * DIM..]
        .chunks_exact(DIM)
        .map(|q| {
            let mut v = q.to_vec();
            Metric::Cosine.prepare(&mut v);
            v
        })
        .collect();
    let mut next = 0;
    let name = format!("ef64/{}", tarn_index::simd::kernels().name);
    c.benchmark_group("sealed_search")
        .bench_function(name, |bench| {
            bench.iter(|| {
                next = (next + 1) % queries.len();
                sealed.search(0, &queries[next], 10, 64, false)
            })
        });
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3));
    targets = distances, sealed_search
}
criterion_main!(benches);
