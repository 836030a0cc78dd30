//! Cluster mode's node: joining the cluster (membership under an etcd lease), keeping this
//! node's shards in line with the shard map (`reconcile.rs`), and finding where each shard is
//! served (here or on its owner) for the router (`routing/`).
//!
//! A shard's data is a local collection on its owner, named `<collection>.<uid>.<shard>`
//! ([`ShardName`]). A router addresses it by shard and epoch through the node-to-node
//! `tarn.v1.Node` service (tarn-server's `node_service.rs`; the owner's own calls go straight to
//! the local collection: no extra hop), handled as `<local name>@<epoch>`; the owner serves it
//! only if the shard map says it owns the shard at exactly that epoch, and answers ABORTED
//! otherwise (fencing by epoch on every write, never by timing).
//!
//! Files: this one holds the node itself ([`ClusterNode`]: joining, its view of the map,
//! connections to the other nodes, the write checks, the locks and gates of local shards);
//! `serving.rs` finds where a shard's call is served (this node's copy, checked against the
//! view, or another node's); `collections.rs` creates and drops collections and forgets a dead
//! node; `identity.rs` settles the cluster's identity and the data directory's token.

mod collections;
mod identity;
mod serving;

use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use dashmap::DashMap;
use tarn_cluster::{
    ClusterState, ClusterStore, CollectionMap, NodeInfo, Registration, ShardAssignment,
};
use tarn_collection::Collection;
use tarn_proto::v1 as pb;
use tokio::sync::watch;

use crate::registry::Registry;
use crate::status::ApiError;

use identity::{incarnation_token, settle_identity};

/// How a node joins a cluster (`tarn serve --etcd ... --node-id ... --advertise ...`).
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    /// etcd endpoints (`http://host:port`).
    pub etcd: Vec<String>,
    pub node_id: String,
    /// The gRPC address the other nodes reach this one at (`host:port`).
    pub advertise: String,
    /// The membership lease: a node silent this long is dead to the cluster.
    pub lease_ttl: Duration,
    /// `--replication-factor`: copies of each shard of a collection created without one; 0 (not
    /// given): [`DEFAULT_REPLICATION_FACTOR`], or the live nodes when fewer.
    pub replication_factor: u32,
    /// `--replace-dead-after`: how long a node may stay dead before the replica copies it held
    /// are rebuilt elsewhere.
    pub replace_dead_after: Duration,
    /// A coordination store to use instead of connecting to `etcd` (in-process tests share a
    /// `tarn_cluster::MemoryStore` between servers).
    pub store: Option<Arc<dyn ClusterStore>>,
    /// `--force-new-cluster`: join an etcd that holds no cluster id even though this data
    /// directory belongs to a cluster (its etcd is lost for good). A new cluster id is created;
    /// local shards the new map does not know are set aside, never deleted.
    pub force_new_cluster: bool,
    /// `--accept-etcd-rollback`: join an etcd whose revision is behind the one this data
    /// directory saw (restored from an older backup). Local copies whose record is older than
    /// the epoch they were held at are set aside, never deleted; shards whose copy was deleted
    /// here are never started empty here.
    pub accept_etcd_rollback: bool,
    /// `--cluster-ca`: the CA (PEM file) that signs the nodes' TLS certificates.
    pub peer_ca: Option<std::path::PathBuf>,
}

/// What a node joins the cluster with ([`ClusterNode::join`](crate::ClusterNode::join)).
#[derive(Debug, Clone)]
pub struct JoinOptions {
    pub node_id: String,
    /// The address other nodes and clients reach it at.
    pub address: String,
    pub lease_ttl: Duration,
    /// Copies of each shard of a collection created without a replication factor.
    pub replication_factor: u32,
    pub replace_dead_after: Duration,
    /// The certificate authority (PEM) that signs the other nodes' TLS certificates, for
    /// `https://` advertise addresses; without it, the Mozilla roots.
    pub peer_ca: Option<Vec<u8>>,
    /// The data directory, locked by this process (its `INCARNATION` and `CLUSTER_ID` files).
    pub data_dir: std::path::PathBuf,
    pub force_new_cluster: bool,
    pub accept_etcd_rollback: bool,
}

/// Copies of each shard of a collection created without a replication factor, when the server
/// was started without `--replication-factor`: 2 (a node's death stops nothing for longer than
/// its lease and loses no acknowledged write), or the live nodes when fewer (a one-node cluster
/// creates collections of one copy).
pub const DEFAULT_REPLICATION_FACTOR: u32 = 2;

/// The metadata that carries the cluster's node credential on node-to-node calls.
pub const NODE_SECRET_HEADER: &str = "x-tarn-node-secret";

/// Byte equality in time that does not depend on where the first difference is.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// How long a call naming a collection this node does not know waits for its view to catch up.
const NOT_FOUND_GRACE: Duration = Duration::from_millis(300);
/// How long connecting to another node may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// How often a connection to another node is pinged, and how long an answer may take.
const PEER_KEEPALIVE: Duration = Duration::from_secs(10);

/// This node's membership and view of the cluster.
pub struct ClusterNode {
    pub node_id: String,
    pub address: String,
    pub(crate) store: Arc<dyn ClusterStore>,
    pub(crate) state: watch::Receiver<Arc<ClusterState>>,
    pub(crate) registry: Arc<Registry>,
    /// Per local shard: writes hold it shared from their epoch check to their acknowledgement;
    /// a shard's hand-over takes it exclusively to drain them (`transfer/`).
    pub(crate) gates: DashMap<String, Arc<tokio::sync::RwLock<()>>>,
    /// Local shards being copied in by a move: not this node's yet, and not to be dropped.
    pub(crate) incoming: Arc<DashMap<String, ()>>,
    /// Local shards whose primary (this node) is handing them over to a replica (`transfer/`).
    pub(crate) handing_over: DashMap<String, ()>,
    pub(crate) moves: MoveCounters,
    /// The CA that signs the other nodes' TLS certificates (`--cluster-ca`).
    peer_ca: Option<Vec<u8>>,
    /// Channels to other nodes for the node-to-node `Cluster` calls, by address.
    pub(crate) peers: DashMap<String, tonic::transport::Channel>,
    /// This data directory's token: the shards the map creates on it (`create_on`).
    pub(crate) incarnation: String,
    /// The cluster this data directory belongs to (its `CLUSTER_ID`, the same as etcd's).
    pub cluster_id: String,
    /// What nodes prove themselves to each other with ([`NODE_SECRET_HEADER`]).
    node_secret: String,
    lease_ttl: Duration,
    /// Copies of each shard of a collection created without a replication factor.
    default_replication_factor: u32,
    /// How long a node may stay dead before the replica copies it held are rebuilt elsewhere.
    pub(crate) replace_dead_after: Duration,
    /// Per local shard: held by whatever may create, replace or remove the local copy (a pull,
    /// reconciliation), so that one never removes what the other just made.
    pub(crate) copy_locks: DashMap<String, Arc<tokio::sync::Mutex<()>>>,
    /// The replication of each shard this node is primary of (`replica_set/`), by local name.
    pub(crate) replication: DashMap<String, Arc<crate::replica_state::ShardReplication>>,
    registration: Registration,
    /// What this data directory has held: etcd's history as this node saw it (`ledger.rs`).
    pub(crate) ledger: Arc<crate::ledger::CopyLedger>,
}

impl std::fmt::Debug for ClusterNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterNode")
            .field("node_id", &self.node_id)
            .field("address", &self.address)
            .finish()
    }
}

/// A local shard taking a write: its collection, its write gate held (shared) until the write
/// is acknowledged, and its replication when it has replicas.
pub(crate) struct ShardWrite {
    pub collection: Collection,
    /// Held until the write is acknowledged (dropped with this value).
    pub _gate: tokio::sync::OwnedRwLockReadGuard<()>,
    pub(crate) replication: Option<Arc<crate::replica_state::ShardReplication>>,
}

/// Where one shard's call goes.
pub(crate) enum Target {
    /// This node owns the shard: the address name, served locally.
    Local(String),
    /// Another node does: a `Node` client to it and the shard as it is addressed there.
    Remote(
        pb::node_client::NodeClient<tonic::transport::Channel>,
        pb::ShardRef,
    ),
}

/// Largest message between nodes (a large insert's part, a large get).
pub(crate) const MAX_NODE_MESSAGE_BYTES: usize = 256 << 20;

impl ClusterNode {
    /// Registers this node under a lease (refused if a live node has the id; a registration
    /// carrying `incarnation`, this data directory's token, is this directory's previous
    /// process and is taken over at once) and starts watching the shard map
    /// ([`ClusterNode::join`], in `start.rs`, then starts the node's tasks).
    ///
    /// First the cluster's identity is settled ([`settle_identity`]): a data directory that
    /// belongs to a cluster joins only the etcd that holds that cluster's id.
    pub(crate) async fn register(
        store: Arc<dyn ClusterStore>,
        options: JoinOptions,
        registry: Arc<Registry>,
    ) -> anyhow::Result<Arc<ClusterNode>> {
        let incarnation = incarnation_token(&options.data_dir)?;
        let ledger = Arc::new(crate::ledger::CopyLedger::open(&options.data_dir)?);
        let holds_shards = !registry.shard_names().is_empty();
        let identity = settle_identity(
            store.as_ref(),
            &options.data_dir,
            holds_shards,
            options.force_new_cluster,
        )
        .await?;
        // From here on the store must hold this cluster's id and never go back behind what
        // this directory saw; a new cluster (--force-new-cluster) or an accepted rollback
        // starts that history again at the store's revision.
        let (floor, witness) = if options.force_new_cluster || options.accept_etcd_rollback {
            tracing::warn!(
                seen = ledger.revision(),
                "the store's history starts again here (--force-new-cluster or \
                 --accept-etcd-rollback): copies held at a later epoch than their record are \
                 set aside, never deleted"
            );
            ledger.restart_history()?;
            (0, None)
        } else {
            (ledger.revision(), ledger.witness())
        };
        store.guard_history(&identity.cluster_id, floor, witness);
        let JoinOptions {
            node_id,
            address,
            lease_ttl,
            peer_ca,
            replication_factor,
            replace_dead_after,
            ..
        } = options;
        let node = NodeInfo {
            node_id: node_id.clone(),
            address: address.clone(),
            incarnation: incarnation.clone(),
        };
        let registration = store
            .register(&node, lease_ttl)
            .await
            .map_err(|e| match e {
                tarn_cluster::ClusterError::HistoryBroken(why) => anyhow::anyhow!(
                    "{why}. This node refuses to join: put back the etcd that holds the cluster's \
                 history, or, if it is lost, restart with --accept-etcd-rollback (copies held at \
                 a later epoch than their record are set aside, never deleted)"
                ),
                e => e.into(),
            })?;
        let state = store.watch().await?;
        tracing::info!(%node_id, %address, cluster_id = %identity.cluster_id, "joined the cluster");
        let node = Arc::new(ClusterNode {
            node_id,
            address,
            store,
            state,
            registry,
            gates: DashMap::new(),
            incoming: Arc::new(DashMap::new()),
            handing_over: DashMap::new(),
            moves: MoveCounters::default(),
            peer_ca,
            peers: DashMap::new(),
            incarnation,
            cluster_id: identity.cluster_id,
            node_secret: identity.node_secret,
            lease_ttl,
            default_replication_factor: replication_factor,
            replace_dead_after,
            copy_locks: DashMap::new(),
            replication: DashMap::new(),
            registration,
            ledger,
        });
        Ok(node)
    }

    /// A channel to a live node for node-to-node calls (`http://` unless it advertises
    /// `https://`).
    pub(crate) async fn peer(&self, node_id: &str) -> Result<tonic::transport::Channel, ApiError> {
        let state = self.state();
        let Some(node) = state.nodes.get(node_id) else {
            return Err(ApiError::Unavailable(format!(
                "node {node_id} is down (its lease lapsed)"
            )));
        };
        if let Some(channel) = self.peers.get(&node.address) {
            return Ok(channel.clone());
        }
        let uri = if node.address.contains("://") {
            node.address.clone()
        } else {
            format!("http://{}", node.address)
        };
        // HTTP/2 keep-alive: a peer that stops answering (SIGSTOP, a cut link) fails its
        // open calls within PEER_KEEPALIVE twice over, not at their deadlines (a pull's is an
        // hour).
        let mut endpoint = tonic::transport::Endpoint::from_shared(uri.clone())
            .map_err(|e| ApiError::Internal(format!("node {node_id}'s address {uri:?}: {e}")))?
            .connect_timeout(CONNECT_TIMEOUT)
            .http2_keep_alive_interval(PEER_KEEPALIVE)
            .keep_alive_timeout(PEER_KEEPALIVE)
            .keep_alive_while_idle(true)
            .tcp_nodelay(true);
        if uri.starts_with("https://") {
            let tls = match &self.peer_ca {
                Some(pem) => tonic::transport::ClientTlsConfig::new()
                    .ca_certificate(tonic::transport::Certificate::from_pem(pem)),
                None => tonic::transport::ClientTlsConfig::new().with_webpki_roots(),
            };
            endpoint = endpoint
                .tls_config(tls)
                .map_err(|e| ApiError::Internal(format!("TLS to node {node_id}: {e}")))?;
        }
        let channel = endpoint.connect().await.map_err(|e| {
            ApiError::Unavailable(format!(
                "node {node_id} at {uri} cannot be reached: {}",
                error_chain(&e)
            ))
        })?;
        self.peers.insert(node.address.clone(), channel.clone());
        Ok(channel)
    }

    /// A request to another node, carrying the cluster's node credential.
    pub(crate) fn internal_request<T>(&self, message: T, timeout: Duration) -> tonic::Request<T> {
        let mut request = tonic::Request::new(message);
        request.set_timeout(timeout);
        if let Ok(value) = self.node_secret.parse() {
            request.metadata_mut().insert(NODE_SECRET_HEADER, value);
        }
        request
    }

    /// Whether a request comes from a node of this cluster (it carries the node credential).
    pub fn is_node_call(&self, metadata: &tonic::metadata::MetadataMap) -> bool {
        metadata
            .get(NODE_SECRET_HEADER)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| constant_time_eq(v.as_bytes(), self.node_secret.as_bytes()))
    }

    /// Refuses a request that does not come from a node of this cluster: node-to-node calls
    /// are not for clients, whatever their API key.
    pub fn check_node<T>(&self, request: &tonic::Request<T>) -> Result<(), ApiError> {
        if self.is_node_call(request.metadata()) {
            Ok(())
        } else {
            Err(ApiError::NotANode)
        }
    }

    pub(crate) fn store(&self) -> &Arc<dyn ClusterStore> {
        &self.store
    }

    /// `Cluster/Drain`: marks `node_id` draining (its shards move away) or not, in etcd.
    pub async fn set_draining(&self, node_id: &str, draining: bool) -> Result<(), ApiError> {
        self.store
            .set_draining(node_id, draining)
            .await
            .map_err(|e| ApiError::ClusterStore(e.to_string()))
    }

    /// This node's local collections and shard copies.
    pub fn registry(&self) -> &Arc<Registry> {
        &self.registry
    }

    /// This node's move, seed and failover counters (for metrics).
    pub fn move_counters(&self) -> &MoveCounters {
        &self.moves
    }

    /// Whether this node may acknowledge a write to a shard it owns: only while its membership
    /// lease is surely alive with a margin to spare, and its view of the map is at least as new
    /// as its registration. A node cut off from etcd cannot know whether the cluster has given
    /// its shards away (`forget` after its lease lapsed), so it stops acknowledging writes a
    /// margin before its lease could lapse, and starts again once it has registered again and
    /// read the map since. Searches go on meanwhile (from the last map it saw).
    pub fn writable(&self) -> Result<(), ApiError> {
        self.check_store_history()?;
        let Some(liveness) = self.registration.liveness() else {
            return Ok(());
        };
        let margin = self.lease_ttl / 4;
        let now = std::time::Instant::now();
        if now + margin >= liveness.lease_alive_until {
            return Err(ApiError::Unavailable(format!(
                "node {} is cut off from etcd: its membership lease ({} s) was not renewed in \
                 time, so it acknowledges no write until it reaches etcd again (retry, or write \
                 through another node)",
                self.node_id,
                self.lease_ttl.as_secs()
            )));
        }
        let seen = self.state.borrow().revision;
        if seen < liveness.registered_at {
            return Err(ApiError::Unavailable(format!(
                "node {} is rejoining the cluster: its view of the shard map (revision {seen}) \
                 predates its registration (revision {}); retry",
                self.node_id, liveness.registered_at
            )));
        }
        Ok(())
    }

    /// Fails (UNAVAILABLE, naming why) once the cluster's store broke its history under this
    /// running node (etcd wiped, replaced, or restored from an older backup): the node is
    /// fenced, acknowledging no write and changing no copy, until it is restarted.
    pub fn check_store_history(&self) -> Result<(), ApiError> {
        match self.store.history_fault() {
            None => Ok(()),
            Some(why) => Err(ApiError::Unavailable(format!(
                "node {} is fenced: {why}; it acknowledges no write and changes no shard copy \
                 until it is restarted against an etcd that holds the cluster's history",
                self.node_id
            ))),
        }
    }

    /// The lock over a local shard's copy (see `copy_locks`).
    pub(crate) fn copy_lock(&self, local_name: &str) -> Arc<tokio::sync::Mutex<()>> {
        Arc::clone(
            self.copy_locks
                .entry(local_name.to_owned())
                .or_default()
                .value(),
        )
    }

    /// Runs a change of the ledger (blocking file I/O) off the async workers.
    pub(crate) async fn note_ledger(
        &self,
        change: impl FnOnce(&crate::ledger::CopyLedger) -> std::io::Result<()> + Send + 'static,
    ) -> std::io::Result<()> {
        let ledger = Arc::clone(&self.ledger);
        tokio::task::spawn_blocking(move || change(&ledger))
            .await
            .map_err(std::io::Error::other)?
    }

    /// The write gate of a local shard.
    pub(crate) fn gate(&self, local_name: &str) -> Arc<tokio::sync::RwLock<()>> {
        Arc::clone(self.gates.entry(local_name.to_owned()).or_default().value())
    }

    /// Waits until this node's view of a shard differs from `seen` (or the collection is gone),
    /// at most until `until` and at most a second; at least a few milliseconds, so that a
    /// caller retrying against a node whose view is behind does not spin.
    pub async fn wait_for_shard_change(
        &self,
        name: &str,
        uid: u64,
        shard: u32,
        seen: &ShardAssignment,
        until: std::time::Instant,
    ) {
        let limit = until
            .saturating_duration_since(std::time::Instant::now())
            .min(Duration::from_secs(1));
        let started = std::time::Instant::now();
        self.wait_for_with(limit, |s| {
            s.collections
                .get(name)
                .filter(|m| m.def.uid == uid)
                .and_then(|m| m.shards.get(shard as usize))
                .is_none_or(|a| a != seen)
        })
        .await;
        let floor = Duration::from_millis(10).min(limit);
        if let Some(rest) = floor.checked_sub(started.elapsed()) {
            tokio::time::sleep(rest).await;
        }
    }

    /// The cluster as last seen.
    pub fn state(&self) -> Arc<ClusterState> {
        Arc::clone(&self.state.borrow())
    }

    /// A receiver of every change of this node's view.
    pub(crate) fn watch(&self) -> watch::Receiver<Arc<ClusterState>> {
        self.state.clone()
    }

    /// Waits (at most `limit`) until this node's view satisfies `done`.
    pub(crate) async fn wait_for_view(
        &self,
        limit: Duration,
        done: impl Fn(&ClusterState) -> bool,
    ) {
        self.wait_for_with(limit, done).await;
    }

    /// Whether the coordination store answers.
    pub fn store_connected(&self) -> bool {
        self.store.connected()
    }

    fn collection(&self, name: &str) -> Result<CollectionMap, ApiError> {
        crate::registry::validate_name(name)?;
        let state = self.state();
        if let Some(why) = state.unreadable.get(name) {
            return Err(unreadable(name, why));
        }
        state
            .collections
            .get(name)
            .cloned()
            .ok_or_else(|| ApiError::NotFound(name.to_owned()))
    }

    pub fn list(&self) -> Vec<String> {
        self.state().collections.keys().cloned().collect()
    }

    /// Waits (briefly) until this node's view satisfies `done`: its own changes are then
    /// visible to the calls that follow.
    async fn wait_for(&self, done: impl Fn(&ClusterState) -> bool) {
        self.wait_for_with(Duration::from_secs(5), done).await;
    }

    async fn wait_for_with(&self, limit: Duration, done: impl Fn(&ClusterState) -> bool) {
        let mut state = self.state.clone();
        let _ = tokio::time::timeout(limit, state.wait_for(|s| done(s))).await;
    }

    /// The map of a collection for a data call. A name this node's view lacks may have just
    /// been created through another node: the view (an etcd watch) is then at most a moment
    /// behind, so the call waits briefly for it before answering NOT_FOUND.
    pub async fn map(&self, name: &str) -> Result<CollectionMap, ApiError> {
        match self.collection(name) {
            Err(ApiError::NotFound(_)) => {
                self.wait_for_with(NOT_FOUND_GRACE, |s| s.collections.contains_key(name))
                    .await;
                self.collection(name)
            }
            other => other,
        }
    }
}

fn store_error(error: tarn_cluster::ClusterError) -> ApiError {
    ApiError::ClusterStore(error.to_string())
}

/// The answer for a collection whose record in etcd this node cannot decode.
fn unreadable(name: &str, why: &str) -> ApiError {
    tracing::warn!(collection = %name, %why, "a call names a collection whose record cannot be read");
    ApiError::Unsupported(format!(
        "collection '{name}': its record in the cluster's store cannot be read by this node \
         (written by a newer tarn, or damaged); upgrade the node or repair the record"
    ))
}

/// An error and its sources, `: `-separated (a transport error's cause is in its source).
fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// Counters of this node's moves (for metrics).
#[derive(Debug, Default)]
pub struct MoveCounters {
    /// Pulls running on this node (as the taker).
    pub in_progress: AtomicU64,
    pub finished: AtomicU64,
    pub failed: AtomicU64,
    /// Bytes received by pulls: snapshots and WAL entries.
    pub bytes: AtomicU64,
    /// Streams running on this node (as the owner).
    pub streams_out: AtomicU64,
    /// The last finished move's write pause (fence to flip), microseconds.
    pub last_write_pause_us: AtomicU64,
    /// Failovers this node landed as the placement coordinator.
    pub failovers: AtomicU64,
    /// Bytes received seeding replica copies (snapshots and WAL entries).
    pub seed_bytes: AtomicU64,
    /// Replica copies seeded here, finished.
    pub seeds: AtomicU64,
}
