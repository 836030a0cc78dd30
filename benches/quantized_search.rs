//! Int8 quantized sealed search against f32 on minilm-debian (60,733 x 384, cosine, the 500
//! public queries), on the same graph in the same process: the cached segment of
//! `search_speed.rs` (tarn's builder, M=16, ef_construction=200) opened twice, once as it is and
//! once in an int8 collection (the codes are made at open), then recall@10 and single-thread
//! q/s at several ef and rescoring depths, the passes of f32 and int8 interleaved so that the
//! machine's noise falls on both; medians of `ROUNDS`. Prints a markdown table and ends with
//!   int8_recall=<at ef 64> int8_bytes=<resident per vector> int8_qps_ratio=<int8 / f32 at ef 64>
//!
//! With `--json FILE` it also writes every row for `scripts/quantization-vs-peers.sh`.
//!
//! Run: `cargo bench -p tarn-benches --bench quantized_search [-- --json FILE]`.
#![allow(clippy::unwrap_used)] // a benchmark that fails should stop loudly

use std::path::Path;
use std::time::Instant;

use tarn_index::{
    BuildConfig, BulkDocuments, Hit, IndexConfig, Metric, Quantization, SealedSegment,
};
use tarn_testkit::{load_minilm, minilm_dir};

const DIM: usize = 384;
const K: usize = 10;
const ROUNDS: usize = 7;

fn config(quantization: Quantization) -> IndexConfig {
    let mut config = IndexConfig::new(DIM, Metric::Cosine);
    config.quantization = quantization;
    config
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let Some(dir) = minilm_dir() else {
        println!("quantized_search: SKIPPED (../shared/data/minilm-debian not found)");
        return;
    };
    let minilm = load_minilm(&dir).unwrap();
    let n = minilm.base.len() / DIM;
    let queries: Vec<Vec<f32>> = minilm.prepared_queries(|v| {
        Metric::Cosine.prepare(v);
    });
    let cache =
        Path::new(env!("CARGO_TARGET_TMPDIR")).join("search_speed/minilm-m16-efc200-builder.tseg");
    if !cache.exists() {
        let doc_ids: Vec<u128> = (0..n as u128).collect();
        let documents = BulkDocuments {
            user_ids: &vec![0; n],
            doc_ids: &doc_ids,
            vectors: &minilm.base,
        };
        let config = config(Quantization::None);
        let mut sealed =
            SealedSegment::build(documents, 1, n as u64, config, &BuildConfig::default()).unwrap();
        std::fs::create_dir_all(cache.parent().unwrap()).unwrap();
        sealed.write(&cache).unwrap();
    }
    let plain = SealedSegment::open(&cache, config(Quantization::None)).unwrap();
    let start = Instant::now();
    let int8_config = |rescore| config(Quantization::Int8 { rescore });
    let int8 = SealedSegment::open(&cache, int8_config(Quantization::DEFAULT_RESCORE)).unwrap();
    let open_int8_s = start.elapsed().as_secs_f64();
    let recall = |results: &[Vec<Hit>]| {
        minilm.recall_at(
            K,
            results
                .iter()
                .map(|hits| hits.iter().map(|h| h.doc_id).collect()),
        )
    };
    let pass = |search: &dyn Fn(&[f32]) -> Vec<Hit>| {
        let start = Instant::now();
        let results: Vec<Vec<Hit>> = queries.iter().map(|q| search(q)).collect();
        (
            recall(&results),
            queries.len() as f64 / start.elapsed().as_secs_f64(),
        )
    };
    let per_vector = |segment: &SealedSegment| segment.figures().memory_bytes as f64 / n as f64;
    println!("### Int8 quantized sealed search on minilm-debian ({n} x {DIM}, cosine, M=16)\n");
    println!(
        "Kernels: {}. Resident bytes per vector: f32 {:.0}, int8 {:.0} (full vectors kept in \
         memory; codes {:.0}). Making the codes at open: {open_int8_s:.2} s.\n",
        tarn_index::simd::kernels().name,
        per_vector(&plain),
        per_vector(&int8),
        int8.figures().quantized_bytes as f64 / n as f64,
    );
    println!(
        "| ef | f32 recall@10 | f32 q/s | int8 rescore | int8 recall@10 | int8 q/s | int8 / f32 |"
    );
    println!("|---|---|---|---|---|---|---|");
    let efs: Vec<usize> = std::env::var("TARN_SEARCH_EFS")
        .ok()
        .map(|v| v.split(',').map(|x| x.parse().unwrap()).collect())
        .unwrap_or(vec![16, 32, 64, 128]);
    let rescores: Vec<usize> = std::env::var("TARN_RESCORES")
        .ok()
        .map(|v| v.split(',').map(|x| x.parse().unwrap()).collect())
        .unwrap_or(vec![1, 2, 3, 4]);
    let mut at_64 = None;
    let mut rows = Vec::new();
    for &ef in &efs {
        for &rescore in &rescores {
            // The same codes under another rescoring depth: a segment opened per depth.
            let quantized = if rescore == Quantization::DEFAULT_RESCORE {
                None
            } else {
                Some(SealedSegment::open(&cache, int8_config(rescore)).unwrap())
            };
            let quantized = quantized.as_ref().unwrap_or(&int8);
            let (mut plain_rates, mut int8_rates) = (Vec::new(), Vec::new());
            let (mut plain_recall, mut int8_recall) = (0.0, 0.0);
            for _ in 0..ROUNDS {
                let (r, q) = pass(&|q| plain.search(0, q, K, ef, false).unwrap());
                (plain_recall, plain_rates) = (r, [plain_rates, vec![q]].concat());
                let (r, q) = pass(&|q| quantized.search(0, q, K, ef, false).unwrap());
                (int8_recall, int8_rates) = (r, [int8_rates, vec![q]].concat());
            }
            let (plain_qps, int8_qps) = (median(plain_rates), median(int8_rates));
            println!(
                "| {ef} | {plain_recall:.4} | {plain_qps:.0} | {rescore} | {int8_recall:.4} | \
                 {int8_qps:.0} | {:.2}x |",
                int8_qps / plain_qps
            );
            rows.push(format!(
                "{{\"ef\": {ef}, \"rescore\": {rescore}, \"f32_recall\": {plain_recall:.5}, \
                 \"f32_qps\": {plain_qps:.1}, \"int8_recall\": {int8_recall:.5}, \
                 \"int8_qps\": {int8_qps:.1}}}"
            ));
            if ef == 64 && rescore == Quantization::DEFAULT_RESCORE {
                at_64 = Some((int8_recall, int8_qps / plain_qps));
            }
        }
    }
    let args: Vec<String> = std::env::args().collect();
    if let Some(path) = args
        .iter()
        .position(|a| a == "--json")
        .and_then(|i| args.get(i + 1))
    {
        let json = format!(
            "{{\"n\": {n}, \"kernels\": \"{}\", \"f32_bytes_per_vector\": {:.1}, \
             \"int8_bytes_per_vector\": {:.1}, \"rows\": [{}]}}\n",
            tarn_index::simd::kernels().name,
            per_vector(&plain),
            per_vector(&int8),
            rows.join(", ")
        );
        std::fs::write(path, json).unwrap();
    }
    if let Some((recall, ratio)) = at_64 {
        println!(
            "\nint8_recall={recall:.4} int8_bytes={:.0} int8_qps_ratio={ratio:.2}",
            per_vector(&int8)
        );
    }
}
