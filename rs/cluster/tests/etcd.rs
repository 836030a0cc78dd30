//! The coordination store's contract, checked twice: one generic function of semantic checks
//! ([`store_semantics`]) runs against [`MemoryStore`] and against [`EtcdStore`] on a real etcd,
//! so that routing and placement tests can trust the in-memory store. Then what only a real etcd
//! shows: leases that lapse when a process dies, a watch that survives an etcd restart, elections,
//! collections too large for one transaction, and values tarn cannot read.
//!
//! The tests start their own etcd (`etcd` on PATH, else Debian's `etcd-server` installed by
//! `scripts/lib-etcd.sh`'s `ensure_etcd`): one shared by most tests, each under its own key
//! prefix, and a private one for the restart test; each listens on free loopback ports and is
//! stopped when the test process ends (a shell wrapper kills it when its stdin, a pipe from the
//! test process, closes). Without etcd the etcd tests print `SKIPPED: no etcd (...)` straight to
//! stderr, past the test harness's capture, and pass.
#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use tarn_cluster::etcd_api::etcdserverpb::RangeResponse;
use tarn_cluster::etcd_api::{ConnectOptions, EtcdClient};
use tarn_cluster::{
    ClusterError, ClusterIdentity, ClusterState, ClusterStore, CollectionDef, CollectionMap,
    EtcdStore, MemoryStore, NodeInfo, ShardAssignment, ShardKey, ShardRecord, ShardSwap,
};
use tokio::sync::watch;

// ---------------------------------------------------------------------------------------------
// etcd processes.

/// One etcd, run by `sh` so that it dies with the test process: the wrapper waits on its stdin
/// (a pipe from us) and sends etcd SIGTERM when the pipe closes, then removes the data directory
/// if asked to.
struct Etcd {
    wrapper: Child,
    stdin: Option<ChildStdin>,
    dir: PathBuf,
    client_port: u16,
    peer_port: u16,
}

const ETCD_WRAPPER: &str = r#"
etcd_bin="$1"; shift
"$etcd_bin" "$@" >>"$TARN_TEST_ETCD_DIR/etcd.log" 2>&1 &
pid=$!
read -r _
kill -TERM "$pid" 2>/dev/null
wait "$pid"
if [ -n "$TARN_TEST_ETCD_REMOVE" ]; then rm -rf "$TARN_TEST_ETCD_DIR"; fi
"#;

impl Etcd {
    /// Starts etcd with its data in `dir` on the given ports and waits until it is healthy.
    /// `remove_dir` removes `dir` once etcd has stopped.
    fn start(
        binary: &Path,
        dir: &Path,
        client_port: u16,
        peer_port: u16,
        remove_dir: bool,
    ) -> Etcd {
        std::fs::create_dir_all(dir).unwrap();
        let client = format!("http://127.0.0.1:{client_port}");
        let peer = format!("http://127.0.0.1:{peer_port}");
        let mut command = Command::new("sh");
        command
            .arg("-c")
            .arg(ETCD_WRAPPER)
            .arg("tarn-test-etcd")
            .arg(binary)
            .args(["--name", "tarn-test", "--data-dir"])
            .arg(dir.join("data"))
            .args([
                "--listen-client-urls",
                &client,
                "--advertise-client-urls",
                &client,
            ])
            .args([
                "--listen-peer-urls",
                &peer,
                "--initial-advertise-peer-urls",
                &peer,
            ])
            .args(["--initial-cluster", &format!("tarn-test={peer}")])
            .args(["--logger", "zap", "--log-level", "warn"])
            .env("TARN_TEST_ETCD_DIR", dir)
            .env("TARN_TEST_ETCD_REMOVE", if remove_dir { "1" } else { "" })
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        // etcd 3.4 refuses to start on other architectures unless told to.
        if std::env::consts::ARCH != "x86_64" {
            command.env("ETCD_UNSUPPORTED_ARCH", std::env::consts::ARCH);
        }
        let mut wrapper = command.spawn().unwrap();
        let stdin = wrapper.stdin.take();
        let etcd = Etcd {
            wrapper,
            stdin,
            dir: dir.to_owned(),
            client_port,
            peer_port,
        };
        etcd.wait_healthy();
        etcd
    }

    fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    fn wait_healthy(&self) {
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline {
            if health(self.client_port) {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let log = std::fs::read_to_string(self.dir.join("etcd.log")).unwrap_or_default();
        panic!(
            "etcd on port {} not healthy in 15 s; its log:\n{log}",
            self.client_port
        );
    }

    /// Stops etcd (SIGTERM) and waits until it is gone.
    fn stop(&mut self) {
        drop(self.stdin.take());
        let _ = self.wrapper.wait();
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Whether etcd's `/health` says so.
fn health(port: u16) -> bool {
    let Ok(mut stream) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(1)));
    if stream
        .write_all(b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .is_err()
    {
        return false;
    }
    let mut answer = String::new();
    let _ = stream.read_to_string(&mut answer);
    answer.contains(r#""health":"true""#)
}

/// Two distinct free loopback ports (free when returned; taking them is racy but fine here).
fn free_ports() -> (u16, u16) {
    let a = TcpListener::bind("127.0.0.1:0").unwrap();
    let b = TcpListener::bind("127.0.0.1:0").unwrap();
    (
        a.local_addr().unwrap().port(),
        b.local_addr().unwrap().port(),
    )
}

fn find_on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
}

/// The etcd binary: on PATH, or installed once by `ensure_etcd`; `Err` says why there is none.
fn etcd_binary() -> Result<&'static Path, &'static str> {
    static BINARY: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let found = BINARY.get_or_init(|| {
        if let Some(path) = find_on_path("etcd") {
            return Ok(path);
        }
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let output = Command::new("bash")
            .arg("-c")
            .arg("source scripts/lib-etcd.sh && ensure_etcd")
            .current_dir(&root)
            .output();
        if let Some(path) = find_on_path("etcd") {
            return Ok(path);
        }
        Err(match output {
            Ok(out) => format!(
                "not on PATH, and ensure_etcd failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ),
            Err(e) => format!("not on PATH, and bash could not run ensure_etcd: {e}"),
        })
    });
    found.as_deref().map_err(String::as_str)
}

/// Says loudly, past the test harness's capture of `println!`, that a test did not run.
fn skip(test: &str, why: &str) {
    assert!(
        std::env::var("CI").as_deref() != Ok("true"),
        "no etcd under CI=true ({why}): {test} must run in CI"
    );
    let _ = writeln!(std::io::stderr(), "SKIPPED: no etcd ({why}): {test}");
}

/// The etcd most tests share (each under its own prefix), started on first use.
fn shared_etcd(test: &str) -> Option<&'static Etcd> {
    static SHARED: OnceLock<Option<Etcd>> = OnceLock::new();
    let etcd = SHARED.get_or_init(|| {
        let binary = etcd_binary().ok()?;
        let dir = std::env::temp_dir().join(format!("tarn-etcd-test-{}", std::process::id()));
        let (client_port, peer_port) = free_ports();
        Some(Etcd::start(binary, &dir, client_port, peer_port, true))
    });
    if etcd.is_none() {
        skip(test, etcd_binary().err().unwrap_or("it did not start"));
    }
    etcd.as_ref()
}

async fn connect(etcd: &Etcd, test: &str) -> EtcdStore {
    EtcdStore::connect(&[etcd.endpoint()], &format!("/tarn-test/{test}"))
        .await
        .unwrap()
}

/// tarn's etcd client on its own, to look at and change keys behind the store's back.
async fn raw_client(etcd: &Etcd) -> EtcdClient {
    EtcdClient::connect(&[etcd.endpoint()], &ConnectOptions::default()).unwrap()
}

// ---------------------------------------------------------------------------------------------
// Helpers.

fn node(id: &str) -> NodeInfo {
    NodeInfo {
        node_id: id.to_owned(),
        address: format!("{id}.example:50061"),
        incarnation: String::new(),
    }
}

/// A node on a data directory whose token is `incarnation`.
fn node_on(id: &str, incarnation: &str) -> NodeInfo {
    NodeInfo {
        incarnation: incarnation.to_owned(),
        ..node(id)
    }
}

/// Registers `node` from a process that then dies: its own runtime on its own thread, the
/// registration neither dropped nor revoked; the runtime's end stops the keep-alive task as the
/// process's death would. Returns the dead registration's lease.
fn register_and_die(endpoint: String, prefix: String, node: NodeInfo, ttl: Duration) -> i64 {
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let store = EtcdStore::connect(std::slice::from_ref(&endpoint), &prefix)
                .await
                .unwrap();
            let registration = store.register(&node, ttl).await.unwrap();
            std::mem::forget(registration);
            let raw = EtcdClient::connect(&[endpoint], &ConnectOptions::default()).unwrap();
            let key = format!("{}nodes/{}", store.prefix(), node.node_id);
            let lease = raw.get(key.as_bytes(), false).await.unwrap().kvs[0].lease;
            std::mem::forget(store);
            lease
        })
    })
    .join()
    .unwrap()
}

fn collection(name: &str, uid: u64, owners: &[&str]) -> CollectionMap {
    CollectionMap {
        def: CollectionDef {
            name: name.to_owned(),
            uid,
            n_shards: owners.len() as u32,
            shard_key: ShardKey::User,
            config: serde_json::json!({ "dim": 4, "metric": "cosine" }),
            replication_factor: 1,
            min_in_sync: 1,
        },
        shards: owners
            .iter()
            .map(|owner| ShardAssignment::serving(*owner, 1))
            .collect(),
    }
}

fn assignment(owner: &str, epoch: u64) -> ShardAssignment {
    ShardAssignment::serving(owner, epoch)
}

fn swap<'a>(
    collection: &'a str,
    uid: u64,
    shard: u32,
    expected_epoch: u64,
    new: &'a ShardAssignment,
) -> ShardSwap<'a> {
    ShardSwap {
        collection,
        uid,
        shard,
        expected_epoch,
        new,
        unless_registered: None,
        unless_registered_from: None,
        registered: None,
        expected: None,
    }
}

/// Waits until the watched state satisfies `pred`, and returns it; panics with `what` and the
/// last state after `within`.
async fn wait_until(
    rx: &mut watch::Receiver<Arc<ClusterState>>,
    within: Duration,
    what: &str,
    pred: impl Fn(&ClusterState) -> bool,
) -> Arc<ClusterState> {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let state = Arc::clone(&rx.borrow_and_update());
        if pred(&state) {
            return state;
        }
        match tokio::time::timeout_at(deadline, rx.changed()).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => panic!("the watch ended while waiting for: {what}"),
            Err(_) => panic!("not within {within:?}: {what}; last state: {state:#?}"),
        }
    }
}

/// Polls `check` every 50 ms until it is true; panics with `what` after `within`.
async fn poll_until<F: std::future::Future<Output = bool>>(
    within: Duration,
    what: &str,
    mut check: impl FnMut() -> F,
) {
    let deadline = Instant::now() + within;
    while !check().await {
        assert!(Instant::now() < deadline, "not within {within:?}: {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

const WAIT: Duration = Duration::from_secs(10);

// ---------------------------------------------------------------------------------------------
// The contract, for both stores.

/// Everything a [`ClusterStore`] promises, on a store whose prefix is empty.
async fn store_semantics(store: &impl ClusterStore) {
    let mut rx = store.watch().await.unwrap();
    assert!(rx.borrow().nodes.is_empty() && rx.borrow().collections.is_empty());
    let ttl = Duration::from_secs(5);

    // Membership: one live node per id.
    let n1 = store.register(&node("n1"), ttl).await.unwrap();
    match store.register(&node("n1"), ttl).await {
        Err(ClusterError::DuplicateNode { node_id, .. }) => assert_eq!(node_id, "n1"),
        other => panic!("a second n1 was not refused: {other:?}"),
    }
    let n2 = store.register(&node("n2"), ttl).await.unwrap();
    let state = wait_until(&mut rx, WAIT, "n1 and n2 registered", |s| {
        s.is_alive("n1") && s.is_alive("n2")
    })
    .await;
    assert_eq!(state.nodes["n2"], node("n2"));

    // A dropped registration ends the membership; the id is free again.
    drop(n2);
    wait_until(
        &mut rx,
        WAIT,
        "n2 gone after its registration was dropped",
        |s| !s.is_alive("n2") && s.is_alive("n1"),
    )
    .await;
    let n2_again = store.register(&node("n2"), ttl).await.unwrap();
    wait_until(&mut rx, WAIT, "n2 back", |s| s.is_alive("n2")).await;
    drop(n2_again);

    // The same data directory's token takes a registration over (its process is known dead:
    // the new one holds the directory's lock); another token is refused while the holder
    // lives; the taken-over registration, dropped, ends nothing.
    let short = Duration::from_secs(2);
    let first = store.register(&node_on("n3", "aa"), short).await.unwrap();
    let second = store.register(&node_on("n3", "aa"), short).await.unwrap();
    match store.register(&node_on("n3", "bb"), short).await {
        Err(ClusterError::DuplicateNode { node_id, detail }) => {
            assert_eq!(node_id, "n3");
            assert!(detail.contains("n3.example:50061"), "{detail}");
        }
        other => panic!("n3 of another data directory was not refused: {other:?}"),
    }
    drop(first);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let state = rx.borrow().clone();
    assert_eq!(state.nodes["n3"].incarnation, "aa", "{state:?}");
    drop(second);
    wait_until(&mut rx, WAIT, "n3 gone", |s| !s.is_alive("n3")).await;

    // Collections: created only if the name is free, in one piece.
    let docs = collection("docs", 1, &["n1", "n2", "n1"]);
    assert!(store.create_collection(&docs).await.unwrap());
    assert!(!store
        .create_collection(&collection("docs", 2, &["n2"]))
        .await
        .unwrap());
    let docs2 = collection("docs2", 3, &["n2", "n1"]);
    assert!(store.create_collection(&docs2).await.unwrap());
    let state = wait_until(&mut rx, WAIT, "docs and docs2 created", |s| {
        s.collections.contains_key("docs") && s.collections.contains_key("docs2")
    })
    .await;
    assert_eq!(
        state.collections["docs"], docs,
        "the first definition stays"
    );
    assert_eq!(state.collections["docs2"], docs2);

    // Dropping `docs` leaves `docs2` (whose shard keys share the prefix `shards/docs`) whole.
    assert!(store.drop_collection("docs").await.unwrap());
    assert!(!store.drop_collection("docs").await.unwrap());
    assert!(!store.drop_collection("never-created").await.unwrap());
    let state = wait_until(&mut rx, WAIT, "docs dropped", |s| {
        !s.collections.contains_key("docs")
    })
    .await;
    assert_eq!(state.collections.get("docs2"), Some(&docs2));

    // Shard moves: compare-and-set on the epoch.
    assert!(store
        .compare_and_set_shard(&swap("docs2", 3, 0, 1, &assignment("n1", 2)))
        .await
        .unwrap());
    assert!(
        !store
            .compare_and_set_shard(&swap("docs2", 3, 0, 1, &assignment("n3", 2)))
            .await
            .unwrap(),
        "a stale epoch must lose"
    );
    assert!(store
        .compare_and_set_shard(&swap("docs2", 3, 0, 2, &assignment("n2", 3)))
        .await
        .unwrap());
    assert!(!store
        .compare_and_set_shard(&swap("docs2", 3, 7, 1, &assignment("n1", 2)))
        .await
        .unwrap());
    assert!(!store
        .compare_and_set_shard(&swap("docs", 1, 0, 1, &assignment("n1", 2)))
        .await
        .unwrap());
    let state = wait_until(&mut rx, WAIT, "docs2 shard 0 moved", |s| {
        s.collections["docs2"].shards[0] == assignment("n2", 3)
    })
    .await;
    assert_eq!(state.collections["docs2"].shards[1], assignment("n1", 1));

    // A shard's failed moves: recorded, shown, cleared; gone with the collection.
    let failure = tarn_cluster::MoveFailure {
        to: "n3".into(),
        error: "cannot catch up".into(),
        failures: 2,
        at_unix_ms: 7,
    };
    store
        .record_move_failure("docs2", 1, Some(&failure))
        .await
        .unwrap();
    wait_until(&mut rx, WAIT, "a failed move shown", |s| {
        s.move_failures.get(&("docs2".to_owned(), 1)) == Some(&failure)
    })
    .await;
    store.record_move_failure("docs2", 1, None).await.unwrap();
    wait_until(&mut rx, WAIT, "a failed move cleared", |s| {
        s.move_failures.is_empty()
    })
    .await;
    store
        .record_move_failure("docs2", 0, Some(&failure))
        .await
        .unwrap();

    // Linearizable shard records: assigned, dropped (a tombstone), unknown.
    assert_eq!(
        store.read_shard("docs2", 3, 0).await.unwrap(),
        ShardRecord::Assigned(assignment("n2", 3))
    );
    assert_eq!(
        store.read_shard("docs", 1, 0).await.unwrap(),
        ShardRecord::Dropped
    );
    assert_eq!(
        store.read_shard("docs2", 99, 0).await.unwrap(),
        ShardRecord::Unknown
    );
    assert_eq!(
        store.read_shard("never-created", 5, 0).await.unwrap(),
        ShardRecord::Unknown
    );

    // A collection created again after a drop is the new one; a swap planned on the old one
    // (same name, same epoch) does not land on it.
    assert!(store.drop_collection("docs2").await.unwrap());
    wait_until(
        &mut rx,
        WAIT,
        "a dropped collection's failed moves gone",
        |s| s.move_failures.is_empty(),
    )
    .await;
    let docs2_again = collection("docs2", 4, &["n1"]);
    assert!(store.create_collection(&docs2_again).await.unwrap());
    wait_until(&mut rx, WAIT, "docs2 created again", |s| {
        s.collections.get("docs2") == Some(&docs2_again)
    })
    .await;
    assert!(
        !store
            .compare_and_set_shard(&swap("docs2", 3, 0, 1, &assignment("n3", 2)))
            .await
            .unwrap(),
        "a swap of the dropped incarnation landed on the new one"
    );
    assert_eq!(
        store.read_shard("docs2", 3, 0).await.unwrap(),
        ShardRecord::Dropped
    );
    assert_eq!(
        store.read_shard("docs2", 4, 0).await.unwrap(),
        ShardRecord::Assigned(assignment("n1", 1))
    );
    // Forget's swap: only while the node has no registration in etcd itself.
    let registered = store
        .register(&node("n7"), Duration::from_secs(10))
        .await
        .unwrap();
    let given_up = assignment("n1", 2);
    let forget = |epoch| ShardSwap {
        unless_registered: Some("n7"),
        ..swap("docs2", 4, 0, epoch, &given_up)
    };
    assert!(
        !store.compare_and_set_shard(&forget(1)).await.unwrap(),
        "forget landed while the node was registered"
    );
    drop(registered);
    let deadline = std::time::Instant::now() + WAIT;
    while !store.compare_and_set_shard(&forget(1)).await.unwrap() {
        assert!(std::time::Instant::now() < deadline, "forget never landed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Changes of a shard's copies keep the epoch and compare the whole record: of two changes
    // decided from the same record only the first lands.
    let base = store.read_shard("docs2", 4, 0).await.unwrap();
    let ShardRecord::Assigned(base) = base else {
        panic!("docs2 shard 0: {base:?}")
    };
    let with_n2 = base.with_replica("n2").unwrap();
    let guarded = |from: &ShardAssignment, to: &ShardAssignment| {
        let (from, to) = (from.clone(), to.clone());
        async move {
            store
                .compare_and_set_shard(&ShardSwap {
                    expected: Some(&from),
                    ..swap("docs2", 4, 0, from.epoch, &to)
                })
                .await
                .unwrap()
        }
    };
    assert!(guarded(&base, &with_n2).await);
    let with_n3 = base.with_replica("n3").unwrap();
    assert!(
        !guarded(&base, &with_n3).await,
        "a change decided from an older record (same epoch) landed"
    );
    let joined = with_n2.with_in_sync("n2", "dir-n2").unwrap();
    assert!(guarded(&with_n2, &joined).await);
    assert_eq!(
        store.read_shard("docs2", 4, 0).await.unwrap(),
        ShardRecord::Assigned(joined.clone())
    );
    // Failover: the in-sync replica is promoted only once the old primary (n1, registered
    // since the start) has no registration.
    assert_eq!(joined.owner, "n1");
    let promoted = joined.promoted("n2").unwrap();
    let promotion = ShardSwap {
        expected: Some(&joined),
        unless_registered: Some("n1"),
        ..swap("docs2", 4, 0, joined.epoch, &promoted)
    };
    let promote = || store.compare_and_set_shard(&promotion);
    assert!(
        !promote().await.unwrap(),
        "a promotion landed while the primary was registered"
    );
    drop(n1);
    wait_until(&mut rx, WAIT, "n1 gone", |s| s.nodes.is_empty()).await;
    let deadline = std::time::Instant::now() + WAIT;
    while !promote().await.unwrap() {
        assert!(
            std::time::Instant::now() < deadline,
            "the promotion never landed"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    wait_until(&mut rx, WAIT, "docs2 shard 0 promoted", |s| {
        s.collections["docs2"].shards[0] == promoted
    })
    .await;

    // Failover over a primary back on another data directory: the promotion's swap allows a
    // registration from another directory than the one recorded for the primary's copy, and
    // only that one.
    assert_eq!(promoted.incarnation_of("n2"), Some("dir-n2"));
    let rejoined = promoted.with_in_sync("n1", "dir-n1").unwrap();
    assert!(guarded(&promoted, &rejoined).await);
    let over = rejoined.promoted("n1").unwrap();
    let promotion = ShardSwap {
        expected: Some(&rejoined),
        unless_registered: Some("n2"),
        unless_registered_from: Some("dir-n2"),
        registered: None,
        ..swap("docs2", 4, 0, rejoined.epoch, &over)
    };
    let n2 = store
        .register(&node_on("n2", "dir-n2"), Duration::from_secs(10))
        .await
        .unwrap();
    assert!(
        !store.compare_and_set_shard(&promotion).await.unwrap(),
        "a promotion landed while the primary was registered from its own directory"
    );
    drop(n2);
    wait_until(&mut rx, WAIT, "n2 gone", |s| s.nodes.is_empty()).await;
    let _wiped = store
        .register(&node_on("n2", "dir-n2-wiped"), Duration::from_secs(10))
        .await
        .unwrap();
    wait_until(&mut rx, WAIT, "n2 back from another directory", |s| {
        s.nodes.contains_key("n2")
    })
    .await;
    let any_registration = ShardSwap {
        unless_registered_from: None,
        registered: None,
        ..promotion
    };
    assert!(
        !store
            .compare_and_set_shard(&any_registration)
            .await
            .unwrap(),
        "without the recorded directory, any registration must stop the promotion"
    );
    // The candidate must be registered, in the store itself, from its recorded directory.
    let guarded_candidate = ShardSwap {
        registered: Some(("n1", "dir-n1")),
        ..promotion
    };
    assert!(
        !store
            .compare_and_set_shard(&guarded_candidate)
            .await
            .unwrap(),
        "a promotion landed on a candidate with no registration"
    );
    let n1_wiped = store
        .register(&node_on("n1", "dir-n1-wiped"), Duration::from_secs(10))
        .await
        .unwrap();
    assert!(
        !store
            .compare_and_set_shard(&guarded_candidate)
            .await
            .unwrap(),
        "a promotion landed on a candidate back on another directory"
    );
    drop(n1_wiped);
    wait_until(&mut rx, WAIT, "n1 gone again", |s| {
        !s.nodes.contains_key("n1")
    })
    .await;
    let _n1 = store
        .register(&node_on("n1", "dir-n1"), Duration::from_secs(10))
        .await
        .unwrap();
    assert!(
        store
            .compare_and_set_shard(&guarded_candidate)
            .await
            .unwrap(),
        "the promotion over a primary back on another directory did not land"
    );
    assert_eq!(
        store.read_shard("docs2", 4, 0).await.unwrap(),
        ShardRecord::Assigned(over)
    );
    assert!(store.connected());
}

#[tokio::test]
async fn memory_store_semantics() {
    store_semantics(&MemoryStore::default()).await;
}

#[tokio::test]
async fn etcd_store_semantics() {
    let Some(etcd) = shared_etcd("etcd_store_semantics") else {
        return;
    };
    let store = connect(etcd, "semantics").await;
    store_semantics(&store).await;
}

// ---------------------------------------------------------------------------------------------
// What only etcd shows.

#[tokio::test]
async fn etcd_connect_names_the_endpoints_it_cannot_reach() {
    // Nothing listens on a port just freed.
    let (port, _) = free_ports();
    let endpoint = format!("http://127.0.0.1:{port}");
    match EtcdStore::connect(std::slice::from_ref(&endpoint), "/tarn/").await {
        Err(ClusterError::StoreUnavailable(message)) => {
            assert!(message.contains(&endpoint), "{message}");
        }
        other => panic!("connected to nothing: {other:?}"),
    }
    assert!(matches!(
        EtcdStore::connect(&[], "/tarn/").await,
        Err(ClusterError::StoreUnavailable(_))
    ));
}

/// A process that dies without revoking its lease: its membership lapses after the TTL, while
/// a live process's membership outlasts the TTL.
#[tokio::test]
async fn etcd_lease_lapses_when_the_process_dies() {
    let Some(etcd) = shared_etcd("etcd_lease_lapses_when_the_process_dies") else {
        return;
    };
    let test = "lapse";
    let store = connect(etcd, test).await;
    let mut rx = store.watch().await.unwrap();
    let ttl = Duration::from_secs(2);
    let live = store.register(&node("live"), ttl).await.unwrap();
    let registered_at = Instant::now();

    // The dying process.
    register_and_die(
        etcd.endpoint(),
        format!("/tarn-test/{test}"),
        node("dying"),
        ttl,
    );
    let died_at = Instant::now();
    wait_until(&mut rx, WAIT, "dying registered", |s| s.is_alive("dying")).await;
    wait_until(
        &mut rx,
        ttl + Duration::from_secs(3),
        "dying's lease lapsed",
        |s| !s.is_alive("dying"),
    )
    .await;
    let lapsed_after = died_at.elapsed();
    assert!(
        lapsed_after >= Duration::from_millis(500),
        "gone after {lapsed_after:?}: revoked, not lapsed"
    );

    // The live node's keep-alives carry it past twice its TTL.
    tokio::time::sleep(
        (2 * ttl).saturating_sub(registered_at.elapsed()) + Duration::from_millis(500),
    )
    .await;
    assert!(rx.borrow().is_alive("live"));
    assert!(store.connected());
    drop(live);
    wait_until(&mut rx, WAIT, "live gone", |s| !s.is_alive("live")).await;
}

/// A lease found expired (here revoked behind the node's back, as a long etcd outage would end
/// it) is replaced: the node registers again under a new lease.
#[tokio::test]
async fn etcd_registration_comes_back_after_its_lease_expires() {
    let Some(etcd) = shared_etcd("etcd_registration_comes_back_after_its_lease_expires") else {
        return;
    };
    let store = connect(etcd, "comeback").await;
    let mut rx = store.watch().await.unwrap();
    let _registration = store
        .register(&node("n1"), Duration::from_secs(2))
        .await
        .unwrap();
    let key = format!("{}nodes/n1", store.prefix());
    let raw = raw_client(etcd).await;
    let lease_of = |response: RangeResponse| response.kvs.first().map(|kv| kv.lease);
    let first = lease_of(raw.get(key.as_bytes(), false).await.unwrap()).unwrap();
    assert!(raw.time_to_live(first).await.unwrap().ttl > 0);
    raw.revoke(first).await.unwrap();
    assert_eq!(raw.time_to_live(first).await.unwrap().ttl, -1);
    poll_until(Duration::from_secs(5), "n1 under a new lease", || {
        let raw = raw.clone();
        let key = key.clone();
        async move {
            let lease = lease_of(raw.get(key.as_bytes(), false).await.unwrap());
            lease.is_some_and(|lease| lease != first)
        }
    })
    .await;
    wait_until(&mut rx, WAIT, "n1 alive", |s| s.is_alive("n1")).await;
}

/// etcd allows 128 operations per transaction: a 300-shard collection is written in several,
/// and shows only once whole.
#[tokio::test]
async fn etcd_collection_of_300_shards_spans_transactions() {
    let Some(etcd) = shared_etcd("etcd_collection_of_300_shards_spans_transactions") else {
        return;
    };
    let store = connect(etcd, "large").await;
    let mut rx = store.watch().await.unwrap();
    let owners: Vec<&str> = (0..300)
        .map(|i| if i % 2 == 0 { "n1" } else { "n2" })
        .collect();
    let big = collection("big", 9, &owners);
    let mut lopsided = collection("lopsided", 1, &["n1"]);
    lopsided.def.n_shards = 2;
    assert!(matches!(
        store.create_collection(&lopsided).await,
        Err(ClusterError::BadValue { .. })
    ));
    assert!(store.create_collection(&big).await.unwrap());
    assert!(!store.create_collection(&big).await.unwrap());
    let state = wait_until(&mut rx, WAIT, "big created", |s| {
        s.collections.contains_key("big")
    })
    .await;
    assert_eq!(state.collections["big"], big);
    assert!(store
        .compare_and_set_shard(&swap("big", 9, 299, 1, &assignment("n3", 2)))
        .await
        .unwrap());
    assert!(store.drop_collection("big").await.unwrap());
    wait_until(&mut rx, WAIT, "big dropped", |s| s.collections.is_empty()).await;
    let raw = raw_client(etcd).await;
    let left = raw
        .count_prefix(format!("{}shards/", store.prefix()).as_bytes())
        .await
        .unwrap();
    assert_eq!(left, 0);
}

/// A value tarn cannot read is an error where it is read on purpose and is skipped (logged) by
/// the watch, which goes on with everything else.
#[tokio::test]
async fn etcd_unreadable_values_are_reported_not_fatal() {
    let Some(etcd) = shared_etcd("etcd_unreadable_values_are_reported_not_fatal") else {
        return;
    };
    let store = connect(etcd, "garbage").await;
    let good = collection("good", 1, &["n1"]);
    assert!(store.create_collection(&good).await.unwrap());
    assert!(store
        .create_collection(&collection("bad", 2, &["n1"]))
        .await
        .unwrap());
    let raw = raw_client(etcd).await;
    let bad_key = format!("{}shards/bad/00000", store.prefix());
    raw.put(bad_key.as_bytes(), b"{not json", 0).await.unwrap();
    raw.put(
        format!("{}nodes/n9", store.prefix()).as_bytes(),
        b"garbage",
        0,
    )
    .await
    .unwrap();
    match store
        .compare_and_set_shard(&swap("bad", 2, 0, 1, &assignment("n2", 2)))
        .await
    {
        Err(ClusterError::BadValue { key, .. }) => assert_eq!(key, bad_key),
        other => panic!("garbage was read: {other:?}"),
    }
    let mut rx = store.watch().await.unwrap();
    let state = wait_until(&mut rx, WAIT, "good visible", |s| {
        s.collections.contains_key("good")
    })
    .await;
    // Unreadable, not absent: nodes must not act on its shards as if it were gone.
    assert!(!state.collections.contains_key("bad"));
    assert!(
        state.unreadable["bad"].contains(&bad_key),
        "{:?}",
        state.unreadable
    );
    assert!(matches!(
        store.read_shard("bad", 2, 0).await,
        Err(ClusterError::BadValue { .. })
    ));
    assert!(!state.is_alive("n9"));
    // Repaired, it shows.
    raw.put(
        bad_key.as_bytes(),
        &serde_json::to_vec(&assignment("n1", 1)).unwrap(),
        0,
    )
    .await
    .unwrap();
    wait_until(&mut rx, WAIT, "bad repaired", |s| {
        s.collections.contains_key("bad") && s.unreadable.is_empty()
    })
    .await;
}

/// The cluster's identity: created once (the first of racing creators wins, every one gets the
/// winner's id), and whether the store already held a cluster without one.
async fn identity_semantics(store: &impl ClusterStore) {
    let id = |s: &str| ClusterIdentity {
        cluster_id: s.to_owned(),
        node_secret: format!("secret-of-{s}"),
    };
    let fresh = store.identity().await.unwrap();
    assert_eq!(fresh.identity, None);
    assert!(!fresh.holds_state);
    let (first, second) = (id("aaaa"), id("bbbb"));
    let (a, b) = tokio::join!(
        store.create_identity(&first),
        store.create_identity(&second)
    );
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_eq!(a, b, "two creators got different ids");
    assert!(a == id("aaaa") || a == id("bbbb"));
    assert_eq!(store.create_identity(&id("cccc")).await.unwrap(), a);
    let after = store.identity().await.unwrap();
    assert_eq!(after.identity, Some(a));
    assert!(
        !after.holds_state,
        "the identity alone is not cluster state"
    );
    assert!(store
        .create_collection(&collection("c", 1, &["n1"]))
        .await
        .unwrap());
    assert!(store.identity().await.unwrap().holds_state);
}

#[tokio::test]
async fn memory_identity_semantics() {
    identity_semantics(&MemoryStore::default()).await;
}

#[tokio::test]
async fn etcd_identity_semantics() {
    let Some(etcd) = shared_etcd("etcd_identity_semantics") else {
        return;
    };
    identity_semantics(&connect(etcd, "identity").await).await;
}

/// etcd stops and comes back on the same ports and data: meanwhile the last state stays
/// readable, calls fail with StoreUnavailable and `connected()` is false; afterwards it is true
/// again, the membership is still there and later changes are seen.
#[tokio::test]
async fn etcd_watch_survives_an_etcd_restart() {
    let test = "etcd_watch_survives_an_etcd_restart";
    let binary = match etcd_binary() {
        Ok(binary) => binary,
        Err(why) => return skip(test, why),
    };
    let dir = std::env::temp_dir().join(format!("tarn-etcd-restart-{}", std::process::id()));
    let (client_port, peer_port) = free_ports();
    let mut etcd = Etcd::start(binary, &dir, client_port, peer_port, false);
    let store = connect(&etcd, "restart").await;
    let mut rx = store.watch().await.unwrap();
    let _registration = store
        .register(&node("n1"), Duration::from_secs(10))
        .await
        .unwrap();
    let before = collection("before", 1, &["n1", "n1"]);
    assert!(store.create_collection(&before).await.unwrap());
    wait_until(&mut rx, WAIT, "before created", |s| {
        s.collections.contains_key("before") && s.is_alive("n1")
    })
    .await;
    assert!(store.connected());

    etcd.stop();
    poll_until(WAIT, "connected() false while etcd is down", || async {
        !store.connected()
    })
    .await;
    assert!(rx.borrow().collections.contains_key("before"));
    assert!(rx.borrow().is_alive("n1"));
    let started = Instant::now();
    match store
        .create_collection(&collection("during", 2, &["n1"]))
        .await
    {
        Err(ClusterError::StoreUnavailable(message)) => {
            assert!(message.contains(&etcd.endpoint()), "{message}");
        }
        other => panic!("created while etcd is down: {other:?}"),
    }
    assert!(started.elapsed() < Duration::from_secs(6));

    let restarted = Etcd::start(binary, &etcd.dir, etcd.client_port, etcd.peer_port, true);
    drop(etcd);
    poll_until(
        Duration::from_secs(15),
        "connected() true again",
        || async { store.connected() },
    )
    .await;
    let after = collection("after", 3, &["n1"]);
    assert!(store.create_collection(&after).await.unwrap());
    let state = wait_until(&mut rx, WAIT, "after seen", |s| {
        s.collections.contains_key("after")
    })
    .await;
    assert_eq!(state.collections["before"], before);
    assert!(!state.collections.contains_key("during"));
    assert!(state.is_alive("n1"));
    drop(restarted);
}

/// Two contenders for one election: one leader at a time; the second wins when the first drops
/// its leadership, a third when the second resigns.
#[tokio::test]
async fn etcd_campaign_elects_one_leader_at_a_time() {
    let Some(etcd) = shared_etcd("etcd_campaign_elects_one_leader_at_a_time") else {
        return;
    };
    let a = Arc::new(connect(etcd, "election").await);
    let b = Arc::new(connect(etcd, "election").await);
    let first = a.campaign("placement", "a").await.unwrap();
    assert!(first.is_leader());
    assert_eq!(first.election(), "placement");

    let contender = Arc::clone(&b);
    let mut second = tokio::spawn(async move { contender.campaign("placement", "b").await });
    assert!(
        tokio::time::timeout(Duration::from_millis(700), &mut second)
            .await
            .is_err(),
        "two leaders at once"
    );
    let name = format!("{}elections/placement", a.prefix());
    let raw = raw_client(etcd).await;
    let leader = raw.leader(name.as_bytes()).await.unwrap();
    assert_eq!(leader.kv.unwrap().value, b"a");

    drop(first);
    let second = tokio::time::timeout(Duration::from_secs(5), second)
        .await
        .expect("b was not elected after a dropped its leadership")
        .unwrap()
        .unwrap();
    assert!(second.is_leader());
    let leader = raw.leader(name.as_bytes()).await.unwrap();
    assert_eq!(leader.kv.unwrap().value, b"b");

    let contender = Arc::clone(&a);
    let mut third = tokio::spawn(async move { contender.campaign("placement", "c").await });
    assert!(tokio::time::timeout(Duration::from_millis(300), &mut third)
        .await
        .is_err());
    second.resign().await;
    let third = tokio::time::timeout(Duration::from_secs(5), third)
        .await
        .expect("c was not elected after b resigned")
        .unwrap()
        .unwrap();
    assert!(third.is_leader());
}

/// A node killed with kill -9 and started again at once on the same data directory takes its
/// old registration over (its lease revoked) without waiting for the lease; a node of another
/// data directory waits for the dead holder's lease to lapse, then registers.
#[tokio::test]
async fn etcd_a_restarted_node_takes_its_own_registration_back() {
    let test = "etcd_a_restarted_node_takes_its_own_registration_back";
    let Some(etcd) = shared_etcd(test) else {
        return;
    };
    let prefix = "/tarn-test/phoenix/";
    let store = EtcdStore::connect(&[etcd.endpoint()], prefix)
        .await
        .unwrap();
    let raw = raw_client(etcd).await;
    let ttl = Duration::from_secs(5);

    let dead = register_and_die(etcd.endpoint(), prefix.into(), node_on("n1", "aa"), ttl);
    let started = Instant::now();
    let _back = store.register(&node_on("n1", "aa"), ttl).await.unwrap();
    let took = started.elapsed();
    assert!(
        took < Duration::from_secs(2),
        "waited {took:?} for its own lease"
    );
    assert_eq!(
        raw.time_to_live(dead).await.unwrap().ttl,
        -1,
        "old lease not revoked"
    );
    let key = format!("{prefix}nodes/n1");
    let now = raw.get(key.as_bytes(), false).await.unwrap();
    assert_ne!(now.kvs[0].lease, dead);

    let dead = register_and_die(etcd.endpoint(), prefix.into(), node_on("n2", "aa"), ttl);
    let started = Instant::now();
    let _other = store.register(&node_on("n2", "bb"), ttl).await.unwrap();
    let took = started.elapsed();
    assert!(
        took >= Duration::from_secs(3) && took < ttl + Duration::from_secs(4),
        "registered after {took:?}: not once the dead holder's lease lapsed"
    );
    assert_eq!(raw.time_to_live(dead).await.unwrap().ttl, -1);
}
