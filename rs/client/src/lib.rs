//! `tarn-client`: an async Rust client for [tarn](https://github.com/tarn-db/tarn), a durable
//! vector database, over gRPC (tonic).
//!
//! Ids are `u128`, vectors are `f32` slices or vectors, and every failure is an [`Error`] that
//! keeps the gRPC status [`Code`] and the server's message. A [`Client`] is cheap to clone and
//! safe to share across tasks.
//!
//! ```no_run
//! use tarn_client::{Client, CollectionSpec, Insert, Metric, Search};
//!
//! # async fn example() -> tarn_client::Result<()> {
//! // host:port, http://host:port, https://host:port or unix:/path
//! let client = Client::connect("127.0.0.1:50051").await?;
//! client
//!     .create_collection(CollectionSpec::new("docs", 4).metric(Metric::Cosine))
//!     .await?;
//! let ack = client
//!     .insert(Insert::new("docs", [1u128, 2], vec![1.0f32, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0]).users([7u128]))
//!     .await?; // durable (fdatasync) when it returns
//! let hits = client
//!     .search(Search::new("docs", vec![1.0f32, 0.1, 0.0, 0.0]).users([7u128]).top_k(1).after(ack.read_token()))
//!     .await?; // waits until the insert is searchable
//! assert_eq!(hits[0].doc_id, 1);
//! # Ok(()) }
//! ```
//!
//! Filtered search: declare typed attribute fields when creating the collection
//! ([`CollectionSpec::field`]), give each document its [`Attributes`] ([`Insert::attributes`]),
//! and search with a [`Filter`] ([`Search::filter`]); remove by filter with
//! [`Remove::matching`].
//!
//! `examples/quickstart.rs` runs the whole cycle against a server given on its command line.

#![warn(missing_docs)]

mod attributes;
mod client;
mod coalesce;
mod connect;
mod error;
mod filter;
mod snapshot;
mod types;

pub use attributes::{Attributes, FieldSpec, FieldType, TextAnalyzer, Value};
pub use client::{Client, ClientBuilder};
pub use error::{retry_overloaded, Code, Error, Result, RETRY_AFTER_MS};
pub use filter::{Field, Filter, Range};
pub use snapshot::{Restored, SnapshotStream};
pub use types::{
    ClusterStatus, CollectionInfo, CollectionSpec, Count, Document, Durability, ForgetReport,
    Fusion, Hit, Insert, Metric, NodeStatus, Quantization, ReadToken, Remove, ReplicaLag, Scroll,
    ScrollPage, Search, SetAsideShard, ShardKey, ShardStatus, SideScore, WriteAck,
};
