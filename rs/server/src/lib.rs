//! `tarn-server`: the tarn server as a library (the gRPC service, its configuration, metrics
//! and the data directory's collections) and the client commands of the `tarn` binary, which
//! is a thin `main` over this crate.
//!
//! Tests and embedders start a server in-process with [`start`] and stop it with
//! [`RunningServer::shutdown`]; `tarn serve` is [`serve`] (the same, plus signals).

mod auth;
mod backup;
mod bench;
pub mod cli;
mod client;
mod cluster;
mod cluster_admin;
mod config;
mod convert;
mod filter_expr;
mod metrics;
mod moves;
mod node_service;
mod registry;
mod replication;
mod routing;
mod server;
mod service;
mod snapshots;
mod status;

pub use client::run as run_client_command;
pub use cluster::{ClusterConfig, NODE_SECRET_HEADER};
pub use config::ServeConfig;
pub use server::{serve, start, RunningServer};
