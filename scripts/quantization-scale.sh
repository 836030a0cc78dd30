#!/usr/bin/env bash
# Issue 29's scale target: N synthetic clustered 384-d vectors (default 2,000,000; seeded,
# generated in chunks, never all held by the client) loaded over gRPC into one release
# `tarn serve` as a collection with RaBitQ 1-bit codes (rescore: the server's default) and the
# full vectors on disk, all in tenant 0 (one partition: the hard case). Measures the load
# (1,000 vectors per Insert, 4 client threads, FSYNC), the wait until nothing is unindexed plus
# a flush, the server's resident memory from /proc (RssAnon against the raw N x 384 x 4 bytes:
# the target is <= 0.25; VmRSS, RssFile and the peak VmHWM beside it) and CollectionInfo's
# memory_bytes and cold_bytes, then recall@10 at ef 64 and 128 of 200 queries against exact
# truth the script computes chunk by chunk (target >= 0.95), and q/s from 1 and 2 client
# threads. Builds the server (under flock /tmp/tarn-build.lock), installs numpy and the Python
# client into target/venv-bench, writes target/quantization_scale.json, prints markdown tables
# and ends with the line
#   scale_n=.. load_s=.. index_s=.. rss_anon_ratio=.. recall_at_64=.. qps_1=..
# Usage: scripts/quantization-scale.sh [ARGS]    (2M vectors: most of an hour on 2 cores)
#        TARN_SCALE_N=200000 scripts/quantization-scale.sh   (about 2 minutes: to validate it)
# At 200k (2026-11-26, 2 vCPUs): load 6.8 s, index 104 s, RssAnon 0.168x raw (peak during the
# load 4.1x: the checkpoint copies the mutable segment's vectors to build, then encodes the file
# in memory), recall@10 1.0000 at ef 64 and 128, 772 q/s from one thread. 200k vectors make 50
# per cluster; with 2M's 500 (--clusters 400 at 200k) recall@10 was 0.9695 at ef 64 and 128
# alike (the rescoring depth limits it: 0.9975 with --rescore 12).
# The data directory is a temporary directory under ${TMPDIR:-/tmp} (2.3x the raw vectors
# settled, the last WAL segments included; more during the load), removed at the end. ARGS go to
# scripts/py/quantization_scale.py: --decay 0 (isotropic clusters), --clusters, --threads,
# --batch, --passes, or another collection of the same data for comparisons (--quantization
# none --in-memory, --rescore R).
set -euo pipefail
cd "$(dirname "$0")/.."
n="${TARN_SCALE_N:-2000000}"
flock /tmp/tarn-build.lock cargo build --release -p tarn
source scripts/lib-venv.sh
bench_venv
"$BENCH_VENV/bin/pip" install --quiet ./clients/python
rm -rf clients/python/build clients/python/*.egg-info
mkdir -p target

source scripts/lib-server.sh
work="$(mktemp -d "${TMPDIR:-/tmp}/tarn-scale.XXXXXX")"
trap 'stop_tarn; rm -rf "$work"' EXIT
start_tarn "$work/data"
echo "tarn serve: pid $TARN_PID on $TARN_ADDR, data in $work/data"
"$BENCH_PYTHON" scripts/py/quantization_scale.py --n "$n" --addr "${TARN_ADDR#http://}" \
    --pid "$TARN_PID" --metrics "$TARN_METRICS" --out-json target/quantization_scale.json "$@"
