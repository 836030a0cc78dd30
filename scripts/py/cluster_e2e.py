"""The cluster end to end through Docker (driven by scripts/cluster-compose-e2e.sh): a DOC-sharded
collection with 2 copies per shard over three tarn containers, writes through every node, exact
search through every node equal to brute force, one node SIGKILLed under writes (its shards refuse
UNAVAILABLE naming the shard until a replica is promoted, then every write is taken again: the
failover), after its restart every shard's copies in sync again, and every acknowledged write
present exactly once.

Usage: cluster_e2e.py PHASE ADDR1 ADDR2 ADDR3 STATE_FILE [SECONDS]
       (PHASE: load | writes | verify), or cluster_e2e.py in-sync < `tarn cluster status --json`
"""

import json
import sys
import time

import grpc
import numpy as np

from tarn_client import Client

DIM = 16


def brute_force(ids, vectors, query, k):
    d = np.linalg.norm(vectors - query, axis=1)
    order = np.lexsort((ids, d))[:k]
    return [int(ids[i]) for i in order]


def load(addrs, state_file):
    clients = [Client(a) for a in addrs]
    for c in clients:
        c.wait_ready(timeout=60)
    info = clients[0].create_collection("e2e", dimension=DIM, metric="l2", shards=6, shard_key="doc")
    assert info.replication_factor == 2, info  # the cluster's default
    rng = np.random.default_rng(5)
    ids = np.arange(3000)
    vectors = rng.standard_normal((3000, DIM)).astype(np.float32)
    for i, start in enumerate(range(0, 3000, 250)):
        clients[i % 3].insert("e2e", doc_ids=ids[start:start + 250].tolist(),
                              vectors=vectors[start:start + 250])
    time.sleep(1.0)  # applied (counts and exact search read the applied state)
    for c in clients:
        assert c.collection("e2e").n_documents == 3000, c.collection("e2e")
        for q in range(5):
            query = rng.standard_normal(DIM).astype(np.float32)
            hits = c.search("e2e", query, top_k=5, exact=True)
            assert [h.doc_id for h in hits] == brute_force(ids, vectors, query, 5)
    with open(state_file, "w") as f:
        json.dump({"acked": {str(i): vectors[i].tolist() for i in range(3000)}}, f)
    print("cluster-e2e: 3000 documents through 3 nodes, exact search equal to brute force on each")


# After the kill, a dead primary's shards refuse writes until its lease (5 s) runs out and the
# coordinator promotes a replica (4.9 s measured: docs/BENCHMARKS.md); the writes' last
# FAILED_OVER_WINDOW seconds must all be taken.
FAILED_OVER_WINDOW = 5.0
# What grpcio says when it cannot parse a response message (an in-doubt write, not a refusal).
UNDECODABLE = "Exception deserializing response!"


def writes_during_kill(addrs, state_file, seconds):
    """Single-document writes through n1 and n2 for `seconds` while n3 is being killed (a second
    after they start): refusals only while n3's shards fail over, none in the last
    FAILED_OVER_WINDOW seconds. `STATE_FILE.writing` appears once the first write is
    acknowledged: the script kills n3 only then, so a slow start (imports, first connections)
    cannot push every write past the failover."""
    with open(state_file) as f:
        state = json.load(f)
    clients = [Client(a, timeout=5) for a in addrs[:2]]
    rng = np.random.default_rng(6)
    failures, doc, undecodable = [], 100_000, 0
    start = time.time()
    deadline = start + seconds
    late_writes, late_failures = 0, []
    while time.time() < deadline:
        v = rng.standard_normal(DIM).astype(np.float32)
        late = time.time() > deadline - FAILED_OVER_WINDOW
        try:
            clients[doc % 2].insert("e2e", doc_ids=[doc], vectors=v[None, :])
            state["acked"][str(doc)] = v.tolist()
            if doc == 100_000:
                open(state_file + ".writing", "w").close()
            late_writes += late
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.INTERNAL and e.details() == UNDECODABLE:
                # Not an answer from tarn: grpcio could not parse the response it received (seen
                # once in ~5 runs while n3 was killed, from n1/n2, whose answers are re-encoded
                # by prost; under investigation, issue 31). The write is in doubt, like one whose
                # connection broke: not counted as acknowledged, so the checks below still hold.
                undecodable += 1
                doc += 1
                continue
            failures.append((e.code().name, e.details()))
            if late:
                late_failures.append((round(time.time() - start, 2), e.code().name, e.details()))
        doc += 1
    with open(state_file, "w") as f:
        json.dump(state, f)
    assert undecodable <= 3, f"{undecodable} responses grpcio could not parse"
    codes = {c for c, _ in failures}
    assert codes <= {"UNAVAILABLE", "DEADLINE_EXCEEDED"}, failures[:5]
    named = [d for c, d in failures if c == "UNAVAILABLE"]
    assert named and all("shard" in d and "n3" in d for d in named), (
        f"{doc - 100_000} writes, {len(failures)} refused (expected refusals naming the shard and "
        f"n3 while its shards failed over): {failures[:5]}")
    assert not late_failures, f"writes still refused after the failover: {late_failures[:5]}"
    assert late_writes > 20, f"only {late_writes} writes in the last {FAILED_OVER_WINDOW} s"
    print(f"cluster-e2e: {doc - 100_000} writes while n3 was down, {len(failures)} refused "
          f"(UNAVAILABLE naming the shard and n3) before the failover, {late_writes} taken in "
          f"the last {FAILED_OVER_WINDOW:.0f} s, none refused; {undecodable} in doubt (grpcio "
          f"could not parse the response)")


def all_in_sync(status_json):
    """True when every shard of e2e lists all its copies in sync (`tarn cluster status --json`)."""
    status = json.loads(status_json)
    shards = [s for s in status["shards"] if s["collection"] == "e2e"]
    return len(shards) == 6 and all(
        len(s["in_sync"]) == len(s["replicas"]) + 1 == 2 for s in shards)


def verify(addrs, state_file):
    with open(state_file) as f:
        acked = {int(k): np.asarray(v, dtype=np.float32) for k, v in json.load(f)["acked"].items()}
    c = Client(addrs[1])
    c.wait_ready(timeout=60)
    ids = sorted(acked)
    for start in range(0, len(ids), 1000):
        chunk = ids[start:start + 1000]
        docs = {d.doc_id: d.vector for d in c.get("e2e", chunk)}
        missing = [i for i in chunk if i not in docs]
        assert not missing, f"acknowledged writes lost: {missing[:10]} ({len(missing)})"
        for i in chunk:
            assert np.array_equal(docs[i], acked[i]), i
    for i in ids[-10:]:
        hits = c.search("e2e", acked[i], top_k=3, exact=True)
        assert hits[0].doc_id == i and sum(h.doc_id == i for h in hits) == 1, hits
    print(f"cluster-e2e: all {len(ids)} acknowledged writes back after the restart, none duplicated")


if __name__ == "__main__":
    if sys.argv[1] == "in-sync":
        sys.exit(0 if all_in_sync(sys.stdin.read()) else 1)
    phase, addrs, state_file = sys.argv[1], sys.argv[2:5], sys.argv[5]
    if phase == "load":
        load(addrs, state_file)
    elif phase == "writes":
        writes_during_kill(addrs, state_file, float(sys.argv[6]))
    else:
        verify(addrs, state_file)
