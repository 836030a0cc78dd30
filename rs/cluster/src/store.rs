//! The coordination store: where membership, collection definitions and the shard map live.
//! [`ClusterStore`] is the small interface the rest of tarn uses; [`crate::EtcdStore`] is the
//! real one (etcd), [`MemoryStore`] an in-process one for tests of routing and placement.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::watch;

use crate::copies::{CopyEvidence, ShardRecord};
use crate::error::{ClusterError, Result};
use crate::map::{
    ClusterState, CollectionMap, HistoryWitness, MoveFailure, NodeInfo, ShardAssignment,
};

/// A node's membership: alive while this handle lives and the store can reach it. Dropping it
/// ends the membership (the lease is revoked, or simply lapses if the process dies).
pub struct Registration {
    _keep_alive: Box<dyn Send + Sync>,
    liveness: Option<Box<dyn Fn() -> Liveness + Send + Sync>>,
}

/// How surely a registration is alive, as its keep-alive task last learnt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Liveness {
    /// The lease surely lives until then: the send time of the last keep-alive etcd answered
    /// plus the TTL it granted. Past it, the store may have expired the registration, and
    /// another node may have been given this node's shards (`forget`).
    pub lease_alive_until: std::time::Instant,
    /// The store revision at which the current registration was made (a new one after the
    /// lease expired and the node registered again). A view older than it may miss what the
    /// cluster did while the node was out.
    pub registered_at: i64,
}

impl Registration {
    /// Keeps `guard` (a task handle, a lease keeper) for the life of the membership.
    pub fn new(guard: impl Send + Sync + 'static) -> Registration {
        Registration {
            _keep_alive: Box::new(guard),
            liveness: None,
        }
    }

    /// A membership whose lease can lapse, as `liveness` reports it.
    pub fn with_liveness(
        mut self,
        liveness: impl Fn() -> Liveness + Send + Sync + 'static,
    ) -> Registration {
        self.liveness = Some(Box::new(liveness));
        self
    }

    /// The lease's state; `None` when the store's memberships never lapse on their own
    /// ([`MemoryStore`]).
    pub fn liveness(&self) -> Option<Liveness> {
        self.liveness.as_ref().map(|f| f())
    }
}

/// A compare-and-swap of one shard's assignment ([`ClusterStore::compare_and_set_shard`]).
#[derive(Debug, Clone, Copy)]
pub struct ShardSwap<'a> {
    pub collection: &'a str,
    /// The collection's incarnation: a swap planned on a dropped collection never lands on a
    /// new one of the same name.
    pub uid: u64,
    pub shard: u32,
    /// The epoch the swap was planned at.
    pub expected_epoch: u64,
    pub new: &'a ShardAssignment,
    /// Only if this node is not registered (its lease has lapsed in the store itself, not only
    /// in the caller's view): `forget`, failover.
    pub unless_registered: Option<&'a str>,
    /// With `unless_registered`: the data directory token recorded for that node's copy. A
    /// registration from another directory ([`crate::is_another_directory`]: the node came
    /// back on a wiped or replaced disk, so it holds no copy) then counts as none: failover
    /// over such a primary. `None`: any registration stops the swap.
    pub unless_registered_from: Option<&'a str>,
    /// Only if this node is registered, from this data directory when the token is not empty
    /// (node id, token): failover's candidate, so that a promotion planned from a stale view
    /// never lands on a node that died or came back on another disk meanwhile.
    pub registered: Option<(&'a str, &'a str)>,
    /// Only if the record is still exactly this one (not only at the same epoch): changes of a
    /// shard's copies keep its epoch, so they compare the whole record.
    pub expected: Option<&'a ShardAssignment>,
}

impl<'a> ShardSwap<'a> {
    /// A swap of `shard`'s record from `from` to `to` that lands only if the whole record is
    /// still `from` (no registration guard: callers that need one set it).
    pub fn whole_record(
        shard: &'a crate::ShardName,
        from: &'a ShardAssignment,
        to: &'a ShardAssignment,
    ) -> Self {
        ShardSwap {
            collection: &shard.collection,
            uid: shard.uid,
            shard: shard.shard,
            expected_epoch: from.epoch,
            new: to,
            unless_registered: None,
            unless_registered_from: None,
            registered: None,
            expected: Some(from),
        }
    }

    /// Whether `registration`, of the node named by `registered`, comes from the data
    /// directory recorded for it (any, when no token was recorded).
    pub fn candidate_holds(&self, registration: &NodeInfo) -> bool {
        self.registered.is_some_and(|(node, recorded)| {
            registration.node_id == node
                && (recorded.is_empty()
                    || !crate::is_another_directory(recorded, &registration.incarnation))
        })
    }

    /// Whether `registration`, of the node named by `unless_registered`, comes from another
    /// data directory than `unless_registered_from` (so it does not stop the swap).
    pub fn registered_elsewhere(&self, registration: &NodeInfo) -> bool {
        self.unless_registered_from.is_some_and(|recorded| {
            crate::is_another_directory(recorded, &registration.incarnation)
        })
    }
}

/// A cluster's identity, created once when the cluster forms.
#[derive(Clone, PartialEq, Eq)]
pub struct ClusterIdentity {
    /// Recorded in every member's data directory: a directory joins only the store that holds
    /// its cluster's id.
    pub cluster_id: String,
    /// The secret nodes prove themselves to each other with on node-to-node calls (never a
    /// client's API key, so rotating client keys never breaks node-to-node traffic). Whoever
    /// can read the store can act as a node, as whoever can write it can rewrite the map.
    pub node_secret: String,
}

impl std::fmt::Debug for ClusterIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterIdentity")
            .field("cluster_id", &self.cluster_id)
            .field("node_secret", &"<secret>")
            .finish()
    }
}

/// The cluster's identity as the store holds it ([`ClusterStore::identity`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreIdentity {
    /// The identity, if one was created.
    pub identity: Option<ClusterIdentity>,
    /// Whether the store holds any other tarn key under the prefix (nodes, collections): a
    /// cluster formed by a tarn that predates identities.
    pub holds_state: bool,
}

impl std::fmt::Debug for Registration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Registration")
    }
}

/// Leadership of an election ([`ClusterStore::campaign`]): held until dropped, or until the
/// store finds it lost (a lapsed lease). Check [`Leader::is_leader`] before each act.
pub struct Leader {
    is_leader: Box<dyn Fn() -> bool + Send + Sync>,
}

impl Leader {
    /// A leadership whose state `is_leader` reports (it owns whatever keeps it).
    pub fn new(is_leader: impl Fn() -> bool + Send + Sync + 'static) -> Leader {
        Leader {
            is_leader: Box::new(is_leader),
        }
    }

    /// Whether this is still surely the leader.
    pub fn is_leader(&self) -> bool {
        (self.is_leader)()
    }
}

impl std::fmt::Debug for Leader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Leader")
            .field("is_leader", &self.is_leader())
            .finish()
    }
}

/// Membership, collection definitions and the shard map, shared by every node.
#[async_trait::async_trait]
pub trait ClusterStore: Send + Sync + std::fmt::Debug + 'static {
    /// Registers `node` under a lease of `ttl`, kept alive in the background while the returned
    /// [`Registration`] lives. When the id is taken by a registration carrying the same
    /// non-empty [`NodeInfo::incarnation`] (this data directory's previous process, killed before
    /// its lease lapsed), that registration is removed and its lease revoked, and this one takes
    /// its place at once. When it is taken by anything else, waits for that registration's lease
    /// to lapse (as long as it has left, plus a margin), saying so in the log, and then gives
    /// [`ClusterError::DuplicateNode`] if a live node still holds the id.
    async fn register(&self, node: &NodeInfo, ttl: Duration) -> Result<Registration>;

    /// A live view of the whole state: the current one at once, then every change.
    async fn watch(&self) -> Result<watch::Receiver<Arc<ClusterState>>>;

    /// Creates a collection's definition and shard map in one transaction, unless the name is
    /// taken (then `false`, nothing written).
    async fn create_collection(&self, map: &CollectionMap) -> Result<bool>;

    /// Deletes a collection's definition and shard map, leaving a tombstone of its uid (the
    /// positive evidence that lets nodes delete its local shards, [`crate::fate_of_copy`]);
    /// `false` if there was none.
    async fn drop_collection(&self, name: &str) -> Result<bool>;

    /// Sets a shard's assignment if the collection still has `swap.uid` and the shard's epoch
    /// is still `swap.expected_epoch` (with `expected`, the record is still exactly that one;
    /// with `unless_registered`, that node has no registration, or, with
    /// `unless_registered_from`, none from that data directory), in one transaction; `false`
    /// if anything changed meanwhile.
    async fn compare_and_set_shard(&self, swap: &ShardSwap<'_>) -> Result<bool>;

    /// A shard's record read linearizably (at least as new as anything any node has seen):
    /// its assignment, or that its collection was dropped, or that nothing is known of it.
    /// [`ClusterError::BadValue`] if the record cannot be decoded.
    async fn read_shard(&self, collection: &str, uid: u64, shard: u32) -> Result<ShardRecord>;

    /// What a node judges a local copy by ([`crate::fate_of_copy`]), read linearizably at one
    /// revision: the shard's record, every node's registration, the store's revision and the
    /// cluster id it holds.
    async fn read_copy_evidence(
        &self,
        collection: &str,
        uid: u64,
        shard: u32,
    ) -> Result<CopyEvidence>;

    /// The cluster's identity in the store.
    async fn identity(&self) -> Result<StoreIdentity>;

    /// Creates the cluster's identity unless one exists; returns the one stored.
    async fn create_identity(&self, proposed: &ClusterIdentity) -> Result<ClusterIdentity>;

    /// Records a shard's failed move (`Some`), or clears the record (`None`, after a move of it
    /// succeeded). Shown in [`ClusterState::move_failures`].
    async fn record_move_failure(
        &self,
        collection: &str,
        shard: u32,
        failure: Option<&MoveFailure>,
    ) -> Result<()>;

    /// Marks `node_id` for draining (`true`) or clears the mark.
    async fn set_draining(&self, node_id: &str, draining: bool) -> Result<()>;

    /// Campaigns in `election` as `node_id`, waiting until elected; one leader at a time.
    async fn campaign(&self, election: &str, node_id: &str) -> Result<Leader>;

    /// From now on, this store must hold the cluster id `cluster_id` and never show a revision
    /// below `floor` (nor below any it showed since): when it does (etcd wiped or replaced
    /// under the running node, or restored from an older backup), it stops following etcd,
    /// never registers the node again, and [`ClusterStore::history_fault`] says why. The node
    /// fences itself on that. `witness`, the newest write the node acted on, must be in the
    /// store's history as the node saw it: an etcd restored from an older backup and written
    /// to since shows a revision past `floor`, but another write at the witness's revision.
    fn guard_history(&self, _cluster_id: &str, _floor: i64, _witness: Option<HistoryWitness>) {}

    /// Why the store broke the history [`ClusterStore::guard_history`] set, if it did.
    fn history_fault(&self) -> Option<String> {
        None
    }

    /// Whether the store answered lately (for health and metrics). While it does not, the
    /// watched state stays as it last was, and the data plane goes on with it.
    fn connected(&self) -> bool {
        true
    }
}

/// An in-process store for tests: the same semantics as etcd's, without the network. A node's
/// lease ends when its [`Registration`] is dropped or [`MemoryStore::expire`] is called.
#[derive(Debug, Clone)]
pub struct MemoryStore {
    state: Arc<Mutex<ClusterState>>,
    /// The registration that holds each node id (a counter value), so that a registration
    /// taken over ends only its own membership when dropped.
    holders: Arc<Mutex<std::collections::HashMap<String, u64>>>,
    next_holder: Arc<std::sync::atomic::AtomicU64>,
    tx: Arc<watch::Sender<Arc<ClusterState>>>,
    /// One leader per store (elections are not told apart: tests use one).
    election: Arc<tokio::sync::Mutex<()>>,
    /// Tombstones of dropped collections: (name, uid).
    dropped: Arc<Mutex<std::collections::HashSet<(String, u64)>>>,
    cluster_id: Arc<Mutex<Option<ClusterIdentity>>>,
}

impl Default for MemoryStore {
    fn default() -> Self {
        let (tx, _) = watch::channel(Arc::new(ClusterState::default()));
        MemoryStore {
            state: Arc::default(),
            holders: Arc::default(),
            next_holder: Arc::default(),
            tx: Arc::new(tx),
            election: Arc::default(),
            dropped: Arc::default(),
            cluster_id: Arc::default(),
        }
    }
}

impl MemoryStore {
    fn change(&self, f: impl FnOnce(&mut ClusterState) -> bool) -> bool {
        let mut state = self.state.lock();
        let changed = f(&mut state);
        if changed {
            state.revision += 1;
            self.tx.send_replace(Arc::new(state.clone()));
        }
        changed
    }

    /// Ends `node_id`'s lease at once (what a lapsed keep-alive does).
    pub fn expire(&self, node_id: &str) {
        self.holders.lock().remove(node_id);
        self.change(|s| {
            s.registered_at.remove(node_id);
            s.nodes.remove(node_id).is_some()
        });
    }
}

struct MemoryLease {
    store: MemoryStore,
    node_id: String,
    holder: u64,
}

impl Drop for MemoryLease {
    fn drop(&mut self) {
        let mut holders = self.store.holders.lock();
        if holders.get(&self.node_id) == Some(&self.holder) {
            holders.remove(&self.node_id);
            drop(holders);
            self.store.change(|s| {
                s.registered_at.remove(&self.node_id);
                s.nodes.remove(&self.node_id).is_some()
            });
        }
    }
}

#[async_trait::async_trait]
impl ClusterStore for MemoryStore {
    /// As etcd's, except that a live holder with another incarnation is refused at once (a
    /// lease here lapses only by [`MemoryStore::expire`]).
    async fn register(&self, node: &NodeInfo, _ttl: Duration) -> Result<Registration> {
        let holder = self
            .next_holder
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut holders = self.holders.lock();
        let mut held_by = None;
        self.change(|s| {
            if let Some(current) = s.nodes.get(&node.node_id) {
                let own = !node.incarnation.is_empty() && current.incarnation == node.incarnation;
                if !own {
                    held_by = Some(current.address.clone());
                    return false;
                }
            }
            s.nodes.insert(node.node_id.clone(), node.clone());
            s.registered_at.insert(node.node_id.clone(), s.revision + 1);
            true
        });
        if let Some(address) = held_by {
            return Err(ClusterError::DuplicateNode {
                node_id: node.node_id.clone(),
                detail: format!("registered from {address} by another data directory"),
            });
        }
        holders.insert(node.node_id.clone(), holder);
        Ok(Registration::new(MemoryLease {
            store: self.clone(),
            node_id: node.node_id.clone(),
            holder,
        }))
    }

    async fn watch(&self) -> Result<watch::Receiver<Arc<ClusterState>>> {
        Ok(self.tx.subscribe())
    }

    async fn create_collection(&self, map: &CollectionMap) -> Result<bool> {
        Ok(self.change(|s| {
            if s.collections.contains_key(&map.def.name) {
                return false;
            }
            s.collections.insert(map.def.name.clone(), map.clone());
            true
        }))
    }

    async fn drop_collection(&self, name: &str) -> Result<bool> {
        Ok(self.change(|s| match s.collections.remove(name) {
            Some(map) => {
                s.move_failures.retain(|(c, _), _| c != name);
                self.dropped.lock().insert((name.to_owned(), map.def.uid));
                true
            }
            None => false,
        }))
    }

    async fn compare_and_set_shard(&self, swap: &ShardSwap<'_>) -> Result<bool> {
        Ok(self.change(|s| {
            let registered = swap.unless_registered.and_then(|n| s.nodes.get(n));
            if registered.is_some_and(|info| !swap.registered_elsewhere(info)) {
                return false;
            }
            if let Some((node, _)) = swap.registered {
                if !s
                    .nodes
                    .get(node)
                    .is_some_and(|info| swap.candidate_holds(info))
                {
                    return false;
                }
            }
            let Some(slot) = s
                .collections
                .get_mut(swap.collection)
                .filter(|m| m.def.uid == swap.uid)
                .and_then(|m| m.shards.get_mut(swap.shard as usize))
            else {
                return false;
            };
            if slot.epoch != swap.expected_epoch || swap.expected.is_some_and(|e| e != slot) {
                return false;
            }
            *slot = swap.new.clone();
            true
        }))
    }

    async fn read_shard(&self, collection: &str, uid: u64, shard: u32) -> Result<ShardRecord> {
        if self.dropped.lock().contains(&(collection.to_owned(), uid)) {
            return Ok(ShardRecord::Dropped);
        }
        let state = self.state.lock();
        Ok(state
            .collections
            .get(collection)
            .filter(|m| m.def.uid == uid)
            .and_then(|m| m.shards.get(shard as usize))
            .map_or(ShardRecord::Unknown, |a| ShardRecord::Assigned(a.clone())))
    }

    async fn read_copy_evidence(
        &self,
        collection: &str,
        uid: u64,
        shard: u32,
    ) -> Result<CopyEvidence> {
        let record = self.read_shard(collection, uid, shard).await?;
        let state = self.state.lock();
        Ok(CopyEvidence {
            record,
            registered: state.nodes.clone(),
            revision: state.revision,
            cluster_id: self
                .cluster_id
                .lock()
                .as_ref()
                .map(|i| i.cluster_id.clone()),
        })
    }

    async fn identity(&self) -> Result<StoreIdentity> {
        let state = self.state.lock();
        Ok(StoreIdentity {
            identity: self.cluster_id.lock().clone(),
            holds_state: !state.nodes.is_empty() || !state.collections.is_empty(),
        })
    }

    async fn create_identity(&self, proposed: &ClusterIdentity) -> Result<ClusterIdentity> {
        Ok(self
            .cluster_id
            .lock()
            .get_or_insert_with(|| proposed.clone())
            .clone())
    }

    async fn record_move_failure(
        &self,
        collection: &str,
        shard: u32,
        failure: Option<&MoveFailure>,
    ) -> Result<()> {
        let key = (collection.to_owned(), shard);
        self.change(|s| match failure {
            Some(f) => s.move_failures.insert(key, f.clone()).as_ref() != Some(f),
            None => s.move_failures.remove(&key).is_some(),
        });
        Ok(())
    }

    async fn set_draining(&self, node_id: &str, draining: bool) -> Result<()> {
        self.change(|s| {
            if draining {
                s.draining.insert(node_id.to_owned())
            } else {
                s.draining.remove(node_id)
            }
        });
        Ok(())
    }

    async fn campaign(&self, _election: &str, _node_id: &str) -> Result<Leader> {
        let guard = Arc::clone(&self.election).lock_owned().await;
        Ok(Leader::new(move || {
            let _held = &guard;
            true
        }))
    }
}
