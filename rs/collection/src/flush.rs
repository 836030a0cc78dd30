//! Flushes share checkpoints. A flush syncs the WAL, then joins the open *batch*; the batch's
//! first member (its leader) waits until the checkpoint of the batch before it is answered,
//! closes its batch (later flushes open the next one) and asks ingestion for one checkpoint
//! covering every member; all members get its result. So any number of concurrent flushes cost
//! at most two checkpoints (the running one and the next), no flush starts a thread, and at most
//! two requests ever wait for ingestion (the bound of the checkpoint job queue follows).
//!
//! Requests go through a queue beside the bounded ingestion channel, so a flush never blocks on
//! a full channel: the leader queues `(min_seq, reply)` and wakes ingestion with a `try_send` (a
//! full channel means ingestion is busy and checks the queue after each signal anyway).
//! Ingestion takes a request once it has applied `min_seq`, the highest sequence number a
//! member's WAL sync returned: every entry up to it was handed to ingestion before that sync
//! resolved, so it will be applied and the checkpoint covers every member. A leader whose
//! caller goes away still requests its batch's checkpoint (on drop), so members never wait for
//! a leader that is gone; a request dropped unanswered (ingestion or the checkpoint thread
//! stopped) answers its batch with the collection's failure, or `Closed`.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::sync::watch;

use crate::collection::Shared;
use crate::error::{CollectionError, Result};

/// A checkpoint's sequence number, or its error shared between the batch's members.
pub(crate) type BatchResult = std::result::Result<u64, Arc<CollectionError>>;

#[derive(Debug)]
pub(crate) struct Batch {
    /// The highest sequence number a member's WAL sync returned.
    min_seq: AtomicU64,
    result: watch::Sender<Option<BatchResult>>,
}

#[derive(Debug, Default)]
struct State {
    /// The batch new flushes join; its checkpoint is not requested yet.
    open: Option<Arc<Batch>>,
    /// The batch whose checkpoint was requested last and is not answered yet.
    running: Option<Arc<Batch>>,
    /// Requests ingestion has not taken yet, oldest first.
    queue: VecDeque<(u64, FlushReply)>,
    /// Set when ingestion stops or the collection fails: requests are refused from then on.
    closed: bool,
}

/// The flush requests of one collection.
#[derive(Debug, Default)]
pub(crate) struct Flushes {
    state: Mutex<State>,
    /// Set while a request is queued: ingestion's check after each signal is one load.
    requested: AtomicBool,
}

/// What a flush does after joining a batch.
pub(crate) enum Joined {
    /// Wait for the batch's result.
    Member(watch::Receiver<Option<BatchResult>>),
    /// Lead the batch: wait for `previous`, then request the checkpoint.
    Leader {
        batch: Arc<Batch>,
        previous: Option<watch::Receiver<Option<BatchResult>>>,
    },
}

impl Flushes {
    /// Joins the open batch (or opens one) with the sequence number this flush's WAL sync
    /// returned.
    pub(crate) fn join(&self, synced: u64) -> Joined {
        let mut state = self.state.lock();
        if let Some(open) = &state.open {
            open.min_seq.fetch_max(synced, Ordering::Relaxed);
            return Joined::Member(open.result.subscribe());
        }
        let batch = Arc::new(Batch {
            min_seq: AtomicU64::new(synced),
            result: watch::Sender::new(None),
        });
        state.open = Some(Arc::clone(&batch));
        let previous = state.running.as_ref().map(|r| r.result.subscribe());
        Joined::Leader { batch, previous }
    }

    /// Closes `batch` to new members and queues its checkpoint request. Returns false if
    /// requests are refused (the batch is answered then).
    pub(crate) fn request(&self, shared: &Arc<Shared>, batch: &Arc<Batch>) -> bool {
        let reply = FlushReply {
            shared: Arc::clone(shared),
            batch: Some(Arc::clone(batch)),
        };
        let mut state = self.state.lock();
        if state.open.as_ref().is_some_and(|o| Arc::ptr_eq(o, batch)) {
            state.open = None;
        }
        if state.closed {
            drop(state);
            drop(reply); // answers the batch with the failure or `Closed`
            return false;
        }
        state.running = Some(Arc::clone(batch));
        let min_seq = batch.min_seq.load(Ordering::Relaxed);
        state.queue.push_back((min_seq, reply));
        self.requested.store(true, Ordering::Release);
        true
    }

    /// Ingestion: takes the oldest request if what it covers is applied.
    pub(crate) fn take_if_applied(&self, applied_seq: u64) -> Option<FlushReply> {
        if !self.requested.load(Ordering::Acquire) {
            return None;
        }
        let mut state = self.state.lock();
        if state.queue.front()?.0 > applied_seq {
            return None;
        }
        let (_, reply) = state.queue.pop_front()?;
        self.requested
            .store(!state.queue.is_empty(), Ordering::Release);
        Some(reply)
    }

    /// Refuses requests from now on; the queued ones are answered (with the collection's
    /// failure, or `Closed`).
    pub(crate) fn close(&self) {
        let queued: Vec<_> = {
            let mut state = self.state.lock();
            state.closed = true;
            self.requested.store(false, Ordering::Release);
            state.queue.drain(..).collect()
        };
        drop(queued);
    }
}

/// The answer to one batch, carried by its checkpoint job. Dropped unanswered, it answers the
/// batch with the collection's failure, or `Closed`.
#[derive(Debug)]
pub(crate) struct FlushReply {
    shared: Arc<Shared>,
    batch: Option<Arc<Batch>>,
}

impl FlushReply {
    pub(crate) fn answer(mut self, result: BatchResult) {
        if let Some(batch) = self.batch.take() {
            finish(&self.shared, &batch, result);
        }
    }
}

impl Drop for FlushReply {
    fn drop(&mut self) {
        if let Some(batch) = self.batch.take() {
            let error = match self.shared.failure.get() {
                Some(failure) => CollectionError::Failed(failure.clone()),
                None => CollectionError::Closed,
            };
            finish(&self.shared, &batch, Err(Arc::new(error)));
        }
    }
}

fn finish(shared: &Shared, batch: &Arc<Batch>, result: BatchResult) {
    {
        let mut state = shared.flushes.state.lock();
        if state
            .running
            .as_ref()
            .is_some_and(|r| Arc::ptr_eq(r, batch))
        {
            state.running = None;
        }
    }
    batch.result.send_replace(Some(result));
}

impl Batch {
    pub(crate) fn subscribe(&self) -> watch::Receiver<Option<BatchResult>> {
        self.result.subscribe()
    }
}

/// Waits for a batch's result and gives this member its own copy of it.
pub(crate) async fn batch_result(mut result: watch::Receiver<Option<BatchResult>>) -> Result<u64> {
    let answered = match result.wait_for(Option::is_some).await {
        Ok(answered) => answered.clone(),
        Err(_) => None,
    };
    match answered {
        Some(Ok(seq)) => Ok(seq),
        Some(Err(error)) => Err(error.duplicate()),
        None => Err(CollectionError::Closed),
    }
}
