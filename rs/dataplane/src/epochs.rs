//! Epoch histories of a shard's copies (`EPOCHS`, docs/CLUSTER.md, "Replicas"): a primary
//! records its epoch before its first entry of it ([`begin_epoch`]), a replica records the
//! epochs of the primary's entries before it appends them ([`record_epochs`]), and the history
//! travels on the wire as `EpochStart`s ([`to_wire`], [`from_wire`]).

use tarn_cluster::EpochHistory;
use tarn_collection::Collection;
use tarn_proto::v1 as pb;

use crate::status::ApiError;

/// Records, durably, that this copy's entries from its next one on are `epoch`'s (before the
/// first of them is appended: a primary's first write at an epoch). Entries the copy holds from
/// before it kept a history are epoch 0's (a shard's one line of primaries before it had
/// replicas: every copy got them from it). Returns the history.
pub(crate) async fn begin_epoch(
    collection: &Collection,
    epoch: u64,
) -> Result<Vec<pb::EpochStart>, ApiError> {
    let collection = collection.clone();
    tokio::task::spawn_blocking(move || -> Result<Vec<pb::EpochStart>, ApiError> {
        let mut wire = Vec::new();
        collection.update_epoch_starts(|starts| -> Result<_, ApiError> {
            let mut history =
                EpochHistory::from_starts(starts.clone()).map_err(ApiError::Internal)?;
            let next = collection.last_seq_no() + 1;
            if history.starts().is_empty() && next > 1 {
                history.begin(0, 1).map_err(ApiError::Internal)?;
            }
            history.begin(epoch, next).map_err(|why| {
                ApiError::Internal(format!(
                    "shard copy {}: cannot begin epoch {epoch}: {why}",
                    collection_label(&collection)
                ))
            })?;
            wire = to_wire(history.starts());
            Ok((history.starts() != starts.as_slice()).then(|| history.starts().to_vec()))
        })?;
        Ok(wire)
    })
    .await
    .map_err(|e| ApiError::Internal(format!("recording an epoch: {e}")))?
}

fn collection_label(collection: &Collection) -> String {
    format!("(last entry {})", collection.last_seq_no())
}

pub(crate) fn to_wire(starts: &[(u64, u64)]) -> Vec<pb::EpochStart> {
    starts
        .iter()
        .map(|&(epoch, first_seq)| pb::EpochStart { epoch, first_seq })
        .collect()
}

/// Records in a replica's epoch history, durably and before they are appended, the epochs of
/// the primary's entries `first..=last` (by the primary's history). An entry of an epoch older
/// than the copy's latest is refused: the copy must first be cut back (the primary's probe
/// does that). So is a batch whose previous entry (`first - 1`) the copy holds at another
/// epoch than the primary's history gives it (Raft's prevLogTerm): the batch would continue a
/// deposed primary's entries, not the primary's log.
pub(crate) async fn record_epochs(
    collection: &Collection,
    primary: &EpochHistory,
    first: u64,
    last: u64,
) -> Result<(), ApiError> {
    let mut starts: Vec<(u64, u64)> = Vec::new();
    if let Some(epoch) = primary.epoch_of(first) {
        starts.push((epoch, first));
    }
    starts.extend(
        primary
            .starts()
            .iter()
            .filter(|&&(_, start)| start > first && start <= last),
    );
    if starts.is_empty() {
        return Ok(());
    }
    let previous = first
        .checked_sub(1)
        .filter(|p| *p > 0)
        .and_then(|p| Some((p, primary.epoch_of(p)?)));
    let collection = collection.clone();
    tokio::task::spawn_blocking(move || -> Result<(), ApiError> {
        collection.update_epoch_starts(|before| -> Result<_, ApiError> {
            let mut history =
                EpochHistory::from_starts(before.clone()).map_err(ApiError::Internal)?;
            if let Some((seq, theirs)) = previous {
                if let Some(mine) = history.epoch_of(seq).filter(|mine| *mine != theirs) {
                    return Err(ApiError::Unsupported(format!(
                        "entries from {first} do not continue this replica's log: its entry \
                         {seq} is of epoch {mine}, the primary's of epoch {theirs}; probe again"
                    )));
                }
            }
            for (epoch, start) in starts {
                history.begin(epoch, start).map_err(|why| {
                    ApiError::Unsupported(format!(
                        "entries from {first} do not continue this replica's log: {why}"
                    ))
                })?;
            }
            Ok((history.starts() != before.as_slice()).then(|| history.starts().to_vec()))
        })
    })
    .await
    .map_err(|e| ApiError::Internal(format!("recording epochs: {e}")))?
}

/// A history from the wire, checked.
pub(crate) fn from_wire(starts: &[pb::EpochStart]) -> Result<EpochHistory, ApiError> {
    EpochHistory::from_starts(starts.iter().map(|s| (s.epoch, s.first_seq)).collect())
        .map_err(|why| ApiError::invalid("epochs", why))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A batch is recorded only if the entry before it is of the epoch the primary's history
    /// gives it: a copy whose last entries a deposed primary wrote refuses the new primary's
    /// next batch (the primary then probes and cuts), and takes it once they match.
    #[test]
    fn a_batch_must_continue_the_entry_before_it_at_the_primary_s_epoch() {
        let dir = tempfile::tempdir().unwrap();
        let config = tarn_collection::CollectionConfig::new(4, tarn_collection::MetricName::L2);
        let copy = Collection::create(&dir.path().join("c"), config).unwrap();
        copy.set_epoch_starts(vec![(1, 1)]).unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        // The copy holds 1..=100 at epoch 1; the primary's entries from 90 on are of epoch 2.
        let primary = EpochHistory::from_starts(vec![(1, 1), (2, 90)]).unwrap();
        let refused = rt
            .block_on(record_epochs(&copy, &primary, 101, 103))
            .unwrap_err();
        assert!(
            refused.to_string().contains("entry 100 is of epoch 1"),
            "{refused}"
        );
        assert_eq!(copy.epoch_starts().unwrap(), [(1, 1)]);
        // The primary's epoch 2 starting at 101: the batch continues the same log.
        let primary = EpochHistory::from_starts(vec![(1, 1), (2, 101)]).unwrap();
        rt.block_on(record_epochs(&copy, &primary, 101, 103))
            .unwrap();
        copy.close();
    }
}
