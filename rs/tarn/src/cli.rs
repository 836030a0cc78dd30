//! Command-line interface (clap): the `tarn` command and its subcommands. `tarn serve`'s flags
//! are `tarn_server::ServeArgs` (config.rs there), so the server does not depend on this crate.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};
pub use tarn_server::ServeArgs;

#[derive(Debug, Parser)]
#[command(name = "tarn", version, about = "tarn: a durable vector database")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the server.
    Serve(ServeArgs),
    /// Exit 0 only if the server at --addr reports SERVING (for container healthchecks).
    Healthcheck {
        #[arg(long, env = "TARN_ADDR", default_value = "http://127.0.0.1:50051")]
        addr: String,
    },
    /// Create, list, inspect or drop collections.
    #[command(subcommand)]
    Collection(CollectionCommand),
    /// Insert the vectors of an fvecs file (doc id = first id + row number), or the documents
    /// of a JSON-lines file (what `tarn scroll` prints).
    Insert(InsertArgs),
    /// Search with the vectors of an fvecs file; with --ivecs, report recall@k.
    Search(SearchArgs),
    /// Print stored vectors and their attributes.
    Get {
        #[command(flatten)]
        client: ClientArgs,
        #[arg(long)]
        collection: String,
        #[arg(long, default_value_t = 0)]
        user_id: u128,
        #[arg(long = "doc-id", required = true)]
        doc_ids: Vec<u128>,
        /// Also print each document's payload (a JSON text), after its fields.
        #[arg(long)]
        with_payload: bool,
    },
    /// Print the exact number of live documents of the tenants (tenant 0 by default), all or
    /// those matching --filter.
    Count {
        #[command(flatten)]
        client: ClientArgs,
        #[arg(long)]
        collection: String,
        #[arg(long = "user-id")]
        user_ids: Vec<u128>,
        /// Count only the documents matching this filter (the grammar of `tarn search
        /// --filter`).
        #[arg(long)]
        filter: Option<String>,
    },
    /// Print every live document of the tenants (tenant 0 by default), all or those matching
    /// --filter, in (user id, doc id) order, one JSON object per line: export and migration.
    Scroll {
        #[command(flatten)]
        client: ClientArgs,
        #[arg(long)]
        collection: String,
        #[arg(long = "user-id")]
        user_ids: Vec<u128>,
        /// Only the documents matching this filter (the grammar of `tarn search --filter`).
        #[arg(long)]
        filter: Option<String>,
        /// Documents per request (1 to 10000).
        #[arg(long, default_value_t = 1000)]
        page: u32,
        /// Print each document's vector too.
        #[arg(long)]
        with_vectors: bool,
        /// Print each document's payload too.
        #[arg(long)]
        with_payload: bool,
    },
    /// Remove documents: listed ones (--doc-id), or every one matching --filter.
    Remove {
        #[command(flatten)]
        client: ClientArgs,
        #[arg(long)]
        collection: String,
        #[arg(long = "user-id")]
        user_ids: Vec<u128>,
        #[arg(
            long = "doc-id",
            required_unless_present = "filter",
            conflicts_with = "filter"
        )]
        doc_ids: Vec<u128>,
        /// Remove every document of the tenants matching this filter (the grammar of
        /// `tarn search --filter`).
        #[arg(long)]
        filter: Option<String>,
    },
    /// Checkpoint a collection.
    Flush {
        #[command(flatten)]
        client: ClientArgs,
        #[arg(long)]
        collection: String,
    },
    /// Load generators against a running server: durable inserts, search, freshness.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Back up and restore collections: consistent snapshots of live collections.
    #[command(subcommand)]
    Snapshot(SnapshotCommand),
    /// Cluster mode: nodes and shard placement.
    #[command(subcommand)]
    Cluster(ClusterCommand),
}

#[derive(Debug, Subcommand)]
pub enum ClusterCommand {
    /// Give a dead node's shards to live nodes as empty shards: their data is lost for good.
    /// Lists what would be given up unless --yes.
    Forget {
        #[command(flatten)]
        client: ClientArgs,
        /// The dead node's id.
        node_id: String,
        /// Give the data up (without it, only list it).
        #[arg(long)]
        yes: bool,
    },
    /// Move every shard off a node (one at a time, while they keep serving) so that it can be
    /// retired; waits until it owns none unless --no-wait. The mark stays in etcd until
    /// --cancel (a drained node takes no new shards).
    Drain {
        #[command(flatten)]
        client: ClientArgs,
        /// The node to drain.
        node_id: String,
        /// Clear the mark: the node takes shards again.
        #[arg(long)]
        cancel: bool,
        /// Answer at once instead of waiting for the node to be empty.
        #[arg(long)]
        no_wait: bool,
    },
    /// Nodes (alive or not) and every shard's owner, epoch and state.
    Status {
        #[command(flatten)]
        client: ClientArgs,
        /// One JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Shard copies the node at --addr took out of service instead of deleting them (the map
    /// had no record of their collection, or their data was given up by forget).
    #[command(subcommand)]
    SetAside(SetAsideCommand),
}

#[derive(Debug, Subcommand)]
pub enum SetAsideCommand {
    /// List the node's set-aside copies, with why and their size.
    List {
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Delete a set-aside copy for good.
    Drop {
        #[command(flatten)]
        client: ClientArgs,
        /// Its name, as listed.
        name: String,
    },
    /// Insert every document of a set-aside copy into a cluster collection (the copy stays).
    Import {
        #[command(flatten)]
        client: ClientArgs,
        /// Its name, as listed.
        name: String,
        /// The cluster collection to insert into (default: the one the copy belonged to).
        #[arg(long)]
        into: Option<String>,
    },
}

#[derive(Debug, Subcommand)]
pub enum SnapshotCommand {
    /// Stream a snapshot of a live collection into a file on this machine (writes go on).
    Create {
        #[command(flatten)]
        client: ClientArgs,
        #[arg(long)]
        collection: String,
        /// The snapshot file to write (replaced only once the snapshot is complete).
        #[arg(long)]
        out: PathBuf,
    },
    /// Restore a snapshot file as a new collection: into a running server (--addr), or, with
    /// --data-dir, offline into a stopped server's data directory.
    Restore {
        #[command(flatten)]
        client: ClientArgs,
        /// The snapshot file.
        #[arg(long = "in")]
        input: PathBuf,
        /// The new collection's name (refused if it exists).
        #[arg(long)]
        collection: String,
        /// Restore offline into this data directory (the server must be stopped).
        #[arg(long)]
        data_dir: Option<PathBuf>,
        /// Into a cluster: the new collection's shards (0 = 8).
        #[arg(long, default_value_t = 0)]
        shards: u32,
        /// Into a cluster: user or doc (see `tarn collection create`).
        #[arg(long, default_value = "user")]
        shard_key: String,
    },
    /// Check a snapshot file (every checksum, the parts, completeness) without restoring it.
    Verify {
        /// The snapshot file.
        #[arg(long = "in")]
        input: PathBuf,
    },
}

impl Command {
    /// Requests this command keeps in flight at once, at most: the server's are unbounded, a
    /// client's are its connections (bench) or its concurrency (bulk insert).
    pub fn max_in_flight(&self) -> usize {
        match self {
            Command::Serve(_) => usize::MAX,
            Command::Insert(args) => args.concurrency,
            Command::Bench(BenchCommand::Insert(args)) => {
                args.clients.iter().copied().max().unwrap_or(1)
            }
            Command::Bench(BenchCommand::Search(args)) => {
                args.clients.iter().copied().max().unwrap_or(1)
            }
            // The inserter and the probes run side by side.
            Command::Bench(BenchCommand::Freshness(_)) => 2,
            _ => 1,
        }
    }
}

#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Random vectors from concurrent clients (one connection and one request in flight each):
    /// requests/s, vectors/s and latency percentiles for each client count.
    Insert(BenchInsertArgs),
    /// The queries of an fvecs file from concurrent clients at each --ef (and --exact):
    /// queries/s, latency percentiles, recall@k with --ivecs.
    Search(BenchSearchArgs),
    /// Inserts at a fixed rate while probes search for a sample of the new vectors until they
    /// are found: insert-to-searchable latency.
    Freshness(BenchFreshnessArgs),
}

#[derive(Debug, Args)]
pub struct BenchInsertArgs {
    #[command(flatten)]
    pub client: ClientArgs,
    /// Created (cosine) if missing.
    #[arg(long)]
    pub collection: String,
    #[arg(long, default_value_t = 128)]
    pub dimension: u32,
    /// Client counts, one run each (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1")]
    pub clients: Vec<usize>,
    /// Vectors per request.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Timed requests per run, shared by the clients.
    #[arg(long, default_value_t = 1000)]
    pub requests: usize,
    /// fsync or written.
    #[arg(long, default_value = "fsync")]
    pub durability: String,
    #[arg(long, default_value_t = 0)]
    pub user_id: u128,
    /// Doc ids are first-id, first-id + 1, ... (runs never overwrite each other).
    #[arg(long, default_value_t = 0)]
    pub first_id: u128,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// One JSON object per run.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct BenchSearchArgs {
    #[command(flatten)]
    pub client: ClientArgs,
    #[arg(long)]
    pub collection: String,
    /// fvecs file of queries.
    #[arg(long)]
    pub fvecs: PathBuf,
    /// ivecs ground truth (row i: the true nearest doc ids of query i, best first).
    #[arg(long)]
    pub ivecs: Option<PathBuf>,
    #[arg(long, value_delimiter = ',', default_value = "1")]
    pub clients: Vec<usize>,
    /// ef values, one run each; 0 is the collection's default.
    #[arg(long, value_delimiter = ',', default_value = "0")]
    pub ef: Vec<u32>,
    /// Also run the exact path.
    #[arg(long)]
    pub exact: bool,
    #[arg(long = "user-id")]
    pub user_ids: Vec<u128>,
    #[arg(long, default_value_t = 10)]
    pub top_k: u32,
    #[arg(long)]
    pub limit: Option<usize>,
    /// Untimed queries per client before each run.
    #[arg(long, default_value_t = 20)]
    pub warmup: usize,
    /// Times each client goes through its share of the queries in a run.
    #[arg(long, default_value_t = 1)]
    pub passes: usize,
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct BenchFreshnessArgs {
    #[command(flatten)]
    pub client: ClientArgs,
    /// Created (cosine) if missing.
    #[arg(long)]
    pub collection: String,
    #[arg(long, default_value_t = 128)]
    pub dimension: u32,
    /// Inserts per second (one vector each, fsync).
    #[arg(long, default_value_t = 1000)]
    pub rate: u32,
    #[arg(long, default_value_t = 10.0)]
    pub seconds: f64,
    /// Probe every n-th insert.
    #[arg(long, default_value_t = 10)]
    pub sample_every: usize,
    /// Writer connections.
    #[arg(long, default_value_t = 8)]
    pub connections: usize,
    #[arg(long, default_value_t = 0)]
    pub user_id: u128,
    #[arg(long, default_value_t = 1u128 << 64)]
    pub first_id: u128,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args, Clone)]
pub struct ClientArgs {
    /// Server address: host:port, http://host:port, https://host:port, or unix:/path (a server
    /// started with --listen unix:/path).
    #[arg(long, env = "TARN_ADDR", default_value = "http://127.0.0.1:50051")]
    pub addr: String,
    /// API key (sent as `authorization: Bearer <key>`).
    #[arg(long, env = "TARN_API_KEY")]
    pub api_key: Option<String>,
}

#[derive(Debug, Subcommand)]
pub enum CollectionCommand {
    Create {
        #[command(flatten)]
        client: ClientArgs,
        name: String,
        #[arg(long)]
        dimension: u32,
        /// cosine, l2 or dot.
        #[arg(long, default_value = "cosine")]
        metric: String,
        #[arg(long, default_value_t = 0)]
        m: u32,
        #[arg(long, default_value_t = 0)]
        ef_construction: u32,
        #[arg(long, default_value_t = 0)]
        ef_search: u32,
        /// fsync or written.
        #[arg(long, default_value = "fsync")]
        durability: String,
        /// Cluster mode: shards (0 = 8).
        #[arg(long, default_value_t = 0)]
        shards: u32,
        /// Cluster mode: user (a tenant's documents on one shard) or doc (spread by document).
        #[arg(long, default_value = "user")]
        shard_key: String,
        /// Cluster mode: copies of each shard, the primary included (0 = the server's
        /// --replication-factor).
        #[arg(long, default_value_t = 0)]
        replicas: u32,
        /// Cluster mode: writes are refused with fewer copies in sync (0 = replicas - 1, at
        /// least 1).
        #[arg(long, default_value_t = 0)]
        min_in_sync: u32,
        /// An attribute field documents may carry, NAME:TYPE with TYPE keyword, keywords
        /// (a list, e.g. tags), number or bool (repeat the flag). Every field is indexed.
        #[arg(long = "field", value_name = "NAME:TYPE")]
        fields: Vec<String>,
        /// Quantized copies of sealed vectors for the graph walk: none, int8, int8:RESCORE,
        /// rabitq (1 bit), rabitq:BITS (1 to 8) or rabitq:BITS:RESCORE (candidates per result
        /// rescored on the full vectors; 0 or unset = the default).
        #[arg(long, default_value = "none")]
        quantization: String,
        /// Leave sealed full vectors in the segment files, read only to rescore a search's
        /// best candidates and for get (needs --quantization).
        #[arg(long)]
        vectors_on_disk: bool,
    },
    /// Add attribute fields to a collection (documents written before have no value for them).
    AddField {
        #[command(flatten)]
        client: ClientArgs,
        name: String,
        /// NAME:TYPE, as for `collection create` (repeat the flag).
        #[arg(long = "field", value_name = "NAME:TYPE", required = true)]
        fields: Vec<String>,
    },
    List {
        #[command(flatten)]
        client: ClientArgs,
    },
    Info {
        #[command(flatten)]
        client: ClientArgs,
        name: String,
    },
    Drop {
        #[command(flatten)]
        client: ClientArgs,
        name: String,
    },
}

#[derive(Debug, Args)]
pub struct InsertArgs {
    #[command(flatten)]
    pub client: ClientArgs,
    #[arg(long)]
    pub collection: String,
    /// fvecs file of vectors.
    #[arg(long, required_unless_present = "jsonl", conflicts_with = "jsonl")]
    pub fvecs: Option<PathBuf>,
    /// A JSON-lines file (gzipped or not) of documents, one object per line, as `tarn scroll`
    /// prints them: `doc_id` and `vector` required; `user_id` (else the --user-id flags'),
    /// `attributes` (converted as --attributes converts them) and `payload` optional. Ids are
    /// decimal strings or integers.
    #[arg(long, value_name = "FILE.jsonl[.gz]", conflicts_with_all = ["attributes", "first_id"])]
    pub jsonl: Option<PathBuf>,
    /// Tenants to insert for (repeat the flag); none = tenant 0.
    #[arg(long = "user-id")]
    pub user_ids: Vec<u128>,
    /// Doc id of the first row.
    #[arg(long, default_value_t = 0)]
    pub first_id: u128,
    /// Vectors per request.
    #[arg(long, default_value_t = 100)]
    pub batch: usize,
    /// Requests in flight.
    #[arg(long, default_value_t = 8)]
    pub concurrency: usize,
    /// Insert only the first N rows.
    #[arg(long)]
    pub limit: Option<usize>,
    /// fsync or written (default: the collection's).
    #[arg(long)]
    pub durability: Option<String>,
    /// Return once the writes are acknowledged, without waiting for the collection to index
    /// them (until then, searches scan the unindexed vectors exactly).
    #[arg(long)]
    pub no_wait: bool,
    /// The rows' attributes: a JSON-lines file (gzipped or not), one object per fvecs row.
    /// Keys the collection declares are converted to their field's type (keyword: a string;
    /// keywords: a list of strings, or one string; number; bool); null and undeclared keys
    /// are left out.
    #[arg(long, value_name = "FILE.jsonl[.gz]")]
    pub attributes: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct SearchArgs {
    #[command(flatten)]
    pub client: ClientArgs,
    #[arg(long)]
    pub collection: String,
    /// fvecs file of queries (a full-text search, --text alone, needs none).
    #[arg(long, required_unless_present = "text")]
    pub fvecs: Option<PathBuf>,
    /// A full-text query (BM25) on the TEXT field --text-field; it prints its hits, one per
    /// line (doc id, tenant, score, and the fields --output-field selects as JSON). With
    /// --fvecs too, each query vector's search is a hybrid one, fused with this text (RRF).
    #[arg(long, requires = "text_field")]
    pub text: Option<String>,
    /// The TEXT field --text searches.
    #[arg(long, requires = "text")]
    pub text_field: Option<String>,
    /// Fields each printed hit shows ("*": every field); repeatable.
    #[arg(long = "output-field")]
    pub output_fields: Vec<String>,
    /// Each printed hit shows its payload too.
    #[arg(long)]
    pub with_payload: bool,
    /// ivecs ground truth (row i: the true nearest doc ids of query i, best first).
    #[arg(long)]
    pub ivecs: Option<PathBuf>,
    #[arg(long = "user-id")]
    pub user_ids: Vec<u128>,
    #[arg(long, default_value_t = 10)]
    pub top_k: u32,
    #[arg(long, default_value_t = 0)]
    pub ef: u32,
    #[arg(long)]
    pub exact: bool,
    #[arg(long)]
    pub limit: Option<usize>,
    /// Print the hits of each query.
    #[arg(long)]
    pub verbose: bool,
    /// Queries sent first and not timed (connection set-up, first touches of memory).
    #[arg(long, default_value_t = 10)]
    pub warmup: usize,
    /// Only documents matching this filter, e.g. 'section in (python, libs) and
    /// installed_size_kb >= 100 and not architecture = all'. Conditions: FIELD in (V, ...),
    /// FIELD = V, FIELD != V, FIELD < N (<=, >, >=), FIELD exists; combined with and, or,
    /// not and parentheses (not binds tightest, then and, then or). Values: numbers, bare
    /// words (letters, digits, _ . - : + / @) or quoted strings.
    #[arg(long)]
    pub filter: Option<String>,
}
