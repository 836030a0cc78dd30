//! Protobuf <-> domain conversions, in one place: the gRPC handlers (tarn-server) and the router,
//! which speaks the public API's messages on both sides of a fan-out, both use them.

use tarn_collection::{
    Attributes, CollectionConfig, CollectionStats, DurabilityName, FieldSelection, FieldSpec,
    FieldType, Filter, FusionMethod, HnswConfig, Hybrid, MetricName, Quantization,
    QuantizationConfig, SearchHit, SideRank, TextAnalyzer, TextQuery, TextStats, Value,
};
use tarn_proto::v1 as pb;
use tarn_wal::Durability;

use crate::status::ApiError;

pub fn id_to_u128(id: &pb::Id) -> u128 {
    (u128::from(id.high) << 64) | u128::from(id.low)
}

pub fn u128_to_id(value: u128) -> pb::Id {
    pb::Id {
        high: (value >> 64) as u64,
        low: value as u64,
    }
}

/// Search hits, (doc, user, score, selected values) best first, as the wire sends them.
pub fn hits(hits: impl Iterator<Item = (u128, u128, f32, Option<pb::Attributes>)>) -> Vec<pb::Hit> {
    hits.map(|(doc_id, user_id, score, attributes)| pb::Hit {
        doc_id: Some(u128_to_id(doc_id)),
        user_id: Some(u128_to_id(user_id)),
        score,
        attributes,
        ..Default::default()
    })
    .collect()
}

/// A local search's hits as the wire sends them.
pub fn search_hits(hits: Vec<SearchHit>) -> Vec<pb::Hit> {
    hits.into_iter()
        .map(|hit| pb::Hit {
            doc_id: Some(u128_to_id(hit.doc_id)),
            user_id: Some(u128_to_id(hit.user_id)),
            score: hit.score,
            attributes: hit
                .fields
                .as_ref()
                .map(|f| attributes_to_wire(f).unwrap_or_default()),
            vector_side: hit.vector_side.map(side_to_wire),
            text_side: hit.text_side.map(side_to_wire),
        })
        .collect()
}

pub fn side_to_wire(side: SideRank) -> pb::SideScore {
    pb::SideScore {
        rank: side.rank,
        score: side.score,
    }
}

/// A hybrid search's fusion settings from the wire (unset: RRF with k 60, weights 1); the
/// collection checks their ranges, naming `fusion.*`.
pub fn hybrid(fusion: Option<&pb::Fusion>) -> Result<Hybrid, ApiError> {
    let Some(fusion) = fusion else {
        return Ok(Hybrid::default());
    };
    let method = match pb::FusionMethod::try_from(fusion.method) {
        Ok(pb::FusionMethod::Unspecified | pb::FusionMethod::Rrf) => FusionMethod::Rrf {
            k: match fusion.rrf_k {
                0.0 => Hybrid::DEFAULT_RRF_K,
                k => k,
            },
        },
        Ok(pb::FusionMethod::RelativeScore) => FusionMethod::RelativeScore,
        Err(_) => {
            return Err(ApiError::invalid(
                "fusion.method",
                format!("unknown value {}", fusion.method),
            ))
        }
    };
    Ok(Hybrid {
        method,
        depth: fusion.depth as usize,
        vector_weight: fusion.vector_weight.unwrap_or(1.0),
        text_weight: fusion.text_weight.unwrap_or(1.0),
    })
}

/// What a search's hits return (`output_fields`, `with_payload`): nothing by default.
pub fn search_selection(output_fields: &[String], with_payload: bool) -> FieldSelection {
    FieldSelection {
        fields: output_fields.to_vec(),
        payload: with_payload,
    }
}

/// What a get's documents return: every field unless `output_fields` lists some, and the
/// payload with `with_payload`.
pub fn get_selection(output_fields: &[String], with_payload: bool) -> FieldSelection {
    FieldSelection {
        fields: match output_fields.is_empty() {
            true => vec!["*".to_string()],
            false => output_fields.to_vec(),
        },
        payload: with_payload,
    }
}

/// The version byte of a scroll cursor: `[1, user_id (16 bytes, big-endian), doc_id (16)]`.
const SCROLL_CURSOR_V1: u8 = 1;

/// A scroll's cursor on the wire: where the next page starts after.
pub fn scroll_cursor(after: Option<(u128, u128)>) -> Vec<u8> {
    match after {
        None => Vec::new(),
        Some((user_id, doc_id)) => {
            let mut bytes = Vec::with_capacity(33);
            bytes.push(SCROLL_CURSOR_V1);
            bytes.extend_from_slice(&user_id.to_be_bytes());
            bytes.extend_from_slice(&doc_id.to_be_bytes());
            bytes
        }
    }
}

/// A scroll's cursor from the wire (empty: from the start); anything else is refused naming
/// `cursor`.
pub fn scroll_after(cursor: &[u8]) -> Result<Option<(u128, u128)>, ApiError> {
    if cursor.is_empty() {
        return Ok(None);
    }
    match cursor {
        [SCROLL_CURSOR_V1, rest @ ..] if rest.len() == 32 => {
            let (user, doc) = rest.split_at(16);
            let word = |b: &[u8]| u128::from_be_bytes(b.try_into().expect("16 bytes"));
            Ok(Some((word(user), word(doc))))
        }
        _ => Err(ApiError::invalid(
            "cursor",
            "not a cursor this server gave (pass a page's next_cursor unchanged)",
        )),
    }
}

/// A scroll's page size: 0 means 100.
pub fn scroll_limit(limit: u32) -> usize {
    match limit {
        0 => 100,
        n => n as usize,
    }
}

pub fn to_ids(values: &[u128]) -> Vec<pb::Id> {
    values.iter().copied().map(u128_to_id).collect()
}

pub fn ids(ids: &[pb::Id]) -> Vec<u128> {
    ids.iter().map(id_to_u128).collect()
}

pub fn durability(value: i32) -> Result<Option<Durability>, ApiError> {
    match pb::Durability::try_from(value) {
        Ok(pb::Durability::Unspecified) => Ok(None),
        Ok(pb::Durability::Fsync) => Ok(Some(Durability::Fsync)),
        Ok(pb::Durability::Written) => Ok(Some(Durability::Written)),
        Err(_) => Err(ApiError::invalid(
            "durability",
            format!("unknown value {value}"),
        )),
    }
}

pub fn collection_config(
    request: &pb::CreateCollectionRequest,
) -> Result<CollectionConfig, ApiError> {
    let metric = match pb::Metric::try_from(request.metric) {
        Ok(pb::Metric::Cosine) => MetricName::Cosine,
        Ok(pb::Metric::L2) => MetricName::L2,
        Ok(pb::Metric::Dot) => MetricName::Dot,
        Ok(pb::Metric::Unspecified) => {
            return Err(ApiError::invalid("metric", "must be COSINE, L2 or DOT"))
        }
        Err(_) => {
            return Err(ApiError::invalid(
                "metric",
                format!("unknown value {}", request.metric),
            ))
        }
    };
    let mut config = CollectionConfig::new(request.dimension as usize, metric);
    if let Some(hnsw) = &request.hnsw {
        let defaults = HnswConfig::default();
        let or_default = |v: u32, d: usize| if v == 0 { d } else { v as usize };
        config.hnsw = HnswConfig {
            m: or_default(hnsw.m, defaults.m),
            ef_construction: or_default(hnsw.ef_construction, defaults.ef_construction),
            ef_search: or_default(hnsw.ef_search, defaults.ef_search),
        };
    }
    config.default_durability = match durability(request.default_durability)? {
        None | Some(Durability::Fsync) => DurabilityName::Fsync,
        Some(Durability::Written) => DurabilityName::Written,
    };
    config.fields = field_specs(&request.fields)?;
    config.quantization = quantization(request.quantization.as_ref())?;
    // Without a quantization: refused by `validate`, naming vectors_on_disk.
    config.vectors_on_disk = request.vectors_on_disk;
    if let Some(bm25) = &request.bm25 {
        config.bm25.k1 = bm25.k1.unwrap_or(config.bm25.k1);
        config.bm25.b = bm25.b.unwrap_or(config.bm25.b);
    }
    // Bad rescores are refused by `validate` when the collection is created.
    // Bad names, repeats, too many fields: refused here, before a cluster records the config.
    config.schema()?;
    Ok(config)
}

/// The quantization a CreateCollection asks for (none when unset; rescore 0 = the default).
fn quantization(request: Option<&pb::Quantization>) -> Result<QuantizationConfig, ApiError> {
    let Some(request) = request else {
        return Ok(QuantizationConfig::None);
    };
    let rescore = |default: usize| match request.rescore {
        0 => Ok(default),
        n if n as usize > Quantization::MAX_RESCORE => Err(ApiError::invalid(
            "quantization.rescore",
            format!("must be at most {}, got {n}", Quantization::MAX_RESCORE),
        )),
        n => Ok(n as usize),
    };
    match pb::QuantizationKind::try_from(request.kind) {
        Ok(pb::QuantizationKind::QuantizationNone) => Ok(QuantizationConfig::None),
        Ok(pb::QuantizationKind::QuantizationInt8) => Ok(QuantizationConfig::Int8 {
            rescore: rescore(Quantization::DEFAULT_RESCORE)?,
        }),
        Ok(pb::QuantizationKind::QuantizationRabitq) => {
            let bits = match request.bits {
                0 => 1,
                n if n <= u32::from(Quantization::MAX_RABITQ_BITS) => n as u8,
                n => {
                    return Err(ApiError::invalid(
                        "quantization.bits",
                        format!(
                            "must be from 1 to {} (0 = 1), got {n}",
                            Quantization::MAX_RABITQ_BITS
                        ),
                    ))
                }
            };
            Ok(QuantizationConfig::Rabitq {
                bits,
                rescore: rescore(Quantization::default_rabitq_rescore(bits))?,
            })
        }
        Err(_) => Err(ApiError::invalid(
            "quantization.kind",
            format!("unknown value {}", request.kind),
        )),
    }
}

fn quantization_to_wire(config: QuantizationConfig) -> pb::Quantization {
    match config {
        QuantizationConfig::None => pb::Quantization {
            kind: pb::QuantizationKind::QuantizationNone as i32,
            bits: 0,
            rescore: 0,
        },
        QuantizationConfig::Int8 { rescore } => pb::Quantization {
            kind: pb::QuantizationKind::QuantizationInt8 as i32,
            bits: 0,
            rescore: rescore as u32,
        },
        QuantizationConfig::Rabitq { bits, rescore } => pb::Quantization {
            kind: pb::QuantizationKind::QuantizationRabitq as i32,
            bits: u32::from(bits),
            rescore: rescore as u32,
        },
    }
}

/// A collection's info; `fields` are its declared fields now (`Collection::schema`, which
/// follows `add_fields`; the config's are as of open).
pub fn collection_info(
    name: &str,
    config: &CollectionConfig,
    fields: &[FieldSpec],
    stats: &CollectionStats,
) -> pb::CollectionInfo {
    pb::CollectionInfo {
        name: name.to_owned(),
        dimension: config.dimension as u32,
        metric: match config.metric {
            MetricName::Cosine => pb::Metric::Cosine,
            MetricName::L2 => pb::Metric::L2,
            MetricName::Dot => pb::Metric::Dot,
        } as i32,
        hnsw: Some(pb::HnswParams {
            m: config.hnsw.m as u32,
            ef_construction: config.hnsw.ef_construction as u32,
            ef_search: config.hnsw.ef_search as u32,
        }),
        default_durability: match config.default_durability {
            DurabilityName::Fsync => pb::Durability::Fsync,
            DurabilityName::Written => pb::Durability::Written,
        } as i32,
        n_documents: stats.n_documents,
        last_seq_no: stats.last_appended_seq,
        applied_seq_no: stats.applied_seq,
        checkpoint_seq_no: stats.checkpoint_seq,
        bytes_on_disk: stats.bytes_on_disk,
        durable_seq_no: stats.durable_seq,
        n_sealed_segments: stats.n_sealed_segments as u32,
        n_removed_not_compacted: stats.n_removed_not_compacted,
        n_tenants: stats.n_tenants as u32,
        n_unindexed: stats.n_unindexed,
        shards: 1,
        shard_key: pb::ShardKey::User as i32,
        replication_factor: 1,
        min_in_sync: 1,
        fields: fields_to_wire(fields),
        quantization: Some(quantization_to_wire(config.quantization)),
        memory_bytes: stats.memory_bytes,
        vectors_on_disk: config.vectors_on_disk,
        cold_bytes: stats.cold_bytes,
        bm25: Some(pb::Bm25Params {
            k1: Some(config.bm25.k1),
            b: Some(config.bm25.b),
        }),
    }
}

/// A name as error messages show it: verbatim up to 80 bytes, then cut (it ends up in a gRPC
/// status header).
fn shown(name: &str) -> String {
    const SHOWN_BYTES: usize = 80;
    if name.len() <= SHOWN_BYTES {
        return name.to_owned();
    }
    let mut end = SHOWN_BYTES;
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &name[..end])
}

/// Declared fields from the wire (`fields` of CreateCollection and AddFields). Names are checked
/// by the schema, not here; the type must be one of the five.
pub fn field_specs(fields: &[pb::FieldSpec]) -> Result<Vec<FieldSpec>, ApiError> {
    fields
        .iter()
        .map(|spec| {
            let field_type = match pb::FieldType::try_from(spec.r#type) {
                Ok(pb::FieldType::Keyword) => FieldType::Keyword,
                Ok(pb::FieldType::Keywords) => FieldType::Keywords,
                Ok(pb::FieldType::Number) => FieldType::Number,
                Ok(pb::FieldType::Bool) => FieldType::Bool,
                Ok(pb::FieldType::Text) => FieldType::Text,
                Ok(pb::FieldType::Unspecified) => {
                    return Err(ApiError::invalid(
                        "fields",
                        format!(
                            "field {:?}: type must be KEYWORD, KEYWORDS, NUMBER, BOOL or TEXT",
                            shown(&spec.name)
                        ),
                    ))
                }
                Err(_) => {
                    return Err(ApiError::invalid(
                        "fields",
                        format!(
                            "field {:?}: unknown type {}",
                            shown(&spec.name),
                            spec.r#type
                        ),
                    ))
                }
            };
            let analyzer = spec
                .analyzer
                .as_ref()
                .map_or_else(TextAnalyzer::default, |a| TextAnalyzer {
                    english_stemmer: a.english_stemmer,
                    english_stop_words: a.english_stop_words,
                });
            Ok(FieldSpec {
                analyzer,
                ..FieldSpec::new(spec.name.clone(), field_type)
            })
        })
        .collect()
}

/// A search's full-text query from the wire.
pub fn text_query(text: &Option<pb::TextQuery>) -> Option<TextQuery> {
    text.as_ref().map(|text| TextQuery {
        field: text.field.clone(),
        query: text.query.clone(),
        stats: text.stats.as_ref().map(text_stats),
    })
}

pub fn text_stats(stats: &pb::TextStats) -> TextStats {
    TextStats {
        n_docs: stats.n_docs,
        total_len: stats.total_len,
        doc_freqs: stats.doc_freqs.clone(),
    }
}

pub fn text_stats_to_wire(stats: &TextStats) -> pb::TextStats {
    pb::TextStats {
        n_docs: stats.n_docs,
        total_len: stats.total_len,
        doc_freqs: stats.doc_freqs.clone(),
    }
}

pub fn field_type_to_wire(field_type: FieldType) -> pb::FieldType {
    match field_type {
        FieldType::Keyword => pb::FieldType::Keyword,
        FieldType::Keywords => pb::FieldType::Keywords,
        FieldType::Number => pb::FieldType::Number,
        FieldType::Bool => pb::FieldType::Bool,
        FieldType::Text => pb::FieldType::Text,
    }
}

pub fn fields_to_wire(fields: &[FieldSpec]) -> Vec<pb::FieldSpec> {
    fields
        .iter()
        .map(|spec| pb::FieldSpec {
            name: spec.name.clone(),
            r#type: field_type_to_wire(spec.field_type) as i32,
            analyzer: (!spec.analyzer.is_default()).then_some(pb::TextAnalyzer {
                english_stemmer: spec.analyzer.english_stemmer,
                english_stop_words: spec.analyzer.english_stop_words,
            }),
        })
        .collect()
}

/// `InsertRequest.attributes` from the wire: structure only (every value has a kind, numbers
/// are finite); the collection checks them against its fields. Errors name the document and
/// the attribute field.
pub fn attributes(documents: &[pb::Attributes]) -> Result<Vec<Attributes>, ApiError> {
    documents
        .iter()
        .enumerate()
        .map(|(doc_idx, document)| document_attributes(doc_idx, document))
        .collect()
}

fn document_attributes(doc_idx: usize, document: &pb::Attributes) -> Result<Attributes, ApiError> {
    let mut attributes = Attributes::new();
    for (name, value) in &document.values {
        let problem = |what: &str| {
            ApiError::invalid(
                "attributes",
                format!("document {doc_idx}: field {:?} {what}", shown(name)),
            )
        };
        let value = match &value.kind {
            None => return Err(problem("has no value (Value.kind is not set)")),
            Some(pb::value::Kind::Keyword(keyword)) => Value::Keyword(keyword.clone()),
            Some(pb::value::Kind::Keywords(list)) => Value::Keywords(list.values.clone()),
            Some(pb::value::Kind::Number(number)) if !number.is_finite() => {
                return Err(problem("has a NaN or infinite number"))
            }
            Some(pb::value::Kind::Number(number)) => Value::Number(*number),
            Some(pb::value::Kind::Boolean(boolean)) => Value::Bool(*boolean),
            Some(pb::value::Kind::Text(text)) => Value::Text(text.clone()),
        };
        attributes.insert(name.clone(), value);
    }
    if !document.payload.is_empty() {
        attributes.set_payload(Some(document.payload.clone()));
    }
    Ok(attributes)
}

/// One document's attributes for the wire (None when it has none).
pub fn attributes_to_wire(attributes: &Attributes) -> Option<pb::Attributes> {
    if attributes.is_empty() {
        return None;
    }
    let values = attributes
        .iter()
        .map(|(name, value)| {
            let kind = match value {
                Value::Keyword(keyword) => pb::value::Kind::Keyword(keyword.clone()),
                Value::Keywords(keywords) => pb::value::Kind::Keywords(pb::KeywordList {
                    values: keywords.clone(),
                }),
                Value::Number(number) => pb::value::Kind::Number(*number),
                Value::Bool(boolean) => pb::value::Kind::Boolean(*boolean),
                Value::Text(text) => pb::value::Kind::Text(text.clone()),
            };
            (name.to_owned(), pb::Value { kind: Some(kind) })
        })
        .collect();
    Some(pb::Attributes {
        values,
        payload: attributes.payload().unwrap_or_default().to_string(),
    })
}

/// A filter from the wire (`filter` of Search and Remove): structure only (every node has a
/// kind, bounds are not NaN, at most 32 levels and 1,024 nodes, counted before anything
/// deeper is read); the collection checks fields and types against its schema.
pub fn filter(filter: &pb::Filter) -> Result<Filter, ApiError> {
    let mut n_nodes = 0;
    filter_node(filter, 1, &mut n_nodes)
}

fn filter_node(filter: &pb::Filter, depth: usize, n_nodes: &mut usize) -> Result<Filter, ApiError> {
    if depth > Filter::MAX_DEPTH {
        return Err(ApiError::invalid(
            "filter",
            format!("nested deeper than {} levels", Filter::MAX_DEPTH),
        ));
    }
    *n_nodes += 1;
    if *n_nodes > Filter::MAX_NODES {
        return Err(ApiError::invalid(
            "filter",
            format!("more than {} nodes", Filter::MAX_NODES),
        ));
    }
    let children = |list: &pb::FilterList, n_nodes: &mut usize| {
        list.filters
            .iter()
            .map(|child| filter_node(child, depth + 1, n_nodes))
            .collect::<Result<Vec<_>, _>>()
    };
    Ok(match &filter.kind {
        None => {
            return Err(ApiError::invalid(
                "filter",
                "a Filter has no kind: set one of all, any, not, match, range, exists",
            ))
        }
        Some(pb::filter::Kind::All(list)) => Filter::All(children(list, n_nodes)?),
        Some(pb::filter::Kind::Any(list)) => Filter::Any(children(list, n_nodes)?),
        Some(pb::filter::Kind::Not(child)) => {
            Filter::Not(Box::new(filter_node(child, depth + 1, n_nodes)?))
        }
        Some(pb::filter::Kind::Match(matching)) => Filter::Match {
            field: matching.field.clone(),
            any_of: matching.any_of.clone(),
            boolean: matching.boolean,
        },
        Some(pb::filter::Kind::Range(range)) => {
            let bounds = [range.gt, range.gte, range.lt, range.lte];
            if bounds.iter().flatten().any(|bound| bound.is_nan()) {
                return Err(ApiError::invalid(
                    "filter",
                    format!("Range on field {:?} has a NaN bound", shown(&range.field)),
                ));
            }
            Filter::Range {
                field: range.field.clone(),
                gt: range.gt,
                gte: range.gte,
                lt: range.lt,
                lte: range.lte,
            }
        }
        Some(pb::filter::Kind::Exists(field)) => Filter::Exists(field.clone()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip() {
        for value in [0u128, 1, u64::MAX as u128, (7u128 << 64) | 9, u128::MAX] {
            assert_eq!(id_to_u128(&u128_to_id(value)), value);
        }
    }

    fn refused(error: ApiError) -> (&'static str, String) {
        match error {
            ApiError::InvalidArgument { field, reason } => (field, reason),
            other => panic!("not INVALID_ARGUMENT: {other}"),
        }
    }

    fn exists(field: &str) -> pb::Filter {
        pb::Filter {
            kind: Some(pb::filter::Kind::Exists(field.into())),
        }
    }

    #[test]
    fn filters_convert_and_bad_ones_are_refused_naming_the_filter() {
        let wire = pb::Filter {
            kind: Some(pb::filter::Kind::All(pb::FilterList {
                filters: vec![
                    pb::Filter {
                        kind: Some(pb::filter::Kind::Match(pb::Match {
                            field: "section".into(),
                            any_of: vec!["python".into()],
                            boolean: None,
                        })),
                    },
                    pb::Filter {
                        kind: Some(pb::filter::Kind::Not(Box::new(pb::Filter {
                            kind: Some(pb::filter::Kind::Range(pb::Range {
                                field: "size".into(),
                                gte: Some(100.0),
                                ..Default::default()
                            })),
                        }))),
                    },
                    exists("tags"),
                ],
            })),
        };
        assert_eq!(
            filter(&wire).unwrap(),
            Filter::All(vec![
                Filter::Match {
                    field: "section".into(),
                    any_of: vec!["python".into()],
                    boolean: None,
                },
                Filter::Not(Box::new(Filter::Range {
                    field: "size".into(),
                    gt: None,
                    gte: Some(100.0),
                    lt: None,
                    lte: None,
                })),
                Filter::Exists("tags".into()),
            ])
        );

        let (field, reason) = refused(filter(&pb::Filter::default()).unwrap_err());
        assert_eq!(field, "filter");
        assert!(reason.contains("no kind"), "{reason}");

        let nan = pb::Filter {
            kind: Some(pb::filter::Kind::Range(pb::Range {
                field: "size".into(),
                lt: Some(f64::NAN),
                ..Default::default()
            })),
        };
        let (field, reason) = refused(filter(&nan).unwrap_err());
        assert_eq!(field, "filter");
        assert!(
            reason.contains("\"size\"") && reason.contains("NaN"),
            "{reason}"
        );

        // 33 levels: refused before the 33rd is read; 32 are fine.
        let mut deep = exists("a");
        for _ in 1..32 {
            deep = pb::Filter {
                kind: Some(pb::filter::Kind::Not(Box::new(deep))),
            };
        }
        assert!(filter(&deep).is_ok());
        let deeper = pb::Filter {
            kind: Some(pb::filter::Kind::Not(Box::new(deep))),
        };
        let (_, reason) = refused(filter(&deeper).unwrap_err());
        assert!(reason.contains("deeper than 32"), "{reason}");

        let wide = pb::Filter {
            kind: Some(pb::filter::Kind::Any(pb::FilterList {
                filters: vec![exists("a"); 1024],
            })),
        };
        let (_, reason) = refused(filter(&wide).unwrap_err());
        assert!(reason.contains("1024 nodes"), "{reason}");
    }

    #[test]
    fn attributes_and_fields_convert_and_bad_ones_name_the_document_and_field() {
        let mut document = pb::Attributes::default();
        for (name, kind) in [
            ("section", pb::value::Kind::Keyword("python".into())),
            (
                "tags",
                pb::value::Kind::Keywords(pb::KeywordList {
                    values: vec!["a".into(), "b".into()],
                }),
            ),
            ("size", pb::value::Kind::Number(12.5)),
            ("essential", pb::value::Kind::Boolean(true)),
        ] {
            document
                .values
                .insert(name.into(), pb::Value { kind: Some(kind) });
        }
        let converted = attributes(std::slice::from_ref(&document)).unwrap();
        assert_eq!(converted[0].len(), 4);
        assert_eq!(
            converted[0].get("size"),
            Some(&tarn_collection::Value::Number(12.5))
        );
        assert_eq!(attributes_to_wire(&converted[0]), Some(document.clone()));
        assert_eq!(attributes_to_wire(&Attributes::new()), None);

        let mut no_kind = document.clone();
        no_kind.values.insert("x".into(), pb::Value { kind: None });
        let (field, reason) = refused(attributes(&[document.clone(), no_kind]).unwrap_err());
        assert_eq!(field, "attributes");
        assert!(
            reason.starts_with("document 1: field \"x\"") && reason.contains("no value"),
            "{reason}"
        );
        let mut nan = document;
        nan.values.insert(
            "size".into(),
            pb::Value {
                kind: Some(pb::value::Kind::Number(f64::NAN)),
            },
        );
        let (_, reason) = refused(attributes(&[nan]).unwrap_err());
        assert!(
            reason.contains("\"size\"") && reason.contains("NaN"),
            "{reason}"
        );

        let spec = |name: &str, r#type: i32| pb::FieldSpec {
            name: name.into(),
            r#type,
            ..Default::default()
        };
        let fields = field_specs(&[
            spec("section", 1),
            spec("tags", 2),
            spec("n", 3),
            spec("b", 4),
        ])
        .unwrap();
        assert_eq!(fields_to_wire(&fields)[3], spec("b", 4));
        for bad in [0, 9, -1] {
            let (field, reason) = refused(field_specs(&[spec("size", bad)]).unwrap_err());
            assert_eq!(field, "fields");
            assert!(reason.contains("\"size\""), "{reason}");
        }
    }
}
