//! Cluster mode's data path: each `tarn.v1.Tarn` call split by shard, sent to the shards
//! concerned in parallel (this node's own shards locally, the others through `tarn-client`),
//! and the answers combined: acknowledgements into a read token, hits merged by score into
//! `top_k`, counters summed. A shard whose owner is down answers UNAVAILABLE naming the shard and
//! the node, within the call's deadline; a search may ask for partial results instead.
//!
//! Files: this one holds the fan-out ([`Router`]'s `fan_out`) and one shard's call with its
//! retries (`on_shard`: a moved shard, a spread read's next copy); `writes.rs` insert and
//! remove; `reads.rs` search and get; `collection_calls.rs` a whole collection's info,
//! `AddFields` and `Flush`; `import.rs` imports of a snapshot or a set-aside copy.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tarn_client::Durability;
use tarn_cluster::{CollectionMap, ReadPositions};
use tarn_collection::SearchRequest;
use tarn_proto::v1 as pb;

use crate::cluster::{ClusterNode, Target};
use crate::convert;
use crate::fanout;
use crate::router::Router;
use crate::status::ApiError;

mod collection_calls;
mod import;
mod reads;
mod writes;

fn wire_durability(value: i32) -> Result<Option<Durability>, ApiError> {
    Ok(match convert::durability(value)? {
        None => None,
        Some(tarn_wal::Durability::Fsync) => Some(Durability::Fsync),
        Some(tarn_wal::Durability::Written) => Some(Durability::Written),
    })
}

impl Router {
    /// Runs `call` for every (shard, part) at once and returns the answers in the parts' order;
    /// records the whole fan-out's time under `method`.
    async fn fan_out<P, T, F, Fut>(
        &self,
        method: &'static str,
        parts: Vec<(u32, P)>,
        call: F,
    ) -> Vec<(u32, Result<T, ApiError>)>
    where
        F: Fn(u32, P) -> Fut,
        Fut: std::future::Future<Output = Result<T, ApiError>>,
    {
        let started = std::time::Instant::now();
        let shards: Vec<u32> = parts.iter().map(|p| p.0).collect();
        let answers = futures_util::future::join_all(
            parts.into_iter().map(|(shard, part)| call(shard, part)),
        )
        .await;
        self.metrics
            .fan_out
            .with_label_values(&[method])
            .observe(started.elapsed().as_secs_f64());
        shards.into_iter().zip(answers).collect()
    }

    /// [`Router::on_shard`], also answering the shard's epoch in the map the successful attempt
    /// was routed by (a write's read token carries the epoch it was acknowledged at, which may
    /// be newer than the map the call started with).
    async fn on_shard_stamped<T, F, Fut>(
        &self,
        cluster: &ClusterNode,
        map: &CollectionMap,
        shard: u32,
        access: Access,
        deadline: Duration,
        call: F,
    ) -> Result<(T, u64), ApiError>
    where
        F: Fn(Target, Arc<CollectionMap>) -> Fut,
        Fut: std::future::Future<Output = Result<T, ApiError>>,
    {
        let stamped = |target, map: Arc<CollectionMap>| {
            let epoch = map.shards.get(shard as usize).map_or(0, |a| a.epoch);
            let answer = call(target, map);
            async move { answer.await.map(|value| (value, epoch)) }
        };
        self.on_shard(cluster, map, shard, access, deadline, stamped)
            .await
    }

    /// Runs `call` on a shard's owner (here or remote). When the owner answers that the map
    /// moved on (ABORTED: the shard was moved, or is fenced while a move hands it over; a
    /// write is refused before anything is written), waits for this node's view of the shard to
    /// change and calls again, until `deadline`; a write never goes to a fenced shard.
    #[allow(clippy::too_many_arguments)]
    async fn on_shard<T, F, Fut>(
        &self,
        cluster: &ClusterNode,
        map: &CollectionMap,
        shard: u32,
        access: Access,
        deadline: Duration,
        call: F,
    ) -> Result<T, ApiError>
    where
        F: Fn(Target, Arc<CollectionMap>) -> Fut,
        Fut: std::future::Future<Output = Result<T, ApiError>>,
    {
        let until = Instant::now() + deadline;
        let mut current: Option<Arc<CollectionMap>> = None;
        let mut attempt = 0usize;
        static SPREAD: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let spread = SPREAD.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        loop {
            let map_now = current.as_deref().unwrap_or(map);
            let assignment = map_now.shards[shard as usize].clone();
            let mut copies = 1;
            let mut asked = assignment.owner.clone();
            let result = if access == Access::Write && !assignment.takes_writes() {
                Err(ApiError::StaleShardMap(format!(
                    "shard {shard} of collection '{}' is being moved to node {}: retry",
                    map.def.name,
                    assignment.moving_to.as_deref().unwrap_or("?")
                )))
            } else {
                let target = if access == Access::Spread {
                    let (target, n, node) =
                        cluster.read_target(map_now, shard, (spread, attempt)).await;
                    copies = n;
                    asked = node;
                    target
                } else {
                    cluster.target(map_now, shard).await
                };
                let target = match target {
                    Ok(target) => target,
                    Err(error) if attempt + 1 < copies && is_unreachable(&error) => {
                        attempt += 1;
                        continue;
                    }
                    Err(error) => return Err(error),
                };
                let shared = match &current {
                    Some(m) => Arc::clone(m),
                    None => Arc::new(map.clone()),
                };
                // Every shard call ends by the caller's deadline, whatever the owner does (a
                // stopped process keeps its connections open and never answers). A spread read
                // gives each copy left to try an equal share of the time left, so that a copy
                // that is stopped or hung (alive to etcd) costs a share, not the whole call.
                let left = until.saturating_duration_since(Instant::now());
                let share = if copies > attempt + 1 {
                    left / (copies - attempt) as u32
                } else {
                    left
                };
                match tokio::time::timeout(share, call(target, shared)).await {
                    Ok(result) => result.map_err(|e| e.naming_copy(&asked)),
                    Err(_) => Err(ApiError::DeadlineExceeded(format!(
                        "shard {shard} of collection '{}' on node {asked} did not answer within \
                         {:.1} s of the deadline ({:.1} s)",
                        map.def.name,
                        share.as_secs_f64(),
                        deadline.as_secs_f64()
                    ))),
                }
            };
            match result {
                // Another in-sync copy may answer a spread read: one that is unreachable, or one
                // that used up its share of the time.
                Err(error)
                    if attempt + 1 < copies
                        && (is_unreachable(&error)
                            || matches!(error, ApiError::DeadlineExceeded(_)))
                        && Instant::now() < until =>
                {
                    attempt += 1;
                }
                Err(error) if is_stale_map(&error) && Instant::now() < until => {
                    self.metrics.retried_on_moved_shard.inc();
                    cluster
                        .wait_for_shard_change(
                            &map.def.name,
                            map.def.uid,
                            shard,
                            &assignment,
                            until,
                        )
                        .await;
                    let fresh = cluster.map(&map.def.name).await?;
                    if fresh.def.uid != map.def.uid {
                        return Err(ApiError::NotFound(map.def.name.clone()));
                    }
                    current = Some(Arc::new(fresh));
                }
                other => return other,
            }
        }
    }

    /// Counts a shard call sent to another node.
    fn count_forwarded(&self, method: &'static str) {
        self.metrics.forwarded.with_label_values(&[method]).inc();
    }
}

/// Whether a shard call needs a write's guarantees (never to a fenced shard).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Access {
    /// A read the shard's owner answers (its counts, a flush).
    Read,
    /// A read any in-sync copy may answer (a search, a get): spread over them, and tried on
    /// the next copy when one cannot be reached.
    Spread,
    Write,
}

/// How long `GetCollection` and `Flush` may take when the client sets no deadline.
const INFO_DEADLINE: Duration = Duration::from_secs(10);
const FLUSH_DEADLINE: Duration = Duration::from_secs(60);

/// An answer that means "the shard map moved on": retried after the map is refreshed.
/// A copy that did not answer (down, unreachable, refusing for now): another may.
fn is_unreachable(error: &ApiError) -> bool {
    match error {
        ApiError::ShardUnavailable { .. } | ApiError::Unavailable(_) => true,
        ApiError::Forwarded(e) => e.code() == tarn_client::Code::Unavailable,
        _ => false,
    }
}

fn is_stale_map(error: &ApiError) -> bool {
    match error {
        ApiError::StaleShardMap(_) => true,
        ApiError::Forwarded(e) => e.code() == tarn_client::Code::Aborted,
        _ => false,
    }
}

/// `seq_no` of a write: its shard's sequence number when the collection has one shard (so
/// `min_seq_no` keeps working there), 0 otherwise (use the read token).
/// One shard's answer to a counted write: its log position and how many pairs it wrote.
type CountedAnswer = Result<((u64, u64), u64), ApiError>;

/// The shards' answers to a counted write (insert, remove by filter): each shard's log
/// position, for the read token, and the total the shards counted; the first error fails it.
/// A write's position on one shard: (shard, sequence number, the epoch it was acknowledged at).
type Position = (u32, u64, u64);

fn positions_and_count(
    answers: Vec<(u32, CountedAnswer)>,
) -> Result<(Vec<Position>, u64), ApiError> {
    let mut positions = Vec::with_capacity(answers.len());
    let mut total = 0;
    for (shard, answer) in answers {
        let ((seq, epoch), n) = answer?;
        positions.push((shard, seq, epoch));
        total += n;
    }
    Ok((positions, total))
}

fn single_position(map: &CollectionMap, positions: &[Position]) -> u64 {
    match positions {
        [(_, seq, _)] if map.def.n_shards == 1 => *seq,
        _ => 0,
    }
}
