//! `tarn serve` settings: flags and environment (clap), then the TOML file, then defaults.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use serde::Deserialize;

/// The settings of a server. Start from [`ServeConfig::resolve`] (what `tarn serve` does) or
/// [`ServeConfig::in_process`] and change fields.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ServeConfig {
    pub data_dir: PathBuf,
    pub listen: String,
    pub metrics_listen: Option<String>,
    pub max_message_bytes: usize,
    pub max_inflight_writes: usize,
    pub api_keys: Vec<String>,
    pub read_only_keys: Vec<String>,
    pub tls: Option<(PathBuf, PathBuf)>,
    pub log_json: bool,
    /// Cluster mode, when etcd endpoints are given.
    pub cluster: Option<tarn_dataplane::ClusterConfig>,
}

/// `tarn serve`'s flags (clap; the binary's command line embeds them). Every one can also come
/// from a `TARN_*` environment variable or the TOML file given by `--config`; precedence: flag,
/// environment, file, default.
#[derive(Debug, Args, Default)]
pub struct ServeArgs {
    /// TOML file with any of the settings below (keys as the flags, with underscores).
    #[arg(long, env = "TARN_CONFIG")]
    pub config: Option<PathBuf>,
    /// Where collections live [default: ./tarn-data].
    #[arg(long, env = "TARN_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
    /// gRPC address: host:port, or unix:/path for a Unix socket [default: 127.0.0.1:50051].
    #[arg(long, env = "TARN_LISTEN")]
    pub listen: Option<String>,
    /// Prometheus /metrics address; "off" disables it [default: 127.0.0.1:9100].
    #[arg(long, env = "TARN_METRICS_LISTEN")]
    pub metrics_listen: Option<String>,
    /// Largest gRPC message accepted or sent [default: 67108864].
    #[arg(long, env = "TARN_MAX_MESSAGE_BYTES")]
    pub max_message_bytes: Option<usize>,
    /// Writes allowed to wait for the WAL at once; more get RESOURCE_EXHAUSTED [default: 10000].
    #[arg(long, env = "TARN_MAX_INFLIGHT_WRITES")]
    pub max_inflight_writes: Option<usize>,
    /// Read-write API keys (comma-separated in the environment). None: auth off.
    #[arg(long = "api-key", env = "TARN_API_KEYS", value_delimiter = ',')]
    pub api_keys: Vec<String>,
    /// Read-only API keys.
    #[arg(
        long = "read-only-key",
        env = "TARN_READ_ONLY_KEYS",
        value_delimiter = ','
    )]
    pub read_only_keys: Vec<String>,
    /// TLS certificate chain (PEM); with --tls-key, serve TLS.
    #[arg(long, env = "TARN_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,
    #[arg(long, env = "TARN_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
    /// Log as JSON lines (level from RUST_LOG).
    #[arg(long, env = "TARN_LOG_JSON")]
    pub log_json: Option<bool>,
    /// Cluster mode: etcd endpoints (comma-separated), e.g. http://127.0.0.1:2379. Without it the
    /// server runs alone (the embedded default).
    #[arg(long, env = "TARN_ETCD", value_delimiter = ',')]
    pub etcd: Vec<String>,
    /// Cluster mode: this node's id, unique in the cluster.
    #[arg(long, env = "TARN_NODE_ID")]
    pub node_id: Option<String>,
    /// Cluster mode: the gRPC address other nodes and clients reach this node at (host:port).
    #[arg(long, env = "TARN_ADVERTISE")]
    pub advertise: Option<String>,
    /// Cluster mode: seconds without a keep-alive after which the node is dead to the cluster
    /// [default: 5].
    #[arg(long, env = "TARN_LEASE_SECONDS")]
    pub lease_seconds: Option<u64>,
    /// Cluster mode: copies of each shard, the primary included, for collections created
    /// without a replication factor [default: 2, or the live nodes when fewer].
    #[arg(long, env = "TARN_REPLICATION_FACTOR")]
    pub replication_factor: Option<u32>,
    /// Cluster mode: seconds a node may stay dead before the replica copies it held are rebuilt
    /// on other live nodes (re-replication) [default: 600].
    #[arg(long, env = "TARN_REPLACE_DEAD_AFTER")]
    pub replace_dead_after: Option<u64>,
    /// Cluster mode: join an etcd that holds no cluster id although this data directory belongs
    /// to a cluster (that cluster's etcd is lost for good). A new cluster is formed; local
    /// shards its map does not know are set aside (`tarn cluster set-aside`), never deleted.
    #[arg(long)]
    pub force_new_cluster: bool,
    /// Cluster mode: join an etcd whose history is behind what this data directory saw (etcd
    /// restored from an older backup, its newer state lost). Without it the node refuses to
    /// start against such an etcd, and a running node fences itself. Local copies held at a
    /// later epoch than their record are set aside, never deleted; a shard whose copy was
    /// deleted here is never started empty here.
    #[arg(long)]
    pub accept_etcd_rollback: bool,
    /// Cluster mode: the certificate authority (PEM) that signs the nodes' TLS certificates
    /// (nodes advertising https:// addresses); without it, nodes trust the Mozilla roots.
    #[arg(long, env = "TARN_CLUSTER_CA")]
    pub cluster_ca: Option<PathBuf>,
}

/// The TOML file: the same settings, all optional.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    data_dir: Option<PathBuf>,
    listen: Option<String>,
    metrics_listen: Option<String>,
    max_message_bytes: Option<usize>,
    max_inflight_writes: Option<usize>,
    api_keys: Option<Vec<String>>,
    read_only_keys: Option<Vec<String>>,
    tls_cert: Option<PathBuf>,
    tls_key: Option<PathBuf>,
    log_json: Option<bool>,
    etcd: Option<Vec<String>>,
    node_id: Option<String>,
    advertise: Option<String>,
    lease_seconds: Option<u64>,
    replication_factor: Option<u32>,
    replace_dead_after: Option<u64>,
    cluster_ca: Option<PathBuf>,
}

impl ServeConfig {
    /// `tarn serve`'s defaults for `data_dir`, but on an ephemeral loopback port and without
    /// metrics: a server for tests and embedders ([`crate::start`]).
    pub fn in_process(data_dir: impl Into<PathBuf>) -> ServeConfig {
        ServeConfig {
            data_dir: data_dir.into(),
            listen: "127.0.0.1:0".to_owned(),
            metrics_listen: None,
            max_message_bytes: 64 << 20,
            max_inflight_writes: 10_000,
            api_keys: Vec::new(),
            read_only_keys: Vec::new(),
            tls: None,
            log_json: false,
            cluster: None,
        }
    }

    /// The settings from the command line and environment (`args`), then the TOML file it
    /// names, then the defaults.
    pub fn resolve(args: ServeArgs) -> anyhow::Result<ServeConfig> {
        let file: FileConfig = match &args.config {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("reading config file {}", path.display()))?;
                toml::from_str(&text)
                    .with_context(|| format!("parsing config file {}", path.display()))?
            }
            None => FileConfig::default(),
        };
        let list = |from_args: Vec<String>, from_file: Option<Vec<String>>| {
            if from_args.is_empty() {
                from_file.unwrap_or_default()
            } else {
                from_args
            }
        };
        let metrics_listen = args
            .metrics_listen
            .or(file.metrics_listen)
            .unwrap_or_else(|| "127.0.0.1:9100".to_owned());
        let tls = match (
            args.tls_cert.or(file.tls_cert),
            args.tls_key.or(file.tls_key),
        ) {
            (Some(cert), Some(key)) => Some((cert, key)),
            (None, None) => None,
            _ => anyhow::bail!("TLS needs both --tls-cert and --tls-key"),
        };
        let etcd = list(args.etcd, file.etcd);
        let cluster = if etcd.is_empty() {
            None
        } else {
            let node_id = args
                .node_id
                .or(file.node_id)
                .context("cluster mode (--etcd) needs --node-id, unique in the cluster")?;
            anyhow::ensure!(
                !node_id.is_empty()
                    && node_id
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-'),
                "node id {node_id:?} must match [A-Za-z0-9_-]+"
            );
            let advertise = args.advertise.or(file.advertise).context(
                "cluster mode (--etcd) needs --advertise host:port (where other nodes reach this one)",
            )?;
            Some(tarn_dataplane::ClusterConfig {
                etcd,
                node_id,
                advertise,
                lease_ttl: std::time::Duration::from_secs(
                    args.lease_seconds
                        .or(file.lease_seconds)
                        .unwrap_or(5)
                        .max(1),
                ),
                // 0: the built-in default (2 copies, fewer while fewer nodes are live).
                replication_factor: args
                    .replication_factor
                    .or(file.replication_factor)
                    .unwrap_or(0),
                replace_dead_after: std::time::Duration::from_secs(
                    args.replace_dead_after
                        .or(file.replace_dead_after)
                        .unwrap_or(600),
                ),
                store: None,
                force_new_cluster: args.force_new_cluster,
                accept_etcd_rollback: args.accept_etcd_rollback,
                peer_ca: args.cluster_ca.clone().or(file.cluster_ca),
            })
        };
        Ok(ServeConfig {
            cluster,
            data_dir: args
                .data_dir
                .or(file.data_dir)
                .unwrap_or_else(|| PathBuf::from("./tarn-data")),
            listen: args
                .listen
                .or(file.listen)
                .unwrap_or_else(|| "127.0.0.1:50051".to_owned()),
            metrics_listen: (metrics_listen != "off").then_some(metrics_listen),
            max_message_bytes: args
                .max_message_bytes
                .or(file.max_message_bytes)
                .unwrap_or(64 << 20),
            max_inflight_writes: args
                .max_inflight_writes
                .or(file.max_inflight_writes)
                .unwrap_or(10_000)
                .max(1),
            api_keys: list(args.api_keys, file.api_keys),
            read_only_keys: list(args.read_only_keys, file.read_only_keys),
            tls,
            log_json: args.log_json.or(file.log_json).unwrap_or(false),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_beat_the_file_which_beats_the_defaults() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tarn.toml");
        std::fs::write(
            &path,
            "data_dir = \"/from/file\"\nlisten = \"0.0.0.0:7000\"\nmetrics_listen = \"off\"\napi_keys = [\"k1\"]\n",
        )
        .unwrap();
        let args = ServeArgs {
            config: Some(path.clone()),
            listen: Some("127.0.0.1:9999".into()),
            ..ServeArgs::default()
        };
        let config = ServeConfig::resolve(args).unwrap();
        assert_eq!(config.data_dir, PathBuf::from("/from/file"));
        assert_eq!(config.listen, "127.0.0.1:9999");
        assert_eq!(config.metrics_listen, None);
        assert_eq!(config.api_keys, vec!["k1".to_owned()]);
        assert_eq!(config.max_message_bytes, 64 << 20);

        let defaults = ServeConfig::resolve(ServeArgs::default()).unwrap();
        assert_eq!(defaults.data_dir, PathBuf::from("./tarn-data"));
        assert_eq!(defaults.listen, "127.0.0.1:50051");
        assert_eq!(defaults.metrics_listen.as_deref(), Some("127.0.0.1:9100"));

        std::fs::write(&path, "lisen = \"typo\"\n").unwrap();
        let args = ServeArgs {
            config: Some(path),
            ..ServeArgs::default()
        };
        assert!(
            ServeConfig::resolve(args).is_err(),
            "unknown keys are errors, not ignored"
        );
    }
}
