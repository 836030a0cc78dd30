//! Integration tests of `tarn-index`: recall against a brute-force oracle, agreement of the
//! sealed search with hnsw_rs on the same graph, tombstones, tenants, files and rebuilds; the
//! segments tarn's own builder makes (`builder.rs`); filtered search (`filtered.rs`); int8 quantized partitions (`quantized.rs`).
#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

mod builder;
mod cold;
mod filtered;
mod quantized;

use std::sync::Arc;

use rand::{Rng, SeedableRng};
use tarn_index::{BuildConfig, Hit, IndexConfig, Metric, MutableSegment, SealedSegment};
use tarn_testkit::{brute_force_top_k, clustered_vectors, recall};

const DIM: usize = 32;

fn config(metric: Metric) -> IndexConfig {
    let mut config = IndexConfig::new(DIM, metric);
    config.graph_threshold = 256;
    config
}

fn prepared(metric: Metric, v: &[f32]) -> Vec<f32> {
    let mut v = v.to_vec();
    assert!(metric.prepare(&mut v));
    v
}

/// One tenant (7) holding rows 0..n as doc ids 0..n.
fn filled(metric: Metric, base: &[f32]) -> MutableSegment {
    let segment = MutableSegment::new(config(metric));
    for (i, row) in base.chunks_exact(DIM).enumerate() {
        segment.upsert(7, i as u128, &prepared(metric, row));
    }
    while segment.index_pending(500) > 0 {}
    assert_eq!(segment.n_unindexed(), 0);
    segment
}

fn ids(hits: &[Hit]) -> Vec<usize> {
    hits.iter().map(|h| h.doc_id as usize).collect()
}

fn mean_recall(
    metric: Metric,
    base: &[f32],
    queries: &[f32],
    search: impl Fn(&[f32]) -> Vec<Hit>,
) -> f64 {
    let n_queries = queries.len() / DIM;
    queries
        .chunks_exact(DIM)
        .map(|q| {
            let truth = brute_force_top_k(base, DIM, q, 10, metric);
            recall(&ids(&search(&prepared(metric, q))), &truth, 10)
        })
        .sum::<f64>()
        / n_queries as f64
}

#[test]
fn recall_at_10_is_at_least_0_95_in_both_segment_kinds_for_every_metric() {
    let base = clustered_vectors(3000, DIM, 40, 1);
    let queries = clustered_vectors(100, DIM, 40, 2);
    // Inner product on unnormalised vectors is not a metric and HNSW needs a wider beam for it
    // (0.94 at ef 64 on this data, in hnsw_rs and in tarn's search alike).
    for (metric, ef) in [(Metric::Cosine, 64), (Metric::L2, 64), (Metric::Dot, 128)] {
        let mutable = filled(metric, &base);
        let sealed = SealedSegment::seal(&mutable, 1, 3000);
        let mutable_recall = mean_recall(metric, &base, &queries, |q| {
            mutable.search(7, q, 10, ef, false)
        });
        let sealed_recall = mean_recall(metric, &base, &queries, |q| {
            sealed.search(7, q, 10, ef, false).unwrap()
        });
        let exact_recall = mean_recall(metric, &base, &queries, |q| {
            sealed.search(7, q, 10, 64, true).unwrap()
        });
        eprintln!("{metric:?}: mutable {mutable_recall:.3} sealed {sealed_recall:.3} exact {exact_recall:.3}");
        assert!(
            mutable_recall >= 0.95,
            "{metric:?} mutable recall {mutable_recall}"
        );
        assert!(
            sealed_recall >= 0.95,
            "{metric:?} sealed recall {sealed_recall}"
        );
        assert!(
            exact_recall >= 0.999,
            "{metric:?} exact recall {exact_recall}"
        );
    }
}

#[test]
fn sealed_search_returns_what_hnsw_rs_returns_on_the_same_graph() {
    let base = clustered_vectors(4000, DIM, 50, 3);
    let queries = clustered_vectors(300, DIM, 50, 4);
    let mutable = filled(Metric::L2, &base);
    let sealed = SealedSegment::seal(&mutable, 1, 4000);
    let (mut identical, mut overlap) = (0, 0.0);
    for q in queries.chunks_exact(DIM) {
        let from_hnsw_rs = ids(&mutable.search(7, q, 10, 64, false));
        let from_tarn = ids(&sealed.search(7, q, 10, 64, false).unwrap());
        identical += usize::from(from_hnsw_rs == from_tarn);
        overlap += recall(&from_tarn, &from_hnsw_rs, 10);
    }
    let n = queries.len() / DIM;
    let overlap = overlap / n as f64;
    eprintln!("overlap {overlap:.4}, identical {identical} of {n}");
    // The two loops differ only in the upper layers (tarn descends greedily to a local minimum,
    // hnsw_rs takes one step per layer) and in tie-breaking, so the results agree almost
    // everywhere (measured: 298 of 300 identical, overlap 0.9993).
    assert!(overlap >= 0.995, "mean overlap {overlap}");
    assert!(identical * 100 >= n * 97, "{identical} of {n} identical");
}

#[test]
fn every_live_document_is_found_by_its_own_vector() {
    // A parallel build (the rebuild path) can leave unreachable nodes; the export reconnects them.
    let base = clustered_vectors(3000, DIM, 30, 5);
    let mutable = filled(Metric::L2, &base);
    let sealed = SealedSegment::seal(&mutable, 1, 1);
    let rebuilt =
        SealedSegment::rebuild(&[&sealed], 2, config(Metric::L2), &BuildConfig::default()).unwrap();
    for (i, row) in base.chunks_exact(DIM).enumerate() {
        let hits = rebuilt.search(7, row, 1, 64, false).unwrap();
        assert_eq!(hits[0].doc_id, i as u128, "row {i} not found by itself");
    }
}

#[test]
fn upserts_hide_old_versions_removes_hide_documents_and_tenants_never_mix() {
    let metric = Metric::L2;
    let segment = MutableSegment::new(config(metric));
    let base = clustered_vectors(600, DIM, 10, 6);
    for (i, row) in base.chunks_exact(DIM).enumerate() {
        let user = (i % 3) as u128;
        segment.upsert(user, i as u128, row);
    }
    let far = vec![100.0f32; DIM];
    // Move doc 0 (tenant 0) far away, remove doc 3 (tenant 0).
    assert!(segment.upsert(0, 0, &far));
    assert!(segment.remove(0, 3));
    assert!(!segment.remove(0, 3));
    assert!(!segment.remove(1, 0), "doc 0 belongs to tenant 0 only");
    type SearchFn<'a> = &'a dyn Fn(u128, &[f32], bool) -> Vec<Hit>;
    let check = |search: SearchFn<'_>| {
        for exact in [false, true] {
            let near_old = search(0, &base[0..DIM], exact);
            assert!(
                near_old.iter().all(|h| h.doc_id != 3),
                "removed doc returned"
            );
            assert!(near_old.iter().all(|h| h.user_id == 0));
            let near_far = search(0, &far, exact);
            assert_eq!(near_far[0].doc_id, 0, "the new version is the one found");
            assert!(near_far[0].distance < 1e-3);
            let other = search(1, &far, exact);
            assert!(other.iter().all(|h| h.user_id == 1 && h.doc_id % 3 == 1));
        }
    };
    check(&|u, q, e| segment.search(u, q, 10, 64, e));
    let sealed = SealedSegment::seal(&segment, 1, 1);
    check(&|u, q, e| sealed.search(u, q, 10, 64, e).unwrap());
    assert_eq!(sealed.get(0, 0).unwrap().unwrap(), far);
    assert!(sealed.get(0, 3).unwrap().is_none());
    assert_eq!(sealed.live_counts()[&0], 199);
    // Tombstones in a sealed segment.
    assert!(sealed.tombstone(1, 1));
    assert!(!sealed.tombstone(1, 1));
    assert!(sealed
        .search(1, &base[DIM..2 * DIM], 10, 64, false)
        .unwrap()
        .iter()
        .all(|h| h.doc_id != 1));
    assert!(sealed.tombstones_dirty());
}

#[test]
fn segment_files_round_trip_and_damage_is_an_error_not_a_panic() {
    let base = clustered_vectors(700, DIM, 10, 7);
    let mutable = filled(Metric::Cosine, &base);
    for i in 0..50u128 {
        mutable.remove(7, i * 3);
    }
    let mut sealed = SealedSegment::seal(&mutable, 9, 1234);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("seg-9.tseg");
    sealed.write(&path).unwrap();
    let reopened = SealedSegment::open(&path, config(Metric::Cosine)).unwrap();
    assert_eq!((reopened.id(), reopened.max_seq()), (9, 1234));
    assert_eq!(reopened.figures(), sealed.figures());
    let q = prepared(Metric::Cosine, &base[5 * DIM..6 * DIM]);
    assert_eq!(
        reopened.search(7, &q, 10, 64, false).unwrap(),
        sealed.search(7, &q, 10, 64, false).unwrap()
    );
    // Tombstones file.
    assert!(reopened.tombstone(7, 1));
    let tomb_path = dir.path().join("seg-9.tomb");
    tarn_index::fsutil::write_durably(&tomb_path, &reopened.encode_tombstones()).unwrap();
    let again = SealedSegment::open(&path, config(Metric::Cosine)).unwrap();
    assert!(again.contains(7, 1));
    again.apply_tombstones(&tomb_path).unwrap();
    assert!(!again.contains(7, 1));
    // Wrong collection shape.
    assert!(SealedSegment::open(&path, config(Metric::L2)).is_err());
    // Damage anywhere: flipped bits, truncation.
    let bytes = std::fs::read(&path).unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(8);
    for _ in 0..200 {
        let mut damaged = bytes.clone();
        let at = rng.random_range(0..damaged.len());
        damaged[at] ^= 1 << rng.random_range(0..8);
        assert!(SealedSegment::decode(&damaged, config(Metric::Cosine)).is_err());
        let cut = rng.random_range(0..bytes.len());
        assert!(SealedSegment::decode(&bytes[..cut], config(Metric::Cosine)).is_err());
    }
}

#[test]
fn rebuild_merges_segments_and_drops_tombstones() {
    let base = clustered_vectors(1200, DIM, 10, 9);
    let first = MutableSegment::new(config(Metric::L2));
    let second = MutableSegment::new(config(Metric::L2));
    for (i, row) in base.chunks_exact(DIM).enumerate() {
        let target = if i < 600 { &first } else { &second };
        target.upsert((i % 2) as u128, i as u128, row);
    }
    let a = SealedSegment::seal(&first, 1, 10);
    let b = SealedSegment::seal(&second, 2, 20);
    for i in (0..1200u128).step_by(4) {
        let segment = if i < 600 { &a } else { &b };
        assert!(segment.tombstone(i % 2, i));
    }
    let merged =
        SealedSegment::rebuild(&[&a, &b], 3, config(Metric::L2), &BuildConfig::default()).unwrap();
    assert_eq!(merged.max_seq(), 20);
    let figures = merged.figures();
    assert_eq!(
        (figures.n_live, figures.n_tombstoned, figures.n_slots),
        (900, 0, 900)
    );
    assert_eq!(merged.live_counts()[&0], 300);
    assert_eq!(merged.live_counts()[&1], 600);
    assert!(merged.get(0, 4).unwrap().is_none());
    assert_eq!(
        merged.get(1, 5).unwrap().unwrap(),
        base[5 * DIM..6 * DIM].to_vec()
    );
}

#[test]
fn an_unindexed_tail_is_searched_exactly_until_the_indexer_takes_it() {
    let base = clustered_vectors(1000, DIM, 10, 12);
    let segment = MutableSegment::new(config(Metric::L2));
    for (i, row) in base.chunks_exact(DIM).enumerate() {
        segment.upsert(7, i as u128, row);
    }
    assert_eq!(
        segment.n_unindexed(),
        1000,
        "past the threshold, nothing indexed yet"
    );
    let find_all = |segment: &MutableSegment| {
        for i in (0..1000).step_by(13) {
            let hits = segment.search(7, &base[i * DIM..(i + 1) * DIM], 1, 64, false);
            assert_eq!(
                hits[0].doc_id,
                i as u128,
                "unindexed: {}",
                segment.n_unindexed()
            );
        }
    };
    find_all(&segment);
    assert_eq!(segment.index_pending(300), 300);
    assert_eq!(segment.n_unindexed(), 700);
    find_all(&segment); // part graph, part tail
    while segment.index_pending(300) > 0 {}
    assert_eq!(segment.n_unindexed(), 0);
    find_all(&segment);
}

#[test]
fn two_searchers_during_five_thousand_inserts() {
    let base = Arc::new(clustered_vectors(5000, DIM, 40, 10));
    let segment = Arc::new(MutableSegment::new(config(Metric::L2)));
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let searchers: Vec<_> = (0..2)
        .map(|t| {
            let (segment, base, done) =
                (Arc::clone(&segment), Arc::clone(&base), Arc::clone(&done));
            std::thread::spawn(move || {
                let mut n = 0;
                while !done.load(std::sync::atomic::Ordering::Relaxed) {
                    let q = &base[(n * 7 + t) % 5000 * DIM..][..DIM];
                    let hits = segment.search(7, q, 10, 32, false);
                    assert!(hits.windows(2).all(|w| w[0].distance <= w[1].distance));
                    n += 1;
                }
                n
            })
        })
        .collect();
    // hnsw_rs inserts (the indexer) run concurrently with the searches.
    let indexer = {
        let (segment, done) = (Arc::clone(&segment), Arc::clone(&done));
        std::thread::spawn(move || {
            let mut n = 0;
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                n += segment.index_pending(100);
            }
            n
        })
    };
    for (i, row) in base.chunks_exact(DIM).enumerate() {
        segment.upsert(7, i as u128, row);
    }
    while segment.n_unindexed() > 0 {
        std::thread::yield_now();
    }
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    for s in searchers {
        assert!(s.join().unwrap() > 0);
    }
    assert!(indexer.join().unwrap() >= 4000);
    assert_eq!(segment.live_counts()[&7], 5000);
    for i in (0..5000).step_by(97) {
        assert_eq!(
            segment.search(7, &base[i * DIM..(i + 1) * DIM], 1, 64, false)[0].doc_id,
            i as u128
        );
    }
}
