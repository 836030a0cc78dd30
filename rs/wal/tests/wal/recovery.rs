//! Damage that is not a torn tail, salvage, and what open does with strangers in the directory.

use std::fs;
use std::path::{Path, PathBuf};

use tarn_wal::layout::{segment_file_name, ENTRY_HEADER_BYTES, SEGMENT_HEADER_BYTES};
use tarn_wal::{RecoveryMode, Wal, WalConfig, WalError};

use crate::{append_all, open, payload, replay_all};

const PAYLOAD_BYTES: usize = 100;
const ENTRY_BYTES: u64 = (ENTRY_HEADER_BYTES + PAYLOAD_BYTES) as u64;

fn config(mode: RecoveryMode) -> WalConfig {
    WalConfig {
        segment_bytes: SEGMENT_HEADER_BYTES + 10 * ENTRY_BYTES,
        recovery_mode: mode,
        ..WalConfig::default()
    }
}

/// 25 entries: segments starting at 1, 11 and 21.
fn write_log(dir: &Path) {
    let (wal, _) = open(dir, config(RecoveryMode::Strict));
    let payloads: Vec<_> = (1..=25).map(|tag| payload(tag, PAYLOAD_BYTES)).collect();
    append_all(&wal, &payloads);
}

fn segment(dir: &Path, first_seq: u64) -> PathBuf {
    dir.join(segment_file_name(first_seq))
}

fn flip_byte_of_entry(path: &Path, entry_idx_in_segment: u64) {
    let mut bytes = fs::read(path).unwrap();
    let offset = SEGMENT_HEADER_BYTES + entry_idx_in_segment * ENTRY_BYTES + 40;
    bytes[offset as usize] ^= 0x10;
    fs::write(path, bytes).unwrap();
}

fn check_prefix(wal: &Wal, n: u64) {
    let entries = replay_all(wal, 1);
    assert_eq!(entries.len() as u64, n);
    for (seq, bytes) in entries {
        assert_eq!(bytes, payload(seq, PAYLOAD_BYTES).to_vec());
    }
}

#[test]
fn damage_followed_by_valid_entries_is_refused_then_salvaged() {
    let dir = tempfile::tempdir().unwrap();
    write_log(dir.path());
    let last = segment(dir.path(), 21);
    flip_byte_of_entry(&last, 1); // entry 22 of 21..=25
    match Wal::open(dir.path(), config(RecoveryMode::Strict)) {
        Err(WalError::Corrupt {
            path,
            offset,
            reason,
        }) => {
            assert_eq!(path, last);
            assert_eq!(offset, SEGMENT_HEADER_BYTES + ENTRY_BYTES);
            assert!(reason.contains("valid entry"), "{reason}");
        }
        other => panic!("expected Corrupt, got {other:?}"),
    }
    let (wal, report) = open(dir.path(), config(RecoveryMode::SalvagePrefix));
    let salvage = report.salvage.expect("salvage report");
    assert_eq!(salvage.path, last);
    assert!(salvage.quarantined.is_empty());
    check_prefix(&wal, 21);
    assert_eq!(append_all(&wal, &[payload(22, PAYLOAD_BYTES)]), vec![22]);
    drop(wal);
    let (wal, report) = open(dir.path(), config(RecoveryMode::Strict));
    assert_eq!((report.torn_tail, report.salvage), (None, None));
    check_prefix(&wal, 22);
}

#[test]
fn damage_in_a_sealed_segment_is_refused_then_salvaged_with_later_segments_set_aside() {
    let dir = tempfile::tempdir().unwrap();
    write_log(dir.path());
    let sealed = segment(dir.path(), 11);
    flip_byte_of_entry(&sealed, 9); // entry 20, the last of the sealed segment
    match Wal::open(dir.path(), config(RecoveryMode::Strict)) {
        Err(WalError::Corrupt { path, reason, .. }) => {
            assert_eq!(path, sealed);
            assert!(reason.contains("sealed"), "{reason}");
        }
        other => panic!("expected Corrupt, got {other:?}"),
    }
    let (wal, report) = open(dir.path(), config(RecoveryMode::SalvagePrefix));
    let salvage = report.salvage.expect("salvage report");
    assert_eq!(salvage.quarantined.len(), 1);
    assert!(salvage.quarantined[0].exists());
    check_prefix(&wal, 19);
    assert_eq!(append_all(&wal, &[payload(20, PAYLOAD_BYTES)]), vec![20]);
    drop(wal);
    let (wal, report) = open(dir.path(), config(RecoveryMode::Strict));
    assert_eq!(
        report.ignored_files.len(),
        1,
        "the quarantined segment is left alone"
    );
    check_prefix(&wal, 20);
}

#[test]
fn a_missing_segment_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    write_log(dir.path());
    fs::remove_file(segment(dir.path(), 11)).unwrap();
    match Wal::open(dir.path(), config(RecoveryMode::Strict)) {
        Err(WalError::Corrupt { reason, .. }) => assert!(reason.contains("missing"), "{reason}"),
        other => panic!("expected Corrupt, got {other:?}"),
    }
    let (wal, _) = open(dir.path(), config(RecoveryMode::SalvagePrefix));
    check_prefix(&wal, 10);
}

#[test]
fn a_damaged_segment_header_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    write_log(dir.path());
    let last = segment(dir.path(), 21);
    let mut bytes = fs::read(&last).unwrap();
    bytes[17] ^= 1;
    fs::write(&last, bytes).unwrap();
    assert!(matches!(
        Wal::open(dir.path(), config(RecoveryMode::Strict)),
        Err(WalError::Corrupt { offset: 0, .. })
    ));
    let (wal, report) = open(dir.path(), config(RecoveryMode::SalvagePrefix));
    assert_eq!(report.salvage.unwrap().quarantined.len(), 1);
    check_prefix(&wal, 20);
    assert_eq!(append_all(&wal, &[payload(21, PAYLOAD_BYTES)]), vec![21]);
}

#[test]
fn strangers_in_the_directory_never_stop_the_open() {
    let dir = tempfile::tempdir().unwrap();
    write_log(dir.path());
    fs::write(
        dir.path().join("00000000000000000026.wal.tmp"),
        b"half-made segment",
    )
    .unwrap();
    fs::write(dir.path().join("notes.txt"), b"left by an operator").unwrap();
    fs::write(dir.path().join("26.wal"), b"not our name format").unwrap();
    fs::create_dir(dir.path().join("subdir")).unwrap();
    let (wal, report) = open(dir.path(), config(RecoveryMode::Strict));
    assert_eq!(report.removed_temp_files.len(), 1);
    assert!(!dir.path().join("00000000000000000026.wal.tmp").exists());
    assert_eq!(report.ignored_files.len(), 3);
    check_prefix(&wal, 25);
}

#[test]
fn truncation_deletes_only_whole_older_segments() {
    let dir = tempfile::tempdir().unwrap();
    write_log(dir.path());
    let (wal, _) = open(dir.path(), config(RecoveryMode::Strict));
    assert_eq!(wal.truncate_before(15).wait().unwrap(), 11);
    assert!(!segment(dir.path(), 1).exists());
    assert!(segment(dir.path(), 11).exists());
    assert!(matches!(
        wal.replay(5),
        Err(WalError::Truncated {
            requested: 5,
            first_available: 11
        })
    ));
    assert_eq!(replay_all(&wal, 15).first().map(|e| e.0), Some(15));
    // Far beyond the end: every sealed segment goes, the active one stays.
    assert_eq!(wal.truncate_before(1000).wait().unwrap(), 21);
    drop(wal);
    let (wal, report) = open(dir.path(), config(RecoveryMode::Strict));
    assert_eq!(
        (report.first_seq, report.last_seq, report.n_segments),
        (21, 25, 1)
    );
    assert_eq!(replay_all(&wal, 21).len(), 5);
}
