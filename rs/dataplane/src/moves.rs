//! Shard moves: one node (the taker) pulls a shard from its owner while the owner keeps serving
//! it, then the owner is changed in etcd by compare-and-swap on the shard's epoch. Nothing here
//! depends on timing for correctness: who may write a shard is decided by its entry in etcd
//! alone, checked on every write.
//!
//! The steps of a move of shard s from A (serving at epoch e) to B, driven by B
//! ([`pull_shard`]), asked by the placement coordinator ([`coordinate`]):
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

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use tarn_cluster::{
    HandoverStep, PlannedHandover, PlannedMove, ShardAssignment, ShardName, ShardState,
};
use tarn_collection::{Collection, Durability};
use tarn_proto::v1 as pb;
use tokio::sync::mpsc;
use tonic::Status;

use crate::cluster::ClusterNode;
use crate::snapshots::RestoreUpload;
use crate::status::ApiError;

/// Snapshot bytes per stream message.
const SNAPSHOT_CHUNK_BYTES: usize = 256 << 10;
/// WAL payload bytes per stream message, about.
const ENTRIES_BATCH_BYTES: usize = 1 << 20;
/// How often the owner looks for new durable entries when it has sent them all.
const TAIL_POLL: Duration = Duration::from_millis(2);
/// How often an idle stream tells the taker where the owner's log is.
const HEARTBEAT: Duration = Duration::from_millis(50);
/// The taker fences the shard only once it is at most this many entries behind, so that the
/// write pause (fence to flip) covers a short backlog.
const FENCE_LAG_ENTRIES: u64 = 128;
/// A taker that has not come that close after this long gives up (no fence was set: writes
/// never paused); the coordinator backs off before it tries the shard again.
const CATCH_UP_LIMIT: Duration = Duration::from_secs(120);
/// From the fence to the owner's last entry: past this the move is abandoned, the fence lifted.
const HANDOVER_LIMIT: Duration = Duration::from_secs(15);
/// How long a primary's hand-over to its in-sync replica may take on the old primary, from
/// seeing the fence to the promotion (draining its writes, its replicas taking its last
/// entries); past it the fence is lifted.
const REPLICA_HANDOVER_LIMIT: Duration = Duration::from_secs(10);
/// A stream that says nothing for this long is broken.
const STREAM_SILENCE_LIMIT: Duration = Duration::from_secs(30);
/// An owner's stream whose taker reads nothing for this long ends (releasing its WAL pin).
const STREAM_IDLE_LIMIT: Duration = Duration::from_secs(30);
/// Most shard streams a node sends at once (each is a thread and a WAL pin).
const MAX_STREAMS_OUT: u64 = 4;
/// How long the coordinator waits for one move.
const MOVE_LIMIT: Duration = Duration::from_secs(3600);
/// How long a taker keeps trying to learn whether its flip landed when etcd does not say.
const FLIP_CONFIRM_LIMIT: Duration = Duration::from_secs(60);
/// The election of the placement coordinator.
const ELECTION: &str = "placement";

/// Counters of this node's moves (for metrics).
#[derive(Debug, Default)]
pub struct MoveCounters {
    /// Pulls running on this node (as the taker).
    pub in_progress: AtomicU64,
    pub finished: AtomicU64,
    pub failed: AtomicU64,
    /// Bytes received by pulls: snapshots and WAL entries.
    pub bytes: AtomicU64,
    /// Streams running on this node (as the owner).
    pub streams_out: AtomicU64,
    /// The last finished move's write pause (fence to flip), microseconds.
    pub last_write_pause_us: AtomicU64,
    /// Failovers this node landed as the placement coordinator.
    pub failovers: AtomicU64,
    /// Bytes received seeding replica copies (snapshots and WAL entries).
    pub seed_bytes: AtomicU64,
    /// Replica copies seeded here, finished.
    pub seeds: AtomicU64,
}

// ---------------------------------------------------------------------------------------------
// The owner's side: `Cluster/ShardStream`.

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

/// Test builds: a pause at a named point of a move, set by a fail point `<name>=return(<ms>)`
/// (the `FAILPOINTS` environment variable), so that tests can kill a process inside a step.
pub(crate) async fn pause_point(name: &str) {
    #[cfg(feature = "failpoints")]
    if let Some(Some(ms)) = fail::eval(name, |arg| arg.and_then(|a| a.parse::<u64>().ok())) {
        tracing::warn!(point = name, ms, "pausing at a fail point");
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    #[cfg(not(feature = "failpoints"))]
    let _ = name;
}

/// Test builds: a failure at a named point of a move, set by a fail point `<name>=return`.
fn fail_point(name: &str) -> Result<(), ApiError> {
    #[cfg(feature = "failpoints")]
    if fail::eval(name, |_| ()).is_some() {
        return Err(ApiError::Unavailable(format!("fail point {name}")));
    }
    #[cfg(not(feature = "failpoints"))]
    let _ = name;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The taker's side: `Cluster/PullShard`.

/// Removes a shard from `incoming` (and counts the pull out) when the pull ends, however.
struct Incoming<'a> {
    node: &'a ClusterNode,
    local: String,
}

impl Drop for Incoming<'_> {
    fn drop(&mut self) {
        self.node.incoming.remove(&self.local);
        self.node.moves.in_progress.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Pulls a shard to this node (see the module documentation); answers once this node owns it
/// at a new epoch, or with why not (the old owner then still serves it).
pub async fn pull_shard(
    node: &Arc<ClusterNode>,
    request: pb::PullShardRequest,
) -> Result<pb::PullShardResponse, ApiError> {
    let map = node.map(&request.collection).await?;
    let Some(assignment) = map.shards.get(request.shard as usize).cloned() else {
        return Err(ApiError::invalid(
            "shard",
            format!(
                "collection '{}' has {} shards",
                map.def.name, map.def.n_shards
            ),
        ));
    };
    if assignment.epoch != request.epoch || !assignment.takes_writes() {
        return Err(ApiError::StaleShardMap(format!(
            "shard {} of collection '{}' is at epoch {} ({:?}), not at the planned {}",
            request.shard, map.def.name, assignment.epoch, assignment.state, request.epoch
        )));
    }
    if assignment.owner == node.node_id {
        return Err(ApiError::invalid(
            "shard",
            format!(
                "shard {} of collection '{}' is already this node's",
                request.shard, map.def.name
            ),
        ));
    }
    let shard = ShardName {
        collection: map.def.name.clone(),
        uid: map.def.uid,
        shard: request.shard,
    };
    let local = shard.local_name();
    if node.incoming.insert(local.clone(), ()).is_some() {
        return Err(ApiError::Aborted(format!(
            "shard {} of collection '{}' is already being pulled here",
            request.shard, map.def.name
        )));
    }
    node.moves.in_progress.fetch_add(1, Ordering::Relaxed);
    let _incoming = Incoming {
        node,
        local: local.clone(),
    };
    // Nothing else creates, replaces or removes the local copy while the pull runs.
    let lock = node.copy_lock(&local);
    let _copy = lock.lock().await;
    // A copy already here (left by an earlier move that failed here, or this node's copy from
    // before its data was given up): judged like any copy that is not this node's.
    if node.registry.get_shard(&local).is_ok() {
        node.incoming.remove(&local);
        let retired = node.retire_copy(&local, &shard).await;
        node.incoming.insert(local.clone(), ());
        if !retired || node.registry.get_shard(&local).is_ok() {
            return Err(ApiError::Unavailable(format!(
                "shard {} of collection '{}': this node holds a copy that cannot be retired yet",
                request.shard, map.def.name
            )));
        }
    }

    let mut fence: Option<ShardAssignment> = None;
    let outcome = copy_and_flip(node, &shard, &assignment, &mut fence).await;
    match outcome {
        Ok(response) => {
            node.moves.finished.fetch_add(1, Ordering::Relaxed);
            node.moves.last_write_pause_us.store(
                (response.write_pause_seconds * 1e6) as u64,
                Ordering::Relaxed,
            );
            tracing::info!(shard = %local, from = %assignment.owner, epoch = response.epoch,
                bytes = response.bytes, entries = response.entries,
                seconds = response.seconds, write_pause_s = response.write_pause_seconds,
                "shard moved here");
            Ok(response)
        }
        Err(error) => {
            node.moves.failed.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(shard = %local, from = %assignment.owner, %error, "shard move failed");
            if let Some(fence) = &fence {
                lift_fence(node, &shard, fence).await;
            }
            // This pull's copy goes only once a linearizable read shows the shard is not this
            // node's: after a flip whose answer was lost, the copy IS the shard, whatever this
            // node's (lagging) view says. Unread, the copy stays for reconciliation.
            match node
                .store()
                .read_shard(&shard.collection, shard.uid, shard.shard)
                .await
            {
                Ok(tarn_cluster::ShardRecord::Assigned(a)) if a.owner == node.node_id => {
                    tracing::warn!(shard = %local, epoch = a.epoch, "the move failed after its flip landed: the copy is this node's shard");
                }
                Ok(tarn_cluster::ShardRecord::Assigned(a))
                    if a.moving_to.as_deref() != Some(node.node_id.as_str()) =>
                {
                    if let Err(drop_error) = node.registry.drop_shard(&local).await {
                        tracing::error!(shard = %local, error = %drop_error, "could not drop a failed move's copy");
                    }
                }
                Ok(record) => {
                    tracing::info!(shard = %local, ?record, "a failed move's copy is left for reconciliation")
                }
                Err(read_error) => {
                    tracing::warn!(shard = %local, error = %read_error, "a failed move's copy stays until its record can be read")
                }
            }
            Err(error)
        }
    }
}

fn peer_error(what: &str, status: Status) -> ApiError {
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

/// Seeds this node's copy of a shard it is a replica of from the primary's snapshot and tail,
/// in a task of its own (the primary's follower asked, finding the copy unable to follow by
/// log: no copy, the primary's log no longer holds what it lacks, or a checkpoint holds
/// entries it would have to cut). Meanwhile the shard is listed in `incoming`, and the
/// replica's `AppendEntries` answers `seeding`. A copy already here is set aside first (never
/// deleted: `tarn cluster set-aside`), the snapshot restored into a fresh one, and the tail
/// appended at the same sequence numbers until the copy is within [`FENCE_LAG_ENTRIES`] of
/// the primary's log; then the stream ends and the follower ships the rest by log.
pub(crate) fn start_seed(node: &Arc<ClusterNode>, shard: ShardName, primary: String, epoch: u64) {
    let local = shard.local_name();
    if node.incoming.insert(local.clone(), ()).is_some() {
        return;
    }
    let node = Arc::clone(node);
    tokio::spawn(async move {
        tracing::warn!(shard = %local, %primary, "seeding this replica from the primary's snapshot");
        let started = Instant::now();
        let outcome = seed(&node, &shard, &primary, epoch).await;
        node.incoming.remove(&local);
        match outcome {
            Ok((bytes, seq_no)) => {
                node.moves.seeds.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(shard = %local, %primary, bytes, seq_no,
                    seconds = started.elapsed().as_secs_f64(), "replica seeded; following by log");
            }
            Err(error) => {
                tracing::warn!(shard = %local, %primary, %error, "seeding this replica failed");
            }
        }
    });
}

/// A replica's seed from its primary, under the copy's lock; a seed that fails deletes the
/// unfinished copy it made (nothing of its own is in it: the primary holds all of it), so that
/// no failed seed leaves a full-size copy behind, and the next probe seeds again.
async fn seed(
    node: &Arc<ClusterNode>,
    shard: &ShardName,
    primary: &str,
    epoch: u64,
) -> Result<(u64, u64), ApiError> {
    let local = shard.local_name();
    let lock = node.copy_lock(&local);
    let _copy = lock.lock().await;
    let outcome = seed_locked(node, shard, primary, epoch).await;
    if outcome.is_err() && node.ledger.is_seeding(&local) {
        if node.registry.get_shard(&local).is_ok() {
            if let Err(error) = node.registry.drop_shard(&local).await {
                tracing::warn!(shard = %local, %error, "could not delete a failed seed's copy");
                return outcome;
            }
        }
        let name = local.clone();
        if let Err(error) = node
            .note_ledger(move |l| l.note_seeding(&name, false))
            .await
        {
            tracing::warn!(shard = %local, %error, "could not update the cluster ledger");
        }
    }
    outcome
}

/// [`seed`]'s work; the caller holds the copy's lock.
async fn seed_locked(
    node: &Arc<ClusterNode>,
    shard: &ShardName,
    primary: &str,
    epoch: u64,
) -> Result<(u64, u64), ApiError> {
    let local = shard.local_name();
    if node.registry.get_shard(&local).is_ok() {
        if node.ledger.is_seeding(&local) {
            // An earlier seed's unfinished copy: nothing of its own, so it goes (set aside,
            // every retry would leave one more full-size copy behind).
            node.registry.drop_shard(&local).await?;
        } else {
            node.registry
                .set_aside(
                    &local,
                    "replaced by a fresh copy of the primary's data: this replica's copy could \
                     not follow the primary's log",
                )
                .await?;
        }
    }
    let name = local.clone();
    node.note_ledger(move |l| l.note_seeding(&name, true))
        .await
        .map_err(|e| ApiError::Internal(format!("recording a seed in the cluster ledger: {e}")))?;
    let Restored {
        mut stream,
        copy,
        info,
        mut n_bytes,
        epochs,
    } = open_and_restore(node, shard, (primary, epoch), true, &node.moves.seed_bytes).await?;
    let history = tarn_cluster::EpochHistory::from_starts(
        epochs.iter().map(|e| (e.epoch, e.first_seq)).collect(),
    )
    .map_err(|why| ApiError::invalid("epochs", why))?;
    {
        let (copy, seq_no) = (copy.clone(), info.seq_no);
        let starts: Vec<(u64, u64)> = history
            .starts()
            .iter()
            .copied()
            .filter(|&(_, start)| start <= seq_no + 1)
            .collect();
        tokio::task::spawn_blocking(move || copy.set_epoch_starts(starts))
            .await
            .map_err(|e| ApiError::Internal(e.to_string()))??;
    }
    let mut applied = info.seq_no;
    // A seed that cannot come close to a busy primary's log gives up, as a move's pull does:
    // its stream slot and the primary's WAL pin go, and the follower tries again later.
    let started = std::time::Instant::now();
    loop {
        if started.elapsed() > CATCH_UP_LIMIT {
            return Err(ApiError::Unavailable(format!(
                "the seed of shard {} of collection '{}' did not come within {FENCE_LAG_ENTRIES} \
                 entries of the primary's log in {} s",
                shard.shard,
                shard.collection,
                CATCH_UP_LIMIT.as_secs()
            )));
        }
        fail_point("moves::seed_tail")?;
        let message = next_message(&mut stream, STREAM_SILENCE_LIMIT).await?;
        if !message.entries.is_empty() {
            let (batch, batch_bytes) = copied_batch(message.entries);
            n_bytes += batch_bytes;
            node.moves
                .seed_bytes
                .fetch_add(batch_bytes, Ordering::Relaxed);
            let (first, last) = (batch[0].0, batch[batch.len() - 1].0);
            crate::replica_set::record_epochs(&copy, &history, first, last).await?;
            // Written, not synced, batch by batch: one sync at the end makes them durable.
            applied = copy.append_copied(batch, Durability::Written).await?;
        }
        if message.head_seq_no.saturating_sub(applied) <= FENCE_LAG_ENTRIES {
            copy.sync_wal().await?;
            let name = local.clone();
            node.note_ledger(move |l| l.note_seeding(&name, false))
                .await
                .map_err(|e| {
                    ApiError::Internal(format!("recording a seed in the cluster ledger: {e}"))
                })?;
            return Ok((n_bytes, applied));
        }
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
    let target = node.registry.shard_restore_target(&local)?;
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

async fn copy_and_flip(
    node: &Arc<ClusterNode>,
    shard: &ShardName,
    from: &ShardAssignment,
    fence: &mut Option<ShardAssignment>,
) -> Result<pb::PullShardResponse, ApiError> {
    let started = Instant::now();
    fail_point("moves::fail_pull")?;
    // 1. The snapshot, into a copy this node does not serve yet.
    let local = shard.local_name();
    let Restored {
        mut stream,
        copy,
        info,
        mut n_bytes,
        ..
    } = open_and_restore(
        node,
        shard,
        (&from.owner, from.epoch),
        false,
        &node.moves.bytes,
    )
    .await?;
    let mut applied = info.seq_no;
    tracing::info!(shard = %local, from = %from.owner, seq_no = applied, n_bytes, "shard snapshot copied; catching up");

    // 2-5. The tail, the fence, the hand-over.
    let catch_up_started = Instant::now();
    let mut fenced_at: Option<Instant> = None;
    // How long the fence's compare-and-swap took (writes are refused from its landing on).
    let mut fence_ms = 0.0;
    let mut n_entries = 0u64;
    let last = loop {
        let limit = match fenced_at {
            Some(at) => HANDOVER_LIMIT.saturating_sub(at.elapsed()),
            None => STREAM_SILENCE_LIMIT,
        };
        let message = next_message(&mut stream, limit).await?;
        if !message.entries.is_empty() {
            let (batch, batch_bytes) = copied_batch(message.entries);
            n_bytes += batch_bytes;
            n_entries += batch.len() as u64;
            node.moves.bytes.fetch_add(batch_bytes, Ordering::Relaxed);
            applied = copy.append_copied(batch, Durability::Written).await?;
        }
        if message.handed_over {
            if applied != message.last_seq_no {
                return Err(ApiError::Internal(format!(
                    "the copy ends at {applied} but the owner's log at {}",
                    message.last_seq_no
                )));
            }
            // The owner's epoch history goes with its log, so that the copy's entries keep
            // their epochs (a replica that followed the owner compares them with this copy's
            // when this node is its primary).
            let starts: Vec<(u64, u64)> = message
                .epochs
                .iter()
                .map(|e| (e.epoch, e.first_seq))
                .collect();
            if !starts.is_empty() {
                let copy = copy.clone();
                tokio::task::spawn_blocking(move || copy.set_epoch_starts(starts))
                    .await
                    .map_err(|e| ApiError::Internal(e.to_string()))??;
            }
            break message.last_seq_no;
        }
        let behind = message.head_seq_no.saturating_sub(applied);
        if fenced_at.is_none() && behind > FENCE_LAG_ENTRIES {
            if catch_up_started.elapsed() > CATCH_UP_LIMIT {
                return Err(ApiError::Aborted(format!(
                    "cannot catch up: still {behind} entries behind the owner after {} s of \
                     copying (the shard takes writes faster than they can be copied); writes \
                     were never paused",
                    CATCH_UP_LIMIT.as_secs()
                )));
            }
            continue;
        }
        if fenced_at.is_none() {
            pause_point("moves::before_fence").await;
            let fence_started = Instant::now();
            let fenced = from.fenced_for(&node.node_id);
            let swapped = node
                .store()
                .compare_and_set_shard(&swap(shard, from.epoch, &fenced))
                .await
                .map_err(|e| ApiError::ClusterStore(e.to_string()))?;
            if !swapped {
                return Err(ApiError::StaleShardMap(format!(
                    "shard {} of collection '{}' changed before it could be fenced",
                    shard.shard, shard.collection
                )));
            }
            *fence = Some(fenced);
            fence_ms = fence_started.elapsed().as_secs_f64() * 1e3;
            fenced_at = Some(Instant::now());
            tracing::info!(shard = %local, from = %from.owner, "shard fenced; taking over");
            pause_point("moves::after_fence").await;
        }
    };
    // The write pause's phases, for the log: until the owner's last entry arrived, until the
    // copy was synced, until the flip landed (milliseconds from the fence).
    let since_fence = |at: Option<Instant>| at.map_or(0.0, |at| at.elapsed().as_secs_f64() * 1e3);
    let handed_over_ms = since_fence(fenced_at);
    copy.sync_wal().await?;
    let synced_ms = since_fence(fenced_at);
    let fenced = fence
        .clone()
        .ok_or_else(|| ApiError::Internal("handed over without a fence".to_owned()))?;
    let owned = fenced.handed_over(&node.incarnation);
    flip(node, shard, &fenced, &owned).await?;
    let write_pause = fenced_at.map_or(0.0, |at| at.elapsed().as_secs_f64());
    tracing::info!(shard = %shard.local_name(), fence_ms = fence_ms, handed_over_ms, synced_ms,
        flipped_ms = write_pause * 1e3, "hand-over phases");
    node.wait_for_view(Duration::from_secs(5), |s| {
        s.assignment(shard).is_some_and(|a| a.epoch >= owned.epoch)
    })
    .await;
    Ok(pb::PullShardResponse {
        epoch: fenced.epoch + 1,
        bytes: n_bytes,
        entries: n_entries,
        last_seq_no: last,
        seconds: started.elapsed().as_secs_f64(),
        write_pause_seconds: write_pause,
    })
}

/// The flip: fenced -> this node's. An answer lost on the way (etcd unreachable) is settled by
/// reading the shard back until etcd says.
async fn flip(
    node: &ClusterNode,
    shard: &ShardName,
    fenced: &ShardAssignment,
    owned: &ShardAssignment,
) -> Result<(), ApiError> {
    let store = node.store();
    let deadline = Instant::now() + FLIP_CONFIRM_LIMIT;
    loop {
        match store
            .compare_and_set_shard(&swap(shard, fenced.epoch, owned))
            .await
        {
            Ok(true) => return Ok(()),
            Ok(false) => {
                // Either an earlier attempt landed (its answer lost), or the fence was lifted:
                // etcd says which (a linearizable read, never this node's lagging view).
                let record = store
                    .read_shard(&shard.collection, shard.uid, shard.shard)
                    .await;
                match record {
                    Ok(tarn_cluster::ShardRecord::Assigned(a)) if a == *owned => return Ok(()),
                    Ok(other) => {
                        return Err(ApiError::StaleShardMap(format!(
                            "the fence of shard {} of collection '{}' was lifted before the \
                             flip (now {other:?})",
                            shard.shard, shard.collection
                        )))
                    }
                    Err(error) if Instant::now() < deadline => {
                        tracing::warn!(%error, "confirming a moved shard's flip: etcd did not answer; retrying");
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                    Err(error) => return Err(ApiError::ClusterStore(error.to_string())),
                }
            }
            Err(error) if Instant::now() < deadline => {
                tracing::warn!(%error, "flipping a moved shard: etcd did not answer; retrying");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(error) => return Err(ApiError::ClusterStore(error.to_string())),
        }
    }
}

/// A swap of `shard` (of its collection's incarnation) planned at `epoch`.
fn swap<'a>(
    shard: &'a ShardName,
    epoch: u64,
    new: &'a ShardAssignment,
) -> tarn_cluster::ShardSwap<'a> {
    tarn_cluster::ShardSwap {
        collection: &shard.collection,
        uid: shard.uid,
        shard: shard.shard,
        expected_epoch: epoch,
        new,
        unless_registered: None,
        unless_registered_from: None,
        registered: None,
        expected: None,
    }
}

/// Lifts a move's fence: the old owner serves the shard again at the next epoch. Logged, not
/// returned: a fence that stays is lifted later by the coordinator or by its taker's
/// reconciliation.
pub(crate) async fn lift_fence(node: &ClusterNode, shard: &ShardName, fence: &ShardAssignment) {
    let back = fence.fence_lifted();
    let (collection, shard_no) = (&shard.collection, shard.shard);
    match node
        .store()
        .compare_and_set_shard(&swap(shard, fence.epoch, &back))
        .await
    {
        Ok(true) => {
            tracing::info!(%collection, shard = shard_no, owner = %fence.owner, epoch = back.epoch, "move abandoned; the fence is lifted")
        }
        Ok(false) => {}
        Err(error) => {
            tracing::warn!(%collection, shard = shard_no, %error, "could not lift a move's fence yet")
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The placement coordinator.

/// Runs for the life of the node: campaigns in etcd's election, and while elected, lifts the
/// fences of takers that died, promotes in-sync replicas of dead primaries, re-replicates, and
/// carries out [`plan_move`]'s moves and [`tarn_cluster::plan_handover`]'s hand-overs one at a
/// time, each as a task of its own ([`run_step`]) so that failovers never wait behind a move.
/// Several coordinators at once (an election lost without knowing) stay safe: every change is
/// a compare-and-swap on the shard's epoch or whole record.
pub(crate) async fn coordinate(node: Weak<ClusterNode>) {
    loop {
        let Some((store, node_id)) = node
            .upgrade()
            .map(|n| (Arc::clone(n.store()), n.node_id.clone()))
        else {
            return;
        };
        let leader = match store.campaign(ELECTION, &node_id).await {
            Ok(leader) => leader,
            Err(error) => {
                tracing::debug!(%error, "placement election: etcd unavailable; retrying");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        tracing::info!(%node_id, "this node is the placement coordinator");
        // Since when each node holding copies has been dead, as this coordinator saw it (a new
        // coordinator starts the clocks again: it may only wait longer).
        let mut dead_since: std::collections::HashMap<String, Instant> = Default::default();
        // The move or hand-over under way ([`run_step`]).
        let mut step_task: Option<tokio::task::JoinHandle<()>> = None;
        while leader.is_leader() {
            let Some(node) = node.upgrade() else {
                return;
            };
            // A receiver marked as having seen the state planned from, so that the wait below
            // wakes on the next change only. (Waiting on a fresh clone of the node's receiver,
            // never marked seen, returned at once every time: the loop spun a core at idle.)
            let mut watch = node.watch();
            let state = Arc::clone(&watch.borrow_and_update());
            for map in state.collections.values() {
                for (shard, a) in map.shards.iter().enumerate() {
                    let Some(taker) = &a.moving_to else {
                        continue;
                    };
                    let name = ShardName {
                        collection: map.def.name.clone(),
                        uid: map.def.uid,
                        shard: shard as u32,
                    };
                    if a.is_replica_handover() {
                        // The old primary drives a hand-over: lifted if it or the replica died.
                        if !state.is_alive(taker) || !state.is_alive(&a.owner) {
                            lift_handover(&node, &name, a.epoch).await;
                        }
                    } else if !state.is_alive(taker) {
                        lift_fence(&node, &name, a).await;
                    }
                }
            }
            promote_replicas(&node, &state).await;
            drop_replaced_copies(&node, &state).await;
            rereplicate(&node, &state, &mut dead_since).await;
            // One move or hand-over at a time, as a task of its own: the rounds above go on
            // while it runs (a move copies for up to an hour; a failover must not wait for it).
            if let Some(running) = step_task.as_mut().filter(|task| !task.is_finished()) {
                drop(node);
                tokio::select! {
                    _ = watch.changed() => {}
                    _ = running => {}
                    _ = tokio::time::sleep(Duration::from_secs(2)) => {}
                }
                continue;
            }
            step_task = None;
            // A replicated collection's primaries move by hand-over, the others by copying.
            // A shard whose moves failed waits out its backoff while the others go on (it is
            // not planned meanwhile: one shard that cannot move holds up no drain).
            let now = unix_ms();
            let backing_off = |collection: &str, shard: u32| {
                state
                    .move_failures
                    .get(&(collection.to_owned(), shard))
                    .is_some_and(|f| !f.may_retry_at(now))
            };
            let step = match tarn_cluster::plan_handover_skipping(&state, &backing_off) {
                Some(handover) => Some(Step::HandOver(Box::new(handover))),
                None => tarn_cluster::plan_move_skipping(&state, &backing_off).map(Step::Move),
            };
            let Some(step) = step else {
                drop(node);
                let _ = tokio::time::timeout(Duration::from_secs(2), watch.changed()).await;
                continue;
            };
            let (collection, shard, _, _) = step.describe();
            let failed_before = state
                .move_failures
                .get(&(collection.to_owned(), shard))
                .cloned();
            step_task = Some(tokio::spawn(run_step(node, step, failed_before)));
        }
        // A step still running finishes on its own (every change it makes is a guarded swap,
        // like a second coordinator's would be).
        tracing::warn!(%node_id, "no longer the placement coordinator");
    }
}

/// Carries out one planned step and records its outcome in etcd: a failure (counted on top of
/// the shard's earlier ones, `failed_before`, so that the coordinator backs off), or, after
/// earlier failures, that the shard moved.
async fn run_step(
    node: Arc<ClusterNode>,
    step: Step,
    failed_before: Option<tarn_cluster::MoveFailure>,
) {
    let (collection, shard, from, to) = step.describe();
    let outcome = match &step {
        Step::Move(planned) => request_move(&node, planned).await,
        Step::HandOver(planned) => hand_over(&node, planned).await,
    };
    let failure = match &outcome {
        Ok(()) => None,
        Err(error) => {
            tracing::warn!(%collection, shard, %from, %to, %error, "planned move failed");
            Some(tarn_cluster::MoveFailure {
                to: to.to_owned(),
                error: error.to_string(),
                failures: failed_before.as_ref().map_or(0, |f| f.failures) + 1,
                at_unix_ms: unix_ms(),
            })
        }
    };
    if failure.is_none() {
        // A move to this taker went through: the failures other shards of the collection had
        // moving to it describe the cluster no more (the planner skipped them while they backed
        // off; they are planned afresh if they still need to move).
        let stale: Vec<u32> = node
            .state()
            .move_failures
            .iter()
            .filter(|((c, s), f)| c == collection && *s != shard && f.to == to)
            .map(|((_, s), _)| *s)
            .collect();
        for other in stale {
            if let Err(error) = node
                .store()
                .record_move_failure(collection, other, None)
                .await
            {
                tracing::warn!(%error, "could not clear a stale move failure");
            }
        }
    }
    if failure.is_some() || failed_before.is_some() {
        if let Err(error) = node
            .store()
            .record_move_failure(collection, shard, failure.as_ref())
            .await
        {
            // The step stays under way a little longer: the next is not planned at once from
            // a record without this outcome.
            tracing::warn!(%error, "could not record a move's outcome");
            tokio::time::sleep(Duration::from_secs(2)).await;
        }
    }
}

/// What the placement coordinator does next for one shard.
enum Step {
    /// Copy the shard to another node and flip it (a collection of one copy per shard).
    Move(PlannedMove),
    /// A step of handing a replicated shard's primary over to a replica.
    HandOver(Box<PlannedHandover>),
}

impl Step {
    /// (collection, shard, from, to), for the log and the failure record.
    fn describe(&self) -> (&str, u32, &str, &str) {
        match self {
            Step::Move(p) => (&p.collection, p.shard, &p.from, &p.to),
            Step::HandOver(p) => {
                let (HandoverStep::AddReplica(to)
                | HandoverStep::Fence(to)
                | HandoverStep::DropReplica(to)) = &p.step;
                (&p.collection, p.shard, &p.from.owner, to)
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// A replicated shard's primary handed over to an in-sync replica.
//
// 1. The coordinator fences the shard for the replica B ([`hand_over`]): (A, e, serving) ->
//    (A, e, fenced, moving to B), a swap of the whole record. The epoch stays, so that A's
//    replication at e goes on shipping to the replicas, and B does not lift the fence as a
//    move's taker would (B holds a copy: `ShardAssignment::is_replica_handover`).
// 2. A sees the fence ([`start_handovers`]), takes the shard's write gate exclusively (the
//    writes that passed their epoch check before finish; later ones find the fence, ABORTED,
//    and routers retry), syncs its log to its last entry L, and waits until every in-sync
//    replica has L durable (one that does not within the bound leaves the in-sync set first,
//    as at any write). Its log and the in-sync replicas' are then the same, entry for entry.
// 3. A reads the record (linearizably) and, if it is still the fence with B in sync, swaps it
//    for (B, e + 1, serving) with A an in-sync replica on its data directory. Nothing is cut
//    from A's log when it follows B.
// 4. Any failure lifts the fence by a swap of the whole record: (A, e + 1, serving) — done by A,
//    by the coordinator when A or B is dead or past the limit. The copy of a draining A then
//    leaves as any replica on a draining node does ([`rereplicate`]).

/// Carries out one planned step of a hand-over (the coordinator's side): a new replica (the
/// primary seeds it; the next rounds wait until it is in sync), a surplus replica dropped, or
/// the fence, after which it waits for the old primary's promotion of the replica (at most
/// [`HANDOVER_LIMIT`], and only while both nodes are alive; else it lifts the fence).
async fn hand_over(node: &Arc<ClusterNode>, planned: &PlannedHandover) -> Result<(), ApiError> {
    let name = ShardName {
        collection: planned.collection.clone(),
        uid: planned.uid,
        shard: planned.shard,
    };
    let swap = whole_record_swap(&name, &planned.from, &planned.to);
    let landed = node
        .store()
        .compare_and_set_shard(&swap)
        .await
        .map_err(|e| ApiError::ClusterStore(e.to_string()))?;
    if !landed {
        return Err(ApiError::StaleShardMap(format!(
            "shard {} of collection '{}' changed before its primary could be handed over",
            planned.shard, planned.collection
        )));
    }
    let local = name.local_name();
    // The next round plans from a view that has this change.
    node.wait_for_view(Duration::from_secs(2), |s| {
        s.assignment(&name) != Some(&planned.from)
    })
    .await;
    let to = match &planned.step {
        HandoverStep::AddReplica(on) => {
            tracing::info!(shard = %local, primary = %planned.from.owner, replica = %on,
                draining = planned.draining,
                "hand-over: a new replica first (it takes over once in sync)");
            return Ok(());
        }
        HandoverStep::DropReplica(node_id) => {
            tracing::info!(shard = %local, replica = %node_id,
                "hand-over: a surplus replica leaves (every other copy is in sync)");
            return Ok(());
        }
        HandoverStep::Fence(to) => to,
    };
    let fenced_at = Instant::now();
    tracing::info!(shard = %local, primary = %planned.from.owner, to = %to,
        draining = planned.draining, "hand-over: fenced; the primary drains and promotes");
    let epoch = planned.to.epoch;
    // Settled (promoted, or the fence lifted), or one of the two nodes died (then the fence is
    // lifted here at once, and the shard fails over if it must).
    node.wait_for_view(HANDOVER_LIMIT, |s| {
        s.assignment(&name).is_none_or(|a| a.epoch > epoch)
            || !s.is_alive(&planned.from.owner)
            || !s.is_alive(to)
    })
    .await;
    let write_pause = fenced_at.elapsed();
    match node.state().assignment(&name) {
        Some(a) if a.epoch > epoch && a.owner == *to => {
            node.moves.finished.fetch_add(1, Ordering::Relaxed);
            node.moves
                .last_write_pause_us
                .store(write_pause.as_micros() as u64, Ordering::Relaxed);
            tracing::info!(shard = %local, from = %planned.from.owner, primary = %to,
                epoch = a.epoch, write_pause_ms = write_pause.as_secs_f64() * 1e3,
                "hand-over: the replica is the shard's primary");
            Ok(())
        }
        Some(a) if a.epoch > epoch => Err(ApiError::StaleShardMap(format!(
            "the hand-over of shard {} of collection '{}' to node {to} was abandoned (now \
             node {}'s at epoch {})",
            planned.shard, planned.collection, a.owner, a.epoch
        ))),
        None => Err(ApiError::NotFound(planned.collection.clone())),
        Some(_) => {
            lift_handover(node, &name, epoch).await;
            Err(ApiError::Unavailable(format!(
                "the hand-over of shard {} of collection '{}' to node {to} was not done (a node \
                 died, or past {} s); its fence is lifted",
                planned.shard,
                planned.collection,
                HANDOVER_LIMIT.as_secs()
            )))
        }
    }
}

/// Starts the old primary's part of a hand-over ([`hand_over_as_primary`]) for every shard
/// this node's view shows it primary of and fenced for a hand-over to a replica, one task per
/// shard; a hand-over that fails lifts its fence.
pub(crate) fn start_handovers(node: &Arc<ClusterNode>) {
    let state = node.state();
    for (shard, a, map) in state.shards_led_by(&node.node_id) {
        if !a.is_replica_handover() {
            continue;
        }
        let local = shard.local_name();
        if node.handing_over.insert(local.clone(), ()).is_some() {
            continue;
        }
        let (node, fence, min_in_sync) = (Arc::clone(node), a.clone(), map.def.min_in_sync);
        tokio::spawn(async move {
            let outcome = tokio::time::timeout(
                REPLICA_HANDOVER_LIMIT,
                hand_over_as_primary(&node, &shard, &fence, min_in_sync),
            )
            .await;
            let error = match outcome {
                Ok(Ok(())) => None,
                Ok(Err(error)) => Some(error.to_string()),
                Err(_) => Some(format!(
                    "not done within {} s",
                    REPLICA_HANDOVER_LIMIT.as_secs()
                )),
            };
            if let Some(error) = error {
                tracing::warn!(shard = %local, %error, "hand-over failed; lifting its fence");
                lift_handover(&node, &shard, fence.epoch).await;
            }
            node.handing_over.remove(&local);
        });
    }
}

/// The old primary's part of a hand-over (steps 2 and 3 above): drains its writes, makes sure
/// every in-sync replica holds its whole log, and promotes the fence's replica with this copy
/// in sync, by a swap of the whole record as read linearizably.
async fn hand_over_as_primary(
    node: &Arc<ClusterNode>,
    shard: &ShardName,
    fence: &ShardAssignment,
    min_in_sync: u32,
) -> Result<(), ApiError> {
    let local = shard.local_name();
    let saw_fence = Instant::now();
    let since_fence = || saw_fence.elapsed().as_secs_f64() * 1e3;
    // Every write that passed its epoch check before this node saw the fence holds the gate
    // shared until it is acknowledged or fails; later writes find the fence and are refused.
    let gate = node.gate(&local);
    let _writes_held = gate.write().await;
    let drained_ms = since_fence();
    let collection = node.registry.get_shard(&local)?;
    let last = collection.sync_wal().await?;
    // The replication at the fence's epoch (the shard's, unchanged) ships what the replicas
    // lack; a replica without `last` within the bound leaves the in-sync set first.
    if let Some(replication) = node
        .replication_for_write(shard, fence, min_in_sync, &collection)
        .await?
    {
        replication.replicate(node, last).await?;
    }
    let replicated_ms = since_fence();
    fail_point("moves::fail_handover")?;
    let record = node
        .store()
        .read_shard(&shard.collection, shard.uid, shard.shard)
        .await
        .map_err(|e| ApiError::ClusterStore(e.to_string()))?;
    let current = match record {
        tarn_cluster::ShardRecord::Assigned(a)
            if a.owner == node.node_id && a.epoch == fence.epoch =>
        {
            a
        }
        other => {
            return Err(ApiError::StaleShardMap(format!(
                "the hand-over's fence is gone (now {other:?})"
            )))
        }
    };
    let promoted = current
        .handed_to_replica(&node.incarnation)
        .ok_or_else(|| {
            ApiError::StaleShardMap(format!(
                "the hand-over's replica is no longer in sync ({current:?})"
            ))
        })?;
    let swap = whole_record_swap(shard, &current, &promoted);
    let landed = node
        .store()
        .compare_and_set_shard(&swap)
        .await
        .map_err(|e| ApiError::ClusterStore(e.to_string()))?;
    if !landed {
        return Err(ApiError::StaleShardMap(
            "the shard's record changed during the hand-over".to_owned(),
        ));
    }
    tracing::info!(shard = %local, primary = %promoted.owner, epoch = promoted.epoch,
        last_seq_no = last, drained_ms, replicated_ms, promoted_ms = since_fence(),
        "hand-over: writes drained, every in-sync replica holds the log; the replica is the \
         primary and this copy an in-sync replica");
    // The view follows before the gate opens, so that no pass of reconciliation starts this
    // hand-over again from the fence.
    node.wait_for_view(Duration::from_secs(1), |s| {
        s.assignment(shard)
            .is_none_or(|a| a.epoch >= promoted.epoch)
    })
    .await;
    Ok(())
}

/// Lifts a hand-over's fence at `epoch` (not a later hand-over's): the old primary serves the
/// shard again at the next epoch, its copies as they are (one swap of the whole record as read
/// linearizably, so that a replica that left the in-sync set under the fence is not put back).
/// Logged, not returned.
async fn lift_handover(node: &ClusterNode, shard: &ShardName, epoch: u64) {
    let local = shard.local_name();
    let record = node
        .store()
        .read_shard(&shard.collection, shard.uid, shard.shard)
        .await;
    let current = match record {
        Ok(tarn_cluster::ShardRecord::Assigned(a))
            if a.is_replica_handover() && a.epoch == epoch =>
        {
            a
        }
        Ok(_) => return,
        Err(error) => {
            tracing::warn!(shard = %local, %error, "could not lift a hand-over's fence yet");
            return;
        }
    };
    let back = current.fence_lifted();
    let swap = whole_record_swap(shard, &current, &back);
    match node.store().compare_and_set_shard(&swap).await {
        Ok(true) => {
            tracing::info!(shard = %local, primary = %back.owner, epoch = back.epoch,
                "hand-over abandoned; the fence is lifted")
        }
        Ok(false) => {}
        Err(error) => {
            tracing::warn!(shard = %local, %error, "could not lift a hand-over's fence yet")
        }
    }
}

/// A swap of `shard`'s record from `from` to `to` that lands only if the whole record is still
/// `from` (no registration guard: callers that need one set it).
pub(crate) fn whole_record_swap<'a>(
    shard: &'a ShardName,
    from: &'a ShardAssignment,
    to: &'a ShardAssignment,
) -> tarn_cluster::ShardSwap<'a> {
    tarn_cluster::ShardSwap {
        collection: &shard.collection,
        uid: shard.uid,
        shard: shard.shard,
        expected_epoch: from.epoch,
        new: to,
        unless_registered: None,
        unless_registered_from: None,
        registered: None,
        expected: Some(from),
    }
}

/// Failover: for each shard whose primary is dead to the cluster (or back on another disk)
/// and that has an alive in-sync replica on the disk recorded for its copy
/// ([`tarn_cluster::plan_promotions`]), promotes that replica at the next epoch, in one etcd
/// transaction that lands only if the shard's record is unchanged since it was read and the
/// old primary's registration is gone from etcd itself (not only from this node's view), or
/// is still the one from another data directory than the one recorded for its copy, and the
/// candidate is registered in etcd itself from the directory recorded for its copy. Without
/// etcd nothing is promoted. Logged and counted (`tarn_failovers_total`); a swap that does not
/// land is decided again from the next view.
async fn promote_replicas(node: &ClusterNode, state: &tarn_cluster::ClusterState) {
    // Each promotion is its own guarded swap of one shard's record: they go to etcd
    // `PROMOTIONS_IN_FLIGHT` at a time, not one after another (a dead node's hundreds of
    // primaries are promoted in a few round trips' time, not hundreds).
    let promotions = tarn_cluster::plan_promotions(state);
    let promote = |planned: tarn_cluster::PlannedPromotion| async move {
        let name = ShardName {
            collection: planned.collection.clone(),
            uid: planned.uid,
            shard: planned.shard,
        };
        let mut swap = whole_record_swap(&name, &planned.from, &planned.to);
        swap.unless_registered = Some(&planned.dead_primary);
        swap.unless_registered_from = planned.dead_primary_incarnation.as_deref();
        // And only onto a candidate registered, in etcd itself, from its recorded directory.
        let candidate = planned.to.owner.as_str();
        swap.registered = Some((
            candidate,
            planned.from.incarnation_of(candidate).unwrap_or(""),
        ));
        match node.store().compare_and_set_shard(&swap).await {
            Ok(true) => {
                node.moves.failovers.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(shard = %name.local_name(), dead = %planned.dead_primary,
                    primary = %planned.to.owner, epoch = planned.to.epoch,
                    "failover: an in-sync replica is the shard's primary");
            }
            Ok(false) => {
                tracing::debug!(shard = %name.local_name(), "failover not landed (the record changed or the primary is still registered)");
            }
            Err(error) => {
                tracing::warn!(shard = %name.local_name(), %error, "failover: etcd unavailable; retrying");
            }
        }
    };
    use futures_util::stream::StreamExt;
    futures_util::stream::iter(promotions)
        .for_each_concurrent(PROMOTIONS_IN_FLIGHT, promote)
        .await;
}

/// How many failovers' swaps the coordinator has in flight at once (etcd serializes them; the
/// bound keeps a storm from queueing thousands of requests on one connection).
const PROMOTIONS_IN_FLIGHT: usize = 32;

/// Takes out of the in-sync set every in-sync replica whose node is registered from another
/// data directory than the one recorded for its copy ([`tarn_cluster::plan_replaced_copies`]:
/// it came back on a wiped or replaced disk and holds nothing), without waiting for its
/// primary's next write or probe: one swap per shard that lands only if the record is
/// unchanged since it was read. The primary's follower then finds the node without a copy and
/// seeds it.
async fn drop_replaced_copies(node: &ClusterNode, state: &tarn_cluster::ClusterState) {
    for planned in tarn_cluster::plan_replaced_copies(state) {
        let name = ShardName {
            collection: planned.collection.clone(),
            uid: planned.uid,
            shard: planned.shard,
        };
        let swap = whole_record_swap(&name, &planned.from, &planned.to);
        match node.store().compare_and_set_shard(&swap).await {
            Ok(true) => {
                tracing::warn!(shard = %name.local_name(), replica = %planned.replica,
                    "a replica back on another data directory left the in-sync set (its copy is gone; it is seeded again)");
            }
            Ok(false) => {}
            Err(error) => {
                tracing::warn!(shard = %name.local_name(), %error, "dropping a replaced copy from the in-sync set: etcd unavailable; retrying");
            }
        }
    }
}

/// Re-replication: a replica copy on a node dead for longer than `--replace-dead-after` is
/// replaced by a new replica on the live node (not draining, without a copy of the shard) that
/// holds the fewest copies, in one swap that lands only if the shard's record is unchanged and
/// the dead node is still unregistered in etcd. The new copy is seeded from the primary's
/// snapshot and log by the primary's follower, and joins the in-sync set once it has
/// everything. A shard with fewer copies than its replication factor (a copy given up by
/// `forget`) gets a new replica the same way. Only shards whose primary holds its copy, alive
/// on its recorded data directory, are touched (a dead primary is first replaced by failover;
/// a primary back on a wiped disk holds nothing, and its in-sync replicas are never replaced
/// while they may hold the last copy); a shard with no spare live node keeps its dead copy
/// listed.
///
/// A replica on a draining node (alive) moves the other way round, so the shard never has
/// fewer copies in sync than before: first a new replica is added on a taker (the shard has
/// one copy more than its factor meanwhile), then, once every other copy is in sync, the
/// draining node's copy is dropped from the record (and from its disk by reconciliation).
async fn rereplicate(
    node: &ClusterNode,
    state: &tarn_cluster::ClusterState,
    dead_since: &mut std::collections::HashMap<String, Instant>,
) {
    let now = Instant::now();
    let mut holders = std::collections::BTreeSet::new();
    for map in state.collections.values() {
        for shard in &map.shards {
            holders.extend(shard.copies().map(str::to_owned));
        }
    }
    dead_since.retain(|n, _| holders.contains(n) && !state.is_alive(n));
    for holder in holders.iter().filter(|n| !state.is_alive(n)) {
        dead_since.entry(holder.clone()).or_insert(now);
    }
    let replace = |n: &str| {
        dead_since
            .get(n)
            .is_some_and(|since| now.duration_since(*since) >= node.replace_dead_after)
    };
    let mut load: std::collections::BTreeMap<String, usize> = state
        .nodes
        .keys()
        .filter(|n| !state.draining.contains(*n))
        .map(|n| (n.clone(), 0))
        .collect();
    for map in state.collections.values() {
        for shard in &map.shards {
            for copy in shard.copies() {
                if let Some(n) = load.get_mut(copy) {
                    *n += 1;
                }
            }
        }
    }
    for (name, map) in &state.collections {
        for (idx, a) in map.shards.iter().enumerate() {
            // Only while the primary holds its copy on its recorded disk: a primary back on a
            // wiped disk holds nothing, and its in-sync replicas, dead or not, may hold the
            // last copy of every acknowledged write (they wait for it, never replaced).
            if !a.takes_writes() || !state.holds_in_sync_copy(a, &a.owner) {
                continue;
            }
            // Both changes keep the epoch and compare the whole record.
            let swap_to = |new, unless_registered| tarn_cluster::ShardSwap {
                collection: name,
                uid: map.def.uid,
                shard: idx as u32,
                expected_epoch: a.epoch,
                new,
                unless_registered,
                unless_registered_from: None,
                registered: None,
                expected: Some(a),
            };
            let draining = a
                .replicas
                .iter()
                .find(|n| state.draining.contains(*n) && state.is_alive(n));
            if let Some(draining) = draining {
                let n_copies = a.copies().count() as u32;
                let others_in_sync = a
                    .copies()
                    .filter(|n| n != draining)
                    .all(|n| a.in_sync().any(|m| m == n));
                let next = if n_copies <= map.def.replication_factor.max(1) {
                    load.iter()
                        .filter(|(n, _)| a.role_of(n).is_none() && !a.given_up.contains(*n))
                        .min_by_key(|(n, copies)| (**copies, n.as_str()))
                        .and_then(|(taker, _)| a.with_replica(taker))
                } else if others_in_sync {
                    a.without_replica(draining)
                } else {
                    None
                };
                // Nothing to do for the draining copy yet (another copy is catching up, or is
                // dead and never will): a dead replica is still replaced below, so that the
                // draining copy can leave once its replacement is in sync.
                if let Some(next) = next {
                    match node
                        .store()
                        .compare_and_set_shard(&swap_to(&next, None))
                        .await
                    {
                        Ok(true) => {
                            tracing::info!(collection = %name, shard = idx, %draining,
                            replicas = ?next.replicas, "drain: a replica moves off a draining node");
                        }
                        Ok(false) => {}
                        Err(error) => {
                            tracing::warn!(collection = %name, shard = idx, %error, "drain: etcd unavailable; retrying");
                            return;
                        }
                    }
                    continue;
                }
            }
            // A dead replica is replaced; a shard with fewer copies than its factor (a copy
            // given up by `forget`) gets one more.
            let dead = a.replicas.iter().find(|n| replace(n));
            let short = a.copies().count() < map.def.replication_factor.max(1) as usize;
            if dead.is_none() && !short {
                continue;
            }
            // Never a node whose copy of the shard was given up: its copy is set aside for an
            // operator, and a seed or a log cut would destroy it.
            let Some(taker) = load
                .iter()
                .filter(|(n, _)| a.role_of(n).is_none() && !a.given_up.contains(*n))
                .min_by_key(|(n, copies)| (**copies, n.as_str()))
                .map(|(n, _)| n.clone())
            else {
                continue;
            };
            let next = match dead {
                Some(dead) => a.without_replica(dead),
                None => Some(a.clone()),
            };
            let Some(next) = next.and_then(|r| r.with_replica(&taker)) else {
                continue;
            };
            match node
                .store()
                .compare_and_set_shard(&swap_to(&next, dead.map(String::as_str)))
                .await
            {
                Ok(true) => {
                    *load.entry(taker.clone()).or_default() += 1;
                    match dead {
                        Some(dead) => {
                            tracing::warn!(collection = %name, shard = idx, %dead, %taker,
                            "re-replication: a dead node's replica is rebuilt on another node")
                        }
                        None => tracing::warn!(collection = %name, shard = idx, %taker,
                            "re-replication: a shard below its replication factor gets a copy"),
                    }
                }
                Ok(false) => {}
                Err(error) => {
                    tracing::warn!(collection = %name, shard = idx, %error, "re-replication: etcd unavailable; retrying");
                    return;
                }
            }
        }
    }
}

/// Milliseconds since the Unix epoch (move failure records are read by every node).
fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Asks the taker of a planned move to pull its shard (in-process when it is this node).
async fn request_move(node: &Arc<ClusterNode>, planned: &PlannedMove) -> Result<(), ApiError> {
    tracing::info!(collection = %planned.collection, shard = planned.shard,
        from = %planned.from, to = %planned.to, epoch = planned.epoch, "moving a shard");
    let request = pb::PullShardRequest {
        collection: planned.collection.clone(),
        shard: planned.shard,
        epoch: planned.epoch,
    };
    if planned.to == node.node_id {
        pull_shard(node, request).await?;
        return Ok(());
    }
    let channel = node.peer(&planned.to).await?;
    let mut client = pb::node_client::NodeClient::new(channel);
    let pull = client.pull_shard(node.internal_request(request, MOVE_LIMIT));
    // The step ends when the taker leaves the cluster (its lease lapsed: stopped, or cut off
    // from etcd), not at the pull's hour-long deadline: the coordinator plans the next one.
    let taker_gone = node.wait_for_view(MOVE_LIMIT, |s| !s.is_alive(&planned.to));
    tokio::select! {
        answer = pull => {
            answer.map_err(|s| peer_error(&format!("node {} pulling the shard", planned.to), s))?;
        }
        _ = taker_gone => {
            return Err(ApiError::Unavailable(format!(
                "node {} left the cluster while pulling the shard",
                planned.to
            )));
        }
    }
    Ok(())
}
