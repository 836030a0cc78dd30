//! Shard moves: one node (the taker) pulls a shard from its owner while the owner keeps serving
//! it, then the owner is changed in etcd by compare-and-swap on the shard's epoch. Nothing here
//! depends on timing for correctness: who may write a shard is decided by its entry in etcd
//! alone, checked on every write.
//!
//! The steps of a move of shard s from A (serving at epoch e) to B, driven by B
//! ([`pull_shard`]), asked by the placement coordinator ([`coordinate`](crate::coordinator::coordinate)):
//! 1. B opens `Cluster/ShardStream` on A. A takes a snapshot of its local shard (which pins its
//!    WAL from the snapshot's checkpoint on, so nothing B still needs is truncated) and sends
//!    it; B restores it into a local copy it does not serve (listed in `incoming`, so that
//!    reconciliation leaves it alone).
//! 2. A then sends the WAL entries after the snapshot as they become durable; B appends each at
//!    the same sequence number (`Collection::append_copied`), so the copy is the same log and
//!    read tokens keep their meaning.
//! 3. Once B is close behind, B fences the shard in etcd: (A, e, serving) -> (A, e + 1, fenced,
//!    moving to B). Every node refuses writes to a fenced shard (retryable ABORTED; routers wait
//!    for the map to change and retry), and so does A if it restarts meanwhile.
//! 4. A sees the fence in its view, takes the shard's write gate exclusively (waiting for every
//!    write that passed its epoch check before the fence), syncs its WAL, sends the entries up
//!    to its last one L, and ends the stream with L. Every write A acknowledged is at or before L.
//! 5. B appends up to L, syncs, and flips the shard: (A, e + 1, fenced) -> (B, e + 2, serving).
//!    Routers retry on B; A drops its copy when it sees the flip.
//! 6. Any failure before the flip lifts the fence: (A, e + 1, fenced) -> (A, e + 2, serving),
//!    and B drops its copy (only once the map says the shard is not B's). A fence whose taker
//!    died is lifted by the coordinator; one whose taker restarted, by the taker itself.
//!    Searches read A's copy until the flip.
//!
//! Files: `stream.rs` is the owner's side (the `ShardStream` a move's taker or a replica's seed
//! reads), `pull.rs` the taker's side of a move (`pull_shard`: copy, fence, flip, or lift the
//! fence), `seed.rs` a replica's copy of its primary's snapshot and tail (`start_seed`), and
//! `handover.rs` the hand-over of a replicated shard's primary to an in-sync replica. This file
//! holds what they share: the limits and opening
//! an owner's stream with its snapshot restored ([`open_and_restore`]). The placement
//! coordinator that asks for moves and hand-overs is `crate::coordinator`.

mod handover;
mod pull;
mod seed;
mod stream;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tarn_cluster::ShardName;
use tarn_collection::Collection;
use tarn_proto::v1 as pb;
use tonic::Status;

use crate::cluster::ClusterNode;
use crate::snapshots::RestoreUpload;
use crate::status::ApiError;

pub(crate) use handover::{hand_over, lift_handover, start_handovers};
pub(crate) use pull::lift_fence;
pub use pull::pull_shard;
pub(crate) use seed::start_seed;
pub use stream::shard_stream;

/// The taker fences the shard only once it is at most this many entries behind, so that the
/// write pause (fence to flip) covers a short backlog.
const FENCE_LAG_ENTRIES: u64 = 128;
/// A taker that has not come that close after this long gives up (no fence was set: writes
/// never paused); the coordinator backs off before it tries the shard again. A replica's seed
/// gives up too, and its follower asks for another after a pause.
const CATCH_UP_LIMIT: Duration = Duration::from_secs(120);

/// [`CATCH_UP_LIMIT`], or (test builds) the milliseconds `moves::catch_up_limit_ms` returns.
fn catch_up_limit() -> Duration {
    Duration::from_millis(crate::faults::tunable(
        "moves::catch_up_limit_ms",
        CATCH_UP_LIMIT.as_millis() as u64,
    ))
}
/// From the fence to the owner's last entry: past this the move is abandoned, the fence lifted.
const HANDOVER_LIMIT: Duration = Duration::from_secs(15);
/// A stream that says nothing for this long is broken.
const STREAM_SILENCE_LIMIT: Duration = Duration::from_secs(30);
/// How long the coordinator waits for one move.
pub(crate) const MOVE_LIMIT: Duration = Duration::from_secs(3600);

pub(crate) fn peer_error(what: &str, status: Status) -> ApiError {
    let message = format!("{what}: {}", status.message());
    match status.code() {
        tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Cancelled => {
            ApiError::Unavailable(message)
        }
        tonic::Code::Aborted => ApiError::StaleShardMap(message),
        _ => ApiError::Aborted(message),
    }
}

/// The next message of a shard stream, within `limit`.
async fn next_message(
    stream: &mut tonic::Streaming<pb::ShardStreamMessage>,
    limit: Duration,
) -> Result<pb::ShardStreamMessage, ApiError> {
    match tokio::time::timeout(limit, stream.message()).await {
        Ok(Ok(Some(message))) => Ok(message),
        Ok(Ok(None)) => Err(ApiError::Unavailable(
            "the owner ended the shard stream early".to_owned(),
        )),
        Ok(Err(status)) => Err(peer_error("the shard stream", status)),
        Err(_) => Err(ApiError::Unavailable(format!(
            "the shard stream said nothing for {limit:?}"
        ))),
    }
}

/// Log entries as `append_copied` takes them: (sequence number, payload).
type CopiedEntries = Vec<(u64, Arc<[u8]>)>;

/// A shard stream's WAL entries as `append_copied` takes them, and their payloads' bytes.
fn copied_batch(entries: Vec<pb::ShardWalEntry>) -> (CopiedEntries, u64) {
    let batch: CopiedEntries = entries
        .into_iter()
        .map(|e| (e.seq_no, Arc::from(e.payload)))
        .collect();
    let n_bytes = batch.iter().map(|(_, p)| p.len() as u64).sum();
    (batch, n_bytes)
}

/// A shard stream opened on its owner, with the snapshot it began with restored into a local
/// copy (not served yet: the caller appends the stream's WAL entries next).
struct Restored {
    stream: tonic::Streaming<pb::ShardStreamMessage>,
    copy: Collection,
    info: tarn_collection::SnapshotInfo,
    /// Snapshot bytes received.
    n_bytes: u64,
    /// The owner's epoch history as of the snapshot.
    epochs: Vec<pb::EpochStart>,
}

/// Opens `owner`'s `ShardStream` of `shard` at `epoch` for this node (`replica`: a replica's
/// seed, else a move's pull) and restores the snapshot it starts with into the local copy
/// (which this node must not hold), counting the bytes in `counter`.
async fn open_and_restore(
    node: &Arc<ClusterNode>,
    shard: &ShardName,
    (owner, epoch): (&str, u64),
    replica: bool,
    counter: &AtomicU64,
) -> Result<Restored, ApiError> {
    let channel = node.peer(owner).await?;
    let mut client = pb::node_client::NodeClient::new(channel)
        .max_decoding_message_size(64 << 20)
        .max_encoding_message_size(64 << 20);
    let request = node.internal_request(
        pb::ShardStreamRequest {
            shard: shard.address(epoch),
            to_node: node.node_id.clone(),
            replica,
        },
        MOVE_LIMIT,
    );
    let mut stream = client
        .shard_stream(request)
        .await
        .map_err(|s| peer_error("opening the shard stream", s))?
        .into_inner();
    let local = shard.local_name();
    let target = node.registry.shard_restore_target(&local).await?;
    let mut upload = RestoreUpload::begin(&local, target)?;
    let mut n_bytes = 0u64;
    let epochs = loop {
        let message = next_message(&mut stream, STREAM_SILENCE_LIMIT).await?;
        if !message.snapshot.is_empty() {
            n_bytes += message.snapshot.len() as u64;
            counter.fetch_add(message.snapshot.len() as u64, Ordering::Relaxed);
            if !upload.push(message.snapshot).await {
                break Vec::new();
            }
        }
        if message.snapshot_done {
            break message.epochs;
        }
    };
    let restore = upload.finish().await?;
    let (copy, info) = node.registry.adopt_restore(&local, restore).await?;
    Ok(Restored {
        stream,
        copy,
        info,
        n_bytes,
        epochs,
    })
}
