#!/usr/bin/env bash
# tarn's sealed-segment search against hnswlib on ../shared/data/minilm-debian, in one run:
# installs hnswlib, numpy and matplotlib from PyPI into a virtualenv (target/venv-bench), runs
# benches/search_speed.rs (tarn, in-process, one thread, one query per call), then hnswlib at the
# same ef values, renders docs/img/search-recall-qps.png, and ends with the line
#   ratio_at_0.98=<tarn q/s / hnswlib q/s> ratio_at_0.99=<...> bytes_per_vector=<...>
# Usage: scripts/search-vs-hnswlib.sh [DATA_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
data="${1:-${TARN_MINILM_DIR:-../shared/data/minilm-debian}}"
if [[ ! -f "$data/base.fvecs" ]]; then
    echo "search-vs-hnswlib: SKIPPED (no minilm-debian data at $data)"
    exit 0
fi
data="$(cd "$data" && pwd)"
source scripts/lib-venv.sh
bench_venv
mkdir -p target docs/img
cargo bench -p tarn-benches --bench search_speed --no-run
export TARN_MINILM_DIR="$data"

# The same curve through gRPC: a real server on loopback, one client (`tarn search`, one query
# per request), after all vectors are inserted and sealed by `tarn flush`.
cargo build --release -p tarn
source scripts/lib-server.sh
work="$(mktemp -d)"
trap 'stop_tarn; rm -rf "$work"' EXIT
start_tarn "$work/data"
tarn=target/release/tarn
$tarn collection create minilm --dimension 384 --metric cosine >/dev/null
$tarn insert --collection minilm --fvecs "$data/base.fvecs" --batch 500 --concurrency 8
$tarn flush --collection minilm >/dev/null
echo '[' >"$work/grpc.json"
sep=
for ef in 10 16 24 32 48 64 96 128 192 256; do
    out="$($tarn search --collection minilm --fvecs "$data/query.fvecs" --ivecs "$data/groundtruth.ivecs" --top-k 10 --ef "$ef")"
    qps="$(sed -n 's/.*: \([0-9.]*\) q\/s;.*/\1/p' <<<"$out")"
    rec="$(sed -n 's/^recall@10: //p' <<<"$out")"
    echo "$sep{\"ef\": $ef, \"recall\": $rec, \"qps\": $qps}" >>"$work/grpc.json"
    sep=,
done
echo ']' >>"$work/grpc.json"
stop_tarn
cp "$work/grpc.json" target/search_grpc.json
"$BENCH_PYTHON" scripts/py/search_vs_hnswlib.py --data "$data" --passes "${TARN_BENCH_PASSES:-3}" \
    --tarn-cmd "cargo bench --quiet -p tarn-benches --bench search_speed -- --json {json}" \
    --grpc-json target/search_grpc.json --png docs/img/search-recall-qps.png \
    --out-json target/search_vs_hnswlib.json
