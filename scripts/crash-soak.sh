#!/usr/bin/env bash
# Soak mode of the crash-under-load test (rs/tarn/tests/crash.rs): N iterations (default 500)
# of load, SIGKILL at a random moment, restart and check, against the real server built with
# optimisations, in chunks of 50 seeds; prints a summary table. CI runs the same test with 20
# iterations (scripts/check.sh). Usage: scripts/crash-soak.sh [ITERATIONS] [FIRST_SEED]
set -euo pipefail
cd "$(dirname "$0")/.."
iterations="${1:-500}"
seed="${2:-1}"
chunk=50
out="$(mktemp)"
trap 'rm -f "$out"' EXIT
echo "| seeds | seconds | acknowledged operations | (tenant, doc) pairs checked | in doubt: applied / absent | lost |"
echo "|---|---|---|---|---|---|"
total_ops=0; total_keys=0; done_iter=0
while (( done_iter < iterations )); do
    n=$(( iterations - done_iter < chunk ? iterations - done_iter : chunk ))
    TARN_CRASH_ITERATIONS="$n" TARN_CRASH_SEED="$seed" \
        cargo test --release --quiet -p tarn --test crash -- --nocapture >"$out" 2>&1 || {
        cat "$out" >&2
        echo "crash-soak: FAILED in seeds $seed..$((seed + n - 1))" >&2
        exit 1
    }
    line="$(grep '^crash: ' "$out")"
    secs="$(sed -n 's/.* in \([0-9.]*\) s;.*/\1/p' <<<"$line")"
    ops="$(sed -n 's/.*; \([0-9]*\) acknowledged operations.*/\1/p' <<<"$line")"
    keys="$(sed -n 's/.*operations, \([0-9]*\) stored.*/\1/p' <<<"$line")"
    doubt="$(sed -n 's/.*applied \([0-9]*\) \/ absent \([0-9]*\).*/\1 \/ \2/p' <<<"$line")"
    echo "| $seed-$((seed + n - 1)) | $secs | $ops | $keys | $doubt | 0 |"
    total_ops=$(( total_ops + ops )); total_keys=$(( total_keys + keys ))
    seed=$(( seed + n )); done_iter=$(( done_iter + n ))
done
echo
echo "crash-soak: $iterations iterations, $total_ops acknowledged operations checked, $total_keys (tenant, doc) pairs checked, 0 lost"

# A short fuzzing run of the decoders (WAL recovery, manifests, WAL payloads) belongs to the soak.
scripts/fuzz.sh "${TARN_FUZZ_SECONDS:-30}"
