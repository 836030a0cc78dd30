//! Integration tests of `tarn-wal` through its public API (one test binary for the crate;
//! fail-point tests live in `tests/failpoints.rs` because fail points are process-global).
#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

mod cut;
mod model;
mod process_crash;
mod recovery;
mod reservation;
mod start_at;
mod tail_damage;
mod write_groups;

use std::path::Path;
use std::sync::Arc;

use tarn_wal::{Durability, RecoveryReport, Wal, WalConfig};

/// Small segments so that a few hundred entries span several files.
pub fn small_config() -> WalConfig {
    WalConfig {
        segment_bytes: 4096,
        ..WalConfig::default()
    }
}

/// A payload that encodes its writer and index, so a replayed entry can be checked.
pub fn payload(tag: u64, len: usize) -> Arc<[u8]> {
    let mut bytes = tag.to_le_bytes().to_vec();
    let mut x = tag.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    while bytes.len() < len.max(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        bytes.push(x as u8);
    }
    bytes.into()
}

pub fn open(dir: &Path, config: WalConfig) -> (Wal, RecoveryReport) {
    Wal::open(dir, config).expect("open WAL")
}

pub fn append_all(wal: &Wal, payloads: &[Arc<[u8]>]) -> Vec<u64> {
    payloads
        .iter()
        .map(|p| {
            wal.append(Arc::clone(p), Durability::Fsync)
                .wait()
                .expect("append")
        })
        .collect()
}

pub fn replay_all(wal: &Wal, from: u64) -> Vec<(u64, Vec<u8>)> {
    wal.replay(from)
        .expect("replay")
        .collect::<Result<Vec<_>, _>>()
        .expect("replay entries")
}
