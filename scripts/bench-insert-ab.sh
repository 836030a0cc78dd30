#!/usr/bin/env bash
# Durable single-vector inserts, PostgreSQL 15 against two tarn binaries, in one run: the quick
# check of whether a change to the write path pays, with PostgreSQL as the yardstick (the full
# suite is scripts/bench-suite.sh). Each round runs pgbench, then `tarn bench insert` against
# binary A's server, then against binary B's (both servers up side by side, empty, on loopback),
# for each client count; 1,000 requests per run. Prints one line per run, then the medians.
# Usage: scripts/bench-insert-ab.sh A_BINARY B_BINARY
#   env: ROUNDS (4), CLIENTS ("1 64"), DURABILITY (fsync), PAUSE (4 s after each tarn run, so
#   its indexer is done before the next run), CLIENT (b: binary B's `tarn bench` drives both
#   servers, so only the server differs; own: each side's own, to compare client changes too)
# Build A from an older commit with, e.g.:
#   git worktree add /tmp/old <commit> && (cd /tmp/old && cargo build --release -p tarn)
#   (commits before the crate split name the package tarn-server: -p tarn-server)
set -euo pipefail
cd "$(dirname "$0")/.."
a_bin="${1:?usage: $0 A_BINARY B_BINARY}"
b_bin="${2:?usage: $0 A_BINARY B_BINARY}"
out=target/bench-insert-ab
rm -rf "$out"
mkdir -p "$out"
source scripts/lib-pg.sh
pg_start "$(pwd)/$out/pg"
trap 'kill $a_pid $b_pid 2>/dev/null || true; pg_stop' EXIT
pg_insert_table

serve() {
    local bin=$1 dir=$2
    mkdir -p "$dir"
    "$bin" serve --data-dir "$dir/data" --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 \
        >"$dir/serve.out" 2>"$dir/serve.err" &
    local i
    for i in $(seq 200); do
        grep -q '^tarn: gRPC listening on ' "$dir/serve.out" 2>/dev/null && return 0
        sleep 0.05
    done
    echo "bench-insert-ab: $bin did not start" >&2
    cat "$dir/serve.err" >&2
    return 1
}
addr_of() { echo "http://$(sed -n 's/^tarn: gRPC listening on //p' "$1/serve.out")"; }
serve "$a_bin" "$out/a"
a_pid=$!
serve "$b_bin" "$out/b"
b_pid=$!
a_addr=$(addr_of "$out/a")
b_addr=$(addr_of "$out/b")

results="$out/results.txt"
: >"$results"
id=0
for round in $(seq "${ROUNDS:-4}"); do
    for c in ${CLIENTS:-1 64}; do
        echo "pg c=$c rps=$(pg_insert_run "$c" 1000)" | tee -a "$results"
        sleep 1
        for side in a b; do
            id=$((id + 100000))
            addr=${side}_addr
            client_bin=$b_bin
            [[ ${CLIENT:-b} == own && $side == a ]] && client_bin=$a_bin
            "$client_bin" bench insert --addr "${!addr}" --collection ab --clients "$c" --requests 1000 \
                --durability "${DURABILITY:-fsync}" --first-id "$id" --json |
                python3 -c "import sys, json; d = json.load(sys.stdin); print('$side c=$c rps=%.0f p50=%.3f p99=%.3f' % (d['requests_per_s'], d['p50_ms'], d['p99_ms']))" |
                tee -a "$results"
            sleep "${PAUSE:-4}"
        done
    done
done
python3 - "$results" <<'EOF'
import re, statistics, sys
runs = {}
for line in open(sys.argv[1]):
    side, c, rps = re.match(r"(\w+) c=(\d+) rps=([0-9.]+)", line).groups()
    runs.setdefault((int(c), side), []).append(float(rps))
for c in sorted({c for c, _ in runs}):
    pg, a, b = (statistics.median(runs[(c, s)]) for s in ("pg", "a", "b"))
    print(f"clients={c}: median req/s PostgreSQL {pg:.0f}, A {a:.0f} ({a / pg:.2f}x), B {b:.0f} ({b / pg:.2f}x); B/A {b / a:.2f}")
EOF
