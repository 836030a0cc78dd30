#!/usr/bin/env bash
# tarn's quantized sealed search (int8 and RaBitQ 1 and 4 bits, each in memory and with vectors
# on disk, warm and cold) against faiss-cpu's IndexHNSWSQ (int8, with and without an exact
# refine step), faiss's IVF-RaBitQ with a refine step, and hnswlib f32 on
# ../shared/data/minilm-debian, in one run: installs hnswlib, numpy and faiss-cpu from PyPI into
# a virtualenv (target/venv-bench), runs benches/quantized_search.rs (tarn's configurations on
# the same graph, in-process, one thread, one query per call; the cold passes drop the segment
# file from the page cache first, and the disk's random-read floor is measured beside them),
# then the peers, and ends with the line
#   int8_recall=.. int8_bytes=.. int8_qps_ratio=.. rabitq1_recall=.. rabitq1_bytes=.. rabitq1_qps_ratio=..
# (tarn with vectors on disk, warm, at ef 64: recall@10, resident bytes per vector, q/s over
# tarn f32's). TARN_RESCORES, TARN_RABITQ_BITS and TARN_RABITQ_RESCORES sweep tarn's settings
# (defaults: int8 x3, RaBitQ bits 1 and 4 at tarn's default rescoring).
# Not covered here: the 2M-vector load (scripts/quantization-scale.sh).
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
    --tarn-cmd "TARN_RESCORES=${TARN_RESCORES:-3} cargo bench --quiet -p tarn-benches --bench quantized_search -- --json {json}" \
    --tarn-json "$PWD/target/quantized_search.json" --out-json target/quantization_vs_peers.json \
    --png "${TARN_QUANT_PNG:-docs/img/quantization.png}"
