//! [`Collection`]: the public face of the engine. Writes are validated, encoded as one WAL entry
//! and acknowledged once durable; the ingestion worker applies them in order; searches read a
//! snapshot of the segments.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};
use tarn_index::{
    AttributeError, Attributes, FieldSpec, FieldType, Filter, Metric, MutableSegment, Schema,
    SealedSegment, TextStats,
};
use tarn_wal::{Durability, Wal, WalConfig};

use crate::checkpoint::{CheckpointState, Checkpointer};
use crate::config::{CollectionConfig, MAX_TOP_K};
use crate::error::{CollectionError, Result};
use crate::failure::{run_guarded, ThreadFailure};
use crate::flush::{batch_result, Joined};
use crate::fusion::{fuse, Fused, Hybrid, SideRank};
use crate::indexer::{run_indexer, IndexerSignal};
use crate::ingestion::{IngestFeeder, IngestSignal, IngestWorker};
use crate::manifest::{self, Manifest, SegmentEntry, CONFIG_FILE};
use crate::op;
use crate::retention::Retention;
use crate::segments::{ApplyState, SegmentSet};
use crate::snapshot::Snapshot;

/// Largest number of (tenant, document) pairs one insert or remove may touch.
pub const MAX_PAIRS_PER_REQUEST: usize = 1_000_000;

/// State shared by the API and the ingestion worker.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) dir: PathBuf,
    /// The config as of open (its `fields` are the schema after the open's replay).
    pub(crate) config: CollectionConfig,
    /// The declared attribute fields now: requests are validated against it. Changed only by
    /// applying an add-fields operation, under the apply lock (ingestion), so every insert
    /// validated against a field is logged after that field's addition.
    pub(crate) schema: RwLock<Arc<Schema>>,
    /// The fields `collection.json` holds; whoever rewrites the file holds this lock.
    pub(crate) config_fields: Mutex<Vec<FieldSpec>>,
    /// Serialises `add_fields` calls (each waits until its fields are applied).
    pub(crate) add_fields_lock: tokio::sync::Mutex<()>,
    pub(crate) segments: RwLock<Arc<SegmentSet>>,
    /// Last applied sequence number; waiters subscribe for read-your-writes.
    pub(crate) applied: tokio::sync::watch::Sender<u64>,
    /// The highest sequence number ingestion may apply (make visible to reads): `u64::MAX` on
    /// a collection of its own; on a replicated shard's copy, the highest entry known
    /// committed (on every in-sync copy), raised by replication (`Collection::raise_visible`).
    /// Entries logged past it wait in ingestion's queue, unread by any search or get.
    pub(crate) visible: AtomicU64,
    pub(crate) checkpoint_seq: AtomicU64,
    /// The apply lock: ingestion applies each operation holding it, and freezing and
    /// installing replace the segment set holding it. Guards the live documents per tenant.
    pub(crate) apply: Mutex<ApplyState>,
    /// The sum of the per-tenant counts and their number (tenants ever seen), kept by ingestion, so that stats
    /// need not take the apply lock.
    pub(crate) n_documents: AtomicU64,
    pub(crate) n_tenants: AtomicU64,
    /// The directory's size when it was last measured (at open and after each checkpoint, on
    /// the checkpoint thread), and the WAL's written bytes then: stats add the WAL's growth.
    pub(crate) disk_bytes_measured: AtomicU64,
    pub(crate) wal_bytes_at_measure: AtomicU64,
    pub(crate) n_ingest_errors: AtomicU64,
    pub(crate) indexer: IndexerSignal,
    /// Set when the collection shuts down: pending checkpoint work is abandoned.
    pub(crate) stopping: AtomicBool,
    /// Files and WAL that open snapshots still read; checkpoints keep them.
    pub(crate) retention: Arc<Retention>,
    /// Checkpoints published (or found nothing to publish) since open.
    pub(crate) n_checkpoints: AtomicU64,
    /// Checkpoint jobs refused because the WAL is poisoned (nothing sealed or written).
    pub(crate) n_checkpoints_refused: AtomicU64,
    /// Flush batches and their checkpoint requests (`flush.rs`).
    pub(crate) flushes: crate::flush::Flushes,
    /// Set once, when one of the collection's threads dies (`failure.rs`).
    pub(crate) failure: std::sync::OnceLock<ThreadFailure>,
    /// Whether a checkpoint takes a mutable segment's tail past `seal_unindexed` (set by
    /// ingestion: false while checkpoints fail or stopped); the indexer leaves such a tail to
    /// it.
    pub(crate) checkpoint_seals_tail: AtomicBool,
    /// Vectors given graphs by checkpoints (sealing, merges, rebuilds) since open, and the time
    /// spent on it: the build throughput metric.
    pub(crate) n_vectors_built: AtomicU64,
    pub(crate) build_micros: AtomicU64,
}

impl Shared {
    /// Measures the collection's directory (a walk: on the checkpoint thread or at open only).
    pub(crate) fn measure_disk(&self, wal: &Wal) {
        self.wal_bytes_at_measure
            .store(wal.stats().n_bytes, Ordering::Relaxed);
        self.disk_bytes_measured
            .store(dir_size(&self.dir), Ordering::Relaxed);
    }

    pub(crate) fn segments(&self) -> Arc<SegmentSet> {
        Arc::clone(&self.segments.read())
    }

    pub(crate) fn schema(&self) -> Arc<Schema> {
        Arc::clone(&self.schema.read())
    }

    /// The config with the current fields (what a snapshot carries).
    pub(crate) fn current_config(&self) -> CollectionConfig {
        let mut config = self.config.clone();
        config.fields = self.schema().fields().to_vec();
        config
    }

    /// Rewrites `collection.json` durably with `fields`, unless it holds them (or more) already.
    pub(crate) fn write_config_fields(&self, fields: &[FieldSpec]) -> Result<()> {
        let mut written = self.config_fields.lock();
        if written.starts_with(fields) {
            return Ok(());
        }
        let mut config = self.config.clone();
        config.fields = fields.to_vec();
        manifest::write_checked(&self.dir.join(CONFIG_FILE), &config)?;
        *written = fields.to_vec();
        Ok(())
    }

    /// Applies an add-fields operation on the ingestion thread, under the apply lock: the
    /// schema grows (fields it holds already, with the same type, are skipped), the mutable
    /// segment indexes the new fields, and `collection.json` holds them before anything is
    /// applied after them (so no checkpoint can truncate the WAL entry before the file has
    /// them). A file that cannot be written fails the collection (a panic on the ingestion
    /// thread, `failure.rs`): the fields would otherwise be lost at the next open.
    pub(crate) fn apply_add_fields(&self, segments: &SegmentSet, fields: &[FieldSpec]) {
        let schema = self.schema();
        let grown = match grow_schema(&schema, fields) {
            Ok(Some(grown)) => grown,
            Ok(None) => return,
            Err(error) => {
                self.n_ingest_errors.fetch_add(1, Ordering::Relaxed);
                tracing::error!(%error, "skipped an add-fields operation that conflicts with the schema");
                return;
            }
        };
        if let Err(error) = self.write_config_fields(grown.fields()) {
            panic!("cannot record added fields in collection.json: {error}");
        }
        if let Err(error) = segments.mutable.extend_schema(grown.clone()) {
            tracing::error!(%error, "the mutable segment did not take the added fields");
        }
        *self.schema.write() = Arc::new(grown);
    }
}

/// `schema` with the fields of an add-fields operation it does not hold yet; `None` if it
/// holds them all. A field it holds with another type is an error.
pub(crate) fn grow_schema(
    schema: &Schema,
    fields: &[FieldSpec],
) -> std::result::Result<Option<Schema>, AttributeError> {
    let mut added = Vec::new();
    for spec in fields {
        match schema.field_type(&spec.name) {
            Some(field_type) if field_type == spec.field_type => {}
            Some(field_type) => {
                return Err(AttributeError::SchemaMismatch {
                    problem: format!(
                        "field {:?} is declared {field_type}, the operation adds it as {}",
                        spec.name, spec.field_type
                    ),
                })
            }
            None => added.push(spec.clone()),
        }
    }
    if added.is_empty() {
        return Ok(None);
    }
    schema.with_added(added).map(Some)
}

/// One search result as users see it.
#[derive(Debug, Clone, PartialEq)]
pub struct SearchHit {
    pub doc_id: u128,
    pub user_id: u128,
    /// Cosine similarity or dot product (higher is better), or Euclidean distance (lower).
    pub score: f32,
    /// With a non-empty [`SearchRequest::output`]: the selected values of the document, read
    /// right after the search from the segments it searched.
    pub fields: Option<Attributes>,
    /// A hybrid search's hit: its rank and score on the vector side and on the text side
    /// (`None` where that side did not retrieve it; both `None` outside hybrid searches).
    pub vector_side: Option<SideRank>,
    pub text_side: Option<SideRank>,
}

/// The tenants a read names (tenant 0 when none), each once, in order.
fn distinct_tenants(user_ids: &[u128]) -> Vec<u128> {
    let mut tenants = op::Operation::tenants(user_ids).to_vec();
    tenants.sort_unstable();
    tenants.dedup();
    tenants
}

/// The most documents one scroll page holds.
pub const MAX_SCROLL_LIMIT: usize = 10_000;

/// One page of [`Collection::scroll`].
#[derive(Debug, Clone, PartialEq)]
pub struct ScrollPage {
    /// `(user_id, doc_id, vector, values)` in (user_id, doc_id) order; the vector is empty
    /// unless asked for.
    pub docs: Vec<(u128, u128, Vec<f32>, Attributes)>,
    /// The pair to scroll on from (the page's last one, present or removed meanwhile) when
    /// documents follow the page; `None` at the end.
    pub next: Option<(u128, u128)>,
}

/// Which of a document's values a search or a get returns: declared fields by name (`"*"`:
/// every field), and the payload.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FieldSelection {
    pub fields: Vec<String>,
    pub payload: bool,
}

impl FieldSelection {
    /// The most names one selection lists.
    pub const MAX_FIELDS: usize = 256;

    /// Every field and the payload.
    pub fn everything() -> FieldSelection {
        FieldSelection {
            fields: vec!["*".to_string()],
            payload: true,
        }
    }

    /// True when nothing is selected.
    pub fn is_empty(&self) -> bool {
        self.fields.is_empty() && !self.payload
    }

    fn all_fields(&self) -> bool {
        self.fields.iter().any(|name| name == "*")
    }

    /// Checks every name against the schema (naming `output_fields`).
    pub(crate) fn validate(&self, schema: &Schema) -> Result<()> {
        if self.fields.len() > FieldSelection::MAX_FIELDS {
            return Err(CollectionError::invalid(
                "output_fields",
                format!(
                    "lists {} names, at most {} allowed",
                    self.fields.len(),
                    FieldSelection::MAX_FIELDS
                ),
            ));
        }
        if let Some(name) = self
            .fields
            .iter()
            .find(|name| *name != "*" && schema.field(name).is_none())
        {
            return Err(CollectionError::invalid(
                "output_fields",
                format!(
                    "field {:?} is not declared (\"*\" selects every field)",
                    tarn_index::shown_name(name)
                ),
            ));
        }
        Ok(())
    }

    /// True when the selection needs a document's stored values (a TEXT field or the payload).
    fn needs_stored(&self, schema: &Schema) -> bool {
        self.payload
            || self.fields.iter().any(|name| {
                name == "*" || schema.field_type(name) == Some(tarn_index::FieldType::Text)
            })
    }

    /// `document` reduced to the selection.
    fn apply(&self, mut document: Attributes) -> Attributes {
        if !self.all_fields() {
            document.retain(|name| self.fields.iter().any(|f| f == name), self.payload);
        } else if !self.payload {
            document.set_payload(None);
        }
        document
    }
}

/// A search request. `ef` 0 means the collection's default; `min_seq` 0 means no wait.
#[derive(Debug, Clone, Default)]
pub struct SearchRequest {
    pub user_ids: Vec<u128>,
    pub vector: Vec<f32>,
    pub top_k: usize,
    pub ef: usize,
    pub exact: bool,
    pub min_seq: u64,
    /// Only documents whose attributes match (validated against the collection's fields).
    /// A filtered search returns `min(top_k, matching live documents)` hits, always.
    pub filter: Option<Filter>,
    /// The values each hit returns (none by default).
    pub output: FieldSelection,
    /// A full-text query: ranks by BM25 on a TEXT field instead of by `vector` when `vector`
    /// is empty (`ef` and `exact` then do not apply); with a vector too, a hybrid search
    /// fused by `hybrid`.
    pub text: Option<TextQuery>,
    /// How a search with both a vector and a text query fuses its two sides.
    pub hybrid: Hybrid,
}

/// A full-text query on one TEXT field: analysed by the field's analyzer, its terms ranked by
/// BM25 with the collection's settings (`tarn_index::Bm25`). A term given twice counts twice.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TextQuery {
    pub field: String,
    pub query: String,
    /// Statistics to score with instead of this collection's own: a cluster's router sums
    /// every shard's ([`Collection::text_stats`]) in a first phase, so that the scores are
    /// those of one node holding every shard (Elasticsearch's `dfs_query_then_fetch`). One
    /// document frequency per analysed term, in order.
    pub stats: Option<TextStats>,
}

impl TextQuery {
    /// The longest query, in bytes.
    pub const MAX_QUERY_BYTES: usize = 16 << 10;
    /// The most terms a query may have after analysis.
    pub const MAX_TERMS: usize = 1024;
}

/// Figures for `GetCollection` and metrics.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CollectionStats {
    pub n_documents: u64,
    /// Tenants that had a document since the last open (some may have none left).
    pub n_tenants: u64,
    /// Tombstoned slots in sealed segments, waiting for a rebuild.
    pub n_removed_not_compacted: u64,
    pub n_sealed_segments: usize,
    pub last_appended_seq: u64,
    pub durable_seq: u64,
    pub applied_seq: u64,
    pub checkpoint_seq: u64,
    /// The directory's size as of the last checkpoint, plus the WAL bytes written since: read
    /// from counters, so stats never walk the directory.
    pub bytes_on_disk: u64,
    /// Approximate memory of the segments.
    pub memory_bytes: u64,
    /// Of `memory_bytes`, the sealed segments' quantized codes (with their ranges).
    pub quantized_bytes: u64,
    /// Of `memory_bytes`, the TEXT fields' inverted indexes (full-text search).
    pub text_index_bytes: u64,
    /// Full vectors left in the sealed segment files (`vectors_on_disk`), not in memory.
    pub cold_bytes: u64,
    pub n_ingest_errors: u64,
    /// Checkpoints completed since open.
    pub n_checkpoints: u64,
    /// Checkpoint jobs refused since open because the WAL is poisoned.
    pub n_checkpoints_refused: u64,
    /// Stored vectors waiting for a graph (searched by exact scan meanwhile), in the mutable
    /// segment and in frozen ones being sealed. Tenants below the graph threshold are searched
    /// exactly by design and not counted.
    pub n_unindexed: u64,
    /// Vectors given graphs by checkpoints (sealing, merges, rebuilds) since open, and the
    /// seconds that took.
    pub n_vectors_built: u64,
    pub build_seconds: f64,
}

#[derive(Debug)]
struct Handle {
    shared: Arc<Shared>,
    wal: Wal,
    signals: SyncSender<IngestSignal>,
    worker: Mutex<Option<JoinHandle<()>>>,
    indexer: Mutex<Option<JoinHandle<()>>>,
}

impl Handle {
    fn shut_down(&self) {
        // The WAL first: it drains its queue and hands the last entries to ingestion.
        if let Err(error) = self.wal.close() {
            tracing::warn!(%error, "WAL closed with an error");
        }
        let _ = self.signals.send(IngestSignal::Shutdown);
        if let Some(worker) = self.worker.lock().take() {
            if worker.join().is_err() {
                tracing::error!("the ingestion thread panicked");
            }
        }
        self.shared.indexer.stop();
        if let Some(indexer) = self.indexer.lock().take() {
            if indexer.join().is_err() {
                tracing::error!("the indexing thread panicked");
            }
        }
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        self.shut_down();
    }
}

/// A collection of vectors in one directory. Cloning gives another handle to the same one.
#[derive(Debug, Clone)]
pub struct Collection {
    handle: Arc<Handle>,
}

impl Collection {
    /// Creates a collection in `dir` (which must not hold one) and opens it. Blocking.
    pub fn create(dir: &Path, config: CollectionConfig) -> Result<Collection> {
        config.validate()?;
        let config_path = dir.join(CONFIG_FILE);
        if config_path.exists() {
            return Err(CollectionError::AlreadyExists {
                path: dir.to_owned(),
            });
        }
        std::fs::create_dir_all(dir)
            .map_err(|e| CollectionError::io("create directory", dir, e))?;
        manifest::write_checked(&config_path, &config)?;
        if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
            tarn_index::fsutil::sync_dir(parent)
                .map_err(|e| CollectionError::io("fsync directory", parent, e))?;
        }
        Self::open(dir)
    }

    /// Opens the collection in `dir`: loads the newest valid checkpoint (falling back to the
    /// previous one if it is damaged), replays the WAL after it, and only then returns, so no
    /// acknowledged write is ever invisible. Blocking.
    pub fn open(dir: &Path) -> Result<Collection> {
        let config_path = dir.join(CONFIG_FILE);
        if !config_path.exists() {
            return Err(CollectionError::NotFound {
                path: dir.to_owned(),
            });
        }
        let mut config: CollectionConfig = manifest::read_checked(&config_path)?;
        config.validate()?;
        let mut schema = config.schema()?;
        crate::memory::configure_allocator();
        let index_config = config.index_config();
        let (state, sealed) = load_checkpoint(dir, &config)?;
        let checkpoint_seq = state.current.checkpoint_seq;
        let set = SegmentSet {
            mutable: Arc::new(MutableSegment::with_schema(index_config, schema.clone())),
            frozen: Vec::new(),
            sealed,
        };

        let (signals, receiver) = sync_channel(config.ingest_queue);
        #[allow(unused_mut)]
        let mut wal_config = WalConfig::default();
        // Tests only: small WAL segments, so that truncation deletes files in a small test
        // (`collection::wal_segment_bytes=return(<bytes>)`, tests/snapshot_wal_pin.rs).
        #[cfg(feature = "failpoints")]
        if let Some(Some(bytes)) = fail::eval("collection::wal_segment_bytes", |arg| {
            arg.and_then(|bytes| bytes.parse::<u64>().ok())
        }) {
            wal_config.segment_bytes = bytes;
        }
        let (wal, report) = Wal::open_with_observer(
            dir.join("wal"),
            wal_config,
            Box::new(IngestFeeder(signals.clone())),
        )?;
        if let Some(repair) = &report.torn_tail {
            tracing::warn!(?repair, "the WAL had a torn tail, cut off");
        }
        let last_seq = wal.last_appended_seq();
        if last_seq < checkpoint_seq {
            return Err(CollectionError::Corrupt(format!(
                "the WAL ends at {last_seq}, before the checkpoint at {checkpoint_seq}"
            )));
        }
        // A replicated shard's copy (it keeps an epoch history) makes visible only what it
        // knows committed: after a restart, what its checkpoint holds (a checkpoint holds only
        // applied entries) or the committed mark it last recorded, if further and within the
        // log, until replication raises the bound again.
        let visible = if dir.join(crate::lineage::EPOCHS_FILE).exists() {
            checkpoint_seq.max(crate::lineage::read_committed(dir).min(last_seq))
        } else {
            u64::MAX
        };
        let mut held = std::collections::VecDeque::new();
        // Replay what the checkpoint does not hold, before anyone can search.
        let mut apply = ApplyState {
            counts: set.live_counts(),
            settled_removals: None,
        };
        let started = Instant::now();
        let mut n_replayed = 0u64;
        let mut replay_bytes = 0u64;
        for entry in wal.replay(checkpoint_seq + 1)? {
            let (seq, payload) = entry?;
            if seq > visible {
                held.push_back((seq, Arc::from(payload)));
                continue;
            }
            let operation = op::decode(&payload, config.dimension)
                .map_err(|e| CollectionError::Corrupt(format!("WAL entry {seq}: {e}")))?;
            if let op::Operation::AddFields { fields } = &operation {
                let grown = grow_schema(&schema, fields).map_err(|e| {
                    CollectionError::Corrupt(format!("WAL entry {seq} adds fields: {e}"))
                })?;
                if let Some(grown) = grown {
                    if !config.fields.starts_with(grown.fields()) {
                        // A copy's log (a restore, a move) added fields its file lacks.
                        config.fields = grown.fields().to_vec();
                        manifest::write_checked(&config_path, &config)?;
                    }
                    set.mutable.extend_schema(grown.clone()).map_err(|e| {
                        CollectionError::Corrupt(format!("WAL entry {seq} adds fields: {e}"))
                    })?;
                    schema = grown;
                }
            }
            set.apply(&operation, &mut apply);
            n_replayed += 1;
            replay_bytes += payload.len() as u64;
        }
        // What `collection.json` holds now (the replay rewrote it if the log added fields).
        let config_fields = config.fields.clone();
        config.fields = schema.fields().to_vec();
        let applied_seq = last_seq.min(visible);
        tracing::info!(dir = %dir.display(), checkpoint_seq, n_replayed, n_held = held.len(), elapsed_ms = started.elapsed().as_millis() as u64, "opened collection");

        let shared = Arc::new(Shared {
            dir: dir.to_owned(),
            config,
            schema: RwLock::new(Arc::new(schema)),
            config_fields: Mutex::new(config_fields),
            add_fields_lock: tokio::sync::Mutex::new(()),
            segments: RwLock::new(Arc::new(set)),
            applied: tokio::sync::watch::Sender::new(applied_seq),
            visible: AtomicU64::new(visible),
            checkpoint_seq: AtomicU64::new(checkpoint_seq),
            n_documents: AtomicU64::new(apply.counts.values().sum()),
            n_tenants: AtomicU64::new(apply.counts.len() as u64),
            apply: Mutex::new(apply),
            disk_bytes_measured: AtomicU64::new(0),
            wal_bytes_at_measure: AtomicU64::new(0),
            n_ingest_errors: AtomicU64::new(0),
            indexer: IndexerSignal::default(),
            stopping: AtomicBool::new(false),
            retention: Arc::new(Retention::new(state.current.clone())),
            n_checkpoints: AtomicU64::new(0),
            n_checkpoints_refused: AtomicU64::new(0),
            flushes: crate::flush::Flushes::default(),
            failure: std::sync::OnceLock::new(),
            checkpoint_seals_tail: AtomicBool::new(true),
            n_vectors_built: AtomicU64::new(0),
            build_micros: AtomicU64::new(0),
        });
        shared.measure_disk(&wal);
        let (indexer_shared, indexer_wal) = (Arc::clone(&shared), wal.clone());
        let indexer = std::thread::Builder::new()
            .name("tarn-indexer".to_owned())
            .spawn(move || {
                run_guarded(&indexer_shared, &indexer_wal, "indexing", || {
                    run_indexer(Arc::clone(&indexer_shared))
                })
            })
            .map_err(|e| CollectionError::io("spawn indexing thread", dir, e))?;
        // The replayed tail gets indexed in the background; searches cover it exactly meanwhile.
        shared.indexer.kick();
        let (jobs, job_receiver) = sync_channel(crate::checkpoint::CHECKPOINT_JOBS);
        let (done, done_receiver) = std::sync::mpsc::channel();
        let checkpointer = Checkpointer {
            shared: Arc::clone(&shared),
            wal: wal.clone(),
            state,
            done,
        };
        let (checkpoint_shared, checkpoint_wal) = (Arc::clone(&shared), wal.clone());
        let checkpointer = std::thread::Builder::new()
            .name("tarn-checkpoint".to_owned())
            .spawn(move || {
                run_guarded(&checkpoint_shared, &checkpoint_wal, "checkpoint", || {
                    checkpointer.run(job_receiver)
                })
            })
            .map_err(|e| CollectionError::io("spawn checkpoint thread", dir, e))?;
        #[allow(unused_mut)]
        let mut checkpoint_wal_bytes = shared.config.checkpoint_wal_bytes;
        // Tests only: a checkpoint every few KiB of log applied, on every copy of a shard
        // (replicas take no flushes) (`collection::checkpoint_wal_bytes=return(<bytes>)`).
        #[cfg(feature = "failpoints")]
        if let Some(Some(bytes)) = fail::eval("collection::checkpoint_wal_bytes", |arg| {
            arg.and_then(|bytes| bytes.parse::<u64>().ok())
        }) {
            checkpoint_wal_bytes = bytes;
        }
        let worker = IngestWorker {
            shared: Arc::clone(&shared),
            applied_seq,
            held,
            triggers: crate::triggers::CheckpointTriggers::new(
                checkpoint_wal_bytes,
                shared.config.checkpoint_mutable_bytes,
                shared.config.seal_unindexed,
                shared.config.checkpoint_interval(),
                replay_bytes,
                Instant::now(),
            ),
            n_applied: 0,
            committed_mark: (
                if visible == u64::MAX { 0 } else { visible },
                Instant::now(),
            ),
            bytes_since_unindexed_check: 0,
            jobs: Some(jobs),
            done: done_receiver,
            in_flight: 0,
            checkpointer: Some(checkpointer),
        };
        let (worker_shared, worker_wal) = (Arc::clone(&shared), wal.clone());
        let worker = std::thread::Builder::new()
            .name("tarn-ingest".to_owned())
            .spawn(move || {
                let mut worker = worker;
                run_guarded(&worker_shared, &worker_wal, "ingestion", || {
                    worker.run(&receiver)
                });
            })
            .map_err(|e| CollectionError::io("spawn ingestion thread", dir, e))?;
        Ok(Collection {
            handle: Arc::new(Handle {
                shared,
                wal,
                signals,
                worker: Mutex::new(Some(worker)),
                indexer: Mutex::new(Some(indexer)),
            }),
        })
    }

    /// Opens the collection in `dir` with every logged entry visible, a replicated shard's
    /// copy too (its log past its checkpoint would otherwise wait for its primary's commit):
    /// for a copy read on its own, such as one set aside. Blocking: returns once every entry
    /// is applied.
    pub fn open_whole(dir: &Path) -> Result<Collection> {
        let collection = Self::open(dir)?;
        collection.release_uncommitted();
        let last = collection.last_seq_no();
        while *collection.shared().applied.borrow() < last {
            collection.check_not_failed()?;
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok(collection)
    }

    pub(crate) fn wal(&self) -> &Wal {
        &self.handle.wal
    }

    pub(crate) fn shared(&self) -> &Shared {
        &self.handle.shared
    }

    /// The config as of open. Its `fields` do not follow later `add_fields` calls: the
    /// current fields are [`Collection::schema`]'s.
    pub fn config(&self) -> &CollectionConfig {
        &self.shared().config
    }

    /// The declared attribute fields, as of the last applied `add_fields`.
    pub fn schema(&self) -> Arc<Schema> {
        self.shared().schema()
    }

    /// Appends attribute fields to the collection's schema; documents written before have no
    /// value for them. Refuses (naming `fields`, changing nothing) an empty list, a name that
    /// is invalid, repeated or already declared, and more than 256 fields in all. Logged as one
    /// operation (so replay, snapshots, moves and replicas see the fields exactly where they
    /// were added, before any document using them) and always synced; resolves once applied,
    /// when inserts and filters may use the fields, to the operation's sequence number. The
    /// ingestion thread records the fields in `collection.json` when it applies them, before
    /// any later operation. Calls are serialised.
    pub async fn add_fields(&self, fields: Vec<FieldSpec>) -> Result<u64> {
        self.check_not_failed()?;
        if fields.is_empty() {
            return Err(CollectionError::invalid("fields", "must not be empty"));
        }
        let _one_at_a_time = self.shared().add_fields_lock.lock().await;
        self.schema()
            .with_added(fields.clone())
            .map_err(|error| CollectionError::attributes("fields", None, &error))?;
        let added = Schema::new(fields)
            .map_err(|error| CollectionError::attributes("fields", None, &error))?;
        let payload = op::encode_add_fields(&added);
        let seq = self
            .handle
            .wal
            .append(payload.into(), Durability::Fsync)
            .await?;
        let mut applied = self.shared().applied.subscribe();
        let failure = &self.shared().failure;
        let waited = applied
            .wait_for(|a| *a >= seq || failure.get().is_some())
            .await;
        match waited {
            Ok(_) if *self.shared().applied.borrow() >= seq => Ok(seq),
            _ => Err(self.closed_or_failed()),
        }
    }

    /// Stores every listed document for every listed tenant (tenant 0 when none), replacing
    /// existing versions. Resolves to the operation's sequence number once it is durable (or
    /// written, under `Durability::Written`). A rejected request changes nothing. The
    /// documents have no attributes.
    pub async fn insert(
        &self,
        doc_ids: &[u128],
        user_ids: &[u128],
        vectors: &[f32],
        durability: Option<Durability>,
    ) -> Result<u64> {
        self.insert_with_attributes(doc_ids, user_ids, vectors, &[], durability)
            .await
    }

    /// `insert` with the documents' attributes: `attributes` is empty (no attributes) or holds
    /// one per document (the same for every listed tenant), each valid for the collection's
    /// fields ([`Schema::validate`]). A bad one is refused naming `attributes`, the document
    /// and the attribute field, and nothing is logged.
    pub async fn insert_with_attributes(
        &self,
        doc_ids: &[u128],
        user_ids: &[u128],
        vectors: &[f32],
        attributes: &[Attributes],
        durability: Option<Durability>,
    ) -> Result<u64> {
        self.check_not_failed()?;
        let payload = self.encode_insert(doc_ids, user_ids, vectors, attributes)?;
        let durability = durability.unwrap_or_else(|| self.config().durability());
        Ok(self.handle.wal.append(payload.into(), durability).await?)
    }

    /// Validates and encodes an insert.
    fn encode_insert(
        &self,
        doc_ids: &[u128],
        user_ids: &[u128],
        vectors: &[f32],
        attributes: &[Attributes],
    ) -> Result<Vec<u8>> {
        let dim = self.config().dimension;
        validate_ids(doc_ids, user_ids)?;
        if !attributes.is_empty() {
            if attributes.len() != doc_ids.len() {
                return Err(CollectionError::invalid(
                    "attributes",
                    format!(
                        "expected none or one per document ({}), got {}",
                        doc_ids.len(),
                        attributes.len()
                    ),
                ));
            }
            let schema = self.schema();
            for (doc_idx, document) in attributes.iter().enumerate() {
                schema.validate(document).map_err(|error| {
                    CollectionError::attributes(
                        "attributes",
                        Some(format!("document {doc_idx}")),
                        &error,
                    )
                })?;
                if let Some(payload) = document.payload() {
                    if let Err(error) = serde_json::from_str::<serde::de::IgnoredAny>(payload) {
                        return Err(CollectionError::invalid(
                            "payload",
                            format!("document {doc_idx}: not a JSON text ({error})"),
                        ));
                    }
                }
            }
        }
        if vectors.len() != doc_ids.len() * dim {
            return Err(CollectionError::invalid(
                "vectors",
                format!(
                    "expected {} values ({} documents x dimension {dim}), got {}",
                    doc_ids.len() * dim,
                    doc_ids.len(),
                    vectors.len()
                ),
            ));
        }
        if let Some(idx) = vectors.iter().position(|v| !v.is_finite()) {
            return Err(CollectionError::invalid(
                "vectors",
                format!(
                    "value {idx} (document {}) is not a finite number",
                    idx / dim
                ),
            ));
        }
        let metric = self.config().metric();
        let mut prepared = vectors.to_vec();
        for (doc_idx, vector) in prepared.chunks_exact_mut(dim).enumerate() {
            if !metric.prepare(vector) {
                return Err(CollectionError::invalid(
                    "vectors",
                    format!("document {doc_idx} is a zero vector, which has no cosine direction"),
                ));
            }
        }
        // Documents without attributes are logged as an insert without them (version 1).
        let attributes = if attributes.iter().all(Attributes::is_empty) {
            &[][..]
        } else {
            attributes
        };
        Ok(op::encode_insert(
            user_ids, doc_ids, dim, &prepared, attributes,
        ))
    }

    /// Removes the listed documents of the listed tenants (tenant 0 when none). Removing a
    /// document that does not exist is not an error.
    pub async fn remove(
        &self,
        doc_ids: &[u128],
        user_ids: &[u128],
        durability: Option<Durability>,
    ) -> Result<u64> {
        self.check_not_failed()?;
        validate_ids(doc_ids, user_ids)?;
        let payload = op::encode_remove(user_ids, doc_ids);
        let durability = durability.unwrap_or_else(|| self.config().durability());
        Ok(self.handle.wal.append(payload.into(), durability).await?)
    }

    /// The stored vectors (unit length under cosine) of the listed documents of one tenant that
    /// exist, in request order. An error when a vector left on disk cannot be read or fails
    /// its checksum (`vectors_on_disk`): [`ErrorKind::DataLoss`] for a damaged file.
    pub fn get(&self, user_id: u128, doc_ids: &[u128]) -> Result<Vec<(u128, Vec<f32>)>> {
        let set = self.shared().segments();
        let mut found = Vec::with_capacity(doc_ids.len());
        for &doc_id in doc_ids {
            if let Some(vector) = set.get(user_id, doc_id)? {
                found.push((doc_id, vector));
            }
        }
        Ok(found)
    }

    /// `get` with each document's attributes: `(doc_id, vector, attributes)` of the listed
    /// documents of one tenant that exist, in request order (empty attributes for a document
    /// stored without any).
    pub fn get_with_attributes(
        &self,
        user_id: u128,
        doc_ids: &[u128],
    ) -> Result<Vec<(u128, Vec<f32>, Attributes)>> {
        let set = self.shared().segments();
        let mut found = Vec::with_capacity(doc_ids.len());
        for &doc_id in doc_ids {
            if let Some((vector, attributes)) = set.get_with_attributes(user_id, doc_id, true)? {
                found.push((doc_id, vector, attributes));
            }
        }
        Ok(found)
    }

    /// `get_with_attributes` with each document's values reduced to `output` (validated
    /// against the schema, naming `output_fields`); stored values are read only when the
    /// selection needs them.
    pub fn get_selected(
        &self,
        user_id: u128,
        doc_ids: &[u128],
        output: &FieldSelection,
    ) -> Result<Vec<(u128, Vec<f32>, Attributes)>> {
        let schema = self.schema();
        output.validate(&schema)?;
        let stored = output.needs_stored(&schema);
        let set = self.shared().segments();
        let mut found = Vec::with_capacity(doc_ids.len());
        for &doc_id in doc_ids {
            // One lookup: the vector and the values of the same version.
            let got = match output.is_empty() {
                true => set
                    .get(user_id, doc_id)?
                    .map(|vector| (vector, Attributes::new())),
                false => set
                    .get_with_attributes(user_id, doc_id, stored)?
                    .map(|(vector, document)| (vector, output.apply(document))),
            };
            if let Some((vector, document)) = got {
                found.push((doc_id, vector, document));
            }
        }
        Ok(found)
    }

    /// One page of the live documents of `user_ids` (tenant 0 when none; a tenant listed twice
    /// counts once) matching `filter` (every one when `None`), in (user_id, doc_id) order,
    /// strictly after the pair `after`: at most `limit` (1..=10,000), each with the values
    /// `output` selects and, with `with_vectors`, its vector (else an empty one). The page is
    /// read from the segments at the moment of the call: a document live and unchanged for a
    /// whole scroll comes exactly once; one written or removed meanwhile may or may not.
    /// Bad input is named (`limit`, `user_ids`, `filter`, `output_fields`).
    pub fn scroll(
        &self,
        user_ids: &[u128],
        filter: Option<&Filter>,
        after: Option<(u128, u128)>,
        limit: usize,
        output: &FieldSelection,
        with_vectors: bool,
    ) -> Result<ScrollPage> {
        if !(1..=MAX_SCROLL_LIMIT).contains(&limit) {
            return Err(CollectionError::invalid(
                "limit",
                format!("must be 1 to {MAX_SCROLL_LIMIT}"),
            ));
        }
        if user_ids.len() > 10_000 {
            return Err(CollectionError::invalid(
                "user_ids",
                "at most 10000 tenants per scroll",
            ));
        }
        let schema = self.schema();
        output.validate(&schema)?;
        let stored = output.needs_stored(&schema);
        let tenants = distinct_tenants(user_ids);
        let everything = Filter::All(Vec::new());
        let pairs = self.matching_documents(&tenants, filter.unwrap_or(&everything))?;
        let rest = &pairs[after.map_or(0, |after| pairs.partition_point(|p| *p <= after))..];
        let set = self.shared().segments();
        let mut docs = Vec::with_capacity(limit.min(rest.len()));
        for &(user_id, doc_id) in rest.iter().take(limit) {
            // One lookup: the vector and the values of the same version.
            let found = match with_vectors {
                true => set.get_with_attributes(user_id, doc_id, stored)?,
                false => set
                    .document(user_id, doc_id, stored)?
                    .map(|values| (Vec::new(), values)),
            };
            if let Some((vector, values)) = found {
                docs.push((user_id, doc_id, vector, output.apply(values)));
            }
        }
        Ok(ScrollPage {
            docs,
            next: (rest.len() > limit).then(|| rest[limit - 1]),
        })
    }

    /// Every live document, as `(user_id, doc_id, vector)` in (user, doc) order, read from the
    /// segments at the moment of the call (what an import into another collection copies). Writes
    /// applied meanwhile may or may not be included; call it on a collection that takes none.
    /// An item is an error when a vector left on disk cannot be read (as `get`).
    pub fn export_documents(&self) -> impl Iterator<Item = Result<(u128, u128, Vec<f32>)>> {
        self.export(false)
            .map(|item| item.map(|(user_id, doc_id, vector, _)| (user_id, doc_id, vector)))
    }

    /// `export_documents` with each document's attributes, stored values included.
    pub fn export_documents_with_attributes(
        &self,
    ) -> impl Iterator<Item = Result<(u128, u128, Vec<f32>, Attributes)>> {
        self.export(true)
    }

    /// The export's documents, their stored values read only with `stored`.
    fn export(
        &self,
        stored: bool,
    ) -> impl Iterator<Item = Result<(u128, u128, Vec<f32>, Attributes)>> {
        let set = self.shared().segments();
        let pairs = set.live_documents();
        pairs.into_iter().filter_map(move |(user_id, doc_id)| {
            set.get_with_attributes(user_id, doc_id, stored)
                .map(|found| {
                    found.map(|(vector, attributes)| (user_id, doc_id, vector, attributes))
                })
                .transpose()
        })
    }

    /// The live `(user_id, doc_id)` pairs of the listed tenants (tenant 0 when none) whose
    /// attributes match `filter`, sorted, read from the segments at the moment of the call
    /// (what a remove by filter resolves to ids before logging removes). The filter is
    /// validated first, naming `filter`.
    pub fn matching_documents(
        &self,
        user_ids: &[u128],
        filter: &Filter,
    ) -> Result<Vec<(u128, u128)>> {
        self.validate_filter(filter)?;
        Ok(self
            .shared()
            .segments()
            .matching_documents(user_ids, filter))
    }

    /// The exact number of live `(user_id, doc_id)` pairs of the listed tenants (tenant 0 when
    /// none; a tenant listed twice counts once) matching `filter` (every document when `None`),
    /// read from the segments at the moment of the call. The filter is validated first, naming
    /// `filter`.
    pub fn count(&self, user_ids: &[u128], filter: Option<&Filter>) -> Result<u64> {
        if user_ids.len() > 10_000 {
            return Err(CollectionError::invalid(
                "user_ids",
                "at most 10000 tenants per count",
            ));
        }
        let tenants = distinct_tenants(user_ids);
        match filter {
            Some(filter) => Ok(self.matching_documents(&tenants, filter)?.len() as u64),
            None => {
                let apply = self.shared().apply.lock();
                Ok(tenants
                    .iter()
                    .map(|t| apply.counts.get(t).copied().unwrap_or(0))
                    .sum())
            }
        }
    }

    fn validate_filter(&self, filter: &Filter) -> Result<()> {
        filter
            .validate(&self.schema())
            .map_err(|error| CollectionError::attributes("filter", None, &error))
    }

    /// The highest sequence number reads may see (`None`: every logged entry is applied as
    /// it comes). See [`Collection::hold_uncommitted`].
    pub fn visible_seq(&self) -> Option<u64> {
        match self.shared().visible.load(Ordering::Acquire) {
            u64::MAX => None,
            seq => Some(seq),
        }
    }

    /// Makes this collection a replicated shard's copy: entries logged from now on past
    /// `committed` are applied (become visible to searches and gets, and to checkpoints and
    /// snapshots) only once [`Collection::raise_visible`] raises the bound over them, so that
    /// no read returns an entry that a failover may later cut (Kafka's high watermark). A
    /// collection held already keeps its bound. A copy with an epoch history opens held at
    /// its checkpoint. The bound is never below what is applied already.
    pub fn hold_uncommitted(&self, committed: u64) {
        let applied = *self.shared().applied.borrow();
        let held = self.shared().visible.compare_exchange(
            u64::MAX,
            committed.max(applied),
            Ordering::AcqRel,
            Ordering::Acquire,
        );
        // A replica calls this on every batch: ingestion is woken only when the bound is new.
        if held.is_ok() {
            self.wake_ingestion();
        }
    }

    /// Raises the visible bound to `committed` (never lowers it); the held entries up to it
    /// are applied in order.
    pub fn raise_visible(&self, committed: u64) {
        if self.shared().visible.fetch_max(committed, Ordering::AcqRel) < committed {
            self.wake_ingestion();
        }
    }

    /// Every logged entry is applied as it comes, from now on (a shard that has no replicas
    /// any more).
    pub fn release_uncommitted(&self) {
        if self.shared().visible.swap(u64::MAX, Ordering::AcqRel) != u64::MAX {
            self.wake_ingestion();
        }
    }

    /// Tells ingestion the bound moved. Never blocks: a full channel means ingestion has
    /// signals to take, and it looks at the bound after each.
    fn wake_ingestion(&self) {
        let _ = self.handle.signals.try_send(IngestSignal::Visible);
    }

    /// Waits until operation `seq` is applied (searchable), up to `timeout`.
    pub async fn wait_applied(&self, seq: u64, timeout: Duration) -> Result<()> {
        let mut applied = self.shared().applied.subscribe();
        let failure = &self.shared().failure;
        let reached = tokio::time::timeout(timeout, async {
            applied
                .wait_for(|a| *a >= seq || failure.get().is_some())
                .await
                .is_ok()
        })
        .await;
        match reached {
            // Applied before the failure: the wait is over either way.
            Ok(true) if *self.shared().applied.borrow() >= seq => Ok(()),
            Ok(true) => Err(self.closed_or_failed()),
            Ok(false) => Err(self.closed_or_failed()),
            Err(_) => Err(CollectionError::DeadlineExceeded {
                seq,
                applied: *self.shared().applied.borrow(),
            }),
        }
    }

    /// Checks a search request. Call before `wait_applied` so a bad request fails at once.
    pub fn validate_search(&self, request: &SearchRequest) -> Result<()> {
        let dim = self.config().dimension;
        if let Some(text) = &request.text {
            self.text_terms(text)?;
            if !request.vector.is_empty() {
                request.hybrid.validate()?;
            }
        }
        if request.text.is_some() && request.vector.is_empty() {
            // Full text alone.
        } else if request.vector.len() != dim {
            return Err(CollectionError::invalid(
                "vector",
                format!("expected dimension {dim}, got {}", request.vector.len()),
            ));
        }
        if request.vector.iter().any(|v| !v.is_finite()) {
            return Err(CollectionError::invalid(
                "vector",
                "contains a value that is not a finite number",
            ));
        }
        if !(1..=MAX_TOP_K).contains(&request.top_k) {
            return Err(CollectionError::invalid(
                "top_k",
                format!("must be from 1 to {MAX_TOP_K}, got {}", request.top_k),
            ));
        }
        if request.ef > MAX_TOP_K {
            return Err(CollectionError::invalid(
                "ef",
                format!("must be at most {MAX_TOP_K}"),
            ));
        }
        if request.user_ids.len() > 10_000 {
            return Err(CollectionError::invalid(
                "user_ids",
                "at most 10000 tenants per search",
            ));
        }
        if let Some(filter) = &request.filter {
            self.validate_filter(filter)?;
        }
        // Names only: a search that selects none (most) does not read the schema for it.
        if !request.output.fields.is_empty() {
            request.output.validate(&self.schema())?;
        }
        Ok(())
    }

    /// Nearest documents among the given tenants, best first. CPU-bound: async callers run it
    /// off their runtime's workers (`spawn_blocking`). It does not wait: if `min_seq` is not
    /// applied yet it fails with `DeadlineExceeded` (use `search_after` or `wait_applied`).
    pub fn search(&self, request: &SearchRequest) -> Result<Vec<SearchHit>> {
        self.validate_search(request)?;
        let applied = *self.shared().applied.borrow();
        if request.min_seq > applied {
            return Err(CollectionError::DeadlineExceeded {
                seq: request.min_seq,
                applied,
            });
        }
        let set = self.shared().segments();
        let text_hits = |text: &TextQuery, k: usize| -> Result<Vec<(u128, u128, f32)>> {
            let terms = self.text_terms(text)?;
            let hits = set.text_search(
                &request.user_ids,
                &text.field,
                &terms,
                &self.config().bm25.index(),
                k,
                request.filter.as_ref(),
                text.stats.as_ref(),
            );
            Ok(hits
                .into_iter()
                .map(|hit| (hit.user_id, hit.doc_id, -hit.distance))
                .collect())
        };
        let fused = match &request.text {
            Some(text) if request.vector.is_empty() => {
                Fused::unfused(text_hits(text, request.top_k)?)
            }
            Some(text) => {
                let depth = request.hybrid.depth_for(request.top_k);
                let vector = self.vector_hits(&set, request, depth)?;
                let text = text_hits(text, depth)?;
                let higher = self.config().metric().higher_is_better();
                fuse(&vector, higher, &text, &request.hybrid, request.top_k)
            }
            None => Fused::unfused(self.vector_hits(&set, request, request.top_k)?),
        };
        self.with_values(&set, request, fused)
    }

    /// The `k` nearest documents to the request's vector as `(user, doc, score)`, best first.
    fn vector_hits(
        &self,
        set: &SegmentSet,
        request: &SearchRequest,
        k: usize,
    ) -> Result<Vec<(u128, u128, f32)>> {
        let metric = self.config().metric();
        let mut query = request.vector.clone();
        if !metric.prepare(&mut query) {
            return Err(CollectionError::invalid(
                "vector",
                "a zero vector has no cosine direction",
            ));
        }
        let ef = if request.ef == 0 {
            self.config().hnsw.ef_search
        } else {
            request.ef
        };
        let hits = set.search(
            &request.user_ids,
            &query,
            k,
            ef.max(k),
            request.exact,
            request.filter.as_ref(),
        )?;
        Ok(hits
            .into_iter()
            .map(|hit| (hit.user_id, hit.doc_id, metric.score(hit.distance)))
            .collect())
    }

    /// The BM25 statistics of a text query over the live documents of `user_ids` (the first
    /// phase of a cluster's full-text search; [`TextQuery::stats`]). Errors as `text_terms`.
    pub fn text_stats(&self, user_ids: &[u128], text: &TextQuery) -> Result<TextStats> {
        let terms = self.text_terms(text)?;
        Ok(self
            .shared()
            .segments()
            .text_stats(user_ids, &text.field, &terms))
    }

    /// The terms of a text query, analysed by its field's analyzer; INVALID_ARGUMENT naming
    /// `text.field` or `text.query` for a field that is not a declared TEXT field, a query
    /// with no term, or one past the limits.
    pub fn text_terms(&self, text: &TextQuery) -> Result<Vec<String>> {
        let schema = self.schema();
        let Some(spec) = schema.field(&text.field) else {
            return Err(CollectionError::invalid(
                "text.field",
                format!(
                    "{} is not a declared field",
                    tarn_index::shown_name(&text.field)
                ),
            ));
        };
        if spec.field_type != FieldType::Text {
            return Err(CollectionError::invalid(
                "text.field",
                format!(
                    "{:?} is a {} field: full-text search needs a TEXT field",
                    text.field, spec.field_type
                ),
            ));
        }
        if text.query.len() > TextQuery::MAX_QUERY_BYTES {
            return Err(CollectionError::invalid(
                "text.query",
                format!(
                    "{} bytes, at most {} allowed",
                    text.query.len(),
                    TextQuery::MAX_QUERY_BYTES
                ),
            ));
        }
        let terms = spec.analyzer.tokens(&text.query);
        if terms.is_empty() {
            return Err(CollectionError::invalid(
                "text.query",
                "has no searchable term (it is empty, or only punctuation or stop words)",
            ));
        }
        if terms.len() > TextQuery::MAX_TERMS {
            return Err(CollectionError::invalid(
                "text.query",
                format!(
                    "{} terms, at most {} allowed",
                    terms.len(),
                    TextQuery::MAX_TERMS
                ),
            ));
        }
        if let Some(stats) = &text.stats {
            let consistent = stats.doc_freqs.len() == terms.len()
                && stats.doc_freqs.iter().all(|&df| df <= stats.n_docs);
            if !consistent {
                return Err(CollectionError::invalid(
                    "text.stats",
                    format!(
                        "{} document frequencies (at most n_docs each) for a query of {} terms",
                        stats.doc_freqs.len(),
                        terms.len()
                    ),
                ));
            }
        }
        Ok(terms)
    }

    /// A search's hits with the values the request selects.
    fn with_values(
        &self,
        set: &SegmentSet,
        request: &SearchRequest,
        hits: Vec<Fused>,
    ) -> Result<Vec<SearchHit>> {
        // The hits' values come from the segments the search read (an upsert of the same
        // document applied meanwhile to the live mutable segment can show its newer values).
        let stored = !request.output.is_empty() && request.output.needs_stored(&self.schema());
        hits.into_iter()
            .map(|hit| {
                let fields = match request.output.is_empty() {
                    true => None,
                    false => set
                        .document(hit.user_id, hit.doc_id, stored)?
                        .map(|document| request.output.apply(document)),
                };
                Ok(SearchHit {
                    doc_id: hit.doc_id,
                    user_id: hit.user_id,
                    score: hit.score,
                    fields,
                    vector_side: hit.vector,
                    text_side: hit.text,
                })
            })
            .collect()
    }

    /// Read-your-writes search: waits up to `timeout` for `min_seq` to be applied, then searches
    /// (on the calling thread).
    pub async fn search_after(
        &self,
        request: &SearchRequest,
        timeout: Duration,
    ) -> Result<Vec<SearchHit>> {
        self.validate_search(request)?;
        if request.min_seq > 0 {
            self.wait_applied(request.min_seq, timeout).await?;
        }
        self.search(request)
    }

    /// Makes everything acknowledged so far durable and checkpointed; returns the checkpoint's
    /// sequence number.
    pub async fn flush(&self) -> Result<u64> {
        self.check_not_failed()?;
        let synced = self.handle.wal.sync().await?;
        // Every entry up to `synced` was handed to ingestion before the barrier resolved; the
        // batch's checkpoint is taken once ingestion applied the highest such number of its
        // members (`flush.rs`).
        let result = match self.shared().flushes.join(synced) {
            Joined::Member(result) => result,
            Joined::Leader { batch, previous } => {
                let result = batch.subscribe();
                let leader = FlushLeader {
                    shared: Arc::clone(&self.handle.shared),
                    signals: self.handle.signals.clone(),
                    batch: Some(batch),
                };
                // Flushes that arrive meanwhile join this batch.
                if let Some(previous) = previous {
                    let _ = batch_result(previous).await;
                }
                leader.request();
                result
            }
        };
        let checkpoint_seq = batch_result(result).await?;
        debug_assert!(checkpoint_seq >= synced);
        Ok(checkpoint_seq)
    }

    pub fn stats(&self) -> CollectionStats {
        let shared = self.shared();
        let set = shared.segments();
        let wal_bytes = self.handle.wal.stats().n_bytes;
        let bytes_on_disk = shared.disk_bytes_measured.load(Ordering::Relaxed)
            + wal_bytes.saturating_sub(shared.wal_bytes_at_measure.load(Ordering::Relaxed));
        let mut stats = CollectionStats {
            n_documents: shared.n_documents.load(Ordering::Relaxed),
            n_tenants: shared.n_tenants.load(Ordering::Relaxed),
            n_sealed_segments: set.sealed.len(),
            last_appended_seq: self.handle.wal.last_appended_seq(),
            durable_seq: self.handle.wal.last_durable_seq(),
            applied_seq: *shared.applied.borrow(),
            checkpoint_seq: shared.checkpoint_seq.load(Ordering::Acquire),
            bytes_on_disk,
            memory_bytes: (set.mutable.memory_bytes()
                + set
                    .frozen
                    .iter()
                    .map(|(_, f)| f.memory_bytes())
                    .sum::<usize>()) as u64,
            n_ingest_errors: shared.n_ingest_errors.load(Ordering::Relaxed),
            n_checkpoints: shared.n_checkpoints.load(Ordering::Relaxed),
            n_checkpoints_refused: shared.n_checkpoints_refused.load(Ordering::Relaxed),
            n_unindexed: set.n_unindexed() as u64,
            n_vectors_built: shared.n_vectors_built.load(Ordering::Relaxed),
            build_seconds: shared.build_micros.load(Ordering::Relaxed) as f64 / 1e6,
            text_index_bytes: std::iter::once(&set.mutable)
                .chain(set.frozen.iter().map(|(_, f)| f))
                .map(|m| m.text_memory_bytes() as u64)
                .sum(),
            ..CollectionStats::default()
        };
        for segment in &set.sealed {
            let figures = segment.figures();
            stats.n_removed_not_compacted += figures.n_tombstoned as u64;
            stats.memory_bytes += figures.memory_bytes as u64;
            stats.quantized_bytes += figures.quantized_bytes as u64;
            stats.text_index_bytes += figures.text_index_bytes as u64;
            stats.cold_bytes += figures.cold_bytes as u64;
        }
        stats
    }

    /// Live documents per tenant (a copy of the whole map, taken under the apply lock: for
    /// tests and diagnostics, not for every scrape).
    pub fn documents_per_tenant(&self) -> HashMap<u128, u64> {
        self.shared().apply.lock().counts.clone()
    }

    /// Starts a snapshot of the collection, consistent at the WAL's durable sequence number
    /// when it is called: it holds exactly the operations up to [`Snapshot::seq_no`], all of
    /// them durable on this collection's disk (under either durability mode: a sync barrier
    /// makes everything appended before the call durable first), and every operation
    /// acknowledged before the call. Read it as the bytes of a `.tsnap` file. Writes,
    /// searches, checkpoints and merges go on meanwhile; until the snapshot is dropped,
    /// checkpoints keep the files and WAL entries it reads. Blocking (a WAL sync, and one pass
    /// over the WAL entries after the checkpoint, whose lengths the file's framing needs).
    pub fn snapshot(&self) -> Result<Snapshot> {
        Snapshot::take(self.shared(), &self.handle.wal)
    }

    /// Snapshots of this collection not yet dropped (each pins files and WAL; for metrics).
    pub fn n_open_snapshots(&self) -> usize {
        self.shared().retention.n_pins()
    }

    /// The WAL's counters and histograms (for metrics).
    pub fn wal_stats(&self) -> tarn_wal::WalStats {
        self.handle.wal.stats()
    }

    /// Why writes are refused, if they are: a dead collection thread, or the WAL's first
    /// poisoning error.
    pub fn write_error(&self) -> Option<String> {
        match self.failure() {
            Some(failure) => Some(failure.to_string()),
            None => self.handle.wal.poisoned().map(|e| e.to_string()),
        }
    }

    /// The thread whose death failed the collection, if one did (until it is reopened).
    pub fn failure(&self) -> Option<&ThreadFailure> {
        self.shared().failure.get()
    }

    pub(crate) fn check_not_failed(&self) -> Result<()> {
        match self.failure() {
            Some(failure) => Err(CollectionError::Failed(failure.clone())),
            None => Ok(()),
        }
    }

    /// The error for a wait whose other side is gone: the failure, if that is why.
    fn closed_or_failed(&self) -> CollectionError {
        match self.failure() {
            Some(failure) => CollectionError::Failed(failure.clone()),
            None => CollectionError::Closed,
        }
    }

    /// Stops ingestion after applying everything acknowledged; the WAL is synced. Later writes
    /// fail with `Unavailable`.
    pub fn close(&self) {
        self.handle.shut_down();
    }

    pub fn metric(&self) -> Metric {
        self.config().metric()
    }
}

/// A flush batch's leader until it has requested the checkpoint; dropped before that (its
/// caller went away), it requests it then, so the batch's other members are answered.
struct FlushLeader {
    shared: Arc<Shared>,
    signals: SyncSender<IngestSignal>,
    batch: Option<Arc<crate::flush::Batch>>,
}

impl FlushLeader {
    fn request(mut self) {
        self.request_now();
    }

    fn request_now(&mut self) {
        let Some(batch) = self.batch.take() else {
            return;
        };
        if self.shared.flushes.request(&self.shared, &batch) {
            // Full: ingestion is busy and looks at the request after its next signal.
            if let Err(std::sync::mpsc::TrySendError::Disconnected(_)) =
                self.signals.try_send(IngestSignal::Flush)
            {
                self.shared.flushes.close();
            }
        }
    }
}

impl Drop for FlushLeader {
    fn drop(&mut self) {
        self.request_now();
    }
}

fn validate_ids(doc_ids: &[u128], user_ids: &[u128]) -> Result<()> {
    if doc_ids.is_empty() {
        return Err(CollectionError::invalid("doc_ids", "must not be empty"));
    }
    let n_pairs = doc_ids.len().saturating_mul(user_ids.len().max(1));
    if n_pairs > MAX_PAIRS_PER_REQUEST {
        return Err(CollectionError::invalid(
            "user_ids",
            format!(
                "{} documents x {} tenants exceeds {MAX_PAIRS_PER_REQUEST} pairs",
                doc_ids.len(),
                user_ids.len()
            ),
        ));
    }
    Ok(())
}

fn dir_size(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|entry| match entry.metadata() {
            Ok(meta) if meta.is_dir() => dir_size(&entry.path()),
            Ok(meta) => meta.len(),
            Err(_) => 0,
        })
        .sum()
}

/// Loads the newest manifest whose files all check out, falling back to older ones.
fn load_checkpoint(
    dir: &Path,
    config: &CollectionConfig,
) -> Result<(CheckpointState, Vec<Arc<SealedSegment>>)> {
    let generations = manifest::list_manifests(dir)?;
    let next_generation = generations.first().map_or(1, |g| g + 1);
    if generations.is_empty() {
        let state = CheckpointState {
            current: Manifest::empty(),
            previous: None,
            next_generation,
            persisted_tombstones: HashMap::new(),
        };
        return Ok((state, Vec::new()));
    }
    let mut failures = Vec::new();
    for (idx, &generation) in generations.iter().enumerate() {
        let path = manifest::manifest_path(dir, generation);
        match load_manifest(dir, &path, config) {
            Ok((current, sealed)) => {
                if !failures.is_empty() {
                    tracing::error!(?failures, fallback = %path.display(), "newer checkpoints are damaged; fell back to an older one");
                }
                // The manifest before it stays the fallback if it is readable.
                let previous = generations[idx + 1..].iter().find_map(|&g| {
                    manifest::read_checked::<Manifest>(&manifest::manifest_path(dir, g)).ok()
                });
                let persisted_tombstones = sealed
                    .iter()
                    .map(|s| (s.id(), s.figures().n_tombstoned))
                    .collect();
                let state = CheckpointState {
                    current,
                    previous,
                    next_generation,
                    persisted_tombstones,
                };
                return Ok((state, sealed));
            }
            Err(error) => failures.push(format!("{}: {error}", path.display())),
        }
    }
    Err(CollectionError::Corrupt(format!(
        "no valid checkpoint remains; refusing to serve possibly wrong data: {}",
        failures.join("; ")
    )))
}

fn load_manifest(
    dir: &Path,
    path: &Path,
    config: &CollectionConfig,
) -> Result<(Manifest, Vec<Arc<SealedSegment>>)> {
    let manifest: Manifest = manifest::read_checked(path)?;
    let mut sealed = Vec::with_capacity(manifest.segments.len());
    for entry in &manifest.segments {
        sealed.push(Arc::new(open_sealed_segment(dir, entry, config)?));
    }
    SegmentSet::sort_sealed(&mut sealed);
    Ok((manifest, sealed))
}

/// Opens one segment a manifest lists, with its tombstone file, checking that it is the
/// segment the manifest says.
pub(crate) fn open_sealed_segment(
    dir: &Path,
    entry: &SegmentEntry,
    config: &CollectionConfig,
) -> Result<SealedSegment> {
    let segment = SealedSegment::open(&dir.join(&entry.file), config.index_config())?;
    if segment.id() != entry.id {
        return Err(CollectionError::Corrupt(format!(
            "{} holds segment {}, not {}",
            entry.file,
            segment.id(),
            entry.id
        )));
    }
    if let Some(tombstones) = &entry.tombstones {
        segment.apply_tombstones(&dir.join(tombstones))?;
    }
    Ok(segment)
}
