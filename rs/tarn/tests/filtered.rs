//! Filtered search through the real `tarn` binary and a tonic client on a real port: collections
//! declare typed fields, inserts carry attributes, searches and removes take a filter. Exact
//! filtered searches equal a brute-force filtered oracle and no search comes back short; every
//! bad input is INVALID_ARGUMENT naming the request field and the attribute field, and nothing
//! is stored; remove by filter, AddFields and Get's attributes, across a restart; the CLI's
//! `--field`, `--attributes` and `--filter`.
#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

mod common;

use std::collections::BTreeMap;

use common::{code, id, run_cli, runtime, Server};
use rand::{Rng, SeedableRng};
use tarn_proto::v1 as pb;
use tarn_proto::v1::tarn_client::TarnClient;
use tonic::transport::Channel;
use tonic::Code;

const DIM: usize = 8;
const SECTIONS: [&str; 6] = ["python", "libs", "devel", "games", "net", "doc"];
const TAGS: [&str; 8] = ["t0", "t1", "t2", "t3", "t4", "t5", "t6", "t7"];

/// One test document's attributes (any may be missing).
#[derive(Debug, Clone, Default)]
struct Doc {
    section: Option<String>,
    tags: Option<Vec<String>>,
    size: Option<f64>,
    essential: Option<bool>,
}

fn random_doc(rng: &mut rand::rngs::StdRng) -> Doc {
    Doc {
        section: rng
            .random_bool(0.9)
            .then(|| SECTIONS[rng.random_range(0..SECTIONS.len())].to_owned()),
        tags: rng.random_bool(0.8).then(|| {
            (0..rng.random_range(0..4))
                .map(|_| TAGS[rng.random_range(0..TAGS.len())].to_owned())
                .collect()
        }),
        size: rng
            .random_bool(0.85)
            .then(|| rng.random_range(0.0..1000.0f64)),
        essential: rng.random_bool(0.7).then(|| rng.random_bool(0.2)),
    }
}

fn value(kind: pb::value::Kind) -> pb::Value {
    pb::Value { kind: Some(kind) }
}

fn wire_attributes(doc: &Doc) -> pb::Attributes {
    let mut values = std::collections::HashMap::new();
    if let Some(section) = &doc.section {
        values.insert(
            "section".into(),
            value(pb::value::Kind::Keyword(section.clone())),
        );
    }
    if let Some(tags) = &doc.tags {
        values.insert(
            "tags".into(),
            value(pb::value::Kind::Keywords(pb::KeywordList {
                values: tags.clone(),
            })),
        );
    }
    if let Some(size) = doc.size {
        values.insert("size".into(), value(pb::value::Kind::Number(size)));
    }
    if let Some(essential) = doc.essential {
        values.insert(
            "essential".into(),
            value(pb::value::Kind::Boolean(essential)),
        );
    }
    pb::Attributes {
        values,
        ..Default::default()
    }
}

fn spec(name: &str, field_type: pb::FieldType) -> pb::FieldSpec {
    pb::FieldSpec {
        name: name.into(),
        r#type: field_type as i32,
        ..Default::default()
    }
}

fn fields() -> Vec<pb::FieldSpec> {
    vec![
        spec("section", pb::FieldType::Keyword),
        spec("tags", pb::FieldType::Keywords),
        spec("size", pb::FieldType::Number),
        spec("essential", pb::FieldType::Bool),
    ]
}

fn node(kind: pb::filter::Kind) -> pb::Filter {
    pb::Filter { kind: Some(kind) }
}

fn any_of(field: &str, values: &[&str]) -> pb::Filter {
    node(pb::filter::Kind::Match(pb::Match {
        field: field.into(),
        any_of: values.iter().map(|v| v.to_string()).collect(),
        boolean: None,
    }))
}

fn is(field: &str, boolean: bool) -> pb::Filter {
    node(pb::filter::Kind::Match(pb::Match {
        field: field.into(),
        any_of: Vec::new(),
        boolean: Some(boolean),
    }))
}

fn range(field: &str, gt: Option<f64>, gte: Option<f64>, lt: Option<f64>) -> pb::Filter {
    node(pb::filter::Kind::Range(pb::Range {
        field: field.into(),
        gt,
        gte,
        lt,
        lte: None,
    }))
}

fn all(filters: Vec<pb::Filter>) -> pb::Filter {
    node(pb::filter::Kind::All(pb::FilterList { filters }))
}

fn any(filters: Vec<pb::Filter>) -> pb::Filter {
    node(pb::filter::Kind::Any(pb::FilterList { filters }))
}

fn not(filter: pb::Filter) -> pb::Filter {
    node(pb::filter::Kind::Not(Box::new(filter)))
}

fn exists(field: &str) -> pb::Filter {
    node(pb::filter::Kind::Exists(field.into()))
}

type Predicate = Box<dyn Fn(&Doc) -> bool>;

/// Filters over the test schema, each with its meaning written out independently of the
/// server (the oracle). `sizes` are every stored size, to build filters matching exactly 1 and
/// `k - 1` documents.
fn filters(sizes: &[f64], k: usize) -> Vec<(&'static str, pb::Filter, Predicate)> {
    let mut sorted = sizes.to_vec();
    sorted.sort_by(f64::total_cmp);
    let second_largest = sorted[sorted.len() - 2];
    let k_minus_one_bound = sorted[sorted.len() - k];
    let has_tag = |doc: &Doc, tag: &str| {
        doc.tags
            .as_ref()
            .is_some_and(|t| t.iter().any(|x| x == tag))
    };
    vec![
        (
            "section = python",
            any_of("section", &["python"]),
            Box::new(|d: &Doc| d.section.as_deref() == Some("python")),
        ),
        (
            "section in (libs, devel) and size >= 500",
            all(vec![
                any_of("section", &["libs", "devel"]),
                range("size", None, Some(500.0), None),
            ]),
            Box::new(|d: &Doc| {
                matches!(d.section.as_deref(), Some("libs" | "devel"))
                    && d.size.is_some_and(|s| s >= 500.0)
            }),
        ),
        (
            "tags has t3",
            any_of("tags", &["t3"]),
            Box::new(move |d: &Doc| has_tag(d, "t3")),
        ),
        (
            "not essential = true",
            not(is("essential", true)),
            Box::new(|d: &Doc| d.essential != Some(true)),
        ),
        (
            "essential = true and tags has t1 and t2",
            all(vec![
                is("essential", true),
                any_of("tags", &["t1"]),
                any_of("tags", &["t2"]),
            ]),
            Box::new(move |d: &Doc| {
                d.essential == Some(true) && has_tag(d, "t1") && has_tag(d, "t2")
            }),
        ),
        (
            "section = games or size < 20",
            any(vec![
                any_of("section", &["games"]),
                range("size", None, None, Some(20.0)),
            ]),
            Box::new(|d: &Doc| {
                d.section.as_deref() == Some("games") || d.size.is_some_and(|s| s < 20.0)
            }),
        ),
        (
            "not exists size",
            not(exists("size")),
            Box::new(|d: &Doc| d.size.is_none()),
        ),
        (
            "matches nothing",
            any_of("section", &["no-such-section"]),
            Box::new(|_: &Doc| false),
        ),
        (
            "matches exactly one",
            range("size", Some(second_largest), None, None),
            Box::new(move |d: &Doc| d.size.is_some_and(|s| s > second_largest)),
        ),
        (
            "matches k - 1",
            range("size", Some(k_minus_one_bound), None, None),
            Box::new(move |d: &Doc| d.size.is_some_and(|s| s > k_minus_one_bound)),
        ),
        (
            "empty all: everything",
            all(Vec::new()),
            Box::new(|_: &Doc| true),
        ),
    ]
}

/// The stored documents: (tenant, doc) -> (vector, attributes).
type Stored = BTreeMap<(u128, u128), (Vec<f32>, Doc)>;

/// Exact top-k by L2 among the documents of `tenants` that match: (tenant, doc) best first.
fn oracle(
    stored: &Stored,
    tenants: &[u128],
    query: &[f32],
    k: usize,
    matches: &dyn Fn(&Doc) -> bool,
) -> Vec<(u128, u128)> {
    let mut scored: Vec<(f32, (u128, u128))> = stored
        .iter()
        .filter(|((tenant, _), (_, doc))| tenants.contains(tenant) && matches(doc))
        .map(|(key, (vector, _))| {
            let distance: f32 = vector
                .iter()
                .zip(query)
                .map(|(a, b)| (a - b) * (a - b))
                .sum();
            (distance, *key)
        })
        .collect();
    scored.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    scored.into_iter().take(k).map(|(_, key)| key).collect()
}

fn random_vectors(rng: &mut rand::rngs::StdRng, n: usize) -> Vec<f32> {
    (0..n * DIM)
        .map(|_| rng.random_range(-1.0f32..1.0))
        .collect()
}

/// Creates "docs" (L2, the test fields) and inserts `n` documents for each of tenants 1 and 2
/// with seeded random attributes, in batches.
async fn load(client: &mut TarnClient<Channel>, n: usize, seed: u64) -> Stored {
    let mut create = common::create("docs", DIM as u32, pb::Metric::L2);
    create.fields = fields();
    client.create_collection(create).await.unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut stored = Stored::new();
    let mut last_seq = 0;
    for tenant in [1u128, 2] {
        for first in (0..n).step_by(100) {
            let docs: Vec<u128> = (first..(first + 100).min(n)).map(|d| d as u128).collect();
            let vectors = random_vectors(&mut rng, docs.len());
            let attributes: Vec<Doc> = docs.iter().map(|_| random_doc(&mut rng)).collect();
            let mut insert = common::insert("docs", &docs, &[tenant], vectors.clone());
            insert.attributes = attributes.iter().map(wire_attributes).collect();
            last_seq = client.insert(insert).await.unwrap().into_inner().seq_no;
            for (i, doc) in docs.iter().enumerate() {
                stored.insert(
                    (tenant, *doc),
                    (
                        vectors[i * DIM..(i + 1) * DIM].to_vec(),
                        attributes[i].clone(),
                    ),
                );
            }
        }
    }
    // An acknowledged insert is durable, and searchable once ingestion applied it: wait for the
    // last one (operations apply in order), or the searches race the last batch.
    let mut search = common::search("docs", &[1], vec![0.0; DIM], 1);
    search.min_seq_no = last_seq;
    client.search(search).await.unwrap();
    stored
}

/// Every filter and a few queries, over tenant 1 and over both: exact searches equal the
/// oracle; graph searches answer min(k, matches) hits, every one matching.
async fn check_filtered_searches(client: &mut TarnClient<Channel>, stored: &Stored, seed: u64) {
    const K: usize = 10;
    let sizes: Vec<f64> = stored.values().filter_map(|(_, d)| d.size).collect();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    for (name, filter, predicate) in filters(&sizes, K) {
        for tenants in [vec![1u128], vec![1, 2]] {
            let n_matches = stored
                .iter()
                .filter(|((t, _), (_, d))| tenants.contains(t) && predicate(d))
                .count();
            for _ in 0..3 {
                let query = random_vectors(&mut rng, 1);
                for exact in [true, false] {
                    let mut search = common::search("docs", &tenants, query.clone(), K as u32);
                    search.exact = exact;
                    search.filter = Some(filter.clone());
                    let hits = client.search(search).await.unwrap().into_inner().hits;
                    let got: Vec<(u128, u128)> = hits
                        .iter()
                        .map(|h| {
                            (
                                common_u128(h.user_id.as_ref()),
                                common_u128(h.doc_id.as_ref()),
                            )
                        })
                        .collect();
                    assert_eq!(
                        got.len(),
                        K.min(n_matches),
                        "{name}, tenants {tenants:?}, exact {exact}: never short"
                    );
                    for key in &got {
                        assert!(predicate(&stored[key].1), "{name}: {key:?} does not match");
                    }
                    if exact {
                        let want = oracle(stored, &tenants, &query, K, &predicate);
                        assert_eq!(got, want, "{name}, tenants {tenants:?}");
                    }
                }
            }
        }
    }
}

fn common_u128(value: Option<&pb::Id>) -> u128 {
    value.map_or(0, |v| (u128::from(v.high) << 64) | u128::from(v.low))
}

#[test]
fn filtered_searches_equal_a_brute_force_oracle_and_never_come_back_short() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &[]);
    runtime().block_on(async {
        let mut client = server.client().await;
        let stored = load(&mut client, 700, 1).await;
        // In the mutable segment, then sealed by a checkpoint.
        check_filtered_searches(&mut client, &stored, 2).await;
        client
            .flush(pb::FlushRequest {
                collection: "docs".into(),
            })
            .await
            .unwrap();
        check_filtered_searches(&mut client, &stored, 3).await;
    });
}

/// Asserts INVALID_ARGUMENT whose message names every one of `words`.
fn assert_refused<T: std::fmt::Debug>(result: Result<T, tonic::Status>, words: &[&str]) {
    let status = result.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    for word in words {
        assert!(
            status.message().contains(word),
            "{word:?} not in {:?}",
            status.message()
        );
    }
}

#[test]
fn bad_filtered_input_is_refused_naming_the_field_and_nothing_is_stored() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &[]);
    runtime().block_on(async {
        let mut c = server.client().await;
        // Creating with bad fields: nothing created.
        for (bad, words) in [
            (
                vec![spec("size", pb::FieldType::Unspecified)],
                &["fields", "\"size\""][..],
            ),
            (
                vec![pb::FieldSpec {
                    name: "size".into(),
                    r#type: 42,
                    ..Default::default()
                }],
                &["fields", "\"size\"", "42"],
            ),
            (
                vec![spec("bad name", pb::FieldType::Keyword)],
                &["fields", "bad name"],
            ),
            (
                vec![
                    spec("a", pb::FieldType::Keyword),
                    spec("a", pb::FieldType::Bool),
                ],
                &["fields", "\"a\""],
            ),
        ] {
            let mut create = common::create("bad", DIM as u32, pb::Metric::L2);
            create.fields = bad;
            assert_refused(c.create_collection(create).await, words);
        }
        let names = c
            .list_collections(pb::ListCollectionsRequest {})
            .await
            .unwrap()
            .into_inner()
            .names;
        assert!(names.is_empty(), "{names:?}");

        let mut create = common::create("docs", DIM as u32, pb::Metric::L2);
        create.fields = fields();
        c.create_collection(create).await.unwrap();
        let before = common::collection_info(&mut c, "docs").await;

        // Inserts with bad attributes: refused, nothing logged.
        let good = wire_attributes(&Doc {
            section: Some("python".into()),
            ..Doc::default()
        });
        let with = |name: &str, kind: Option<pb::value::Kind>| {
            let mut attributes = good.clone();
            attributes.values.insert(name.into(), pb::Value { kind });
            attributes
        };
        let many_fields = pb::Attributes {
            values: (0..65)
                .map(|i| (format!("f{i}"), value(pb::value::Kind::Boolean(true))))
                .collect(),
            ..Default::default()
        };
        let cases: Vec<(Vec<pb::Attributes>, Vec<&str>)> = vec![
            (
                vec![good.clone()],
                vec!["attributes", "one per document (2)", "got 1"],
            ),
            (
                vec![
                    good.clone(),
                    with("color", Some(pb::value::Kind::Keyword("red".into()))),
                ],
                vec!["attributes", "document 1", "\"color\"", "not declared"],
            ),
            (
                vec![
                    good.clone(),
                    with("size", Some(pb::value::Kind::Keyword("big".into()))),
                ],
                vec!["attributes", "document 1", "\"size\"", "NUMBER"],
            ),
            (
                vec![
                    with("size", Some(pb::value::Kind::Number(f64::NAN))),
                    good.clone(),
                ],
                vec!["attributes", "document 0", "\"size\"", "NaN"],
            ),
            (
                vec![
                    with("size", Some(pb::value::Kind::Number(f64::INFINITY))),
                    good.clone(),
                ],
                vec!["attributes", "\"size\"", "infinite"],
            ),
            (
                vec![
                    good.clone(),
                    with("section", Some(pb::value::Kind::Keyword("x".repeat(257)))),
                ],
                vec!["attributes", "\"section\"", "257 bytes"],
            ),
            (
                vec![good.clone(), with("section", None)],
                vec!["attributes", "document 1", "\"section\"", "no value"],
            ),
            (
                vec![good.clone(), many_fields],
                vec!["attributes", "65 fields", "64"],
            ),
            (
                vec![
                    good.clone(),
                    with(
                        "tags",
                        Some(pb::value::Kind::Keywords(pb::KeywordList {
                            values: vec!["t".into(); 1025],
                        })),
                    ),
                ],
                vec!["attributes", "\"tags\"", "1025 keywords"],
            ),
        ];
        for (attributes, words) in cases {
            let mut insert = common::insert("docs", &[1, 2], &[], vec![0.5; 2 * DIM]);
            insert.attributes = attributes;
            assert_refused(c.insert(insert).await, &words);
        }
        let after = common::collection_info(&mut c, "docs").await;
        assert_eq!(after.last_seq_no, before.last_seq_no, "nothing was logged");
        assert_eq!(after.n_documents, 0);

        // Searches and removes with bad filters.
        let deep = (0..32).fold(exists("size"), |f, _| not(f));
        let wide = any(vec![exists("size"); 1024]);
        let cases: Vec<(pb::Filter, Vec<&str>)> = vec![
            (pb::Filter::default(), vec!["filter", "no kind"]),
            (
                any_of("color", &["red"]),
                vec!["filter", "\"color\"", "not declared"],
            ),
            (any_of("size", &["1"]), vec!["filter", "\"size\""]),
            (
                range("section", Some(1.0), None, None),
                vec!["filter", "\"section\""],
            ),
            (
                range("size", None, None, Some(f64::NAN)),
                vec!["filter", "\"size\"", "NaN"],
            ),
            (range("size", None, None, None), vec!["filter", "\"size\""]),
            (any_of("section", &[]), vec!["filter", "\"section\""]),
            (
                node(pb::filter::Kind::Match(pb::Match {
                    field: "section".into(),
                    any_of: vec!["x".into(); 1025],
                    boolean: None,
                })),
                vec!["filter", "\"section\"", "1024"],
            ),
            (deep, vec!["filter", "deeper than 32"]),
            (wide, vec!["filter", "1024 nodes"]),
        ];
        for (filter, words) in cases {
            let mut search = common::search("docs", &[], vec![0.5; DIM], 5);
            search.filter = Some(filter.clone());
            assert_refused(c.search(search).await, &words);
            let remove = pb::RemoveRequest {
                collection: "docs".into(),
                filter: Some(filter),
                ..Default::default()
            };
            assert_refused(c.remove(remove).await, &words);
        }
        let both = pb::RemoveRequest {
            collection: "docs".into(),
            doc_ids: vec![id(1)],
            filter: Some(exists("size")),
            ..Default::default()
        };
        assert_refused(c.remove(both).await, &["filter", "not both"]);

        // AddFields: bad lists change nothing.
        for (fields, words) in [
            (Vec::new(), &["fields", "empty"][..]),
            (
                vec![spec("section", pb::FieldType::Keyword)],
                &["fields", "\"section\""],
            ),
            (
                vec![spec("new", pb::FieldType::Unspecified)],
                &["fields", "\"new\""],
            ),
            (
                vec![
                    spec("x", pb::FieldType::Bool),
                    spec("x", pb::FieldType::Bool),
                ],
                &["fields", "\"x\""],
            ),
        ] {
            assert_refused(
                c.add_fields(pb::AddFieldsRequest {
                    collection: "docs".into(),
                    fields,
                })
                .await,
                words,
            );
        }
        let after = common::collection_info(&mut c, "docs").await;
        assert_eq!(after.last_seq_no, before.last_seq_no, "nothing was logged");
        assert_eq!(after.fields, fields());
        assert_eq!(
            code(
                c.add_fields(pb::AddFieldsRequest {
                    collection: "nope".into(),
                    fields: fields(),
                })
                .await
            ),
            Code::NotFound
        );
    });
}

#[test]
fn remove_by_filter_add_fields_and_get_attributes_survive_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &[]);
    let stored = runtime().block_on(async {
        let mut c = server.client().await;
        let mut stored = load(&mut c, 300, 7).await;
        // Get returns the attributes as inserted (none for a document without any).
        let docs = c
            .get(pb::GetRequest {
                collection: "docs".into(),
                user_id: Some(id(2)),
                doc_ids: vec![id(5), id(6), id(100_000)],
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
            .docs;
        assert_eq!(docs.len(), 2);
        for doc in &docs {
            let want = wire_attributes(&stored[&(2, common_u128(doc.doc_id.as_ref()))].1);
            let got = doc.attributes.clone().unwrap_or_default();
            assert_eq!(got, want);
        }

        // Remove by filter, tenant 1 only: the count is the oracle's, tenant 2 keeps its own.
        let filter = all(vec![
            any_of("section", &["python", "libs"]),
            range("size", None, Some(300.0), None),
        ]);
        let predicate = |d: &Doc| {
            matches!(d.section.as_deref(), Some("python" | "libs"))
                && d.size.is_some_and(|s| s >= 300.0)
        };
        let doomed: Vec<(u128, u128)> = stored
            .iter()
            .filter(|((t, _), (_, d))| *t == 1 && predicate(d))
            .map(|(key, _)| *key)
            .collect();
        assert!(doomed.len() > 5, "{}", doomed.len());
        let answer = c
            .remove(pb::RemoveRequest {
                collection: "docs".into(),
                user_ids: vec![id(1)],
                filter: Some(filter.clone()),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(answer.n_removed, doomed.len() as u64);
        assert!(answer.seq_no > 0);
        for key in &doomed {
            stored.remove(key);
        }
        let mut search = common::search("docs", &[1, 2], vec![0.0; DIM], 1000);
        search.exact = true;
        search.filter = Some(filter.clone());
        search.min_seq_no = answer.seq_no;
        let hits = c.search(search).await.unwrap().into_inner().hits;
        assert!(hits.iter().all(|h| common_u128(h.user_id.as_ref()) == 2));
        let tenant_two = stored
            .iter()
            .filter(|((t, _), (_, d))| *t == 2 && predicate(d))
            .count();
        assert_eq!(hits.len(), tenant_two);
        // Nothing left to match: nothing logged, nothing counted.
        let again = c
            .remove(pb::RemoveRequest {
                collection: "docs".into(),
                user_ids: vec![id(1)],
                filter: Some(filter),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!((again.seq_no, again.n_removed), (0, 0));

        // AddFields: the new field is listed, usable at once; older documents have no value.
        let info = c
            .add_fields(pb::AddFieldsRequest {
                collection: "docs".into(),
                fields: vec![spec("priority", pb::FieldType::Keyword)],
            })
            .await
            .unwrap()
            .into_inner()
            .collection
            .unwrap();
        let mut want_fields = fields();
        want_fields.push(spec("priority", pb::FieldType::Keyword));
        assert_eq!(info.fields, want_fields);
        let mut insert = common::insert("docs", &[5000, 5001], &[1], vec![0.25; 2 * DIM]);
        let mut with_priority = wire_attributes(&Doc::default());
        with_priority.values.insert(
            "priority".into(),
            value(pb::value::Kind::Keyword("required".into())),
        );
        insert.attributes = vec![with_priority, pb::Attributes::default()];
        let seq = c.insert(insert).await.unwrap().into_inner().seq_no;
        let mut search = common::search("docs", &[1, 2], vec![0.0; DIM], 10);
        search.filter = Some(exists("priority"));
        search.min_seq_no = seq;
        let hits = c.search(search).await.unwrap().into_inner().hits;
        assert_eq!(
            hits.iter()
                .map(|h| common_u128(h.doc_id.as_ref()))
                .collect::<Vec<_>>(),
            vec![5000]
        );
        for doc in [5000, 5001] {
            stored.insert((1, doc), (vec![0.25; DIM], Doc::default()));
        }
        stored
    });
    // A restart replays the log: the fields, the attributes and the removals are all there.
    assert!(server.terminate().success());
    let server = Server::start(dir.path(), &[]);
    runtime().block_on(async {
        let mut c = server.client().await;
        let info = common::collection_info(&mut c, "docs").await;
        assert_eq!(info.fields.len(), 5);
        check_filtered_searches(&mut c, &stored, 8).await;
        let mut search = common::search("docs", &[1], vec![0.0; DIM], 10);
        search.filter = Some(any_of("priority", &["required"]));
        let hits = c.search(search).await.unwrap().into_inner().hits;
        assert_eq!(hits.len(), 1);
    });
}

/// TEXT fields and payloads over gRPC: stored with inserts, returned by searches with
/// `output_fields` / `with_payload` and by Get (every field by default, the payload on request),
/// checked against the schema with the field named, and back after kill -9 and a restart.
#[test]
fn texts_and_payloads_come_back_with_hits_and_gets_and_survive_kill_9() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &[]);
    let text_of = |doc: u128| format!("Package {doc}: a long description, with ünïcode.");
    let payload_of =
        |doc: u128| format!(r#"{{"doc":{doc},"tags":["a","b"],"nested":{{"x":1.5}}}}"#);
    let documents = |docs: &[u128]| -> Vec<pb::Attributes> {
        docs.iter()
            .map(|&doc| {
                let mut attributes = pb::Attributes {
                    payload: payload_of(doc),
                    ..Default::default()
                };
                attributes.values.insert(
                    "section".into(),
                    value(pb::value::Kind::Keyword(format!("s{}", doc % 2))),
                );
                attributes
                    .values
                    .insert("body".into(), value(pb::value::Kind::Text(text_of(doc))));
                attributes
            })
            .collect()
    };
    let vector_of = |doc: u128| -> Vec<f32> { (0..DIM).map(|d| (doc as f32) + d as f32).collect() };
    runtime().block_on(async {
        let mut c = server.client().await;
        let mut create = common::create("texts", DIM as u32, pb::Metric::L2);
        create.fields = vec![
            spec("section", pb::FieldType::Keyword),
            spec("body", pb::FieldType::Text),
        ];
        c.create_collection(create).await.unwrap();
        let docs: Vec<u128> = (1..=40).collect();
        let vectors: Vec<f32> = docs.iter().flat_map(|&d| vector_of(d)).collect();
        let mut insert = common::insert("texts", &docs, &[], vectors);
        insert.attributes = documents(&docs);
        let seq = c.insert(insert).await.unwrap().into_inner().seq_no;

        let mut search = common::search("texts", &[], vector_of(7), 3);
        search.min_seq_no = seq;
        search.output_fields = vec!["body".into()];
        search.with_payload = true;
        let hits = c.search(search.clone()).await.unwrap().into_inner().hits;
        assert_eq!(common_u128(hits[0].doc_id.as_ref()), 7);
        let got = hits[0].attributes.clone().unwrap();
        assert_eq!(got.payload, payload_of(7));
        assert_eq!(got.values.len(), 1, "{got:?}");
        assert_eq!(got.values["body"], value(pb::value::Kind::Text(text_of(7))));
        // No selection: no values, as before.
        search.output_fields.clear();
        search.with_payload = false;
        let hits = c.search(search.clone()).await.unwrap().into_inner().hits;
        assert!(hits.iter().all(|h| h.attributes.is_none()), "{hits:?}");
        // Get: every field by default, the payload only when asked.
        let get = |with_payload: bool, output_fields: Vec<String>| pb::GetRequest {
            collection: "texts".into(),
            doc_ids: vec![id(3), id(99)],
            with_payload,
            output_fields,
            ..Default::default()
        };
        let doc = c.get(get(false, vec![])).await.unwrap().into_inner().docs;
        let attributes = doc[0].attributes.clone().unwrap();
        assert_eq!((doc.len(), attributes.values.len()), (1, 2));
        assert_eq!(attributes.payload, "");
        let doc = c
            .get(get(true, vec!["section".into()]))
            .await
            .unwrap()
            .into_inner()
            .docs;
        let attributes = doc[0].attributes.clone().unwrap();
        assert_eq!(attributes.values.len(), 1);
        assert_eq!(attributes.payload, payload_of(3));

        // Bad input, each naming its field; nothing is stored.
        let mut bad = common::insert("texts", &[500], &[], vector_of(500));
        bad.attributes = documents(&[500]);
        bad.attributes[0].payload = "{\"unclosed\": ".into();
        assert_refused(
            c.insert(bad.clone()).await,
            &["payload", "document 0", "JSON"],
        );
        bad.attributes[0].payload = format!("\"{}\"", "z".repeat(1 << 20));
        assert_refused(
            c.insert(bad.clone()).await,
            &["attributes", "payload", "1048576"],
        );
        bad.attributes = documents(&[500]);
        bad.attributes[0]
            .values
            .insert("section".into(), value(pb::value::Kind::Text("x".into())));
        assert_refused(c.insert(bad).await, &["attributes", "section", "KEYWORD"]);
        search.output_fields = vec!["missing".into()];
        assert_refused(
            c.search(search.clone()).await,
            &["output_fields", "missing"],
        );
        search.output_fields.clear();
        search.filter = Some(exists("body"));
        assert_refused(c.search(search.clone()).await, &["filter", "body", "TEXT"]);
        let mut nothing = get(true, vec![]);
        nothing.doc_ids = vec![id(500)];
        assert!(c.get(nothing).await.unwrap().into_inner().docs.is_empty());
        let mut search = common::search("texts", &[], vector_of(500), 1);
        search.exact = true;
        let hits = c.search(search).await.unwrap().into_inner().hits;
        assert_ne!(common_u128(hits[0].doc_id.as_ref()), 500);

        // Half of them sealed (their values then stay in the segment file), half in the log.
        c.flush(pb::FlushRequest {
            collection: "texts".into(),
        })
        .await
        .unwrap();
        let more: Vec<u128> = (41..=60).collect();
        let vectors: Vec<f32> = more.iter().flat_map(|&d| vector_of(d)).collect();
        let mut insert = common::insert("texts", &more, &[], vectors);
        insert.attributes = documents(&more);
        c.insert(insert).await.unwrap();
    });
    server.kill();
    let server = Server::start(dir.path(), &[]);
    runtime().block_on(async {
        let mut c = server.client().await;
        for doc in [1u128, 40, 41, 60] {
            let mut search = common::search("texts", &[], vector_of(doc), 1);
            search.output_fields = vec!["*".into()];
            search.with_payload = true;
            let hits = c.search(search).await.unwrap().into_inner().hits;
            assert_eq!(common_u128(hits[0].doc_id.as_ref()), doc);
            let got = hits[0].attributes.clone().unwrap();
            assert_eq!(got, documents(&[doc])[0], "doc {doc}");
        }
    });
}

/// Full-text search over gRPC: a TEXT field with an English analyzer and BM25 settings given at
/// creation (reported back by GetCollection), hits ranked by BM25 with a filter and the
/// selected values, bad queries refused naming the field, and the same hits and scores after
/// a checkpoint, more writes, kill -9 and a restart.
#[test]
fn full_text_search_ranks_by_bm25_and_gives_the_same_answer_after_kill_9() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &[]);
    let texts = [
        "Python library for parsing configuration files",
        "Python python tools",
        "Kernel modules and firmware",
        "The libraries of Debian",
        "A daemon with no relevant words",
    ];
    let attributes = |doc: usize| {
        let mut attributes = pb::Attributes::default();
        attributes.values.insert(
            "section".into(),
            value(pb::value::Kind::Keyword(format!("s{}", doc % 2))),
        );
        attributes.values.insert(
            "body".into(),
            value(pb::value::Kind::Text(texts[doc % texts.len()].to_string())),
        );
        attributes
    };
    let text_search = |query: &str| pb::SearchRequest {
        collection: "docs".into(),
        top_k: 10,
        text: Some(pb::TextQuery {
            field: "body".into(),
            query: query.into(),
            ..Default::default()
        }),
        ..Default::default()
    };
    let ranked = |hits: Vec<pb::Hit>| -> Vec<(u128, f32)> {
        hits.iter()
            .map(|h| (common_u128(h.doc_id.as_ref()), h.score))
            .collect()
    };
    let before = runtime().block_on(async {
        let mut c = server.client().await;
        let mut create = common::create("docs", DIM as u32, pb::Metric::L2);
        let mut body = spec("body", pb::FieldType::Text);
        body.analyzer = Some(pb::TextAnalyzer {
            english_stemmer: true,
            english_stop_words: true,
        });
        create.fields = vec![spec("section", pb::FieldType::Keyword), body];
        create.bm25 = Some(pb::Bm25Params {
            k1: Some(0.9),
            b: None,
        });
        c.create_collection(create).await.unwrap();
        let info = c
            .get_collection(pb::GetCollectionRequest {
                name: "docs".into(),
            })
            .await
            .unwrap()
            .into_inner()
            .collection
            .unwrap();
        assert_eq!(
            info.bm25,
            Some(pb::Bm25Params {
                k1: Some(0.9),
                b: Some(0.75)
            })
        );
        let analyzer = info.fields[1].analyzer.unwrap();
        assert!(analyzer.english_stemmer && analyzer.english_stop_words);

        let docs: Vec<u128> = (0..10).collect();
        // Document d's vector is d everywhere: the vector side ranks by id from the origin.
        let vectors_of = |docs: &[u128]| -> Vec<f32> {
            docs.iter().flat_map(|&d| vec![d as f32; DIM]).collect()
        };
        let mut insert = common::insert("docs", &docs, &[], vectors_of(&docs));
        insert.attributes = (0..docs.len()).map(attributes).collect();
        let seq = c.insert(insert).await.unwrap().into_inner().seq_no;
        let mut search = text_search("python libraries");
        search.min_seq_no = seq;
        search.output_fields = vec!["body".into()];
        let hits = c.search(search.clone()).await.unwrap().into_inner().hits;
        // Docs 0 and 5 hold both terms ("library" and "libraries" stem alike), 1 and 6
        // "python" twice, 3 and 8 "libraries".
        let found: Vec<u128> = ranked(hits.clone()).iter().map(|h| h.0).collect();
        assert_eq!(found.len(), 6, "{found:?}");
        assert_eq!(found[..2], [0, 5], "{found:?}");
        assert!(hits.windows(2).all(|w| w[0].score >= w[1].score));
        let body = &hits[0].attributes.as_ref().unwrap().values["body"];
        assert_eq!(body, &value(pb::value::Kind::Text(texts[0].into())));
        // A filter keeps the matching ones, with the same scores.
        search.filter = Some(node(pb::filter::Kind::Match(pb::Match {
            field: "section".into(),
            any_of: vec!["s1".into()],
            ..Default::default()
        })));
        search.output_fields.clear();
        let filtered = ranked(c.search(search).await.unwrap().into_inner().hits);
        let odd: Vec<(u128, f32)> = ranked(hits).into_iter().filter(|h| h.0 % 2 == 1).collect();
        assert_eq!(filtered, odd);

        // Bad queries, each naming its field.
        let mut bad = text_search("python");
        bad.text.as_mut().unwrap().field = "section".into();
        assert_refused(c.search(bad).await, &["text.field", "KEYWORD"]);
        assert_refused(
            c.search(text_search("the of")).await,
            &["text.query", "no searchable term"],
        );
        // With a vector too: a hybrid search, each hit saying where each side ranked it.
        let mut hybrid = text_search("python");
        hybrid.vector = vec![0.0; DIM];
        hybrid.top_k = 3;
        hybrid.fusion = Some(pb::Fusion {
            depth: 4,
            ..Default::default()
        });
        let hits = c.search(hybrid.clone()).await.unwrap().into_inner().hits;
        let ids: Vec<u128> = hits
            .iter()
            .map(|h| common_u128(h.doc_id.as_ref()))
            .collect();
        // Docs 0 and 1 are on both sides (the nearest, and python in their texts): doc 1 is
        // second nearest but first by BM25 ("python" twice in a shorter text), doc 0 third.
        assert_eq!(ids[..2], [1, 0], "{hits:?}");
        let (vector_side, text_side) = (hits[0].vector_side.unwrap(), hits[0].text_side.unwrap());
        assert_eq!((vector_side.rank, text_side.rank), (2, 1));
        assert_eq!(hits[0].score, 1.0 / 62.0 + 1.0 / 61.0);
        hybrid.fusion = Some(pb::Fusion {
            method: 99,
            ..Default::default()
        });
        assert_refused(c.search(hybrid).await, &["fusion.method"]);
        let mut bad_create = common::create("bad", DIM as u32, pb::Metric::L2);
        bad_create.bm25 = Some(pb::Bm25Params {
            k1: Some(-1.0),
            b: None,
        });
        assert_refused(c.create_collection(bad_create).await, &["bm25.k1"]);

        c.flush(pb::FlushRequest {
            collection: "docs".into(),
        })
        .await
        .unwrap();
        let more: Vec<u128> = (10..20).collect();
        let mut insert = common::insert("docs", &more, &[], vectors_of(&more));
        insert.attributes = (10..20).map(attributes).collect();
        let seq = c.insert(insert).await.unwrap().into_inner().seq_no;
        let mut search = text_search("kernel python");
        search.min_seq_no = seq;
        ranked(c.search(search).await.unwrap().into_inner().hits)
    });
    // "kernel" in 4 documents, "python" in 8: the best 10.
    assert_eq!(before.len(), 10, "{before:?}");
    server.kill();
    let server = Server::start(dir.path(), &[]);
    let after = runtime().block_on(async {
        let mut c = server.client().await;
        ranked(
            c.search(text_search("kernel python"))
                .await
                .unwrap()
                .into_inner()
                .hits,
        )
    });
    assert_eq!(after, before);
    // The CLI: `tarn search --text` prints the hits, best first, with the selected fields.
    let out = run_cli(
        server.addr.as_str(),
        &[
            "search",
            "--collection",
            "docs",
            "--text",
            "kernel python",
            "--text-field",
            "body",
            "--top-k",
            "3",
            "--output-field",
            "body",
        ],
    );
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 3, "{out}");
    for (line, (doc, score)) in lines.iter().zip(&after) {
        let fields: Vec<&str> = line.split('\t').collect();
        assert_eq!(fields[0], doc.to_string(), "{line}");
        assert_eq!(fields[2].parse::<f32>().unwrap(), *score, "{line}");
        assert!(fields[3].starts_with("{\"body\":"), "{line}");
    }
}

/// The CLI: `collection create --field`, `collection add-field`, `insert --attributes` from a
/// gzipped JSON-lines file, `search --filter` in the small grammar, and `remove --filter`.
#[test]
fn the_cli_creates_fields_inserts_attributes_and_searches_with_a_filter() {
    use std::io::Write;
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &[]);
    let files = tempfile::tempdir().unwrap();
    let fvecs = files.path().join("base.fvecs");
    let mut bytes = Vec::new();
    for row in 0..4u32 {
        bytes.extend_from_slice(&4u32.to_le_bytes());
        for col in 0..4u32 {
            let v = if col == row { 1.0f32 } else { 0.0 };
            bytes.extend_from_slice(&v.to_le_bytes());
        }
    }
    std::fs::write(&fvecs, &bytes).unwrap();
    let jsonl = files.path().join("base.jsonl.gz");
    let mut gz = flate2::write::GzEncoder::new(
        std::fs::File::create(&jsonl).unwrap(),
        flate2::Compression::default(),
    );
    for line in [
        r#"{"section": "python", "tags": ["a", "b"], "installed_size_kb": 120, "essential": false, "extra": "ignored"}"#,
        r#"{"section": "libs", "tags": [], "installed_size_kb": 80, "essential": true}"#,
        r#"{"section": "python", "installed_size_kb": 5000, "architecture": "all"}"#,
        r#"{}"#,
    ] {
        writeln!(gz, "{line}").unwrap();
    }
    gz.finish().unwrap();
    let addr = server.addr.as_str();
    let out = run_cli(
        addr,
        &[
            "collection",
            "create",
            "pkgs",
            "--dimension",
            "4",
            "--field",
            "section:keyword",
            "--field",
            "tags:keywords",
            "--field",
            "installed_size_kb:number",
            "--field",
            "essential:bool",
        ],
    );
    assert!(out.contains("section (keyword)"), "{out}");
    let out = run_cli(
        addr,
        &[
            "collection",
            "add-field",
            "pkgs",
            "--field",
            "architecture:keyword",
        ],
    );
    assert!(out.contains("architecture (keyword)"), "{out}");
    let fvecs_arg = fvecs.to_str().unwrap();
    let jsonl_arg = jsonl.to_str().unwrap();
    run_cli(
        addr,
        &[
            "insert",
            "--collection",
            "pkgs",
            "--fvecs",
            fvecs_arg,
            "--attributes",
            jsonl_arg,
        ],
    );
    let search = |filter: &str| {
        let out = run_cli(
            addr,
            &[
                "search",
                "--collection",
                "pkgs",
                "--fvecs",
                fvecs_arg,
                "--limit",
                "1",
                "--warmup",
                "0",
                "--top-k",
                "10",
                "--verbose",
                "--filter",
                filter,
            ],
        );
        let line = out
            .lines()
            .find(|l| l.starts_with("query 0:"))
            .unwrap()
            .to_owned();
        let mut ids: Vec<u128> = line
            .split('(')
            .skip(1)
            .map(|part| part.split(',').next().unwrap().trim().parse().unwrap())
            .collect();
        ids.sort_unstable();
        ids
    };
    assert_eq!(search("section = python"), vec![0, 2]);
    assert_eq!(
        search("section in (python, libs) and installed_size_kb >= 100"),
        vec![0, 2]
    );
    assert_eq!(
        search("section = python and not architecture = all"),
        vec![0]
    );
    assert_eq!(search("tags exists and not tags = a"), vec![1]);
    assert_eq!(
        search("essential = true or installed_size_kb < 100"),
        vec![1]
    );
    assert_eq!(search("not (section exists)"), vec![3]);
    // A bad filter fails with a message pointing at the problem.
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_tarn"))
        .args([
            "search",
            "--collection",
            "pkgs",
            "--fvecs",
            fvecs_arg,
            "--filter",
            "section in (python",
        ])
        .args(["--addr", addr])
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("--filter") && stderr.contains("')'"),
        "{stderr}"
    );
    let count_in = |collection: &str| {
        run_cli(addr, &["count", "--collection", collection])
            .trim()
            .parse::<u64>()
            .unwrap()
    };
    let count = |filter: Option<&str>| {
        let mut args = vec!["count", "--collection", "pkgs"];
        args.extend(filter.map(|f| ["--filter", f]).into_iter().flatten());
        run_cli(addr, &args).trim().parse::<u64>().unwrap()
    };
    assert_eq!(count(None), 4);
    assert_eq!(count(Some("section = python")), 2);
    // Scroll prints the documents, one JSON object a line, in id order, page by page.
    let scroll = |extra: &[&str]| {
        let mut args = vec!["scroll", "--collection", "pkgs", "--page", "1"];
        args.extend_from_slice(extra);
        run_cli(addr, &args)
            .lines()
            .map(|line| serde_json::from_str::<serde_json::Value>(line).unwrap())
            .collect::<Vec<_>>()
    };
    let all = scroll(&["--with-vectors"]);
    let ids: Vec<&str> = all.iter().map(|d| d["doc_id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["0", "1", "2", "3"]);
    assert_eq!(all[0]["attributes"]["section"], "python");
    assert_eq!(all[0]["vector"].as_array().unwrap().len(), 4);
    // What scroll prints, insert --jsonl reads back: a copy scrolls the same.
    let exported = files.path().join("pkgs.jsonl");
    let text: String = all.iter().map(|d| format!("{d}\n")).collect();
    std::fs::write(&exported, text).unwrap();
    run_cli(
        addr,
        &[
            "collection",
            "create",
            "copy",
            "--dimension",
            "4",
            "--field",
            "section:keyword",
            "--field",
            "tags:keywords",
            "--field",
            "installed_size_kb:number",
            "--field",
            "essential:bool",
            "--field",
            "architecture:keyword",
        ],
    );
    let exported_arg = exported.to_str().unwrap();
    let out = run_cli(
        addr,
        &[
            "insert",
            "--collection",
            "copy",
            "--jsonl",
            exported_arg,
            "--batch",
            "3",
        ],
    );
    assert!(out.contains("inserted 4 vectors"), "{out}");
    let copied = run_cli(addr, &["scroll", "--collection", "copy", "--with-vectors"]);
    let copied: Vec<serde_json::Value> = copied
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    assert_eq!(copied, all);
    // A bad line is refused naming it, before anything is sent.
    for (line, expected) in [
        (
            r#"{"doc_id": "9", "vector": [1, 2]}"#,
            "document 9 has 2 values",
        ),
        (r#"{"vector": [1, 2, 3, 4]}"#, "line 1: no doc_id"),
        (
            r#"{"doc_id": 9, "vector": [1, 2, 3, 4], "attributes": {"essential": "yes"}}"#,
            "\"essential\" is a bool field",
        ),
    ] {
        let bad = files.path().join("bad.jsonl");
        std::fs::write(&bad, line).unwrap();
        let output = std::process::Command::new(env!("CARGO_BIN_EXE_tarn"))
            .args([
                "insert",
                "--collection",
                "copy",
                "--jsonl",
                bad.to_str().unwrap(),
            ])
            .args(["--addr", addr])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            !output.status.success() && stderr.contains(expected),
            "{stderr}"
        );
    }
    assert_eq!(count_in("copy"), 4);
    let python = scroll(&["--filter", "section = python"]);
    let ids: Vec<&str> = python
        .iter()
        .map(|d| d["doc_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["0", "2"]);
    assert!(python[0].get("vector").is_none());
    assert_eq!(count(Some("not (section exists)")), 1);
    let out = run_cli(
        addr,
        &[
            "remove",
            "--collection",
            "pkgs",
            "--filter",
            "section = python",
        ],
    );
    assert!(out.contains("removed 2"), "{out}");
    assert_eq!(search("installed_size_kb >= 0"), vec![1]);
    assert_eq!(count(Some("section = python")), 0);
    assert_eq!(count(None), 2);
}
