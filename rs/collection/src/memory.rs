//! Giving freed heap memory back to the operating system after a checkpoint.
//!
//! glibc's malloc keeps what is freed in its arenas (one per thread that allocates: the tokio
//! workers, the rayon pools) and returns pages to the system only from the top of a heap. A
//! checkpoint drops a frozen mutable segment, whose hnsw_rs graph is millions of small
//! allocations; afterwards the process stayed at 5,466 resident bytes per 128-d vector sealed
//! (50,000 vectors), against 1,072 once `malloc_trim(0)` had run
//! (docs/benchmarks/history-of-runs.md, "Where the insert time goes, what was tried, what was
//! kept"). mimalloc as the global allocator was measured too: it kept more (8,039), and did not
//! make writes faster.

use std::time::Instant;

/// Largest allocation glibc serves from its arenas; bigger ones get their own mapping, which
/// goes back to the system the moment it is freed.
const MMAP_THRESHOLD_BYTES: i32 = 128 << 10;

/// Fixes glibc's mmap threshold at its initial 128 KiB, once per process (called when a
/// collection opens). By default glibc raises the threshold to the size of each large block
/// freed (up to 32 MiB), after which the large buffers of a load (request payloads, a
/// checkpoint's copies and graph arrays) come from the per-thread arenas, where what is freed
/// stays resident as fragments that `malloc_trim` cannot return: after loading 60,733 384-d
/// vectors the process kept about 25 MB (400 bytes a vector) more than the same collection
/// reopened from disk; with the threshold fixed the difference is gone (docs/BENCHMARKS.md,
/// "Index build"). Setting it also stops glibc adjusting the trim threshold.
pub(crate) fn configure_allocator() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(set_mmap_threshold);
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
fn set_mmap_threshold() {
    // SAFETY: mallopt only changes a parameter of glibc's allocator, under its own lock; it
    // takes no pointer and is safe to call from any thread at any time.
    let ok = unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) };
    if ok != 1 {
        tracing::warn!("mallopt(M_MMAP_THRESHOLD) refused; freed load buffers may stay resident");
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn set_mmap_threshold() {}

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
