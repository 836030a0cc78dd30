//! A copy's epoch history, and the rule that cuts a returning copy's log back to what the new
//! primary holds (Kafka's KIP-101 and KIP-279, Raft's log matching).
//!
//! Every shipped entry carries the epoch of the primary that assigned its sequence number, and
//! each copy remembers where each epoch began in its own log ([`EpochHistory`]). One primary
//! per epoch, which only appends, means that two copies holding an entry at the same sequence
//! number from the same epoch hold the same entry, and the same entries before it. So the
//! part of a copy's log that is also the primary's ends at the highest sequence number where
//! both say the same epoch ([`last_common_seq`]); what the copy holds after that was written
//! by a primary that lost its place before the write was acknowledged (an acknowledged write
//! is on every in-sync copy, and only an in-sync copy is promoted), and is cut off.

/// Where each epoch began in one copy's log: `(epoch, first sequence number)`, epochs strictly
/// increasing, first sequence numbers non-decreasing (an epoch whose primary appended nothing
/// shares its start with the next one and is dropped by it).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EpochHistory {
    starts: Vec<(u64, u64)>,
}

impl EpochHistory {
    /// An empty history (a log with no entry).
    pub fn new() -> EpochHistory {
        EpochHistory::default()
    }

    /// A history from its starts, checked: epochs strictly increasing, starts increasing.
    pub fn from_starts(starts: Vec<(u64, u64)>) -> Result<EpochHistory, String> {
        for pair in starts.windows(2) {
            let ((e0, s0), (e1, s1)) = (pair[0], pair[1]);
            if e1 <= e0 || s1 <= s0 {
                return Err(format!(
                    "epoch history out of order: epoch {e0} from {s0}, then epoch {e1} from {s1}"
                ));
            }
        }
        Ok(EpochHistory { starts })
    }

    /// `(epoch, first sequence number)`, oldest first.
    pub fn starts(&self) -> &[(u64, u64)] {
        &self.starts
    }

    /// The latest epoch and where it began.
    pub fn latest(&self) -> Option<(u64, u64)> {
        self.starts.last().copied()
    }

    /// Records that the entries from `seq` on are `epoch`'s (called before appending the first
    /// entry of a new epoch). The same epoch again changes nothing; an older one is refused (a
    /// stale primary's entry). An epoch that begins where the previous one began replaces it.
    pub fn begin(&mut self, epoch: u64, seq: u64) -> Result<(), String> {
        match self.starts.last().copied() {
            Some((last_epoch, _)) if epoch == last_epoch => Ok(()),
            Some((last_epoch, _)) if epoch < last_epoch => Err(format!(
                "an entry of epoch {epoch} after entries of epoch {last_epoch}"
            )),
            Some((_, last_start)) if seq < last_start => Err(format!(
                "epoch {epoch} would begin at {seq}, before the previous epoch's first entry \
                 {last_start}"
            )),
            Some((_, last_start)) if seq == last_start => {
                self.starts.pop();
                self.starts.push((epoch, seq));
                Ok(())
            }
            _ => {
                self.starts.push((epoch, seq));
                Ok(())
            }
        }
    }

    /// The epoch of the entry at `seq` (in a log that holds it), `None` before the first start.
    pub fn epoch_of(&self, seq: u64) -> Option<u64> {
        let idx = self.starts.partition_point(|&(_, start)| start <= seq);
        idx.checked_sub(1).map(|i| self.starts[i].0)
    }

    /// Forgets the epochs that began after `last_seq` (the log was cut back to `last_seq`).
    pub fn truncate_after(&mut self, last_seq: u64) {
        self.starts.retain(|&(_, start)| start <= last_seq);
    }
}

/// The last sequence number a copy keeps when it follows a primary: the highest `s` at or
/// below both logs' ends at which both hold an entry of the same epoch (0: nothing in common).
/// The copy cuts its log after `s`, then appends the primary's entries from `s + 1`.
pub fn last_common_seq(
    copy: &EpochHistory,
    copy_last: u64,
    primary: &EpochHistory,
    primary_last: u64,
) -> u64 {
    let limit = copy_last.min(primary_last);
    let end_of = |history: &EpochHistory, idx: usize, last: u64| {
        history
            .starts
            .get(idx + 1)
            .map_or(last, |&(_, next)| next - 1)
    };
    for (idx, &(epoch, start)) in copy.starts.iter().enumerate().rev() {
        if start > limit {
            continue;
        }
        let Ok(p_idx) = primary.starts.binary_search_by_key(&epoch, |&(e, _)| e) else {
            continue;
        };
        let low = start.max(primary.starts[p_idx].1);
        let high = end_of(copy, idx, copy_last)
            .min(end_of(primary, p_idx, primary_last))
            .min(limit);
        if low <= high {
            return high;
        }
    }
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histories_record_epochs_in_order() {
        let mut h = EpochHistory::new();
        assert_eq!(h.epoch_of(1), None);
        h.begin(1, 1).unwrap();
        h.begin(1, 5).unwrap();
        h.begin(3, 10).unwrap();
        assert!(h.begin(2, 12).is_err(), "an older epoch's entry is refused");
        assert!(h.begin(4, 9).is_err());
        assert_eq!(h.starts(), [(1, 1), (3, 10)]);
        assert_eq!(h.epoch_of(9), Some(1));
        assert_eq!(h.epoch_of(10), Some(3));
        assert_eq!(h.epoch_of(1_000), Some(3));
        // An epoch with no entry gives way to the next one at the same start.
        h.begin(5, 12).unwrap();
        h.begin(6, 12).unwrap();
        assert_eq!(h.starts(), [(1, 1), (3, 10), (6, 12)]);
        h.truncate_after(11);
        assert_eq!(h.starts(), [(1, 1), (3, 10)]);
        assert_eq!(h.latest(), Some((3, 10)));
        assert!(EpochHistory::from_starts(vec![(1, 1), (1, 4)]).is_err());
        assert!(EpochHistory::from_starts(vec![(1, 4), (2, 4)]).is_err());
        assert_eq!(EpochHistory::from_starts(vec![(1, 1), (3, 10)]).unwrap(), h);
    }

    #[test]
    fn kip_101_a_double_failover_cuts_the_divergent_tail() {
        // KIP-101's case: A (epoch 1) wrote 1..=3, replicated 1..=2 to B; A fails, B is
        // primary at epoch 2 and writes 3..=4 (a different entry 3); B fails before A returns,
        // A is promoted again at epoch 3 ... here: A returns as B's follower.
        let a = EpochHistory::from_starts(vec![(1, 1)]).unwrap();
        let b = EpochHistory::from_starts(vec![(1, 1), (2, 3)]).unwrap();
        assert_eq!(last_common_seq(&a, 3, &b, 4), 2, "A's entry 3 is cut");
        // A copy that is only behind keeps everything.
        assert_eq!(last_common_seq(&a, 2, &b, 4), 2);
        // A copy ahead within the same epoch is cut back to the primary's end.
        assert_eq!(last_common_seq(&b, 4, &a, 2), 2);
        // Nothing in common.
        let c = EpochHistory::from_starts(vec![(4, 1)]).unwrap();
        assert_eq!(last_common_seq(&c, 3, &b, 4), 0);
        assert_eq!(last_common_seq(&EpochHistory::new(), 0, &b, 4), 0);
    }

    /// SplitMix64: a seeded generator for the model test.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
    }

    /// One copy in the model: its log (entry i at sequence number i + 1, each `(epoch, id)`),
    /// its history, and whether it follows the current primary (its log is a prefix of the
    /// primary's) or must first cut its log back.
    #[derive(Clone)]
    struct ModelCopy {
        log: Vec<(u64, u64)>,
        history: EpochHistory,
        following: bool,
        alive: bool,
    }

    /// Random appends, shipping, acknowledgements, replica failures, failovers among the
    /// in-sync copies and returns, over 3 copies: every acknowledged entry survives every
    /// failover, and a returning copy cut back by `last_common_seq` holds a prefix of the
    /// primary's log (no divergence is ever kept).
    #[test]
    fn model_no_acknowledged_entry_lost_and_copies_never_diverge() {
        for seed in 0..400u64 {
            let mut rng = Rng(seed);
            let mut copies: Vec<ModelCopy> = (0..3)
                .map(|_| ModelCopy {
                    log: Vec::new(),
                    history: EpochHistory::new(),
                    following: true,
                    alive: true,
                })
                .collect();
            let mut primary = 0usize;
            let mut epoch = 1u64;
            let mut in_sync = [true; 3];
            let mut acknowledged: Vec<(u64, (u64, u64))> = Vec::new();
            let mut next_id = 0u64;
            for _step in 0..200 {
                match rng.below(7) {
                    // The primary appends an entry of its epoch.
                    0 | 1 if copies[primary].alive => {
                        next_id += 1;
                        let p = &mut copies[primary];
                        let seq = p.log.len() as u64 + 1;
                        p.history.begin(epoch, seq).unwrap();
                        p.log.push((epoch, next_id));
                    }
                    // Ship part of the primary's tail to a following copy.
                    2 | 3 => {
                        let to = rng.below(3);
                        if to == primary || !copies[to].following || !copies[to].alive {
                            continue;
                        }
                        let p_log = copies[primary].log.clone();
                        let have = copies[to].log.len();
                        let upto = have + rng.below(p_log.len() - have + 1);
                        for (i, &(e, id)) in p_log.iter().enumerate().take(upto).skip(have) {
                            copies[to].history.begin(e, i as u64 + 1).unwrap();
                            copies[to].log.push((e, id));
                        }
                    }
                    // Acknowledge what every in-sync copy holds (a primary that is alive).
                    4 if copies[primary].alive => {
                        assert!(
                            (0..3).all(|c| !in_sync[c] || copies[c].following),
                            "seed {seed}: an in-sync copy counted before it follows"
                        );
                        let held = (0..3)
                            .filter(|c| in_sync[*c])
                            .map(|c| copies[c].log.len())
                            .min()
                            .unwrap();
                        for (i, entry) in copies[primary].log.iter().enumerate().take(held) {
                            if !acknowledged.iter().any(|(s, _)| *s == i as u64 + 1) {
                                acknowledged.push((i as u64 + 1, *entry));
                            }
                        }
                    }
                    // A replica fails: out of the in-sync set (before any write is acknowledged
                    // without it), and its process dies.
                    5 => {
                        let c = rng.below(3);
                        if c != primary {
                            in_sync[c] = false;
                            copies[c].alive = false;
                        }
                    }
                    // The primary dies; an alive in-sync copy is promoted at the next epoch.
                    _ => {
                        copies[primary].alive = false;
                        let candidates: Vec<usize> = (0..3)
                            .filter(|c| *c != primary && in_sync[*c] && copies[*c].alive)
                            .collect();
                        if candidates.is_empty() {
                            copies[primary].alive = true; // nobody to promote: it comes back
                            continue;
                        }
                        let old = primary;
                        primary = candidates[rng.below(candidates.len())];
                        epoch += 1;
                        in_sync[old] = false;
                        for (i, c) in copies.iter_mut().enumerate() {
                            c.following = i == primary;
                        }
                        // Every acknowledged entry is on the new primary.
                        for (seq, entry) in &acknowledged {
                            assert_eq!(
                                copies[primary].log.get(*seq as usize - 1),
                                Some(entry),
                                "seed {seed}: acknowledged entry {seq} lost by the failover"
                            );
                        }
                    }
                }
                // Copies that are not following come back (alive), cut their logs back by the
                // rule and follow; then they may rejoin the in-sync set once they hold
                // everything.
                for c in 0..3 {
                    if c == primary {
                        continue;
                    }
                    if !copies[c].alive && rng.below(4) == 0 {
                        copies[c].alive = true;
                        copies[c].following = false;
                    }
                    if copies[c].alive && !copies[c].following {
                        let (p_hist, p_last) = (
                            copies[primary].history.clone(),
                            copies[primary].log.len() as u64,
                        );
                        let keep = last_common_seq(
                            &copies[c].history,
                            copies[c].log.len() as u64,
                            &p_hist,
                            p_last,
                        );
                        // Nothing in common is cut: the next entries differ or one is missing.
                        if let (Some(mine), Some(theirs)) = (
                            copies[c].log.get(keep as usize),
                            copies[primary].log.get(keep as usize),
                        ) {
                            assert_ne!(mine, theirs, "seed {seed}: cut too much");
                        }
                        copies[c].log.truncate(keep as usize);
                        copies[c].history.truncate_after(keep);
                        assert_eq!(
                            copies[c].log[..],
                            copies[primary].log[..keep as usize],
                            "seed {seed}: copy {c} kept a divergent entry"
                        );
                        copies[c].following = true;
                    }
                    if copies[c].alive
                        && copies[c].following
                        && copies[c].log == copies[primary].log
                    {
                        in_sync[c] = true;
                    }
                }
            }
        }
    }
}
