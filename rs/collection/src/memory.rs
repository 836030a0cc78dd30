//! Giving freed heap memory back to the operating system after a checkpoint.
//!
//! glibc's malloc keeps what is freed in its arenas (one per thread that allocates: the tokio
//! workers, the rayon pools) and returns pages to the system only from the top of a heap. A
//! checkpoint drops a frozen mutable segment, whose hnsw_rs graph is millions of small
//! allocations; afterwards the process stayed at 5,466 resident bytes per 128-d vector sealed
//! (50,000 vectors), against 1,072 once `malloc_trim(0)` had run (docs/BENCHMARKS.md, "Resident
//! memory"). mimalloc as the global allocator was measured too: it kept more (8,039), and did
//! not make writes faster.

use std::time::Instant;

/// Asks the allocator to return free pages to the system; logs how much RSS that released. A
/// no-op where the allocator is not glibc's.
pub(crate) fn release_free_memory() {
    let started = Instant::now();
    let before = resident_bytes();
    if !trim() {
        return;
    }
    let after = resident_bytes();
    tracing::debug!(
        released_bytes = before.saturating_sub(after),
        resident_bytes = after,
        micros = started.elapsed().as_micros() as u64,
        "returned freed memory to the system"
    );
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
fn trim() -> bool {
    // SAFETY: malloc_trim takes no pointer from the caller; it walks and trims glibc's own
    // arenas, each under that arena's lock, so it is safe to call from any thread at any time.
    unsafe { libc::malloc_trim(0) };
    true
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn trim() -> bool {
    false
}

/// The process's resident set size from /proc (0 where unavailable).
fn resident_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
            line.split_whitespace().nth(1)?.parse::<u64>().ok()
        })
        .map_or(0, |kib| kib * 1024)
}
