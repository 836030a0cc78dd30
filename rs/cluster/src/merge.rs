//! Merging the hits of several shards into one top-k.

/// One hit as a shard returns it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ShardHit {
    pub doc_id: u128,
    pub user_id: u128,
    pub score: f32,
}

/// The best `top_k` of the shards' hits, best first: highest score first when
/// `higher_is_better` (cosine, dot), lowest first otherwise (L2). Each shard's list may be in
/// any order; ties are broken by (user, doc) so the answer does not depend on which shard
/// answered first. A (user, doc) pair lives on one shard, so there is nothing to deduplicate.
pub fn merge_top_k(
    shards: Vec<Vec<ShardHit>>,
    top_k: usize,
    higher_is_better: bool,
) -> Vec<ShardHit> {
    let mut all: Vec<ShardHit> = shards.into_iter().flatten().collect();
    all.sort_by(|a, b| {
        let by_score = if higher_is_better {
            b.score.total_cmp(&a.score)
        } else {
            a.score.total_cmp(&b.score)
        };
        by_score
            .then(a.user_id.cmp(&b.user_id))
            .then(a.doc_id.cmp(&b.doc_id))
    });
    all.truncate(top_k);
    all
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn hit(doc: u128, score: f32) -> ShardHit {
        ShardHit {
            doc_id: doc,
            user_id: 0,
            score,
        }
    }

    proptest! {
        /// Model: the top-k over the shards' own top-k lists equals the top-k over the union of
        /// every shard's documents (each shard returns its best k, as a shard search does).
        #[test]
        fn top_k_over_shards_equals_top_k_over_their_union(
            scores in proptest::collection::vec((0u32..8, -1000i32..1000), 0..200),
            k in 1usize..30,
            higher in any::<bool>(),
        ) {
            let docs: Vec<(u32, ShardHit)> = scores
                .iter()
                .enumerate()
                .map(|(i, (shard, s))| (*shard, hit(i as u128, *s as f32 / 7.0)))
                .collect();
            let union = merge_top_k(vec![docs.iter().map(|d| d.1).collect()], k, higher);
            let per_shard: Vec<Vec<ShardHit>> = (0..8)
                .map(|shard| {
                    let mine = docs.iter().filter(|d| d.0 == shard).map(|d| d.1).collect();
                    merge_top_k(vec![mine], k, higher)
                })
                .collect();
            prop_assert_eq!(merge_top_k(per_shard, k, higher), union);
        }
    }

    #[test]
    fn direction_follows_the_metric() {
        let shards = vec![vec![hit(1, 0.5), hit(2, 0.9)], vec![hit(3, 0.1)]];
        let best_high: Vec<u128> = merge_top_k(shards.clone(), 2, true)
            .iter()
            .map(|h| h.doc_id)
            .collect();
        assert_eq!(best_high, vec![2, 1]);
        let best_low: Vec<u128> = merge_top_k(shards, 2, false)
            .iter()
            .map(|h| h.doc_id)
            .collect();
        assert_eq!(best_low, vec![3, 1]);
    }
}
