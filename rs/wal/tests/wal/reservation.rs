//! A log's first segment reserves `initial_segment_bytes` of disk and each later one twice its
//! predecessor, up to `segment_bytes`: an empty log takes little disk, a busy one reaches full
//! segments, and nothing about recovery changes.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use tarn_wal::WalConfig;

use crate::{append_all, open, payload, replay_all};

fn segment_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "wal"))
        .collect();
    files.sort();
    files
}

/// (length, bytes allocated on disk) of a file.
fn sizes(path: &Path) -> (u64, u64) {
    let meta = std::fs::metadata(path).unwrap();
    (meta.len(), meta.blocks() * 512)
}

fn growing_config() -> WalConfig {
    WalConfig {
        segment_bytes: 64 << 10,
        initial_segment_bytes: 4 << 10,
        ..WalConfig::default()
    }
}

#[test]
fn a_new_log_reserves_the_initial_size_not_a_full_segment() {
    let dir = tempfile::tempdir().unwrap();
    let (wal, _) = open(dir.path(), WalConfig::default());
    let files = segment_files(dir.path());
    assert_eq!(files.len(), 1);
    let (len, allocated) = sizes(&files[0]);
    assert_eq!(len, WalConfig::default().initial_segment_bytes);
    // Allocated blocks may round up to the file system's allocation unit.
    assert!(allocated <= len + (64 << 10), "{allocated} bytes allocated");
    assert!(len < WalConfig::default().segment_bytes / 16);
    drop(wal);
}

#[test]
fn each_segment_reserves_twice_the_one_before_up_to_a_full_segment_and_every_entry_comes_back() {
    let dir = tempfile::tempdir().unwrap();
    let config = growing_config();
    let (wal, _) = open(dir.path(), config.clone());
    let payloads: Vec<_> = (1..=300).map(|t| payload(t, 700)).collect();
    let seqs = append_all(&wal, &payloads[..40]);
    assert_eq!(seqs, (1..=40).collect::<Vec<_>>());
    // 40 entries of 716 bytes (5 fit in 4 KiB, 11 in 8, 22 in 16): segments of 4, 8, 16 and
    // 32 KiB.
    let lengths =
        |dir: &Path| -> Vec<u64> { segment_files(dir).iter().map(|f| sizes(f).0).collect() };
    assert_eq!(
        lengths(dir.path()),
        vec![4 << 10, 8 << 10, 16 << 10, 32 << 10]
    );
    drop(wal);
    // Reopen inside the 32 KiB segment; the next ones go on doubling from it, then stay at
    // the full 64 KiB.
    let (wal, report) = open(dir.path(), config.clone());
    assert_eq!(report.last_seq, 40);
    append_all(&wal, &payloads[40..]);
    let lengths = lengths(dir.path());
    assert!(lengths.len() >= 6, "{lengths:?}");
    assert_eq!(
        lengths[..5],
        [4 << 10, 8 << 10, 16 << 10, 32 << 10, 64 << 10]
    );
    assert!(
        lengths[5..].iter().all(|&l| l == config.segment_bytes),
        "{lengths:?}"
    );
    let replayed = replay_all(&wal, 1);
    assert_eq!(replayed.len(), 300);
    for (seq, bytes) in &replayed {
        assert_eq!(bytes, &payloads[*seq as usize - 1].to_vec());
    }
    drop(wal);
    let (wal, report) = open(dir.path(), config);
    assert_eq!(report.last_seq, 300);
    assert!(report.torn_tail.is_none());
    assert_eq!(replay_all(&wal, 1).len(), 300);
}

#[test]
fn entries_larger_than_the_reservation_or_a_segment_fit() {
    let dir = tempfile::tempdir().unwrap();
    let config = growing_config();
    let (wal, _) = open(dir.path(), config.clone());
    // Larger than the 4 KiB reservation; then larger than a 64 KiB segment.
    let payloads = vec![payload(1, 10_000), payload(2, 100_000), payload(3, 300)];
    assert_eq!(append_all(&wal, &payloads), vec![1, 2, 3]);
    drop(wal);
    let (wal, report) = open(dir.path(), config);
    assert_eq!(report.last_seq, 3);
    let replayed = replay_all(&wal, 1);
    assert_eq!(
        replayed.into_iter().map(|(_, b)| b).collect::<Vec<_>>(),
        payloads.iter().map(|p| p.to_vec()).collect::<Vec<_>>()
    );
}
