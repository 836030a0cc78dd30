"""Quantized search on minilm-debian: tarn's int8 sealed segments against faiss-cpu's scalar
int8 HNSW (IndexHNSWSQ, with and without an exact refine step) and hnswlib f32, in one run.

tarn's figures come from `benches/quantized_search.rs --json` (f32 and int8 on the same graph,
in-process, one thread, one query per call). faiss and hnswlib are built here with M=16,
ef_construction=200 on the unit-length vectors (inner product = cosine) and measured the same
way: one thread, one query per call, the median of `--passes` passes per ef. Memory per vector:
the serialised index's bytes over n (faiss, hnswlib), tarn's segment accounting (tarn).
Prints a table, the ratios at each recall tier, and ends with the line
  int8_recall=<tarn ef 64> int8_bytes=<tarn int8 resident / vector> int8_qps_ratio=<int8 / f32 at ef 64>
Called by scripts/quantization-vs-peers.sh.
"""

import argparse
import json
import statistics
import subprocess
import time

import faiss
import hnswlib
import numpy as np

from vecs import read_vecs, recall  # scripts/py/vecs.py

K = 10
EFS = [16, 32, 64, 128]


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
    hnsw = hnswlib.Index(space="ip", dim=dim)
    hnsw.init_index(max_elements=n, M=16, ef_construction=200, random_seed=100)
    hnsw.set_num_threads(2)
    hnsw.add_items(base, np.arange(n))
    hnsw.set_num_threads(1)
    hnsw_bytes = None
    try:
        import os
        import tempfile
        with tempfile.TemporaryDirectory() as tmp:
            hnsw.save_index(f"{tmp}/h.bin")
            hnsw_bytes = os.path.getsize(f"{tmp}/h.bin") / n
    except OSError:
        pass
    faiss.omp_set_num_threads(1)

    for ef in EFS:
        sq.hnsw.efSearch = ef
        r, q = measure(lambda v: sq.search(v[None, :], K)[1][0], queries, truth, args.passes)
        rows.append({"system": "faiss HNSWSQ int8", "ef": ef, "recall": r, "qps": q, "bytes": sq_bytes})
        params = faiss.IndexRefineSearchParameters(
            k_factor=3, base_index_params=faiss.SearchParametersHNSW(efSearch=ef))
        r, q = measure(lambda v: refined.search(v[None, :], K, params=params)[1][0],
                       queries, truth, args.passes)
        rows.append({"system": "faiss HNSWSQ int8 + refine x3", "ef": ef, "recall": r, "qps": q,
                     "bytes": refined_bytes})
        hnsw.set_ef(max(ef, K))
        r, q = measure(lambda v: hnsw.knn_query(v, k=K)[0][0], queries, truth, args.passes)
        rows.append({"system": "hnswlib f32", "ef": ef, "recall": r, "qps": q, "bytes": hnsw_bytes})
    for row in tarn["rows"]:
        if row["rescore"] == 3:
            rows.append({"system": "tarn f32", "ef": row["ef"], "recall": row["f32_recall"],
                         "qps": row["f32_qps"], "bytes": tarn["f32_bytes_per_vector"]})
            rows.append({"system": "tarn int8 (rescore x3)", "ef": row["ef"],
                         "recall": row["int8_recall"], "qps": row["int8_qps"],
                         "bytes": tarn["int8_bytes_per_vector"]})

    print()
    print("| system | ef | recall@10 | q/s (1 thread) | bytes / vector |")
    print("|---|---|---|---|---|")
    for row in sorted(rows, key=lambda r: (r["system"], r["ef"])):
        shown = f"{row['bytes']:.0f}" if row["bytes"] else "?"
        print(f"| {row['system']} | {row['ef']} | {row['recall']:.4f} | {row['qps']:.0f} | {shown} |")
    at = {(r["system"], r["ef"]): r for r in rows}
    t8, tf, f8, fr = (at[("tarn int8 (rescore x3)", 64)], at[("tarn f32", 64)],
                      at[("faiss HNSWSQ int8", 64)], at[("faiss HNSWSQ int8 + refine x3", 64)])
    print()
    print(f"At ef 64: tarn int8 / tarn f32 q/s {t8['qps'] / tf['qps']:.2f}x; "
          f"tarn int8 / faiss HNSWSQ {t8['qps'] / f8['qps']:.2f}x "
          f"(recall {t8['recall']:.4f} against {f8['recall']:.4f}); "
          f"tarn int8 / faiss HNSWSQ + refine {t8['qps'] / fr['qps']:.2f}x "
          f"(recall {fr['recall']:.4f})")
    with open(args.out_json, "w") as f:
        json.dump({"tarn": tarn, "rows": rows}, f, indent=1)
    print(f"int8_recall={t8['recall']:.4f} int8_bytes={t8['bytes']:.0f} "
          f"int8_qps_ratio={t8['qps'] / tf['qps']:.2f}")


if __name__ == "__main__":
    main()
