//! Sealed segments: immutable vectors and graphs in tarn's own checksummed file format, searched
//! by tarn's own HNSW loop (`flat_graph.rs`). Only their tombstones change, kept in a separate
//! small file per checkpoint. Byte layout: `docs/SEGMENT_FORMAT.md`.
//!
//! Each partition keeps its documents' attributes (an [`AttributeIndex`] by slot, written as an
//! optional section of the partition: format version 2); a segment of version 1 opens as one
//! whose documents have no attributes.
//!
//! A partition with a graph of a quantized collection also keeps codes of its vectors, int8
//! ([`Quantization::Int8`]) or RaBitQ ([`Quantization::Rabitq`]) (an optional section each: an
//! older reader skips it and walks the full vectors).
//! The graph search walks the codes and rescores its best `k x rescore` candidates on the full
//! vectors, so returned distances are exact. Codes are made when a partition is sealed, merged
//! or rebuilt, and when a segment written without them opens in such a collection.

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::attribute_index::{AttributeIndex, SlotSet};
use crate::attributes::{Attributes, Schema};
use crate::bitset::AtomicBitset;
use crate::builder::{build_graph, BuildConfig};
use crate::bytes::{ByteReader, ByteWriter};
use crate::cold::{FirstError, SegmentFile, StoredVectors};
use crate::config::IndexConfig;
use crate::error::{IndexError, Result};
use crate::filter::Filter;
use crate::filtered::{filtered_top_k, plan};
use crate::flat_graph::{Candidate, FlatGraph, Walk, WalkDensity};
use crate::fulltext::{text_hits, TermWeights, TextStats};
use crate::metric::Metric;
use crate::mutable::MutableSegment;
use crate::quantized::{Codes, Int8Codes, Quantization};
use crate::rabitq::RabitqCodes;
use crate::search::{exact_top_k, to_hits, Hit};
use crate::simd::prefetch;
use crate::stored::StoredColumn;

const SEGMENT_MAGIC: &[u8; 8] = b"TARNSEG1";
const TOMBSTONE_MAGIC: &[u8; 8] = b"TARNTMB1";
/// The version `encode` writes: 2 added each partition's table of optional sections.
const FORMAT_VERSION: u32 = 2;
/// Version 1: partitions without a section table (opened as having no attributes).
const FORMAT_VERSION_NO_SECTIONS: u32 = 1;
/// Section kind: the partition's attribute index (`AttributeIndex::encode_section`).
const SECTION_ATTRIBUTES: u16 = 1;
/// Section kind: the partition's int8 codes (`Int8Codes::encode_section`). Optional: the full
/// vectors are still in the partition.
const SECTION_INT8: u16 = 2;
/// Section kind: the partition's RaBitQ codes (`RabitqCodes::encode_section`). Optional, as
/// int8's.
const SECTION_RABITQ: u16 = 3;
/// Section flag: a reader that does not know the section's kind must refuse the file (the
/// section changes what the partition means). Sections without it are skipped when unknown.
const SECTION_REQUIRED: u16 = 1;
/// Section kind 4: the partition's stored values (TEXT values and payloads; `stored.rs`).
const SECTION_STORED: u16 = 4;
/// Section kind 5: the inverted indexes of the partition's TEXT fields (`fulltext.rs`).
/// Optional: a partition without it (written before full text existed) builds them from its
/// stored values when it opens.
const SECTION_POSTINGS: u16 = 5;
/// Why sealing a mutable segment cannot fail where a rebuild of sealed ones can: the mutable
/// segment's stored values are in memory, so carrying them reads no file.
const IN_MEMORY: &str =
    "a mutable segment's stored values are in memory: carrying them cannot fail";
/// The most sections one partition may list.
const MAX_SECTIONS: usize = 64;
/// Cache lines of a vector prefetched before its distance is computed: all of it, up to 2 KiB
/// (measured: docs/benchmarks/sealed-search.md, "What each step bought").
const PREFETCH_MAX_LINES: usize = 32;
/// What an hnsw_rs insert costs against one by tarn's builder, same vector, same M and
/// ef_construction: 32 s against 7 s for minilm-debian's 60,733 x 384 on 2 threads
/// (docs/BENCHMARKS.md, "Index build"), rounded down. Sealing rebuilds a partition whose
/// unindexed tail is at least `1 / HNSW_RS_INSERT_COST` of it.
const HNSW_RS_INSERT_COST: f64 = 4.0;

/// Where each partition's vectors start in a segment file: `(user_id, byte offset)`.
/// Where things start in an encoded segment: each partition's vectors, and each stored
/// section (tenant, offset, length).
#[derive(Debug, Default)]
struct FileOffsets {
    vectors: Vec<(u128, u64)>,
    stored: Vec<(u128, u64, usize)>,
}

/// One tenant's part of a sealed segment.
#[derive(Debug)]
pub(crate) struct SealedPartition {
    /// The full vectors by slot: in memory, or left in the segment file (`cold.rs`).
    vectors: StoredVectors,
    /// By slot.
    doc_ids: Vec<u128>,
    /// `(doc_id, slot)` of the documents live at sealing, sorted by doc id.
    doc_index: Vec<(u128, u32)>,
    tombstones: AtomicBitset,
    graph: Option<FlatGraph>,
    /// The attributes by slot (an index of no fields when the partition has none).
    attributes: AttributeIndex,
    /// Int8 codes of every slot, walked by the graph search instead of `vectors` (only with a
    /// graph, in a collection with [`Quantization::Int8`]).
    codes: Option<Codes>,
}

impl SealedPartition {
    /// A partition of `doc_ids` (sorted, one per slot) and their vectors and attributes, every
    /// one live.
    fn new_live(
        vectors: Vec<f32>,
        doc_ids: Vec<u128>,
        graph: Option<FlatGraph>,
        attributes: AttributeIndex,
    ) -> Self {
        let n = doc_ids.len();
        SealedPartition {
            vectors: StoredVectors::Memory(vectors),
            doc_index: doc_ids
                .iter()
                .enumerate()
                .map(|(slot, d)| (*d, slot as u32))
                .collect(),
            doc_ids,
            tombstones: AtomicBitset::from_words(vec![0; AtomicBitset::words_for(n)]),
            graph,
            attributes,
            codes: None,
        }
    }

    /// Live slots: those not tombstoned (every slot a partition does not list as a live
    /// document is tombstoned).
    fn n_live_slots(&self) -> usize {
        self.n_slots().saturating_sub(self.tombstones.count())
    }

    /// The live slots whose attributes match `filter`, exactly.
    fn live_matches(&self, filter: &Filter) -> SlotSet {
        let n_slots = self.n_slots() as u32;
        let dead = SlotSet::from_words(self.tombstones.snapshot());
        self.attributes
            .matching(filter, n_slots)
            .and(&dead.not(n_slots))
    }

    fn n_slots(&self) -> usize {
        self.doc_ids.len()
    }

    fn slot_of(&self, doc_id: u128) -> Option<u32> {
        let idx = self
            .doc_index
            .binary_search_by_key(&doc_id, |(d, _)| *d)
            .ok()?;
        let slot = self.doc_index[idx].1;
        (!self.tombstones.get(slot as usize)).then_some(slot)
    }

    fn n_live(&self) -> usize {
        self.doc_index
            .iter()
            .filter(|(_, slot)| !self.tombstones.get(*slot as usize))
            .count()
    }

    /// The metric's distance from `query` to slot `slot`'s full vector (read from the file
    /// when cold).
    #[inline]
    fn distance(&self, metric: Metric, query: &[f32], slot: u32) -> Result<f32> {
        self.vectors
            .with(slot, query.len(), |vector| metric.distance(query, vector))
    }

    /// Slot `slot`'s full vector.
    fn vector(&self, slot: u32, dim: usize) -> Result<Vec<f32>> {
        self.vectors.with(slot, dim, <[f32]>::to_vec)
    }

    fn memory_bytes(&self) -> usize {
        self.vectors.memory_bytes()
            + self.doc_ids.len() * 16
            + self.doc_index.len() * 32
            + self.n_slots().div_ceil(8)
            + self.graph.as_ref().map_or(0, FlatGraph::memory_bytes)
            + self.codes.as_ref().map_or(0, Codes::memory_bytes)
            + self.attributes.stored_memory_bytes()
            + self.attributes.text_memory_bytes()
    }

    /// Makes the codes `quantization` asks for when the partition has a graph and lacks them
    /// (or has codes of another kind).
    fn quantize(&mut self, quantization: Quantization, dim: usize) {
        if self.graph.is_none() || self.codes.as_ref().is_some_and(|c| c.serve(quantization)) {
            return;
        }
        if let Some(vectors) = self.vectors.in_memory() {
            self.codes = Codes::encode(quantization, vectors, dim);
        }
    }

    /// Approximate nearest slots through the graph (which the partition must have), nearest
    /// first, with exact distances: on the full vectors, or on the quantized codes with the
    /// best `k x rescore` then rescored on the full vectors (read from the file when cold).
    #[allow(clippy::too_many_arguments)]
    fn graph_search(
        &self,
        graph: &FlatGraph,
        query: &[f32],
        config: &IndexConfig,
        k: usize,
        ef: usize,
        accept: impl Fn(u32) -> bool,
        walk: Walk,
        density: &mut WalkDensity,
    ) -> Result<Vec<Candidate>> {
        let dim = config.dimension;
        let metric = config.metric;
        let failure = FirstError::default();
        let exact = |slot: u32| failure.distance(self.distance(metric, query, slot));
        let Some(codes) = &self.codes else {
            let found = graph.search(
                k,
                ef,
                exact,
                |slot| {
                    if let Some(vectors) = self.vectors.in_memory() {
                        prefetch(&vectors[slot as usize * dim..][..dim], PREFETCH_MAX_LINES)
                    }
                },
                accept,
                walk,
                density,
            );
            return failure.into_result(found);
        };
        let rescore = config
            .quantization
            .rescore()
            .unwrap_or_else(|| codes.default_rescore());
        let wanted = k.saturating_mul(rescore.max(1));
        let prepared = codes.query(query, metric);
        let mut found = graph.search(
            wanted,
            ef.max(wanted),
            |slot| prepared.distance(slot),
            |slot| prefetch(prepared.codes_of(slot), PREFETCH_MAX_LINES),
            accept,
            walk,
            density,
        );
        for candidate in &mut found {
            candidate.distance = exact(candidate.node);
        }
        failure.into_result(())?;
        found.sort_unstable();
        found.truncate(k);
        Ok(found)
    }

    /// Leaves the vectors in `file`, at `offset`, where they were written, when the partition
    /// walks codes (a graph and quantized codes): only the rescored candidates are read back.
    fn make_cold(&mut self, dim: usize, file: &Arc<SegmentFile>, offset: u64) {
        if self.graph.is_some() && self.codes.is_some() {
            self.vectors.make_cold(dim, Arc::clone(file), offset);
        }
    }
}

/// An immutable segment: every tenant partition sealed at one checkpoint (or by a rebuild).
#[derive(Debug)]
pub struct SealedSegment {
    id: u64,
    /// The last sequence number whose effects this segment's vectors include.
    max_seq: u64,
    config: IndexConfig,
    partitions: HashMap<u128, SealedPartition>,
    /// Tombstones set since the last `write_tombstones`.
    tombstones_dirty: AtomicBool,
}

/// Documents to build a sealed segment from (`SealedSegment::build`): row `i` is the vector
/// `vectors[i * dimension..(i + 1) * dimension]` of document `doc_ids[i]` of tenant
/// `user_ids[i]`. Vectors are as users send them: the build prepares them for the metric (unit
/// length under cosine). A `(tenant, document)` given twice keeps its last row, as upserts
/// applied in row order would.
#[derive(Debug, Clone, Copy)]
pub struct BulkDocuments<'a> {
    pub user_ids: &'a [u128],
    pub doc_ids: &'a [u128],
    pub vectors: &'a [f32],
}

/// The attributes of [`BulkDocuments`]' rows (`SealedSegment::build_with_attributes`): `rows`
/// is empty (no document has attributes) or holds row `i`'s attributes at `i`, each valid for
/// `schema`.
#[derive(Debug, Clone, Copy)]
pub struct BulkAttributes<'a> {
    pub schema: &'a Schema,
    pub rows: &'a [Attributes],
}

/// Size and shape figures for stats and benchmarks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SegmentFigures {
    pub n_slots: usize,
    pub n_live: usize,
    pub n_tombstoned: usize,
    pub memory_bytes: usize,
    /// Bytes beyond the raw vectors of the slots (graph, ids, maps, bitmaps, codes).
    pub index_bytes: usize,
    /// Of `memory_bytes`, the quantized codes with their ranges and corrections.
    pub quantized_bytes: usize,
    /// Of `memory_bytes`, the TEXT fields' inverted indexes.
    pub text_index_bytes: usize,
    /// Bytes of full vectors left in the segment file (`vectors_on_disk`), not in memory.
    pub cold_bytes: usize,
}

impl SealedSegment {
    fn assemble(
        id: u64,
        max_seq: u64,
        config: IndexConfig,
        mut partitions: HashMap<u128, SealedPartition>,
    ) -> Self {
        for partition in partitions.values_mut() {
            partition.quantize(config.quantization, config.dimension);
            // Sealed partitions never change their attributes: ranges use sorted columns.
            partition.attributes.freeze();
        }
        SealedSegment {
            id,
            max_seq,
            config,
            partitions,
            tombstones_dirty: AtomicBool::new(false),
        }
    }

    pub fn id(&self) -> u64 {
        self.id
    }

    pub fn max_seq(&self) -> u64 {
        self.max_seq
    }

    /// Seals a mutable segment. Partitions with a graph keep all their slots (tombstoned ones
    /// stay in the graph, marked); partitions without one keep only their live vectors.
    pub fn seal(mutable: &MutableSegment, id: u64, max_seq: u64) -> SealedSegment {
        Self::seal_compacting(mutable, id, max_seq, f64::INFINITY, &BuildConfig::default())
    }

    /// Like `seal`, but a partition gets a fresh graph over its live vectors from tarn's
    /// builder (`build` threads) instead of its hnsw_rs graph when that is cheaper or better:
    /// - its share of superseded or removed slots exceeds `rebuild_dead_fraction` (as `rebuild`
    ///   would give it right after sealing), so an upsert-heavy partition is not first indexed,
    ///   exported and written with its dead slots only to be rebuilt;
    /// - or the tail hnsw_rs has not indexed yet is at least `1 / HNSW_RS_INSERT_COST` of its
    ///   live documents: finishing the tail with hnsw_rs would cost more than building the
    ///   whole partition (a load that outran the indexer).
    pub fn seal_compacting(
        mutable: &MutableSegment,
        id: u64,
        max_seq: u64,
        rebuild_dead_fraction: f64,
        build: &BuildConfig,
    ) -> SealedSegment {
        let config = *mutable.config();
        let dim = config.dimension;
        let is_dead_heavy = |data: &crate::mutable::MutableData| {
            let n = data.doc_ids.len();
            n > 0 && (n - data.by_doc.len()) as f64 / n as f64 > rebuild_dead_fraction
        };
        let is_tail_heavy = |data: &crate::mutable::MutableData| {
            let tail = data.doc_ids.len() - data.indexed;
            data.by_doc.len() >= config.graph_threshold
                && tail as f64 * HNSW_RS_INSERT_COST >= data.by_doc.len() as f64
        };
        let mut partitions = HashMap::new();
        for (user_id, partition) in mutable.partitions() {
            {
                let data = partition.data.read();
                if data.by_doc.is_empty() {
                    continue;
                }
                if is_dead_heavy(&data) || is_tail_heavy(&data) {
                    // Copied out: the graph build takes seconds, and holding the read lock that
                    // long would block removals from this (frozen) partition, and behind them
                    // every search of it.
                    let live: Vec<(u128, Vec<f32>, u32)> = data
                        .by_doc
                        .iter()
                        .map(|(d, s)| {
                            let vector = data.vectors[*s as usize * dim..][..dim].to_vec();
                            (*d, vector, *s)
                        })
                        .collect();
                    let attributes = data.attributes.clone();
                    drop(data);
                    let live = live
                        .iter()
                        .map(|(d, v, slot)| LiveDocument {
                            doc_id: *d,
                            vector: v.as_slice(),
                            attributes: &attributes,
                            slot: *slot,
                        })
                        .collect();
                    let schema = attributes.schema().clone();
                    let partition = build_partition(live, schema, &config, build).expect(IN_MEMORY);
                    partitions.insert(user_id, partition);
                    continue;
                }
            }
            // The graph must hold the whole partition before it is exported.
            mutable.index_partition(&partition, usize::MAX);
            let data = partition.data.read();
            let mut doc_index: Vec<(u128, u32)> =
                data.by_doc.iter().map(|(d, s)| (*d, *s)).collect();
            let exported = data.graph.as_ref().and_then(|graph| {
                let by_doc = &data.by_doc;
                let live: std::collections::HashSet<u32> = by_doc.values().copied().collect();
                graph.export(data.doc_ids.len(), |n| live.contains(&n))
            });
            let sealed = match exported {
                Some((graph, reconnected)) => {
                    if reconnected > 0 {
                        tracing::info!(reconnected, "reconnected unreachable nodes while sealing");
                    }
                    doc_index.sort_unstable();
                    let n_slots = data.doc_ids.len();
                    SealedPartition {
                        vectors: StoredVectors::Memory(graph_vectors(
                            std::iter::once(&data.vectors[..]),
                            data.vectors.len(),
                        )),
                        doc_ids: data.doc_ids.clone(),
                        doc_index,
                        tombstones: AtomicBitset::from_words(
                            data.tombstones.clone().into_words(n_slots),
                        ),
                        graph: Some(graph),
                        attributes: data.attributes.clone(),
                        codes: None,
                    }
                }
                None => compact_partition(&doc_index, &data.attributes, |slot| {
                    &data.vectors[slot as usize * dim..(slot as usize + 1) * dim]
                })
                .expect(IN_MEMORY),
            };
            partitions.insert(user_id, sealed);
        }
        SealedSegment::assemble(id, max_seq, config, partitions)
    }

    /// Builds a fresh segment from the live documents of `sources` (merging several, or
    /// rebuilding one with many tombstones). Graphs are rebuilt from scratch by tarn's builder
    /// (`build` threads).
    ///
    /// Cold vectors are read whole, one source partition at a time (an error if a read fails
    /// or a checksum does not match): a rebuild holds the vectors it builds from in memory.
    pub fn rebuild(
        sources: &[&SealedSegment],
        id: u64,
        config: IndexConfig,
        build: &BuildConfig,
    ) -> Result<SealedSegment> {
        let dim = config.dimension;
        let max_seq = sources.iter().map(|s| s.max_seq).max().unwrap_or(0);
        // Fields are only ever appended, so the longest schema extends every other one.
        let schema = sources
            .iter()
            .flat_map(|source| source.partitions.values())
            .map(|partition| partition.attributes.schema())
            .max_by_key(|schema| schema.len())
            .cloned()
            .unwrap_or_default();
        let mut vectors_by_partition = Vec::new();
        for source in sources {
            for (user_id, partition) in &source.partitions {
                vectors_by_partition.push((*user_id, partition, partition.vectors.all()?));
            }
        }
        let mut by_user: HashMap<u128, Vec<LiveDocument<'_>>> = HashMap::new();
        for (user_id, partition, vectors) in &vectors_by_partition {
            let live = by_user.entry(*user_id).or_default();
            for &(doc_id, slot) in &partition.doc_index {
                if !partition.tombstones.get(slot as usize) {
                    live.push(LiveDocument {
                        doc_id,
                        vector: &vectors[slot as usize * dim..][..dim],
                        attributes: &partition.attributes,
                        slot,
                    });
                }
            }
        }
        let partitions = by_user
            .into_iter()
            .filter(|(_, live)| !live.is_empty())
            .map(|(user_id, live)| {
                let partition = build_partition(live, schema.clone(), &config, build)?;
                Ok((user_id, partition))
            })
            .collect::<Result<_>>()?;
        Ok(SealedSegment::assemble(id, max_seq, config, partitions))
    }

    /// Builds a segment from raw documents with tarn's own parallel HNSW builder (`builder.rs`,
    /// `build` threads, `config.hnsw`'s M and ef_construction): one partition per tenant, with a
    /// graph when it holds at least `config.graph_threshold` documents, searched exactly
    /// otherwise, exactly as a sealed mutable segment would be. Slots are in doc id order and
    /// no slot is tombstoned.
    pub fn build(
        documents: BulkDocuments<'_>,
        id: u64,
        max_seq: u64,
        config: IndexConfig,
        build: &BuildConfig,
    ) -> Result<SealedSegment> {
        Self::build_with_attributes(documents, None, id, max_seq, config, build)
    }

    /// `build` with the rows' attributes (`None`: no attributes, as `build`). Every row's
    /// attributes must be valid for the schema; the first invalid one is an
    /// [`IndexError::InvalidInput`] naming the row and the field.
    pub fn build_with_attributes(
        documents: BulkDocuments<'_>,
        attributes: Option<BulkAttributes<'_>>,
        id: u64,
        max_seq: u64,
        config: IndexConfig,
        build: &BuildConfig,
    ) -> Result<SealedSegment> {
        let dim = config.dimension;
        let n_rows = documents.doc_ids.len();
        if dim == 0
            || documents.user_ids.len() != n_rows
            || Some(documents.vectors.len()) != n_rows.checked_mul(dim)
        {
            return Err(IndexError::InvalidInput(format!(
                "{} tenant ids, {} document ids and {} values for dimension {dim}",
                documents.user_ids.len(),
                n_rows,
                documents.vectors.len()
            )));
        }
        let (schema, attribute_rows) = match attributes {
            Some(attributes) => (attributes.schema.clone(), attributes.rows),
            None => (Schema::default(), &[][..]),
        };
        if !attribute_rows.is_empty() && attribute_rows.len() != n_rows {
            return Err(IndexError::InvalidInput(format!(
                "{} attribute rows for {n_rows} documents",
                attribute_rows.len()
            )));
        }
        for (row, row_attributes) in attribute_rows.iter().enumerate() {
            schema.validate(row_attributes).map_err(|error| {
                IndexError::InvalidInput(format!("the attributes of row {row}: {error}"))
            })?;
        }
        let mut rows_by_user: HashMap<u128, Vec<u32>> = HashMap::new();
        for (row, user_id) in documents.user_ids.iter().enumerate() {
            rows_by_user.entry(*user_id).or_default().push(row as u32);
        }
        let mut partitions = HashMap::with_capacity(rows_by_user.len());
        for (user_id, mut rows) in rows_by_user {
            // Doc id order; of rows with the same doc id (kept in row order by the stable
            // sort), the last one.
            rows.sort_by_key(|&row| documents.doc_ids[row as usize]);
            let mut live: Vec<u32> = Vec::with_capacity(rows.len());
            for row in rows {
                match live.last_mut() {
                    Some(last)
                        if documents.doc_ids[*last as usize] == documents.doc_ids[row as usize] =>
                    {
                        *last = row
                    }
                    _ => live.push(row),
                }
            }
            let n = live.len();
            let mut vectors = if n >= config.graph_threshold {
                crate::simd::huge_page_vec(n * dim)
            } else {
                Vec::with_capacity(n * dim)
            };
            for &row in &live {
                let start = vectors.len();
                vectors.extend_from_slice(&documents.vectors[row as usize * dim..][..dim]);
                let vector = &mut vectors[start..];
                if !vector.iter().all(|x| x.is_finite()) || !config.metric.prepare(vector) {
                    return Err(IndexError::InvalidInput(format!(
                        "the vector of document {} of tenant {user_id} is not finite or has \
                         zero length under cosine",
                        documents.doc_ids[row as usize]
                    )));
                }
            }
            let graph = (n >= config.graph_threshold)
                .then(|| build_graph(&vectors, dim, config.metric, &config.hnsw, build))
                .flatten();
            let doc_ids: Vec<u128> = live
                .iter()
                .map(|&row| documents.doc_ids[row as usize])
                .collect();
            let mut partition_attributes = AttributeIndex::new(schema.clone());
            if !attribute_rows.is_empty() {
                for (slot, &row) in (0u32..).zip(&live) {
                    partition_attributes
                        .push(slot, &attribute_rows[row as usize])
                        .map_err(|error| IndexError::InvalidInput(error.to_string()))?;
                }
            }
            let partition =
                SealedPartition::new_live(vectors, doc_ids, graph, partition_attributes);
            partitions.insert(user_id, partition);
        }
        Ok(SealedSegment::assemble(id, max_seq, config, partitions))
    }

    /// `build`, then `write` to `path` (durably): returns the segment and the file's size.
    pub fn build_to_file(
        path: &Path,
        documents: BulkDocuments<'_>,
        id: u64,
        max_seq: u64,
        config: IndexConfig,
        build: &BuildConfig,
    ) -> Result<(SealedSegment, u64)> {
        Self::build_to_file_with_attributes(path, documents, None, id, max_seq, config, build)
    }

    /// `build_with_attributes`, then `write` to `path` (durably): returns the segment and the
    /// file's size.
    pub fn build_to_file_with_attributes(
        path: &Path,
        documents: BulkDocuments<'_>,
        attributes: Option<BulkAttributes<'_>>,
        id: u64,
        max_seq: u64,
        config: IndexConfig,
        build: &BuildConfig,
    ) -> Result<(SealedSegment, u64)> {
        let mut segment =
            Self::build_with_attributes(documents, attributes, id, max_seq, config, build)?;
        let bytes = segment.write(path)?;
        Ok((segment, bytes))
    }

    /// Live `(user_id, doc_id)` pairs.
    pub fn live_documents(&self) -> impl Iterator<Item = (u128, u128)> + '_ {
        self.partitions.iter().flat_map(|(user_id, partition)| {
            partition
                .doc_index
                .iter()
                .filter(|(_, slot)| !partition.tombstones.get(*slot as usize))
                .map(move |(doc_id, _)| (*user_id, *doc_id))
        })
    }

    /// Marks `(user_id, doc_id)` removed here; returns true if it was live here.
    pub fn tombstone(&self, user_id: u128, doc_id: u128) -> bool {
        let Some(partition) = self.partitions.get(&user_id) else {
            return false;
        };
        let Some(slot) = partition.slot_of(doc_id) else {
            return false;
        };
        let newly = partition.tombstones.set(slot as usize);
        if newly {
            self.tombstones_dirty.store(true, Ordering::Release);
        }
        newly
    }

    pub fn contains(&self, user_id: u128, doc_id: u128) -> bool {
        self.partitions
            .get(&user_id)
            .is_some_and(|p| p.slot_of(doc_id).is_some())
    }

    /// The stored vector of a live document (`None` when it is not live here); an error when
    /// a cold vector cannot be read or fails its checksum.
    pub fn get(&self, user_id: u128, doc_id: u128) -> Result<Option<Vec<f32>>> {
        let Some(partition) = self.partitions.get(&user_id) else {
            return Ok(None);
        };
        let Some(slot) = partition.slot_of(doc_id) else {
            return Ok(None);
        };
        partition.vector(slot, self.config.dimension).map(Some)
    }

    /// The stored vector and the attributes of a live document, its stored values too with
    /// `stored` (as `get`).
    pub fn get_with_attributes(
        &self,
        user_id: u128,
        doc_id: u128,
        stored: bool,
    ) -> Result<Option<(Vec<f32>, Attributes)>> {
        let Some(partition) = self.partitions.get(&user_id) else {
            return Ok(None);
        };
        let Some(slot) = partition.slot_of(doc_id) else {
            return Ok(None);
        };
        let vector = partition.vector(slot, self.config.dimension)?;
        Ok(Some((
            vector,
            partition.attributes.document_of(slot, stored)?,
        )))
    }

    /// The attributes of a live document, without its vector (`None` when it is not live
    /// here); its stored values (TEXT values, payload) too with `stored`, read from the file
    /// for a written segment: an error when they cannot be read or fail their checksum.
    pub fn document(
        &self,
        user_id: u128,
        doc_id: u128,
        stored: bool,
    ) -> Result<Option<Attributes>> {
        let Some(partition) = self.partitions.get(&user_id) else {
            return Ok(None);
        };
        match partition.slot_of(doc_id) {
            Some(slot) => partition.attributes.document_of(slot, stored).map(Some),
            None => Ok(None),
        }
    }

    /// The live documents of one tenant whose attributes match `filter`, in no order.
    pub fn matching_documents(&self, user_id: u128, filter: &Filter) -> Vec<u128> {
        let Some(partition) = self.partitions.get(&user_id) else {
            return Vec::new();
        };
        partition
            .live_matches(filter)
            .iter()
            .map(|slot| partition.doc_ids[slot as usize])
            .collect()
    }

    /// Nearest live documents of one tenant, nearest first; an error when a cold vector cannot
    /// be read or fails its checksum.
    pub fn search(
        &self,
        user_id: u128,
        query: &[f32],
        k: usize,
        ef: usize,
        exact: bool,
    ) -> Result<Vec<Hit>> {
        self.search_filtered(user_id, query, k, ef, exact, None)
    }

    /// Nearest live documents of one tenant whose attributes match `filter` (all when `None`),
    /// nearest first: `min(k, matching live documents)` of them, always (`filtered.rs`).
    /// Validate the filter against the schema first (it recurses once per level).
    pub fn search_filtered(
        &self,
        user_id: u128,
        query: &[f32],
        k: usize,
        ef: usize,
        exact: bool,
        filter: Option<&Filter>,
    ) -> Result<Vec<Hit>> {
        let Some(partition) = self.partitions.get(&user_id) else {
            return Ok(Vec::new());
        };
        let metric = self.config.metric;
        let failure = FirstError::default();
        let distance = |slot: u32| failure.distance(partition.distance(metric, query, slot));
        if let Some(filter) = filter {
            let matches = partition.live_matches(filter);
            let n_matches = matches.count();
            let graph = partition.graph.as_ref();
            let n_live = partition.n_live_slots();
            let plan = plan(n_matches, n_live, k, ef, graph.is_some(), exact);
            let graph_search = |ef: usize, walk: Walk, density: &mut WalkDensity| match graph {
                Some(graph) => partition
                    .graph_search(
                        graph,
                        query,
                        &self.config,
                        k,
                        ef,
                        // Tombstones set since the matches were taken count too.
                        |slot| matches.contains(slot) && !partition.tombstones.get(slot as usize),
                        walk,
                        density,
                    )
                    .unwrap_or_else(|error| {
                        failure.distance(Err(error));
                        Vec::new()
                    }),
                None => Vec::new(),
            };
            let candidates =
                filtered_top_k(&matches, n_matches, n_live, k, plan, graph_search, distance);
            return failure.into_result(to_hits(user_id, candidates, &partition.doc_ids));
        }
        let candidates = match (&partition.graph, exact) {
            (Some(graph), false) => partition.graph_search(
                graph,
                query,
                &self.config,
                k,
                ef,
                |slot| !partition.tombstones.get(slot as usize),
                Walk::All,
                &mut WalkDensity::default(),
            )?,
            _ => exact_top_k(
                partition
                    .doc_index
                    .iter()
                    .map(|(_, slot)| *slot)
                    .filter(|slot| !partition.tombstones.get(*slot as usize)),
                k,
                distance,
            ),
        };
        failure.into_result(to_hits(user_id, candidates, &partition.doc_ids))
    }

    /// BM25 statistics of one tenant's live documents here (as `MutableSegment::text_stats`).
    pub fn text_stats(&self, user_id: u128, field: &str, terms: &[String]) -> TextStats {
        let Some(partition) = self.partitions.get(&user_id) else {
            return TextStats::default();
        };
        let Some(column) = partition.attributes.text_column(field) else {
            return TextStats::default();
        };
        column.stats(terms, &SlotSet::from_words(partition.tombstones.snapshot()))
    }

    /// The best live documents of one tenant for a text query (as
    /// `MutableSegment::text_search`).
    pub fn text_search(
        &self,
        user_id: u128,
        field: &str,
        terms: &[String],
        weights: &TermWeights,
        k: usize,
        filter: Option<&Filter>,
    ) -> Vec<Hit> {
        let Some(partition) = self.partitions.get(&user_id) else {
            return Vec::new();
        };
        let Some(column) = partition.attributes.text_column(field) else {
            return Vec::new();
        };
        let matches = filter.map(|filter| partition.live_matches(filter));
        // Tombstones set since the matches were taken count too.
        let accept = |slot: u32| {
            matches.as_ref().is_none_or(|m| m.contains(slot))
                && !partition.tombstones.get(slot as usize)
        };
        let doc_ids = &partition.doc_ids;
        text_hits(user_id, column, terms, weights, k, accept, doc_ids)
    }

    pub fn live_counts(&self) -> HashMap<u128, u64> {
        self.partitions
            .iter()
            .map(|(u, p)| (*u, p.n_live() as u64))
            .filter(|(_, n)| *n > 0)
            .collect()
    }

    pub fn figures(&self) -> SegmentFigures {
        let mut figures = SegmentFigures::default();
        let mut vector_bytes = 0;
        for partition in self.partitions.values() {
            figures.n_slots += partition.n_slots();
            figures.n_live += partition.n_live();
            figures.n_tombstoned += partition.tombstones.count();
            figures.memory_bytes += partition.memory_bytes();
            figures.quantized_bytes += partition.codes.as_ref().map_or(0, Codes::memory_bytes);
            figures.text_index_bytes += partition.attributes.text_memory_bytes();
            figures.cold_bytes += partition.vectors.cold_bytes();
            if !partition.vectors.is_cold() {
                vector_bytes += partition.vectors.n_values() * 4;
            }
        }
        figures.index_bytes = figures.memory_bytes - vector_bytes;
        figures
    }

    /// Bytes cold reads have asked of this segment's file since it was opened or written.
    pub fn cold_bytes_read(&self) -> u64 {
        self.cold_file().map_or(0, |file| file.bytes_read())
    }

    /// Drops this segment's file from the page cache (`POSIX_FADV_DONTNEED`) when it has cold
    /// vectors, so that the next cold reads go to the disk: for benchmarks of cold searches.
    pub fn evict_cold_vectors(&self) -> Result<()> {
        match self.cold_file() {
            Some(file) => file.evict(),
            None => Ok(()),
        }
    }

    fn cold_file(&self) -> Option<&Arc<SegmentFile>> {
        self.partitions
            .values()
            .find_map(|partition| partition.vectors.file())
    }

    /// Share of slots that are tombstoned (0 for an empty segment).
    pub fn tombstone_fraction(&self) -> f64 {
        let figures = self.figures();
        if figures.n_slots == 0 {
            0.0
        } else {
            figures.n_tombstoned as f64 / figures.n_slots as f64
        }
    }

    pub fn tombstones_dirty(&self) -> bool {
        self.tombstones_dirty.load(Ordering::Acquire)
    }

    /// Encodes the segment (vectors, ids, graphs, the tombstones at sealing and the attributes)
    /// with a CRC32 trailer over everything before it. Cold vectors are read back (an error if
    /// that fails).
    pub fn encode(&self) -> Result<Vec<u8>> {
        Ok(self.encode_version(FORMAT_VERSION)?.0)
    }

    /// `encode` in format `version`: 2, or 1 (no section table; for tests of old files, and
    /// only for segments without attributes). Also returns where each partition's vectors
    /// start in the bytes.
    fn encode_version(&self, version: u32) -> Result<(Vec<u8>, FileOffsets)> {
        let mut offsets = FileOffsets::default();
        let mut out = ByteWriter::default();
        out.bytes.extend_from_slice(SEGMENT_MAGIC);
        out.u32(version);
        out.u32(self.config.dimension as u32);
        out.u8(self.config.metric.code());
        out.u64(self.id);
        out.u64(self.max_seq);
        let mut users: Vec<&u128> = self.partitions.keys().collect();
        users.sort_unstable();
        out.u32(users.len() as u32);
        for user_id in users {
            let p = &self.partitions[user_id];
            out.u128(*user_id);
            out.u32(p.n_slots() as u32);
            out.u32(p.doc_index.len() as u32);
            offsets.vectors.push((*user_id, out.bytes.len() as u64));
            out.f32s(&p.vectors.all()?);
            for doc_id in &p.doc_ids {
                out.u128(*doc_id);
            }
            for (doc_id, slot) in &p.doc_index {
                out.u128(*doc_id);
                out.u32(*slot);
            }
            out.u64s(&p.tombstones.snapshot());
            match &p.graph {
                Some(graph) => {
                    out.u8(1);
                    graph.write(&mut out);
                }
                None => out.u8(0),
            }
            if version == FORMAT_VERSION_NO_SECTIONS {
                debug_assert!(
                    p.attributes.schema().is_empty(),
                    "version 1 has no attributes"
                );
                continue;
            }
            let mut sections: Vec<(u16, u16, Vec<u8>)> = Vec::new();
            if !p.attributes.schema().is_empty() {
                let section = p.attributes.encode_section();
                sections.push((SECTION_ATTRIBUTES, SECTION_REQUIRED, section));
            }
            match &p.codes {
                Some(Codes::Int8(codes)) => {
                    sections.push((SECTION_INT8, 0, codes.encode_section()))
                }
                Some(Codes::Rabitq(codes)) => {
                    sections.push((SECTION_RABITQ, 0, codes.encode_section()))
                }
                None => {}
            }
            if p.attributes.has_stored() {
                let section = p.attributes.encode_stored_section()?;
                sections.push((SECTION_STORED, SECTION_REQUIRED, section));
            }
            if p.attributes.has_text_fields() {
                let section = p.attributes.encode_postings_section(p.n_slots() as u32);
                sections.push((SECTION_POSTINGS, 0, section));
            }
            out.u32(sections.len() as u32);
            for (kind, flags, bytes) in &sections {
                out.u16(*kind);
                out.u16(*flags);
                out.u64(bytes.len() as u64);
            }
            for (kind, _, bytes) in sections {
                if kind == SECTION_STORED {
                    offsets
                        .stored
                        .push((*user_id, out.bytes.len() as u64, bytes.len()));
                }
                out.bytes.extend_from_slice(&bytes);
            }
        }
        let crc = crc32fast::hash(&out.bytes);
        out.u32(crc);
        Ok((out.bytes, offsets))
    }

    /// Writes the segment file durably (temp file, fsync, rename, directory fsync). With
    /// `config.vectors_on_disk`, the vectors of partitions that walk quantized codes are then
    /// left in the file (`cold.rs`) and their memory freed.
    pub fn write(&mut self, path: &Path) -> Result<u64> {
        let (bytes, offsets) = self.encode_version(FORMAT_VERSION)?;
        crate::fsutil::write_durably(path, &bytes)
            .map_err(|e| IndexError::io("write segment", path, e))?;
        if self.config.vectors_on_disk {
            self.leave_vectors_in(path, &offsets.vectors)?;
        }
        self.leave_stored_in(path, &bytes, &offsets.stored)?;
        Ok(bytes.len() as u64)
    }

    /// Leaves the stored values of every partition in the file just written at `path` (`bytes`
    /// are its contents; `stored` where each partition's section is): what stays in memory is
    /// their offsets and checksums.
    fn leave_stored_in(
        &mut self,
        path: &Path,
        bytes: &[u8],
        stored: &[(u128, u64, usize)],
    ) -> Result<()> {
        if stored.is_empty() {
            return Ok(());
        }
        let file = SegmentFile::open(path)?;
        for &(user_id, offset, len) in stored {
            let Some(partition) = self.partitions.get_mut(&user_id) else {
                continue;
            };
            let section = &bytes[offset as usize..offset as usize + len];
            let n_slots = partition.n_slots() as u32;
            let column = StoredColumn::decode_section(section, n_slots, Some((&file, offset)))?;
            partition.attributes.set_stored(column, n_slots);
        }
        Ok(())
    }

    /// Makes cold the in-memory vectors of the partitions that walk codes, which are at
    /// `vector_offsets` of the file at `path`.
    fn leave_vectors_in(&mut self, path: &Path, vector_offsets: &[(u128, u64)]) -> Result<()> {
        let goes_cold = |p: &SealedPartition| p.graph.is_some() && p.codes.is_some();
        if !self.partitions.values().any(goes_cold) {
            return Ok(());
        }
        let file = SegmentFile::open(path)?;
        let dim = self.config.dimension;
        for (user_id, offset) in vector_offsets {
            if let Some(partition) = self.partitions.get_mut(user_id) {
                partition.make_cold(dim, &file, *offset);
            }
        }
        Ok(())
    }

    /// Opens a segment file, checking its checksum and that it belongs to `config`'s collection.
    /// With `config.vectors_on_disk`, the vectors of partitions that walk quantized codes stay
    /// in the file (the whole file is read once, to check it and to checksum each vector).
    pub fn open(path: &Path, config: IndexConfig) -> Result<SealedSegment> {
        let bytes = std::fs::read(path).map_err(|e| IndexError::io("read segment", path, e))?;
        // Stored values always stay in the file; vectors only with `vectors_on_disk`.
        let file = SegmentFile::open(path)?;
        let vector_file = config.vectors_on_disk.then_some(&file);
        Self::decode_from(&bytes, config, vector_file, Some(&file)).map_err(|e| match e {
            IndexError::Format(reason) => IndexError::Corrupt {
                path: path.to_owned(),
                reason,
            },
            IndexError::Mismatch { reason, .. } => IndexError::Mismatch {
                path: path.to_owned(),
                reason,
            },
            other => other,
        })
    }

    /// Decodes a segment's bytes, its vectors in memory.
    pub fn decode(bytes: &[u8], config: IndexConfig) -> Result<SealedSegment> {
        Self::decode_from(bytes, config, None, None)
    }

    /// `decode` of the bytes of a segment file: with `file`, the vectors of partitions that walk
    /// codes stay in it; with `stored_file`, the partitions' stored values do.
    fn decode_from(
        bytes: &[u8],
        config: IndexConfig,
        file: Option<&Arc<SegmentFile>>,
        stored_file: Option<&Arc<SegmentFile>>,
    ) -> Result<SealedSegment> {
        let body = check_trailer(bytes)?;
        let mut input = ByteReader::new(body);
        if input.take(8, "magic")? != SEGMENT_MAGIC {
            return Err(IndexError::Format("not a tarn segment (bad magic)".into()));
        }
        let version = input.u32("version")?;
        if version != FORMAT_VERSION && version != FORMAT_VERSION_NO_SECTIONS {
            return Err(IndexError::Format(format!(
                "unsupported segment version {version}"
            )));
        }
        let dimension = input.u32("dimension")? as usize;
        let metric = Metric::from_code(input.u8("metric")?);
        if dimension != config.dimension || metric != Some(config.metric) {
            return Err(IndexError::Mismatch {
                path: Default::default(),
                reason: format!("segment has dimension {dimension} and metric {metric:?}"),
            });
        }
        let id = input.u64("segment id")?;
        let max_seq = input.u64("max seq")?;
        let n_partitions = input.u32("partition count")? as usize;
        let mut partitions = HashMap::with_capacity(n_partitions.min(1 << 16));
        let mut vector_offsets = Vec::with_capacity(n_partitions.min(1 << 16));
        for _ in 0..n_partitions {
            let user_id = input.u128("user id")?;
            let n_slots = input.u32("slot count")? as usize;
            let n_indexed = input.u32("doc index count")? as usize;
            if n_indexed > n_slots {
                return Err(IndexError::Format(
                    "more indexed documents than slots".into(),
                ));
            }
            let n_values = n_slots
                .checked_mul(dimension)
                .ok_or_else(|| IndexError::Format("slot count overflows".into()))?;
            let vector_offset = input.offset() as u64;
            let vector_bytes = n_values
                .checked_mul(4)
                .ok_or_else(|| IndexError::Format("slot count overflows".into()))?;
            let vector_block = input.take(vector_bytes, "vectors")?;
            let doc_ids = input.u128s(n_slots, "doc ids")?;
            let mut doc_index = Vec::with_capacity(n_indexed);
            for _ in 0..n_indexed {
                let doc_id = input.u128("doc index id")?;
                let slot = input.u32("doc index slot")?;
                if slot as usize >= n_slots {
                    return Err(IndexError::Format("doc index slot out of range".into()));
                }
                doc_index.push((doc_id, slot));
            }
            if !doc_index.windows(2).all(|w| w[0].0 < w[1].0) {
                return Err(IndexError::Format("doc index not sorted".into()));
            }
            let tombstones = input.u64s(AtomicBitset::words_for(n_slots), "tombstones")?;
            let graph = match input.u8("graph flag")? {
                0 => None,
                1 => Some(FlatGraph::read(&mut input, n_slots)?),
                other => return Err(IndexError::Format(format!("bad graph flag {other}"))),
            };
            let Sections { attributes, codes } = if version == FORMAT_VERSION_NO_SECTIONS {
                Sections::default()
            } else {
                read_sections(&mut input, n_slots, dimension, stored_file)?
            };
            if codes.is_some() && graph.is_none() {
                return Err(IndexError::Format(
                    "quantized codes in a partition without a graph".into(),
                ));
            }
            // Codes of another kind than the collection's are made again in `assemble`.
            let codes = codes.filter(|codes| codes.serve(config.quantization));
            let vectors = match file {
                Some(file) if codes.is_some() => StoredVectors::cold_from_bytes(
                    vector_block,
                    dimension,
                    Arc::clone(file),
                    vector_offset,
                ),
                _ => {
                    StoredVectors::Memory(ByteReader::new(vector_block).f32s(n_values, "vectors")?)
                }
            };
            vector_offsets.push((user_id, vector_offset));
            let previous = partitions.insert(
                user_id,
                SealedPartition {
                    vectors,
                    doc_ids,
                    doc_index,
                    tombstones: AtomicBitset::from_words(tombstones),
                    graph,
                    attributes,
                    codes,
                },
            );
            if previous.is_some() {
                return Err(IndexError::Format(format!(
                    "tenant {user_id} has two partitions"
                )));
            }
        }
        if input.remaining() != 0 {
            return Err(IndexError::Format(
                "trailing bytes after the partitions".into(),
            ));
        }
        let mut segment = SealedSegment::assemble(id, max_seq, config, partitions);
        // Partitions written without codes got them in `assemble`: theirs go cold now.
        if let Some(file) = file {
            for (user_id, offset) in vector_offsets {
                if let Some(partition) = segment.partitions.get_mut(&user_id) {
                    partition.make_cold(dimension, file, offset);
                }
            }
        }
        Ok(segment)
    }

    /// Encodes every partition's tombstones (with a CRC32 trailer) and clears the dirty flag.
    pub fn encode_tombstones(&self) -> Vec<u8> {
        self.tombstones_dirty.store(false, Ordering::Release);
        let mut out = ByteWriter::default();
        out.bytes.extend_from_slice(TOMBSTONE_MAGIC);
        out.u64(self.id);
        let mut users: Vec<&u128> = self.partitions.keys().collect();
        users.sort_unstable();
        out.u32(users.len() as u32);
        for user_id in users {
            let words = self.partitions[user_id].tombstones.snapshot();
            out.u128(*user_id);
            out.u32(words.len() as u32);
            out.u64s(&words);
        }
        let crc = crc32fast::hash(&out.bytes);
        out.u32(crc);
        out.bytes
    }

    /// Sets the tombstones recorded in a tombstone file (they only ever add to the segment's).
    pub fn apply_tombstones(&self, path: &Path) -> Result<()> {
        let bytes = std::fs::read(path).map_err(|e| IndexError::io("read tombstones", path, e))?;
        let corrupt = |reason: String| IndexError::Corrupt {
            path: path.to_owned(),
            reason,
        };
        let body = check_trailer(&bytes).map_err(|e| corrupt(e.to_string()))?;
        let mut input = ByteReader::new(body);
        let parse = |input: &mut ByteReader<'_>| -> Result<Vec<(u128, Vec<u64>)>> {
            if input.take(8, "magic")? != TOMBSTONE_MAGIC {
                return Err(IndexError::Format("not a tarn tombstone file".into()));
            }
            if input.u64("segment id")? != self.id {
                return Err(IndexError::Format("tombstones of another segment".into()));
            }
            let n = input.u32("partition count")? as usize;
            let mut all = Vec::new();
            for _ in 0..n {
                let user_id = input.u128("user id")?;
                let n_words = input.u32("word count")? as usize;
                all.push((user_id, input.u64s(n_words, "tombstone words")?));
            }
            Ok(all)
        };
        let all = parse(&mut input).map_err(|e| corrupt(e.to_string()))?;
        for (user_id, words) in all {
            let Some(partition) = self.partitions.get(&user_id) else {
                return Err(corrupt(format!(
                    "tombstones for a tenant the segment does not hold: {user_id}"
                )));
            };
            for (word_idx, word) in words.iter().enumerate() {
                for bit in 0..64 {
                    if word & (1 << bit) != 0 {
                        let slot = word_idx * 64 + bit;
                        if slot >= partition.n_slots() {
                            return Err(corrupt("tombstone past the last slot".into()));
                        }
                        partition.tombstones.set(slot);
                    }
                }
            }
        }
        Ok(())
    }
}

/// A copy of a graph partition's vectors in memory backed by huge pages where the kernel allows
/// (`simd::huge_page_vec`; what `open` gives them too).
fn graph_vectors<'a>(parts: impl Iterator<Item = &'a [f32]>, len: usize) -> Vec<f32> {
    let mut copy = crate::simd::huge_page_vec(len);
    parts.for_each(|part| copy.extend_from_slice(part));
    copy
}

/// One live document going into a rebuilt partition: its vector (prepared for the metric) and
/// where its attributes are (`slot` of `attributes`).
struct LiveDocument<'a> {
    doc_id: u128,
    vector: &'a [f32],
    attributes: &'a AttributeIndex,
    slot: u32,
}

/// A partition over `live` (one tenant's documents, in any order, each once): a fresh graph
/// from tarn's builder when there are enough of them, an exactly searched list otherwise;
/// slots in doc id order, attributes carried over under `schema` (which must extend every
/// source's).
fn build_partition(
    mut live: Vec<LiveDocument<'_>>,
    schema: Schema,
    config: &IndexConfig,
    build: &BuildConfig,
) -> Result<SealedPartition> {
    live.sort_unstable_by_key(|document| document.doc_id);
    let doc_ids: Vec<u128> = live.iter().map(|document| document.doc_id).collect();
    let attributes = AttributeIndex::gather_slots(
        schema,
        live.iter()
            .map(|document| (document.attributes, document.slot)),
    )?;
    if live.len() < config.graph_threshold {
        let vectors = live
            .iter()
            .flat_map(|document| document.vector.iter().copied())
            .collect();
        return Ok(SealedPartition::new_live(
            vectors, doc_ids, None, attributes,
        ));
    }
    let vectors = graph_vectors(
        live.iter().map(|document| document.vector),
        live.len() * config.dimension,
    );
    drop(live);
    let graph = build_graph(
        &vectors,
        config.dimension,
        config.metric,
        &config.hnsw,
        build,
    );
    Ok(SealedPartition::new_live(
        vectors, doc_ids, graph, attributes,
    ))
}

/// A partition without a graph: live documents only, renumbered in doc id order, with their
/// attributes.
fn compact_partition<'a>(
    doc_index: &[(u128, u32)],
    attributes: &AttributeIndex,
    vector: impl Fn(u32) -> &'a [f32],
) -> Result<SealedPartition> {
    let mut sorted = doc_index.to_vec();
    sorted.sort_unstable();
    let vectors = sorted
        .iter()
        .flat_map(|(_, slot)| vector(*slot).iter().copied())
        .collect();
    let doc_ids: Vec<u128> = sorted.iter().map(|(d, _)| *d).collect();
    let old_slots: Vec<u32> = sorted.iter().map(|(_, slot)| *slot).collect();
    Ok(SealedPartition::new_live(
        vectors,
        doc_ids,
        None,
        attributes.remap(&old_slots)?,
    ))
}

/// What a partition's sections hold.
struct Sections {
    /// An index of no fields when there is no attribute section.
    attributes: AttributeIndex,
    codes: Option<Codes>,
}

impl Default for Sections {
    fn default() -> Self {
        Sections {
            attributes: AttributeIndex::new(Schema::default()),
            codes: None,
        }
    }
}

/// Reads a partition's section table and sections (format version 2). Each kind at most once;
/// an unknown kind is skipped unless flagged required, which refuses the file.
fn read_sections(
    input: &mut ByteReader<'_>,
    n_slots: usize,
    dimension: usize,
    stored_file: Option<&Arc<SegmentFile>>,
) -> Result<Sections> {
    let n_sections = input.u32("section count")? as usize;
    if n_sections > MAX_SECTIONS {
        return Err(IndexError::Format(format!(
            "{n_sections} sections in a partition, at most {MAX_SECTIONS}"
        )));
    }
    let mut table = Vec::with_capacity(n_sections);
    for _ in 0..n_sections {
        let kind = input.u16("section kind")?;
        let flags = input.u16("section flags")?;
        let len = input.u64("section length")?;
        if table.iter().any(|&(seen, _, _)| seen == kind) {
            return Err(IndexError::Format(format!(
                "section kind {kind} appears twice"
            )));
        }
        table.push((kind, flags, len));
    }
    let mut sections = Sections::default();
    let mut stored = None;
    let mut postings = None;
    for (kind, flags, len) in table {
        let len = usize::try_from(len)
            .map_err(|_| IndexError::Format(format!("section length {len} overflows")))?;
        let at = input.offset() as u64;
        let bytes = input.take(len, "section")?;
        match kind {
            SECTION_STORED => {
                let file = stored_file.map(|file| (file, at));
                stored = Some(StoredColumn::decode_section(bytes, n_slots as u32, file)?);
            }
            SECTION_POSTINGS => postings = Some(bytes),
            SECTION_ATTRIBUTES => {
                let index =
                    AttributeIndex::decode_section(bytes, n_slots as u32).map_err(|error| {
                        IndexError::Format(format!("attribute section: {}", format_reason(error)))
                    })?;
                sections.attributes = index;
            }
            SECTION_INT8 => {
                let codes =
                    Int8Codes::decode_section(bytes, n_slots, dimension).map_err(|error| {
                        IndexError::Format(format!("int8 section: {}", format_reason(error)))
                    })?;
                if sections.codes.replace(Codes::Int8(codes)).is_some() {
                    return Err(IndexError::Format("two kinds of codes".into()));
                }
            }
            SECTION_RABITQ => {
                let codes =
                    RabitqCodes::decode_section(bytes, n_slots, dimension).map_err(|error| {
                        IndexError::Format(format!("RaBitQ section: {}", format_reason(error)))
                    })?;
                if sections.codes.replace(Codes::Rabitq(codes)).is_some() {
                    return Err(IndexError::Format("two kinds of codes".into()));
                }
            }
            _ if flags & SECTION_REQUIRED != 0 => {
                return Err(IndexError::Format(format!(
                    "required section of unknown kind {kind} (written by a newer tarn)"
                )));
            }
            _ => {}
        }
    }
    // After the attribute section, wherever the table put it.
    if let Some(stored) = stored {
        sections.attributes.set_stored(stored, n_slots as u32);
    }
    match postings {
        Some(bytes) => sections
            .attributes
            .decode_postings_section(bytes)
            .map_err(|error| {
                IndexError::Format(format!("postings section: {}", format_reason(error)))
            })?,
        None => sections.attributes.rebuild_postings()?,
    }
    Ok(sections)
}

fn format_reason(error: IndexError) -> String {
    match error {
        IndexError::Format(reason) => reason,
        other => other.to_string(),
    }
}

/// Checks the CRC32 trailer; returns the bytes it covers.
fn check_trailer(bytes: &[u8]) -> Result<&[u8]> {
    if bytes.len() < 4 {
        return Err(IndexError::Format("file shorter than its checksum".into()));
    }
    let (body, trailer) = bytes.split_at(bytes.len() - 4);
    let stored = u32::from_le_bytes(trailer.try_into().expect("4 bytes"));
    if crc32fast::hash(body) != stored {
        return Err(IndexError::Format("checksum mismatch".into()));
    }
    Ok(body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attributes::{FieldSpec, FieldType, Value};
    use crate::filtered::FilteredPlan;

    const DIM: usize = 4;

    fn config() -> IndexConfig {
        let mut config = IndexConfig::new(DIM, Metric::L2);
        config.graph_threshold = 64;
        config
    }

    fn schema() -> Schema {
        Schema::new(vec![
            FieldSpec::new("section", FieldType::Keyword),
            FieldSpec::new("size", FieldType::Number),
        ])
        .unwrap()
    }

    fn attributes(i: usize) -> Attributes {
        let mut attributes = Attributes::new();
        attributes.insert("section", Value::Keyword(format!("s{}", i % 3)));
        attributes.insert("size", Value::Number(i as f64));
        attributes
    }

    fn vector(i: usize) -> Vec<f32> {
        vec![i as f32, (i % 7) as f32, 1.0, -(i as f32)]
    }

    /// Tenants 1 (`n` documents) and 2 (3 documents); tenant 1's documents with attributes
    /// when `with_attributes`.
    fn mutable(n: usize, with_attributes: bool) -> MutableSegment {
        let segment = if with_attributes {
            MutableSegment::with_schema(config(), schema())
        } else {
            MutableSegment::new(config())
        };
        for i in 0..n {
            if with_attributes {
                segment
                    .upsert_with_attributes(1, i as u128, &vector(i), &attributes(i))
                    .unwrap();
            } else {
                segment.upsert(1, i as u128, &vector(i));
            }
        }
        for i in 0..3 {
            segment.upsert(2, i as u128, &vector(i));
        }
        segment
    }

    #[test]
    fn filters_between_3_and_30_percent_walk_accepted_nodes_and_keep_their_recall() {
        // 10,000 clustered 32-d documents, a quarter of them marked: 2,500 matches take the
        // two-hop walk at ef 20 (beam 22, about 1,400 distances against 2,500 to scan).
        const N: usize = 10_000;
        const D: usize = 32;
        const K: usize = 10;
        let mut config = IndexConfig::new(D, Metric::L2);
        config.graph_threshold = 64;
        let schema = Schema::new(vec![FieldSpec::new("mark", FieldType::Keyword)]).unwrap();
        let base = tarn_testkit::clustered_vectors(N, D, 40, 21);
        let queries = tarn_testkit::clustered_vectors(30, D, 40, 22);
        let mutable = MutableSegment::with_schema(config, schema);
        let mark = |i: usize| if i % 4 == 1 { "quarter" } else { "rest" };
        for i in 0..N {
            let mut attributes = Attributes::new();
            attributes.insert("mark", Value::Keyword(mark(i).to_string()));
            mutable
                .upsert_with_attributes(1, i as u128, &base[i * D..(i + 1) * D], &attributes)
                .unwrap();
        }
        // Nothing indexed by hnsw_rs (whose level draws are not seeded): the seal builds the
        // graph with tarn's builder on one thread and a fixed seed, so the recall below is the
        // same on every run and under any parallel load.
        let build = BuildConfig {
            threads: 1,
            seed: 21,
        };
        let sealed = SealedSegment::seal_compacting(&mutable, 1, 1, f64::INFINITY, &build);
        let filter = Filter::Match {
            field: "mark".to_string(),
            any_of: vec!["quarter".to_string()],
            boolean: None,
        };
        let ef = 20;
        assert!(matches!(
            plan(N / 4, N, K, ef, true, false),
            FilteredPlan::Graph {
                walk: Walk::Accepted { .. },
                ..
            }
        ));
        let mut recall = 0.0;
        for query in queries.chunks_exact(D) {
            let hits = sealed
                .search_filtered(1, query, K, ef, false, Some(&filter))
                .unwrap();
            assert_eq!(hits.len(), K);
            assert!(hits
                .iter()
                .all(|hit| mark(hit.doc_id as usize) == "quarter"));
            let mut truth: Vec<(f32, usize)> = (0..N)
                .filter(|&i| mark(i) == "quarter")
                .map(|i| (Metric::L2.distance(query, &base[i * D..(i + 1) * D]), i))
                .collect();
            truth.sort_by(|a, b| a.0.total_cmp(&b.0));
            recall += truth[..K]
                .iter()
                .filter(|(_, i)| hits.iter().any(|hit| hit.doc_id == *i as u128))
                .count() as f64
                / K as f64;
        }
        recall /= (queries.len() / D) as f64;
        eprintln!("two-hop walk at 25%, ef {ef}: recall {recall:.3}");
        assert!(recall >= 0.9, "recall {recall}");
    }

    fn section_s1() -> Filter {
        Filter::Match {
            field: "section".to_string(),
            any_of: vec!["s1".to_string()],
            boolean: None,
        }
    }

    fn found(segment: &SealedSegment, user_id: u128, filter: &Filter) -> Vec<u128> {
        let mut ids: Vec<u128> = segment
            .search_filtered(user_id, &vector(0), 1000, 64, false, Some(filter))
            .unwrap()
            .iter()
            .map(|hit| hit.doc_id)
            .collect();
        ids.sort_unstable();
        ids
    }

    #[test]
    fn attributes_survive_sealing_encoding_and_rebuilds() {
        for n in [10, 200] {
            let segment = mutable(n, true);
            segment.remove(1, 4);
            segment
                .upsert_with_attributes(1, 7, &vector(7), &attributes(8))
                .unwrap();
            let sealed = SealedSegment::seal(&segment, 1, 5);
            let expected: Vec<u128> = (0..n as u128)
                .filter(|&i| i != 4 && (if i == 7 { 8 } else { i }) % 3 == 1)
                .collect();
            assert_eq!(found(&sealed, 1, &section_s1()), expected, "n = {n}");
            assert_eq!(
                sealed.get_with_attributes(1, 7, true).unwrap().unwrap().1,
                attributes(8)
            );
            assert_eq!(
                sealed.get_with_attributes(2, 1, true).unwrap().unwrap().1,
                Attributes::new()
            );
            let decoded = SealedSegment::decode(&sealed.encode().unwrap(), config()).unwrap();
            assert_eq!(found(&decoded, 1, &section_s1()), expected);
            assert_eq!(
                decoded.get_with_attributes(1, 7, true).unwrap().unwrap().1,
                attributes(8)
            );
            assert!(found(&decoded, 2, &section_s1()).is_empty());
            let rebuilt =
                SealedSegment::rebuild(&[&decoded], 2, config(), &BuildConfig::default()).unwrap();
            assert_eq!(found(&rebuilt, 1, &section_s1()), expected);
            assert_eq!(
                rebuilt.get_with_attributes(1, 5, true).unwrap().unwrap().1,
                attributes(5)
            );
        }
    }

    fn text_schema() -> Schema {
        Schema::new(vec![
            FieldSpec::new("section", FieldType::Keyword),
            FieldSpec::new("body", FieldType::Text),
        ])
        .unwrap()
    }

    /// Document `i`'s attributes with a TEXT value and a payload (every third has neither).
    fn stored_document(i: usize) -> Attributes {
        let mut document = Attributes::new();
        document.insert("section", Value::Keyword(format!("s{}", i % 3)));
        if !i.is_multiple_of(3) {
            document.insert(
                "body",
                Value::Text(format!("the text of document {i} \u{e9}")),
            );
            document.set_payload(Some(format!("{{\"n\": {i}}}")));
        }
        document
    }

    /// Every document's BM25 score for "text" and "document" in a segment's partition 1.
    fn text_scores(segment: &SealedSegment) -> Vec<(u128, f32)> {
        let terms = ["text".to_string(), "document".to_string()];
        let weights = crate::fulltext::Bm25::default()
            .weigh(&segment.text_stats(1, "body", &terms))
            .unwrap();
        let hits = segment.text_search(1, "body", &terms, &weights, 1000, None);
        hits.iter().map(|h| (h.doc_id, h.distance)).collect()
    }

    #[test]
    fn postings_are_written_and_a_segment_without_them_builds_them_from_its_stored_values() {
        let segment = MutableSegment::with_schema(config(), text_schema());
        for i in 0..60 {
            segment
                .upsert_with_attributes(1, i as u128, &vector(i), &stored_document(i))
                .unwrap();
        }
        segment.remove(1, 7);
        let sealed = SealedSegment::seal(&segment, 1, 1);
        let want = text_scores(&sealed);
        // Every document with a text (two in three), but the removed one.
        assert_eq!(want.len(), 39);
        let bytes = sealed.encode().unwrap();
        assert_eq!(
            text_scores(&SealedSegment::decode(&bytes, config()).unwrap()),
            want
        );
        // The same file with its postings section relabelled as an unknown optional kind, as a
        // segment written before postings existed: they are rebuilt from the stored values.
        let partition = &sealed.partitions[&1];
        let section_len = partition
            .attributes
            .encode_postings_section(partition.n_slots() as u32)
            .len() as u64;
        let mut entry = SECTION_POSTINGS.to_le_bytes().to_vec();
        entry.extend_from_slice(&0u16.to_le_bytes());
        entry.extend_from_slice(&section_len.to_le_bytes());
        let at = bytes
            .windows(entry.len())
            .position(|w| w == entry.as_slice())
            .unwrap();
        let mut old = bytes[..bytes.len() - 4].to_vec();
        old[at..at + 2].copy_from_slice(&99u16.to_le_bytes());
        let crc = crc32fast::hash(&old);
        old.extend_from_slice(&crc.to_le_bytes());
        assert_eq!(
            text_scores(&SealedSegment::decode(&old, config()).unwrap()),
            want
        );
        // A damaged postings section (the one partition's last section: its analyzer byte
        // flipped) is refused with its name.
        let mut damaged = bytes[..bytes.len() - 4].to_vec();
        let section_start = damaged.len() - section_len as usize;
        damaged[section_start + 1] ^= 0x3;
        let crc = crc32fast::hash(&damaged);
        damaged.extend_from_slice(&crc.to_le_bytes());
        let error = SealedSegment::decode(&damaged, config()).unwrap_err();
        assert!(error.to_string().contains("postings"), "{error}");
    }

    #[test]
    fn stored_values_survive_sealing_files_merges_and_stay_in_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let segment = MutableSegment::with_schema(config(), text_schema());
        for i in 0..100 {
            segment
                .upsert_with_attributes(1, i as u128, &vector(i), &stored_document(i))
                .unwrap();
        }
        // A replaced version's stored values are not the document's any more.
        let mut replaced = stored_document(4);
        replaced.set_payload(Some("\"new\"".to_string()));
        segment
            .upsert_with_attributes(1, 4, &vector(4), &replaced)
            .unwrap();
        assert_eq!(
            segment.document(1, 4, true).unwrap(),
            Some(replaced.clone())
        );
        let want = |i: usize| {
            if i == 4 {
                replaced.clone()
            } else {
                stored_document(i)
            }
        };
        let check = |what: &str, sealed: &SealedSegment| {
            for i in 0..100 {
                assert_eq!(
                    sealed.document(1, i as u128, true).unwrap(),
                    Some(want(i)),
                    "{what}: document {i}"
                );
            }
            assert_eq!(sealed.document(1, 1000, true).unwrap(), None);
            // The indexed columns know nothing of the text: a filter still counts exactly.
            assert_eq!(found(sealed, 1, &section_s1()).len(), 33);
        };
        let mut sealed = SealedSegment::seal(&segment, 1, 1);
        check("sealed", &sealed);
        let in_memory = sealed.figures().memory_bytes;
        let path = dir.path().join("a.tseg");
        sealed.write(&path).unwrap();
        check("written", &sealed);
        assert!(sealed.figures().memory_bytes < in_memory);
        let opened = SealedSegment::open(&path, config()).unwrap();
        check("opened", &opened);
        check(
            "decoded",
            &SealedSegment::decode(&std::fs::read(&path).unwrap(), config()).unwrap(),
        );
        let mut cold = config();
        cold.vectors_on_disk = true;
        check(
            "opened, vectors on disk",
            &SealedSegment::open(&path, cold).unwrap(),
        );
        // A merge with a segment that has no stored values, and a rebuild, carry them.
        let other = MutableSegment::new(config());
        other.upsert(1, 500, &vector(500));
        let without = SealedSegment::seal(&other, 2, 2);
        let merged =
            SealedSegment::rebuild(&[&opened, &without], 3, config(), &BuildConfig::default())
                .unwrap();
        check("merged", &merged);
        assert_eq!(
            merged.document(1, 500, true).unwrap(),
            Some(Attributes::new())
        );

        // Damage after opening (the whole-file checksum was checked then): the read that
        // meets it fails its slot's checksum, naming the file.
        let mut bytes = std::fs::read(&path).unwrap();
        let text = b"the text of document 98";
        let at = bytes
            .windows(text.len())
            .position(|w| w == text)
            .expect("the text is in the file");
        bytes[at] ^= 0x20;
        std::fs::write(&path, &bytes).unwrap();
        let error = opened.document(1, 98, true).unwrap_err();
        assert!(matches!(error, IndexError::Corrupt { .. }), "{error}");
        assert_eq!(
            opened.document(1, 97, true).unwrap(),
            Some(stored_document(97))
        );
        // Without its stored values, the document reads nothing from the file.
        let (indexed, _) = stored_document(98).split_stored();
        assert_eq!(opened.document(1, 98, false).unwrap(), Some(indexed));
        // Opening it again finds the damage at once.
        assert!(SealedSegment::open(&path, config()).is_err());
    }

    #[test]
    fn a_merge_of_segments_with_older_schemas_keeps_every_value() {
        let old = MutableSegment::new(config());
        old.upsert(1, 100, &vector(100));
        let older = SealedSegment::seal(&old, 1, 1);
        let newer = SealedSegment::seal(&mutable(5, true), 2, 2);
        let merged =
            SealedSegment::rebuild(&[&older, &newer], 3, config(), &BuildConfig::default())
                .unwrap();
        assert_eq!(found(&merged, 1, &section_s1()), vec![1, 4]);
        assert_eq!(
            merged.get_with_attributes(1, 100, true).unwrap().unwrap().1,
            Attributes::new()
        );
        let not_s1 = Filter::Not(Box::new(section_s1()));
        assert_eq!(found(&merged, 1, &not_s1), vec![0, 2, 3, 100]);
    }

    #[test]
    fn version_1_segments_open_as_having_no_attributes() {
        let sealed = SealedSegment::seal(&mutable(100, false), 1, 5);
        let old_bytes = sealed.encode_version(FORMAT_VERSION_NO_SECTIONS).unwrap().0;
        assert_eq!(&old_bytes[8..12], &1u32.to_le_bytes());
        let opened = SealedSegment::decode(&old_bytes, config()).unwrap();
        assert_eq!(opened.figures(), sealed.figures());
        assert_eq!(opened.get(1, 3).unwrap(), sealed.get(1, 3).unwrap());
        assert!(found(&opened, 1, &Filter::Exists("size".to_string())).is_empty());
        let everything = Filter::Not(Box::new(Filter::Exists("size".to_string())));
        assert_eq!(found(&opened, 1, &everything).len(), 100);
        // Version 2 without attributes: version 1 plus an empty section table per partition.
        let new_bytes = sealed.encode().unwrap();
        assert_eq!(new_bytes.len(), old_bytes.len() + 2 * 4);
    }

    /// A segment of one partition without attributes, its empty section table replaced by
    /// `table` (then the sections' bytes), the checksum recomputed.
    fn with_sections(table: &[(u16, u16, Vec<u8>)]) -> Vec<u8> {
        let segment = MutableSegment::new(config());
        segment.upsert(1, 1, &vector(1));
        let bytes = SealedSegment::seal(&segment, 1, 1).encode().unwrap();
        let mut body = bytes[..bytes.len() - 8].to_vec();
        body.extend_from_slice(&(table.len() as u32).to_le_bytes());
        for (kind, flags, section) in table {
            body.extend_from_slice(&kind.to_le_bytes());
            body.extend_from_slice(&flags.to_le_bytes());
            body.extend_from_slice(&(section.len() as u64).to_le_bytes());
        }
        for (_, _, section) in table {
            body.extend_from_slice(section);
        }
        let crc = crc32fast::hash(&body);
        body.extend_from_slice(&crc.to_le_bytes());
        body
    }

    #[test]
    fn unknown_optional_sections_are_skipped_and_unknown_required_ones_refused() {
        assert!(SealedSegment::decode(&with_sections(&[]), config()).is_ok());
        let optional = with_sections(&[(99, 0, vec![1, 2, 3])]);
        assert_eq!(
            SealedSegment::decode(&optional, config())
                .unwrap()
                .get(1, 1)
                .unwrap(),
            Some(vector(1))
        );
        let refused = |bytes: Vec<u8>, expected: &str| {
            let error = SealedSegment::decode(&bytes, config())
                .unwrap_err()
                .to_string();
            assert!(error.contains(expected), "{error}");
        };
        refused(
            with_sections(&[(99, SECTION_REQUIRED, vec![1])]),
            "required section",
        );
        refused(
            with_sections(&[(99, 0, vec![]), (99, 0, vec![])]),
            "appears twice",
        );
        let empty_index = AttributeIndex::new(Schema::default()).encode_section();
        let mut too_many = AttributeIndex::new(schema()).encode_section();
        too_many[1..5].copy_from_slice(&7u32.to_le_bytes());
        assert!(SealedSegment::decode(
            &with_sections(&[(SECTION_ATTRIBUTES, SECTION_REQUIRED, empty_index)]),
            config()
        )
        .is_ok());
        refused(
            with_sections(&[(SECTION_ATTRIBUTES, SECTION_REQUIRED, too_many)]),
            "attribute section",
        );
        // A length past the end of the file.
        let mut past_end = with_sections(&[(99, 0, vec![1, 2, 3])]);
        let table_len = past_end.len() - 4 - 3 - 8;
        past_end[table_len..table_len + 8].copy_from_slice(&u64::MAX.to_le_bytes());
        let body_len = past_end.len() - 4;
        let crc = crc32fast::hash(&past_end[..body_len]);
        past_end[body_len..].copy_from_slice(&crc.to_le_bytes());
        assert!(SealedSegment::decode(&past_end, config()).is_err());
    }

    #[test]
    fn damaged_attribute_sections_are_errors_never_panics() {
        let sealed = SealedSegment::seal(&mutable(30, true), 1, 5);
        let bytes = sealed.encode().unwrap();
        // Tenant 2's partition (3 slots, no attributes) comes last; tenant 1's attribute
        // section ends right before its user id.
        let section = sealed.partitions[&1].attributes.encode_section();
        let section_end = bytes
            .windows(section.len())
            .position(|window| window == section.as_slice())
            .unwrap()
            + section.len();
        let section_start = section_end - section.len();
        for offset in section_start..section_end {
            for bit in [0, 3, 7] {
                let mut damaged = bytes.clone();
                damaged[offset] ^= 1 << bit;
                // The checksum catches every flip...
                assert!(SealedSegment::decode(&damaged, config()).is_err());
                // ...and with a recomputed checksum the section's own checks never panic.
                let body_len = damaged.len() - 4;
                let crc = crc32fast::hash(&damaged[..body_len]);
                damaged[body_len..].copy_from_slice(&crc.to_le_bytes());
                let _ = SealedSegment::decode(&damaged, config());
            }
        }
        // The section's version byte is structural: refused.
        let mut damaged = bytes.clone();
        damaged[section_start] = 9;
        let body_len = damaged.len() - 4;
        let crc = crc32fast::hash(&damaged[..body_len]);
        damaged[body_len..].copy_from_slice(&crc.to_le_bytes());
        let error = SealedSegment::decode(&damaged, config())
            .unwrap_err()
            .to_string();
        assert!(error.contains("attribute section"), "{error}");
    }

    #[test]
    fn build_with_attributes_keeps_the_last_row_of_a_document_and_refuses_bad_rows() {
        let rows: Vec<Attributes> = (0..4).map(attributes).collect();
        let vectors: Vec<f32> = (0..4).flat_map(vector).collect();
        let documents = BulkDocuments {
            user_ids: &[1, 1, 1, 2],
            doc_ids: &[10, 11, 10, 10],
            vectors: &vectors,
        };
        let schema = schema();
        let bulk = BulkAttributes {
            schema: &schema,
            rows: &rows,
        };
        let built = SealedSegment::build_with_attributes(
            documents,
            Some(bulk),
            1,
            1,
            config(),
            &BuildConfig::default(),
        )
        .unwrap();
        assert_eq!(
            built.get_with_attributes(1, 10, true).unwrap().unwrap().1,
            attributes(2)
        );
        assert_eq!(
            built.get_with_attributes(1, 11, true).unwrap().unwrap().1,
            attributes(1)
        );
        assert_eq!(
            built.get_with_attributes(2, 10, true).unwrap().unwrap().1,
            attributes(3)
        );
        let s2 = Filter::Match {
            field: "section".to_string(),
            any_of: vec!["s2".to_string()],
            boolean: None,
        };
        assert_eq!(found(&built, 1, &s2), vec![10]);

        let mut bad = rows.clone();
        bad[3].insert("colour", Value::Keyword("red".to_string()));
        let error = SealedSegment::build_with_attributes(
            documents,
            Some(BulkAttributes {
                schema: &schema,
                rows: &bad,
            }),
            1,
            1,
            config(),
            &BuildConfig::default(),
        )
        .unwrap_err()
        .to_string();
        assert!(
            error.contains("row 3") && error.contains("colour"),
            "{error}"
        );
        let error = SealedSegment::build_with_attributes(
            documents,
            Some(BulkAttributes {
                schema: &schema,
                rows: &rows[..3],
            }),
            1,
            1,
            config(),
            &BuildConfig::default(),
        )
        .unwrap_err()
        .to_string();
        assert!(
            error.contains("3 attribute rows for 4 documents"),
            "{error}"
        );
    }
}
