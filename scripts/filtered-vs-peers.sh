#!/usr/bin/env bash
# Filtered search on ../shared/data/minilm-debian (60,733 x 384 with each row's Debian
# attributes), in one run: tarn in-process (benches/filtered_search.rs: filtered search at ef 32,
# 64 and 128, the exact scan of the matches, post-filtering), tarn over gRPC (a release server
# loaded by `tarn insert --attributes`, the Python client, one query per call), hnswlib 0.8.0 with
# its filter callback and faiss-cpu HNSW with an IDSelectorBitmap (M=16, ef_construction=200, one
# thread). Exact filtered ground truth is computed by the script. Installs hnswlib, faiss-cpu,
# numpy, matplotlib and the Python client from PyPI into target/venv-bench. Renders
# docs/img/filtered-qps.png and ends with the line
#   filtered_min_recall=.. short=.. worst_ratio_vs_best_peer=.. ratio_vs_postfilter_1pct=..
# Usage: scripts/filtered-vs-peers.sh [DATA_DIR]   (about 10 minutes on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
data="${1:-${TARN_MINILM_DIR:-../shared/data/minilm-debian}}"
if [[ ! -f "$data/base_metadata.jsonl.gz" ]]; then
    echo "filtered-vs-peers: SKIPPED (no minilm-debian data with attributes at $data)"
    exit 0
fi
data="$(cd "$data" && pwd)"
source scripts/lib-venv.sh
bench_venv
"$BENCH_PYTHON" -m pip install --quiet 'faiss-cpu<2' ./clients/python
rm -rf clients/python/build clients/python/*.egg-info
mkdir -p target docs/img
cargo bench -p tarn-benches --bench filtered_search --no-run
cargo build --release -p tarn
export TARN_MINILM_DIR="$data"

source scripts/lib-server.sh
work="$(mktemp -d)"
trap 'stop_tarn; rm -rf "$work"' EXIT
start_tarn "$work/data"
tarn=target/release/tarn
$tarn collection create minilm --dimension 384 --metric cosine \
    --field section:keyword --field tags:keywords --field installed_size_kb:number \
    --field architecture:keyword --field priority:keyword >/dev/null
$tarn insert --collection minilm --fvecs "$data/base.fvecs" --attributes "$data/base_metadata.jsonl.gz" \
    --batch 500 --concurrency 8
$tarn flush --collection minilm >/dev/null

"$BENCH_PYTHON" scripts/py/filtered_vs_peers.py --data "$data" --work "$work" \
    --tarn-cmd "cargo bench --quiet -p tarn-benches --bench filtered_search -- --filters {filters} --attributes {attributes} --json {json}" \
    --grpc "${TARN_ADDR#http://}" --collection minilm \
    --png docs/img/filtered-qps.png --out-json target/filtered_vs_peers.json
