//! A process killed between any two steps of a checkpoint reopens consistent: the child (this
//! binary running the ignored test `child_checkpoint`) writes, checkpoints once, writes more,
//! then aborts at a fail point inside the second checkpoint. Run with `--features failpoints`.
#![cfg(feature = "failpoints")]
#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::path::Path;
use std::process::Command;

use tarn_collection::{Collection, CollectionConfig, MetricName, SearchRequest};
use tarn_testkit::clustered_vectors;

const DIM: usize = 8;
const CHILD_DIR: &str = "TARN_CHECKPOINT_CRASH_DIR";
const CHILD_FAIL_POINT: &str = "TARN_CHECKPOINT_CRASH_FAIL_POINT";
const FAR: [f32; DIM] = [9.0; DIM];

fn config() -> CollectionConfig {
    let mut config = CollectionConfig::new(DIM, MetricName::L2);
    config.graph_threshold = 100;
    // Two sealed segments after the second checkpoint: it merges them, so a crash can land in
    // the merge too.
    config.max_sealed_segments = 1;
    config
}

fn base() -> Vec<f32> {
    clustered_vectors(600, DIM, 6, 11)
}

#[test]
#[ignore = "run only as the child of kill_between_checkpoint_steps"]
fn child_checkpoint() {
    let (Ok(dir), Ok(fail_point)) = (std::env::var(CHILD_DIR), std::env::var(CHILD_FAIL_POINT))
    else {
        return;
    };
    let base = base();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let c = Collection::create(Path::new(&dir), config()).unwrap();
    rt.block_on(async {
        let ids: Vec<u128> = (0..300).collect();
        c.insert(&ids, &[0], &base[..300 * DIM], None)
            .await
            .unwrap();
        c.flush().await.unwrap();
        let ids: Vec<u128> = (300..600).collect();
        c.insert(&ids, &[1], &base[300 * DIM..], None)
            .await
            .unwrap();
        let removed: Vec<u128> = (0..50).step_by(5).collect();
        c.remove(&removed, &[0], None).await.unwrap();
        c.insert(&[1], &[0], &FAR, None).await.unwrap();
        fail::cfg(&fail_point, "return").unwrap();
        let _ = c.flush().await;
    });
    // Reaching this line means the fail point was never hit.
    std::process::exit(3);
}

fn check(c: &Collection, base: &[f32], when: &str) {
    let stats = c.stats();
    assert_eq!(stats.n_documents, 590, "{when}: {stats:?}");
    assert_eq!(c.documents_per_tenant()[&0], 290, "{when}");
    for doc in (0..50).step_by(5) {
        assert!(
            c.get(0, &[doc]).unwrap().is_empty(),
            "{when}: removed doc {doc} is back"
        );
    }
    assert_eq!(
        c.get(0, &[1]).unwrap()[0].1,
        FAR.to_vec(),
        "{when}: upsert lost"
    );
    for i in (300..600).step_by(29) {
        let request = SearchRequest {
            user_ids: vec![1],
            vector: base[i * DIM..(i + 1) * DIM].to_vec(),
            top_k: 1,
            exact: true,
            ..SearchRequest::default()
        };
        assert_eq!(
            c.search(&request).unwrap()[0].doc_id,
            i as u128,
            "{when}: doc {i}"
        );
    }
}

#[test]
fn kill_between_checkpoint_steps() {
    let base = base();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    for fail_point in [
        "checkpoint::after_seal",
        "checkpoint::after_merge",
        "checkpoint::after_tombstones",
        "checkpoint::after_manifest",
        "checkpoint::after_truncate",
    ] {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c");
        let status = Command::new(std::env::current_exe().unwrap())
            .args([
                "child_checkpoint",
                "--exact",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_DIR, &path)
            .env(CHILD_FAIL_POINT, fail_point)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .unwrap();
        assert!(
            !status.success() && status.code() != Some(3),
            "{fail_point}: child did not die there ({status:?})"
        );
        let c = Collection::open(&path).unwrap();
        check(
            &c,
            &base,
            &format!("reopened after a crash at {fail_point}"),
        );
        rt.block_on(c.flush()).unwrap();
        check(
            &c,
            &base,
            &format!("checkpointed after a crash at {fail_point}"),
        );
        drop(c);
        let c = Collection::open(&path).unwrap();
        check(
            &c,
            &base,
            &format!("reopened twice after a crash at {fail_point}"),
        );
    }
}
