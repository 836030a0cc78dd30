//! Integration tests of `tarn-collection` through its public API: writes, validation, tenants,
//! read-your-writes, checkpoints, recovery (with fallback), merges and rebuilds; snapshots and
//! restores (`snapshot.rs`); attributes and filtered search (`attributes.rs`); int8 quantized
//! collections (`quantized.rs`).
#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::collections::HashSet;
use std::time::Duration;

use tarn_collection::{
    Collection, CollectionConfig, CollectionError, Durability, MetricName, SearchHit, SearchRequest,
};
use tarn_index::Metric;
use tarn_testkit::{brute_force_top_k, clustered_vectors, recall};

mod attributes;
mod quantized;
mod snapshot;
mod stored;
mod text;
mod visible;

const DIM: usize = 16;

fn config() -> CollectionConfig {
    let mut config = CollectionConfig::new(DIM, MetricName::L2);
    config.graph_threshold = 200;
    config
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn request(user_ids: &[u128], vector: &[f32], top_k: usize, exact: bool) -> SearchRequest {
    SearchRequest {
        user_ids: user_ids.to_vec(),
        vector: vector.to_vec(),
        top_k,
        exact,
        ..SearchRequest::default()
    }
}

fn row(base: &[f32], i: usize) -> &[f32] {
    &base[i * DIM..(i + 1) * DIM]
}

/// Inserts rows `range` of `base` as doc ids = row index for `user`, one request per 50 rows.
async fn insert_rows(
    c: &Collection,
    base: &[f32],
    range: std::ops::Range<usize>,
    user: u128,
) -> u64 {
    let mut last = 0;
    let rows: Vec<usize> = range.collect();
    for chunk in rows.chunks(50) {
        let ids: Vec<u128> = chunk.iter().map(|&i| i as u128).collect();
        let vectors: Vec<f32> = chunk.iter().flat_map(|&i| row(base, i).to_vec()).collect();
        last = c.insert(&ids, &[user], &vectors, None).await.unwrap();
    }
    last
}

fn exact_ids(c: &Collection, users: &[u128], q: &[f32], k: usize) -> Vec<u128> {
    c.search(&request(users, q, k, true))
        .unwrap()
        .iter()
        .map(|h| h.doc_id)
        .collect()
}

#[test]
fn writes_are_searchable_after_their_sequence_number_is_applied() {
    let dir = tempfile::tempdir().unwrap();
    let rt = runtime();
    let c = Collection::create(&dir.path().join("c"), config()).unwrap();
    let base = clustered_vectors(300, DIM, 5, 1);
    rt.block_on(async {
        let seq = insert_rows(&c, &base, 0..300, 7).await;
        c.wait_applied(seq, Duration::from_secs(10)).await.unwrap();
        let hits = c.search(&request(&[7], row(&base, 42), 1, false)).unwrap();
        assert_eq!(hits[0].doc_id, 42);
        assert!(hits[0].score < 1e-3, "L2 distance to itself");
        // Read-your-writes on a single insert, through min_seq.
        let seq = c.insert(&[1000], &[7], &[9.0; DIM], None).await.unwrap();
        let mut req = request(&[7], &[9.0; DIM], 1, true);
        req.min_seq = seq;
        let hits = c.search_after(&req, Duration::from_secs(10)).await.unwrap();
        assert_eq!(hits[0].doc_id, 1000);
        req.min_seq = seq + 100;
        assert!(matches!(
            c.search(&req),
            Err(CollectionError::DeadlineExceeded { .. })
        ));
        // A sequence number that will not come: the deadline is respected.
        let err = c
            .wait_applied(seq + 100, Duration::from_millis(50))
            .await
            .unwrap_err();
        assert!(matches!(err, CollectionError::DeadlineExceeded { .. }));
    });
    let stats = c.stats();
    assert_eq!(stats.n_documents, 301);
    assert_eq!(c.documents_per_tenant()[&7], 301);
    assert_eq!(stats.applied_seq, stats.last_appended_seq);
}

#[test]
fn bad_requests_name_the_field_and_change_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let rt = runtime();
    let mut cosine = config();
    cosine.metric = MetricName::Cosine;
    let c = Collection::create(&dir.path().join("c"), cosine).unwrap();
    let before = c.stats();
    rt.block_on(async {
        let cases: Vec<(&str, tarn_collection::Result<u64>)> = vec![
            ("vectors", c.insert(&[1], &[], &[1.0; DIM - 1], None).await),
            ("vectors", c.insert(&[1, 2], &[], &[1.0; DIM], None).await),
            ("doc_ids", c.insert(&[], &[], &[], None).await),
            ("vectors", c.insert(&[1], &[], &[f32::NAN; DIM], None).await),
            (
                "vectors",
                c.insert(&[1], &[], &[f32::INFINITY; DIM], None).await,
            ),
            ("vectors", c.insert(&[1], &[], &[0.0; DIM], None).await),
            ("doc_ids", c.remove(&[], &[1], None).await),
        ];
        for (field, result) in cases {
            match result {
                Err(CollectionError::InvalidArgument { field: f, .. }) => assert_eq!(f, field),
                other => panic!("expected InvalidArgument({field}), got {other:?}"),
            }
        }
    });
    for (field, req) in [
        ("vector", request(&[], &[1.0; DIM + 1], 10, false)),
        ("vector", request(&[], &[f32::NAN; DIM], 10, false)),
        ("top_k", request(&[], &[1.0; DIM], 0, false)),
        ("top_k", request(&[], &[1.0; DIM], 10_001, false)),
    ] {
        match c.search(&req) {
            Err(CollectionError::InvalidArgument { field: f, .. }) => assert_eq!(f, field),
            other => panic!("expected InvalidArgument({field}), got {other:?}"),
        }
    }
    assert_eq!(c.stats().last_appended_seq, before.last_appended_seq);
    assert_eq!(c.stats().n_documents, 0);
    // Bad configs.
    let mut bad = config();
    bad.dimension = 0;
    assert!(Collection::create(&dir.path().join("d"), bad.clone()).is_err());
    bad.dimension = 4097;
    assert!(Collection::create(&dir.path().join("d"), bad).is_err());
    assert!(matches!(
        Collection::create(&dir.path().join("c"), config()),
        Err(CollectionError::AlreadyExists { .. })
    ));
    assert!(matches!(
        Collection::open(&dir.path().join("nothing")),
        Err(CollectionError::NotFound { .. })
    ));
}

#[test]
fn tenants_upserts_and_removes_survive_recovery_and_sealing() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c");
    let rt = runtime();
    let base = clustered_vectors(600, DIM, 8, 2);
    let far = vec![50.0f32; DIM];
    let expect = |c: &Collection| {
        // Tenant 1 has rows 0..300, tenant 2 rows 300..600; doc 5 of tenant 1 moved far away,
        // doc 6 of tenant 1 removed; doc 7 stored for tenants 1 and 3 (multi-tenant insert).
        assert_eq!(c.get(1, &[5]).unwrap()[0].1, far);
        assert!(c.get(1, &[6]).unwrap().is_empty());
        assert_eq!(c.get(3, &[7]).unwrap().len(), 1);
        assert!(
            c.get(2, &[5]).unwrap().is_empty(),
            "tenant 2 never had doc 5"
        );
        for exact in [true, false] {
            let hits = c.search(&request(&[1], row(&base, 6), 10, exact)).unwrap();
            assert!(hits
                .iter()
                .all(|h| h.user_id == 1 && h.doc_id != 6 && h.doc_id < 300));
            let hits = c.search(&request(&[2], &far, 5, exact)).unwrap();
            assert!(hits.iter().all(|h| h.user_id == 2));
        }
        // Exact search over two tenants. (Approximate search may miss this extreme outlier in
        // the mutable segment: hnsw_rs can leave a point that no other point links to; sealing
        // reconnects such points, and exact search always finds them.)
        let hits = c.search(&request(&[1, 2], &far, 1, true)).unwrap();
        assert_eq!((hits[0].user_id, hits[0].doc_id), (1, 5));
        let stats = c.stats();
        assert_eq!(c.documents_per_tenant()[&1], 299);
        assert_eq!(c.documents_per_tenant()[&2], 300);
        assert_eq!(c.documents_per_tenant()[&3], 1);
        assert_eq!(stats.n_documents, 600);
    };
    {
        let c = Collection::create(&path, config()).unwrap();
        rt.block_on(async {
            insert_rows(&c, &base, 0..300, 1).await;
            insert_rows(&c, &base, 300..600, 2).await;
            c.insert(&[5], &[1], &far, None).await.unwrap();
            c.remove(&[6], &[1], None).await.unwrap();
            let seq = c
                .insert(&[7], &[1, 3], row(&base, 7), Some(Durability::Written))
                .await
                .unwrap();
            c.wait_applied(seq, Duration::from_secs(10)).await.unwrap();
        });
        expect(&c);
    }
    // Recovery from the WAL alone.
    let c = Collection::open(&path).unwrap();
    expect(&c);
    // Sealed, then more changes on top of the sealed data.
    let checkpoint = rt.block_on(c.flush()).unwrap();
    assert_eq!(c.stats().checkpoint_seq, checkpoint);
    assert_eq!(c.stats().n_sealed_segments, 1);
    expect(&c);
    rt.block_on(async {
        c.insert(&[8], &[2], &far, None).await.unwrap(); // new doc in tenant 2 ...
        c.remove(&[8], &[2], None).await.unwrap(); // ... and gone again
        c.remove(&[300], &[2], None).await.unwrap();
        c.insert(&[300], &[2], row(&base, 300), None).await.unwrap(); // back
    });
    drop(c);
    let c = Collection::open(&path).unwrap();
    expect(&c);
    assert!(c.get(2, &[8]).unwrap().is_empty());
    rt.block_on(c.flush()).unwrap();
    drop(c);
    let c = Collection::open(&path).unwrap();
    expect(&c);
}

/// Mean recall@10 of tenant 0's searches for `queries` against brute force (L2) over `base`.
fn mean_recall_at_10(c: &Collection, base: &[f32], queries: &[f32]) -> f64 {
    let n_queries = queries.len() / DIM;
    queries
        .chunks_exact(DIM)
        .map(|q| {
            let truth = brute_force_top_k(base, DIM, q, 10, Metric::L2);
            let found: Vec<usize> = c
                .search(&request(&[0], q, 10, false))
                .unwrap()
                .iter()
                .map(|h| h.doc_id as usize)
                .collect();
            recall(&found, &truth, 10)
        })
        .sum::<f64>()
        / n_queries as f64
}

#[test]
fn recall_at_10_of_the_sealed_and_mutable_collection_is_at_least_0_95() {
    let dir = tempfile::tempdir().unwrap();
    let rt = runtime();
    let c = Collection::create(&dir.path().join("c"), config()).unwrap();
    let base = clustered_vectors(2000, DIM, 20, 3);
    let queries = clustered_vectors(50, DIM, 20, 4);
    let measure = |c: &Collection| mean_recall_at_10(c, &base, &queries);
    rt.block_on(async {
        let seq = insert_rows(&c, &base, 0..1000, 0).await;
        c.flush().await.unwrap();
        let seq2 = insert_rows(&c, &base, 1000..2000, 0).await;
        c.wait_applied(seq.max(seq2), Duration::from_secs(30))
            .await
            .unwrap();
    });
    // Half sealed, half mutable.
    let mixed = measure(&c);
    rt.block_on(c.flush()).unwrap();
    let sealed = measure(&c);
    assert!(mixed >= 0.95, "mixed recall {mixed}");
    assert!(sealed >= 0.95, "sealed recall {sealed}");
}

#[test]
fn a_damaged_newest_checkpoint_falls_back_to_the_previous_one_and_nothing_is_lost() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c");
    let rt = runtime();
    let base = clustered_vectors(400, DIM, 5, 5);
    {
        let c = Collection::create(&path, config()).unwrap();
        rt.block_on(async {
            insert_rows(&c, &base, 0..200, 0).await;
            c.flush().await.unwrap();
            insert_rows(&c, &base, 200..400, 0).await;
            c.remove(&[3], &[], None).await.unwrap();
            c.flush().await.unwrap();
        });
    }
    let mut manifests = tarn_testkit::files_starting_with(&path, "MANIFEST-").unwrap();
    assert_eq!(
        manifests.len(),
        2,
        "the current and the previous manifest are kept"
    );
    let newest = manifests.pop().unwrap();
    let mut bytes = std::fs::read(&newest).unwrap();
    bytes[10] ^= 0xFF;
    std::fs::write(&newest, &bytes).unwrap();
    {
        let c = Collection::open(&path).unwrap();
        assert_eq!(c.stats().n_documents, 399);
        assert!(c.get(0, &[3]).unwrap().is_empty());
        assert_eq!(c.get(0, &[399]).unwrap()[0].1, row(&base, 399).to_vec());
        // Working normally: the next checkpoint supersedes the damaged one.
        rt.block_on(c.flush()).unwrap();
    }
    let c = Collection::open(&path).unwrap();
    assert_eq!(c.stats().n_documents, 399);
    drop(c);

    // Every segment file damaged: no checkpoint is valid, so refuse to start, naming the files.
    let mut all_segments: Vec<_> = std::fs::read_dir(&path)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "tseg"))
        .collect();
    all_segments.sort();
    for seg in &all_segments {
        let mut bytes = std::fs::read(seg).unwrap();
        let mid = bytes.len() / 2;
        bytes[mid] ^= 1;
        std::fs::write(seg, &bytes).unwrap();
    }
    match Collection::open(&path) {
        Err(CollectionError::Corrupt(message)) => {
            assert!(message.contains("no valid checkpoint"), "{message}");
            assert!(message.contains(".tseg"), "{message}");
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[test]
fn merges_and_rebuilds_keep_every_live_document_under_concurrent_searches() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c");
    let rt = runtime();
    let mut cfg = config();
    cfg.max_sealed_segments = 2;
    let base = clustered_vectors(1200, DIM, 10, 6);
    let c = Collection::create(&path, cfg).unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    // A searcher that must never see a removed document (multiples of 3 below 600, removed
    // before it starts) and always find a live one by its own vector (rows 600.. once written).
    let removed: HashSet<u128> = (0..600).step_by(3).collect();
    rt.block_on(async {
        insert_rows(&c, &base, 0..600, 0).await;
        let ids: Vec<u128> = removed.iter().copied().collect();
        let seq = c.remove(&ids, &[], None).await.unwrap();
        c.wait_applied(seq, Duration::from_secs(10)).await.unwrap();
    });
    let searcher = {
        let (c, stop, base, removed) = (c.clone(), stop.clone(), base.clone(), removed.clone());
        std::thread::spawn(move || {
            let mut n = 0usize;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let i = (n * 7) % 600;
                let hits: Vec<SearchHit> =
                    c.search(&request(&[0], row(&base, i), 10, false)).unwrap();
                assert!(
                    hits.iter().all(|h| !removed.contains(&h.doc_id)),
                    "removed doc returned"
                );
                if !removed.contains(&(i as u128)) {
                    assert_eq!(
                        hits[0].doc_id, i as u128,
                        "live doc {i} not found by itself"
                    );
                }
                n += 1;
            }
            n
        })
    };
    rt.block_on(async {
        for batch in 0..4 {
            c.flush().await.unwrap();
            insert_rows(&c, &base, 600 + batch * 150..600 + (batch + 1) * 150, 0).await;
        }
        c.flush().await.unwrap();
    });
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    assert!(searcher.join().unwrap() > 0);
    let stats = c.stats();
    assert!(stats.n_sealed_segments <= 2, "{stats:?}");
    assert_eq!(stats.n_documents, 1000);
    // The first segment had a third of its slots tombstoned: it was rebuilt or merged away.
    assert_eq!(stats.n_removed_not_compacted, 0, "{stats:?}");
    for i in (600..1200).step_by(37) {
        assert_eq!(exact_ids(&c, &[0], row(&base, i), 1), vec![i as u128]);
    }
    drop(c);
    let c = Collection::open(&path).unwrap();
    assert_eq!(c.stats().n_documents, 1000);
    let files: Vec<String> = std::fs::read_dir(&path)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    let n_segment_files = files.iter().filter(|f| f.ends_with(".tseg")).count();
    assert!(
        n_segment_files <= 4,
        "unreferenced segment files are deleted: {files:?}"
    );
}

#[test]
fn automatic_checkpoints_by_age() {
    let dir = tempfile::tempdir().unwrap();
    let rt = runtime();
    let mut cfg = config();
    cfg.checkpoint_interval_ms = 100;
    let c = Collection::create(&dir.path().join("c"), cfg).unwrap();
    let seq = rt.block_on(c.insert(&[1], &[], &[1.0; DIM], None)).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while c.stats().checkpoint_seq < seq {
        assert!(std::time::Instant::now() < deadline, "no checkpoint by age");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(c.stats().n_sealed_segments, 1);
}

fn wait_for_checkpoint(c: &Collection) -> tarn_collection::CollectionStats {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let stats = c.stats();
        if stats.checkpoint_seq > 0 {
            return stats;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no automatic checkpoint: {stats:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn automatic_checkpoints_by_mutable_size() {
    // Upserts over 100 documents: the WAL grows slowly, the mutable segment (which keeps every
    // superseded version until sealing) fast. Its size bound must checkpoint it.
    let dir = tempfile::tempdir().unwrap();
    let rt = runtime();
    let mut cfg = config();
    cfg.checkpoint_mutable_bytes = 200_000;
    let c = Collection::create(&dir.path().join("c"), cfg).unwrap();
    let base = clustered_vectors(2_000, DIM, 5, 11);
    rt.block_on(async {
        let mut seq = 0;
        for round in 0..20 {
            for chunk in (0..100).collect::<Vec<usize>>().chunks(50) {
                let ids: Vec<u128> = chunk.iter().map(|&i| i as u128).collect();
                let vectors: Vec<f32> = chunk
                    .iter()
                    .flat_map(|&i| base[(round * 100 + i) * DIM..][..DIM].to_vec())
                    .collect();
                seq = c.insert(&ids, &[0], &vectors, None).await.unwrap();
            }
        }
        c.wait_applied(seq, Duration::from_secs(10)).await.unwrap();
    });
    let stats = wait_for_checkpoint(&c);
    assert_eq!(stats.n_documents, 100);
    drop(c);
    let c = Collection::open(&dir.path().join("c")).unwrap();
    assert_eq!(c.stats().n_documents, 100);
    for i in [0usize, 37, 99] {
        let expected = &base[(19 * 100 + i) * DIM..][..DIM];
        assert_eq!(
            c.get(0, &[i as u128]).unwrap(),
            vec![(i as u128, expected.to_vec())]
        );
    }
}

#[test]
fn a_load_that_outruns_the_indexer_is_sealed_by_the_builder_and_searched_well_meanwhile() {
    // Past `seal_unindexed` vectors waiting for a graph, a checkpoint seals them with tarn's
    // builder; nothing else could checkpoint here (the other triggers are far, no flush).
    let dir = tempfile::tempdir().unwrap();
    let rt = runtime();
    let mut cfg = config();
    cfg.graph_threshold = 64;
    cfg.seal_unindexed = 500;
    cfg.max_unindexed = 2_000;
    let c = Collection::create(&dir.path().join("c"), cfg).unwrap();
    let n = 6_000;
    let base = clustered_vectors(n, DIM, 30, 21);
    let queries = clustered_vectors(40, DIM, 30, 22);
    let measure = |c: &Collection| mean_recall_at_10(c, &base, &queries);
    let mut recalls = Vec::new();
    rt.block_on(async {
        let mut seq = 0;
        for part in 0..6 {
            let rows = part * 1_000..(part + 1) * 1_000;
            let ids: Vec<u128> = rows.clone().map(|i| i as u128).collect();
            let vectors: Vec<f32> = base[rows.start * DIM..rows.end * DIM].to_vec();
            seq = c
                .insert(&ids, &[0], &vectors, Some(Durability::Written))
                .await
                .unwrap();
        }
        c.wait_applied(seq, Duration::from_secs(30)).await.unwrap();
    });
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let stats = loop {
        let stats = c.stats();
        recalls.push(measure(&c));
        if stats.n_unindexed == 0 {
            break stats;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "never indexed: {stats:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(
        stats.n_vectors_built >= 500 && stats.n_sealed_segments >= 1,
        "the unindexed tail was not sealed by a build: {stats:?}"
    );
    assert_eq!(stats.n_documents, n as u64);
    let worst = recalls.iter().copied().fold(1.0, f64::min);
    assert!(
        worst >= 0.95,
        "recall fell to {worst} during the load: {recalls:?}"
    );
    let ids: Vec<u128> = (0..n as u128).collect();
    assert_eq!(c.get(0, &ids).unwrap().len(), n);
    drop(c);
    let c = Collection::open(&dir.path().join("c")).unwrap();
    assert_eq!(c.stats().n_documents, n as u64);
    assert!(measure(&c) >= 0.95);
}

#[test]
fn automatic_checkpoints_by_wal_size() {
    let dir = tempfile::tempdir().unwrap();
    let rt = runtime();
    let mut cfg = config();
    cfg.checkpoint_wal_bytes = 20_000;
    let c = Collection::create(&dir.path().join("c"), cfg).unwrap();
    let base = clustered_vectors(500, DIM, 5, 7);
    rt.block_on(async {
        let seq = insert_rows(&c, &base, 0..500, 0).await;
        c.wait_applied(seq, Duration::from_secs(10)).await.unwrap();
    });
    // Checkpoints run on their own thread: wait for the first one.
    let stats = wait_for_checkpoint(&c);
    assert!(stats.n_sealed_segments >= 1);
    drop(c);
    let c = Collection::open(&dir.path().join("c")).unwrap();
    assert_eq!(c.stats().n_documents, 500);
}

#[test]
fn writes_during_background_checkpoints_are_never_lost_or_resurrected() {
    // Checkpoints run on their own thread while ingestion goes on: upserts and removes land in
    // segments being sealed, merged and rebuilt. A model of every acknowledged write must match
    // the collection while checkpoints run, after they settle, and after a reopen.
    use rand::{Rng, SeedableRng};
    let dir = tempfile::tempdir().unwrap();
    let rt = runtime();
    let mut cfg = config();
    cfg.graph_threshold = 50;
    cfg.checkpoint_mutable_bytes = 150_000;
    cfg.max_sealed_segments = 2;
    let c = Collection::create(&dir.path().join("c"), cfg).unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(23);
    let mut model: std::collections::HashMap<(u128, u128), Vec<f32>> =
        std::collections::HashMap::new();
    let mut n_flushes = 0;
    rt.block_on(async {
        let mut flushes = Vec::new();
        for round in 0..600 {
            let user: u128 = rng.random_range(0..2);
            let ids: Vec<u128> = (0..rng.random_range(1..12))
                .map(|_| rng.random_range(0..300))
                .collect::<std::collections::BTreeSet<_>>()
                .into_iter()
                .collect();
            if rng.random_bool(0.75) {
                let vectors: Vec<f32> = (0..ids.len() * DIM)
                    .map(|_| rng.random_range(-1.0..1.0))
                    .collect();
                c.insert(&ids, &[user], &vectors, None).await.unwrap();
                for (id, v) in ids.iter().zip(vectors.chunks(DIM)) {
                    model.insert((user, *id), v.to_vec());
                }
            } else {
                c.remove(&ids, &[user], None).await.unwrap();
                for id in &ids {
                    model.remove(&(user, *id));
                }
            }
            if round % 97 == 0 {
                // Flushes queue behind automatic checkpoints, concurrently with the writes.
                let c = c.clone();
                flushes.push(tokio::spawn(async move { c.flush().await }));
                n_flushes += 1;
            }
        }
        for flush in flushes {
            flush.await.unwrap().unwrap();
        }
    });
    assert!(n_flushes > 0);
    let check = |c: &Collection, when: &str| {
        for user in 0..2u128 {
            for id in 0..300u128 {
                let got = c.get(user, &[id]).unwrap();
                match model.get(&(user, id)) {
                    Some(v) => assert_eq!(got, vec![(id, v.clone())], "{when}: ({user}, {id})"),
                    None => assert!(got.is_empty(), "{when}: ({user}, {id}) resurrected"),
                }
            }
            let expected = model.keys().filter(|(u, _)| *u == user).count() as u64;
            assert_eq!(
                c.documents_per_tenant().get(&user).copied().unwrap_or(0),
                expected,
                "{when}: count of tenant {user}"
            );
            // Exact search over everything finds each live document exactly once.
            let mut found = exact_ids(c, &[user], &[0.0; DIM], model.len().max(1));
            found.sort_unstable();
            let mut live: Vec<u128> = model
                .keys()
                .filter(|(u, _)| *u == user)
                .map(|(_, d)| *d)
                .collect();
            live.sort_unstable();
            assert_eq!(found, live, "{when}: exact search of tenant {user}");
        }
    };
    check(&c, "after the writes");
    let stats = c.stats();
    assert!(
        stats.checkpoint_seq > 0 && stats.n_sealed_segments >= 1,
        "{stats:?}"
    );
    let seq = rt.block_on(c.flush()).unwrap();
    check(&c, "after a final flush");
    drop(c);
    let c = Collection::open(&dir.path().join("c")).unwrap();
    assert_eq!(c.stats().checkpoint_seq, seq);
    check(&c, "after reopening");
}

#[test]
fn export_lists_every_live_document_once_from_every_kind_of_segment() {
    let dir = tempfile::tempdir().unwrap();
    let c = Collection::create(dir.path(), config()).unwrap();
    let base = clustered_vectors(600, DIM, 8, 11);
    let rt = runtime();
    let mut want = std::collections::BTreeMap::new();
    rt.block_on(async {
        // Sealed: 400 rows of two tenants, then a checkpoint; then upserts of 50 of them and
        // removals of 30 (tombstones in the sealed segment), and 200 new rows (mutable).
        insert_rows(&c, &base, 0..400, 1).await;
        insert_rows(&c, &base, 0..100, 2).await;
        c.flush().await.unwrap();
        for i in 0..400 {
            want.insert((1u128, i as u128), row(&base, i).to_vec());
        }
        for i in 0..100 {
            want.insert((2u128, i as u128), row(&base, i).to_vec());
        }
        let ids: Vec<u128> = (0..50).collect();
        let vectors: Vec<f32> = (500..550).flat_map(|i| row(&base, i).to_vec()).collect();
        c.insert(&ids, &[1], &vectors, None).await.unwrap();
        for (k, id) in ids.iter().enumerate() {
            want.insert((1, *id), row(&base, 500 + k).to_vec());
        }
        let removed: Vec<u128> = (100..130).collect();
        c.remove(&removed, &[1], None).await.unwrap();
        for id in &removed {
            want.remove(&(1, *id));
        }
        let last = insert_rows(&c, &base, 400..600, 3).await;
        for i in 400..600 {
            want.insert((3u128, i as u128), row(&base, i).to_vec());
        }
        c.wait_applied(last, Duration::from_secs(10)).await.unwrap();
    });
    let got: std::collections::BTreeMap<(u128, u128), Vec<f32>> = c
        .export_documents()
        .map(|document| document.map(|(user, doc, vector)| ((user, doc), vector)))
        .collect::<Result<_, _>>()
        .unwrap();
    let got: std::collections::BTreeMap<(u128, u128), Vec<f32>> = got.into_iter().collect();
    assert_eq!(got.len(), want.len());
    assert_eq!(got, want);
    assert_eq!(c.export_documents().count(), c.stats().n_documents as usize);
}

/// Fifty concurrent flushes share checkpoints: at most two run (the one that was running when
/// the others arrived, and one for all of those), and each flush's answer covers the write its
/// caller made just before it. Then a flush alone still makes its own checkpoint.
#[test]
fn concurrent_flushes_share_one_or_two_checkpoints_and_each_covers_its_writes() {
    let dir = tempfile::tempdir().unwrap();
    let c = Collection::create(dir.path(), config()).unwrap();
    let rt = runtime();
    rt.block_on(async {
        let tasks: Vec<_> = (0..50u128)
            .map(|i| {
                let c = c.clone();
                tokio::spawn(async move {
                    let vector: Vec<f32> = (0..DIM).map(|d| (i * 7 + d as u128) as f32).collect();
                    let seq = c.insert(&[i], &[], &vector, None).await.unwrap();
                    let checkpoint_seq = c.flush().await.unwrap();
                    assert!(checkpoint_seq >= seq, "{checkpoint_seq} < {seq}");
                })
            })
            .collect();
        for task in tasks {
            task.await.unwrap();
        }
    });
    let stats = c.stats();
    assert!(
        (1..=2).contains(&stats.n_checkpoints),
        "{} checkpoints for 50 flushes",
        stats.n_checkpoints
    );
    assert_eq!(stats.checkpoint_seq, 50);
    rt.block_on(async {
        c.insert(&[100], &[], &[1.0; DIM], None).await.unwrap();
        assert_eq!(c.flush().await.unwrap(), 51);
    });
    assert_eq!(c.stats().n_checkpoints, stats.n_checkpoints + 1);
    c.close();
    let c = Collection::open(dir.path()).unwrap();
    assert_eq!(c.stats().n_documents, 51);
}

/// Stats come from counters kept by ingestion and the checkpoint thread, not from the
/// per-tenant map or a directory walk: the counters agree with the map through seeded inserts,
/// upserts and removes over several tenants, across checkpoints and a reopen; the size on disk
/// counts WAL growth at once and is re-measured by each checkpoint.
#[test]
fn stats_counters_agree_with_the_per_tenant_counts_through_writes_checkpoints_and_reopen() {
    use rand::{Rng, SeedableRng};
    let dir = tempfile::tempdir().unwrap();
    let c = Collection::create(dir.path(), config()).unwrap();
    let rt = runtime();
    let mut rng = rand::rngs::StdRng::seed_from_u64(20);
    let check = |c: &Collection, when: &str| {
        let stats = c.stats();
        let per_tenant = c.documents_per_tenant();
        assert_eq!(
            stats.n_documents,
            per_tenant.values().sum::<u64>(),
            "{when}"
        );
        assert_eq!(stats.n_tenants, per_tenant.len() as u64, "{when}");
        stats
    };
    let empty = check(&c, "empty");
    assert_eq!((empty.n_documents, empty.n_tenants), (0, 0));
    rt.block_on(async {
        let mut last = 0;
        for round in 0..300 {
            let tenant: u128 = rng.random_range(0..7);
            let docs: Vec<u128> = (0..rng.random_range(1..5))
                .map(|_| rng.random_range(0..40))
                .collect();
            last = if rng.random_bool(0.3) {
                c.remove(&docs, &[tenant], None).await.unwrap()
            } else {
                let vectors: Vec<f32> = (0..docs.len() * DIM)
                    .map(|_| rng.random_range(-1.0..1.0))
                    .collect();
                c.insert(&docs, &[tenant], &vectors, None).await.unwrap()
            };
            if round % 100 == 99 {
                c.wait_applied(last, Duration::from_secs(60)).await.unwrap();
                check(&c, &format!("round {round}"));
                c.flush().await.unwrap();
            }
        }
        c.wait_applied(last, Duration::from_secs(60)).await.unwrap();
    });
    let before = check(&c, "end");
    assert!(before.n_documents > 0 && before.n_tenants == 7);
    // WAL growth shows at once; a checkpoint re-measures the directory.
    rt.block_on(async {
        c.insert(&[1000], &[0], &[0.5; DIM], None).await.unwrap();
    });
    assert!(c.stats().bytes_on_disk > before.bytes_on_disk);
    rt.block_on(async { c.flush().await.unwrap() });
    assert!(c.stats().bytes_on_disk > 0);
    let at_close = check(&c, "before close");
    c.close();
    let c = Collection::open(dir.path()).unwrap();
    let reopened = check(&c, "reopened");
    assert_eq!(reopened.n_documents, at_close.n_documents);
}
