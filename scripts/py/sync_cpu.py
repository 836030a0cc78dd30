"""How much an fdatasync costs depending on the CPU that issues it
(docs/benchmarks/history-of-runs.md, "What decides the one-client figures on this VM").

On a VM whose disk has one request queue, the disk's completion interrupt is taken by one vCPU
(`/proc/irq/N/effective_affinity_list`); a thread that waits in fdatasync on another, halted vCPU
is woken through the host. This times the WAL's pattern (576-byte appends into a preallocated
file, `pwrite` + `fdatasync`) from each CPU in turn, with nothing else running and with a busy
loop at nice 5 (tarn's indexer priority) on the other CPU, alternating over rounds.

Usage: python3 scripts/py/sync_cpu.py [DIR] [ROUNDS]   (DIR on the disk under test; default target/)
Prints one line per run and the medians; about 30 s with the defaults. Linux only.
"""

import os
import statistics
import subprocess
import sys
import time

N_SYNCS = 2000
SEGMENT = 16 << 20
ENTRY = os.urandom(576)


def sync_loop(path):
    """Times N_SYNCS appends + fdatasync into a fallocated file; returns (mean, p50, p90) in us."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.posix_fallocate(fd, 0, SEGMENT)
        os.fsync(fd)
        times = []
        offset = 0
        for _ in range(N_SYNCS):
            started = time.perf_counter()
            os.pwrite(fd, ENTRY, offset)
            os.fdatasync(fd)
            times.append(time.perf_counter() - started)
            offset += len(ENTRY)
    finally:
        os.close(fd)
        os.unlink(path)
    times.sort()
    return (
        statistics.mean(times) * 1e6,
        times[len(times) // 2] * 1e6,
        times[len(times) * 9 // 10] * 1e6,
    )


def disk_interrupts():
    """The /proc/interrupts lines of block-device request queues, for the report."""
    lines = []
    with open("/proc/interrupts") as f:
        for line in f:
            name = line.split()[-1]
            if ("virtio" in name and "req" in name) or name.startswith(("nvme", "ahci")):
                irq = line.split(":")[0].strip()
                try:
                    with open(f"/proc/irq/{irq}/effective_affinity_list") as a:
                        affinity = a.read().strip()
                except OSError:
                    affinity = "?"
                lines.append(f"irq {irq} ({name}) taken by CPU {affinity}")
    return lines


def main():
    directory = sys.argv[1] if len(sys.argv) > 1 else "target"
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        sys.exit("needs two CPUs")
    for line in disk_interrupts():
        print(line)
    path = os.path.join(directory, f"sync_cpu.{os.getpid()}.tmp")
    results = {}
    for _ in range(rounds):
        for cpu in cpus[:2]:
            other = cpus[1] if cpu == cpus[0] else cpus[0]
            for loaded in (False, True):
                hog = None
                if loaded:
                    hog = subprocess.Popen(
                        [sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{other}}}); "
                         "os.nice(5)\nwhile True: pass"])
                    time.sleep(0.2)
                os.sched_setaffinity(0, {cpu})
                try:
                    mean, p50, p90 = sync_loop(path)
                finally:
                    os.sched_setaffinity(0, set(cpus))
                    if hog is not None:
                        hog.kill()
                        hog.wait()
                key = (cpu, loaded)
                results.setdefault(key, []).append(mean)
                label = f"busy loop on CPU {other}" if loaded else "other CPU idle"
                print(f"sync from CPU {cpu}, {label}: mean {mean:.1f} us, p50 {p50:.1f}, p90 {p90:.1f}")
    print("medians of the means:")
    for (cpu, loaded), means in sorted(results.items()):
        label = "busy loop on the other CPU" if loaded else "other CPU idle"
        print(f"  CPU {cpu}, {label}: {statistics.median(means):.1f} us")


if __name__ == "__main__":
    main()
