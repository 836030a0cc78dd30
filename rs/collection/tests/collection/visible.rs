//! The visible bound of a replicated shard's copy (`hold_uncommitted`, `raise_visible`): held
//! entries are durable and logged but no read, checkpoint or snapshot sees them until the bound
//! is raised over them, and a copy with an epoch history reopens held at its checkpoint.

use super::*;

fn ids_of(c: &Collection, user: u128, doc_ids: &[u128]) -> Vec<u128> {
    c.get(user, doc_ids)
        .unwrap()
        .into_iter()
        .map(|(id, _)| id)
        .collect()
}

#[test]
fn held_entries_are_invisible_until_the_bound_is_raised_over_them() {
    let dir = tempfile::tempdir().unwrap();
    let rt = runtime();
    let c = Collection::create(&dir.path().join("c"), config()).unwrap();
    let base = clustered_vectors(20, DIM, 2, 3);
    rt.block_on(async {
        let first = c.insert(&[0], &[1], row(&base, 0), None).await.unwrap();
        c.wait_applied(first, Duration::from_secs(5)).await.unwrap();
        assert_eq!(c.visible_seq(), None);
        c.hold_uncommitted(first);
        assert_eq!(c.visible_seq(), Some(first));
        let second = c.insert(&[1], &[1], row(&base, 1), None).await.unwrap();
        let third = c.remove(&[0], &[1], None).await.unwrap();
        // Durable and logged, not applied: reads see the state as of `first`.
        assert_eq!(c.stats().durable_seq, third);
        assert!(c
            .wait_applied(second, Duration::from_millis(200))
            .await
            .is_err());
        assert_eq!(ids_of(&c, 1, &[0, 1]), vec![0]);
        assert_eq!(exact_ids(&c, &[1], row(&base, 1), 5), vec![0]);
        // A snapshot taken now holds what is visible, no more.
        assert_eq!(c.snapshot().unwrap().seq_no(), first);
        c.raise_visible(second);
        c.wait_applied(second, Duration::from_secs(5))
            .await
            .unwrap();
        assert_eq!(c.stats().applied_seq, second);
        assert_eq!(ids_of(&c, 1, &[0, 1]), vec![0, 1]);
        // Never lowered.
        c.raise_visible(first);
        assert_eq!(c.visible_seq(), Some(second));
        c.release_uncommitted();
        c.wait_applied(third, Duration::from_secs(5)).await.unwrap();
        assert_eq!(ids_of(&c, 1, &[0, 1]), vec![1]);
        assert_eq!(c.visible_seq(), None);
    });
}

#[test]
fn a_flush_waits_for_the_bound_and_checkpoints_only_visible_entries() {
    let dir = tempfile::tempdir().unwrap();
    let rt = runtime();
    let c = Collection::create(&dir.path().join("c"), config()).unwrap();
    let base = clustered_vectors(20, DIM, 2, 4);
    rt.block_on(async {
        c.hold_uncommitted(0);
        let seq = c.insert(&[7], &[2], row(&base, 7), None).await.unwrap();
        let flush = {
            let c = c.clone();
            tokio::spawn(async move { c.flush().await })
        };
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(
            !flush.is_finished(),
            "a flush checkpointed an entry not yet visible"
        );
        assert_eq!(c.stats().checkpoint_seq, 0);
        c.raise_visible(seq);
        assert_eq!(flush.await.unwrap().unwrap(), seq);
        assert_eq!(ids_of(&c, 2, &[7]), vec![7]);
    });
}

#[test]
fn a_copy_with_an_epoch_history_reopens_held_at_its_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c");
    let rt = runtime();
    let base = clustered_vectors(20, DIM, 2, 5);
    let (checkpointed, tail) = {
        let c = Collection::create(&path, config()).unwrap();
        c.set_epoch_starts(vec![(1, 1)]).unwrap();
        rt.block_on(async {
            let checkpointed = c.insert(&[3], &[4], row(&base, 3), None).await.unwrap();
            c.flush().await.unwrap();
            c.hold_uncommitted(checkpointed);
            let tail = c.insert(&[4], &[4], row(&base, 4), None).await.unwrap();
            (checkpointed, tail)
        })
    };
    let c = Collection::open(&path).unwrap();
    assert_eq!(c.visible_seq(), Some(checkpointed));
    assert_eq!(c.last_seq_no(), tail);
    assert_eq!(c.stats().applied_seq, checkpointed);
    assert_eq!(ids_of(&c, 4, &[3, 4]), vec![3]);
    c.raise_visible(tail);
    rt.block_on(c.wait_applied(tail, Duration::from_secs(5)))
        .unwrap();
    assert_eq!(ids_of(&c, 4, &[3, 4]), vec![3, 4]);
    // A collection without a history opens with everything visible.
    let other = dir.path().join("d");
    {
        let d = Collection::create(&other, config()).unwrap();
        rt.block_on(async {
            d.hold_uncommitted(0);
            d.insert(&[5], &[4], row(&base, 5), None).await.unwrap();
        });
    }
    let d = Collection::open(&other).unwrap();
    assert_eq!(d.visible_seq(), None);
    assert_eq!(ids_of(&d, 4, &[5]), vec![5]);
}

/// A copy records what it knows committed (`COMMITTED`, while it runs, not only at close) and
/// reopens showing it instead of its older checkpoint; a mark past the end of the log (entries
/// lost with an unsynced tail) is cut to the log's end.
#[test]
fn a_copy_reopens_showing_what_it_last_knew_committed() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c");
    let rt = runtime();
    let base = clustered_vectors(20, DIM, 2, 6);
    let (second, third) = {
        let c = Collection::create(&path, config()).unwrap();
        c.set_epoch_starts(vec![(1, 1)]).unwrap();
        c.hold_uncommitted(0);
        rt.block_on(async {
            c.insert(&[1], &[4], row(&base, 1), None).await.unwrap();
            let second = c.insert(&[2], &[4], row(&base, 2), None).await.unwrap();
            let third = c.insert(&[3], &[4], row(&base, 3), None).await.unwrap();
            c.raise_visible(second);
            c.wait_applied(second, Duration::from_secs(5))
                .await
                .unwrap();
            // Recorded while the copy runs (a process killed now keeps it).
            let started = std::time::Instant::now();
            while !path.join(tarn_collection::COMMITTED_FILE).exists() {
                assert!(
                    started.elapsed() < Duration::from_secs(5),
                    "no mark recorded"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            (second, third)
        })
    };
    let c = Collection::open(&path).unwrap();
    assert_eq!(c.stats().checkpoint_seq, 0);
    assert_eq!(c.visible_seq(), Some(second));
    assert_eq!(ids_of(&c, 4, &[1, 2, 3]), vec![1, 2]);
    // A bound past the log's end (the primary's commit reached this copy before its entries
    // did, and they were lost): reopened at the log's end.
    c.raise_visible(third + 10);
    rt.block_on(c.wait_applied(third, Duration::from_secs(5)))
        .unwrap();
    c.close();
    let c = Collection::open(&path).unwrap();
    assert_eq!(c.visible_seq(), Some(third));
    assert_eq!(ids_of(&c, 4, &[1, 2, 3]), vec![1, 2, 3]);
}
