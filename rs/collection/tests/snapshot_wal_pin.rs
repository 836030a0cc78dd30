//! A snapshot keeps the WAL after its checkpoint while later checkpoints truncate the log.
//! A collection's WAL segments are 64 MiB, so truncation deletes nothing in a small test; the
//! fail point `collection::wal_segment_bytes` makes them 4 KiB. Its own test binary because
//! fail points are process-global. Run with `--features failpoints`.
#![cfg(feature = "failpoints")]
#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::collections::HashMap;
use std::io::Read;
use std::path::Path;

use tarn_collection::{verify_snapshot, Collection, CollectionConfig, MetricName, SnapshotRestore};

const DIM: usize = 8;

/// First sequence numbers of the WAL's segment files, in order.
fn wal_segments(collection_dir: &Path) -> Vec<u64> {
    let mut firsts: Vec<u64> = std::fs::read_dir(collection_dir.join("wal"))
        .unwrap()
        .filter_map(|e| {
            let name = e.unwrap().file_name().to_string_lossy().into_owned();
            name.strip_suffix(".wal").and_then(|n| n.parse().ok())
        })
        .collect();
    firsts.sort_unstable();
    firsts
}

/// Operation `k`: insert documents 4k..4k+4 of tenant 0, or (every fifth) remove those of
/// operation k - 3.
async fn write(c: &Collection, k: u64, log: &mut Vec<(u64, u64)>) {
    let seq = if k % 5 == 4 {
        let docs: Vec<u128> = (0..4).map(|i| u128::from((k - 3) * 4 + i)).collect();
        c.remove(&docs, &[], None).await.unwrap()
    } else {
        let docs: Vec<u128> = (0..4).map(|i| u128::from(k * 4 + i)).collect();
        let vectors: Vec<f32> = (0..4 * DIM).map(|i| (k as f32) + i as f32).collect();
        c.insert(&docs, &[], &vectors, None).await.unwrap()
    };
    log.push((seq, k));
}

/// Thirty more operations (numbered from `*k`), then a checkpoint.
async fn write_30_and_flush(c: &Collection, k: &mut u64, log: &mut Vec<(u64, u64)>) {
    for _ in 0..30 {
        write(c, *k, log).await;
        *k += 1;
    }
    c.flush().await.unwrap();
}

/// The documents after the logged operations up to `seq_no`.
fn model(log: &[(u64, u64)], seq_no: u64) -> HashMap<u128, Vec<f32>> {
    let mut docs = HashMap::new();
    for &(_, k) in log.iter().filter(|(seq, _)| *seq <= seq_no) {
        for i in 0..4 {
            if k % 5 == 4 {
                docs.remove(&u128::from((k - 3) * 4 + i));
            } else {
                let vector = (0..DIM)
                    .map(|d| (k as f32) + (i as usize * DIM + d) as f32)
                    .collect();
                docs.insert(u128::from(k * 4 + i), vector);
            }
        }
    }
    docs
}

/// 4 KiB WAL segments (the fail point), a temp dir with the source's path, and a runtime.
fn small_segments() -> (
    tempfile::TempDir,
    std::path::PathBuf,
    tokio::runtime::Runtime,
) {
    fail::cfg("collection::wal_segment_bytes", "return(4096)").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("source");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    (dir, path, rt)
}

#[test]
fn a_snapshot_keeps_the_wal_after_its_checkpoint_while_later_checkpoints_truncate_it() {
    let (dir, path, rt) = small_segments();
    let mut config = CollectionConfig::new(DIM, MetricName::L2);
    config.graph_threshold = 100;
    let c = Collection::create(&path, config).unwrap();
    let mut log = Vec::new();
    let mut k = 0;
    rt.block_on(async {
        for _ in 0..30 {
            write(&c, k, &mut log).await;
            k += 1;
        }
        c.flush().await.unwrap();
        for _ in 0..30 {
            write(&c, k, &mut log).await;
            k += 1;
        }
    });
    let mut snapshot = c.snapshot().unwrap();
    let (seq_no, checkpoint_seq) = (snapshot.seq_no(), snapshot.checkpoint_seq());
    assert!(checkpoint_seq > 0 && seq_no > checkpoint_seq);
    assert!(
        wal_segments(&path).len() >= 3,
        "small segments: {:?}",
        wal_segments(&path)
    );

    // Four more checkpoints: each truncates before its predecessor's checkpoint, far past the
    // snapshot's, but for the pin.
    for _ in 0..4 {
        rt.block_on(write_30_and_flush(&c, &mut k, &mut log));
        let first = wal_segments(&path)[0];
        assert!(
            first <= checkpoint_seq + 1,
            "the WAL now starts at {first}, after the snapshot's {}",
            checkpoint_seq + 1
        );
    }
    let mut bytes = Vec::new();
    snapshot.read_to_end(&mut bytes).unwrap();
    let info = verify_snapshot(&bytes[..]).unwrap();
    assert_eq!(info.n_wal_entries, seq_no - checkpoint_seq);

    // Released, the next checkpoint truncates past it.
    drop(snapshot);
    rt.block_on(write_30_and_flush(&c, &mut k, &mut log));
    let first = wal_segments(&path)[0];
    assert!(
        first > checkpoint_seq + 1,
        "truncated once the snapshot is gone (starts at {first})"
    );

    let target = dir.path().join("restored");
    let mut restore = SnapshotRestore::begin(&target).unwrap();
    for chunk in bytes.chunks(1000) {
        restore.write(chunk).unwrap();
    }
    restore.finish().unwrap();
    let r = Collection::open(&target).unwrap();
    let expected = model(&log, seq_no);
    let stats = r.stats();
    assert_eq!(stats.last_appended_seq, seq_no);
    assert_eq!(stats.n_documents, expected.len() as u64);
    for doc in 0..k * 4 {
        let doc = u128::from(doc);
        match expected.get(&doc) {
            Some(vector) => assert_eq!(r.get(0, &[doc]).unwrap(), vec![(doc, vector.clone())]),
            None => assert!(r.get(0, &[doc]).unwrap().is_empty(), "doc {doc}"),
        }
    }
    fail::remove("collection::wal_segment_bytes");
}

/// A shard move's copy: a snapshot, then the WAL entries after it read by a `WalTail` while
/// checkpoints truncate the source's log, appended to the restored copy at the same sequence
/// numbers. The copy ends as the same log: every document and the same last sequence number.
#[test]
fn a_wal_tail_copies_the_entries_after_a_snapshot_at_the_same_sequence_numbers() {
    let (dir, path, rt) = small_segments();
    let c = Collection::create(&path, CollectionConfig::new(DIM, MetricName::L2)).unwrap();
    let mut log = Vec::new();
    let mut k = 0;
    rt.block_on(write_30_and_flush(&c, &mut k, &mut log));
    rt.block_on(async {
        for _ in 0..7 {
            write(&c, k, &mut log).await;
            k += 1;
        }
    });
    let mut snapshot = c.snapshot().unwrap();
    let mut bytes = Vec::new();
    snapshot.read_to_end(&mut bytes).unwrap();
    let mut tail = c.wal_tail(snapshot);
    let mut copied = Vec::new();
    for _ in 0..4 {
        rt.block_on(write_30_and_flush(&c, &mut k, &mut log));
        // Small reads: a batch stops near its byte budget and the next one continues.
        loop {
            let batch = tail.read(u64::MAX, 200).unwrap();
            if batch.is_empty() {
                break;
            }
            copied.extend(batch);
        }
    }
    let last = c.last_seq_no();
    assert_eq!(tail.next_seq(), last + 1);
    assert_eq!(copied.first().unwrap().0, log[36].0 + 1);

    let target = dir.path().join("copy");
    let mut restore = SnapshotRestore::begin(&target).unwrap();
    restore.write(&bytes).unwrap();
    restore.finish().unwrap();
    let copy = Collection::open(&target).unwrap();
    rt.block_on(async {
        // A gap, and an entry that is not an operation, are refused with nothing appended.
        let before = copy.last_seq_no();
        let gap = vec![copied[1].clone()];
        let error = copy
            .append_copied(gap, tarn_collection::Durability::Fsync)
            .await
            .unwrap_err();
        assert!(error.to_string().contains("does not continue"), "{error}");
        let garbage = vec![(copied[0].0, std::sync::Arc::from(&b"garbage"[..]))];
        assert!(copy
            .append_copied(garbage, tarn_collection::Durability::Fsync)
            .await
            .is_err());
        assert_eq!(copy.last_seq_no(), before);

        for batch in copied.chunks(25) {
            copy.append_copied(batch.to_vec(), tarn_collection::Durability::Written)
                .await
                .unwrap();
        }
        assert_eq!(copy.sync_wal().await.unwrap(), last);
        copy.wait_applied(last, std::time::Duration::from_secs(10))
            .await
            .unwrap();
    });
    let expected = model(&log, last);
    assert_eq!(copy.stats().n_documents, expected.len() as u64);
    for doc in 0..k * 4 {
        let doc = u128::from(doc);
        assert_eq!(
            copy.get(0, &[doc]).unwrap(),
            c.get(0, &[doc]).unwrap(),
            "doc {doc} differs between the source and the copy"
        );
        assert_eq!(
            copy.get(0, &[doc]).unwrap().is_empty(),
            !expected.contains_key(&doc)
        );
    }
    // Reopened, the copy is the same log.
    drop(copy);
    let copy = Collection::open(&target).unwrap();
    assert_eq!(copy.last_seq_no(), last);
    // The fail point stays: the other test of this binary may still rely on it.
}
