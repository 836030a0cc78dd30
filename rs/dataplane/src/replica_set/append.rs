//! The replica's side of a shard's replication: [`append_entries`], which takes the primary's
//! entries (or answers its probe, cuts a divergent tail, starts a seed) for this node's copy.

use std::sync::Arc;
use std::time::Duration;

use tarn_cluster::{EpochHistory, ShardName};
use tarn_proto::v1 as pb;

use crate::cluster::ClusterNode;
use crate::epochs::{from_wire, record_epochs, to_wire};
use crate::status::ApiError;

/// How long a replica waits for the batches before one that arrived ahead of them (calls in
/// flight together may reach the replica's handler out of order).
const REORDER_WAIT: Duration = Duration::from_secs(1);

/// The replica's side of `AppendEntries`: appends the primary's entries to this node's copy at
/// the same sequence numbers. Served only when this node's view gives the shard, at exactly
/// the request's epoch, to the sender as primary and to this node as a replica; a local copy is
/// created empty only where the map says this data directory starts it empty. Every answer
/// names this data directory (its token), the one a join records for the copy.
pub async fn append_entries(
    node: &Arc<ClusterNode>,
    request: pb::AppendEntriesRequest,
) -> Result<pb::AppendEntriesResponse, ApiError> {
    let mut answer = append_entries_here(node, request).await?;
    answer.incarnation = node.incarnation.clone();
    Ok(answer)
}

async fn append_entries_here(
    node: &Arc<ClusterNode>,
    request: pb::AppendEntriesRequest,
) -> Result<pb::AppendEntriesResponse, ApiError> {
    let shard_ref = request
        .shard
        .ok_or_else(|| ApiError::invalid("shard", "missing"))?;
    crate::registry::validate_name(&shard_ref.collection)?;
    let shard = ShardName {
        collection: shard_ref.collection.clone(),
        uid: shard_ref.uid,
        shard: shard_ref.shard,
    };
    let epoch = shard_ref.epoch;
    if node
        .state()
        .assignment(&shard)
        .is_none_or(|a| a.epoch < epoch)
    {
        // The primary's view may be a moment ahead of this node's.
        node.wait_for_view(Duration::from_millis(500), |s| {
            s.assignment(&shard).is_some_and(|a| a.epoch >= epoch)
        })
        .await;
    }
    let assignment = node
        .state()
        .assignment(&shard)
        .cloned()
        .ok_or_else(|| ApiError::NotFound(shard.collection.clone()))?;
    if assignment.epoch != epoch || assignment.owner != request.from_node {
        return Err(ApiError::StaleShardMap(format!(
            "shard {} of collection '{}' has primary {} at epoch {} here, not {} at epoch \
             {epoch}",
            shard.shard, shard.collection, assignment.owner, assignment.epoch, request.from_node
        )));
    }
    if !matches!(
        assignment.role_of(&node.node_id),
        Some(tarn_cluster::CopyRole::InSyncReplica | tarn_cluster::CopyRole::CatchingUp)
    ) {
        return Err(ApiError::StaleShardMap(format!(
            "node {} is not a replica of shard {} of collection '{}' at epoch {epoch}",
            node.node_id, shard.shard, shard.collection
        )));
    }
    let primary_history = from_wire(&request.epochs)?;
    let local = shard.local_name();
    if assignment.epoch < node.ledger.held_epoch(&local) {
        // A record older than this copy's (etcd restored from an older backup): nothing is
        // cut or appended on its word; reconciliation sets the copy aside.
        return Err(ApiError::StaleShardMap(format!(
            "shard {} of collection '{}': the record's epoch {} is older than the epoch this \
             replica held it at",
            shard.shard, shard.collection, assignment.epoch
        )));
    }
    if node.incoming.contains_key(&local) {
        return Ok(pb::AppendEntriesResponse {
            seeding: true,
            ..Default::default()
        });
    }
    if request.seed {
        crate::transfer::start_seed(node, shard, request.from_node, epoch);
        return Ok(pb::AppendEntriesResponse {
            seeding: true,
            ..Default::default()
        });
    }
    let needs_seed = || pb::AppendEntriesResponse {
        needs_seed: true,
        ..Default::default()
    };
    // The shard's write gate, exclusively, then the copy's lock (the data plane's lock order):
    // a write this node took as the shard's primary at an earlier epoch, still in flight, lands
    // before anything of the new primary's does, never among its entries (where a later batch
    // would take it for the primary's own entry). Such a write fails as soon as this node's
    // view moves on, so the wait is short; bounded all the same.
    let gate = node.gate(&local);
    let lock = node.copy_lock(&local);
    let reorder_until = tokio::time::Instant::now() + REORDER_WAIT;
    let (writes_held, copy) = loop {
        let Ok(held) =
            tokio::time::timeout(super::EPOCH_DRAIN_LIMIT, Arc::clone(&gate).write_owned()).await
        else {
            return Err(ApiError::Unavailable(format!(
                "shard {} of collection '{}': writes this node took as its primary are still \
                 in flight here; retry",
                shard.shard, shard.collection
            )));
        };
        let copy = Arc::clone(&lock).lock_owned().await;
        // A batch sent while earlier ones were in flight may get here first: it waits for them
        // (bounded), so batches are applied in the order they were sent.
        let ahead = request.first_seq > 1
            && !request.entries.is_empty()
            && node
                .registry
                .get_shard(&local)
                .is_ok_and(|c| c.last_seq_no() + 1 < request.first_seq);
        if !ahead || tokio::time::Instant::now() >= reorder_until {
            break (held, copy);
        }
        drop(copy);
        drop(held);
        tokio::time::sleep(Duration::from_micros(200)).await;
    };
    // The view again, under the copy's lock and after any wait: a new primary's probe may have
    // been served meanwhile (its promotion seen), and nothing of an older epoch's primary is
    // taken after that.
    if node
        .state()
        .assignment(&shard)
        .is_none_or(|now| now.epoch != epoch || now.owner != request.from_node)
    {
        return Err(ApiError::StaleShardMap(format!(
            "shard {} of collection '{}' changed primary while this call waited",
            shard.shard, shard.collection
        )));
    }
    if node.registry.get_shard(&local).is_err()
        && !node.replica_starts_empty_here(&local, &assignment)
    {
        return Ok(needs_seed());
    }
    let mut collection = node.replica_copy(&shard, &assignment).await?;
    let mut cut_entries = 0;
    if request.cut && request.cut_after < collection.last_seq_no() {
        match node.registry.cut_shard_log(&local, request.cut_after).await {
            Ok(cut) => (collection, cut_entries) = cut,
            Err(error) => {
                tracing::warn!(shard = %local, %error, "this replica needs a fresh copy of the primary's data");
                return Ok(needs_seed());
            }
        }
    }
    // A replica's copy makes visible only what the primary says is committed (docs/CLUSTER.md,
    // "What a read sees").
    collection.hold_uncommitted(0);
    let last = collection.last_seq_no();
    if request.entries.is_empty() && request.matched > 0 && !request.cut {
        // A commit notice: this copy's log is the primary's up to `matched`.
        collection.raise_visible(request.committed.min(request.matched).min(last));
        return Ok(pb::AppendEntriesResponse {
            last_seq: last,
            durable_seq: collection.durable_seq_no(),
            ..Default::default()
        });
    }
    if request.entries.is_empty() {
        let history = {
            let collection = collection.clone();
            tokio::task::spawn_blocking(move || collection.epoch_starts())
                .await
                .map_err(|e| ApiError::Internal(e.to_string()))??
        };
        return Ok(pb::AppendEntriesResponse {
            last_seq: last,
            durable_seq: collection.sync_wal().await?,
            epochs: to_wire(&history),
            cut_entries,
            ..Default::default()
        });
    }
    if request.first_seq == 0 || request.first_seq > last + 1 {
        return Err(ApiError::Unsupported(format!(
            "entries from {} do not continue this replica's log, which ends at {last}",
            request.first_seq
        )));
    }
    // Entries this copy already has (sent again after a lost answer) are skipped, but only if
    // they are the same ones: written at the epoch the primary's history gives each position
    // (one primary per epoch). Entries of another epoch at those positions (a deposed
    // primary's) refuse the batch: the primary probes again, and the copy is cut back.
    let batch_end = request.first_seq + request.entries.len() as u64 - 1;
    let skip = (last + 1 - request.first_seq) as usize;
    if skip > 0 {
        let starts = {
            let collection = collection.clone();
            tokio::task::spawn_blocking(move || collection.epoch_starts())
                .await
                .map_err(|e| ApiError::Internal(e.to_string()))??
        };
        let own = EpochHistory::from_starts(starts).map_err(ApiError::Internal)?;
        let differs = (request.first_seq..=last).find(|seq| {
            matches!(
                (own.epoch_of(*seq), primary_history.epoch_of(*seq)),
                (Some(mine), Some(primary)) if mine != primary
            )
        });
        if let Some(seq) = differs {
            return Err(ApiError::Unsupported(format!(
                "this replica's entry {seq} is of epoch {:?}, the primary's of epoch {:?}: the \
                 copies differ there; probe again",
                own.epoch_of(seq),
                primary_history.epoch_of(seq)
            )));
        }
    }
    let entries: Vec<(u64, Arc<[u8]>)> = request
        .entries
        .into_iter()
        .enumerate()
        .skip(skip)
        .map(|(i, payload)| (request.first_seq + i as u64, Arc::from(payload)))
        .collect();
    if let Some((first, end)) = entries.first().zip(entries.last()).map(|(f, l)| (f.0, l.0)) {
        record_epochs(&collection, &primary_history, first, end).await?;
        collection
            .append_copied(entries, tarn_wal::Durability::Written)
            .await?;
    }
    let last_seq = collection.last_seq_no();
    // Every entry up to the batch's last is now the primary's (appended, or checked to be of
    // the primary's epoch): those it says are committed become visible.
    collection.raise_visible(request.committed.min(batch_end));
    // Synced outside the copy's lock: the next batch is appended meanwhile, and the WAL's
    // write group makes one sync of both when they meet.
    drop(copy);
    drop(writes_held);
    let durable = collection.sync_wal().await?;
    // Test builds: a replica slow to answer (a slow disk), which keeps it close behind but
    // never quick enough to join.
    crate::faults::pause_point("replication::answer_delay").await;
    Ok(pb::AppendEntriesResponse {
        last_seq,
        durable_seq: durable,
        cut_entries,
        ..Default::default()
    })
}
