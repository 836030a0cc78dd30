//! Cluster mode against a real etcd and real `tarn` processes: three nodes, sharded collections
//! (by document and by tenant), routing and fan-out through every node, read-your-writes across
//! shards, a node killed under write load (UNAVAILABLE naming the shard, partial searches on
//! request, nothing acknowledged lost or duplicated after its restart, its shards never handed
//! to another node), a second node with a taken id, and etcd stopped and restarted.
//!
//! etcd comes from Debian's `etcd-server` (installed by `scripts/lib-etcd.sh` when missing);
//! where it cannot be had, each test prints `SKIPPED` and passes, except under `CI=true`, where
//! a missing etcd fails the test.
#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

mod common;
#[path = "cluster/nemesis.rs"]
mod nemesis;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{run_cli, runtime, Server};
use rand::{Rng, SeedableRng};
use tarn_client::{
    Client, Code, CollectionSpec, Count, Durability, Insert, Metric, Remove, Scroll, Search,
    ShardKey,
};

/// A free loopback TCP port (bound, then released).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The `etcd` binary, installed from Debian if missing; None (and a SKIPPED line) if it cannot
/// be had here.
fn etcd_binary() -> Option<PathBuf> {
    let find = || {
        ["/usr/bin/etcd", "/usr/local/bin/etcd"]
            .iter()
            .map(PathBuf::from)
            .find(|p| p.exists())
    };
    if let Some(path) = find() {
        return Some(path);
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let _ = Command::new("bash")
        .arg("-c")
        .arg("source scripts/lib-etcd.sh && ensure_etcd")
        .current_dir(&root)
        .status();
    let found = find();
    if found.is_none() {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "no etcd under CI=true: Debian's etcd-server could not be installed, and the \
             cluster tests must run in CI"
        );
        eprintln!("SKIPPED: no etcd (Debian's etcd-server could not be installed)");
    }
    found
}

/// One etcd member on free loopback ports, with its data in `dir`.
struct Etcd {
    child: Option<Child>,
    binary: PathBuf,
    dir: PathBuf,
    client_port: u16,
    peer_port: u16,
}

impl Etcd {
    fn start(binary: PathBuf, dir: &Path) -> Etcd {
        let mut etcd = Etcd {
            child: None,
            binary,
            dir: dir.to_owned(),
            client_port: free_port(),
            peer_port: free_port(),
        };
        etcd.restart();
        etcd
    }

    fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    /// Starts (again) on the same ports and data, and waits until it answers.
    fn restart(&mut self) {
        let client = self.endpoint();
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let child = Command::new(&self.binary)
            .arg("--name=t")
            .arg(format!("--data-dir={}", self.dir.display()))
            .arg(format!("--listen-client-urls={client}"))
            .arg(format!("--advertise-client-urls={client}"))
            .arg(format!("--listen-peer-urls={peer}"))
            .arg(format!("--initial-advertise-peer-urls={peer}"))
            .arg(format!("--initial-cluster=t={peer}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if std::net::TcpStream::connect(("127.0.0.1", self.client_port)).is_ok() {
                std::thread::sleep(Duration::from_millis(200));
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("etcd did not start");
    }

    fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Stops it with SIGTERM (a clean shutdown). A single-member etcd 3.4 killed with SIGKILL
    /// may lose the last writes it acknowledged (etcd-io/etcd#14370: it applies an entry
    /// before writing it to its log); the nodes then see its revision go back and fence
    /// themselves, as they must.
    fn terminate(&mut self) {
        if let Some(mut child) = self.child.take() {
            common::sigterm(child.id());
            let _ = child.wait();
        }
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A tarn node of the test cluster.
struct Node {
    id: String,
    dir: PathBuf,
    port: u16,
    /// `--lease-seconds`.
    lease_seconds: u64,
    /// `--advertise` when other nodes reach it through a proxy (else its listening address).
    advertise: Option<String>,
    server: Option<Server>,
    /// Set once the node has run: its address is then known to the cluster and kept.
    has_run: bool,
}

impl Node {
    /// Node `id` with data in `dir/<id>`, on a free port, not started yet.
    fn new(dir: &Path, id: &str, lease_seconds: u64) -> Node {
        Node {
            id: id.to_owned(),
            dir: dir.join(id),
            port: free_port(),
            lease_seconds,
            advertise: None,
            server: None,
            has_run: false,
        }
    }

    fn start(&mut self, etcd: &str) {
        self.start_with_env(etcd, &[]);
    }

    /// Starts the node with extra environment (fail points: `FAILPOINTS`).
    fn start_with_env(&mut self, etcd: &str, env: &[(&str, &str)]) {
        if let Err(log) = self.try_start(etcd, &[], env) {
            panic!("node {} did not start: {log}", self.id);
        }
    }

    /// Starts the node with extra arguments and environment; its log if it exits instead. A
    /// node's first start takes another free port when its own was taken between
    /// `free_port` and the bind (by another test's process).
    fn try_start(
        &mut self,
        etcd: &str,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Result<(), String> {
        for _ in 0..5 {
            match self.try_start_once(etcd, extra, env) {
                Err(log)
                    if !self.has_run
                        && self.advertise.is_none()
                        && log.contains("Address already in use") =>
                {
                    self.port = free_port();
                }
                result => {
                    self.has_run |= result.is_ok();
                    return result;
                }
            }
        }
        self.try_start_once(etcd, extra, env)
    }

    fn try_start_once(
        &mut self,
        etcd: &str,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Result<(), String> {
        let listen = format!("127.0.0.1:{}", self.port);
        let lease = self.lease_seconds.to_string();
        let advertise = self.advertise.clone().unwrap_or_else(|| listen.clone());
        let mut args = vec![
            "--listen",
            &listen,
            "--etcd",
            etcd,
            "--node-id",
            &self.id,
            "--advertise",
            &advertise,
            "--lease-seconds",
            &lease,
        ];
        // One copy per shard unless a test asks otherwise (the default is 2): the single-copy
        // scenarios (a dead owner's shards UNAVAILABLE, moves, set-aside copies) depend on it;
        // the replica tests ask for their copies per collection.
        if !extra.contains(&"--replication-factor") {
            args.extend_from_slice(&["--replication-factor", "1"]);
        }
        args.extend_from_slice(extra);
        // Fail points this test may change while the node runs ([`Node::set_fail_points`]).
        let file = self.fail_points_file();
        let file = file.to_str().unwrap();
        let mut env = env.to_vec();
        if !env.iter().any(|(k, _)| *k == "FAILPOINTS_FILE") {
            env.push(("FAILPOINTS_FILE", file));
        }
        self.server = Some(Server::try_start(&self.dir, &args, &env)?);
        Ok(())
    }

    /// The file of fail points the running node reads every 50 ms (`FAILPOINTS_FILE`).
    fn fail_points_file(&self) -> PathBuf {
        self.dir.with_extension("failpoints")
    }

    /// Sets fail points in the running node (`name=actions;...`), waiting until it has had
    /// time to read them.
    fn set_fail_points(&self, text: &str) {
        std::fs::write(self.fail_points_file(), text).unwrap();
        std::thread::sleep(Duration::from_millis(300));
    }

    /// Sends `signal`; for SIGSTOP, returns once every thread of the process has stopped (a
    /// thread running on another core stops a moment after the signal is sent, and may answer
    /// a call meanwhile).
    fn signal(&self, signal: rustix::process::Signal) {
        let pid = self.server.as_ref().unwrap().child.id();
        rustix::process::kill_process(rustix::process::Pid::from_raw(pid as i32).unwrap(), signal)
            .unwrap();
        if signal != rustix::process::Signal::STOP {
            return;
        }
        let all_stopped = || {
            std::fs::read_dir(format!("/proc/{pid}/task"))
                .map(|tasks| {
                    tasks.flatten().all(|task| {
                        std::fs::read_to_string(task.path().join("stat")).is_ok_and(|stat| {
                            // The state follows the command's closing parenthesis.
                            stat.rsplit_once(") ")
                                .is_some_and(|(_, rest)| rest.starts_with('T'))
                        })
                    })
                })
                .unwrap_or(true)
        };
        let deadline = Instant::now() + Duration::from_secs(2);
        while !all_stopped() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    fn kill(&mut self) {
        if let Some(server) = self.server.take() {
            server.kill();
        }
    }
}

/// `n` nodes `n1`.. with data in `dir/n<i>`, registered under leases of `lease_seconds`, each
/// started with the extra arguments `extra` and environment `env` (fail points: `FAILPOINTS`).
fn nodes_with(
    dir: &Path,
    n: usize,
    etcd: &str,
    lease_seconds: u64,
    extra: &[&str],
    env: &[(&str, &str)],
) -> Vec<Node> {
    (1..=n)
        .map(|i| {
            let mut node = Node::new(dir, &format!("n{i}"), lease_seconds);
            if let Err(log) = node.try_start(etcd, extra, env) {
                panic!("node {} did not start: {log}", node.id);
            }
            node
        })
        .collect()
}

/// A real etcd and `n` nodes on it (leases of `lease_seconds`), all under one temporary
/// directory; `None` (SKIPPED printed) where etcd cannot be had. Bound as `let Some((dir, etcd,
/// nodes)) = ...`, they drop in reverse: the nodes, then etcd, then the directory.
fn real_cluster(n: usize, lease_seconds: u64) -> Option<(tempfile::TempDir, Etcd, Vec<Node>)> {
    let binary = etcd_binary()?;
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(binary, &dir.path().join("etcd"));
    let nodes = nodes_with(dir.path(), n, &etcd.endpoint(), lease_seconds, &[], &[]);
    Some((dir, etcd, nodes))
}

fn vectors(rng: &mut rand::rngs::StdRng, n: usize, dim: usize) -> Vec<f32> {
    (0..n * dim)
        .map(|_| rng.random_range(-1.0f32..1.0))
        .collect()
}

/// Exact top-k by L2 over `(doc, vector)` pairs: (distance, doc).
fn brute_force(data: &BTreeMap<u128, Vec<f32>>, query: &[f32], k: usize) -> Vec<(f32, u128)> {
    let mut all: Vec<(f32, u128)> = data
        .iter()
        .map(|(d, v)| {
            let dist: f32 = v.iter().zip(query).map(|(a, b)| (a - b) * (a - b)).sum();
            (dist.sqrt(), *d)
        })
        .collect();
    all.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    all.truncate(k);
    all
}

/// Routing over an in-memory shard map (`tarn_cluster::MemoryStore` shared by three servers in
/// this process): the same rules as with etcd, with no etcd needed.
#[test]
fn routing_over_an_in_memory_shard_map() {
    let dir = tempfile::tempdir().unwrap();
    let rt = runtime();
    rt.block_on(async {
        let (servers, store) = memory_cluster(dir.path(), 3).await;
        let mut clients = Vec::new();
        for server in &servers {
            clients.push(Client::connect(server.grpc_addr()).await.unwrap());
        }
        const DIM: usize = 8;
        clients[0]
            .create_collection(
                CollectionSpec::new("docs", DIM as u32)
                    .metric(Metric::L2)
                    .shards(5, ShardKey::Doc),
            )
            .await
            .unwrap();
        let mut rng = rand::rngs::StdRng::seed_from_u64(9);
        let v = vectors(&mut rng, 300, DIM);
        let ids: Vec<u128> = (0..300).collect();
        let data: BTreeMap<u128, Vec<f32>> = ids
            .iter()
            .map(|&i| (i, v[i as usize * DIM..(i as usize + 1) * DIM].to_vec()))
            .collect();
        let ack = clients[1]
            .insert(Insert::new("docs", ids.clone(), v.clone()))
            .await
            .unwrap();
        assert_eq!(
            ack.seq_no, 0,
            "a write to several shards has no single seq_no"
        );
        assert!(!ack.read_token().as_bytes().is_empty());
        for client in &clients {
            for q in 0..5 {
                let query = vectors(&mut rng, 1, DIM);
                let hits = client
                    .search(
                        Search::new("docs", query.clone())
                            .exact(true)
                            .top_k(7)
                            .after(ack.read_token()),
                    )
                    .await
                    .unwrap();
                let want: Vec<u128> = brute_force(&data, &query, 7).iter().map(|t| t.1).collect();
                let got: Vec<u128> = hits.iter().map(|h| h.doc_id).collect();
                assert_eq!(got, want, "query {q}");
            }
            assert_eq!(
                client.collection_info("docs").await.unwrap().n_documents,
                300
            );
        }
        // A read token of another collection, or garbage, is refused naming the field.
        let error = clients[0]
            .search(
                Search::new("docs", vec![0.0f32; DIM])
                    .after(tarn_client::ReadToken::from_seq_no(3)),
            )
            .await
            .unwrap_err();
        assert_eq!(error.code(), Code::InvalidArgument);
        assert!(error.message().contains("min_seq_no"), "{error}");
        // Not yet for sharded collections: said plainly, not a wrong answer.
        let error = clients[0].create_snapshot("docs").await.unwrap_err();
        assert_eq!(error.code(), Code::FailedPrecondition, "{error}");
        assert!(error.message().contains("not supported yet"), "{error}");
        // n3's lease ends: its shards answer UNAVAILABLE naming the shard and the node.
        let status = clients[0].cluster_status().await.unwrap();
        let mut n3_shards: Vec<u32> = status
            .shards
            .iter()
            .filter(|s| s.node_id == "n3")
            .map(|s| s.shard)
            .collect();
        n3_shards.sort_unstable();
        assert!(!n3_shards.is_empty());
        store.expire("n3");
        tokio::time::sleep(Duration::from_millis(100)).await;
        let error = clients[0]
            .search(Search::new("docs", vec![0.0f32; DIM]).exact(true))
            .await
            .unwrap_err();
        assert_eq!(error.code(), Code::Unavailable);
        assert!(
            error.message().contains("n3") && error.message().contains("shard"),
            "{error}"
        );
        let (hits, mut missing) = clients[1]
            .search_partial(
                Search::new("docs", vec![0.0f32; DIM])
                    .exact(true)
                    .allow_partial(true),
            )
            .await
            .unwrap();
        missing.sort_unstable();
        assert_eq!(missing, n3_shards);
        assert!(hits.iter().all(|h| {
            let shard = tarn_cluster::shard_for(h.doc_id, 5);
            !n3_shards.contains(&shard)
        }));
        let status = clients[1].cluster_status().await.unwrap();
        assert!(status.nodes.iter().any(|n| n.node_id == "n3" && !n.alive));

        // Forgetting a live node is refused; a dry run changes nothing; then n3's shards are
        // given up: empty, on the live nodes, at the next epoch, and every search answers again.
        let error = clients[0].forget_node("n1", true).await.unwrap_err();
        assert_eq!(error.code(), Code::FailedPrecondition, "{error}");
        let plan = clients[0].forget_node("n3", false).await.unwrap();
        let mut planned: Vec<u32> = plan.iter().map(|s| s.shard).collect();
        planned.sort_unstable();
        assert_eq!(planned, n3_shards);
        assert_eq!(clients[0].cluster_status().await.unwrap(), status);
        let given = clients[0].forget_node("n3", true).await.unwrap();
        assert!(
            given.iter().all(|s| s.node_id != "n3" && s.epoch == 2),
            "{given:?}"
        );
        let hits = clients[1]
            .search(
                Search::new("docs", vec![0.0f32; DIM])
                    .exact(true)
                    .top_k(300),
            )
            .await
            .unwrap();
        let expected = (0..300u128)
            .filter(|d| !n3_shards.contains(&tarn_cluster::shard_for(*d, 5)))
            .count();
        assert_eq!(hits.len(), expected, "the given-up shards start empty");
        let ack = clients[2]
            .insert(Insert::new(
                "docs",
                (0..300u128).collect::<Vec<_>>(),
                v.clone(),
            ))
            .await
            .unwrap();
        let hits = clients[0]
            .search(
                Search::new("docs", vec![0.0f32; DIM])
                    .exact(true)
                    .top_k(300)
                    .after(ack.read_token()),
            )
            .await
            .unwrap();
        assert_eq!(hits.len(), 300);
        let status = clients[0].cluster_status().await.unwrap();
        assert!(status.nodes.iter().all(|n| n.node_id != "n3"), "{status:?}");
        // n3 (still running here) drops its copies of the shards it no longer owns.
        let n3_dir = dir.path().join("n3/collections");
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        loop {
            let left = std::fs::read_dir(&n3_dir)
                .unwrap()
                .filter(|e| {
                    e.as_ref()
                        .unwrap()
                        .file_name()
                        .to_string_lossy()
                        .starts_with("docs.")
                })
                .count();
            if left == 0 {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{left} shards left on n3"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        for server in servers {
            server.shutdown().await.unwrap();
        }
    });
}

/// `n` in-process cluster nodes over a shared in-memory map (and the map, to expire leases).
async fn memory_cluster(
    dir: &Path,
    n: usize,
) -> (
    Vec<tarn_server::RunningServer>,
    std::sync::Arc<tarn_cluster::MemoryStore>,
) {
    let store = std::sync::Arc::new(tarn_cluster::MemoryStore::default());
    let mut servers = Vec::new();
    for i in 1..=n {
        servers.push(memory_node(dir, i, &store).await);
    }
    (servers, store)
}

/// In-process cluster node `n<i>` over the shared in-memory map.
async fn memory_node(
    dir: &Path,
    i: usize,
    store: &std::sync::Arc<tarn_cluster::MemoryStore>,
) -> tarn_server::RunningServer {
    memory_node_with(dir, i, store, |_| {}).await
}

/// [`memory_node`], its configuration changed by `configure` first.
async fn memory_node_with(
    dir: &Path,
    i: usize,
    store: &std::sync::Arc<tarn_cluster::MemoryStore>,
    configure: impl FnOnce(&mut tarn_server::ServeConfig),
) -> tarn_server::RunningServer {
    let listen = format!("127.0.0.1:{}", free_port());
    let mut config = tarn_server::ServeConfig::in_process(dir.join(format!("n{i}")));
    config.listen = listen.clone();
    config.cluster = Some(tarn_server::ClusterConfig {
        etcd: Vec::new(),
        node_id: format!("n{i}"),
        advertise: listen,
        lease_ttl: Duration::from_secs(2),
        replication_factor: 1,
        replace_dead_after: Duration::from_secs(600),
        store: Some(store.clone()),
        force_new_cluster: false,
        accept_etcd_rollback: false,
        peer_ca: None,
    });
    configure(&mut config);
    tarn_server::start(config).await.unwrap()
}

/// The node-to-node RPCs (`Cluster/PullShard`, `Cluster/ShardStream`) and the administrative
/// ones (`ForgetNode`, `Drain`) share the client port. The administrative ones need a
/// read-write key: no key, an unknown key or a read-only key gets UNAUTHENTICATED or
/// PERMISSION_DENIED. The node-to-node ones need the cluster's node credential: every client
/// key, read-write included, gets PERMISSION_DENIED; so does a data call naming an internal
/// shard address (INVALID_ARGUMENT). Nothing happens meanwhile (no drain mark, no shard given
/// up or moved, not one byte of a shard streamed). The same calls with the right credential
/// do act (so the refusals are the credentials', not the requests').
#[test]
fn node_to_node_rpcs_need_the_node_credential_and_admin_rpcs_a_read_write_key() {
    use tarn_proto::v1 as pb;
    let dir = tempfile::tempdir().unwrap();
    let rt = runtime();
    rt.block_on(async {
        let store = std::sync::Arc::new(tarn_cluster::MemoryStore::default());
        let mut servers = Vec::new();
        for i in 1..=2 {
            let node = memory_node_with(dir.path(), i, &store, |config| {
                config.api_keys = vec!["rw-key".into()];
                config.read_only_keys = vec!["ro-key".into()];
            });
            servers.push(node.await);
        }
        let addr = format!("http://{}", servers[0].grpc_addr());
        let admin = Client::builder(addr.clone())
            .api_key("rw-key")
            .connect()
            .await
            .unwrap();
        admin
            .create_collection(CollectionSpec::new("guarded", 4).shards(2, ShardKey::Doc))
            .await
            .unwrap();
        admin
            .insert(Insert::new("guarded", [1u128, 2, 3, 4], vec![0.5f32; 16]))
            .await
            .unwrap();
        let state = {
            use tarn_cluster::ClusterStore;
            store.watch().await.unwrap().borrow().clone()
        };
        let map = &state.collections["guarded"];
        let on_n1 = map.shards.iter().position(|a| a.owner == "n1").unwrap() as u32;
        let on_n2 = map.shards.iter().position(|a| a.owner == "n2").unwrap() as u32;
        let name = |shard: u32| tarn_cluster::ShardName {
            collection: "guarded".into(),
            uid: map.def.uid,
            shard,
        };
        let stream_request = pb::ShardStreamRequest {
            shard: name(on_n1).address(map.shards[on_n1 as usize].epoch),
            to_node: "n2".into(),
            replica: false,
        };
        let pull_request = pb::PullShardRequest {
            collection: "guarded".into(),
            shard: on_n2,
            epoch: map.shards[on_n2 as usize].epoch,
        };
        let channel = tonic::transport::Endpoint::from_shared(addr.clone())
            .unwrap()
            .connect()
            .await
            .unwrap();
        fn with_key<T>(key: Option<&str>, message: T) -> tonic::Request<T> {
            let mut request = tonic::Request::new(message);
            if let Some(key) = key {
                request
                    .metadata_mut()
                    .insert("authorization", format!("Bearer {key}").parse().unwrap());
            }
            request
        }
        let callers = [
            (None, tonic::Code::Unauthenticated),
            (Some("wrong-key"), tonic::Code::Unauthenticated),
            (Some("ro-key"), tonic::Code::PermissionDenied),
            (Some("rw-key"), tonic::Code::Ok),
        ];
        // A client writing to a shard's address (the name routers use between nodes).
        let shard_address = name(on_n1).address(map.shards[on_n1 as usize].epoch);
        let sneaky = admin
            .insert(Insert::new(shard_address.clone(), [9u128], vec![0.5f32; 4]))
            .await
            .unwrap_err();
        assert_eq!(sneaky.code(), Code::InvalidArgument, "{sneaky}");
        assert!(sneaky.message().contains("internal shard name"), "{sneaky}");
        let sneaky = admin
            .search(Search::new(shard_address, vec![0.5f32; 4]).top_k(3))
            .await
            .unwrap_err();
        assert_eq!(sneaky.code(), Code::InvalidArgument, "{sneaky}");
        for (key, admin_code) in callers {
            let mut cluster = pb::cluster_client::ClusterClient::new(channel.clone());
            let who = key.unwrap_or("no key");
            let drain = pb::DrainRequest {
                node_id: "n2".into(),
                cancel: false,
            };
            let forget = pb::ForgetNodeRequest {
                node_id: "n2".into(),
                confirm: true,
            };
            if admin_code != tonic::Code::Ok {
                let outcomes = [
                    ("Drain", cluster.drain(with_key(key, drain)).await.err()),
                    (
                        "ForgetNode",
                        cluster.forget_node(with_key(key, forget)).await.err(),
                    ),
                ];
                for (rpc, error) in outcomes {
                    let code = error.map(|e| e.code());
                    assert_eq!(code, Some(admin_code), "{rpc} with {who}");
                }
            }
            let mut node = pb::node_client::NodeClient::new(channel.clone());
            let shard_ref = pb::ShardRef {
                collection: "guarded".into(),
                uid: map.def.uid,
                shard: on_n1,
                epoch: map.shards[on_n1 as usize].epoch,
                role: pb::ShardRole::Owner as i32,
            };
            let insert = pb::ShardInsertRequest {
                shard: Some(shard_ref.clone()),
                request: Some(pb::InsertRequest {
                    doc_ids: vec![pb::Id { high: 0, low: 99 }],
                    vectors: vec![0.5; 4],
                    ..Default::default()
                }),
            };
            let info = pb::ShardInfoRequest {
                shard: Some(shard_ref),
            };
            let outcomes = [
                (
                    "Node/Insert",
                    node.insert(with_key(key, insert)).await.err(),
                ),
                (
                    "Node/GetShard",
                    node.get_shard(with_key(key, info)).await.err(),
                ),
                (
                    "PullShard",
                    node.pull_shard(with_key(key, pull_request.clone()))
                        .await
                        .err(),
                ),
                (
                    "ShardStream",
                    node.shard_stream(with_key(key, stream_request.clone()))
                        .await
                        .err(),
                ),
            ];
            for (rpc, error) in outcomes {
                let code = error.map(|e| e.code());
                assert_eq!(
                    code,
                    Some(tonic::Code::PermissionDenied),
                    "{rpc} with {who}"
                );
            }
        }
        // Nothing happened: no drain mark, the map as it was, the data all there.
        let after = {
            use tarn_cluster::ClusterStore;
            store.watch().await.unwrap().borrow().clone()
        };
        assert!(after.draining.is_empty(), "{after:?}");
        assert_eq!(after.collections, state.collections);
        assert_eq!(
            admin.collection_info("guarded").await.unwrap().n_documents,
            4
        );

        // With the right credentials the same calls act: ShardStream (the node credential,
        // which lives in the store beside the cluster id) streams the shard's snapshot (then
        // waits for a fence that never comes), ForgetNode of a live node is refused for that
        // reason, Drain marks the node.
        let node_secret = {
            use tarn_cluster::ClusterStore;
            store
                .identity()
                .await
                .unwrap()
                .identity
                .unwrap()
                .node_secret
        };
        let mut as_node = tonic::Request::new(stream_request.clone());
        as_node.metadata_mut().insert(
            tarn_server::NODE_SECRET_HEADER,
            node_secret.parse().unwrap(),
        );
        let mut node = pb::node_client::NodeClient::new(channel.clone());
        let mut stream = node.shard_stream(as_node).await.unwrap().into_inner();
        let mut cluster = pb::cluster_client::ClusterClient::new(channel.clone());
        let first = stream.message().await.unwrap().unwrap();
        assert!(!first.snapshot.is_empty(), "no snapshot bytes streamed");
        drop(stream);
        // At most 4 streams out at once (each is a thread and a WAL pin); a stream whose taker
        // went away ends and makes room.
        let open_stream = || {
            let mut request = tonic::Request::new(stream_request.clone());
            request.metadata_mut().insert(
                tarn_server::NODE_SECRET_HEADER,
                node_secret.parse().unwrap(),
            );
            let mut node = pb::node_client::NodeClient::new(channel.clone());
            async move { node.shard_stream(request).await }
        };
        tokio::time::sleep(Duration::from_millis(200)).await;
        let mut held = Vec::new();
        for _ in 0..4 {
            held.push(open_stream().await.unwrap().into_inner());
        }
        let refused = open_stream().await.unwrap_err();
        assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused}");
        drop(held);
        tokio::time::sleep(Duration::from_millis(300)).await;
        open_stream().await.unwrap();
        let forget = pb::ForgetNodeRequest {
            node_id: "n2".into(),
            confirm: false,
        };
        let code = cluster
            .forget_node(with_key(Some("rw-key"), forget))
            .await
            .unwrap_err()
            .code();
        assert_eq!(
            code,
            tonic::Code::FailedPrecondition,
            "ForgetNode of a live node"
        );
        for cancel in [false, true] {
            let drain = pb::DrainRequest {
                node_id: "n2".into(),
                cancel,
            };
            cluster
                .drain(with_key(Some("rw-key"), drain))
                .await
                .unwrap();
            let draining = {
                use tarn_cluster::ClusterStore;
                store
                    .watch()
                    .await
                    .unwrap()
                    .borrow()
                    .draining
                    .contains("n2")
            };
            assert_eq!(draining, !cancel, "Drain with cancel = {cancel}");
        }
        for server in servers {
            server.shutdown().await.unwrap();
        }
    });
}

/// Shards per node of `collection`, as `status` shows them (fenced shards count for their owner).
fn owners(status: &tarn_client::ClusterStatus, collection: &str) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    for shard in status.shards.iter().filter(|s| s.collection == collection) {
        *counts.entry(shard.node_id.clone()).or_default() += 1;
    }
    counts
}

/// A document as concurrent writers left it: acknowledged live (with its vector), acknowledged
/// removed, or uncertain (a write that failed may or may not have landed).
#[derive(Debug, Clone, PartialEq)]
enum Doc {
    Live(Vec<f32>),
    Removed,
    Uncertain,
}

/// What concurrent writers got acknowledged, by document (writers own disjoint documents).
type Acked = std::sync::Arc<std::sync::Mutex<BTreeMap<u128, Doc>>>;

/// Writer `w`: upserts of its own documents (ids `w * 1_000_000 + k`, tenant `id % 7`), one
/// removal in five, each recorded when acknowledged (or as uncertain when it fails), until
/// `stop`. Returns the number of acknowledged writes and the failures' messages.
async fn write_until(
    client: Client,
    w: u128,
    dim: usize,
    acked: Acked,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> (u64, Vec<String>) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(w as u64);
    let (mut n, mut failures) = (0u64, Vec::new());
    let mut k = 0u128;
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        let doc = w * 1_000_000 + k;
        k += 1;
        let (target, outcome) = if k.is_multiple_of(5) {
            let old = doc - 3;
            let result = client
                .remove(
                    Remove::new("moving", vec![old])
                        .users(vec![old % 7])
                        .timeout(Duration::from_secs(10)),
                )
                .await;
            (old, result.map(|_| Doc::Removed))
        } else {
            let v = vectors(&mut rng, 1, dim);
            let result = client
                .insert(
                    Insert::new("moving", vec![doc], v.clone())
                        .users(vec![doc % 7])
                        .timeout(Duration::from_secs(10)),
                )
                .await;
            (doc, result.map(|_| Doc::Live(v)))
        };
        match outcome {
            Ok(state) => {
                n += 1;
                acked.lock().unwrap().insert(target, state);
            }
            Err(error) => {
                failures.push(format!("{:?}: {}", error.code(), error.message()));
                acked.lock().unwrap().insert(target, Doc::Uncertain);
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    (n, failures)
}

/// One [`write_until`] writer per client on the `moving` collection; what they acknowledge,
/// the flag that stops them, and their tasks.
#[allow(clippy::type_complexity)]
fn start_writers(
    clients: &[Client],
    dim: usize,
) -> (
    Acked,
    std::sync::Arc<std::sync::atomic::AtomicBool>,
    Vec<tokio::task::JoinHandle<(u64, Vec<String>)>>,
) {
    let acked: Acked = Default::default();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writers = clients
        .iter()
        .enumerate()
        .map(|(w, client)| {
            tokio::spawn(write_until(
                client.clone(),
                1 + w as u128,
                dim,
                acked.clone(),
                stop.clone(),
            ))
        })
        .collect();
    (acked, stop, writers)
}

/// Searches of tenant 3 in `moving` through `client` until `stop`: how many answered, and the
/// failures (code and message).
fn start_searcher(
    client: Client,
    dim: usize,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> tokio::task::JoinHandle<(u64, Vec<String>)> {
    tokio::spawn(async move {
        let (mut ok, mut failures) = (0u64, Vec::new());
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            let search = Search::new("moving", vec![0.5; dim])
                .users(vec![3])
                .top_k(5)
                .timeout(Duration::from_secs(10));
            match client.search(search).await {
                Ok(_) => ok += 1,
                Err(e) => {
                    failures.push(format!("{:?}: {}", e.code(), e.message()));
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
        (ok, failures)
    })
}

/// Every acknowledged write is there, once: Get of every document through `client`, and the
/// collection's document count between the live acknowledged documents and those plus the
/// uncertain ones (a duplicate would go past it).
async fn check_acked(client: &Client, acked: &Acked) {
    let expected: BTreeMap<u128, Doc> = acked.lock().unwrap().clone();
    let (mut live, mut uncertain) = (0u64, 0u64);
    for (doc, state) in &expected {
        // A token-less read through a copy that has just restarted answers from its checkpoint
        // until its primary's follower reaches it (docs/CLUSTER.md, "What a read sees"): a
        // document missing, older or still there is read again for up to 5 s.
        let started = Instant::now();
        let got = loop {
            let got = client.get("moving", doc % 7, &[*doc]).await.unwrap();
            let right = match state {
                Doc::Live(v) => got.len() == 1 && &got[0].vector == v,
                Doc::Removed => got.is_empty(),
                Doc::Uncertain => true,
            };
            if right || started.elapsed() > Duration::from_secs(5) {
                break got;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        match state {
            Doc::Live(v) => {
                live += 1;
                assert_eq!(got.len(), 1, "acknowledged document {doc} is missing");
                assert_eq!(&got[0].vector, v, "document {doc} has another vector");
            }
            Doc::Removed => assert!(got.is_empty(), "removed document {doc} is back"),
            Doc::Uncertain => uncertain += 1,
        }
    }
    let n = client.collection_info("moving").await.unwrap().n_documents;
    assert!(
        (live..=live + uncertain).contains(&n),
        "{n} documents counted over the shards; {live} acknowledged live, {uncertain} uncertain"
    );
}

/// A real etcd and three nodes (leases of `lease` seconds, each started with `extra`) holding
/// the one-shard collection `moving` (dimension 8, `copies` copies, min_in_sync 1), every copy
/// in sync. Fields drop in order: the nodes, etcd, then the directory.
struct OneShardCluster {
    nodes: Vec<Node>,
    etcd: Etcd,
    rt: tokio::runtime::Runtime,
    addrs: Vec<String>,
    /// Indexes into `nodes`: the shard's primary, its replicas, and the nodes with no copy.
    primary: usize,
    replicas: Vec<usize>,
    others: Vec<usize>,
    dir: tempfile::TempDir,
}

/// [`OneShardCluster`]; `None` (SKIPPED printed) where etcd cannot be had.
fn one_shard_cluster(lease: u64, copies: u32, extra: &[&str]) -> Option<OneShardCluster> {
    let binary = etcd_binary()?;
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(binary, &dir.path().join("etcd"));
    let nodes = nodes_with(dir.path(), 3, &etcd.endpoint(), lease, extra, &[]);
    let rt = runtime();
    let addrs: Vec<String> = nodes.iter().map(|n| n.addr()).collect();
    let status = rt.block_on(async {
        let client = Client::connect(addrs[0].clone()).await.unwrap();
        create_moving(&client, 8, 1, copies, 1).await;
        wait_in_sync(&addrs[0], copies as usize).await
    });
    let shard = moving_shard(&status);
    let index = |id: &str| nodes.iter().position(|n| n.id == id).unwrap();
    let primary = index(&shard.node_id);
    let replicas: Vec<usize> = shard.replicas.iter().map(|id| index(id)).collect();
    let others = (0..3)
        .filter(|i| *i != primary && !replicas.contains(i))
        .collect();
    Some(OneShardCluster {
        nodes,
        etcd,
        rt,
        addrs,
        primary,
        replicas,
        others,
        dir,
    })
}

/// The status of `moving`'s shard 0.
fn moving_shard(status: &tarn_client::ClusterStatus) -> tarn_client::ShardStatus {
    status
        .shards
        .iter()
        .find(|s| s.collection == "moving" && s.shard == 0)
        .unwrap()
        .clone()
}

/// Copies a stopped etcd's data directory (`cp -a`), as a backup of its volume would.
fn copy_etcd_data(from: &Path, to: &Path) {
    let _ = std::fs::remove_dir_all(to);
    let copied = Command::new("cp")
        .arg("-a")
        .arg(from)
        .arg(to)
        .status()
        .unwrap();
    assert!(
        copied.success(),
        "cp -a {} {}",
        from.display(),
        to.display()
    );
}

/// Polls a write through each of `addrs` until every one is refused UNAVAILABLE because the
/// node fenced itself (`what` happened to etcd); panics after `limit`.
async fn wait_until_fenced(addrs: &[String], limit: Duration, what: &str) {
    let deadline = Instant::now() + limit;
    for addr in addrs {
        let client = Client::connect(addr.clone()).await.unwrap();
        loop {
            let insert = Insert::new("moving", vec![7 * 999_999], vec![0.5; 8])
                .users(vec![0])
                .durability(Durability::Fsync)
                .timeout(Duration::from_secs(2));
            match client.insert(insert).await {
                Err(e) if e.code() == Code::Unavailable && e.to_string().contains("fenced") => {
                    break
                }
                outcome => assert!(
                    Instant::now() < deadline,
                    "node at {addr} did not fence itself after {what}: {outcome:?}"
                ),
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

/// The etcd revision a node's data directory says it acted on (its cluster ledger).
fn ledger_revision(data_dir: &Path) -> i64 {
    let ledger = std::fs::read(data_dir.join("CLUSTER_LEDGER")).unwrap();
    let ledger: serde_json::Value = serde_json::from_slice(&ledger).unwrap();
    ledger["revision"].as_i64().unwrap()
}

/// Writes a key outside tarn's prefix until etcd's revision is past `revision`.
async fn advance_etcd_past(endpoint: &str, revision: i64) {
    let client = tarn_cluster::etcd_api::EtcdClient::connect(
        &[endpoint.to_owned()],
        &tarn_cluster::etcd_api::ConnectOptions::default(),
    )
    .unwrap();
    loop {
        let put = client.put(b"/elsewhere/counter", b"x", 0).await.unwrap();
        if put.header.unwrap().revision > revision + 5 {
            return;
        }
    }
}

/// etcd restored from a backup taken before a drain (its volume copied while stopped, then put
/// back after the drain and more writes): every node fences itself (writes refused
/// UNAVAILABLE "fenced", no copy deleted, set aside or created); a restart is refused naming
/// `--accept-etcd-rollback`, also once the restored etcd was written to past every revision
/// the nodes saw (its history differs at the newest write a node acted on: before, a node
/// compared revisions only and joined, and CI saw that when lease expiries and registrations
/// had moved the restored etcd past a node's revision); and with it the node that took the shard sets its newer copy
/// aside (its record is older than the epoch it held it at) while the node that gave it away
/// never starts it empty: no Get answers OK without an acknowledged document, and every
/// acknowledged document is in a copy on disk. Before, the new owner deleted its copy and the
/// old one served an empty shard: Gets answered OK with the writes since the backup missing.
#[test]
fn processes_an_etcd_restored_from_an_older_backup_fences_the_nodes_and_loses_nothing() {
    let Some((dir, mut etcd, mut nodes)) = real_cluster(3, 2) else {
        return;
    };
    const DIM: usize = 8;
    let rt = runtime();
    let addrs: Vec<String> = nodes.iter().map(|n| n.addr()).collect();
    let client = rt.block_on(Client::connect(addrs[0].clone())).unwrap();
    rt.block_on(create_moving(&client, DIM, 2, 1, 1));
    let acked: Acked = Default::default();
    let write = |from: u128, to: u128| {
        rt.block_on(async {
            for batch in (from..to).step_by(20) {
                let docs = (batch..batch + 20).map(|k| k * 7).collect();
                insert_settled(&client, &acked, docs).await;
            }
        })
    };
    write(0, 300);
    // The backup: etcd stopped, its volume copied, started again.
    let backup = dir.path().join("etcd-backup");
    etcd.stop();
    copy_etcd_data(&etcd.dir, &backup);
    etcd.restart();
    let status = rt.block_on(wait_for_status(
        &client,
        Duration::from_secs(20),
        "the cluster back after the backup",
        |s| s.nodes.iter().filter(|n| n.alive).count() == 3,
    ));
    let owner = status
        .shards
        .iter()
        .find(|s| s.collection == "moving")
        .unwrap()
        .node_id
        .clone();
    // A drain moves the owner's shards away; more writes land on their new owners.
    rt.block_on(async {
        client.drain_node(&owner, false).await.unwrap();
        wait_for_status(&client, Duration::from_secs(60), "the drain", |s| {
            s.shards
                .iter()
                .all(|s| s.collection != "moving" || s.node_id != owner)
        })
        .await;
    });
    write(300, 600);
    // etcd lost and restored from the backup.
    etcd.stop();
    let _ = std::fs::remove_dir_all(&etcd.dir);
    copy_etcd_data(&backup, &etcd.dir);
    etcd.restart();
    rt.block_on(wait_until_fenced(
        &addrs,
        Duration::from_secs(20),
        "etcd restored from an older backup",
    ));
    // Nothing was deleted: every acknowledged document is in a copy on disk.
    for node in &mut nodes {
        node.kill();
    }
    let on_disk: std::collections::BTreeSet<u128> = nodes
        .iter()
        .flat_map(|n| local_copies(&n.dir, "moving").into_values().flatten())
        .map(|(_, doc)| doc)
        .collect();
    for (doc, state) in acked.lock().unwrap().iter() {
        if matches!(state, Doc::Live(_)) {
            assert!(
                on_disk.contains(doc),
                "acknowledged document {doc} is on no disk"
            );
        }
    }
    // Other writers move the restored etcd past every revision a node saw: its revision alone
    // no longer tells it apart.
    let seen = nodes.iter().map(|n| ledger_revision(&n.dir)).max().unwrap();
    rt.block_on(advance_etcd_past(&etcd.endpoint(), seen));
    // A restart is refused against the older history, naming the way out.
    let log = nodes[0]
        .try_start(&etcd.endpoint(), &[], &[])
        .expect_err("a node joined an etcd behind its history");
    assert!(log.contains("--accept-etcd-rollback"), "{log}");
    for node in &mut nodes {
        node.try_start(&etcd.endpoint(), &["--accept-etcd-rollback"], &[])
            .unwrap();
    }
    // No Get answers OK without an acknowledged document (a shard whose copy is set aside or
    // was never started empty answers UNAVAILABLE).
    rt.block_on(async {
        let client = Client::connect(addrs[0].clone()).await.unwrap();
        tokio::time::sleep(Duration::from_secs(3)).await;
        let expected = acked.lock().unwrap().clone();
        assert_no_get_without_its_document(&client, &expected).await;
        let started = Instant::now();
        while n_set_aside(&addrs).await == 0 {
            assert!(
                started.elapsed() < Duration::from_secs(15),
                "the copy newer than its record was not set aside"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    });
}

/// etcd restored from a backup taken before a failover of a replicated shard (2 copies): the
/// primary is killed after the backup, its replica promoted at the next epoch, more writes
/// acknowledged, the old primary back as a replica; then etcd is put back to the backup. Every
/// node fences itself; restarted with `--accept-etcd-rollback`, no copy is deleted and no Get
/// answers OK without an acknowledged document (both copies are held at a later epoch than the
/// restored record, which names the old primary at the old epoch: nothing may serve the shard
/// as that record says), and every acknowledged document comes back by importing the set-aside
/// copies into a new collection, as docs/CLUSTER.md's procedure says. Before, the old primary
/// set its copy aside and then started the shard empty (the restored record names its data
/// directory as where the shard is created), so Gets answered OK with every acknowledged
/// document missing; and a read spread to the old replica, whose copy was set aside too, was
/// answered "stale map" and retried until its deadline.
#[test]
fn processes_an_etcd_restored_from_before_a_failover_keeps_every_replicated_write() {
    let Some((dir, mut etcd, mut nodes)) = real_cluster(3, 2) else {
        return;
    };
    const DIM: usize = 8;
    let rt = runtime();
    let addrs: Vec<String> = nodes.iter().map(|n| n.addr()).collect();
    let acked: Acked = Default::default();
    let write = |to: &str, from: u128, until: u128| {
        rt.block_on(async {
            let client = Client::connect(to.to_owned()).await.unwrap();
            for batch in (from..until).step_by(20) {
                let docs = (batch..batch + 20).map(|k| k * 7).collect();
                insert_settled(&client, &acked, docs).await;
            }
        })
    };
    let client = rt.block_on(Client::connect(addrs[0].clone())).unwrap();
    rt.block_on(create_moving(&client, DIM, 1, 2, 1));
    let shard = rt.block_on(wait_for_status(
        &client,
        Duration::from_secs(20),
        "the shard's replica in sync",
        |s| {
            s.shards
                .iter()
                .any(|s| s.collection == "moving" && s.in_sync.len() == 2)
        },
    ));
    let shard = moving_shard(&shard);
    let primary = nodes.iter().position(|n| n.id == shard.node_id).unwrap();
    let replica = nodes
        .iter()
        .position(|n| n.id == shard.replicas[0])
        .unwrap();
    let third = 3 - primary - replica;
    write(&addrs[third], 0, 300);
    // The backup: etcd stopped, its volume copied, started again.
    let backup = dir.path().join("etcd-backup");
    etcd.stop();
    copy_etcd_data(&etcd.dir, &backup);
    etcd.restart();
    // The primary killed: its replica is promoted at the next epoch and takes more writes.
    let since = Instant::now();
    nodes[primary].kill();
    let third_client = rt.block_on(Client::connect(addrs[third].clone())).unwrap();
    rt.block_on(wait_promoted(&third_client, &nodes[replica].id, since));
    write(&addrs[third], 300, 600);
    // The old primary back, as a replica that catches up.
    nodes[primary].start(&etcd.endpoint());
    rt.block_on(wait_for_status(
        &third_client,
        Duration::from_secs(30),
        "the old primary back in sync",
        |s| {
            s.shards.iter().any(|s| {
                s.collection == "moving" && s.in_sync.iter().any(|n| *n == nodes[primary].id)
            })
        },
    ));
    write(&addrs[third], 600, 700);
    // etcd lost and restored from the backup.
    etcd.stop();
    let _ = std::fs::remove_dir_all(&etcd.dir);
    copy_etcd_data(&backup, &etcd.dir);
    etcd.restart();
    rt.block_on(wait_until_fenced(
        &addrs,
        Duration::from_secs(20),
        "etcd restored from an older backup",
    ));
    for node in &mut nodes {
        node.kill();
    }
    let on_disk = |nodes: &[Node]| -> std::collections::BTreeSet<u128> {
        nodes
            .iter()
            .flat_map(|n| local_copies(&n.dir, "moving").into_values().flatten())
            .map(|(_, doc)| doc)
            .collect()
    };
    let expected = acked.lock().unwrap().clone();
    let held = on_disk(&nodes);
    for (doc, state) in &expected {
        if matches!(state, Doc::Live(_)) {
            assert!(
                held.contains(doc),
                "acknowledged document {doc} is on no disk"
            );
        }
    }
    for node in &mut nodes {
        node.try_start(&etcd.endpoint(), &["--accept-etcd-rollback"], &[])
            .unwrap();
    }
    rt.block_on(async {
        let client = Client::connect(addrs[third].clone()).await.unwrap();
        tokio::time::sleep(Duration::from_secs(3)).await;
        // No Get answers OK without an acknowledged document.
        assert_no_get_without_its_document(&client, &expected).await;
        // Both copies, held at a later epoch than the restored record, are set aside.
        let started = Instant::now();
        while n_set_aside(&addrs).await < 2 {
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "the copies newer than their record were not set aside"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        // Imported into a new collection, they hold every acknowledged document.
        client
            .create_collection(
                CollectionSpec::new("recovered", DIM as u32)
                    .metric(Metric::L2)
                    .shards(1, ShardKey::Doc),
            )
            .await
            .unwrap();
        for addr in &addrs {
            let node_client = Client::connect(addr.clone()).await.unwrap();
            for copy in node_client.list_set_aside().await.unwrap() {
                let n = node_client
                    .import_set_aside(&copy.name, "recovered")
                    .await
                    .unwrap();
                eprintln!("imported {n} documents from {} on {addr}", copy.name);
            }
        }
        for (doc, state) in &expected {
            if let Doc::Live(v) = state {
                let got = client.get("recovered", doc % 7, &[*doc]).await.unwrap();
                assert_eq!(
                    got.len(),
                    1,
                    "acknowledged document {doc} was not recovered"
                );
                assert_eq!(&got[0].vector, v, "document {doc} has another vector");
            }
        }
    });
}

/// Gets each acknowledged live document of `expected` from `moving` through `client`: each
/// answers OK with the document and its vector, or is refused UNAVAILABLE or
/// FAILED_PRECONDITION (after an accepted etcd rollback, a shard whose copy was set aside or
/// never started empty); never OK without it.
async fn assert_no_get_without_its_document(client: &Client, expected: &BTreeMap<u128, Doc>) {
    let (mut answered, mut refused) = (0, 0);
    for (doc, state) in expected {
        let Doc::Live(v) = state else { continue };
        match client.get("moving", doc % 7, &[*doc]).await {
            Ok(got) => {
                assert_eq!(got.len(), 1, "acknowledged document {doc} is missing");
                assert_eq!(&got[0].vector, v);
                answered += 1;
            }
            Err(e) => {
                assert!(
                    matches!(e.code(), Code::Unavailable | Code::FailedPrecondition),
                    "{e}"
                );
                refused += 1;
            }
        }
    }
    eprintln!("after the accepted rollback: {answered} documents read, {refused} refused");
}

/// How many copies the nodes at `addrs` set aside.
async fn n_set_aside(addrs: &[String]) -> usize {
    let mut n = 0;
    for addr in addrs {
        let client = Client::connect(addr.clone()).await.unwrap();
        n += client.list_set_aside().await.unwrap().len();
    }
    n
}

/// etcd wiped and restarted empty under running nodes: every node fences itself (writes refused
/// UNAVAILABLE "fenced"), none registers again into the empty etcd, and no copy is set aside
/// or deleted. Before, every copy of every collection was set aside at once and the nodes
/// registered again into the empty etcd, which then looked like a healthy, empty cluster.
#[test]
fn processes_an_etcd_wiped_under_running_nodes_fences_them() {
    let Some((_dir, mut etcd, nodes)) = real_cluster(2, 2) else {
        return;
    };
    const DIM: usize = 8;
    let rt = runtime();
    let addrs: Vec<String> = nodes.iter().map(|n| n.addr()).collect();
    let client = rt.block_on(Client::connect(addrs[0].clone())).unwrap();
    rt.block_on(create_moving(&client, DIM, 2, 1, 1));
    let acked: Acked = Default::default();
    rt.block_on(async {
        insert_recorded(
            &client,
            &acked,
            (0..40).map(|k| k * 7).collect(),
            Duration::from_secs(10),
        )
        .await
        .unwrap();
    });
    let before: Vec<usize> = nodes.iter().map(|n| shard_dirs(n, "moving")).collect();
    etcd.stop();
    std::fs::remove_dir_all(&etcd.dir).unwrap();
    etcd.restart();
    rt.block_on(async {
        wait_until_fenced(&addrs, Duration::from_secs(20), "etcd wiped").await;
        // Longer than a lease: nobody registered again, nothing was set aside.
        tokio::time::sleep(Duration::from_secs(3)).await;
        let raw = raw_etcd(&etcd.endpoint());
        let registered = raw.get(b"/tarn/nodes/", true).await.unwrap();
        assert!(
            registered.kvs.is_empty(),
            "a node registered into the wiped etcd"
        );
        assert_eq!(n_set_aside(&addrs).await, 0);
    });
    let after: Vec<usize> = nodes.iter().map(|n| shard_dirs(n, "moving")).collect();
    assert_eq!(after, before);
}

/// A node's view of the in-memory store in which its first flip of a moved shard lands but the
/// answer is lost ("etcd did not answer"), and its watch then lags by `lag` (changes held back).
#[derive(Debug)]
struct LosingFlipStore {
    inner: std::sync::Arc<tarn_cluster::MemoryStore>,
    node_id: String,
    armed: std::sync::atomic::AtomicBool,
    lag: Duration,
    frozen_until: std::sync::Arc<std::sync::Mutex<Option<Instant>>>,
    tx: std::sync::Arc<tokio::sync::watch::Sender<std::sync::Arc<tarn_cluster::ClusterState>>>,
    forwarding: std::sync::atomic::AtomicBool,
}

impl LosingFlipStore {
    fn new(inner: std::sync::Arc<tarn_cluster::MemoryStore>, node_id: &str, lag: Duration) -> Self {
        let (tx, _) = tokio::sync::watch::channel(std::sync::Arc::default());
        LosingFlipStore {
            inner,
            node_id: node_id.to_owned(),
            armed: std::sync::atomic::AtomicBool::new(true),
            lag,
            frozen_until: std::sync::Arc::default(),
            tx: std::sync::Arc::new(tx),
            forwarding: std::sync::atomic::AtomicBool::new(false),
        }
    }

    fn fired(&self) -> bool {
        !self.armed.load(std::sync::atomic::Ordering::Relaxed)
    }
}

#[async_trait::async_trait]
impl tarn_cluster::ClusterStore for LosingFlipStore {
    async fn register(
        &self,
        node: &tarn_cluster::NodeInfo,
        ttl: Duration,
    ) -> tarn_cluster::Result<tarn_cluster::Registration> {
        self.inner.register(node, ttl).await
    }

    async fn watch(
        &self,
    ) -> tarn_cluster::Result<
        tokio::sync::watch::Receiver<std::sync::Arc<tarn_cluster::ClusterState>>,
    > {
        let mut source = self.inner.watch().await?;
        self.tx.send_replace(source.borrow_and_update().clone());
        if !self
            .forwarding
            .swap(true, std::sync::atomic::Ordering::Relaxed)
        {
            let tx = self.tx.clone();
            let frozen = self.frozen_until.clone();
            tokio::spawn(async move {
                while source.changed().await.is_ok() {
                    loop {
                        let until = *frozen.lock().unwrap();
                        match until {
                            Some(t) if Instant::now() < t => {
                                tokio::time::sleep(Duration::from_millis(50)).await
                            }
                            _ => break,
                        }
                    }
                    tx.send_replace(source.borrow_and_update().clone());
                }
            });
        }
        Ok(self.tx.subscribe())
    }

    async fn create_collection(
        &self,
        map: &tarn_cluster::CollectionMap,
    ) -> tarn_cluster::Result<bool> {
        self.inner.create_collection(map).await
    }

    async fn drop_collection(&self, name: &str) -> tarn_cluster::Result<bool> {
        self.inner.drop_collection(name).await
    }

    async fn compare_and_set_shard(
        &self,
        swap: &tarn_cluster::ShardSwap<'_>,
    ) -> tarn_cluster::Result<bool> {
        let flip = swap.new.owner == self.node_id
            && swap.new.takes_writes()
            && swap.new.moving_to.is_none();
        if flip && self.armed.swap(false, std::sync::atomic::Ordering::Relaxed) {
            let landed = self.inner.compare_and_set_shard(swap).await?;
            assert!(landed, "the flip under test did not land");
            *self.frozen_until.lock().unwrap() = Some(Instant::now() + self.lag);
            return Err(tarn_cluster::ClusterError::StoreUnavailable(
                "test: the flip landed but its answer was lost".to_owned(),
            ));
        }
        self.inner.compare_and_set_shard(swap).await
    }

    async fn read_shard(
        &self,
        collection: &str,
        uid: u64,
        shard: u32,
    ) -> tarn_cluster::Result<tarn_cluster::ShardRecord> {
        self.inner.read_shard(collection, uid, shard).await
    }

    async fn read_copy_evidence(
        &self,
        collection: &str,
        uid: u64,
        shard: u32,
    ) -> tarn_cluster::Result<tarn_cluster::CopyEvidence> {
        self.inner.read_copy_evidence(collection, uid, shard).await
    }

    async fn identity(&self) -> tarn_cluster::Result<tarn_cluster::StoreIdentity> {
        self.inner.identity().await
    }

    async fn create_identity(
        &self,
        proposed: &tarn_cluster::ClusterIdentity,
    ) -> tarn_cluster::Result<tarn_cluster::ClusterIdentity> {
        self.inner.create_identity(proposed).await
    }

    async fn record_move_failure(
        &self,
        collection: &str,
        shard: u32,
        failure: Option<&tarn_cluster::MoveFailure>,
    ) -> tarn_cluster::Result<()> {
        self.inner
            .record_move_failure(collection, shard, failure)
            .await
    }

    async fn set_draining(&self, node_id: &str, draining: bool) -> tarn_cluster::Result<()> {
        self.inner.set_draining(node_id, draining).await
    }

    async fn campaign(
        &self,
        election: &str,
        node_id: &str,
    ) -> tarn_cluster::Result<tarn_cluster::Leader> {
        self.inner.campaign(election, node_id).await
    }
}

/// A move whose flip lands while the taker is told etcd did not answer, and whose taker's view
/// then lags 8 s behind (longer than any wait on it): the taker must settle the flip from etcd
/// itself (a linearizable read), not from its view, and keep its copy; the old owner drops its
/// own on seeing the flip. Every acknowledged document is there afterwards. (Deciding from the
/// lagging view, the taker dropped its copy too, and then served an empty shard.)
#[test]
fn a_move_whose_flip_answer_is_lost_keeps_the_data() {
    let dir = tempfile::tempdir().unwrap();
    const DIM: usize = 8;
    runtime().block_on(async {
        let store = std::sync::Arc::new(tarn_cluster::MemoryStore::default());
        let n1 = memory_node(dir.path(), 1, &store).await;
        let c1 = Client::connect(n1.grpc_addr()).await.unwrap();
        c1.create_collection(
            CollectionSpec::new("flip", DIM as u32)
                .metric(Metric::L2)
                .shards(2, ShardKey::Doc),
        )
        .await
        .unwrap();
        let docs = insert_docs(&c1, "flip", 1, 300, DIM).await;
        let faulty = std::sync::Arc::new(LosingFlipStore::new(
            store.clone(),
            "n2",
            Duration::from_secs(8),
        ));
        let n2 = memory_node_with(dir.path(), 2, &store, |config| {
            config.cluster.as_mut().unwrap().store = Some(faulty.clone());
        })
        .await;
        wait_for_status(&c1, Duration::from_secs(30), "a shard moved to n2", |s| {
            s.shards
                .iter()
                .filter(|s| s.node_id == "n2" && s.state == "serving")
                .count()
                == 1
        })
        .await;
        assert!(faulty.fired(), "the flip's answer was never lost");
        // Past the lag: both views agree, and nothing was lost.
        tokio::time::sleep(Duration::from_secs(9)).await;
        let c2 = Client::connect(n2.grpc_addr()).await.unwrap();
        assert_all_there(&c1, "flip", &docs).await;
        assert_all_there(&c2, "flip", &docs).await;
        assert_eq!(
            c1.collection_info("flip").await.unwrap().n_documents,
            docs.len() as u64
        );
        n2.shutdown().await.unwrap();
        n1.shutdown().await.unwrap();
    });
}

/// A read token names each shard's epoch: once a shard was given up (`forget`), a token for a
/// write on it answers FAILED_PRECONDITION at once (it named a log that is gone: later writes
/// to the new, empty shard must not satisfy it), while a token for a write after the forget
/// reads as usual.
#[test]
fn a_read_token_of_a_given_up_shard_fails_at_once() {
    let dir = tempfile::tempdir().unwrap();
    const DIM: usize = 4;
    runtime().block_on(async {
        let (mut servers, _store) = memory_cluster(dir.path(), 2).await;
        let c1 = Client::connect(servers[0].grpc_addr()).await.unwrap();
        c1.create_collection(
            CollectionSpec::new("tok", DIM as u32)
                .metric(Metric::L2)
                .shards(2, ShardKey::Doc),
        )
        .await
        .unwrap();
        let status = c1.cluster_status().await.unwrap();
        let n2_shard = status
            .shards
            .iter()
            .find(|s| s.node_id == "n2")
            .unwrap()
            .shard;
        let on_n2: Vec<u128> = (0u128..)
            .filter(|d| tarn_cluster::shard_for(*d, 2) == n2_shard)
            .take(21)
            .collect();
        let doc = on_n2[20];
        let mut ack = None;
        for d in &on_n2[..20] {
            // Several writes, so the token's position is past what an empty shard reaches soon.
            ack = Some(
                c1.insert(Insert::new("tok", [*d], vec![0.5; DIM]))
                    .await
                    .unwrap(),
            );
        }
        let token = ack.unwrap().read_token();
        let search = |token| Search::new("tok", vec![0.5; DIM]).top_k(3).after(token);
        c1.search(search(token.clone())).await.unwrap();
        // n2 dies; its shard is given up to n1, empty.
        servers.pop().unwrap().shutdown().await.unwrap();
        wait_for_status(&c1, Duration::from_secs(10), "n2 dead", |s| {
            s.nodes.iter().any(|n| n.node_id == "n2" && !n.alive)
        })
        .await;
        c1.forget_node("n2", true).await.unwrap();
        let started = Instant::now();
        let error = c1.search(search(token)).await.unwrap_err();
        assert_eq!(error.code(), Code::FailedPrecondition, "{error}");
        assert!(error.message().contains("given up"), "{error}");
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "{:?}",
            started.elapsed()
        );
        let after = c1
            .insert(Insert::new("tok", [doc], vec![0.25; DIM]))
            .await
            .unwrap();
        let hits = c1.search(search(after.read_token())).await.unwrap();
        assert_eq!(hits.len(), 1);
        servers.pop().unwrap().shutdown().await.unwrap();
    });
}

/// GetCollection's tenant count over shards: exact with USER sharding, never a tenant counted
/// once per shard with DOC sharding.
/// The port a node advertises, from status.
fn port_of(status: &tarn_client::ClusterStatus, node_id: &str) -> String {
    let node = status.nodes.iter().find(|n| n.node_id == node_id).unwrap();
    node.address.rsplit(':').next().unwrap().to_owned()
}

/// `GET /metrics` of a node.
fn http_get(addr: std::net::SocketAddr) -> String {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    write!(
        stream,
        "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut body = String::new();
    stream.read_to_string(&mut body).unwrap();
    body
}

/// The documents of every local copy of `collection`'s shards in a (stopped) node's data
/// directory, by shard number.
fn local_copies(node_dir: &Path, collection: &str) -> BTreeMap<u32, Vec<(u128, u128)>> {
    let mut copies = BTreeMap::new();
    let Ok(entries) = std::fs::read_dir(node_dir.join("collections")) else {
        return copies;
    };
    for entry in entries {
        let entry = entry.unwrap();
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some((shard, None)) = tarn_cluster::ShardName::parse(&name) else {
            continue;
        };
        if shard.collection != collection {
            continue;
        }
        let copy = tarn_collection::Collection::open_whole(&entry.path()).unwrap();
        let mut docs: Vec<(u128, u128)> = copy
            .export_documents()
            .map(|d| d.map(|(u, d, _)| (u, d)).unwrap())
            .collect();
        docs.sort_unstable();
        copy.close();
        copies.insert(shard.shard, docs);
    }
    copies
}

/// Asserts that each of the `n_shards` shards of `collection` has `n_copies` copies in the
/// (stopped) nodes' data directories `node_dirs`, all holding the same documents; returns each
/// shard's documents.
fn assert_copies_identical(
    node_dirs: impl IntoIterator<Item = impl AsRef<Path>>,
    collection: &str,
    n_shards: u32,
    n_copies: usize,
) -> BTreeMap<u32, Vec<(u128, u128)>> {
    let copies: Vec<BTreeMap<u32, Vec<(u128, u128)>>> = node_dirs
        .into_iter()
        .map(|d| local_copies(d.as_ref(), collection))
        .collect();
    (0..n_shards)
        .map(|shard| {
            let held: Vec<&Vec<(u128, u128)>> =
                copies.iter().filter_map(|c| c.get(&shard)).collect();
            assert_eq!(held.len(), n_copies, "shard {shard}'s copies");
            assert!(
                held.windows(2).all(|w| w[0] == w[1]),
                "the copies of shard {shard} differ"
            );
            (shard, held[0].clone())
        })
        .collect()
}

/// Replicas: a write is acknowledged once every in-sync copy has it durable; a replica that
/// stops answering leaves the in-sync set (in the store's record) before any write is
/// acknowledged without it; with fewer copies in sync than `min_in_sync`, writes are refused
/// (UNAVAILABLE naming both counts) and never acknowledged on fewer; a replica that comes back
/// catches up from the primary's log and rejoins the in-sync set; afterwards every copy of a
/// shard holds the same documents, and every acknowledged document is there. Refusals: a
/// replication factor above the live nodes (FAILED_PRECONDITION naming both numbers).
#[test]
fn replicas_acknowledge_on_every_in_sync_copy_and_a_returning_one_rejoins() {
    let dir = tempfile::tempdir().unwrap();
    let rt = runtime();
    rt.block_on(async {
        let store = std::sync::Arc::new(tarn_cluster::MemoryStore::default());
        let with_metrics = |config: &mut tarn_server::ServeConfig| {
            config.metrics_listen = Some("127.0.0.1:0".to_owned());
            // No --replication-factor: the built-in default.
            if let Some(cluster) = config.cluster.as_mut() {
                cluster.replication_factor = 0;
            }
        };
        let mut servers = Vec::new();
        for i in 1..=3 {
            servers.push(memory_node_with(dir.path(), i, &store, with_metrics).await);
        }
        let client = Client::connect(servers[0].grpc_addr()).await.unwrap();
        const DIM: usize = 4;
        let error = client
            .create_collection(CollectionSpec::new("too_many", DIM as u32).replicas(4, 0))
            .await
            .unwrap_err();
        assert_eq!(error.code(), Code::FailedPrecondition, "{error}");
        assert!(
            error
                .message()
                .contains("replication_factor 4 needs 4 live nodes, and the cluster has 3"),
            "{error}"
        );
        // `r`: 2 shards, 3 copies each, 2 needed in sync; `s`: 3 shards, 2 copies, 2 needed.
        client
            .create_collection(
                CollectionSpec::new("r", DIM as u32)
                    .metric(Metric::L2)
                    .shards(2, ShardKey::Doc)
                    .replicas(3, 0),
            )
            .await
            .unwrap();
        client
            .create_collection(
                CollectionSpec::new("s", DIM as u32)
                    .metric(Metric::L2)
                    .shards(3, ShardKey::Doc)
                    .replicas(2, 2),
            )
            .await
            .unwrap();
        let info = client.collection_info("r").await.unwrap();
        assert_eq!((info.replication_factor, info.min_in_sync), (3, 2));
        // Without a factor: the server's default, 2 copies (1 needed in sync).
        client
            .create_collection(CollectionSpec::new("default_copies", DIM as u32))
            .await
            .unwrap();
        let info = client.collection_info("default_copies").await.unwrap();
        assert_eq!((info.replication_factor, info.min_in_sync), (2, 1));
        client.drop_collection("default_copies").await.unwrap();
        let status = client.cluster_status().await.unwrap();
        for shard in status.shards.iter().filter(|s| s.collection == "r") {
            assert_eq!(shard.in_sync.len(), 3, "{shard:?}");
            assert_eq!(shard.in_sync[0], shard.node_id);
            assert_eq!(shard.replicas.len(), 2, "{shard:?}");
        }
        let mut rng = rand::rngs::StdRng::seed_from_u64(31);
        let mut acked: BTreeMap<u128, Vec<f32>> = BTreeMap::new();
        let v = vectors(&mut rng, 100, DIM);
        let ids: Vec<u128> = (0..100).collect();
        let ack = client
            .insert(Insert::new("r", ids.clone(), v.clone()))
            .await
            .unwrap();
        for (i, id) in ids.iter().enumerate() {
            acked.insert(*id, v[i * DIM..(i + 1) * DIM].to_vec());
        }
        // Reads are spread over the in-sync copies: every server holds one of each of r's
        // shards and answers from it, without forwarding; the write's read token makes each
        // copy wait until it has applied the write.
        for server in &servers {
            let local = Client::connect(server.grpc_addr()).await.unwrap();
            let hits = local
                .search(
                    Search::new("r", vec![0.0; DIM])
                        .top_k(100)
                        .exact(true)
                        .after(ack.read_token()),
                )
                .await
                .unwrap();
            assert_eq!(hits.len(), 100, "read your write on every copy");
            let metrics = http_get(server.metrics_addr().unwrap());
            assert!(
                !metrics.contains("tarn_cluster_forwarded_total{method=\"Search\"}"),
                "a search was forwarded although this node holds in-sync copies: {metrics}"
            );
        }
        // The node that is primary of none of r's shards goes away (no failover is needed).
        let primaries: Vec<String> = status
            .shards
            .iter()
            .filter(|s| s.collection == "r")
            .map(|s| s.node_id.clone())
            .collect();
        let gone = (1..=3)
            .map(|i| format!("n{i}"))
            .find(|n| !primaries.contains(n))
            .unwrap();
        let gone_idx: usize = gone[1..].parse::<usize>().unwrap() - 1;
        let survivor = servers
            .iter()
            .enumerate()
            .find(|(i, _)| *i != gone_idx)
            .map(|(_, s)| s.grpc_addr())
            .unwrap();
        let client = Client::connect(survivor).await.unwrap();
        // s's shard of which `gone` is the replica (its primary lives).
        let s_shard = status
            .shards
            .iter()
            .find(|s| s.collection == "s" && s.replicas.contains(&gone) && s.node_id != gone)
            .unwrap()
            .shard;
        servers.remove(gone_idx).shutdown().await.unwrap();
        store.expire(&gone);
        // r goes on once `gone` left the in-sync set (within the 2 s bound).
        let started = Instant::now();
        let v = vectors(&mut rng, 100, DIM);
        let ids: Vec<u128> = (100..200).collect();
        client
            .insert(Insert::new("r", ids.clone(), v.clone()))
            .await
            .unwrap();
        for (i, id) in ids.iter().enumerate() {
            acked.insert(*id, v[i * DIM..(i + 1) * DIM].to_vec());
        }
        assert!(
            started.elapsed() < Duration::from_secs(8),
            "{:?}",
            started.elapsed()
        );
        let status = client.cluster_status().await.unwrap();
        for shard in status.shards.iter().filter(|s| s.collection == "r") {
            assert_eq!(shard.in_sync.len(), 2, "{shard:?}");
            assert!(!shard.in_sync.contains(&gone), "{shard:?}");
            assert!(shard.replicas.contains(&gone), "still a replica: {shard:?}");
            // The primary's metrics say so too.
            let primary = servers
                .iter()
                .find(|s| {
                    s.grpc_addr()
                        .ends_with(&format!(":{}", port_of(&status, &shard.node_id)))
                })
                .unwrap();
            let metrics = http_get(primary.metrics_addr().unwrap());
            let line = |name: &str, node: &str| {
                format!(
                    "{name}{{collection=\"r\",shard=\"{}\",node=\"{node}\"}}",
                    shard.shard
                )
            };
            assert!(
                metrics.contains(&format!("{} 0", line("tarn_replication_in_sync", &gone))),
                "{metrics}"
            );
            let alive_replica = shard.in_sync.iter().find(|n| **n != shard.node_id).unwrap();
            assert!(
                metrics.contains(&format!(
                    "{} 1",
                    line("tarn_replication_in_sync", alive_replica)
                )),
                "{metrics}"
            );
            assert!(
                metrics.contains(&format!(
                    "{} 0",
                    line("tarn_replication_lag_entries", alive_replica)
                )),
                "{metrics}"
            );
        }
        // s's shard with one copy left in sync refuses writes, the first one after the bound,
        // later ones at once.
        let on_shard: Vec<u128> = (1_000u128..)
            .filter(|id| tarn_cluster::shard_for(*id, 3) == s_shard)
            .take(5)
            .collect();
        for _ in 0..2 {
            let error = client
                .insert(Insert::new(
                    "s",
                    on_shard.clone(),
                    vectors(&mut rng, 5, DIM),
                ))
                .await
                .unwrap_err();
            assert_eq!(error.code(), Code::Unavailable, "{error}");
            assert!(
                error
                    .message()
                    .contains("1 of the shard's copies are in sync, and writes need 2"),
                "{error}"
            );
        }
        // `gone` comes back with its data: it catches up from the primaries' logs and rejoins.
        servers.insert(
            gone_idx,
            memory_node_with(dir.path(), gone_idx + 1, &store, with_metrics).await,
        );
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let status = client.cluster_status().await.unwrap();
            let rejoined = status
                .shards
                .iter()
                .filter(|s| s.collection == "r")
                .all(|s| s.in_sync.len() == 3);
            if rejoined {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "never rejoined: {:?}",
                status.shards
            );
            // Writes keep the followers busy meanwhile.
            let id = 5_000 + rng.random_range(0..1_000u128);
            let v = vectors(&mut rng, 1, DIM);
            client
                .insert(Insert::new("r", vec![id], v.clone()))
                .await
                .unwrap();
            acked.insert(id, v);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        // A last write reaches all three copies.
        let v = vectors(&mut rng, 10, DIM);
        let ids: Vec<u128> = (200..210).collect();
        client
            .insert(Insert::new("r", ids.clone(), v.clone()))
            .await
            .unwrap();
        for (i, id) in ids.iter().enumerate() {
            acked.insert(*id, v[i * DIM..(i + 1) * DIM].to_vec());
        }
        assert_eq!(
            client.collection_info("r").await.unwrap().n_documents,
            acked.len() as u64
        );
        for server in servers {
            server.shutdown().await.unwrap();
        }
        // Every copy of each shard holds the same documents: every acknowledged one, once.
        let node_dirs = (1..=3).map(|i| dir.path().join(format!("n{i}")));
        let mut all: Vec<u128> = assert_copies_identical(node_dirs, "r", 2, 3)
            .values()
            .flat_map(|docs| docs.iter().map(|(_, d)| *d))
            .collect();
        all.sort_unstable();
        assert_eq!(all, acked.keys().copied().collect::<Vec<_>>());
    });
}

/// Filtered search over an in-memory cluster: a collection with fields, sharded by document
/// over 4 shards on 3 nodes, each shard with 3 copies (reads are answered by each node's own
/// copy, so the replicas' attributes, removals and added fields are what is checked); an
/// insert's attributes travel with their documents to each shard and its replicas, every
/// shard filters and the merged answer of an exact search equals a brute-force filtered
/// oracle, through every node, never short; Get returns attributes from remote
/// shards; remove by filter counts every shard's removals; AddFields reaches every shard;
/// bad input is refused naming the field.
#[test]
fn filtered_search_over_shards_is_exact_and_remove_and_add_fields_reach_every_shard() {
    use tarn_client::{Attributes, FieldType, Filter, Value};
    let dir = tempfile::tempdir().unwrap();
    runtime().block_on(async {
        let (servers, _store) = memory_cluster(dir.path(), 3).await;
        let mut clients = Vec::new();
        for server in &servers {
            clients.push(Client::connect(server.grpc_addr()).await.unwrap());
        }
        const DIM: usize = 8;
        const SECTIONS: [&str; 5] = ["python", "libs", "devel", "games", "net"];
        clients[0]
            .create_collection(
                CollectionSpec::new("pkgs", DIM as u32)
                    .metric(Metric::L2)
                    .shards(4, ShardKey::Doc)
                    .replicas(3, 0)
                    .field("section", FieldType::Keyword)
                    .field("size", FieldType::Number)
                    .field("tags", FieldType::Keywords),
            )
            .await
            .unwrap();
        let info = clients[1].collection_info("pkgs").await.unwrap();
        assert_eq!(info.fields.len(), 3, "{:?}", info.fields);
        // Document i: section i % 5, size i, tag even/odd; every tenth has no attributes.
        let attributes_of = |i: u128| {
            if i % 10 == 9 {
                return Attributes::new();
            }
            Attributes::new()
                .with("section", SECTIONS[(i % 5) as usize])
                .with("size", i as f64)
                .with("tags", [if i.is_multiple_of(2) { "even" } else { "odd" }])
        };
        let mut rng = rand::rngs::StdRng::seed_from_u64(28);
        let v = vectors(&mut rng, 400, DIM);
        let ids: Vec<u128> = (0..400).collect();
        let mut data: BTreeMap<u128, Vec<f32>> = ids
            .iter()
            .map(|&i| (i, v[i as usize * DIM..(i as usize + 1) * DIM].to_vec()))
            .collect();
        let ack = clients[1]
            .insert(
                Insert::new("pkgs", ids.clone(), v.clone())
                    .users([7u128])
                    .attributes(ids.iter().map(|&i| attributes_of(i))),
            )
            .await
            .unwrap();
        type Predicate = Box<dyn Fn(u128) -> bool>;
        let has = |i: u128| i % 10 != 9;
        let filters: Vec<(&str, Filter, Predicate)> = vec![
            (
                "section = python",
                Filter::field("section").eq("python"),
                Box::new(move |i| has(i) && i % 5 == 0),
            ),
            (
                "section in (libs, devel) and size >= 200",
                Filter::field("section").any_of(["libs", "devel"])
                    & Filter::range("size").gte(200.0),
                Box::new(move |i| has(i) && matches!(i % 5, 1 | 2) && i >= 200),
            ),
            (
                "not tags = even",
                !Filter::field("tags").eq("even"),
                Box::new(move |i| !(has(i) && i % 2 == 0)),
            ),
            (
                "size < 3",
                Filter::range("size").lt(3.0).into(),
                Box::new(move |i| has(i) && i < 3),
            ),
            (
                "nothing",
                Filter::field("section").eq("none"),
                Box::new(|_| false),
            ),
        ];
        let check = |data: BTreeMap<u128, Vec<f32>>,
                     token: tarn_client::ReadToken,
                     rng_seed: u64| {
            let (clients, filters) = (&clients, &filters);
            async move {
                let mut rng = rand::rngs::StdRng::seed_from_u64(rng_seed);
                for (name, filter, predicate) in filters {
                    let matching: BTreeMap<u128, Vec<f32>> = data
                        .iter()
                        .filter(|(d, _)| predicate(**d))
                        .map(|(d, v)| (*d, v.clone()))
                        .collect();
                    for client in clients {
                        let query = vectors(&mut rng, 1, DIM);
                        for exact in [true, false] {
                            let hits = client
                                .search(
                                    Search::new("pkgs", query.clone())
                                        .users([7u128])
                                        .top_k(10)
                                        .exact(exact)
                                        .filter(filter.clone())
                                        .after(token.clone()),
                                )
                                .await
                                .unwrap();
                            assert_eq!(hits.len(), matching.len().min(10), "{name}: never short");
                            assert!(hits.iter().all(|h| predicate(h.doc_id)), "{name}");
                            if exact {
                                let want: Vec<u128> = brute_force(&matching, &query, 10)
                                    .iter()
                                    .map(|t| t.1)
                                    .collect();
                                let got: Vec<u128> = hits.iter().map(|h| h.doc_id).collect();
                                assert_eq!(got, want, "{name}: the merge is exact");
                            }
                        }
                    }
                }
            }
        };
        check(data.clone(), ack.read_token(), 1).await;

        // Get through a node that owns few of the shards: the attributes come back.
        let wanted: Vec<u128> = (0..12).collect();
        let docs = clients[2].get("pkgs", 7, &wanted).await.unwrap();
        assert_eq!(docs.len(), 12);
        for doc in &docs {
            assert_eq!(
                doc.attributes,
                attributes_of(doc.doc_id),
                "doc {}",
                doc.doc_id
            );
        }

        // Bad input, refused naming the field: at the router (the count) and on the shards.
        let error = clients[0]
            .insert(
                Insert::new("pkgs", [1u128, 2], vec![0.5f32; 2 * DIM])
                    .attributes([Attributes::new()]),
            )
            .await
            .unwrap_err();
        assert_eq!(error.code(), Code::InvalidArgument);
        assert!(error.message().contains("attributes"), "{error}");
        let error = clients[0]
            .insert(
                Insert::new("pkgs", [1u128, 2, 3], vec![0.5f32; 3 * DIM])
                    .attributes((0..3).map(|_| Attributes::new().with("size", "big"))),
            )
            .await
            .unwrap_err();
        assert_eq!(error.code(), Code::InvalidArgument);
        assert!(error.message().contains("\"size\""), "{error}");
        let error = clients[2]
            .search(Search::new("pkgs", vec![0.5f32; DIM]).filter(Filter::field("color").eq("red")))
            .await
            .unwrap_err();
        assert_eq!(error.code(), Code::InvalidArgument);
        assert!(
            error.message().contains("filter") && error.message().contains("\"color\""),
            "{error}"
        );
        assert_eq!(
            clients[0].get("pkgs", 7, &[1, 2, 3]).await.unwrap()[0].vector,
            data[&1]
        );

        // Remove by filter: every shard removes its matches; the answer counts them all.
        let python = Filter::field("section").eq("python");
        let doomed: Vec<u128> = data
            .keys()
            .copied()
            .filter(|&i| has(i) && i % 5 == 0)
            .collect();
        let removed = clients[2]
            .remove(Remove::matching("pkgs", python.clone()).users([7u128]))
            .await
            .unwrap();
        assert_eq!(removed.n_written, doomed.len() as u64);
        for doc in &doomed {
            data.remove(doc);
        }
        let hits = clients[0]
            .search(
                Search::new("pkgs", vec![0.0f32; DIM])
                    .users([7u128])
                    .exact(true)
                    .filter(python.clone())
                    .after(removed.read_token()),
            )
            .await
            .unwrap();
        assert!(hits.is_empty(), "{hits:?}");
        check(data.clone(), removed.read_token(), 2).await;
        // Count sums every shard's, each read after the token's write; no tenant's documents
        // are counted for another.
        let libs = Filter::field("section").eq("libs");
        let n_libs = data.keys().filter(|&&i| has(i) && i % 5 == 1).count() as u64;
        for client in &clients {
            let after = |count: tarn_client::Count| count.after(removed.read_token());
            let all = Count::new("pkgs").users([7u128]);
            assert_eq!(client.count(after(all)).await.unwrap(), data.len() as u64);
            let libs = Count::new("pkgs").users([7u128]).filter(libs.clone());
            assert_eq!(client.count(after(libs)).await.unwrap(), n_libs);
            let python = Count::new("pkgs").users([7u128]).filter(python.clone());
            assert_eq!(client.count(after(python)).await.unwrap(), 0);
            assert_eq!(
                client
                    .count(Count::new("pkgs").users([8u128]))
                    .await
                    .unwrap(),
                0
            );
        }
        let error = clients[1]
            .count(Count::new("pkgs").filter(Filter::field("color").eq("red")))
            .await
            .unwrap_err();
        assert_eq!(error.code(), Code::InvalidArgument, "{error}");
        assert!(error.message().contains("filter"), "{error}");
        // A batch of routed searches answers each as it is answered alone, in order.
        let searches: Vec<Search> = data
            .values()
            .take(12)
            .map(|v| {
                Search::new("pkgs", v.clone())
                    .users([7u128])
                    .top_k(5)
                    .after(removed.read_token())
            })
            .collect();
        let batch = clients[2].search_batch(searches.clone()).await.unwrap();
        assert_eq!(batch.len(), searches.len());
        for (search, hits) in searches.into_iter().zip(batch) {
            assert_eq!(clients[1].search(search).await.unwrap(), hits);
        }
        // Scroll over the 4 shards lists every document once, in id order, page by page.
        let every: Vec<u128> = data.keys().copied().collect();
        let libs_docs: Vec<u128> = every
            .iter()
            .copied()
            .filter(|&i| has(i) && i % 5 == 1)
            .collect();
        for (limit, filter, expected) in [(7u32, None, every), (3, Some(libs), libs_docs)] {
            let mut listed = Vec::new();
            let mut cursor = Vec::new();
            loop {
                let mut scroll = Scroll::new("pkgs")
                    .users([7u128])
                    .limit(limit)
                    .cursor(cursor.clone())
                    .after(removed.read_token())
                    .vectors(true);
                if let Some(filter) = &filter {
                    scroll = scroll.filter(filter.clone());
                }
                let page = clients[listed.len() % 3].scroll(scroll).await.unwrap();
                assert!(page.docs.len() <= limit as usize);
                for doc in &page.docs {
                    assert_eq!(doc.vector, data[&doc.doc_id]);
                }
                listed.extend(page.docs.iter().map(|d| d.doc_id));
                match page.next {
                    Some(next) => cursor = next,
                    None => break,
                }
            }
            assert_eq!(listed, expected, "limit {limit}");
        }

        // AddFields reaches every shard: documents on every shard can use the field at once.
        let info = clients[0]
            .add_fields("pkgs", [("priority", FieldType::Keyword)])
            .await
            .unwrap();
        assert_eq!(info.fields.len(), 4);
        assert_eq!(
            clients[2].collection_info("pkgs").await.unwrap().fields,
            info.fields
        );
        let new_docs: Vec<u128> = (1000..1032).collect();
        let shards: std::collections::BTreeSet<u32> = new_docs
            .iter()
            .map(|d| tarn_cluster::shard_for(*d, 4))
            .collect();
        assert_eq!(shards.len(), 4, "the new documents are on every shard");
        let ack = clients[1]
            .insert(
                Insert::new(
                    "pkgs",
                    new_docs.clone(),
                    vectors(&mut rng, new_docs.len(), DIM),
                )
                .users([7u128])
                .attributes(
                    new_docs
                        .iter()
                        .map(|_| Attributes::new().with("priority", "required")),
                ),
            )
            .await
            .unwrap();
        let mut hits: Vec<u128> = clients[2]
            .search(
                Search::new("pkgs", vec![0.0f32; DIM])
                    .users([7u128])
                    .top_k(100)
                    .filter(Filter::field("priority").eq("required"))
                    .after(ack.read_token()),
            )
            .await
            .unwrap()
            .iter()
            .map(|h| h.doc_id)
            .collect();
        hits.sort_unstable();
        assert_eq!(hits, new_docs);
        // A Get through another node with the write's token: that node's copy may be the one
        // not yet told the write is committed (3 copies, 2 in sync are enough to acknowledge).
        assert_eq!(
            clients[1]
                .get_after("pkgs", 7, &[1000], &ack.read_token())
                .await
                .unwrap()[0]
                .attributes
                .get("priority"),
            Some(&Value::Keyword("required".into()))
        );
        let error = clients[1]
            .add_fields("pkgs", [("priority", FieldType::Keyword)])
            .await
            .unwrap_err();
        assert_eq!(error.code(), Code::InvalidArgument);
        assert!(error.message().contains("\"priority\""), "{error}");
        let error = clients[1]
            .add_fields("pkgs", [("priority", FieldType::Number)])
            .await
            .unwrap_err();
        assert!(error.message().contains("KEYWORD"), "{error}");
        for server in servers {
            server.shutdown().await.unwrap();
        }
    });
}

#[test]
fn tenant_counts_over_shards_count_each_tenant_once() {
    let dir = tempfile::tempdir().unwrap();
    runtime().block_on(async {
        let (servers, _store) = memory_cluster(dir.path(), 2).await;
        let c1 = Client::connect(servers[0].grpc_addr()).await.unwrap();
        for (name, key) in [("by_doc", ShardKey::Doc), ("by_user", ShardKey::User)] {
            c1.create_collection(CollectionSpec::new(name, 4).shards(4, key))
                .await
                .unwrap();
        }
        // One tenant whose 40 documents spread over the 4 DOC shards.
        let docs: Vec<u128> = (1..=40).collect();
        c1.insert(Insert::new("by_doc", docs.clone(), vec![0.5f32; 160]).users([7u128]))
            .await
            .unwrap();
        let shards_used: std::collections::BTreeSet<u32> = docs
            .iter()
            .map(|d| tarn_cluster::shard_for(*d, 4))
            .collect();
        assert!(shards_used.len() > 1);
        // Counts are of applied writes (ingestion is asynchronous): wait until they settle.
        let tenants = |name: &'static str, want: u32| {
            let c1 = c1.clone();
            async move {
                let started = Instant::now();
                loop {
                    let n = c1.collection_info(name).await.unwrap().n_tenants;
                    if n == want || started.elapsed() > Duration::from_secs(10) {
                        return n;
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        };
        assert_eq!(tenants("by_doc", 1).await, 1);
        for user in [1u128, 2, 3] {
            c1.insert(Insert::new("by_user", [user], vec![0.5f32; 4]).users([user]))
                .await
                .unwrap();
        }
        assert_eq!(tenants("by_user", 3).await, 3);
        for server in servers {
            server.shutdown().await.unwrap();
        }
    });
}

/// Moves over the in-memory map: a node that joins takes its share of a collection while
/// writers and searchers run through every node, then gives it back when drained; nothing
/// acknowledged is lost or duplicated, no write or search fails, read tokens from before the
/// moves still work, and the status and metrics show the moves.
#[test]
fn shards_move_to_a_joining_node_and_off_a_drained_one_under_load() {
    let dir = tempfile::tempdir().unwrap();
    let rt = runtime();
    rt.block_on(async {
        const DIM: usize = 8;
        let (mut servers, store) = memory_cluster(dir.path(), 2).await;
        let c1 = Client::connect(servers[0].grpc_addr()).await.unwrap();
        let c2 = Client::connect(servers[1].grpc_addr()).await.unwrap();
        c1.create_collection(
            CollectionSpec::new("moving", DIM as u32)
                .metric(Metric::L2)
                .shards(6, ShardKey::Doc),
        )
        .await
        .unwrap();
        let first = c1
            .insert(Insert::new("moving", vec![7], vec![0.5; DIM]).users(vec![0]))
            .await
            .unwrap();
        let acked: Acked = Default::default();
        acked.lock().unwrap().insert(7, Doc::Live(vec![0.5; DIM]));

        for round in 0..2 {
            let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
            let mut writers = Vec::new();
            for w in 0..4u128 {
                let client = if w % 2 == 0 { c1.clone() } else { c2.clone() };
                writers.push(tokio::spawn(write_until(
                    client,
                    1 + w + 10 * round,
                    DIM,
                    acked.clone(),
                    stop.clone(),
                )));
            }
            let searcher = {
                let (client, stop) = (c2.clone(), stop.clone());
                tokio::spawn(async move {
                    let mut n = 0;
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        client
                            .search(
                                Search::new("moving", vec![0.5; DIM])
                                    .users(vec![0])
                                    .top_k(3),
                            )
                            .await
                            .unwrap_or_else(|e| panic!("search failed during moves: {e}"));
                        n += 1;
                    }
                    n
                })
            };
            tokio::time::sleep(Duration::from_millis(300)).await;
            if round == 0 {
                // A third node joins: it takes its share (2 of 6) from the others.
                servers.push(memory_node(dir.path(), 3, &store).await);
            } else {
                assert_eq!(c1.drain_node("n3", false).await.unwrap(), 2);
                assert_eq!(
                    c1.drain_node("nobody", false).await.unwrap_err().code(),
                    Code::NotFound
                );
            }
            let want: BTreeMap<String, usize> = if round == 0 {
                [("n1", 2), ("n2", 2), ("n3", 2)]
            } else {
                [("n1", 3), ("n2", 3), ("n3", 0)]
            }
            .into_iter()
            .filter(|(_, n)| *n > 0)
            .map(|(k, v)| (k.to_owned(), v))
            .collect();
            let deadline = Instant::now() + Duration::from_secs(60);
            loop {
                let status = c1.cluster_status().await.unwrap();
                let serving = status.shards.iter().all(|s| s.state == "serving");
                if owners(&status, "moving") == want && serving {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "placement did not settle: {status:?}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            // Writes go on a moment on the new placement, then stop.
            tokio::time::sleep(Duration::from_millis(300)).await;
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            let mut n_writes = 0;
            for writer in writers {
                let (n, failures) = writer.await.unwrap();
                assert!(
                    failures.is_empty(),
                    "writes failed during moves: {failures:?}"
                );
                n_writes += n;
            }
            let n_searches = searcher.await.unwrap();
            assert!(
                n_writes > 100 && n_searches > 10,
                "{n_writes} writes, {n_searches} searches"
            );
            for client in [&c1, &c2] {
                check_acked(client, &acked).await;
            }
            // A read token from before every move still reads its write.
            let hits = c2
                .search(
                    Search::new("moving", vec![0.5; DIM])
                        .users(vec![0])
                        .exact(true)
                        .top_k(1)
                        .after(first.read_token()),
                )
                .await
                .unwrap();
            assert_eq!(hits[0].doc_id, 7);
        }
        let status = c1.cluster_status().await.unwrap();
        assert!(status.nodes.iter().any(|n| n.node_id == "n3" && n.draining));
        assert!(status.shards.iter().all(|s| s.epoch >= 1));
        // Cancelled, the node may take shards again.
        c1.drain_node("n3", true).await.unwrap();
        for server in servers {
            server.shutdown().await.unwrap();
        }
    });
}

/// Full-text and hybrid search over shards answer exactly as one shard holding every document
/// does: a collection split by document over 4 shards on 2 nodes scores with the statistics of
/// all of them (a first phase sums each shard's, then every shard scores with the sum), and a
/// hybrid search fuses each side's global merge. Checked against the same data in a collection
/// of one shard, hit for hit and score for score, through removes.
#[test]
fn full_text_and_hybrid_search_over_shards_answer_as_one_shard_does() {
    use tarn_client::{Attributes, Filter, Fusion, TextAnalyzer, Value};
    let dir = tempfile::tempdir().unwrap();
    runtime().block_on(async {
        const DIM: usize = 8;
        const N: u128 = 400;
        let (servers, _store) = memory_cluster(dir.path(), 2).await;
        let client = Client::connect(servers[0].grpc_addr()).await.unwrap();
        for (name, shards, key) in [("spread", 4, ShardKey::Doc), ("whole", 1, ShardKey::User)] {
            client
                .create_collection(
                    CollectionSpec::new(name, DIM as u32)
                        .metric(Metric::L2)
                        .shards(shards, key)
                        .replicas(1, 0)
                        .field("section", tarn_client::FieldType::Keyword)
                        .text_field("body", TextAnalyzer::english())
                        .bm25(1.1, 0.7),
                )
                .await
                .unwrap();
        }
        let words = [
            "python",
            "library",
            "libraries",
            "kernel",
            "module",
            "daemon",
            "the",
            "tools",
            "debian",
            "parser",
            "network",
            "firmware",
        ];
        let mut rng = rand::rngs::StdRng::seed_from_u64(37);
        let texts: Vec<String> = (0..N)
            .map(|_| {
                let len = rng.random_range(1..12);
                (0..len)
                    .map(|_| words[rng.random_range(0..words.len())])
                    .collect::<Vec<_>>()
                    .join(" ")
            })
            .collect();
        let v = vectors(&mut rng, N as usize, DIM);
        let ids: Vec<u128> = (0..N).collect();
        let attributes = |i: u128| {
            Attributes::new()
                .with("section", ["a", "b"][(i % 2) as usize])
                .with("body", Value::text(texts[i as usize].clone()))
        };
        let removed: Vec<u128> = (0..N).step_by(9).collect();
        // Searches read after the removes (their tokens): a search that raced them would
        // count and find removed documents on some shards only.
        let mut after = BTreeMap::new();
        for name in ["spread", "whole"] {
            client
                .insert(
                    Insert::new(name, ids.clone(), v.clone())
                        .attributes(ids.iter().map(|&i| attributes(i))),
                )
                .await
                .unwrap();
            client.flush(name).await.unwrap();
            let ack = client
                .remove(Remove::new(name, removed.clone()))
                .await
                .unwrap();
            after.insert(name, ack.read_token());
        }
        let queries = [
            "python libraries",
            "kernel firmware module",
            "the tools",
            "network",
        ];
        let query_vector = vectors(&mut rng, 1, DIM);
        let searches = |name: &str, query: &str| {
            [
                Search::text(name, "body", query).top_k(20),
                Search::text(name, "body", query)
                    .top_k(20)
                    .filter(Filter::field("section").eq("b")),
                Search::hybrid(name, query_vector.clone(), "body", query)
                    .top_k(15)
                    .depth(40),
                Search::hybrid(name, query_vector.clone(), "body", query)
                    .top_k(15)
                    .fusion(Fusion::RelativeScore)
                    .weights(0.4, 0.6),
            ]
            .map(|search| search.after(after[name].clone()))
        };
        for query in queries {
            for (spread, whole) in searches("spread", query)
                .into_iter()
                .zip(searches("whole", query))
            {
                let spread = client.search(spread).await.unwrap();
                let whole = client.search(whole).await.unwrap();
                assert!(!whole.is_empty(), "{query:?}");
                assert_eq!(spread, whole, "{query:?}");
                assert!(spread.iter().all(|hit| !removed.contains(&hit.doc_id)));
            }
        }
        for server in servers {
            server.shutdown().await.unwrap();
        }
    });
}

/// Shards that move carry their documents' attributes and their quantization: a drain moves
/// every shard of an int8 collection with attributes off a node, and afterwards filtered
/// searches (exact and through the graph) answer exactly as before, Get returns the same
/// attributes, and the collection still reports int8.
#[test]
fn moved_shards_keep_attributes_filters_and_quantization() {
    use tarn_client::{Attributes, FieldType, Filter, Quantization, Value};
    let dir = tempfile::tempdir().unwrap();
    runtime().block_on(async {
        const DIM: usize = 8;
        const N: u128 = 1500;
        let (servers, _store) = memory_cluster(dir.path(), 2).await;
        let client = Client::connect(servers[1].grpc_addr()).await.unwrap();
        client
            .create_collection(
                CollectionSpec::new("tagged", DIM as u32)
                    .metric(Metric::L2)
                    .shards(2, ShardKey::User)
                    .replicas(1, 0)
                    .quantization(Quantization::Rabitq {
                        bits: 4,
                        rescore: 3,
                    })
                    .vectors_on_disk(true)
                    .field("section", FieldType::Keyword)
                    .field("size", FieldType::Number)
                    .field("body", FieldType::Text),
            )
            .await
            .unwrap();
        // Every document with a TEXT value and a payload: stored values go with the move (in
        // the sealed segments' files and in the log's tail).
        let attributes_of = |i: u128| {
            Attributes::new()
                .with("section", ["python", "libs", "devel"][(i % 3) as usize])
                .with("size", i as f64)
                .with("body", Value::text(format!("the text of document {i}")))
                .with_payload(format!(r#"{{"i":{i}}}"#))
        };
        let mut rng = rand::rngs::StdRng::seed_from_u64(31);
        let v = vectors(&mut rng, N as usize, DIM);
        let ids: Vec<u128> = (0..N).collect();
        // Two tenants, so that each of the two shards holds one (a partition of 1,500: a graph
        // and RaBitQ codes once sealed, its full vectors left in the segment file).
        for user in [7u128, 8] {
            client
                .insert(
                    Insert::new("tagged", ids.clone(), v.clone())
                        .users([user])
                        .attributes(ids.iter().map(|&i| attributes_of(i))),
                )
                .await
                .unwrap();
        }
        client.flush("tagged").await.unwrap();
        // A tail in the log only: 100 documents rewritten after the checkpoint.
        let tail: Vec<u128> = (0..100).collect();
        for user in [7u128, 8] {
            client
                .insert(
                    Insert::new("tagged", tail.clone(), v[..100 * DIM].to_vec())
                        .users([user])
                        .attributes(tail.iter().map(|&i| attributes_of(i))),
                )
                .await
                .unwrap();
        }
        let filters = [
            Filter::field("section").eq("libs"),
            Filter::range("size").gte(100.0) & Filter::range("size").lt(400.0),
            !Filter::field("section").eq("python") & Filter::range("size").lte(1200.0),
        ];
        let queries = vectors(&mut rng, 5, DIM);
        let answers = |client: Client| {
            let (filters, queries) = (filters.clone(), queries.clone());
            async move {
                let mut all = Vec::new();
                for user in [7u128, 8] {
                    for filter in &filters {
                        for query in queries.chunks_exact(DIM) {
                            for exact in [true, false] {
                                let hits = client
                                    .search(
                                        Search::new("tagged", query.to_vec())
                                            .users([user])
                                            .top_k(10)
                                            .exact(exact)
                                            .filter(filter.clone()),
                                    )
                                    .await
                                    .unwrap();
                                assert_eq!(hits.len(), 10, "{filter:?}: never short");
                                all.push(
                                    hits.iter()
                                        .map(|h| (h.doc_id, h.score.to_bits()))
                                        .collect::<Vec<_>>(),
                                );
                            }
                        }
                    }
                }
                all
            }
        };
        let before = answers(client.clone()).await;
        let status = client.cluster_status().await.unwrap();
        let n1_before = owners(&status, "tagged").get("n1").copied().unwrap_or(0);
        assert!(n1_before > 0, "n1 owns a shard to move: {status:?}");
        assert_eq!(
            client.drain_node("n1", false).await.unwrap() as usize,
            n1_before
        );
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let status = client.cluster_status().await.unwrap();
            let serving = status.shards.iter().all(|s| s.state == "serving");
            if owners(&status, "tagged") == BTreeMap::from([("n2".to_owned(), 2)]) && serving {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the drain did not settle: {status:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(
            answers(client.clone()).await,
            before,
            "the same answers after the move"
        );
        let no_token = tarn_client::ReadToken::default();
        for user in [7u128, 8] {
            let docs = client
                .get_selected("tagged", user, &[0, 1, 2, 777, 1499], &[], true, &no_token)
                .await
                .unwrap();
            assert_eq!(docs.len(), 5);
            for doc in &docs {
                assert_eq!(
                    doc.attributes,
                    attributes_of(doc.doc_id),
                    "doc {}",
                    doc.doc_id
                );
                assert_eq!(doc.vector, v[doc.doc_id as usize * DIM..][..DIM].to_vec());
            }
            // A search's hits carry them too, from the moved copies.
            for doc in [5u128, 1234] {
                let hits = client
                    .search(
                        Search::new("tagged", v[doc as usize * DIM..][..DIM].to_vec())
                            .users([user])
                            .top_k(1)
                            .exact(true)
                            .output_fields(["body"])
                            .with_payload(true),
                    )
                    .await
                    .unwrap();
                assert_eq!(hits[0].doc_id, doc);
                let want = Attributes::new()
                    .with("body", Value::text(format!("the text of document {doc}")))
                    .with_payload(format!(r#"{{"i":{doc}}}"#));
                assert_eq!(hits[0].attributes, want);
            }
        }
        let info = client.collection_info("tagged").await.unwrap();
        assert_eq!(
            info.quantization,
            Quantization::Rabitq {
                bits: 4,
                rescore: 3
            }
        );
        assert_eq!(info.n_documents, 2 * N as u64);
        // The moved copies opened their segments with the vectors left on disk.
        assert!(info.vectors_on_disk);
        assert_eq!(info.cold_bytes, 2 * N as u64 * DIM as u64 * 4);
        for server in servers {
            server.shutdown().await.unwrap();
        }
    });
}

/// The documented way from one node to a cluster: a snapshot of the single node's collection,
/// restored into the cluster as a sharded collection; every document comes over, once, and
/// exact search answers as on the single node.
#[test]
fn a_single_node_collection_moves_into_a_cluster_by_snapshot() {
    let dir = tempfile::tempdir().unwrap();
    let rt = runtime();
    rt.block_on(async {
        const DIM: usize = 8;
        let single = tarn_server::start(tarn_server::ServeConfig::in_process(
            dir.path().join("single"),
        ))
        .await
        .unwrap();
        let alone = Client::connect(single.grpc_addr()).await.unwrap();
        alone
            .create_collection(CollectionSpec::new("docs", DIM as u32).metric(Metric::L2))
            .await
            .unwrap();
        let mut rng = rand::rngs::StdRng::seed_from_u64(21);
        let mut model: BTreeMap<(u128, u128), Vec<f32>> = BTreeMap::new();
        for tenant in [1u128, 2, 3] {
            let v = vectors(&mut rng, 700, DIM);
            let ids: Vec<u128> = (0..700).collect();
            alone
                .insert(Insert::new("docs", ids.clone(), v.clone()).users([tenant]))
                .await
                .unwrap();
            for (i, id) in ids.iter().enumerate() {
                model.insert((tenant, *id), v[i * DIM..(i + 1) * DIM].to_vec());
            }
        }
        alone.flush("docs").await.unwrap();
        // After the checkpoint: removals (tombstones) and upserts (in the log tail).
        alone
            .remove(Remove::new("docs", (0..50u128).collect::<Vec<_>>()).users([2u128]))
            .await
            .unwrap();
        for id in 0..50u128 {
            model.remove(&(2, id));
        }
        let v = vectors(&mut rng, 10, DIM);
        alone
            .insert(
                Insert::new("docs", (100..110u128).collect::<Vec<_>>(), v.clone()).users([3u128]),
            )
            .await
            .unwrap();
        for i in 0..10 {
            model.insert((3, 100 + i as u128), v[i * DIM..(i + 1) * DIM].to_vec());
        }
        let mut stream = alone.create_snapshot("docs").await.unwrap();
        let mut file = Vec::new();
        while let Some(chunk) = stream.next_chunk().await.unwrap() {
            file.extend_from_slice(&chunk);
        }

        let (servers, _) = memory_cluster(&dir.path().join("cluster"), 3).await;
        let client = Client::connect(servers[1].grpc_addr()).await.unwrap();
        let restored = client
            .restore_snapshot_sharded("docs", 4, ShardKey::Doc, std::io::Cursor::new(file.clone()))
            .await
            .unwrap();
        assert_eq!(restored.collection.n_documents, model.len() as u64);
        assert_eq!(
            (restored.collection.shards, restored.collection.dimension),
            (4, DIM as u32)
        );
        assert_eq!(restored.collection.metric, Metric::L2);
        // Every document, once, through another node.
        let other = Client::connect(servers[2].grpc_addr()).await.unwrap();
        for tenant in [1u128, 2, 3] {
            let docs = other
                .get("docs", tenant, &(0..700u128).collect::<Vec<_>>())
                .await
                .unwrap();
            let got: BTreeMap<u128, Vec<f32>> =
                docs.into_iter().map(|d| (d.doc_id, d.vector)).collect();
            let want: BTreeMap<u128, Vec<f32>> = model
                .iter()
                .filter(|((u, _), _)| *u == tenant)
                .map(|((_, d), v)| (*d, v.clone()))
                .collect();
            assert_eq!(got, want, "tenant {tenant}");
            for q in 0..3 {
                let query = vectors(&mut rng, 1, DIM);
                let here = other
                    .search(
                        Search::new("docs", query.clone())
                            .users([tenant])
                            .exact(true)
                            .top_k(5),
                    )
                    .await
                    .unwrap();
                let there = alone
                    .search(
                        Search::new("docs", query)
                            .users([tenant])
                            .exact(true)
                            .top_k(5),
                    )
                    .await
                    .unwrap();
                let ids = |h: &[tarn_client::Hit]| h.iter().map(|h| h.doc_id).collect::<Vec<_>>();
                assert_eq!(ids(&here), ids(&there), "tenant {tenant} query {q}");
            }
        }
        // Onto a taken name: refused; a damaged file: refused, and nothing appears.
        let error = client
            .restore_snapshot("docs", std::io::Cursor::new(file.clone()))
            .await
            .unwrap_err();
        assert_eq!(error.code(), Code::AlreadyExists);
        let mut damaged = file;
        let at = damaged.len() / 2;
        damaged[at] ^= 0x20;
        let error = client
            .restore_snapshot("docs2", std::io::Cursor::new(damaged))
            .await
            .unwrap_err();
        assert_eq!(error.code(), Code::InvalidArgument, "{error}");
        assert_eq!(client.list_collections().await.unwrap(), vec!["docs"]);
        let leftovers: Vec<String> = std::fs::read_dir(dir.path().join("cluster/n2/collections"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with('.'))
            .collect();
        assert!(leftovers.is_empty(), "{leftovers:?}");
        for server in servers {
            server.shutdown().await.unwrap();
        }
        single.shutdown().await.unwrap();
    });
}

#[test]
fn processes_three_nodes_route_fan_out_and_isolate_tenants() {
    let Some((_dir, _etcd, nodes)) = real_cluster(3, 2) else {
        return;
    };
    let rt = runtime();
    rt.block_on(async {
        let clients: Vec<Client> = {
            let mut clients = Vec::new();
            for node in &nodes {
                clients.push(Client::connect(node.addr()).await.unwrap());
            }
            clients
        };
        // DOC-sharded: 4,000 documents of one tenant spread over 8 shards on 3 nodes.
        const DIM: usize = 16;
        let info = clients[0]
            .create_collection(
                CollectionSpec::new("docs", DIM as u32)
                    .metric(Metric::L2)
                    .shards(8, ShardKey::Doc),
            )
            .await
            .unwrap();
        assert_eq!((info.shards, info.shard_key), (8, ShardKey::Doc));
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let mut data = BTreeMap::new();
        let mut token = None;
        for batch in 0..8u128 {
            let ids: Vec<u128> = (batch * 500..(batch + 1) * 500).collect();
            let v = vectors(&mut rng, 500, DIM);
            for (i, id) in ids.iter().enumerate() {
                data.insert(*id, v[i * DIM..(i + 1) * DIM].to_vec());
            }
            // Every node takes writes; each request spreads over every shard.
            let client = &clients[batch as usize % 3];
            let ack = client.insert(Insert::new("docs", ids, v)).await.unwrap();
            assert_eq!(ack.n_written, 500);
            token = Some(ack.read_token());
        }
        // Every node sees the collection, with every shard's documents counted once they are
        // applied (the last write's read token covers every shard).
        for client in &clients {
            client
                .search(Search::new("docs", vec![0.0f32; DIM]).after(token.clone().unwrap()))
                .await
                .unwrap();
            assert_eq!(client.list_collections().await.unwrap(), vec!["docs"]);
            let info = client.collection_info("docs").await.unwrap();
            assert_eq!(info.n_documents, 4000);
        }
        let status = clients[1].cluster_status().await.unwrap();
        assert_eq!(status.nodes.len(), 3);
        assert_eq!(status.shards.len(), 8);
        for node in &nodes {
            let owned = status
                .shards
                .iter()
                .filter(|s| s.node_id == node.id)
                .count();
            assert!((2..=3).contains(&owned), "{status:?}");
        }
        // Exact search through every node equals brute force over the union; graph search
        // finds most of it.
        let mut found = 0;
        for q in 0..20 {
            let query = vectors(&mut rng, 1, DIM);
            let truth = brute_force(&data, &query, 10);
            for client in &clients {
                let hits = client
                    .search(
                        Search::new("docs", query.clone())
                            .top_k(10)
                            .exact(true)
                            .after(token.clone().unwrap()),
                    )
                    .await
                    .unwrap();
                let ids: Vec<u128> = hits.iter().map(|h| h.doc_id).collect();
                let want: Vec<u128> = truth.iter().map(|t| t.1).collect();
                assert_eq!(ids, want, "query {q}");
                for (hit, (dist, _)) in hits.iter().zip(&truth) {
                    assert!((hit.score - dist).abs() < 1e-4);
                }
            }
            let hits = clients[q % 3]
                .search(Search::new("docs", query.clone()).top_k(10).ef(64))
                .await
                .unwrap();
            found += hits
                .iter()
                .filter(|h| truth.iter().any(|t| t.1 == h.doc_id))
                .count();
        }
        assert!(found >= 190, "graph recall@10 {}/200", found);
        // Get across shards, in the order asked.
        let docs = clients[2]
            .get("docs", 0, &[3999, 7, 1234, 99_999])
            .await
            .unwrap();
        let ids: Vec<u128> = docs.iter().map(|d| d.doc_id).collect();
        assert_eq!(ids, vec![3999, 7, 1234]);
        assert_eq!(docs[1].vector, data[&7]);

        // USER-sharded: 50 tenants, each isolated, each on one shard.
        clients[1]
            .create_collection(
                CollectionSpec::new("tenants", 4)
                    .metric(Metric::Dot)
                    .shards(0, ShardKey::User),
            )
            .await
            .unwrap();
        let mut acks = Vec::new();
        for tenant in 0..50u128 {
            let v: Vec<f32> = (0..10)
                .flat_map(|i| [tenant as f32, i as f32, 1.0, 0.0])
                .collect();
            let ack = clients[tenant as usize % 3]
                .insert(Insert::new("tenants", (0..10u128).collect::<Vec<_>>(), v).users([tenant]))
                .await
                .unwrap();
            // One tenant: one shard, so the shard's own sequence number is not 0 only if the
            // collection has one shard; the read token works either way.
            acks.push(ack);
        }
        for tenant in 0..50u128 {
            let hits = clients[(tenant as usize + 1) % 3]
                .search(
                    Search::new("tenants", vec![1.0f32, 1.0, 1.0, 1.0])
                        .users([tenant])
                        .top_k(100)
                        .after(acks[tenant as usize].read_token()),
                )
                .await
                .unwrap();
            assert_eq!(hits.len(), 10, "tenant {tenant}");
            assert!(hits.iter().all(|h| h.user_id == tenant));
            let other = (tenant + 1) % 50;
            assert!(clients[0]
                .get("tenants", other, &[0])
                .await
                .unwrap()
                .iter()
                .all(|d| d.user_id == other));
        }
        let info = clients[2].collection_info("tenants").await.unwrap();
        assert_eq!((info.n_documents, info.shards), (500, 8));

        // Remove across shards, read through another node.
        let ack = clients[0]
            .remove(Remove::new("docs", (0..100u128).collect::<Vec<_>>()))
            .await
            .unwrap();
        let hits = clients[1]
            .search(
                Search::new("docs", data[&5].clone())
                    .top_k(5)
                    .exact(true)
                    .after(ack.read_token()),
            )
            .await
            .unwrap();
        assert!(hits.iter().all(|h| h.doc_id >= 100));
        assert_eq!(
            clients[2]
                .collection_info("docs")
                .await
                .unwrap()
                .n_documents,
            3900
        );

        // Drop: gone everywhere, and the name can be used again from scratch.
        clients[2].drop_collection("tenants").await.unwrap();
        assert_eq!(clients[2].list_collections().await.unwrap(), vec!["docs"]);
        // The other nodes' views follow etcd's watch within moments.
        for client in &clients {
            let deadline = Instant::now() + Duration::from_secs(5);
            while client.list_collections().await.unwrap() != vec!["docs"] {
                assert!(
                    Instant::now() < deadline,
                    "the drop never reached every node"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        clients[0]
            .create_collection(CollectionSpec::new("tenants", 4).shards(2, ShardKey::User))
            .await
            .unwrap();
        assert_eq!(
            clients[1]
                .collection_info("tenants")
                .await
                .unwrap()
                .n_documents,
            0
        );
        let error = clients[1]
            .create_collection(CollectionSpec::new("tenants", 4))
            .await
            .unwrap_err();
        assert_eq!(error.code(), Code::AlreadyExists);
    });
}

#[test]
fn processes_a_second_node_with_a_live_id_is_refused() {
    let Some((dir, etcd, _nodes)) = real_cluster(1, 2) else {
        return;
    };
    let port = free_port().to_string();
    let listen = format!("127.0.0.1:{port}");
    let refused = Server::try_start(
        &dir.path().join("other"),
        &[
            "--listen",
            &listen,
            "--etcd",
            &etcd.endpoint(),
            "--node-id",
            "n1",
            "--advertise",
            &listen,
        ],
        &[],
    );
    let log = refused.err().expect("a second n1 must not start");
    assert!(log.contains("already registered"), "{log}");
    assert!(log.contains("another data directory"), "{log}");
    assert!(log.contains("waiting for its lease to lapse"), "{log}");
}

/// A raw etcd client, for tests that change etcd behind tarn's back.
fn raw_etcd(endpoint: &str) -> tarn_cluster::etcd_api::EtcdClient {
    tarn_cluster::etcd_api::EtcdClient::connect(
        &[endpoint.to_owned()],
        &tarn_cluster::etcd_api::ConnectOptions::default(),
    )
    .unwrap()
}

/// How many local shard directories of `collection` a node's data directory holds.
fn shard_dirs(node: &Node, collection: &str) -> usize {
    std::fs::read_dir(node.dir.join("collections"))
        .map(|entries| {
            entries
                .flatten()
                .filter(|e| {
                    e.file_name()
                        .to_string_lossy()
                        .starts_with(&format!("{collection}."))
                })
                .count()
        })
        .unwrap_or(0)
}

/// Inserts `n` documents from `first` (tenant 0, FSYNC, batches of 25) into `collection`;
/// returns them.
async fn insert_docs(
    client: &Client,
    collection: &str,
    first: u128,
    n: usize,
    dim: usize,
) -> BTreeMap<u128, Vec<f32>> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(first as u64);
    let mut docs = BTreeMap::new();
    for start in (0..n).step_by(25) {
        let ids: Vec<u128> = (start..n.min(start + 25))
            .map(|i| first + i as u128)
            .collect();
        let v = vectors(&mut rng, ids.len(), dim);
        client
            .insert(Insert::new(collection, ids.clone(), v.clone()).durability(Durability::Fsync))
            .await
            .unwrap();
        for (i, id) in ids.iter().enumerate() {
            docs.insert(*id, v[i * dim..(i + 1) * dim].to_vec());
        }
    }
    docs
}

/// Every document of `docs` is in `collection` (tenant 0) with its vector.
async fn assert_all_there(client: &Client, collection: &str, docs: &BTreeMap<u128, Vec<f32>>) {
    for (doc, v) in docs {
        let got = client.get(collection, 0, &[*doc]).await.unwrap();
        assert_eq!(got.len(), 1, "acknowledged document {doc} is missing");
        assert_eq!(&got[0].vector, v, "document {doc} has another vector");
    }
}

/// Waits (at most 20 s) until the node at `addr` has set `n` shard copies aside; returns them.
async fn wait_for_set_aside(addr: &str, n: usize) -> Vec<tarn_client::SetAsideShard> {
    let client = Client::connect(addr.to_owned()).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let list = client.list_set_aside().await.unwrap_or_default();
        if list.len() >= n {
            return list;
        }
        assert!(
            Instant::now() < deadline,
            "{addr} set aside {list:?}, not {n} copies"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Cluster identity and the set-aside rule, with real processes and real etcds: nodes holding
/// data refuse an empty etcd and another cluster's etcd (nothing deleted); back on their own
/// etcd rolled back behind their back (the collection's keys gone, as after a restore from an
/// older backup), they set their shards aside instead of deleting them, and every acknowledged
/// document comes back by import; a dropped collection's shards are deleted (its tombstone);
/// `--force-new-cluster` forms a new cluster over a node's data, which it sets aside.
#[test]
fn processes_shards_are_set_aside_never_deleted_by_an_empty_foreign_or_rolled_back_etcd() {
    let Some((dir, etcd, mut nodes)) = real_cluster(2, 2) else {
        return;
    };
    let rt = runtime();
    const DIM: usize = 8;
    let spec = || {
        CollectionSpec::new("keep", DIM as u32)
            .metric(Metric::L2)
            .shards(4, ShardKey::Doc)
    };
    let docs = rt.block_on(async {
        let client = Client::connect(nodes[0].addr()).await.unwrap();
        client.create_collection(spec()).await.unwrap();
        insert_docs(&client, "keep", 1, 200, DIM).await
    });
    let before: Vec<usize> = nodes.iter().map(|n| shard_dirs(n, "keep")).collect();
    assert_eq!(before, vec![2, 2], "4 shards over 2 nodes, each written");

    // An empty etcd, then another cluster's: refused, naming why; nothing deleted.
    for node in &mut nodes {
        node.kill();
    }
    let binary = etcd_binary().unwrap();
    let other = Etcd::start(binary.clone(), &dir.path().join("etcd-other"));
    let log = nodes[0]
        .try_start(&other.endpoint(), &[], &[])
        .expect_err("a node with data joined an empty etcd");
    assert!(log.contains("etcd holds no cluster id"), "{log}");
    let mut stranger = Node {
        dir: dir.path().join("stranger"),
        ..Node::new(dir.path(), "s1", 2)
    };
    stranger.start(&other.endpoint());
    let log = nodes[0]
        .try_start(&other.endpoint(), &[], &[])
        .expect_err("a node with data joined another cluster's etcd");
    assert!(log.contains("but etcd holds cluster"), "{log}");
    stranger.kill();
    let after: Vec<usize> = nodes.iter().map(|n| shard_dirs(n, "keep")).collect();
    assert_eq!(after, before, "a refused node deleted shards");

    // Its own etcd, rolled back behind the nodes' back: set aside, then imported whole.
    for node in &mut nodes {
        node.start(&etcd.endpoint());
    }
    rt.block_on(async {
        let client = Client::connect(nodes[0].addr()).await.unwrap();
        assert_all_there(&client, "keep", &docs).await;
        let raw = raw_etcd(&etcd.endpoint());
        raw.delete(b"/tarn/collections/keep", false).await.unwrap();
        raw.delete(b"/tarn/shards/keep/", true).await.unwrap();
        let mut imported = 0;
        let mut copies = Vec::new();
        for (node, n) in nodes.iter().zip(&before) {
            let list = wait_for_set_aside(&node.addr(), *n).await;
            assert_eq!(list.len(), *n, "{list:?}");
            for copy in &list {
                assert!(copy.reason.contains("no record"), "{copy:?}");
                assert!(copy.bytes > 0, "{copy:?}");
            }
            copies.push((node.addr(), list));
        }
        assert!(nodes.iter().all(|n| shard_dirs(n, "keep") == 0));
        let status = client.cluster_status().await.unwrap();
        assert!(!status.cluster_id.is_empty());
        assert_eq!(status.set_aside, before[0] as u32);
        client.create_collection(spec()).await.unwrap();
        for (addr, list) in &copies {
            let node_client = Client::connect(addr.clone()).await.unwrap();
            for copy in list {
                imported += node_client
                    .import_set_aside(&copy.name, "keep")
                    .await
                    .unwrap();
            }
        }
        assert_eq!(imported, docs.len() as u64);
        assert_all_there(&client, "keep", &docs).await;
        // The CLI drops them for good.
        for (addr, list) in &copies {
            let out = run_cli(addr, &["cluster", "set-aside", "list"]);
            for copy in list {
                assert!(out.contains(&copy.name), "{out}");
                run_cli(addr, &["cluster", "set-aside", "drop", &copy.name]);
            }
            let node_client = Client::connect(addr.clone()).await.unwrap();
            assert!(node_client.list_set_aside().await.unwrap().is_empty());
        }
        // A dropped collection (its tombstone) is deleted everywhere.
        client.drop_collection("keep").await.unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while nodes.iter().any(|n| shard_dirs(n, "keep") > 0) {
            assert!(
                Instant::now() < deadline,
                "a dropped collection's shards stayed"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        client.create_collection(spec()).await.unwrap();
        insert_docs(&client, "keep", 1_000, 100, DIM).await;
    });

    // The cluster's etcd lost for good: --force-new-cluster forms a new one over n1's data,
    // which it sets aside (the new map has no record of it).
    let n1_shards = shard_dirs(&nodes[0], "keep");
    assert!(n1_shards > 0);
    for node in &mut nodes {
        node.kill();
    }
    drop(etcd);
    let fresh = Etcd::start(binary, &dir.path().join("etcd-fresh"));
    let log = nodes[0]
        .try_start(&fresh.endpoint(), &[], &[])
        .expect_err("a node with data joined an empty etcd");
    assert!(log.contains("--force-new-cluster"), "{log}");
    nodes[0]
        .try_start(&fresh.endpoint(), &["--force-new-cluster"], &[])
        .unwrap();
    rt.block_on(async {
        let list = wait_for_set_aside(&nodes[0].addr(), n1_shards).await;
        assert_eq!(list.len(), n1_shards);
    });
}

/// Copies bytes between a proxied connection's two sockets, one thread each way, swallowing
/// them while `swallow()` says the link is cut; each side is shut down when the other ends.
fn pump_both_ways(
    client: std::net::TcpStream,
    server: std::net::TcpStream,
    swallow: impl Fn() -> bool + Clone + Send + 'static,
) {
    for (mut from, mut to) in [
        (client.try_clone().unwrap(), server.try_clone().unwrap()),
        (server, client),
    ] {
        let swallow = swallow.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 16 << 10];
            loop {
                let n = match std::io::Read::read(&mut from, &mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => n,
                };
                if swallow() {
                    continue; // swallowed
                }
                if std::io::Write::write_all(&mut to, &buf[..n]).is_err() {
                    break;
                }
            }
            let _ = to.shutdown(std::net::Shutdown::Both);
        });
    }
}

/// A TCP proxy to etcd that a test cuts silently (bytes swallowed both ways, new connections
/// accepted and left hanging: a partition, not a refusal) and restores (the cut connections
/// closed, so clients reconnect).
struct CuttableProxy {
    port: u16,
    cut: std::sync::Arc<std::sync::atomic::AtomicBool>,
    open: std::sync::Arc<std::sync::Mutex<Vec<std::net::TcpStream>>>,
}

impl CuttableProxy {
    fn start(target_port: u16) -> CuttableProxy {
        use std::sync::atomic::Ordering::Relaxed;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let cut = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let open = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let (cut2, open2) = (cut.clone(), open.clone());
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { continue };
                open2.lock().unwrap().push(client.try_clone().unwrap());
                if cut2.load(Relaxed) {
                    continue; // accepted, never answered
                }
                let Ok(server) = std::net::TcpStream::connect(("127.0.0.1", target_port)) else {
                    // etcd is down: refused, as without the proxy.
                    let _ = client.shutdown(std::net::Shutdown::Both);
                    continue;
                };
                open2.lock().unwrap().push(server.try_clone().unwrap());
                let cut = cut2.clone();
                pump_both_ways(client, server, move || cut.load(Relaxed));
            }
        });
        CuttableProxy { port, cut, open }
    }

    fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn cut(&self) {
        self.cut.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    fn is_cut(&self) -> bool {
        self.cut.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn restore(&self) {
        self.cut.store(false, std::sync::atomic::Ordering::Relaxed);
        for stream in self.open.lock().unwrap().drain(..) {
            let _ = stream.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// A live primary whose WAL is poisoned (an fsync error, by the `wal::fdatasync` fail point
/// after its first 20 syncs) hands its replicated shard to its in-sync replica: writes through
/// a third node are acknowledged again within seconds, by the new primary, and every write
/// acknowledged before or after is there. Before, the poisoned primary kept its lease and the
/// shard took no write until a person restarted the node.
#[test]
fn processes_a_primary_whose_wal_is_poisoned_hands_its_shard_over() {
    const LEASE: u64 = 20;
    const DIM: usize = 8;
    let Some(binary) = etcd_binary() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(binary, &dir.path().join("etcd"));
    let endpoint = etcd.endpoint();
    // The node the placement makes the primary of `moving`'s one shard (initial_placement: the
    // name's hash over the sorted node ids) has its WAL syncs fail after its first 100.
    let p = "moving"
        .bytes()
        .fold(0usize, |h, b| h.wrapping_mul(31).wrapping_add(b as usize))
        % 3;
    let mut nodes: Vec<Node> = (1..=3)
        .map(|i| Node::new(dir.path(), &format!("n{i}"), LEASE))
        .collect();
    for (i, node) in nodes.iter_mut().enumerate() {
        if i == p {
            node.start_with_env(
                &endpoint,
                &[("FAILPOINTS", "wal::fdatasync=100*off->return")],
            );
        } else {
            node.start(&endpoint);
        }
    }
    let rt = runtime();
    let addrs: Vec<String> = nodes.iter().map(|n| n.addr()).collect();
    let status = rt.block_on(async {
        let client = Client::connect(addrs[0].clone()).await.unwrap();
        wait_for_status(&client, Duration::from_secs(10), "three live nodes", |s| {
            s.nodes.iter().filter(|n| n.alive).count() == 3
        })
        .await;
        create_moving(&client, DIM, 1, 2, 1).await;
        wait_in_sync(&addrs[0], 2).await
    });
    let the_shard = |status: &tarn_client::ClusterStatus| {
        status
            .shards
            .iter()
            .find(|s| s.collection == "moving")
            .unwrap()
            .clone()
    };
    let shard = the_shard(&status);
    assert_eq!(shard.node_id, nodes[p].id, "{shard:?}");
    let r = nodes
        .iter()
        .position(|n| n.id == shard.replicas[0])
        .unwrap();
    let c = 3 - p - r;
    let r_id = nodes[r].id.clone();
    let client = rt.block_on(Client::connect(addrs[c].clone())).unwrap();
    let acked: Acked = Default::default();
    let (mut failed, mut last_failure) = (0, None);
    let started = Instant::now();
    // Writes until 200 are acknowledged by the replica promoted over the failed primary.
    rt.block_on(async {
        let (mut doc, mut after) = (0u128, 0);
        while after < 200 {
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "writes not acknowledged by a new primary: {failed} failed"
            );
            doc += 1;
            match insert_recorded(&client, &acked, vec![doc * 7], Duration::from_secs(3)).await {
                Ok(()) => {
                    let status = client.cluster_status().await.unwrap();
                    if the_shard(&status).node_id == r_id {
                        after += 1;
                    }
                }
                Err(_) => {
                    failed += 1;
                    last_failure = Some(started.elapsed());
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    });
    eprintln!("{failed} writes failed, the last {last_failure:?} after the start");
    let log = nodes[p].server.as_ref().unwrap().logs();
    assert!(
        log.contains("handing the shard to an in-sync replica")
            && log.contains("this primary's copy refuses writes"),
        "{log}"
    );
    rt.block_on(check_acked(&client, &acked));
}

/// An in-sync replica whose data directory is put back to an older copy of itself (the same
/// INCARNATION: a restored backup or VM snapshot) leaves the in-sync set as soon as its
/// primary's probe finds it behind what it acknowledged, so the primary killed right after is
/// not failed over to it: the shard waits for its primary, which comes back with every
/// acknowledged write. Before, the replica stayed in sync and was promoted without the writes
/// acknowledged since the copy was taken.
#[test]
fn processes_a_replica_restored_behind_its_acknowledged_position_leaves_the_in_sync_set() {
    const LEASE: u64 = 2;
    let Some(cluster) = one_shard_cluster(LEASE, 2, &[]) else {
        return;
    };
    let OneShardCluster {
        mut nodes,
        etcd,
        rt,
        addrs,
        primary: p,
        replicas,
        others,
        dir,
    } = cluster;
    let (r, c) = (replicas[0], others[0]);
    let endpoint = etcd.endpoint();
    let r_id = nodes[r].id.clone();
    let client = rt.block_on(Client::connect(addrs[c].clone())).unwrap();
    let acked: Acked = Default::default();
    let write = |from: u128| {
        rt.block_on(async {
            for batch in (from..from + 100).step_by(20) {
                let docs = (batch..batch + 20).map(|k| k * 7).collect();
                insert_settled(&client, &acked, docs).await;
            }
        })
    };
    write(0);
    // The replica's directory copied while it is down, then more writes on both copies.
    nodes[r].kill();
    rt.block_on(revoke_registration(&endpoint, &r_id));
    let backup = dir.path().join("replica-backup");
    copy_etcd_data(&nodes[r].dir, &backup);
    nodes[r].start(&endpoint);
    rt.block_on(wait_in_sync(&addrs[c], 2));
    write(1_000);
    // The older copy put back; the primary probes it, then dies.
    nodes[r].kill();
    rt.block_on(revoke_registration(&endpoint, &r_id));
    std::fs::remove_dir_all(&nodes[r].dir).unwrap();
    copy_etcd_data(&backup, &nodes[r].dir);
    nodes[r].start(&endpoint);
    rt.block_on(wait_for_status(
        &client,
        Duration::from_secs(15),
        "the restored replica out of the in-sync set",
        |s| !moving_shard(s).in_sync.contains(&r_id),
    ));
    let p_id = nodes[p].id.clone();
    nodes[p].kill();
    rt.block_on(revoke_registration(&endpoint, &p_id));
    // No failover to the copy that lacks acknowledged writes.
    std::thread::sleep(Duration::from_secs(8));
    let now = moving_shard(&rt.block_on(client.cluster_status()).unwrap());
    assert_eq!(
        now.node_id, p_id,
        "promoted a copy behind its acknowledged writes: {now:?}"
    );
    nodes[p].start(&endpoint);
    rt.block_on(async {
        wait_in_sync(&addrs[c], 2).await;
        check_acked(&client, &acked).await;
    });
}

/// etcd stopped for twice the lease: every write is refused UNAVAILABLE ("cut off from etcd")
/// from at most 3/4 of a lease after the stop (the last renewal was up to a third of a lease
/// earlier, so from 5/12 of a lease on), none is acknowledged after that while etcd is down,
/// and writes are acknowledged again once etcd is back. Prints when the first refusal came.
#[test]
fn processes_writes_stop_within_three_quarters_of_a_lease_after_etcd_stops() {
    const LEASE: u64 = 4;
    const DIM: usize = 8;
    let Some((_dir, mut etcd, nodes)) = real_cluster(2, LEASE) else {
        return;
    };
    let rt = runtime();
    let client = rt.block_on(Client::connect(nodes[0].addr())).unwrap();
    rt.block_on(create_moving(&client, DIM, 2, 1, 1));
    let acked: Acked = Default::default();
    let mut doc = 0u128;
    let mut write = |timeout: Duration| {
        doc += 1;
        rt.block_on(insert_recorded(&client, &acked, vec![doc * 7], timeout))
    };
    write(Duration::from_secs(5)).unwrap();
    etcd.stop();
    let stopped = Instant::now();
    let mut first_refusal = None;
    while stopped.elapsed() < Duration::from_secs(2 * LEASE) {
        match write(Duration::from_millis(500)) {
            Ok(()) => assert!(
                first_refusal.is_none(),
                "a write acknowledged {:?} after etcd stopped, after a refusal at {first_refusal:?}",
                stopped.elapsed()
            ),
            Err(error) => {
                assert_eq!(error.code(), Code::Unavailable, "{error}");
                first_refusal.get_or_insert(stopped.elapsed());
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let first_refusal = first_refusal.expect("writes went on with etcd down for two leases");
    eprintln!("lease {LEASE} s: writes refused from {first_refusal:?} after etcd stopped");
    assert!(
        first_refusal <= Duration::from_millis(LEASE * 750 + 1_000),
        "{first_refusal:?}"
    );
    etcd.restart();
    let back = Instant::now();
    while write(Duration::from_secs(2)).is_err() {
        assert!(
            back.elapsed() < Duration::from_secs(30),
            "writes never came back"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    eprintln!(
        "writes acknowledged again {:?} after etcd restarted",
        back.elapsed()
    );
}

/// A node holding a copy of a replicated shard cut off from etcd (its link silently cut; its
/// links to the other nodes and its clients intact) stops answering reads from its own copy,
/// which may be behind: every Get through it of a write acknowledged after the cut either
/// finds the write (another copy answered) or fails; none answers OK without it. Before, the
/// cut-off node answered from its stale copy for as long as the cut lasted.
#[test]
fn processes_a_copy_cut_off_from_etcd_serves_no_stale_read() {
    const LEASE: u64 = 3;
    const DIM: usize = 8;
    let Some(binary) = etcd_binary() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(binary, &dir.path().join("etcd"));
    let proxy = CuttableProxy::start(etcd.client_port);
    let mut nodes = nodes_with(dir.path(), 2, &etcd.endpoint(), LEASE, &[], &[]);
    let mut n3 = Node::new(dir.path(), "n3", LEASE);
    n3.start(&proxy.endpoint());
    nodes.push(n3);
    let rt = runtime();
    let addrs: Vec<String> = nodes.iter().map(|n| n.addr()).collect();
    rt.block_on(async {
        let c1 = Client::connect(addrs[0].clone()).await.unwrap();
        create_moving(&c1, DIM, 1, 3, 1).await;
        wait_in_sync(&addrs[0], 3).await;
        let acked: Acked = Default::default();
        let docs = (0..20u128).map(|k| k * 7).collect();
        insert_recorded(&c1, &acked, docs, Duration::from_secs(10))
            .await
            .unwrap();
        proxy.cut();
        // Past n3's lease: a failover if it led the shard, its copy out of the in-sync set
        // otherwise; writes through n1 are acknowledged again.
        tokio::time::sleep(Duration::from_secs(LEASE + 1)).await;
        let fresh: Vec<u128> = (1_000..1_020u128).map(|k| k * 7).collect();
        let started = Instant::now();
        while insert_recorded(&c1, &acked, fresh.clone(), Duration::from_secs(5))
            .await
            .is_err()
        {
            assert!(started.elapsed() < Duration::from_secs(30), "no write acknowledged");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let c3 = Client::builder(addrs[2].clone())
            .timeout(Duration::from_secs(3))
            .connect()
            .await
            .unwrap();
        let (mut found, mut refused) = (0, 0);
        for doc in &fresh {
            match c3.get("moving", doc % 7, &[*doc]).await {
                Ok(got) => {
                    assert_eq!(
                        got.len(),
                        1,
                        "a read through the cut-off node answered without acknowledged document {doc}"
                    );
                    found += 1;
                }
                Err(_) => refused += 1,
            }
        }
        eprintln!("through the cut-off node: {found} found, {refused} refused");
        proxy.restore();
    });
}

/// A node cut off from etcd (a silent partition, by a proxy) stops acknowledging writes to its
/// shards before its lease can lapse (UNAVAILABLE "cut off from etcd"); once its lease has
/// lapsed, `forget` through another node gives its shards up; when the partition heals the node
/// registers again, sets its copies aside instead of dropping them, and writes through it work
/// again. Every acknowledged write is then there (the given-up ones by importing the set-aside
/// copies).
#[test]
fn processes_a_node_cut_off_from_etcd_stops_acknowledging_and_keeps_its_data() {
    let Some(binary) = etcd_binary() else {
        return;
    };
    const LEASE: u64 = 3;
    const DIM: usize = 8;
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(binary, &dir.path().join("etcd"));
    let proxy = CuttableProxy::start(etcd.client_port);
    let mut nodes = nodes_with(dir.path(), 1, &etcd.endpoint(), LEASE, &[], &[]);
    let mut n2 = Node::new(dir.path(), "n2", LEASE);
    n2.start(&proxy.endpoint());
    nodes.push(n2);
    let rt = runtime();
    rt.block_on(async {
        let c1 = Client::connect(nodes[0].addr()).await.unwrap();
        let c2 = Client::connect(nodes[1].addr()).await.unwrap();
        c1.create_collection(
            CollectionSpec::new("cut", DIM as u32)
                .metric(Metric::L2)
                .shards(4, ShardKey::Doc),
        )
        .await
        .unwrap();
        let status = c1.cluster_status().await.unwrap();
        let n2_shards: Vec<u32> = status
            .shards
            .iter()
            .filter(|s| s.node_id == "n2")
            .map(|s| s.shard)
            .collect();
        assert!(!n2_shards.is_empty());
        // A writer through n2, one document per request.
        let acked = std::sync::Arc::new(acked::Acked::default());
        let late = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let cut_at = std::sync::Arc::new(std::sync::Mutex::new(None::<Instant>));
        let writer = {
            let (acked, late, stop, cut_at) =
                (acked.clone(), late.clone(), stop.clone(), cut_at.clone());
            let (c2, n2_shards) = (c2.clone(), n2_shards.clone());
            tokio::spawn(async move {
                let mut rng = rand::rngs::StdRng::seed_from_u64(3);
                let mut failures = Vec::new();
                let mut doc = 0u128;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    doc += 1;
                    let v = vectors(&mut rng, 1, DIM);
                    let result = c2
                        .insert(
                            Insert::new("cut", [doc], v.clone())
                                .durability(Durability::Fsync)
                                .timeout(Duration::from_secs(2)),
                        )
                        .await;
                    match result {
                        Ok(_) => {
                            let on_n2 = n2_shards.contains(&tarn_cluster::shard_for(doc, 4));
                            let cut = *cut_at.lock().unwrap();
                            if on_n2
                                && cut.is_some_and(|t| t.elapsed() > Duration::from_secs(LEASE))
                            {
                                late.lock().unwrap().push(doc);
                            }
                            acked.push(doc, v);
                        }
                        Err(error) => {
                            failures.push((error.code(), error.message().to_owned()));
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                    }
                }
                failures
            })
        };
        tokio::time::sleep(Duration::from_millis(1500)).await;
        *cut_at.lock().unwrap() = Some(Instant::now());
        proxy.cut();
        // Past n2's lease: n1 sees it dead, and gives its shards up.
        wait_for_status(&c1, Duration::from_secs(20), "n2 dead to n1", |s| {
            s.nodes.iter().any(|n| n.node_id == "n2" && !n.alive)
        })
        .await;
        tokio::time::sleep(Duration::from_secs(1)).await;
        let given_up = c1.forget_node("n2", true).await.unwrap();
        assert_eq!(given_up.len(), n2_shards.len());
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let failures = writer.await.unwrap();
        let late = late.lock().unwrap().clone();
        assert!(
            late.is_empty(),
            "n2 acknowledged writes to its shards more than a lease after it was cut off: {late:?}"
        );
        assert!(
            failures
                .iter()
                .any(|(code, m)| *code == Code::Unavailable && m.contains("cut off from etcd")),
            "{failures:?}"
        );
        // The partition heals: n2 registers again, sets its copies aside, takes writes.
        proxy.restore();
        let copies = wait_for_set_aside(&nodes[1].addr(), n2_shards.len()).await;
        for copy in &copies {
            assert!(copy.reason.contains("given up"), "{copy:?}");
        }
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let v = vec![0.25; DIM];
            match c2
                .insert(Insert::new("cut", [1_000_000u128], v.clone()))
                .await
            {
                Ok(_) => {
                    acked.push(1_000_000, v);
                    break;
                }
                Err(error) => {
                    assert!(
                        Instant::now() < deadline,
                        "n2 takes no writes after rejoining: {error}"
                    )
                }
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        // Nothing acknowledged is lost: the given-up shards' documents come back by import.
        for copy in &copies {
            c2.import_set_aside(&copy.name, "cut").await.unwrap();
        }
        assert_all_there(&c1, "cut", &acked.all()).await;
    });
}

/// A move that keeps failing is shown in status (to whom, how many times, why) and retried
/// with a doubling backoff, not every 2 s; once the taker can pull, the move goes through and
/// the record is cleared.
#[test]
fn processes_failed_moves_back_off_and_show_in_status() {
    let Some((dir, etcd, mut nodes)) = real_cluster(1, 2) else {
        return;
    };
    let rt = runtime();
    let c1 = rt.block_on(async {
        let c1 = Client::connect(nodes[0].addr()).await.unwrap();
        c1.create_collection(
            CollectionSpec::new("stuck", 4)
                .metric(Metric::L2)
                .shards(2, ShardKey::Doc),
        )
        .await
        .unwrap();
        insert_docs(&c1, "stuck", 1, 50, 4).await;
        c1
    });
    let mut n2 = Node::new(dir.path(), "n2", 2);
    n2.start_with_env(
        &etcd.endpoint(),
        &[("FAILPOINTS", "moves::fail_pull=return")],
    );
    let problem = |s: &tarn_client::ClusterStatus| {
        s.shards
            .iter()
            .find(|s| !s.move_problem.is_empty())
            .map(|s| s.move_problem.clone())
    };
    rt.block_on(async {
        let status = wait_for_status(&c1, Duration::from_secs(20), "a failed move shown", |s| {
            problem(s).is_some()
        })
        .await;
        let shown = problem(&status).unwrap();
        assert!(shown.contains("moving to n2 failed 1 times"), "{shown}");
        assert!(shown.contains("fail point"), "{shown}");
        // 2 s, 4 s, 8 s between attempts: at most 4 in 12 s (every 2 s would be 7).
        tokio::time::sleep(Duration::from_secs(12)).await;
        let status = c1.cluster_status().await.unwrap();
        let shown = problem(&status).unwrap();
        let n: u32 = shown
            .split("failed ")
            .nth(1)
            .and_then(|rest| rest.split(' ').next())
            .and_then(|n| n.parse().ok())
            .unwrap();
        assert!((2..=4).contains(&n), "{n} attempts: {shown}");
        assert!(status.shards.iter().all(|s| s.node_id == "n1"));
    });
    // The taker can pull again: the move goes through, the record goes.
    n2.kill();
    n2.start(&etcd.endpoint());
    rt.block_on(async {
        wait_for_status(
            &c1,
            Duration::from_secs(60),
            "the move done, its record cleared",
            |s| problem(s).is_none() && s.shards.iter().any(|s| s.node_id == "n2"),
        )
        .await;
    });
    nodes.push(n2);
}

/// The seeded nemesis, one fault at a time (the two-at-a-time one is `nemesis.rs`): three nodes, each reaching etcd through its own cuttable proxy, writers
/// (inserts and removes) and searchers through every node, while faults chosen by a seeded RNG
/// follow one another: kill -9 and restart at once, SIGSTOP for a few seconds, a node's etcd
/// connection cut (silently) and restored, a graceful restart, a drain and its cancel. Then
/// every fault is undone and the cluster settles; every acknowledged write is there exactly
/// once, no removed document is back, no shard lost its data, and every error any call saw
/// was UNAVAILABLE, DEADLINE_EXCEEDED or ABORTED. `TARN_NEMESIS_SEED` and
/// `TARN_NEMESIS_SECONDS` (default 90) choose the run; the seed is printed.
#[test]
fn processes_nemesis_one_fault_at_a_time() {
    use rustix::process::Signal;
    let Some(binary) = etcd_binary() else {
        return;
    };
    let seed: u64 = std::env::var("TARN_NEMESIS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20261124);
    let seconds: u64 = std::env::var("TARN_NEMESIS_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(90);
    // Copies of each shard (TARN_NEMESIS_REPLICAS: 1 by default; scripts/cluster-e2e.sh also
    // runs it with 2, where kill -9 and SIGSTOP fail shards over).
    let replicas: u32 = std::env::var("TARN_NEMESIS_REPLICAS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1);
    eprintln!(
        "nemesis: seed {seed}, {seconds} s, {replicas} copies (TARN_NEMESIS_SEED, \
         TARN_NEMESIS_SECONDS, TARN_NEMESIS_REPLICAS)"
    );
    const DIM: usize = 8;
    const LEASE: u64 = 3;
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(binary, &dir.path().join("etcd"));
    let proxies: Vec<CuttableProxy> = (0..3)
        .map(|_| CuttableProxy::start(etcd.client_port))
        .collect();
    let mut nodes: Vec<Node> = (1..=3)
        .map(|i| Node::new(dir.path(), &format!("n{i}"), LEASE))
        .collect();
    for (node, proxy) in nodes.iter_mut().zip(&proxies) {
        node.start(&proxy.endpoint());
    }
    let rt = runtime();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let (acked, stop, writers, searchers) = rt.block_on(async {
        let mut clients = Vec::new();
        for node in &nodes {
            clients.push(Client::connect(node.addr()).await.unwrap());
        }
        create_moving(&clients[0], DIM, 6, replicas, 0).await;
        let (acked, stop, writers) = start_writers(&clients, DIM);
        let searchers: Vec<_> = clients
            .iter()
            .map(|client| start_searcher(client.clone(), DIM, stop.clone()))
            .collect();
        (acked, stop, writers, searchers)
    });
    let started = Instant::now();
    let pause = |rng: &mut rand::rngs::StdRng, lo: u64, hi: u64| {
        std::thread::sleep(Duration::from_millis(rng.random_range(lo..hi)));
    };
    let mut faults = Vec::new();
    while started.elapsed() < Duration::from_secs(seconds) {
        pause(&mut rng, 1_000, 3_000);
        let i = rng.random_range(0..3usize);
        let fault = rng.random_range(0..5u32);
        let at = started.elapsed().as_secs_f64();
        match fault {
            0 => {
                faults.push(format!("{at:.1}s kill -9 n{}, restart", i + 1));
                nodes[i].kill();
                pause(&mut rng, 0, 3_000);
                nodes[i].start(&proxies[i].endpoint());
            }
            1 => {
                faults.push(format!("{at:.1}s SIGSTOP n{}", i + 1));
                nodes[i].signal(Signal::STOP);
                pause(&mut rng, 500, 5_000);
                nodes[i].signal(Signal::CONT);
            }
            2 => {
                faults.push(format!("{at:.1}s cut n{}'s etcd", i + 1));
                proxies[i].cut();
                pause(&mut rng, 1_000, 8_000);
                proxies[i].restore();
            }
            3 => {
                faults.push(format!("{at:.1}s graceful restart of n{}", i + 1));
                if let Some(server) = nodes[i].server.take() {
                    server.terminate();
                }
                nodes[i].start(&proxies[i].endpoint());
            }
            _ => {
                faults.push(format!("{at:.1}s drain n{} and cancel", i + 1));
                let other = nodes[(i + 1) % 3].addr();
                let id = nodes[i].id.clone();
                rt.block_on(async {
                    if let Ok(client) = Client::connect(other).await {
                        let _ = client.drain_node(&id, false).await;
                        tokio::time::sleep(Duration::from_millis(rng.random_range(2_000..8_000)))
                            .await;
                        let _ = client.drain_node(&id, true).await;
                    }
                });
            }
        }
    }
    eprintln!("nemesis: {} faults: {faults:?}", faults.len());
    rt.block_on(async {
        // Undo everything and let the cluster settle: every node alive, no drain, no fence.
        let client = Client::connect(nodes[0].addr()).await.unwrap();
        for node in &nodes {
            let _ = client.drain_node(&node.id, true).await;
        }
        wait_for_status(
            &client,
            Duration::from_secs(90),
            "the cluster settled",
            |s| {
                s.nodes.iter().filter(|n| n.alive && !n.draining).count() == 3
                    && s.shards.iter().all(|s| s.state == "serving")
            },
        )
        .await;
        tokio::time::sleep(Duration::from_secs(2)).await;
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let mut failures = Vec::new();
        let mut n_acked = 0;
        for writer in writers {
            let (n, f) = writer.await.unwrap();
            n_acked += n;
            failures.extend(f);
        }
        for searcher in searchers {
            failures.extend(searcher.await.unwrap().1);
        }
        let allowed = ["Unavailable:", "DeadlineExceeded:", "Aborted:"];
        let odd: Vec<&String> = failures
            .iter()
            .filter(|f| !allowed.iter().any(|a| f.starts_with(a)))
            .collect();
        assert!(odd.is_empty(), "errors of other codes: {odd:#?}");
        assert!(n_acked > 100, "only {n_acked} writes acknowledged");
        eprintln!(
            "nemesis: {n_acked} writes acknowledged, {} calls failed",
            failures.len()
        );
        // Each acknowledged write once, no removed document back (read through a node the
        // seed picks: every read is routed to the shards' owners anyway).
        let reader = &nodes[(seed % 3) as usize];
        let client = Client::connect(reader.addr()).await.unwrap();
        check_acked(&client, &acked).await;
    });
    if replicas > 1 {
        // Every shard back to all its copies in sync, and the copies hold the same documents.
        rt.block_on(wait_in_sync(&nodes[0].addr(), replicas as usize));
        std::thread::sleep(Duration::from_secs(1));
        for node in &mut nodes {
            node.kill();
        }
        assert_copies_identical(nodes.iter().map(|n| &n.dir), "moving", 6, replicas as usize);
    }
}

/// A node asked to stop (SIGTERM) while a peer that holds connections to it is stopped
/// (SIGSTOP: the peer never closes them) stops within its shutdown grace (15 s), its
/// collections closed: HTTP/2 pings close the dead peer's connections, and the grace bounds
/// what is left. Before, the graceful shutdown waited for the stopped peer's connections to
/// close, for good (found by the nemesis: a restart of n3 while n1 was stopped).
#[test]
fn processes_a_node_stops_in_bounded_time_while_a_peer_is_stopped() {
    use rustix::process::Signal;
    let Some((_dir, _etcd, mut nodes)) = real_cluster(2, 2) else {
        return;
    };
    let rt = runtime();
    rt.block_on(async {
        let c2 = Client::connect(nodes[1].addr()).await.unwrap();
        wait_for_status(&c2, Duration::from_secs(10), "two live nodes", |s| {
            s.nodes.iter().filter(|n| n.alive).count() == 2
        })
        .await;
        // Two copies of each shard: n2 ships to n1 and forwards to it, over its connections.
        create_moving(&c2, 8, 2, 2, 1).await;
        wait_in_sync(&nodes[1].addr(), 2).await;
        insert_docs(&c2, "moving", 1, 50, 8).await;
    });
    nodes[1].signal(Signal::STOP);
    let server = nodes[0].server.take().unwrap();
    let pid = server.child.id();
    let started = Instant::now();
    let (done, stopped) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = done.send(server.terminate());
    });
    let outcome = stopped.recv_timeout(Duration::from_secs(40));
    if outcome.is_err() {
        let _ = rustix::process::kill_process(
            rustix::process::Pid::from_raw(pid as i32).unwrap(),
            Signal::KILL,
        );
    }
    nodes[1].signal(Signal::CONT);
    let took = started.elapsed();
    let status = outcome.expect("n1 did not stop within 40 s of SIGTERM while n2 was stopped");
    eprintln!("n1 stopped {took:?} after SIGTERM");
    assert!(status.success(), "{status:?}");
    assert!(took < Duration::from_secs(30), "{took:?}");
}

/// GetCollection and Flush fan out to every shard: with a shard's owner stopped (SIGSTOP: its
/// connections stay open and never answer) they end by the client's deadline with
/// DEADLINE_EXCEEDED naming the shard and node, or by the default deadline when the client sets
/// none; nothing hangs.
#[test]
fn processes_forwarded_admin_calls_keep_the_caller_s_deadline() {
    use rustix::process::Signal;
    // A lease that outlasts the test's stop: the stopped node stays a live owner.
    let Some((_dir, _etcd, nodes)) = real_cluster(2, 30) else {
        return;
    };
    let rt = runtime();
    rt.block_on(async {
        let c1 = Client::connect(nodes[0].addr()).await.unwrap();
        // Both nodes in n1's view first, so that the placement gives n2 its shards at once.
        wait_for_status(&c1, Duration::from_secs(10), "two live nodes", |s| {
            s.nodes.iter().filter(|n| n.alive).count() == 2
        })
        .await;
        c1.create_collection(
            CollectionSpec::new("slow", 4)
                .metric(Metric::L2)
                .shards(4, ShardKey::Doc),
        )
        .await
        .unwrap();
        insert_docs(&c1, "slow", 1, 50, 4).await;
        let status = c1.cluster_status().await.unwrap();
        assert!(
            status.shards.iter().any(|s| s.node_id == "n2"),
            "n2 owns shards of slow: {status:?}"
        );
    });
    nodes[1].signal(Signal::STOP);
    rt.block_on(async {
        let hurried = Client::builder(nodes[0].addr())
            .timeout(Duration::from_secs(2))
            .connect()
            .await
            .unwrap();
        for call in ["GetCollection", "Flush"] {
            let started = Instant::now();
            let error = match call {
                "GetCollection" => hurried.collection_info("slow").await.map(|_| ()),
                _ => hurried.flush("slow").await.map(|_| ()),
            }
            .unwrap_err();
            let took = started.elapsed();
            assert_eq!(error.code(), Code::DeadlineExceeded, "{call}: {error}");
            assert!(took < Duration::from_secs(4), "{call} took {took:?}");
        }
        // No client deadline: the server's default one (10 s for GetCollection).
        let patient = Client::connect(nodes[0].addr()).await.unwrap();
        let started = Instant::now();
        let error = patient.collection_info("slow").await.unwrap_err();
        assert_eq!(error.code(), Code::DeadlineExceeded, "{error}");
        assert!(error.message().contains("n2"), "{error}");
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "{:?}",
            started.elapsed()
        );
    });
    nodes[1].signal(Signal::CONT);
    rt.block_on(async {
        let c1 = Client::connect(nodes[0].addr()).await.unwrap();
        assert_eq!(c1.collection_info("slow").await.unwrap().n_documents, 50);
    });
}

/// A shard stream whose taker reads nothing ends after the idle limit (shortened to 500 ms by a
/// fail point here; 30 s in production), releasing its thread and WAL pin: with 4 such streams
/// held unread, a fifth is refused at once, and a moment later streams open again.
#[test]
fn processes_unread_shard_streams_end_and_release_their_slot() {
    use tarn_proto::v1 as pb;
    let Some(binary) = etcd_binary() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(binary, &dir.path().join("etcd"));
    let mut n1 = Node::new(dir.path(), "n1", 2);
    n1.start_with_env(
        &etcd.endpoint(),
        &[("FAILPOINTS", "moves::stream_idle_ms=return(500)")],
    );
    let mut n2 = Node::new(dir.path(), "n2", 2);
    runtime().block_on(async {
        let c1 = Client::connect(n1.addr()).await.unwrap();
        // A shard with enough data that its snapshot does not fit in the stream's buffer.
        c1.create_collection(CollectionSpec::new("pinned", 64).shards(1, ShardKey::Doc))
            .await
            .unwrap();
        insert_docs(&c1, "pinned", 1, 10_000, 64).await;
        c1.flush("pinned").await.unwrap();
        // The taker must be a live node: n2 joins, its moves failing so the shard stays put.
        n2.start_with_env(
            &etcd.endpoint(),
            &[("FAILPOINTS", "moves::fail_pull=return")],
        );
        wait_for_status(&c1, Duration::from_secs(10), "n2 alive", |s| {
            s.nodes.iter().any(|n| n.node_id == "n2" && n.alive)
        })
        .await;
        let raw = raw_etcd(&etcd.endpoint());
        let record = raw.get(b"/tarn/cluster", false).await.unwrap();
        let secret = serde_json::from_slice::<serde_json::Value>(&record.kvs[0].value).unwrap()
            ["node_secret"]
            .as_str()
            .unwrap()
            .to_owned();
        let status = c1.cluster_status().await.unwrap();
        let epoch = status.shards[0].epoch;
        let state = {
            let kvs = raw
                .get(b"/tarn/collections/pinned", false)
                .await
                .unwrap()
                .kvs;
            serde_json::from_slice::<serde_json::Value>(&kvs[0].value).unwrap()
        };
        let uid = state["uid"].as_u64().unwrap();
        let address = tarn_cluster::ShardName {
            collection: "pinned".into(),
            uid,
            shard: 0,
        }
        .address(epoch);
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", n1.addr()))
            .unwrap()
            .connect()
            .await
            .unwrap();
        let open = || {
            let mut request = tonic::Request::new(pb::ShardStreamRequest {
                shard: address.clone(),
                to_node: "n2".into(),
                replica: false,
            });
            request
                .metadata_mut()
                .insert(tarn_server::NODE_SECRET_HEADER, secret.parse().unwrap());
            let mut node = pb::node_client::NodeClient::new(channel.clone());
            async move { node.shard_stream(request).await }
        };
        let mut held = Vec::new();
        for _ in 0..4 {
            held.push(open().await.unwrap());
        }
        let refused = open().await.unwrap_err();
        assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused}");
        // Unread, they end after the idle limit; the slots come back.
        tokio::time::sleep(Duration::from_secs(3)).await;
        open().await.unwrap();
        drop(held);
    });
    drop(n2);
    drop(n1);
}

/// Nodes that advertise `https://` addresses with certificates of a private CA: with
/// `--cluster-ca` they trust it for each other's calls, so writes and searches forwarded between
/// them work; without it (the Mozilla roots only) a forwarded call fails UNAVAILABLE.
#[test]
fn processes_nodes_trust_a_private_ca_for_each_other() {
    let Some(binary) = etcd_binary() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(binary, &dir.path().join("etcd"));
    let certified = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
    let (cert_pem, key_pem) = (certified.cert.pem(), certified.signing_key.serialize_pem());
    let cert = dir.path().join("cert.pem");
    let key = dir.path().join("key.pem");
    std::fs::write(&cert, &cert_pem).unwrap();
    std::fs::write(&key, &key_pem).unwrap();
    let start = |i: usize, port: u16, ca: bool| {
        let listen = format!("127.0.0.1:{port}");
        let advertise = format!("https://localhost:{port}");
        let mut args = vec![
            "--listen".to_owned(),
            listen,
            "--etcd".to_owned(),
            etcd.endpoint(),
            "--node-id".to_owned(),
            format!("n{i}"),
            "--advertise".to_owned(),
            advertise,
            "--lease-seconds".to_owned(),
            "2".to_owned(),
            "--tls-cert".to_owned(),
            cert.display().to_string(),
            "--tls-key".to_owned(),
            key.display().to_string(),
        ];
        if ca {
            args.push("--cluster-ca".to_owned());
            args.push(cert.display().to_string());
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        Server::start(&dir.path().join(format!("n{i}")), &args)
    };
    let ports = [free_port(), free_port()];
    let connect = |port: u16| {
        let pem = cert_pem.clone();
        async move {
            Client::builder(format!("https://localhost:{port}"))
                .tls_ca_certificate(pem)
                .connect()
                .await
                .unwrap()
        }
    };
    let rt = runtime();
    for ca in [true, false] {
        let servers = [start(1, ports[0], ca), start(2, ports[1], ca)];
        rt.block_on(async {
            let c1 = connect(ports[0]).await;
            let name = if ca { "trusted" } else { "untrusted" };
            // Creating answers with the collection's info, gathered from every shard's owner.
            let created = c1
                .create_collection(CollectionSpec::new(name, 4).shards(4, ShardKey::Doc))
                .await;
            if ca {
                created.unwrap();
                let docs: Vec<u128> = (1..=40).collect();
                c1.insert(Insert::new(name, docs, vec![0.5f32; 160]))
                    .await
                    .unwrap();
                let c2 = connect(ports[1]).await;
                assert_eq!(c2.collection_info(name).await.unwrap().n_documents, 40);
            } else {
                let error = created.unwrap_err();
                assert_eq!(error.code(), Code::Unavailable, "{error}");
                assert!(error.message().contains("certificate"), "{error}");
            }
        });
        for server in servers {
            server.kill();
        }
    }
}

/// CPU seconds (user + system) a process has used so far, from /proc.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // The fields after the command name (which is in parentheses and may hold spaces).
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .unwrap()
        .1
        .split_whitespace()
        .collect();
    let ticks: f64 = fields[11].parse::<f64>().unwrap() + fields[12].parse::<f64>().unwrap();
    let output = Command::new("getconf").arg("CLK_TCK").output().unwrap();
    let per_second: f64 = String::from_utf8_lossy(&output.stdout)
        .trim()
        .parse()
        .unwrap();
    ticks / per_second
}

/// An idle three-node cluster (a collection created, nothing asked of it) uses next to no CPU:
/// the placement coordinator waits for the next change of the map instead of planning in a loop
/// (it once spun a whole core: 53 s of CPU in 51 s).
#[test]
fn processes_an_idle_cluster_uses_no_cpu() {
    let Some((_dir, _etcd, nodes)) = real_cluster(3, 2) else {
        return;
    };
    let rt = runtime();
    rt.block_on(async {
        let client = Client::connect(nodes[0].addr()).await.unwrap();
        client
            .create_collection(CollectionSpec::new("idle", 8).shards(6, ShardKey::Doc))
            .await
            .unwrap();
        client
            .insert(Insert::new("idle", [1u128, 2, 3], vec![0.25f32; 24]))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_secs(3)).await;
    });
    let pids: Vec<u32> = nodes
        .iter()
        .map(|n| n.server.as_ref().unwrap().child.id())
        .collect();
    let before: Vec<f64> = pids.iter().map(|p| cpu_seconds(*p)).collect();
    let window = Duration::from_secs(30);
    std::thread::sleep(window);
    for (i, pid) in pids.iter().enumerate() {
        let used = cpu_seconds(*pid) - before[i];
        eprintln!("n{}: {used:.2} s of CPU in {window:?} idle", i + 1);
        assert!(
            used < 1.5,
            "n{} used {used:.2} s of CPU in {window:?} idle",
            i + 1
        );
    }
}

/// A node killed with kill -9 and started again at once (what systemd's `Restart=always` or a
/// container's restart policy does) serves at once: it proves with its data directory's token
/// that the registration still in etcd is its dead predecessor's, takes it over, and writes
/// through every node to every shard go on long before the old 20 s lease would have lapsed;
/// every acknowledged write is there after.
#[test]
fn processes_a_node_restarted_right_after_kill_9_serves_at_once() {
    let Some((_dir, etcd, mut nodes)) = real_cluster(3, 20) else {
        return;
    };
    let endpoint = etcd.endpoint();
    let rt = runtime();
    const DIM: usize = 8;
    let addrs: Vec<String> = nodes.iter().map(Node::addr).collect();
    let mut rng = rand::rngs::StdRng::seed_from_u64(27);
    let mut acked: BTreeMap<u128, Vec<f32>> = BTreeMap::new();
    // One request per node, 24 documents over the 6 shards: every node to every shard.
    let mut batch = |round: u128, node: usize| {
        let ids: Vec<u128> = (0..24)
            .map(|k| round * 1_000 + node as u128 * 100 + k)
            .collect();
        let v = vectors(&mut rng, ids.len(), DIM);
        (ids, v)
    };
    rt.block_on(async {
        let client = Client::connect(addrs[0].clone()).await.unwrap();
        client
            .create_collection(
                CollectionSpec::new("phoenix", DIM as u32)
                    .metric(Metric::L2)
                    .shards(6, ShardKey::Doc),
            )
            .await
            .unwrap();
    });
    for (i, addr) in addrs.iter().enumerate() {
        let (ids, v) = batch(1, i);
        rt.block_on(async {
            let client = Client::connect(addr.clone()).await.unwrap();
            client
                .insert(Insert::new("phoenix", ids.clone(), v.clone()))
                .await
                .unwrap();
        });
        for (k, id) in ids.iter().enumerate() {
            acked.insert(*id, v[k * DIM..(k + 1) * DIM].to_vec());
        }
    }
    nodes[2].signal(rustix::process::Signal::KILL);
    nodes[2].kill(); // reaps it
    let restarted = Instant::now();
    nodes[2].start(&endpoint);
    for (i, addr) in addrs.iter().enumerate() {
        let (ids, v) = batch(2, i);
        rt.block_on(async {
            let client = Client::connect(addr.clone()).await.unwrap();
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                let insert =
                    Insert::new("phoenix", ids.clone(), v.clone()).timeout(Duration::from_secs(2));
                match client.insert(insert).await {
                    Ok(_) => break,
                    Err(e) if Instant::now() < deadline => {
                        eprintln!("write through {addr} after the restart: {e}");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    Err(e) => panic!("no write through {addr} 10 s after n3's restart: {e}"),
                }
            }
        });
        for (k, id) in ids.iter().enumerate() {
            acked.insert(*id, v[k * DIM..(k + 1) * DIM].to_vec());
        }
    }
    let took = restarted.elapsed();
    eprintln!(
        "n3 restarted after kill -9: writes through every node to every shard {took:?} later"
    );
    assert!(
        took < Duration::from_secs(12),
        "{took:?}: waited for the old lease"
    );
    rt.block_on(async {
        for addr in &addrs {
            let client = Client::connect(addr.clone()).await.unwrap();
            let ids: Vec<u128> = acked.keys().copied().collect();
            // Get reads what each shard has applied, which follows the acknowledgement by a
            // moment (ingestion): a loaded machine may need a few tries.
            let deadline = Instant::now() + Duration::from_secs(10);
            let docs = loop {
                let docs = client.get("phoenix", 0, &ids).await.unwrap();
                if docs.len() == ids.len() || Instant::now() > deadline {
                    break docs;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            };
            assert_eq!(
                docs.len(),
                ids.len(),
                "acknowledged documents missing via {addr}"
            );
            for doc in docs {
                assert_eq!(doc.vector, acked[&doc.doc_id]);
            }
            let status = client.cluster_status().await.unwrap();
            assert!(status.nodes.iter().all(|n| n.alive), "{status:?}");
        }
    });
}

#[test]
fn processes_a_killed_node_s_shards_are_unavailable_then_come_back_whole() {
    let Some((_dir, mut etcd, mut nodes)) = real_cluster(3, 2) else {
        return;
    };
    let rt = runtime();
    const DIM: usize = 8;
    let entry = nodes[0].addr();
    let writer_addrs = [nodes[0].addr(), nodes[1].addr()];
    let (acked, stop, writers, victim_shards) = rt.block_on(async {
        let client = Client::connect(entry).await.unwrap();
        client
            .create_collection(
                CollectionSpec::new("load", DIM as u32)
                    .metric(Metric::L2)
                    .shards(6, ShardKey::Doc),
            )
            .await
            .unwrap();
        let status = client.cluster_status().await.unwrap();
        let victim_shards: Vec<u32> = status
            .shards
            .iter()
            .filter(|s| s.node_id == "n3")
            .map(|s| s.shard)
            .collect();
        assert!(!victim_shards.is_empty());
        // Writers through n1 and n2: one document per request, so each write is on one shard.
        let acked = std::sync::Arc::new(acked::Acked::default());
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut writers = Vec::new();
        for w in 0..4u128 {
            let addr = writer_addrs[(w % 2) as usize].clone();
            let (acked, stop) = (acked.clone(), stop.clone());
            writers.push(tokio::spawn(async move {
                let client = Client::connect(addr).await.unwrap();
                let mut rng = rand::rngs::StdRng::seed_from_u64(w as u64);
                let mut i = 0u128;
                let mut codes = Vec::new();
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let doc = w * 1_000_000 + i;
                    i += 1;
                    let v = vectors(&mut rng, 1, DIM);
                    let result = client
                        .insert(
                            Insert::new("load", [doc], v.clone())
                                .durability(Durability::Fsync)
                                .timeout(Duration::from_secs(5)),
                        )
                        .await;
                    match result {
                        Ok(_) => acked.push(doc, v),
                        Err(error) => codes.push((error.code(), error.message().to_owned())),
                    }
                }
                codes
            }));
        }
        tokio::time::sleep(Duration::from_millis(700)).await;
        (acked, stop, writers, victim_shards)
    });
    nodes[2].kill();
    rt.block_on(async {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let mut failures = Vec::new();
        for writer in writers {
            failures.extend(writer.await.unwrap());
        }
        // Failed writes are the dead node's shards, named, with a retryable code.
        assert!(!failures.is_empty(), "some writes went to n3's shards");
        for (code, message) in &failures {
            assert!(
                matches!(code, Code::Unavailable | Code::DeadlineExceeded),
                "{code:?}: {message}"
            );
            if *code == Code::Unavailable {
                assert!(
                    message.contains("shard") && message.contains("n3"),
                    "{message}"
                );
            }
        }
    });
    rt.block_on(async {
        let client = Client::connect(nodes[0].addr()).await.unwrap();
        // A search over every shard fails naming a dead one, unless partial answers are asked.
        let query = vec![0.0f32; DIM];
        let error = client
            .search(Search::new("load", query.clone()).exact(true))
            .await
            .unwrap_err();
        assert_eq!(error.code(), Code::Unavailable);
        assert!(error.message().contains("n3"), "{error}");
        let (hits, missing) = client
            .search_partial(
                Search::new("load", query.clone())
                    .exact(true)
                    .allow_partial(true),
            )
            .await
            .unwrap();
        assert!(!hits.is_empty());
        let mut missing = missing;
        missing.sort_unstable();
        assert_eq!(missing, victim_shards);
        // Past its lease, n3 is dead but still owns its shards: never handed to another node.
        tokio::time::sleep(Duration::from_secs(3)).await;
        let status = client.cluster_status().await.unwrap();
        assert!(
            status.nodes.iter().any(|n| n.node_id == "n3" && !n.alive),
            "{status:?}"
        );
        for shard in &victim_shards {
            let s = status.shards.iter().find(|s| s.shard == *shard).unwrap();
            assert_eq!(
                (s.node_id.as_str(), s.state.as_str()),
                ("n3", "unavailable")
            );
        }
    });
    // n3 comes back: every acknowledged write is there, once.
    let endpoint = etcd.endpoint();
    nodes[2].start(&endpoint);
    rt.block_on(async {
        let client = Client::connect(nodes[1].addr()).await.unwrap();
        let acked = acked.all();
        assert!(acked.len() > 50, "{}", acked.len());
        let info = client.collection_info("load").await.unwrap();
        assert!(info.n_documents >= acked.len() as u64);
        let ids: Vec<u128> = acked.keys().copied().collect();
        for chunk in ids.chunks(1000) {
            let docs = client.get("load", 0, chunk).await.unwrap();
            assert_eq!(docs.len(), chunk.len(), "every acknowledged write is back");
            for doc in docs {
                assert_eq!(doc.vector, acked[&doc.doc_id]);
            }
        }
        // No duplicates: exact search for a stored vector finds its document once.
        for id in ids.iter().take(20) {
            let hits = client
                .search(Search::new("load", acked[id].clone()).exact(true).top_k(3))
                .await
                .unwrap();
            assert_eq!(hits[0].doc_id, *id);
            assert_eq!(hits.iter().filter(|h| h.doc_id == *id).count(), 1);
        }
    });
    // n3 stopped (SIGSTOP: registered, its connections open, silent): a partial search
    // answers within its deadline, listing n3's shards as missing; a whole one fails. Before,
    // the partial one failed DEADLINE_EXCEEDED too.
    nodes[2].signal(rustix::process::Signal::STOP);
    rt.block_on(async {
        let client = Client::connect(nodes[0].addr()).await.unwrap();
        let query = vec![0.0f32; DIM];
        let started = Instant::now();
        let (hits, mut missing) = client
            .search_partial(
                Search::new("load", query.clone())
                    .exact(true)
                    .allow_partial(true)
                    .timeout(Duration::from_secs(3)),
            )
            .await
            .unwrap();
        assert!(!hits.is_empty());
        missing.sort_unstable();
        assert_eq!(missing, victim_shards);
        assert!(started.elapsed() < Duration::from_secs(3));
        let error = client
            .search(
                Search::new("load", query)
                    .exact(true)
                    .timeout(Duration::from_secs(2)),
            )
            .await
            .unwrap_err();
        // (UNAVAILABLE once n3's 2 s lease has lapsed meanwhile.)
        assert!(
            matches!(error.code(), Code::DeadlineExceeded | Code::Unavailable),
            "{error}"
        );
    });
    nodes[2].signal(rustix::process::Signal::CONT);
    // n3 registered again (its lease lapsed while it was stopped) and answering.
    rt.block_on(async {
        let client = Client::connect(nodes[0].addr()).await.unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        while client
            .search(Search::new("load", vec![0.0f32; DIM]).exact(true))
            .await
            .is_err()
        {
            assert!(Instant::now() < deadline, "n3 did not answer again");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    });

    // etcd stopped: the data plane goes on with the map it has; placement waits.
    etcd.stop();
    rt.block_on(async {
        let client = Client::connect(nodes[0].addr()).await.unwrap();
        tokio::time::sleep(Duration::from_millis(500)).await;
        let ack = client
            .insert(Insert::new(
                "load",
                [5_000_000u128, 5_000_001],
                vec![0.5f32; 2 * DIM],
            ))
            .await
            .unwrap();
        let hits = client
            .search(
                Search::new("load", vec![0.5f32; DIM])
                    .exact(true)
                    .top_k(2)
                    .after(ack.read_token()),
            )
            .await
            .unwrap();
        assert!(hits.iter().all(|h| h.score < 1e-4));
        let status = client.cluster_status().await.unwrap();
        assert!(!status.etcd_connected);
        let error = client
            .create_collection(CollectionSpec::new("later", 4))
            .await
            .unwrap_err();
        assert_eq!(error.code(), Code::Unavailable, "{error}");
    });
    etcd.restart();
    rt.block_on(async {
        let client = Client::connect(nodes[0].addr()).await.unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            match client
                .create_collection(CollectionSpec::new("later", 4))
                .await
            {
                Ok(_) => break,
                Err(error) if Instant::now() < deadline => {
                    let _ = error;
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(error) => panic!("placement did not resume: {error}"),
            }
        }
        assert!(client.cluster_status().await.unwrap().etcd_connected);
    });
}

/// Acknowledged writes, shared by the writer tasks.
mod acked {
    use std::collections::BTreeMap;
    use std::sync::Mutex;

    #[derive(Default)]
    pub struct Acked(Mutex<BTreeMap<u128, Vec<f32>>>);

    impl Acked {
        pub fn push(&self, doc: u128, vector: Vec<f32>) {
            self.0.lock().unwrap().insert(doc, vector);
        }

        pub fn all(&self) -> BTreeMap<u128, Vec<f32>> {
            self.0.lock().unwrap().clone()
        }
    }
}

/// Waits until `done` holds for the cluster status seen through `client`, failing with `what`.
async fn wait_for_status(
    client: &Client,
    limit: Duration,
    what: &str,
    done: impl Fn(&tarn_client::ClusterStatus) -> bool,
) -> tarn_client::ClusterStatus {
    let deadline = Instant::now() + limit;
    loop {
        if let Ok(status) = client.cluster_status().await {
            if done(&status) {
                return status;
            }
            assert!(Instant::now() < deadline, "{what}: {status:#?}");
        }
        assert!(Instant::now() < deadline, "{what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Shard moves between real processes on a real etcd, under writes through every node: a node
/// that joins is killed in the middle of catching up (nothing changes for the shard); back, it
/// fences a shard and its old owner is killed between the fence and the flip (the fence is
/// lifted, the shard waits for its owner, which comes back whole); the placement then settles
/// with the new node holding its share; a node is stopped (SIGSTOP) while the new node is
/// drained and resumed after a flip, so it routes with a stale map. Afterwards each shard has
/// one owner, every acknowledged write is there once, and every failed write failed with a
/// retryable code.
#[test]
fn processes_shard_moves_survive_kills_and_a_stale_map() {
    let Some((dir, etcd, mut nodes)) = real_cluster(3, 2) else {
        return;
    };
    let endpoint = etcd.endpoint();
    nodes.push(Node::new(dir.path(), "n4", 2));
    let rt = runtime();
    const DIM: usize = 8;
    rt.block_on(async {
        let mut clients = Vec::new();
        for node in &nodes[..3] {
            clients.push(Client::connect(node.addr()).await.unwrap());
        }
        clients[0]
            .create_collection(
                CollectionSpec::new("moving", DIM as u32)
                    .metric(Metric::L2)
                    .shards(8, ShardKey::Doc),
            )
            .await
            .unwrap();
        let (acked, stop, writers) = start_writers(&clients, DIM);
        let searcher = start_searcher(clients[1].clone(), DIM, stop.clone());
        tokio::time::sleep(Duration::from_millis(500)).await;

        // 1. n4 joins, and is killed while it catches up on its first shard.
        nodes[3].start_with_env(
            &endpoint,
            &[("FAILPOINTS", "moves::before_fence=return(3000)")],
        );
        let deadline = Instant::now() + Duration::from_secs(30);
        while !nodes[3]
            .server
            .as_ref()
            .unwrap()
            .logs()
            .contains("moves::before_fence")
        {
            assert!(Instant::now() < deadline, "n4 never started catching up");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        nodes[3].kill();
        let status = clients[0].cluster_status().await.unwrap();
        assert!(
            status
                .shards
                .iter()
                .all(|s| s.node_id != "n4" && s.state != "fenced"),
            "a copy killed before its fence changes nothing: {status:#?}"
        );
        let gone = |id: &'static str| {
            move |s: &tarn_client::ClusterStatus| {
                !s.nodes.iter().any(|n| n.node_id == id && n.alive)
            }
        };
        wait_for_status(
            &clients[0],
            Duration::from_secs(15),
            "n4's lease",
            gone("n4"),
        )
        .await;

        // 2. n4 again; this time it is paused right after fencing, and the old owner dies.
        nodes[3].start_with_env(
            &endpoint,
            &[("FAILPOINTS", "moves::after_fence=return(3000)")],
        );
        clients.push(Client::connect(nodes[3].addr()).await.unwrap());
        let status = wait_for_status(&clients[0], Duration::from_secs(30), "no fence", |s| {
            s.shards
                .iter()
                .any(|s| s.state == "fenced" && s.moving_to == "n4")
        })
        .await;
        let fenced = status
            .shards
            .iter()
            .find(|s| s.state == "fenced")
            .unwrap()
            .clone();
        let owner = nodes.iter().position(|n| n.id == fenced.node_id).unwrap();
        nodes[owner].kill();
        // The taker cannot finish: the fence is lifted and the shard stays its owner's.
        let status = wait_for_status(
            &clients[3],
            Duration::from_secs(30),
            "fence not lifted",
            |s| {
                s.shards.iter().any(|x| {
                    x.shard == fenced.shard && x.epoch > fenced.epoch && x.state != "fenced"
                })
            },
        )
        .await;
        let lifted = status
            .shards
            .iter()
            .find(|x| x.shard == fenced.shard)
            .unwrap();
        assert_eq!(lifted.node_id, fenced.node_id, "{status:#?}");
        let owner_id = nodes[owner].id.clone();
        wait_for_status(
            &clients[3],
            Duration::from_secs(15),
            "the owner's lease",
            |s| !s.nodes.iter().any(|n| n.node_id == owner_id && n.alive),
        )
        .await;
        nodes[owner].start(&endpoint);
        clients[owner] = Client::connect(nodes[owner].addr()).await.unwrap();

        // 3. The placement settles: two shards each, n4 included.
        let want: BTreeMap<String, usize> = (1..=4).map(|i| (format!("n{i}"), 2)).collect();
        wait_for_status(
            &clients[0],
            Duration::from_secs(120),
            "placement did not settle",
            |s| owners(s, "moving") == want && s.shards.iter().all(|x| x.state == "serving"),
        )
        .await;

        // 4. n3 stopped while n4 is drained, resumed after a flip: it routes with a stale map.
        nodes[2].signal(rustix::process::Signal::STOP);
        let out = common::run_cli(&nodes[0].addr(), &["cluster", "drain", "n4", "--no-wait"]);
        assert!(out.contains("n4 is draining: 2 shards"), "{out}");
        let flipped = Instant::now() + Duration::from_secs(20);
        while Instant::now() < flipped {
            let status = clients[0].cluster_status().await.unwrap();
            if owners(&status, "moving").get("n4").copied().unwrap_or(0) < 2 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        nodes[2].signal(rustix::process::Signal::CONT);
        wait_for_status(
            &clients[0],
            Duration::from_secs(120),
            "n4 not drained",
            |s| {
                !owners(s, "moving").contains_key("n4")
                    && s.shards.iter().all(|x| x.state == "serving")
                    && s.nodes.iter().filter(|n| n.alive).count() == 4
            },
        )
        .await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let mut n_acked = 0;
        for writer in writers {
            let (n, failures) = writer.await.unwrap();
            n_acked += n;
            for failure in &failures {
                assert!(
                    ["Unavailable", "DeadlineExceeded", "Aborted"]
                        .iter()
                        .any(|code| failure.starts_with(code)),
                    "a write failed with a code that is not retryable: {failure}"
                );
            }
        }
        assert!(n_acked > 200, "{n_acked} acknowledged writes");
        // Searches fail only while a shard's owner is dead (UNAVAILABLE naming it), never
        // because of a move.
        let (n_searched, failures) = searcher.await.unwrap();
        assert!(n_searched > 50, "{n_searched} searches answered");
        for failure in &failures {
            assert!(
                ["Unavailable", "DeadlineExceeded"]
                    .iter()
                    .any(|code| failure.starts_with(code)),
                "a search failed during moves: {failure}"
            );
        }
        let out = common::run_cli(&nodes[0].addr(), &["cluster", "status"]);
        assert!(out.contains("(draining)"), "{out}");
        // Each shard has one owner in every node's view, and every node answers alike.
        let first = clients[0].cluster_status().await.unwrap().shards;
        for client in &clients {
            let deadline = Instant::now() + Duration::from_secs(10);
            while client.cluster_status().await.unwrap().shards != first {
                assert!(Instant::now() < deadline, "the nodes' maps differ");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            check_acked(client, &acked).await;
        }
    });
}

/// Inserts a batch of documents over every shard of `moving` through `addr`, again every
/// 100 ms until one is acknowledged (at most `limit`): how long that took. Each try's documents
/// are recorded in `acked` (live when acknowledged, uncertain when not).
async fn first_acknowledged_batch(
    addr: &str,
    acked: &Acked,
    base: u128,
    limit: Duration,
) -> Duration {
    const DIM: usize = 8;
    let client = Client::connect(addr.to_owned()).await.unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(base as u64);
    let started = std::time::Instant::now();
    for attempt in 0u128.. {
        assert!(
            started.elapsed() < limit,
            "no write acknowledged within {limit:?} of the fault"
        );
        // Multiples of 7: tenant 0 (`doc % 7`), as `check_acked` reads them.
        let docs: Vec<u128> = (0..48).map(|i| (base + attempt * 100 + i) * 7).collect();
        let v = vectors(&mut rng, docs.len(), DIM);
        let insert = Insert::new("moving", docs.clone(), v.clone())
            .users(vec![0])
            .durability(Durability::Fsync)
            .timeout(Duration::from_secs(3));
        let ok = client.insert(insert).await.is_ok();
        {
            let mut map = acked.lock().unwrap();
            for (i, doc) in docs.iter().enumerate() {
                let state = if ok {
                    Doc::Live(v[i * DIM..(i + 1) * DIM].to_vec())
                } else {
                    Doc::Uncertain
                };
                map.insert(*doc, state);
            }
        }
        if ok {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    started.elapsed()
}

/// Waits (at most a minute) until `node` logs that a fail point paused it.
fn wait_for_fail_point(node: &Node) {
    let started = std::time::Instant::now();
    while !node
        .server
        .as_ref()
        .unwrap()
        .logs()
        .contains("pausing at a fail point")
    {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the fail point never fired"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Waits (at most a minute) until every shard of `moving` has `copies` copies in sync, as
/// `addr` sees it; the status then.
async fn wait_in_sync(addr: &str, copies: usize) -> tarn_client::ClusterStatus {
    let client = Client::connect(addr.to_owned()).await.unwrap();
    let started = std::time::Instant::now();
    loop {
        if let Ok(status) = client.cluster_status().await {
            let shards: Vec<_> = status
                .shards
                .iter()
                .filter(|s| s.collection == "moving")
                .collect();
            if !shards.is_empty() && shards.iter().all(|s| s.in_sync.len() == copies) {
                return status;
            }
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "shards not back in sync within a minute: {shards:?}"
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Creates `moving` (`dim`, L2, `shards` DOC shards, `copies` copies of each, `min_in_sync`)
/// through `client`, once the node it asks sees `copies` live nodes (a node just started may
/// not have seen the others' registrations yet, and refuses a factor above what it sees).
async fn create_moving(client: &Client, dim: usize, shards: u32, copies: u32, min_in_sync: u32) {
    let started = std::time::Instant::now();
    loop {
        let status = client.cluster_status().await.unwrap();
        if status.nodes.iter().filter(|n| n.alive).count() >= copies as usize {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the node did not see {copies} live nodes within 30 s: {:?}",
            status.nodes
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    client
        .create_collection(
            CollectionSpec::new("moving", dim as u32)
                .metric(Metric::L2)
                .shards(shards, ShardKey::Doc)
                .replicas(copies, min_in_sync),
        )
        .await
        .unwrap();
}

/// A client connected to each of `addrs`.
async fn connect_all(addrs: &[String]) -> Vec<Client> {
    let mut clients = Vec::new();
    for addr in addrs {
        clients.push(Client::connect(addr.clone()).await.unwrap());
    }
    clients
}

/// Only the codes a client is told to retry on.
fn assert_retryable(failures: &[String]) {
    let distinct: std::collections::BTreeSet<&String> = failures.iter().collect();
    for failure in &distinct {
        eprintln!("  failure: {failure}");
    }
    for failure in failures {
        assert!(
            ["Unavailable:", "DeadlineExceeded:", "Aborted:"]
                .iter()
                .any(|code| failure.starts_with(code)),
            "{failure}"
        );
    }
}

/// Failover (replicas, issue tests 1, 5 and 8): a collection with 2 copies of each shard
/// (min_in_sync 1) under writers (inserts and removes). kill -9 of a node: each shard it was
/// primary of gets its in-sync replica promoted once its lease lapses, writes go on, and every
/// acknowledged write (no removed document back) is readable through each surviving node while
/// it is down. It comes back and rejoins the in-sync set. Then a primary is SIGSTOPped past
/// its lease under writers through every node (itself included): its shards fail over, and
/// once it runs again it acknowledges nothing the new primaries lack (every acknowledged write
/// is there afterwards) and rejoins as a replica. At the end every shard's copies hold the
/// same documents.
#[test]
fn processes_primaries_fail_over_after_kill_9_and_sigstop_losing_no_acknowledged_write() {
    use rustix::process::Signal;
    const LEASE: u64 = 2;
    let Some((_dir, _etcd, mut nodes)) = real_cluster(3, LEASE) else {
        return;
    };
    let rt = runtime();
    const DIM: usize = 8;
    let addrs: Vec<String> = nodes.iter().map(|n| n.addr()).collect();
    let (clients, status) = rt.block_on(async {
        let clients = connect_all(&addrs).await;
        create_moving(&clients[0], DIM, 6, 2, 1).await;
        let status = wait_in_sync(&addrs[0], 2).await;
        (clients, status)
    });
    let n3_primary: Vec<u32> = status
        .shards
        .iter()
        .filter(|s| s.collection == "moving" && s.node_id == "n3")
        .map(|s| s.shard)
        .collect();
    assert!(!n3_primary.is_empty(), "{status:?}");

    // kill -9 of n3 under writers through n1 and n2.
    let (acked, stop, writers) = rt.block_on(async {
        let started = start_writers(&clients[..2], DIM);
        tokio::time::sleep(Duration::from_millis(1500)).await;
        started
    });
    nodes[2].kill();
    rt.block_on(async {
        // Searches over every shard stay available at once (before the lease lapses: no
        // failover yet), answered by in-sync copies.
        for _ in 0..10 {
            let search = Search::new("moving", vec![0.5; DIM])
                .users(vec![3])
                .top_k(5)
                .timeout(Duration::from_secs(5));
            let hits = clients[0].search(search).await.unwrap();
            assert!(!hits.is_empty());
        }
        let took = first_acknowledged_batch(&addrs[0], &acked, 100_000_000, Duration::from_secs(30)).await;
        eprintln!("failover after kill -9: a write over every shard acknowledged {took:?} after the kill (lease {LEASE} s)");
        tokio::time::sleep(Duration::from_secs(1)).await;
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let mut n = 0;
        for writer in writers {
            let (acknowledged, failures) = writer.await.unwrap();
            n += acknowledged;
            eprintln!("writer: {acknowledged} acknowledged, {} failed", failures.len());
            assert_retryable(&failures);
        }
        assert!(n > 0);
        let status = clients[0].cluster_status().await.unwrap();
        for shard in status.shards.iter().filter(|s| s.collection == "moving") {
            assert_ne!(shard.node_id, "n3", "{shard:?}");
            if n3_primary.contains(&shard.shard) {
                assert_eq!(shard.state, "serving", "{shard:?}");
            }
        }
        let failovers: usize = nodes[..2]
            .iter()
            .map(|n| n.server.as_ref().unwrap().logs())
            .map(|log| log.matches("failover: an in-sync replica").count())
            .sum();
        assert_eq!(failovers, n3_primary.len(), "one promotion per shard n3 led");
        // Every acknowledged write, through each survivor, while n3 is down.
        for client in &clients[..2] {
            check_acked(client, &acked).await;
        }
    });

    // n3 returns: it catches up and rejoins the in-sync set of every shard it holds.
    nodes[2].start(&_etcd.endpoint());
    rt.block_on(wait_in_sync(&addrs[0], 2));

    // SIGSTOP of a primary past its lease, under writers through every node.
    let status = rt.block_on(clients[0].cluster_status()).unwrap();
    let victim = status
        .shards
        .iter()
        .find(|s| s.collection == "moving")
        .unwrap()
        .node_id
        .clone();
    let victim_idx = nodes.iter().position(|n| n.id == victim).unwrap();
    let other = addrs[(victim_idx + 1) % 3].clone();
    let (acked2, stop, writers) = rt.block_on(async {
        let started = start_writers(&clients, DIM);
        tokio::time::sleep(Duration::from_millis(1000)).await;
        started
    });
    nodes[victim_idx].signal(Signal::STOP);
    rt.block_on(async {
        let took = first_acknowledged_batch(&other, &acked2, 110_000_000, Duration::from_secs(30)).await;
        eprintln!("failover after SIGSTOP of {victim}: a write over every shard acknowledged {took:?} after the stop");
        tokio::time::sleep(Duration::from_secs(1)).await;
    });
    nodes[victim_idx].signal(Signal::CONT);
    rt.block_on(async {
        tokio::time::sleep(Duration::from_secs(2)).await;
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for writer in writers {
            let (acknowledged, failures) = writer.await.unwrap();
            eprintln!(
                "writer: {acknowledged} acknowledged, {} failed",
                failures.len()
            );
            assert_retryable(&failures);
        }
        // The earlier writers' documents are distinct from these (same ids: the later state
        // wins, and both runs recorded what they were told).
        let mut all = acked.lock().unwrap().clone();
        all.extend(acked2.lock().unwrap().clone());
        *acked.lock().unwrap() = all;
        let status = wait_in_sync(&addrs[0], 2).await;
        for shard in status.shards.iter().filter(|s| s.collection == "moving") {
            assert_eq!(shard.state, "serving", "{shard:?}");
        }
        for client in &clients {
            check_acked(client, &acked).await;
        }
        // Every copy has what its primary wrote.
        tokio::time::sleep(Duration::from_secs(1)).await;
    });
    for node in &mut nodes {
        node.kill();
    }
    assert_copies_identical(nodes.iter().map(|n| &n.dir), "moving", 6, 2);
}

/// KIP-101's case (issue tests 6 and 8): the primary A of a shard with 2 copies appends writes
/// its replica B never gets (a fail point holds A's next batch back: every node runs with
/// `replication::hold_entries` firing once, after 200 batches), and A is killed before any of
/// them is acknowledged. B (still in sync: A never removed it) is promoted and writes other
/// entries at the same sequence numbers. When A returns it finds that its log's tail is of an
/// older epoch than B's entries there, cuts it off (never replays it), catches up from B and
/// rejoins the in-sync set; both copies then hold the same documents, every acknowledged write
/// is there and no removed document came back.
#[test]
fn processes_a_deposed_primary_cuts_its_unacknowledged_tail_and_resyncs() {
    const LEASE: u64 = 3;
    let Some(binary) = etcd_binary() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(binary, &dir.path().join("etcd"));
    const HOLD: (&str, &str) = (
        "FAILPOINTS",
        "replication::hold_entries=200*off->1*return(3000)->off",
    );
    let mut nodes = nodes_with(dir.path(), 3, &etcd.endpoint(), LEASE, &[], &[HOLD]);
    let rt = runtime();
    const DIM: usize = 8;
    let addrs: Vec<String> = nodes.iter().map(|n| n.addr()).collect();
    let status = rt.block_on(async {
        let client = Client::connect(addrs[0].clone()).await.unwrap();
        create_moving(&client, DIM, 1, 2, 1).await;
        wait_in_sync(&addrs[0], 2).await
    });
    let shard = status
        .shards
        .iter()
        .find(|s| s.collection == "moving")
        .unwrap()
        .clone();
    let index = |id: &str| nodes.iter().position(|n| n.id == id).unwrap();
    let (a, b) = (index(&shard.node_id), index(&shard.replicas[0]));
    let c = 3 - a - b;
    // Writers through B and C (their writes go to A, the primary).
    let clients: Vec<Client> = rt.block_on(async {
        let mut clients = Vec::new();
        for i in [b, c, c] {
            clients.push(Client::connect(addrs[i].clone()).await.unwrap());
        }
        clients
    });
    let (acked, stop, writers) = start_writers_on(&rt, &clients, DIM);
    // A holds a batch back: it dies with it (and whatever it appended after).
    wait_for_fail_point(&nodes[a]);
    nodes[a].kill();
    rt.block_on(async {
        let took =
            first_acknowledged_batch(&addrs[c], &acked, 120_000_000, Duration::from_secs(30)).await;
        eprintln!("failover: a write acknowledged {took:?} after the primary's kill");
        // B writes at the sequence numbers A's lost entries had.
        tokio::time::sleep(Duration::from_secs(1)).await;
    });
    nodes[a].start(&etcd.endpoint());
    rt.block_on(async {
        let status = wait_in_sync(&addrs[c], 2).await;
        let now = status
            .shards
            .iter()
            .find(|s| s.collection == "moving")
            .unwrap();
        assert_eq!(now.node_id, nodes[b].id, "{now:?}");
        assert!(now.epoch > shard.epoch, "{now:?}");
        tokio::time::sleep(Duration::from_millis(500)).await;
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for writer in writers {
            let (acknowledged, failures) = writer.await.unwrap();
            eprintln!(
                "writer: {acknowledged} acknowledged, {} failed",
                failures.len()
            );
            assert_retryable(&failures);
        }
        for client in &clients {
            check_acked(client, &acked).await;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    });
    let log = nodes[a].server.as_ref().unwrap().logs();
    assert!(
        log.contains("cut entries a deposed primary never had acknowledged"),
        "A did not cut its log: {log}"
    );
    for node in &mut nodes {
        node.kill();
    }
    drop(etcd);
    let copy = |i: usize| local_copies(&dir.path().join(format!("n{}", i + 1)), "moving");
    let (copy_a, copy_b) = (copy(a), copy(b));
    assert_eq!(copy_a.len(), 1);
    assert_eq!(copy_a, copy_b, "the copies differ after the resync");
}

/// Three nodes (leases of `lease_seconds`, fail points `env`), each reaching `etcd` through
/// its own [`CuttableProxy`]: the proxies and the nodes, by index.
fn nodes_behind_proxies(
    dir: &Path,
    etcd: &Etcd,
    lease_seconds: u64,
    env: (&str, &str),
) -> (Vec<CuttableProxy>, Vec<Node>) {
    let proxies: Vec<CuttableProxy> = (0..3)
        .map(|_| CuttableProxy::start(etcd.client_port))
        .collect();
    let nodes = (0..3)
        .map(|i| {
            let mut node = Node::new(dir, &format!("n{}", i + 1), lease_seconds);
            if let Err(log) = node.try_start(&proxies[i].endpoint(), &[], &[env]) {
                panic!("node {} did not start: {log}", node.id);
            }
            node
        })
        .collect();
    (proxies, nodes)
}

/// Waits (at most 30 s after `since`) until `client`'s node shows `node_id` as the primary of
/// `moving`.
async fn wait_promoted(client: &Client, node_id: &str, since: std::time::Instant) {
    loop {
        let promoted = client.cluster_status().await.is_ok_and(|status| {
            status
                .shards
                .iter()
                .any(|s| s.collection == "moving" && s.node_id == node_id)
        });
        if promoted {
            return;
        }
        assert!(
            since.elapsed() < Duration::from_secs(30),
            "{node_id} never promoted"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A write the primary took before it was deposed, still in flight when its copy already
/// follows the new primary, never lands among the new primary's entries: primary A holds one
/// write 8.5 s between its epoch check and its append (`write::checked`, within the write's
/// deadline) and is cut off from etcd (a proxy per node); B is promoted and takes writes; A's
/// link comes back and A follows B while the held write is still asleep. The write is never
/// acknowledged, and A's copy ends identical to B's. Before, A followed B at once and the held
/// write appended its entry at the end of A's log, after entries A had recorded at B's epoch:
/// B's next batch found an entry of its own epoch there, took it for its own, and skipped it,
/// so the copies differed for good.
#[test]
fn processes_a_deposed_primary_s_write_in_flight_never_lands_among_the_new_primary_s_entries() {
    const LEASE: u64 = 3;
    let Some(binary) = etcd_binary() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(binary, &dir.path().join("etcd"));
    const HOLD: (&str, &str) = ("FAILPOINTS", "write::checked=100*off->1*return(8500)->off");
    let (proxies, mut nodes) = nodes_behind_proxies(dir.path(), &etcd, LEASE, HOLD);
    let rt = runtime();
    const DIM: usize = 8;
    let addrs: Vec<String> = nodes.iter().map(|n| n.addr()).collect();
    let status = rt.block_on(async {
        let client = Client::connect(addrs[0].clone()).await.unwrap();
        create_moving(&client, DIM, 1, 2, 1).await;
        wait_in_sync(&addrs[0], 2).await
    });
    let shard = status
        .shards
        .iter()
        .find(|s| s.collection == "moving")
        .unwrap()
        .clone();
    let index = |id: &str| nodes.iter().position(|n| n.id == id).unwrap();
    let (a, b) = (index(&shard.node_id), index(&shard.replicas[0]));
    let c = 3 - a - b;
    let clients: Vec<Client> = rt.block_on(async {
        let mut clients = Vec::new();
        for i in [b, c, c] {
            clients.push(Client::connect(addrs[i].clone()).await.unwrap());
        }
        clients
    });
    let (acked, stop, writers) = start_writers_on(&rt, &clients, DIM);
    wait_for_fail_point(&nodes[a]);
    let held_since = std::time::Instant::now();
    proxies[a].cut();
    rt.block_on(async {
        let client = Client::connect(addrs[c].clone()).await.unwrap();
        wait_promoted(&client, &nodes[b].id, held_since).await;
        let took =
            first_acknowledged_batch(&addrs[c], &acked, 130_000_000, Duration::from_secs(30)).await;
        eprintln!("failover: a write acknowledged {took:?} after the primary was cut off");
    });
    proxies[a].restore();
    assert!(
        held_since.elapsed() < Duration::from_secs(6),
        "A came back too late for the held write to find it following B"
    );
    rt.block_on(async {
        // B's writes go on until past the held write's append, and a while after.
        tokio::time::sleep(Duration::from_secs(13).saturating_sub(held_since.elapsed())).await;
        let status = wait_in_sync(&addrs[c], 2).await;
        let now = status
            .shards
            .iter()
            .find(|s| s.collection == "moving")
            .unwrap();
        assert_eq!(now.node_id, nodes[b].id, "{now:?}");
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for writer in writers {
            let (acknowledged, failures) = writer.await.unwrap();
            eprintln!(
                "writer: {acknowledged} acknowledged, {} failed",
                failures.len()
            );
            assert_retryable(&failures);
        }
        for client in &clients {
            check_acked(client, &acked).await;
        }
        // The last batches and their commit reach A.
        tokio::time::sleep(Duration::from_secs(2)).await;
    });
    let log = nodes[a].server.as_ref().unwrap().logs();
    for node in &mut nodes {
        node.kill();
    }
    drop(etcd);
    let copy = |i: usize| local_copies(&dir.path().join(format!("n{}", i + 1)), "moving");
    let (copy_a, copy_b) = (copy(a), copy(b));
    assert_eq!(copy_a.len(), 1);
    assert_eq!(
        copy_a, copy_b,
        "A's copy differs from its new primary's: {log}"
    );
}

/// Read tokens across a failover, read through every node, the deposed primary included (the
/// replication review's R4): primary A holds a batch back 8 s (`replication::hold_entries`),
/// so its log has a tail no replica has and no write was acknowledged for, and is cut off from
/// etcd (its links to the nodes and clients intact); B is promoted. Each write through C keeps
/// its read token, and an exact search and a Get with that token through A, B and C either find
/// the write or fail with a retryable code: none answers OK without it. Healed, A cuts its tail
/// and follows B: the copies are identical, entry by entry and epoch by epoch.
#[test]
fn processes_read_tokens_across_a_failover_find_their_write_or_fail_through_every_node() {
    const LEASE: u64 = 3;
    const DIM: usize = 8;
    let Some(binary) = etcd_binary() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(binary, &dir.path().join("etcd"));
    const HOLD: (&str, &str) = (
        "FAILPOINTS",
        "replication::hold_entries=100*off->1*return(8000)->off",
    );
    let (proxies, mut nodes) = nodes_behind_proxies(dir.path(), &etcd, LEASE, HOLD);
    let rt = runtime();
    let addrs: Vec<String> = nodes.iter().map(|n| n.addr()).collect();
    let status = rt.block_on(async {
        let client = Client::connect(addrs[0].clone()).await.unwrap();
        create_moving(&client, DIM, 1, 2, 1).await;
        wait_in_sync(&addrs[0], 2).await
    });
    let shard = status
        .shards
        .iter()
        .find(|s| s.collection == "moving")
        .unwrap()
        .clone();
    let index = |id: &str| nodes.iter().position(|n| n.id == id).unwrap();
    let (a, b) = (index(&shard.node_id), index(&shard.replicas[0]));
    let c = 3 - a - b;
    // Clients with a deadline, so that a read through the cut-off node ends.
    let clients: Vec<Client> = rt.block_on(async {
        let mut clients = Vec::new();
        for (i, addr) in addrs.iter().enumerate() {
            let deadline = if i == a { 1500 } else { 3000 };
            let client = Client::builder(addr.clone())
                .timeout(Duration::from_millis(deadline))
                .connect()
                .await
                .unwrap();
            clients.push(client);
        }
        clients
    });
    let writers_through = vec![clients[b].clone(), clients[c].clone()];
    let (acked, stop, writers) = start_writers_on(&rt, &writers_through, DIM);
    // A holds a batch: the writes in it are in A's log only.
    wait_for_fail_point(&nodes[a]);
    let cut_at = std::time::Instant::now();
    proxies[a].cut();
    rt.block_on(wait_promoted(&clients[c], &nodes[b].id, cut_at));
    eprintln!("B promoted {:?} after A was cut off", cut_at.elapsed());
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    rt.block_on(async {
        for writer in writers {
            let (acknowledged, failures) = writer.await.unwrap();
            eprintln!(
                "writer: {acknowledged} acknowledged, {} failed",
                failures.len()
            );
            assert_retryable(&failures);
        }
    });
    // Writes through C, each read back with its token through every node.
    let mut rng = rand::rngs::StdRng::seed_from_u64(4717);
    let mut answered = [0u32; 3];
    let mut refused: Vec<String> = Vec::new();
    rt.block_on(async {
        for k in 0..6u128 {
            let doc = (700_000_000 + k) * 7;
            let v = vectors(&mut rng, 1, DIM);
            let mut tries = 0;
            let ack = loop {
                let insert = Insert::new("moving", vec![doc], v.clone())
                    .users(vec![0])
                    .durability(Durability::Fsync)
                    .timeout(Duration::from_secs(10));
                match clients[c].insert(insert).await {
                    Ok(ack) => break ack,
                    Err(error) => {
                        tries += 1;
                        assert!(tries < 20, "writes through C never acknowledged: {error}");
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                }
            };
            acked.lock().unwrap().insert(doc, Doc::Live(v.clone()));
            let token = ack.read_token();
            for (i, client) in clients.iter().enumerate() {
                let search = Search::new("moving", v.clone())
                    .users([0u128])
                    .top_k(1)
                    .exact(true)
                    .after(token.clone());
                match client.search(search).await {
                    Ok(hits) => {
                        assert_eq!(
                            hits.first().map(|h| h.doc_id),
                            Some(doc),
                            "a search through {} with the token of document {doc} answered \
                             without it",
                            nodes[i].id
                        );
                        answered[i] += 1;
                    }
                    Err(error) => refused.push(format!(
                        "{:?}: search through {}: {}",
                        error.code(),
                        nodes[i].id,
                        error.message()
                    )),
                }
                match client.get_after("moving", 0, &[doc], &token).await {
                    Ok(docs) => {
                        assert_eq!(
                            docs.iter().map(|d| d.doc_id).collect::<Vec<_>>(),
                            vec![doc],
                            "a Get through {} with the token of document {doc} answered \
                             without it",
                            nodes[i].id
                        );
                        answered[i] += 1;
                    }
                    Err(error) => refused.push(format!(
                        "{:?}: get through {}: {}",
                        error.code(),
                        nodes[i].id,
                        error.message()
                    )),
                }
            }
        }
    });
    eprintln!(
        "token reads answered through A, B, C: {:?} of 12 each",
        [answered[a], answered[b], answered[c]]
    );
    assert_retryable(&refused);
    assert_eq!(
        answered[b], 12,
        "reads through the new primary failed: {refused:?}"
    );
    assert_eq!(answered[c], 12, "reads through C failed: {refused:?}");
    // Healed: A cuts its tail and follows B.
    proxies[a].restore();
    rt.block_on(async {
        wait_in_sync(&addrs[c], 2).await;
        check_acked(&clients[c], &acked).await;
        // The last batches and their commit reach A.
        tokio::time::sleep(Duration::from_secs(2)).await;
    });
    let log = nodes[a].server.as_ref().unwrap().logs();
    for node in &mut nodes {
        node.kill();
    }
    drop(etcd);
    let differences = nemesis::compare_copies(&nodes, 1, 2, &mut BTreeMap::new());
    assert!(differences.is_empty(), "{differences:#?}\nA's log: {log}");
}

/// No dirty read (docs/CLUSTER.md, "What a read sees"): with every batch held back 1.5 s on
/// the primary (`replication::hold_entries`), a write in flight is durable in the primary's log
/// and on no replica. A search or get through the primary does not find it until the write is
/// acknowledged (a failover meanwhile may cut it); once acknowledged, a read through the
/// primary finds it as soon as it is applied (within 5 s here), and one through the replica with
/// the write's token finds it when the primary's commit reaches it. Before, the primary applied an entry as soon as it was
/// logged.
#[test]
fn processes_a_read_sees_an_entry_only_once_it_is_committed() {
    const LEASE: u64 = 20;
    let Some(binary) = etcd_binary() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(binary, &dir.path().join("etcd"));
    const HOLD: (&str, &str) = ("FAILPOINTS", "replication::hold_entries=return(1500)");
    let mut nodes = nodes_with(dir.path(), 3, &etcd.endpoint(), LEASE, &[], &[HOLD]);
    let rt = runtime();
    const DIM: usize = 8;
    let addrs: Vec<String> = nodes.iter().map(|n| n.addr()).collect();
    let shard = rt.block_on(async {
        let client = Client::connect(addrs[0].clone()).await.unwrap();
        create_moving(&client, DIM, 1, 2, 1).await;
        moving_shard(&wait_in_sync(&addrs[0], 2).await)
    });
    let index = |id: &str| nodes.iter().position(|n| n.id == id).unwrap();
    let (p, r) = (index(&shard.node_id), index(&shard.replicas[0]));
    rt.block_on(async {
        let primary = Client::connect(addrs[p].clone()).await.unwrap();
        let replica = Client::connect(addrs[r].clone()).await.unwrap();
        let vector = vec![0.25f32; DIM];
        let found = |client: &Client| {
            let (client, vector) = (client.clone(), vector.clone());
            async move {
                let hits = client
                    .search(Search::new("moving", vector).users([7u128]).exact(true))
                    .await
                    .unwrap();
                let got = client.get("moving", 7, &[42]).await.unwrap();
                (hits.iter().any(|h| h.doc_id == 42), !got.is_empty())
            }
        };
        for round in 0..3u128 {
            let write = {
                let (primary, vector) = (primary.clone(), vector.clone());
                tokio::spawn(async move {
                    primary
                        .insert(Insert::new("moving", [42u128], vector).users([7u128]))
                        .await
                })
            };
            tokio::time::sleep(Duration::from_millis(600)).await;
            assert!(
                !write.is_finished(),
                "round {round}: the batch was not held"
            );
            if round == 0 {
                assert_eq!(
                    found(&primary).await,
                    (false, false),
                    "the primary served an entry no replica has"
                );
                assert_eq!(found(&replica).await, (false, false));
            }
            let ack = write.await.unwrap().unwrap();
            // Applied asynchronously once committed (docs/CLUSTER.md, "What a read sees"): a
            // token-less read right after the acknowledgement may come a moment early.
            let mut seen = found(&primary).await;
            let until = Instant::now() + Duration::from_secs(5);
            while seen != (true, true) && Instant::now() < until {
                tokio::time::sleep(Duration::from_millis(20)).await;
                seen = found(&primary).await;
            }
            assert_eq!(seen, (true, true), "round {round}");
            let hits = replica
                .search(
                    Search::new("moving", vector.clone())
                        .users([7u128])
                        .exact(true)
                        .after(ack.read_token()),
                )
                .await
                .unwrap();
            assert!(hits.iter().any(|h| h.doc_id == 42), "round {round}");
            assert_eq!(found(&replica).await, (true, true), "round {round}");
            let removed = primary
                .remove(Remove::new("moving", [42u128]).users([7u128]))
                .await
                .unwrap();
            replica
                .search(
                    Search::new("moving", vector.clone())
                        .users([7u128])
                        .after(removed.read_token()),
                )
                .await
                .unwrap();
            assert_eq!(found(&replica).await, (false, false), "round {round}");
        }
    });
    for node in &mut nodes {
        node.kill();
    }
}

#[allow(clippy::type_complexity)]
fn start_writers_on(
    rt: &tokio::runtime::Runtime,
    clients: &[Client],
    dim: usize,
) -> (
    Acked,
    std::sync::Arc<std::sync::atomic::AtomicBool>,
    Vec<tokio::task::JoinHandle<(u64, Vec<String>)>>,
) {
    let _entered = rt.enter();
    start_writers(clients, dim)
}

/// A replica goes late while another tries to join (3 copies): replica Y comes back with every
/// answer delayed 600 ms (close behind, never quick enough to join), replica X is SIGSTOPped
/// for 6 s under a steady writer. Writes go on: none fails DEADLINE_EXCEEDED and the longest
/// gap between two acknowledgements stays under IN_SYNC_BOUND plus a swap and a margin (5 s).
/// Before, a join held the in-sync lock while it waited for the write gate, and the write
/// holding the gate waited for that lock to swap X out: the shard took no write until the
/// write's deadline (10 s here), and a failed join was tried again every second.
#[test]
fn processes_a_late_replica_while_another_tries_to_join_does_not_stall_writes() {
    use rustix::process::Signal;
    const LEASE: u64 = 20;
    let Some(cluster) = one_shard_cluster(LEASE, 3, &[]) else {
        return;
    };
    let OneShardCluster {
        mut nodes,
        etcd,
        rt,
        primary: p,
        replicas,
        addrs,
        ..
    } = cluster;
    let (x, y) = (replicas[0], replicas[1]);
    let endpoint = etcd.endpoint();
    let client = rt.block_on(Client::connect(addrs[p].clone())).unwrap();
    // Y back, slow to answer: it catches up but never joins.
    nodes[y].kill();
    rt.block_on(revoke_registration(&endpoint, &nodes[y].id));
    let acked: Acked = Default::default();
    rt.block_on(insert_batches(&client, &acked, 10));
    nodes[y].start_with_env(
        &endpoint,
        &[("FAILPOINTS", "replication::answer_delay=return(600)")],
    );
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (client, acked, stop) = (client.clone(), acked.clone(), stop.clone());
        rt.spawn(async move {
            let (mut longest, mut last, mut failures) =
                (Duration::ZERO, Instant::now(), Vec::new());
            let mut doc = 100_000u128;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                doc += 1;
                let outcome =
                    insert_recorded(&client, &acked, vec![doc * 7], Duration::from_secs(10)).await;
                match outcome {
                    Ok(()) => {
                        longest = longest.max(last.elapsed());
                        last = Instant::now();
                    }
                    Err(error) => failures.push(format!("{:?}: {}", error.code(), error)),
                }
            }
            (longest.max(last.elapsed()), failures)
        })
    };
    std::thread::sleep(Duration::from_secs(4));
    nodes[x].signal(Signal::STOP);
    std::thread::sleep(Duration::from_secs(6));
    nodes[x].signal(Signal::CONT);
    std::thread::sleep(Duration::from_secs(3));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (longest, failures) = rt.block_on(writer).unwrap();
    eprintln!("longest gap between acknowledged writes: {longest:?}; failures: {failures:?}");
    assert!(failures.is_empty(), "{failures:?}");
    assert!(
        longest < Duration::from_secs(5),
        "writes stalled {longest:?}"
    );
    rt.block_on(check_acked(&client, &acked));
    let log = nodes[p].server.as_ref().unwrap().logs();
    assert!(log.contains("a replica left the in-sync set"), "{log}");
}

/// A primary's reconcile pass that acts on a view taken before a replica joined never takes
/// that replica out of the in-sync set the primary waits for (review R3): every acknowledged
/// write stays on every copy etcd lists in sync. Primary A's next reconcile pass holds its view
/// 15 s (`cluster::reconcile`, set while A runs); meanwhile its replica B is drained, C is added,
/// seeded and joins under a writer through A, and B is dropped. C is then SIGSTOPped and the
/// held pass applies its view, which lists B and not C. One write through A follows: A must
/// wait for C, take it out of the in-sync set in etcd (after `IN_SYNC_BOUND`) and only then
/// acknowledge. A is killed and C resumed: C is never promoted, and A restarted has every
/// acknowledged write. Before, the stale view dropped C from A's cached set (the cache kept
/// only the view's replicas): the write was acknowledged by A alone while etcd still listed C
/// in sync, and C, promoted once A's lease ran out, lacked it.
#[test]
fn processes_a_stale_view_never_takes_a_joined_copy_out_of_the_primary_s_in_sync_set() {
    use rustix::process::Signal;
    const LEASE: u64 = 4;
    const PAUSE: Duration = Duration::from_secs(15);
    let Some(cluster) = one_shard_cluster(LEASE, 2, &[]) else {
        return;
    };
    let OneShardCluster {
        mut nodes,
        etcd,
        rt,
        primary: a,
        replicas,
        others,
        addrs,
        ..
    } = cluster;
    let (b, c) = (replicas[0], others[0]);
    let (a_id, b_id, c_id) = (
        nodes[a].id.clone(),
        nodes[b].id.clone(),
        nodes[c].id.clone(),
    );
    let client = rt.block_on(Client::connect(addrs[a].clone())).unwrap();
    let acked: Acked = Default::default();
    rt.block_on(insert_batches(&client, &acked, 5));
    // A's next reconcile pass takes its view now (woken by another collection's creation) and
    // acts on it PAUSE later.
    nodes[a].set_fail_points(&format!(
        "cluster::reconcile=1*return({})",
        PAUSE.as_millis()
    ));
    rt.block_on(
        client.create_collection(
            CollectionSpec::new("nudge", 8)
                .metric(Metric::L2)
                .shards(1, ShardKey::Doc)
                .replicas(1, 1),
        ),
    )
    .unwrap();
    let paused = Instant::now();
    while !nodes[a]
        .server
        .as_ref()
        .unwrap()
        .logs()
        .contains("cluster::reconcile")
    {
        assert!(
            paused.elapsed() < Duration::from_secs(5),
            "A's pass never paused"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let paused = Instant::now();
    // B drained under a writer through A (whose writes start C's follower): C joins, B goes.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (client, acked, stop) = (client.clone(), acked.clone(), stop.clone());
        rt.spawn(async move {
            let mut doc = 1_000u128;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                doc += 1;
                let _ =
                    insert_recorded(&client, &acked, vec![doc * 7], Duration::from_secs(10)).await;
            }
        })
    };
    rt.block_on(client.drain_node(&b_id, false)).unwrap();
    let c_client = rt.block_on(Client::connect(addrs[c].clone())).unwrap();
    assert!(
        rt.block_on(wait_replica_replaced(
            &c_client,
            &a_id,
            &c_id,
            paused + PAUSE - Duration::from_secs(3)
        )),
        "C did not join and B did not leave within the pause: the test shows nothing"
    );
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    rt.block_on(writer).unwrap();
    nodes[c].signal(Signal::STOP);
    // The held pass applies its view (B a replica, C none).
    std::thread::sleep(
        (paused + PAUSE + Duration::from_millis(1500)).saturating_duration_since(Instant::now()),
    );
    let started = Instant::now();
    rt.block_on(insert_recorded(
        &client,
        &acked,
        vec![7 * 50_000],
        Duration::from_secs(30),
    ))
    .unwrap();
    eprintln!(
        "the write after the stale pass took {:?}",
        started.elapsed()
    );
    // Any view lags etcd by well under 2 s: C is out of the in-sync set by now.
    std::thread::sleep(Duration::from_secs(2));
    let b_client = rt.block_on(Client::connect(addrs[b].clone())).unwrap();
    let shard = moving_shard(&rt.block_on(b_client.cluster_status()).unwrap());
    assert!(
        !shard.in_sync.contains(&c_id),
        "a write was acknowledged while etcd listed stopped C in sync: {shard:?}"
    );
    // The consequence: A dies, C comes back. C is not promoted; A restarted has every write.
    nodes[a].kill();
    nodes[c].signal(Signal::CONT);
    std::thread::sleep(Duration::from_secs(LEASE + 4));
    let shard = moving_shard(&rt.block_on(b_client.cluster_status()).unwrap());
    assert_eq!(shard.node_id, a_id, "promoted while A was down: {shard:?}");
    nodes[a].start(&etcd.endpoint());
    let client = rt.block_on(Client::connect(nodes[a].addr())).unwrap();
    let back = Instant::now();
    while !rt
        .block_on(client.cluster_status())
        .is_ok_and(|s| moving_shard(&s).state == "serving")
    {
        assert!(
            back.elapsed() < Duration::from_secs(30),
            "A's shard never served again"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    rt.block_on(check_acked(&client, &acked));
}

/// A replica dropped from the record while its seed runs does not keep the seeded copy: the
/// pass of reconciliation that sees it dropped skips a copy being seeded, and judges it again
/// once the seed is over. Replica B comes back on a wiped disk, and its seed from primary A
/// pauses 8 s after the snapshot (`moves::seed_restored`); meanwhile B is drained: C is seeded,
/// joins, and B leaves the record. Within 8 s of the seed's end B's copy is gone (dropped: A and
/// C hold the data). Before, the copy stayed in B's data directory until some later change of
/// the map woke reconciliation (the nemesis, seed 68: a third, stale copy of a shard found on
/// disk after the run).
#[test]
fn processes_a_replica_dropped_while_its_seed_runs_does_not_keep_the_copy() {
    const LEASE: u64 = 4;
    const PAUSE: Duration = Duration::from_secs(8);
    let Some(cluster) = one_shard_cluster(LEASE, 2, &[]) else {
        return;
    };
    let OneShardCluster {
        mut nodes,
        etcd,
        rt,
        primary: a,
        replicas,
        others,
        addrs,
        ..
    } = cluster;
    let (b, c) = (replicas[0], others[0]);
    let (a_id, b_id, c_id) = (
        nodes[a].id.clone(),
        nodes[b].id.clone(),
        nodes[c].id.clone(),
    );
    let client = rt.block_on(Client::connect(addrs[a].clone())).unwrap();
    let acked: Acked = Default::default();
    rt.block_on(insert_batches(&client, &acked, 5));
    // B back on a wiped disk, its seed held after the snapshot.
    nodes[b].kill();
    std::fs::remove_dir_all(&nodes[b].dir).unwrap();
    std::fs::write(
        nodes[b].fail_points_file(),
        format!("moves::seed_restored=return({})", PAUSE.as_millis()),
    )
    .unwrap();
    nodes[b].start(&etcd.endpoint());
    let started = Instant::now();
    while !nodes[b]
        .server
        .as_ref()
        .unwrap()
        .logs()
        .contains("moves::seed_restored")
    {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "B's seed never started"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let paused = Instant::now();
    assert_eq!(
        shard_dirs(&nodes[b], "moving"),
        1,
        "the seed's copy is on B's disk"
    );
    rt.block_on(client.drain_node(&b_id, false)).unwrap();
    assert!(
        rt.block_on(wait_replica_replaced(&client, &a_id, &c_id, paused + PAUSE)),
        "C did not join and B did not leave while B's seed was held: the test shows nothing"
    );
    let gone_by = paused + PAUSE + Duration::from_secs(8);
    while shard_dirs(&nodes[b], "moving") > 0 {
        assert!(
            Instant::now() < gone_by,
            "B still holds a copy of the shard 8 s after its seed ended: {}",
            nodes[b].server.as_ref().unwrap().logs()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!(
        "B's copy gone {:?} after its seed was held",
        paused.elapsed()
    );
    rt.block_on(check_acked(&client, &acked));
}

/// A primary shut down gracefully (SIGTERM) hands its shard to its in-sync replica first,
/// while it still serves: under a steady writer through a node that holds no copy, the longest
/// gap between acknowledged writes stays under 4 s (the lease is 20 s), no write fails for
/// good, and every acknowledged write is there. Before, the node stopped accepting calls, kept
/// its lease while it finished the calls in flight (up to its 15 s grace while peers kept
/// their connections open) and the shard took no write until it was gone.
#[test]
fn processes_a_primary_shut_down_gracefully_hands_its_shard_over_first() {
    use rustix::process::Signal;
    const LEASE: u64 = 20;
    let Some(cluster) = one_shard_cluster(LEASE, 2, &[]) else {
        return;
    };
    let OneShardCluster {
        nodes,
        etcd: _etcd,
        rt,
        primary: p,
        replicas,
        others,
        addrs,
        ..
    } = cluster;
    let client = rt
        .block_on(Client::connect(addrs[others[0]].clone()))
        .unwrap();
    let acked: Acked = Default::default();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (client, acked, stop) = (client.clone(), acked.clone(), stop.clone());
        rt.spawn(async move {
            let (mut longest, mut last, mut failures) =
                (Duration::ZERO, Instant::now(), Vec::new());
            let mut doc = 200_000u128;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                doc += 1;
                let outcome =
                    insert_recorded(&client, &acked, vec![doc * 7], Duration::from_secs(30)).await;
                match outcome {
                    Ok(()) => {
                        longest = longest.max(last.elapsed());
                        last = Instant::now();
                    }
                    Err(error) => failures.push(format!("{:?}: {}", error.code(), error)),
                }
            }
            (longest.max(last.elapsed()), failures)
        })
    };
    std::thread::sleep(Duration::from_secs(3));
    nodes[p].signal(Signal::TERM);
    std::thread::sleep(Duration::from_secs(8));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (longest, failures) = rt.block_on(writer).unwrap();
    eprintln!("longest gap between acknowledged writes: {longest:?}; failures: {failures:?}");
    assert!(
        longest < Duration::from_secs(4),
        "writes stalled {longest:?} while the primary shut down"
    );
    assert_retryable(&failures);
    rt.block_on(async {
        let status = client.cluster_status().await.unwrap();
        assert_eq!(moving_shard(&status).node_id, nodes[replicas[0]].id);
        check_acked(&client, &acked).await;
    });
    let log = nodes[p].server.as_ref().unwrap().logs();
    assert!(log.contains("this node is shutting down"), "{log}");
}

/// Spread reads with one in-sync copy stopped (SIGSTOP: alive to etcd, its connections open,
/// never answering): every Get through a node that holds no copy answers, each within the
/// client's deadline, the stopped copy costing a share of it. Before, a read sent to the
/// stopped copy waited out the whole deadline and failed DEADLINE_EXCEEDED (about half of
/// them); the message named the owner even when the replica was asked.
#[test]
fn processes_spread_reads_move_to_another_copy_when_one_is_stopped() {
    use rustix::process::Signal;
    // A lease that outlasts the stop: the stopped copy stays alive and in sync.
    const LEASE: u64 = 30;
    let Some(cluster) = one_shard_cluster(LEASE, 2, &[]) else {
        return;
    };
    let OneShardCluster {
        nodes,
        rt,
        replicas,
        others,
        addrs,
        ..
    } = cluster;
    let (r, c) = (replicas[0], others[0]);
    let acked: Acked = Default::default();
    let client = rt.block_on(Client::connect(addrs[c].clone())).unwrap();
    rt.block_on(async {
        let docs = (0..20u128).map(|k| k * 7).collect();
        insert_settled(&client, &acked, docs).await;
        // Both copies have applied them before the stop.
        tokio::time::sleep(Duration::from_millis(500)).await;
    });
    nodes[r].signal(Signal::STOP);
    let hurried = rt
        .block_on(
            Client::builder(addrs[c].clone())
                .timeout(Duration::from_secs(4))
                .connect(),
        )
        .unwrap();
    let outcomes: Vec<Result<usize, String>> = rt.block_on(async {
        let mut outcomes = Vec::new();
        for k in 0..8u128 {
            let doc = k * 7;
            let started = Instant::now();
            let outcome = hurried.get("moving", doc % 7, &[doc]).await;
            assert!(started.elapsed() < Duration::from_secs(5));
            outcomes.push(outcome.map(|d| d.len()).map_err(|e| e.to_string()));
        }
        outcomes
    });
    nodes[r].signal(Signal::CONT);
    assert!(
        outcomes.iter().all(|o| o == &Ok(1)),
        "reads failed with a copy stopped: {outcomes:?}"
    );
}

/// The last in-sync copy standing (issue test 7): a shard with 3 copies and min_in_sync 2
/// loses its primary and one replica at once (kill -9). The third copy, in sync, is promoted:
/// nothing acknowledged is lost and reads go on, but with one copy alive writes are refused
/// (UNAVAILABLE naming both counts), never acknowledged on fewer than 2 copies. When a killed
/// replica returns it catches up and rejoins, and writes are acknowledged again.
#[test]
fn processes_the_last_in_sync_copy_is_promoted_and_refuses_writes_below_min_in_sync() {
    const LEASE: u64 = 2;
    let Some((_dir, etcd, mut nodes)) = real_cluster(3, LEASE) else {
        return;
    };
    let rt = runtime();
    const DIM: usize = 8;
    let addrs: Vec<String> = nodes.iter().map(|n| n.addr()).collect();
    let status = rt.block_on(async {
        let client = Client::connect(addrs[0].clone()).await.unwrap();
        create_moving(&client, DIM, 1, 3, 2).await;
        wait_in_sync(&addrs[0], 3).await
    });
    let shard = status
        .shards
        .iter()
        .find(|s| s.collection == "moving")
        .unwrap()
        .clone();
    let index = |id: &str| nodes.iter().position(|n| n.id == id).unwrap();
    let (a, b) = (index(&shard.node_id), index(&shard.replicas[0]));
    let c = 3 - a - b;
    let client = rt.block_on(Client::connect(addrs[c].clone())).unwrap();
    let (acked, stop, writers) = rt.block_on(async {
        let started = start_writers(std::slice::from_ref(&client), DIM);
        tokio::time::sleep(Duration::from_millis(1000)).await;
        started
    });
    nodes[a].kill();
    nodes[b].kill();
    rt.block_on(async {
        // C is promoted once A's lease lapses.
        let started = std::time::Instant::now();
        loop {
            let status = client.cluster_status().await.unwrap();
            let now = status
                .shards
                .iter()
                .find(|s| s.collection == "moving")
                .unwrap();
            if now.node_id == nodes[c].id {
                eprintln!("promoted {:?} after the kills: {now:?}", started.elapsed());
                break;
            }
            assert!(started.elapsed() < Duration::from_secs(30), "{now:?}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        // Writes are refused with one copy alive (after B leaves the in-sync set).
        tokio::time::sleep(Duration::from_secs(4)).await;
        let refused = client
            .insert(
                Insert::new("moving", vec![7_000_000_000u128], vec![0.5; DIM])
                    .users(vec![7_000_000_000u128 % 7])
                    .timeout(Duration::from_secs(10)),
            )
            .await
            .unwrap_err();
        assert_eq!(refused.code(), Code::Unavailable, "{refused}");
        assert!(
            refused
                .message()
                .contains("1 of the shard's copies are in sync, and writes need 2"),
            "{refused}"
        );
        acked.lock().unwrap().insert(7_000_000_000, Doc::Uncertain);
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for writer in writers {
            let (acknowledged, failures) = writer.await.unwrap();
            eprintln!(
                "writer: {acknowledged} acknowledged, {} failed",
                failures.len()
            );
            assert_retryable(&failures);
        }
        // Reads go on: every acknowledged write is on the last copy.
        check_acked(&client, &acked).await;
    });
    // B returns, catches up, rejoins: two copies in sync, writes acknowledged again.
    nodes[b].start(&etcd.endpoint());
    rt.block_on(async {
        let started = std::time::Instant::now();
        loop {
            let result = client
                .insert(
                    Insert::new("moving", vec![7_000_000_007u128], vec![0.25; DIM])
                        .users(vec![0])
                        .timeout(Duration::from_secs(10)),
                )
                .await;
            if result.is_ok() {
                acked
                    .lock()
                    .unwrap()
                    .insert(7_000_000_007, Doc::Live(vec![0.25; DIM]));
                break;
            }
            assert!(started.elapsed() < Duration::from_secs(60), "{result:?}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let status = client.cluster_status().await.unwrap();
        let now = status
            .shards
            .iter()
            .find(|s| s.collection == "moving")
            .unwrap();
        assert!(now.in_sync.len() >= 2, "{now:?}");
        check_acked(&client, &acked).await;
    });
}

/// No promotion without etcd (issue test 10): with etcd stopped, a primary killed under
/// writers is not replaced (nothing can be promoted without the transaction that checks its
/// registration is gone), whatever time passes; writes fail only with retryable codes. Once
/// etcd is back the dead primary's lease lapses there, its in-sync replica is promoted, writes
/// are acknowledged again, and every acknowledged write is readable.
#[test]
fn processes_no_promotion_happens_without_etcd() {
    const LEASE: u64 = 2;
    let Some((_dir, mut etcd, mut nodes)) = real_cluster(3, LEASE) else {
        return;
    };
    let rt = runtime();
    const DIM: usize = 8;
    let addrs: Vec<String> = nodes.iter().map(|n| n.addr()).collect();
    let status = rt.block_on(async {
        let client = Client::connect(addrs[0].clone()).await.unwrap();
        create_moving(&client, DIM, 1, 2, 1).await;
        wait_in_sync(&addrs[0], 2).await
    });
    let shard = status
        .shards
        .iter()
        .find(|s| s.collection == "moving")
        .unwrap()
        .clone();
    let a = nodes.iter().position(|n| n.id == shard.node_id).unwrap();
    let survivor = (a + 1) % 3;
    let clients: Vec<Client> = rt.block_on(async {
        let mut clients = Vec::new();
        for i in [(a + 1) % 3, (a + 2) % 3] {
            clients.push(Client::connect(addrs[i].clone()).await.unwrap());
        }
        clients
    });
    let (acked, stop, writers) = start_writers_on(&rt, &clients, DIM);
    std::thread::sleep(Duration::from_millis(1000));
    etcd.stop();
    nodes[a].kill();
    // Three leases without etcd: the survivors' view still names the dead primary.
    std::thread::sleep(Duration::from_secs(3 * LEASE));
    rt.block_on(async {
        let status = clients[0].cluster_status().await.unwrap();
        let now = status
            .shards
            .iter()
            .find(|s| s.collection == "moving")
            .unwrap();
        assert_eq!(
            (now.node_id.as_str(), now.epoch),
            (shard.node_id.as_str(), shard.epoch),
            "promoted without etcd: {now:?}"
        );
    });
    etcd.restart();
    rt.block_on(async {
        let took = first_acknowledged_batch(
            &addrs[survivor],
            &acked,
            130_000_000,
            Duration::from_secs(60),
        )
        .await;
        eprintln!("a write acknowledged {took:?} after etcd came back");
        let status = clients[0].cluster_status().await.unwrap();
        let now = status
            .shards
            .iter()
            .find(|s| s.collection == "moving")
            .unwrap();
        assert_ne!(now.node_id, shard.node_id, "{now:?}");
        assert!(now.epoch > shard.epoch, "{now:?}");
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for writer in writers {
            let (acknowledged, failures) = writer.await.unwrap();
            eprintln!(
                "writer: {acknowledged} acknowledged, {} failed",
                failures.len()
            );
            assert_retryable(&failures);
        }
        for client in &clients {
            check_acked(client, &acked).await;
        }
    });
}

/// Catch-up by log (issue test 2): a replica killed while its primaries write and checkpoint
/// (small WAL segments) comes back within the log they keep for it (`AWAY_REPLICA_WAL_BYTES`):
/// its copies follow the log from where they stopped, never seeded, and rejoin; every
/// acknowledged write is there and the copies are identical. That includes a shard it led,
/// which fails over while it is down: the new primary never learnt its position and holds its
/// log from its epoch's start for it.
#[test]
fn processes_a_replica_back_within_the_kept_log_catches_up_by_log_across_checkpoints() {
    const LEASE: u64 = 2;
    let Some(binary) = etcd_binary() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(binary, &dir.path().join("etcd"));
    // Small log segments, so that the checkpoints below would truncate what n3 lacks were the
    // primaries not keeping it (the default bound, 1 GiB, is far above what is written here);
    // a checkpoint every 16 KiB of log on every copy, so that the replica promoted for the
    // shard n3 leads has checkpointed before (its log no longer starts at 1).
    const SMALL_WAL: (&str, &str) = (
        "FAILPOINTS",
        "collection::wal_segment_bytes=return(32768);collection::checkpoint_wal_bytes=return(16384)",
    );
    let mut nodes = nodes_with(dir.path(), 3, &etcd.endpoint(), LEASE, &[], &[SMALL_WAL]);
    let rt = runtime();
    const DIM: usize = 8;
    let addrs: Vec<String> = nodes.iter().map(|n| n.addr()).collect();
    let clients: Vec<Client> = rt.block_on(async {
        let client = Client::connect(addrs[0].clone()).await.unwrap();
        create_moving(&client, DIM, 3, 2, 1).await;
        wait_in_sync(&addrs[0], 2).await;
        connect_all(&addrs[..2]).await
    });
    // About 50 KiB of log per shard before the kill, so that every copy checkpoints: documents
    // of tenant 0 whose ids are multiples of 7 (as `check_acked` reads them).
    let preloaded: Vec<(u128, Vec<f32>)> = rt.block_on(async {
        let mut rng = rand::rngs::StdRng::seed_from_u64(4601);
        let mut preloaded = Vec::new();
        for batch in 0..120u128 {
            let docs: Vec<u128> = (0..25).map(|i| (900_000 + batch * 25 + i) * 7).collect();
            let v = vectors(&mut rng, docs.len(), DIM);
            clients[0]
                .insert(
                    Insert::new("moving", docs.clone(), v.clone())
                        .users(vec![0])
                        .durability(Durability::Fsync),
                )
                .await
                .unwrap();
            for (i, doc) in docs.into_iter().enumerate() {
                preloaded.push((doc, v[i * DIM..(i + 1) * DIM].to_vec()));
            }
        }
        preloaded
    });
    // The shards n3 holds a copy of: replicas, and those it leads (their new primary, promoted
    // while n3 is down, never learnt n3's position: it holds its log from its epoch's start).
    // A copy balancing adds on n3 afterwards is seeded, as any new copy.
    let held_by_n3: std::collections::BTreeSet<u32> = rt.block_on(async {
        let status = Client::connect(addrs[0].clone())
            .await
            .unwrap()
            .cluster_status()
            .await
            .unwrap();
        status
            .shards
            .iter()
            .filter(|s| {
                s.collection == "moving"
                    && (s.node_id == "n3" || s.replicas.iter().any(|n| n == "n3"))
            })
            .map(|s| s.shard)
            .collect()
    });
    assert!(!held_by_n3.is_empty());
    nodes[2].kill();
    let (acked, stop, writers) = start_writers_on(&rt, &clients, DIM);
    acked.lock().unwrap().extend(
        preloaded
            .into_iter()
            .map(|(doc, vector)| (doc, Doc::Live(vector))),
    );
    rt.block_on(async {
        tokio::time::sleep(Duration::from_secs(5)).await;
        for _ in 0..2 {
            clients[0].flush("moving").await.unwrap();
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    });
    nodes[2].start_with_env(&etcd.endpoint(), &[SMALL_WAL]);
    rt.block_on(async {
        wait_in_sync(&addrs[0], 2).await;
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for writer in writers {
            let (acknowledged, failures) = writer.await.unwrap();
            eprintln!(
                "writer: {acknowledged} acknowledged, {} failed",
                failures.len()
            );
            assert_retryable(&failures);
        }
        for client in &clients {
            check_acked(client, &acked).await;
        }
    });
    // The shards n3's log says it was seeded for (the log's colour codes taken out).
    let plain = without_colours(&nodes[2].server.as_ref().unwrap().logs());
    let seeded: std::collections::BTreeSet<u32> = plain
        .lines()
        .filter(|l| l.contains("replica seeded; following by log"))
        .filter_map(|l| l.split("shard=").nth(1))
        .filter_map(|s| {
            s.split_whitespace()
                .next()?
                .rsplit('.')
                .next()?
                .parse()
                .ok()
        })
        .collect();
    eprintln!("n3 held copies of shards {held_by_n3:?}; seeded: {seeded:?}");
    assert!(
        seeded.is_disjoint(&held_by_n3),
        "n3 was seeded for shards it held a copy of ({seeded:?} of {held_by_n3:?}) instead of \
         following the kept log: {plain}"
    );
    for node in &mut nodes {
        node.kill();
    }
    drop(etcd);
    assert_copies_identical(nodes.iter().map(|n| &n.dir), "moving", 3, 2);
}

/// The bytes of the WAL files of `collection`'s shard copies in a node's data directory.
fn wal_bytes(node_dir: &Path, collection: &str) -> u64 {
    let mut n = 0;
    let Ok(entries) = std::fs::read_dir(node_dir.join("collections")) else {
        return 0;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some((shard, None)) = tarn_cluster::ShardName::parse(&name) else {
            continue;
        };
        if shard.collection != collection {
            continue;
        }
        if let Ok(files) = std::fs::read_dir(entry.path().join("wal")) {
            n += files
                .flatten()
                .filter_map(|f| f.metadata().ok())
                .map(|m| m.len())
                .sum::<u64>();
        }
    }
    n
}

/// A replica that answers but falls ever further behind (its primary's follower ships one
/// entry per call, 200 ms apart, by fail points, to 24 writers; out of the in-sync set after
/// 2 s, so writes stop waiting for it) is seeded from a snapshot once it lacks more log than is kept for one
/// (64 KiB here, 1 GiB by default), instead of holding the primary's log from its position for
/// good. With 32 KiB log segments and a checkpoint every 16 KiB, the primary's log on disk stays
/// under 600 KiB while about 1 MiB is written (224-416 KiB seen); every acknowledged write is there, and the
/// replica is back in sync once the writes stop. Before, the follower's hold kept the log from
/// the replica's position (768 KiB on disk at the end of the writes) and it was never seeded.
#[test]
fn processes_a_slow_connected_replica_is_seeded_instead_of_pinning_the_log() {
    const LEASE: u64 = 2;
    const DIM: usize = 8;
    let Some(binary) = etcd_binary() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(binary, &dir.path().join("etcd"));
    const SLOW: (&str, &str) = (
        "FAILPOINTS",
        "collection::wal_segment_bytes=return(32768);collection::checkpoint_wal_bytes=return(16384);\
         replication::away_wal_bytes=return(65536);replication::max_batch_bytes=return(1);\
         replication::hold_entries=return(200)",
    );
    let nodes = nodes_with(dir.path(), 3, &etcd.endpoint(), LEASE, &[], &[SLOW]);
    let rt = runtime();
    let addrs: Vec<String> = nodes.iter().map(|n| n.addr()).collect();
    let client = rt.block_on(Client::connect(addrs[0].clone())).unwrap();
    let status = rt.block_on(async {
        create_moving(&client, DIM, 1, 2, 1).await;
        wait_in_sync(&addrs[0], 2).await
    });
    let primary = nodes
        .iter()
        .find(|n| n.id == moving_shard(&status).node_id)
        .unwrap();
    let acked: Acked = Default::default();
    rt.block_on(async {
        let mut writers = Vec::new();
        // More writers than the follower ships in 2 s, so that the replica leaves the in-sync
        // set and the writes stop waiting for it.
        for w in 0..24u128 {
            let (client, acked) = (client.clone(), acked.clone());
            writers.push(tokio::spawn(async move {
                for batch in 0..25u128 {
                    let docs = (0..25)
                        .map(|i| ((w * 1_000 + batch) * 25 + i + 1) * 7)
                        .collect();
                    let _ = insert_recorded(&client, &acked, docs, Duration::from_secs(10)).await;
                }
            }));
        }
        for writer in writers {
            writer.await.unwrap();
        }
        client.flush("moving").await.unwrap();
    });
    std::thread::sleep(Duration::from_secs(1));
    let written = primary.server.as_ref().unwrap().logs();
    let on_disk = wal_bytes(&primary.dir, "moving");
    eprintln!("the primary's log on disk after the writes: {on_disk} bytes");
    assert!(
        written.contains("fell further behind than the log kept for one"),
        "the slow replica was never seeded: {}",
        without_colours(&written)
            .lines()
            .filter(|l| !l.contains("pausing at a fail point"))
            .take(30)
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert!(
        on_disk < 600 << 10,
        "the primary keeps {on_disk} bytes of log for its slow replica"
    );
    rt.block_on(async {
        check_acked(&client, &acked).await;
        wait_in_sync(&addrs[0], 2).await;
    });
}

/// Catch-up by snapshot (issue tests 3 and 4): with small WAL segments and no log kept for a
/// replica that is away (fail points), a replica down while its primaries write and
/// checkpoint finds their logs no longer hold what it lacks: it is seeded from a snapshot and
/// the tail, and rejoins the in-sync set. Then its data directory is deleted while it is down
/// and it restarts with the same id: every copy it held is rebuilt from the primaries; once
/// more with no write at all (idle followers probe a copy out of the in-sync set and seed it),
/// its first seed running out of its time limit once its snapshot is restored (the limit cut
/// to nothing by a fail point): it gives up, and the retry deletes that unfinished copy, so
/// nothing is left set aside (before, every failed seed left a full-size
/// copy set aside). Afterwards each shard's copies hold the same documents, every acknowledged
/// write is there, and the seeds were counted (`tarn_rereplication_bytes_total`).
#[test]
fn processes_replicas_catch_up_by_snapshot_past_the_log_and_after_a_wiped_disk() {
    const LEASE: u64 = 2;
    let Some(binary) = etcd_binary() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(binary, &dir.path().join("etcd"));
    // Small log segments, and no log kept for a replica that is away: checkpoints truncate
    // what it lacks.
    const SMALL_WAL: (&str, &str) = (
        "FAILPOINTS",
        "collection::wal_segment_bytes=return(32768);replication::away_wal_bytes=return(0)",
    );
    let mut nodes = nodes_with(dir.path(), 3, &etcd.endpoint(), LEASE, &[], &[SMALL_WAL]);
    let rt = runtime();
    const DIM: usize = 8;
    let addrs: Vec<String> = nodes.iter().map(|n| n.addr()).collect();
    let clients: Vec<Client> = rt.block_on(async {
        let client = Client::connect(addrs[0].clone()).await.unwrap();
        create_moving(&client, DIM, 3, 2, 1).await;
        wait_in_sync(&addrs[0], 2).await;
        connect_all(&addrs[..2]).await
    });
    let mut acked: Option<Acked> = None;
    for round in 0..2 {
        nodes[2].kill();
        let (round_acked, stop, writers) = start_writers_on(&rt, &clients, DIM);
        rt.block_on(async {
            // Enough writes to fill several 32 KiB log segments, then checkpoints: the
            // primaries' logs drop what n3 lacks.
            tokio::time::sleep(Duration::from_secs(5)).await;
            for _ in 0..2 {
                clients[0].flush("moving").await.unwrap();
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        });
        if round == 1 {
            std::fs::remove_dir_all(&nodes[2].dir).unwrap();
            std::fs::create_dir_all(&nodes[2].dir).unwrap();
        }
        nodes[2].start_with_env(&etcd.endpoint(), &[SMALL_WAL]);
        rt.block_on(async {
            wait_in_sync(&addrs[0], 2).await;
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            for writer in writers {
                let (acknowledged, failures) = writer.await.unwrap();
                eprintln!(
                    "round {round} writer: {acknowledged} acknowledged, {} failed",
                    failures.len()
                );
                assert_retryable(&failures);
            }
        });
        let log = nodes[2].server.as_ref().unwrap().logs();
        assert!(
            log.contains("replica seeded; following by log"),
            "round {round}: n3 was not seeded: {log}"
        );
        match &acked {
            None => acked = Some(round_acked),
            Some(all) => {
                let later = round_acked.lock().unwrap().clone();
                all.lock().unwrap().extend(later);
            }
        }
    }
    // Idle shards: no write goes to n3's primaries while it comes back on a wiped disk once
    // more. No call of a write reaches it, so the followers' probes of a copy out of the
    // in-sync set must find it and seed every copy it holds.
    let status = rt.block_on(wait_in_sync(&addrs[0], 2));
    let copies = status
        .shards
        .iter()
        .filter(|s| s.collection == "moving" && s.in_sync.iter().any(|n| n == "n3"))
        .count();
    nodes[2].kill();
    std::fs::remove_dir_all(&nodes[2].dir).unwrap();
    std::fs::create_dir_all(&nodes[2].dir).unwrap();
    // Its first seed runs out of time once its snapshot is restored (its time limit cut to
    // nothing by a fail point): it gives up, and the retry deletes that unfinished copy
    // instead of setting it aside.
    nodes[2].start_with_env(
        &etcd.endpoint(),
        &[(
            "FAILPOINTS",
            "collection::wal_segment_bytes=return(32768);replication::away_wal_bytes=return(0);\
             moves::catch_up_limit_ms=1*return(0)",
        )],
    );
    let started = std::time::Instant::now();
    loop {
        let log = nodes[2].server.as_ref().unwrap().logs();
        let seeded = log.matches("replica seeded; following by log").count();
        if seeded >= copies {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "idle shards: {seeded} of n3's {copies} copies seeded in 60 s: {log}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    eprintln!(
        "idle shards: n3's {copies} copies seeded {:.1} s after its restart on a wiped disk",
        started.elapsed().as_secs_f64()
    );
    let log = nodes[2].server.as_ref().unwrap().logs();
    assert_eq!(
        log.matches("did not come within 128 entries of the primary's log in 0.0 s")
            .count(),
        1,
        "the seed that ran out of time: {log}"
    );
    let aside = rt
        .block_on(async {
            Client::connect(addrs[2].clone())
                .await
                .unwrap()
                .list_set_aside()
                .await
        })
        .unwrap();
    assert!(
        aside.is_empty(),
        "a failed seed's unfinished copy was set aside: {aside:?}"
    );
    let acked = acked.unwrap();
    rt.block_on(async {
        wait_in_sync(&addrs[0], 2).await;
        for client in &clients {
            check_acked(client, &acked).await;
        }
        let client = Client::connect(addrs[2].clone()).await.unwrap();
        check_acked(&client, &acked).await;
        tokio::time::sleep(Duration::from_secs(1)).await;
    });
    let metrics = http_get(
        nodes[2]
            .server
            .as_ref()
            .unwrap()
            .metrics_addr
            .parse()
            .unwrap(),
    );
    let seeded: f64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("tarn_rereplication_bytes_total "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0);
    assert!(seeded > 0.0, "{metrics}");
    for node in &mut nodes {
        node.kill();
    }
    drop(etcd);
    assert_copies_identical(nodes.iter().map(|n| &n.dir), "moving", 3, 2);
}

/// Removes `node_id`'s registration from etcd at once (revokes its lease), as the lease's
/// lapse after a kill -9 would, without waiting for it.
async fn revoke_registration(endpoint: &str, node_id: &str) {
    let raw = raw_etcd(endpoint);
    let key = format!("/tarn/nodes/{node_id}");
    let found = raw.get(key.as_bytes(), false).await.unwrap();
    if let Some(registration) = found.kvs.first() {
        raw.revoke(registration.lease).await.unwrap();
    }
}

/// Inserts `batches` batches of 20 documents (0, 7, 14, ...) into `moving` through `client`,
/// recording them ([`insert_recorded`]); each must be acknowledged.
async fn insert_batches(client: &Client, acked: &Acked, batches: u128) {
    for batch in 0..batches {
        let docs = (batch * 20..batch * 20 + 20).map(|k| k * 7).collect();
        insert_settled(client, acked, docs).await;
    }
}

/// A test's setup write, where no fault is under test: `insert_recorded`, sent again while
/// it is refused UNAVAILABLE for up to 30 s (a node whose 2 s lease a loaded machine renewed
/// late refuses writes until it renews it, as it must). Panics on any other error.
async fn insert_settled(client: &Client, acked: &Acked, docs: Vec<u128>) {
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        match insert_recorded(client, acked, docs.clone(), Duration::from_secs(10)).await {
            Ok(()) => return,
            Err(e) if e.code() == tarn_client::Code::Unavailable && Instant::now() < until => {
                tokio::time::sleep(Duration::from_millis(200)).await
            }
            Err(e) => panic!("setup write of {} documents: {e:?}", docs.len()),
        }
    }
}

/// Whether, before `until`, `client`'s view shows `moving`'s shard led by `primary` with
/// `replica` as its only replica, in sync (a drain's new copy joined and the old one left).
async fn wait_replica_replaced(
    client: &Client,
    primary: &str,
    replica: &str,
    until: Instant,
) -> bool {
    while Instant::now() < until {
        let shard = client.cluster_status().await.map(|s| moving_shard(&s));
        if shard.is_ok_and(|s| {
            s.node_id == primary
                && s.replicas == [replica]
                && s.in_sync.iter().any(|n| n == replica)
        }) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

/// Inserts `docs`, multiples of 7, into `moving` (tenant 0, `doc % 7` as `check_acked` reads
/// them; FSYNC; one batch) through `client`, recording each as acknowledged, or as uncertain
/// when the write fails.
async fn insert_recorded(
    client: &Client,
    acked: &Acked,
    docs: Vec<u128>,
    timeout: Duration,
) -> Result<(), tarn_client::Error> {
    const DIM: usize = 8;
    assert!(docs.iter().all(|d| d % 7 == 0), "{docs:?}");
    let mut rng = rand::rngs::StdRng::seed_from_u64(docs[0] as u64);
    let v = vectors(&mut rng, docs.len(), DIM);
    let insert = Insert::new("moving", docs.clone(), v.clone())
        .users(vec![0])
        .durability(Durability::Fsync)
        .timeout(timeout);
    let outcome = client.insert(insert).await;
    let mut map = acked.lock().unwrap();
    for (i, doc) in docs.iter().enumerate() {
        let state = match outcome {
            Ok(_) => Doc::Live(v[i * DIM..(i + 1) * DIM].to_vec()),
            Err(_) => Doc::Uncertain,
        };
        map.insert(*doc, state);
    }
    outcome.map(|_| ())
}

/// A node back with the same id on a wiped disk (issue 31, "in-sync incarnations"): the shard
/// record keeps the data directory token of each in-sync copy, and a node registered from
/// another directory holds no copy.
///
/// 1. A replica comes back on a wiped disk while its primary (SIGSTOPped) cannot probe it, and
///    the primary is then killed: the wiped replica is never promoted (for 12 s after the
///    primary's registration is gone, the shard keeps its primary and epoch, and every write
///    is refused UNAVAILABLE, none acknowledged), and it leaves the in-sync set without any
///    write. The primary returns: every acknowledged write is there, the replica is seeded
///    again and rejoins the in-sync set.
/// 2. The primary comes back on a wiped disk, registered before any coordinator saw it gone
///    (the other two nodes SIGSTOPped meanwhile): it holds nothing, so its in-sync replica is
///    promoted over it, and it is seeded and rejoins. Every acknowledged write is there, and
///    the two copies end identical.
///
/// Without the rule, phase 1 promotes the wiped replica (the shard then has no copy that
/// serves) and phase 2 never promotes anyone (the shard stays UNAVAILABLE).
#[test]
fn processes_a_copy_back_on_a_wiped_disk_is_never_promoted_and_is_seeded_again() {
    use rustix::process::Signal;
    // Long leases: a SIGSTOPped node keeps its registration; dead ones are revoked by hand.
    const LEASE: u64 = 20;
    const DIM: usize = 8;
    let Some(binary) = etcd_binary() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(binary, &dir.path().join("etcd"));
    let endpoint = etcd.endpoint();
    let mut nodes = nodes_with(dir.path(), 3, &endpoint, LEASE, &[], &[]);
    let rt = runtime();
    let addrs: Vec<String> = nodes.iter().map(|n| n.addr()).collect();
    let status = rt.block_on(async {
        let client = Client::connect(addrs[0].clone()).await.unwrap();
        create_moving(&client, DIM, 1, 2, 1).await;
        wait_in_sync(&addrs[0], 2).await
    });
    let shard = status
        .shards
        .iter()
        .find(|s| s.collection == "moving")
        .unwrap()
        .clone();
    let index = |id: &str| nodes.iter().position(|n| n.id == id).unwrap();
    let (p, r) = (index(&shard.node_id), index(&shard.replicas[0]));
    let c = 3 - p - r;
    let (p_id, r_id) = (nodes[p].id.clone(), nodes[r].id.clone());
    let wipe = |node: &Node| {
        std::fs::remove_dir_all(&node.dir).unwrap();
        std::fs::create_dir_all(&node.dir).unwrap();
    };
    let the_shard = |status: &tarn_client::ClusterStatus| {
        status
            .shards
            .iter()
            .find(|s| s.collection == "moving")
            .unwrap()
            .clone()
    };
    let client = rt.block_on(Client::connect(addrs[c].clone())).unwrap();
    let acked: Acked = Default::default();
    let mut next_doc = 0u128;
    let mut next_batch = || {
        next_doc += 20;
        (next_doc - 20..next_doc)
            .map(|k| k * 7)
            .collect::<Vec<u128>>()
    };
    rt.block_on(async {
        for _ in 0..10 {
            insert_recorded(&client, &acked, next_batch(), Duration::from_secs(10))
                .await
                .unwrap();
        }
    });

    // Phase 1: the replica back on a wiped disk, then the primary killed.
    let started = Instant::now();
    nodes[p].signal(Signal::STOP);
    nodes[r].kill();
    rt.block_on(revoke_registration(&endpoint, &r_id));
    wipe(&nodes[r]);
    nodes[r].start(&endpoint);
    rt.block_on(wait_for_status(
        &client,
        Duration::from_secs(20),
        "the wiped replica registered again",
        |s| s.nodes.iter().any(|n| n.node_id == r_id && n.alive),
    ));
    nodes[p].kill();
    rt.block_on(revoke_registration(&endpoint, &p_id));
    eprintln!(
        "phase 1: replica back on a wiped disk and primary killed {:?} after the stop",
        started.elapsed()
    );
    let primary_gone = Instant::now();
    rt.block_on(async {
        // Longer than a new coordinator takes to be elected (5 s) and to act.
        let mut left_in_sync = None;
        let mut refused = 0;
        while primary_gone.elapsed() < Duration::from_secs(12) {
            let now = the_shard(&client.cluster_status().await.unwrap());
            assert_eq!(
                (now.node_id.as_str(), now.epoch),
                (p_id.as_str(), shard.epoch),
                "the shard changed primary while its only copy with data was down: {now:?}"
            );
            if !now.in_sync.contains(&r_id) {
                left_in_sync.get_or_insert(primary_gone.elapsed());
            }
            let error = insert_recorded(&client, &acked, next_batch(), Duration::from_secs(2))
                .await
                .expect_err("a write acknowledged while the shard's only copy with data was down");
            assert_eq!(error.code(), Code::Unavailable, "{error}");
            refused += 1;
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let left = left_in_sync.expect("the wiped replica stayed in the in-sync set");
        eprintln!(
            "phase 1: {refused} writes refused UNAVAILABLE; the wiped replica was out of the \
             in-sync set {left:?} after the primary's registration went"
        );
    });
    nodes[p].start(&endpoint);
    rt.block_on(async {
        let now = the_shard(&wait_in_sync(&addrs[c], 2).await);
        assert_eq!(
            (now.node_id.as_str(), now.epoch),
            (p_id.as_str(), shard.epoch)
        );
        check_acked(&client, &acked).await;
        insert_recorded(&client, &acked, next_batch(), Duration::from_secs(10))
            .await
            .unwrap();
    });
    let log = nodes[r].server.as_ref().unwrap().logs();
    assert!(
        log.contains("replica seeded; following by log"),
        "the wiped replica was not seeded: {log}"
    );
    eprintln!("phase 1: {:?} in all", started.elapsed());

    // Phase 2: the primary back on a wiped disk, registered before anyone saw it gone.
    let started = Instant::now();
    nodes[r].signal(Signal::STOP);
    nodes[c].signal(Signal::STOP);
    nodes[p].kill();
    rt.block_on(revoke_registration(&endpoint, &p_id));
    wipe(&nodes[p]);
    nodes[p].start(&endpoint);
    nodes[r].signal(Signal::CONT);
    nodes[c].signal(Signal::CONT);
    rt.block_on(async {
        let status = wait_for_status(
            &client,
            Duration::from_secs(30),
            "the in-sync replica promoted over the primary on a wiped disk, which rejoins",
            |s| {
                let now = the_shard(s);
                now.node_id == r_id && now.in_sync.len() == 2
            },
        )
        .await;
        assert!(the_shard(&status).epoch > shard.epoch);
        eprintln!(
            "phase 2: promoted over the wiped primary, which rejoined, {:?} after its kill",
            started.elapsed()
        );
        check_acked(&client, &acked).await;
        insert_recorded(&client, &acked, next_batch(), Duration::from_secs(10))
            .await
            .unwrap();
        check_acked(&client, &acked).await;
        tokio::time::sleep(Duration::from_secs(1)).await;
    });
    let log = nodes[p].server.as_ref().unwrap().logs();
    assert!(
        log.contains("replica seeded; following by log"),
        "the wiped primary was not seeded: {log}"
    );
    for node in &mut nodes {
        node.kill();
    }
    drop(etcd);
    assert_copies_identical(nodes.iter().map(|n| &n.dir), "moving", 1, 2);
}

/// A primary back on a wiped disk while its only in-sync replica is down past
/// `--replace-dead-after` (double fault): the replica, which holds the last copy of every
/// acknowledged write, is never replaced in the record while it is down; when it returns it
/// keeps its copy, is promoted over the wiped primary, and every acknowledged write is there.
/// Without the guard in re-replication, the replica left the record while it was down (the
/// primary, registered again from another directory, counted as alive), and deleted its copy
/// when it came back: the shard stayed UNAVAILABLE with its data gone.
#[test]
fn processes_a_wiped_primary_never_costs_its_down_replica_s_copy() {
    const LEASE: u64 = 2;
    const REPLACE: &[&str] = &["--replace-dead-after", "3"];
    let Some(cluster) = one_shard_cluster(LEASE, 2, REPLACE) else {
        return;
    };
    let OneShardCluster {
        mut nodes,
        etcd,
        rt,
        primary: p,
        replicas,
        others,
        addrs,
        ..
    } = cluster;
    let (r, c) = (replicas[0], others[0]);
    let endpoint = etcd.endpoint();
    let r_id = nodes[r].id.clone();
    let client = rt.block_on(Client::connect(addrs[c].clone())).unwrap();
    let acked: Acked = Default::default();
    rt.block_on(async {
        for batch in 0..30u128 {
            let docs = (batch * 20..batch * 20 + 20).map(|k| k * 7).collect();
            insert_settled(&client, &acked, docs).await;
        }
    });
    // The replica goes down; then the primary loses its disk and comes back at once.
    nodes[r].kill();
    rt.block_on(revoke_registration(&endpoint, &r_id));
    nodes[p].kill();
    rt.block_on(revoke_registration(&endpoint, &nodes[p].id));
    std::fs::remove_dir_all(&nodes[p].dir).unwrap();
    std::fs::create_dir_all(&nodes[p].dir).unwrap();
    nodes[p].try_start(&endpoint, REPLACE, &[]).unwrap();
    // Well past --replace-dead-after, a coordinator election and its rounds: the replica, the
    // only copy with data, stays in the record, in sync.
    let down = Instant::now();
    rt.block_on(async {
        while down.elapsed() < Duration::from_secs(12) {
            if let Ok(status) = client.cluster_status().await {
                let now = moving_shard(&status);
                assert!(
                    now.in_sync.contains(&r_id) || now.node_id == r_id,
                    "the down replica holding the last copy left the record: {now:?}"
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    });
    nodes[r]
        .try_start(&endpoint, REPLACE, &[("RUST_LOG", "info")])
        .unwrap();
    rt.block_on(async {
        wait_for_status(
            &client,
            Duration::from_secs(30),
            "the returning replica promoted over the wiped primary",
            |s| moving_shard(s).node_id == r_id,
        )
        .await;
        check_acked(&client, &acked).await;
    });
    let log = nodes[r].server.as_ref().unwrap().logs();
    assert!(
        !log.contains("dropping a local shard") && !log.contains("setting a local shard aside"),
        "{log}"
    );
}

/// ForgetNode of an in-sync replica whose primary is dead never says "no data lost": the
/// replica leaves the record listed as given up, so its copy is set aside (never deleted) when
/// it comes back, in either order of the two forgets (the replica's first, or the primary's).
/// Before, forgetting the replica first listed the shard as kept, and after the primary was
/// forgotten too the returning replica deleted the only copy of the shard's data.
#[test]
fn forget_of_a_replica_whose_primary_is_dead_sets_its_copy_aside_in_either_order() {
    let rt = runtime();
    for replica_first in [true, false] {
        let dir = tempfile::tempdir().unwrap();
        rt.block_on(async {
            let (mut servers, store) = memory_cluster(dir.path(), 3).await;
            let client = Client::connect(servers[0].grpc_addr()).await.unwrap();
            const DIM: usize = 4;
            client
                .create_collection(
                    CollectionSpec::new("pair", DIM as u32)
                        .metric(Metric::L2)
                        .shards(1, ShardKey::Doc)
                        .replicas(2, 1),
                )
                .await
                .unwrap();
            let mut rng = rand::rngs::StdRng::seed_from_u64(43);
            let ids: Vec<u128> = (0..40).collect();
            client
                .insert(Insert::new("pair", ids, vectors(&mut rng, 40, DIM)))
                .await
                .unwrap();
            let status = wait_for_status(&client, Duration::from_secs(20), "two in sync", |s| {
                s.shards.iter().all(|s| s.in_sync.len() == 2)
            })
            .await;
            let shard = status.shards[0].clone();
            let (primary, replica) = (shard.node_id.clone(), shard.replicas[0].clone());
            let number = |id: &str| id[1..].parse::<usize>().unwrap();
            let mut others: Vec<usize> = vec![number(&primary), number(&replica)];
            others.sort_unstable();
            let survivor = (1..=3).find(|i| !others.contains(i)).unwrap();
            let client = Client::connect(servers[survivor - 1].grpc_addr())
                .await
                .unwrap();
            // Both copies' nodes go down.
            for i in others.iter().rev() {
                servers.remove(i - 1).shutdown().await.unwrap();
            }
            store.expire(&primary);
            store.expire(&replica);
            let order = if replica_first {
                [replica.clone(), primary.clone()]
            } else {
                [primary.clone(), replica.clone()]
            };
            for node in &order {
                let report = client.forget_node_report(node, true).await.unwrap();
                assert!(
                    report.kept.is_empty(),
                    "forget {node} said no data lost: {report:?}"
                );
                if *node == replica && replica_first {
                    assert_eq!(report.set_aside.len(), 1, "{report:?}");
                }
            }
            // The replica comes back: its copy is set aside, not deleted.
            let back = memory_node(dir.path(), number(&replica), &store).await;
            let back_client = Client::connect(back.grpc_addr()).await.unwrap();
            let started = Instant::now();
            loop {
                let aside = back_client.list_set_aside().await.unwrap();
                if aside.len() == 1 {
                    break;
                }
                assert!(
                    started.elapsed() < Duration::from_secs(20),
                    "the returning replica's copy was not set aside (order: {order:?}): {aside:?}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            back.shutdown().await.unwrap();
            for server in servers {
                server.shutdown().await.unwrap();
            }
        });
    }
}

/// Re-replication: with `--replace-dead-after 3`, a node killed under writes has the replica
/// copies it held rebuilt on the other live nodes (seeded from the primaries' snapshots), and
/// the shards it led fail over first; every shard is back to 2 in-sync copies without it,
/// every acknowledged write is there, and both copies of each shard hold the same documents.
/// When the node returns, the copies it held, no longer in the map, are dropped (the data is
/// on two other in-sync copies).
#[test]
fn processes_a_dead_node_s_copies_are_rebuilt_elsewhere_after_replace_dead_after() {
    const LEASE: u64 = 2;
    let Some(binary) = etcd_binary() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(binary, &dir.path().join("etcd"));
    const REPLACE: &[&str] = &["--replace-dead-after", "3"];
    let mut nodes = nodes_with(dir.path(), 3, &etcd.endpoint(), LEASE, REPLACE, &[]);
    let rt = runtime();
    const DIM: usize = 8;
    let addrs: Vec<String> = nodes.iter().map(|n| n.addr()).collect();
    let clients: Vec<Client> = rt.block_on(async {
        let client = Client::connect(addrs[0].clone()).await.unwrap();
        create_moving(&client, DIM, 3, 2, 1).await;
        wait_in_sync(&addrs[0], 2).await;
        connect_all(&addrs[..2]).await
    });
    let (acked, stop, writers) = start_writers_on(&rt, &clients, DIM);
    std::thread::sleep(Duration::from_millis(1000));
    nodes[2].kill();
    let killed = std::time::Instant::now();
    rt.block_on(async {
        // Every shard back to two in-sync copies, none of them on n3.
        let status = loop {
            let status = wait_in_sync(&addrs[0], 2).await;
            if status
                .shards
                .iter()
                .filter(|s| s.collection == "moving")
                .all(|s| {
                    !s.in_sync.contains(&"n3".to_owned()) && !s.replicas.contains(&"n3".to_owned())
                })
            {
                break status;
            }
            assert!(killed.elapsed() < Duration::from_secs(60), "{status:?}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        eprintln!(
            "two copies again {:?} after the kill: {:?}",
            killed.elapsed(),
            status.shards
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for writer in writers {
            let (acknowledged, failures) = writer.await.unwrap();
            eprintln!(
                "writer: {acknowledged} acknowledged, {} failed",
                failures.len()
            );
            assert_retryable(&failures);
        }
        for client in &clients {
            check_acked(client, &acked).await;
        }
    });
    let coordinator_logs: String = nodes[..2]
        .iter()
        .map(|n| n.server.as_ref().unwrap().logs())
        .collect();
    assert!(
        coordinator_logs.contains("re-replication: a dead node's replica is rebuilt"),
        "{coordinator_logs}"
    );
    // Both copies of each shard hold the same documents.
    std::thread::sleep(Duration::from_secs(1));
    for node in &mut nodes[..2] {
        node.kill();
    }
    assert_copies_identical(nodes[..2].iter().map(|n| &n.dir), "moving", 3, 2);
    // n3 returns: the copies it held are no longer in the map and go (it may be given other
    // shards afterwards: the placement balances primaries).
    let held = shard_dirs(&nodes[2], "moving");
    assert!(held > 0);
    for node in &mut nodes[..2] {
        node.try_start(&etcd.endpoint(), REPLACE, &[]).unwrap();
    }
    nodes[2]
        .try_start(&etcd.endpoint(), REPLACE, &[("RUST_LOG", "info")])
        .unwrap();
    let started = std::time::Instant::now();
    loop {
        let log = nodes[2].server.as_ref().unwrap().logs();
        if log.matches("dropping a local shard").count() >= held {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "n3 kept its old copies: {log}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// ForgetNode with replicas: a dead node's copies that another in-sync copy makes redundant
/// lose no data (listed as kept: the node's copy leaves the record; a shard it led is led by
/// the promoted copy), and only a shard with no other copy is given up (listed, starts empty).
/// Every kept shard is then back to its replication factor (a new copy seeded on the other
/// live node).
#[test]
fn forget_keeps_every_shard_another_in_sync_copy_holds() {
    let dir = tempfile::tempdir().unwrap();
    let rt = runtime();
    rt.block_on(async {
        let store = std::sync::Arc::new(tarn_cluster::MemoryStore::default());
        let mut servers = Vec::new();
        for i in 1..=3 {
            servers.push(memory_node(dir.path(), i, &store).await);
        }
        let client = Client::connect(servers[0].grpc_addr()).await.unwrap();
        const DIM: usize = 4;
        for (name, copies) in [("kept", 2), ("lone", 1)] {
            client
                .create_collection(
                    CollectionSpec::new(name, DIM as u32)
                        .metric(Metric::L2)
                        .shards(3, ShardKey::Doc)
                        .replicas(copies, 1),
                )
                .await
                .unwrap();
        }
        let mut rng = rand::rngs::StdRng::seed_from_u64(41);
        let v = vectors(&mut rng, 60, DIM);
        let ids: Vec<u128> = (0..60).collect();
        for name in ["kept", "lone"] {
            client
                .insert(Insert::new(name, ids.clone(), v.clone()))
                .await
                .unwrap();
        }
        let status = client.cluster_status().await.unwrap();
        let lone_on_n3 = status
            .shards
            .iter()
            .filter(|s| s.collection == "lone" && s.node_id == "n3")
            .count();
        let kept_on_n3 = status
            .shards
            .iter()
            .filter(|s| {
                s.collection == "kept" && (s.node_id == "n3" || s.replicas.contains(&"n3".into()))
            })
            .count();
        assert!(kept_on_n3 > 0 && lone_on_n3 > 0, "{status:?}");
        servers.remove(2).shutdown().await.unwrap();
        store.expire("n3");
        // The shards n3 led fail over first (their copies on n1 and n2 are in sync).
        let started = Instant::now();
        loop {
            let status = client.cluster_status().await.unwrap();
            if status
                .shards
                .iter()
                .all(|s| s.collection != "kept" || s.node_id != "n3")
            {
                break;
            }
            assert!(started.elapsed() < Duration::from_secs(20), "{status:?}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let report = client.forget_node_report("n3", false).await.unwrap();
        let (given_up, kept) = (report.given_up, report.kept);
        assert_eq!(kept.len(), kept_on_n3, "{kept:?}");
        assert!(kept
            .iter()
            .all(|s| s.collection == "kept" && s.state == "planned"));
        assert_eq!(given_up.len(), lone_on_n3, "{given_up:?}");
        assert!(given_up.iter().all(|s| s.collection == "lone"));
        let report = client.forget_node_report("n3", true).await.unwrap();
        let (given_up, kept) = (report.given_up, report.kept);
        assert_eq!((given_up.len(), kept.len()), (lone_on_n3, kept_on_n3));
        // Nothing of "kept" is lost, and n3 is none of its copies any more.
        let started = Instant::now();
        loop {
            let status = client.cluster_status().await.unwrap();
            let clean = status
                .shards
                .iter()
                .filter(|s| s.collection == "kept")
                .all(|s| {
                    s.node_id != "n3"
                        && !s.replicas.contains(&"n3".into())
                        && !s.in_sync.contains(&"n3".into())
                });
            if clean {
                break;
            }
            assert!(started.elapsed() < Duration::from_secs(10), "{status:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // The replication factor comes back without a person: every shard of "kept" gets a
        // second copy on the other live node, seeded and in sync.
        wait_for_status(
            &client,
            Duration::from_secs(30),
            "every shard of kept back to two in-sync copies after forget",
            |s| {
                s.shards
                    .iter()
                    .filter(|s| s.collection == "kept")
                    .all(|s| s.in_sync.len() == 2)
            },
        )
        .await;
        for id in &ids {
            let got = client.get("kept", 0, &[*id]).await.unwrap();
            assert_eq!(got.len(), 1, "document {id} of kept is missing");
            assert_eq!(
                got[0].vector,
                v[*id as usize * DIM..(*id as usize + 1) * DIM]
            );
        }
        let info = client.collection_info("kept").await.unwrap();
        assert_eq!(info.n_documents, 60);
    });
}

/// Draining a node moves its replica copies too (issue: moves and drains keep working with
/// replicas): each shard of a 2-copy collection gets a new copy on the other node first, and
/// the draining node's copy leaves only once the others are in sync; the shards it led move
/// as before. Afterwards the node holds no copy (in the map or on its disk), every shard has
/// two in-sync copies, and every document is there.
#[test]
fn a_drain_moves_replica_copies_off_the_node_add_first() {
    let dir = tempfile::tempdir().unwrap();
    let rt = runtime();
    rt.block_on(async {
        let (servers, _store) = memory_cluster(dir.path(), 3).await;
        let client = Client::connect(servers[0].grpc_addr()).await.unwrap();
        const DIM: usize = 4;
        client
            .create_collection(
                CollectionSpec::new("d", DIM as u32)
                    .metric(Metric::L2)
                    .shards(3, ShardKey::Doc)
                    .replicas(2, 1),
            )
            .await
            .unwrap();
        let mut rng = rand::rngs::StdRng::seed_from_u64(43);
        let v = vectors(&mut rng, 90, DIM);
        let ids: Vec<u128> = (0..90).collect();
        client
            .insert(Insert::new("d", ids.clone(), v.clone()))
            .await
            .unwrap();
        let status = client.cluster_status().await.unwrap();
        assert!(
            status
                .shards
                .iter()
                .any(|s| s.collection == "d" && s.replicas.contains(&"n3".into())),
            "n3 holds a replica: {status:?}"
        );
        let n3 = dir.path().join("n3").join("collections");
        let n3_holds_copies = || {
            std::fs::read_dir(&n3)
                .map(|d| {
                    d.flatten()
                        .any(|e| e.file_name().to_string_lossy().starts_with("d."))
                })
                .unwrap_or(false)
        };
        // Copies appear on a replica with the first entries shipped to it.
        let started = Instant::now();
        while !n3_holds_copies() {
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "n3 has no copy"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        client.drain_node("n3", false).await.unwrap();
        let started = Instant::now();
        loop {
            let status = client.cluster_status().await.unwrap();
            let shards: Vec<_> = status
                .shards
                .iter()
                .filter(|s| s.collection == "d")
                .collect();
            let done = shards.iter().all(|s| {
                s.node_id != "n3"
                    && !s.replicas.contains(&"n3".into())
                    && s.in_sync.len() == 2
                    && s.replicas.len() == 1
            });
            if done {
                break;
            }
            assert!(started.elapsed() < Duration::from_secs(30), "{shards:?}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        for id in &ids {
            let got = client.get("d", 0, &[*id]).await.unwrap();
            assert_eq!(got.len(), 1, "document {id} is missing");
        }
        assert_eq!(client.collection_info("d").await.unwrap().n_documents, 90);
        // n3's disk lets its copies go.
        let started = Instant::now();
        while n3_holds_copies() {
            assert!(
                started.elapsed() < Duration::from_secs(15),
                "n3 kept a copy"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
}

/// `text` without terminal colour sequences (a node's log read back).
fn without_colours(text: &str) -> String {
    let mut plain = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c == 'm' {
                    break;
                }
            }
        } else {
            plain.push(c);
        }
    }
    plain
}

/// Writes one document at a time through `client` (tenant 0, multiples of 7 from `base`, as
/// `check_acked` reads them), each recorded in `acked`, until `stop`: the longest time between
/// two acknowledgements (how long writes were refused at worst), and the failures.
async fn probe_refusals(
    client: Client,
    base: u128,
    acked: Acked,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> (Duration, Vec<String>) {
    const DIM: usize = 8;
    let mut rng = rand::rngs::StdRng::seed_from_u64(base as u64);
    let (mut longest, mut failures) = (Duration::ZERO, Vec::new());
    let mut last_ack = std::time::Instant::now();
    for k in 0u128.. {
        if stop.load(std::sync::atomic::Ordering::Relaxed) {
            break;
        }
        let doc = (base + k) * 7;
        let v = vectors(&mut rng, 1, DIM);
        let insert = Insert::new("moving", vec![doc], v.clone())
            .users(vec![0])
            .timeout(Duration::from_secs(5));
        match client.insert(insert).await {
            Ok(_) => {
                longest = longest.max(last_ack.elapsed());
                last_ack = std::time::Instant::now();
                acked.lock().unwrap().insert(doc, Doc::Live(v));
            }
            Err(error) => {
                failures.push(format!("{:?}: {}", error.code(), error.message()));
                acked.lock().unwrap().insert(doc, Doc::Uncertain);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
    (longest, failures)
}

/// Moving primaries while a failover happens (issue test 9): 4 nodes, a collection of 2 copies
/// per shard (min_in_sync 1) under two writers through each node. n1, primary of some shards, is
/// drained while n4, primary of others, is killed with kill -9: n1's primaries are handed over
/// to their in-sync replicas (fence, drain, promotion) and its copies then leave add-first,
/// n4's shards fail over and its replicas are rebuilt (`--replace-dead-after 3`), and the
/// primaries left unbalanced by the failover move by hand-over too. Afterwards: n1 holds no
/// copy (map and disk), every shard has two in-sync copies, every acknowledged write is there
/// once and no removed document is back (through each live node), the two copies of each shard
/// are identical, failed writes are only UNAVAILABLE / DEADLINE_EXCEEDED / ABORTED, and no
/// hand-over's old primary had its log cut afterwards (its whole log is on the new primary:
/// with the drain skipped, writes in flight at the fence leave entries there that the new
/// primary lacks, and they are cut; a fail point delays every shipped batch by 20 ms so that
/// writes are in flight). The longest refusal of a one-at-a-time
/// writer and each hand-over's write pause (fence to promotion) are reported.
#[test]
fn processes_a_drain_and_primary_moves_during_a_failover_lose_no_acknowledged_write() {
    const LEASE: u64 = 2;
    let Some(binary) = etcd_binary() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(binary, &dir.path().join("etcd"));
    const REPLACE: &[&str] = &["--replace-dead-after", "3"];
    let mut nodes = nodes_with(
        dir.path(),
        4,
        &etcd.endpoint(),
        LEASE,
        REPLACE,
        &[
            ("RUST_LOG", "info"),
            // Every batch a primary ships waits 20 ms first: writes are in flight whenever a
            // fence lands, so a hand-over that did not drain them would leave entries on the
            // old primary that its successor lacks (and they would be cut).
            ("FAILPOINTS", "replication::hold_entries=return(20)"),
        ],
    );
    let rt = runtime();
    const DIM: usize = 8;
    const SHARDS: u32 = 8;
    let addrs: Vec<String> = nodes.iter().map(|n| n.addr()).collect();
    let (clients, status) = rt.block_on(async {
        let clients = connect_all(&addrs).await;
        create_moving(&clients[0], DIM, SHARDS, 2, 1).await;
        let status = wait_in_sync(&addrs[0], 2).await;
        (clients, status)
    });
    let led = owners(&status, "moving");
    assert!(led.get("n1").is_some_and(|n| *n > 0), "{led:?}");
    assert!(led.get("n4").is_some_and(|n| *n > 0), "{led:?}");

    // Two writers through each node: a write in flight on most shards at any time.
    let doubled: Vec<Client> = clients.iter().chain(&clients).cloned().collect();
    let (acked, stop, writers) = start_writers_on(&rt, &doubled, DIM);
    let probe = {
        let _entered = rt.enter();
        tokio::spawn(probe_refusals(
            clients[1].clone(),
            300_000_000,
            acked.clone(),
            stop.clone(),
        ))
    };
    std::thread::sleep(Duration::from_millis(1000));
    // The drain of n1 and the kill of n4, together.
    rt.block_on(clients[1].drain_node("n1", false)).unwrap();
    std::thread::sleep(Duration::from_millis(30));
    nodes[3].kill();
    let faulted = std::time::Instant::now();
    let status = rt.block_on(async {
        loop {
            let status = clients[1].cluster_status().await.unwrap();
            let shards: Vec<_> = status
                .shards
                .iter()
                .filter(|s| s.collection == "moving")
                .collect();
            let gone = |n: &str| {
                shards.iter().all(|s| {
                    s.node_id != n
                        && !s.replicas.iter().any(|r| r == n)
                        && !s.in_sync.iter().any(|r| r == n)
                })
            };
            if gone("n1")
                && gone("n4")
                && shards
                    .iter()
                    .all(|s| s.state == "serving" && s.in_sync.len() == 2)
            {
                break status;
            }
            assert!(
                faulted.elapsed() < Duration::from_secs(40),
                "not settled 40 s after the faults: {shards:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    eprintln!(
        "settled {:?} after the drain and the kill: {:?}",
        faulted.elapsed(),
        owners(&status, "moving")
    );
    rt.block_on(async {
        tokio::time::sleep(Duration::from_millis(500)).await;
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let mut failures = Vec::new();
        for writer in writers {
            let (acknowledged, failed) = writer.await.unwrap();
            eprintln!(
                "writer: {acknowledged} acknowledged, {} failed",
                failed.len()
            );
            failures.extend(failed);
        }
        let (longest, failed) = probe.await.unwrap();
        eprintln!(
            "one-at-a-time writer through n2: longest time without an acknowledgement {longest:?} \
             ({} refusals)",
            failed.len()
        );
        failures.extend(failed);
        assert_retryable(&failures);
        for client in &clients[..3] {
            check_acked(client, &acked).await;
        }
    });
    // Each live node's log, without the terminal's colours.
    let logs: Vec<String> = nodes[..3]
        .iter()
        .map(|n| without_colours(&n.server.as_ref().unwrap().logs()))
        .collect();
    let all_logs = logs.concat();
    let field = |line: &str, name: &str| -> String {
        let key = format!(" {name}=");
        line.find(&key)
            .and_then(|at| line[at + key.len()..].split_whitespace().next())
            .unwrap_or_default()
            .to_owned()
    };
    // (time, shard, old primary) of each landed hand-over, from the coordinators' logs.
    let handed: Vec<(String, String, String)> = all_logs
        .lines()
        .filter(|l| l.contains("hand-over: the replica is the shard's primary"))
        .map(|l| {
            let at = l.split_whitespace().next().unwrap_or_default().to_owned();
            (at, field(l, "shard"), field(l, "from"))
        })
        .collect();
    let pauses: Vec<f64> = all_logs
        .lines()
        .filter(|l| l.contains("hand-over: the replica is the shard's primary"))
        .filter_map(|l| field(l, "write_pause_ms").parse().ok())
        .collect();
    let failovers = all_logs.matches("failover: an in-sync replica").count();
    for line in all_logs.lines().filter(|l| l.contains("hand-over")) {
        eprintln!("  {line}");
    }
    eprintln!(
        "{} hand-overs (write pause, fence to promotion, ms: {pauses:?}), {failovers} failovers",
        handed.len()
    );
    assert!(
        handed.len() >= led["n1"],
        "each shard n1 led was handed over"
    );
    assert!(failovers >= 1, "n4's shards failed over");
    assert!(
        pauses.iter().all(|ms| *ms < 2000.0),
        "a hand-over paused writes for long: {pauses:?}"
    );
    // A hand-over's old primary holds nothing its successor lacks: its log is never cut after
    // it (a copy that followed the killed n4 may be: n4's unacknowledged tail).
    for (node, log) in nodes.iter().zip(&logs) {
        for cut in log
            .lines()
            .filter(|l| l.contains("cut entries a deposed primary never had acknowledged"))
        {
            let at = cut.split_whitespace().next().unwrap_or_default();
            let shard = field(cut, "shard");
            assert!(
                !handed
                    .iter()
                    .any(|(t, s, from)| *s == shard && *from == node.id && at > t.as_str()),
                "{} handed {shard} over and then its log was cut: the replica was promoted \
                 without the old primary's whole log ({cut})",
                node.id
            );
        }
    }
    // n1 lets its copies go from disk.
    let started = std::time::Instant::now();
    while shard_dirs(&nodes[0], "moving") > 0 {
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "n1 kept a copy on disk"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_secs(1));
    for node in &mut nodes[..3] {
        node.kill();
    }
    assert!(local_copies(&nodes[0].dir, "moving").is_empty());
    assert_copies_identical(nodes[1..3].iter().map(|n| &n.dir), "moving", SHARDS, 2);
}

/// A hand-over that fails (the fail point `moves::fail_handover` fires once, on the old primary
/// after its drain) lifts its fence: the old primary serves the shard again at the next epoch,
/// the failure is recorded, and the coordinator tries again after its backoff, which lands. The
/// drain of n1 (primary of some shards of a 2-copy collection, under writers through every node)
/// ends with n1 in no record and on no disk; every acknowledged write is there, failed writes
/// only UNAVAILABLE / DEADLINE_EXCEEDED / ABORTED.
#[test]
fn processes_a_failed_hand_over_lifts_its_fence_and_is_tried_again() {
    const LEASE: u64 = 2;
    let Some(binary) = etcd_binary() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(binary, &dir.path().join("etcd"));
    let nodes = nodes_with(
        dir.path(),
        3,
        &etcd.endpoint(),
        LEASE,
        &[],
        &[
            ("RUST_LOG", "info"),
            ("FAILPOINTS", "moves::fail_handover=1*return"),
        ],
    );
    let rt = runtime();
    const DIM: usize = 8;
    let addrs: Vec<String> = nodes.iter().map(|n| n.addr()).collect();
    let (clients, status) = rt.block_on(async {
        let clients = connect_all(&addrs).await;
        create_moving(&clients[0], DIM, 3, 2, 1).await;
        let status = wait_in_sync(&addrs[0], 2).await;
        (clients, status)
    });
    assert!(owners(&status, "moving").contains_key("n1"), "{status:?}");
    let (acked, stop, writers) = start_writers_on(&rt, &clients, DIM);
    std::thread::sleep(Duration::from_millis(500));
    rt.block_on(async {
        clients[1].drain_node("n1", false).await.unwrap();
        let started = std::time::Instant::now();
        loop {
            let status = clients[1].cluster_status().await.unwrap();
            let shards: Vec<_> = status
                .shards
                .iter()
                .filter(|s| s.collection == "moving")
                .collect();
            let done = shards.iter().all(|s| {
                s.node_id != "n1"
                    && !s.replicas.iter().any(|r| r == "n1")
                    && s.state == "serving"
                    && s.in_sync.len() == 2
            });
            if done {
                break;
            }
            assert!(started.elapsed() < Duration::from_secs(30), "{shards:?}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let mut failures = Vec::new();
        for writer in writers {
            let (acknowledged, failed) = writer.await.unwrap();
            eprintln!(
                "writer: {acknowledged} acknowledged, {} failed",
                failed.len()
            );
            failures.extend(failed);
        }
        assert_retryable(&failures);
        for client in &clients {
            check_acked(client, &acked).await;
        }
    });
    let logs: String = nodes
        .iter()
        .map(|n| without_colours(&n.server.as_ref().unwrap().logs()))
        .collect();
    for needle in [
        "hand-over failed; lifting its fence",
        "hand-over abandoned; the fence is lifted",
        "hand-over: the replica is the shard's primary",
    ] {
        assert!(logs.contains(needle), "no {needle:?} in the logs");
    }
    let started = std::time::Instant::now();
    while shard_dirs(&nodes[0], "moving") > 0 {
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "n1 kept a copy on disk"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A long move does not hold up a failover: the placement coordinator runs each move or
/// hand-over as a task of its own and goes on promoting replicas (and rebuilding copies)
/// meanwhile. n3 joins a cluster of two and pulls shards of a one-copy collection, each pull held
/// 20 s before its fence (`moves::before_fence`); while one is held, the node of n1 and n2 that
/// is not the coordinator is killed (kill -9) under writers: every shard of the 2-copy
/// collection it led is served by a promoted replica within the lease plus 6 s, while the pull
/// is still held (the coordinator that awaited its moves promoted only after them). Every
/// acknowledged write is there afterwards; failed writes only UNAVAILABLE / DEADLINE_EXCEEDED /
/// ABORTED.
#[test]
fn processes_a_failover_is_not_held_up_by_a_long_move() {
    const LEASE: u64 = 2;
    let Some(binary) = etcd_binary() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(binary, &dir.path().join("etcd"));
    let env: &[(&str, &str)] = &[
        ("RUST_LOG", "info"),
        ("FAILPOINTS", "moves::before_fence=return(20000)"),
    ];
    let mut nodes = nodes_with(dir.path(), 2, &etcd.endpoint(), LEASE, &[], env);
    let rt = runtime();
    const DIM: usize = 8;
    rt.block_on(async {
        let client = Client::connect(nodes[0].addr()).await.unwrap();
        create_moving(&client, DIM, 4, 2, 1).await;
        client
            .create_collection(
                CollectionSpec::new("single", DIM as u32)
                    .metric(Metric::L2)
                    .shards(4, ShardKey::Doc),
            )
            .await
            .unwrap();
        let mut rng = rand::rngs::StdRng::seed_from_u64(31);
        let docs: Vec<u128> = (0..200).collect();
        client
            .insert(Insert::new("single", docs, vectors(&mut rng, 200, DIM)).users(vec![1]))
            .await
            .unwrap();
        wait_in_sync(&nodes[0].addr(), 2).await;
    });
    let logs = |node: &Node| without_colours(&node.server.as_ref().unwrap().logs());
    let coordinator = (0..2)
        .find(|&i| logs(&nodes[i]).contains("this node is the placement coordinator"))
        .expect("no coordinator among n1 and n2");
    let victim = 1 - coordinator;
    let mut n3 = Node::new(dir.path(), "n3", LEASE);
    n3.start_with_env(&etcd.endpoint(), env);
    nodes.push(n3);
    let started = std::time::Instant::now();
    while !logs(&nodes[2]).contains("pausing at a fail point") {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "n3 never pulled a shard"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let victim_id = nodes[victim].id.clone();
    let survivors: Vec<String> = [coordinator, 2].iter().map(|&i| nodes[i].addr()).collect();
    let (clients, led) = rt.block_on(async {
        let clients = connect_all(&survivors).await;
        let status = clients[0].cluster_status().await.unwrap();
        (clients, owners(&status, "moving"))
    });
    assert!(
        led.get(&victim_id).is_some_and(|n| *n > 0),
        "{victim_id} leads no shard of 'moving': {led:?}"
    );
    let (acked, stop, writers) = start_writers_on(&rt, &clients, DIM);
    std::thread::sleep(Duration::from_millis(300));
    nodes[victim].kill();
    let killed = std::time::Instant::now();
    rt.block_on(async {
        loop {
            let status = clients[0].cluster_status().await.unwrap();
            let failed_over = status
                .shards
                .iter()
                .filter(|s| s.collection == "moving")
                .all(|s| s.node_id != victim_id && s.state == "serving");
            if failed_over {
                break;
            }
            assert!(
                killed.elapsed() < Duration::from_secs(LEASE + 6),
                "no failover within {} s of the kill, behind the held move: {:?}",
                LEASE + 6,
                status.shards
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    eprintln!("failed over {:?} after the kill", killed.elapsed());
    assert!(
        !logs(&nodes[2]).contains("shard moved here"),
        "the pull was no longer held when the failover landed: the test proves nothing"
    );
    std::thread::sleep(Duration::from_secs(1));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    rt.block_on(async {
        let mut failures = Vec::new();
        for writer in writers {
            let (acknowledged, failed) = writer.await.unwrap();
            eprintln!(
                "writer: {acknowledged} acknowledged, {} failed",
                failed.len()
            );
            failures.extend(failed);
        }
        assert_retryable(&failures);
        for client in &clients {
            check_acked(client, &acked).await;
        }
    });
}
