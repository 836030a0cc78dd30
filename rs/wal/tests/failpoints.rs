//! Fail points for write, fdatasync and segment-creation errors: the log poisons itself, no
//! failed append resolves as durable, and a reopen brings back every acknowledged entry.
//!
//! Fail points are process-global, so these tests live in their own binary and each holds a
//! `FailScenario` (which serialises them). Run with `--features failpoints`.
#![cfg(feature = "failpoints")]
#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::sync::Arc;
use std::time::Duration;

use fail::FailScenario;
use tarn_wal::{Durability, Wal, WalConfig, WalError};

fn payload(tag: u64) -> Arc<[u8]> {
    let mut bytes = tag.to_le_bytes().to_vec();
    bytes.resize(200, tag as u8);
    bytes.into()
}

fn replay_all(wal: &Wal) -> Vec<(u64, Vec<u8>)> {
    wal.replay(1).unwrap().collect::<Result<_, _>>().unwrap()
}

fn assert_poisoned(wal: &Wal) {
    assert!(wal.poisoned().is_some());
    assert!(matches!(
        wal.append(payload(99), Durability::Fsync).wait(),
        Err(WalError::Poisoned { .. })
    ));
    assert!(matches!(
        wal.append(payload(99), Durability::Written).wait(),
        Err(WalError::Poisoned { .. })
    ));
    assert!(matches!(wal.sync().wait(), Err(WalError::Poisoned { .. })));
    assert!(wal.close().is_err());
}

/// Appends 5 entries, arms `fail_point`, checks that the next append fails and poisons the log,
/// then reopens and checks that the 5 acknowledged entries are intact and new appends work.
fn poisons_and_recovers(fail_point: &str, config: WalConfig) -> tarn_wal::RecoveryReport {
    let scenario = FailScenario::setup();
    let dir = tempfile::tempdir().unwrap();
    let (wal, _) = Wal::open(dir.path(), config.clone()).unwrap();
    for tag in 1..=5 {
        assert_eq!(
            wal.append(payload(tag), Durability::Fsync).wait().unwrap(),
            tag
        );
    }
    fail::cfg(fail_point, "return").unwrap();
    let result = wal.append(payload(6), Durability::Fsync).wait();
    assert!(
        matches!(result, Err(WalError::Io { .. })),
        "{fail_point}: {result:?}"
    );
    fail::remove(fail_point);
    // Nothing is retried: the log stays poisoned even though the fault is gone.
    assert_poisoned(&wal);
    assert_eq!(wal.last_durable_seq(), 5);
    drop(wal);

    let (wal, report) = Wal::open(dir.path(), config).unwrap();
    let entries = replay_all(&wal);
    assert!(entries.len() >= 5, "{fail_point}");
    for (seq, bytes) in entries.iter().take(5) {
        assert_eq!(bytes, &payload(*seq).to_vec());
    }
    let next = entries.len() as u64 + 1;
    assert_eq!(
        wal.append(payload(next), Durability::Fsync).wait().unwrap(),
        next
    );
    scenario.teardown();
    report
}

#[test]
fn failed_fdatasync_poisons() {
    let _ = poisons_and_recovers("wal::fdatasync", WalConfig::default());
}

#[test]
fn failed_write_poisons() {
    let _ = poisons_and_recovers("wal::write", WalConfig::default());
}

#[test]
fn torn_write_poisons_and_the_tail_is_cut_at_reopen() {
    let report = poisons_and_recovers("wal::torn_write", WalConfig::default());
    let repair = report.torn_tail.expect("the half-written entry is cut off");
    assert_eq!(repair.bytes_dropped, 8, "{repair:?}");
    assert_eq!(report.last_seq, 5);
}

#[test]
fn failed_segment_creation_at_rollover_poisons() {
    // 5 entries of 216 bytes fill a 1,112-byte segment; the sixth needs a new one.
    let config = WalConfig {
        segment_bytes: 32 + 5 * 216,
        ..WalConfig::default()
    };
    let _ = poisons_and_recovers("wal::create_segment", config);
}

/// A full disk when the next (larger) segment is reserved is a full disk like any other: the
/// append fails out-of-space, the log is poisoned out-of-space, nothing acknowledged is lost.
#[test]
fn a_full_disk_when_reserving_the_next_segment_is_out_of_space() {
    let scenario = FailScenario::setup();
    let dir = tempfile::tempdir().unwrap();
    // 5 entries of 216 bytes fill the first 1,112-byte segment; the sixth needs the next.
    let config = WalConfig {
        initial_segment_bytes: 32 + 5 * 216,
        ..WalConfig::default()
    };
    let (wal, _) = Wal::open(dir.path(), config.clone()).unwrap();
    for tag in 1..=5 {
        wal.append(payload(tag), Durability::Fsync).wait().unwrap();
    }
    fail::cfg("wal::create_segment", "return(nospc)").unwrap();
    let error = wal
        .append(payload(6), Durability::Fsync)
        .wait()
        .unwrap_err();
    assert!(error.is_out_of_space(), "{error}");
    fail::remove("wal::create_segment");
    let later = wal
        .append(payload(7), Durability::Fsync)
        .wait()
        .unwrap_err();
    assert!(
        matches!(
            later,
            WalError::Poisoned {
                out_of_space: true,
                ..
            }
        ),
        "{later:?}"
    );
    drop(wal);
    let (wal, report) = Wal::open(dir.path(), config).unwrap();
    assert_eq!(report.last_seq, 5);
    assert_eq!(replay_all(&wal).len(), 5);
    scenario.teardown();
}

#[test]
fn every_member_of_a_failing_group_gets_the_error() {
    let scenario = FailScenario::setup();
    let dir = tempfile::tempdir().unwrap();
    let (wal, _) = Wal::open(dir.path(), WalConfig::default()).unwrap();
    // Hold the leader in its first sync (which then succeeds) while 199 appends queue up behind
    // it; they form the next group, whose sync fails. The margins are wide: the leader is in
    // the 300 ms sleep long before the 199 are queued.
    fail::cfg("wal::fdatasync", "1*sleep(300)").unwrap();
    let first = wal.append(payload(1), Durability::Fsync);
    std::thread::sleep(Duration::from_millis(30));
    let tickets: Vec<_> = (2..=200)
        .map(|tag| wal.append(payload(tag), Durability::Fsync))
        .collect();
    fail::cfg("wal::fdatasync", "return").unwrap();
    assert_eq!(first.wait().unwrap(), 1);
    let results: Vec<_> = tickets.into_iter().map(|t| t.wait()).collect();
    let first_error = results[0].clone().unwrap_err();
    assert!(
        matches!(
            first_error,
            WalError::Io {
                op: "fdatasync",
                ..
            }
        ),
        "{first_error:?}"
    );
    for result in &results {
        // Every member got the leader's error itself, not a later "poisoned".
        assert_eq!(
            result.as_ref().unwrap_err().to_string(),
            first_error.to_string()
        );
    }
    assert_eq!(wal.last_durable_seq(), 1);
    assert_eq!(wal.stats().n_groups, 2);
    fail::remove("wal::fdatasync");
    assert_poisoned(&wal);
    scenario.teardown();
}

#[test]
fn a_failed_background_sync_poisons_written_mode() {
    let scenario = FailScenario::setup();
    let dir = tempfile::tempdir().unwrap();
    let config = WalConfig {
        background_sync_interval: Duration::from_millis(10),
        ..WalConfig::default()
    };
    let (wal, _) = Wal::open(dir.path(), config).unwrap();
    fail::cfg("wal::fdatasync", "return").unwrap();
    assert_eq!(
        wal.append(payload(1), Durability::Written).wait().unwrap(),
        1
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while wal.poisoned().is_none() {
        assert!(
            std::time::Instant::now() < deadline,
            "background sync never failed"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    fail::remove("wal::fdatasync");
    assert_eq!(wal.last_durable_seq(), 0);
    assert_poisoned(&wal);
    scenario.teardown();
}

/// A full disk poisons the log like any failed sync, and the refusals that follow stay
/// out-of-space (so a server answers RESOURCE_EXHAUSTED, not UNAVAILABLE, until restarted).
#[test]
fn a_full_disk_keeps_every_later_refusal_out_of_space() {
    let scenario = FailScenario::setup();
    let dir = tempfile::tempdir().unwrap();
    let (wal, _) = Wal::open(dir.path(), WalConfig::default()).unwrap();
    wal.append(payload(1), Durability::Fsync).wait().unwrap();
    fail::cfg("wal::fdatasync", "return(nospc)").unwrap();
    let first = wal
        .append(payload(2), Durability::Fsync)
        .wait()
        .unwrap_err();
    assert!(
        matches!(first, WalError::Io { .. }) && first.is_out_of_space(),
        "{first}"
    );
    fail::remove("wal::fdatasync");
    for later in [
        wal.append(payload(3), Durability::Fsync).wait(),
        wal.append(payload(4), Durability::Written).wait(),
        wal.sync().wait(),
    ] {
        let error = later.unwrap_err();
        assert!(
            matches!(
                error,
                WalError::Poisoned {
                    out_of_space: true,
                    ..
                }
            ),
            "{error:?}"
        );
        assert!(error.is_out_of_space());
    }
    assert!(wal.poison_error().unwrap().is_out_of_space());
    // Another failure poisons without claiming a full disk.
    let dir = tempfile::tempdir().unwrap();
    let (wal, _) = Wal::open(dir.path(), WalConfig::default()).unwrap();
    fail::cfg("wal::fdatasync", "return").unwrap();
    assert!(!wal
        .append(payload(1), Durability::Fsync)
        .wait()
        .unwrap_err()
        .is_out_of_space());
    assert!(!wal
        .append(payload(2), Durability::Fsync)
        .wait()
        .unwrap_err()
        .is_out_of_space());
    scenario.teardown();
}
