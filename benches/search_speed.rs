//! Sealed-segment search speed on minilm-debian (60,733 x 384, cosine, the 500 public queries):
//! recall@10 and single-thread queries/s, one query per call, at several ef; two-thread
//! throughput; the exact path; index bytes per vector; open time. Not a criterion bench: it
//! prints a markdown table and, with `--json FILE`, writes the figures for
//! `scripts/search-vs-hnswlib.sh`, which runs hnswlib on the same data in the same run.
//!
//! The segment is built once (by tarn's builder, as sealing and merges build it, a few seconds) and
//! cached as a `.tseg` file under the target directory; later runs open it (delete the file, or
//! set `TARN_SEARCH_REBUILD=1`, to rebuild).
//!
//! Run: `cargo bench -p tarn-benches --bench search_speed [-- --json out.json]`.
#![allow(clippy::unwrap_used)] // a benchmark that fails should stop loudly

use std::path::{Path, PathBuf};
use std::time::Instant;

use tarn_index::{BuildConfig, BulkDocuments, Hit, IndexConfig, Metric, SealedSegment};
use tarn_testkit::{load_minilm, minilm_dir};

const DIM: usize = 384;
const K: usize = 10;
const ROUNDS: usize = 5;

struct Data {
    base: Vec<f32>,
    queries: Vec<Vec<f32>>,
    truth: Vec<i32>,
    truth_width: usize,
}

fn load(dir: &Path) -> Data {
    let minilm = load_minilm(dir).unwrap();
    assert_eq!(minilm.dim, DIM);
    let queries = minilm.prepared_queries(|v| {
        Metric::Cosine.prepare(v);
    });
    Data {
        base: minilm.base,
        queries,
        truth: minilm.truth,
        truth_width: minilm.truth_width,
    }
}

fn config() -> IndexConfig {
    IndexConfig::new(DIM, Metric::Cosine)
}

/// Opens the cached segment, or builds, writes and opens it.
fn segment(data: &Data, cache: &Path) -> (SealedSegment, f64) {
    let rebuild = std::env::var_os("TARN_SEARCH_REBUILD").is_some();
    if rebuild || !cache.exists() {
        // tarn's own builder, as sealing and merges build the bulk of a collection's graphs.
        let n = data.base.len() / DIM;
        let doc_ids: Vec<u128> = (0..n as u128).collect();
        let documents = BulkDocuments {
            user_ids: &vec![0; n],
            doc_ids: &doc_ids,
            vectors: &data.base,
        };
        let start = Instant::now();
        let mut sealed =
            SealedSegment::build(documents, 1, n as u64, config(), &BuildConfig::default())
                .unwrap();
        eprintln!("built the graph in {:.1} s", start.elapsed().as_secs_f64());
        std::fs::create_dir_all(cache.parent().unwrap()).unwrap();
        sealed.write(cache).unwrap();
    }
    let start = Instant::now();
    let sealed = SealedSegment::open(cache, config()).unwrap();
    (sealed, start.elapsed().as_secs_f64())
}

fn recall(data: &Data, results: &[Vec<Hit>]) -> f64 {
    let mut found = 0usize;
    for (q, hits) in results.iter().enumerate() {
        let truth = &data.truth[q * data.truth_width..q * data.truth_width + K];
        found += hits
            .iter()
            .filter(|h| truth.contains(&(h.doc_id as i32)))
            .count();
    }
    found as f64 / (results.len() * K) as f64
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Median single-thread q/s over `ROUNDS` passes of all queries, and recall@10.
fn measure(data: &Data, search: impl Fn(&[f32]) -> Vec<Hit>, rounds: usize) -> (f64, f64) {
    let mut rates = Vec::new();
    let mut results = Vec::new();
    for _ in 0..rounds {
        let start = Instant::now();
        results = data.queries.iter().map(|q| search(q)).collect();
        rates.push(data.queries.len() as f64 / start.elapsed().as_secs_f64());
    }
    (recall(data, &results), median(rates))
}

/// Queries/s of `threads` threads each running every query `ROUNDS` times.
fn throughput(data: &Data, sealed: &SealedSegment, ef: usize, threads: usize) -> f64 {
    let start = Instant::now();
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| {
                for _ in 0..ROUNDS {
                    for q in &data.queries {
                        std::hint::black_box(sealed.search(0, q, K, ef, false).unwrap());
                    }
                }
            });
        }
    });
    (threads * ROUNDS * data.queries.len()) as f64 / start.elapsed().as_secs_f64()
}

fn json_path() -> Option<PathBuf> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == "--json")
        .and_then(|i| args.get(i + 1))
        .map(PathBuf::from)
}

fn main() {
    let Some(dir) = minilm_dir() else {
        println!("search_speed: SKIPPED (../shared/data/minilm-debian not found)");
        return;
    };
    let data = load(&dir);
    let cache =
        Path::new(env!("CARGO_TARGET_TMPDIR")).join("search_speed/minilm-m16-efc200-builder.tseg");
    let (sealed, open_s) = segment(&data, &cache);
    let n = data.base.len() / DIM;
    let figures = sealed.figures();
    let bytes_per_vector = figures.index_bytes as f64 / n as f64;

    println!(
        "### Sealed search on minilm-debian ({n} x {DIM}, cosine, M=16, ef_construction=200)\n"
    );
    println!("Distance kernels: {}.", tarn_index::simd::kernels().name);
    println!(
        "Open: {open_s:.3} s. Index memory beyond the raw vectors: {bytes_per_vector:.0} bytes per vector.\n"
    );
    println!("| ef | recall@10 | q/s (1 thread, median of {ROUNDS}) |");
    println!("|---|---|---|");
    let mut rows = Vec::new();
    let efs: Vec<usize> = std::env::var("TARN_SEARCH_EFS")
        .ok()
        .map(|v| v.split(',').map(|x| x.parse().unwrap()).collect())
        .unwrap_or(vec![10, 16, 24, 32, 48, 64, 96, 128, 192, 256]);
    for ef in efs {
        let (r, qps) = measure(
            &data,
            |q| sealed.search(0, q, K, ef, false).unwrap(),
            ROUNDS,
        );
        println!("| {ef} | {r:.4} | {qps:.0} |");
        rows.push(format!(
            "{{\"ef\": {ef}, \"recall\": {r:.5}, \"qps\": {qps:.1}}}"
        ));
    }
    let (exact_recall, exact_qps) = measure(&data, |q| sealed.search(0, q, K, 0, true).unwrap(), 1);
    println!("| exact | {exact_recall:.4} | {exact_qps:.0} |\n");
    let one = throughput(&data, &sealed, 64, 1);
    let two = throughput(&data, &sealed, 64, 2);
    println!(
        "Throughput at ef 64: 1 thread {one:.0} q/s, 2 threads {two:.0} q/s ({:.2}x).\n",
        two / one
    );
    if let Some(path) = json_path() {
        let json = format!(
            "{{\"n\": {n}, \"kernels\": \"{}\", \"open_seconds\": {open_s:.4}, \"bytes_per_vector\": {bytes_per_vector:.1}, \"exact_qps\": {exact_qps:.1}, \"threads1_qps\": {one:.1}, \"threads2_qps\": {two:.1}, \"curve\": [{}]}}\n",
            tarn_index::simd::kernels().name,
            rows.join(", ")
        );
        std::fs::write(&path, json).unwrap();
    }
}
