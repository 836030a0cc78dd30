//! Filtered search in both segment kinds against a brute-force filtered oracle: every answer
//! holds `min(k, matching live documents)` hits, all matching; the exact path (few matches, or
//! `exact`) has recall 1.0, the graph path (many matches) at least 0.95; through tombstones,
//! re-inserts with new attributes, an unindexed tail, sealing, the file and a rebuild.

use std::collections::HashMap;

use tarn_index::{
    Attributes, BuildConfig, FieldSpec, FieldType, Filter, Hit, Metric, MutableSegment, Schema,
    SealedSegment, Value, FILTER_EXACT_SCAN_MAX_MATCHES,
};
use tarn_testkit::clustered_vectors;

use super::{config, DIM};

const N: usize = 5000;
const K: usize = 10;

fn schema() -> Schema {
    Schema::new(vec![
        FieldSpec::new("bucket", FieldType::Keyword),
        FieldSpec::new("size", FieldType::Number),
        FieldSpec::new("tags", FieldType::Keywords),
        FieldSpec::new("even", FieldType::Bool),
    ])
    .unwrap()
}

fn attributes(i: usize, version: usize) -> Attributes {
    let mut attributes = Attributes::new();
    attributes.insert("bucket", Value::Keyword(format!("b{}", (i + version) % 50)));
    attributes.insert("size", Value::Number(i as f64));
    attributes.insert(
        "tags",
        Value::Keywords(vec![format!("t{}", i % 7), format!("u{}", i % 11)]),
    );
    if !i.is_multiple_of(5) {
        attributes.insert("even", Value::Bool(i.is_multiple_of(2)));
    }
    attributes
}

fn bucket(name: &str) -> Filter {
    Filter::Match {
        field: "bucket".to_string(),
        any_of: vec![name.to_string()],
        boolean: None,
    }
}

fn size(gte: f64, lt: f64) -> Filter {
    Filter::Range {
        field: "size".to_string(),
        gt: None,
        gte: Some(gte),
        lt: Some(lt),
        lte: None,
    }
}

fn even(value: bool) -> Filter {
    Filter::Match {
        field: "even".to_string(),
        any_of: Vec::new(),
        boolean: Some(value),
    }
}

/// Filters from no match to nearly all, on both sides of the exact-scan threshold.
fn filters() -> Vec<(&'static str, Filter)> {
    let tag = Filter::Match {
        field: "tags".to_string(),
        any_of: vec!["t3".to_string()],
        boolean: None,
    };
    vec![
        ("none", Filter::Any(Vec::new())),
        ("one", size(42.0, 43.0)),
        ("k-1", size((N - K + 1) as f64, N as f64)),
        ("one bucket", bucket("b3")),
        ("tag and even", Filter::All(vec![tag, even(true)])),
        (
            "no value",
            Filter::Not(Box::new(Filter::Exists("even".to_string()))),
        ),
        ("most sizes", size(0.0, 4000.0)),
        ("not one bucket", Filter::Not(Box::new(bucket("b3")))),
        ("even", even(true)),
        ("has even", Filter::Exists("even".to_string())),
    ]
}

/// The live documents of the model: doc id -> (vector, attributes).
type Model = HashMap<u128, (Vec<f32>, Attributes)>;

fn oracle(model: &Model, filter: &Filter, query: &[f32], k: usize) -> Vec<u128> {
    let mut scored: Vec<(f32, u128)> = model
        .iter()
        .filter(|(_, (_, attributes))| filter.matches(attributes))
        .map(|(doc_id, (vector, _))| (Metric::L2.distance(query, vector), *doc_id))
        .collect();
    scored.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    scored
        .into_iter()
        .take(k)
        .map(|(_, doc_id)| doc_id)
        .collect()
}

/// Checks every filter over `queries`; returns the mean recall per filter.
fn check(
    what: &str,
    model: &Model,
    queries: &[f32],
    search: impl Fn(&[f32], &Filter, bool) -> Vec<Hit>,
) {
    for (name, filter) in filters() {
        let n_matches = model.values().filter(|(_, a)| filter.matches(a)).count();
        let exact_path = n_matches <= FILTER_EXACT_SCAN_MAX_MATCHES;
        for exact in [false, true] {
            let mut recall_sum = 0.0;
            for query in queries.chunks_exact(DIM) {
                let hits = search(query, &filter, exact);
                assert_eq!(
                    hits.len(),
                    K.min(n_matches),
                    "{what}, {name} (exact {exact}): {n_matches} matches"
                );
                for hit in &hits {
                    let (_, attributes) = &model[&hit.doc_id];
                    assert!(filter.matches(attributes), "{what}, {name}: {}", hit.doc_id);
                }
                let truth = oracle(model, &filter, query, K);
                let found = truth
                    .iter()
                    .filter(|doc_id| hits.iter().any(|hit| hit.doc_id == **doc_id))
                    .count();
                recall_sum += if truth.is_empty() {
                    1.0
                } else {
                    found as f64 / truth.len() as f64
                };
            }
            let recall = recall_sum / (queries.len() / DIM) as f64;
            eprintln!("{what}, {name} ({n_matches} matches, exact {exact}): recall {recall:.3}");
            if exact || exact_path {
                assert_eq!(recall, 1.0, "{what}, {name}, exact {exact}");
            } else {
                assert!(recall >= 0.95, "{what}, {name}: recall {recall}");
            }
        }
    }
}

#[test]
fn filtered_search_returns_min_k_matches_with_recall_1_on_the_exact_path_in_both_kinds() {
    let base = clustered_vectors(N, DIM, 40, 11);
    let queries = clustered_vectors(10, DIM, 40, 12);
    let mutable = MutableSegment::with_schema(config(Metric::L2), schema());
    let mut model = Model::new();
    let row = |i: usize| base[i * DIM..(i + 1) * DIM].to_vec();
    for i in 0..N {
        mutable
            .upsert_with_attributes(7, i as u128, &row(i), &attributes(i, 0))
            .unwrap();
        model.insert(i as u128, (row(i), attributes(i, 0)));
    }
    while mutable.index_pending(1000) > 0 {}
    // Tombstones: removals and re-inserts whose new attributes differ.
    for i in (0..N).step_by(13) {
        mutable.remove(7, i as u128);
        model.remove(&(i as u128));
    }
    for i in (1..N).step_by(17) {
        mutable
            .upsert_with_attributes(7, i as u128, &row(i), &attributes(i, 1))
            .unwrap();
        model.insert(i as u128, (row(i), attributes(i, 1)));
    }
    // Another tenant with matching documents, never returned for tenant 7.
    for i in 0..50 {
        mutable
            .upsert_with_attributes(8, i, &row(0), &attributes(3, 0))
            .unwrap();
    }
    assert!(
        mutable.n_unindexed() > 0,
        "the re-inserts are an unindexed tail"
    );
    check("mutable", &model, &queries, |q, f, exact| {
        mutable.search_filtered(7, q, K, 64, exact, Some(f))
    });
    let sealed = SealedSegment::seal(&mutable, 1, 1);
    check("sealed", &model, &queries, |q, f, exact| {
        sealed.search_filtered(7, q, K, 64, exact, Some(f)).unwrap()
    });
    let opened = SealedSegment::decode(&sealed.encode().unwrap(), config(Metric::L2)).unwrap();
    check("opened", &model, &queries, |q, f, exact| {
        opened.search_filtered(7, q, K, 64, exact, Some(f)).unwrap()
    });
    for i in (2..N).step_by(19) {
        if opened.tombstone(7, i as u128) {
            model.remove(&(i as u128));
        }
    }
    check("tombstoned", &model, &queries, |q, f, exact| {
        opened.search_filtered(7, q, K, 64, exact, Some(f)).unwrap()
    });
    let rebuilt =
        SealedSegment::rebuild(&[&opened], 2, config(Metric::L2), &BuildConfig::default()).unwrap();
    check("rebuilt", &model, &queries, |q, f, exact| {
        rebuilt
            .search_filtered(7, q, K, 64, exact, Some(f))
            .unwrap()
    });
    for (doc_id, (vector, attributes)) in model.iter().take(100) {
        assert_eq!(
            rebuilt.get_with_attributes(7, *doc_id, true).unwrap(),
            Some((vector.clone(), attributes.clone()))
        );
    }
    let mut matching = rebuilt.matching_documents(7, &bucket("b3"));
    matching.sort_unstable();
    let mut expected: Vec<u128> = model
        .iter()
        .filter(|(_, (_, attributes))| bucket("b3").matches(attributes))
        .map(|(doc_id, _)| *doc_id)
        .collect();
    expected.sort_unstable();
    assert_eq!(matching, expected);
}
