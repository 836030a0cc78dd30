//! Cutting a closed log's tail (`tarn_wal::cut_after`): what a replica does with entries a
//! deposed primary wrote but never had acknowledged.

use tarn_wal::{cut_after, Durability, Wal};

use crate::{append_all, open, payload, replay_all, small_config};

/// A closed log of entries 1..=n spanning several 4 KiB segments.
fn log_of(path: &std::path::Path, n: u64) {
    let wal = Wal::open(path, small_config()).unwrap().0;
    let payloads: Vec<_> = (1..=n).map(|tag| payload(tag, 200)).collect();
    append_all(&wal, &payloads);
    wal.close().unwrap();
}

#[test]
fn a_cut_keeps_exactly_the_entries_up_to_it_and_the_log_continues_there() {
    // Cuts inside the first segment, inside a later one, right at segment boundaries (both
    // sides), at the very start, at the end (nothing to cut) and past it.
    let n = 100;
    let dir = tempfile::tempdir().unwrap();
    let probe = dir.path().join("probe");
    log_of(&probe, n);
    let (_, report) = open(&probe, small_config());
    assert!(report.n_segments > 3, "{report:?}");
    let mut boundaries: Vec<u64> = std::fs::read_dir(&probe)
        .unwrap()
        .filter_map(|e| {
            let name = e.unwrap().file_name().to_string_lossy().into_owned();
            name.strip_suffix(".wal").and_then(|s| s.parse().ok())
        })
        .collect();
    boundaries.sort_unstable();
    let second = boundaries[1];
    for keep in [0, 1, 5, second - 1, second, second + 1, n - 1, n, n + 7] {
        let path = dir.path().join(format!("cut-{keep}"));
        log_of(&path, n);
        let cut = cut_after(&path, &small_config(), keep).unwrap();
        assert_eq!(cut, n - keep.min(n), "keep {keep}");
        // Cutting again changes nothing.
        assert_eq!(cut_after(&path, &small_config(), keep).unwrap(), 0);
        let (wal, report) = open(&path, small_config());
        assert!(report.torn_tail.is_none(), "keep {keep}: {report:?}");
        let kept = keep.min(n);
        assert_eq!(wal.last_appended_seq(), kept, "keep {keep}");
        let entries = replay_all(&wal, 1);
        assert_eq!(entries.len() as u64, kept, "keep {keep}");
        for (seq, bytes) in &entries {
            assert_eq!(bytes[..], payload(*seq, 200)[..]);
        }
        // New entries continue right after the cut, and survive a reopen.
        let next = wal
            .append(payload(10_000 + kept, 200), Durability::Fsync)
            .wait()
            .unwrap();
        assert_eq!(next, kept + 1);
        wal.close().unwrap();
        drop(wal);
        let (wal, _) = open(&path, small_config());
        assert_eq!(wal.last_appended_seq(), kept + 1);
        let last = replay_all(&wal, kept + 1);
        assert_eq!(last[0].1[..], payload(10_000 + kept, 200)[..]);
    }
}

#[test]
fn a_cut_before_the_log_s_first_entry_is_refused_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("wal");
    let wal = Wal::create_at(&path, small_config(), 50).unwrap();
    let payloads: Vec<_> = (50..80).map(|tag| payload(tag, 200)).collect();
    append_all(&wal, &payloads);
    wal.close().unwrap();
    drop(wal);
    let error = cut_after(&path, &small_config(), 40).unwrap_err();
    assert!(
        error.to_string().contains("it begins at entry 50"),
        "{error}"
    );
    // Right before the first entry: everything goes, the log still begins at 50.
    assert_eq!(cut_after(&path, &small_config(), 49).unwrap(), 30);
    let (wal, _) = open(&path, small_config());
    assert_eq!(wal.last_appended_seq(), 49);
    assert_eq!(
        wal.append(payload(1, 10), Durability::Fsync)
            .wait()
            .unwrap(),
        50
    );
}
