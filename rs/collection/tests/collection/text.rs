//! Full-text search through the public API: BM25 scores equal a naive scorer's over the live
//! documents of the tenants searched, through upserts, removes, checkpoints, merges,
//! reopening (replay) and a snapshot restore; filters apply; bad queries are refused naming
//! the field.

use std::collections::HashMap;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tarn_collection::{
    fuse, Attributes, Bm25Config, Collection, CollectionConfig, CollectionError, FieldSpec,
    FieldType, Filter, FusionMethod, Hybrid, SearchRequest, TextAnalyzer, TextQuery, Value,
};

use crate::attributes::random_vector;
use crate::snapshot::{read_all, restore};
use crate::{config, runtime, DIM};

const WORDS: [&str; 12] = [
    "Debian",
    "kernel",
    "library",
    "libraries",
    "python",
    "the",
    "of",
    "Résumé",
    "resume",
    "tools",
    "tool",
    "daemon",
];

fn text_config() -> CollectionConfig {
    let mut config = config();
    config.fields = vec![
        FieldSpec::new("section", FieldType::Keyword),
        FieldSpec::text(
            "body",
            TextAnalyzer {
                english_stemmer: true,
                english_stop_words: true,
            },
        ),
        FieldSpec::new("title", FieldType::Text),
    ];
    config.max_sealed_segments = 2;
    config.bm25 = Bm25Config { k1: 1.5, b: 0.6 };
    config
}

fn random_text(rng: &mut StdRng) -> String {
    let len = rng.random_range(0..14);
    (0..len)
        .map(|_| WORDS[rng.random_range(0..WORDS.len())])
        .collect::<Vec<_>>()
        .join(" ")
}

/// (tenant, doc) -> body text of the live documents (None: no body value).
type Model = HashMap<(u128, u128), Option<String>>;

async fn insert(c: &Collection, model: &mut Model, rng: &mut StdRng, tenant: u128, docs: &[u128]) {
    let vectors: Vec<f32> = docs.iter().flat_map(|_| random_vector(rng)).collect();
    let mut values = Vec::new();
    for &doc in docs {
        let mut document = Attributes::new();
        document.insert("section", Value::Keyword(format!("s{}", doc % 2)));
        let body = (!doc.is_multiple_of(5)).then(|| random_text(rng));
        if let Some(body) = &body {
            document.insert("body", Value::Text(body.clone()));
        }
        document.insert("title", Value::Text(format!("title {doc}")));
        model.insert((tenant, doc), body);
        values.push(document);
    }
    let seq = c
        .insert_with_attributes(docs, &[tenant], &vectors, &values, None)
        .await
        .unwrap();
    c.wait_applied(seq, Duration::from_secs(10)).await.unwrap();
}

/// BM25 from the formula over the model's live documents of `tenants` (k1 1.5, b 0.6).
fn naive(model: &Model, tenants: &[u128], query: &str) -> HashMap<(u128, u128), f64> {
    let analyzer = TextAnalyzer {
        english_stemmer: true,
        english_stop_words: true,
    };
    let terms = analyzer.tokens(query);
    let docs: Vec<((u128, u128), Vec<String>)> = model
        .iter()
        .filter(|((tenant, _), _)| tenants.contains(tenant))
        .filter_map(|(key, body)| Some((*key, analyzer.tokens(body.as_ref()?))))
        .filter(|(_, tokens)| !tokens.is_empty())
        .collect();
    let n = docs.len() as f64;
    let avg = docs.iter().map(|(_, t)| t.len()).sum::<usize>() as f64 / n;
    let (k1, b) = (1.5, 0.6);
    let mut scores = HashMap::new();
    for (key, tokens) in &docs {
        let mut score = 0.0;
        let mut matched = false;
        for term in &terms {
            let df = docs.iter().filter(|(_, t)| t.contains(term)).count() as f64;
            let tf = tokens.iter().filter(|t| *t == term).count() as f64;
            if tf > 0.0 {
                matched = true;
                let idf = (1.0 + (n - df + 0.5) / (df + 0.5)).ln();
                score += idf * tf / (tf + k1 * (1.0 - b + b * tokens.len() as f64 / avg));
            }
        }
        if matched {
            scores.insert(*key, score);
        }
    }
    scores
}

fn text_search(
    c: &Collection,
    tenants: &[u128],
    query: &str,
    filter: Option<Filter>,
) -> Vec<(u128, u128, f32)> {
    c.search(&SearchRequest {
        user_ids: tenants.to_vec(),
        top_k: 1000,
        filter,
        text: Some(TextQuery {
            field: "body".to_string(),
            query: query.to_string(),
            stats: None,
        }),
        ..Default::default()
    })
    .unwrap()
    .into_iter()
    .map(|hit| (hit.user_id, hit.doc_id, hit.score))
    .collect()
}

fn check(c: &Collection, model: &Model, what: &str) {
    let queries = [
        "kernel",
        "libraries python",
        "the résumé tool",
        "daemon daemon kernel",
        "of Debian",
    ];
    for tenants in [&[1u128][..], &[2], &[1, 2]] {
        for query in queries {
            let want = naive(model, tenants, query);
            let got = text_search(c, tenants, query, None);
            assert_eq!(got.len(), want.len(), "{what}: {query:?} for {tenants:?}");
            for pair in got.windows(2) {
                assert!(pair[0].2 >= pair[1].2, "{what}: not best first");
            }
            for (tenant, doc, score) in &got {
                let expected = want[&(*tenant, *doc)];
                assert!(
                    (f64::from(*score) - expected).abs() <= 1e-5 * expected.max(1.0),
                    "{what}: {query:?} doc {doc}: {score} against {expected}"
                );
            }
            // A filter keeps the matching hits, with the same scores (statistics ignore it).
            let filter = Filter::Match {
                field: "section".to_string(),
                any_of: vec!["s1".to_string()],
                boolean: None,
            };
            let filtered = text_search(c, tenants, query, Some(filter));
            let expected: Vec<_> = got
                .iter()
                .filter(|(_, doc, _)| doc % 2 == 1)
                .copied()
                .collect();
            assert_eq!(filtered, expected, "{what}: filtered {query:?}");
        }
    }
}

#[test]
fn bm25_scores_are_the_formulas_over_live_documents_through_segments_merges_and_restores() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c");
    let rt = runtime();
    let mut rng = StdRng::seed_from_u64(43);
    let mut model = Model::new();
    {
        let c = Collection::create(&path, text_config()).unwrap();
        rt.block_on(async {
            insert(&c, &mut model, &mut rng, 1, &(0..150).collect::<Vec<_>>()).await;
            insert(&c, &mut model, &mut rng, 2, &(0..60).collect::<Vec<_>>()).await;
        });
        check(&c, &model, "mutable");
    }
    let c = Collection::open(&path).unwrap();
    check(&c, &model, "replayed");
    rt.block_on(async {
        c.flush().await.unwrap();
        check(&c, &model, "sealed");
        // Upserts (new texts win), removes in sealed and mutable segments, merges.
        let again: Vec<u128> = (0..150).step_by(4).collect();
        insert(&c, &mut model, &mut rng, 1, &again).await;
        c.flush().await.unwrap();
        insert(&c, &mut model, &mut rng, 1, &(150..220).collect::<Vec<_>>()).await;
        let removed: Vec<u128> = (3..220).step_by(7).collect();
        let seq = c.remove(&removed, &[1], None).await.unwrap();
        c.wait_applied(seq, Duration::from_secs(10)).await.unwrap();
        for doc in removed {
            model.remove(&(1, doc));
        }
        check(&c, &model, "removed");
        c.flush().await.unwrap();
        insert(&c, &mut model, &mut rng, 2, &(50..90).collect::<Vec<_>>()).await;
        c.flush().await.unwrap();
    });
    assert!(c.stats().n_sealed_segments <= 2);
    check(&c, &model, "merged");
    let bytes = read_all(&mut c.snapshot().unwrap());
    drop(c);
    let c = Collection::open(&path).unwrap();
    check(&c, &model, "reopened");
    let restored = dir.path().join("restored");
    restore(&bytes, &restored, 1 << 16).unwrap();
    check(&Collection::open(&restored).unwrap(), &model, "restored");
}

#[test]
fn bad_text_queries_are_refused_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let c = Collection::create(&dir.path().join("c"), text_config()).unwrap();
    let refused = |text: TextQuery, vector: Vec<f32>, field: &str, expected: &str| {
        let result = c.search(&SearchRequest {
            vector,
            top_k: 5,
            text: Some(text),
            ..Default::default()
        });
        match result {
            Err(CollectionError::InvalidArgument { field: f, reason }) => {
                assert_eq!(f, field, "{reason}");
                assert!(reason.contains(expected), "{reason}");
            }
            other => panic!("expected InvalidArgument({field}), got {other:?}"),
        }
    };
    let query = |field: &str, query: &str| TextQuery {
        field: field.to_string(),
        query: query.to_string(),
        stats: None,
    };
    refused(
        query("nope", "kernel"),
        vec![],
        "text.field",
        "not a declared field",
    );
    refused(
        query("section", "kernel"),
        vec![],
        "text.field",
        "is a KEYWORD field",
    );
    refused(
        query("body", ""),
        vec![],
        "text.query",
        "no searchable term",
    );
    // Only stop words and punctuation: nothing to search for.
    refused(
        query("body", "the, of!"),
        vec![],
        "text.query",
        "no searchable term",
    );
    refused(
        query("body", &"x ".repeat(9000)),
        vec![],
        "text.query",
        "at most 16384",
    );
    // An empty collection answers no hit.
    let hits = c
        .search(&SearchRequest {
            top_k: 5,
            text: Some(query("title", "anything")),
            ..Default::default()
        })
        .unwrap();
    assert!(hits.is_empty());
    // Settings out of range are refused at creation, naming them.
    let mut config = text_config();
    config.bm25.b = 1.5;
    let error = Collection::create(&dir.path().join("d"), config).unwrap_err();
    assert!(error.to_string().contains("bm25.b"), "{error}");
}

#[test]
fn hybrid_searches_fuse_the_two_sides_with_filters_and_report_each_sides_rank() {
    let dir = tempfile::tempdir().unwrap();
    let rt = runtime();
    let mut rng = StdRng::seed_from_u64(47);
    let mut model = Model::new();
    let c = Collection::create(&dir.path().join("c"), text_config()).unwrap();
    rt.block_on(async {
        insert(&c, &mut model, &mut rng, 1, &(0..120).collect::<Vec<_>>()).await;
        c.flush().await.unwrap();
        insert(&c, &mut model, &mut rng, 1, &(120..200).collect::<Vec<_>>()).await;
    });
    let vector = random_vector(&mut rng);
    let text = TextQuery {
        field: "body".to_string(),
        query: "python kernel tools".to_string(),
        stats: None,
    };
    let filter = Filter::Match {
        field: "section".to_string(),
        any_of: vec!["s0".to_string()],
        boolean: None,
    };
    let side = |vector: Vec<f32>, text: Option<TextQuery>, depth: usize| {
        c.search(&SearchRequest {
            user_ids: vec![1],
            vector,
            top_k: depth,
            exact: true,
            filter: Some(filter.clone()),
            text,
            ..Default::default()
        })
        .unwrap()
        .into_iter()
        .map(|hit| (hit.user_id, hit.doc_id, hit.score))
        .collect::<Vec<_>>()
    };
    for method in [FusionMethod::Rrf { k: 60.0 }, FusionMethod::RelativeScore] {
        let hybrid = Hybrid {
            method,
            depth: 30,
            vector_weight: 0.7,
            text_weight: 1.3,
        };
        let hits = c
            .search(&SearchRequest {
                user_ids: vec![1],
                vector: vector.clone(),
                top_k: 10,
                exact: true,
                filter: Some(filter.clone()),
                text: Some(text.clone()),
                hybrid,
                output: tarn_collection::FieldSelection {
                    fields: vec!["section".to_string()],
                    payload: false,
                },
                ..Default::default()
            })
            .unwrap();
        // The same as fusing each side searched alone at the depth, filter applied to both.
        let vector_side = side(vector.clone(), None, 30);
        let text_side = side(Vec::new(), Some(text.clone()), 30);
        let want = fuse(&vector_side, false, &text_side, &hybrid, 10);
        assert_eq!(hits.len(), 10);
        for (hit, want) in hits.iter().zip(&want) {
            assert_eq!(
                (hit.doc_id, hit.score),
                (want.doc_id, want.score),
                "{method:?}"
            );
            assert_eq!(hit.vector_side, want.vector);
            assert_eq!(hit.text_side, want.text);
            assert_eq!(hit.doc_id % 2, 0, "the filter applies");
            let section = hit.fields.as_ref().unwrap().get("section").cloned();
            assert_eq!(section, Some(Value::Keyword("s0".to_string())));
        }
        // Both sides contribute: some hit comes from each.
        assert!(hits.iter().any(|h| h.text_side.is_some()));
        assert!(hits.iter().any(|h| h.vector_side.is_some()));
    }
    // Bad fusion settings name their field.
    let bad = |hybrid: Hybrid, field: &str| {
        let error = c
            .search(&SearchRequest {
                vector: vector.clone(),
                top_k: 5,
                text: Some(text.clone()),
                hybrid,
                ..Default::default()
            })
            .unwrap_err();
        assert!(error.to_string().contains(field), "{error}");
    };
    let base = Hybrid::default();
    bad(
        Hybrid {
            depth: 20_000,
            ..base
        },
        "fusion.depth",
    );
    bad(
        Hybrid {
            method: FusionMethod::Rrf { k: 0.5 },
            ..base
        },
        "fusion.rrf_k",
    );
    bad(
        Hybrid {
            text_weight: -1.0,
            ..base
        },
        "fusion.text_weight",
    );
    bad(
        Hybrid {
            vector_weight: 0.0,
            text_weight: 0.0,
            ..base
        },
        "fusion.vector_weight",
    );
    let error = c
        .search(&SearchRequest {
            vector: vec![0.5; DIM - 1],
            top_k: 5,
            text: Some(text.clone()),
            ..Default::default()
        })
        .unwrap_err();
    assert!(error.to_string().contains("vector"), "{error}");
}
