//! Quantized sealed search against f32 on minilm-debian (60,733 x 384, cosine, the 500 public
//! queries), on the same graph in the same process: the cached segment of `search_speed.rs`
//! (tarn's builder, M=16, ef_construction=200) opened once per configuration (codes are made
//! at open): f32; int8 in memory at each rescoring depth of `TARN_RESCORES` (default 3), and
//! with vectors on disk; RaBitQ of each of `TARN_RABITQ_BITS` (default 1,4) at each depth of
//! `TARN_RABITQ_RESCORES` (default: tarn's default for the bits), in memory and on disk.
//! Recall@10 and single-thread q/s at each ef, the passes of every
//! configuration interleaved so that the machine's noise falls on all; medians of `ROUNDS`.
//!
//! Vectors on disk are measured warm (the page cache holds what was read) and cold: before
//! each cold pass the segment file is dropped from the page cache (`POSIX_FADV_DONTNEED`); per
//! query latency p50/p99, bytes read from the disk per query (`/proc/self/io` `read_bytes`) and
//! bytes asked of the file. The disk's own floor: single random reads of one vector's bytes
//! from the evicted file, p50/p99. Prints markdown tables and ends with
//!   int8_recall=.. int8_bytes=.. int8_qps_ratio=.. rabitq1_recall=.. rabitq1_bytes=.. rabitq1_qps_ratio=..
//! (at ef 64, with vectors on disk, warm: recall@10, resident bytes per vector, q/s over f32's).
//!
//! With `--json FILE` it also writes every row for `scripts/quantization-vs-peers.sh`.
//!
//! Run: `cargo bench -p tarn-benches --bench quantized_search [-- --json FILE]`.
#![allow(clippy::unwrap_used)] // a benchmark that fails should stop loudly

use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::Instant;

use tarn_index::{
    BuildConfig, BulkDocuments, Hit, IndexConfig, Metric, Quantization, SealedSegment,
};
use tarn_testkit::{load_minilm, minilm_dir};

const DIM: usize = 384;
const K: usize = 10;
const ROUNDS: usize = 7;
const COLD_PASSES: usize = 3;
/// Random reads for the disk's floor.
const FLOOR_READS: usize = 2000;

fn config(quantization: Quantization, on_disk: bool) -> IndexConfig {
    let mut config = IndexConfig::new(DIM, Metric::Cosine);
    config.quantization = quantization;
    config.vectors_on_disk = on_disk;
    config
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// Bytes this process has had read from storage (`/proc/self/io`), when the kernel says.
fn disk_read_bytes() -> Option<u64> {
    let io = std::fs::read_to_string("/proc/self/io").ok()?;
    io.lines()
        .find_map(|line| line.strip_prefix("read_bytes: "))
        .and_then(|v| v.trim().parse().ok())
}

/// One way of opening the segment.
struct Configuration {
    label: String,
    segment: SealedSegment,
    on_disk: bool,
    rescore: usize,
}

/// A measured pass: recall, q/s, per-query latencies in microseconds (sorted).
struct Pass {
    recall: f64,
    qps: f64,
    latencies_us: Vec<f64>,
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
        let config = config(Quantization::None, false);
        let mut sealed =
            SealedSegment::build(documents, 1, n as u64, config, &BuildConfig::default()).unwrap();
        std::fs::create_dir_all(cache.parent().unwrap()).unwrap();
        sealed.write(&cache).unwrap();
    }
    let open = |label: String, quantization: Quantization, on_disk: bool| {
        let start = Instant::now();
        let segment = SealedSegment::open(&cache, config(quantization, on_disk)).unwrap();
        let rescore = quantization.rescore().unwrap_or(0);
        eprintln!("{label}: opened in {:.2} s", start.elapsed().as_secs_f64());
        Configuration {
            label,
            segment,
            on_disk,
            rescore,
        }
    };
    let rescores: Vec<usize> = std::env::var("TARN_RESCORES")
        .ok()
        .map(|v| v.split(',').map(|x| x.parse().unwrap()).collect())
        .unwrap_or(vec![Quantization::DEFAULT_RESCORE]);
    let mut configurations = vec![open("f32".into(), Quantization::None, false)];
    for &rescore in &rescores {
        let label = format!("int8 x{rescore}");
        configurations.push(open(label, Quantization::Int8 { rescore }, false));
    }
    let default_int8 = Quantization::Int8 {
        rescore: Quantization::DEFAULT_RESCORE,
    };
    configurations.push(open(
        format!("int8 x{} on disk", Quantization::DEFAULT_RESCORE),
        default_int8,
        true,
    ));
    let list = |name: &str, default: &str| -> Vec<usize> {
        std::env::var(name)
            .unwrap_or(default.into())
            .split(',')
            .filter(|x| !x.is_empty())
            .map(|x| x.parse().unwrap())
            .collect()
    };
    for bits in list("TARN_RABITQ_BITS", "1,4") {
        let bits = bits as u8;
        let default = Quantization::default_rabitq_rescore(bits).to_string();
        for rescore in list("TARN_RABITQ_RESCORES", &default) {
            for on_disk in [false, true] {
                let label = format!(
                    "rabitq{bits} x{rescore}{}",
                    if on_disk { " on disk" } else { "" }
                );
                configurations.push(open(label, Quantization::Rabitq { bits, rescore }, on_disk));
            }
        }
    }

    let recall = |results: &[Vec<Hit>]| {
        minilm.recall_at(
            K,
            results
                .iter()
                .map(|hits| hits.iter().map(|h| h.doc_id).collect()),
        )
    };
    let pass = |segment: &SealedSegment, ef: usize| {
        let mut latencies_us = Vec::with_capacity(queries.len());
        let start = Instant::now();
        let results: Vec<Vec<Hit>> = queries
            .iter()
            .map(|q| {
                let started = Instant::now();
                let hits = segment.search(0, q, K, ef, false).unwrap();
                latencies_us.push(started.elapsed().as_secs_f64() * 1e6);
                hits
            })
            .collect();
        let qps = queries.len() as f64 / start.elapsed().as_secs_f64();
        latencies_us.sort_by(f64::total_cmp);
        Pass {
            recall: recall(&results),
            qps,
            latencies_us,
        }
    };
    let per_vector = |segment: &SealedSegment| segment.figures().memory_bytes as f64 / n as f64;
    println!("### Quantized sealed search on minilm-debian ({n} x {DIM}, cosine, M=16)\n");
    println!(
        "Kernels: {}. One thread, one query per call; medians of {ROUNDS} interleaved passes.\n",
        tarn_index::simd::kernels().name
    );
    println!("| configuration | resident bytes / vector | of which codes | on disk |");
    println!("|---|---|---|---|");
    for c in &configurations {
        let figures = c.segment.figures();
        println!(
            "| {} | {:.0} | {:.0} | {:.0} |",
            c.label,
            per_vector(&c.segment),
            figures.quantized_bytes as f64 / n as f64,
            figures.cold_bytes as f64 / n as f64
        );
    }
    println!();
    let efs: Vec<usize> = std::env::var("TARN_SEARCH_EFS")
        .ok()
        .map(|v| v.split(',').map(|x| x.parse().unwrap()).collect())
        .unwrap_or(vec![16, 32, 64, 128]);
    println!("| ef | configuration | recall@10 | q/s | / f32 | p50 us | p99 us |");
    println!("|---|---|---|---|---|---|---|");
    let mut rows = Vec::new();
    let mut at_64 = None;
    let mut rabitq1_at_64 = None;
    for &ef in &efs {
        let mut rates = vec![Vec::new(); configurations.len()];
        let mut last: Vec<Option<Pass>> = (0..configurations.len()).map(|_| None).collect();
        for _ in 0..ROUNDS {
            for (i, c) in configurations.iter().enumerate() {
                let measured = pass(&c.segment, ef);
                rates[i].push(measured.qps);
                last[i] = Some(measured);
            }
        }
        let f32_qps = median(rates[0].clone());
        for (i, c) in configurations.iter().enumerate() {
            let measured = last[i].take().unwrap();
            let qps = median(rates[i].clone());
            let (p50, p99) = (
                percentile(&measured.latencies_us, 0.5),
                percentile(&measured.latencies_us, 0.99),
            );
            println!(
                "| {ef} | {} | {:.4} | {qps:.0} | {:.2}x | {p50:.0} | {p99:.0} |",
                c.label,
                measured.recall,
                qps / f32_qps
            );
            rows.push(format!(
                "{{\"config\": \"{}\", \"ef\": {ef}, \"rescore\": {}, \"on_disk\": {}, \
                 \"cold\": false, \"recall\": {:.5}, \"qps\": {qps:.1}, \"p50_us\": {p50:.1}, \
                 \"p99_us\": {p99:.1}, \"bytes\": {:.1}}}",
                c.label,
                c.rescore,
                c.on_disk,
                measured.recall,
                per_vector(&c.segment)
            ));
            let figures = (measured.recall, qps / f32_qps, per_vector(&c.segment));
            if ef == 64 && c.on_disk && c.label.starts_with("int8") {
                at_64 = Some(figures);
            }
            let rabitq1_default = format!(
                "rabitq1 x{} on disk",
                Quantization::default_rabitq_rescore(1)
            );
            if ef == 64 && c.label == rabitq1_default {
                rabitq1_at_64 = Some(figures);
            }
        }
    }

    // Cold: the file evicted before each pass.
    let floor = disk_floor(&cache, n);
    println!(
        "\nCold passes at ef 64 (the segment file dropped from the page cache before each of \
         {COLD_PASSES}); the disk's floor, one random {}-byte read of the evicted file: p50 \
         {:.0} us, p99 {:.0} us ({FLOOR_READS} reads).\n",
        DIM * 4,
        floor.0,
        floor.1
    );
    println!(
        "| configuration | recall@10 | q/s | p50 us | p99 us | disk bytes / query | \
         asked bytes / query | p99 / (reads x floor p50) |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for c in configurations.iter().filter(|c| c.on_disk) {
        let mut latencies = Vec::new();
        let (mut rates, mut recall_cold) = (Vec::new(), 0.0);
        let (disk_before, asked_before) = (disk_read_bytes(), c.segment.cold_bytes_read());
        for _ in 0..COLD_PASSES {
            c.segment.evict_cold_vectors().unwrap();
            let measured = pass(&c.segment, 64);
            rates.push(measured.qps);
            recall_cold = measured.recall;
            latencies.extend(measured.latencies_us);
        }
        latencies.sort_by(f64::total_cmp);
        let n_queries = (COLD_PASSES * queries.len()) as f64;
        let disk_per_query = match (disk_before, disk_read_bytes()) {
            (Some(before), Some(after)) => format!("{:.0}", (after - before) as f64 / n_queries),
            _ => "?".into(),
        };
        let asked = (c.segment.cold_bytes_read() - asked_before) as f64 / n_queries;
        let reads = asked / (DIM * 4) as f64;
        let (qps, p50, p99) = (
            median(rates),
            percentile(&latencies, 0.5),
            percentile(&latencies, 0.99),
        );
        println!(
            "| {} | {recall_cold:.4} | {qps:.0} | {p50:.0} | {p99:.0} | {disk_per_query} | \
             {asked:.0} | {:.2} |",
            c.label,
            p99 / (reads * floor.0)
        );
        rows.push(format!(
            "{{\"config\": \"{}\", \"ef\": 64, \"rescore\": {}, \"on_disk\": true, \
             \"cold\": true, \"recall\": {recall_cold:.5}, \"qps\": {qps:.1}, \
             \"p50_us\": {p50:.1}, \"p99_us\": {p99:.1}, \"bytes\": {:.1}, \
             \"disk_bytes_per_query\": \"{disk_per_query}\", \"asked_bytes_per_query\": {asked:.0}}}",
            c.label,
            c.rescore,
            per_vector(&c.segment)
        ));
    }

    let args: Vec<String> = std::env::args().collect();
    if let Some(path) = args
        .iter()
        .position(|a| a == "--json")
        .and_then(|i| args.get(i + 1))
    {
        let json = format!(
            "{{\"n\": {n}, \"kernels\": \"{}\", \"floor_p50_us\": {:.1}, \"floor_p99_us\": {:.1}, \
             \"rows\": [{}]}}\n",
            tarn_index::simd::kernels().name,
            floor.0,
            floor.1,
            rows.join(", ")
        );
        std::fs::write(path, json).unwrap();
    }
    let show = |figures: Option<(f64, f64, f64)>| match figures {
        Some((recall, ratio, bytes)) => (
            format!("{recall:.4}"),
            format!("{bytes:.0}"),
            format!("{ratio:.2}"),
        ),
        None => ("?".into(), "?".into(), "?".into()),
    };
    let (int8, rabitq1) = (show(at_64), show(rabitq1_at_64));
    println!(
        "\nint8_recall={} int8_bytes={} int8_qps_ratio={} rabitq1_recall={} rabitq1_bytes={} \
         rabitq1_qps_ratio={}",
        int8.0, int8.1, int8.2, rabitq1.0, rabitq1.1, rabitq1.2
    );
}

/// p50 and p99 in microseconds of single random reads of one vector's bytes from `path`
/// after dropping it from the page cache: what one cold rescoring read cannot beat.
fn disk_floor(path: &Path, n: usize) -> (f64, f64) {
    let file = std::fs::File::open(path).unwrap();
    rustix::fs::fadvise(&file, 0, None, rustix::fs::Advice::Random).unwrap();
    rustix::fs::fadvise(&file, 0, None, rustix::fs::Advice::DontNeed).unwrap();
    let mut buffer = vec![0u8; DIM * 4];
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut latencies = Vec::with_capacity(FLOOR_READS);
    for _ in 0..FLOOR_READS {
        // xorshift: a different vector each read, the same sequence every run.
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let offset = 64 + (state % n as u64) * (DIM * 4) as u64;
        let started = Instant::now();
        file.read_exact_at(&mut buffer, offset).unwrap();
        latencies.push(started.elapsed().as_secs_f64() * 1e6);
    }
    latencies.sort_by(f64::total_cmp);
    (percentile(&latencies, 0.5), percentile(&latencies, 0.99))
}
