"""Inserts the minilm-debian vectors (sentence embeddings of Debian package descriptions) into
tarn and prints the packages nearest to a few queries.

    python examples/minilm_search.py --data ../../../shared/data/minilm-debian --address localhost:50051

The collection `minilm` is created if missing; documents are the base rows (doc id = row).
"""

import argparse
import gzip
import json
import os
import time

import numpy as np

from tarn_client import Client


def read_fvecs(path):
    raw = np.fromfile(path, dtype=np.int32)
    dim = raw[0]
    return np.ascontiguousarray(raw.reshape(-1, dim + 1)[:, 1:].view(np.float32))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=os.path.join(os.path.dirname(__file__), "..", "..", "..", "..", "shared", "data", "minilm-debian"))
    parser.add_argument("--address", default="localhost:50051")
    parser.add_argument("--limit", type=int, default=0, help="insert only the first N vectors")
    parser.add_argument("--queries", type=int, nargs="*", default=[0, 1, 2], help="query rows to run")
    parser.add_argument("--top-k", type=int, default=5)
    args = parser.parse_args()

    base = read_fvecs(os.path.join(args.data, "base.fvecs"))
    if args.limit:
        base = base[: args.limit]
    queries = read_fvecs(os.path.join(args.data, "query.fvecs"))
    with gzip.open(os.path.join(args.data, "base_texts.jsonl.gz"), "rt") as f:
        base_texts = [json.loads(line) for line in f]
    with open(os.path.join(args.data, "query_texts.jsonl")) as f:
        query_texts = [json.loads(line) for line in f]

    with Client(args.address) as client:
        client.wait_ready()
        if "minilm" not in client.list_collections():
            client.create_collection("minilm", dimension=base.shape[1], metric="cosine")
        start = time.perf_counter()
        seq = 0
        for lo in range(0, len(base), 1000):
            rows = base[lo : lo + 1000]
            seq = client.insert("minilm", doc_ids=range(lo, lo + len(rows)), vectors=rows)
        print(f"inserted {len(base)} vectors in {time.perf_counter() - start:.1f} s (durable)")
        for q in args.queries:
            print(f"\nquery {q}: {query_texts[q]['package']}: {query_texts[q]['text'][:100]}")
            for hit in client.search("minilm", queries[q], top_k=args.top_k, min_seq_no=seq):
                text = base_texts[hit.doc_id]
                print(f"  {hit.score:.3f}  {text['package']}: {text['text'][:90]}")


if __name__ == "__main__":
    main()
