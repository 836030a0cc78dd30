//! The primary's side of a shard's replication: one follower task per replica ([`follow`]),
//! which probes where the replica's log ends, has a divergent tail cut, ships the log with
//! `Node/AppendEntries` (up to [`PIPELINE_DEPTH`] calls in flight), keeps a hold on the log for
//! a replica that is away, asks for a seed when the log no longer serves, and tries a catching-up
//! replica's join ([`try_join`]). The calls themselves go through a [`Link`].

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::stream::{FuturesOrdered, StreamExt};
use tarn_cluster::{last_common_seq, ShardName};
use tarn_collection::{Collection, WalTail};
use tarn_proto::v1 as pb;
use tokio::sync::watch;

use super::{
    replication_at, Acked, IN_SYNC_BOUND, JOIN_BACKOFF_MAX, JOIN_LAG_ENTRIES, JOIN_TRY_EVERY,
};
use crate::cluster::ClusterNode;
use crate::epochs::from_wire;
use crate::faults::{pause_point, tunable};
use crate::status::ApiError;

/// How long an idle follower waits for a write before it sends its replica a commit notice.
const NOTICE_DELAY: Duration = Duration::from_millis(5);
/// Most payload bytes shipped in one call.
const MAX_BATCH_BYTES: usize = 4 << 20;
/// How many entries a follower reads before letting checkpoints truncate what it has shipped.
const RELEASE_EVERY_ENTRIES: u64 = 4_096;
/// How often a busy follower looks whether its replica, out of the in-sync set, lacks more
/// log than [`AWAY_REPLICA_WAL_BYTES`].
const LAG_CHECK_EVERY: Duration = Duration::from_millis(100);
/// How much log (bytes written since it went away) a primary keeps for a replica whose calls
/// fail: one back within it catches up by log, checkpoints meanwhile notwithstanding; past it,
/// checkpoints may truncate what it lacks and it is seeded from a snapshot (PostgreSQL's
/// `max_slot_wal_keep_size`, as a fixed bound). The same bound holds for a replica that
/// answers but falls behind (out of the in-sync set): past it, it is seeded instead of pinning
/// the log from its position.
const AWAY_REPLICA_WAL_BYTES: u64 = 1 << 30;

/// [`MAX_BATCH_BYTES`], or `replication::max_batch_bytes` (a slow follower: one entry per
/// batch at `return(1)`).
fn max_batch_bytes() -> usize {
    tunable("replication::max_batch_bytes", MAX_BATCH_BYTES)
}

/// [`AWAY_REPLICA_WAL_BYTES`], or `replication::away_wal_bytes` (the process tests of catch-up
/// by snapshot set it to 0).
fn away_wal_bytes() -> u64 {
    tunable("replication::away_wal_bytes", AWAY_REPLICA_WAL_BYTES)
}

/// `AppendEntries` calls a follower keeps in flight to one replica: a write that arrives while
/// a batch is on its way is sent at once instead of after that batch's answer, and the
/// replica syncs one batch while it appends the next (docs/BENCHMARKS.md, "Replicas").
const PIPELINE_DEPTH: usize = 4;

/// What a follower ships from and to.
pub(super) struct Follower {
    pub(super) node: std::sync::Weak<ClusterNode>,
    pub(super) shard: ShardName,
    pub(super) epoch: u64,
    /// The primary's epoch history.
    pub(super) history: Vec<pb::EpochStart>,
    pub(super) replica: String,
    pub(super) collection: Collection,
    /// The shard's commit, sent with every call (`ShardReplication::advance_commit`).
    pub(super) commit: watch::Receiver<u64>,
    /// Notified after each acknowledgement, for the committer.
    pub(super) acks: Arc<tokio::sync::Notify>,
}

/// A follower: ships the shard's log to `replica` for as long as this node is the shard's
/// primary at `epoch` (the task is aborted when its `ShardReplication` goes).
pub(super) async fn follow(
    follower: Follower,
    mut wanted: watch::Receiver<u64>,
    acked: watch::Sender<Acked>,
    mut held: Option<(WalTail, u64)>,
) {
    let Follower {
        node,
        shard,
        epoch,
        history,
        replica,
        collection,
        commit,
        acks,
    } = follower;
    let mut backoff = RetryBackoff::default();
    // `held`: a hold on the log from the replica's position while it is away (from the epoch's
    // start until it first answers), and the log's byte count when it was taken.
    // `gave_up_log`: the replica fell too far behind while connected and is seeded instead:
    // no hold is taken for it until it follows by log again.
    let mut gave_up_log = false;
    loop {
        let Some(node) = node.upgrade() else {
            return;
        };
        let link = Link {
            node: &node,
            shard: &shard,
            epoch,
            history: &history,
            replica: &replica,
            commit: &commit,
            acks: &acks,
        };
        let mut reached = false;
        match ship(
            &link,
            &collection,
            &mut wanted,
            &acked,
            &mut held,
            &mut gave_up_log,
            &mut reached,
        )
        .await
        {
            Ok(()) => return,
            Err(error) => {
                tracing::debug!(shard = %shard.local_name(), %replica, %error, "shipping to a replica failed; retrying");
            }
        }
        // The replica is away (or being seeded): keep the log from its acknowledged position
        // for it, so that it comes back by log, up to a bound of log written since.
        if held.is_none() && !gave_up_log {
            let from = acked.borrow().seq + 1;
            held = collection
                .wal_tail_from(from)
                .map(|tail| (tail, collection.wal_stats().n_bytes));
        }
        let bound = away_wal_bytes();
        if held
            .as_ref()
            .is_some_and(|(_, at)| collection.wal_stats().n_bytes.saturating_sub(*at) > bound)
        {
            tracing::warn!(shard = %shard.local_name(), %replica, bound,
                "a replica away while this primary wrote more log than it keeps for one: \
                 checkpoints may truncate what it lacks (it will be seeded from a snapshot)");
            held = None;
        }
        drop(node);
        tokio::time::sleep(backoff.next(reached)).await;
    }
}

/// The pause before a follower tries its replica again: from [`RetryBackoff::MIN`], doubling
/// while the replica stays unreachable, up to [`RetryBackoff::MAX`]; back to the minimum once a
/// try reached the replica (a replica away for a minute, then back and briefly cut again, is
/// retried within milliseconds, not after the second it waited while away).
#[derive(Debug, Clone, Copy)]
pub(super) struct RetryBackoff {
    pause: Duration,
}

impl RetryBackoff {
    pub(super) const MIN: Duration = Duration::from_millis(50);
    pub(super) const MAX: Duration = Duration::from_secs(1);

    /// The pause after a try that failed; `reached`: the replica answered, following by log,
    /// during that try.
    pub(super) fn next(&mut self, reached: bool) -> Duration {
        if reached {
            self.pause = Self::MIN;
        }
        let pause = self.pause;
        self.pause = (self.pause * 2).min(Self::MAX);
        pause
    }
}

impl Default for RetryBackoff {
    fn default() -> Self {
        Self { pause: Self::MIN }
    }
}

/// One connection's worth of shipping: probes where the replica's log ends, then sends what
/// writers want, in order, until a call fails.
async fn ship(
    link: &Link<'_>,
    collection: &Collection,
    wanted: &mut watch::Receiver<u64>,
    acked: &watch::Sender<Acked>,
    held: &mut Option<(WalTail, u64)>,
    gave_up_log: &mut bool,
    reached: &mut bool,
) -> Result<(), ApiError> {
    let (node, shard, epoch, replica) = (link.node, link.shard, link.epoch, link.replica);
    let mut probe = link.append(0, Vec::new(), None).await?;
    link.seed_if_needed(&probe).await?;
    // The replica answers and follows by log (one being seeded is retried at the slower pace).
    *reached = true;
    // KIP-101's rule: the replica keeps its log up to the last entry both logs hold from the
    // same epoch; what it holds after that was written by a primary that lost its place before
    // the entries were acknowledged (an acknowledged entry is on every in-sync copy, and only
    // an in-sync copy is promoted), so it is cut off.
    let primary_last = collection.last_seq_no();
    let keep = last_common_seq(
        &from_wire(&probe.epochs)?,
        probe.last_seq,
        &from_wire(link.history)?,
        primary_last,
    );
    if keep < probe.last_seq {
        tracing::warn!(shard = %shard.local_name(), %replica, replica_last = probe.last_seq,
            keep, "the replica holds entries this primary does not: cutting them off");
        probe = link.append(0, Vec::new(), Some(keep)).await?;
        link.seed_if_needed(&probe).await?;
    }
    let durable = probe.durable_seq.min(probe.last_seq);
    // The same directory now ends below what it acknowledged (restored from an older backup or
    // VM snapshot, or a disk that lost synced data): its copy lacks acknowledged writes, so it
    // leaves the in-sync set before anything else, and is never promoted meanwhile.
    let before = acked.borrow().clone();
    if before.incarnation == probe.incarnation && durable < before.seq {
        tracing::error!(shard = %shard.local_name(), %replica, acknowledged = before.seq, durable,
            "a replica's copy went back behind what it acknowledged (restored from an older copy?)");
        if let Some(replication) = replication_at(node, shard, epoch) {
            replication
                .leave_in_sync(
                    node,
                    replica,
                    "its copy went back behind what it acknowledged",
                )
                .await?;
        }
    }
    acked.send_replace(Acked {
        seq: durable,
        incarnation: probe.incarnation.clone(),
    });
    link.acks.notify_one();
    // The highest commit this replica was told of together with entries it shares with this
    // primary (what it may make visible); a notice is sent when the commit moves past it.
    let mut notified = 0u64;
    let mut commit_changes = link.commit.clone();
    // A replica that registers again (its process restarted, perhaps on a copy put back from
    // an older backup) is probed again even while no write comes.
    let registered = node.state().registered_at.get(replica).copied();
    let tail = collection.wal_tail_from(probe.last_seq + 1);
    // Following by log again (or never able to): the hold kept for the replica while it was
    // away has done its work.
    *held = None;
    *gave_up_log = false;
    let Some(mut tail) = tail else {
        link.seed().await?;
        return Err(ApiError::Unavailable(format!(
            "replica {replica} ends at {} and this primary's log no longer holds what follows: \
             it is seeded from a snapshot",
            probe.last_seq
        )));
    };
    let mut since_release = 0u64;
    let mut last_join_try = Instant::now();
    let mut last_lag_check = Instant::now();
    // Calls sent and not answered yet, oldest first; each entry is the call and its batch's
    // entry count. Dropping them (an error returns) drops the calls.
    let mut in_flight = FuturesOrdered::new();
    loop {
        let next = tail.next_seq();
        let want = *wanted.borrow_and_update();
        let durable = tail.durable_seq();
        // What writes wait for, and whatever else is durable already. An entry appended but
        // neither durable nor waited for yet is left to its own write group's sync (syncing
        // for it here would add an fsync per batch on the primary); its write raises `wanted`
        // once it is durable.
        let pending = want >= next || durable >= next;
        if pending && in_flight.len() < PIPELINE_DEPTH {
            let up_to = want.max(durable);
            if durable < want {
                // A tail reads durable entries only: make what was written (WRITTEN) durable.
                collection.sync_wal().await?;
            }
            let (entries, back) = tokio::task::spawn_blocking(move || {
                let read = tail.read(up_to, max_batch_bytes());
                (read, tail)
            })
            .await
            .map_err(|e| ApiError::Internal(format!("reading the log to ship: {e}")))?;
            tail = back;
            let entries = entries?;
            if entries.is_empty() {
                tokio::time::sleep(Duration::from_millis(1)).await;
                continue;
            }
            let first = entries[0].0;
            let n = entries.len() as u64;
            let payloads = entries.into_iter().map(|(_, p)| p.to_vec()).collect();
            // Test builds: a primary that holds its next batch back (it dies meanwhile in tests).
            pause_point("replication::hold_entries").await;
            let committed = *link.commit.borrow();
            in_flight.push_back(async move {
                let answer = link.append(first, payloads, None).await;
                (answer, n, committed.min(first + n - 1))
            });
            continue;
        }
        if in_flight.is_empty() {
            // Nothing to ship: the replica learns the commit its last entries reached, then
            // the follower waits for a write, or looks again for a join now and then.
            let matched = acked.borrow().seq;
            let committed = *commit_changes.borrow_and_update();
            if committed.min(matched) > notified {
                // Under writes the next batch carries the commit: a notice waits a moment for
                // one instead of adding a call per batch.
                match tokio::time::timeout(NOTICE_DELAY, wanted.changed()).await {
                    Ok(Err(_)) => return Ok(()),
                    Ok(Ok(())) => continue,
                    Err(_) => {}
                }
                link.notice(committed, matched).await?;
                notified = committed.min(matched);
                continue;
            }
            let changed = tokio::time::timeout(Duration::from_millis(500), async {
                tokio::select! {
                    changed = wanted.changed() => changed,
                    changed = commit_changes.changed() => changed,
                }
            })
            .await;
            match changed {
                Ok(Err(_)) => return Ok(()), // the shard's replication is gone
                Ok(Ok(())) => {}
                Err(_) => {
                    // Idle for a while with entries no write waits for (their writers gave
                    // up): make them durable so that they are shipped.
                    if collection.last_seq_no() >= tail.next_seq()
                        && tail.durable_seq() < tail.next_seq()
                    {
                        collection.sync_wal().await?;
                    }
                    if node.state().registered_at.get(replica).copied() != registered {
                        return Err(ApiError::Unavailable(format!(
                            "replica {replica} registered again: probing it"
                        )));
                    }
                    // A copy out of the in-sync set on an idle shard is probed now and then:
                    // one back on a wiped disk is seeded without waiting for a write (no call
                    // would otherwise reach it).
                    if worth_probing(node, shard, epoch, replica) {
                        let probe = link.append(0, Vec::new(), None).await?;
                        link.seed_if_needed(&probe).await?;
                    }
                }
            }
            try_join(node, shard, epoch, replica, acked).await;
            continue;
        }
        // The oldest call's answer, or (room in the pipeline) a new write to send meanwhile.
        let answered = tokio::select! {
            answered = in_flight.next() => answered,
            changed = wanted.changed(), if in_flight.len() < PIPELINE_DEPTH => {
                if changed.is_err() {
                    return Ok(());
                }
                None
            }
        };
        let Some((answer, n, told)) = answered else {
            continue;
        };
        let answer = answer?;
        if answer.needs_seed || answer.seeding {
            // The replica lost its copy meanwhile (a restart on another disk): probe again.
            return Err(ApiError::Unavailable(format!(
                "replica {replica} has no copy to append to any more"
            )));
        }
        // Answers come in the order the calls were sent, but a later call's sync may have
        // finished first: the acknowledged position only grows, for one data directory.
        acked.send_modify(|acked| {
            if acked.incarnation == answer.incarnation {
                acked.seq = acked.seq.max(answer.durable_seq);
            } else {
                *acked = Acked {
                    seq: answer.durable_seq,
                    incarnation: answer.incarnation,
                };
            }
        });
        link.acks.notify_one();
        notified = notified.max(told);
        // Under steady writes the follower is never idle: try a join (which holds writes back
        // while the last entries go over) once close behind, at most once a second.
        if last_join_try.elapsed() >= JOIN_TRY_EVERY {
            last_join_try = Instant::now();
            try_join(node, shard, epoch, replica, acked).await;
        }
        since_release += n;
        if since_release >= RELEASE_EVERY_ENTRIES {
            tail.release_read();
            since_release = 0;
        }
        // A replica that answers but falls ever further behind (a slower disk; out of the
        // in-sync set, so writes do not wait for it) would hold this primary's log from its
        // position for good: past the bound it is seeded from a snapshot instead, and the
        // hold goes with the tail. Looked at every 100 ms, not per answer (the bound is large
        // and the look reads the log's figures and the record).
        if last_lag_check.elapsed() < LAG_CHECK_EVERY {
            continue;
        }
        last_lag_check = Instant::now();
        let acked_seq = acked.borrow().seq;
        if let Some(behind) = too_far_behind(link, collection, acked_seq) {
            tracing::warn!(shard = %shard.local_name(), %replica, behind_bytes = behind,
                bound = away_wal_bytes(),
                "a connected replica fell further behind than the log kept for one: \
                 seeding it from a snapshot");
            drop(tail);
            drop(in_flight);
            *gave_up_log = true;
            link.seed().await?;
            return Err(ApiError::Unavailable(format!(
                "replica {replica} fell {behind} bytes of log behind: it is seeded from a snapshot"
            )));
        }
    }
}

/// The bytes of log (estimated from the average entry size) that `replica`, out of the
/// in-sync set, lacks past `acked`, if more than the log kept for one
/// ([`away_wal_bytes`]). An in-sync replica is never too far behind: writes wait for it.
fn too_far_behind(link: &Link<'_>, collection: &Collection, acked: u64) -> Option<u64> {
    let behind_entries = collection.last_seq_no().saturating_sub(acked);
    if behind_entries == 0 {
        return None;
    }
    let in_sync = replication_at(link.node, link.shard, link.epoch).is_some_and(|r| {
        r.record()
            .in_sync_replicas
            .iter()
            .any(|n| n == link.replica)
    });
    if in_sync {
        return None;
    }
    let stats = collection.wal_stats();
    let per_entry = stats.n_bytes / stats.n_entries.max(1);
    let behind = behind_entries.saturating_mul(per_entry);
    (behind > away_wal_bytes()).then_some(behind)
}

/// Whether an idle follower should probe `replica`: its copy is out of the in-sync set
/// (catching up) as this primary knows the record, or this node's view shows it registered
/// from another data directory than the one recorded for its copy (back on a wiped disk:
/// nothing else would reach it while no write comes).
fn worth_probing(node: &ClusterNode, shard: &ShardName, epoch: u64, replica: &str) -> bool {
    replication_at(node, shard, epoch).is_some_and(|r| {
        let record = r.record().clone();
        record.role_of(replica) == Some(tarn_cluster::CopyRole::CatchingUp)
            || node.state().copy_replaced(&record, replica)
    })
}

/// Starts a join of `replica` to the in-sync set if it is catching up and has everything, in a
/// task of its own (the follower goes on shipping meanwhile: the join waits for it).
async fn try_join(
    node: &Arc<ClusterNode>,
    shard: &ShardName,
    epoch: u64,
    replica: &str,
    acked: &watch::Sender<Acked>,
) {
    let Some(replication) = replication_at(node, shard, epoch) else {
        return;
    };
    if replication.record().role_of(replica) != Some(tarn_cluster::CopyRole::CatchingUp) {
        return;
    }
    if replication
        .collection
        .last_seq_no()
        .saturating_sub(acked.borrow().seq)
        > JOIN_LAG_ENTRIES
    {
        return;
    }
    if replication
        .join_backoff
        .get(replica)
        .is_some_and(|b| Instant::now() < b.0)
    {
        return;
    }
    if replication
        .joining
        .swap(true, std::sync::atomic::Ordering::AcqRel)
    {
        return;
    }
    let receiver = acked.subscribe();
    let (node, replica, local) = (Arc::clone(node), replica.to_owned(), shard.local_name());
    tokio::spawn(async move {
        let joined = match replication.join_in_sync(&node, &replica, &receiver).await {
            Ok(joined) => joined,
            Err(error) => {
                tracing::warn!(shard = %local, %replica, %error, "a replica could not join the in-sync set");
                false
            }
        };
        if joined {
            replication.join_backoff.remove(&replica);
        } else {
            let wait = replication
                .join_backoff
                .get(&replica)
                .map_or(JOIN_TRY_EVERY, |b| (b.1 * 2).min(JOIN_BACKOFF_MAX));
            tracing::debug!(shard = %local, %replica, ?wait, "a join did not happen; the next waits");
            replication
                .join_backoff
                .insert(replica, (Instant::now() + wait, wait));
        }
        replication
            .joining
            .store(false, std::sync::atomic::Ordering::Release);
    });
}

/// A follower's link to one replica.
struct Link<'a> {
    node: &'a Arc<ClusterNode>,
    shard: &'a ShardName,
    epoch: u64,
    history: &'a [pb::EpochStart],
    replica: &'a str,
    commit: &'a watch::Receiver<u64>,
    acks: &'a tokio::sync::Notify,
}

impl Link<'_> {
    /// One `AppendEntries` call, bounded by [`IN_SYNC_BOUND`]: entries from `first_seq`, or
    /// (none) a probe, which first cuts the replica's log after `cut_after` when given.
    async fn append(
        &self,
        first_seq: u64,
        entries: Vec<Vec<u8>>,
        cut_after: Option<u64>,
    ) -> Result<pb::AppendEntriesResponse, ApiError> {
        append(self, first_seq, entries, cut_after, false).await
    }

    /// A commit notice: the replica's log is this primary's up to `matched`; it makes its
    /// entries visible up to `committed` (no further than `matched`).
    async fn notice(&self, committed: u64, matched: u64) -> Result<(), ApiError> {
        let request = self.request(0, Vec::new(), None, false, matched, committed);
        call(self, request).await.map(|_| ())
    }

    /// Asks the replica to copy this primary's snapshot and tail (`seed`), after taking it out
    /// of the in-sync set (a copy being replaced is never in sync, so a promotion never picks a
    /// node whose copy is gone).
    async fn seed(&self) -> Result<(), ApiError> {
        if let Some(replication) = replication_at(self.node, self.shard, self.epoch) {
            replication
                .leave_in_sync(self.node, self.replica, "to be seeded")
                .await?;
        }
        tracing::warn!(shard = %self.shard.local_name(), replica = %self.replica,
            "the replica cannot follow by log: seeding it from a snapshot");
        append(self, 0, Vec::new(), None, true).await.map(|_| ())
    }

    /// Fails (to be retried after a pause) while the replica is being seeded, after asking for
    /// a seed if the probe says one is needed.
    async fn seed_if_needed(&self, probe: &pb::AppendEntriesResponse) -> Result<(), ApiError> {
        if probe.needs_seed {
            self.seed().await?;
        }
        if probe.needs_seed || probe.seeding {
            return Err(ApiError::Unavailable(format!(
                "replica {} is copying this primary's data",
                self.replica
            )));
        }
        Ok(())
    }
}

impl Link<'_> {
    /// An `AppendEntries` request of this link, carrying the shard's commit.
    fn request(
        &self,
        first_seq: u64,
        entries: Vec<Vec<u8>>,
        cut_after: Option<u64>,
        seed: bool,
        matched: u64,
        committed: u64,
    ) -> pb::AppendEntriesRequest {
        pb::AppendEntriesRequest {
            shard: Some(pb::ShardRef {
                collection: self.shard.collection.clone(),
                uid: self.shard.uid,
                shard: self.shard.shard,
                epoch: self.epoch,
                role: pb::ShardRole::Replica as i32,
            }),
            first_seq,
            entries,
            sync: true,
            from_node: self.node.node_id.clone(),
            epochs: self.history.to_vec(),
            cut: cut_after.is_some(),
            cut_after: cut_after.unwrap_or(0),
            seed,
            committed,
            matched,
        }
    }
}

async fn append(
    link: &Link<'_>,
    first_seq: u64,
    entries: Vec<Vec<u8>>,
    cut_after: Option<u64>,
    seed: bool,
) -> Result<pb::AppendEntriesResponse, ApiError> {
    let committed = *link.commit.borrow();
    let request = link.request(first_seq, entries, cut_after, seed, 0, committed);
    call(link, request).await
}

/// One `AppendEntries` call, bounded by [`IN_SYNC_BOUND`].
async fn call(
    link: &Link<'_>,
    request: pb::AppendEntriesRequest,
) -> Result<pb::AppendEntriesResponse, ApiError> {
    let (node, shard, replica) = (link.node, link.shard, link.replica);
    let channel = node.peer(replica).await?;
    let mut client = pb::node_client::NodeClient::new(channel)
        .max_decoding_message_size(crate::cluster::MAX_NODE_MESSAGE_BYTES)
        .max_encoding_message_size(crate::cluster::MAX_NODE_MESSAGE_BYTES);
    let started = Instant::now();
    let answer = client
        .append_entries(node.internal_request(request, IN_SYNC_BOUND))
        .await
        .map_err(|status| {
            ApiError::Unavailable(format!(
                "replica {replica} of shard {} did not take entries ({:?}): {}",
                shard.local_name(),
                started.elapsed(),
                status.message()
            ))
        })?;
    Ok(answer.into_inner())
}

#[cfg(test)]
mod tests {
    use super::RetryBackoff;
    use std::time::Duration;

    #[test]
    fn a_follower_s_backoff_doubles_while_unreachable_and_restarts_once_the_replica_answered() {
        let mut backoff = RetryBackoff::default();
        let away: Vec<Duration> = (0..8).map(|_| backoff.next(false)).collect();
        let ms = |v: &[Duration]| v.iter().map(|d| d.as_millis()).collect::<Vec<_>>();
        assert_eq!(ms(&away), [50, 100, 200, 400, 800, 1000, 1000, 1000]);
        // Back, then cut again: the next try comes after the minimum, then doubles again.
        assert_eq!(backoff.next(true), RetryBackoff::MIN);
        assert_eq!(backoff.next(false), Duration::from_millis(100));
        assert_eq!(backoff.next(true), RetryBackoff::MIN);
    }
}
