//! Prometheus metrics on a separate HTTP port (`GET /metrics`).

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, Opts,
    Registry as PromRegistry, TextEncoder,
};

use tarn_dataplane::ClusterNode;
use tarn_dataplane::{Registry, RouterMetrics};

#[derive(Debug)]
pub struct Metrics {
    registry: PromRegistry,
    rpc: HistogramVec,
    /// Insert/remove: from handing the operation to the WAL to its acknowledgement.
    pub append_ack: Histogram,
    pub search: Histogram,
    /// Cluster mode: calls a router sent to another node, by RPC.
    pub forwarded: IntCounterVec,
    /// Cluster mode: a routed call from start to its merged answer, by RPC.
    pub fan_out: HistogramVec,
    /// Cluster mode: shard calls sent again after the shard's owner or state changed.
    pub retried_on_moved_shard: IntCounter,
}

const LATENCY_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    10.0,
];

impl Metrics {
    /// The data plane's own metrics (registered here; prometheus handles share their values).
    pub fn router_metrics(&self) -> RouterMetrics {
        RouterMetrics {
            append_ack: self.append_ack.clone(),
            forwarded: self.forwarded.clone(),
            fan_out: self.fan_out.clone(),
            retried_on_moved_shard: self.retried_on_moved_shard.clone(),
        }
    }

    pub fn new() -> anyhow::Result<Self> {
        let registry = PromRegistry::new();
        let rpc = HistogramVec::new(
            HistogramOpts::new(
                "tarn_rpc_duration_seconds",
                "gRPC request latency by method and status code",
            )
            .buckets(LATENCY_BUCKETS.to_vec()),
            &["method", "code"],
        )?;
        let append_ack = Histogram::with_opts(
            HistogramOpts::new(
                "tarn_append_ack_seconds",
                "insert/remove: WAL append to acknowledgement",
            )
            .buckets(LATENCY_BUCKETS.to_vec()),
        )?;
        let search = Histogram::with_opts(
            HistogramOpts::new(
                "tarn_search_seconds",
                "search latency (including any min_seq_no wait)",
            )
            .buckets(LATENCY_BUCKETS.to_vec()),
        )?;
        let forwarded = IntCounterVec::new(
            Opts::new(
                "tarn_cluster_forwarded_total",
                "cluster mode: shard calls sent to another node, by RPC",
            ),
            &["method"],
        )?;
        let fan_out = HistogramVec::new(
            HistogramOpts::new(
                "tarn_cluster_fan_out_seconds",
                "cluster mode: a routed call over its shards, start to merged answer, by RPC",
            )
            .buckets(LATENCY_BUCKETS.to_vec()),
            &["method"],
        )?;
        let retried_on_moved_shard = IntCounter::new(
            "tarn_cluster_retried_total",
            "cluster mode: shard calls sent again after a move changed the shard's owner or state",
        )?;
        registry.register(Box::new(retried_on_moved_shard.clone()))?;
        registry.register(Box::new(forwarded.clone()))?;
        registry.register(Box::new(fan_out.clone()))?;
        registry.register(Box::new(rpc.clone()))?;
        registry.register(Box::new(append_ack.clone()))?;
        registry.register(Box::new(search.clone()))?;
        Ok(Metrics {
            registry,
            rpc,
            append_ack,
            search,
            forwarded,
            fan_out,
            retried_on_moved_shard,
        })
    }

    pub fn observe_rpc(&self, method: &str, code: tonic::Code, elapsed: Duration) {
        self.rpc
            .with_label_values(&[method, &format!("{code:?}")])
            .observe(elapsed.as_secs_f64());
    }

    /// The text exposition: the registered metrics, then per-collection figures read now.
    pub fn render(&self, collections: &Registry, cluster: Option<&ClusterNode>) -> String {
        let mut out = Vec::new();
        if let Err(error) = TextEncoder::new().encode(&self.registry.gather(), &mut out) {
            tracing::warn!(%error, "could not encode metrics");
        }
        let mut text = String::from_utf8_lossy(&out).into_owned();
        if let Some(cluster) = cluster {
            use std::sync::atomic::Ordering::Relaxed;
            let state = cluster.state();
            let moves = cluster.move_counters();
            let _ = writeln!(
                text,
                "# HELP tarn_cluster_shards_owned shards this node owns\n\
                 # TYPE tarn_cluster_shards_owned gauge\n\
                 tarn_cluster_shards_owned {}\n\
                 # HELP tarn_cluster_nodes_alive nodes whose lease is alive\n\
                 # TYPE tarn_cluster_nodes_alive gauge\n\
                 tarn_cluster_nodes_alive {}\n\
                 # HELP tarn_cluster_etcd_connected 1 while this node reaches etcd\n\
                 # TYPE tarn_cluster_etcd_connected gauge\n\
                 tarn_cluster_etcd_connected {}\n\
                 # HELP tarn_cluster_moves_in_progress shard moves this node is taking in now\n\
                 # TYPE tarn_cluster_moves_in_progress gauge\n\
                 tarn_cluster_moves_in_progress {}\n\
                 # HELP tarn_cluster_moves_total shard moves this node took in, by outcome\n\
                 # TYPE tarn_cluster_moves_total counter\n\
                 tarn_cluster_moves_total{{outcome=\"finished\"}} {}\n\
                 tarn_cluster_moves_total{{outcome=\"failed\"}} {}\n\
                 # HELP tarn_cluster_move_bytes_total bytes received by shard moves (snapshots and WAL entries)\n\
                 # TYPE tarn_cluster_move_bytes_total counter\n\
                 tarn_cluster_move_bytes_total {}\n\
                 # HELP tarn_cluster_move_streams_out shards this node is sending to another node now\n\
                 # TYPE tarn_cluster_move_streams_out gauge\n\
                 tarn_cluster_move_streams_out {}\n\
                 # HELP tarn_cluster_move_write_pause_seconds the last finished move's write pause (fence to flip)\n\
                 # TYPE tarn_cluster_move_write_pause_seconds gauge\n\
                 tarn_cluster_move_write_pause_seconds {}\n\
                 # HELP tarn_cluster_set_aside_shards shard copies this node set aside instead of deleting them\n\
                 # TYPE tarn_cluster_set_aside_shards gauge\n\
                 tarn_cluster_set_aside_shards {}\n\
                 # HELP tarn_cluster_writable 1 while this node may acknowledge writes (its etcd lease is surely alive)\n\
                 # TYPE tarn_cluster_writable gauge\n\
                 tarn_cluster_writable {}\n\
                 # HELP tarn_cluster_fenced_by_store 1 once etcd broke the cluster's history under this node (wiped, replaced, restored from an older backup): it acknowledges no write and changes no copy until restarted\n\
                 # TYPE tarn_cluster_fenced_by_store gauge\n\
                 tarn_cluster_fenced_by_store {}\n\
                 # HELP tarn_failovers_total replicas this node promoted to primary as the placement coordinator\n\
                 # TYPE tarn_failovers_total counter\n\
                 tarn_failovers_total {}\n\
                 # HELP tarn_rereplication_bytes_total bytes this node received seeding replica copies from primaries' snapshots and logs\n\
                 # TYPE tarn_rereplication_bytes_total counter\n\
                 tarn_rereplication_bytes_total {}",
                state.shards_owned_by(&cluster.node_id).count(),
                state.nodes.len(),
                u8::from(cluster.store_connected()),
                moves.in_progress.load(Relaxed),
                moves.finished.load(Relaxed),
                moves.failed.load(Relaxed),
                moves.bytes.load(Relaxed),
                moves.streams_out.load(Relaxed),
                moves.last_write_pause_us.load(Relaxed) as f64 / 1e6,
                collections.set_aside_list().map_or(0, |l| l.len()),
                u8::from(cluster.writable().is_ok()),
                u8::from(cluster.check_store_history().is_err()),
                moves.failovers.load(Relaxed),
                moves.seed_bytes.load(Relaxed),
            );
            let replicas = cluster.replication_figures();
            for (name, help) in [
                (
                    "tarn_replication_lag_entries",
                    "log entries a replica of a shard this node is primary of has not yet made durable",
                ),
                (
                    "tarn_replication_in_sync",
                    "1 while a replica of a shard this node is primary of is in the in-sync set",
                ),
            ] {
                let _ = writeln!(text, "# HELP {name} {help}\n# TYPE {name} gauge");
                for figure in &replicas {
                    let value = if name == "tarn_replication_lag_entries" {
                        figure.lag
                    } else {
                        u64::from(figure.in_sync)
                    };
                    let _ = writeln!(
                        text,
                        "{name}{{collection=\"{}\",shard=\"{}\",node=\"{}\"}} {value}",
                        figure.collection, figure.shard, figure.node
                    );
                }
            }
        }
        let all = collections.all();
        let gauge = |text: &mut String,
                     name: &str,
                     help: &str,
                     values: &mut dyn Iterator<Item = (String, f64)>| {
            let _ = writeln!(text, "# HELP {name} {help}\n# TYPE {name} gauge");
            for (collection, value) in values {
                let _ = writeln!(text, "{name}{{collection=\"{collection}\"}} {value}");
            }
        };
        let stats: Vec<_> = all
            .iter()
            .map(|(n, c)| (n.clone(), c.stats(), c.wal_stats(), c.write_error()))
            .collect();
        gauge(
            &mut text,
            "tarn_collection_documents",
            "live (tenant, document) pairs",
            &mut stats
                .iter()
                .map(|(n, s, _, _)| (n.clone(), s.n_documents as f64)),
        );
        gauge(
            &mut text,
            "tarn_ingestion_lag",
            "operations appended but not yet applied",
            &mut stats.iter().map(|(n, s, _, _)| {
                (
                    n.clone(),
                    s.last_appended_seq.saturating_sub(s.applied_seq) as f64,
                )
            }),
        );
        gauge(
            &mut text,
            "tarn_collection_unindexed",
            "stored vectors waiting for a graph, searched by exact scan meanwhile",
            &mut stats
                .iter()
                .map(|(n, s, _, _)| (n.clone(), s.n_unindexed as f64)),
        );
        for (name, help, pick) in [
            (
                "tarn_index_build_vectors_total",
                "vectors given graphs by checkpoints (sealing, merges, rebuilds)",
                0,
            ),
            (
                "tarn_index_build_seconds_total",
                "time checkpoints spent building graphs (throughput: vectors / seconds)",
                1,
            ),
        ] {
            let _ = writeln!(text, "# HELP {name} {help}\n# TYPE {name} counter");
            for (collection, s, _, _) in &stats {
                let value = if pick == 0 {
                    s.n_vectors_built as f64
                } else {
                    s.build_seconds
                };
                let _ = writeln!(text, "{name}{{collection=\"{collection}\"}} {value}");
            }
        }
        gauge(
            &mut text,
            "tarn_wal_poisoned",
            "1 when the WAL refuses writes after an I/O error",
            &mut stats
                .iter()
                .map(|(n, _, _, e)| (n.clone(), f64::from(u8::from(e.is_some())))),
        );
        let _ = writeln!(
            text,
            "# HELP tarn_collection_failed 1 when the collection's thread died (it refuses writes until restart)\n\
             # TYPE tarn_collection_failed gauge"
        );
        for (collection, handle) in &all {
            let failed = handle.failure().map(|f| f.thread);
            for thread in tarn_collection::ThreadFailure::THREADS {
                let _ = writeln!(
                    text,
                    "tarn_collection_failed{{collection=\"{collection}\",thread=\"{thread}\"}} {}",
                    u8::from(failed == Some(thread))
                );
            }
        }
        for (name, help, pick) in [
            ("tarn_wal_sync_seconds", "WAL fdatasync latency", 0),
            ("tarn_wal_group_size", "entries per WAL write group", 1),
        ] {
            let _ = writeln!(text, "# HELP {name} {help}\n# TYPE {name} histogram");
            for (collection, _, wal, _) in &stats {
                let histogram = if pick == 0 {
                    &wal.sync_seconds
                } else {
                    &wal.group_size
                };
                let mut cumulative = 0;
                for (bound, count) in histogram.bounds.iter().zip(&histogram.counts) {
                    cumulative += count;
                    let _ = writeln!(
                        text,
                        "{name}_bucket{{collection=\"{collection}\",le=\"{bound}\"}} {cumulative}"
                    );
                }
                cumulative += histogram.counts.last().copied().unwrap_or(0);
                let _ = writeln!(
                    text,
                    "{name}_bucket{{collection=\"{collection}\",le=\"+Inf\"}} {cumulative}"
                );
                let _ = writeln!(
                    text,
                    "{name}_sum{{collection=\"{collection}\"}} {}",
                    histogram.sum
                );
                let _ = writeln!(
                    text,
                    "{name}_count{{collection=\"{collection}\"}} {cumulative}"
                );
            }
        }
        text
    }
}

/// Serves `GET /metrics` until `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    metrics: Arc<Metrics>,
    collections: Arc<Registry>,
    cluster: Option<Arc<ClusterNode>>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let (metrics, collections) = (Arc::clone(&metrics), Arc::clone(&collections));
            let cluster = cluster.clone();
            async move { metrics.render(&collections, cluster.as_deref()) }
        }),
    );
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await?;
    Ok(())
}
