//! Shared by the integration tests: the real `tarn` binary on ephemeral ports, and request
//! builders.
#![allow(dead_code)] // each test binary uses its own subset

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};

use tarn_proto::v1 as pb;
use tarn_proto::v1::tarn_client::TarnClient;
use tonic::transport::Channel;
use tonic::Code;

pub struct Server {
    pub child: Child,
    pub addr: String,
    pub metrics_addr: String,
    /// The server's stderr (its logs at RUST_LOG=warn), deleted with the server.
    pub log: tempfile::NamedTempFile,
}

impl Server {
    pub fn start(dir: &Path, extra: &[&str]) -> Server {
        Server::start_with_env(dir, extra, &[])
    }

    pub fn start_with_env(dir: &Path, extra: &[&str], env: &[(&str, &str)]) -> Server {
        Server::try_start(dir, extra, env)
            .unwrap_or_else(|log| panic!("server did not start: {log}"))
    }

    /// Starts the server; if it exits before announcing both addresses, returns its stderr.
    pub fn try_start(dir: &Path, extra: &[&str], env: &[(&str, &str)]) -> Result<Server, String> {
        let log = tempfile::NamedTempFile::new().unwrap();
        // An ephemeral TCP port unless `extra` names the gRPC address itself.
        let listen: &[&str] = if extra.contains(&"--listen") {
            &[]
        } else {
            &["--listen", "127.0.0.1:0"]
        };
        let mut child = Command::new(env!("CARGO_BIN_EXE_tarn"))
            .arg("serve")
            .args(listen)
            .args(["--metrics-listen", "127.0.0.1:0", "--data-dir"])
            .arg(dir)
            .args(extra)
            .env("RUST_LOG", "warn")
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log.reopen().unwrap()))
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let (mut addr, mut metrics_addr) = (String::new(), String::new());
        while addr.is_empty() || metrics_addr.is_empty() {
            let Some(Ok(line)) = lines.next() else {
                let _ = child.wait();
                return Err(std::fs::read_to_string(log.path()).unwrap_or_default());
            };
            if let Some(a) = line.strip_prefix("tarn: gRPC listening on ") {
                let a = a.split_whitespace().next().unwrap();
                addr = if a.starts_with("unix:") {
                    a.to_owned()
                } else {
                    format!("http://{a}")
                };
            } else if let Some(a) = line.strip_prefix("tarn: metrics listening on ") {
                metrics_addr = a.to_owned();
            }
        }
        std::thread::spawn(move || for _ in lines {});
        Ok(Server {
            child,
            addr,
            metrics_addr,
            log,
        })
    }

    /// What the server has logged so far.
    pub fn logs(&self) -> String {
        std::fs::read_to_string(self.log.path()).unwrap_or_default()
    }

    pub async fn client(&self) -> TarnClient<Channel> {
        TarnClient::connect(self.addr.clone()).await.unwrap()
    }

    /// SIGKILL: the process dies at once, whatever it was doing.
    pub fn kill(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }

    /// SIGTERM, then the exit status.
    pub fn terminate(mut self) -> std::process::ExitStatus {
        sigterm(self.child.id());
        self.child.wait().unwrap()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Sends SIGTERM (no outside `kill` program needed).
pub fn sigterm(pid: u32) {
    let pid = rustix::process::Pid::from_raw(pid as i32).unwrap();
    rustix::process::kill_process(pid, rustix::process::Signal::TERM).unwrap();
}

pub fn id(v: u128) -> pb::Id {
    pb::Id {
        high: (v >> 64) as u64,
        low: v as u64,
    }
}

pub fn create(name: &str, dimension: u32, metric: pb::Metric) -> pb::CreateCollectionRequest {
    pb::CreateCollectionRequest {
        name: name.into(),
        dimension,
        metric: metric as i32,
        hnsw: None,
        default_durability: 0,
        ..Default::default()
    }
}

pub fn insert(
    collection: &str,
    docs: &[u128],
    users: &[u128],
    vectors: Vec<f32>,
) -> pb::InsertRequest {
    pb::InsertRequest {
        collection: collection.into(),
        doc_ids: docs.iter().map(|d| id(*d)).collect(),
        user_ids: users.iter().map(|u| id(*u)).collect(),
        vectors,
        durability: 0,
        attributes: Vec::new(),
    }
}

pub fn search(collection: &str, users: &[u128], vector: Vec<f32>, top_k: u32) -> pb::SearchRequest {
    pb::SearchRequest {
        collection: collection.into(),
        user_ids: users.iter().map(|u| id(*u)).collect(),
        vector,
        top_k,
        ef: 0,
        exact: false,
        min_seq_no: 0,
        ..Default::default()
    }
}

pub fn code<T: std::fmt::Debug>(result: Result<T, tonic::Status>) -> Code {
    result.map(|_| ()).unwrap_err().code()
}

pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// The `CollectionInfo` of `name` (panics if the call fails).
pub async fn collection_info(client: &mut TarnClient<Channel>, name: &str) -> pb::CollectionInfo {
    client
        .get_collection(pb::GetCollectionRequest { name: name.into() })
        .await
        .unwrap()
        .into_inner()
        .collection
        .unwrap()
}

/// Flips one bit in the middle of every file in `dir` whose extension is `ext`.
pub fn damage_files(dir: &Path, ext: &str) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == ext) {
            let mut bytes = std::fs::read(&path).unwrap();
            let mid = bytes.len() / 2;
            bytes[mid] ^= 1;
            std::fs::write(&path, &bytes).unwrap();
        }
    }
}

/// Runs `tarn <args> --addr <addr>`; asserts it succeeds and returns its standard output.
pub fn run_cli(addr: &str, args: &[&str]) -> String {
    let output = Command::new(env!("CARGO_BIN_EXE_tarn"))
        .args(args)
        .args(["--addr", addr])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "{args:?}: {stdout} {}",
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

/// CreateCollection's answer, the new collection's info (panics on an error: for tests).
pub async fn created(
    client: &mut TarnClient<Channel>,
    request: pb::CreateCollectionRequest,
) -> pb::CollectionInfo {
    client
        .create_collection(request)
        .await
        .unwrap()
        .into_inner()
        .collection
        .unwrap()
}
