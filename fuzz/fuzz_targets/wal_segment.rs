//! WAL recovery on arbitrary bytes after a valid segment header: `Wal::open` must return a log
//! (with the damage cut off) or an error, never panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fn header() -> Vec<u8> {
    let mut h = Vec::with_capacity(32);
    h.extend_from_slice(b"TARNWAL1");
    h.extend_from_slice(&1u32.to_le_bytes());
    h.extend_from_slice(&32u32.to_le_bytes());
    h.extend_from_slice(&1u64.to_le_bytes());
    let crc = crc32fast::hash(&h);
    h.extend_from_slice(&crc.to_le_bytes());
    h.extend_from_slice(&0u32.to_le_bytes());
    h
}

fuzz_target!(|data: &[u8]| {
    let dir = tempfile::tempdir().expect("temp dir");
    let mut bytes = header();
    bytes.extend_from_slice(data);
    std::fs::write(dir.path().join("00000000000000000001.wal"), &bytes).expect("write");
    let config = tarn_wal::WalConfig {
        segment_bytes: 1 << 16,
        ..tarn_wal::WalConfig::default()
    };
    if let Ok((wal, _report)) = tarn_wal::Wal::open(dir.path(), config) {
        // Whatever survived must replay without panicking.
        let _ = wal.replay(1).map(|entries| entries.count());
    }
});
