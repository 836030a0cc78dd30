//! A panic on one of a collection's threads (ingestion, checkpoint, indexing) fails that
//! collection at once: later writes, flushes and `wait_applied` return an error naming the
//! thread instead of hanging or being acknowledged and never applied; reads go on; another
//! collection keeps working; a reopen recovers every acknowledged write. The threads are killed
//! with the `fail` crate's `panic` action, armed for one hit (`1*panic`). Fail points are
//! process-global, so this is its own binary and each test holds a `FailScenario`. Run with
//! `--features failpoints`.
//!
//! Also here (it needs the WAL's fail points): a checkpoint on a poisoned WAL stops before
//! sealing and is not retried.
#![cfg(feature = "failpoints")]
#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::time::Duration;

use fail::FailScenario;
use tarn_collection::{Collection, CollectionConfig, CollectionError, MetricName};

const DIM: usize = 8;
/// Long enough never to be reached by a wait that the failure is meant to end.
const NEVER: Duration = Duration::from_secs(120);

fn config() -> CollectionConfig {
    let mut config = CollectionConfig::new(DIM, MetricName::L2);
    // Small, so a few inserts give the indexer graph work.
    config.graph_threshold = 8;
    config
}

/// Documents `first..first + n` of tenant 0, with vectors derived from their ids.
fn docs(first: u128, n: u128) -> (Vec<u128>, Vec<f32>) {
    let ids: Vec<u128> = (first..first + n).collect();
    let vectors = ids
        .iter()
        .flat_map(|&id| (0..DIM).map(move |d| id as f32 + d as f32 * 0.25))
        .collect();
    (ids, vectors)
}

fn assert_present(c: &Collection, ids: &[u128]) {
    let found = c.get(0, ids).unwrap();
    assert_eq!(
        found.iter().map(|(id, _)| *id).collect::<Vec<_>>(),
        ids,
        "acknowledged documents missing"
    );
}

fn assert_failed_by(error: CollectionError, thread: &str) {
    match error {
        CollectionError::Failed(failure) => assert_eq!(failure.thread, thread),
        other => panic!("expected the {thread} thread's failure, got {other:?}"),
    }
}

/// Opens collections A and B, writes a first batch to each, arms `fail_point` for one panic,
/// lets `trigger` make A's thread hit it, then checks the failed state and the recovery.
fn a_dead_thread_fails_only_its_collection(
    fail_point: &str,
    thread: &str,
    trigger: impl AsyncFnOnce(&Collection) -> Vec<u128>,
) {
    let scenario = FailScenario::setup();
    let dir = tempfile::tempdir().unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let a = Collection::create(&dir.path().join("a"), config()).unwrap();
    let b = Collection::create(&dir.path().join("b"), config()).unwrap();
    let (before_ids, before_vectors) = docs(1000, 4);
    let mut acknowledged = before_ids.clone();
    rt.block_on(async {
        for c in [&a, &b] {
            let seq = c
                .insert(&before_ids, &[], &before_vectors, None)
                .await
                .unwrap();
            c.wait_applied(seq, NEVER).await.unwrap();
        }
    });
    fail::cfg(fail_point, "1*panic(killed by a test)").unwrap();
    rt.block_on(async {
        acknowledged.extend(trigger(&a).await);
        // The failure ends a wait for an operation that will never come.
        let last = a.stats().last_appended_seq;
        assert_failed_by(a.wait_applied(last + 1, NEVER).await.unwrap_err(), thread);
        let failure = a.failure().expect("A is failed").clone();
        assert!(failure.why.contains("killed by a test"), "{failure}");
        let write_error = a.write_error().unwrap();
        assert!(write_error.contains(thread), "{write_error}");
        // Writes and flushes are refused, naming the thread.
        let (ids, vectors) = docs(5000, 1);
        assert_failed_by(
            a.insert(&ids, &[], &vectors, None).await.unwrap_err(),
            thread,
        );
        assert_failed_by(a.remove(&ids, &[], None).await.unwrap_err(), thread);
        assert_failed_by(a.flush().await.unwrap_err(), thread);
        // The WAL is poisoned too, so whatever was queued behind the failure was refused: a
        // snapshot's sync barrier finds it so.
        match a.snapshot() {
            Err(CollectionError::Unavailable(error)) => {
                assert!(error.to_string().contains(thread), "{error}")
            }
            other => panic!("expected a poisoned WAL, got {:?}", other.err()),
        }
        // Reads go on.
        assert_present(&a, &before_ids);
        // B is untouched: writes, read-your-writes and a checkpoint.
        assert!(b.failure().is_none() && b.write_error().is_none());
        let (ids, vectors) = docs(2000, 20);
        let seq = b.insert(&ids, &[], &vectors, None).await.unwrap();
        b.wait_applied(seq, NEVER).await.unwrap();
        assert!(b.flush().await.unwrap() >= seq);
        assert_present(&b, &ids);
    });
    a.close();
    drop(a);
    let a = Collection::open(&dir.path().join("a")).unwrap();
    assert!(a.failure().is_none());
    assert_present(&a, &acknowledged);
    rt.block_on(async {
        let (ids, vectors) = docs(6000, 2);
        let seq = a.insert(&ids, &[], &vectors, None).await.unwrap();
        a.wait_applied(seq, NEVER).await.unwrap();
        a.flush().await.unwrap();
    });
    scenario.teardown();
}

#[test]
fn a_panic_on_the_ingestion_thread_fails_the_collection_and_a_reopen_recovers_every_write() {
    a_dead_thread_fails_only_its_collection("ingest::apply", "ingestion", async |a| {
        let (ids, vectors) = docs(3000, 3);
        // Acknowledged (it is in the WAL) although ingestion dies applying it.
        a.insert(&ids, &[], &vectors, None).await.unwrap();
        ids
    });
}

/// A panic at `point` during the checkpoint a flush of `n_docs` documents starts.
fn a_checkpoint_panic_fails_the_flush(point: &str, n_docs: u128) {
    a_dead_thread_fails_only_its_collection(point, "checkpoint", async |a| {
        let (ids, vectors) = docs(3000, n_docs);
        a.insert(&ids, &[], &vectors, None).await.unwrap();
        assert_failed_by(a.flush().await.unwrap_err(), "checkpoint");
        ids
    });
}

#[test]
fn a_panic_on_the_checkpoint_thread_fails_the_collection_and_its_flush() {
    a_checkpoint_panic_fails_the_flush("checkpoint::start", 3);
}

#[test]
fn a_panic_in_a_checkpoint_graph_build_fails_the_collection_and_loses_nothing() {
    // Past the graph threshold: sealing builds a graph.
    a_checkpoint_panic_fails_the_flush("checkpoint::build", 40);
}

#[test]
fn a_panic_on_the_indexing_thread_fails_the_collection() {
    a_dead_thread_fails_only_its_collection("indexer::batch", "indexing", async |a| {
        // Past the graph threshold: the indexer has a batch to index.
        let (ids, vectors) = docs(3000, 16);
        a.insert(&ids, &[], &vectors, None).await.unwrap();
        ids
    });
}

fn segment_files(dir: &std::path::Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.starts_with("seg-"))
        .collect()
}

#[test]
fn a_checkpoint_on_a_poisoned_wal_seals_nothing_and_is_not_retried() {
    let scenario = FailScenario::setup();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("a");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut config = config();
    // A failed checkpoint used to be retried an interval later, forever: make that quick.
    config.checkpoint_interval_ms = 5;
    let a = Collection::create(&path, config).unwrap();
    let (ids, vectors) = docs(1, 20);
    rt.block_on(async {
        // Held at its start, an automatic checkpoint cannot run before the WAL is poisoned.
        fail::cfg("checkpoint::start", "pause").unwrap();
        // Applied, not checkpointed: the next checkpoint would seal these.
        fail::cfg("wal::fdatasync", "return").unwrap();
        let error = a
            .insert(
                &ids,
                &[],
                &vectors,
                Some(tarn_collection::Durability::Written),
            )
            .await
            .map(|_| ())
            .and(
                a.insert(&ids[..1], &[], &vectors[..DIM], None)
                    .await
                    .map(|_| ()),
            );
        assert!(
            matches!(error, Err(CollectionError::Unavailable(_))),
            "{error:?}"
        );
        assert!(a.write_error().is_some());
        fail::remove("checkpoint::start");
        match a.flush().await {
            Err(CollectionError::Unavailable(_)) => {}
            other => panic!("expected Unavailable, got {other:?}"),
        }
    });
    // No retry loop: a hundred intervals later, the one automatic checkpoint that was held at
    // its start is the only one refused (the flush was refused at its WAL barrier, before
    // reaching the checkpoint thread), and nothing was written.
    std::thread::sleep(Duration::from_millis(500));
    let stats = a.stats();
    assert_eq!(stats.n_checkpoints_refused, 1);
    assert_eq!(stats.n_checkpoints, 0);
    assert!(
        segment_files(&path).is_empty(),
        "{:?}",
        segment_files(&path)
    );
    fail::remove("wal::fdatasync");
    a.close();
    drop(a);
    let a = Collection::open(&path).unwrap();
    assert_present(&a, &ids);
    scenario.teardown();
}
