//! `tarn-server`: the tarn server as a library: the tonic services (`tarn.v1.Tarn`,
//! `tarn.v1.Cluster`, `tarn.v1.Node`), API keys, configuration, metrics, and starting and
//! stopping a server. The data (local collections, routing over the cluster's shards, moves,
//! replication) is `tarn-dataplane`'s; this crate knows no CLI (the `tarn` binary's crate parses
//! the command line into [`ServeArgs`]).
//!
//! Tests and embedders start a server in-process with [`start`] and stop it with
//! [`RunningServer::shutdown`]; `tarn serve` is [`serve`] (the same, plus signals).

mod auth;
mod cluster_admin;
mod config;
mod metrics;
mod node_service;
mod server;
mod service;

pub use config::{ServeArgs, ServeConfig};
pub use server::{lock_data_dir, serve, start, RunningServer};
pub use tarn_dataplane::{ClusterConfig, NODE_SECRET_HEADER};
