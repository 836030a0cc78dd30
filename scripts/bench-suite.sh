#!/usr/bin/env bash
# The performance suite against real peers, in one run on one machine (issue 8):
#   1. PostgreSQL 15 (Debian package, installed if missing) as a throwaway cluster with fsync on
#      and synchronous_commit on: pgbench inserts of one 128-float row per transaction from 1, 8,
#      64 and 256 connections;
#   2. a release `tarn serve` on loopback, driven by `tarn bench`: durable single-vector inserts
#      from 1, 8, 64 and 256 clients and batched inserts (100 vectors per request), both
#      durability modes; resident memory per stored vector; insert-to-searchable latency at
#      1,000 inserts/s; search on minilm-debian at 1 and 16 clients, ef 32-256 and exact;
#      then inserts (1 and 64 clients, against pgbench on PostgreSQL's socket) and one-client
#      search again over Unix sockets;
#   3. time to reopen after 100k and 1M WAL entries (benches/reopen.rs, in-process);
#   4. hnswlib from PyPI against tarn in-process and through gRPC (scripts/search-vs-hnswlib.sh);
#   5. the WalInsertion strategies (scripts/bench-wal.sh, criterion), for context (BENCH_SUITE_WAL=0
#      skips them).
# Results: target/bench-suite/results.jsonl; the tables (markdown) and charts
# (docs/img/insert-throughput.png, docs/img/search-recall-qps.png) are rendered by
# scripts/py/bench_suite_report.py, which ends with the target ratios.
# Usage: scripts/bench-suite.sh   (about 15 minutes on 2 cores; run it on a quiet machine)
set -euo pipefail
cd "$(dirname "$0")/.."
out=target/bench-suite
rm -rf "$out"
mkdir -p "$out" docs/img
results="$out/results.jsonl"
: >"$results"
data="${TARN_MINILM_DIR:-../shared/data/minilm-debian}"
clients="1,8,64,256"

source scripts/lib-venv.sh
bench_venv
cargo build --release -p tarn
cargo bench -p tarn-benches --bench reopen --no-run

# The guest's idle polling decides what a wake-up of an idle vCPU costs, and with it the
# one-client figures (docs/benchmarks/history-of-runs.md, "What decides the one-client figures on
# this VM"): recorded with the machine.
halt_poll_ns() { cat /sys/module/haltpoll/parameters/guest_halt_poll_ns 2>/dev/null || echo null; }
machine() {
    echo "{\"bench\":\"machine\",\"cpus\":$(nproc),\"cpu\":\"$(sed -n 's/^model name\s*: //p' /proc/cpuinfo | head -1)\",\"kernel\":\"$(uname -r)\",\"guest_halt_poll_ns\":$(halt_poll_ns),\"date\":\"$(date -u +%FT%TZ)\",\"commit\":\"$(git rev-parse --short HEAD)\"}" >>"$results"
}
machine

# ---------------------------------------------------------------- 1. PostgreSQL
source scripts/lib-pg.sh
pg_start "$(pwd)/$out/pg"
pg_dir=$PG_DIR
trap 'pg_stop' EXIT
psql_ -c "SHOW fsync; SHOW synchronous_commit; SHOW wal_sync_method;" -t | tr -s ' \n' ' ' | sed 's/^/postgres settings: /'
echo
pg_insert_table

# ---------------------------------------------------------------- 2. tarn over gRPC
source scripts/lib-server.sh
work="$(pwd)/$out/tarn"
trap 'stop_tarn; pg_stop' EXIT
start_tarn "$work/data"
tarn=target/release/tarn
bench() { $tarn bench "$@" --json | tee -a "$results"; }
# Single-vector durable inserts, 1,000 timed requests per client count, alternating PostgreSQL
# and tarn run by run, three rounds (the disk's fsync latency drifts; the report takes medians).
# A pause after each tarn run lets its indexer finish the vectors just written.
# pg_run CLIENTS [unix]: with "unix", pgbench connects through PostgreSQL's Unix socket.
pg_run() {
    local c=$1 transport=${2:-tcp} host=()
    [[ $transport == unix ]] && host=(-h "$pg_dir")
    rm -f "$pg_dir"/pgbench_log.*
    pg_insert_run "$c" 1000 -l --log-prefix=pgbench_log "${host[@]}" >/dev/null
    python3 - "$c" "$pg_dir" "$transport" >>"$results" <<'EOF'
import glob, json, re, sys
c, d, transport = int(sys.argv[1]), sys.argv[2], sys.argv[3]
text = open(f"{d}/pgbench.out").read()
tps = float(re.search(r"tps = ([0-9.]+) \(without initial connection time\)", text).group(1))
lat = []
for path in glob.glob(f"{d}/pgbench_log*"):
    for line in open(path):
        lat.append(int(line.split()[2]) / 1000.0)  # microseconds -> ms
lat.sort()
at = lambda p: lat[min(len(lat) - 1, round((len(lat) - 1) * p))]
print(json.dumps({"bench": "pg_insert", "transport": transport, "clients": c, "batch": 1, "requests": len(lat),
                  "requests_per_s": tps, "seconds": len(lat) / tps,
                  "p50_ms": at(0.5), "p99_ms": at(0.99)}))
EOF
    tail -1 "$results"
}

for round in 1 2 3; do
    for c in ${clients//,/ }; do
        pg_run "$c"
        sleep 1
        bench insert --collection "single$round" --clients "$c" --requests 1000 --durability fsync \
            --first-id $((c * 100000))
        sleep 3
    done
done
bench insert --collection single1 --clients "$clients" --requests 1000 --durability written --first-id 10000000
bench insert --collection batched --clients 1,8,64 --batch 100 --requests 100 --durability fsync --first-id 0
bench insert --collection batched --clients 1,8,64 --batch 100 --requests 100 --durability written --first-id 100000000

for round in 1 2 3; do $tarn flush --collection "single$round" >/dev/null; done
$tarn flush --collection batched >/dev/null

# Resident memory per stored vector: a server of its own (no memory freed by earlier work to
# reuse), about 50,000 128-d vectors, sealed by a flush; RSS against the empty server's.
main_pid=$TARN_PID main_addr=$TARN_ADDR
start_tarn "$work/memory"
rss() { awk '/VmRSS/ {print $2 * 1024}' "/proc/$TARN_PID/status"; }
before=$(rss)
$tarn bench insert --collection memory --clients 8 --batch 500 --requests 100 --durability written >/dev/null
$tarn flush --collection memory >/dev/null
sleep 1
sealed=$(rss)
docs=$($tarn collection info memory | sed -n 's/^documents: *\([0-9]*\).*/\1/p')
echo "{\"bench\":\"memory\",\"vectors\":$docs,\"dimension\":128,\"rss_before\":$before,\"rss_sealed\":$sealed}" | tee -a "$results"
stop_tarn
TARN_PID=$main_pid TARN_ADDR=$main_addr
export TARN_ADDR

# Insert-to-searchable at 1,000 inserts/s, on a collection that already holds 20,000 vectors.
$tarn bench insert --collection fresh --clients 8 --batch 500 --requests 40 --durability written >/dev/null
$tarn flush --collection fresh >/dev/null
bench freshness --collection fresh --rate 1000 --seconds 15 --sample-every 10

# Search on minilm-debian: all 60,733 vectors inserted and sealed, then 1 and 16 clients.
if [[ -f "$data/base.fvecs" ]]; then
    $tarn collection create minilm --dimension 384 --metric cosine >/dev/null
    $tarn insert --collection minilm --fvecs "$data/base.fvecs" --batch 500 --concurrency 8
    $tarn flush --collection minilm >/dev/null
    # One invocation per client count: with one client `tarn bench` runs on one thread (see
    # rs/tarn/src/main.rs), as pgbench does.
    for c in 1 16; do
        bench search --collection minilm --fvecs "$data/query.fvecs" --ivecs "$data/groundtruth.ivecs" \
            --clients "$c" --ef 16,24,32,64,128,256 --exact --passes 4
    done
else
    echo "bench-suite: search SKIPPED (no minilm-debian data at $data)"
fi

# ---------------------------------------------------------------- 2b. over Unix sockets
# The same server restarted on a Unix socket, PostgreSQL reached through its own: on this VM a
# loopback TCP round trip costs tens of microseconds more (the Docker engine's netfilter rules
# see every packet), for both. Inserts from 1 and 64 clients, alternating, three rounds; then
# one-client search.
stop_tarn
TARN_SOCKET="$work/tarn.sock" start_tarn "$work/data"
unix_bench() { $tarn bench "$@" --json | sed 's/^{/{"transport":"unix",/' | tee -a "$results"; }
for round in 1 2 3; do
    for c in 1 64; do
        pg_run "$c" unix
        sleep 1
        unix_bench insert --collection "unix$round" --clients "$c" --requests 1000 \
            --durability fsync --first-id $((c * 100000))
        sleep 3
    done
done
pg_stop
if [[ -f "$data/base.fvecs" ]]; then
    unix_bench search --collection minilm --fvecs "$data/query.fvecs" \
        --ivecs "$data/groundtruth.ivecs" --clients 1 --ef 16,24,32,64,128,256 --passes 4
fi
stop_tarn
trap - EXIT

# ---------------------------------------------------------------- 3. reopen
cargo bench --quiet -p tarn-benches --bench reopen -- --json | grep '^{' | tee -a "$results"

# ---------------------------------------------------------------- 4. hnswlib, 5. WAL strategies
if [[ -f "$data/base.fvecs" ]]; then
    scripts/search-vs-hnswlib.sh "$data" | tee "$out/search-vs-hnswlib.out"
    cp target/search_vs_hnswlib.json "$out/"
fi
if [[ "${BENCH_SUITE_WAL:-1}" == 1 ]]; then
    scripts/bench-wal.sh | tee "$out/bench-wal.out"
fi

"$BENCH_PYTHON" scripts/py/bench_suite_report.py --results "$results" \
    --hnswlib "$out/search_vs_hnswlib.json" --png docs/img/insert-throughput.png | tee "$out/report.md"
