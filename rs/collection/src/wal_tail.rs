//! What a shard move needs from a collection beyond a snapshot: the WAL entries written after
//! it, read on the old owner ([`WalTail`]), and appended on the new one at the same sequence
//! numbers ([`Collection::append_copied`]), so that the copy is the same log and every read
//! token (a position in that log) keeps its meaning after the move.
//!
//! A tail keeps the snapshot's retention pin (the WAL from the snapshot's checkpoint on), so
//! checkpoints on the old owner never truncate an entry the tail has yet to read.

use std::sync::Arc;

use tarn_wal::{Durability, Replay, ReplayPosition};

use crate::collection::Collection;
use crate::error::{CollectionError, Result};
use crate::op;
use crate::retention::RetentionPin;
use crate::snapshot::Snapshot;

/// Reads a collection's WAL entries after a snapshot, in order, as they become durable.
#[derive(Debug)]
pub struct WalTail {
    collection: Collection,
    next_seq: u64,
    /// The replay being read, while it has entries left.
    replay: Option<Replay>,
    /// Where the last replay stopped: the next one starts reading there, so following the log
    /// reads each entry once (re-reading the segment from its start per call made the last
    /// entries of a move arrive tens of milliseconds late).
    resume: Option<ReplayPosition>,
    _pin: RetentionPin,
}

impl Collection {
    /// The entries after `snapshot` (taken of this collection), keeping the WAL they are in.
    pub fn wal_tail(&self, snapshot: Snapshot) -> WalTail {
        WalTail {
            collection: self.clone(),
            next_seq: snapshot.seq_no() + 1,
            replay: None,
            resume: None,
            _pin: snapshot.into_pin(),
        }
    }

    /// The entries from `seq` on (a replica's next entry), keeping the WAL they are in; `None`
    /// if checkpoints may already have truncated the log past `seq` (the reader needs a
    /// snapshot) or `seq` is beyond the next entry to be appended.
    pub fn wal_tail_from(&self, seq: u64) -> Option<WalTail> {
        let seq = seq.max(1);
        if seq > self.wal().last_appended_seq() + 1 {
            return None;
        }
        let pin = self.shared().retention.pin_wal_from(seq)?;
        Some(WalTail {
            collection: self.clone(),
            next_seq: seq,
            replay: None,
            resume: None,
            _pin: pin,
        })
    }

    /// Appends entries read from another copy of this collection's log (a [`WalTail`]) at the
    /// same sequence numbers: `entries` must continue this log exactly (the first one right
    /// after its last entry, then consecutive), and each must be a valid operation for this
    /// collection. Resolves to the last one's sequence number once written (durable under
    /// `Fsync`). Only a collection that takes no other writes (a shard being copied in) may
    /// be given copied entries.
    pub async fn append_copied(
        &self,
        entries: Vec<(u64, Arc<[u8]>)>,
        durability: Durability,
    ) -> Result<u64> {
        self.check_not_failed()?;
        let wal = self.wal();
        for (expected, (seq, payload)) in (wal.last_appended_seq() + 1..).zip(&entries) {
            if *seq != expected {
                return Err(CollectionError::invalid(
                    "seq_no",
                    format!("a copied entry at {seq} does not continue the log at {expected}"),
                ));
            }
            op::decode(payload, self.config().dimension)?;
        }
        let n = entries.len();
        let tickets: Vec<_> = entries
            .into_iter()
            .enumerate()
            .map(|(i, (seq, payload))| {
                let mode = if i + 1 == n {
                    durability
                } else {
                    Durability::Written
                };
                (seq, wal.append(payload, mode))
            })
            .collect();
        let mut last = wal.last_appended_seq();
        for (seq, ticket) in tickets {
            let got = ticket.await?;
            if got != seq {
                let why = format!("a copied entry meant for {seq} was written at {got}");
                wal.poison(&why);
                return Err(CollectionError::Corrupt(why));
            }
            last = got;
        }
        Ok(last)
    }

    /// Makes every entry appended so far durable; resolves to the last one's sequence number.
    pub async fn sync_wal(&self) -> Result<u64> {
        Ok(self.wal().sync().await?)
    }

    /// [`Collection::sync_wal`] for a blocking thread.
    pub fn sync_wal_blocking(&self) -> Result<u64> {
        Ok(self.wal().sync().wait()?)
    }

    /// The last sequence number appended (durable or not).
    pub fn last_seq_no(&self) -> u64 {
        self.wal().last_appended_seq()
    }

    /// The last sequence number known durable.
    pub fn durable_seq_no(&self) -> u64 {
        self.wal().last_durable_seq()
    }
}

impl WalTail {
    /// The next entry's sequence number.
    pub fn next_seq(&self) -> u64 {
        self.next_seq
    }

    /// Moves the tail's hold on the WAL up to its next entry, so that checkpoints may
    /// truncate what it has read (a long-lived reader, such as a replica's, calls it now and
    /// then).
    pub fn release_read(&mut self) {
        if let Some(pin) = self
            .collection
            .shared()
            .retention
            .pin_wal_from(self.next_seq)
        {
            self._pin = pin;
        }
    }

    /// The collection's last durable sequence number.
    pub fn durable_seq(&self) -> u64 {
        self.collection.wal().last_durable_seq()
    }

    /// The next entries, in order, up to `up_to` (at most the last durable one) and about
    /// `max_bytes` of payload; empty when there are none yet. Blocking (file reads).
    pub fn read(&mut self, up_to: u64, max_bytes: usize) -> Result<Vec<(u64, Arc<[u8]>)>> {
        let last = up_to.min(self.durable_seq());
        let mut out = Vec::new();
        let mut n_bytes = 0;
        while self.next_seq <= last && n_bytes < max_bytes {
            let replay = match &mut self.replay {
                Some(replay) => replay,
                None => self.replay.insert(
                    self.collection
                        .wal()
                        .replay_resuming(self.next_seq, last, self.resume)
                        .map_err(CollectionError::from)?,
                ),
            };
            match replay.next() {
                Some(entry) => {
                    let (seq, payload) = entry.map_err(CollectionError::from)?;
                    if seq != self.next_seq {
                        return Err(CollectionError::Corrupt(format!(
                            "the WAL gave entry {seq} where {} was next",
                            self.next_seq
                        )));
                    }
                    n_bytes += payload.len();
                    out.push((seq, Arc::from(payload)));
                    self.next_seq += 1;
                }
                None => {
                    self.resume = self.replay.take().and_then(|r| r.position());
                }
            }
        }
        Ok(out)
    }
}
