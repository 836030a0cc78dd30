//! `tarn serve`: lock the data directory, open the collections, serve gRPC (with health,
//! reflection and compression) and metrics, and shut down gracefully on SIGTERM/SIGINT.

use std::fs::{File, TryLockError};
use std::io::Write as _;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use tarn_proto::v1::tarn_server::TarnServer;
use tokio::sync::Semaphore;
use tonic::codec::CompressionEncoding;
use tonic::transport::{Identity, Server, ServerTlsConfig};

use crate::auth::ApiKeys;
use crate::config::ServeConfig;
use crate::metrics::{self, Metrics};
use crate::service::TarnService;
use tarn_dataplane::{Registry, Router};

/// Holds an exclusive lock on `<data_dir>/LOCK` for the life of the server.
pub fn lock_data_dir(data_dir: &std::path::Path) -> anyhow::Result<File> {
    std::fs::create_dir_all(data_dir)
        .with_context(|| format!("creating data directory {}", data_dir.display()))?;
    let path = data_dir.join("LOCK");
    let file = File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(TryLockError::WouldBlock) => bail!(
            "another tarn server is using {} (it holds {}); stop it or choose another --data-dir",
            data_dir.display(),
            path.display()
        ),
        Err(TryLockError::Error(e)) => {
            Err(e).with_context(|| format!("locking {}", path.display()))
        }
    }
}

/// SIGTERM and SIGINT, registered before the server announces itself: a signal that arrives
/// right after start must shut down gracefully, not kill the process with the default action.
struct ShutdownSignals {
    terminate: tokio::signal::unix::Signal,
    interrupt: tokio::signal::unix::Signal,
}

impl ShutdownSignals {
    fn register() -> anyhow::Result<Self> {
        use tokio::signal::unix::{signal, SignalKind};
        Ok(ShutdownSignals {
            terminate: signal(SignalKind::terminate()).context("listening for SIGTERM")?,
            interrupt: signal(SignalKind::interrupt()).context("listening for SIGINT")?,
        })
    }

    async fn recv(mut self) {
        tokio::select! {
            _ = self.terminate.recv() => {},
            _ = self.interrupt.recv() => {},
        }
    }
}

/// A server started in this process ([`start`]): its addresses, and the means to stop it.
#[derive(Debug)]
pub struct RunningServer {
    grpc_addr: String,
    metrics_addr: Option<std::net::SocketAddr>,
    /// Sends whether to hand a cluster node's primaries over first.
    stop: Option<tokio::sync::oneshot::Sender<bool>>,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl RunningServer {
    /// The gRPC address as clients give it: `host:port` (the port chosen if 0 was asked) or
    /// `unix:/path`.
    pub fn grpc_addr(&self) -> &str {
        &self.grpc_addr
    }

    /// The Prometheus address, unless metrics are off.
    pub fn metrics_addr(&self) -> Option<std::net::SocketAddr> {
        self.metrics_addr
    }

    /// Graceful shutdown: stop accepting, finish the requests in flight, close every
    /// collection (syncing its log), release the data directory. A cluster node keeps the
    /// shards it is primary of until its lease lapses or is revoked at exit (see
    /// [`RunningServer::shutdown_handing_over`]).
    pub async fn shutdown(self) -> anyhow::Result<()> {
        self.stop(false).await
    }

    /// [`RunningServer::shutdown`], but a cluster node first hands every shard it is primary of
    /// to an in-sync replica (at most 5 s), while it still serves: what SIGTERM and SIGINT do.
    pub async fn shutdown_handing_over(self) -> anyhow::Result<()> {
        self.stop(true).await
    }

    async fn stop(mut self, hand_over: bool) -> anyhow::Result<()> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(hand_over);
        }
        self.task.await.context("the server task panicked")?
    }

    /// Waits until the server stops by itself (its listener failed).
    async fn stopped(&mut self) -> anyhow::Result<()> {
        (&mut self.task).await.context("the server task panicked")?
    }
}

/// Starts a server in this process: locks the data directory, opens every collection, binds
/// the gRPC (and metrics) listeners and serves in a background task until
/// [`RunningServer::shutdown`]. Returns once the listeners are bound.
pub async fn start(config: ServeConfig) -> anyhow::Result<RunningServer> {
    let lock = lock_data_dir(&config.data_dir)?;
    let data_dir = config.data_dir.clone();
    let registry = Arc::new(tokio::task::spawn_blocking(move || Registry::open(&data_dir)).await??);
    let metrics = Arc::new(Metrics::new()?);
    let keys = ApiKeys::new(&config.api_keys, &config.read_only_keys);
    if !keys.enabled() {
        tracing::warn!("no API keys configured: every client may read and write");
    }

    let listener = GrpcListener::bind(&config.listen).await?;
    let grpc_addr = listener.describe()?;
    let cluster = match &config.cluster {
        Some(cluster) => {
            let store: Arc<dyn tarn_cluster::ClusterStore> = match &cluster.store {
                Some(store) => Arc::clone(store),
                None => Arc::new(
                    tarn_cluster::EtcdStore::connect(&cluster.etcd, tarn_cluster::DEFAULT_PREFIX)
                        .await
                        .context("connecting to etcd")?,
                ),
            };
            let options = tarn_dataplane::JoinOptions {
                node_id: cluster.node_id.clone(),
                address: cluster.advertise.clone(),
                lease_ttl: cluster.lease_ttl,
                replication_factor: cluster.replication_factor,
                replace_dead_after: cluster.replace_dead_after,
                peer_ca: match &cluster.peer_ca {
                    Some(path) => Some(
                        std::fs::read(path)
                            .with_context(|| format!("reading --cluster-ca {}", path.display()))?,
                    ),
                    None => None,
                },
                data_dir: config.data_dir.clone(),
                force_new_cluster: cluster.force_new_cluster,
                accept_etcd_rollback: cluster.accept_etcd_rollback,
            };
            let node = tarn_dataplane::ClusterNode::join(store, options, Arc::clone(&registry))
                .await
                .context("joining the cluster")?;
            Some(node)
        }
        None => None,
    };
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let (metrics_task, metrics_addr) = match &config.metrics_listen {
        Some(addr) => {
            let metrics_listener = tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("binding metrics address {addr}"))?;
            let metrics_addr = metrics_listener.local_addr()?;
            let mut stop = stop_rx.clone();
            let shutdown = async move {
                let _ = stop.wait_for(|s| *s).await;
            };
            let task = tokio::spawn(metrics::serve(
                metrics_listener,
                Arc::clone(&metrics),
                Arc::clone(&registry),
                cluster.clone(),
                shutdown,
            ));
            (Some(task), Some(metrics_addr))
        }
        None => (None, None),
    };

    let (health_reporter, health_service) = tonic_health::server::health_reporter();
    health_reporter
        .set_serving::<TarnServer<TarnService>>()
        .await;
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(tarn_proto::v1::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()?;
    let reflection_alpha = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(tarn_proto::v1::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1alpha()?;
    let router = Router::new(
        Arc::clone(&registry),
        cluster.clone(),
        config.max_inflight_writes,
        metrics.router_metrics(),
    );
    let service = Arc::new(TarnService {
        router,
        keys,
        metrics,
        snapshot_slots: Arc::new(Semaphore::new(tarn_dataplane::MAX_CONCURRENT_SNAPSHOTS)),
        restore_slots: Arc::new(Semaphore::new(tarn_dataplane::MAX_CONCURRENT_SNAPSHOTS)),
    });
    let cluster_admin =
        tarn_proto::v1::cluster_server::ClusterServer::new(crate::cluster_admin::ClusterAdmin {
            cluster: cluster.clone(),
            keys: ApiKeys::new(&config.api_keys, &config.read_only_keys),
            tarn: Arc::clone(&service),
        });
    let node_service =
        tarn_proto::v1::node_server::NodeServer::new(crate::node_service::NodeService {
            cluster: cluster.clone(),
            tarn: Arc::clone(&service),
        })
        .max_decoding_message_size(config.max_message_bytes)
        .max_encoding_message_size(config.max_message_bytes);
    let tarn = TarnServer::from_arc(service)
        .accept_compressed(CompressionEncoding::Gzip)
        .accept_compressed(CompressionEncoding::Zstd)
        .send_compressed(CompressionEncoding::Gzip)
        .send_compressed(CompressionEncoding::Zstd)
        .max_decoding_message_size(config.max_message_bytes)
        .max_encoding_message_size(config.max_message_bytes);

    // HTTP/2 pings on every connection: one whose client stopped answering (a SIGSTOPped or
    // partitioned peer) is closed after 20 s instead of being held open for good.
    let mut builder = Server::builder()
        .http2_keepalive_interval(Some(KEEPALIVE_INTERVAL))
        .http2_keepalive_timeout(Some(KEEPALIVE_INTERVAL));
    if let Some((cert, key)) = &config.tls {
        let cert = std::fs::read(cert)
            .with_context(|| format!("reading TLS certificate {}", cert.display()))?;
        let key =
            std::fs::read(key).with_context(|| format!("reading TLS key {}", key.display()))?;
        builder =
            builder.tls_config(ServerTlsConfig::new().identity(Identity::from_pem(cert, key)))?;
    }
    tracing::info!(%grpc_addr, data_dir = %config.data_dir.display(), "serving");

    let health_task = tokio::spawn(watch_health(
        health_reporter.clone(),
        Arc::clone(&registry),
        stop_tx.subscribe(),
    ));
    let (stop, stop_requested) = tokio::sync::oneshot::channel::<bool>();
    let (begun, shutdown_begun) = tokio::sync::oneshot::channel::<()>();
    let health = health_reporter.clone();
    let stepping_down = cluster.clone();
    let shutdown = async move {
        let hand_over = stop_requested.await.unwrap_or(false);
        health.set_not_serving::<TarnServer<TarnService>>().await;
        // A cluster node first hands the shards it is primary of to in-sync replicas, while it
        // still serves (their writes go on there; calls in flight here are told to retry).
        if let (true, Some(cluster)) = (hand_over, &stepping_down) {
            cluster.step_down_all(STEP_DOWN_LIMIT).await;
        }
        tracing::info!("shutting down: no new requests; finishing the ones in flight");
        let _ = begun.send(());
    };
    let router = builder
        .add_service(health_service)
        .add_service(reflection)
        .add_service(reflection_alpha)
        .add_service(cluster_admin)
        .add_service(node_service)
        .add_service(tarn);
    let task = tokio::spawn(async move {
        // The data directory stays locked until every collection is closed.
        let _lock = lock;
        let served = match listener {
            GrpcListener::Tcp(listener) => {
                let serve = router.serve_with_incoming_shutdown(
                    // TCP_NODELAY on every connection: tonic sets it only on listeners it
                    // binds itself, and with Nagle a small response waits for the client's
                    // delayed ACK.
                    tokio_stream::StreamExt::map(
                        tokio_stream::wrappers::TcpListenerStream::new(listener),
                        |accepted| {
                            accepted.inspect(|stream| {
                                if let Err(error) = stream.set_nodelay(true) {
                                    tracing::debug!(%error, "could not set TCP_NODELAY");
                                }
                            })
                        },
                    ),
                    shutdown,
                );
                within_grace(serve, shutdown_begun).await
            }
            GrpcListener::Unix(listener, path) => {
                let serve = router.serve_with_incoming_shutdown(
                    tokio_stream::wrappers::UnixListenerStream::new(listener),
                    shutdown,
                );
                let served = within_grace(serve, shutdown_begun).await;
                if let Err(error) = std::fs::remove_file(&path) {
                    tracing::warn!(%error, path = %path.display(), "could not remove the socket file");
                }
                served
            }
        };
        let _ = stop_tx.send(true);
        if let Some(task) = metrics_task {
            let _ = task.await;
        }
        let _ = health_task.await;
        // In-flight requests are done: let ingestion finish and sync every WAL.
        let closing = Arc::clone(&registry);
        tokio::task::spawn_blocking(move || closing.close_all()).await?;
        tracing::info!("stopped");
        served.context("serving gRPC")
    });
    Ok(RunningServer {
        grpc_addr,
        metrics_addr,
        stop: Some(stop),
        task,
    })
}

/// How long a graceful shutdown waits, at most, for a cluster node's primaries to be handed
/// to in-sync replicas before it stops accepting calls.
const STEP_DOWN_LIMIT: Duration = Duration::from_secs(5);

/// How long a graceful shutdown waits for the requests in flight and for clients to close
/// their connections, before it closes the collections (every WAL synced) anyway.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(15);
/// HTTP/2 ping interval and timeout on the server's connections.
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);

/// Serves until `serve` ends, but for at most [`SHUTDOWN_GRACE`] once the shutdown has begun:
/// a connection whose client stopped answering (a SIGSTOPped or partitioned peer node) is never
/// closed by that client, and would otherwise hold the shutdown for good.
async fn within_grace<F>(
    serve: F,
    begun: tokio::sync::oneshot::Receiver<()>,
) -> Result<(), tonic::transport::Error>
where
    F: std::future::Future<Output = Result<(), tonic::transport::Error>>,
{
    tokio::pin!(serve);
    tokio::select! {
        biased;
        served = &mut serve => return served,
        _ = begun => {}
    }
    match tokio::time::timeout(SHUTDOWN_GRACE, serve).await {
        Ok(served) => served,
        Err(_) => {
            tracing::warn!(
                grace_seconds = SHUTDOWN_GRACE.as_secs(),
                "shutting down with connections still open (a client or peer that stopped \
                 answering?): closing them"
            );
            Ok(())
        }
    }
}

/// `tarn serve`: [`start`], announce the addresses on stdout, and shut down gracefully on
/// SIGTERM or SIGINT.
pub async fn serve(config: ServeConfig) -> anyhow::Result<()> {
    let signals = ShutdownSignals::register()?;
    let tls = config.tls.is_some();
    let mut server = start(config).await?;
    if let Some(addr) = server.metrics_addr() {
        println!("tarn: metrics listening on {addr}");
    }
    println!(
        "tarn: gRPC listening on {}{}",
        server.grpc_addr(),
        if tls { " (TLS)" } else { "" }
    );
    let _ = std::io::stdout().flush();
    tokio::select! {
        () = signals.recv() => server.shutdown_handing_over().await?,
        stopped = server.stopped() => stopped?,
    }
    println!("tarn: stopped");
    Ok(())
}

/// Where gRPC is served: a TCP address (`host:port`), or a Unix socket (`unix:/path`) for
/// clients on the same machine, which skips the loopback TCP stack (measured:
/// docs/BENCHMARKS.md, "Over Unix sockets").
enum GrpcListener {
    Tcp(tokio::net::TcpListener),
    Unix(tokio::net::UnixListener, std::path::PathBuf),
}

impl GrpcListener {
    async fn bind(listen: &str) -> anyhow::Result<Self> {
        let Some(path) = listen.strip_prefix("unix:") else {
            let listener = tokio::net::TcpListener::bind(listen)
                .await
                .with_context(|| format!("binding gRPC address {listen}"))?;
            return Ok(GrpcListener::Tcp(listener));
        };
        let path = std::path::PathBuf::from(path);
        if path.as_os_str().is_empty() {
            bail!("listen: `unix:` needs a socket path, as in unix:/run/tarn/tarn.sock");
        }
        // A socket file left by a server that died is removed; one that still answers is
        // another server's, and is left alone.
        if std::fs::symlink_metadata(&path)
            .is_ok_and(|m| std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()))
        {
            if tokio::net::UnixStream::connect(&path).await.is_ok() {
                bail!(
                    "listen: another server is listening on {} (choose another socket path)",
                    path.display()
                );
            }
            std::fs::remove_file(&path)
                .with_context(|| format!("removing the stale socket {}", path.display()))?;
        }
        let listener = tokio::net::UnixListener::bind(&path)
            .with_context(|| format!("binding gRPC socket {}", path.display()))?;
        Ok(GrpcListener::Unix(listener, path))
    }

    /// The address as printed at start (`127.0.0.1:50051` or `unix:/path`).
    fn describe(&self) -> anyhow::Result<String> {
        Ok(match self {
            GrpcListener::Tcp(listener) => listener.local_addr()?.to_string(),
            GrpcListener::Unix(_, path) => format!("unix:{}", path.display()),
        })
    }
}

/// Health follows the collections' logs: once a collection's WAL is poisoned (a failed write or
/// fdatasync; only a restart clears it), `tarn.v1.Tarn/<collection>` and the server as a whole
/// (`""` and `tarn.v1.Tarn`) report NOT_SERVING, so that `tarn healthcheck` fails and an
/// orchestrator restarts the server, which recovers every acknowledged write. Checked every
/// 500 ms.
async fn watch_health(
    mut reporter: tonic_health::server::HealthReporter,
    registry: Arc<Registry>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    use tonic_health::ServingStatus;
    let mut known: std::collections::HashMap<String, bool> = std::collections::HashMap::new();
    let mut all_ok = true;
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        let mut ok_now = true;
        let mut seen = std::collections::HashSet::new();
        for (name, collection) in registry.all() {
            let ok = collection.write_error().is_none();
            ok_now &= ok;
            if known.get(&name) != Some(&ok) {
                let status = if ok {
                    ServingStatus::Serving
                } else {
                    tracing::error!(collection = %name, error = ?collection.write_error(), "collection refuses writes (WAL poisoned or a thread died): reporting NOT_SERVING until restart");
                    ServingStatus::NotServing
                };
                reporter
                    .set_service_status(format!("tarn.v1.Tarn/{name}"), status)
                    .await;
                known.insert(name.clone(), ok);
            }
            seen.insert(name);
        }
        for gone in known
            .keys()
            .filter(|n| !seen.contains(*n))
            .cloned()
            .collect::<Vec<_>>()
        {
            reporter
                .clear_service_status(&format!("tarn.v1.Tarn/{gone}"))
                .await;
            known.remove(&gone);
        }
        if ok_now != all_ok {
            all_ok = ok_now;
            let status = if ok_now {
                ServingStatus::Serving
            } else {
                ServingStatus::NotServing
            };
            reporter.set_service_status("", status).await;
            reporter.set_service_status("tarn.v1.Tarn", status).await;
        }
    }
}
