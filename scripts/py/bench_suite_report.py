"""Renders scripts/bench-suite.sh's results (JSON lines) as the markdown tables of
docs/BENCHMARKS.md and the insert-throughput chart, and ends with the suite's targets, each
with its measured ratio and whether it is met."""

import argparse
import json
import os
import statistics

from search_vs_hnswlib import qps_at


def merge_rounds(rows):
    """Insert runs repeated over rounds (same bench, clients, batch and durability) become one
    row: the median of each figure, with the spread of throughput in `rounds`."""
    groups, order = {}, []
    for r in rows:
        if r["bench"] not in ("insert", "pg_insert"):
            order.append(r)
            continue
        key = (r["bench"], r.get("transport", "tcp"), r["clients"], r["batch"], r.get("durability"))
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append(r)
    merged = []
    for item in order:
        if isinstance(item, dict):
            merged.append(item)
            continue
        runs = groups[item]
        row = dict(runs[0])
        for field in ("requests_per_s", "vectors_per_s", "seconds", "p50_ms", "p99_ms"):
            if field in row:
                row[field] = statistics.median(r[field] for r in runs)
        row["rounds"] = [r["requests_per_s"] for r in runs]
        merged.append(row)
    return merged


def cell(r):
    """Requests/s of a merged row, with the range of its rounds."""
    if not r:
        return "-"
    spread = r.get("rounds", [])
    return f"{r['requests_per_s']:,.0f}" + (
        f" ({min(spread):,.0f}-{max(spread):,.0f})" if len(spread) > 1 else "")


def lat(r):
    return f"{r['p50_ms']:.2f} / {r['p99_ms']:.2f}" if r else "-"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--results", required=True)
    parser.add_argument("--hnswlib", help="target/search_vs_hnswlib.json of the same run")
    parser.add_argument("--png", required=True)
    args = parser.parse_args()
    rows = [json.loads(line) for line in open(args.results) if line.strip()]
    rows = merge_rounds(rows)
    # Rows over Unix sockets (section 2b of the suite) have their own tables.
    unix = [r for r in rows if r.get("transport") == "unix"]
    rows = [r for r in rows if r.get("transport", "tcp") == "tcp"]
    by = lambda kind: [r for r in rows if r["bench"] == kind]
    machine = by("machine")[0]
    if "guest_halt_poll_ns" not in machine:
        poll = "guest halt polling not recorded"
    elif machine["guest_halt_poll_ns"] is None:
        poll = "no haltpoll cpuidle driver"
    else:
        poll = f"guest_halt_poll_ns {machine['guest_halt_poll_ns']}"
    print(f"Machine: {machine['cpus']} cores, {machine['cpu']}, Linux {machine['kernel']} ({poll}); "
          f"commit {machine['commit']}; {machine['date']}.")
    print()

    pg = {r["clients"]: r for r in by("pg_insert")}
    ins = by("insert")
    single = {(r["durability"], r["clients"]): r for r in ins if r["batch"] == 1}
    print("### Durable single-vector inserts (128-d), tarn over gRPC vs PostgreSQL 15\n")
    print("Each client has its own connection and one request in flight; 1,000 timed requests per "
          "run. PostgreSQL: pgbench, one `INSERT` of a `real[]` row per transaction, fsync on, "
          "synchronous_commit on. PostgreSQL and tarn fsync runs alternate, three rounds: medians, "
          "with the range of the rounds in brackets.\n")
    print("| clients | tarn fsync req/s | p50 / p99 ms | tarn written req/s | p50 / p99 ms | PostgreSQL tx/s | p50 / p99 ms | tarn fsync / PostgreSQL |")
    print("|---|---|---|---|---|---|---|---|")
    for c in sorted({c for (_, c) in single}):
        f, w, p = single.get(("fsync", c)), single.get(("written", c)), pg.get(c)
        ratio = f"{f['requests_per_s'] / p['requests_per_s']:.2f}x" if f and p else "-"
        print(f"| {c} | {cell(f)} | {lat(f)} | {cell(w)} | {lat(w)} | {cell(p)} | {lat(p)} | {ratio} |")
    print()
    batched = [r for r in ins if r["batch"] > 1]
    if batched:
        print("### Batched inserts (100 vectors of 128-d per request)\n")
        print("| clients | durability | requests/s | vectors/s | p50 / p99 ms |")
        print("|---|---|---|---|---|")
        for r in batched:
            print(f"| {r['clients']} | {r['durability']} | {r['requests_per_s']:,.0f} | "
                  f"{r['vectors_per_s']:,.0f} | {r['p50_ms']:.2f} / {r['p99_ms']:.2f} |")
        print()
    for m in by("memory"):
        n, raw = m["vectors"], m["dimension"] * 4
        sealed = (m["rss_sealed"] - m["rss_before"]) / n
        print("### Resident memory per stored vector\n")
        print(f"{n:,} vectors of {m['dimension']}-d ({raw} raw bytes each) into an empty server of "
              f"its own, sealed by a flush: resident memory grew by **{sealed:,.0f} bytes per "
              f"vector** ({sealed - raw:,.0f} beyond the raw vector; the whole process, including "
              f"allocator slack left by the hnsw_rs graph that sealing replaced).\n")
    fresh = by("freshness")
    for f in fresh:
        print("### Insert-to-searchable\n")
        print(f"{f['inserts']:,} single-vector fsync inserts at {f['rate']:,}/s into a collection "
              f"holding 20,000 vectors; every 10th is searched for (approximate search, default ef) "
              f"until found ({f['probed']} probes, {f['missed']} not found):\n")
        print("| | p50 ms | p99 ms |")
        print("|---|---|---|")
        print(f"| request sent -> found by search | {f['to_searchable_p50_ms']:.2f} | {f['to_searchable_p99_ms']:.2f} |")
        print(f"| of which: durable acknowledgement | {f['ack_p50_ms']:.2f} | {f['ack_p99_ms']:.2f} |")
        print(f"| of which: acknowledgement -> found | {f['after_ack_p50_ms']:.2f} | {f['after_ack_p99_ms']:.2f} |")
        print()
    search = by("search")
    if search:
        print("### Search through gRPC on minilm-debian (60,733 x 384, 500 queries x 4 passes, k=10)\n")
        print("| clients | ef | recall@10 | queries/s | p50 ms | p99 ms |")
        print("|---|---|---|---|---|---|")
        for r in search:
            ef = "exact" if r["exact"] else r["ef"]
            print(f"| {r['clients']} | {ef} | {r['recall']:.4f} | {r['queries_per_s']:,.0f} | "
                  f"{r['p50_ms']:.2f} | {r['p99_ms']:.2f} |")
        print()
    unix_pg = {r["clients"]: r for r in unix if r["bench"] == "pg_insert"}
    unix_ins = {r["clients"]: r for r in unix if r["bench"] == "insert"}
    unix_search = [r for r in unix if r["bench"] == "search"]
    if unix_ins:
        print("### Over Unix sockets: the same server restarted on one, PostgreSQL through its own\n")
        print("Durable single-vector inserts as above (1,000 per run, three alternating rounds, "
              "medians and range), then one-client search.\n")
        print("| clients | tarn fsync req/s | p50 / p99 ms | PostgreSQL tx/s | p50 / p99 ms | tarn / PostgreSQL |")
        print("|---|---|---|---|---|---|")
        for c in sorted(unix_ins):
            f, p = unix_ins[c], unix_pg.get(c)
            ratio = f"{f['requests_per_s'] / p['requests_per_s']:.2f}x" if p else "-"
            print(f"| {c} | {cell(f)} | {lat(f)} | {cell(p)} | {lat(p)} | {ratio} |")
        print()
    if unix_search:
        print("| clients | ef | recall@10 | queries/s | p50 ms | p99 ms |")
        print("|---|---|---|---|---|---|")
        for r in unix_search:
            print(f"| {r['clients']} | {r['ef']} | {r['recall']:.4f} | {r['queries_per_s']:,.0f} | "
                  f"{r['p50_ms']:.2f} | {r['p99_ms']:.2f} |")
        print()
    reopen = by("reopen")
    if reopen:
        print("### Time to reopen after a long WAL (benches/reopen.rs, in-process)\n")
        print("| WAL entries after the checkpoint | WAL bytes | open (replay) | entries/s |")
        print("|---|---|---|---|")
        for r in reopen:
            print(f"| {r['wal_entries']:,} | {r['wal_bytes'] / 1e6:,.0f} MB | {r['open_s']:.2f} s | "
                  f"{r['wal_entries'] / r['open_s']:,.0f} |")
        print()

    hnsw = None
    if args.hnswlib and os.path.exists(args.hnswlib):
        hnsw = json.load(open(args.hnswlib))

    # The chart: throughput against clients.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    series = [
        ("tarn, fsync (durable)", [single[k] for k in sorted(single) if k[0] == "fsync"]),
        ("tarn, written", [single[k] for k in sorted(single) if k[0] == "written"]),
        ("PostgreSQL 15, synchronous_commit=on", [pg[c] for c in sorted(pg)]),
    ]
    for name, points in series:
        if points:
            ax.plot([p["clients"] for p in points], [p["requests_per_s"] for p in points],
                    marker="o", label=name)
    # The Unix-socket rounds (1 and 64 clients), dashed, in the colours of their TCP series.
    unix_series = [
        ("tarn, fsync, Unix socket", [unix_ins[c] for c in sorted(unix_ins)], "C0"),
        ("PostgreSQL 15, Unix socket", [unix_pg[c] for c in sorted(unix_pg)], "C2"),
    ]
    for name, points, colour in unix_series:
        if points:
            ax.plot([p["clients"] for p in points], [p["requests_per_s"] for p in points],
                    marker="s", linestyle="--", color=colour, label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("concurrent clients (one connection each)")
    ax.set_ylabel("single-vector inserts/s (128-d)")
    ax.set_title("Durable inserts, same machine, same run")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)

    print("### Targets\n")
    targets = []
    f1, p1 = single.get(("fsync", 1)), pg.get(1)
    if f1 and p1:
        t_tarn, t_pg = 1000 / f1["requests_per_s"], 1000 / p1["requests_per_s"]
        targets.append((f"1,000 sequential durable inserts, one client: tarn {t_tarn:.3f} s, "
                        f"PostgreSQL {t_pg:.3f} s (no slower)", t_pg / t_tarn, 1.0))
    f64, p64 = single.get(("fsync", 64)), pg.get(64)
    if f64 and p64:
        targets.append((f"64 clients: tarn {f64['requests_per_s']:,.0f}/s, PostgreSQL "
                        f"{p64['requests_per_s']:,.0f}/s (at least 3x)",
                        f64["requests_per_s"] / p64["requests_per_s"], 3.0))
    u1, up1 = unix_ins.get(1), unix_pg.get(1)
    if u1 and up1:
        targets.append((f"the same over Unix sockets: tarn {1000 / u1['requests_per_s']:.3f} s, "
                        f"PostgreSQL {1000 / up1['requests_per_s']:.3f} s",
                        u1["requests_per_s"] / up1["requests_per_s"], 1.0))
    u64, up64 = unix_ins.get(64), unix_pg.get(64)
    if u64 and up64:
        targets.append((f"64 clients over Unix sockets: tarn {u64['requests_per_s']:,.0f}/s, "
                        f"PostgreSQL {up64['requests_per_s']:,.0f}/s",
                        u64["requests_per_s"] / up64["requests_per_s"], 3.0))
    one = [r for r in search if r["clients"] == 1 and not r["exact"]]
    if hnsw:
        h = qps_at(hnsw["hnswlib"], 0.98)
        curves = [("`tarn bench search`", [{"recall": r["recall"], "qps": r["queries_per_s"]} for r in one])]
        if unix_search:
            curves.append(("`tarn bench search` over a Unix socket",
                           [{"recall": r["recall"], "qps": r["queries_per_s"]} for r in unix_search]))
        if hnsw.get("grpc"):
            curves.append(("`tarn search` in search-vs-hnswlib.sh", hnsw["grpc"]))
        for name, curve in curves:
            g = qps_at(curve, 0.98) if curve else None
            if g and h:
                targets.append((f"search through gRPC, one client ({name}), recall@10 0.98: tarn "
                                f"{g:,.0f} q/s, hnswlib in-process {h:,.0f} q/s measured in the same "
                                f"run (at least 0.5x)", g / h, 0.5))
            elif curve:
                print(f"- search through gRPC ({name}): the curve does not cross recall 0.98")
    for f in fresh:
        targets.append((f"insert-to-searchable p99 at 1,000 inserts/s: {f['to_searchable_p99_ms']:.1f} ms "
                        f"(under 50 ms)", 50 / f["to_searchable_p99_ms"], 1.0))
    for text, ratio, need in targets:
        print(f"- {text}: ratio {ratio:.2f}, {'met' if ratio >= need else 'NOT met'}")


if __name__ == "__main__":
    main()
