//! Filtered search in-process: the collection engine (`tarn_collection::Collection`, sealed by a
//! flush, as a server holds it) answers each filter of a filters file for every query, one query
//! per call on one thread, in three ways: tarn's filtered search (at several ef), the exact scan
//! of the matches (`exact: true`), and post-filtering (an unfiltered search for
//! `2 k / selectivity` hits, capped at 10,000, filtered afterwards: what a database without
//! filtered search makes its users do). Per filter and way: recall@10 against the caller's exact
//! filtered truth, queries/s, and short answers (fewer than min(k, matches) hits). Not a
//! criterion bench: the scripts run it and compare the figures with hnswlib and faiss in the
//! same run.
//!
//! Data: by default minilm-debian (384-d, cosine, its five Debian fields; `TARN_MINILM_DIR`),
//! as `scripts/filtered-vs-peers.sh` runs it. With `--fvecs BASE --queries QUERIES --dimension D
//! --metric l2|cosine|dot --fields name:type,..` (types keyword, keywords, number, bool) any
//! vectors and fields instead, as `scripts/filtered-scale.sh` runs it on its synthetic data.
//!
//! Input: `--attributes FILE` (JSON lines, one object per base row) and `--filters FILE` (JSON:
//! per filter its name, its per-query filters in the form `{"all"|"any": [..]}`, `{"not": ..}`,
//! `{"match": {"field", "any_of"}}`, `{"range": {"field", "gt", "gte", "lt", "lte"}}`, the
//! number of matches per query and the exact top 10 ids per query). Optional: `--efs 32,64,128`
//! (the filtered search's ef values, these by default), `--batch 1000` (documents per insert),
//! `--reopen`. Output: `--json FILE` (one record per filter and way), and with `--load-json
//! FILE` the load's figures (seconds to insert, flush and finish indexing; sealed segments).
//!
//! Run: `scripts/filtered-vs-peers.sh` or `scripts/filtered-scale.sh` (they build and run this
//! with the files above).
#![allow(clippy::unwrap_used)] // a benchmark that fails should stop loudly

use std::collections::HashMap;
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::time::Instant;

use serde_json::{json, Value as Json};
use tarn_collection::{
    Attributes, Collection, CollectionConfig, Durability, FieldSpec, FieldType, Filter, MetricName,
    SearchRequest, Value,
};
use tarn_testkit::{files_starting_with, load_minilm, minilm_dir, read_fvecs};

const MINILM_DIM: usize = 384;
const K: usize = 10;
const DEFAULT_EFS: &str = "32,64,128";
const DEFAULT_BATCH: usize = 1000;
const POSTFILTER_MAX: usize = 10_000;

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

/// The minilm-debian rows' fields.
fn minilm_fields() -> Vec<FieldSpec> {
    vec![
        FieldSpec::new("section", FieldType::Keyword),
        FieldSpec::new("tags", FieldType::Keywords),
        FieldSpec::new("installed_size_kb", FieldType::Number),
        FieldSpec::new("architecture", FieldType::Keyword),
        FieldSpec::new("priority", FieldType::Keyword),
    ]
}

/// The vectors, the queries and the fields a run loads.
struct Dataset {
    dim: usize,
    metric: MetricName,
    fields: Vec<FieldSpec>,
    /// Row after row.
    base: Vec<f32>,
    queries: Vec<f32>,
}

/// minilm-debian, or the files `--fvecs` and `--queries` name.
fn dataset() -> Dataset {
    let Some(base_path) = arg("--fvecs") else {
        let dir = minilm_dir().expect("TARN_MINILM_DIR or ../shared/data/minilm-debian");
        let data = load_minilm(&dir).unwrap();
        assert_eq!(data.dim, MINILM_DIM);
        return Dataset {
            dim: data.dim,
            metric: MetricName::Cosine,
            fields: minilm_fields(),
            base: data.base,
            queries: data.queries,
        };
    };
    let dim: usize = arg("--dimension")
        .expect("--dimension D with --fvecs")
        .parse()
        .unwrap();
    let metric = match arg("--metric").as_deref() {
        Some("l2") => MetricName::L2,
        Some("cosine") => MetricName::Cosine,
        Some("dot") => MetricName::Dot,
        other => panic!("--metric l2|cosine|dot with --fvecs, got {other:?}"),
    };
    let fields = arg("--fields")
        .map(|list| parse_fields(&list))
        .unwrap_or_default();
    let read = |path: &Path| {
        let (file_dim, values) = read_fvecs(path).unwrap();
        assert_eq!(file_dim, dim, "{}: dimension", path.display());
        values
    };
    let base = read(Path::new(&base_path));
    let queries = read(Path::new(
        &arg("--queries").expect("--queries FILE with --fvecs"),
    ));
    Dataset {
        dim,
        metric,
        fields,
        base,
        queries,
    }
}

/// `name:type,name:type`, the types keyword, keywords, number and bool.
fn parse_fields(list: &str) -> Vec<FieldSpec> {
    list.split(',')
        .filter(|item| !item.is_empty())
        .map(|item| {
            let (name, kind) = item.rsplit_once(':').expect("--fields name:type,..");
            let field_type = match kind {
                "keyword" => FieldType::Keyword,
                "keywords" => FieldType::Keywords,
                "number" => FieldType::Number,
                "bool" => FieldType::Bool,
                other => panic!("--fields: unknown type {other:?}"),
            };
            FieldSpec::new(name, field_type)
        })
        .collect()
}

fn attributes(row: &Json, fields: &[FieldSpec]) -> Attributes {
    let mut out = Attributes::new();
    for spec in fields {
        let value = match (&row[&spec.name], spec.field_type) {
            (Json::String(s), FieldType::Keyword) => Value::Keyword(s.clone()),
            (Json::Array(items), FieldType::Keywords) => Value::Keywords(
                items
                    .iter()
                    .filter_map(|i| i.as_str().map(String::from))
                    .collect(),
            ),
            (Json::Number(n), FieldType::Number) => Value::Number(n.as_f64().unwrap()),
            (Json::Bool(b), FieldType::Bool) => Value::Bool(*b),
            _ => continue,
        };
        out.insert(spec.name.clone(), value);
    }
    out
}

fn filter(spec: &Json) -> Filter {
    let object = spec.as_object().unwrap();
    let (kind, body) = object.iter().next().unwrap();
    let number = |key: &str| body.get(key).and_then(Json::as_f64);
    match kind.as_str() {
        "all" => Filter::All(body.as_array().unwrap().iter().map(filter).collect()),
        "any" => Filter::Any(body.as_array().unwrap().iter().map(filter).collect()),
        "not" => Filter::Not(Box::new(filter(body))),
        "match" => Filter::Match {
            field: body["field"].as_str().unwrap().to_string(),
            any_of: body["any_of"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_str().unwrap().to_string())
                .collect(),
            boolean: None,
        },
        "range" => Filter::Range {
            field: body["field"].as_str().unwrap().to_string(),
            gt: number("gt"),
            gte: number("gte"),
            lt: number("lt"),
            lte: number("lte"),
        },
        other => panic!("unknown filter kind {other}"),
    }
}

/// The sizes of the sealed segment files the newest manifest of the collection in `dir` names,
/// newest first (how a load was split decides each segment's filtered-search plan). A manifest
/// is JSON followed by its CRC32 (docs/SEGMENT_FORMAT.md).
fn sealed_segment_bytes(dir: &Path) -> Vec<u64> {
    let manifests = files_starting_with(dir, "MANIFEST-").unwrap();
    let Some(newest) = manifests.last() else {
        return Vec::new();
    };
    let bytes = std::fs::read(newest).unwrap();
    let manifest: Json = serde_json::from_slice(&bytes[..bytes.len() - 4]).unwrap();
    manifest["segments"]
        .as_array()
        .unwrap()
        .iter()
        .map(|segment| {
            let file = dir.join(segment["file"].as_str().unwrap());
            std::fs::metadata(file).unwrap().len()
        })
        .collect()
}

struct Measured {
    recall: f64,
    qps: f64,
    short: usize,
}

/// Runs one search per query (timed together), then scores the answers.
fn measure(
    n_matches: &[usize],
    truth: &[Vec<u64>],
    search: impl Fn(usize) -> Vec<u128>,
) -> Measured {
    let n = truth.len();
    // One untimed pass first: the first touches of memory are not the steady state.
    for q in 0..n.min(50) {
        std::hint::black_box(search(q));
    }
    let start = Instant::now();
    let answers: Vec<Vec<u128>> = (0..n).map(&search).collect();
    let qps = n as f64 / start.elapsed().as_secs_f64();
    let (mut found, mut wanted, mut short) = (0usize, 0usize, 0usize);
    for (q, answer) in answers.iter().enumerate() {
        let expected = K.min(n_matches[q]);
        if answer.len() < expected {
            short += 1;
        }
        wanted += truth[q].len();
        found += answer
            .iter()
            .filter(|id| truth[q].contains(&(**id as u64)))
            .count();
    }
    Measured {
        recall: if wanted == 0 {
            1.0
        } else {
            found as f64 / wanted as f64
        },
        qps,
        short,
    }
}

fn main() {
    if std::env::args().any(|a| a == "--bench") && arg("--filters").is_none() {
        // `cargo bench` without the script's files: nothing to measure.
        println!("filtered_search: run by scripts/filtered-vs-peers.sh or scripts/filtered-scale.sh (needs --filters and --attributes)");
        return;
    }
    let filters_path = PathBuf::from(arg("--filters").expect("--filters FILE"));
    let attributes_path = PathBuf::from(arg("--attributes").expect("--attributes FILE"));
    let out_path = PathBuf::from(arg("--json").expect("--json FILE"));
    let efs: Vec<usize> = arg("--efs")
        .unwrap_or_else(|| DEFAULT_EFS.to_string())
        .split(',')
        .map(|ef| ef.parse().unwrap())
        .collect();
    let batch: usize = arg("--batch").map_or(DEFAULT_BATCH, |b| b.parse().unwrap());
    let data = dataset();
    let dim = data.dim;
    let n = data.base.len() / dim;
    let rows: Vec<Attributes> =
        std::io::BufReader::new(std::fs::File::open(&attributes_path).unwrap())
            .lines()
            .map(|line| attributes(&serde_json::from_str(&line.unwrap()).unwrap(), &data.fields))
            .collect();
    assert_eq!(rows.len(), n, "one attributes row per base vector");
    let spec: Json = serde_json::from_slice(&std::fs::read(&filters_path).unwrap()).unwrap();

    let work = tempfile::tempdir().unwrap();
    let mut config = CollectionConfig::new(dim, data.metric);
    config.fields = data.fields.clone();
    let collection = Collection::create(&work.path().join("c"), config).unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let start = Instant::now();
    let (insert_s, flush_s) = rt.block_on(async {
        for first in (0..n).step_by(batch) {
            let last = (first + batch).min(n);
            let ids: Vec<u128> = (first as u128..last as u128).collect();
            collection
                .insert_with_attributes(
                    &ids,
                    &[],
                    &data.base[first * dim..last * dim],
                    &rows[first..last],
                    Some(Durability::Written),
                )
                .await
                .unwrap();
        }
        let insert_s = start.elapsed().as_secs_f64();
        collection.flush().await.unwrap();
        (insert_s, start.elapsed().as_secs_f64() - insert_s)
    });
    while collection.stats().n_unindexed > 0 {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let total_s = start.elapsed().as_secs_f64();
    let stats = collection.stats();
    let segment_mib: Vec<f64> = sealed_segment_bytes(&work.path().join("c"))
        .iter()
        .map(|&bytes| (bytes as f64 / (1 << 20) as f64).round())
        .collect();
    eprintln!(
        "filtered_search: {n} documents with attributes loaded, sealed and indexed in {total_s:.1} s \
         (inserts {insert_s:.1} s, then the flush {flush_s:.1} s; {} sealed segments of {segment_mib:?} MiB; \
         checkpoints gave {} vectors graphs in {:.1} s)",
        stats.n_sealed_segments, stats.n_vectors_built, stats.build_seconds
    );
    if let Some(path) = arg("--load-json") {
        let figures = json!({"n": n, "insert_s": insert_s, "flush_s": flush_s,
            "indexed_s": total_s, "sealed_segments": stats.n_sealed_segments,
            "segment_mib": segment_mib, "vectors_built": stats.n_vectors_built,
            "build_s": stats.build_seconds});
        std::fs::write(path, serde_json::to_vec_pretty(&figures).unwrap()).unwrap();
    }
    drop(data.base);
    // `--reopen`: search the collection as a restart opens it (segments read from their files)
    // instead of as the load left it in memory.
    let collection = if std::env::args().any(|a| a == "--reopen") {
        drop(collection);
        Collection::open(&work.path().join("c")).unwrap()
    } else {
        collection
    };

    let queries: Vec<&[f32]> = data.queries.chunks_exact(dim).collect();
    let search = |q: usize, filter: Option<Filter>, top_k: usize, ef: usize, exact: bool| {
        collection
            .search(&SearchRequest {
                user_ids: Vec::new(),
                vector: queries[q].to_vec(),
                top_k,
                ef,
                exact,
                min_seq: 0,
                filter,
                ..Default::default()
            })
            .unwrap()
    };
    // Which rows each distinct filter matches, for post-filtering (filters repeat across
    // queries: at most one evaluation over the rows per distinct filter).
    let mut matched_rows: HashMap<String, Rc<Vec<bool>>> = HashMap::new();
    let mut results = Vec::new();
    for entry in spec["filters"].as_array().unwrap() {
        let name = entry["name"].as_str().unwrap();
        let per_query_json = entry["per_query"].as_array().unwrap();
        let per_query: Vec<Option<Filter>> = per_query_json
            .iter()
            .map(|f| (!f.is_null()).then(|| filter(f)))
            .collect();
        let n_matches: Vec<usize> = entry["n_matches"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as usize)
            .collect();
        let truth: Vec<Vec<u64>> = entry["truth"]
            .as_array()
            .unwrap()
            .iter()
            .map(|ids| {
                ids.as_array()
                    .unwrap()
                    .iter()
                    .map(|i| i.as_u64().unwrap())
                    .collect()
            })
            .collect();
        let mut record = |mode: String, m: Measured| {
            eprintln!(
                "  {name:<14} {mode:<16} recall@10 {:.4}  {:>8.0} q/s  short {}",
                m.recall, m.qps, m.short
            );
            results.push(json!({"filter": name, "system": "tarn", "mode": mode,
                "recall": m.recall, "qps": m.qps, "short": m.short}));
        };
        for &ef in &efs {
            let m = measure(&n_matches, &truth, |q| {
                search(q, per_query[q].clone(), K, ef, false)
                    .iter()
                    .map(|h| h.doc_id)
                    .collect()
            });
            record(format!("filtered ef={ef}"), m);
        }
        if per_query.iter().any(Option::is_some) {
            let m = measure(&n_matches, &truth, |q| {
                search(q, per_query[q].clone(), K, 0, true)
                    .iter()
                    .map(|h| h.doc_id)
                    .collect()
            });
            record("exact scan".to_string(), m);
            // Post-filtering: ask for enough unfiltered hits to expect 2 k matches among them.
            let matched: Vec<Rc<Vec<bool>>> = per_query_json
                .iter()
                .zip(&per_query)
                .map(|(text, f)| {
                    let f = f.as_ref().unwrap();
                    matched_rows
                        .entry(text.to_string())
                        .or_insert_with(|| Rc::new(rows.iter().map(|row| f.matches(row)).collect()))
                        .clone()
                })
                .collect();
            let m = measure(&n_matches, &truth, |q| {
                let selectivity = (n_matches[q].max(1) as f64 / n as f64).min(1.0);
                let top_k = ((2 * K) as f64 / selectivity).ceil() as usize;
                let top_k = top_k.clamp(K, POSTFILTER_MAX);
                search(q, None, top_k, top_k, false)
                    .iter()
                    .map(|h| h.doc_id)
                    .filter(|id| matched[q][*id as usize])
                    .take(K)
                    .collect()
            });
            record("post-filter".to_string(), m);
        }
    }
    std::fs::write(&out_path, serde_json::to_vec_pretty(&results).unwrap()).unwrap();
}
