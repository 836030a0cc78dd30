//! `tarn-collection`: a collection of tenant-owned vectors: the WAL, the segments, the
//! ingestion worker, checkpoints, and snapshots (taking, restoring, verifying). The only crate
//! that knows both the log and the index.

mod checkpoint;
mod collection;
mod config;
mod error;
mod failure;
mod flush;
mod fusion;
mod indexer;
mod ingestion;
mod lineage;
mod manifest;
mod memory;
mod op;
mod restore;
mod retention;
mod segments;
mod snapshot;
mod snapshot_format;
mod triggers;
mod wal_tail;

pub use collection::{
    Collection, CollectionStats, FieldSelection, ScrollPage, SearchHit, SearchRequest, TextQuery,
    MAX_PAIRS_PER_REQUEST, MAX_SCROLL_LIMIT,
};
pub use config::{
    Bm25Config, CollectionConfig, DurabilityName, HnswConfig, MetricName, QuantizationConfig,
    MAX_DIMENSION, MAX_TOP_K,
};
pub use error::{CollectionError, ErrorKind, Result};
pub use failure::ThreadFailure;
pub use fusion::{fuse, Fused, FusionMethod, Hybrid, SideHits, SideRank};
pub use lineage::{cut_log_after, CutError, COMMITTED_FILE, EPOCHS_FILE};
pub use restore::{remove_interrupted_restores, verify_snapshot, SnapshotRestore};
pub use snapshot::Snapshot;
pub use snapshot_format::SnapshotInfo;
pub use tarn_index::{
    AttributeError, Attributes, FieldSpec, FieldType, Filter, Quantization, Schema, TextAnalyzer,
    TextStats, Value, FILTER_EXACT_SCAN_MAX_MATCHES,
};
pub use tarn_wal::Durability;
pub use wal_tail::WalTail;

/// Entry points for the fuzz targets in `fuzz/` (not part of the API): each decodes untrusted
/// bytes the way recovery does and reports whether they were accepted. They must never panic.
#[doc(hidden)]
pub mod fuzzing {
    /// A checkpoint manifest file's bytes (JSON with a CRC32).
    pub fn decode_manifest(bytes: &[u8]) -> bool {
        crate::manifest::decode_checked::<crate::manifest::Manifest>(bytes).is_ok()
    }

    /// A `collection.json` file's bytes (JSON with a CRC32), validated as at open.
    pub fn decode_config(bytes: &[u8]) -> bool {
        crate::manifest::decode_checked::<crate::config::CollectionConfig>(bytes)
            .is_ok_and(|c| c.validate().is_ok())
    }

    /// A snapshot file's bytes, checked as `verify_snapshot` checks them (in chunks of 61
    /// bytes, so that fields split across pushes are exercised too).
    pub fn decode_snapshot(bytes: &[u8]) -> bool {
        let mut decoder = crate::snapshot_format::SnapshotDecoder::new();
        let mut sink = crate::snapshot_format::DiscardSink;
        bytes
            .chunks(61)
            .try_for_each(|chunk| decoder.push(chunk, &mut sink))
            .and_then(|()| decoder.finish())
            .is_ok()
    }

    /// A WAL entry's payload, decoded into an operation for a collection of `dimension`.
    pub fn decode_operation(bytes: &[u8], dimension: usize) -> bool {
        crate::op::decode(bytes, dimension).is_ok()
    }

    /// Filtered search's encodings: the first byte picks a schema, one document's attributes,
    /// a filter, or a sealed segment's attribute section (for 0 to 65,535 slots, from the next
    /// two bytes); a decoded filter is also validated against a schema decoded from the same
    /// bytes, and a decoded section answers that filter.
    pub fn decode_attributes(bytes: &[u8]) -> bool {
        let Some((&kind, rest)) = bytes.split_first() else {
            return false;
        };
        match kind % 4 {
            0 => tarn_index::Schema::decode(rest).is_ok(),
            1 => tarn_index::Attributes::decode(rest).is_ok(),
            2 => match tarn_index::Filter::decode(rest) {
                Ok(filter) => {
                    let schema = tarn_index::Schema::decode(rest)
                        .unwrap_or_else(|_| tarn_index::Schema::default());
                    let _ = filter.validate(&schema);
                    let _ = filter.matches(&tarn_index::Attributes::new());
                    true
                }
                Err(_) => false,
            },
            _ => {
                let [a, b, section @ ..] = rest else {
                    return false;
                };
                let n_slots = u32::from(u16::from_le_bytes([*a, *b]));
                tarn_index::AttributeIndex::decode_section(section, n_slots).is_ok_and(|index| {
                    let filter = tarn_index::Filter::Exists("f".to_string());
                    let _ = index.matching(&filter, n_slots);
                    true
                })
            }
        }
    }

    /// A sealed segment file's body (its CRC32 trailer is appended here, so that the parser
    /// behind the checksum is what gets fuzzed: section tables, graphs, attribute and int8
    /// sections), for a collection of dimension 4 under L2 without quantization (so that
    /// whatever codes the segment has, int8 or RaBitQ, are walked); an opened segment is
    /// searched and its figures taken.
    pub fn decode_segment(body: &[u8]) -> bool {
        let mut bytes = body.to_vec();
        bytes.extend_from_slice(&crc32fast::hash(body).to_le_bytes());
        let config = tarn_index::IndexConfig::new(4, tarn_index::Metric::L2);
        tarn_index::SealedSegment::decode(&bytes, config).is_ok_and(|segment| {
            let _ = segment.figures();
            for (user_id, _) in segment.live_documents().take(2) {
                let _ = segment.search(user_id, &[0.5, -1.0, 2.0, 0.0], 5, 16, false);
                // A TEXT field "t"'s postings, when the segment has one.
                let terms = ["common".to_string(), "word1".to_string()];
                let stats = segment.text_stats(user_id, "t", &terms);
                if let Some(weights) = tarn_index::Bm25::default().weigh(&stats) {
                    let _ = segment.text_search(user_id, "t", &terms, &weights, 5, None);
                }
            }
            true
        })
    }
}

#[cfg(test)]
mod tests {
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};
    use tarn_index::{AttributeIndex, Attributes, FieldSpec, FieldType, Filter, Schema, Value};

    /// The fuzz target's entry point over valid encodings of each kind and seeded mutations of
    /// them (truncations, bit flips, random bytes): it decides, never panics.
    #[test]
    fn the_attributes_fuzz_entry_point_accepts_valid_encodings_and_survives_mutations() {
        let schema = Schema::new(vec![
            FieldSpec::new("f", FieldType::Keyword),
            FieldSpec::new("tags", FieldType::Keywords),
            FieldSpec::new("n", FieldType::Number),
        ])
        .unwrap();
        let mut document = Attributes::new();
        document.insert("f", Value::Keyword("a".into()));
        document.insert("tags", Value::Keywords(vec!["x".into(), "y".into()]));
        document.insert("n", Value::Number(3.5));
        let filter = Filter::All(vec![
            Filter::Exists("f".into()),
            Filter::Not(Box::new(Filter::Range {
                field: "n".into(),
                gt: Some(1.0),
                gte: None,
                lt: None,
                lte: None,
            })),
        ]);
        let mut index = AttributeIndex::new(schema.clone());
        for slot in 0..5 {
            index.push(slot, &document).unwrap();
        }
        let mut section = vec![3u8, 5, 0];
        section.extend(index.encode_section());
        let valid: Vec<Vec<u8>> = vec![
            [vec![0u8], schema.encode()].concat(),
            [vec![1u8], document.encode()].concat(),
            [vec![2u8], filter.encode()].concat(),
            section,
        ];
        for bytes in &valid {
            assert!(super::fuzzing::decode_attributes(bytes), "{bytes:?}");
        }
        let mut rng = StdRng::seed_from_u64(28);
        let mut refused = 0;
        for round in 0..4_000 {
            let mut bytes = valid[round % valid.len()].clone();
            match rng.random_range(0..3) {
                0 => bytes.truncate(rng.random_range(0..bytes.len())),
                1 => {
                    let i = rng.random_range(1..bytes.len());
                    bytes[i] ^= 1 << rng.random_range(0..8);
                }
                _ => bytes = (0..rng.random_range(0..64)).map(|_| rng.random()).collect(),
            }
            if !super::fuzzing::decode_attributes(&bytes) {
                refused += 1;
            }
        }
        // Mutations are mostly refused: the decoders check, they do not guess.
        assert!(refused > 1_000, "only {refused} of 4,000 mutations refused");
    }

    /// The segment entry point over segments with a graph, attributes and int8 or RaBitQ
    /// codes, and seeded mutations of their bodies: it decides, never panics.
    #[test]
    fn the_segment_fuzz_entry_point_accepts_valid_segments_and_survives_mutations() {
        for quantization in [
            tarn_index::Quantization::Int8 { rescore: 2 },
            tarn_index::Quantization::Rabitq {
                bits: 1,
                rescore: 4,
            },
            tarn_index::Quantization::Rabitq {
                bits: 4,
                rescore: 2,
            },
        ] {
            segment_mutations(quantization);
        }
    }

    fn segment_mutations(quantization: tarn_index::Quantization) {
        let mut config = tarn_index::IndexConfig::new(4, tarn_index::Metric::L2);
        config.quantization = quantization;
        config.graph_threshold = 16;
        let n = 40usize;
        let vectors: Vec<f32> = (0..n * 4).map(|i| ((i * 37) % 23) as f32 - 11.0).collect();
        let doc_ids: Vec<u128> = (0..n as u128).collect();
        let user_ids = vec![9u128; n];
        // A keyword (attribute section), a TEXT field (stored values and postings sections)
        // and payloads.
        let schema = Schema::new(vec![
            FieldSpec::new("f", FieldType::Keyword),
            FieldSpec::new("t", FieldType::Text),
        ])
        .unwrap();
        let rows: Vec<Attributes> = (0..n)
            .map(|i| {
                let mut row = Attributes::new();
                row.insert("f", Value::Keyword(format!("k{}", i % 3)));
                row.insert(
                    "t",
                    Value::Text(format!("word{} common word{}", i % 5, i % 2)),
                );
                row.set_payload(Some(format!("{{\"i\": {i}}}")));
                row
            })
            .collect();
        let segment = tarn_index::SealedSegment::build_with_attributes(
            tarn_index::BulkDocuments {
                user_ids: &user_ids,
                doc_ids: &doc_ids,
                vectors: &vectors,
            },
            Some(tarn_index::BulkAttributes {
                schema: &schema,
                rows: &rows,
            }),
            1,
            1,
            config,
            &tarn_index::BuildConfig::default(),
        )
        .unwrap();
        assert!(segment.figures().quantized_bytes > 0);
        let encoded = segment.encode().unwrap();
        let body = &encoded[..encoded.len() - 4];
        assert!(super::fuzzing::decode_segment(body));
        // The valid body carries postings: its text search finds every document.
        let decoded = tarn_index::SealedSegment::decode(&encoded, config).unwrap();
        let terms = ["common".to_string()];
        let weights = tarn_index::Bm25::default()
            .weigh(&decoded.text_stats(9, "t", &terms))
            .unwrap();
        assert_eq!(
            decoded
                .text_search(9, "t", &terms, &weights, 100, None)
                .len(),
            n
        );
        let mut rng = StdRng::seed_from_u64(29);
        let mut refused = 0;
        for _ in 0..3_000 {
            let mut bytes = body.to_vec();
            match rng.random_range(0..3) {
                0 => bytes.truncate(rng.random_range(0..bytes.len())),
                1 => {
                    for _ in 0..rng.random_range(1..4) {
                        let i = rng.random_range(0..bytes.len());
                        bytes[i] ^= 1 << rng.random_range(0..8);
                    }
                }
                _ => {
                    let at = rng.random_range(0..bytes.len());
                    let value: u32 = rng.random();
                    let end = (at + 4).min(bytes.len());
                    bytes[at..end].copy_from_slice(&value.to_le_bytes()[..end - at]);
                }
            }
            if !super::fuzzing::decode_segment(&bytes) {
                refused += 1;
            }
        }
        assert!(refused > 500, "only {refused} of 3,000 mutations refused");
    }
}
