"""hnswlib on minilm-debian next to tarn's sealed search, in the same run.

Builds an hnswlib index (M=16, ef_construction=200, inner product on the unit-length vectors,
which is cosine), measures single-thread queries/s with one query per call at the same ef values
tarn's harness uses, reads tarn's figures (JSON from `benches/search_speed.rs --json`),
interpolates both recall-vs-q/s curves at recall@10 0.98 and 0.99, renders the chart, and prints
one summary line. Called by scripts/search-vs-hnswlib.sh.
"""

import argparse
import json
import os
import statistics
import subprocess
import time

import hnswlib
import numpy as np

from vecs import read_vecs, recall  # scripts/py/vecs.py

K = 10
ROUNDS = 5


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def qps_at(curve, target):
    """Queries/s where the recall curve (sorted by ef) crosses `target`, linearly interpolated."""
    points = sorted((p["recall"], p["qps"]) for p in curve)
    for (r0, q0), (r1, q1) in zip(points, points[1:]):
        if r0 <= target <= r1:
            if r1 == r0:
                return max(q0, q1)
            return q0 + (q1 - q0) * (target - r0) / (r1 - r0)
    return None


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--tarn-cmd", required=True,
                        help="runs tarn's harness; {json} is replaced by the output file")
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--grpc-json", help="tarn's curve through gRPC, one client")
    parser.add_argument("--png", required=True)
    parser.add_argument("--out-json", required=True)
    args = parser.parse_args()

    base = read_vecs(os.path.join(args.data, "base.fvecs"), np.float32)
    queries = read_vecs(os.path.join(args.data, "query.fvecs"), np.float32)
    queries = queries / np.linalg.norm(queries, axis=1, keepdims=True)
    truth = read_vecs(os.path.join(args.data, "groundtruth.ivecs"), np.int32)
    n, dim = base.shape

    rss_before = rss_bytes()
    index = hnswlib.Index(space="ip", dim=int(dim))
    index.init_index(max_elements=n, M=16, ef_construction=200, random_seed=100)
    index.set_num_threads(2)
    start = time.perf_counter()
    index.add_items(base, np.arange(n))
    build_s = time.perf_counter() - start
    hnswlib_bytes = (rss_bytes() - rss_before) / n - dim * 4
    index.set_num_threads(1)

    # Passes alternate between tarn (its harness, a separate process, run while hnswlib's index
    # waits in memory) and hnswlib, so that both see the same machine conditions; each point is
    # the median over passes of per-pass medians.
    tarn_passes, hnsw_passes = [], []
    for p in range(args.passes):
        out = os.path.abspath(f"{args.out_json}.tarn{p}")
        subprocess.run(args.tarn_cmd.replace("{json}", out), shell=True, check=True)
        with open(out) as f:
            tarn_passes.append(json.load(f))
        curve = []
        for point in tarn_passes[-1]["curve"]:
            ef = point["ef"]
            index.set_ef(max(ef, K))
            rates = []
            for _ in range(ROUNDS):
                labels = []
                start = time.perf_counter()
                for q in queries:
                    labels.append(index.knn_query(q, k=K)[0][0])
                rates.append(len(queries) / (time.perf_counter() - start))
            # The same queries in one call (still one thread): how much of the per-call figure
            # is Python's call overhead rather than hnswlib's search.
            batched = []
            for _ in range(ROUNDS):
                start = time.perf_counter()
                index.knn_query(queries, k=K, num_threads=1)
                batched.append(len(queries) / (time.perf_counter() - start))
            curve.append({"ef": ef, "recall": recall(labels, truth), "qps": statistics.median(rates),
                          "batched_qps": statistics.median(batched)})
        hnsw_passes.append(curve)

    def merge(passes):
        return [
            {"ef": pts[0]["ef"], "recall": pts[0]["recall"],
             "qps": statistics.median(p["qps"] for p in pts),
             **({"batched_qps": statistics.median(p["batched_qps"] for p in pts)}
                if "batched_qps" in pts[0] else {})}
            for pts in zip(*passes)
        ]

    tarn = dict(tarn_passes[0])
    tarn["curve"] = merge([t["curve"] for t in tarn_passes])
    for key in ("threads1_qps", "threads2_qps", "exact_qps", "open_seconds"):
        tarn[key] = statistics.median(t[key] for t in tarn_passes)
    hnsw_curve = merge(hnsw_passes)

    print(f"hnswlib build {build_s:.1f} s on 2 threads; about {hnswlib_bytes:.0f} bytes per vector beyond the raw vectors (RSS growth)")
    print()
    print(f"tarn: kernels {tarn['kernels']}, open {tarn['open_seconds']:.3f} s, exact {tarn['exact_qps']:.0f} q/s, "
          f"ef 64 throughput 1 thread {tarn['threads1_qps']:.0f} q/s, 2 threads {tarn['threads2_qps']:.0f} q/s")
    print(f"medians over {args.passes} alternating passes")
    print()
    grpc = None
    if args.grpc_json:
        with open(args.grpc_json) as f:
            grpc = {p["ef"]: p for p in json.load(f)}
    print("| ef | tarn recall@10 | tarn q/s | hnswlib recall@10 | hnswlib q/s | tarn/hnswlib | hnswlib q/s, all queries in one call | tarn via gRPC recall@10 | via gRPC q/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for t, h in zip(tarn["curve"], hnsw_curve):
        g = (grpc or {}).get(t["ef"])
        g_text = f"{g['recall']:.4f} | {g['qps']:.0f}" if g else "- | -"
        print(f"| {t['ef']} | {t['recall']:.4f} | {t['qps']:.0f} | {h['recall']:.4f} | {h['qps']:.0f} | {t['qps'] / h['qps']:.2f} | {h['batched_qps']:.0f} | {g_text} |")
    print()

    ratios = {}
    for target in (0.98, 0.99):
        t, h = qps_at(tarn["curve"], target), qps_at(hnsw_curve, target)
        ratios[target] = (t / h) if t and h else float("nan")
        g = qps_at(list(grpc.values()), target) if grpc else None
        print(f"recall@10 {target}: tarn {t or float('nan'):.0f} q/s, hnswlib {h or float('nan'):.0f} q/s, "
              f"tarn via gRPC {g or float('nan'):.0f} q/s")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    curves = [("tarn sealed segment, in-process", tarn["curve"]), ("hnswlib 0.8.0, in-process (Python)", hnsw_curve)]
    if grpc:
        curves.append(("tarn through gRPC, one client", sorted(grpc.values(), key=lambda p: p["ef"])))
    for name, curve in curves:
        ax.plot([p["recall"] for p in curve], [p["qps"] for p in curve], marker="o", label=name)
    ax.set_xlabel("recall@10")
    ax.set_ylabel("queries/s (1 thread, 1 query per call)")
    ax.set_yscale("log")
    ax.set_title(f"minilm-debian {n} x {dim}, M=16, ef_construction=200")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)

    with open(args.out_json, "w") as f:
        json.dump({"tarn": tarn, "hnswlib": hnsw_curve, "hnswlib_build_seconds": build_s,
                   "grpc": sorted(grpc.values(), key=lambda p: p["ef"]) if grpc else None,
                   "hnswlib_bytes_per_vector": hnswlib_bytes}, f, indent=1)
    print(
        f"ratio_at_0.98={ratios[0.98]:.2f} ratio_at_0.99={ratios[0.99]:.2f} "
        f"bytes_per_vector={tarn['bytes_per_vector']:.0f}"
    )


if __name__ == "__main__":
    main()
