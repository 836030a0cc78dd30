//! Attributes and filtered search through the public API: a filtered search returns
//! `min(k, matching live documents)` hits, exactly the brute-force filtered answer, across the
//! mutable, frozen and sealed segments, tenants, removals and re-inserts, through replay,
//! checkpoints, merges, rebuilds and reopening; fields added later; every bad input refused
//! naming its field with nothing logged; old segment files; damaged attribute sections.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tarn_collection::{
    Attributes, Collection, CollectionConfig, CollectionError, FieldSpec, FieldType, Filter,
    SearchRequest, Value,
};
use tarn_index::Metric;

use crate::{config, runtime, DIM};

pub(crate) const K: usize = 10;

/// (tenant, doc) -> (vector, attributes) of the live documents, as acknowledged.
pub(crate) type Model = HashMap<(u128, u128), (Vec<f32>, Attributes)>;

pub(crate) fn fields() -> Vec<FieldSpec> {
    vec![
        FieldSpec::new("section", FieldType::Keyword),
        FieldSpec::new("tags", FieldType::Keywords),
        FieldSpec::new("size", FieldType::Number),
        FieldSpec::new("flag", FieldType::Bool),
    ]
}

pub(crate) fn attributed_config() -> CollectionConfig {
    let mut config = config();
    config.fields = fields();
    config
}

/// Random attributes; the sections "only-one", "nine" and "tail" are never drawn (tests
/// assign them), and each field is sometimes absent.
pub(crate) fn random_attributes(rng: &mut StdRng) -> Attributes {
    let mut attributes = Attributes::new();
    attributes.insert(
        "section",
        Value::Keyword(format!("s{}", rng.random_range(0..5))),
    );
    if rng.random_bool(0.9) {
        let tags = (0..10)
            .filter(|_| rng.random_bool(0.2))
            .map(|tag| format!("t{tag}"))
            .collect();
        attributes.insert("tags", Value::Keywords(tags));
    }
    if rng.random_bool(0.9) {
        attributes.insert("size", Value::Number(rng.random_range(0..1000) as f64));
    }
    if rng.random_bool(0.8) {
        attributes.insert("flag", Value::Bool(rng.random_bool(0.5)));
    }
    attributes
}

pub(crate) fn section(name: &str) -> Filter {
    Filter::Match {
        field: "section".to_string(),
        any_of: vec![name.to_string()],
        boolean: None,
    }
}

pub(crate) fn random_vector(rng: &mut StdRng) -> Vec<f32> {
    (0..DIM).map(|_| rng.random_range(-1.0..1.0)).collect()
}

/// Filters matching no document, one, k - 1, some, many, and only documents of the mutable
/// tail.
pub(crate) fn filters() -> Vec<(&'static str, Filter)> {
    let tags = |any_of: &[&str]| Filter::Match {
        field: "tags".to_string(),
        any_of: any_of.iter().map(|tag| tag.to_string()).collect(),
        boolean: None,
    };
    vec![
        ("none", Filter::Any(Vec::new())),
        ("one", section("only-one")),
        ("k-1", section("nine")),
        ("tail only", section("tail")),
        ("tags", tags(&["t1", "t2"])),
        (
            "size range",
            Filter::Range {
                field: "size".to_string(),
                gt: None,
                gte: Some(100.0),
                lt: Some(300.0),
                lte: None,
            },
        ),
        (
            "no flag",
            Filter::Not(Box::new(Filter::Exists("flag".to_string()))),
        ),
        ("everything", Filter::All(Vec::new())),
        (
            "compound",
            Filter::All(vec![
                tags(&["t3"]),
                Filter::Range {
                    field: "size".to_string(),
                    gt: None,
                    gte: Some(500.0),
                    lt: None,
                    lte: None,
                },
                Filter::Not(Box::new(Filter::Match {
                    field: "flag".to_string(),
                    any_of: Vec::new(),
                    boolean: Some(true),
                })),
            ]),
        ),
    ]
}

pub(crate) fn filtered(
    users: &[u128],
    vector: &[f32],
    k: usize,
    exact: bool,
    filter: &Filter,
) -> SearchRequest {
    SearchRequest {
        user_ids: users.to_vec(),
        vector: vector.to_vec(),
        top_k: k,
        exact,
        filter: Some(filter.clone()),
        ..SearchRequest::default()
    }
}

/// The brute-force filtered answer: the nearest `k` matching live documents of `users`.
fn oracle(
    model: &Model,
    users: &[u128],
    filter: &Filter,
    query: &[f32],
    k: usize,
) -> Vec<(u128, u128)> {
    let mut scored: Vec<(f32, (u128, u128))> = model
        .iter()
        .filter(|((user, _), (_, attributes))| users.contains(user) && filter.matches(attributes))
        .map(|(pair, (vector, _))| (Metric::L2.distance(query, vector), *pair))
        .collect();
    scored.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    scored.into_iter().take(k).map(|(_, pair)| pair).collect()
}

/// Every filter, for single tenants, several, and one without documents, approximate and
/// exact: `min(k, matches)` hits, all matching, exactly the oracle's (every filter here
/// matches at most 2,048 documents per partition: the exact path, recall 1.0).
pub(crate) fn check(c: &Collection, model: &Model, queries: &[Vec<f32>], when: &str) {
    for (name, filter) in filters() {
        for users in [vec![1], vec![2], vec![1, 2], vec![3]] {
            let n_matches = model
                .iter()
                .filter(|((user, _), (_, a))| users.contains(user) && filter.matches(a))
                .count();
            for exact in [false, true] {
                for query in queries {
                    let hits = c
                        .search(&filtered(&users, query, K, exact, &filter))
                        .unwrap();
                    assert_eq!(
                        hits.len(),
                        K.min(n_matches),
                        "{when}, {name}, tenants {users:?}, exact {exact}: {n_matches} match"
                    );
                    let mut found: Vec<(u128, u128)> =
                        hits.iter().map(|h| (h.user_id, h.doc_id)).collect();
                    for pair in &found {
                        assert!(
                            filter.matches(&model[pair].1),
                            "{when}, {name}: {pair:?} does not match"
                        );
                    }
                    let mut truth = oracle(model, &users, &filter, query, K);
                    found.sort_unstable();
                    truth.sort_unstable();
                    assert_eq!(
                        found, truth,
                        "{when}, {name}, tenants {users:?}, exact {exact}"
                    );
                }
            }
        }
    }
    for (pair, (vector, attributes)) in model.iter().step_by(7) {
        let got = c.get_with_attributes(pair.0, &[pair.1]).unwrap();
        assert_eq!(
            got,
            vec![(pair.1, vector.clone(), attributes.clone())],
            "{when}: {pair:?}"
        );
    }
}

/// Inserts `docs` of `users` with random vectors and attributes (or `assigned` ones).
pub(crate) async fn insert(
    c: &Collection,
    model: &mut Model,
    rng: &mut StdRng,
    users: &[u128],
    docs: std::ops::Range<u128>,
    assigned: Option<&Attributes>,
) -> u64 {
    let docs: Vec<u128> = docs.collect();
    let mut last = 0;
    for chunk in docs.chunks(50) {
        let vectors: Vec<Vec<f32>> = chunk.iter().map(|_| random_vector(rng)).collect();
        let attributes: Vec<Attributes> = chunk
            .iter()
            .map(|_| assigned.cloned().unwrap_or_else(|| random_attributes(rng)))
            .collect();
        let flat: Vec<f32> = vectors.concat();
        last = c
            .insert_with_attributes(chunk, users, &flat, &attributes, None)
            .await
            .unwrap();
        for &user in users {
            for (i, doc) in chunk.iter().enumerate() {
                model.insert((user, *doc), (vectors[i].clone(), attributes[i].clone()));
            }
        }
    }
    last
}

pub(crate) fn only(section_name: &str) -> Attributes {
    let mut attributes = Attributes::new();
    attributes.insert("section", Value::Keyword(section_name.to_string()));
    attributes.insert("flag", Value::Bool(false));
    attributes
}

#[test]
fn filtered_search_is_exact_and_never_short_through_replay_checkpoints_merges_and_reopening() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c");
    let rt = runtime();
    let mut config = attributed_config();
    config.max_sealed_segments = 2;
    config.rebuild_tombstone_fraction = 0.05;
    let mut rng = StdRng::seed_from_u64(28);
    let queries: Vec<Vec<f32>> = (0..4).map(|_| random_vector(&mut rng)).collect();
    let mut model = Model::new();
    {
        let c = Collection::create(&path, config).unwrap();
        rt.block_on(async {
            insert(&c, &mut model, &mut rng, &[1], 0..500, None).await;
            insert(&c, &mut model, &mut rng, &[2], 0..500, None).await;
            // One insert for two tenants: the same attributes for both.
            insert(&c, &mut model, &mut rng, &[1, 2], 1000..1100, None).await;
            insert(
                &c,
                &mut model,
                &mut rng,
                &[1],
                2000..2001,
                Some(&only("only-one")),
            )
            .await;
            let seq = insert(
                &c,
                &mut model,
                &mut rng,
                &[1],
                3000..3009,
                Some(&only("nine")),
            )
            .await;
            c.wait_applied(seq, Duration::from_secs(10)).await.unwrap();
        });
        check(&c, &model, &queries, "mutable");
    }
    // Reopened without a checkpoint: everything comes back from the WAL.
    let c = Collection::open(&path).unwrap();
    check(&c, &model, &queries, "replayed");
    rt.block_on(c.flush()).unwrap();
    assert_eq!(c.stats().n_sealed_segments, 1);
    check(&c, &model, &queries, "sealed");
    rt.block_on(async {
        // Removals, and re-inserts whose new attributes win (some move into "nine"'s place:
        // the old "nine" documents are re-inserted as something else).
        let removed: Vec<u128> = (0..500).step_by(9).collect();
        let seq = c.remove(&removed, &[1], None).await.unwrap();
        for doc in &removed {
            model.remove(&(1, *doc));
        }
        c.wait_applied(seq, Duration::from_secs(10)).await.unwrap();
        insert(&c, &mut model, &mut rng, &[2], 0..40, None).await;
        insert(&c, &mut model, &mut rng, &[1], 3000..3001, None).await;
        insert(
            &c,
            &mut model,
            &mut rng,
            &[1],
            3100..3101,
            Some(&only("nine")),
        )
        .await;
        // Documents only in the mutable tail.
        let seq = insert(
            &c,
            &mut model,
            &mut rng,
            &[2],
            4000..4015,
            Some(&only("tail")),
        )
        .await;
        c.wait_applied(seq, Duration::from_secs(10)).await.unwrap();
    });
    check(&c, &model, &queries, "tail");
    // Two more checkpoints: more segments than allowed (merges) and many removals (rebuilds).
    rt.block_on(async {
        c.flush().await.unwrap();
        let removed: Vec<u128> = (1..500).step_by(4).collect();
        c.remove(&removed, &[2], None).await.unwrap();
        for doc in &removed {
            model.remove(&(2, *doc));
        }
        insert(&c, &mut model, &mut rng, &[1], 5000..5100, None).await;
        c.flush().await.unwrap();
    });
    assert!(c.stats().n_sealed_segments <= 2, "{:?}", c.stats());
    assert_eq!(c.stats().n_documents as usize, model.len());
    check(&c, &model, &queries, "merged and rebuilt");
    drop(c);
    let c = Collection::open(&path).unwrap();
    check(&c, &model, &queries, "reopened");
    let mut matching = c.matching_documents(&[1, 2], &section("nine")).unwrap();
    matching.sort_unstable();
    let mut expected: Vec<(u128, u128)> = model
        .iter()
        .filter(|(_, (_, a))| section("nine").matches(a))
        .map(|(pair, _)| *pair)
        .collect();
    expected.sort_unstable();
    assert_eq!(matching, expected);
    assert_eq!(matching.len(), K - 1);
    // Count agrees with the model, by filter and without, over segments merged and rebuilt.
    for tenants in [&[1u128, 2][..], &[1], &[2], &[2, 2, 1], &[9]] {
        for filter in [None, Some(section("nine")), Some(Filter::All(Vec::new()))] {
            let expected = model
                .iter()
                .filter(|((user, _), (_, a))| {
                    tenants.contains(user) && filter.as_ref().is_none_or(|f| f.matches(a))
                })
                .count() as u64;
            assert_eq!(
                c.count(tenants, filter.as_ref()).unwrap(),
                expected,
                "{tenants:?} {filter:?}"
            );
        }
    }
    // Scroll lists the model's pairs once each, in order, page by page, with their values.
    let everything = tarn_collection::FieldSelection::everything();
    for (limit, filter) in [
        (1, None),
        (37, None),
        (10_000, None),
        (5, Some(section("nine"))),
    ] {
        let mut listed = Vec::new();
        let mut after = None;
        loop {
            let page = c
                .scroll(&[2, 1], filter.as_ref(), after, limit, &everything, true)
                .unwrap();
            assert!(page.docs.len() <= limit);
            for (user, doc, vector, values) in &page.docs {
                let (stored, attributes) = &model[&(*user, *doc)];
                assert_eq!((vector, values), (stored, attributes), "{user} {doc}");
            }
            listed.extend(page.docs.iter().map(|(user, doc, _, _)| (*user, *doc)));
            match page.next {
                Some(next) => after = Some(next),
                None => break,
            }
        }
        let mut expected: Vec<(u128, u128)> = model
            .iter()
            .filter(|(_, (_, a))| filter.as_ref().is_none_or(|f| f.matches(a)))
            .map(|(pair, _)| *pair)
            .collect();
        expected.sort_unstable();
        assert_eq!(listed, expected, "limit {limit} {filter:?}");
    }
    let page = c
        .scroll(&[1], None, None, 3, &Default::default(), false)
        .unwrap();
    assert!(page
        .docs
        .iter()
        .all(|(_, _, v, a)| v.is_empty() && a.is_empty()));
}

#[test]
fn filtered_searches_are_never_short_while_checkpoints_seal_merge_and_rebuild() {
    let dir = tempfile::tempdir().unwrap();
    let rt = runtime();
    let mut config = attributed_config();
    config.max_sealed_segments = 2;
    config.rebuild_tombstone_fraction = 0.05;
    let c = Collection::create(&dir.path().join("c"), config).unwrap();
    let mut rng = StdRng::seed_from_u64(7);
    let mut model = Model::new();
    const N_STABLE: usize = 300;
    rt.block_on(async {
        let seq = insert(
            &c,
            &mut model,
            &mut rng,
            &[1],
            0..N_STABLE as u128,
            Some(&only("stable")),
        )
        .await;
        c.wait_applied(seq, Duration::from_secs(10)).await.unwrap();
    });
    let stop = Arc::new(AtomicBool::new(false));
    let searcher = {
        let (c, stop) = (c.clone(), Arc::clone(&stop));
        std::thread::spawn(move || {
            let mut rng = StdRng::seed_from_u64(8);
            let mut n_searches = 0;
            while !stop.load(Ordering::Relaxed) {
                let query = random_vector(&mut rng);
                for (k, exact) in [(K, false), (K, true), (400, false)] {
                    let hits = c
                        .search(&filtered(&[1], &query, k, exact, &section("stable")))
                        .unwrap();
                    assert_eq!(hits.len(), k.min(N_STABLE), "k {k}, exact {exact}");
                    assert!(hits.iter().all(|h| (h.doc_id as usize) < N_STABLE));
                }
                n_searches += 1;
            }
            n_searches
        })
    };
    rt.block_on(async {
        for round in 0..6u128 {
            let docs = 1000 + round * 100..1000 + (round + 1) * 100;
            insert(&c, &mut model, &mut rng, &[1], docs, None).await;
            let removed: Vec<u128> = (1000..1000 + (round + 1) * 100).step_by(3).collect();
            c.remove(&removed, &[1], None).await.unwrap();
            c.flush().await.unwrap();
        }
    });
    stop.store(true, Ordering::Relaxed);
    let n_searches = searcher.join().unwrap();
    assert!(n_searches > 0);
    assert!(c.stats().n_sealed_segments <= 2);
}

/// The message of an `InvalidArgument` for `field`, or a panic.
fn refused<T: std::fmt::Debug>(result: tarn_collection::Result<T>, field: &str) -> String {
    match result {
        Err(CollectionError::InvalidArgument { field: f, reason }) => {
            assert_eq!(f, field, "{reason}");
            reason
        }
        other => panic!("expected InvalidArgument({field}), got {other:?}"),
    }
}

#[test]
fn every_bad_attribute_filter_and_field_is_refused_naming_it_and_nothing_is_logged() {
    let dir = tempfile::tempdir().unwrap();
    let rt = runtime();
    let c = Collection::create(&dir.path().join("c"), attributed_config()).unwrap();
    let one = |field: &str, value: Value| {
        let mut attributes = Attributes::new();
        attributes.insert(field, value);
        attributes
    };
    let vector = vec![0.5f32; DIM];
    let before = c.stats();
    rt.block_on(async {
        let two = [vector.clone(), vector.clone()].concat();
        let reason = refused(
            c.insert_with_attributes(&[1, 2], &[], &two, &[Attributes::new()], None)
                .await,
            "attributes",
        );
        assert!(reason.contains("one per document (2), got 1"), "{reason}");
        let cases = [
            (
                one("colour", Value::Keyword("red".into())),
                "\"colour\" is not declared",
            ),
            (
                one("size", Value::Keyword("big".into())),
                "\"size\" is declared NUMBER",
            ),
            (one("size", Value::Number(f64::NAN)), "\"size\" has a NaN"),
            (
                one("section", Value::Keyword("x".repeat(257))),
                "\"section\" has a keyword of 257",
            ),
            (
                one("tags", Value::Keywords(vec!["t".into(); 1025])),
                "\"tags\" has 1025 keywords",
            ),
            (one("flag", Value::Number(1.0)), "\"flag\" is declared BOOL"),
        ];
        for (attributes, expected) in cases {
            // The second document is the bad one.
            let reason = refused(
                c.insert_with_attributes(
                    &[1, 2],
                    &[5],
                    &two,
                    &[Attributes::new(), attributes],
                    None,
                )
                .await,
                "attributes",
            );
            assert!(
                reason.contains("document 1") && reason.contains(expected),
                "{reason}"
            );
        }
        // More than 64 fields in one document.
        let mut wide = CollectionConfig::new(DIM, tarn_collection::MetricName::L2);
        wide.fields = (0..70)
            .map(|i| FieldSpec::new(format!("f{i}"), FieldType::Bool))
            .collect();
        let w = Collection::create(&dir.path().join("wide"), wide).unwrap();
        let too_many: Attributes = (0..65)
            .map(|i| (format!("f{i}"), Value::Bool(true)))
            .collect();
        let reason = refused(
            w.insert_with_attributes(&[1], &[], &vector, &[too_many], None)
                .await,
            "attributes",
        );
        assert!(reason.contains("65 fields, at most 64"), "{reason}");
        assert_eq!(w.stats().last_appended_seq, 0);

        // Fields: empty, already declared, a bad name, too many, and at creation.
        let reason = refused(c.add_fields(Vec::new()).await, "fields");
        assert!(reason.contains("must not be empty"), "{reason}");
        let reason = refused(
            c.add_fields(vec![FieldSpec::new("size", FieldType::Keyword)])
                .await,
            "fields",
        );
        assert!(
            reason.contains("\"size\" is declared more than once"),
            "{reason}"
        );
        let reason = refused(
            c.add_fields(vec![FieldSpec::new("has space", FieldType::Bool)])
                .await,
            "fields",
        );
        assert!(reason.contains("\"has space\""), "{reason}");
        let many = (0..253)
            .map(|i| FieldSpec::new(format!("g{i}"), FieldType::Bool))
            .collect();
        let reason = refused(c.add_fields(many).await, "fields");
        assert!(
            reason.contains("257 fields declared, at most 256"),
            "{reason}"
        );
    });
    let mut duplicate = config();
    duplicate.fields = vec![
        FieldSpec::new("a", FieldType::Bool),
        FieldSpec::new("a", FieldType::Number),
    ];
    let reason = refused(
        Collection::create(&dir.path().join("dup"), duplicate),
        "fields",
    );
    assert!(
        reason.contains("\"a\" is declared more than once"),
        "{reason}"
    );
    assert!(!dir.path().join("dup").join("collection.json").exists());

    // Filters.
    let mut deep = Filter::Exists("size".to_string());
    for _ in 0..32 {
        deep = Filter::Not(Box::new(deep));
    }
    let range = |field: &str, gte: Option<f64>| Filter::Range {
        field: field.to_string(),
        gt: None,
        gte,
        lt: None,
        lte: None,
    };
    let filters = [
        (
            Filter::Exists("colour".to_string()),
            "\"colour\" is not declared",
        ),
        (
            Filter::Match {
                field: "size".to_string(),
                any_of: vec!["1".to_string()],
                boolean: None,
            },
            "\"size\"",
        ),
        (range("section", Some(1.0)), "\"section\""),
        (range("size", None), "\"size\""),
        (range("size", Some(f64::NAN)), "\"size\""),
        (deep, "deeper than 32"),
        (
            Filter::Match {
                field: "tags".to_string(),
                any_of: vec!["t".to_string(); 1025],
                boolean: None,
            },
            "\"tags\"",
        ),
        (
            Filter::Any(
                (0..1100)
                    .map(|_| Filter::Exists("size".to_string()))
                    .collect(),
            ),
            "more than 1024 nodes",
        ),
    ];
    for (filter, expected) in filters {
        let request = filtered(&[1], &vector, 10, false, &filter);
        let reason = refused(c.validate_search(&request), "filter");
        assert!(reason.contains(expected), "{reason}");
        refused(c.search(&request), "filter");
        refused(c.matching_documents(&[1], &filter), "filter");
        refused(c.count(&[1], Some(&filter)), "filter");
        let all = tarn_collection::FieldSelection::everything();
        refused(
            c.scroll(&[1], Some(&filter), None, 9, &all, false),
            "filter",
        );
    }
    refused(c.count(&vec![1; 10_001], None), "user_ids");
    let all = tarn_collection::FieldSelection::everything();
    refused(c.scroll(&[1], None, None, 0, &all, false), "limit");
    refused(c.scroll(&[1], None, None, 10_001, &all, false), "limit");
    let unknown = tarn_collection::FieldSelection {
        fields: vec!["colour".into()],
        payload: false,
    };
    refused(
        c.scroll(&[1], None, None, 10, &unknown, false),
        "output_fields",
    );
    let after = c.stats();
    assert_eq!(after.last_appended_seq, before.last_appended_seq);
    assert_eq!(after.n_documents, 0);
    assert_eq!(c.schema().len(), fields().len());
}

/// The fields `collection.json` in `dir` declares.
fn fields_on_disk(dir: &Path) -> Vec<String> {
    let bytes = std::fs::read(dir.join("collection.json")).unwrap();
    let config: CollectionConfig = serde_json::from_slice(&bytes[..bytes.len() - 4]).unwrap();
    config.fields.into_iter().map(|spec| spec.name).collect()
}

/// Writes `config` as `collection.json` (JSON and its CRC32, as the collection does).
fn write_config(dir: &Path, config: &CollectionConfig) {
    let mut bytes = serde_json::to_vec_pretty(config).unwrap();
    let crc = crc32fast::hash(&bytes);
    bytes.extend_from_slice(&crc.to_le_bytes());
    std::fs::write(dir.join("collection.json"), bytes).unwrap();
}

#[test]
fn added_fields_take_values_from_then_on_older_documents_have_none_and_replay_restores_them() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c");
    let rt = runtime();
    let c = Collection::create(&path, attributed_config()).unwrap();
    let mut rng = StdRng::seed_from_u64(3);
    let mut model = Model::new();
    let colour = |name: &str| {
        let mut attributes = only("s1");
        attributes.insert("colour", Value::Keyword(name.to_string()));
        attributes
    };
    let red = Filter::Match {
        field: "colour".to_string(),
        any_of: vec!["red".to_string()],
        boolean: None,
    };
    let has_colour = Filter::Exists("colour".to_string());
    let no_colour = Filter::Not(Box::new(has_colour.clone()));
    rt.block_on(async {
        insert(&c, &mut model, &mut rng, &[1], 0..100, None).await;
        // Not declared yet: refused.
        refused(
            c.insert_with_attributes(&[500], &[1], &[0.5; DIM], &[colour("red")], None)
                .await,
            "attributes",
        );
        let seq = c
            .add_fields(vec![FieldSpec::new("colour", FieldType::Keyword)])
            .await
            .unwrap();
        assert_eq!(c.stats().applied_seq, seq, "applied when it returns");
        insert(
            &c,
            &mut model,
            &mut rng,
            &[1],
            100..110,
            Some(&colour("red")),
        )
        .await;
        let seq = insert(
            &c,
            &mut model,
            &mut rng,
            &[1],
            110..115,
            Some(&colour("blue")),
        )
        .await;
        c.wait_applied(seq, Duration::from_secs(10)).await.unwrap();
    });
    assert_eq!(c.schema().len(), 5);
    assert_eq!(fields_on_disk(&path).last().unwrap(), "colour");
    let doc_3 = model[&(1, 3)].1.clone();
    let expect = |c: &Collection, when: &str| {
        let count = |filter: &Filter| {
            c.search(&filtered(&[1], &[0.0; DIM], 1000, false, filter))
                .unwrap()
                .len()
        };
        assert_eq!(count(&red), 10, "{when}");
        assert_eq!(count(&has_colour), 15, "{when}");
        assert_eq!(count(&no_colour), 100, "{when}");
        let old = c.get_with_attributes(1, &[3]).unwrap();
        assert!(old[0].2.get("colour").is_none(), "{when}");
        assert_eq!(old[0].2, doc_3);
        let new = c.get_with_attributes(1, &[112]).unwrap();
        assert_eq!(new[0].2, colour("blue"), "{when}");
        assert_eq!(c.schema().field_type("colour"), Some(FieldType::Keyword));
    };
    expect(&c, "added");
    drop(c);
    // A copy's file (a restore or a move) that lacks the field: replaying the log adds it
    // back and rewrites the file.
    write_config(&path, &attributed_config());
    assert_eq!(fields_on_disk(&path).len(), 4);
    let c = Collection::open(&path).unwrap();
    expect(&c, "replayed");
    assert_eq!(fields_on_disk(&path).len(), 5);
    // Checkpointed twice (the WAL before the fields' entry is truncated): the file holds them.
    rt.block_on(async {
        c.flush().await.unwrap();
        // A re-insert of an older document, so that the counts stay.
        insert(&c, &mut model, &mut rng, &[1], 0..1, None).await;
        c.flush().await.unwrap();
    });
    expect(&c, "checkpointed");
    drop(c);
    let c = Collection::open(&path).unwrap();
    expect(&c, "reopened");
    assert_eq!(c.config().fields.len(), 5);
    // Adding again continues the schema, across the sealed segments' older ones.
    rt.block_on(async {
        c.add_fields(vec![FieldSpec::new("weight", FieldType::Number)])
            .await
            .unwrap();
        let mut heavy = colour("red");
        heavy.insert("weight", Value::Number(9.0));
        c.insert_with_attributes(&[300], &[1], &[0.5; DIM], &[heavy], None)
            .await
            .unwrap();
        c.flush().await.unwrap();
    });
    let heavy = Filter::Exists("weight".to_string());
    let hits = c
        .search(&filtered(&[1], &[0.0; DIM], 100, false, &heavy))
        .unwrap();
    assert_eq!(hits.iter().map(|h| h.doc_id).collect::<Vec<_>>(), vec![300]);
}

/// The only `.tseg` file in `dir`.
fn segment_file(dir: &Path) -> PathBuf {
    let files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "tseg"))
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    files[0].clone()
}

fn with_crc(mut body: Vec<u8>) -> Vec<u8> {
    let crc = crc32fast::hash(&body);
    body.extend_from_slice(&crc.to_le_bytes());
    body
}

#[test]
fn a_segment_of_the_format_before_attributes_opens_and_takes_new_fields() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c");
    let rt = runtime();
    let mut rng = StdRng::seed_from_u64(4);
    let vectors: Vec<f32> = (0..100).flat_map(|_| random_vector(&mut rng)).collect();
    {
        let c = Collection::create(&path, config()).unwrap();
        rt.block_on(async {
            let docs: Vec<u128> = (0..100).collect();
            c.insert(&docs, &[], &vectors, None).await.unwrap();
            c.flush().await.unwrap();
        });
    }
    // Version 2 of one partition without attributes is version 1 with an empty section
    // table (4 zero bytes) before the checksum: rewrite the file as the old code wrote it.
    let file = segment_file(&path);
    let bytes = std::fs::read(&file).unwrap();
    assert_eq!(&bytes[8..12], &2u32.to_le_bytes());
    assert_eq!(&bytes[bytes.len() - 8..bytes.len() - 4], &[0, 0, 0, 0]);
    let mut old = bytes[..bytes.len() - 8].to_vec();
    old[8..12].copy_from_slice(&1u32.to_le_bytes());
    std::fs::write(&file, with_crc(old)).unwrap();

    let c = Collection::open(&path).unwrap();
    for doc in [0usize, 42, 99] {
        let hits = c
            .search(&SearchRequest {
                vector: vectors[doc * DIM..(doc + 1) * DIM].to_vec(),
                top_k: 1,
                ..SearchRequest::default()
            })
            .unwrap();
        assert_eq!(hits[0].doc_id, doc as u128);
    }
    let everything = Filter::All(Vec::new());
    let hits = c
        .search(&filtered(&[], &[0.0; DIM], 1000, false, &everything))
        .unwrap();
    assert_eq!(hits.len(), 100);
    rt.block_on(async {
        c.add_fields(vec![FieldSpec::new("colour", FieldType::Keyword)])
            .await
            .unwrap();
        let colour: Attributes = [("colour".to_string(), Value::Keyword("red".into()))]
            .into_iter()
            .collect();
        let docs: Vec<u128> = (100..110).collect();
        let seq = c
            .insert_with_attributes(&docs, &[], &vectors[..10 * DIM], &vec![colour; 10], None)
            .await
            .unwrap();
        c.wait_applied(seq, Duration::from_secs(10)).await.unwrap();
    });
    let expect = |c: &Collection| {
        let has_colour = Filter::Exists("colour".to_string());
        let no_colour = Filter::Not(Box::new(has_colour.clone()));
        let count = |filter: &Filter| {
            c.search(&filtered(&[], &[0.0; DIM], 1000, false, filter))
                .unwrap()
                .len()
        };
        assert_eq!(count(&has_colour), 10);
        assert_eq!(count(&no_colour), 100);
        assert_eq!(
            c.get_with_attributes(0, &[5]).unwrap()[0].2,
            Attributes::new()
        );
    };
    expect(&c);
    rt.block_on(c.flush()).unwrap();
    drop(c);
    let c = Collection::open(&path).unwrap();
    expect(&c);
}

#[test]
fn a_damaged_attribute_section_is_refused_at_open_never_a_panic() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c");
    let rt = runtime();
    let mut rng = StdRng::seed_from_u64(5);
    {
        let c = Collection::create(&path, attributed_config()).unwrap();
        let mut model = Model::new();
        rt.block_on(async {
            insert(
                &c,
                &mut model,
                &mut rng,
                &[1],
                0..50,
                Some(&only("zz-marker-zz")),
            )
            .await;
            c.flush().await.unwrap();
        });
    }
    let file = segment_file(&path);
    let bytes = std::fs::read(&file).unwrap();
    let marker = bytes
        .windows(12)
        .position(|w| w == b"zz-marker-zz")
        .unwrap();
    let open_error = |damaged: Vec<u8>| {
        std::fs::write(&file, damaged).unwrap();
        let error = Collection::open(&path).unwrap_err();
        assert!(matches!(error, CollectionError::Corrupt(_)), "{error}");
        error.to_string()
    };
    // A flipped bit in the section: the checksum refuses it.
    let mut flipped = bytes.clone();
    flipped[marker + 3] ^= 0x10;
    let error = open_error(flipped);
    assert!(error.contains("checksum"), "{error}");
    // Damage that keeps the checksum right (the dictionary's term count, the four bytes
    // before the only term's length): the section's own bounds checks refuse it.
    let mut body = bytes[..bytes.len() - 4].to_vec();
    body[marker - 8..marker - 4].copy_from_slice(&u32::MAX.to_le_bytes());
    let error = open_error(with_crc(body));
    assert!(error.contains("attribute section"), "{error}");
    // Undamaged again, it opens.
    std::fs::write(&file, &bytes).unwrap();
    let c = Collection::open(&path).unwrap();
    assert_eq!(c.stats().n_documents, 50);
}
