//! A replica's seed: a copy of its primary's snapshot and tail ([`start_seed`]), taken when the
//! replica cannot follow the primary's log.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use tarn_cluster::ShardName;
use tarn_collection::Durability;

use super::{
    catch_up_limit, copied_batch, next_message, open_and_restore, Restored, FENCE_LAG_ENTRIES,
    STREAM_SILENCE_LIMIT,
};
use crate::cluster::ClusterNode;
use crate::faults::pause_point;
use crate::status::ApiError;

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
    // The snapshot holds what the primary knew committed; the entries streamed after it stay
    // invisible until the primary's commit reaches them (its first calls after the seed).
    copy.hold_uncommitted(info.seq_no);
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
    // Test builds: a seed slow to finish (`moves::seed_restored=return(ms)`).
    pause_point("moves::seed_restored").await;
    let mut applied = info.seq_no;
    // A seed that cannot come close to a busy primary's log gives up, as a move's pull does:
    // its stream slot and the primary's WAL pin go, and the follower tries again later.
    let (started, limit) = (std::time::Instant::now(), catch_up_limit());
    loop {
        if started.elapsed() > limit {
            return Err(ApiError::Unavailable(format!(
                "the seed of shard {} of collection '{}' did not come within {FENCE_LAG_ENTRIES} \
                 entries of the primary's log in {:.1} s",
                shard.shard,
                shard.collection,
                limit.as_secs_f64()
            )));
        }
        let message = next_message(&mut stream, STREAM_SILENCE_LIMIT).await?;
        if !message.entries.is_empty() {
            let (batch, batch_bytes) = copied_batch(message.entries);
            n_bytes += batch_bytes;
            node.moves
                .seed_bytes
                .fetch_add(batch_bytes, Ordering::Relaxed);
            let (first, last) = (batch[0].0, batch[batch.len() - 1].0);
            crate::epochs::record_epochs(&copy, &history, first, last).await?;
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
