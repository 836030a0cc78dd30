//! Vectors on disk (`IndexConfig::vectors_on_disk`): partitions that walk int8 codes leave
//! their full vectors in the segment file. Answers are those of the same segment in memory,
//! memory drops to the codes, graph and ids, and damaged cold vectors are errors, never served.

use std::io::{Seek, SeekFrom, Write};
use std::path::Path;

use tarn_index::{
    BuildConfig, BulkDocuments, IndexConfig, IndexError, Metric, Quantization, SealedSegment,
};
use tarn_testkit::clustered_vectors;

use super::{prepared, DIM};

const TENANT: u128 = 7;
/// Below the graph threshold of `config`: searched exactly, never cold.
const SMALL_TENANT: u128 = 8;
const SMALL: usize = 50;

fn config(on_disk: bool) -> IndexConfig {
    let mut config = super::config(Metric::L2);
    config.quantization = Quantization::Int8 { rescore: 3 };
    config.vectors_on_disk = on_disk;
    config
}

/// `n` documents of `TENANT` and `SMALL` of `SMALL_TENANT`, built with one thread (the same
/// graph every time) and written to `path`.
fn built_to(path: &Path, base: &[f32], on_disk: bool) -> SealedSegment {
    let n = base.len() / DIM;
    let mut user_ids = vec![TENANT; n];
    user_ids[n - SMALL..].fill(SMALL_TENANT);
    let doc_ids: Vec<u128> = (0..n as u128).collect();
    let documents = BulkDocuments {
        user_ids: &user_ids,
        doc_ids: &doc_ids,
        vectors: base,
    };
    let build = BuildConfig {
        threads: 1,
        ..BuildConfig::default()
    };
    SealedSegment::build_to_file(path, documents, 1, 1, config(on_disk), &build)
        .unwrap()
        .0
}

fn answers(segment: &SealedSegment, queries: &[f32]) -> Vec<Vec<(u128, f32)>> {
    queries
        .chunks_exact(DIM)
        .flat_map(|q| {
            let q = prepared(Metric::L2, q);
            [TENANT, SMALL_TENANT].map(|tenant| {
                segment
                    .search(tenant, &q, 10, 64, false)
                    .unwrap()
                    .iter()
                    .map(|hit| (hit.doc_id, hit.distance))
                    .collect()
            })
        })
        .collect()
}

#[test]
fn cold_vectors_answer_like_memory_and_keep_only_codes_graph_and_ids_resident() {
    let base = clustered_vectors(2000, DIM, 20, 31);
    let queries = clustered_vectors(30, DIM, 20, 32);
    let dir = tempfile::tempdir().unwrap();
    let in_memory = built_to(&dir.path().join("memory.tseg"), &base, false);
    let cold = built_to(&dir.path().join("cold.tseg"), &base, true);
    let (memory_figures, cold_figures) = (in_memory.figures(), cold.figures());
    assert_eq!(memory_figures.cold_bytes, 0);
    // The graph partition's vectors (not the small tenant's) left memory for 4 bytes a slot.
    let n_cold = 2000 - SMALL;
    assert_eq!(cold_figures.cold_bytes, n_cold * DIM * 4);
    assert_eq!(
        cold_figures.memory_bytes,
        memory_figures.memory_bytes - n_cold * DIM * 4 + n_cold * 4
    );
    assert_eq!(
        cold_figures.index_bytes,
        memory_figures.index_bytes + n_cold * 4
    );
    // Written then left in the file, or opened from it: the same answers as in memory.
    let expected = answers(&in_memory, &queries);
    assert_eq!(answers(&cold, &queries), expected);
    let read_by_searches = cold.cold_bytes_read();
    // Only rescored candidates are read: at most k x rescore = 30 vectors a search.
    let n_searches = (queries.len() / DIM) as u64;
    assert!(read_by_searches > 0);
    assert!(read_by_searches <= n_searches * 30 * DIM as u64 * 4);
    let opened = SealedSegment::open(&dir.path().join("cold.tseg"), config(true)).unwrap();
    assert_eq!(opened.figures(), cold_figures);
    assert_eq!(answers(&opened, &queries), expected);
    // Evicted from the page cache: read from the disk again, same answers.
    opened.evict_cold_vectors().unwrap();
    assert_eq!(answers(&opened, &queries), expected);
    // Get and exact searches read the exact stored vectors.
    for doc_id in [0u128, 1, 977, (2000 - SMALL - 1) as u128] {
        assert_eq!(
            opened.get(TENANT, doc_id).unwrap(),
            in_memory.get(TENANT, doc_id).unwrap()
        );
    }
    let q = prepared(Metric::L2, &queries[..DIM]);
    assert_eq!(
        opened.search(TENANT, &q, 10, 64, true).unwrap(),
        in_memory.search(TENANT, &q, 10, 64, true).unwrap()
    );
    // A merge reads the cold vectors back whole: the same segment as a merge in memory.
    let build = BuildConfig {
        threads: 1,
        ..BuildConfig::default()
    };
    let mut merged = SealedSegment::rebuild(&[&opened], 2, config(true), &build).unwrap();
    let merged_in_memory = SealedSegment::rebuild(&[&in_memory], 2, config(false), &build).unwrap();
    assert_eq!(
        answers(&merged, &queries),
        answers(&merged_in_memory, &queries)
    );
    merged.write(&dir.path().join("merged.tseg")).unwrap();
    assert_eq!(merged.figures().cold_bytes, n_cold * DIM * 4);
    assert_eq!(
        answers(&merged, &queries),
        answers(&merged_in_memory, &queries)
    );
}

#[test]
fn without_codes_vectors_stay_in_memory() {
    // vectors_on_disk without a quantization: nothing walks codes, nothing goes cold.
    let base = clustered_vectors(1500, DIM, 20, 33);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("plain.tseg");
    let mut plain_config = config(true);
    plain_config.quantization = Quantization::None;
    let doc_ids: Vec<u128> = (0..1500).collect();
    let documents = BulkDocuments {
        user_ids: &[TENANT; 1500],
        doc_ids: &doc_ids,
        vectors: &base,
    };
    let (segment, _) = SealedSegment::build_to_file(
        &path,
        documents,
        1,
        1,
        plain_config,
        &BuildConfig::default(),
    )
    .unwrap();
    assert_eq!(segment.figures().cold_bytes, 0);
    let opened = SealedSegment::open(&path, plain_config).unwrap();
    assert_eq!(opened.figures().cold_bytes, 0);
    // The same file opened in an int8 collection on disk gets codes, then goes cold.
    let opened = SealedSegment::open(&path, config(true)).unwrap();
    assert_eq!(opened.figures().cold_bytes, 1500 * DIM * 4);
    assert_eq!(
        opened.get(TENANT, 3).unwrap().unwrap(),
        segment.get(TENANT, 3).unwrap().unwrap()
    );
}

fn damage(path: &Path, offset: u64, len: usize) {
    let mut file = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    file.seek(SeekFrom::Start(offset)).unwrap();
    file.write_all(&vec![0x5a; len]).unwrap();
    file.sync_all().unwrap();
}

fn is_corrupt<T: std::fmt::Debug>(result: Result<T, IndexError>) -> String {
    match result {
        Err(IndexError::Corrupt { reason, .. }) => reason,
        other => panic!("expected a damaged file, got {other:?}"),
    }
}

#[test]
fn damaged_cold_vectors_are_reported_never_served() {
    let base = clustered_vectors(2000, DIM, 20, 34);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cold.tseg");
    let segment = built_to(&path, &base, true);
    let q = prepared(Metric::L2, &base[..DIM]);
    assert_eq!(
        segment.search(TENANT, &q, 10, 64, false).unwrap()[0].doc_id,
        0
    );
    // The tenant's vectors come first in the file (tenants in id order, 7 before 8), right
    // after the header (37 bytes) and the partition's (user, slots, indexed) fields (24).
    let block = 37 + 24;
    damage(&path, block, DIM * 4 * 1950);
    segment.evict_cold_vectors().unwrap();
    let reason = is_corrupt(segment.get(TENANT, 0));
    assert!(
        reason.contains("slot 0") && reason.contains("checksum"),
        "{reason}"
    );
    is_corrupt(segment.search(TENANT, &q, 10, 64, false));
    is_corrupt(segment.search(TENANT, &q, 10, 64, true));
    let build = BuildConfig::default();
    is_corrupt(SealedSegment::rebuild(&[&segment], 2, config(true), &build));
    // The small tenant's vectors are in memory: still served.
    let small_doc = (2000 - SMALL) as u128;
    assert!(segment.get(SMALL_TENANT, small_doc).unwrap().is_some());
    // Reopening checks the whole file: refused.
    match SealedSegment::open(&path, config(true)) {
        Err(IndexError::Corrupt { reason, .. }) => assert!(reason.contains("checksum"), "{reason}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_truncated_cold_file_is_an_error_not_a_crash() {
    let base = clustered_vectors(1200, DIM, 20, 35);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cold.tseg");
    let segment = built_to(&path, &base, true);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(100)
        .unwrap();
    match segment.get(TENANT, 1100) {
        Err(IndexError::Io { .. }) => {}
        other => panic!("expected an I/O error, got {other:?}"),
    }
}
