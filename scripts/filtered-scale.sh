#!/usr/bin/env bash
# Issue 28's filtered-search scale target, in one run: N synthetic clustered 128-d vectors (L2;
# default 1,000,000, TARN_FILTERED_SCALE_N overrides) with Zipf-distributed tags in one KEYWORDS
# field, some tags correlated with the clusters and some not; filters picked from the data
# (uncorrelated tags at about 5%, 1% and 0.1%, correlated tags at about 5% and 1%, two tags
# ANDed, none), 300 queries near the clusters, exact filtered top 10 by numpy.
# tarn in-process (benches/filtered_search.rs on the generated files: the collection engine
# loaded in batches of 1,000 with attributes, flushed, indexed by tarn's parallel builder, then
# filtered search at ef 16 to 256, the exact scan of the matches, post-filtering; one query per
# call on one thread) against faiss-cpu IndexHNSWFlat (M=16, efConstruction=200, built on 2
# threads, searched on one thread with SearchParametersHNSW(sel=IDSelectorBitmap, efSearch) at
# 16 to 512). Builds the bench under flock /tmp/tarn-build.lock, then runs its binary directly
# (no cargo, so no lock held while it measures); installs numpy and faiss-cpu into
# target/venv-bench. Generated data and faiss's index are cached in
# target/filtered-scale/n<N>-seed<S>/ (reruns skip both: delete the directory to redo them).
# Prints the load's and each phase's times, a table per filter, writes
# target/filtered_scale.json, and ends with the line
#   scale_n=.. recall_uncorr_1pct=.. recall_uncorr_5pct=.. min_recall=.. short=..
#   worst_ratio_vs_faiss=.. faiss_below_tarn=..
# (one line; scripts/py/filtered_scale.py says what each figure is).
# Usage: scripts/filtered-scale.sh [ARGS]   (ARGS go to scripts/py/filtered_scale.py: --seed,
#        --clusters, --queries, --zipf, --locality, --tarn-efs, ...)
#        TARN_FILTERED_SCALE_N=100000 scripts/filtered-scale.sh   (a quick run)
# How long, on 2 shared cores (2026-11-26), besides the first build of the bench: see
# "Time" below.
set -euo pipefail
cd "$(dirname "$0")/.."
n="${TARN_FILTERED_SCALE_N:-1000000}"
source scripts/lib-venv.sh
bench_venv
"$BENCH_PYTHON" -m pip install --quiet 'faiss-cpu<2'
mkdir -p target
bench="$(flock /tmp/tarn-build.lock cargo bench -p tarn-benches --bench filtered_search --no-run \
    --message-format=json | sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -n 1)"
[[ -x "$bench" ]] || { echo "filtered-scale: no filtered_search bench binary" >&2; exit 1; }

work="$(mktemp -d "${TMPDIR:-/tmp}/tarn-filtered-scale.XXXXXX")"
trap 'rm -rf "$work"' EXIT
# The bench's collection lives in a temporary directory of its own (about 2x the raw vectors).
"$BENCH_PYTHON" scripts/py/filtered_scale.py --n "$n" --work "$work" \
    --tarn-cmd "$bench --fvecs {fvecs} --queries {queries} --dimension {dim} --metric l2 --fields tags:keywords --attributes {attributes} --filters {filters} --efs {efs} --json {json} --load-json {load_json}" \
    --out-json target/filtered_scale.json "$@"
