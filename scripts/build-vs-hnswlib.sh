#!/usr/bin/env bash
# tarn's index build against hnswlib's on ../shared/data/minilm-debian (60,733 x 384, cosine),
# in one run (issue 18): installs hnswlib 0.8.0 from PyPI into the benchmark virtualenv
# (scripts/lib-venv.sh), builds benches/index_build.rs in release, then alternates passes of
# tarn's builder (in-process: raw vectors -> sealed segment in memory) and of an hnswlib build,
# both on 2 threads with M=16 and ef_construction=200, and ends with the line
#   build_ratio=<tarn s / hnswlib s> load_ratio=<load s / hnswlib s> recall_ef64=<tarn> hnswlib_recall_ef64=<...>
# Times are medians over every build of the run; recalls are recall@10 at ef 64 over the 500
# public queries, medians over builds. load_ratio: after each hnswlib pass, a fresh release
# `tarn serve` and `tarn insert` of all vectors over gRPC (FSYNC) until the collection reports
# nothing unindexed; medians over passes. A last load runs with one client searching throughout:
# its q/s and recall@10 per second go to target/build_vs_hnswlib.curve.json (and the output).
# Usage: scripts/build-vs-hnswlib.sh [DATA_DIR]   (TARN_BUILD_PASSES passes, default 3; each
# tarn pass builds TARN_BUILD_ROUNDS times, default 1; about 2 minutes per pass on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
data="${1:-${TARN_MINILM_DIR:-../shared/data/minilm-debian}}"
if [[ ! -f "$data/base.fvecs" ]]; then
    echo "build-vs-hnswlib: SKIPPED (no minilm-debian data at $data)"
    exit 0
fi
data="$(cd "$data" && pwd)"
source scripts/lib-venv.sh
bench_venv
mkdir -p target
cargo bench -p tarn-benches --bench index_build --no-run
cargo build --release -p tarn
"$BENCH_VENV/bin/pip" install --quiet ./clients/python
rm -rf clients/python/build clients/python/*.egg-info
export TARN_MINILM_DIR="$data"
"$BENCH_PYTHON" scripts/py/build_vs_hnswlib.py --data "$data" --threads 2 \
    --passes "${TARN_BUILD_PASSES:-3}" \
    --tarn-cmd "cargo bench --quiet -p tarn-benches --bench index_build -- --threads 2 --rounds ${TARN_BUILD_ROUNDS:-1} --json {json}" \
    --tarn-bin target/release/tarn --curve-json target/build_vs_hnswlib.curve.json \
    --out-json target/build_vs_hnswlib.json
