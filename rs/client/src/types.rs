//! tarn's values on the client side: ids as `u128`, vectors as `f32` slices, and the requests
//! and answers of each call. Conversions to and from the wire types stay in this crate.

use std::time::Duration;

use tarn_proto::v1 as pb;

use crate::attributes::{Attributes, FieldSpec, FieldType, TextAnalyzer};
use crate::error::{Error, Result};
use crate::filter::Filter;

/// How vectors are compared. Fixed when the collection is created.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Metric {
    /// Cosine similarity (higher is better); vectors are stored at unit length.
    Cosine,
    /// Euclidean distance (lower is better).
    L2,
    /// Inner product (higher is better).
    Dot,
}

impl Metric {
    /// `cosine`, `l2` or `dot`.
    pub fn as_str(self) -> &'static str {
        match self {
            Metric::Cosine => "cosine",
            Metric::L2 => "l2",
            Metric::Dot => "dot",
        }
    }

    pub(crate) fn to_wire(self) -> i32 {
        let metric = match self {
            Metric::Cosine => pb::Metric::Cosine,
            Metric::L2 => pb::Metric::L2,
            Metric::Dot => pb::Metric::Dot,
        };
        metric as i32
    }

    fn from_wire(value: i32) -> Result<Metric> {
        match pb::Metric::try_from(value) {
            Ok(pb::Metric::Cosine) => Ok(Metric::Cosine),
            Ok(pb::Metric::L2) => Ok(Metric::L2),
            Ok(pb::Metric::Dot) => Ok(Metric::Dot),
            _ => Err(Error::invalid(
                "metric",
                format!("the server sent unknown value {value}"),
            )),
        }
    }
}

impl std::str::FromStr for Metric {
    type Err = Error;

    /// `cosine`, `l2` or `dot`, in any case.
    fn from_str(name: &str) -> Result<Metric> {
        match name.to_ascii_lowercase().as_str() {
            "cosine" => Ok(Metric::Cosine),
            "l2" => Ok(Metric::L2),
            "dot" => Ok(Metric::Dot),
            _ => Err(Error::invalid(
                "metric",
                format!("unknown metric {name:?} (cosine, l2 or dot)"),
            )),
        }
    }
}

/// When a write is acknowledged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Durability {
    /// After an `fdatasync` that covers the write: survives power loss.
    Fsync,
    /// After `write(2)`: survives a crash of the server process; a power loss can lose up to
    /// the server's background sync interval (100 ms).
    Written,
}

impl Durability {
    /// `fsync` or `written`.
    pub fn as_str(self) -> &'static str {
        match self {
            Durability::Fsync => "fsync",
            Durability::Written => "written",
        }
    }

    pub(crate) fn to_wire(durability: Option<Durability>) -> i32 {
        let durability = match durability {
            None => pb::Durability::Unspecified,
            Some(Durability::Fsync) => pb::Durability::Fsync,
            Some(Durability::Written) => pb::Durability::Written,
        };
        durability as i32
    }

    fn from_wire(value: i32) -> Durability {
        match pb::Durability::try_from(value) {
            Ok(pb::Durability::Written) => Durability::Written,
            _ => Durability::Fsync,
        }
    }
}

impl std::str::FromStr for Durability {
    type Err = Error;

    /// `fsync` or `written`, in any case.
    fn from_str(name: &str) -> Result<Durability> {
        match name.to_ascii_lowercase().as_str() {
            "fsync" => Ok(Durability::Fsync),
            "written" => Ok(Durability::Written),
            _ => Err(Error::invalid(
                "durability",
                format!("unknown durability {name:?} (fsync or written)"),
            )),
        }
    }
}

pub(crate) fn id_to_wire(value: u128) -> pb::Id {
    pb::Id {
        high: (value >> 64) as u64,
        low: value as u64,
    }
}

pub(crate) fn id_from_wire(id: Option<&pb::Id>) -> u128 {
    id.map_or(0, |id| (u128::from(id.high) << 64) | u128::from(id.low))
}

/// Cluster mode: what decides a document's shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum ShardKey {
    /// The tenant: a tenant's documents share one shard, so its searches touch one node.
    #[default]
    User,
    /// The document: a large tenant spreads over every shard; searches fan out.
    Doc,
}

impl ShardKey {
    pub(crate) fn to_wire(self) -> i32 {
        let key = match self {
            ShardKey::User => pb::ShardKey::User,
            ShardKey::Doc => pb::ShardKey::Doc,
        };
        key as i32
    }

    fn from_wire(value: i32) -> ShardKey {
        match pb::ShardKey::try_from(value) {
            Ok(pb::ShardKey::Doc) => ShardKey::Doc,
            _ => ShardKey::User,
        }
    }
}

impl std::str::FromStr for ShardKey {
    type Err = Error;

    /// `user` or `doc`, in any case.
    fn from_str(name: &str) -> Result<ShardKey> {
        match name.to_ascii_lowercase().as_str() {
            "user" => Ok(ShardKey::User),
            "doc" => Ok(ShardKey::Doc),
            _ => Err(Error::invalid(
                "shard_key",
                format!("unknown shard key {name:?} (user or doc)"),
            )),
        }
    }
}

/// A collection to create: name, dimension and metric, and optionally the HNSW parameters, the
/// default durability, the attribute fields documents may carry (filtered search) and
/// (cluster mode) the shards (zero and `None` take the server's defaults).
///
/// ```
/// use tarn_client::{CollectionSpec, Durability, FieldType, Metric};
/// let spec = CollectionSpec::new("docs", 384)
///     .metric(Metric::L2)
///     .hnsw(16, 200, 64)
///     .default_durability(Durability::Written)
///     .field("section", FieldType::Keyword)
///     .field("installed_size_kb", FieldType::Number);
/// assert_eq!(spec.name(), "docs");
/// ```
#[derive(Debug, Clone)]
pub struct CollectionSpec {
    name: String,
    dimension: u32,
    metric: Metric,
    m: u32,
    ef_construction: u32,
    ef_search: u32,
    default_durability: Option<Durability>,
    shards: u32,
    shard_key: ShardKey,
    replication_factor: u32,
    min_in_sync: u32,
    fields: Vec<FieldSpec>,
    quantization: Quantization,
    vectors_on_disk: bool,
    bm25: Option<(f64, f64)>,
}

/// How a collection keeps its sealed vectors for the graph walk. Returned scores are always
/// the exact metric on the full vectors, whatever the quantization.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Quantization {
    /// Full `f32` vectors only.
    #[default]
    None,
    /// One byte per dimension; the graph walk reads the codes.
    Int8 {
        /// Candidates per result rescored on the full vectors (0 when creating: the server's
        /// default).
        rescore: u32,
    },
    /// RaBitQ codes (a randomly rotated residual, `bits` per dimension); the graph walk reads
    /// the codes.
    Rabitq {
        /// Bits per dimension, 1 to 8 (0 when creating: 1).
        bits: u32,
        /// Candidates per result rescored on the full vectors (0 when creating: the server's
        /// default for the bits).
        rescore: u32,
    },
}

impl Quantization {
    fn to_wire(self) -> Option<pb::Quantization> {
        match self {
            Quantization::None => None,
            Quantization::Int8 { rescore } => Some(pb::Quantization {
                kind: pb::QuantizationKind::QuantizationInt8 as i32,
                bits: 0,
                rescore,
            }),
            Quantization::Rabitq { bits, rescore } => Some(pb::Quantization {
                kind: pb::QuantizationKind::QuantizationRabitq as i32,
                bits,
                rescore,
            }),
        }
    }

    fn from_wire(quantization: Option<pb::Quantization>) -> Quantization {
        match quantization {
            Some(q) if q.kind == pb::QuantizationKind::QuantizationInt8 as i32 => {
                Quantization::Int8 { rescore: q.rescore }
            }
            Some(q) if q.kind == pb::QuantizationKind::QuantizationRabitq as i32 => {
                Quantization::Rabitq {
                    bits: q.bits,
                    rescore: q.rescore,
                }
            }
            _ => Quantization::None,
        }
    }
}

impl std::str::FromStr for Quantization {
    type Err = Error;

    /// `none`, `int8`, `int8:RESCORE`, `rabitq` (1 bit), `rabitq:BITS` or
    /// `rabitq:BITS:RESCORE`.
    fn from_str(text: &str) -> Result<Quantization> {
        let mut parts = text.split(':');
        let kind = parts.next().unwrap_or_default().trim().to_ascii_lowercase();
        let numbers = parts
            .map(|n| {
                n.trim()
                    .parse::<u32>()
                    .map_err(|_| Error::invalid("quantization", format!("bad number {n:?}")))
            })
            .collect::<Result<Vec<u32>>>()?;
        match (kind.as_str(), numbers.as_slice()) {
            ("none", []) => Ok(Quantization::None),
            ("int8", []) => Ok(Quantization::Int8 { rescore: 0 }),
            ("int8", [rescore]) => Ok(Quantization::Int8 { rescore: *rescore }),
            ("rabitq", []) => Ok(Quantization::Rabitq {
                bits: 1,
                rescore: 0,
            }),
            ("rabitq", [bits]) => Ok(Quantization::Rabitq {
                bits: *bits,
                rescore: 0,
            }),
            ("rabitq", [bits, rescore]) => Ok(Quantization::Rabitq {
                bits: *bits,
                rescore: *rescore,
            }),
            _ => Err(Error::invalid(
                "quantization",
                format!(
                    "{text:?} is not none, int8, int8:RESCORE, rabitq, rabitq:BITS or \
                     rabitq:BITS:RESCORE"
                ),
            )),
        }
    }
}

impl CollectionSpec {
    /// A cosine collection of `dimension`-long vectors named `name` (`[A-Za-z0-9_-]{1,64}`).
    pub fn new(name: impl Into<String>, dimension: u32) -> CollectionSpec {
        CollectionSpec {
            name: name.into(),
            dimension,
            metric: Metric::Cosine,
            m: 0,
            ef_construction: 0,
            ef_search: 0,
            default_durability: None,
            shards: 0,
            shard_key: ShardKey::User,
            replication_factor: 0,
            min_in_sync: 0,
            fields: Vec::new(),
            quantization: Quantization::None,
            vectors_on_disk: false,
            bm25: None,
        }
    }

    /// Declares a TEXT field analysed by `analyzer`: stored, returned on request and
    /// full-text searched ([`Search::text`]).
    pub fn text_field(mut self, name: impl Into<String>, analyzer: TextAnalyzer) -> CollectionSpec {
        self.fields.push(FieldSpec::text(name, analyzer));
        self
    }

    /// BM25's settings for full-text search: `k1` (0 to 10) and `b` (0 to 1); Lucene's 1.2 and
    /// 0.75 unless set.
    pub fn bm25(mut self, k1: f64, b: f64) -> CollectionSpec {
        self.bm25 = Some((k1, b));
        self
    }

    /// Quantized copies of sealed vectors for the graph walk (none unless set).
    pub fn quantization(mut self, quantization: Quantization) -> CollectionSpec {
        self.quantization = quantization;
        self
    }

    /// Leaves sealed full vectors in the segment files, read only to rescore a search's best
    /// candidates and for `get` (off unless set; needs a [`Quantization`], the server refuses
    /// it without one).
    pub fn vectors_on_disk(mut self, on_disk: bool) -> CollectionSpec {
        self.vectors_on_disk = on_disk;
        self
    }

    /// Declares an attribute field documents may carry (and filters test); every declared field
    /// is indexed. More can be added later ([`crate::Client::add_fields`]).
    pub fn field(mut self, name: impl Into<String>, field_type: FieldType) -> CollectionSpec {
        self.fields.push(FieldSpec::new(name, field_type));
        self
    }

    /// Cluster mode: copies of each shard, the primary included (0: the server's
    /// `--replication-factor`), and how many must be in sync for a write to be taken (0:
    /// `replication_factor - 1`, at least 1).
    pub fn replicas(mut self, replication_factor: u32, min_in_sync: u32) -> CollectionSpec {
        self.replication_factor = replication_factor;
        self.min_in_sync = min_in_sync;
        self
    }

    /// Cluster mode: how many shards (0: the server's default, 8) and what places a document.
    pub fn shards(mut self, shards: u32, shard_key: ShardKey) -> CollectionSpec {
        self.shards = shards;
        self.shard_key = shard_key;
        self
    }

    /// The metric (cosine unless set).
    pub fn metric(mut self, metric: Metric) -> CollectionSpec {
        self.metric = metric;
        self
    }

    /// HNSW links per node, build-time and default search-time `ef` (0 = the server's default).
    pub fn hnsw(mut self, m: u32, ef_construction: u32, ef_search: u32) -> CollectionSpec {
        (self.m, self.ef_construction, self.ef_search) = (m, ef_construction, ef_search);
        self
    }

    /// What writes that do not choose get (fsync unless set).
    pub fn default_durability(mut self, durability: Durability) -> CollectionSpec {
        self.default_durability = Some(durability);
        self
    }

    /// The collection's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    pub(crate) fn into_wire(self) -> pb::CreateCollectionRequest {
        pb::CreateCollectionRequest {
            name: self.name,
            dimension: self.dimension,
            metric: self.metric.to_wire(),
            hnsw: Some(pb::HnswParams {
                m: self.m,
                ef_construction: self.ef_construction,
                ef_search: self.ef_search,
            }),
            default_durability: Durability::to_wire(self.default_durability),
            shards: self.shards,
            shard_key: self.shard_key.to_wire(),
            replication_factor: self.replication_factor,
            min_in_sync: self.min_in_sync,
            fields: self.fields.iter().map(FieldSpec::to_wire).collect(),
            quantization: self.quantization.to_wire(),
            vectors_on_disk: self.vectors_on_disk,
            bm25: self.bm25.map(|(k1, b)| pb::Bm25Params {
                k1: Some(k1),
                b: Some(b),
            }),
        }
    }
}

/// What the server reports about a collection.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct CollectionInfo {
    /// The collection's name.
    pub name: String,
    /// The length of every vector.
    pub dimension: u32,
    /// How vectors are compared.
    pub metric: Metric,
    /// HNSW links per node.
    pub m: u32,
    /// The breadth of the graph search when a vector is indexed.
    pub ef_construction: u32,
    /// The default `ef` of searches.
    pub ef_search: u32,
    /// What writes that do not choose get.
    pub default_durability: Durability,
    /// Live (tenant, document) pairs.
    pub n_documents: u64,
    /// Tenants with at least one live document.
    pub n_tenants: u32,
    /// Last operation appended to the log.
    pub last_seq_no: u64,
    /// Last operation known to be on disk.
    pub durable_seq_no: u64,
    /// Last operation searchable.
    pub applied_seq_no: u64,
    /// Last operation in a checkpoint.
    pub checkpoint_seq_no: u64,
    /// Immutable segments on disk.
    pub n_sealed_segments: u32,
    /// Removed or replaced documents still taking space in sealed segments.
    pub n_removed_not_compacted: u64,
    /// The collection's files: segments, log, manifests.
    pub bytes_on_disk: u64,
    /// Stored vectors waiting for a graph, searched by exact scan meanwhile (a load that
    /// outran indexing); 0 once the collection is indexed.
    pub n_unindexed: u64,
    /// Cluster mode: the collection's shards (1 on a single node). The counters above are then
    /// sums over the shards.
    pub shards: u32,
    /// Cluster mode: what places a document.
    pub shard_key: ShardKey,
    /// Cluster mode: copies of each shard, the primary included (1 on a single node).
    pub replication_factor: u32,
    /// Cluster mode: the fewest copies in sync that writes need (1 on a single node).
    pub min_in_sync: u32,
    /// The declared attribute fields, in declaration order.
    pub fields: Vec<FieldSpec>,
    /// The collection's quantization (its rescore resolved).
    pub quantization: Quantization,
    /// Approximate bytes its segments hold in memory (vectors, codes, graphs, ids).
    pub memory_bytes: u64,
    /// Sealed full vectors are left in the segment files.
    pub vectors_on_disk: bool,
    /// Of `bytes_on_disk`, the full vectors not held in memory.
    pub cold_bytes: u64,
}

impl CollectionInfo {
    pub(crate) fn from_wire(info: Option<pb::CollectionInfo>) -> Result<CollectionInfo> {
        let info = info.ok_or_else(|| {
            Error::new(
                crate::Code::Internal,
                "the server's answer has no collection",
            )
        })?;
        let hnsw = info.hnsw.unwrap_or_default();
        Ok(CollectionInfo {
            metric: Metric::from_wire(info.metric)?,
            name: info.name,
            dimension: info.dimension,
            m: hnsw.m,
            ef_construction: hnsw.ef_construction,
            ef_search: hnsw.ef_search,
            default_durability: Durability::from_wire(info.default_durability),
            n_documents: info.n_documents,
            n_tenants: info.n_tenants,
            last_seq_no: info.last_seq_no,
            durable_seq_no: info.durable_seq_no,
            applied_seq_no: info.applied_seq_no,
            checkpoint_seq_no: info.checkpoint_seq_no,
            n_sealed_segments: info.n_sealed_segments,
            n_removed_not_compacted: info.n_removed_not_compacted,
            bytes_on_disk: info.bytes_on_disk,
            n_unindexed: info.n_unindexed,
            shards: info.shards.max(1),
            shard_key: ShardKey::from_wire(info.shard_key),
            replication_factor: info.replication_factor.max(1),
            min_in_sync: info.min_in_sync.max(1),
            fields: FieldSpec::list_from_wire(info.fields),
            quantization: Quantization::from_wire(info.quantization),
            memory_bytes: info.memory_bytes,
            vectors_on_disk: info.vectors_on_disk,
            cold_bytes: info.cold_bytes,
        })
    }
}

/// The read-your-writes handle of an acknowledged write: pass it to [`Search::after`] (or
/// [`crate::Client::get_after`]) and the read waits (within its deadline) until the write is
/// visible, on every shard it touched in cluster mode.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct ReadToken {
    seq_no: u64,
    bytes: Vec<u8>,
}

impl ReadToken {
    /// The token of the write with this sequence number (as `tarn insert` prints it): a
    /// single-node collection's, or a one-shard collection's.
    pub fn from_seq_no(seq_no: u64) -> ReadToken {
        ReadToken {
            seq_no,
            bytes: Vec::new(),
        }
    }

    /// The write's sequence number in its collection (0 for a write to several shards).
    pub fn seq_no(&self) -> u64 {
        self.seq_no
    }

    /// The server's opaque token (the position of every shard the write touched).
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes
    }
}

/// An acknowledged write: durable on the server in the mode asked for (on every shard it
/// touched, in cluster mode).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct WriteAck {
    /// The write's sequence number in its collection (0 for a write to several shards).
    pub seq_no: u64,
    /// For an insert, the (tenant, document) pairs stored; for a remove by filter, the pairs
    /// removed; 0 for a remove by ids.
    pub n_written: u64,
    pub(crate) token: Vec<u8>,
}

impl WriteAck {
    /// The handle to pass to [`Search::after`] to read this write.
    pub fn read_token(&self) -> ReadToken {
        ReadToken {
            seq_no: self.seq_no,
            bytes: self.token.clone(),
        }
    }
}

/// Inserts (upserts) documents for tenants: every listed document for every listed tenant
/// (none listed: tenant 0), replacing what they had under those ids.
///
/// ```
/// use tarn_client::{Durability, Insert};
/// let vectors: Vec<f32> = vec![0.0; 2 * 4]; // two documents of dimension 4, row after row
/// let insert = Insert::new("docs", [10u128, 11], vectors)
///     .users([7u128])
///     .durability(Durability::Fsync);
/// ```
#[derive(Debug, Clone)]
pub struct Insert {
    collection: String,
    doc_ids: Vec<u128>,
    user_ids: Vec<u128>,
    vectors: Vec<f32>,
    attributes: Vec<Attributes>,
    durability: Option<Durability>,
    timeout: Option<Duration>,
}

impl Insert {
    /// `vectors` holds one vector per document, row after row (`doc_ids.len() x dimension`).
    /// An owned `Vec<f32>` is moved into the request; a slice is copied once.
    pub fn new(
        collection: impl Into<String>,
        doc_ids: impl Into<Vec<u128>>,
        vectors: impl Into<Vec<f32>>,
    ) -> Insert {
        Insert {
            collection: collection.into(),
            doc_ids: doc_ids.into(),
            user_ids: Vec::new(),
            vectors: vectors.into(),
            attributes: Vec::new(),
            durability: None,
            timeout: None,
        }
    }

    /// The tenants that own the documents.
    pub fn users(mut self, user_ids: impl Into<Vec<u128>>) -> Insert {
        self.user_ids = user_ids.into();
        self
    }

    /// The documents' attributes: one per document, in `doc_ids` order (the same for every
    /// tenant), each valid for the collection's declared fields. None set: no attributes.
    ///
    /// ```
    /// use tarn_client::{Attributes, Insert};
    /// let insert = Insert::new("docs", [1u128, 2], vec![0.0f32; 2 * 4]).attributes([
    ///     Attributes::new().with("section", "python").with("installed_size_kb", 120),
    ///     Attributes::new().with("section", "libs"),
    /// ]);
    /// ```
    pub fn attributes(mut self, attributes: impl IntoIterator<Item = Attributes>) -> Insert {
        self.attributes = attributes.into_iter().collect();
        self
    }

    /// The durability (the collection's default unless set).
    pub fn durability(mut self, durability: Durability) -> Insert {
        self.durability = Some(durability);
        self
    }

    /// The deadline of this call (the client's default unless set).
    pub fn timeout(mut self, timeout: Duration) -> Insert {
        self.timeout = Some(timeout);
        self
    }

    pub(crate) fn into_wire(self) -> (pb::InsertRequest, Option<Duration>) {
        let request = pb::InsertRequest {
            collection: self.collection,
            doc_ids: self.doc_ids.into_iter().map(id_to_wire).collect(),
            user_ids: self.user_ids.into_iter().map(id_to_wire).collect(),
            vectors: self.vectors,
            durability: Durability::to_wire(self.durability),
            attributes: self.attributes.iter().map(Attributes::to_wire).collect(),
        };
        (request, self.timeout)
    }
}

/// Removes documents from tenants (none listed: tenant 0): listed ones (ids that are not
/// stored are ignored), or every one matching a filter ([`Remove::matching`]).
///
/// ```
/// use tarn_client::{Filter, Remove};
/// let by_ids = Remove::new("docs", [1u128, 2]).users([7u128]);
/// let by_filter = Remove::matching("docs", Filter::field("section").eq("oldlibs")).users([7u128]);
/// ```
#[derive(Debug, Clone)]
pub struct Remove {
    collection: String,
    doc_ids: Vec<u128>,
    user_ids: Vec<u128>,
    filter: Option<Filter>,
    durability: Option<Durability>,
    timeout: Option<Duration>,
}

impl Remove {
    /// Removes `doc_ids` from tenant 0 unless [`Remove::users`] says otherwise.
    pub fn new(collection: impl Into<String>, doc_ids: impl Into<Vec<u128>>) -> Remove {
        Remove {
            collection: collection.into(),
            doc_ids: doc_ids.into(),
            user_ids: Vec::new(),
            filter: None,
            durability: None,
            timeout: None,
        }
    }

    /// Removes every document of the tenants (tenant 0 unless [`Remove::users`] says
    /// otherwise) that matches `filter` when the server handles the call (every write
    /// acknowledged before it included); [`WriteAck::n_written`] counts them.
    pub fn matching(collection: impl Into<String>, filter: impl Into<Filter>) -> Remove {
        Remove {
            filter: Some(filter.into()),
            ..Remove::new(collection, Vec::new())
        }
    }

    /// The tenants to remove the documents from.
    pub fn users(mut self, user_ids: impl Into<Vec<u128>>) -> Remove {
        self.user_ids = user_ids.into();
        self
    }

    /// The durability (the collection's default unless set).
    pub fn durability(mut self, durability: Durability) -> Remove {
        self.durability = Some(durability);
        self
    }

    /// The deadline of this call (the client's default unless set).
    pub fn timeout(mut self, timeout: Duration) -> Remove {
        self.timeout = Some(timeout);
        self
    }

    pub(crate) fn into_wire(self) -> (pb::RemoveRequest, Option<Duration>) {
        let request = pb::RemoveRequest {
            collection: self.collection,
            doc_ids: self.doc_ids.into_iter().map(id_to_wire).collect(),
            user_ids: self.user_ids.into_iter().map(id_to_wire).collect(),
            durability: Durability::to_wire(self.durability),
            filter: self.filter.as_ref().map(Filter::to_wire),
        };
        (request, self.timeout)
    }
}

/// The exact number of live documents of some tenants (none listed: tenant 0), all of them or
/// those matching a filter ([`Client::count`](crate::Client::count)). A document owned by two
/// of the tenants counts twice.
///
/// ```
/// use tarn_client::{Count, Filter};
/// let all = Count::new("docs").users([7u128]);
/// let some = Count::new("docs").filter(Filter::field("section").eq("oldlibs"));
/// ```
#[derive(Debug, Clone)]
pub struct Count {
    collection: String,
    user_ids: Vec<u128>,
    filter: Option<Filter>,
    after: ReadToken,
    timeout: Option<Duration>,
}

impl Count {
    /// Counts every document of tenant 0 unless [`Count::users`] or [`Count::filter`] say
    /// otherwise.
    pub fn new(collection: impl Into<String>) -> Count {
        Count {
            collection: collection.into(),
            user_ids: Vec::new(),
            filter: None,
            after: ReadToken::default(),
            timeout: None,
        }
    }

    /// The tenants whose documents are counted.
    pub fn users(mut self, user_ids: impl Into<Vec<u128>>) -> Count {
        self.user_ids = user_ids.into();
        self
    }

    /// Counts only the documents matching `filter`.
    pub fn filter(mut self, filter: impl Into<Filter>) -> Count {
        self.filter = Some(filter.into());
        self
    }

    /// Waits (within the deadline) until the write `token` is counted, on every shard asked.
    pub fn after(mut self, token: ReadToken) -> Count {
        self.after = token;
        self
    }

    /// The deadline of this call (the client's default unless set).
    pub fn timeout(mut self, timeout: Duration) -> Count {
        self.timeout = Some(timeout);
        self
    }

    pub(crate) fn into_wire(self) -> (pb::CountRequest, Option<Duration>) {
        let request = pb::CountRequest {
            collection: self.collection,
            user_ids: self.user_ids.into_iter().map(id_to_wire).collect(),
            filter: self.filter.as_ref().map(Filter::to_wire),
            min_seq_no: if self.after.as_bytes().is_empty() {
                self.after.seq_no()
            } else {
                0
            },
            read_token: self.after.as_bytes().to_vec(),
        };
        (request, self.timeout)
    }
}

/// One page of the live documents of some tenants (none listed: tenant 0), all or those
/// matching a filter, in (user_id, doc_id) order ([`Client::scroll`](crate::Client::scroll)):
/// export and migration. Each page is read when asked for: a document live and unchanged for
/// the whole scroll comes exactly once.
///
/// ```
/// use tarn_client::{Filter, Scroll};
/// let first = Scroll::new("docs").users([7u128]).limit(500).vectors(true);
/// let utils = Scroll::new("docs").filter(Filter::field("section").eq("utils"));
/// ```
#[derive(Debug, Clone)]
pub struct Scroll {
    collection: String,
    user_ids: Vec<u128>,
    filter: Option<Filter>,
    limit: u32,
    cursor: Vec<u8>,
    output_fields: Vec<String>,
    with_payload: bool,
    with_vectors: bool,
    after: ReadToken,
    timeout: Option<Duration>,
}

impl Scroll {
    /// The first page (100 documents) of tenant 0's documents, every field, no vectors.
    pub fn new(collection: impl Into<String>) -> Scroll {
        Scroll {
            collection: collection.into(),
            user_ids: Vec::new(),
            filter: None,
            limit: 0,
            cursor: Vec::new(),
            output_fields: Vec::new(),
            with_payload: false,
            with_vectors: false,
            after: ReadToken::default(),
            timeout: None,
        }
    }

    /// The tenants whose documents are listed.
    pub fn users(mut self, user_ids: impl Into<Vec<u128>>) -> Scroll {
        self.user_ids = user_ids.into();
        self
    }

    /// Only the documents matching `filter`.
    pub fn filter(mut self, filter: impl Into<Filter>) -> Scroll {
        self.filter = Some(filter.into());
        self
    }

    /// Documents per page (1 to 10,000; 100 unless set).
    pub fn limit(mut self, limit: u32) -> Scroll {
        self.limit = limit;
        self
    }

    /// Starts after where a page ended ([`ScrollPage::next`]).
    pub fn cursor(mut self, cursor: impl Into<Vec<u8>>) -> Scroll {
        self.cursor = cursor.into();
        self
    }

    /// The declared fields each document returns (none: every field; `"*"`: every field).
    pub fn output_fields<S: Into<String>>(mut self, fields: impl IntoIterator<Item = S>) -> Scroll {
        self.output_fields = fields.into_iter().map(Into::into).collect();
        self
    }

    /// Returns each document's payload too.
    pub fn payload(mut self, with_payload: bool) -> Scroll {
        self.with_payload = with_payload;
        self
    }

    /// Returns each document's vector too (left out unless asked for).
    pub fn vectors(mut self, with_vectors: bool) -> Scroll {
        self.with_vectors = with_vectors;
        self
    }

    /// Waits (within the deadline) until the write `token` is visible, on every shard asked.
    pub fn after(mut self, token: ReadToken) -> Scroll {
        self.after = token;
        self
    }

    /// The deadline of this call (the client's default unless set).
    pub fn timeout(mut self, timeout: Duration) -> Scroll {
        self.timeout = Some(timeout);
        self
    }

    pub(crate) fn into_wire(self) -> (pb::ScrollRequest, Option<Duration>) {
        let request = pb::ScrollRequest {
            collection: self.collection,
            user_ids: self.user_ids.into_iter().map(id_to_wire).collect(),
            filter: self.filter.as_ref().map(Filter::to_wire),
            limit: self.limit,
            cursor: self.cursor,
            output_fields: self.output_fields,
            with_payload: self.with_payload,
            with_vectors: self.with_vectors,
            min_seq_no: if self.after.as_bytes().is_empty() {
                self.after.seq_no()
            } else {
                0
            },
            read_token: self.after.as_bytes().to_vec(),
        };
        (request, self.timeout)
    }
}

/// One page of a [`Scroll`].
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct ScrollPage {
    /// In (user_id, doc_id) order; vectors empty unless asked for.
    pub docs: Vec<Document>,
    /// The cursor of the next page ([`Scroll::cursor`]); `None` after the last page.
    pub next: Option<Vec<u8>>,
}

/// A top-k search over some tenants' documents (none listed: tenant 0).
///
/// ```
/// use tarn_client::{ReadToken, Search};
/// let query = [0.1f32, 0.2, 0.3, 0.4];
/// let search = Search::new("docs", &query[..])
///     .top_k(5)
///     .users([7u128])
///     .ef(128)
///     .after(ReadToken::from_seq_no(42));
/// ```
#[derive(Debug, Clone)]
pub struct Search {
    collection: String,
    vector: Vec<f32>,
    user_ids: Vec<u128>,
    top_k: u32,
    ef: u32,
    exact: bool,
    after: ReadToken,
    allow_partial: bool,
    filter: Option<Filter>,
    timeout: Option<Duration>,
    output_fields: Vec<String>,
    with_payload: bool,
    text: Option<(String, String)>,
    fusion: Option<pb::Fusion>,
}

/// How a hybrid search ([`Search::hybrid`]) fuses its vector and text sides.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub enum Fusion {
    /// Reciprocal rank fusion: `Σ weight / (k + rank)` over the sides (k 60 by default).
    Rrf {
        /// At least 1; 60 is the paper's and every peer's default.
        k: f64,
    },
    /// Relative score fusion: each side's scores min-max normalised to 0..1, weighted and
    /// summed.
    RelativeScore,
}

/// Where one side of a hybrid search ranked a hit.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct SideScore {
    /// From 1.
    pub rank: u32,
    /// That side's own score: the metric's, or BM25.
    pub score: f32,
}

impl Search {
    /// A hybrid search: the documents nearest to `vector` and those with the best BM25 scores
    /// for `query` in the TEXT field `field`, each side retrieving its candidates (filters and
    /// tenants apply to both), fused by reciprocal rank fusion (k 60) unless
    /// [`Search::fusion`] says otherwise. [`Hit::score`] is the fused score;
    /// [`Hit::vector_side`] and [`Hit::text_side`] say where each side ranked the hit.
    ///
    /// ```
    /// use tarn_client::{Fusion, Search};
    /// let search = Search::hybrid("debian", vec![0.0f32; 384], "description", "python library")
    ///     .fusion(Fusion::RelativeScore)
    ///     .weights(0.7, 0.3)
    ///     .depth(50);
    /// ```
    pub fn hybrid(
        collection: impl Into<String>,
        vector: impl Into<Vec<f32>>,
        field: impl Into<String>,
        query: impl Into<String>,
    ) -> Search {
        Search {
            text: Some((field.into(), query.into())),
            ..Search::new(collection, vector)
        }
    }

    fn fusion_mut(&mut self) -> &mut pb::Fusion {
        self.fusion.get_or_insert_with(pb::Fusion::default)
    }

    /// A hybrid search's fusion (RRF with k 60 unless set).
    pub fn fusion(mut self, fusion: Fusion) -> Search {
        let wire = self.fusion_mut();
        match fusion {
            Fusion::Rrf { k } => {
                wire.method = pb::FusionMethod::Rrf as i32;
                wire.rrf_k = k;
            }
            Fusion::RelativeScore => wire.method = pb::FusionMethod::RelativeScore as i32,
        }
        self
    }

    /// A hybrid search's candidates per side (0: `max(top_k, 100)`).
    pub fn depth(mut self, depth: u32) -> Search {
        self.fusion_mut().depth = depth;
        self
    }

    /// A hybrid search's weight of each side (1 and 1 unless set).
    pub fn weights(mut self, vector_weight: f64, text_weight: f64) -> Search {
        let wire = self.fusion_mut();
        wire.vector_weight = Some(vector_weight);
        wire.text_weight = Some(text_weight);
        self
    }

    /// The 10 documents of a TEXT field with the best BM25 scores for `query` (analysed by the
    /// field's analyzer); [`Hit::score`] is the BM25 score, higher is better. `ef` and `exact`
    /// do not apply; filters, tenants and field selections do.
    ///
    /// ```
    /// use tarn_client::Search;
    /// let search = Search::text("debian", "description", "python library").top_k(5);
    /// ```
    pub fn text(
        collection: impl Into<String>,
        field: impl Into<String>,
        query: impl Into<String>,
    ) -> Search {
        Search {
            text: Some((field.into(), query.into())),
            ..Search::new(collection, Vec::new())
        }
    }

    /// The 10 documents nearest to `vector`.
    pub fn new(collection: impl Into<String>, vector: impl Into<Vec<f32>>) -> Search {
        Search {
            collection: collection.into(),
            vector: vector.into(),
            user_ids: Vec::new(),
            top_k: 10,
            ef: 0,
            exact: false,
            after: ReadToken::default(),
            allow_partial: false,
            filter: None,
            timeout: None,
            output_fields: Vec::new(),
            with_payload: false,
            text: None,
            fusion: None,
        }
    }

    /// Only documents matching `filter`; the answer still has `min(top_k, matching
    /// documents)` hits, with or without [`Search::exact`].
    ///
    /// ```
    /// use tarn_client::{Filter, Search};
    /// let search = Search::new("debian", vec![0.0f32; 384])
    ///     .filter(Filter::field("section").any_of(["python", "libs"]) & Filter::range("installed_size_kb").gte(100.0));
    /// ```
    pub fn filter(mut self, filter: impl Into<Filter>) -> Search {
        self.filter = Some(filter.into());
        self
    }

    /// How many hits, at most (1..10,000).
    pub fn top_k(mut self, top_k: u32) -> Search {
        self.top_k = top_k;
        self
    }

    /// The tenants whose documents are searched.
    pub fn users(mut self, user_ids: impl Into<Vec<u128>>) -> Search {
        self.user_ids = user_ids.into();
        self
    }

    /// The graph search's breadth (0: the collection's default). Higher finds more of the true
    /// neighbours, more slowly.
    pub fn ef(mut self, ef: u32) -> Search {
        self.ef = ef;
        self
    }

    /// Compare with every stored vector instead of searching the graph: exact, and slow on a
    /// large collection.
    pub fn exact(mut self, exact: bool) -> Search {
        self.exact = exact;
        self
    }

    /// Read your writes: wait until the write behind `token` is searchable (within the call's
    /// deadline; DEADLINE_EXCEEDED otherwise).
    pub fn after(mut self, token: ReadToken) -> Search {
        self.after = token;
        self
    }

    /// Cluster mode: answer from the shards that answer when some owner is down or silent (see
    /// [`crate::Client::search_partial`]), instead of failing with UNAVAILABLE or
    /// DEADLINE_EXCEEDED: a shard that cannot be reached, or does not answer within the
    /// deadline less a reserve (a tenth, at most 0.5 s), is listed as missing.
    pub fn allow_partial(mut self, allow: bool) -> Search {
        self.allow_partial = allow;
        self
    }

    /// The deadline of this call (the client's default unless set).
    pub fn timeout(mut self, timeout: Duration) -> Search {
        self.timeout = Some(timeout);
        self
    }

    /// The declared fields each hit returns in [`Hit::attributes`] (`"*"`: every field; none
    /// by default), read right after the search (a write of the document in between may show).
    pub fn output_fields<S: Into<String>>(mut self, fields: impl IntoIterator<Item = S>) -> Search {
        self.output_fields = fields.into_iter().map(Into::into).collect();
        self
    }

    /// Each hit returns its document's payload too ([`Attributes::payload`]).
    pub fn with_payload(mut self, with_payload: bool) -> Search {
        self.with_payload = with_payload;
        self
    }

    pub(crate) fn into_wire(self) -> (pb::SearchRequest, Option<Duration>) {
        let request = pb::SearchRequest {
            collection: self.collection,
            user_ids: self.user_ids.into_iter().map(id_to_wire).collect(),
            vector: self.vector,
            top_k: self.top_k,
            ef: self.ef,
            exact: self.exact,
            min_seq_no: if self.after.bytes.is_empty() {
                self.after.seq_no
            } else {
                0
            },
            read_token: self.after.bytes,
            allow_partial: self.allow_partial,
            filter: self.filter.as_ref().map(Filter::to_wire),
            output_fields: self.output_fields,
            with_payload: self.with_payload,
            text: self.text.map(|(field, query)| pb::TextQuery {
                field,
                query,
                ..Default::default()
            }),
            fusion: self.fusion,
        };
        (request, self.timeout)
    }
}

/// One search result.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Hit {
    /// The document.
    pub doc_id: u128,
    /// The tenant it belongs to (one of those searched).
    pub user_id: u128,
    /// Cosine similarity or inner product (higher is better), or Euclidean distance (lower is
    /// better), by the collection's metric.
    pub score: f32,
    /// The values [`Search::output_fields`] and [`Search::with_payload`] selected (empty
    /// otherwise).
    pub attributes: Attributes,
    /// A hybrid search's hit: where the vector side ranked it (`None`: it did not retrieve
    /// it, or the search was not hybrid).
    pub vector_side: Option<SideScore>,
    /// A hybrid search's hit: where the text side ranked it.
    pub text_side: Option<SideScore>,
}

impl Hit {
    pub(crate) fn from_wire(hit: &pb::Hit) -> Hit {
        Hit {
            doc_id: id_from_wire(hit.doc_id.as_ref()),
            user_id: id_from_wire(hit.user_id.as_ref()),
            score: hit.score,
            attributes: Attributes::from_wire(hit.attributes.clone()),
            vector_side: hit.vector_side.map(|s| SideScore {
                rank: s.rank,
                score: s.score,
            }),
            text_side: hit.text_side.map(|s| SideScore {
                rank: s.rank,
                score: s.score,
            }),
        }
    }
}

/// A stored document.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Document {
    /// The document.
    pub doc_id: u128,
    /// The tenant it belongs to.
    pub user_id: u128,
    /// As stored: unit length in a cosine collection.
    pub vector: Vec<f32>,
    /// Its attributes (empty if it was stored without any).
    pub attributes: Attributes,
}

impl Document {
    pub(crate) fn from_wire(doc: pb::Document) -> Document {
        Document {
            doc_id: id_from_wire(doc.doc_id.as_ref()),
            user_id: id_from_wire(doc.user_id.as_ref()),
            vector: doc.vector,
            attributes: Attributes::from_wire(doc.attributes),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_through_the_wire_form() {
        for value in [0u128, 1, u64::MAX as u128, (7u128 << 64) | 9, u128::MAX] {
            assert_eq!(id_from_wire(Some(&id_to_wire(value))), value);
        }
    }

    #[test]
    fn names_parse_in_any_case_and_unknown_ones_name_the_field() {
        assert_eq!("COSINE".parse::<Metric>(), Ok(Metric::Cosine));
        assert_eq!("l2".parse::<Metric>(), Ok(Metric::L2));
        assert_eq!("Written".parse::<Durability>(), Ok(Durability::Written));
        let error = "hamming".parse::<Metric>().unwrap_err();
        assert_eq!(error.code(), crate::Code::InvalidArgument);
        assert!(error.message().starts_with("metric:"), "{error}");
        let error = "never".parse::<Durability>().unwrap_err();
        assert!(error.message().starts_with("durability:"), "{error}");
        assert_eq!("none".parse::<Quantization>(), Ok(Quantization::None));
        assert_eq!(
            "INT8:2".parse::<Quantization>(),
            Ok(Quantization::Int8 { rescore: 2 })
        );
        assert_eq!(
            "rabitq".parse::<Quantization>(),
            Ok(Quantization::Rabitq {
                bits: 1,
                rescore: 0
            })
        );
        assert_eq!(
            "rabitq:4:6".parse::<Quantization>(),
            Ok(Quantization::Rabitq {
                bits: 4,
                rescore: 6
            })
        );
        for bad in ["int4", "int8:x", "rabitq:1:2:3", "none:1"] {
            let error = bad.parse::<Quantization>().unwrap_err();
            assert!(error.message().starts_with("quantization:"), "{error}");
        }
    }
}

/// Cluster mode: what `ForgetNode` does (or would do) to each shard the node held a copy of
/// ([`crate::Client::forget_node_report`]).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct ForgetReport {
    /// Shards whose data is given up: they start empty on another node.
    pub given_up: Vec<ShardStatus>,
    /// Shards that lose nothing: another in-sync copy alive on its disk is, or becomes, their
    /// primary; the node's copy leaves their record.
    pub kept: Vec<ShardStatus>,
    /// Shards the node held an in-sync replica of while no other in-sync copy is alive (their
    /// primary is down): the node leaves their record, and its copy, should it come back, is
    /// set aside, never deleted. They wait for their primary.
    pub set_aside: Vec<ShardStatus>,
}

/// Cluster mode: the nodes and the shard placement ([`crate::Client::cluster_status`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ClusterStatus {
    /// Every node that is alive or still owns shards.
    pub nodes: Vec<NodeStatus>,
    /// Every shard of every collection.
    pub shards: Vec<ShardStatus>,
    /// Whether the node asked reaches etcd now.
    pub etcd_connected: bool,
    /// The cluster's identity.
    pub cluster_id: String,
    /// How many shard copies the node asked set aside ([`crate::Client::list_set_aside`]).
    pub set_aside: u32,
    /// Collections whose record in etcd the node asked cannot decode.
    pub unreadable: Vec<String>,
}

/// A shard copy a node took out of service instead of deleting it
/// ([`crate::Client::list_set_aside`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct SetAsideShard {
    /// Its name, to pass to drop or import.
    pub name: String,
    /// Why it was set aside.
    pub reason: String,
    /// Bytes on disk.
    pub bytes: u64,
}

/// One node of a [`ClusterStatus`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct NodeStatus {
    /// Its `--node-id`.
    pub node_id: String,
    /// Its `--advertise` address (empty for a dead node).
    pub address: String,
    /// Whether its lease in etcd is alive.
    pub alive: bool,
    /// Whether it is marked for draining (its shards move off it).
    pub draining: bool,
}

/// One shard of a [`ClusterStatus`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ShardStatus {
    /// The collection.
    pub collection: String,
    /// The shard's number.
    pub shard: u32,
    /// The node that owns it.
    pub node_id: String,
    /// Its epoch (bumped by every change of owner).
    pub epoch: u64,
    /// `serving`; `unavailable` while its owner is down; `fenced` while a move hands it over
    /// (writes wait, searches answer).
    pub state: String,
    /// While fenced: the node taking it (empty otherwise).
    pub moving_to: String,
    /// The shard's last failed move, until one succeeds (empty when none failed).
    pub move_problem: String,
    /// The other copies' nodes (replicas).
    pub replicas: Vec<String>,
    /// Every copy in sync, the primary (`node_id`) first.
    pub in_sync: Vec<String>,
    /// Writes are refused with fewer copies in sync.
    pub min_in_sync: u32,
    /// Per replica, the log entries it has not made durable yet: only the shard's primary
    /// knows it, so this is filled in the status of the primary's node and empty elsewhere.
    pub replication_lag: Vec<ReplicaLag>,
}

/// How far one replica of a shard is behind its primary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaLag {
    /// The replica's node.
    pub node_id: String,
    /// Log entries the replica has not made durable yet.
    pub entries: u64,
    /// Whether it is in the in-sync set.
    pub in_sync: bool,
}

impl ClusterStatus {
    pub(crate) fn from_wire(reply: pb::ClusterStatusResponse) -> ClusterStatus {
        ClusterStatus {
            nodes: reply
                .nodes
                .into_iter()
                .map(|n| NodeStatus {
                    node_id: n.node_id,
                    address: n.address,
                    alive: n.alive,
                    draining: n.draining,
                })
                .collect(),
            shards: reply
                .shards
                .into_iter()
                .map(|s| ShardStatus {
                    collection: s.collection,
                    shard: s.shard,
                    node_id: s.node_id,
                    epoch: s.epoch,
                    state: s.state,
                    moving_to: s.moving_to,
                    move_problem: s.move_problem,
                    replicas: s.replicas,
                    in_sync: s.in_sync,
                    min_in_sync: s.min_in_sync,
                    replication_lag: s
                        .replication_lag
                        .into_iter()
                        .map(|l| ReplicaLag {
                            node_id: l.node_id,
                            entries: l.entries,
                            in_sync: l.in_sync,
                        })
                        .collect(),
                })
                .collect(),
            etcd_connected: reply.etcd_connected,
            cluster_id: reply.cluster_id,
            set_aside: reply.set_aside,
            unreadable: reply.unreadable,
        }
    }
}
