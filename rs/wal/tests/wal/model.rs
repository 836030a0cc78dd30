//! Property test: random appends, syncs, truncations, replays and reopenings against a `Vec`.

use proptest::prelude::*;
use tarn_wal::{Durability, Wal};

use crate::{open, payload, replay_all, small_config};

#[derive(Debug, Clone)]
enum Op {
    /// Append entries of these payload lengths (concurrently from threads when more than one).
    Append(Vec<usize>, bool),
    Sync,
    /// Truncate before `first + (len * per_mille / 1000)`.
    TruncateBefore(u64),
    Replay(u64),
    Reopen,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (prop::collection::vec(0usize..700, 1..12), any::<bool>()).prop_map(|(lens, fsync)| Op::Append(lens, fsync)),
        1 => Just(Op::Sync),
        1 => (0u64..=1000).prop_map(Op::TruncateBefore),
        2 => (0u64..=1000).prop_map(Op::Replay),
        1 => Just(Op::Reopen),
    ]
}

fn check_replay(wal: &Wal, model: &[Vec<u8>], from: u64) {
    let entries = replay_all(wal, from);
    let expected: Vec<(u64, Vec<u8>)> = model
        .iter()
        .enumerate()
        .skip(from as usize - 1)
        .map(|(idx, p)| (idx as u64 + 1, p.clone()))
        .collect();
    assert_eq!(entries, expected);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn log_matches_a_vec_model(ops in prop::collection::vec(op(), 1..40)) {
        let dir = tempfile::tempdir().unwrap();
        let (mut wal, _) = open(dir.path(), small_config());
        let mut model: Vec<Vec<u8>> = Vec::new();
        // Every sequence number below this may have been truncated.
        let mut truncated_before = 1u64;
        let mut tag = 0u64;
        for op in ops {
            match op {
                Op::Append(lens, fsync) => {
                    let durability = if fsync { Durability::Fsync } else { Durability::Written };
                    let tickets: Vec<_> = lens
                        .iter()
                        .map(|&len| {
                            tag += 1;
                            let p = payload(tag, len);
                            (p.clone(), wal.append(p, durability))
                        })
                        .collect();
                    for (p, ticket) in tickets {
                        let seq = ticket.wait().unwrap();
                        prop_assert_eq!(seq, model.len() as u64 + 1);
                        model.push(p.to_vec());
                    }
                }
                Op::Sync => {
                    prop_assert_eq!(wal.sync().wait().unwrap(), model.len() as u64);
                    prop_assert_eq!(wal.last_durable_seq(), model.len() as u64);
                }
                Op::TruncateBefore(per_mille) => {
                    let span = model.len() as u64 + 1 - truncated_before;
                    let seq = truncated_before + span * per_mille / 1000;
                    let first = wal.truncate_before(seq).wait().unwrap();
                    prop_assert!(first <= seq.max(1));
                    truncated_before = truncated_before.max(seq);
                    prop_assert_eq!(first, wal.first_seq());
                }
                Op::Replay(per_mille) => {
                    let first = wal.first_seq();
                    let from = first + (model.len() as u64 + 1 - first) * per_mille / 1000;
                    check_replay(&wal, &model, from.max(1));
                    if first > 1 {
                        prop_assert!(wal.replay(first - 1).is_err(), "replay of truncated entries must fail");
                    }
                }
                Op::Reopen => {
                    let first_before = wal.first_seq();
                    drop(wal);
                    let (reopened, report) = open(dir.path(), small_config());
                    wal = reopened;
                    prop_assert_eq!(report.torn_tail, None);
                    prop_assert_eq!(report.last_seq, model.len() as u64);
                    prop_assert_eq!(wal.first_seq(), first_before);
                    prop_assert_eq!(wal.last_durable_seq(), model.len() as u64);
                }
            }
            prop_assert_eq!(wal.last_appended_seq(), model.len() as u64);
            prop_assert!(wal.first_seq() <= truncated_before.max(1));
        }
        let first = wal.first_seq();
        check_replay(&wal, &model, first.max(1));
    }
}
