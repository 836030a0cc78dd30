//! Stored values through the public API: TEXT fields and payloads come back with search hits
//! and gets (the selected fields only), through replay, checkpoints,
//! merges, reopening and a snapshot restore; bad input is refused naming its field with
//! nothing logged.

use std::collections::HashMap;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::SeedableRng;
use tarn_collection::{
    Attributes, Collection, CollectionConfig, FieldSelection, FieldSpec, FieldType, SearchRequest,
    Value,
};

use crate::attributes::random_vector;
use crate::snapshot::{read_all, restore};
use crate::{config, runtime, DIM};

fn stored_config() -> CollectionConfig {
    let mut config = config();
    config.fields = vec![
        FieldSpec::new("section", FieldType::Keyword),
        FieldSpec::new("title", FieldType::Text),
        FieldSpec::new("body", FieldType::Text),
    ];
    config.max_sealed_segments = 2;
    config
}

/// Document `doc`'s values at `version`: every fourth has no text and no payload.
fn document(doc: u128, version: u32) -> Attributes {
    let mut document = Attributes::new();
    document.insert("section", Value::Keyword(format!("s{}", doc % 3)));
    if !doc.is_multiple_of(4) {
        document.insert("title", Value::Text(format!("Title {doc} v{version}")));
        document.insert(
            "body",
            Value::Text(format!("Ünïcode body of {doc}, version {version}. ").repeat(6)),
        );
        document.set_payload(Some(format!(
            r#"{{"doc": {doc}, "version": {version}, "url": "https://example.org/{doc}"}}"#
        )));
    }
    document
}

/// (tenant, doc) -> (vector, values) as acknowledged.
type Model = HashMap<(u128, u128), (Vec<f32>, Attributes)>;

async fn insert(c: &Collection, model: &mut Model, rng: &mut StdRng, docs: &[u128], version: u32) {
    let vectors: Vec<f32> = docs.iter().flat_map(|_| random_vector(rng)).collect();
    let values: Vec<Attributes> = docs.iter().map(|&d| document(d, version)).collect();
    let seq = c
        .insert_with_attributes(docs, &[5], &vectors, &values, None)
        .await
        .unwrap();
    c.wait_applied(seq, Duration::from_secs(10)).await.unwrap();
    for ((doc, vector), values) in docs.iter().zip(vectors.chunks(DIM)).zip(values) {
        model.insert((5, *doc), (vector.to_vec(), values));
    }
}

fn selection(fields: &[&str], payload: bool) -> FieldSelection {
    FieldSelection {
        fields: fields.iter().map(|f| f.to_string()).collect(),
        payload,
    }
}

/// Every document's values by get, and by searches for its own vector (its hit carries the
/// document's values), under several selections.
fn check(c: &Collection, model: &Model, what: &str) {
    for ((user, doc), (vector, values)) in model {
        let everything = c
            .get_selected(*user, &[*doc], &FieldSelection::everything())
            .unwrap();
        assert_eq!(everything.len(), 1, "{what}: doc {doc}");
        assert_eq!(&everything[0].2, values, "{what}: doc {doc}");
        let mut request = SearchRequest {
            user_ids: vec![*user],
            vector: vector.clone(),
            top_k: 1,
            exact: true,
            output: selection(&["title"], true),
            ..Default::default()
        };
        let hits = c.search(&request).unwrap();
        assert_eq!(hits[0].doc_id, *doc, "{what}");
        let mut want = values.clone();
        want.retain(|name| name == "title", true);
        assert_eq!(hits[0].fields.as_ref(), Some(&want), "{what}: doc {doc}");
        request.output = selection(&["*"], false);
        let hits = c.search(&request).unwrap();
        let mut want = values.clone();
        want.set_payload(None);
        assert_eq!(hits[0].fields.as_ref(), Some(&want), "{what}: doc {doc}");
        request.output = FieldSelection::default();
        assert_eq!(c.search(&request).unwrap()[0].fields, None, "{what}");
    }
}

#[test]
fn texts_and_payloads_come_back_through_replay_checkpoints_merges_reopening_and_restores() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c");
    let rt = runtime();
    let mut rng = StdRng::seed_from_u64(41);
    let mut model = Model::new();
    {
        let c = Collection::create(&path, stored_config()).unwrap();
        rt.block_on(async {
            let first: Vec<u128> = (0..300).collect();
            insert(&c, &mut model, &mut rng, &first, 1).await;
        });
        check(&c, &model, "mutable");
    }
    // Reopened without a checkpoint: the values come back from the WAL.
    let c = Collection::open(&path).unwrap();
    check(&c, &model, "replayed");
    rt.block_on(c.flush()).unwrap();
    check(&c, &model, "sealed");
    // New versions of some documents (their new values win), more documents, removes, and
    // checkpoints that merge the segments.
    rt.block_on(async {
        let again: Vec<u128> = (0..300).step_by(7).collect();
        insert(&c, &mut model, &mut rng, &again, 2).await;
        c.flush().await.unwrap();
        let more: Vec<u128> = (300..450).collect();
        insert(&c, &mut model, &mut rng, &more, 1).await;
        let removed: Vec<u128> = (1..450).step_by(11).collect();
        let seq = c.remove(&removed, &[5], None).await.unwrap();
        c.wait_applied(seq, Duration::from_secs(10)).await.unwrap();
        for doc in removed {
            model.remove(&(5, doc));
        }
        c.flush().await.unwrap();
        let last: Vec<u128> = (450..470).collect();
        insert(&c, &mut model, &mut rng, &last, 3).await;
        c.flush().await.unwrap();
    });
    assert!(c.stats().n_sealed_segments <= 2);
    check(&c, &model, "merged");
    // A removed document has no values to get.
    assert!(c
        .get_selected(5, &[1], &FieldSelection::everything())
        .unwrap()
        .is_empty());
    let bytes = read_all(&mut c.snapshot().unwrap());
    drop(c);
    let c = Collection::open(&path).unwrap();
    check(&c, &model, "reopened");
    let restored = dir.path().join("restored");
    restore(&bytes, &restored, 1 << 16).unwrap();
    let r = Collection::open(&restored).unwrap();
    check(&r, &model, "restored");
    // Text and payloads stay in the segment files once sealed: far less memory than their
    // bytes (the TEXT field's inverted index, for full-text search, is held in memory and
    // counted apart).
    let text_bytes: usize = model
        .values()
        .map(|(_, values)| values.encode().len())
        .sum();
    assert!(text_bytes > 50_000, "{text_bytes}");
    let stats = r.stats();
    assert!(stats.text_index_bytes > 0);
    assert!(
        ((stats.memory_bytes - stats.text_index_bytes) as usize) < text_bytes,
        "{} bytes in memory for {text_bytes} bytes of values",
        stats.memory_bytes
    );
}

#[test]
fn bad_texts_payloads_and_selections_are_refused_naming_the_field_and_nothing_is_logged() {
    let dir = tempfile::tempdir().unwrap();
    let rt = runtime();
    let c = Collection::create(&dir.path().join("c"), stored_config()).unwrap();
    let vector = vec![0.5f32; DIM];
    let before = c.stats();
    let refused = |values: Attributes, field: &str, expected: &str| {
        let result = rt.block_on(c.insert_with_attributes(&[1], &[], &vector, &[values], None));
        match result {
            Err(tarn_collection::CollectionError::InvalidArgument { field: f, reason }) => {
                assert_eq!(f, field, "{reason}");
                assert!(reason.contains(expected), "{reason}");
            }
            other => panic!("expected InvalidArgument({field}), got {other:?}"),
        }
    };
    let mut not_json = Attributes::new();
    not_json.set_payload(Some("{not json".to_string()));
    refused(not_json, "payload", "document 0: not a JSON text");
    let mut too_big = Attributes::new();
    too_big.set_payload(Some(format!("\"{}\"", "x".repeat(1 << 20))));
    refused(too_big, "attributes", "the payload has 1048578 bytes");
    let mut long_text = Attributes::new();
    long_text.insert("body", Value::Text("y".repeat((1 << 20) + 1)));
    refused(
        long_text,
        "attributes",
        "text field \"body\" has 1048577 bytes",
    );
    let mut wrong = Attributes::new();
    wrong.insert("section", Value::Text("a text".to_string()));
    refused(wrong, "attributes", "declared KEYWORD but got a text");
    assert_eq!(c.stats(), before);

    let search = |output: FieldSelection| {
        c.search(&SearchRequest {
            vector: vector.clone(),
            top_k: 1,
            output,
            ..Default::default()
        })
    };
    let error = search(selection(&["nope"], false)).unwrap_err();
    assert!(
        error.to_string().contains("output_fields") && error.to_string().contains("\"nope\""),
        "{error}"
    );
    let error = c
        .get_selected(0, &[1], &selection(&["title", "nope"], false))
        .unwrap_err();
    assert!(error.to_string().contains("output_fields"), "{error}");
    let filter = tarn_collection::Filter::Exists("body".to_string());
    let error = c
        .search(&SearchRequest {
            vector: vector.clone(),
            top_k: 1,
            filter: Some(filter),
            ..Default::default()
        })
        .unwrap_err();
    assert!(error.to_string().contains("TEXT field"), "{error}");
}
