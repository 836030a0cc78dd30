//! Cluster mode's node: joining the cluster (membership under an etcd lease), keeping this
//! node's shards in line with the shard map (`reconcile.rs`), and finding where each shard is
//! served (here or on its owner) for the router (`routing.rs`).
//!
//! A shard's data is a local collection on its owner, named `<collection>.<uid>.<shard>`
//! ([`ShardName`]). A router addresses it by shard and epoch through the node-to-node
//! `tarn.v1.Node` service (tarn-server's `node_service.rs`; the owner's own calls go straight to
//! the local collection: no extra hop), handled as `<local name>@<epoch>`; the owner serves it
//! only if the shard map says it owns the shard at exactly that epoch, and answers ABORTED
//! otherwise (fencing by epoch on every write, never by timing).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use dashmap::DashMap;
use tarn_client::Code;
use tarn_cluster::{
    initial_placement, merge_top_k, shard_for, ClusterState, ClusterStore, CollectionDef,
    CollectionMap, NodeInfo, ReadPositions, Registration, ShardAssignment, ShardHit, ShardKey,
    ShardName, DEFAULT_SHARDS, MAX_SHARDS,
};
use tarn_collection::{Collection, CollectionConfig, MetricName};
use tarn_proto::v1 as pb;
use tokio::sync::watch;

use crate::registry::Registry;
use crate::status::ApiError;

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

/// What a node joins the cluster with ([`ClusterNode::join`]).
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

/// What `forget` does to a dead node's shards: each as (collection, shard, its new record).
#[derive(Debug, Default)]
pub struct Forgotten {
    /// Shards whose data is given up: they start empty on another node.
    pub given_up: Vec<(String, u32, ShardAssignment)>,
    /// Shards that lose nothing: another in-sync copy is (or becomes) the primary, and the
    /// node's copy is dropped from the record.
    pub kept: Vec<(String, u32, ShardAssignment)>,
    /// Shards the node held an in-sync replica of while no other in-sync copy is alive on its
    /// recorded disk (its primary is down): the node leaves the record and is listed as given
    /// up, so that its copy, should it come back, is set aside (never deleted). The shard
    /// waits for its primary.
    pub set_aside: Vec<(String, u32, ShardAssignment)>,
}

/// The metadata that carries the cluster's node credential on node-to-node calls.
pub const NODE_SECRET_HEADER: &str = "x-tarn-node-secret";

/// Byte equality in time that does not depend on where the first difference is.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// How long a forwarded call may take when the client set no deadline.
const DEFAULT_FORWARD_DEADLINE: Duration = Duration::from_secs(30);
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
    pub(crate) moves: crate::transfer::MoveCounters,
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
    pub(crate) replication: DashMap<String, Arc<crate::replica_set::ShardReplication>>,
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
    pub(crate) replication: Option<Arc<crate::replica_set::ShardReplication>>,
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
    /// Joins: registers this node under a lease (refused if a live node has the id; a
    /// registration carrying `incarnation`, this data directory's token, is this directory's
    /// previous process and is taken over at once) and starts
    /// watching the shard map; a task drops local shards of collections that no longer exist.
    ///
    /// First the cluster's identity is settled ([`settle_identity`]): a data directory that
    /// belongs to a cluster joins only the etcd that holds that cluster's id.
    pub async fn join(
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
        let floor = if options.force_new_cluster || options.accept_etcd_rollback {
            tracing::warn!(
                seen = ledger.revision(),
                "the store's history starts again here (--force-new-cluster or \
                 --accept-etcd-rollback): copies held at a later epoch than their record are \
                 set aside, never deleted"
            );
            ledger.restart_history()?;
            0
        } else {
            ledger.revision()
        };
        store.guard_history(&identity.cluster_id, floor);
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
            moves: crate::transfer::MoveCounters::default(),
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
        tokio::spawn(crate::reconcile::reconcile(Arc::downgrade(&node)));
        tokio::spawn(crate::coordinator::coordinate(Arc::downgrade(&node)));
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
    pub fn move_counters(&self) -> &crate::transfer::MoveCounters {
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
                "node {} is cut off from etcd: its membership lease ({} s) was not renewed in                  time, so it acknowledges no write until it reaches etcd again (retry, or write                  through another node)",
                self.node_id,
                self.lease_ttl.as_secs()
            )));
        }
        let seen = self.state.borrow().revision;
        if seen < liveness.registered_at {
            return Err(ApiError::Unavailable(format!(
                "node {} is rejoining the cluster: its view of the shard map (revision {seen})                  predates its registration (revision {}); retry",
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

    /// The local collection behind a shard address for a write, with the shard's write gate
    /// held (shared) until the write is acknowledged: served only if this node owns the shard
    /// at exactly `epoch` and the shard is not fenced. The gate is taken before the check, so
    /// a hand-over that drains the gate after seeing the fence waits for every write that
    /// passed the check.
    pub(crate) async fn local_shard_for_write(
        self: &Arc<Self>,
        shard: &ShardName,
        epoch: u64,
    ) -> Result<ShardWrite, ApiError> {
        self.writable()?;
        let guard = self.gate(&shard.local_name()).read_owned().await;
        let collection = self.local_shard(&self.registry, shard, epoch).await?;
        let state = self.state();
        let map = state.collection_of(shard);
        let assignment = state.assignment(shard);
        match (map, assignment) {
            (Some(map), Some(a))
                if a.takes_writes() && a.epoch == epoch && a.owner == self.node_id =>
            {
                let replication = self
                    .replication_for_write(shard, a, map.def.min_in_sync, &collection)
                    .await?;
                Ok(ShardWrite {
                    collection,
                    _gate: guard,
                    replication,
                })
            }
            (_, Some(a)) => Err(ApiError::StaleShardMap(format!(
                "shard {} of collection '{}' is being handed over to node {} (epoch {}): \
                 refresh the shard map and retry",
                shard.shard,
                shard.collection,
                a.moving_to.as_deref().unwrap_or(&a.owner),
                a.epoch
            ))),
            _ => Err(ApiError::NotFound(shard.collection.clone())),
        }
    }

    /// This node's copy of a shard it is a replica of (per `assignment`): the local one, or a
    /// new empty one where the map says this data directory starts it empty (a new
    /// collection's replicas). The caller holds the copy's lock.
    pub(crate) async fn replica_copy(
        &self,
        shard: &ShardName,
        assignment: &ShardAssignment,
    ) -> Result<Collection, ApiError> {
        let local = shard.local_name();
        if let Ok(collection) = self.registry.get_shard(&local) {
            return Ok(collection);
        }
        if !self.replica_starts_empty_here(&local, assignment) {
            return Err(ApiError::ShardUnavailable {
                collection: shard.collection.clone(),
                shard: shard.shard,
                node: self.node_id.clone(),
                why: "this replica holds no copy of it yet (it needs a copy of the primary's \
                      data)"
                    .to_owned(),
            });
        }
        let state = self.state();
        let def = &state
            .collection_of(shard)
            .ok_or_else(|| ApiError::NotFound(shard.collection.clone()))?
            .def;
        let config =
            serde_json::from_value::<CollectionConfig>(def.config.clone()).map_err(|e| {
                ApiError::Internal(format!("collection '{}' has a bad config: {e}", def.name))
            })?;
        self.registry.create_shard(&local, config).await
    }

    /// Whether this data directory may start its replica copy of `local` empty: the record
    /// lists it among the directories a new collection's replicas start on, and no copy of the
    /// shard was ever deleted here (an older record, from an etcd restored from a backup, may
    /// still list it).
    pub(crate) fn replica_starts_empty_here(
        &self,
        local: &str,
        assignment: &ShardAssignment,
    ) -> bool {
        assignment.create_replicas_on.contains(&self.incarnation)
            && self.ledger.may_start_empty(local, assignment.epoch)
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

    /// The local collection behind a shard address, if this node owns the shard at `epoch`.
    pub async fn local_shard(
        &self,
        registry: &Registry,
        shard: &ShardName,
        epoch: u64,
    ) -> Result<Collection, ApiError> {
        let known = |s: &ClusterState| s.collection_of(shard).is_some();
        if !known(&self.state()) {
            // The router's view may be a moment ahead of this node's.
            self.wait_for_with(NOT_FOUND_GRACE, known).await;
        }
        let state = self.state();
        if let Some(why) = state.unreadable.get(&shard.collection) {
            return Err(unreadable(&shard.collection, why));
        }
        let map = state
            .collection_of(shard)
            .ok_or_else(|| ApiError::NotFound(shard.collection.clone()))?;
        let assignment = map
            .shards
            .get(shard.shard as usize)
            .ok_or_else(|| ApiError::invalid("collection", format!("no shard {}", shard.shard)))?;
        if assignment.epoch < self.ledger.held_epoch(&shard.local_name()) {
            return Err(ApiError::ShardUnavailable {
                collection: shard.collection.clone(),
                shard: shard.shard,
                node: self.node_id.clone(),
                why: format!(
                    "its record (epoch {}) is older than the epoch this node held it at (etcd \
                     restored from an older backup?): this copy is set aside, not served",
                    assignment.epoch
                ),
            });
        }
        if assignment.owner != self.node_id || assignment.epoch != epoch {
            // A shard moved off this node: its router may still think it is here.
            return Err(ApiError::StaleShardMap(format!(
                "shard {} of collection '{}' is on node {} at epoch {}, not on node {} at \
                 epoch {epoch}: refresh the shard map and retry",
                shard.shard, shard.collection, assignment.owner, assignment.epoch, self.node_id
            )));
        }
        let local = shard.local_name();
        if let Ok(collection) = registry.get_shard(&local) {
            return Ok(collection);
        }
        // Created only where the map says this data directory starts it empty: a lookup never
        // invents a shard whose data is elsewhere (or lost). A replica promoted before its copy
        // was ever created (the primary of a new collection died at once) starts it empty too:
        // its directory is one the shard's replicas start empty on, and no copy of the shard
        // was set aside here (a copy replaced by a seed leaves the in-sync set first, so a
        // promoted copy was never replaced).
        // Never where a copy of the shard was deleted before (a record from an etcd restored
        // from an older backup may still name this directory).
        let starts_empty_here = self.ledger.may_start_empty(&local, assignment.epoch)
            && (assignment.create_on.as_deref() == Some(self.incarnation.as_str())
                || (assignment.create_replicas_on.contains(&self.incarnation)
                    && !registry.has_set_aside(&local)));
        if !starts_empty_here {
            return Err(ApiError::ShardUnavailable {
                collection: shard.collection.clone(),
                shard: shard.shard,
                node: self.node_id.clone(),
                why: "this node holds no copy of it (its data directory is not the one the \
                      shard was created or copied on); bring that directory back, or give the \
                      shard up with `tarn cluster forget`"
                    .to_owned(),
            });
        }
        let def = &map.def;
        let config =
            serde_json::from_value::<CollectionConfig>(def.config.clone()).map_err(|e| {
                ApiError::Internal(format!("collection '{}' has a bad config: {e}", def.name))
            })?;
        let lock = self.copy_lock(&local);
        let _copy = lock.lock().await;
        registry.create_shard(&local, config).await
    }

    /// The local copy a read of a shard address names: the owner's ([`Self::local_shard`]), or
    /// this node's copy when it is an in-sync replica of the shard at exactly `epoch`, on the
    /// data directory recorded for its copy (routers
    /// spread searches and gets over the in-sync copies; a read token's positions are in the
    /// same log on every copy, and the read waits until this copy has applied them).
    pub async fn local_copy(
        &self,
        registry: &Registry,
        shard: &ShardName,
        epoch: u64,
    ) -> Result<Collection, ApiError> {
        // A copy of a replicated shard answers reads only while this node is surely in the
        // cluster (its lease alive, its view current): cut off from etcd it cannot know that
        // it was deposed or dropped from the in-sync set, and newer copies serve elsewhere. A
        // shard's only copy goes on serving from the last map (nothing newer exists).
        let replicated = self
            .state()
            .assignment(shard)
            .is_some_and(|a| !a.replicas.is_empty());
        if replicated {
            self.writable().map_err(|why| {
                ApiError::Unavailable(format!(
                    "shard {} of collection '{}': this copy may be behind ({why}); read from \
                     another copy",
                    shard.shard, shard.collection
                ))
            })?;
        }
        match self.local_shard(registry, shard, epoch).await {
            Err(ApiError::StaleShardMap(why)) => {
                let in_sync_here = self.state().assignment(shard).is_some_and(|a| {
                    a.epoch == epoch
                        && a.role_of(&self.node_id) == Some(tarn_cluster::CopyRole::InSyncReplica)
                        && !a.copy_replaced(&self.node_id, &self.incarnation)
                });
                match registry.get_shard(&shard.local_name()) {
                    Ok(copy)
                        if in_sync_here && !self.incoming.contains_key(&shard.local_name()) =>
                    {
                        Ok(copy)
                    }
                    _ => Err(ApiError::StaleShardMap(why)),
                }
            }
            other => other,
        }
    }

    /// Where a read of `shard` that any in-sync copy may answer (a search, a get) goes: this
    /// node first when it holds an in-sync copy (no hop), else the alive in-sync copies (each
    /// on the data directory recorded for it: a node back on a wiped disk holds none) from
    /// the `spread`-th on (callers pass a rotating number, plus one per failed try, so reads
    /// spread over the copies and a retry takes the next one). Also how many copies there are
    /// to try. The owner alone when it is the only one.
    pub(crate) async fn read_target(
        &self,
        map: &CollectionMap,
        shard: u32,
        (spread, attempt): (usize, usize),
    ) -> (Result<Target, ApiError>, usize, String) {
        let assignment = &map.shards[shard as usize];
        let state = self.state();
        let copies: Vec<&str> = assignment
            .in_sync()
            .filter(|n| {
                if *n == self.node_id {
                    !assignment.copy_replaced(n, &self.incarnation)
                } else {
                    state.holds_in_sync_copy(assignment, n)
                }
            })
            .collect();
        if copies.len() <= 1 || !assignment.takes_writes() {
            return (self.target(map, shard).await, 1, assignment.owner.clone());
        }
        let first = copies
            .iter()
            .position(|n| *n == self.node_id)
            .unwrap_or(spread);
        let pick = copies[(first + attempt) % copies.len()];
        let role = if pick == assignment.owner {
            pb::ShardRole::Owner
        } else {
            pb::ShardRole::Replica
        };
        (
            self.target_on(map, shard, pick, role).await,
            copies.len(),
            pick.to_owned(),
        )
    }

    /// Where a call for `shard` of `map` goes: here, or to its live owner (over the `Node`
    /// service, naming the shard at the epoch this node's map gives it).
    pub(crate) async fn target(&self, map: &CollectionMap, shard: u32) -> Result<Target, ApiError> {
        let owner = &map.shards[shard as usize].owner;
        self.target_on(map, shard, owner, pb::ShardRole::Owner)
            .await
    }

    /// A call for `shard` of `map` on the copy of `node` (this node's, or a peer's over the
    /// `Node` service, naming the shard at the epoch this node's map gives it and the copy's
    /// `role`).
    async fn target_on(
        &self,
        map: &CollectionMap,
        shard: u32,
        node: &str,
        role: pb::ShardRole,
    ) -> Result<Target, ApiError> {
        let epoch = map.shards[shard as usize].epoch;
        if node == self.node_id {
            let name = ShardName {
                collection: map.def.name.clone(),
                uid: map.def.uid,
                shard,
            }
            .address(epoch);
            return Ok(Target::Local(name));
        }
        let channel = self.peer(node).await.map_err(|e| {
            let why = match e {
                ApiError::Unavailable(why) => why,
                other => other.to_string(),
            };
            ApiError::ShardUnavailable {
                collection: map.def.name.clone(),
                shard,
                node: node.to_owned(),
                why,
            }
        })?;
        let client = pb::node_client::NodeClient::new(channel)
            .max_decoding_message_size(MAX_NODE_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_NODE_MESSAGE_BYTES);
        let shard_ref = pb::ShardRef {
            collection: map.def.name.clone(),
            uid: map.def.uid,
            shard,
            epoch,
            role: role as i32,
        };
        Ok(Target::Remote(client, shard_ref))
    }

    /// A request to another node for a client's call: the node credential, the client's own
    /// API key (the owner checks the caller's rights too), and the deadline.
    pub(crate) fn node_request<T>(
        &self,
        message: T,
        api_key: Option<&str>,
        timeout: Duration,
    ) -> tonic::Request<T> {
        let mut request = self.internal_request(message, timeout);
        if let Some(value) = api_key.and_then(|k| format!("Bearer {k}").parse().ok()) {
            request.metadata_mut().insert("authorization", value);
        }
        request
    }

    /// `CreateCollection` in cluster mode: the definition and an even placement over the live
    /// nodes, written to the store in one transaction.
    pub async fn create_collection(
        &self,
        request: &pb::CreateCollectionRequest,
        config: CollectionConfig,
    ) -> Result<CollectionMap, ApiError> {
        crate::registry::validate_name(&request.name)?;
        let n_shards = match request.shards {
            0 => DEFAULT_SHARDS,
            n if n <= MAX_SHARDS => n,
            n => {
                return Err(ApiError::invalid(
                    "shards",
                    format!("{n} is over the limit of {MAX_SHARDS}"),
                ))
            }
        };
        let shard_key = match pb::ShardKey::try_from(request.shard_key) {
            Ok(pb::ShardKey::User) => ShardKey::User,
            Ok(pb::ShardKey::Doc) => ShardKey::Doc,
            Err(_) => {
                return Err(ApiError::invalid(
                    "shard_key",
                    format!("unknown value {}", request.shard_key),
                ))
            }
        };
        let nodes: Vec<NodeInfo> = self.state().nodes.values().cloned().collect();
        let default_factor = match self.default_replication_factor {
            0 => DEFAULT_REPLICATION_FACTOR.min(nodes.len().max(1) as u32),
            given => given,
        };
        let (replication_factor, min_in_sync) = tarn_cluster::replication_settings(
            request.replication_factor,
            request.min_in_sync,
            default_factor,
            nodes.len(),
        )
        .map_err(ApiError::Unsupported)?;
        let def = CollectionDef {
            name: request.name.clone(),
            uid: rand::random::<u64>() | 1,
            n_shards,
            shard_key,
            config: serde_json::to_value(&config)
                .map_err(|e| ApiError::Internal(format!("encoding the config: {e}")))?,
            replication_factor,
            min_in_sync,
        };
        let map = CollectionMap {
            shards: initial_placement(&def.name, n_shards, &nodes, def.replication_factor),
            def,
        };
        if map.shards.is_empty() {
            return Err(ApiError::Unavailable(
                "no live node to place shards on (etcd shows none registered)".into(),
            ));
        }
        if !self
            .store
            .create_collection(&map)
            .await
            .map_err(store_error)?
        {
            return Err(ApiError::AlreadyExists(request.name.clone()));
        }
        self.wait_for(|s| {
            s.collections
                .get(&map.def.name)
                .is_some_and(|m| m.def.uid == map.def.uid)
        })
        .await;
        Ok(map)
    }

    pub async fn drop_collection(&self, name: &str) -> Result<(), ApiError> {
        let map = self.collection(name)?;
        if !self
            .store
            .drop_collection(name)
            .await
            .map_err(store_error)?
        {
            return Err(ApiError::NotFound(name.to_owned()));
        }
        self.wait_for(|s| {
            s.collections
                .get(name)
                .is_none_or(|m| m.def.uid != map.def.uid)
        })
        .await;
        Ok(())
    }

    /// `ForgetNode`: hands every shard of the dead node `node_id` to the live node with the
    /// fewest shards, as an empty shard at the next epoch (compare-and-swap per shard). With
    /// `confirm` false, only the plan. Refused while the node is alive.
    pub async fn forget(&self, node_id: &str, confirm: bool) -> Result<Forgotten, ApiError> {
        let state = self.state();
        if state.is_alive(node_id) {
            return Err(ApiError::Unsupported(format!(
                "node {node_id} is alive: only a dead node's shards can be given up"
            )));
        }
        let mut load: BTreeMap<String, usize> =
            state.nodes.keys().map(|n| (n.clone(), 0)).collect();
        if load.is_empty() {
            return Err(ApiError::Unsupported(
                "no live node to take the shards".into(),
            ));
        }
        for map in state.collections.values() {
            for assignment in &map.shards {
                if let Some(n) = load.get_mut(&assignment.owner) {
                    *n += 1;
                }
            }
        }
        let mut plan = Vec::new();
        let mut kept = Vec::new();
        let mut set_aside = Vec::new();
        for (name, map) in &state.collections {
            for (shard, assignment) in map.shards.iter().enumerate() {
                let change = |new| {
                    let shard = shard as u32;
                    (name.clone(), map.def.uid, shard, assignment.clone(), new)
                };
                // An in-sync replica whose data no other in-sync copy holds alive on its disk
                // (the primary is down, or back on a wiped disk): never "no data lost".
                let another_holds = assignment
                    .in_sync()
                    .any(|n| n != node_id && state.holds_in_sync_copy(assignment, n));
                if assignment.owner != node_id
                    && assignment.in_sync().any(|n| n == node_id)
                    && !another_holds
                {
                    if let Some(mut new) = assignment.without_replica(node_id) {
                        new.given_up.push(node_id.to_owned());
                        set_aside.push(change(new));
                    }
                    continue;
                }
                // A copy another in-sync copy makes redundant loses no data: the forgotten
                // node's replica leaves the record; a primary gives way to an alive in-sync
                // replica (the promotion failover would make), which then drops it.
                let without = if assignment.owner == node_id {
                    let candidate = assignment
                        .in_sync_replicas
                        .iter()
                        .find(|n| state.holds_in_sync_copy(assignment, n));
                    candidate
                        .and_then(|c| assignment.promoted(c))
                        .and_then(|p| p.without_replica(node_id))
                } else {
                    assignment.without_replica(node_id)
                };
                if let Some(new) = without {
                    kept.push(change(new));
                    continue;
                }
                if assignment.owner != node_id {
                    continue;
                }
                let (target, n) = load
                    .iter_mut()
                    .min_by_key(|(id, n)| (**n, (*id).clone()))
                    .ok_or_else(|| ApiError::Internal("no live node".into()))?;
                *n += 1;
                let incarnation = state
                    .nodes
                    .get(target)
                    .map_or("", |n| n.incarnation.as_str());
                plan.push(change(assignment.given_up_to(target, incarnation)));
            }
        }
        if confirm {
            // Only while the node has no registration in etcd itself: a node this one's view
            // thinks dead may be alive (a lagging view, or a node cut off from etcd whose lease
            // has not lapsed yet, which still acknowledges writes).
            let swap_unless_registered = async |name: &str,
                                                uid: u64,
                                                shard: u32,
                                                expected_epoch: u64,
                                                new: &ShardAssignment,
                                                expected: Option<&ShardAssignment>|
                   -> Result<(), ApiError> {
                let swapped = self
                    .store
                    .compare_and_set_shard(&tarn_cluster::ShardSwap {
                        collection: name,
                        uid,
                        shard,
                        expected_epoch,
                        new,
                        unless_registered: Some(node_id),
                        unless_registered_from: None,
                        registered: None,
                        expected,
                    })
                    .await
                    .map_err(store_error)?;
                if !swapped {
                    return Err(ApiError::StaleShardMap(format!(
                        "shard {shard} of collection '{name}' changed meanwhile, or node \
                         {node_id} is registered again: check `tarn cluster status` and run \
                         forget again"
                    )));
                }
                Ok(())
            };
            for (name, uid, shard, from, new) in &kept {
                swap_unless_registered(name, *uid, *shard, from.epoch, new, Some(from)).await?;
                tracing::warn!(collection = %name, shard, forgotten = %node_id, owner = %new.owner, "a forgotten node's copy dropped: another in-sync copy holds the data");
            }
            for (name, uid, shard, from, new) in &set_aside {
                swap_unless_registered(name, *uid, *shard, from.epoch, new, Some(from)).await?;
                tracing::warn!(collection = %name, shard, forgotten = %node_id, owner = %new.owner, "a forgotten node's in-sync copy leaves the record and is set aside should it come back: no other in-sync copy is alive");
            }
            for (name, uid, shard, from, new) in &plan {
                swap_unless_registered(name, *uid, *shard, from.epoch, new, Some(from)).await?;
                tracing::warn!(collection = %name, shard, forgotten = %node_id, owner = %new.owner, "shard given up: its data is lost, it starts empty");
            }
            let last = plan.last().map(|p| (p.0.clone(), p.2, p.4.epoch));
            if let Some((name, shard, epoch)) = last {
                self.wait_for(|s| {
                    s.collections
                        .get(&name)
                        .is_some_and(|m| m.shards[shard as usize].epoch >= epoch)
                })
                .await;
            }
        }
        Ok(Forgotten {
            given_up: plan
                .into_iter()
                .map(|(name, _, shard, _, new)| (name, shard, new))
                .collect(),
            kept: kept
                .into_iter()
                .map(|(name, _, shard, _, new)| (name, shard, new))
                .collect(),
            set_aside: set_aside
                .into_iter()
                .map(|(name, _, shard, _, new)| (name, shard, new))
                .collect(),
        })
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

/// One shard's part of a request: the indexes of its documents in the request, and its tenants.
pub type ShardPart = (Vec<usize>, Vec<u128>);

/// Splits (doc ids x user ids) by shard: for each shard concerned, in shard order, the indexes
/// of its documents in the request and its tenants. USER: each tenant's shard gets every
/// document; DOC: each document's shard gets every tenant. No tenant listed means tenant 0.
pub fn split(def: &CollectionDef, doc_ids: &[u128], user_ids: &[u128]) -> Vec<(u32, ShardPart)> {
    let users: Vec<u128> = if user_ids.is_empty() {
        vec![0]
    } else {
        user_ids.to_vec()
    };
    let mut by_shard: BTreeMap<u32, ShardPart> = BTreeMap::new();
    match def.shard_key {
        ShardKey::User => {
            for user in users {
                let entry = by_shard.entry(shard_for(user, def.n_shards)).or_default();
                entry.1.push(user);
            }
            for entry in by_shard.values_mut() {
                entry.0 = (0..doc_ids.len()).collect();
            }
        }
        ShardKey::Doc => {
            for (i, doc) in doc_ids.iter().enumerate() {
                let entry = by_shard.entry(shard_for(*doc, def.n_shards)).or_default();
                entry.0.push(i);
            }
            for entry in by_shard.values_mut() {
                entry.1 = users.clone();
            }
        }
    }
    by_shard.into_iter().collect()
}

/// The shards a search over `user_ids` touches: the tenants' shards (USER), or all (DOC).
pub fn search_shards(def: &CollectionDef, user_ids: &[u128]) -> Vec<u32> {
    match def.shard_key {
        ShardKey::Doc => (0..def.n_shards).collect(),
        ShardKey::User => {
            let mut shards: Vec<u32> = if user_ids.is_empty() {
                vec![shard_for(0, def.n_shards)]
            } else {
                user_ids
                    .iter()
                    .map(|u| shard_for(*u, def.n_shards))
                    .collect()
            };
            shards.sort_unstable();
            shards.dedup();
            shards
        }
    }
}

/// Whether higher scores are better for the collection's metric.
pub fn higher_is_better(def: &CollectionDef) -> bool {
    serde_json::from_value::<CollectionConfig>(def.config.clone())
        .map_or(true, |c| c.metric != MetricName::L2)
}

/// The forward deadline: what the client has left, or the default.
pub fn forward_deadline(client_deadline: Option<Duration>) -> Duration {
    client_deadline.unwrap_or(DEFAULT_FORWARD_DEADLINE)
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

/// A remote error, with the shard it came from when the owner could not be reached or did not
/// answer in time.
pub fn forwarded(map: &CollectionMap, shard: u32, error: tarn_client::Error) -> ApiError {
    if error.code() == Code::DeadlineExceeded {
        // The router names the copy it asked (`routing.rs`, `on_shard`).
        return ApiError::DeadlineExceeded(format!(
            "shard {shard} of collection '{}' did not answer within the deadline ({})",
            map.def.name,
            error.message()
        ));
    }
    if error.code() == Code::Unavailable {
        return ApiError::ShardUnavailable {
            collection: map.def.name.clone(),
            shard,
            node: map.shards[shard as usize].owner.clone(),
            why: error.message().to_owned(),
        };
    }
    ApiError::Forwarded(error)
}

/// Another node's refusal or failure, as [`forwarded`] (a transport failure is the node being
/// unreachable; a deadline is the caller's).
pub fn forwarded_status(map: &CollectionMap, shard: u32, status: tonic::Status) -> ApiError {
    forwarded(map, shard, tarn_client::Error::from(status))
}

/// Converts hits of either path into the merge's type.
pub fn shard_hits(hits: impl IntoIterator<Item = (u128, u128, f32)>) -> Vec<ShardHit> {
    hits.into_iter()
        .map(|(doc_id, user_id, score)| ShardHit {
            doc_id,
            user_id,
            score,
        })
        .collect()
}

/// The merged top-k of shard results.
pub fn merge(def: &CollectionDef, results: Vec<Vec<ShardHit>>, top_k: usize) -> Vec<ShardHit> {
    merge_top_k(results, top_k, higher_is_better(def))
}

/// A read token for positions in `map`'s shards: (shard, sequence number, the epoch the write
/// was acknowledged at: that of the map its successful attempt was routed by).
pub fn read_token(map: &CollectionMap, positions: Vec<(u32, u64, u64)>) -> Vec<u8> {
    let mut token = ReadPositions {
        uid: map.def.uid,
        positions: Vec::new(),
    };
    token.merge(&ReadPositions {
        uid: map.def.uid,
        positions: positions
            .into_iter()
            .map(|(shard, seq, epoch)| tarn_cluster::TokenPosition { shard, epoch, seq })
            .collect(),
    });
    token.encode()
}

/// The name of the file in the data directory that holds its token ([`incarnation_token`]).
pub(crate) const INCARNATION_FILE: &str = "INCARNATION";

/// The data directory's token: 32 hex digits, made once (written to a temporary file, synced,
/// renamed, the directory synced) and read at every start. The caller holds the directory's
/// lock, so a cluster registration carrying this token belongs to this directory's previous
/// process, which is dead. A file that does not hold a token (damaged by hand) is replaced,
/// with a warning: the only cost is one start that waits for the old lease to lapse.
pub(crate) fn incarnation_token(data_dir: &std::path::Path) -> anyhow::Result<String> {
    use anyhow::Context;
    let path = data_dir.join(INCARNATION_FILE);
    match std::fs::read_to_string(&path) {
        Ok(text) => {
            let token = text.trim();
            if is_token(token) {
                return Ok(token.to_owned());
            }
            tracing::warn!(path = %path.display(), "not a data directory token; writing a new one");
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    }
    let token = new_token();
    write_token_file(data_dir, INCARNATION_FILE, &token)?;
    Ok(token)
}

/// 32 random hex digits.
fn new_token() -> String {
    format!("{:032x}", rand::random::<u128>())
}

/// Whether `text` is a token [`new_token`] made.
fn is_token(text: &str) -> bool {
    text.len() == 32 && text.bytes().all(|b| b.is_ascii_hexdigit())
}

/// Writes `data_dir/name` durably: a temporary file, synced, renamed, the directory synced.
fn write_token_file(data_dir: &std::path::Path, name: &str, token: &str) -> anyhow::Result<()> {
    use anyhow::Context;
    use std::io::Write;
    let path = data_dir.join(name);
    let staging = data_dir.join(format!("{name}.tmp"));
    let mut file = std::fs::File::create(&staging)
        .with_context(|| format!("creating {}", staging.display()))?;
    file.write_all(format!("{token}\n").as_bytes())
        .and_then(|()| file.sync_all())
        .with_context(|| format!("writing {}", staging.display()))?;
    std::fs::rename(&staging, &path).with_context(|| format!("renaming to {}", path.display()))?;
    std::fs::File::open(data_dir)
        .and_then(|dir| dir.sync_all())
        .with_context(|| format!("syncing {}", data_dir.display()))?;
    Ok(())
}

/// The file in the data directory that names the cluster it belongs to.
pub(crate) const CLUSTER_ID_FILE: &str = "CLUSTER_ID";

/// Settles which cluster this data directory and the store belong to, before the node
/// registers: a cluster id is created in the store when the cluster forms (by its first node)
/// and recorded in every member's data directory (`CLUSTER_ID`). Then:
/// - directory and store name the same cluster: join;
/// - they name different clusters: refused (a wrong etcd, or a directory of another cluster);
/// - the directory names a cluster, the store none (an empty etcd, another one, one restored
///   from a backup older than the cluster): refused, unless `force_new_cluster` (the etcd is
///   lost for good): then a new id is created and recorded, and local shards the new map does
///   not know are set aside by reconciliation, never deleted;
/// - the directory names none (new, or written by a tarn before identities): it takes the
///   store's id, creating one if the store has none; but a directory that holds shards refuses
///   a store that holds nothing at all (no id, no node, no collection) unless
///   `force_new_cluster`.
pub(crate) async fn settle_identity(
    store: &dyn ClusterStore,
    data_dir: &std::path::Path,
    holds_shards: bool,
    force_new_cluster: bool,
) -> anyhow::Result<tarn_cluster::ClusterIdentity> {
    let path = data_dir.join(CLUSTER_ID_FILE);
    let local = match std::fs::read_to_string(&path) {
        Ok(text) if is_token(text.trim()) => Some(text.trim().to_owned()),
        Ok(_) => anyhow::bail!(
            "{} does not hold a cluster id; restore it from a backup, or delete it to join the \
             cluster etcd names",
            path.display()
        ),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(anyhow::Error::from(e).context(format!("reading {}", path.display()))),
    };
    let remote = store.identity().await?;
    let proposed = || tarn_cluster::ClusterIdentity {
        cluster_id: new_token(),
        node_secret: format!("{}{}", new_token(), new_token()),
    };
    let identity = match (local, remote.identity) {
        (Some(local), Some(remote)) if local == remote.cluster_id => return Ok(remote),
        (Some(local), Some(remote)) => anyhow::bail!(
            "this data directory ({}) belongs to cluster {local}, but etcd holds cluster \
             {}: --etcd points at another cluster's etcd, or the directory is another \
             cluster's. Refusing to join: its shards would be judged against a map they are not \
             in",
            data_dir.display(),
            remote.cluster_id
        ),
        (Some(local), None) if !force_new_cluster => anyhow::bail!(
            "this data directory ({}) belongs to cluster {local}, but etcd holds no cluster id \
             (an empty etcd, another one, or one restored from a backup older than the \
             cluster). Refusing to join: its shards would be judged against a map they are not \
             in. Point --etcd at the cluster's etcd; if that etcd is lost for good, start with \
             --force-new-cluster (a new cluster is formed; shards the new map does not know are \
             set aside, not deleted)",
            data_dir.display()
        ),
        (Some(local), None) => {
            let id = store.create_identity(&proposed()).await?;
            tracing::warn!(old = %local, new = %id.cluster_id, "--force-new-cluster: this data directory joins a new cluster");
            id
        }
        (None, Some(remote)) => {
            if holds_shards {
                tracing::warn!(cluster_id = %remote.cluster_id, "this data directory holds shards but no cluster id (written by an older tarn): it takes etcd's");
            }
            remote
        }
        (None, None) => {
            if holds_shards && !remote.holds_state && !force_new_cluster {
                anyhow::bail!(
                    "this data directory ({}) holds shards of a cluster, but etcd holds no \
                     cluster at all (no id, no node, no collection). Refusing to form a new \
                     cluster over them; point --etcd at the cluster's etcd, or start with \
                     --force-new-cluster (shards the new map does not know are set aside, not \
                     deleted)",
                    data_dir.display()
                );
            }
            let id = store.create_identity(&proposed()).await?;
            tracing::info!(cluster_id = %id.cluster_id, "cluster id settled");
            id
        }
    };
    write_token_file(data_dir, CLUSTER_ID_FILE, &identity.cluster_id)?;
    Ok(identity)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn def(shard_key: ShardKey, n_shards: u32) -> CollectionDef {
        CollectionDef {
            name: "c".into(),
            uid: 1,
            n_shards,
            shard_key,
            config: serde_json::Value::Null,
            replication_factor: 1,
            min_in_sync: 1,
        }
    }

    #[test]
    fn requests_split_by_tenant_or_by_document_and_lose_nothing() {
        let docs: Vec<u128> = (0..100).collect();
        let users: Vec<u128> = (0..20).collect();
        // USER: every part holds every document; each tenant lands on its own shard once.
        let parts = split(&def(ShardKey::User, 8), &docs, &users);
        let mut tenants: Vec<u128> = parts.iter().flat_map(|(_, (_, u))| u.clone()).collect();
        tenants.sort_unstable();
        assert_eq!(tenants, users);
        for (shard, (doc_idx, part_users)) in &parts {
            assert_eq!(doc_idx.len(), docs.len());
            assert!(part_users.iter().all(|u| shard_for(*u, 8) == *shard));
        }
        // No tenant: tenant 0's shard.
        let parts = split(&def(ShardKey::User, 8), &docs, &[]);
        assert_eq!(parts.len(), 1);
        assert_eq!(parts[0].0, shard_for(0, 8));
        assert_eq!(parts[0].1 .1, vec![0]);
        // DOC: every document once, on its own shard, with every tenant.
        let parts = split(&def(ShardKey::Doc, 8), &docs, &users);
        let mut seen: Vec<usize> = parts.iter().flat_map(|(_, (d, _))| d.clone()).collect();
        seen.sort_unstable();
        assert_eq!(seen, (0..100).collect::<Vec<_>>());
        for (shard, (doc_idx, part_users)) in &parts {
            assert!(doc_idx.iter().all(|&i| shard_for(docs[i], 8) == *shard));
            assert_eq!(part_users, &users);
        }
        assert!(parts.windows(2).all(|w| w[0].0 < w[1].0), "in shard order");
    }

    #[test]
    fn searches_touch_the_tenants_shards_or_all() {
        let user = def(ShardKey::User, 16);
        assert_eq!(search_shards(&user, &[]), vec![shard_for(0, 16)]);
        let shards = search_shards(&user, &[1, 2, 3, 1]);
        let mut want: Vec<u32> = [1u128, 2, 3].iter().map(|u| shard_for(*u, 16)).collect();
        want.sort_unstable();
        want.dedup();
        assert_eq!(shards, want);
        assert_eq!(
            search_shards(&def(ShardKey::Doc, 4), &[7]),
            vec![0, 1, 2, 3]
        );
    }
}
