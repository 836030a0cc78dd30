//! Int8 quantized partitions: recall against f32 on the same graphs, exact returned distances,
//! and the codes surviving files, rebuilds and old segments.

use tarn_index::{BuildConfig, BulkDocuments, IndexConfig, Metric, Quantization, SealedSegment};
use tarn_testkit::{brute_force_top_k, clustered_vectors, recall};

use super::{ids, prepared, DIM};

fn config(metric: Metric, quantization: Quantization) -> IndexConfig {
    let mut config = super::config(metric);
    config.quantization = quantization;
    config
}

fn built(metric: Metric, quantization: Quantization, base: &[f32]) -> SealedSegment {
    let n = base.len() / DIM;
    let doc_ids: Vec<u128> = (0..n as u128).collect();
    let user_ids = vec![7u128; n];
    let documents = BulkDocuments {
        user_ids: &user_ids,
        doc_ids: &doc_ids,
        vectors: base,
    };
    let config = config(metric, quantization);
    // One thread: the same graph every time, so segments built with and without codes compare.
    let build = BuildConfig {
        threads: 1,
        ..BuildConfig::default()
    };
    SealedSegment::build(documents, 1, 1, config, &build).unwrap()
}

#[test]
fn int8_keeps_recall_within_0_01_of_f32_and_returns_exact_distances() {
    let base = clustered_vectors(4000, DIM, 40, 11);
    let queries = clustered_vectors(200, DIM, 40, 12);
    for metric in [Metric::Cosine, Metric::L2, Metric::Dot] {
        let plain = built(metric, Quantization::None, &base);
        let int8 = built(metric, Quantization::Int8 { rescore: 4 }, &base);
        let unscored = built(metric, Quantization::Int8 { rescore: 1 }, &base);
        assert_eq!(plain.figures().quantized_bytes, 0);
        assert_eq!(int8.figures().quantized_bytes, 4000 * (DIM + 4) + DIM * 8);
        let (mut plain_recall, mut int8_recall, mut unscored_recall) = (0.0, 0.0, 0.0);
        for q in queries.chunks_exact(DIM) {
            let q = prepared(metric, q);
            let truth = brute_force_top_k(&base, DIM, &q, 10, metric);
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
        let n = (queries.len() / DIM) as f64;
        let (plain_recall, int8_recall, unscored_recall) =
            (plain_recall / n, int8_recall / n, unscored_recall / n);
        eprintln!(
            "{metric:?}: f32 {plain_recall:.4} int8 rescored x4 {int8_recall:.4} \
             x1 {unscored_recall:.4}"
        );
        assert!(
            int8_recall >= plain_recall - 0.01,
            "{metric:?}: int8 {int8_recall} against f32 {plain_recall}"
        );
    }
}

#[test]
fn int8_codes_survive_files_rebuilds_and_old_segments_get_them_when_opened() {
    let metric = Metric::L2;
    let quantization = Quantization::Int8 { rescore: 3 };
    let base = clustered_vectors(1500, DIM, 20, 13);
    let mut segment = built(metric, quantization, &base);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("seg.tseg");
    segment.write(&path).unwrap();
    let reopened = SealedSegment::open(&path, config(metric, quantization)).unwrap();
    assert_eq!(reopened.figures(), segment.figures());
    let queries = clustered_vectors(20, DIM, 20, 14);
    for q in queries.chunks_exact(DIM) {
        assert_eq!(
            reopened.search(7, q, 10, 64, false).unwrap(),
            segment.search(7, q, 10, 64, false).unwrap()
        );
    }
    // The same file opened by a collection without quantization: the codes are still used (and
    // its figures count them), the answers are the same.
    let plain_config = config(metric, Quantization::None);
    let as_plain = SealedSegment::open(&path, plain_config).unwrap();
    assert_eq!(as_plain.figures(), segment.figures());
    // A segment written without codes gets them when opened in an int8 collection.
    let mut old = built(metric, Quantization::None, &base);
    old.write(&path).unwrap();
    let upgraded = SealedSegment::open(&path, config(metric, quantization)).unwrap();
    assert_eq!(upgraded.figures(), segment.figures());
    for q in queries.chunks_exact(DIM) {
        assert_eq!(
            upgraded.search(7, q, 10, 64, false).unwrap(),
            segment.search(7, q, 10, 64, false).unwrap()
        );
    }
    // A rebuild (merge) quantizes its new partitions.
    let rebuilt = SealedSegment::rebuild(
        &[&reopened],
        2,
        config(metric, quantization),
        &BuildConfig::default(),
    )
    .unwrap();
    let codes = segment.figures().quantized_bytes;
    assert_eq!(codes, 1500 * (DIM + 4) + DIM * 8);
    assert_eq!(rebuilt.figures().quantized_bytes, codes);
    let mut found = 0.0;
    for (i, row) in base.chunks_exact(DIM).enumerate().step_by(50) {
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
    assert!(SealedSegment::open(&path, config(metric, quantization)).is_err());
}
