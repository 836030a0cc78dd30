"""Issue 29's scale target: N synthetic clustered 384-d vectors loaded over gRPC into one
`tarn serve` with RaBitQ 1-bit codes and the full vectors on disk; resident memory against the
raw vectors, recall@10 against exact truth on a sample, load time and q/s.

The data: `--clusters` centres ~ N(0, 1) in 384 dimensions and each vector = a centre (drawn
uniformly) + noise ~ N(0, (sigma * w_d)^2) in dimension d, cosine metric. The weights
w_d ~ (d + 1)^-decay, scaled so that sum(w_d^2) = 384, give a cluster the same total spread as
isotropic noise of `sigma` but a lower intrinsic dimension (participation ratio 26 at decay 0.5),
as real embeddings have; `--decay 0` is isotropic noise. Why not isotropic by default: in 384
dimensions isotropic noise puts every member of a cluster at almost the same distance from a
query (measured at 500 vectors a cluster, sigma 0.5: the 1st neighbour's cosine 0.833, the
10th 0.822, the 11th 0.821, the 40th 0.814), so recall@10 would measure ties; with decay 0.5
they are 0.883, 0.866, 0.865 and 0.850 (the cluster's mean 0.799). Either way, with 50 or more
vectors a cluster, the exact top 10 come from the query's own cluster (the script reports the
share): other clusters are far (best cosine about 0.25).

Everything is generated from `--seed` in chunks of `--chunk` vectors, each chunk from its own
generator (numpy default_rng([seed, 1, chunk])), so the client holds one chunk at a time: the
load generates them as it sends them, and the exact top 10 of the `--queries` queries (drawn
from the same distribution, their own generator, not from the base set) are computed after the
load by generating the chunks again. Doc ids are 0..N-1, all in tenant 0 (one partition of N
vectors: the hard case for graph builds, merges and the k-means of the codes).

Phases, each timed: the load (`--batch` vectors per Insert, `--threads` client threads, FSYNC,
the collection's default), the wait until every write is applied and nothing is unindexed, then
one Flush (a checkpoint: the mutable segment's last vectors sealed, freed memory returned to
the system). The server's /proc/<pid>/status (VmRSS, RssAnon, RssFile, VmHWM) is read before
the load, after it, once settled and after the searches, and sampled every 0.5 s meanwhile
(the peaks); CollectionInfo gives memory_bytes, cold_bytes and bytes_on_disk.
Searches: each query at every `--efs` value, top 10, one query per call, from 1 client thread
and from 2 (each its own channel, the whole query set `--passes` times); recall@10 of the
1-thread pass, q/s and latency percentiles. A few exact searches (`exact=True`) check the
script's truth against the server's. Prints a table and ends with
  scale_n=.. load_s=.. index_s=.. rss_anon_ratio=.. recall_at_64=.. qps_1=..
(index_s: the wait plus the flush; rss_anon_ratio: settled RssAnon / (N x 384 x 4); qps_1: one
client thread at ef 64). `--quantization`, `--bits`, `--rescore` and `--in-memory` make other
collections of the same data, for comparisons. Called by scripts/quantization-scale.sh.
"""

import argparse
import json
import queue
import resource
import threading
import time
import urllib.request

import numpy as np

from tarn_client import Client

DIM = 384
K = 10
COLLECTION = "scale"


class Data:
    """The seeded clustered vectors, reproducible chunk by chunk."""

    def __init__(self, n, seed, n_clusters, sigma, decay, chunk):
        self.n, self.seed, self.chunk_size = n, seed, chunk
        self.centres = np.random.default_rng([seed, 0]).standard_normal((n_clusters, DIM), dtype=np.float32)
        w = (np.arange(DIM) + 1.0) ** -decay
        w *= np.sqrt(DIM / np.sum(w * w))
        self.scale = (sigma * w).astype(np.float32)
        self.participation_ratio = float(np.sum(w * w) ** 2 / np.sum(w ** 4))

    def _draw(self, rng, m):
        labels = rng.integers(len(self.centres), size=m)
        vectors = rng.standard_normal((m, DIM), dtype=np.float32)
        vectors *= self.scale
        vectors += self.centres[labels]
        return labels, vectors

    def n_chunks(self):
        return (self.n + self.chunk_size - 1) // self.chunk_size

    def chunk(self, i):
        """(first doc id, labels, vectors) of chunk i."""
        start = i * self.chunk_size
        m = min(self.chunk_size, self.n - start)
        labels, vectors = self._draw(np.random.default_rng([self.seed, 1, i]), m)
        return start, labels, vectors

    def queries(self, n):
        return self._draw(np.random.default_rng([self.seed, 2]), n)


def unit(vectors):
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


def proc_status(pid):
    """The memory lines of /proc/<pid>/status, in bytes."""
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM"):
                fields[key] = int(value.split()[0]) * 1024
    return fields


class Sampler(threading.Thread):
    """Reads the server's /proc status every second; keeps the peaks."""

    def __init__(self, pid):
        super().__init__(daemon=True)
        self.pid, self.stop, self.peak = pid, threading.Event(), {}

    def run(self):
        while not self.stop.is_set():
            for key, value in proc_status(self.pid).items():
                self.peak[key] = max(self.peak.get(key, 0), value)
            self.stop.wait(0.5)


def build_counters(metrics):
    """(vectors, seconds) the server's checkpoints spent building graphs, from /metrics."""
    if not metrics:
        return None
    text = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=30).read().decode()
    values = {}
    for line in text.splitlines():
        for name in ("tarn_index_build_vectors_total", "tarn_index_build_seconds_total"):
            if line.startswith(name + "{") and f'collection="{COLLECTION}"' in line:
                values[name] = float(line.rsplit(" ", 1)[1])
    return values.get("tarn_index_build_vectors_total", 0), values.get("tarn_index_build_seconds_total", 0)


def mib(n):
    return f"{n / 2**20:,.0f} MiB"


def load(args, data, pid):
    """Inserts every chunk, `args.batch` vectors per request from `args.threads` threads.
    Returns (seconds, last seq_no)."""
    batches = queue.Queue(maxsize=4 * args.threads)
    errors, seqs = [], []

    def worker():
        client = Client(args.addr, timeout=600, overload_retries=100)
        last = 0
        while True:
            item = batches.get()
            if item is None:
                break
            if errors:
                continue
            start, vectors = item
            try:
                last = max(last, client.insert(COLLECTION, range(start, start + len(vectors)), vectors))
            except Exception as error:  # noqa: BLE001 - reported by the main thread
                errors.append(error)
        seqs.append(last)
        client.close()

    threads = [threading.Thread(target=worker) for _ in range(args.threads)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    next_tenth = 1
    for i in range(data.n_chunks()):
        start, _, vectors = data.chunk(i)
        for at in range(0, len(vectors), args.batch):
            batches.put((start + at, vectors[at:at + args.batch]))
        if errors:
            break
        done = (start + len(vectors)) / data.n
        if done * 10 >= next_tenth:
            elapsed = time.perf_counter() - t0
            status = proc_status(pid)
            print(f"  load {done:4.0%}: {start + len(vectors):,} queued in {elapsed:.0f} s "
                  f"({(start + len(vectors)) / elapsed:,.0f}/s), server RssAnon {mib(status['RssAnon'])}",
                  flush=True)
            next_tenth = int(done * 10) + 1
    for _ in threads:
        batches.put(None)
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - t0, max(seqs)


def wait_indexed(client, last_seq, pid):
    """Waits until every write up to `last_seq` is applied and nothing is unindexed."""
    t0 = time.perf_counter()
    next_report = t0 + 30
    while True:
        info = client.collection(COLLECTION)
        if info.applied_seq_no >= max(last_seq, info.last_seq_no) and info.n_unindexed == 0:
            return time.perf_counter() - t0, info
        if time.perf_counter() >= next_report:
            print(f"  indexing, {time.perf_counter() - t0:.0f} s: {info.n_unindexed:,} unindexed, "
                  f"applied {info.applied_seq_no} of {info.last_seq_no}, checkpoint at "
                  f"{info.checkpoint_seq_no}, server RssAnon {mib(proc_status(pid)['RssAnon'])}",
                  flush=True)
            next_report += 30
        time.sleep(0.25)


def exact_truth(data, queries):
    """Exact top K (cosine) of each query over all N vectors, a chunk at a time. Returns ids,
    similarities and the ids' cluster labels, best first."""
    qn = unit(queries)
    m = len(queries)
    best_sim = np.full((m, K), -np.inf, dtype=np.float32)
    best_id = np.zeros((m, K), dtype=np.int64)
    best_label = np.zeros((m, K), dtype=np.int64)
    for i in range(data.n_chunks()):
        start, labels, vectors = data.chunk(i)
        sims = qn @ unit(vectors).T
        top = np.argpartition(-sims, min(K, sims.shape[1] - 1), axis=1)[:, :K]
        sim = np.concatenate([best_sim, np.take_along_axis(sims, top, 1)], axis=1)
        ids = np.concatenate([best_id, top + start], axis=1)
        labs = np.concatenate([best_label, labels[top]], axis=1)
        order = np.argsort(-sim, axis=1, kind="stable")[:, :K]
        best_sim = np.take_along_axis(sim, order, 1)
        best_id = np.take_along_axis(ids, order, 1)
        best_label = np.take_along_axis(labs, order, 1)
    return best_id, best_sim, best_label


def search_pass(client, queries, ef, hits_out=None):
    """One search per query; returns the latencies (seconds)."""
    latencies = []
    for i, q in enumerate(queries):
        t = time.perf_counter()
        hits = client.search(COLLECTION, q, top_k=K, ef=ef)
        latencies.append(time.perf_counter() - t)
        if hits_out is not None:
            hits_out.append([h.doc_id for h in hits])
    return latencies


def measure_search(args, queries, truth, ef):
    row = {"ef": ef}
    # One thread: a warm-up pass, then `passes` timed ones; recall from the first timed one.
    client = Client(args.addr, timeout=600)
    search_pass(client, queries, ef)
    hits = []
    latencies = search_pass(client, queries, ef, hits)
    for _ in range(args.passes - 1):
        latencies += search_pass(client, queries, ef)
    client.close()
    found = sum(len(set(h) & set(t.tolist())) for h, t in zip(hits, truth))
    row["recall"] = found / (len(queries) * K)
    row["short"] = sum(len(h) < K for h in hits)
    row["qps_1"] = len(latencies) / sum(latencies)
    row["p50_ms"] = float(np.percentile(latencies, 50) * 1e3)
    row["p99_ms"] = float(np.percentile(latencies, 99) * 1e3)
    # Two threads, each its own channel and the whole query set `passes` times.
    clients = [Client(args.addr, timeout=600) for _ in range(2)]
    done = []
    barrier = threading.Barrier(3)

    def run(c):
        barrier.wait()
        lat = []
        for _ in range(args.passes):
            lat += search_pass(c, queries, ef)
        done.append(lat)

    threads = [threading.Thread(target=run, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    row["qps_2"] = sum(len(lat) for lat in done) / (time.perf_counter() - t0)
    for c in clients:
        c.close()
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=2_000_000)
    parser.add_argument("--addr", required=True, help="the server's gRPC address (host:port or unix:/path)")
    parser.add_argument("--pid", type=int, required=True, help="the server's process id")
    parser.add_argument("--seed", type=int, default=29)
    parser.add_argument("--clusters", type=int, default=4000)
    parser.add_argument("--sigma", type=float, default=0.5)
    parser.add_argument("--decay", type=float, default=0.5)
    parser.add_argument("--chunk", type=int, default=10_000)
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--efs", default="64,128")
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--exact-checks", type=int, default=3)
    parser.add_argument("--quantization", default="rabitq", help="for comparisons: none, int8, rabitq")
    parser.add_argument("--bits", type=int, default=1)
    parser.add_argument("--rescore", type=int, default=0, help="0: the server's default")
    parser.add_argument("--in-memory", action="store_true", help="full vectors in memory (not on disk)")
    parser.add_argument("--metrics", help="the server's metrics address (host:port): build counters")
    parser.add_argument("--out-json")
    args = parser.parse_args()
    efs = [int(e) for e in args.efs.split(",")]
    started = time.perf_counter()

    data = Data(args.n, args.seed, args.clusters, args.sigma, args.decay, args.chunk)
    raw = args.n * DIM * 4
    print(f"data: {args.n:,} x {DIM} around {args.clusters:,} centres, sigma {args.sigma}, decay "
          f"{args.decay} (participation ratio {data.participation_ratio:.0f}), seed {args.seed}; "
          f"raw vectors {mib(raw)}", flush=True)

    if args.quantization == "none" and not args.in_memory:
        parser.error("--quantization none keeps the vectors in memory: add --in-memory")
    client = Client(args.addr, timeout=600)
    client.wait_ready()
    created = client.create_collection(
        COLLECTION, dimension=DIM, metric="cosine", quantization=args.quantization,
        bits=args.bits if args.quantization == "rabitq" else 0, rescore=args.rescore,
        vectors_on_disk=not args.in_memory)
    print(f"collection: {created.quantization} ({created.bits} bit), rescore x{created.rescore}, "
          f"vectors on disk: {created.vectors_on_disk}", flush=True)
    memory = {"empty": proc_status(args.pid)}
    sampler = Sampler(args.pid)
    sampler.start()

    load_s, last_seq = load(args, data, args.pid)
    memory["loaded"] = proc_status(args.pid)
    print(f"load: {args.n:,} vectors in {load_s:.1f} s ({args.n / load_s:,.0f} vectors/s), "
          f"last seq_no {last_seq}", flush=True)
    wait_s, info = wait_indexed(client, last_seq, args.pid)
    print(f"indexed {wait_s:.1f} s after the last acknowledgement", flush=True)
    t = time.perf_counter()
    client.flush(COLLECTION)
    flush_s = time.perf_counter() - t
    index_s = wait_s + flush_s
    info = client.collection(COLLECTION)
    assert info.n_documents == args.n and info.n_unindexed == 0, info
    assert info.checkpoint_seq_no >= info.last_seq_no, info
    print(f"flush: {flush_s:.1f} s (checkpoint at seq_no {info.checkpoint_seq_no})", flush=True)
    time.sleep(2)
    sampler.stop.set()
    sampler.join()
    settled = proc_status(args.pid)
    memory["settled"] = settled
    built = build_counters(args.metrics)
    if built:
        print(f"graph builds (checkpoints: sealing and merges): {built[0]:,.0f} vectors in "
              f"{built[1]:.1f} s ({built[0] / max(built[1], 1e-9):,.0f} vectors/s)", flush=True)
    memory["peak_load"] = sampler.peak

    t = time.perf_counter()
    query_labels, queries = data.queries(args.queries)
    truth, truth_sim, truth_labels = exact_truth(data, queries)
    truth_s = time.perf_counter() - t
    same_cluster = float((truth_labels == query_labels[:, None]).mean())
    print(f"exact truth: {truth_s:.1f} s; {same_cluster:.1%} of the true top {K} in the query's "
          f"cluster; cosine of the 1st {truth_sim[:, 0].mean():.4f}, the {K}th "
          f"{truth_sim[:, K - 1].mean():.4f}", flush=True)
    agree = []
    for i in range(min(args.exact_checks, len(queries))):
        hits = client.search(COLLECTION, queries[i], top_k=K, exact=True)
        agree.append(len({h.doc_id for h in hits} & set(truth[i].tolist())) / K)
    if agree:
        print(f"server's exact search against the script's truth ({len(agree)} queries): "
              f"{np.mean(agree):.3f}", flush=True)

    rows = [measure_search(args, queries, truth, ef) for ef in efs]
    memory["after_search"] = proc_status(args.pid)
    client.close()

    ratio = settled["RssAnon"] / raw
    print()
    print("| N | load s | vectors/s | index s (wait + flush) | RssAnon | VmRSS | RssFile | "
          "RssAnon / raw | memory_bytes / N | cold_bytes | bytes on disk |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    print(f"| {args.n:,} | {load_s:.1f} | {args.n / load_s:,.0f} | {index_s:.1f} ({wait_s:.1f} + "
          f"{flush_s:.1f}) | {mib(settled['RssAnon'])} | {mib(settled['VmRSS'])} | "
          f"{mib(settled['RssFile'])} | {ratio:.3f} | {info.memory_bytes / args.n:.0f} B | "
          f"{mib(info.cold_bytes)} | {mib(info.bytes_on_disk)} |")
    print()
    print("| server memory | VmRSS | RssAnon | RssAnon / raw | RssFile | VmHWM |")
    print("|---|---|---|---|---|---|")
    for name, label in (("empty", "before the load (empty collection)"), ("loaded", "at the load's last ack"),
                        ("settled", "indexed and flushed"), ("after_search", "after the searches")):
        m = memory[name]
        print(f"| {label} | {mib(m['VmRSS'])} | {mib(m['RssAnon'])} | {m['RssAnon'] / raw:.3f} | "
              f"{mib(m['RssFile'])} | {mib(m['VmHWM'])} |")
    peak = memory["peak_load"]
    print(f"| peak sampled during load + index (every 0.5 s) | {mib(peak.get('VmRSS', 0))} | "
          f"{mib(peak.get('RssAnon', 0))} | {peak.get('RssAnon', 0) / raw:.3f} | "
          f"{mib(peak.get('RssFile', 0))} | |")
    print(f"(VmHWM, the process's peak resident set, and the sampled peak are the load's: the "
          f"mutable segment's full vectors and the checkpoints' graph builds, which copy them; "
          f"raw vectors {mib(raw)})")
    print()
    print(f"| ef | recall@{K} | short answers | q/s 1 thread | q/s 2 threads | p50 ms | p99 ms |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['ef']} | {r['recall']:.4f} | {r['short']} | {r['qps_1']:,.0f} | {r['qps_2']:,.0f} | "
              f"{r['p50_ms']:.2f} | {r['p99_ms']:.2f} |")
    client_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    total_s = time.perf_counter() - started
    print(f"\nclient peak RSS {mib(client_peak)}; {args.queries} queries, {args.passes} timed passes "
          f"per thread; whole run {total_s:.0f} s")

    by_ef = {r["ef"]: r for r in rows}
    headline = by_ef.get(64, rows[0])
    result = {
        "n": args.n, "dimension": DIM, "clusters": args.clusters, "sigma": args.sigma,
        "decay": args.decay, "seed": args.seed, "batch": args.batch, "threads": args.threads,
        "rescore": created.rescore, "load_s": load_s, "wait_s": wait_s, "flush_s": flush_s,
        "index_s": index_s, "truth_s": truth_s, "raw_bytes": raw, "rss_anon_ratio": ratio,
        "memory": memory, "memory_bytes": info.memory_bytes, "cold_bytes": info.cold_bytes,
        "bytes_on_disk": info.bytes_on_disk, "same_cluster_share": same_cluster,
        "exact_agreement": float(np.mean(agree)) if agree else None, "search": rows,
        "client_peak_rss": client_peak, "total_s": total_s,
        "quantization": created.quantization, "bits": created.bits,
        "vectors_on_disk": created.vectors_on_disk,
        "build_vectors": built[0] if built else None, "build_s": built[1] if built else None,
    }
    if args.out_json:
        with open(args.out_json, "w") as f:
            json.dump(result, f, indent=1)
    print(f"scale_n={args.n} load_s={load_s:.1f} index_s={index_s:.1f} rss_anon_ratio={ratio:.3f} "
          f"recall_at_{headline['ef']}={headline['recall']:.4f} qps_1={headline['qps_1']:.0f}")


if __name__ == "__main__":
    main()
