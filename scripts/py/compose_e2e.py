"""The Python half of scripts/compose-e2e.sh.

Data: the minilm-debian vectors (--data DIR with base.fvecs and query.fvecs), or, with
--data generated, 10,000 + 200 seeded synthetic 384-d vectors shaped like sentence embeddings
(100 clusters, most of each point's spread in a 32-d subspace of its cluster, a little in all
384 dimensions). Either way the exact answers are computed here by brute force.

load:   inserts 10,000 vectors for two tenants (rows 0-4,999 for tenant 1, rows
        5,000-9,999 for tenant 2; doc id = row), recording every acknowledged batch; checks
        recall@10 of the public queries against exact search per tenant, and tenant isolation.
verify: after the container was killed and restarted, checks that every acknowledged document
        is stored (Get) with its vector and is found by exact search for its own tenant only.
"""

import argparse
import json
import sys

import numpy as np

from tarn_client import Client

N_PER_TENANT = 5000
TENANTS = {1: (0, 5000), 2: (5000, 10000)}
COLLECTION = "e2e"


def read_fvecs(path):
    raw = np.fromfile(path, dtype=np.int32)
    dim = raw[0]
    return np.ascontiguousarray(raw.reshape(-1, dim + 1)[:, 1:].view(np.float32))


def generate(seed=27, n=2 * N_PER_TENANT, n_queries=200, dim=384, clusters=100, intrinsic=32):
    """Seeded embeddings-like data: (base, queries), the queries drawn like the base."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(clusters, dim))
    bases = rng.normal(size=(clusters, intrinsic, dim)) / np.sqrt(intrinsic)

    def draw(count):
        c = rng.integers(0, clusters, size=count)
        coords = rng.normal(size=(count, intrinsic))
        points = centres[c] + 2.0 * np.einsum("ni,nid->nd", coords, bases[c])
        points += 0.3 * rng.normal(size=(count, dim))
        return points.astype(np.float32)

    return draw(n), draw(n_queries)


def fail(message):
    print(f"compose-e2e: FAILED: {message}", file=sys.stderr)
    sys.exit(1)


def load(client, base, queries, state_path):
    client.create_collection(COLLECTION, dimension=base.shape[1], metric="cosine")
    acked = {}
    seq = 0
    for tenant, (lo, hi) in TENANTS.items():
        for start in range(lo, hi, 500):
            rows = range(start, min(start + 500, hi))
            seq = client.insert(COLLECTION, doc_ids=rows, vectors=base[rows.start : rows.stop], user_ids=tenant)
            acked.setdefault(str(tenant), []).extend(rows)
    with open(state_path, "w") as f:
        json.dump({"acked": acked, "seq": seq}, f)
    print(f"compose-e2e: {sum(len(v) for v in acked.values())} documents acknowledged (fsync)")
    # Sealed: the recall below is the graph's, not an exact scan of vectors waiting for one.
    client.flush(COLLECTION)

    # recall@10 per tenant against brute force over that tenant's own rows.
    for tenant, (lo, hi) in TENANTS.items():
        rows = base[lo:hi] / np.linalg.norm(base[lo:hi], axis=1, keepdims=True)
        found = total = 0
        for q in queries[:200]:
            truth = set((np.argsort(-(rows @ (q / np.linalg.norm(q))))[:10] + lo).tolist())
            hits = client.search(COLLECTION, q, top_k=10, user_ids=tenant, min_seq_no=seq)
            if any(h.user_id != tenant or not lo <= h.doc_id < hi for h in hits):
                fail(f"tenant {tenant} got another tenant's document")
            found += len(truth & {h.doc_id for h in hits})
            total += 10
        recall = found / total
        print(f"compose-e2e: tenant {tenant} recall@10 {recall:.4f}")
        if recall < 0.95:
            fail(f"recall@10 {recall:.4f} < 0.95 for tenant {tenant}")
    # Isolation: a tenant-1 document's own vector, searched as tenant 2, never returns it.
    for row in (0, 1234, 4999):
        hits = client.search(COLLECTION, base[row], top_k=10, user_ids=2)
        if any(h.doc_id == row or h.user_id != 2 for h in hits):
            fail(f"tenant 2 sees tenant 1's document {row}")
    print("compose-e2e: tenant isolation holds")


def verify(client, base, state_path):
    with open(state_path) as f:
        state = json.load(f)
    checked = 0
    for tenant, rows in state["acked"].items():
        tenant = int(tenant)
        for start in range(0, len(rows), 1000):
            chunk = rows[start : start + 1000]
            docs = {d.doc_id: d for d in client.get(COLLECTION, chunk, user_id=tenant)}
            missing = [r for r in chunk if r not in docs]
            if missing:
                fail(f"{len(missing)} acknowledged documents of tenant {tenant} lost, e.g. {missing[:5]}")
            for r in chunk:
                expected = base[r] / np.linalg.norm(base[r])
                if not np.allclose(docs[r].vector, expected, atol=1e-5):
                    fail(f"document {r} of tenant {tenant} has a different vector")
            checked += len(chunk)
        for r in rows[::250]:
            hits = client.search(COLLECTION, base[r], top_k=1, user_ids=tenant, exact=True)
            if not hits or hits[0].doc_id != r:
                fail(f"exact search for document {r} of tenant {tenant} did not find it")
    info = client.collection(COLLECTION)
    if info.n_documents != checked:
        fail(f"stats say {info.n_documents} documents, {checked} were acknowledged")
    print(f"compose-e2e: all {checked} acknowledged documents present after SIGKILL and restart")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("step", choices=["load", "verify"])
    parser.add_argument("--address", required=True)
    parser.add_argument("--data", required=True, help="a directory with base.fvecs and query.fvecs, or 'generated'")
    parser.add_argument("--state", required=True)
    args = parser.parse_args()
    if args.data == "generated":
        base, queries = generate()
        print("compose-e2e: data: 10,000 generated 384-d vectors (seed 27), exact answers by brute force")
    else:
        base = read_fvecs(f"{args.data}/base.fvecs")[: 2 * N_PER_TENANT]
        queries = read_fvecs(f"{args.data}/query.fvecs")
        print(f"compose-e2e: data: {args.data}")
    with Client(args.address) as client:
        client.wait_ready(timeout=30)
        if args.step == "load":
            load(client, base, queries, args.state)
        else:
            verify(client, base, args.state)


if __name__ == "__main__":
    main()
