//! Int8 quantized partitions: recall against f32 on the same graphs, exact returned distances,
//! and the codes surviving files, rebuilds and old segments.

use tarn_index::{BuildConfig, BulkDocuments, IndexConfig, Metric, Quantization, SealedSegment};
use tarn_testkit::{brute_force_top_k, clustered_vectors, recall};

use super::{ids, prepared, DIM};

/// The dimension a quantization is tested at: 1-bit RaBitQ estimates an inner product within
/// about `1 / sqrt(dim)`, too coarse at 32 dimensions to steer a graph walk; 128 is the
/// smallest common embedding size. These clusters are hard for 1 bit: within one, vectors are
/// a centre plus uniform noise, nearly equidistant, so a generous rescore here is 32 (at 10:
/// recall 0.94 against f32's 0.99; minilm's real embeddings keep 0.99 at 10,
/// docs/BENCHMARKS.md).
fn dim_for(quantization: Quantization) -> usize {
    match quantization {
        Quantization::Rabitq { bits: 1, .. } => 128,
        _ => DIM,
    }
}

fn config(dim: usize, metric: Metric, quantization: Quantization) -> IndexConfig {
    let mut config = super::config(metric);
    config.dimension = dim;
    config.quantization = quantization;
    config
}

fn built(dim: usize, metric: Metric, quantization: Quantization, base: &[f32]) -> SealedSegment {
    let n = base.len() / dim;
    let doc_ids: Vec<u128> = (0..n as u128).collect();
    let user_ids = vec![7u128; n];
    let documents = BulkDocuments {
        user_ids: &user_ids,
        doc_ids: &doc_ids,
        vectors: base,
    };
    let config = config(dim, metric, quantization);
    // One thread: the same graph every time, so segments built with and without codes compare.
    let build = BuildConfig {
        threads: 1,
        ..BuildConfig::default()
    };
    SealedSegment::build(documents, 1, 1, config, &build).unwrap()
}

#[test]
fn int8_keeps_recall_within_0_01_of_f32_and_returns_exact_distances() {
    keeps_recall(
        Quantization::Int8 { rescore: 4 },
        Quantization::Int8 { rescore: 1 },
    );
}

#[test]
fn rabitq_1_bit_keeps_recall_within_0_01_of_f32_at_a_generous_rescore() {
    keeps_recall(
        Quantization::Rabitq {
            bits: 1,
            rescore: 32,
        },
        Quantization::Rabitq {
            bits: 1,
            rescore: 1,
        },
    );
}

#[test]
fn rabitq_4_bits_keep_recall_within_0_01_of_f32() {
    keeps_recall(
        Quantization::Rabitq {
            bits: 4,
            rescore: 4,
        },
        Quantization::Rabitq {
            bits: 4,
            rescore: 1,
        },
    );
}

/// What `n_slots` slots' codes take, with the partition's constant part.
fn codes_bytes(quantization: Quantization, n_slots: usize) -> usize {
    let dim = dim_for(quantization);
    match quantization {
        Quantization::None => 0,
        Quantization::Int8 { .. } => n_slots * (dim + 4) + dim * 8,
        // A record: the code (1 bit, or 4 bits for 2 to 4), three f32 factors and the index
        // of its centroid; about sqrt(n) centroids with their squared norms, and the
        // rotation's signs (4 rounds x 2 sign vectors, a bit each).
        Quantization::Rabitq { bits, .. } => {
            let code = if bits == 1 { dim / 8 } else { dim / 2 };
            let n_centroids = ((n_slots as f64).sqrt().round() as usize).clamp(1, 256);
            n_slots * (code + 13) + n_centroids * (dim + 1) * 4 + 8 * dim.div_ceil(64) * 8
        }
    }
}

/// `quantization` (rescoring generously) keeps recall@10 within 0.01 of f32 on the same graph,
/// and returns exact distances; `unscored` (rescoring 1) is reported for comparison.
fn keeps_recall(quantization: Quantization, unscored: Quantization) {
    let dim = dim_for(quantization);
    let base = clustered_vectors(4000, dim, 40, 11);
    let queries = clustered_vectors(200, dim, 40, 12);
    for metric in [Metric::Cosine, Metric::L2, Metric::Dot] {
        let plain = built(dim, metric, Quantization::None, &base);
        let int8 = built(dim, metric, quantization, &base);
        let unscored = built(dim, metric, unscored, &base);
        assert_eq!(plain.figures().quantized_bytes, 0);
        assert_eq!(
            int8.figures().quantized_bytes,
            codes_bytes(quantization, 4000)
        );
        let (mut plain_recall, mut int8_recall, mut unscored_recall) = (0.0, 0.0, 0.0);
        for q in queries.chunks_exact(dim) {
            let q = prepared(metric, q);
            let truth = brute_force_top_k(&base, dim, &q, 10, metric);
            let hits = int8.search(7, &q, 10, 128, false).unwrap();
            plain_recall += recall(
                &ids(&plain.search(7, &q, 10, 128, false).unwrap()),
                &truth,
                10,
            );
            int8_recall += recall(&ids(&hits), &truth, 10);
            unscored_recall += recall(
                &ids(&unscored.search(7, &q, 10, 128, false).unwrap()),
                &truth,
                10,
            );
            // Returned distances are the exact metric on the stored vectors, nearest first.
            for hit in &hits {
                let stored = int8.get(7, hit.doc_id).unwrap().unwrap();
                assert_eq!(hit.distance, metric.distance(&q, &stored), "{metric:?}");
            }
            assert!(hits.windows(2).all(|w| w[0].distance <= w[1].distance));
        }
        let n = (queries.len() / dim) as f64;
        let (plain_recall, int8_recall, unscored_recall) =
            (plain_recall / n, int8_recall / n, unscored_recall / n);
        eprintln!(
            "{metric:?}: f32 {plain_recall:.4} {quantization:?} {int8_recall:.4} \
             rescoring 1 {unscored_recall:.4}"
        );
        assert!(
            int8_recall >= plain_recall - 0.01,
            "{metric:?}: {quantization:?} {int8_recall} against f32 {plain_recall}"
        );
    }
}

#[test]
fn int8_codes_survive_files_rebuilds_and_old_segments_get_them_when_opened() {
    codes_survive(Quantization::Int8 { rescore: 3 });
}

#[test]
fn rabitq_codes_survive_files_rebuilds_and_old_segments_get_them_when_opened() {
    codes_survive(Quantization::Rabitq {
        bits: 1,
        rescore: 10,
    });
    codes_survive(Quantization::Rabitq {
        bits: 3,
        rescore: 4,
    });
}

fn codes_survive(quantization: Quantization) {
    let dim = dim_for(quantization);
    let metric = Metric::L2;
    let base = clustered_vectors(1500, dim, 20, 13);
    let mut segment = built(dim, metric, quantization, &base);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("seg.tseg");
    segment.write(&path).unwrap();
    let reopened = SealedSegment::open(&path, config(dim, metric, quantization)).unwrap();
    assert_eq!(reopened.figures(), segment.figures());
    let queries = clustered_vectors(20, dim, 20, 14);
    for q in queries.chunks_exact(dim) {
        assert_eq!(
            reopened.search(7, q, 10, 64, false).unwrap(),
            segment.search(7, q, 10, 64, false).unwrap()
        );
    }
    // The same file opened by a collection without quantization: the codes are still used (and
    // its figures count them), the answers are the same.
    let plain_config = config(dim, metric, Quantization::None);
    let as_plain = SealedSegment::open(&path, plain_config).unwrap();
    assert_eq!(as_plain.figures(), segment.figures());
    // A segment written without codes gets them when opened in an int8 collection.
    let mut old = built(dim, metric, Quantization::None, &base);
    old.write(&path).unwrap();
    let upgraded = SealedSegment::open(&path, config(dim, metric, quantization)).unwrap();
    assert_eq!(upgraded.figures(), segment.figures());
    for q in queries.chunks_exact(dim) {
        assert_eq!(
            upgraded.search(7, q, 10, 64, false).unwrap(),
            segment.search(7, q, 10, 64, false).unwrap()
        );
    }
    // A rebuild (merge) quantizes its new partitions.
    let rebuilt = SealedSegment::rebuild(
        &[&reopened],
        2,
        config(dim, metric, quantization),
        &BuildConfig::default(),
    )
    .unwrap();
    let codes = segment.figures().quantized_bytes;
    assert_eq!(codes, codes_bytes(quantization, 1500));
    assert_eq!(rebuilt.figures().quantized_bytes, codes);
    let mut found = 0.0;
    for (i, row) in base.chunks_exact(dim).enumerate().step_by(50) {
        found += recall(
            &ids(&rebuilt.search(7, row, 1, 64, false).unwrap()),
            &[i],
            1,
        );
    }
    assert_eq!(
        found, 30.0,
        "every sampled document found by its own vector"
    );
    // Damage in the codes is a checksum error, never a panic.
    let mut bytes = std::fs::read(&path).unwrap();
    let middle = bytes.len() - 100;
    bytes[middle] ^= 0x40;
    std::fs::write(&path, &bytes).unwrap();
    assert!(SealedSegment::open(&path, config(dim, metric, quantization)).is_err());
}
