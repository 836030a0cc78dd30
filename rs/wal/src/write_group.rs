//! Group commit, generic over the request and its result; knows nothing of the entry format.
//!
//! Callers `submit` a request and get a [`Ticket`] (a future, or `wait()` for threads). One leader
//! at a time calls [`GroupQueue::take_group`]: it takes everything queued at that moment (bounded
//! in entries and weight), does the work for the whole group, and completes every member. Whoever
//! arrives while the leader works forms the next group. No timer decides when a group closes: a
//! lone writer is taken at once.
//!
//! In tarn the leader is the log-writer thread, so no caller's thread (and never a tokio worker)
//! blocks on file I/O. Dropping a ticket is safe: the request still runs with its group and its
//! result is discarded; no other member waits for it.
//!
//! If the leader dies (panics), the members of the group it held are answered [`Abandoned`]
//! when the group is dropped during unwinding; the leader's owner then calls
//! [`GroupQueue::close_and_drain`] to refuse later submissions and answer everything still
//! queued, so no ticket waits forever (`log_writer.rs` does this and poisons the log).

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::Instant;

std::thread_local! {
    /// The role of a thread that must never block on a ticket (see [`forbid_ticket_waits`]).
    static NO_TICKET_WAITS: std::cell::Cell<Option<&'static str>> =
        const { std::cell::Cell::new(None) };
}

/// Declares that the calling thread must never block on a [`Ticket`]: the log-writer thread
/// (it answers tickets), and any thread the writer may wait on (tarn's ingestion thread, which
/// the writer feeds through a bounded channel). Such a wait could deadlock; debug builds panic
/// in [`Ticket::wait`] instead, naming `role`.
pub fn forbid_ticket_waits(role: &'static str) {
    NO_TICKET_WAITS.with(|cell| cell.set(Some(role)));
}

/// The result a member gets when its group is dropped without being completed (the leader
/// panicked or shut down). Results convert from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Abandoned;

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding these locks cannot leave their state half-updated (single-field
    // writes), so a poisoned lock is still usable.
    mutex.lock().unwrap_or_else(|poison| poison.into_inner())
}

#[derive(Debug)]
struct Completion<T> {
    state: Mutex<CompletionState<T>>,
    done: Condvar,
}

#[derive(Debug)]
struct CompletionState<T> {
    result: Option<T>,
    waker: Option<Waker>,
    /// A thread is blocked in `Ticket::wait` (so `complete` must signal the condvar; skipping
    /// the signal otherwise saves the completing thread a futex syscall per member).
    thread_waiting: bool,
}

impl<T> Completion<T> {
    fn new(result: Option<T>) -> Arc<Self> {
        Arc::new(Completion {
            state: Mutex::new(CompletionState {
                result,
                waker: None,
                thread_waiting: false,
            }),
            done: Condvar::new(),
        })
    }

    fn complete(&self, result: T) {
        let (waker, thread_waiting) = {
            let mut state = lock(&self.state);
            state.result = Some(result);
            (state.waker.take(), state.thread_waiting)
        };
        if thread_waiting {
            self.done.notify_all();
        }
        if let Some(waker) = waker {
            waker.wake();
        }
    }
}

/// The pending result of a submitted request. Await it, or call [`Ticket::wait`] from a thread.
/// Dropping it does not cancel the request.
#[derive(Debug)]
#[must_use = "a ticket resolves to the result of the request"]
pub struct Ticket<T> {
    completion: Arc<Completion<T>>,
}

impl<T> Ticket<T> {
    /// A ticket that is already resolved.
    pub fn ready(result: T) -> Self {
        Ticket {
            completion: Completion::new(Some(result)),
        }
    }

    /// Blocks the calling thread until the result is in. Do not call it on an async runtime's
    /// worker thread: await the ticket there.
    pub fn wait(self) -> T {
        if cfg!(debug_assertions) {
            if let Some(role) = NO_TICKET_WAITS.with(std::cell::Cell::get) {
                panic!("the {role} thread must never wait on a WAL ticket (docs/CHECKPOINT.md)");
            }
        }
        let mut state = lock(&self.completion.state);
        loop {
            if let Some(result) = state.result.take() {
                return result;
            }
            state.thread_waiting = true;
            state = self
                .completion
                .done
                .wait(state)
                .unwrap_or_else(|poison| poison.into_inner());
        }
    }
}

impl<T> Future for Ticket<T> {
    type Output = T;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        let mut state = lock(&self.completion.state);
        match state.result.take() {
            Some(result) => Poll::Ready(result),
            None => {
                match &mut state.waker {
                    Some(waker) if waker.will_wake(cx.waker()) => {}
                    slot => *slot = Some(cx.waker().clone()),
                }
                Poll::Pending
            }
        }
    }
}

/// One queued request and the means to answer it.
#[derive(Debug)]
pub(crate) struct Member<R, T: From<Abandoned>> {
    pub(crate) request: R,
    completion: Option<Arc<Completion<T>>>,
}

impl<R, T: From<Abandoned>> Member<R, T> {
    pub(crate) fn complete(mut self, result: T) {
        if let Some(completion) = self.completion.take() {
            completion.complete(result);
        }
    }
}

impl<R, T: From<Abandoned>> Drop for Member<R, T> {
    fn drop(&mut self) {
        if let Some(completion) = self.completion.take() {
            completion.complete(T::from(Abandoned));
        }
    }
}

#[derive(Debug)]
struct QueueState<R, T: From<Abandoned>> {
    pending: VecDeque<Member<R, T>>,
    closed: bool,
    /// The leader is blocked in `take_group`. Writers signal the condvar only then: while the
    /// leader writes and syncs, arrivals just queue, without a futex syscall each.
    leader_waiting: bool,
}

/// What a leader gets from [`GroupQueue::take_group`].
#[derive(Debug)]
pub(crate) enum Taken<R, T: From<Abandoned>> {
    /// The next group, oldest first; never empty.
    Group(Vec<Member<R, T>>),
    /// The deadline passed with nothing queued.
    TimedOut,
    /// The queue is closed and empty.
    Closed,
}

/// Limits on one group. A group always takes at least one request, whatever its weight.
#[derive(Debug, Clone, Copy)]
pub(crate) struct GroupBounds {
    pub(crate) max_members: usize,
    pub(crate) max_weight: usize,
}

/// The queue writers join and the leader drains.
#[derive(Debug)]
pub(crate) struct GroupQueue<R, T: From<Abandoned>> {
    state: Mutex<QueueState<R, T>>,
    arrived: Condvar,
}

impl<R, T: From<Abandoned>> GroupQueue<R, T> {
    pub(crate) fn new() -> Self {
        GroupQueue {
            state: Mutex::new(QueueState {
                pending: VecDeque::new(),
                closed: false,
                leader_waiting: false,
            }),
            arrived: Condvar::new(),
        }
    }

    /// Queues a request. Returns it back if the queue is closed.
    pub(crate) fn submit(&self, request: R) -> Result<Ticket<T>, R> {
        let completion = Completion::new(None);
        let leader_waiting = {
            let mut state = lock(&self.state);
            if state.closed {
                return Err(request);
            }
            state.pending.push_back(Member {
                request,
                completion: Some(Arc::clone(&completion)),
            });
            std::mem::replace(&mut state.leader_waiting, false)
        };
        if leader_waiting {
            self.arrived.notify_one();
        }
        Ok(Ticket { completion })
    }

    /// Stops accepting requests; the leader still drains what is queued.
    pub(crate) fn close(&self) {
        lock(&self.state).closed = true;
        self.arrived.notify_all();
    }

    /// Stops accepting requests and takes everything still queued, for a leader that cannot go
    /// on (its owner answers them; dropping them answers [`Abandoned`]).
    pub(crate) fn close_and_drain(&self) -> Vec<Member<R, T>> {
        let drained: Vec<_> = {
            let mut state = lock(&self.state);
            state.closed = true;
            state.pending.drain(..).collect()
        };
        self.arrived.notify_all();
        drained
    }

    /// Waits until at least one request is queued (or `deadline` passes, or the queue is closed
    /// and drained), then takes every queued request up to `bounds`.
    pub(crate) fn take_group(
        &self,
        bounds: GroupBounds,
        weight: impl Fn(&R) -> usize,
        deadline: Option<Instant>,
    ) -> Taken<R, T> {
        let mut state = lock(&self.state);
        loop {
            if !state.pending.is_empty() {
                break;
            }
            if state.closed {
                return Taken::Closed;
            }
            state.leader_waiting = true;
            state = match deadline {
                None => self
                    .arrived
                    .wait(state)
                    .unwrap_or_else(|poison| poison.into_inner()),
                Some(deadline) => {
                    let now = Instant::now();
                    if now >= deadline {
                        state.leader_waiting = false;
                        return Taken::TimedOut;
                    }
                    self.arrived
                        .wait_timeout(state, deadline - now)
                        .unwrap_or_else(|poison| poison.into_inner())
                        .0
                }
            };
        }
        state.leader_waiting = false;
        let mut group = Vec::with_capacity(state.pending.len().min(bounds.max_members));
        let mut group_weight = 0usize;
        while let Some(next) = state.pending.front() {
            let next_weight = weight(&next.request);
            let full = group.len() >= bounds.max_members
                || (!group.is_empty() && group_weight + next_weight > bounds.max_weight);
            if full {
                break;
            }
            group_weight += next_weight;
            group.extend(state.pending.pop_front());
        }
        Taken::Group(group)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::thread;

    #[derive(Debug, PartialEq)]
    enum Outcome {
        Done(usize),
        Abandoned,
    }
    impl From<Abandoned> for Outcome {
        fn from(_: Abandoned) -> Self {
            Outcome::Abandoned
        }
    }

    const BOUNDS: GroupBounds = GroupBounds {
        max_members: 1000,
        max_weight: 1000,
    };

    #[test]
    fn leader_takes_everything_queued_and_respects_bounds() {
        let queue: GroupQueue<usize, Outcome> = GroupQueue::new();
        let tickets: Vec<_> = (0..10).map(|i| queue.submit(i).unwrap()).collect();
        let bounds = GroupBounds {
            max_members: 4,
            max_weight: 1000,
        };
        let Taken::Group(group) = queue.take_group(bounds, |_| 1, None) else {
            panic!()
        };
        assert_eq!(
            group.iter().map(|m| m.request).collect::<Vec<_>>(),
            vec![0, 1, 2, 3]
        );
        // Weight bound: 3 + 3 > 5, so one per group; an over-weight request still goes alone.
        let bounds = GroupBounds {
            max_members: 100,
            max_weight: 5,
        };
        for member in group {
            let request = member.request;
            member.complete(Outcome::Done(request));
        }
        let Taken::Group(group) = queue.take_group(bounds, |_| 3, None) else {
            panic!()
        };
        assert_eq!(group.len(), 1);
        drop(group); // abandoned
        let Taken::Group(rest) = queue.take_group(BOUNDS, |_| 1, None) else {
            panic!()
        };
        assert_eq!(rest.len(), 5);
        for member in rest {
            let request = member.request;
            member.complete(Outcome::Done(request));
        }
        let results: Vec<_> = tickets.into_iter().map(Ticket::wait).collect();
        assert_eq!(results[4], Outcome::Abandoned);
        assert_eq!(results[3], Outcome::Done(3));
        assert_eq!(results[9], Outcome::Done(9));
        assert!(matches!(
            queue.take_group(BOUNDS, |_| 1, Some(Instant::now())),
            Taken::TimedOut
        ));
        queue.close();
        assert!(matches!(
            queue.take_group(BOUNDS, |_| 1, None),
            Taken::Closed
        ));
        assert!(queue.submit(1).is_err());
    }

    #[test]
    #[cfg(debug_assertions)]
    fn a_thread_that_must_not_wait_on_tickets_panics_when_it_does() {
        let waited = thread::spawn(|| {
            forbid_ticket_waits("test");
            Ticket::<Outcome>::ready(Outcome::Done(1)).wait()
        })
        .join();
        let panic = waited.unwrap_err();
        let message = panic.downcast_ref::<String>().unwrap();
        assert!(message.contains("test thread must never wait"), "{message}");
        // Other threads are unaffected.
        assert_eq!(Ticket::ready(Outcome::Done(2)).wait(), Outcome::Done(2));
    }

    #[test]
    fn close_and_drain_hands_back_every_queued_member_and_refuses_later_ones() {
        let queue: GroupQueue<usize, Outcome> = GroupQueue::new();
        let tickets: Vec<_> = (0..3).map(|i| queue.submit(i).unwrap()).collect();
        let drained = queue.close_and_drain();
        assert_eq!(
            drained.iter().map(|m| m.request).collect::<Vec<_>>(),
            vec![0, 1, 2]
        );
        let mut drained = drained.into_iter();
        drained.next().unwrap().complete(Outcome::Done(7));
        drop(drained);
        let results: Vec<_> = tickets.into_iter().map(Ticket::wait).collect();
        assert_eq!(
            results,
            vec![Outcome::Done(7), Outcome::Abandoned, Outcome::Abandoned]
        );
        assert!(queue.submit(3).is_err());
        assert!(matches!(
            queue.take_group(BOUNDS, |_| 1, None),
            Taken::Closed
        ));
    }

    #[test]
    fn many_threads_all_answered_with_dropped_tickets() {
        let queue: Arc<GroupQueue<usize, Outcome>> = Arc::new(GroupQueue::new());
        let leader = {
            let queue = Arc::clone(&queue);
            thread::spawn(move || {
                let mut n_groups = 0;
                let mut n_members = 0;
                while let Taken::Group(group) = queue.take_group(BOUNDS, |_| 1, None) {
                    n_groups += 1;
                    n_members += group.len();
                    thread::sleep(std::time::Duration::from_micros(200));
                    for member in group {
                        let request = member.request;
                        member.complete(Outcome::Done(request * 2));
                    }
                }
                (n_groups, n_members)
            })
        };
        let writers: Vec<_> = (0..16)
            .map(|t| {
                let queue = Arc::clone(&queue);
                thread::spawn(move || {
                    for i in 0..200 {
                        let value = t * 1000 + i;
                        let ticket = queue.submit(value).unwrap();
                        if i % 7 == 0 {
                            drop(ticket); // a caller that gave up
                        } else {
                            assert_eq!(ticket.wait(), Outcome::Done(value * 2));
                        }
                    }
                })
            })
            .collect();
        for writer in writers {
            writer.join().unwrap();
        }
        queue.close();
        let (n_groups, n_members) = leader.join().unwrap();
        assert_eq!(n_members, 16 * 200);
        assert!(
            n_groups < n_members,
            "{n_groups} groups for {n_members} members"
        );
    }
}
