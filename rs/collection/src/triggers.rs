//! When a checkpoint is due: the rules, as a value ingestion updates and asks, so that unit
//! tests drive them with made-up sizes and instants instead of threads and clocks.
//!
//! A checkpoint is due by WAL bytes applied since the last one, by the mutable segment's
//! estimated size, by the vectors it holds that wait for a graph (sealing builds them with
//! tarn's builder, several times faster than the indexer's hnsw_rs: ARCHITECTURE.md, "Where
//! graphs are built"), or by age (the first operation not yet checkpointed is an interval old).
//! Automatic checkpoints start only when none is in flight. After a failure, the next one waits
//! for the next trigger (an interval, or one more bound of growth), never a tight loop; after
//! the WAL is found poisoned, none is due again.

use std::time::{Duration, Instant};

/// Why a checkpoint is due.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reason {
    WalSize,
    MutableSize,
    UnindexedTail,
    Age,
}

impl Reason {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Reason::WalSize => "WAL size",
            Reason::MutableSize => "mutable segment size",
            Reason::UnindexedTail => "unindexed tail",
            Reason::Age => "age",
        }
    }
}

#[derive(Debug, Clone)]
pub(crate) struct CheckpointTriggers {
    wal_bytes_bound: u64,
    mutable_bytes_bound: u64,
    interval: Duration,
    wal_bytes_since: u64,
    first_unsaved_at: Option<Instant>,
    /// The mutable segment's estimated size that triggers the next checkpoint: the bound,
    /// pushed one bound further after a failed checkpoint so that a failing disk is not retried
    /// on every apply.
    mutable_bytes_trigger: u64,
    unindexed_bound: usize,
    /// The unindexed tail that triggers the next checkpoint: the bound, pushed one bound
    /// further after a failed checkpoint (as `mutable_bytes_trigger`).
    unindexed_trigger: usize,
    /// The WAL is poisoned: no checkpoint is due any more.
    stopped: bool,
}

impl CheckpointTriggers {
    /// Rules with these bounds; `replayed_bytes` of WAL applied at open and not checkpointed
    /// (if any, they are unsaved as of `now`).
    pub(crate) fn new(
        wal_bytes_bound: u64,
        mutable_bytes_bound: u64,
        unindexed_bound: usize,
        interval: Duration,
        replayed_bytes: u64,
        now: Instant,
    ) -> Self {
        CheckpointTriggers {
            wal_bytes_bound,
            mutable_bytes_bound,
            interval,
            wal_bytes_since: replayed_bytes,
            first_unsaved_at: (replayed_bytes > 0).then_some(now),
            mutable_bytes_trigger: mutable_bytes_bound,
            unindexed_bound,
            unindexed_trigger: unindexed_bound,
            stopped: false,
        }
    }

    /// An operation of `payload_bytes` was applied at `now`.
    pub(crate) fn applied(&mut self, payload_bytes: u64, now: Instant) {
        self.wal_bytes_since += payload_bytes;
        self.first_unsaved_at.get_or_insert(now);
    }

    /// After an apply: is a checkpoint due by size?
    pub(crate) fn due_by_size(&self, mutable_bytes: u64, in_flight: bool) -> Option<Reason> {
        if in_flight || self.stopped {
            None
        } else if self.wal_bytes_since >= self.wal_bytes_bound {
            Some(Reason::WalSize)
        } else if mutable_bytes >= self.mutable_bytes_trigger {
            Some(Reason::MutableSize)
        } else {
            None
        }
    }

    /// Is a checkpoint due by the mutable segment's vectors waiting for a graph?
    pub(crate) fn due_by_unindexed(&self, n_unindexed: usize, in_flight: bool) -> Option<Reason> {
        (!in_flight && !self.stopped && n_unindexed >= self.unindexed_trigger)
            .then_some(Reason::UnindexedTail)
    }

    /// Whether a checkpoint will take a tail of this size off the indexer's hands: the tail is
    /// past the bound and checkpoints neither failed since the last one started nor stopped.
    pub(crate) fn seals_unindexed(&self, n_unindexed: usize) -> bool {
        !self.stopped
            && self.unindexed_trigger == self.unindexed_bound
            && n_unindexed >= self.unindexed_bound
    }

    /// When a checkpoint falls due by age, if nothing else happens first.
    pub(crate) fn deadline(&self) -> Option<Instant> {
        self.first_unsaved_at
            .filter(|_| !self.stopped)
            .map(|at| at + self.interval)
    }

    /// The deadline passed at `now`: due by age, unless one is in flight (then the next one is
    /// due an interval from now).
    pub(crate) fn deadline_passed(&mut self, in_flight: bool, now: Instant) -> Option<Reason> {
        if in_flight {
            self.first_unsaved_at = Some(now);
            None
        } else {
            Some(Reason::Age)
        }
    }

    /// A checkpoint was started (by a trigger or a flush).
    pub(crate) fn started(&mut self) {
        self.wal_bytes_since = 0;
        self.first_unsaved_at = None;
        self.mutable_bytes_trigger = self.mutable_bytes_bound;
        self.unindexed_trigger = self.unindexed_bound;
    }

    /// A checkpoint failed at `now`: retry at the next trigger, not at once.
    pub(crate) fn failed(&mut self, mutable_bytes: u64, n_unindexed: usize, now: Instant) {
        self.first_unsaved_at = Some(now);
        self.wal_bytes_since = 0;
        self.mutable_bytes_trigger = mutable_bytes + self.mutable_bytes_bound;
        self.unindexed_trigger = n_unindexed.saturating_add(self.unindexed_bound);
    }

    /// The WAL is poisoned: no checkpoint is due any more.
    pub(crate) fn stop(&mut self) {
        self.stopped = true;
        self.first_unsaved_at = None;
    }

    pub(crate) fn stopped(&self) -> bool {
        self.stopped
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECOND: Duration = Duration::from_secs(1);

    fn rules(now: Instant) -> CheckpointTriggers {
        CheckpointTriggers::new(1000, 500, 300, 10 * SECOND, 0, now)
    }

    #[test]
    fn each_trigger_fires_at_its_bound_and_only_with_nothing_in_flight() {
        let t0 = Instant::now();
        let mut r = rules(t0);
        assert_eq!(r.deadline(), None, "nothing unsaved, no deadline");
        r.applied(999, t0);
        assert_eq!(r.deadline(), Some(t0 + 10 * SECOND));
        assert_eq!(r.due_by_size(499, false), None);
        assert_eq!(r.due_by_size(500, false), Some(Reason::MutableSize));
        r.applied(1, t0 + SECOND);
        assert_eq!(
            r.deadline(),
            Some(t0 + 10 * SECOND),
            "the first unsaved one counts"
        );
        assert_eq!(r.due_by_size(0, false), Some(Reason::WalSize));
        assert_eq!(r.due_by_size(10_000, true), None, "one in flight");
        assert_eq!(r.due_by_unindexed(299, false), None);
        assert!(!r.seals_unindexed(299));
        assert_eq!(r.due_by_unindexed(300, false), Some(Reason::UnindexedTail));
        assert!(r.seals_unindexed(300));
        assert_eq!(r.due_by_unindexed(300, true), None, "one in flight");
        assert_eq!(
            r.deadline_passed(false, t0 + 10 * SECOND),
            Some(Reason::Age)
        );
        // With one in flight, age waits another interval.
        assert_eq!(r.deadline_passed(true, t0 + 10 * SECOND), None);
        assert_eq!(r.deadline(), Some(t0 + 20 * SECOND));
        r.started();
        assert_eq!((r.deadline(), r.due_by_size(499, false)), (None, None));
    }

    #[test]
    fn a_failure_waits_for_the_next_trigger_and_a_poisoned_wal_stops_them_all() {
        let t0 = Instant::now();
        let mut r = rules(t0);
        r.applied(2000, t0);
        r.started();
        r.failed(800, 400, t0 + SECOND);
        // Not due again at once: WAL bytes reset, the size bound moved one bound further.
        assert_eq!(r.due_by_size(1299, false), None);
        assert_eq!(r.due_by_size(1300, false), Some(Reason::MutableSize));
        assert_eq!(r.deadline(), Some(t0 + 11 * SECOND));
        assert_eq!(r.due_by_unindexed(699, false), None);
        assert!(
            !r.seals_unindexed(10_000),
            "after a failure the indexer takes the tail"
        );
        assert_eq!(r.due_by_unindexed(700, false), Some(Reason::UnindexedTail));
        r.stop();
        assert!(r.stopped());
        r.applied(5000, t0 + 2 * SECOND);
        assert_eq!(r.due_by_size(1_000_000, false), None);
        assert_eq!(r.deadline(), None);
    }

    #[test]
    fn replayed_bytes_at_open_count_and_start_the_clock() {
        let t0 = Instant::now();
        let r = CheckpointTriggers::new(1000, 500, 300, 10 * SECOND, 1000, t0);
        assert_eq!(r.due_by_size(0, false), Some(Reason::WalSize));
        assert_eq!(r.deadline(), Some(t0 + 10 * SECOND));
    }
}
