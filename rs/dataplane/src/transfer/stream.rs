//! The owner's side of a shard's copy: `Cluster/ShardStream` ([`shard_stream`]), a thread that
//! sends the shard's snapshot and then its WAL entries as they become durable, to a move's
//! taker (ending with the hand-over: the fence seen, writes drained, the last entry sent) or to
//! a replica being seeded (ending when the replica has caught up and closes the stream).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tarn_cluster::{ShardName, ShardState};
use tarn_collection::Collection;
use tarn_proto::v1 as pb;
use tokio::sync::mpsc;
use tonic::Status;

use crate::cluster::ClusterNode;
use crate::status::ApiError;

/// Snapshot bytes per stream message.
const SNAPSHOT_CHUNK_BYTES: usize = 256 << 10;
/// WAL payload bytes per stream message, about.
const ENTRIES_BATCH_BYTES: usize = 1 << 20;
/// How often the owner looks for new durable entries when it has sent them all.
const TAIL_POLL: Duration = Duration::from_millis(2);
/// How often an idle stream tells the taker where the owner's log is.
const HEARTBEAT: Duration = Duration::from_millis(50);
/// An owner's stream whose taker reads nothing for this long ends (releasing its WAL pin).
const STREAM_IDLE_LIMIT: Duration = Duration::from_secs(30);
/// Most shard streams a node sends at once (each is a thread and a WAL pin).
const MAX_STREAMS_OUT: u64 = 4;

/// Where a shard stands for the stream that sends it to `to`.
enum Handover {
    /// Still serving at the stream's epoch: keep sending.
    NotYet,
    /// Fenced for `to` at the next epoch: drain and finish.
    Fenced,
    /// Anything else: the move is off.
    Off(String),
}

fn handover(node: &ClusterNode, shard: &ShardName, epoch: u64, to: &str) -> Handover {
    let state = node.state();
    let Some(a) = state.assignment(shard) else {
        return Handover::Off("the collection was dropped".to_owned());
    };
    if a.owner == node.node_id && a.epoch == epoch && a.takes_writes() {
        Handover::NotYet
    } else if a.owner == node.node_id
        && a.epoch == epoch + 1
        && a.state == ShardState::Fenced
        && a.moving_to.as_deref() == Some(to)
    {
        Handover::Fenced
    } else {
        Handover::Off(format!(
            "shard {} of collection '{}' is now node {}'s at epoch {} ({:?})",
            shard.shard, shard.collection, a.owner, a.epoch, a.state
        ))
    }
}

type StreamItem = Result<pb::ShardStreamMessage, Status>;

/// Starts sending the shard `request.shard` (an address `<local name>@<epoch>` this node owns
/// and serves) to `request.to_node`, on a thread of its own (snapshot and WAL reads are
/// blocking file I/O).
pub async fn shard_stream(
    node: Arc<ClusterNode>,
    request: pb::ShardStreamRequest,
) -> Result<tokio_stream::wrappers::ReceiverStream<StreamItem>, ApiError> {
    let Some((shard, Some(epoch))) = ShardName::parse(&request.shard) else {
        return Err(ApiError::invalid(
            "shard",
            format!("{:?} is not a shard address", request.shard),
        ));
    };
    if request.to_node.is_empty() || request.to_node == node.node_id {
        return Err(ApiError::invalid(
            "to_node",
            "the node taking the shard must be another node",
        ));
    }
    if !node.state().is_alive(&request.to_node) {
        return Err(ApiError::invalid(
            "to_node",
            format!("node {} is not a live node of the cluster", request.to_node),
        ));
    }
    if request.replica {
        let is_replica = node.state().assignment(&shard).is_some_and(|a| {
            matches!(
                a.role_of(&request.to_node),
                Some(tarn_cluster::CopyRole::InSyncReplica | tarn_cluster::CopyRole::CatchingUp)
            )
        });
        if !is_replica {
            return Err(ApiError::invalid(
                "to_node",
                format!(
                    "node {} is not a replica of shard {} of collection '{}'",
                    request.to_node, shard.shard, shard.collection
                ),
            ));
        }
    }
    let collection = node.local_shard_for_write(&shard, epoch).await?.collection;
    if node.moves.streams_out.fetch_add(1, Ordering::Relaxed) >= MAX_STREAMS_OUT {
        node.moves.streams_out.fetch_sub(1, Ordering::Relaxed);
        return Err(ApiError::Unavailable(format!(
            "node {} is sending {MAX_STREAMS_OUT} shards already; retry later",
            node.node_id
        )));
    }
    let (tx, rx) = mpsc::channel::<StreamItem>(4);
    let name = shard.local_name();
    let slot_holder = Arc::clone(&node);
    std::thread::Builder::new()
        .name(format!("tarn-move-out-{}", shard.shard))
        .spawn(move || {
            let outcome = send_shard(
                &node,
                &collection,
                (&shard, epoch, request.replica),
                &request.to_node,
                &tx,
            );
            node.moves.streams_out.fetch_sub(1, Ordering::Relaxed);
            match outcome {
                Ok(Some(last)) => {
                    tracing::info!(shard = %name, to = %request.to_node, last_seq_no = last, "shard handed over")
                }
                Ok(None) => {
                    tracing::info!(shard = %name, to = %request.to_node, "shard stream closed by the taker")
                }
                Err(error) => {
                    tracing::warn!(shard = %name, to = %request.to_node, %error, "shard stream failed");
                    let _ = tx.try_send(Err(Status::from(error)));
                }
            }
        })
        .map_err(|e| {
            // The thread never ran: its slot is given back here.
            slot_holder.moves.streams_out.fetch_sub(1, Ordering::Relaxed);
            ApiError::Internal(format!("cannot start a shard stream thread: {e}"))
        })?;
    Ok(tokio_stream::wrappers::ReceiverStream::new(rx))
}

/// The stream thread: snapshot, tail, hand-over. `Ok(None)` when the taker went away.
fn send_shard(
    node: &ClusterNode,
    collection: &Collection,
    (shard, epoch, replica): (&ShardName, u64, bool),
    to: &str,
    tx: &mpsc::Sender<StreamItem>,
) -> Result<Option<u64>, ApiError> {
    let idle_limit = stream_idle_limit();
    let send = |message: pb::ShardStreamMessage| send_within(tx, message, idle_limit);
    let mut snapshot = collection.snapshot()?;
    let mut buf = vec![0u8; SNAPSHOT_CHUNK_BYTES];
    loop {
        let n = std::io::Read::read(&mut snapshot, &mut buf)
            .map_err(|e| ApiError::Internal(format!("reading the shard's snapshot: {e}")))?;
        if n == 0 {
            break;
        }
        let message = pb::ShardStreamMessage {
            snapshot: buf[..n].to_vec(),
            ..Default::default()
        };
        if !send(message) {
            return Ok(None);
        }
    }
    let mut tail = collection.wal_tail(snapshot);
    if !send(pb::ShardStreamMessage {
        snapshot_done: true,
        head_seq_no: tail.durable_seq(),
        epochs: epochs_on_wire(collection)?,
        ..Default::default()
    }) {
        return Ok(None);
    }
    let entries_message = |batch: Vec<(u64, Arc<[u8]>)>, head: u64| pb::ShardStreamMessage {
        entries: batch
            .into_iter()
            .map(|(seq_no, payload)| pb::ShardWalEntry {
                seq_no,
                payload: payload.to_vec(),
            })
            .collect(),
        head_seq_no: head,
        ..Default::default()
    };
    let mut last_sent = Instant::now();
    loop {
        match handover(node, shard, epoch, to) {
            Handover::NotYet => {}
            // A replica's seed ends when it has caught up (it closes the stream).
            Handover::Fenced if replica => {
                return Err(ApiError::StaleShardMap(
                    "a move is handing the shard over".to_owned(),
                ))
            }
            Handover::Fenced => break,
            Handover::Off(why) => return Err(ApiError::StaleShardMap(why)),
        }
        let batch = tail.read(u64::MAX, ENTRIES_BATCH_BYTES)?;
        if batch.is_empty() {
            if tx.is_closed() {
                return Ok(None);
            }
            if last_sent.elapsed() >= HEARTBEAT {
                if !send(entries_message(Vec::new(), tail.durable_seq())) {
                    return Ok(None);
                }
                last_sent = Instant::now();
            }
            std::thread::sleep(TAIL_POLL);
            continue;
        }
        if !send(entries_message(batch, tail.durable_seq())) {
            return Ok(None);
        }
        last_sent = Instant::now();
    }
    // Fenced: every write that passed its epoch check before this node saw the fence holds
    // the gate shared until acknowledged; taking it exclusively waits for them. Later writes
    // find the fence and are refused.
    let saw_fence = Instant::now();
    let gate = node.gate(&shard.local_name());
    let drained = gate.blocking_write();
    let drain_ms = saw_fence.elapsed().as_secs_f64() * 1e3;
    let last = collection.sync_wal_blocking()?;
    drop(drained);
    // The owner's part of the write pause, for the log (the taker logs the whole of it).
    tracing::info!(shard = %shard.local_name(), drain_ms,
        sync_ms = saw_fence.elapsed().as_secs_f64() * 1e3 - drain_ms,
        "hand-over: fence seen, writes drained, log synced");
    loop {
        let batch = tail.read(last, ENTRIES_BATCH_BYTES)?;
        if batch.is_empty() {
            break;
        }
        if !send(entries_message(batch, last)) {
            return Ok(None);
        }
    }
    if tail.next_seq() != last + 1 {
        return Err(ApiError::Internal(format!(
            "the shard's log ends at {last} but its tail stopped before {}",
            tail.next_seq()
        )));
    }
    let epochs = epochs_on_wire(collection)?;
    if !send(pb::ShardStreamMessage {
        handed_over: true,
        last_seq_no: last,
        head_seq_no: last,
        epochs,
        ..Default::default()
    }) {
        return Ok(None);
    }
    Ok(Some(last))
}

/// A copy's epoch history, for the wire.
fn epochs_on_wire(collection: &Collection) -> Result<Vec<pb::EpochStart>, ApiError> {
    Ok(collection
        .epoch_starts()?
        .into_iter()
        .map(|(epoch, first_seq)| pb::EpochStart { epoch, first_seq })
        .collect())
}

/// [`STREAM_IDLE_LIMIT`]; test builds shorten it with the fail point
/// `moves::stream_idle_ms=return(<ms>)`.
fn stream_idle_limit() -> Duration {
    #[cfg(feature = "failpoints")]
    if let Some(Some(ms)) = fail::eval("moves::stream_idle_ms", |arg| {
        arg.and_then(|a| a.parse::<u64>().ok())
    }) {
        return Duration::from_millis(ms);
    }
    STREAM_IDLE_LIMIT
}

/// Sends one message, waiting at most `limit` for the taker to make room; `false` if the
/// taker went away or read nothing for that long (the stream then ends, and its snapshot's WAL
/// pin goes with it).
fn send_within(
    tx: &mpsc::Sender<StreamItem>,
    message: pb::ShardStreamMessage,
    limit: Duration,
) -> bool {
    let deadline = Instant::now() + limit;
    let mut item = Ok(message);
    loop {
        match tx.try_send(item) {
            Ok(()) => return true,
            Err(mpsc::error::TrySendError::Closed(_)) => return false,
            Err(mpsc::error::TrySendError::Full(back)) => {
                if Instant::now() >= deadline {
                    tracing::warn!(
                        limit_s = limit.as_secs(),
                        "a shard stream's taker read nothing; ending the stream"
                    );
                    return false;
                }
                item = back;
                std::thread::sleep(TAIL_POLL);
            }
        }
    }
}
