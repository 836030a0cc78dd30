//! Int8 quantized collections: sealed partitions get codes when sealed, merged, reopened and
//! restored, and searches keep returning exact scores; with `vectors_on_disk`, their full
//! vectors stay in the segment files through all of it.

use std::time::Duration;

use tarn_collection::{Collection, CollectionConfig, QuantizationConfig};
use tarn_testkit::clustered_vectors;

use crate::snapshot::{read_all, restore};
use crate::{config, insert_rows, request, row, runtime, DIM};

fn int8_config() -> CollectionConfig {
    let mut config = config();
    config.quantization = QuantizationConfig::Int8 { rescore: 3 };
    config.max_sealed_segments = 2;
    config
}

/// What one tenant's sealed documents' codes take: a byte per value and an `f32` norm per
/// slot, two `f32` ranges per dimension per partition (one partition per segment here).
fn codes_bytes(n_slots: u64, n_segments: u64) -> u64 {
    n_slots * (DIM as u64 + 4) + n_segments * DIM as u64 * 8
}

/// Each sampled row is found first by its own vector, every returned score is the exact L2
/// distance to the stored vector, and Get returns the exact vectors (never decoded codes).
fn check(c: &Collection, base: &[f32], n: usize, label: &str) {
    let sample: Vec<u128> = (0..n as u128).step_by(41).collect();
    let got = c.get(7, &sample).unwrap();
    assert_eq!(got.len(), sample.len(), "{label}");
    for (doc_id, vector) in got {
        assert_eq!(
            vector,
            row(base, doc_id as usize),
            "{label}: Get of {doc_id}"
        );
    }
    for i in (0..n).step_by(97) {
        let hits = c.search(&request(&[7], row(base, i), 5, false)).unwrap();
        assert_eq!(hits[0].doc_id, i as u128, "{label}: row {i}");
        for hit in &hits {
            let stored = row(base, hit.doc_id as usize);
            let exact: f32 = stored
                .iter()
                .zip(row(base, i))
                .map(|(a, b)| (a - b) * (a - b))
                .sum::<f32>()
                .sqrt();
            assert!(
                (hit.score - exact).abs() <= 1e-4 * (1.0 + exact),
                "{label}: score {} for an exact {exact}",
                hit.score
            );
        }
    }
}

/// Sealed vectors kept in files (`cold_bytes`) with `vectors_on_disk`, none otherwise.
fn assert_cold(c: &Collection, n_sealed: u64, on_disk: bool, label: &str) {
    let stats = c.stats();
    let expected = if on_disk {
        n_sealed * DIM as u64 * 4
    } else {
        0
    };
    assert_eq!(stats.cold_bytes, expected, "{label}: {stats:?}");
}

const INT8: QuantizationConfig = QuantizationConfig::Int8 { rescore: 3 };

#[test]
fn int8_codes_are_made_at_sealing_and_survive_merges_reopening_and_restores() {
    lifecycle(INT8, false);
}

#[test]
fn vectors_on_disk_stay_in_files_through_merges_reopening_and_restores() {
    lifecycle(INT8, true);
}

#[test]
fn rabitq_codes_with_vectors_on_disk_survive_merges_reopening_and_restores() {
    for bits in [1, 4] {
        lifecycle(QuantizationConfig::Rabitq { bits, rescore: 8 }, true);
    }
}

/// The codes of `n_slots` slots in `n_segments` segments (one partition each), when the
/// quantization's size is a formula of those (int8's).
fn expected_codes(quantization: QuantizationConfig, n_slots: u64, n_segments: u64) -> Option<u64> {
    (quantization == INT8).then(|| codes_bytes(n_slots, n_segments))
}

fn lifecycle(quantization: QuantizationConfig, on_disk: bool) {
    let dir = tempfile::tempdir().unwrap();
    let rt = runtime();
    let mut config = int8_config();
    config.quantization = quantization;
    config.vectors_on_disk = on_disk;
    let c = Collection::create(&dir.path().join("c"), config).unwrap();
    let base = clustered_vectors(1800, DIM, 12, 21);
    rt.block_on(async {
        let seq = insert_rows(&c, &base, 0..600, 7).await;
        c.wait_applied(seq, Duration::from_secs(10)).await.unwrap();
        // The mutable segment keeps full vectors only.
        assert_eq!(c.stats().quantized_bytes, 0);
        check(&c, &base, 600, "mutable");
        c.flush().await.unwrap();
    });
    let stats = c.stats();
    assert_eq!(stats.n_sealed_segments, 1);
    assert!(stats.quantized_bytes > 0);
    if let Some(expected) = expected_codes(quantization, 600, 1) {
        assert_eq!(stats.quantized_bytes, expected);
    }
    assert_cold(&c, 600, on_disk, "sealed");
    check(&c, &base, 600, "sealed");
    rt.block_on(async {
        for part in 1..3 {
            insert_rows(&c, &base, part * 600..(part + 1) * 600, 7).await;
            c.flush().await.unwrap();
        }
    });
    // Three flushes with at most two sealed segments: a merge made at least one of them.
    let stats = c.stats();
    assert!(stats.n_sealed_segments <= 2, "{stats:?}");
    if let Some(expected) = expected_codes(quantization, 1800, stats.n_sealed_segments as u64) {
        assert_eq!(stats.quantized_bytes, expected);
    }
    assert_cold(&c, 1800, on_disk, "merged");
    check(&c, &base, 1800, "merged");
    let bytes = read_all(&mut c.snapshot().unwrap());
    drop(c);

    let c = Collection::open(&dir.path().join("c")).unwrap();
    assert_eq!(c.config().quantization, quantization);
    assert_eq!(c.config().vectors_on_disk, on_disk);
    assert_eq!(c.stats().quantized_bytes, stats.quantized_bytes);
    assert_eq!(c.stats().memory_bytes, stats.memory_bytes);
    assert_cold(&c, 1800, on_disk, "reopened");
    check(&c, &base, 1800, "reopened");

    restore(&bytes, &dir.path().join("restored"), 1 << 16).unwrap();
    let r = Collection::open(&dir.path().join("restored")).unwrap();
    assert_eq!(r.config().quantization, quantization);
    assert_eq!(r.stats().quantized_bytes, stats.quantized_bytes);
    assert_cold(&r, 1800, on_disk, "restored");
    check(&r, &base, 1800, "restored");
}
