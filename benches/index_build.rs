//! Index build speed on minilm-debian (60,733 x 384, cosine, M=16, ef_construction=200): the
//! time tarn's own parallel HNSW builder takes to turn the raw vectors into a sealed segment in
//! memory (`SealedSegment::build`: grouping, normalising, copying and the graph), and the
//! recall@10 of the result over the 500 public queries (one query per call, in-process). Not a
//! criterion bench: one build per round, then a summary; with `--json FILE` it writes the figures
//! for `scripts/build-vs-hnswlib.sh`, which times hnswlib on the same data in the same run.
//!
//! Run: `cargo bench -p tarn-benches --bench index_build -- [--rounds N] [--threads T] [--json F]`.
#![allow(clippy::unwrap_used)] // a benchmark that fails should stop loudly

use std::path::PathBuf;
use std::time::Instant;

use tarn_index::{BuildConfig, BulkDocuments, Hit, IndexConfig, Metric, SealedSegment};
use tarn_testkit::{load_minilm, minilm_dir};

const K: usize = 10;
const EFS: [usize; 4] = [32, 64, 128, 256];

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .cloned()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let Some(dir) = minilm_dir() else {
        println!("index_build: SKIPPED (../shared/data/minilm-debian not found)");
        return;
    };
    let rounds: usize = arg("--rounds").map_or(3, |r| r.parse().unwrap());
    let threads: usize = arg("--threads").map_or(2, |t| t.parse().unwrap());
    let json = arg("--json").map(PathBuf::from);
    let minilm = load_minilm(&dir).unwrap();
    let dim = minilm.dim;
    let n = minilm.base.len() / dim;
    let config = IndexConfig::new(dim, Metric::Cosine);
    let build = BuildConfig {
        threads,
        ..BuildConfig::default()
    };
    let user_ids = vec![0u128; n];
    let doc_ids: Vec<u128> = (0..n as u128).collect();
    let documents = BulkDocuments {
        user_ids: &user_ids,
        doc_ids: &doc_ids,
        vectors: &minilm.base,
    };
    let queries: Vec<Vec<f32>> = minilm.prepared_queries(|v| {
        Metric::Cosine.prepare(v);
    });
    let recall = |results: &[Vec<Hit>]| {
        minilm.recall_at(
            K,
            results
                .iter()
                .map(|hits| hits.iter().map(|h| h.doc_id).collect()),
        )
    };

    println!(
        "### Index build on minilm-debian ({n} x {dim}, cosine, M={}, ef_construction={}, {threads} threads, kernels {})\n",
        config.hnsw.m,
        config.hnsw.ef_construction,
        tarn_index::simd::kernels().name
    );
    println!("| round | build s | recall@10 ef 32 | ef 64 | ef 128 | ef 256 |");
    println!("|---|---|---|---|---|---|");
    let mut seconds = Vec::new();
    let mut recalls: Vec<Vec<f64>> = vec![Vec::new(); EFS.len()];
    for round in 0..rounds {
        let start = Instant::now();
        let segment = SealedSegment::build(documents, 1, n as u64, config, &build).unwrap();
        let elapsed = start.elapsed().as_secs_f64();
        seconds.push(elapsed);
        let mut row = format!("| {} | {elapsed:.2} |", round + 1);
        for (i, ef) in EFS.iter().enumerate() {
            let results: Vec<Vec<Hit>> = queries
                .iter()
                .map(|q| segment.search(0, q, K, *ef, false).unwrap())
                .collect();
            let r = recall(&results);
            recalls[i].push(r);
            row.push_str(&format!(" {r:.4} |"));
        }
        println!("{row}");
        let figures = segment.figures();
        if round == 0 {
            println!(
                "(index memory beyond the raw vectors: {:.0} bytes per vector)",
                figures.index_bytes as f64 / n as f64
            );
        }
    }
    let build_s = median(seconds.clone());
    let recall_medians: Vec<f64> = recalls.into_iter().map(median).collect();
    println!(
        "\nmedian build {build_s:.2} s over {rounds} rounds; median recall@10 at ef 64: {:.4}",
        recall_medians[1]
    );
    if let Some(path) = json {
        let curve: Vec<String> = EFS
            .iter()
            .zip(&recall_medians)
            .map(|(ef, r)| format!("{{\"ef\": {ef}, \"recall\": {r:.5}}}"))
            .collect();
        let all: Vec<String> = seconds.iter().map(|s| format!("{s:.3}")).collect();
        std::fs::write(
            &path,
            format!(
                "{{\"n\": {n}, \"threads\": {threads}, \"kernels\": \"{}\", \"build_seconds\": {build_s:.3}, \"build_seconds_all\": [{}], \"curve\": [{}]}}\n",
                tarn_index::simd::kernels().name,
                all.join(", "),
                curve.join(", ")
            ),
        )
        .unwrap();
    }
}
