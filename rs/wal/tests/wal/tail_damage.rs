//! Torn and corrupt tails of the last segment: exactly the intact prefix comes back, and entries
//! appended after recovery survive another reopen.

use std::fs::{self, OpenOptions};
use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use rand::{Rng, SeedableRng};
use tarn_wal::layout::{ENTRY_HEADER_BYTES, SEGMENT_HEADER_BYTES};
use tarn_wal::WalConfig;

use crate::{append_all, open, payload, replay_all};

const N_ENTRIES: u64 = 20;
const PAYLOAD_BYTES: usize = 100;
const ENTRY_BYTES: u64 = (ENTRY_HEADER_BYTES + PAYLOAD_BYTES) as u64;

fn config() -> WalConfig {
    // Seven entries per segment: 20 entries make three segments, the last holding six.
    WalConfig {
        segment_bytes: SEGMENT_HEADER_BYTES + 7 * ENTRY_BYTES,
        ..WalConfig::default()
    }
}

/// The last segment file and the offset of the last entry in it.
fn last_entry(dir: &Path) -> (PathBuf, u64) {
    let mut segments: Vec<PathBuf> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "wal"))
        .collect();
    segments.sort();
    let last = segments.pop().unwrap();
    let first_seq: u64 = last.file_stem().unwrap().to_str().unwrap().parse().unwrap();
    let entries_in_last = N_ENTRIES - first_seq + 1;
    (
        last,
        SEGMENT_HEADER_BYTES + (entries_in_last - 1) * ENTRY_BYTES,
    )
}

fn write_log(dir: &Path) -> (PathBuf, u64) {
    let (wal, _) = open(dir, config());
    let payloads: Vec<_> = (1..=N_ENTRIES)
        .map(|tag| payload(tag, PAYLOAD_BYTES))
        .collect();
    append_all(&wal, &payloads);
    drop(wal);
    last_entry(dir)
}

/// Reopens a damaged log: `expect_entries` must come back, then two appends must survive a
/// second reopen right after them.
fn check_recovers_prefix(dir: &Path, expect_entries: u64, expect_repair: bool) {
    let (wal, report) = open(dir, config());
    assert_eq!(report.torn_tail.is_some(), expect_repair, "{report:?}");
    if let Some(repair) = &report.torn_tail {
        assert!(
            repair.bytes_dropped >= 1 && repair.entries_dropped >= 1,
            "{repair:?}"
        );
    }
    assert_eq!(report.last_seq, expect_entries);
    let entries = replay_all(&wal, 1);
    let expected: Vec<(u64, Vec<u8>)> = (1..=expect_entries)
        .map(|tag| (tag, payload(tag, PAYLOAD_BYTES).to_vec()))
        .collect();
    assert_eq!(entries, expected);
    let new_payloads = [payload(1000, 50), payload(1001, 300)];
    assert_eq!(
        append_all(&wal, &new_payloads),
        vec![expect_entries + 1, expect_entries + 2]
    );
    drop(wal);

    let (wal, report) = open(dir, config());
    assert_eq!(
        report.torn_tail, None,
        "appends after recovery must not land after garbage"
    );
    let entries = replay_all(&wal, 1);
    assert_eq!(entries.len() as u64, expect_entries + 2);
    assert_eq!(entries[expect_entries as usize].1, new_payloads[0].to_vec());
    assert_eq!(
        entries[expect_entries as usize + 1].1,
        new_payloads[1].to_vec()
    );
}

#[test]
fn truncation_at_every_byte_of_the_last_entry() {
    for cut in 0..=ENTRY_BYTES {
        let dir = tempfile::tempdir().unwrap();
        let (path, entry_offset) = write_log(dir.path());
        let file = OpenOptions::new().write(true).open(&path).unwrap();
        file.set_len(entry_offset + cut).unwrap();
        drop(file);
        let intact = cut == ENTRY_BYTES;
        let expect_entries = if intact { N_ENTRIES } else { N_ENTRIES - 1 };
        check_recovers_prefix(dir.path(), expect_entries, cut > 0 && !intact);
    }
}

#[test]
fn a_flipped_bit_in_any_byte_of_the_last_entry() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    for byte in 0..ENTRY_BYTES {
        let dir = tempfile::tempdir().unwrap();
        let (path, entry_offset) = write_log(dir.path());
        let mut bytes = fs::read(&path).unwrap();
        bytes[(entry_offset + byte) as usize] ^= 1 << rng.random_range(0..8);
        fs::write(&path, &bytes).unwrap();
        check_recovers_prefix(dir.path(), N_ENTRIES - 1, true);
    }
}

#[test]
fn a_zeroed_last_entry_is_a_clean_end_and_a_zeroed_header_is_a_torn_tail() {
    let dir = tempfile::tempdir().unwrap();
    let (path, entry_offset) = write_log(dir.path());
    overwrite(&path, entry_offset, &vec![0u8; ENTRY_BYTES as usize]);
    check_recovers_prefix(dir.path(), N_ENTRIES - 1, false);

    let dir = tempfile::tempdir().unwrap();
    let (path, entry_offset) = write_log(dir.path());
    overwrite(&path, entry_offset, &[0u8; ENTRY_HEADER_BYTES]);
    check_recovers_prefix(dir.path(), N_ENTRIES - 1, true);
}

#[test]
fn garbage_in_the_preallocated_space_is_cut_off() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    for garbage_len in [1usize, 7, 16, 17, 60] {
        let dir = tempfile::tempdir().unwrap();
        let (path, entry_offset) = write_log(dir.path());
        let garbage: Vec<u8> = (0..garbage_len)
            .map(|_| rng.random_range(1..=255))
            .collect();
        overwrite(&path, entry_offset + ENTRY_BYTES, &garbage);
        check_recovers_prefix(dir.path(), N_ENTRIES, true);
    }
}

fn overwrite(path: &Path, offset: u64, bytes: &[u8]) {
    let mut file = OpenOptions::new().write(true).open(path).unwrap();
    file.seek(SeekFrom::Start(offset)).unwrap();
    file.write_all(bytes).unwrap();
}
