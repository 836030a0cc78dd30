"""Quantized search on minilm-debian: tarn's int8 and RaBitQ sealed segments (in memory and with
vectors on disk, warm and cold) against faiss-cpu's scalar int8 HNSW (IndexHNSWSQ, with and
without an exact refine step), faiss's IVF-RaBitQ with a refine step, and hnswlib f32, in one run.

tarn's figures come from `benches/quantized_search.rs --json` (every configuration on the same
graph, in-process, one thread, one query per call). The peers are built here on the unit-length
vectors (inner product = cosine): HNSW with M=16, ef_construction=200; IVF-RaBitQ with
nlist = 4 sqrt(n), 1-bit codes, refined with the full vectors (k_factor 10, as tarn's rescoring).
Each is measured the same way: one thread, one query per call, the median of `--passes` passes
per setting. Memory per vector: the serialised index's bytes over n (faiss, hnswlib; the refine
step's full vectors counted), tarn's segment accounting (resident bytes: with vectors on disk
the full vectors are not counted, they are in the segment file).

Prints a table, then for each tarn configuration at each ef the ratios of q/s and memory
against the fastest faiss setting (any of its quantized indexes) that reaches at least its
recall, and ends with the line
  int8_recall=.. int8_bytes=.. int8_qps_ratio=.. rabitq1_recall=.. rabitq1_bytes=.. rabitq1_qps_ratio=..
(tarn with vectors on disk, warm, ef 64; q/s ratios against tarn f32 in the same run).
Called by scripts/quantization-vs-peers.sh.
"""

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time

import faiss
import hnswlib
import numpy as np

from vecs import read_vecs, recall  # scripts/py/vecs.py

K = 10
EFS = [16, 32, 64, 128]
NPROBES = [16, 32, 64, 128, 256]


def measure(search, queries, truth, passes):
    rates, labels = [], None
    for _ in range(passes):
        start = time.perf_counter()
        labels = [search(q) for q in queries]
        rates.append(len(queries) / (time.perf_counter() - start))
    return recall(labels, truth), statistics.median(rates)


def faiss_bytes(index):
    return len(faiss.serialize_index(index))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--tarn-cmd", required=True,
                        help="runs tarn's harness; {json} is replaced by the output file")
    parser.add_argument("--tarn-json", required=True)
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--out-json", required=True)
    parser.add_argument("--png", help="writes a chart of recall against q/s and memory")
    args = parser.parse_args()

    subprocess.run(args.tarn_cmd.format(json=args.tarn_json), shell=True, check=True)
    with open(args.tarn_json) as f:
        tarn = json.load(f)

    base = read_vecs(f"{args.data}/base.fvecs", np.float32)
    queries = read_vecs(f"{args.data}/query.fvecs", np.float32)
    truth = read_vecs(f"{args.data}/groundtruth.ivecs", np.int32)
    base /= np.linalg.norm(base, axis=1, keepdims=True)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    n, dim = base.shape
    rows = []

    faiss.omp_set_num_threads(2)
    sq = faiss.IndexHNSWSQ(dim, faiss.ScalarQuantizer.QT_8bit, 16, faiss.METRIC_INNER_PRODUCT)
    sq.hnsw.efConstruction = 200
    start = time.perf_counter()
    sq.train(base)
    # The refine index holds the full vectors beside the codes; adding to it adds to both.
    refined = faiss.IndexRefineFlat(sq)
    refined.k_factor = 3
    refined.add(base)
    print(f"faiss IndexHNSWSQ int8: built in {time.perf_counter() - start:.1f} s", flush=True)
    sq_bytes = faiss_bytes(sq) / n
    refined_bytes = sq_bytes + dim * 4

    rabitq = None
    if hasattr(faiss, "IndexIVFRaBitQ"):
        nlist = int(4 * np.sqrt(n))
        coarse = faiss.IndexFlatIP(dim)
        ivf = faiss.IndexIVFRaBitQ(coarse, dim, nlist, faiss.METRIC_INNER_PRODUCT)
        start = time.perf_counter()
        ivf.train(base)
        rabitq = faiss.IndexRefineFlat(ivf)
        rabitq.k_factor = 10
        rabitq.add(base)
        print(f"faiss IndexIVFRaBitQ 1-bit (nlist {nlist}) + refine: built in "
              f"{time.perf_counter() - start:.1f} s", flush=True)
        rabitq_bytes = faiss_bytes(ivf) / n + dim * 4
    else:
        print(f"faiss {faiss.__version__} has no IndexIVFRaBitQ: its rows are SKIPPED")

    hnsw = hnswlib.Index(space="ip", dim=dim)
    hnsw.init_index(max_elements=n, M=16, ef_construction=200, random_seed=100)
    hnsw.set_num_threads(2)
    hnsw.add_items(base, np.arange(n))
    hnsw.set_num_threads(1)
    hnsw_bytes = None
    try:
        with tempfile.TemporaryDirectory() as tmp:
            hnsw.save_index(f"{tmp}/h.bin")
            hnsw_bytes = os.path.getsize(f"{tmp}/h.bin") / n
    except OSError:
        pass
    faiss.omp_set_num_threads(1)

    for ef in EFS:
        sq.hnsw.efSearch = ef
        r, q = measure(lambda v: sq.search(v[None, :], K)[1][0], queries, truth, args.passes)
        rows.append({"system": "faiss HNSWSQ int8", "family": "int8", "setting": f"ef {ef}",
                     "recall": r, "qps": q, "bytes": sq_bytes})
        params = faiss.IndexRefineSearchParameters(
            k_factor=3, base_index_params=faiss.SearchParametersHNSW(efSearch=ef))
        r, q = measure(lambda v: refined.search(v[None, :], K, params=params)[1][0],
                       queries, truth, args.passes)
        rows.append({"system": "faiss HNSWSQ int8 + refine x3", "family": "int8",
                     "setting": f"ef {ef}", "recall": r, "qps": q, "bytes": refined_bytes})
        hnsw.set_ef(max(ef, K))
        r, q = measure(lambda v: hnsw.knn_query(v, k=K)[0][0], queries, truth, args.passes)
        rows.append({"system": "hnswlib f32", "family": "f32", "setting": f"ef {ef}",
                     "recall": r, "qps": q, "bytes": hnsw_bytes})
    if rabitq is not None:
        for nprobe in NPROBES:
            params = faiss.IndexRefineSearchParameters(
                k_factor=10, base_index_params=faiss.IVFSearchParameters(nprobe=nprobe))
            r, q = measure(lambda v: rabitq.search(v[None, :], K, params=params)[1][0],
                           queries, truth, args.passes)
            rows.append({"system": "faiss IVF-RaBitQ 1-bit + refine x10", "family": "rabitq",
                         "setting": f"nprobe {nprobe}", "recall": r, "qps": q,
                         "bytes": rabitq_bytes})
    for row in tarn["rows"]:
        family = ("f32" if row["config"] == "f32"
                  else "int8" if row["config"].startswith("int8") else "rabitq")
        cold = " cold" if row["cold"] else ""
        rows.append({"system": f"tarn {row['config']}{cold}", "family": family,
                     "setting": f"ef {row['ef']}", "ef": row["ef"], "cold": row["cold"],
                     "recall": row["recall"], "qps": row["qps"], "bytes": row["bytes"],
                     "p99_us": row["p99_us"]})

    print()
    print("| system | setting | recall@10 | q/s (1 thread) | resident bytes / vector |")
    print("|---|---|---|---|---|")
    for row in sorted(rows, key=lambda r: (r["system"], r["setting"])):
        shown = f"{row['bytes']:.0f}" if row["bytes"] else "?"
        print(f"| {row['system']} | {row['setting']} | {row['recall']:.4f} | {row['qps']:.0f} "
              f"| {shown} |")

    print()
    print("Each tarn configuration (warm) against the fastest faiss setting of any of its "
          "quantized indexes with at least its recall (within 0.002):")
    print()
    print("| tarn | setting | recall@10 | q/s | bytes | faiss | its recall | q/s ratio "
          "| memory ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    faiss_rows = [r for r in rows if r["system"].startswith("faiss")]
    for row in sorted(rows, key=lambda r: (r["system"], r.get("ef", 0))):
        if not row["system"].startswith("tarn") or row["cold"] or row["family"] == "f32":
            continue
        peers = [p for p in faiss_rows if p["recall"] >= row["recall"] - 0.002]
        if not peers:
            print(f"| {row['system']} | {row['setting']} | {row['recall']:.4f} | "
                  f"{row['qps']:.0f} | {row['bytes']:.0f} | none of faiss's settings reaches it "
                  f"| | | |")
            continue
        best = max(peers, key=lambda p: p["qps"])
        print(f"| {row['system']} | {row['setting']} | {row['recall']:.4f} | {row['qps']:.0f} "
              f"| {row['bytes']:.0f} | {best['system']} {best['setting']} | {best['recall']:.4f} "
              f"| {row['qps'] / best['qps']:.2f}x | {row['bytes'] / best['bytes']:.2f}x |")

    with open(args.out_json, "w") as f:
        json.dump({"tarn": tarn, "rows": rows}, f, indent=1)
    if args.png:
        render(rows, args.png)
    f32 = next(r for r in tarn["rows"] if r["config"] == "f32" and r["ef"] == 64)

    def line(prefix, predicate):
        row = next((r for r in tarn["rows"] if r["ef"] == 64 and not r["cold"]
                    and predicate(r["config"])), None)
        if row is None:
            return f"{prefix}_recall=? {prefix}_bytes=? {prefix}_qps_ratio=?"
        return (f"{prefix}_recall={row['recall']:.4f} {prefix}_bytes={row['bytes']:.0f} "
                f"{prefix}_qps_ratio={row['qps'] / f32['qps']:.2f}")

    print(line("int8", lambda c: c.startswith("int8") and c.endswith("on disk")) + " " +
          line("rabitq1", lambda c: c.startswith("rabitq1 ") and c.endswith("on disk")))


def render(rows, png):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    systems = sorted({r["system"] for r in rows if not r.get("cold")})
    for system in systems:
        points = sorted(((r["recall"], r["qps"]) for r in rows
                         if r["system"] == system and not r.get("cold")))
        style = "-o" if system.startswith("tarn") else "--s"
        left.plot([p[0] for p in points], [p[1] for p in points], style, label=system,
                  markersize=4)
    left.set_xlabel("recall@10")
    left.set_ylabel("queries/s, one thread")
    left.set_title("minilm-debian (60,733 x 384): recall against speed")
    left.legend(fontsize=6)
    at_64 = [r for r in rows if not r.get("cold") and r["bytes"]
             and (r["setting"] == "ef 64" or r["setting"] == "nprobe 16")]
    at_64.sort(key=lambda r: r["bytes"])
    right.barh([r["system"] for r in at_64], [r["bytes"] for r in at_64])
    right.set_xlabel("resident bytes per vector (full vectors on disk are not resident)")
    right.set_title("memory")
    right.tick_params(axis="y", labelsize=6)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


if __name__ == "__main__":
    main()
