//! Logs that start at a given sequence number (`Wal::create_at`) and bounded replays
//! (`Wal::replay_range`): what a restored collection's log is built from and read with.

use std::sync::Arc;

use tarn_wal::{Durability, Wal, WalConfig, WalError};

use crate::{append_all, open, payload, replay_all, small_config};

#[test]
fn a_log_created_at_a_sequence_number_continues_from_it_across_reopens() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("wal");
    let wal = Wal::create_at(&path, small_config(), 1_000).unwrap();
    assert_eq!(wal.last_appended_seq(), 999);
    assert_eq!(wal.first_seq(), 1_000);
    // Enough entries to roll over several 4 KiB segments.
    let payloads: Vec<_> = (1_000..1_100).map(|tag| payload(tag, 200)).collect();
    assert_eq!(
        append_all(&wal, &payloads),
        (1_000..1_100).collect::<Vec<_>>()
    );
    wal.close().unwrap();
    drop(wal);

    let (wal, report) = open(&path, small_config());
    assert_eq!((report.first_seq, report.last_seq), (1_000, 1_099));
    assert!(report.n_segments > 1, "{report:?}");
    let entries = replay_all(&wal, 1_000);
    assert_eq!(entries.len(), 100);
    for (seq, bytes) in &entries {
        assert_eq!(bytes[..], payload(*seq, 200)[..]);
    }
    let next = wal
        .append(payload(1_100, 10), Durability::Fsync)
        .wait()
        .unwrap();
    assert_eq!(next, 1_100);
}

#[test]
fn an_empty_log_created_at_a_sequence_number_keeps_it_when_reopened() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("wal");
    let wal = Wal::create_at(&path, small_config(), 42).unwrap();
    wal.close().unwrap();
    drop(wal);
    let (wal, report) = open(&path, small_config());
    assert_eq!((report.first_seq, report.last_seq), (42, 41));
    assert_eq!(wal.last_appended_seq(), 41);
    assert!(replay_all(&wal, 42).is_empty());
    let seq = wal
        .append(Arc::from(&b"x"[..]), Durability::Fsync)
        .wait()
        .unwrap();
    assert_eq!(seq, 42);
}

#[test]
fn create_at_refuses_a_directory_with_files_and_sequence_number_zero() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("wal");
    {
        let (wal, _) = open(&path, small_config());
        append_all(&wal, &[payload(1, 10)]);
    }
    match Wal::create_at(&path, small_config(), 5) {
        Err(WalError::NotEmpty { path: reported }) => assert_eq!(reported, path),
        other => panic!("expected NotEmpty, got {other:?}"),
    }
    // The existing log is untouched.
    let (wal, _) = open(&path, small_config());
    assert_eq!(replay_all(&wal, 1).len(), 1);

    let stranger = dir.path().join("other");
    std::fs::create_dir(&stranger).unwrap();
    std::fs::write(stranger.join("notes.txt"), b"hello").unwrap();
    assert!(matches!(
        Wal::create_at(&stranger, small_config(), 5),
        Err(WalError::NotEmpty { .. })
    ));
    assert!(matches!(
        Wal::create_at(dir.path().join("zero"), small_config(), 0),
        Err(WalError::InvalidConfig(_))
    ));
    assert!(!dir.path().join("zero").exists());
}

#[test]
fn replay_range_stops_at_its_last_sequence_number_and_refuses_one_not_appended() {
    let dir = tempfile::tempdir().unwrap();
    let (wal, _) = open(dir.path(), small_config());
    let payloads: Vec<_> = (1..=60).map(|tag| payload(tag, 150)).collect();
    append_all(&wal, &payloads);
    let range: Vec<(u64, Vec<u8>)> = wal
        .replay_range(10, 33)
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(
        range.iter().map(|(seq, _)| *seq).collect::<Vec<_>>(),
        (10..=33).collect::<Vec<_>>()
    );
    for (seq, bytes) in &range {
        assert_eq!(bytes[..], payload(*seq, 150)[..]);
    }
    // An empty range, and one that ends at the last entry.
    assert_eq!(wal.replay_range(34, 33).unwrap().count(), 0);
    assert_eq!(wal.replay_range(55, 60).unwrap().count(), 6);
    match wal.replay_range(1, 61) {
        Err(WalError::BeyondEnd {
            requested,
            last_appended,
        }) => assert_eq!((requested, last_appended), (61, 60)),
        other => panic!("expected BeyondEnd, got {other:?}"),
    }
    // Truncated entries are reported as such.
    wal.truncate_before(40).wait().unwrap();
    assert!(matches!(
        wal.replay_range(1, 50),
        Err(WalError::Truncated { .. })
    ));
}

/// Follows the log the way a shard move's tail does: short replays, each resuming where the
/// last one stopped. Returns every entry read.
fn follow(wal: &Wal, mut next: u64, step: u64) -> Vec<(u64, Vec<u8>)> {
    let mut at = None;
    let mut out = Vec::new();
    while next <= wal.last_appended_seq() {
        let last = (next + step - 1).min(wal.last_appended_seq());
        let mut replay = wal.replay_resuming(next, last, at).unwrap();
        for entry in replay.by_ref() {
            out.push(entry.unwrap());
        }
        at = replay.position();
        next = last + 1;
        if let Some(at) = at {
            assert_eq!(at.seq(), next, "a position names the next entry");
        }
    }
    out
}

#[test]
fn a_replay_resumed_where_another_stopped_reads_each_entry_once_across_segments_and_chunks() {
    let dir = tempfile::tempdir().unwrap();
    // Small segments: the follower crosses many rollovers.
    let (wal, _) = open(&dir.path().join("small"), small_config());
    let payloads: Vec<_> = (1..=120).map(|tag| payload(tag, 150)).collect();
    append_all(&wal, &payloads);
    for step in [1, 3, 7, 50] {
        let read = follow(&wal, 5, step);
        assert_eq!(
            read.iter().map(|(seq, _)| *seq).collect::<Vec<_>>(),
            (5..=120).collect::<Vec<_>>(),
            "step {step}"
        );
        for (seq, bytes) in &read {
            assert_eq!(bytes[..], payload(*seq, 150)[..], "step {step}");
        }
    }
    // A position is used only by a replay that starts at its entry: any other start reads
    // from the segment's beginning and gets the right entries.
    let mut replay = wal.replay_range(10, 20).unwrap();
    replay.by_ref().for_each(|e| drop(e.unwrap()));
    let at = replay.position();
    assert_eq!(at.map(|a| a.seq()), Some(21));
    let other: Vec<_> = wal
        .replay_resuming(15, 30, at)
        .unwrap()
        .map(|e| e.unwrap().0)
        .collect();
    assert_eq!(other, (15..=30).collect::<Vec<_>>());

    // Large segments and entries: reads cross the 1 MiB read chunks, and one entry is larger
    // than a chunk.
    let (wal, _) = open(&dir.path().join("large"), WalConfig::default());
    let sizes: Vec<usize> = (1..=40u64)
        .map(|tag| {
            if tag == 17 {
                3 << 20
            } else {
                100_000 + tag as usize * 3
            }
        })
        .collect();
    let payloads: Vec<_> = (1..=40u64)
        .map(|tag| payload(tag, sizes[tag as usize - 1]))
        .collect();
    append_all(&wal, &payloads);
    for step in [1, 4, 40] {
        let read = follow(&wal, 1, step);
        assert_eq!(read.len(), 40, "step {step}");
        for (seq, bytes) in &read {
            assert_eq!(bytes[..], payloads[*seq as usize - 1][..], "step {step}");
        }
    }
}
