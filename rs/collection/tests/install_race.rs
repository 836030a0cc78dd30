//! Writes that race a checkpoint's install: removals and upserts of documents that the
//! checkpoint has already copied into a merged segment, applied (a) after the merge and before
//! the install reconciles its copies outside the apply lock, and (b) after that reconciliation
//! and before the install takes the apply lock. Each window is held open by a fail point whose
//! callback blocks the checkpoint thread until the test's writes are applied. Afterwards, and
//! again after a further checkpoint and a reopen, the collection must equal a model of the
//! acknowledged operations: a copy that missed a removal would bring a document back (get,
//! exact search) or count a replaced one twice (the counts a reopen takes from the segments).
//! Fail points are process-global, so this is its own binary. Run with `--features failpoints`.
#![cfg(feature = "failpoints")]
#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::collections::{BTreeMap, HashMap};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Mutex;
use std::time::Duration;

use fail::FailScenario;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tarn_collection::{Collection, CollectionConfig, MetricName, SearchRequest};

const DIM: usize = 8;
const TENANTS: u128 = 3;
/// Documents `0..HALF` of each tenant are sealed by the first checkpoint, `HALF..2 * HALF` are
/// frozen and sealed by the second, which merges both into one segment.
const HALF: u128 = 150;
const WAIT: Duration = Duration::from_secs(60);

type Model = BTreeMap<(u128, u128), Vec<f32>>;

fn config() -> CollectionConfig {
    let mut config = CollectionConfig::new(DIM, MetricName::L2);
    config.graph_threshold = 64;
    config.max_sealed_segments = 1;
    // Only flushes checkpoint.
    config.checkpoint_wal_bytes = u64::MAX / 2;
    config.checkpoint_mutable_bytes = u64::MAX / 2;
    config.checkpoint_interval_ms = 24 * 3600 * 1000;
    config
}

/// A vector unique to (tenant, doc, version).
fn vector(user_id: u128, doc_id: u128, version: u32) -> Vec<f32> {
    (0..DIM)
        .map(|d| user_id as f32 * 1000.0 + doc_id as f32 + version as f32 * 0.125 + d as f32 * 0.01)
        .collect()
}

/// Blocks the checkpoint thread at `fail_point` until the test lets it go: returns a receiver
/// that gets a message when the thread arrives, and the sender that lets it go on.
fn gate(fail_point: &str) -> (Receiver<()>, Sender<()>) {
    let (arrived_tx, arrived_rx) = channel();
    let (go_tx, go_rx) = channel::<()>();
    let arrived_tx = Mutex::new(arrived_tx);
    let go_rx = Mutex::new(go_rx);
    fail::cfg_callback(fail_point, move || {
        let _ = arrived_tx.lock().unwrap().send(());
        // Later checkpoints pass straight through: the sender is gone by then.
        let _ = go_rx.lock().unwrap().recv();
    })
    .unwrap();
    (arrived_rx, go_tx)
}

/// Seeded random removals, upserts and remove-then-insert pairs over `ids` of every tenant, each
/// applied before the function returns.
async fn race_writes(
    c: &Collection,
    model: &mut Model,
    rng: &mut StdRng,
    ids: &[u128],
    version: u32,
) {
    let mut last_seq = 0;
    for &doc_id in ids {
        for user_id in 0..TENANTS {
            match rng.random_range(0..3) {
                0 => {
                    last_seq = c.remove(&[doc_id], &[user_id], None).await.unwrap();
                    model.remove(&(user_id, doc_id));
                }
                1 => {
                    let v = vector(user_id, doc_id, version);
                    last_seq = c.insert(&[doc_id], &[user_id], &v, None).await.unwrap();
                    model.insert((user_id, doc_id), v);
                }
                _ => {
                    c.remove(&[doc_id], &[user_id], None).await.unwrap();
                    let v = vector(user_id, doc_id, version);
                    last_seq = c.insert(&[doc_id], &[user_id], &v, None).await.unwrap();
                    model.insert((user_id, doc_id), v);
                }
            }
        }
    }
    c.wait_applied(last_seq, WAIT).await.unwrap();
}

fn assert_matches(c: &Collection, model: &Model, when: &str) {
    let mut counts: HashMap<u128, u64> = HashMap::new();
    for &(user_id, _) in model.keys() {
        *counts.entry(user_id).or_default() += 1;
    }
    let per_tenant = c.documents_per_tenant();
    for user_id in 0..TENANTS {
        assert_eq!(
            per_tenant.get(&user_id).copied().unwrap_or(0),
            counts.get(&user_id).copied().unwrap_or(0),
            "{when}: live documents of tenant {user_id}"
        );
        let all: Vec<u128> = (0..2 * HALF).collect();
        let found: Model = c
            .get(user_id, &all)
            .unwrap()
            .into_iter()
            .map(|(doc_id, v)| ((user_id, doc_id), v))
            .collect();
        let expected: Model = model
            .iter()
            .filter(|((u, _), _)| *u == user_id)
            .map(|(k, v)| (*k, v.clone()))
            .collect();
        let wrong: Vec<&(u128, u128)> = expected
            .keys()
            .chain(found.keys())
            .filter(|pair| found.get(pair) != expected.get(pair))
            .collect();
        assert!(
            wrong.is_empty(),
            "{when}: get of tenant {user_id}: {} documents missing, undone or resurrected, e.g. {:?}",
            wrong.len(),
            &wrong[..wrong.len().min(5)]
        );
        let hits = c
            .search(&SearchRequest {
                user_ids: vec![user_id],
                vector: vector(user_id, 0, 0),
                top_k: 4 * HALF as usize,
                exact: true,
                ..SearchRequest::default()
            })
            .unwrap();
        let mut hit_ids: Vec<u128> = hits.iter().map(|h| h.doc_id).collect();
        hit_ids.sort_unstable();
        let expected_ids: Vec<u128> = expected.keys().map(|(_, d)| *d).collect();
        assert_eq!(
            hit_ids, expected_ids,
            "{when}: exact search of tenant {user_id}"
        );
    }
}

#[test]
fn writes_racing_the_install_of_a_merge_are_neither_lost_nor_undone() {
    let scenario = FailScenario::setup();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let mut rng = StdRng::seed_from_u64(20);
    let mut model = Model::new();
    let c = Collection::create(&path, config()).unwrap();
    rt.block_on(async {
        for (idx, docs) in [0..HALF, HALF..2 * HALF].into_iter().enumerate() {
            for user_id in 0..TENANTS {
                for doc_id in docs.clone() {
                    let v = vector(user_id, doc_id, 0);
                    c.insert(&[doc_id], &[user_id], &v, None).await.unwrap();
                    model.insert((user_id, doc_id), v);
                }
            }
            if idx == 0 {
                c.flush().await.unwrap();
            }
        }
    });
    assert_eq!(c.stats().n_sealed_segments, 1);

    // Window (a): the merged copy is written, the install has not begun.
    let (merged, go_merged) = gate("checkpoint::after_merge");
    // Window (b): the journal was reconciled outside the lock, the lock not yet taken.
    let (locking, go_locking) = gate("checkpoint::before_install_lock");
    let flush = {
        let c = c.clone();
        rt.spawn(async move { c.flush().await })
    };
    merged.recv_timeout(WAIT).unwrap();
    let ids_a: Vec<u128> = (0..2 * HALF).step_by(2).collect();
    rt.block_on(race_writes(&c, &mut model, &mut rng, &ids_a, 1));
    drop(go_merged);
    locking.recv_timeout(WAIT).unwrap();
    let ids_b: Vec<u128> = (0..2 * HALF).skip(1).step_by(2).collect();
    rt.block_on(race_writes(&c, &mut model, &mut rng, &ids_b, 2));
    // Some of window (a)'s documents again, now in the mutable segment.
    rt.block_on(race_writes(&c, &mut model, &mut rng, &ids_a[..20], 3));
    drop(go_locking);
    rt.block_on(flush).unwrap().unwrap();
    fail::remove("checkpoint::after_merge");
    fail::remove("checkpoint::before_install_lock");
    assert_eq!(
        c.stats().n_sealed_segments,
        1,
        "the second checkpoint merged"
    );
    assert_matches(&c, &model, "after the racing install");

    // The removals carried over are in the WAL after the checkpoint; the next checkpoint writes
    // them into the merged segment's tombstone file. Both must reopen to the model.
    c.close();
    drop(c);
    let c = Collection::open(&path).unwrap();
    assert_matches(&c, &model, "reopened (carried-over removals replayed)");
    rt.block_on(c.flush()).unwrap();
    c.close();
    drop(c);
    let c = Collection::open(&path).unwrap();
    assert_matches(&c, &model, "reopened after a further checkpoint");
    c.close();
    scenario.teardown();
}
