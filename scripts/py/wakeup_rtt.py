"""What one cross-thread hand-off costs on this machine: two processes ping-pong one byte over
a pair of pipes, pinned to the same CPU, then to two different CPUs. Each round trip is two
wake-ups of a blocked reader. On a VM whose idle vCPUs halt (no guest halt-polling), a wake-up
on another CPU costs an inter-processor interrupt and the host waking that vCPU, which a
durable insert pays at every hand-off between threads (docs/benchmarks/history-of-runs.md,
"One write per request, and where a hand-off's time goes").
Then the waker's own share: how long the `write` that wakes a reader blocked on an idle CPU
takes, against one that wakes a reader on the writer's own CPU (the reader answers, and the
writer sleeps 0.2 ms before the next write so that the reader's CPU goes idle again).

Usage: python3 scripts/py/wakeup_rtt.py [round_trips=20000] [rounds=5]
Prints one line per round and placement, then the medians in microseconds per round trip.
"""

import os
import statistics
import sys
import time


def echo_child(n, cpu_child):
    """Forks a child pinned to `cpu_child` that answers `n` one-byte messages; returns
    (pid, fd to write to it, fd to read its answers from, every fd to close)."""
    to_child_r, to_child_w = os.pipe()
    to_parent_r, to_parent_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.sched_setaffinity(0, {cpu_child})
        for _ in range(n):
            os.read(to_child_r, 1)
            os.write(to_parent_w, b"x")
        os._exit(0)
    return pid, to_child_w, to_parent_r, (to_child_r, to_child_w, to_parent_r, to_parent_w)


def reap(pid, fds):
    os.waitpid(pid, 0)
    for fd in fds:
        os.close(fd)


def ping_pong(n, cpu_parent, cpu_child):
    pid, to_child, from_child, fds = echo_child(n + 1, cpu_child)
    os.sched_setaffinity(0, {cpu_parent})
    # One untimed round trip: the child is up and pinned.
    os.write(to_child, b"x")
    os.read(from_child, 1)
    started = time.perf_counter()
    for _ in range(n):
        os.write(to_child, b"x")
        os.read(from_child, 1)
    elapsed = time.perf_counter() - started
    reap(pid, fds)
    return elapsed / n * 1e6


def waker_cost(n, cpu_writer, cpu_reader):
    """Mean time in us of the write() that wakes a reader blocked on `cpu_reader`."""
    pid, to_child, from_child, fds = echo_child(n, cpu_reader)
    os.sched_setaffinity(0, {cpu_writer})
    times = []
    for _ in range(n):
        time.sleep(0.0002)
        started = time.perf_counter()
        os.write(to_child, b"x")
        times.append(time.perf_counter() - started)
        os.read(from_child, 1)
    reap(pid, fds)
    return statistics.mean(times) * 1e6


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 20000
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        sys.exit("wakeup_rtt: needs two CPUs")
    placements = {"same CPU": (cpus[0], cpus[0]), "two CPUs": (cpus[0], cpus[1])}
    results = {name: [] for name in placements}
    for r in range(rounds):
        for name, (a, b) in placements.items():
            us = ping_pong(n, a, b)
            results[name].append(us)
            print(f"round {r + 1} {name}: {us:.1f} us per round trip", flush=True)
    same = statistics.median(results["same CPU"])
    cross = statistics.median(results["two CPUs"])
    print(
        f"median round trip: same CPU {same:.1f} us, two CPUs {cross:.1f} us "
        f"({cross / same:.1f}x); one wake-up across CPUs about {cross / 2:.1f} us"
    )
    waker = {name: [] for name in placements}
    for r in range(rounds):
        for name, (a, b) in placements.items():
            waker[name].append(waker_cost(max(n // 10, 100), a, b))
    print(
        f"median time of the waking write: reader on the same CPU "
        f"{statistics.median(waker['same CPU']):.1f} us, on the other (idle) CPU "
        f"{statistics.median(waker['two CPUs']):.1f} us"
    )
    idle = "/sys/devices/system/cpu/cpuidle/current_driver"
    poll = "/sys/module/haltpoll/parameters/guest_halt_poll_ns"
    for path in (idle, poll):
        if os.path.exists(path):
            print(f"{path}: {open(path).read().strip()}")


if __name__ == "__main__":
    main()
