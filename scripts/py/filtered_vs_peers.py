"""Filtered search on minilm-debian: tarn against hnswlib and faiss, in the same run.

Defines the filters (the query's own section, a rare section, one tag at about 1% and 0.1%, two
tags ANDed, installed-size ranges at 50%, 10% and 1%, architecture, none), computes each
query's exact filtered top 10 with numpy, writes them for tarn's in-process harness
(`benches/filtered_search.rs`) and runs it, searches the same filters through a running tarn
server over gRPC (the Python client, one query per call), then hnswlib 0.8.0 (its filter
callback) and faiss-cpu HNSW (an IDSelectorBitmap), both M=16, ef_construction=200, one thread,
one query per call. Prints a table per filter, renders a chart, writes JSON, and ends with
  filtered_min_recall=.. short=.. worst_ratio_vs_best_peer=.. ratio_vs_postfilter_1pct=..
Called by scripts/filtered-vs-peers.sh.
"""

import argparse
import collections
import gzip
import json
import os
import subprocess
import time

import numpy as np

from vecs import filtered_score, read_vecs, timed  # scripts/py/vecs.py

K = 10
PEER_EFS = [16, 32, 64, 128, 256, 512]
GRPC_EFS = [64]
HEADLINE_EF = 64


def read_jsonl_gz(path):
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f]


# Filters in the neutral form both harnesses read: {"match": {"field", "any_of"}},
# {"range": {"field", "gte"}}, {"all": [...]}; and the same as a predicate over a metadata row.
def match(field, values):
    return {"match": {"field": field, "any_of": list(values)}}


def holds(spec, row):
    kind, body = next(iter(spec.items()))
    if kind == "all":
        return all(holds(s, row) for s in body)
    if kind == "any":
        return any(holds(s, row) for s in body)
    if kind == "not":
        return not holds(body, row)
    if kind == "match":
        value = row.get(body["field"])
        if value is None:
            return False
        values = value if isinstance(value, list) else [value]
        return any(v in body["any_of"] for v in values)
    if kind == "range":
        value = row.get(body["field"])
        if value is None:
            return False
        return all(
            (op != "gt" or value > b) and (op != "gte" or value >= b)
            and (op != "lt" or value < b) and (op != "lte" or value <= b)
            for op, b in body.items() if op != "field"
        )
    raise ValueError(kind)


def define_filters(base_meta, query_meta, seed):
    rng = np.random.default_rng(seed)
    n = len(base_meta)
    sections = collections.Counter(r["section"] for r in base_meta if "section" in r)
    tags = collections.Counter(t for r in base_meta for t in r.get("tags", []))
    sizes = np.array([r["installed_size_kb"] for r in base_meta if "installed_size_kb" in r])

    def closest_tag(share):
        return min(tags, key=lambda t: (abs(tags[t] / n - share), t))

    rare = sorted(s for s, c in sections.items() if c < 0.001 * n)
    rare_section = rare[rng.integers(len(rare))]
    top = [t for t, _ in tags.most_common(30)]
    tag_sets = [set(r.get("tags", [])) for r in base_meta]
    pairs = []
    for i, a in enumerate(top):
        for b in top[i + 1:]:
            both = sum(1 for s in tag_sets if a in s and b in s)
            pairs.append((abs(both / n - 0.005), a, b))
    _, tag_a, tag_b = min(pairs)
    fixed = [
        ("rare_section", match("section", [rare_section])),
        ("tag_1pct", match("tags", [closest_tag(0.01)])),
        ("tag_0.1pct", match("tags", [closest_tag(0.001)])),
        ("two_tags", {"all": [match("tags", [tag_a]), match("tags", [tag_b])]}),
        ("size_50pct", {"range": {"field": "installed_size_kb", "gte": float(np.quantile(sizes, 0.5))}}),
        ("size_10pct", {"range": {"field": "installed_size_kb", "gte": float(np.quantile(sizes, 0.9))}}),
        ("size_1pct", {"range": {"field": "installed_size_kb", "gte": float(np.quantile(sizes, 0.99))}}),
        ("arch_all", match("architecture", ["all"])),
    ]
    n_queries = len(query_meta)
    own = [match("section", [q.get("section", "libs")]) for q in query_meta]
    out = [("own_section", own)]
    out += [(name, [spec] * n_queries) for name, spec in fixed]
    out.append(("none", [None] * n_queries))
    return out


def masks_for(per_query, base_meta):
    """One boolean mask per distinct filter (filters repeat across queries)."""
    cache = {}
    masks = []
    for spec in per_query:
        key = json.dumps(spec, sort_keys=True)
        if key not in cache:
            if spec is None:
                cache[key] = np.ones(len(base_meta), dtype=bool)
            else:
                cache[key] = np.array([holds(spec, r) for r in base_meta], dtype=bool)
        masks.append(cache[key])
    return masks


def exact_truth(base, queries, masks):
    truth = []
    for q, mask in zip(queries, masks):
        ids = np.flatnonzero(mask)
        if len(ids) == 0:
            truth.append([])
            continue
        scores = base[ids] @ q
        best = np.argsort(-scores, kind="stable")[:K]
        truth.append(ids[best].tolist())
    return truth


def run_hnswlib(base, queries, filters, all_masks, truth, n_matches, results):
    import hnswlib

    start = time.perf_counter()
    index = hnswlib.Index(space="ip", dim=base.shape[1])
    index.init_index(max_elements=len(base), M=16, ef_construction=200, random_seed=100)
    index.add_items(base, np.arange(len(base)))
    index.set_num_threads(1)
    print(f"hnswlib: built in {time.perf_counter() - start:.1f} s", flush=True)
    for (name, per_query), masks in zip(filters, all_masks):
        lists = {}
        allowed = [lists.setdefault(id(m), m.tolist()) for m in masks]
        for ef in PEER_EFS:
            index.set_ef(max(ef, K))

            def search(q):
                f = None
                if per_query[q] is not None:
                    f = allowed[q].__getitem__
                try:
                    labels, _ = index.knn_query(queries[q], k=K, filter=f)
                    return labels[0].tolist()
                except RuntimeError:
                    # Fewer than k found: hnswlib refuses to return a short array.
                    return []

            answers, qps = timed(len(queries), search)
            recall, short = filtered_score(answers, truth[name], n_matches[name])
            results.append({"filter": name, "system": "hnswlib", "mode": f"ef={ef}",
                            "recall": recall, "qps": qps, "short": short})
            print(f"  {name:<14} hnswlib ef={ef:<4} recall@10 {recall:.4f} {qps:>8.0f} q/s short {short}",
                  flush=True)
            if recall >= 1.0 and short == 0:
                break  # a wider beam is only slower


def run_faiss(base, queries, filters, all_masks, truth, n_matches, results):
    import faiss

    faiss.omp_set_num_threads(2)
    start = time.perf_counter()
    index = faiss.IndexHNSWFlat(base.shape[1], 16, faiss.METRIC_INNER_PRODUCT)
    index.hnsw.efConstruction = 200
    index.add(base)
    faiss.omp_set_num_threads(1)
    print(f"faiss: built in {time.perf_counter() - start:.1f} s", flush=True)
    for (name, per_query), masks in zip(filters, all_masks):
        selectors = {}
        keep = []

        def selector(q):
            if per_query[q] is None:
                return None
            key = id(masks[q])
            if key not in selectors:
                bits = np.packbits(masks[q], bitorder="little")
                keep.append(bits)
                selectors[key] = faiss.IDSelectorBitmap(len(masks[q]), faiss.swig_ptr(bits))
            return selectors[key]

        for ef in PEER_EFS:
            params = {}

            def search(q):
                sel = selector(q)
                key = (id(sel), ef)
                if key not in params:
                    params[key] = faiss.SearchParametersHNSW(efSearch=max(ef, K), sel=sel) \
                        if sel is not None else faiss.SearchParametersHNSW(efSearch=max(ef, K))
                _, labels = index.search(queries[q:q + 1], K, params=params[key])
                return [i for i in labels[0].tolist() if i >= 0]

            answers, qps = timed(len(queries), search)
            recall, short = filtered_score(answers, truth[name], n_matches[name])
            results.append({"filter": name, "system": "faiss", "mode": f"ef={ef}",
                            "recall": recall, "qps": qps, "short": short})
            print(f"  {name:<14} faiss   ef={ef:<4} recall@10 {recall:.4f} {qps:>8.0f} q/s short {short}",
                  flush=True)
            if recall >= 1.0 and short == 0:
                break  # a wider beam is only slower


def to_pb(spec, pb):
    if spec is None:
        return None
    kind, body = next(iter(spec.items()))
    if kind in ("all", "any"):
        return pb.Filter(**{kind: pb.FilterList(filters=[to_pb(s, pb) for s in body])})
    if kind == "not":
        return pb.Filter(**{"not": to_pb(body, pb)})
    if kind == "match":
        return pb.Filter(match=pb.Match(field=body["field"], any_of=body["any_of"]))
    if kind == "range":
        return pb.Filter(range=pb.Range(**body))
    raise ValueError(kind)


def run_grpc(address, collection, queries, filters, truth, n_matches, results):
    from tarn_client import Client
    from tarn_client._gen import tarn_pb2

    client = Client(address)
    for name, per_query in filters:
        wire = [to_pb(s, tarn_pb2) for s in per_query]
        for ef in GRPC_EFS:
            def search(q):
                return [h.doc_id for h in client.search(collection, queries[q], top_k=K, ef=ef,
                                                        filter=wire[q])]

            answers, qps = timed(len(queries), search)
            recall, short = filtered_score(answers, truth[name], n_matches[name])
            results.append({"filter": name, "system": "tarn gRPC", "mode": f"filtered ef={ef}",
                            "recall": recall, "qps": qps, "short": short})
            print(f"  {name:<14} tarn gRPC ef={ef:<4} recall@10 {recall:.4f} {qps:>8.0f} q/s short {short}",
                  flush=True)


def best_peer(results, name, recall):
    """The fastest peer configuration on this filter with recall at least `recall`."""
    eligible = [r for r in results if r["filter"] == name and r["system"] in ("hnswlib", "faiss")
                and r["recall"] >= recall and r["short"] == 0]
    return max(eligible, key=lambda r: r["qps"]) if eligible else None


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--work", required=True)
    parser.add_argument("--tarn-cmd", required=True,
                        help="tarn's harness; {filters} {attributes} {json} are replaced")
    parser.add_argument("--grpc", help="address of a tarn server holding --collection")
    parser.add_argument("--collection", default="minilm")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--png")
    parser.add_argument("--out-json", required=True)
    args = parser.parse_args()

    base = read_vecs(os.path.join(args.data, "base.fvecs"), np.float32)
    queries = read_vecs(os.path.join(args.data, "query.fvecs"), np.float32)
    base /= np.linalg.norm(base, axis=1, keepdims=True)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    base_meta = read_jsonl_gz(os.path.join(args.data, "base_metadata.jsonl.gz"))
    query_meta = read_jsonl_gz(os.path.join(args.data, "query_metadata.jsonl.gz"))
    assert len(base_meta) == len(base) and len(query_meta) == len(queries)

    filters = define_filters(base_meta, query_meta, args.seed)
    all_masks, truth, n_matches, out_filters = [], {}, {}, []
    for name, per_query in filters:
        masks = masks_for(per_query, base_meta)
        all_masks.append(masks)
        truth[name] = exact_truth(base, queries, masks)
        n_matches[name] = [int(m.sum()) for m in masks]
        share = float(np.mean(n_matches[name])) / len(base)
        print(f"filter {name}: {share:.4%} of the documents match (mean over queries); "
              f"{json.dumps(per_query[1])}", flush=True)
        out_filters.append({"name": name, "per_query": per_query, "n_matches": n_matches[name],
                            "truth": truth[name], "share": share})
    filters_path = os.path.join(args.work, "filters.json")
    attributes_path = os.path.join(args.work, "attributes.jsonl")
    with open(filters_path, "w") as f:
        json.dump({"filters": out_filters}, f)
    with open(attributes_path, "w") as f:
        for row in base_meta:
            f.write(json.dumps(row) + "\n")

    results = []
    tarn_json = os.path.join(args.work, "tarn.json")
    command = args.tarn_cmd.format(filters=filters_path, attributes=attributes_path, json=tarn_json)
    print(f"tarn in-process: {command}", flush=True)
    subprocess.run(command, shell=True, check=True)
    with open(tarn_json) as f:
        results += json.load(f)
    if args.grpc:
        run_grpc(args.grpc, args.collection, queries, filters, truth, n_matches, results)
    run_hnswlib(base, queries, filters, all_masks, truth, n_matches, results)
    run_faiss(base, queries, filters, all_masks, truth, n_matches, results)

    # The table and the summary: tarn's default configuration (ef 64) against the fastest peer
    # configuration reaching at least its recall on the same filter.
    headline = f"filtered ef={HEADLINE_EF}"
    print()
    print("| filter | share | tarn ef=64 recall / q/s | tarn exact scan | post-filter recall / q/s "
          "| tarn gRPC q/s | best peer at >= recall | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    ratios, min_recall, short, pf_ratios = [], 1.0, 0, []
    for entry in out_filters:
        name = entry["name"]
        rows = {(r["system"], r["mode"]): r for r in results if r["filter"] == name}
        t = rows[("tarn", headline)]
        min_recall = min(min_recall, t["recall"])
        short += sum(r["short"] for (system, mode), r in rows.items()
                     if system.startswith("tarn") and mode != "post-filter")
        exact = rows.get(("tarn", "exact scan"))
        post = rows.get(("tarn", "post-filter"))
        grpc = rows.get(("tarn gRPC", headline))
        peer = best_peer(results, name, t["recall"])
        ratio = t["qps"] / peer["qps"] if peer else None
        if ratio is not None:
            ratios.append(ratio)
        if name in ("tag_1pct", "size_1pct") and post:
            pf_ratios.append(t["qps"] / post["qps"])
        cell = lambda r: f"{r['recall']:.4f} / {r['qps']:,.0f}" if r else "-"
        peer_cell = f"{peer['system']} {peer['mode']}: {peer['recall']:.4f} / {peer['qps']:,.0f}" \
            if peer else "none reaches it"
        print(f"| {name} | {entry['share']:.2%} | {cell(t)} | {cell(exact)} | {cell(post)} | "
              f"{grpc['qps']:,.0f} | {peer_cell} | {f'{ratio:.2f}x' if ratio else '-'} |"
              if grpc else
              f"| {name} | {entry['share']:.2%} | {cell(t)} | {cell(exact)} | {cell(post)} | - | "
              f"{peer_cell} | {f'{ratio:.2f}x' if ratio else '-'} |")
    with open(args.out_json, "w") as f:
        json.dump({"filters": [{k: v for k, v in e.items() if k in ("name", "share")}
                               for e in out_filters], "results": results}, f, indent=1)
    if args.png:
        render(out_filters, results, args.png)
    worst = min(ratios) if ratios else float("nan")
    pf = min(pf_ratios) if pf_ratios else float("nan")
    print(f"filtered_min_recall={min_recall:.4f} short={short} "
          f"worst_ratio_vs_best_peer={worst:.2f} ratio_vs_postfilter_1pct={pf:.2f}")


def render(out_filters, results, png):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [e["name"] for e in out_filters]
    series = [("tarn", f"filtered ef={HEADLINE_EF}", "tarn (ef 64)"),
              ("tarn", "exact scan", "tarn exact scan"),
              ("tarn", "post-filter", "post-filtering"),
              ("hnswlib", f"ef={HEADLINE_EF}", "hnswlib ef 64"),
              ("faiss", f"ef={HEADLINE_EF}", "faiss ef 64")]
    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.16
    for i, (system, mode, label) in enumerate(series):
        values = []
        for name in names:
            hit = [r for r in results if r["filter"] == name and r["system"] == system and r["mode"] == mode]
            values.append(hit[0]["qps"] if hit else 0)
        ax.bar(np.arange(len(names)) + (i - 2) * width, values, width, label=label)
    ax.set_yscale("log")
    ax.set_xticks(np.arange(len(names)))
    ax.set_xticklabels(names, rotation=20)
    ax.set_ylabel("queries/s, one thread (log)")
    ax.set_title("Filtered search on minilm-debian (60,733 x 384), k=10")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


if __name__ == "__main__":
    main()
