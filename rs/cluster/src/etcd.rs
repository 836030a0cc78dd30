//! [`EtcdStore`]: the [`ClusterStore`] of a real cluster, in etcd (v3 API, through tarn's own
//! small client of it, [`crate::etcd_api`]). etcd does all the agreeing: membership is keys under leases, every
//! change is one etcd transaction, each node follows the state with one etcd watch, and the
//! placement coordinator is chosen by etcd's election API ([`EtcdStore::campaign`]). Nothing here
//! votes, elects or times out a peer by itself.
//!
//! # Key layout
//!
//! Every key lives under a prefix ([`DEFAULT_PREFIX`], `/tarn/`, unless told otherwise), so that
//! several clusters can share one etcd:
//!
//! ```text
//! <prefix>nodes/<node_id>                   NodeInfo JSON, attached to the node's lease
//! <prefix>collections/<name>                CollectionDef JSON
//! <prefix>shards/<name>/<shard, 5 digits>   ShardAssignment JSON ("00000" to "01023")
//! <prefix>draining/<node_id>                "{}": the node is being drained (until cancelled)
//! <prefix>moves/<name>/<shard, 5 digits>    MoveFailure JSON: the shard's last failed move
//! <prefix>dropped/<name>/<uid, 16 hex>      "{}": a dropped collection's tombstone (kept)
//! <prefix>cluster                           {"cluster_id": ...}: the cluster's identity
//! <prefix>elections/<election>/...          etcd's election keys (EtcdStore::campaign)
//! ```
//!
//! A collection is in the watched [`ClusterState`] once its definition and all its `n_shards`
//! shard keys are present. A collection of up to 127 shards is written in one transaction; a
//! larger one does not fit in one (etcd allows 128 operations per transaction by default), so its
//! definition and first 127 shards are written by one transaction that claims the name, and the
//! rest by transactions that each check that the definition is still the one written. Until the
//! last one lands the collection is invisible; if the writer dies between them, the name stays
//! taken by an invisible collection until `drop_collection` removes it.
//!
//! # Failures
//!
//! Every request has a deadline ([`REQUEST_TIMEOUT`]; a campaign waits as long as the election
//! takes). An etcd that does not answer, or answers with an error, gives
//! [`ClusterError::StoreUnavailable`] naming the endpoints, and `connected()` turns false until
//! a call or the watch succeeds again. The watched state stays as it last was while etcd is away
//! (the data plane goes on with it); the watch task retries with backoff and reloads the whole
//! prefix when etcd is back. A node's keep-alive task retries the same way; if it finds its lease
//! expired when etcd is back, it registers the node again under a new lease, if the id is still
//! free (and logs an error, retrying, if not). A value that does not decode is
//! [`ClusterError::BadValue`] where it is read on purpose; in the watched state a node record
//! that does not decode is logged and left out, and a collection's definition or shard record
//! that does not decode makes the collection unreadable ([`ClusterState::unreadable`]), never
//! absent.
//!
//! Node ids and collection names are validated by the caller; they must not contain `/`.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::etcd_api::etcdserverpb::{
    compare, event::EventType, request_op, response_op, Compare, RangeRequest, RequestOp,
    TxnRequest, WatchCreateRequest,
};
use crate::etcd_api::v3electionpb::LeaderKey;
use crate::etcd_api::{delete_request, prefix_end, ConnectOptions, EtcdClient};
use parking_lot::Mutex;
use tokio::sync::{watch, OnceCell};
use tokio::task::JoinHandle;

use crate::copies::{CopyEvidence, ShardRecord};
use crate::error::{ClusterError, Result};
use crate::map::{
    ClusterState, CollectionDef, CollectionMap, HistoryWitness, MoveFailure, NodeInfo,
    ShardAssignment,
};
use crate::store::{
    ClusterIdentity, ClusterStore, Liveness, Registration, ShardSwap, StoreIdentity,
};

/// The key of the cluster's identity, under the prefix.
const IDENTITY_KEY: &str = "cluster";

/// The value of [`IDENTITY_KEY`].
#[derive(serde::Serialize, serde::Deserialize)]
struct IdentityRecord {
    cluster_id: String,
    node_secret: String,
}

/// The key prefix of a cluster when none is given.
pub const DEFAULT_PREFIX: &str = "/tarn/";
/// How long one etcd request may take before it counts as failed.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// How long opening a TCP connection to an endpoint may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// The first and the longest wait between two attempts to reach etcd again.
const RETRY_FIRST: Duration = Duration::from_millis(100);
const RETRY_MAX: Duration = Duration::from_secs(2);
/// How long after a foreign registration's lease should have lapsed a starting node still
/// waits before it gives up ([`ClusterStore::register`]).
const LAPSE_MARGIN: Duration = Duration::from_secs(2);
/// Most registrations of this data directory's previous processes one start takes over (each
/// is one etcd transaction; more means something else keeps writing the key).
const MAX_TAKEOVERS: u32 = 3;
/// etcd's default `--max-txn-ops`: the most operations in one branch of a transaction.
const MAX_TXN_OPS: usize = 128;
/// The lease of a candidate in an election: a coordinator that dies is replaced this long after.
pub const ELECTION_TTL: Duration = Duration::from_secs(5);
/// Largest gRPC message accepted from etcd (the full state of a large cluster in one range read).
const MAX_MESSAGE_BYTES: usize = 64 << 20;
/// HTTP/2 pings on open streams, so that a silent (not closed) connection is found dead. etcd
/// refuses pings more often than every 5 s (`--grpc-keepalive-min-time`).
const HTTP2_PING_INTERVAL: Duration = Duration::from_secs(10);
const HTTP2_PING_TIMEOUT: Duration = Duration::from_secs(5);

/// gRPC status codes that mean "etcd was not reached" rather than "etcd refused": Cancelled,
/// Unknown (a broken connection), DeadlineExceeded and Unavailable.
const UNREACHED_GRPC_CODES: [i32; 4] = [1, 2, 4, 14];

/// Membership, collection definitions and the shard map in etcd. Shared behind an `Arc`; one
/// background task per store follows the state once [`ClusterStore::watch`] is first called,
/// and every `watch()` subscribes to it. Dropping the store stops that task: receivers keep the
/// last state, and their `changed()` ends with an error.
pub struct EtcdStore {
    inner: Arc<Inner>,
    watcher: OnceCell<Watcher>,
}

impl std::fmt::Debug for EtcdStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdStore")
            .field("endpoints", &self.inner.endpoints)
            .field("prefix", &self.inner.prefix)
            .field("connected", &self.connected())
            .finish()
    }
}

/// What the store and its background tasks share.
struct Inner {
    client: EtcdClient,
    /// Ends with `/`.
    prefix: String,
    /// The endpoints as given, comma-separated, for error messages.
    endpoints: String,
    /// Whether the last call, keep-alive or watch step reached etcd.
    connected: AtomicBool,
    /// What this store must keep seeing ([`ClusterStore::guard_history`]), and whether it
    /// stopped doing so.
    history: Mutex<History>,
}

/// The history a node's store must keep: the cluster id it joined and the highest revision it
/// (or its data directory, before this process) saw. etcd restored from an older backup shows
/// a lower revision; etcd wiped or replaced shows no cluster id, or another.
#[derive(Debug, Default)]
struct History {
    /// Set once the node's identity is settled; until then nothing is checked.
    cluster_id: Option<String>,
    /// The highest revision seen.
    floor: i64,
    /// The revision the ledger says this data directory saw (`guard_history`): every read,
    /// whenever sent, must be at or past it.
    guarded_floor: i64,
    /// The newest write seen (the ledger's, then any newer read): it must stay in the store's
    /// history as it was seen ([`Inner::check_witness`]).
    witness: Option<HistoryWitness>,
    /// Set when the store broke that history: the reason. Never cleared in this process.
    fault: Option<String>,
}

impl History {
    /// Keeps `witness` if it is newer than the one kept.
    fn note_witness(&mut self, witness: Option<&HistoryWitness>) {
        if let Some(witness) = witness {
            if self
                .witness
                .as_ref()
                .is_none_or(|w| witness.mod_revision > w.mod_revision)
            {
                self.witness = Some(witness.clone());
            }
        }
    }

    /// Records that the store broke the history (logging it once): the error to return.
    fn fence(&mut self, fault: String) -> ClusterError {
        if self.fault.is_none() {
            tracing::error!(%fault, "THIS NODE IS FENCED: the cluster's store broke its history; \
                it acknowledges no write and changes no shard copy until it is restarted \
                against an etcd that holds its history (see docs/CLUSTER.md, etcd restored \
                from a backup)");
            self.fault = Some(fault);
        }
        ClusterError::HistoryBroken(self.fault.clone().unwrap_or_default())
    }
}

/// The watch task and the channel it publishes on.
struct Watcher {
    tx: Arc<watch::Sender<Arc<ClusterState>>>,
    _task: AbortOnDrop,
}

/// Aborts a background task when dropped.
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl EtcdStore {
    /// Connects to etcd at `endpoints` (`http://host:port`, several for an etcd cluster) and
    /// checks that it answers; the cluster's keys live under `prefix` (a `/` is appended when it
    /// does not end with one). [`ClusterError::StoreUnavailable`] names the endpoints when they
    /// are malformed or etcd does not answer.
    pub async fn connect(endpoints: &[String], prefix: &str) -> Result<EtcdStore> {
        let joined = endpoints.join(",");
        if endpoints.is_empty() {
            return Err(ClusterError::StoreUnavailable(
                "no etcd endpoint given".to_owned(),
            ));
        }
        let options = ConnectOptions {
            connect_timeout: CONNECT_TIMEOUT,
            keep_alive: Some((HTTP2_PING_INTERVAL, HTTP2_PING_TIMEOUT)),
            require_leader: true,
            max_decoding_message_size: MAX_MESSAGE_BYTES,
        };
        let client = EtcdClient::connect(endpoints, &options)
            .map_err(|e| ClusterError::StoreUnavailable(format!("etcd at {joined}: {e}")))?;
        let mut prefix = prefix.to_owned();
        if !prefix.ends_with('/') {
            prefix.push('/');
        }
        let inner = Arc::new(Inner {
            client,
            prefix,
            endpoints: joined,
            connected: AtomicBool::new(false),
            history: Mutex::default(),
        });
        // A cheap read proves that etcd answers (the client itself connects lazily).
        inner
            .call(
                "first contact",
                inner.client.count_prefix(inner.prefix.as_bytes()),
            )
            .await?;
        Ok(EtcdStore {
            inner,
            watcher: OnceCell::new(),
        })
    }

    /// The key prefix, ending with `/`.
    pub fn prefix(&self) -> &str {
        &self.inner.prefix
    }

    /// Campaigns in `election` (under `<prefix>elections/`) as `node_id`, waiting until this
    /// candidate is the leader; one leader at a time, the next one in line takes over when it
    /// resigns, drops its [`Leadership`] or dies (`ELECTION_TTL`, 5 s, later). Cancelling the wait
    /// withdraws the candidacy. [`ClusterError::StoreUnavailable`] if etcd fails meanwhile (then
    /// campaign again).
    pub async fn campaign(&self, election: &str, node_id: &str) -> Result<Leadership> {
        let inner = &self.inner;
        let lease = inner.grant(ttl_seconds(ELECTION_TTL)).await?;
        let guard = LeaseGuard::start(Arc::clone(inner), lease, 0, OnExpiry::GiveUp);
        let name = inner.key(&format!("elections/{election}"));
        // No deadline: etcd answers when this candidate is elected.
        let response = inner
            .client
            .campaign(name.as_bytes(), node_id.as_bytes(), guard.lease.id())
            .await
            .map_err(|e| inner.failed("campaign", &e))?;
        inner.set_connected(true);
        let leader_key = response.leader.ok_or_else(|| {
            ClusterError::StoreUnavailable(format!(
                "etcd at {}: campaign answered without a leader key",
                inner.endpoints
            ))
        })?;
        tracing::info!(election, node_id, "elected");
        Ok(Leadership {
            guard: Some(guard),
            leader_key,
            election: election.to_owned(),
        })
    }
}

#[async_trait::async_trait]
impl ClusterStore for EtcdStore {
    async fn register(&self, node: &NodeInfo, ttl: Duration) -> Result<Registration> {
        let inner = &self.inner;
        let key = inner.key(&format!("nodes/{}", node.node_id));
        // Until when to wait for another process's registration to lapse (set when first seen).
        let mut wait_until: Option<(Instant, Instant)> = None;
        let mut takeovers = 0;
        let (lease, registered_at) = loop {
            if let Some(registered) = register_again(inner, node, ttl).await? {
                break registered;
            }
            // The id is taken: by this data directory's previous process, or by another one?
            let response = inner
                .call(
                    "read the node's registration",
                    inner.client.get(key.as_bytes(), false),
                )
                .await?;
            let Some(holder) = response.kvs.first() else {
                continue; // it lapsed meanwhile
            };
            let info = serde_json::from_slice::<NodeInfo>(&holder.value).ok();
            let address = info.as_ref().map_or("?", |h| h.address.as_str()).to_owned();
            let own = !node.incarnation.is_empty()
                && info
                    .as_ref()
                    .is_some_and(|h| h.incarnation == node.incarnation);
            if own && takeovers < MAX_TAKEOVERS {
                // This process holds the directory's lock, so the registration's process is
                // dead: remove its key (only if it is still the one read) and its lease.
                takeovers += 1;
                let txn = when(
                    vec![modified_at(&key, holder.mod_revision)],
                    vec![delete_op(&key, false)],
                );
                inner
                    .call("take over the registration", inner.client.txn(txn))
                    .await?;
                inner.revoke_quietly(holder.lease).await;
                tracing::warn!(node_id = %node.node_id, old_lease = holder.lease, %address,
                    "this data directory's previous process was still registered (killed before \
                     its lease lapsed): its registration is removed and its lease revoked");
                continue;
            }
            let now = Instant::now();
            let (since, deadline) = match wait_until {
                Some(waiting) => waiting,
                None => {
                    let left = inner
                        .call(
                            "read the holder's lease",
                            inner.client.time_to_live(holder.lease),
                        )
                        .await
                        .map_or(0, |r| r.ttl.max(0));
                    let wait = Duration::from_secs(left.unsigned_abs()) + LAPSE_MARGIN;
                    let holder_kind = if info.is_some_and(|h| !h.incarnation.is_empty()) {
                        "a process with another data directory"
                    } else {
                        "a process that carries no data directory token (an older tarn)"
                    };
                    tracing::warn!(node_id = %node.node_id, %address, wait_s = wait.as_secs(),
                        "node id registered by {holder_kind}; waiting for its lease to lapse \
                         (a dead node's does within its TTL, a live node keeps it)");
                    *wait_until.insert((now, now + wait))
                }
            };
            if now >= deadline {
                return Err(ClusterError::DuplicateNode {
                    node_id: node.node_id.clone(),
                    detail: format!(
                        "registered from {address} by a process with another data directory (or \
                         none), which kept its lease alive while this one waited {:.1} s; stop \
                         it, or give this node another --node-id",
                        (now - since).as_secs_f64()
                    ),
                });
            }
            tokio::time::sleep(RETRY_FIRST * 5).await;
        };
        tracing::info!(node_id = %node.node_id, lease = lease.id, ttl_s = lease.ttl.as_secs(), "registered in etcd");
        let guard = LeaseGuard::start(
            Arc::clone(inner),
            lease,
            registered_at,
            OnExpiry::RegisterAgain(node.clone()),
        );
        let state = Arc::clone(&guard.lease);
        Ok(Registration::new(guard).with_liveness(move || Liveness {
            lease_alive_until: *state.alive_until.lock(),
            registered_at: state.registered_at.load(Ordering::Relaxed),
        }))
    }

    async fn watch(&self) -> Result<watch::Receiver<Arc<ClusterState>>> {
        let watcher = self
            .watcher
            .get_or_try_init(|| async {
                let floor = self.inner.floor();
                let view = self.inner.load().await?;
                self.inner.check_view(&view, floor).await?;
                let (tx, _) = watch::channel(Arc::new(view.state()));
                let tx = Arc::new(tx);
                let task = tokio::spawn(follow_forever(
                    Arc::clone(&self.inner),
                    view,
                    Arc::clone(&tx),
                ));
                Ok::<_, ClusterError>(Watcher {
                    tx,
                    _task: AbortOnDrop(task),
                })
            })
            .await?;
        Ok(watcher.tx.subscribe())
    }

    async fn create_collection(&self, map: &CollectionMap) -> Result<bool> {
        let inner = &self.inner;
        let name = &map.def.name;
        let def_key = inner.key(&format!("collections/{name}"));
        if map.shards.len() != map.def.n_shards as usize {
            // It would never show in the watched state, and would hold the name.
            return Err(ClusterError::BadValue {
                key: def_key,
                reason: format!(
                    "n_shards is {} but {} shard assignments were given",
                    map.def.n_shards,
                    map.shards.len()
                ),
            });
        }
        let mut puts = Vec::with_capacity(1 + map.shards.len());
        puts.push(put_op(&def_key, encode(&def_key, &map.def)?, 0));
        for (shard, assignment) in map.shards.iter().enumerate() {
            let key = inner.shard_key(name, shard as u32);
            let value = encode(&key, assignment)?;
            puts.push(put_op(&key, value, 0));
        }
        let rest = if puts.len() > MAX_TXN_OPS {
            puts.split_off(MAX_TXN_OPS)
        } else {
            Vec::new()
        };
        let txn = when(vec![created_at(&def_key, 0)], puts);
        let response = inner
            .call("create collection", inner.client.txn(txn))
            .await?;
        if !response.succeeded {
            return Ok(false);
        }
        if rest.is_empty() {
            return Ok(true);
        }
        // The definition's revision: the later transactions write only while it is unchanged.
        let def_revision = response.header.map_or(0, |h| h.revision);
        let n_chunks = rest.len().div_ceil(MAX_TXN_OPS);
        for chunk in rest.chunks(MAX_TXN_OPS) {
            let txn = when(vec![modified_at(&def_key, def_revision)], chunk.to_vec());
            let outcome = inner
                .call("create collection (more shards)", inner.client.txn(txn))
                .await;
            match outcome {
                Ok(r) if r.succeeded => {}
                Ok(_) => {
                    return Err(ClusterError::StoreUnavailable(format!(
                        "collection {name:?} was dropped or replaced while its {} shards were \
                         being written in {n_chunks} more transactions",
                        map.shards.len()
                    )))
                }
                Err(e) => {
                    // Best effort: take the half-written collection back, so the name is free.
                    let undo = when(
                        vec![modified_at(&def_key, def_revision)],
                        inner.drop_ops(name),
                    );
                    if let Err(undo_error) = inner
                        .call("undo create collection", inner.client.txn(undo))
                        .await
                    {
                        tracing::warn!(collection = %name, error = %undo_error,
                            "a half-written collection stays invisible until it is dropped");
                    }
                    return Err(e);
                }
            }
        }
        Ok(true)
    }

    async fn drop_collection(&self, name: &str) -> Result<bool> {
        let inner = &self.inner;
        let def_key = inner.key(&format!("collections/{name}"));
        loop {
            let response = inner
                .call(
                    "read collection",
                    inner.client.get(def_key.as_bytes(), false),
                )
                .await?;
            let Some(current) = response.kvs.first() else {
                // No definition: remove any half-written shard keys all the same.
                let txn = when(vec![created_at(&def_key, 0)], inner.drop_ops(name));
                inner.call("drop collection", inner.client.txn(txn)).await?;
                return Ok(false);
            };
            // An unreadable definition is dropped all the same, without a tombstone: its
            // shards' local copies are then set aside rather than deleted.
            let uid = decode::<CollectionDef>(&def_key, &current.value)
                .ok()
                .map(|d| d.uid);
            let mut ops = inner.drop_ops(name);
            if let Some(uid) = uid {
                let tombstone = inner.tombstone_key(name, uid);
                ops.push(put_op(&tombstone, b"{}".to_vec(), 0));
            }
            let txn = when(vec![modified_at(&def_key, current.mod_revision)], ops);
            if inner
                .call("drop collection", inner.client.txn(txn))
                .await?
                .succeeded
            {
                return Ok(true);
            }
            // Replaced meanwhile: drop what is there now.
        }
    }

    async fn compare_and_set_shard(&self, swap: &ShardSwap<'_>) -> Result<bool> {
        let inner = &self.inner;
        let key = inner.shard_key(swap.collection, swap.shard);
        let def_key = inner.key(&format!("collections/{}", swap.collection));
        let node_key = swap
            .unless_registered
            .map(|node_id| inner.key(&format!("nodes/{node_id}")));
        let candidate_key = swap
            .registered
            .map(|(node_id, _)| inner.key(&format!("nodes/{node_id}")));
        // One read of the keys at one revision.
        let mut reads = vec![get_op(&def_key), get_op(&key)];
        reads.extend(node_key.as_deref().map(get_op));
        reads.extend(candidate_key.as_deref().map(get_op));
        let read = when(Vec::new(), reads);
        let response = inner.call("read shard", inner.client.txn(read)).await?;
        let mut found = range_results(&response.responses);
        let (Some(def), Some(current)) = (found.remove(&def_key), found.remove(&key)) else {
            return Ok(false);
        };
        if decode::<CollectionDef>(&def_key, &def.value)?.uid != swap.uid {
            return Ok(false);
        }
        let assignment: ShardAssignment = decode(&key, &current.value)?;
        if assignment.epoch != swap.expected_epoch
            || swap.expected.is_some_and(|e| *e != assignment)
        {
            return Ok(false);
        }
        // etcd compares bytes or revisions, not JSON fields: the write goes through only if
        // both keys are still the ones just read (and, for forget and failover, the node is not
        // registered, or is still registered from the other data directory just read).
        let mut compare = vec![
            modified_at(&def_key, def.mod_revision),
            modified_at(&key, current.mod_revision),
        ];
        if let Some(node_key) = node_key {
            match found.remove(&node_key) {
                None => compare.push(created_at(&node_key, 0)),
                Some(registration) => {
                    let elsewhere = serde_json::from_slice::<NodeInfo>(&registration.value)
                        .is_ok_and(|info| swap.registered_elsewhere(&info));
                    if !elsewhere {
                        return Ok(false);
                    }
                    compare.push(modified_at(&node_key, registration.mod_revision));
                }
            }
        }
        if let Some(candidate_key) = candidate_key {
            // The candidate's registration just read must be the one from its recorded
            // directory, and still be that one when the write lands.
            let Some(registration) = found.remove(&candidate_key) else {
                return Ok(false);
            };
            let holds = serde_json::from_slice::<NodeInfo>(&registration.value)
                .is_ok_and(|info| swap.candidate_holds(&info));
            if !holds {
                return Ok(false);
            }
            compare.push(modified_at(&candidate_key, registration.mod_revision));
        }
        let txn = when(compare, vec![put_op(&key, encode(&key, swap.new)?, 0)]);
        let response = inner.call("set shard", inner.client.txn(txn)).await?;
        Ok(response.succeeded)
    }

    async fn read_shard(&self, collection: &str, uid: u64, shard: u32) -> Result<ShardRecord> {
        let inner = &self.inner;
        let keys = inner.shard_record_keys(collection, uid, shard);
        // etcd's reads are linearizable unless asked to be serializable.
        let read = when(Vec::new(), keys.reads());
        let response = inner.call("read shard", inner.client.txn(read)).await?;
        keys.record(&mut range_results(&response.responses), uid)
    }

    async fn read_copy_evidence(
        &self,
        collection: &str,
        uid: u64,
        shard: u32,
    ) -> Result<CopyEvidence> {
        let inner = &self.inner;
        let keys = inner.shard_record_keys(collection, uid, shard);
        let identity_key = inner.key(IDENTITY_KEY);
        let nodes = inner.key("nodes/");
        let mut reads = keys.reads();
        reads.push(get_op(&identity_key));
        reads.push(RequestOp {
            request: Some(request_op::Request::RequestRange(
                crate::etcd_api::etcdserverpb::RangeRequest {
                    key: nodes.as_bytes().to_vec(),
                    range_end: prefix_end(nodes.as_bytes()),
                    ..Default::default()
                },
            )),
        });
        let response = inner
            .call(
                "read a shard's evidence",
                inner.client.txn(when(Vec::new(), reads)),
            )
            .await?;
        let revision = response.header.as_ref().map_or(0, |h| h.revision);
        let mut found = range_results(&response.responses);
        let cluster_id = match found.remove(&identity_key) {
            Some(kv) => Some(decode::<IdentityRecord>(&identity_key, &kv.value)?.cluster_id),
            None => None,
        };
        let mut registered = BTreeMap::new();
        for (key, kv) in &found {
            if key.starts_with(&nodes) {
                // A registration this tarn cannot read counts as no live copy (never as one).
                if let Ok(info) = serde_json::from_slice::<NodeInfo>(&kv.value) {
                    registered.insert(info.node_id.clone(), info);
                }
            }
        }
        Ok(CopyEvidence {
            record: keys.record(&mut found, uid)?,
            registered,
            revision,
            cluster_id,
        })
    }

    async fn identity(&self) -> Result<StoreIdentity> {
        let inner = &self.inner;
        let key = inner.key(IDENTITY_KEY);
        let response = inner
            .call(
                "read the cluster id",
                inner.client.get(key.as_bytes(), false),
            )
            .await?;
        let identity = match response.kvs.first() {
            Some(kv) => {
                let record = decode::<IdentityRecord>(&key, &kv.value)?;
                Some(ClusterIdentity {
                    cluster_id: record.cluster_id,
                    node_secret: record.node_secret,
                })
            }
            None => None,
        };
        let n_keys = inner
            .call(
                "count the cluster's keys",
                inner.client.count_prefix(inner.prefix.as_bytes()),
            )
            .await?;
        Ok(StoreIdentity {
            holds_state: n_keys > i64::from(identity.is_some()),
            identity,
        })
    }

    async fn create_identity(&self, proposed: &ClusterIdentity) -> Result<ClusterIdentity> {
        let inner = &self.inner;
        let key = inner.key(IDENTITY_KEY);
        let value = encode(
            &key,
            &IdentityRecord {
                cluster_id: proposed.cluster_id.clone(),
                node_secret: proposed.node_secret.clone(),
            },
        )?;
        let txn = when(vec![created_at(&key, 0)], vec![put_op(&key, value, 0)]);
        inner
            .call("create the cluster id", inner.client.txn(txn))
            .await?;
        self.identity()
            .await?
            .identity
            .ok_or_else(|| ClusterError::StoreUnavailable("the cluster id vanished".to_owned()))
    }

    async fn record_move_failure(
        &self,
        collection: &str,
        shard: u32,
        failure: Option<&MoveFailure>,
    ) -> Result<()> {
        let inner = &self.inner;
        let key = inner.key(&format!("moves/{collection}/{shard:05}"));
        match failure {
            Some(failure) => {
                let value = encode(&key, failure)?;
                inner
                    .call(
                        "record a failed move",
                        inner.client.put(key.as_bytes(), &value, 0),
                    )
                    .await?;
            }
            None => {
                inner
                    .call(
                        "clear a failed move",
                        inner.client.delete(key.as_bytes(), false),
                    )
                    .await?;
            }
        }
        Ok(())
    }

    async fn set_draining(&self, node_id: &str, draining: bool) -> Result<()> {
        let inner = &self.inner;
        let key = inner.key(&format!("draining/{node_id}"));
        if draining {
            inner
                .call("mark draining", inner.client.put(key.as_bytes(), b"{}", 0))
                .await?;
        } else {
            inner
                .call("clear draining", inner.client.delete(key.as_bytes(), false))
                .await?;
        }
        Ok(())
    }

    async fn campaign(&self, election: &str, node_id: &str) -> Result<crate::store::Leader> {
        let leadership = EtcdStore::campaign(self, election, node_id).await?;
        Ok(crate::store::Leader::new(move || leadership.is_leader()))
    }

    fn connected(&self) -> bool {
        self.inner.connected.load(Ordering::Relaxed)
    }

    fn guard_history(&self, cluster_id: &str, floor: i64, witness: Option<HistoryWitness>) {
        let mut history = self.inner.history.lock();
        history.cluster_id = Some(cluster_id.to_owned());
        history.floor = history.floor.max(floor);
        history.guarded_floor = history.guarded_floor.max(floor);
        history.note_witness(witness.as_ref());
    }

    fn history_fault(&self) -> Option<String> {
        self.inner.history.lock().fault.clone()
    }
}

impl Inner {
    /// The highest revision this node has seen so far: taken before a read is sent, and
    /// passed to [`Inner::check_history`] with its answer.
    fn floor(&self) -> i64 {
        self.history.lock().floor
    }

    /// Checks a state read at `revision`, holding the cluster id `cluster_id`, against the
    /// history this store must keep; records the fault (and logs it once) if it breaks it.
    /// `floor_then` is [`Inner::floor`] when the read was sent: a read sent before a later
    /// revision was seen elsewhere (a watch event, another read answered first) may rightly
    /// answer at a lower one, so only what was seen before it counts.
    fn check_history(
        &self,
        revision: i64,
        cluster_id: Option<&str>,
        witness: Option<&HistoryWitness>,
        floor_then: i64,
    ) -> Result<()> {
        let mut history = self.history.lock();
        let floor_then = floor_then.max(history.guarded_floor);
        if let Some(fault) = &history.fault {
            return Err(ClusterError::HistoryBroken(fault.clone()));
        }
        let Some(expected) = history.cluster_id.clone() else {
            return Ok(());
        };
        let fault = if cluster_id != Some(expected.as_str()) {
            Some(match cluster_id {
                None => format!(
                    "etcd at {} holds no cluster id (wiped, or replaced by an empty etcd, under \
                     this running node; cluster {expected})",
                    self.endpoints
                ),
                Some(other) => format!(
                    "etcd at {} holds cluster id {other}, not {expected} (replaced by another \
                     cluster's etcd under this running node)",
                    self.endpoints
                ),
            })
        } else if revision < floor_then {
            Some(format!(
                "etcd at {} went back in time: its revision {revision} is behind revision \
                 {floor_then} that this node saw (restored from an older backup?)",
                self.endpoints
            ))
        } else {
            history.floor = history.floor.max(revision);
            history.note_witness(witness);
            None
        };
        match fault {
            None => Ok(()),
            Some(fault) => Err(history.fence(fault)),
        }
    }

    /// Checks a view just read (whole) against the history this store must keep, then keeps
    /// its newest write as the witness to check later reads against.
    async fn check_view(&self, view: &View, floor_then: i64) -> Result<()> {
        self.check_history(view.revision, view.cluster_id.as_deref(), None, floor_then)?;
        self.check_witness().await?;
        self.history.lock().note_witness(view.witness.as_ref());
        Ok(())
    }

    /// Checks that the newest write this node saw ([`History::witness`]) is in the store's
    /// history as it was seen: read at its revision, its key holds the same value written at
    /// that revision. An etcd restored from an older backup and written to since shows a
    /// revision past the node's, so only this tells it apart. Where the store compacted its
    /// history past the witness, the key's current version is judged instead: one written
    /// before the witness's revision, or at it with another value, breaks the history; a later
    /// one cannot be judged (the revision check stays).
    async fn check_witness(&self) -> Result<()> {
        let Some(witness) = self.history.lock().witness.clone() else {
            return Ok(());
        };
        let read = |revision: i64| {
            let request = RangeRequest {
                key: witness.key.as_bytes().to_vec(),
                revision,
                ..RangeRequest::default()
            };
            tokio::time::timeout(REQUEST_TIMEOUT, self.client.range(request))
        };
        let found = match read(witness.mod_revision).await {
            Ok(Ok(response)) => response.kvs.into_iter().next(),
            Ok(Err(status)) if status.code() == tonic::Code::OutOfRange => {
                // Compacted past the witness: the key as it is now.
                let now = self
                    .call(
                        "read the witness key",
                        self.client.get(witness.key.as_bytes(), false),
                    )
                    .await?;
                match now.kvs.into_iter().next() {
                    Some(kv) if kv.mod_revision > witness.mod_revision => return Ok(()),
                    Some(kv) => Some(kv),
                    None => return Ok(()),
                }
            }
            Ok(Err(status)) => return Err(self.failed("read the witness key", &status)),
            Err(_) => {
                self.set_connected(false);
                return Err(ClusterError::StoreUnavailable(format!(
                    "etcd at {}: read the witness key: no answer in {REQUEST_TIMEOUT:?}",
                    self.endpoints
                )));
            }
        };
        let same = found
            .as_ref()
            .is_some_and(|kv| HistoryWitness::of(&kv.key, &kv.value, kv.mod_revision) == witness);
        if same {
            return Ok(());
        }
        let there = match &found {
            Some(kv) => format!("a value written at revision {}", kv.mod_revision),
            None => "no such key".to_owned(),
        };
        let fault = format!(
            "etcd at {} holds another history: this node saw {} written at revision {}, and \
             etcd's history at that revision has {there} (restored from an older backup, and \
             written to since?)",
            self.endpoints, witness.key, witness.mod_revision
        );
        Err(self.history.lock().fence(fault))
    }

    /// The cluster id and the revision etcd holds now, read linearizably.
    async fn current_identity(&self) -> Result<(Option<String>, i64)> {
        let key = self.key(IDENTITY_KEY);
        let response = self
            .call(
                "read the cluster id",
                self.client.get(key.as_bytes(), false),
            )
            .await?;
        let revision = response.header.as_ref().map_or(0, |h| h.revision);
        let cluster_id = match response.kvs.first() {
            Some(kv) => Some(decode::<IdentityRecord>(&key, &kv.value)?.cluster_id),
            None => None,
        };
        Ok((cluster_id, revision))
    }

    fn key(&self, relative: &str) -> String {
        format!("{}{relative}", self.prefix)
    }

    fn shard_key(&self, collection: &str, shard: u32) -> String {
        self.key(&format!("shards/{collection}/{shard:05}"))
    }

    fn tombstone_key(&self, collection: &str, uid: u64) -> String {
        self.key(&format!("dropped/{collection}/{uid:016x}"))
    }

    fn shard_record_keys(&self, collection: &str, uid: u64, shard: u32) -> ShardRecordKeys {
        ShardRecordKeys {
            tombstone: self.tombstone_key(collection, uid),
            def: self.key(&format!("collections/{collection}")),
            shard: self.shard_key(collection, shard),
        }
    }

    fn set_connected(&self, connected: bool) {
        self.connected.store(connected, Ordering::Relaxed);
    }

    /// The error of a failed call, noting whether etcd was reached at all.
    fn failed(&self, what: &str, error: &tonic::Status) -> ClusterError {
        let unreached = UNREACHED_GRPC_CODES.contains(&i32::from(error.code()));
        self.set_connected(!unreached);
        ClusterError::StoreUnavailable(format!(
            "etcd at {}: {what}: {}: {}",
            self.endpoints,
            error.code(),
            error.message()
        ))
    }

    /// Runs one etcd request under [`REQUEST_TIMEOUT`], keeping `connected` up to date.
    async fn call<T>(
        &self,
        what: &str,
        request: impl Future<Output = std::result::Result<T, tonic::Status>>,
    ) -> Result<T> {
        match tokio::time::timeout(REQUEST_TIMEOUT, request).await {
            Ok(Ok(value)) => {
                self.set_connected(true);
                Ok(value)
            }
            Ok(Err(e)) => Err(self.failed(what, &e)),
            Err(_) => {
                self.set_connected(false);
                Err(ClusterError::StoreUnavailable(format!(
                    "etcd at {}: {what}: no answer in {REQUEST_TIMEOUT:?}",
                    self.endpoints
                )))
            }
        }
    }

    /// Grants a lease of `ttl_s` seconds (etcd may grant a longer one: it has a minimum).
    async fn grant(&self, ttl_s: i64) -> Result<Lease> {
        let asked_at = Instant::now();
        let response = self.call("grant lease", self.client.grant(ttl_s)).await?;
        let ttl = Duration::from_secs(response.ttl.max(1).unsigned_abs());
        Ok(Lease {
            id: response.id,
            ttl,
            asked_at,
        })
    }

    /// Revokes a lease, logging (not returning) a failure: the lease lapses on its own anyway.
    async fn revoke_quietly(&self, lease: i64) {
        if let Err(e) = self.call("revoke lease", self.client.revoke(lease)).await {
            tracing::debug!(lease, error = %e, "lease not revoked; it will lapse");
        }
    }

    /// Creates `nodes/<id>` under `lease` unless the key exists: the revision it was created
    /// at, or `None` if it exists.
    async fn create_node_key(&self, node: &NodeInfo, lease: i64) -> Result<Option<i64>> {
        let key = self.key(&format!("nodes/{}", node.node_id));
        let value = encode(&key, node)?;
        let txn = when(vec![created_at(&key, 0)], vec![put_op(&key, value, lease)]);
        let response = self.call("register node", self.client.txn(txn)).await?;
        Ok(response
            .succeeded
            .then(|| response.header.map_or(0, |h| h.revision)))
    }

    /// The operations that delete a collection: its definition first, then its shard keys. The
    /// trailing slash keeps `shards/docs/` from matching `shards/docs2/`.
    fn drop_ops(&self, name: &str) -> Vec<RequestOp> {
        vec![
            delete_op(&self.key(&format!("collections/{name}")), false),
            delete_op(&self.key(&format!("shards/{name}/")), true),
            delete_op(&self.key(&format!("moves/{name}/")), true),
        ]
    }

    /// Reads the whole prefix in one range read.
    async fn load(&self) -> Result<View> {
        let response = self
            .call(
                "read the cluster state",
                self.client.get(self.prefix.as_bytes(), true),
            )
            .await?;
        let mut view = View {
            revision: response.header.map_or(0, |h| h.revision),
            ..View::default()
        };
        for kv in &response.kvs {
            view.put(&self.prefix, &kv.key, &kv.value, kv.mod_revision);
        }
        Ok(view)
    }
}

/// The keys a shard's record is read from: the collection's tombstone, definition and the
/// shard's assignment.
struct ShardRecordKeys {
    tombstone: String,
    def: String,
    shard: String,
}

impl ShardRecordKeys {
    fn reads(&self) -> Vec<RequestOp> {
        vec![
            get_op(&self.tombstone),
            get_op(&self.def),
            get_op(&self.shard),
        ]
    }

    /// The record those reads found (they are taken out of `found`).
    fn record(
        &self,
        found: &mut BTreeMap<String, crate::etcd_api::etcdserverpb::KeyValue>,
        uid: u64,
    ) -> Result<ShardRecord> {
        if found.remove(&self.tombstone).is_some() {
            return Ok(ShardRecord::Dropped);
        }
        let Some(def) = found.remove(&self.def) else {
            return Ok(ShardRecord::Unknown);
        };
        if decode::<CollectionDef>(&self.def, &def.value)?.uid != uid {
            return Ok(ShardRecord::Unknown);
        }
        match found.remove(&self.shard) {
            Some(kv) => Ok(ShardRecord::Assigned(decode(&self.shard, &kv.value)?)),
            None => Ok(ShardRecord::Unknown),
        }
    }
}

/// A transaction: `then` if every comparison holds (no comparison: always).
fn when(compare: Vec<Compare>, then: Vec<RequestOp>) -> TxnRequest {
    TxnRequest {
        compare,
        success: then,
        failure: Vec::new(),
    }
}

/// Holds if `key` was created at `revision` (0: the key does not exist).
fn created_at(key: &str, revision: i64) -> Compare {
    revision_equals(
        key,
        compare::CompareTarget::Create,
        compare::TargetUnion::CreateRevision(revision),
    )
}

/// Holds if `key` was last written at `revision`.
fn modified_at(key: &str, revision: i64) -> Compare {
    revision_equals(
        key,
        compare::CompareTarget::Mod,
        compare::TargetUnion::ModRevision(revision),
    )
}

/// Holds if `key`'s revision of kind `target` equals `value`.
fn revision_equals(
    key: &str,
    target: compare::CompareTarget,
    value: compare::TargetUnion,
) -> Compare {
    Compare {
        result: compare::CompareResult::Equal.into(),
        target: target.into(),
        key: key.as_bytes().to_vec(),
        target_union: Some(value),
        range_end: Vec::new(),
    }
}

/// Reads `key`.
fn get_op(key: &str) -> RequestOp {
    RequestOp {
        request: Some(request_op::Request::RequestRange(
            crate::etcd_api::etcdserverpb::RangeRequest {
                key: key.as_bytes().to_vec(),
                ..Default::default()
            },
        )),
    }
}

/// The keys a transaction's reads found, by key.
fn range_results(
    responses: &[crate::etcd_api::etcdserverpb::ResponseOp],
) -> BTreeMap<String, crate::etcd_api::etcdserverpb::KeyValue> {
    responses
        .iter()
        .filter_map(|r| match &r.response {
            Some(response_op::Response::ResponseRange(range)) => Some(range.kvs.iter()),
            _ => None,
        })
        .flatten()
        .map(|kv| (String::from_utf8_lossy(&kv.key).into_owned(), kv.clone()))
        .collect()
}

/// Writes `key`, attached to `lease` unless it is 0.
fn put_op(key: &str, value: Vec<u8>, lease: i64) -> RequestOp {
    RequestOp {
        request: Some(request_op::Request::RequestPut(
            crate::etcd_api::etcdserverpb::PutRequest {
                key: key.as_bytes().to_vec(),
                value,
                lease,
            },
        )),
    }
}

/// Deletes `key`, or with `prefix` every key starting with it.
fn delete_op(key: &str, prefix: bool) -> RequestOp {
    RequestOp {
        request: Some(request_op::Request::RequestDeleteRange(delete_request(
            key.as_bytes(),
            prefix,
        ))),
    }
}

/// Serialises a value for `key`.
fn encode(key: &str, value: &impl serde::Serialize) -> Result<Vec<u8>> {
    serde_json::to_vec(value).map_err(|e| ClusterError::BadValue {
        key: key.to_owned(),
        reason: e.to_string(),
    })
}

/// Deserialises the value found at `key`.
fn decode<T: serde::de::DeserializeOwned>(key: &str, bytes: &[u8]) -> Result<T> {
    serde_json::from_slice(bytes).map_err(|e| ClusterError::BadValue {
        key: key.to_owned(),
        reason: e.to_string(),
    })
}

/// A lease's TTL in whole seconds, rounded up, at least 1.
fn ttl_seconds(ttl: Duration) -> i64 {
    i64::try_from(ttl.as_millis().div_ceil(1000).max(1)).unwrap_or(i64::MAX)
}

/// A granted lease.
#[derive(Debug, Clone, Copy)]
struct Lease {
    id: i64,
    /// As granted (etcd has a minimum, 2 s with its default election timeout).
    ttl: Duration,
    /// When the grant was asked for: the lease surely lives until `asked_at + ttl`.
    asked_at: Instant,
}

/// Doubling waits between attempts, from [`RETRY_FIRST`] to [`RETRY_MAX`].
struct Backoff {
    next: Duration,
}

impl Backoff {
    fn new() -> Backoff {
        Backoff { next: RETRY_FIRST }
    }

    fn reset(&mut self) {
        self.next = RETRY_FIRST;
    }

    async fn wait(&mut self) {
        tokio::time::sleep(self.next).await;
        self.next = (self.next * 2).min(RETRY_MAX);
    }
}

// ---------------------------------------------------------------------------------------------
// Leases: membership and candidacy.

/// What a keep-alive task does when it finds its lease expired (etcd was out of reach for longer
/// than the TTL, or someone revoked it).
enum OnExpiry {
    /// Registers the node again under a new lease, if its id is still free.
    RegisterAgain(NodeInfo),
    /// Stops: the leadership that hung on the lease is lost.
    GiveUp,
}

/// A lease kept alive by a background task, as the task last saw it.
struct LeaseState {
    /// The current lease (a new one after registering again).
    id: AtomicI64,
    /// Until when the lease is surely alive: the send time of the last answered keep-alive plus
    /// the TTL.
    alive_until: Mutex<Instant>,
    /// The lease expired and the task gave up ([`OnExpiry::GiveUp`]).
    lost: AtomicBool,
    /// The revision of the registration made under the current lease (0 for a candidacy).
    registered_at: AtomicI64,
}

impl LeaseState {
    fn id(&self) -> i64 {
        self.id.load(Ordering::Relaxed)
    }
}

/// Owns a keep-alive task; on drop, stops it and revokes the lease (best effort, in a spawned
/// task; without a runtime the lease simply lapses, as when the process dies).
struct LeaseGuard {
    inner: Arc<Inner>,
    lease: Arc<LeaseState>,
    task: JoinHandle<()>,
    /// False once [`LeaseGuard::revoke`] has done it.
    revoke_on_drop: bool,
}

impl LeaseGuard {
    fn start(
        inner: Arc<Inner>,
        lease: Lease,
        registered_at: i64,
        on_expiry: OnExpiry,
    ) -> LeaseGuard {
        let state = Arc::new(LeaseState {
            id: AtomicI64::new(lease.id),
            alive_until: Mutex::new(lease.asked_at + lease.ttl),
            lost: AtomicBool::new(false),
            registered_at: AtomicI64::new(registered_at),
        });
        let task = tokio::spawn(keep_alive_forever(
            Arc::clone(&inner),
            Arc::clone(&state),
            lease.ttl,
            on_expiry,
        ));
        LeaseGuard {
            inner,
            lease: state,
            task,
            revoke_on_drop: true,
        }
    }

    /// Stops the keep-alive task and revokes the lease, waiting for etcd's answer.
    async fn revoke(mut self) {
        self.task.abort();
        self.revoke_on_drop = false;
        self.inner.revoke_quietly(self.lease.id()).await;
    }
}

impl Drop for LeaseGuard {
    fn drop(&mut self) {
        self.task.abort();
        if !self.revoke_on_drop {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let inner = Arc::clone(&self.inner);
        let lease = self.lease.id();
        runtime.spawn(async move { inner.revoke_quietly(lease).await });
    }
}

/// How one keep-alive stream ended.
enum KeepAliveEnd {
    /// etcd says the lease does not exist (any more).
    Expired,
    /// etcd could not be reached, or the stream broke.
    Broken(String),
}

/// Keeps a lease alive for as long as the task runs: keep-alives every TTL/3 on one stream,
/// a new stream after a failure (with backoff), and [`OnExpiry`] when the lease is found gone.
async fn keep_alive_forever(
    inner: Arc<Inner>,
    lease: Arc<LeaseState>,
    ttl: Duration,
    on_expiry: OnExpiry,
) {
    let mut backoff = Backoff::new();
    loop {
        match keep_alive_stream(&inner, &lease, ttl, &mut backoff).await {
            KeepAliveEnd::Broken(reason) => {
                inner.set_connected(false);
                tracing::warn!(lease = lease.id(), %reason, "lease keep-alive failed; retrying");
                backoff.wait().await;
            }
            KeepAliveEnd::Expired => match &on_expiry {
                OnExpiry::GiveUp => {
                    tracing::warn!(lease = lease.id(), "lease expired; leadership lost");
                    lease.lost.store(true, Ordering::Relaxed);
                    return;
                }
                OnExpiry::RegisterAgain(node) => {
                    tracing::warn!(node_id = %node.node_id, "membership lease expired; registering again");
                    match register_again(&inner, node, ttl).await {
                        Ok(Some((new, revision))) => {
                            // The registration's revision first: a view older than it must
                            // never pair with the new lease's liveness (writable()).
                            lease.registered_at.store(revision, Ordering::Relaxed);
                            lease.id.store(new.id, Ordering::Relaxed);
                            *lease.alive_until.lock() = new.asked_at + new.ttl;
                            tracing::info!(node_id = %node.node_id, lease = new.id, "registered again");
                            backoff.reset();
                        }
                        Ok(None) => {
                            tracing::error!(node_id = %node.node_id,
                                "THIS NODE IS OUT OF THE CLUSTER: its lease expired and another \
                                 live node registered the same node id meanwhile; retrying until \
                                 the id is free");
                            tokio::time::sleep(ttl.max(RETRY_MAX)).await;
                        }
                        Err(e) => {
                            tracing::warn!(node_id = %node.node_id, error = %e,
                                "registering again failed; retrying");
                            backoff.wait().await;
                        }
                    }
                }
            },
        }
    }
}

/// Registers `node` under a new lease: the lease and the registration's revision; `None` (the
/// lease revoked) if its id is taken.
async fn register_again(
    inner: &Inner,
    node: &NodeInfo,
    ttl: Duration,
) -> Result<Option<(Lease, i64)>> {
    // Never register into an etcd that lost this cluster's history (wiped, replaced, or
    // restored from an older backup): the node stays out, fenced, instead.
    let floor = inner.floor();
    let (cluster_id, revision) = inner.current_identity().await?;
    inner.check_history(revision, cluster_id.as_deref(), None, floor)?;
    inner.check_witness().await?;
    let lease = inner.grant(ttl_seconds(ttl)).await?;
    match inner.create_node_key(node, lease.id).await {
        Ok(Some(revision)) => Ok(Some((lease, revision))),
        Ok(None) => {
            inner.revoke_quietly(lease.id).await;
            Ok(None)
        }
        Err(e) => {
            inner.revoke_quietly(lease.id).await;
            Err(e)
        }
    }
}

/// One keep-alive stream, until it breaks or finds the lease expired.
async fn keep_alive_stream(
    inner: &Inner,
    lease: &LeaseState,
    ttl: Duration,
    backoff: &mut Backoff,
) -> KeepAliveEnd {
    let id = lease.id();
    // Opening the stream sends a first keep-alive; its answer says whether the lease lives.
    let sent_at = Instant::now();
    let opened = tokio::time::timeout(REQUEST_TIMEOUT, async {
        let mut keeper = inner.client.keep_alive(id).await?;
        let first = keeper.answer().await?;
        Ok::<_, tonic::Status>((keeper, first))
    })
    .await;
    let (mut keeper, granted) = match opened {
        Ok(Ok((keeper, Some(answer)))) if answer.ttl > 0 => (keeper, answer.ttl),
        Ok(Ok((_, Some(_)))) => {
            inner.set_connected(true);
            return KeepAliveEnd::Expired;
        }
        Ok(Ok((_, None))) => return KeepAliveEnd::Broken("keep-alive stream closed".to_owned()),
        Ok(Err(e)) => return KeepAliveEnd::Broken(e.to_string()),
        Err(_) => return KeepAliveEnd::Broken(format!("no answer in {REQUEST_TIMEOUT:?}")),
    };
    *lease.alive_until.lock() = sent_at + Duration::from_secs(granted.unsigned_abs()).min(ttl);
    inner.set_connected(true);
    backoff.reset();
    let period = (ttl / 3).max(Duration::from_millis(100));
    let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        let sent_at = Instant::now();
        if let Err(e) = keeper.renew().await {
            return KeepAliveEnd::Broken(e.to_string());
        }
        match tokio::time::timeout(period.max(Duration::from_secs(1)), keeper.answer()).await {
            Ok(Ok(Some(answer))) if answer.ttl <= 0 => return KeepAliveEnd::Expired,
            Ok(Ok(Some(answer))) => {
                let granted = Duration::from_secs(answer.ttl.unsigned_abs());
                *lease.alive_until.lock() = sent_at + granted;
                inner.set_connected(true);
            }
            Ok(Ok(None)) => return KeepAliveEnd::Broken("keep-alive stream closed".to_owned()),
            Ok(Err(e)) => return KeepAliveEnd::Broken(e.to_string()),
            Err(_) => return KeepAliveEnd::Broken("keep-alive not answered".to_owned()),
        }
    }
}

/// Leadership in an etcd election, won by [`EtcdStore::campaign`]. Dropping it resigns (the
/// candidacy's lease is revoked, so the next candidate is elected at once); a process that dies
/// is replaced once its lease lapses (`ELECTION_TTL`, 5 s).
pub struct Leadership {
    /// `None` once resigned.
    guard: Option<LeaseGuard>,
    leader_key: LeaderKey,
    election: String,
}

impl std::fmt::Debug for Leadership {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Leadership")
            .field("election", &self.election)
            .field("is_leader", &self.is_leader())
            .finish()
    }
}

impl Leadership {
    /// Whether this is still surely the leader: its lease was confirmed alive by etcd less than
    /// a TTL ago (counted from when the confirmed keep-alive was sent) and has not been found
    /// expired. Check it before each act of leadership; false is final once the lease has been
    /// found expired, and may turn true again after an etcd outage shorter than the TTL.
    pub fn is_leader(&self) -> bool {
        self.guard.as_ref().is_some_and(|guard| {
            !guard.lease.lost.load(Ordering::Relaxed)
                && Instant::now() < *guard.lease.alive_until.lock()
        })
    }

    /// The election this leadership is in.
    pub fn election(&self) -> &str {
        &self.election
    }

    /// Resigns now and waits for etcd to take it (the next candidate is elected). Errors are
    /// logged, not returned: the lease lapses on its own anyway.
    pub async fn resign(mut self) {
        let Some(guard) = self.guard.take() else {
            return;
        };
        let inner = Arc::clone(&guard.inner);
        let resigned = inner.client.resign(self.leader_key.clone());
        if let Err(e) = inner.call("resign", resigned).await {
            tracing::debug!(election = %self.election, error = %e, "resign failed; revoking the lease");
        }
        guard.revoke().await;
    }
}

// ---------------------------------------------------------------------------------------------
// Following the state.

/// The state as read from the keys, before it is assembled into a [`ClusterState`].
#[derive(Debug, Default)]
struct View {
    revision: i64,
    nodes: BTreeMap<String, NodeInfo>,
    defs: BTreeMap<String, CollectionDef>,
    shards: BTreeMap<String, BTreeMap<u32, ShardAssignment>>,
    draining: std::collections::BTreeSet<String>,
    move_failures: BTreeMap<(String, u32), MoveFailure>,
    /// Collection records that did not decode, by key: the collection's name and why.
    unreadable: BTreeMap<String, (String, String)>,
    /// The cluster id under the prefix (`None`: none, or it did not decode).
    cluster_id: Option<String>,
    /// The revision each live node's registration was written at.
    registered_at: BTreeMap<String, i64>,
    /// The newest write under the prefix.
    witness: Option<HistoryWitness>,
}

/// What a key under the prefix is.
enum KeyKind<'a> {
    Node(&'a str),
    Collection(&'a str),
    Shard(&'a str, u32),
    Draining(&'a str),
    MoveFailure(&'a str, u32),
    /// The cluster's identity.
    Identity,
    /// Election keys, and anything a newer tarn may add.
    Other,
}

fn key_kind<'a>(prefix: &str, key: &'a [u8]) -> KeyKind<'a> {
    let Some(relative) = std::str::from_utf8(key)
        .ok()
        .and_then(|k| k.strip_prefix(prefix))
    else {
        return KeyKind::Other;
    };
    if relative == IDENTITY_KEY {
        return KeyKind::Identity;
    }
    if let Some(id) = relative.strip_prefix("nodes/") {
        return KeyKind::Node(id);
    }
    if let Some(name) = relative.strip_prefix("collections/") {
        return KeyKind::Collection(name);
    }
    if let Some(id) = relative.strip_prefix("draining/") {
        return KeyKind::Draining(id);
    }
    if let Some((name, shard)) = relative
        .strip_prefix("moves/")
        .and_then(|rest| rest.rsplit_once('/'))
    {
        if let Ok(shard) = shard.parse() {
            return KeyKind::MoveFailure(name, shard);
        }
    }
    if let Some((name, shard)) = relative
        .strip_prefix("shards/")
        .and_then(|rest| rest.rsplit_once('/'))
    {
        if let Ok(shard) = shard.parse() {
            return KeyKind::Shard(name, shard);
        }
    }
    KeyKind::Other
}

impl View {
    /// Applies a key's new value. A node or draining value that does not decode is logged and
    /// counts as absent; a collection's definition or shard record that does not decode makes
    /// the collection unreadable (never absent: absent would let nodes act on its shards).
    /// Takes `key`'s new `value`, written at `revision`.
    fn put(&mut self, prefix: &str, key: &[u8], value: &[u8], revision: i64) {
        // A witness is read back by its key: only a key that is text can be.
        if std::str::from_utf8(key).is_ok()
            && self
                .witness
                .as_ref()
                .is_none_or(|w| revision > w.mod_revision)
        {
            self.witness = Some(HistoryWitness::of(key, value, revision));
        }
        let key_text = String::from_utf8_lossy(key);
        self.unreadable.remove(key_text.as_ref());
        let kind = key_kind(prefix, key);
        let collection = match kind {
            KeyKind::Collection(name) | KeyKind::Shard(name, _) => Some(name.to_owned()),
            _ => None,
        };
        let outcome = match kind {
            KeyKind::Node(id) => decode::<NodeInfo>(&key_text, value).map(|node| {
                self.nodes.insert(id.to_owned(), node);
                self.registered_at.insert(id.to_owned(), revision);
            }),
            KeyKind::Collection(name) => decode::<CollectionDef>(&key_text, value).map(|def| {
                self.defs.insert(name.to_owned(), def);
            }),
            KeyKind::Shard(name, shard) => {
                decode::<ShardAssignment>(&key_text, value).map(|assignment| {
                    self.shards
                        .entry(name.to_owned())
                        .or_default()
                        .insert(shard, assignment);
                })
            }
            KeyKind::Draining(id) => {
                self.draining.insert(id.to_owned());
                Ok(())
            }
            KeyKind::MoveFailure(name, shard) => {
                decode::<MoveFailure>(&key_text, value).map(|failure| {
                    self.move_failures.insert((name.to_owned(), shard), failure);
                })
            }
            KeyKind::Identity => decode::<IdentityRecord>(&key_text, value).map(|identity| {
                self.cluster_id = Some(identity.cluster_id);
            }),
            KeyKind::Other => Ok(()),
        };
        if let Err(e) = outcome {
            self.delete(prefix, key);
            match collection {
                Some(name) => {
                    tracing::error!(error = %e, collection = %name,
                        "a collection record tarn cannot read: the collection is unavailable \
                         here, and its local shards are left as they are");
                    self.unreadable
                        .insert(key_text.into_owned(), (name, e.to_string()));
                }
                None => tracing::error!(error = %e, "ignoring a value tarn cannot read"),
            }
        }
    }

    fn delete(&mut self, prefix: &str, key: &[u8]) {
        self.unreadable
            .remove(String::from_utf8_lossy(key).as_ref());
        match key_kind(prefix, key) {
            KeyKind::Node(id) => {
                self.nodes.remove(id);
                self.registered_at.remove(id);
            }
            KeyKind::Collection(name) => {
                self.defs.remove(name);
            }
            KeyKind::Shard(name, shard) => {
                if let Some(shards) = self.shards.get_mut(name) {
                    shards.remove(&shard);
                    if shards.is_empty() {
                        self.shards.remove(name);
                    }
                }
            }
            KeyKind::Draining(id) => {
                self.draining.remove(id);
            }
            KeyKind::MoveFailure(name, shard) => {
                self.move_failures.remove(&(name.to_owned(), shard));
            }
            KeyKind::Identity => self.cluster_id = None,
            KeyKind::Other => {}
        }
    }

    /// The state: every node, and every collection whose definition and shards are all there.
    fn state(&self) -> ClusterState {
        let unreadable: BTreeMap<String, String> = self
            .unreadable
            .iter()
            .map(|(key, (name, why))| (name.clone(), format!("{key}: {why}")))
            .collect();
        let mut collections = BTreeMap::new();
        for (name, def) in &self.defs {
            if unreadable.contains_key(name) {
                continue;
            }
            let complete = self.shards.get(name).and_then(|shards| {
                (0..def.n_shards)
                    .map(|shard| shards.get(&shard).cloned())
                    .collect::<Option<Vec<_>>>()
            });
            if let Some(shards) = complete {
                collections.insert(
                    name.clone(),
                    CollectionMap {
                        def: def.clone(),
                        shards,
                    },
                );
            }
        }
        ClusterState {
            revision: self.revision,
            witness: self.witness.clone(),
            nodes: self.nodes.clone(),
            registered_at: self.registered_at.clone(),
            collections,
            draining: self.draining.clone(),
            unreadable,
            move_failures: self.move_failures.clone(),
        }
    }
}

/// Publishes the view's state if it differs from the last one published.
fn publish(tx: &watch::Sender<Arc<ClusterState>>, view: &View) {
    let state = view.state();
    tx.send_if_modified(|current| {
        if **current == state {
            return false;
        }
        *current = Arc::new(state);
        true
    });
}

/// The watch task: follows the prefix from the view's revision; when the watch breaks, keeps the
/// last state published, retries with backoff, reloads the whole prefix and follows again.
async fn follow_forever(
    inner: Arc<Inner>,
    mut view: View,
    tx: Arc<watch::Sender<Arc<ClusterState>>>,
) {
    let mut backoff = Backoff::new();
    loop {
        let reason = follow(&inner, &mut view, &tx, &mut backoff).await;
        inner.set_connected(false);
        tracing::warn!(%reason, revision = view.revision,
            "etcd watch broken; keeping the last cluster state and retrying");
        loop {
            backoff.wait().await;
            let floor = inner.floor();
            match inner.load().await {
                Ok(reloaded) => {
                    match inner.check_view(&reloaded, floor).await {
                        Ok(()) => {}
                        // Fenced: the last state stays published, and nothing follows.
                        Err(ClusterError::HistoryBroken(_)) => return,
                        Err(e) => {
                            tracing::debug!(error = %e, "etcd still unreachable");
                            continue;
                        }
                    }
                    view = reloaded;
                    publish(&tx, &view);
                    tracing::info!(revision = view.revision, "etcd watch: state reloaded");
                    break;
                }
                Err(e) => tracing::debug!(error = %e, "etcd still unreachable"),
            }
        }
    }
}

/// Follows the prefix from `view.revision + 1` until the watch breaks; says why it did.
async fn follow(
    inner: &Inner,
    view: &mut View,
    tx: &watch::Sender<Arc<ClusterState>>,
    backoff: &mut Backoff,
) -> String {
    // The stream's events come in revision order from where the view was read (checked
    // then): they are held to what was seen before the stream opened.
    let floor = inner.floor();
    let create = WatchCreateRequest {
        key: inner.prefix.as_bytes().to_vec(),
        range_end: prefix_end(inner.prefix.as_bytes()),
        start_revision: view.revision + 1,
        ..WatchCreateRequest::default()
    };
    let mut stream = match tokio::time::timeout(REQUEST_TIMEOUT, inner.client.watch(create)).await {
        Ok(Ok(stream)) => stream,
        Ok(Err(e)) => return format!("cannot start the watch: {e}"),
        Err(_) => return format!("cannot start the watch: no answer in {REQUEST_TIMEOUT:?}"),
    };
    loop {
        let response = match stream.message().await {
            Ok(Some(response)) => response,
            Ok(None) => return "the watch stream ended".to_owned(),
            Err(e) => return e.to_string(),
        };
        if response.canceled {
            return format!(
                "the watch was cancelled ({}; compacted up to revision {})",
                response.cancel_reason, response.compact_revision
            );
        }
        if response.created {
            inner.set_connected(true);
            backoff.reset();
        }
        if response.events.is_empty() {
            continue;
        }
        for event in &response.events {
            let Some(kv) = &event.kv else { continue };
            match event.r#type() {
                EventType::Put => view.put(&inner.prefix, &kv.key, &kv.value, kv.mod_revision),
                EventType::Delete => view.delete(&inner.prefix, &kv.key),
            }
            // A deletion's key carries the revision of the deletion.
            view.revision = view.revision.max(kv.mod_revision);
        }
        if inner
            .check_history(
                view.revision,
                view.cluster_id.as_deref(),
                view.witness.as_ref(),
                floor,
            )
            .is_err()
        {
            return "the store broke this cluster's history".to_owned();
        }
        publish(tx, view);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A read answered at a revision below one the node saw after sending it (a watch event,
    /// another read answered first: a node resuming from SIGSTOP takes in answers in any
    /// order) is not a rollback; one below what was seen before it was sent is, and the fence
    /// stays. Before, the first case fenced the node for good (found by the nemesis).
    #[test]
    fn only_revisions_seen_before_a_read_was_sent_make_its_answer_a_rollback() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let _entered = rt.enter();
        let client =
            EtcdClient::connect(&["http://127.0.0.1:9".to_owned()], &Default::default()).unwrap();
        let inner = Inner {
            client,
            prefix: "/t/".to_owned(),
            endpoints: "http://127.0.0.1:9".to_owned(),
            connected: AtomicBool::new(false),
            history: Mutex::new(History {
                cluster_id: Some("c".to_owned()),
                floor: 40,
                guarded_floor: 30,
                witness: None,
                fault: None,
            }),
        };
        let id = Some("c");
        let sent = inner.floor();
        inner.check_history(45, id, None, inner.floor()).unwrap();
        inner.check_history(44, id, None, sent).unwrap();
        assert_eq!(inner.floor(), 45);
        // Below the ledger's revision, whenever sent: a rollback.
        assert!(inner.check_history(29, id, None, 0).is_err());
        // And the fence stays.
        assert!(inner.check_history(50, id, None, inner.floor()).is_err());
        let inner = Inner {
            history: Mutex::new(History {
                cluster_id: Some("c".to_owned()),
                floor: 45,
                guarded_floor: 0,
                witness: None,
                fault: None,
            }),
            ..inner
        };
        let sent = inner.floor();
        assert!(inner.check_history(44, id, None, sent).is_err());
    }

    #[test]
    fn keys_are_classified_with_their_prefix() {
        let p = "/tarn/";
        assert!(matches!(
            key_kind(p, b"/tarn/nodes/n1"),
            KeyKind::Node("n1")
        ));
        assert!(matches!(
            key_kind(p, b"/tarn/collections/docs"),
            KeyKind::Collection("docs")
        ));
        assert!(matches!(
            key_kind(p, b"/tarn/shards/docs/00012"),
            KeyKind::Shard("docs", 12)
        ));
        assert!(matches!(
            key_kind(p, b"/tarn/shards/docs/x"),
            KeyKind::Other
        ));
        assert!(matches!(
            key_kind(p, b"/tarn/elections/placement/694d"),
            KeyKind::Other
        ));
        assert!(matches!(key_kind(p, b"/other/nodes/n1"), KeyKind::Other));
    }

    #[test]
    fn a_collection_shows_once_all_its_shards_are_there() {
        let p = "/t/";
        let mut view = View::default();
        let def = CollectionDef {
            name: "docs".into(),
            uid: 7,
            n_shards: 2,
            shard_key: crate::map::ShardKey::User,
            config: serde_json::json!({}),
            replication_factor: 1,
            min_in_sync: 1,
        };
        let shard = ShardAssignment::serving("n1", 1);
        view.put(
            p,
            b"/t/collections/docs",
            &serde_json::to_vec(&def).unwrap(),
            1,
        );
        view.put(
            p,
            b"/t/shards/docs/00000",
            &serde_json::to_vec(&shard).unwrap(),
            1,
        );
        assert!(view.state().collections.is_empty());
        view.put(
            p,
            b"/t/shards/docs/00001",
            &serde_json::to_vec(&shard).unwrap(),
            1,
        );
        assert_eq!(view.state().collections["docs"].shards.len(), 2);
        // A value that does not decode counts as absent.
        view.put(p, b"/t/shards/docs/00001", b"{garbage", 1);
        assert!(view.state().collections.is_empty());
        view.put(p, b"/t/nodes/n1", br#"{"node_id":"n1","address":"a:1"}"#, 1);
        view.delete(p, b"/t/collections/docs");
        let state = view.state();
        assert!(state.collections.is_empty());
        assert!(state.is_alive("n1"));
    }

    #[test]
    fn ttls_round_up_to_whole_seconds() {
        assert_eq!(ttl_seconds(Duration::ZERO), 1);
        assert_eq!(ttl_seconds(Duration::from_millis(1500)), 2);
        assert_eq!(ttl_seconds(Duration::from_secs(5)), 5);
    }
}
