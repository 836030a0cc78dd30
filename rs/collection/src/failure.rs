//! The collection's failed state. Each of a collection's threads (ingestion, checkpoint,
//! indexing) runs inside [`run_guarded`]: if it panics, the collection is marked failed at once,
//! naming the thread and the panic. A failed collection poisons its WAL, so queued and later
//! writes fail (UNAVAILABLE at the server) instead of being acknowledged and never applied; it
//! wakes every `wait_applied` waiter, which then fails; and `Collection::failure` reports it, so
//! the server's health says NOT_SERVING. Reads keep working. Reopening recovers every
//! acknowledged write from the WAL, as after a crash. (The WAL writer thread poisons its own log
//! when it panics, `tarn_wal::Wal`.)

use std::fmt;
use tarn_wal::Wal;

use crate::collection::Shared;

/// Which of a collection's threads died, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ThreadFailure {
    /// `"ingestion"`, `"checkpoint"` or `"indexing"`.
    pub thread: &'static str,
    /// The panic's message.
    pub why: String,
}

impl ThreadFailure {
    /// Every value `thread` can take.
    pub const THREADS: [&'static str; 3] = ["ingestion", "checkpoint", "indexing"];
}

impl fmt::Display for ThreadFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the collection's {} thread died: {}",
            self.thread, self.why
        )
    }
}

/// Runs a collection thread's body; if it panics, marks the collection failed. What the body
/// borrows outlives the unwinding, so it is dropped only after the failure is recorded.
pub(crate) fn run_guarded(shared: &Shared, wal: &Wal, thread: &'static str, body: impl FnOnce()) {
    let run = std::panic::AssertUnwindSafe(body);
    if let Err(panic) = std::panic::catch_unwind(run) {
        let why = panic_message(panic.as_ref());
        mark_failed(shared, wal, ThreadFailure { thread, why });
    }
}

/// What a panic carried, as text.
pub(crate) fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_owned())
}

/// Records the first failure, poisons the WAL with it and wakes every waiter.
pub(crate) fn mark_failed(shared: &Shared, wal: &Wal, failure: ThreadFailure) {
    let message = failure.to_string();
    let first = shared.failure.get_or_init(|| failure);
    tracing::error!(
        dir = %shared.dir.display(),
        thread = first.thread,
        error = %message,
        "collection failed: it refuses writes until reopened"
    );
    wal.poison(&first.to_string());
    // A queued flush request would wait for a checkpoint that may never come.
    shared.flushes.close();
    // `wait_applied` re-checks `failure` on every change of `applied`.
    shared.applied.send_modify(|_| {});
}
