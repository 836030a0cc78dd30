"""Mixed load against a running tarn server for a fixed time, sampling the server's resident
memory and the latency percentiles every interval. Upserts and removes cycle over a fixed set of
documents, so the stored data stays bounded and memory should reach a plateau.
Called by scripts/soak.sh; exits 1 on any error, on memory still growing in the last third, or
on p99 latency in the last third above 3x the first third's."""

import argparse
import statistics
import threading
import time

import numpy as np

from tarn_client import Client

DIM = 128
DOCS = 20_000
TENANTS = 4


def rss_bytes(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def pct(values, p):
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round((len(values) - 1) * p)))]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--address", required=True)
    parser.add_argument("--pid", type=int, required=True)
    parser.add_argument("--seconds", type=int, default=600)
    parser.add_argument("--interval", type=int, default=30)
    parser.add_argument("--writers", type=int, default=4)
    parser.add_argument("--searchers", type=int, default=2)
    args = parser.parse_args()

    client = Client(args.address)
    client.wait_ready()
    client.create_collection("soak", dimension=DIM, metric="cosine")
    lock = threading.Lock()
    window = {"insert": [], "remove": [], "search": [], "errors": []}
    stop = time.monotonic() + args.seconds

    def record(kind, started):
        with lock:
            window[kind].append((time.perf_counter() - started) * 1e3)

    def writer(seed):
        rng = np.random.default_rng(seed)
        while time.monotonic() < stop:
            tenant = int(rng.integers(TENANTS))
            docs = rng.choice(DOCS, size=int(rng.integers(1, 20)), replace=False)
            started = time.perf_counter()
            try:
                if rng.random() < 0.8:
                    client.insert("soak", doc_ids=[int(d) for d in docs],
                                  vectors=rng.standard_normal((len(docs), DIM)), user_ids=tenant,
                                  durability="fsync" if rng.random() < 0.5 else "written")
                    record("insert", started)
                else:
                    client.remove("soak", [int(d) for d in docs], user_ids=tenant)
                    record("remove", started)
            except Exception as e:  # noqa: BLE001 - every error is a failure of the soak
                with lock:
                    window["errors"].append(repr(e))

    def searcher(seed):
        rng = np.random.default_rng(seed)
        while time.monotonic() < stop:
            started = time.perf_counter()
            try:
                client.search("soak", rng.standard_normal(DIM), top_k=10, user_ids=int(rng.integers(TENANTS)))
                record("search", started)
            except Exception as e:  # noqa: BLE001
                with lock:
                    window["errors"].append(repr(e))

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(args.writers)]
    threads += [threading.Thread(target=searcher, args=(100 + i,)) for i in range(args.searchers)]
    for t in threads:
        t.start()
    rows = []
    print("| minute | server RSS MB | writes/s | searches/s | write p50 / p99 ms | search p50 / p99 ms | errors |")
    print("|---|---|---|---|---|---|---|")
    start = time.monotonic()
    errors = []
    while time.monotonic() < stop:
        time.sleep(args.interval)
        with lock:
            snap = {k: v for k, v in window.items()}
            for k in window:
                window[k] = []
        writes = snap["insert"] + snap["remove"]
        row = {
            "t": (time.monotonic() - start) / 60,
            "rss": rss_bytes(args.pid) / 1e6,
            "wps": len(writes) / args.interval,
            "sps": len(snap["search"]) / args.interval,
            "w50": pct(writes, 0.5), "w99": pct(writes, 0.99),
            "s50": pct(snap["search"], 0.5), "s99": pct(snap["search"], 0.99),
            "errors": len(snap["errors"]),
        }
        errors += snap["errors"]
        rows.append(row)
        print(f"| {row['t']:.1f} | {row['rss']:.0f} | {row['wps']:.0f} | {row['sps']:.0f} | "
              f"{row['w50']:.1f} / {row['w99']:.1f} | {row['s50']:.1f} / {row['s99']:.1f} | {row['errors']} |", flush=True)
    for t in threads:
        t.join()

    third = max(1, len(rows) // 3)
    first, middle, last = rows[:third], rows[third:2 * third], rows[-third:]
    rss_mid = max(r["rss"] for r in middle or first)
    rss_last = max(r["rss"] for r in last)
    p99_first = statistics.median(r["w99"] for r in first)
    p99_last = statistics.median(r["w99"] for r in last)
    s99_first = statistics.median(r["s99"] for r in first)
    s99_last = statistics.median(r["s99"] for r in last)
    print()
    print(f"soak: {args.seconds} s, {len(errors)} errors; RSS max middle third {rss_mid:.0f} MB, last third {rss_last:.0f} MB; "
          f"write p99 first/last third {p99_first:.1f}/{p99_last:.1f} ms; search p99 {s99_first:.1f}/{s99_last:.1f} ms")
    failed = []
    if errors:
        failed.append(f"errors, e.g. {errors[:3]}")
    if rss_last > 1.15 * rss_mid:
        failed.append("resident memory still growing in the last third")
    if p99_last > 3 * p99_first or s99_last > 3 * s99_first:
        failed.append("p99 latency grew over time")
    if failed:
        print("soak: FAILED: " + "; ".join(failed))
        raise SystemExit(1)
    print("soak: PASSED")


if __name__ == "__main__":
    main()
