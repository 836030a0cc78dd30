//! Sealed segments: immutable vectors and graphs in tarn's own checksummed file format, searched
//! by tarn's own HNSW loop (`flat_graph.rs`). Only their tombstones change, kept in a separate
//! small file per checkpoint. Byte layout: `docs/SEGMENT_FORMAT.md`.

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::bitset::AtomicBitset;
use crate::builder::{build_graph, BuildConfig};
use crate::bytes::{ByteReader, ByteWriter};
use crate::config::IndexConfig;
use crate::error::{IndexError, Result};
use crate::flat_graph::FlatGraph;
use crate::metric::Metric;
use crate::mutable::MutableSegment;
use crate::search::{exact_top_k, to_hits, Hit};
use crate::simd::prefetch;

const SEGMENT_MAGIC: &[u8; 8] = b"TARNSEG1";
const TOMBSTONE_MAGIC: &[u8; 8] = b"TARNTMB1";
const FORMAT_VERSION: u32 = 1;
/// Cache lines of a vector prefetched before its distance is computed: all of it, up to 2 KiB
/// (measured: docs/benchmarks/sealed-search.md, "What each step bought").
const PREFETCH_MAX_LINES: usize = 32;
/// What an hnsw_rs insert costs against one by tarn's builder, same vector, same M and
/// ef_construction: 32 s against 7 s for minilm-debian's 60,733 x 384 on 2 threads
/// (docs/BENCHMARKS.md, "Index build"), rounded down. Sealing rebuilds a partition whose
/// unindexed tail is at least `1 / HNSW_RS_INSERT_COST` of it.
const HNSW_RS_INSERT_COST: f64 = 4.0;

/// One tenant's part of a sealed segment.
#[derive(Debug)]
pub(crate) struct SealedPartition {
    vectors: Vec<f32>,
    /// By slot.
    doc_ids: Vec<u128>,
    /// `(doc_id, slot)` of the documents live at sealing, sorted by doc id.
    doc_index: Vec<(u128, u32)>,
    tombstones: AtomicBitset,
    graph: Option<FlatGraph>,
}

impl SealedPartition {
    /// A partition of `doc_ids` (sorted, one per slot) and their vectors, every one live.
    fn new_live(vectors: Vec<f32>, doc_ids: Vec<u128>, graph: Option<FlatGraph>) -> Self {
        let n = doc_ids.len();
        SealedPartition {
            vectors,
            doc_index: doc_ids
                .iter()
                .enumerate()
                .map(|(slot, d)| (*d, slot as u32))
                .collect(),
            doc_ids,
            tombstones: AtomicBitset::from_words(vec![0; AtomicBitset::words_for(n)]),
            graph,
        }
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

    fn vector(&self, slot: u32, dim: usize) -> &[f32] {
        &self.vectors[slot as usize * dim..(slot as usize + 1) * dim]
    }

    fn memory_bytes(&self) -> usize {
        self.vectors.len() * 4
            + self.doc_ids.len() * 16
            + self.doc_index.len() * 32
            + self.n_slots().div_ceil(8)
            + self.graph.as_ref().map_or(0, FlatGraph::memory_bytes)
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

/// Size and shape figures for stats and benchmarks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SegmentFigures {
    pub n_slots: usize,
    pub n_live: usize,
    pub n_tombstoned: usize,
    pub memory_bytes: usize,
    /// Bytes beyond the raw vectors of the slots (graph, ids, maps, bitmaps).
    pub index_bytes: usize,
}

impl SealedSegment {
    fn assemble(
        id: u64,
        max_seq: u64,
        config: IndexConfig,
        partitions: HashMap<u128, SealedPartition>,
    ) -> Self {
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
                    let live: Vec<(u128, Vec<f32>)> = data
                        .by_doc
                        .iter()
                        .map(|(d, s)| (*d, data.vectors[*s as usize * dim..][..dim].to_vec()))
                        .collect();
                    drop(data);
                    let live = live.iter().map(|(d, v)| (*d, v.as_slice())).collect();
                    partitions.insert(user_id, build_partition(live, &config, build));
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
                        vectors: graph_vectors(
                            std::iter::once(&data.vectors[..]),
                            data.vectors.len(),
                        ),
                        doc_ids: data.doc_ids.clone(),
                        doc_index,
                        tombstones: AtomicBitset::from_words(
                            data.tombstones.clone().into_words(n_slots),
                        ),
                        graph: Some(graph),
                    }
                }
                None => compact_partition(&doc_index, |slot| {
                    &data.vectors[slot as usize * dim..(slot as usize + 1) * dim]
                }),
            };
            partitions.insert(user_id, sealed);
        }
        SealedSegment::assemble(id, max_seq, config, partitions)
    }

    /// Builds a fresh segment from the live documents of `sources` (merging several, or
    /// rebuilding one with many tombstones). Graphs are rebuilt from scratch by tarn's builder
    /// (`build` threads).
    pub fn rebuild(
        sources: &[&SealedSegment],
        id: u64,
        config: IndexConfig,
        build: &BuildConfig,
    ) -> SealedSegment {
        let dim = config.dimension;
        let max_seq = sources.iter().map(|s| s.max_seq).max().unwrap_or(0);
        let mut by_user: HashMap<u128, Vec<(u128, &[f32])>> = HashMap::new();
        for source in sources {
            for (user_id, partition) in &source.partitions {
                let live = by_user.entry(*user_id).or_default();
                for &(doc_id, slot) in &partition.doc_index {
                    if !partition.tombstones.get(slot as usize) {
                        live.push((doc_id, partition.vector(slot, dim)));
                    }
                }
            }
        }
        let partitions = by_user
            .into_iter()
            .filter(|(_, live)| !live.is_empty())
            .map(|(user_id, live)| (user_id, build_partition(live, &config, build)))
            .collect();
        SealedSegment::assemble(id, max_seq, config, partitions)
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
            let partition = SealedPartition::new_live(vectors, doc_ids, graph);
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
        let segment = Self::build(documents, id, max_seq, config, build)?;
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

    pub fn get(&self, user_id: u128, doc_id: u128) -> Option<Vec<f32>> {
        let partition = self.partitions.get(&user_id)?;
        let slot = partition.slot_of(doc_id)?;
        Some(partition.vector(slot, self.config.dimension).to_vec())
    }

    /// Nearest live documents of one tenant, nearest first.
    pub fn search(
        &self,
        user_id: u128,
        query: &[f32],
        k: usize,
        ef: usize,
        exact: bool,
    ) -> Vec<Hit> {
        let Some(partition) = self.partitions.get(&user_id) else {
            return Vec::new();
        };
        let dim = self.config.dimension;
        let metric = self.config.metric;
        let distance = |slot: u32| metric.distance(query, partition.vector(slot, dim));
        let candidates = match (&partition.graph, exact) {
            (Some(graph), false) => graph.search(
                k,
                ef,
                distance,
                |slot| prefetch(partition.vector(slot, dim), PREFETCH_MAX_LINES),
                |slot| !partition.tombstones.get(slot as usize),
            ),
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
        to_hits(user_id, candidates, &partition.doc_ids)
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
        for partition in self.partitions.values() {
            figures.n_slots += partition.n_slots();
            figures.n_live += partition.n_live();
            figures.n_tombstoned += partition.tombstones.count();
            figures.memory_bytes += partition.memory_bytes();
        }
        figures.index_bytes = figures.memory_bytes - figures.n_slots * self.config.dimension * 4;
        figures
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

    /// Encodes the segment (vectors, ids, graphs and the tombstones at sealing) with a CRC32
    /// trailer over everything before it.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = ByteWriter::default();
        out.bytes.extend_from_slice(SEGMENT_MAGIC);
        out.u32(FORMAT_VERSION);
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
            out.f32s(&p.vectors);
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
        }
        let crc = crc32fast::hash(&out.bytes);
        out.u32(crc);
        out.bytes
    }

    /// Writes the segment file durably (temp file, fsync, rename, directory fsync).
    pub fn write(&self, path: &Path) -> Result<u64> {
        let bytes = self.encode();
        crate::fsutil::write_durably(path, &bytes)
            .map_err(|e| IndexError::io("write segment", path, e))?;
        Ok(bytes.len() as u64)
    }

    /// Opens a segment file, checking its checksum and that it belongs to `config`'s collection.
    pub fn open(path: &Path, config: IndexConfig) -> Result<SealedSegment> {
        let bytes = std::fs::read(path).map_err(|e| IndexError::io("read segment", path, e))?;
        Self::decode(&bytes, config).map_err(|e| match e {
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

    pub fn decode(bytes: &[u8], config: IndexConfig) -> Result<SealedSegment> {
        let body = check_trailer(bytes)?;
        let mut input = ByteReader::new(body);
        if input.take(8, "magic")? != SEGMENT_MAGIC {
            return Err(IndexError::Format("not a tarn segment (bad magic)".into()));
        }
        let version = input.u32("version")?;
        if version != FORMAT_VERSION {
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
            let vectors = input.f32s(n_values, "vectors")?;
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
            partitions.insert(
                user_id,
                SealedPartition {
                    vectors,
                    doc_ids,
                    doc_index,
                    tombstones: AtomicBitset::from_words(tombstones),
                    graph,
                },
            );
        }
        if input.remaining() != 0 {
            return Err(IndexError::Format(
                "trailing bytes after the partitions".into(),
            ));
        }
        Ok(SealedSegment::assemble(id, max_seq, config, partitions))
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

/// A partition over `live` (one tenant's documents, in any order, vectors prepared for the
/// metric): a fresh graph from tarn's builder when there are enough of them, an exactly
/// searched list otherwise.
fn build_partition(
    mut live: Vec<(u128, &[f32])>,
    config: &IndexConfig,
    build: &BuildConfig,
) -> SealedPartition {
    live.sort_unstable_by_key(|(doc_id, _)| *doc_id);
    let doc_ids: Vec<u128> = live.iter().map(|(d, _)| *d).collect();
    if live.len() < config.graph_threshold {
        let vectors = live.iter().flat_map(|(_, v)| v.iter().copied()).collect();
        return SealedPartition::new_live(vectors, doc_ids, None);
    }
    let vectors = graph_vectors(live.iter().map(|(_, v)| *v), live.len() * config.dimension);
    drop(live);
    let graph = build_graph(
        &vectors,
        config.dimension,
        config.metric,
        &config.hnsw,
        build,
    );
    SealedPartition::new_live(vectors, doc_ids, graph)
}

/// A partition without a graph: live documents only, renumbered in doc id order.
fn compact_partition<'a>(
    doc_index: &[(u128, u32)],
    vector: impl Fn(u32) -> &'a [f32],
) -> SealedPartition {
    let mut sorted = doc_index.to_vec();
    sorted.sort_unstable();
    let vectors = sorted
        .iter()
        .flat_map(|(_, slot)| vector(*slot).iter().copied())
        .collect();
    let doc_ids: Vec<u128> = sorted.iter().map(|(d, _)| *d).collect();
    SealedPartition::new_live(vectors, doc_ids, None)
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
