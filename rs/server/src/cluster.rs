//! Cluster mode in the server: joining the cluster (membership under an etcd lease), keeping
//! this node's shards in line with the shard map, and routing every `tarn.v1.Tarn` call to the
//! shards concerned, here or on their owners.
//!
//! A shard's data is a local collection on its owner, named `<collection>.<uid>.<shard>`
//! ([`ShardName`]). A router addresses it as `<local name>@<epoch>`, through the ordinary RPCs
//! (the owner's own calls go straight to the local collection: no extra hop); the owner serves
//! such a name only if the shard map says it owns the shard at exactly that epoch, and answers
//! ABORTED otherwise (fencing by epoch on every write, never by timing).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use dashmap::DashMap;
use tarn_client::{Client, Code};
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
    /// A coordination store to use instead of connecting to `etcd` (in-process tests share a
    /// `tarn_cluster::MemoryStore` between servers).
    pub store: Option<Arc<dyn ClusterStore>>,
}

/// How long a forwarded call may take when the client set no deadline.
const DEFAULT_FORWARD_DEADLINE: Duration = Duration::from_secs(30);
/// How long a call naming a collection this node does not know waits for its view to catch up.
const NOT_FOUND_GRACE: Duration = Duration::from_millis(300);
/// How long connecting to another node may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// This node's membership and view of the cluster.
pub struct ClusterNode {
    pub node_id: String,
    pub address: String,
    store: Arc<dyn ClusterStore>,
    state: watch::Receiver<Arc<ClusterState>>,
    /// Connections to the other nodes, by (address, API key).
    clients: DashMap<(String, Option<String>), Client>,
    _registration: Registration,
}

impl std::fmt::Debug for ClusterNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterNode")
            .field("node_id", &self.node_id)
            .field("address", &self.address)
            .finish()
    }
}

/// Where one shard's call goes.
pub enum Target {
    /// This node owns the shard: the address name, served locally.
    Local(String),
    /// Another node does: a client to it and the address name.
    Remote(Box<Client>, String),
}

impl ClusterNode {
    /// Joins: registers this node under a lease (refused if a live node has the id) and starts
    /// watching the shard map; a task drops local shards of collections that no longer exist.
    pub async fn join(
        store: Arc<dyn ClusterStore>,
        node_id: String,
        address: String,
        lease_ttl: Duration,
        registry: Arc<Registry>,
    ) -> anyhow::Result<Arc<ClusterNode>> {
        let node = NodeInfo {
            node_id: node_id.clone(),
            address: address.clone(),
        };
        let registration = store.register(&node, lease_ttl).await?;
        let state = store.watch().await?;
        tracing::info!(%node_id, %address, "joined the cluster");
        tokio::spawn(reconcile(state.clone(), registry, node_id.clone()));
        Ok(Arc::new(ClusterNode {
            node_id,
            address,
            store,
            state,
            clients: DashMap::new(),
            _registration: registration,
        }))
    }

    /// The cluster as last seen.
    pub fn state(&self) -> Arc<ClusterState> {
        Arc::clone(&self.state.borrow())
    }

    /// Whether the coordination store answers.
    pub fn store_connected(&self) -> bool {
        self.store.connected()
    }

    fn collection(&self, name: &str) -> Result<CollectionMap, ApiError> {
        crate::registry::validate_name(name)?;
        self.state()
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
        let known = |s: &ClusterState| {
            s.collections
                .get(&shard.collection)
                .is_some_and(|m| m.def.uid == shard.uid)
        };
        if !known(&self.state()) {
            // The router's view may be a moment ahead of this node's.
            self.wait_for_with(NOT_FOUND_GRACE, known).await;
        }
        let state = self.state();
        let map = state
            .collections
            .get(&shard.collection)
            .filter(|m| m.def.uid == shard.uid)
            .ok_or_else(|| ApiError::NotFound(shard.collection.clone()))?;
        let assignment = map
            .shards
            .get(shard.shard as usize)
            .ok_or_else(|| ApiError::invalid("collection", format!("no shard {}", shard.shard)))?;
        if assignment.owner != self.node_id || assignment.epoch != epoch {
            return Err(ApiError::StaleShardMap(format!(
                "shard {} of collection '{}' is on node {} at epoch {}, not on node {} at \
                 epoch {epoch}: refresh the shard map and retry",
                shard.shard, shard.collection, assignment.owner, assignment.epoch, self.node_id
            )));
        }
        let def = &map.def;
        registry
            .shard(&shard.local_name(), || {
                serde_json::from_value::<CollectionConfig>(def.config.clone()).map_err(|e| {
                    ApiError::Internal(format!("collection '{}' has a bad config: {e}", def.name))
                })
            })
            .await
    }

    /// Where a call for `shard` of `map` goes: here, or to its live owner.
    pub async fn target(
        &self,
        map: &CollectionMap,
        shard: u32,
        api_key: Option<&str>,
    ) -> Result<Target, ApiError> {
        let assignment = &map.shards[shard as usize];
        let name = ShardName {
            collection: map.def.name.clone(),
            uid: map.def.uid,
            shard,
        }
        .address(assignment.epoch);
        if assignment.owner == self.node_id {
            return Ok(Target::Local(name));
        }
        let unavailable = |why: String| ApiError::ShardUnavailable {
            collection: map.def.name.clone(),
            shard,
            node: assignment.owner.clone(),
            why,
        };
        let state = self.state();
        let Some(owner) = state.nodes.get(&assignment.owner) else {
            return Err(unavailable("the node is down (its lease lapsed)".into()));
        };
        let key = (owner.address.clone(), api_key.map(str::to_owned));
        if let Some(client) = self.clients.get(&key) {
            return Ok(Target::Remote(Box::new(client.clone()), name));
        }
        let mut builder = Client::builder(owner.address.as_str()).connect_timeout(CONNECT_TIMEOUT);
        if let Some(api_key) = api_key {
            builder = builder.api_key(api_key);
        }
        let client = builder
            .connect()
            .await
            .map_err(|e| unavailable(e.message().to_owned()))?;
        self.clients.insert(key, client.clone());
        Ok(Target::Remote(Box::new(client), name))
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
        let nodes: Vec<String> = self.state().nodes.keys().cloned().collect();
        let def = CollectionDef {
            name: request.name.clone(),
            uid: rand::random::<u64>() | 1,
            n_shards,
            shard_key,
            config: serde_json::to_value(&config)
                .map_err(|e| ApiError::Internal(format!("encoding the config: {e}")))?,
        };
        let map = CollectionMap {
            shards: initial_placement(&def.name, n_shards, &nodes),
            def,
        };
        if map.shards.is_empty() {
            return Err(ApiError::Internal("no live node to place shards on".into()));
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
    pub async fn forget(
        &self,
        node_id: &str,
        confirm: bool,
    ) -> Result<Vec<(String, u32, ShardAssignment)>, ApiError> {
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
        for (name, map) in &state.collections {
            for (shard, assignment) in map.shards.iter().enumerate() {
                if assignment.owner != node_id {
                    continue;
                }
                let (target, n) = load
                    .iter_mut()
                    .min_by_key(|(id, n)| (**n, (*id).clone()))
                    .ok_or_else(|| ApiError::Internal("no live node".into()))?;
                *n += 1;
                plan.push((
                    name.clone(),
                    shard as u32,
                    assignment.epoch,
                    ShardAssignment::serving(target.clone(), assignment.epoch + 1),
                ));
            }
        }
        if confirm {
            for (name, shard, epoch, new) in &plan {
                let swapped = self
                    .store
                    .compare_and_set_shard(name, *shard, *epoch, new)
                    .await
                    .map_err(store_error)?;
                if !swapped {
                    return Err(ApiError::StaleShardMap(format!(
                        "shard {shard} of collection '{name}' changed meanwhile: run forget again"
                    )));
                }
                tracing::warn!(collection = %name, shard, forgotten = %node_id, owner = %new.owner, "shard given up: its data is lost, it starts empty");
            }
            let last = plan.last().map(|p| (p.0.clone(), p.1, p.3.epoch));
            if let Some((name, shard, epoch)) = last {
                self.wait_for(|s| {
                    s.collections
                        .get(&name)
                        .is_some_and(|m| m.shards[shard as usize].epoch >= epoch)
                })
                .await;
            }
        }
        Ok(plan
            .into_iter()
            .map(|(name, shard, _, new)| (name, shard, new))
            .collect())
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

/// Drops the local shards of collections that are gone from the map (or were re-created
/// under a new uid), and of shards the map gives to another node (a node forgotten while it was
/// down finds its shards given up when it returns). Runs for the life of the node.
async fn reconcile(
    mut state: watch::Receiver<Arc<ClusterState>>,
    registry: Arc<Registry>,
    node_id: String,
) {
    loop {
        let current = Arc::clone(&state.borrow_and_update());
        for local in registry.shard_names() {
            let Some((shard, _)) = ShardName::parse(&local) else {
                continue;
            };
            let live = current
                .collections
                .get(&shard.collection)
                .filter(|m| m.def.uid == shard.uid)
                .and_then(|m| m.shards.get(shard.shard as usize))
                .is_some_and(|a| a.owner == node_id);
            if !live && current.revision > 0 {
                tracing::info!(shard = %local, "dropping a shard whose collection is gone");
                if let Err(error) = registry.drop_shard(&local).await {
                    tracing::error!(shard = %local, %error, "could not drop a shard");
                }
            }
        }
        if state.changed().await.is_err() {
            return;
        }
    }
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

/// A remote error, with the shard it came from when the owner could not be reached.
pub fn forwarded(map: &CollectionMap, shard: u32, error: tarn_client::Error) -> ApiError {
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

/// A read token for positions in `map`'s shards.
pub fn read_token(map: &CollectionMap, positions: Vec<(u32, u64)>) -> Vec<u8> {
    let mut token = ReadPositions {
        uid: map.def.uid,
        positions: Vec::new(),
    };
    token.merge(&ReadPositions {
        uid: map.def.uid,
        positions,
    });
    token.encode()
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
