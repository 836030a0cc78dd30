#!/usr/bin/env bash
# tarn's int8 quantized sealed search against faiss-cpu's IndexHNSWSQ (int8, with and without an
# exact refine step) and hnswlib f32 on ../shared/data/minilm-debian, in one run: installs
# hnswlib, numpy and faiss-cpu from PyPI into a virtualenv (target/venv-bench), runs
# benches/quantized_search.rs (tarn f32 and int8 on the same graph, in-process, one thread, one
# query per call), then the peers at the same ef values, and ends with the line
#   int8_recall=<..> int8_bytes=<..> int8_qps_ratio=<..>
# Not covered yet (issue 29): vectors on disk, RaBitQ, the cold-cache passes, the 2M-vector load.
# Usage: scripts/quantization-vs-peers.sh [DATA_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
data="${1:-${TARN_MINILM_DIR:-../shared/data/minilm-debian}}"
if [[ ! -f "$data/base.fvecs" ]]; then
    echo "quantization-vs-peers: SKIPPED (no minilm-debian data at $data)"
    exit 0
fi
data="$(cd "$data" && pwd)"
source scripts/lib-venv.sh
bench_venv
"$BENCH_PYTHON" -m pip install --quiet 'faiss-cpu<2'
mkdir -p target
cargo bench -p tarn-benches --bench quantized_search --no-run
export TARN_MINILM_DIR="$data"
"$BENCH_PYTHON" scripts/py/quantization_vs_peers.py --data "$data" \
    --passes "${TARN_BENCH_PASSES:-5}" \
    --tarn-cmd "TARN_RESCORES=${TARN_RESCORES:-1,2,3,4} cargo bench --quiet -p tarn-benches --bench quantized_search -- --json {json}" \
    --tarn-json "$PWD/target/quantized_search.json" --out-json target/quantization_vs_peers.json
