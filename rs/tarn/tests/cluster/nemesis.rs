//! The nemesis: three real nodes on a real etcd, each reaching etcd through its own cuttable
//! proxy and reached by the other nodes through a proxy that knows which node opened each
//! connection (so that the link between two nodes can be cut both ways while both still see
//! etcd). Writers (inserts, removes, re-inserts) and readers (searches that record what they
//! saw, and read-your-writes checks with read tokens through another node) run while a seeded
//! RNG applies faults TWO AT A TIME, overlapping, then heals them:
//!
//! - kill -9 (and restart), SIGSTOP (and SIGCONT), a graceful restart;
//! - a node's etcd link cut; the links between two nodes cut;
//! - a node's data directory wiped (kill -9, `rm -rf`, started again on the empty disk when
//!   healed);
//! - `ForgetNode` of a killed node (healed by a replacement: the same id on an empty disk);
//! - a drain (and its cancel);
//! - etcd stopped (SIGTERM: a single-member etcd 3.4 killed with SIGKILL may lose writes it
//!   acknowledged, etcd-io/etcd#14370, and the nodes then fence themselves, as they must) and a
//!   copy of its data taken as a backup now and then;
//! - etcd restored from a backup taken earlier in the run (healed as docs/CLUSTER.md says: the
//!   newer data put back, every node restarted);
//! - a node's fsync slowed by 50-300 ms while it runs, then back to its pace (its
//!   `FAILPOINTS_FILE`, read by the running process);
//! - per run, chosen by the seed: one node with a slow fsync (`wal::fdatasync` sleeps) and one
//!   whose reconciliation acts on its view late (`cluster::reconcile` pauses);
//!   `--replace-dead-after 5` on every node.
//!
//! A destructive fault (a wipe, a forget) is only the first of a pair, started while every
//! shard has all its copies in sync: otherwise it would destroy the only copy of acknowledged
//! writes, which no database survives.
//!
//! After healing and settling it checks, and prints one line `nemesis seed=... result=ok|FAILED`
//! with the counts: every acknowledged write present exactly once with its vector (`lost`, a
//! removed document back: `back`, the document count), how many reads returned a write that was
//! never acknowledged and is absent at the end (`dirty_reads`: a read sees committed entries
//! only, docs/CLUSTER.md, "What a read sees"), every read with a token saw its write
//! (`token_misses`), every shard's copies identical (documents, and the WAL entries and the
//! epoch of every sequence number both logs hold: `divergent`), errors only of the retryable
//! codes (`odd_errors`), and the longest stretch each shard refused writes
//! (`max_unavailable_s`). `scripts/nemesis.sh` runs many seeds and sums the lines.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use super::*;

const DIM: usize = 8;
const SHARDS: u32 = 6;
const LEASE: u64 = 3;
/// Tenants of the writers' documents (`doc % TENANTS`).
const TENANTS: u128 = 7;

/// The run's knobs, from the environment.
struct Plan {
    seed: u64,
    seconds: u64,
    copies: u32,
    writers: usize,
}

impl Plan {
    fn from_env() -> Plan {
        let var = |name: &str, default: u64| -> u64 {
            std::env::var(name)
                .ok()
                .and_then(|s| s.parse().ok())
                .unwrap_or(default)
        };
        let seed = var("TARN_NEMESIS_SEED", 20261127);
        Plan {
            seed,
            seconds: var("TARN_NEMESIS_SECONDS", 60),
            // 2 or 3 copies by the seed's parity unless asked.
            copies: var("TARN_NEMESIS_COPIES", 2 + seed % 2) as u32,
            writers: var("TARN_NEMESIS_WRITERS", 16) as usize,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Node-to-node links.

/// A proxied connection: the pid that opened it, the node it goes to, one of its sockets.
type Proxied = (Option<u32>, usize, TcpStream);

/// Each node is reached by the others through its own proxy, which finds out which node opened
/// each connection (the process owning the connecting socket, from `/proc`) and swallows the
/// bytes of the links the test cuts, both ways, as a partition between two nodes would (new
/// connections over a cut link are accepted and left hanging). Restoring a link closes its
/// connections, so that the nodes reconnect.
struct PeerLinks {
    /// The pid of each node's running process.
    pids: Arc<Mutex<Vec<Option<u32>>>>,
    /// Cut links, as (from, to) node indexes, both orders.
    cut: Arc<Mutex<BTreeSet<(usize, usize)>>>,
    /// Every proxied connection: (the pid that opened it, the node it goes to, its sockets).
    open: Arc<Mutex<Vec<Proxied>>>,
    /// The proxy port of each node (what it advertises).
    ports: Vec<u16>,
}

/// The pid, among `pids`, of the process owning the socket connected from `peer_port` to
/// `proxy_port` on 127.0.0.1.
fn socket_owner(peer_port: u16, proxy_port: u16, pids: &[u32]) -> Option<u32> {
    let table = std::fs::read_to_string("/proc/net/tcp").ok()?;
    let port_of = |field: &str| {
        field
            .rsplit_once(':')
            .and_then(|(_, p)| u16::from_str_radix(p, 16).ok())
    };
    let inode = table.lines().skip(1).find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        (fields.len() > 9
            && port_of(fields[1]) == Some(peer_port)
            && port_of(fields[2]) == Some(proxy_port))
        .then(|| fields[9].to_owned())
    })?;
    let wanted = format!("socket:[{inode}]");
    pids.iter().copied().find(|pid| {
        std::fs::read_dir(format!("/proc/{pid}/fd")).is_ok_and(|fds| {
            fds.flatten().any(|fd| {
                std::fs::read_link(fd.path()).is_ok_and(|target| target.to_string_lossy() == wanted)
            })
        })
    })
}

impl PeerLinks {
    fn start(node_ports: &[u16]) -> PeerLinks {
        let pids = Arc::new(Mutex::new(vec![None; node_ports.len()]));
        let cut = Arc::new(Mutex::new(BTreeSet::new()));
        let open = Arc::new(Mutex::new(Vec::new()));
        let mut ports = Vec::new();
        for (to, &target) in node_ports.iter().enumerate() {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            let port = listener.local_addr().unwrap().port();
            ports.push(port);
            let (pids, cut, open) = (pids.clone(), cut.clone(), open.clone());
            std::thread::spawn(move || {
                for client in listener.incoming() {
                    let Ok(client) = client else { continue };
                    let (pids, cut, open) = (pids.clone(), cut.clone(), open.clone());
                    std::thread::spawn(move || {
                        PeerLinks::serve(client, port, target, to, pids, cut, open)
                    });
                }
            });
        }
        PeerLinks {
            pids,
            cut,
            open,
            ports,
        }
    }

    /// One proxied connection to node `to` (at `target`).
    #[allow(clippy::too_many_arguments)]
    fn serve(
        client: TcpStream,
        port: u16,
        target: u16,
        to: usize,
        pids: Arc<Mutex<Vec<Option<u32>>>>,
        cut: Arc<Mutex<BTreeSet<(usize, usize)>>>,
        open: Arc<Mutex<Vec<Proxied>>>,
    ) {
        let peer_port = client.peer_addr().map(|a| a.port()).unwrap_or(0);
        // A node's pid is recorded once its start returns: a connection it opens before that
        // is found on a later try.
        let mut from_pid = None;
        for _ in 0..40 {
            let known: Vec<u32> = pids.lock().unwrap().iter().flatten().copied().collect();
            from_pid = socket_owner(peer_port, port, &known);
            if from_pid.is_some() {
                break;
            }
            std::thread::sleep(Duration::from_millis(25));
        }
        let node_of = move |pids: &Mutex<Vec<Option<u32>>>| {
            let pid = from_pid?;
            pids.lock().unwrap().iter().position(|p| *p == Some(pid))
        };
        let is_cut = {
            let (pids, cut) = (pids.clone(), cut.clone());
            move || node_of(&pids).is_some_and(|from| cut.lock().unwrap().contains(&(from, to)))
        };
        open.lock()
            .unwrap()
            .push((from_pid, to, client.try_clone().unwrap()));
        if is_cut() {
            return; // accepted, never answered (closed when the link is restored)
        }
        let Ok(server) = TcpStream::connect(("127.0.0.1", target)) else {
            // The node is down: its connection is refused, as it would be without the proxy
            // (left open, it would hang its opener like a stopped node).
            let _ = client.shutdown(std::net::Shutdown::Both);
            return;
        };
        open.lock()
            .unwrap()
            .push((from_pid, to, server.try_clone().unwrap()));
        pump_both_ways(client, server, is_cut);
    }

    fn set_pid(&self, node: usize, pid: Option<u32>) {
        self.pids.lock().unwrap()[node] = pid;
    }

    fn cut(&self, a: usize, b: usize) {
        let mut cut = self.cut.lock().unwrap();
        cut.insert((a, b));
        cut.insert((b, a));
    }

    /// Restores the link between `a` and `b` and closes its connections.
    fn restore(&self, a: usize, b: usize) {
        {
            let mut cut = self.cut.lock().unwrap();
            cut.remove(&(a, b));
            cut.remove(&(b, a));
        }
        let pids = self.pids.lock().unwrap().clone();
        let node_of = |pid: Option<u32>| pid.and_then(|p| pids.iter().position(|q| *q == Some(p)));
        self.open.lock().unwrap().retain(|(pid, to, stream)| {
            let link = [node_of(*pid), Some(*to)];
            let on_link = link.contains(&Some(a)) && link.contains(&Some(b)) && a != b;
            // Connections whose opener is gone or unknown are closed too: harmless.
            if on_link || node_of(*pid).is_none() {
                let _ = stream.shutdown(std::net::Shutdown::Both);
                return false;
            }
            true
        });
    }
}

// ---------------------------------------------------------------------------------------------
// The cluster under test.

struct Cluster {
    nodes: Vec<Node>,
    etcd: Etcd,
    etcd_links: Vec<CuttableProxy>,
    peers: PeerLinks,
    /// Each node's fail points (`FAILPOINTS`).
    env: Vec<String>,
    extra: Vec<String>,
    dir: tempfile::TempDir,
    /// A copy of etcd's data taken while it was stopped, if one was.
    backup: Option<PathBuf>,
    /// Whether the next stop of etcd replaces the backup (the seed decides).
    new_backup: bool,
    /// The nodes' `RUST_LOG` (`TARN_NEMESIS_RUST_LOG`; warnings and reconciliation's decisions
    /// otherwise).
    rust_log: Option<String>,
}

impl Cluster {
    fn start(binary: PathBuf, plan: &Plan, rng: &mut rand::rngs::StdRng) -> Cluster {
        let dir = tempfile::tempdir().unwrap();
        let etcd = Etcd::start(binary, &dir.path().join("etcd"));
        let etcd_links = (0..3)
            .map(|_| CuttableProxy::start(etcd.client_port))
            .collect();
        let mut nodes: Vec<Node> = (1..=3)
            .map(|i| Node::new(dir.path(), &format!("n{i}"), LEASE))
            .collect();
        let peers = PeerLinks::start(&nodes.iter().map(|n| n.port).collect::<Vec<_>>());
        for (node, port) in nodes.iter_mut().zip(&peers.ports) {
            node.advertise = Some(format!("127.0.0.1:{port}"));
        }
        // One node with a slow disk, one whose reconciliation acts late (or the same one).
        let mut env = vec![String::new(); 3];
        let slow = rng.random_range(0..3usize);
        let sleepy = rng.random_range(0..3usize);
        let fsync_ms = rng.random_range(5..40u32);
        let reconcile_ms = rng.random_range(200..1500u32);
        env[slow] = format!("wal::fdatasync=sleep({fsync_ms})");
        let join = if env[sleepy].is_empty() { "" } else { ";" };
        env[sleepy] += &format!("{join}cluster::reconcile=return({reconcile_ms})");
        let extra = if plan.copies > 1 {
            vec!["--replace-dead-after".to_owned(), "5".to_owned()]
        } else {
            Vec::new()
        };
        let mut cluster = Cluster {
            nodes,
            etcd,
            etcd_links,
            peers,
            env,
            extra,
            dir,
            backup: None,
            new_backup: false,
            rust_log: std::env::var("TARN_NEMESIS_RUST_LOG").ok(),
        };
        for i in 0..3 {
            cluster.start_node(i).unwrap();
        }
        eprintln!(
            "nemesis: n{} fsync +{fsync_ms} ms, n{} reconcile +{reconcile_ms} ms",
            slow + 1,
            sleepy + 1
        );
        cluster
    }

    fn addrs(&self) -> Vec<String> {
        self.nodes.iter().map(|n| n.addr()).collect()
    }

    fn is_running(&self, i: usize) -> bool {
        self.nodes[i].server.is_some()
    }

    /// Starts node `i` (its fail points, its etcd link); its log if it exits instead.
    fn start_node(&mut self, i: usize) -> Result<(), String> {
        let endpoint = self.etcd_links[i].endpoint();
        let extra: Vec<&str> = self.extra.iter().map(String::as_str).collect();
        let mut env: Vec<(&str, &str)> = if self.env[i].is_empty() {
            Vec::new()
        } else {
            vec![("FAILPOINTS", self.env[i].as_str())]
        };
        // More of the nodes' logs when chasing a failure (`TARN_NEMESIS_RUST_LOG`, e.g.
        // `warn,tarn_dataplane=debug`); by default warnings and what reconciliation decides
        // about each local copy (a copy found where the record lists none is explained by it).
        let filter = self
            .rust_log
            .as_deref()
            .unwrap_or("warn,tarn_dataplane::reconcile=info");
        env.push(("RUST_LOG", filter));
        // etcd just restarted by a heal may accept connections a while before it answers: a
        // node that gave up on its first contact is started again (at most 3 times).
        let mut started = self.nodes[i].try_start(&endpoint, &extra, &env);
        for _ in 0..3 {
            match &started {
                Err(log) if log.contains("first contact") => {
                    std::thread::sleep(Duration::from_secs(1));
                    started = self.nodes[i].try_start(&endpoint, &extra, &env);
                }
                _ => break,
            }
        }
        let pid = self.nodes[i].server.as_ref().map(|s| s.child.id());
        self.peers.set_pid(i, pid);
        started
    }

    /// Node `i`'s file of fail points changed while it runs (`FAILPOINTS_FILE`).
    fn fail_points_file(&self, i: usize) -> PathBuf {
        self.nodes[i].fail_points_file()
    }

    /// Sets node `i`'s fsync fail point to `actions` while it runs (and for its later
    /// processes: a slow disk stays slow across restarts).
    fn set_fsync(&self, i: usize, actions: &str) {
        std::fs::write(
            self.fail_points_file(i),
            format!("wal::fdatasync={actions}"),
        )
        .unwrap();
    }

    fn kill(&mut self, i: usize) {
        self.nodes[i].kill();
        self.peers.set_pid(i, None);
    }

    /// Starts every node that is not running; what refused to start.
    fn start_all(&mut self) -> Vec<String> {
        let mut refused = Vec::new();
        for i in 0..3 {
            // A node whose etcd link is cut could not start: it is started when the link heals.
            if !self.is_running(i) && !self.etcd_links[i].is_cut() {
                if let Err(log) = self.start_node(i) {
                    refused.push(format!("n{}: {}", i + 1, last_lines(&log, 5)));
                }
            }
        }
        refused
    }
}

/// The last `n` lines of a log.
fn last_lines(log: &str, n: usize) -> String {
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(n)..].join(" | ")
}

// ---------------------------------------------------------------------------------------------
// Faults.

#[derive(Debug, Clone, Copy, PartialEq)]
enum Fault {
    Kill(usize),
    Stop(usize),
    Restart(usize),
    CutEtcd(usize),
    CutLink(usize, usize),
    Wipe(usize),
    Forget(usize),
    Drain(usize),
    /// The node's fsync slowed by this many milliseconds while it runs (`FAILPOINTS_FILE`).
    SlowDisk(usize, u32),
    EtcdStop,
    EtcdRestore,
}

impl Fault {
    fn destructive(self) -> bool {
        matches!(self, Fault::Wipe(_) | Fault::Forget(_))
    }

    fn on_etcd(self) -> bool {
        matches!(self, Fault::EtcdStop | Fault::EtcdRestore)
    }

    /// The node whose process the fault stops or replaces (two of those never share a node).
    fn process(self) -> Option<usize> {
        match self {
            Fault::Kill(i) | Fault::Stop(i) | Fault::Restart(i) | Fault::Wipe(i) => Some(i),
            Fault::Forget(i) => Some(i),
            _ => None,
        }
    }

    fn name(self) -> String {
        match self {
            Fault::Kill(i) => format!("kill -9 n{}", i + 1),
            Fault::Stop(i) => format!("SIGSTOP n{}", i + 1),
            Fault::Restart(i) => format!("restart n{}", i + 1),
            Fault::CutEtcd(i) => format!("cut n{}-etcd", i + 1),
            Fault::CutLink(a, b) => format!("cut n{}-n{}", a + 1, b + 1),
            Fault::Wipe(i) => format!("wipe n{}", i + 1),
            Fault::Forget(i) => format!("forget n{}", i + 1),
            Fault::Drain(i) => format!("drain n{}", i + 1),
            Fault::SlowDisk(i, ms) => format!("fsync of n{} +{ms} ms", i + 1),
            Fault::EtcdStop => "etcd stopped".to_owned(),
            Fault::EtcdRestore => "etcd restored from a backup".to_owned(),
        }
    }

    /// Kind names, for the tally of faults run.
    fn kind(self) -> &'static str {
        match self {
            Fault::Kill(_) => "kill",
            Fault::Stop(_) => "stop",
            Fault::Restart(_) => "restart",
            Fault::CutEtcd(_) => "cut-etcd",
            Fault::CutLink(..) => "cut-link",
            Fault::Wipe(_) => "wipe",
            Fault::Forget(_) => "forget",
            Fault::Drain(_) => "drain",
            Fault::SlowDisk(..) => "slow-disk",
            Fault::EtcdStop => "etcd-stop",
            Fault::EtcdRestore => "etcd-restore",
        }
    }
}

/// A fault the seed picks; destructive ones only when `destructive` (the first of a pair, with
/// every copy in sync), etcd ones only when `etcd`.
fn pick(rng: &mut rand::rngs::StdRng, destructive: bool, etcd: bool, backup: bool) -> Fault {
    loop {
        let i = rng.random_range(0..3usize);
        let fault = match rng.random_range(0..13u32) {
            0 | 1 => Fault::Kill(i),
            2 | 3 => Fault::Stop(i),
            4 => Fault::Restart(i),
            5 => Fault::CutEtcd(i),
            6 | 7 => Fault::CutLink(i, (i + rng.random_range(1..3usize)) % 3),
            8 => Fault::Wipe(i),
            9 => Fault::Forget(i),
            10 => Fault::Drain(i),
            11 => Fault::SlowDisk(i, rng.random_range(50..300u32)),
            _ if rng.random_bool(0.5) => Fault::EtcdStop,
            _ => Fault::EtcdRestore,
        };
        if (fault.destructive() && !destructive)
            || (fault.on_etcd() && !etcd)
            || (fault == Fault::EtcdRestore && !backup)
        {
            continue;
        }
        return fault;
    }
}

/// What the run did and saw, for the result line.
#[derive(Default)]
struct Tally {
    faults: Vec<String>,
    kinds: BTreeMap<&'static str, u32>,
    /// Nodes that refused to start when a fault was healed (printed, and a failure unless an
    /// etcd restore explains it).
    refused: Vec<String>,
    forgets: Vec<String>,
}

impl Cluster {
    /// Applies `fault`; returns false if it could not be (a forget whose node never went).
    fn apply(&mut self, fault: Fault, rt: &tokio::runtime::Runtime, tally: &mut Tally) -> bool {
        use rustix::process::Signal;
        match fault {
            Fault::Kill(i) => self.kill(i),
            Fault::Stop(i) => {
                if self.is_running(i) {
                    self.nodes[i].signal(Signal::STOP);
                }
            }
            Fault::Restart(i) => {
                // Graceful: SIGTERM and wait (a node whose peer is stopped closes its
                // connections after the shutdown grace); started again when healed.
                if let Some(server) = self.nodes[i].server.take() {
                    server.terminate();
                }
                self.peers.set_pid(i, None);
            }
            Fault::CutEtcd(i) => self.etcd_links[i].cut(),
            Fault::CutLink(a, b) => self.peers.cut(a, b),
            Fault::Wipe(i) => {
                // Started again on the empty disk when healed.
                self.kill(i);
                std::fs::remove_dir_all(&self.nodes[i].dir).unwrap();
            }
            Fault::Forget(i) => {
                self.kill(i);
                let id = self.nodes[i].id.clone();
                let others = [(i + 1) % 3, (i + 2) % 3].map(|j| self.nodes[j].addr());
                let report = rt.block_on(async {
                    // Forget refuses a node that is still alive: wait for its lease to lapse.
                    for attempt in 0..40 {
                        let other = others[attempt % 2].clone();
                        if let Some(client) = quick_client(other).await {
                            if let Ok(report) = client.forget_node_report(&id, true).await {
                                return Some(report);
                            }
                        }
                        tokio::time::sleep(Duration::from_millis(500)).await;
                    }
                    None
                });
                match report {
                    Some(r) => tally.forgets.push(format!(
                        "forget n{}: given_up {} kept {} set_aside {}",
                        i + 1,
                        r.given_up.len(),
                        r.kept.len(),
                        r.set_aside.len()
                    )),
                    None => {
                        // Not forgotten: bring it back as it was.
                        let _ = self.start_node(i);
                        return false;
                    }
                }
            }
            Fault::Drain(i) => {
                let id = self.nodes[i].id.clone();
                let others = [(i + 1) % 3, (i + 2) % 3].map(|j| self.nodes[j].addr());
                rt.block_on(async {
                    for other in others {
                        if let Some(client) = quick_client(other).await {
                            if client.drain_node(&id, false).await.is_ok() {
                                return;
                            }
                        }
                    }
                });
            }
            Fault::SlowDisk(i, ms) => self.set_fsync(i, &format!("sleep({ms})")),
            Fault::EtcdStop => {
                self.etcd.terminate();
                if self.backup.is_none() || self.new_backup {
                    let backup = self.dir.path().join("etcd-backup");
                    copy_etcd_data(&self.etcd.dir, &backup);
                    self.backup = Some(backup);
                }
            }
            Fault::EtcdRestore => {
                self.etcd.terminate();
                let newer = self.dir.path().join("etcd-newer");
                let _ = std::fs::remove_dir_all(&newer);
                std::fs::rename(&self.etcd.dir, &newer).unwrap();
                copy_etcd_data(self.backup.as_ref().unwrap(), &self.etcd.dir);
                self.etcd.restart();
            }
        }
        true
    }

    /// Undoes `fault`.
    fn heal(&mut self, fault: Fault, rt: &tokio::runtime::Runtime, tally: &mut Tally) {
        use rustix::process::Signal;
        match fault {
            Fault::Kill(i) | Fault::Restart(i) | Fault::Wipe(i) => {
                if !self.is_running(i) {
                    if let Err(log) = self.start_node(i) {
                        tally
                            .refused
                            .push(format!("n{}: {}", i + 1, last_lines(&log, 5)));
                    }
                }
            }
            Fault::Stop(i) => {
                if self.is_running(i) {
                    self.nodes[i].signal(Signal::CONT);
                }
            }
            Fault::CutEtcd(i) => {
                self.etcd_links[i].restore();
                // A node (re)started while its etcd link was cut gave up on its first contact
                // (as it must): started again now, as a supervisor would.
                if !self.is_running(i) {
                    if let Err(log) = self.start_node(i) {
                        tally
                            .refused
                            .push(format!("n{}: {}", i + 1, last_lines(&log, 5)));
                    }
                }
            }
            Fault::CutLink(a, b) => self.peers.restore(a, b),
            Fault::Forget(i) => {
                // A replacement machine: the same id on an empty disk.
                self.kill(i);
                let _ = std::fs::remove_dir_all(&self.nodes[i].dir);
                if let Err(log) = self.start_node(i) {
                    tally
                        .refused
                        .push(format!("n{}: {}", i + 1, last_lines(&log, 5)));
                }
            }
            Fault::Drain(i) => {
                let id = self.nodes[i].id.clone();
                let addrs = self.addrs();
                rt.block_on(async {
                    for addr in addrs {
                        if let Some(client) = quick_client(addr).await {
                            if client.drain_node(&id, true).await.is_ok() {
                                return;
                            }
                        }
                    }
                });
            }
            Fault::SlowDisk(i, _) => {
                // Back to the node's own pace: the run's slow disk stays slow.
                let base = self.env[i]
                    .split(';')
                    .find_map(|e| e.strip_prefix("wal::fdatasync="))
                    .unwrap_or("off")
                    .to_owned();
                self.set_fsync(i, &base);
            }
            Fault::EtcdStop => self.etcd.restart(),
            Fault::EtcdRestore => {
                // docs/CLUSTER.md: the newer data put back, every node restarted normally.
                self.etcd.terminate();
                std::fs::remove_dir_all(&self.etcd.dir).unwrap();
                std::fs::rename(self.dir.path().join("etcd-newer"), &self.etcd.dir).unwrap();
                self.etcd.restart();
                for i in 0..3 {
                    self.kill(i);
                }
                tally.refused.extend(self.start_all());
            }
        }
    }

    /// Whether the cluster is [`Cluster::all_in_sync`] within `limit` (asked every 500 ms).
    fn all_in_sync_within(
        &self,
        rt: &tokio::runtime::Runtime,
        copies: u32,
        limit: Duration,
    ) -> bool {
        let started = Instant::now();
        loop {
            if self.all_in_sync(rt, copies) {
                return true;
            }
            if started.elapsed() > limit {
                return false;
            }
            std::thread::sleep(Duration::from_millis(500));
        }
    }

    /// Whether every node is alive and not draining, and every shard serving with all its
    /// copies in sync (asked of each node in turn until one answers).
    fn all_in_sync(&self, rt: &tokio::runtime::Runtime, copies: u32) -> bool {
        rt.block_on(async {
            for addr in self.addrs() {
                let Some(client) = quick_client(addr).await else {
                    continue;
                };
                let Ok(status) = client.cluster_status().await else {
                    continue;
                };
                return settled(&status, copies);
            }
            false
        })
    }
}

/// A client of `addr` whose calls give up after 5 s; `None` if it does not connect within 3 s
/// (a stopped node accepts connections and never answers).
async fn quick_client(addr: String) -> Option<Client> {
    let connect = Client::builder(addr)
        .timeout(Duration::from_secs(5))
        .connect();
    tokio::time::timeout(Duration::from_secs(3), connect)
        .await
        .ok()?
        .ok()
}

/// Every node alive and not draining, and every shard serving with exactly its `copies` copies
/// listed, all in sync.
fn settled(status: &tarn_client::ClusterStatus, copies: u32) -> bool {
    status
        .nodes
        .iter()
        .filter(|n| n.alive && !n.draining)
        .count()
        == 3
        && !status.shards.is_empty()
        && status.shards.iter().all(|s| {
            // Every listed copy in sync: no copy being added (a rebalancing move adds one
            // first, then drops another).
            s.state == "serving"
                && s.moving_to.is_empty()
                && s.in_sync.len() == copies as usize
                && s.replicas.len() + 1 == copies as usize
        })
}

// ---------------------------------------------------------------------------------------------
// Clients.

/// A document's history as the writers know it.
#[derive(Debug, Clone, Default)]
struct History {
    /// Its last acknowledged state, or uncertain after a write that failed (then never
    /// written again: a failed write may still land later).
    state: Option<Doc>,
    /// Some insert of it was acknowledged.
    ever_acked: bool,
}

/// What the clients share.
#[derive(Default)]
struct Shared {
    docs: Mutex<BTreeMap<u128, History>>,
    /// Documents some read returned.
    seen: Mutex<BTreeSet<u128>>,
    failures: Mutex<Vec<String>>,
    token_misses: Mutex<Vec<String>>,
    acked: AtomicU64,
    token_checks: AtomicU64,
    /// Per shard: since when writes to it fail (none while they succeed), and the longest
    /// such stretch ended by a success.
    refusing: Mutex<BTreeMap<u32, (Option<Instant>, Duration)>>,
}

impl Shared {
    fn outcome(&self, doc: u128, ok: bool) {
        let shard = tarn_cluster::shard_for(doc, SHARDS);
        let mut refusing = self.refusing.lock().unwrap();
        let (since, longest) = refusing.entry(shard).or_default();
        if ok {
            if let Some(since) = since.take() {
                *longest = (*longest).max(since.elapsed());
            }
        } else if since.is_none() {
            *since = Some(Instant::now());
        }
    }
}

/// The tenant of a writer's document.
fn tenant(doc: u128) -> u128 {
    doc % TENANTS
}

/// Writer `w`: inserts of new documents, removes and re-inserts of its own documents whose
/// state is certain; after one acknowledged insert in three, a search with its read token
/// through `reader` (another node) must find it.
async fn writer(
    w: u128,
    seed: u64,
    client: Client,
    reader: Client,
    shared: Arc<Shared>,
    stop: Arc<AtomicBool>,
) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ (w as u64).wrapping_mul(0x9e37));
    let mut certain: Vec<u128> = Vec::new();
    let mut k = 0u128;
    while !stop.load(Relaxed) {
        let roll = rng.random_range(0..10u32);
        let doc = if roll < 6 || certain.is_empty() {
            k += 1;
            w * 10_000_000 + k
        } else {
            certain[rng.random_range(0..certain.len())]
        };
        let live = matches!(
            shared
                .docs
                .lock()
                .unwrap()
                .get(&doc)
                .and_then(|h| h.state.clone()),
            Some(Doc::Live(_))
        );
        let remove = (6..8).contains(&roll) && live;
        let (outcome, state, token) = if remove {
            let result = client
                .remove(
                    Remove::new("moving", vec![doc])
                        .users(vec![tenant(doc)])
                        .timeout(Duration::from_secs(10)),
                )
                .await;
            (
                result
                    .err()
                    .map(|e| format!("{:?}: {}", e.code(), e.message())),
                Doc::Removed,
                None,
            )
        } else {
            let v = vectors(&mut rng, 1, DIM);
            let result = client
                .insert(
                    Insert::new("moving", vec![doc], v.clone())
                        .users(vec![tenant(doc)])
                        .timeout(Duration::from_secs(10)),
                )
                .await;
            match result {
                Ok(ack) => (None, Doc::Live(v), Some(ack.read_token())),
                Err(e) => (
                    Some(format!("{:?}: {}", e.code(), e.message())),
                    Doc::Live(v),
                    None,
                ),
            }
        };
        shared.outcome(doc, outcome.is_none());
        match outcome {
            None => {
                shared.acked.fetch_add(1, Relaxed);
                let mut docs = shared.docs.lock().unwrap();
                let history = docs.entry(doc).or_default();
                history.ever_acked |= matches!(state, Doc::Live(_));
                history.state = Some(state.clone());
                drop(docs);
                if !certain.contains(&doc) {
                    certain.push(doc);
                }
            }
            Some(error) => {
                shared.failures.lock().unwrap().push(error);
                shared.docs.lock().unwrap().entry(doc).or_default().state = Some(Doc::Uncertain);
                certain.retain(|d| *d != doc);
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        }
        let (Some(token), Doc::Live(v)) = (token, state) else {
            continue;
        };
        if rng.random_range(0..3u32) != 0 {
            continue;
        }
        shared.token_checks.fetch_add(1, Relaxed);
        let search = Search::new("moving", v)
            .users(vec![tenant(doc)])
            .top_k(1)
            .exact(true)
            .after(token)
            .timeout(Duration::from_secs(10));
        match reader.search(search).await {
            Ok(hits) => {
                shared
                    .seen
                    .lock()
                    .unwrap()
                    .extend(hits.iter().map(|h| h.doc_id));
                if !hits.iter().any(|h| h.doc_id == doc) {
                    shared.token_misses.lock().unwrap().push(format!(
                        "doc {doc}: the token's search answered {:?}",
                        hits.iter().map(|h| h.doc_id).collect::<Vec<_>>()
                    ));
                }
            }
            Err(error) => shared.failures.lock().unwrap().push(format!(
                "{:?}: {}",
                error.code(),
                error.message()
            )),
        }
    }
}

/// Searches of random tenants through `client` until `stop`, recording what they return.
async fn searcher(client: Client, seed: u64, shared: Arc<Shared>, stop: Arc<AtomicBool>) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    while !stop.load(Relaxed) {
        let search = Search::new("moving", vectors(&mut rng, 1, DIM))
            .users(vec![rng.random_range(0..TENANTS)])
            .top_k(10)
            .timeout(Duration::from_secs(10));
        match client.search(search).await {
            Ok(hits) => shared
                .seen
                .lock()
                .unwrap()
                .extend(hits.iter().map(|h| h.doc_id)),
            Err(error) => {
                shared.failures.lock().unwrap().push(format!(
                    "{:?}: {}",
                    error.code(),
                    error.message()
                ));
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Copies compared entry by entry.

/// The epoch of `seq` in an epoch history; `None` before its first start.
fn epoch_at(starts: &[(u64, u64)], seq: u64) -> Option<u64> {
    starts
        .iter()
        .take_while(|(_, first)| *first <= seq)
        .last()
        .map(|(epoch, _)| *epoch)
}

/// One shard copy read from a stopped node's data directory.
struct CopyOnDisk {
    node: String,
    docs: Vec<(u128, u128)>,
    last_seq: u64,
    starts: Vec<(u64, u64)>,
    /// The WAL entries it still holds, by sequence number.
    entries: BTreeMap<u64, Arc<[u8]>>,
}

fn read_copy(node: &str, dir: &Path) -> CopyOnDisk {
    let copy = tarn_collection::Collection::open_whole(dir).unwrap();
    let mut docs: Vec<(u128, u128)> = copy
        .export_documents()
        .map(|d| d.map(|(u, d, _)| (u, d)).unwrap())
        .collect();
    docs.sort_unstable();
    let last_seq = copy.last_seq_no();
    let starts = copy.epoch_starts().unwrap();
    // The first entry the WAL still holds: `wal_tail_from` answers for it and every later one.
    let (mut lo, mut hi) = (1, last_seq + 1);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if copy.wal_tail_from(mid).is_some() {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    let mut entries = BTreeMap::new();
    if lo <= last_seq {
        let mut tail = copy.wal_tail_from(lo).unwrap();
        loop {
            let batch = tail.read(last_seq, 1 << 20).unwrap();
            if batch.is_empty() {
                break;
            }
            entries.extend(batch);
        }
    }
    copy.close();
    CopyOnDisk {
        node: node.to_owned(),
        docs,
        last_seq,
        starts,
        entries,
    }
}

/// Whether every node's data directory holds exactly the copies of `moving` that `status`'s
/// record gives it (as primary or replica).
fn copies_match_record(nodes: &[Node], status: &tarn_client::ClusterStatus) -> bool {
    nodes.iter().all(|node| {
        let held: BTreeSet<u32> = std::fs::read_dir(node.dir.join("collections"))
            .map(|entries| {
                entries
                    .flatten()
                    .filter_map(|e| {
                        let name = e.file_name().to_string_lossy().into_owned();
                        match tarn_cluster::ShardName::parse(&name) {
                            Some((shard, None)) if shard.collection == "moving" => {
                                Some(shard.shard)
                            }
                            _ => None,
                        }
                    })
                    .collect()
            })
            .unwrap_or_default();
        let listed: BTreeSet<u32> = status
            .shards
            .iter()
            .filter(|s| {
                s.collection == "moving" && (s.node_id == node.id || s.replicas.contains(&node.id))
            })
            .map(|s| s.shard)
            .collect();
        held == listed
    })
}

/// Every shard's copies across the stopped nodes compared: the same documents, the same last
/// sequence number, the same epoch at every sequence number both histories know, the same bytes
/// at every sequence number both logs hold. The differences found, one line each.
pub(crate) fn compare_copies(
    nodes: &[Node],
    shards: u32,
    copies: u32,
    on_disk: &mut BTreeMap<u128, Vec<String>>,
) -> Vec<String> {
    let mut by_shard: BTreeMap<u32, Vec<CopyOnDisk>> = BTreeMap::new();
    for node in nodes {
        let Ok(entries) = std::fs::read_dir(node.dir.join("collections")) else {
            continue;
        };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some((shard, None)) = tarn_cluster::ShardName::parse(&name) else {
                continue;
            };
            if shard.collection == "moving" {
                let copy = read_copy(&node.id, &entry.path());
                for &(_, doc) in &copy.docs {
                    on_disk
                        .entry(doc)
                        .or_default()
                        .push(format!("{}:{}", node.id, shard.shard));
                }
                by_shard.entry(shard.shard).or_default().push(copy);
            }
        }
    }
    let mut differences = Vec::new();
    for shard in 0..shards {
        let held = by_shard.remove(&shard).unwrap_or_default();
        if held.len() != copies as usize {
            differences.push(format!(
                "shard {shard}: {} copies on disk ({:?}), not {copies}",
                held.len(),
                held.iter().map(|c| &c.node).collect::<Vec<_>>()
            ));
        }
        let before = differences.len();
        for pair in held.windows(2) {
            let (a, b) = (&pair[0], &pair[1]);
            let what = format!("shard {shard} on {} and {}", a.node, b.node);
            if a.docs != b.docs {
                differences.push(format!(
                    "{what}: documents differ ({} and {})",
                    a.docs.len(),
                    b.docs.len()
                ));
            }
            if a.last_seq != b.last_seq {
                differences.push(format!(
                    "{what}: logs end at {} and {}",
                    a.last_seq, b.last_seq
                ));
            }
            let last = a.last_seq.min(b.last_seq);
            if let Some(seq) = (1..=last).find(|seq| {
                let (x, y) = (epoch_at(&a.starts, *seq), epoch_at(&b.starts, *seq));
                x.is_some() && y.is_some() && x != y
            }) {
                differences.push(format!(
                    "{what}: entry {seq} written at epoch {:?} and {:?} ({:?} / {:?})",
                    epoch_at(&a.starts, seq),
                    epoch_at(&b.starts, seq),
                    a.starts,
                    b.starts
                ));
            }
            if let Some((seq, _)) = a
                .entries
                .iter()
                .find(|(seq, bytes)| b.entries.get(seq).is_some_and(|other| other != *bytes))
            {
                differences.push(format!("{what}: entry {seq} differs"));
            }
        }
        if differences.len() > before {
            for copy in &held {
                differences.push(format!(
                    "shard {shard} on {}: log ends at {}, epochs {:?}, entries {:?}",
                    copy.node,
                    copy.last_seq,
                    copy.starts,
                    copy.entries.keys().next().zip(copy.entries.keys().last())
                ));
            }
        }
    }
    differences
}

// ---------------------------------------------------------------------------------------------
// The run.

/// The nemesis (module docs). `TARN_NEMESIS_SEED`, `TARN_NEMESIS_SECONDS` (60),
/// `TARN_NEMESIS_COPIES` (2 or 3 by the seed), `TARN_NEMESIS_WRITERS` (16).
#[test]
#[ignore = "run by scripts/nemesis.sh (about 2 minutes a seed); in CI once 50 seeds pass"]
fn processes_nemesis_two_faults_at_a_time() {
    let Some(binary) = etcd_binary() else {
        return;
    };
    let plan = Plan::from_env();
    let mut rng = rand::rngs::StdRng::seed_from_u64(plan.seed);
    eprintln!(
        "nemesis: seed {}, {} s, {} copies, {} writers",
        plan.seed, plan.seconds, plan.copies, plan.writers
    );
    let mut cluster = Cluster::start(binary, &plan, &mut rng);
    let rt = runtime();
    let shared = Arc::new(Shared::default());
    let stop = Arc::new(AtomicBool::new(false));
    let tasks = rt.block_on(async {
        let clients = connect_all(&cluster.addrs()).await;
        // min_in_sync 1 with 2 copies, 2 with 3 (writes refused while only one is in sync).
        create_moving(&clients[0], DIM, SHARDS, plan.copies, plan.copies - 1).await;
        let mut tasks = Vec::new();
        for w in 0..plan.writers {
            tasks.push(tokio::spawn(writer(
                1 + w as u128,
                plan.seed,
                clients[w % 3].clone(),
                clients[(w + 1) % 3].clone(),
                shared.clone(),
                stop.clone(),
            )));
        }
        for (i, client) in clients.iter().enumerate() {
            tasks.push(tokio::spawn(searcher(
                client.clone(),
                plan.seed + i as u64,
                shared.clone(),
                stop.clone(),
            )));
        }
        tasks
    });
    let mut tally = Tally::default();
    let started = Instant::now();
    let pause = |rng: &mut rand::rngs::StdRng, lo: u64, hi: u64| {
        std::thread::sleep(Duration::from_millis(rng.random_range(lo..hi)));
    };
    while started.elapsed() < Duration::from_secs(plan.seconds) {
        pause(&mut rng, 500, 2_500);
        // A destructive fault only first, with every copy in sync.
        let destructive = plan.copies > 1
            && rng.random_bool(0.3)
            && cluster.all_in_sync_within(&rt, plan.copies, Duration::from_secs(20));
        cluster.new_backup = rng.random_bool(0.5);
        let first = pick(&mut rng, destructive, true, cluster.backup.is_some());
        let second = loop {
            let f = pick(&mut rng, false, !first.on_etcd(), cluster.backup.is_some());
            let clash = matches!((first.process(), f.process()), (Some(a), Some(b)) if a == b);
            if !clash && f != first {
                break f;
            }
        };
        let at = started.elapsed().as_secs_f64();
        let mut applied = Vec::new();
        for fault in [first, second] {
            if cluster.apply(fault, &rt, &mut tally) {
                applied.push(fault);
                *tally.kinds.entry(fault.kind()).or_default() += 1;
            }
            pause(&mut rng, 0, 2_000);
        }
        tally.faults.push(format!(
            "{at:.1}s {}",
            applied
                .iter()
                .map(|f| f.name())
                .collect::<Vec<_>>()
                .join(" + ")
        ));
        pause(&mut rng, 1_000, 6_000);
        // etcd first, then the links, then the rest in a seeded order: a node starts only once
        // it reaches etcd (it registers before it serves), and one started while etcd holds
        // an older backup refuses to start.
        let rank = |f: &Fault| match f {
            Fault::EtcdStop | Fault::EtcdRestore => 0,
            Fault::CutEtcd(_) | Fault::CutLink(..) => 1,
            _ => 2,
        };
        applied.sort_by_key(rank);
        if applied.len() == 2 && rank(&applied[0]) == rank(&applied[1]) && rng.random_bool(0.5) {
            applied.swap(0, 1);
        }
        for fault in applied {
            cluster.heal(fault, &rt, &mut tally);
            pause(&mut rng, 0, 1_500);
        }
    }
    eprintln!("nemesis: {} pairs of faults:", tally.faults.len());
    for fault in &tally.faults {
        eprintln!("  {fault}");
    }
    for forget in &tally.forgets {
        eprintln!("  {forget}");
    }
    // Everything healed: every node running, no drain, and the cluster settles.
    tally.refused.extend(cluster.start_all());
    let settle_started = Instant::now();
    let settled_in = rt.block_on(async {
        let client = Client::connect(cluster.nodes[0].addr()).await.unwrap();
        for node in &cluster.nodes {
            let _ = client.drain_node(&node.id, true).await;
        }
        loop {
            if let Ok(status) = client.cluster_status().await {
                if settled(&status, plan.copies) {
                    return Ok(settle_started.elapsed());
                }
                if settle_started.elapsed() > Duration::from_secs(120) {
                    return Err(format!("{status:#?}"));
                }
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    });
    if let Err(status) = &settled_in {
        eprintln!("nemesis: the cluster did not settle within 120 s: {status}");
    }
    std::thread::sleep(Duration::from_secs(2));
    stop.store(true, Relaxed);
    rt.block_on(async {
        for task in tasks {
            task.await.unwrap();
        }
    });
    let end = Instant::now();
    // The reads: every acknowledged document once, with its vector; none removed back.
    let reader = cluster.nodes[(plan.seed % 3) as usize].addr();
    let docs = shared.docs.lock().unwrap().clone();
    let (lost, back, count_problem, present) = rt.block_on(read_back(&reader, &docs));
    let seen = shared.seen.lock().unwrap().clone();
    let dirty: Vec<u128> = seen
        .iter()
        .filter(|d| !present.contains(d) && !docs.get(d).is_some_and(|h| h.ever_acked))
        .copied()
        .collect();
    // The copies, entry by entry, once every copy is in sync again (a replica may have left
    // the in-sync set during the last writes, and catches up) and every node is stopped.
    if settled_in.is_ok() && !cluster.all_in_sync_within(&rt, plan.copies, Duration::from_secs(60))
    {
        eprintln!("nemesis: the copies were not all in sync again within 60 s of the last write");
    }
    // A copy the record stopped listing leaves its node's data directory a moment later (at
    // once, or at reconciliation's next try 5 s later when the copy was busy): the comparison
    // waits for every node to hold exactly the copies the record gives it.
    let retired = Instant::now();
    while rt
        .block_on(async {
            let client = quick_client(cluster.nodes[0].addr()).await?;
            let status = client.cluster_status().await.ok()?;
            copies_match_record(&cluster.nodes, &status).then_some(())
        })
        .is_none()
    {
        if retired.elapsed() > Duration::from_secs(30) {
            eprintln!("nemesis: the copies on disk were not the record's within 30 s");
            break;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    std::thread::sleep(Duration::from_secs(1));
    let logs: Vec<String> = cluster
        .nodes
        .iter()
        .map(|n| n.server.as_ref().map(|s| s.logs()).unwrap_or_default())
        .collect();
    if let Some(status) = rt.block_on(async {
        quick_client(cluster.nodes[0].addr())
            .await?
            .cluster_status()
            .await
            .ok()
    }) {
        for shard in &status.shards {
            eprintln!(
                "nemesis: shard {} primary {} epoch {} in sync {:?} lag {:?}",
                shard.shard,
                shard.node_id,
                shard.epoch,
                shard.in_sync,
                shard
                    .replication_lag
                    .iter()
                    .map(|l| format!("{l:?}"))
                    .collect::<Vec<_>>()
            );
        }
    }
    for i in 0..3 {
        cluster.kill(i);
    }
    let mut on_disk = BTreeMap::new();
    let divergent = compare_copies(&cluster.nodes, SHARDS, plan.copies, &mut on_disk);
    // A document the final reads missed: lost, or held invisible on the copy that answered?
    let lost: Vec<String> = lost
        .into_iter()
        .map(|line| {
            let doc = line
                .split_whitespace()
                .find_map(|w| w.parse::<u128>().ok())
                .unwrap_or(0);
            match on_disk.get(&doc) {
                Some(copies) => format!("{line} (on disk in copies {copies:?})"),
                None => format!("{line} (in no copy on disk)"),
            }
        })
        .collect();
    let failures = shared.failures.lock().unwrap().clone();
    let allowed = ["Unavailable:", "DeadlineExceeded:", "Aborted:"];
    let odd: BTreeSet<&String> = failures
        .iter()
        .filter(|f| !allowed.iter().any(|a| f.starts_with(a)))
        .collect();
    let token_misses = shared.token_misses.lock().unwrap().clone();
    let refusing = shared.refusing.lock().unwrap().clone();
    let longest: BTreeMap<u32, f64> = refusing
        .iter()
        .map(|(shard, (since, longest))| {
            let open = since.map_or(Duration::ZERO, |s| end.saturating_duration_since(s));
            (*shard, longest.max(&open).as_secs_f64())
        })
        .collect();
    let max_unavailable = longest.values().copied().fold(0.0, f64::max);
    let restore_seen = tally.kinds.contains_key("etcd-restore");
    // A node refusing to start is a failure unless an etcd restore was in progress then (it
    // is started again, with the newer data back, by the restore's heal and the final start).
    let stuck: Vec<&String> = tally
        .refused
        .iter()
        .filter(|r| !(restore_seen && r.contains("went back in time")))
        .collect();
    let ok = lost.is_empty()
        && back.is_empty()
        && count_problem.is_none()
        && dirty.is_empty()
        && token_misses.is_empty()
        && divergent.is_empty()
        && odd.is_empty()
        && settled_in.is_ok()
        && stuck.is_empty();
    for line in lost.iter().chain(&back).take(20) {
        eprintln!("  {line}");
    }
    for line in token_misses.iter().chain(&divergent).take(20) {
        eprintln!("  {line}");
    }
    for line in odd.iter().take(20) {
        eprintln!("  odd error: {line}");
    }
    for line in &stuck {
        eprintln!("  refused to start: {line}");
    }
    if let Some(problem) = &count_problem {
        eprintln!("  {problem}");
    }
    if !dirty.is_empty() {
        eprintln!(
            "  dirty reads (writes never acknowledged, seen, then cut; docs/CLUSTER.md, \
             \"What a read sees\"): {dirty:?}"
        );
    }
    eprintln!("nemesis: longest refusal per shard (s): {longest:?}");
    let kinds: Vec<String> = tally
        .kinds
        .iter()
        .map(|(k, n)| format!("{k}:{n}"))
        .collect();
    eprintln!(
        "nemesis seed={} copies={} pairs={} acked={} token_checks={} lost={} back={} \
         duplicates={} dirty_reads={} token_misses={} divergent={} odd_errors={} stuck={} \
         settled={} max_unavailable_s={:.1} faults={} result={}",
        plan.seed,
        plan.copies,
        tally.faults.len(),
        shared.acked.load(Relaxed),
        shared.token_checks.load(Relaxed),
        lost.len(),
        back.len(),
        u8::from(count_problem.is_some()),
        dirty.len(),
        token_misses.len(),
        divergent.len(),
        odd.len(),
        stuck.len(),
        settled_in
            .as_ref()
            .map_or("no".to_owned(), |d| format!("{:.1}s", d.as_secs_f64())),
        max_unavailable,
        kinds.join(","),
        if ok { "ok" } else { "FAILED" }
    );
    if let (false, Ok(dir)) = (ok, std::env::var("TARN_NEMESIS_LOG_DIR")) {
        // Each node's whole log (of its last process), for the failure's investigation.
        for (node, log) in cluster.nodes.iter().zip(&logs) {
            let path = Path::new(&dir).join(format!("seed-{}-{}.log", plan.seed, node.id));
            let _ = std::fs::write(&path, without_colours(log));
            eprintln!("nemesis: {}'s log is in {}", node.id, path.display());
        }
    }
    if !ok {
        // What each node logged last (fail point pauses left out).
        for (node, log) in cluster.nodes.iter().zip(&logs) {
            let lines: Vec<String> = without_colours(log)
                .lines()
                .filter(|l| !l.contains("pausing at a fail point"))
                .map(|l| l.chars().take(400).collect())
                .collect();
            eprintln!("nemesis: the last lines of {}'s log:", node.id);
            for line in &lines[lines.len().saturating_sub(40)..] {
                eprintln!("    {line}");
            }
        }
    }
    assert!(ok, "the nemesis found a problem (seed {})", plan.seed);
}

/// Gets every document the writers touched, through `addr`, by tenant in batches: the
/// acknowledged live ones missing or with another vector (`lost`), the acknowledged removed ones
/// present (`back`), whether the collection's count is outside [live, live + uncertain] (a
/// duplicate), and every document present.
/// Gets every listed document of each tenant through `client` into `present`.
async fn read_into(
    client: &Client,
    by_tenant: &HashMap<u128, Vec<u128>>,
    present: &mut BTreeMap<u128, Vec<f32>>,
) {
    for (&user, ids) in by_tenant {
        for chunk in ids.chunks(500) {
            let got = loop {
                match client.get("moving", user, chunk).await {
                    Ok(got) => break got,
                    Err(error) => {
                        eprintln!("nemesis: a Get failed ({error}); again");
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                }
            };
            present.extend(got.into_iter().map(|d| (d.doc_id, d.vector)));
        }
    }
}

async fn read_back(
    addr: &str,
    docs: &BTreeMap<u128, History>,
) -> (Vec<String>, Vec<String>, Option<String>, BTreeSet<u128>) {
    let client = Client::connect(addr.to_owned()).await.unwrap();
    let mut by_tenant: HashMap<u128, Vec<u128>> = HashMap::new();
    for doc in docs.keys() {
        by_tenant.entry(tenant(*doc)).or_default().push(*doc);
    }
    let mut present: BTreeMap<u128, Vec<f32>> = BTreeMap::new();
    read_into(&client, &by_tenant, &mut present).await;
    // A copy makes an entry visible once it learns it is committed (a commit notice after the
    // last write): a token-less read may be a moment behind. Acknowledged documents missing,
    // with an older vector, or still there after their acknowledged removal are read again for
    // up to 10 s; what is still wrong then is lost (or back).
    let started = Instant::now();
    loop {
        let mut missing: HashMap<u128, Vec<u128>> = HashMap::new();
        for (doc, history) in docs {
            let stale = match &history.state {
                Some(Doc::Live(v)) => present.get(doc) != Some(v),
                Some(Doc::Removed) => present.contains_key(doc),
                _ => false,
            };
            if stale {
                missing.entry(tenant(*doc)).or_default().push(*doc);
            }
        }
        if missing.is_empty() {
            break;
        }
        if started.elapsed() > Duration::from_secs(10) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        let n_missing: usize = missing.values().map(Vec::len).sum();
        for doc in missing.values().flatten() {
            present.remove(doc);
        }
        read_into(&client, &missing, &mut present).await;
        let now_right = missing
            .values()
            .flatten()
            .filter(|doc| match &docs[doc].state {
                Some(Doc::Live(v)) => present.get(doc) == Some(v),
                _ => !present.contains_key(doc),
            })
            .count();
        if now_right > 0 {
            eprintln!(
                "nemesis: {now_right} of {n_missing} acknowledged documents missing, older or \
                 removed became right {:.1} s after the first read",
                started.elapsed().as_secs_f64()
            );
        }
    }
    let (mut lost, mut back) = (Vec::new(), Vec::new());
    let (mut live, mut uncertain) = (0u64, 0u64);
    for (doc, history) in docs {
        match &history.state {
            Some(Doc::Live(v)) => {
                live += 1;
                match present.get(doc) {
                    None => lost.push(format!("acknowledged document {doc} is missing")),
                    Some(got) if got != v => {
                        lost.push(format!("document {doc} has another vector"))
                    }
                    Some(_) => {}
                }
            }
            Some(Doc::Removed) if present.contains_key(doc) => {
                back.push(format!("removed document {doc} is back"))
            }
            Some(Doc::Uncertain) => uncertain += 1,
            _ => {}
        }
    }
    let n = client.collection_info("moving").await.unwrap().n_documents;
    let count_problem = (!(live..=live + uncertain).contains(&n)).then(|| {
        format!("{n} documents counted over the shards; {live} acknowledged live, {uncertain} uncertain")
    });
    (lost, back, count_problem, present.into_keys().collect())
}
