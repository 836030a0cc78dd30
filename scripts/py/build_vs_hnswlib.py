"""hnswlib's index build on minilm-debian next to tarn's builder, in the same run.

Alternates passes: tarn's harness (`benches/index_build.rs`, a separate process: builds a sealed
segment in memory from the raw vectors with tarn's parallel builder, times it, measures recall@10
over the 500 public queries) and an hnswlib build of the same vectors (M=16, ef_construction=200,
inner product on the unit vectors, which is cosine), both on the same number of threads. Each
side's time is the median over all its builds; recall@10 at ef 64 is each side's median over its
builds.

Then the load (`--tarn-bin`): a fresh `tarn serve`, a collection with the same parameters, and
`tarn insert` of every vector over gRPC (FSYNC, 500 per request, 8 in flight), which returns once
the collection reports nothing unindexed; load seconds are from its start to its exit, load_ratio
= load seconds / hnswlib's median build. A second load, with one client searching throughout
(recall@10 at ef 64 against an exact search of the collection at that moment, every 5th query;
a sample counts only when exact searches just before and just after it agree, see `searcher`),
gives the curve of q/s (of the approximate searches, their time alone) and recall per second, written to --curve-json. Prints one summary line.
Called by scripts/build-vs-hnswlib.sh.
"""

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import threading
import time

import hnswlib
import numpy as np

from vecs import read_vecs, recall  # scripts/py/vecs.py

K = 10
EFS = (32, 64, 128, 256)


def rss_kb(pid, field="VmRSS"):
    """A process's resident set (or its peak, VmHWM) in KiB, from /proc."""
    status = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status"))
    return int(status[field].split()[0])


def start_tarn(tarn_bin, work):
    """A throwaway `tarn serve`; returns (process, gRPC address host:port)."""
    out = open(os.path.join(work, "serve.out"), "w")
    err = open(os.path.join(work, "serve.err"), "w")
    proc = subprocess.Popen([tarn_bin, "serve", "--data-dir", os.path.join(work, "data"),
                             "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"],
                            stdout=out, stderr=err)
    for _ in range(400):
        with open(os.path.join(work, "serve.out")) as f:
            for line in f:
                if line.startswith("tarn: gRPC listening on "):
                    return proc, line.split()[-1]
        if proc.poll() is not None:
            raise SystemExit("tarn serve exited early: " + open(os.path.join(work, "serve.err")).read())
        time.sleep(0.05)
    raise SystemExit("tarn serve did not announce its address")


def load(tarn_bin, data, queries, with_searcher):
    """Inserts base.fvecs through `tarn insert` (waits until indexed). Returns (seconds, curve)."""
    from tarn_client import Client

    work = tempfile.mkdtemp(prefix="tarn-load-")
    proc, address = start_tarn(tarn_bin, work)
    curve = []
    try:
        client = Client(address, timeout=120)
        client.wait_ready()
        client.create_collection("minilm", dimension=queries.shape[1], metric="cosine",
                                 m=16, ef_construction=200, ef_search=64)
        stop = threading.Event()

        def exact(q):
            return sorted(h.doc_id for h in client.search("minilm", q, top_k=K, exact=True))

        def searcher(t0):
            i = 0
            while not stop.is_set():
                second_end = t0 + len(curve) + 1
                n, found, expected, moved, busy = 0, 0, 0, 0, 0.0
                while time.perf_counter() < second_end and not stop.is_set():
                    q = queries[i % len(queries)]
                    if i % 5 == 0:
                        # The exact answer is taken before and after the approximate one; the
                        # load only inserts, so when both agree no better document arrived in
                        # between and they are the truth at the moment of the approximate
                        # search. Otherwise the sample is skipped (counted as `moved`).
                        before = exact(q)
                        started = time.perf_counter()
                        hits = [h.doc_id for h in client.search("minilm", q, top_k=K, ef=64)]
                        busy += time.perf_counter() - started
                        after = exact(q)
                        if before == after:
                            found += len(set(hits) & set(after))
                            expected += len(after)
                        else:
                            moved += 1
                    else:
                        started = time.perf_counter()
                        client.search("minilm", q, top_k=K, ef=64)
                        busy += time.perf_counter() - started
                    n += 1
                    i += 1
                info = client.collection("minilm")
                # q/s of the approximate searches alone: the exact ones are the measurement's.
                curve.append({"second": len(curve) + 1, "qps": round(n / busy) if busy else 0,
                              "recall": found / expected if expected else None,
                              "samples": expected // K, "moved": moved,
                              "n_documents": info.n_documents, "n_unindexed": info.n_unindexed})

        env = dict(os.environ, TARN_ADDR="http://" + address)
        empty_kb = rss_kb(proc.pid)
        t0 = time.perf_counter()
        thread = None
        if with_searcher:
            thread = threading.Thread(target=searcher, args=(t0,))
            thread.start()
        result = subprocess.run([tarn_bin, "insert", "--collection", "minilm", "--fvecs",
                                 os.path.join(data, "base.fvecs"), "--batch", "500",
                                 "--concurrency", "8", "--durability", "fsync"],
                                env=env, check=True, capture_output=True, text=True)
        seconds = time.perf_counter() - t0
        if thread:
            # One more second after the load, to see the settled speed.
            time.sleep(1.5)
            stop.set()
            thread.join()
        info = client.collection("minilm")
        assert info.n_unindexed == 0, info
        # Resident memory once settled (after a checkpoint's memory release), and the peak.
        time.sleep(2)
        settled_kb, peak_kb = rss_kb(proc.pid), rss_kb(proc.pid, "VmHWM")
        raw = info.n_documents * queries.shape[1] * 4
        # Per vector: what the load added to the resident set (the server with its empty
        # collection, binary and runtime included, was `empty_kb` before it), beyond the raw
        # vectors, divided by the vectors.
        memory = {"rss_bytes": settled_kb * 1024, "peak_bytes": peak_kb * 1024, "raw_bytes": raw,
                  "empty_rss_bytes": empty_kb * 1024,
                  "over_raw_per_vector":
                      ((settled_kb - empty_kb) * 1024 - raw) / max(info.n_documents, 1)}
        print(f"tarn memory after the load: RSS {settled_kb / 1024:.0f} MiB, "
              f"{empty_kb / 1024:.0f} MiB before it (raw vectors {raw / 2**20:.0f} MiB, "
              f"{memory['over_raw_per_vector']:.0f} B/vector over raw), "
              f"peak {peak_kb / 1024:.0f} MiB", flush=True)
        print(f"tarn load{' with a searcher' if with_searcher else ''}: {seconds:.2f} s "
              f"({result.stdout.strip().splitlines()[-1]})", flush=True)
        client.close()
        return seconds, curve, memory
    finally:
        proc.terminate()
        proc.wait()
        subprocess.run(["rm", "-rf", work], check=False)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--tarn-cmd", required=True,
                        help="runs tarn's harness; {json} is replaced by the output file")
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out-json", required=True)
    parser.add_argument("--tarn-bin", help="tarn binary for the load; no load without it")
    parser.add_argument("--curve-json", help="where the load's per-second curve goes")
    args = parser.parse_args()

    base = read_vecs(os.path.join(args.data, "base.fvecs"), np.float32)
    queries = read_vecs(os.path.join(args.data, "query.fvecs"), np.float32)
    queries = queries / np.linalg.norm(queries, axis=1, keepdims=True)
    truth = read_vecs(os.path.join(args.data, "groundtruth.ivecs"), np.int32)
    n, dim = base.shape

    tarn_seconds, tarn_recalls = [], {ef: [] for ef in EFS}
    hnsw_seconds, hnsw_recalls = [], {ef: [] for ef in EFS}
    load_seconds, curve, memories = [], [], []
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
        if args.tarn_bin:
            seconds, _, memory = load(args.tarn_bin, args.data, queries, False)
            load_seconds.append(seconds)
            memories.append(memory)

    if args.tarn_bin:
        curve = load(args.tarn_bin, args.data, queries, True)[1]
        with open(args.curve_json or args.out_json + ".curve", "w") as f:
            json.dump(curve, f, indent=1)
        print("second | q/s | recall@10 (samples, skipped as moved) | documents | unindexed")
        for point in curve:
            r = "-" if point["recall"] is None else f"{point['recall']:.3f}"
            print(f"{point['second']} | {point['qps']} | {r} ({point['samples']}, {point['moved']}) "
                  f"| {point['n_documents']} | {point['n_unindexed']}")
    tarn_s = statistics.median(tarn_seconds)
    hnsw_s = statistics.median(hnsw_seconds)
    load_s = statistics.median(load_seconds) if load_seconds else None
    recalls = [p["recall"] for p in curve if p["recall"] is not None]
    summary = {
        "n": int(n), "threads": args.threads, "passes": args.passes,
        "tarn_build_seconds": tarn_s, "tarn_build_seconds_all": tarn_seconds,
        "hnswlib_build_seconds": hnsw_s, "hnswlib_build_seconds_all": hnsw_seconds,
        "tarn_recall": {ef: statistics.median(v) for ef, v in tarn_recalls.items()},
        "hnswlib_recall": {ef: statistics.median(v) for ef, v in hnsw_recalls.items()},
        "build_ratio": tarn_s / hnsw_s,
        "load_seconds_all": load_seconds, "load_seconds": load_s,
        "load_ratio": load_s / hnsw_s if load_s else None,
        "load_min_recall": min(recalls) if recalls else None,
        "load_memory": memories,
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
    if load_s:
        print(f"load: {load_s:.2f} s (median of {', '.join(f'{s:.2f}' for s in load_seconds)}); "
              f"recall@10 during the load with a searcher: min {min(recalls):.3f}")
        over = statistics.median(m["over_raw_per_vector"] for m in memories)
        peak = max(m["peak_bytes"] for m in memories)
        print(f"memory once settled: {over:.0f} B/vector over raw (median over loads); "
              f"peak resident during a load {peak / 2**20:.0f} MiB "
              f"(raw vectors {memories[0]['raw_bytes'] / 2**20:.0f} MiB)")
    load_ratio = f"{load_s / hnsw_s:.3f}" if load_s else "na"
    print(f"build_ratio={tarn_s / hnsw_s:.3f} load_ratio={load_ratio} "
          f"recall_ef64={summary['tarn_recall'][64]:.4f} "
          f"hnswlib_recall_ef64={summary['hnswlib_recall'][64]:.4f}")


if __name__ == "__main__":
    main()
