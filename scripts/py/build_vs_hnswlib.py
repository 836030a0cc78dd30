"""hnswlib's index build on minilm-debian next to tarn's builder, in the same run.

Alternates passes: tarn's harness (`benches/index_build.rs`, a separate process: builds a sealed
segment in memory from the raw vectors with tarn's parallel builder, times it, measures recall@10
over the 500 public queries) and an hnswlib build of the same vectors (M=16, ef_construction=200,
inner product on the unit vectors, which is cosine), both on the same number of threads. Each
side's time is the median over all its builds; recall@10 at ef 64 is each side's median over its
builds. Prints one summary line. Called by scripts/build-vs-hnswlib.sh.
"""

import argparse
import json
import os
import statistics
import subprocess
import time

import hnswlib
import numpy as np

K = 10
EFS = (32, 64, 128, 256)


def read_vecs(path, dtype):
    raw = np.fromfile(path, dtype=np.int32)
    dim = raw[0]
    rows = raw.reshape(-1, dim + 1)[:, 1:]
    return np.ascontiguousarray(rows.view(dtype))


def recall(labels, truth):
    found = sum(len(set(row[:K]) & set(t[:K])) for row, t in zip(labels, truth))
    return found / (len(labels) * K)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--tarn-cmd", required=True,
                        help="runs tarn's harness; {json} is replaced by the output file")
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out-json", required=True)
    args = parser.parse_args()

    base = read_vecs(os.path.join(args.data, "base.fvecs"), np.float32)
    queries = read_vecs(os.path.join(args.data, "query.fvecs"), np.float32)
    queries = queries / np.linalg.norm(queries, axis=1, keepdims=True)
    truth = read_vecs(os.path.join(args.data, "groundtruth.ivecs"), np.int32)
    n, dim = base.shape

    tarn_seconds, tarn_recalls = [], {ef: [] for ef in EFS}
    hnsw_seconds, hnsw_recalls = [], {ef: [] for ef in EFS}
    for p in range(args.passes):
        out = os.path.abspath(f"{args.out_json}.tarn{p}")
        subprocess.run(args.tarn_cmd.replace("{json}", out), shell=True, check=True)
        with open(out) as f:
            tarn = json.load(f)
        tarn_seconds.extend(tarn["build_seconds_all"])
        for point in tarn["curve"]:
            tarn_recalls[point["ef"]].append(point["recall"])

        index = hnswlib.Index(space="ip", dim=int(dim))
        index.init_index(max_elements=n, M=16, ef_construction=200, random_seed=100 + p)
        index.set_num_threads(args.threads)
        start = time.perf_counter()
        index.add_items(base, np.arange(n))
        elapsed = time.perf_counter() - start
        hnsw_seconds.append(elapsed)
        index.set_num_threads(1)
        row = []
        for ef in EFS:
            index.set_ef(max(ef, K))
            labels = [index.knn_query(q, k=K)[0][0] for q in queries]
            r = recall(labels, truth)
            hnsw_recalls[ef].append(r)
            row.append(f"ef {ef}: {r:.4}")
        print(f"hnswlib pass {p + 1}: build {elapsed:.2f} s; recall@10 " + ", ".join(row), flush=True)
        del index

    tarn_s = statistics.median(tarn_seconds)
    hnsw_s = statistics.median(hnsw_seconds)
    summary = {
        "n": int(n), "threads": args.threads, "passes": args.passes,
        "tarn_build_seconds": tarn_s, "tarn_build_seconds_all": tarn_seconds,
        "hnswlib_build_seconds": hnsw_s, "hnswlib_build_seconds_all": hnsw_seconds,
        "tarn_recall": {ef: statistics.median(v) for ef, v in tarn_recalls.items()},
        "hnswlib_recall": {ef: statistics.median(v) for ef, v in hnsw_recalls.items()},
        "build_ratio": tarn_s / hnsw_s,
    }
    with open(args.out_json, "w") as f:
        json.dump(summary, f, indent=1)
    print()
    print(f"| | build s (median of {len(tarn_seconds)} / {len(hnsw_seconds)}) | all builds | "
          + " | ".join(f"recall@10 ef {ef}" for ef in EFS) + " |")
    print("|---|---|---|" + "---|" * len(EFS))
    print(f"| tarn | {tarn_s:.2f} | {', '.join(f'{s:.2f}' for s in tarn_seconds)} | "
          + " | ".join(f"{summary['tarn_recall'][ef]:.4f}" for ef in EFS) + " |")
    print(f"| hnswlib | {hnsw_s:.2f} | {', '.join(f'{s:.2f}' for s in hnsw_seconds)} | "
          + " | ".join(f"{summary['hnswlib_recall'][ef]:.4f}" for ef in EFS) + " |")
    print()
    print(f"build_ratio={tarn_s / hnsw_s:.3f} load_ratio=na "
          f"recall_ef64={summary['tarn_recall'][64]:.4f} "
          f"hnswlib_recall_ef64={summary['hnswlib_recall'][64]:.4f}")


if __name__ == "__main__":
    main()
