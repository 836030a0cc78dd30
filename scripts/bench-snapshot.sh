#!/usr/bin/env bash
# Snapshot and restore of the minilm-debian collection (60,733 x 384) against `tar` of the stopped
# data directory, in one run; and the durable-insert latency of a concurrent load into the same
# collection, with and without a snapshot running (alternating rounds).
#
#   scripts/bench-snapshot.sh [DATA_DIR]       (ROUNDS=3 by default)
#
# Ends with one line:
#   snapshot_s=.. snapshot_mb_s=.. restore_s=.. restore_mb_s=.. tar_s=.. tar_mb_s=.. untar_s=..
#   write_p50_ms=../.. write_p99_ms=../.. (without/with a snapshot running)
# Medians over the rounds. Every file is in the page cache for both tarn and tar (just written).
set -euo pipefail
cd "$(dirname "$0")/.."
data="${1:-${TARN_MINILM_DIR:-../shared/data/minilm-debian}}"
if [[ ! -f "$data/base.fvecs" ]]; then
    echo "bench-snapshot: SKIPPED (no minilm-debian data at $data)"
    exit 0
fi
data="$(cd "$data" && pwd)"
rounds="${ROUNDS:-3}"
cargo build --release --locked -p tarn
source scripts/lib-server.sh
work="$(mktemp -d)"
trap 'stop_tarn; rm -rf "$work"' EXIT
tarn=target/release/tarn
median() { sort -g | awk '{v[NR]=$1} END {print (NR%2) ? v[(NR+1)/2] : (v[NR/2]+v[NR/2+1])/2}'; }

echo "== machine: $(nproc) cores, $(sed -n 's/^model name\s*: //p' /proc/cpuinfo | head -1)"
start_tarn "$work/data"
$tarn collection create minilm --dimension 384 --metric cosine >/dev/null
$tarn insert --collection minilm --fvecs "$data/base.fvecs" --batch 500 --concurrency 8
$tarn flush --collection minilm >/dev/null
# A log tail after the checkpoint, as a live collection has.
$tarn insert --collection minilm --fvecs "$data/query.fvecs" --first-id 1000000 --batch 50 >/dev/null
$tarn collection info minilm | grep -E 'documents|bytes on disk'

: >"$work/snap.txt"; : >"$work/restore.txt"
for r in $(seq 1 "$rounds"); do
    out="$($tarn snapshot create --collection minilm --out "$work/minilm.tsnap")"
    echo "$out"
    echo "$(sed -n 's/.* in \([0-9.]*\) s (.*/\1/p' <<<"$out") $(sed -n 's/.*(\([0-9.]*\) MB\/s).*/\1/p' <<<"$out")" >>"$work/snap.txt"
    out="$($tarn snapshot restore --in "$work/minilm.tsnap" --collection "copy$r")"
    echo "$out"
    echo "$(sed -n 's/.* in \([0-9.]*\) s.*/\1/p' <<<"$out") $(sed -n 's/.*(\([0-9.]*\) MB\/s).*/\1/p' <<<"$out")" >>"$work/restore.txt"
    $tarn collection drop "copy$r" >/dev/null
done
$tarn snapshot verify --in "$work/minilm.tsnap"

# Write latency into the collection being snapshotted: 8 clients, 2,000 durable single-vector
# inserts per run; "with" runs have `tarn snapshot create` looping in the background.
: >"$work/without.txt"; : >"$work/with.txt"
first=2000000
for r in $(seq 1 "$rounds"); do
    for mode in without with; do
        loop_pid=
        if [[ $mode == with ]]; then
            (while true; do $tarn snapshot create --collection minilm --out "$work/bg.tsnap" >/dev/null; done) &
            loop_pid=$!
            sleep 0.3
        fi
        out="$($tarn bench insert --collection minilm --dimension 384 --clients 8 --requests 2000 \
            --first-id "$first" --json)"
        first=$((first + 10000))
        [[ -n $loop_pid ]] && { kill "$loop_pid"; wait "$loop_pid" 2>/dev/null || true; }
        echo "$mode: $out"
        python3 -c 'import json,sys; j=json.loads(sys.argv[1]); print(j["p50_ms"], j["p99_ms"])' "$out" >>"$work/$mode.txt"
    done
done
size="$(stat -c %s "$work/minilm.tsnap")"
stop_tarn

# tar of the stopped data directory (the same files: the collection and its log).
rm -f "$work/data/collections/minilm/"*.partial 2>/dev/null || true
: >"$work/tar.txt"; : >"$work/untar.txt"
for r in $(seq 1 "$rounds"); do
    t0=$(date +%s.%N)
    tar -C "$work" -cf "$work/data.tar" data
    sync -f "$work/data.tar" 2>/dev/null || sync
    t1=$(date +%s.%N)
    rm -rf "$work/untar"; mkdir "$work/untar"
    tar -C "$work/untar" -xf "$work/data.tar"
    sync -f "$work/untar" 2>/dev/null || sync
    t2=$(date +%s.%N)
    echo "$t1 - $t0" | bc >>"$work/tar.txt"
    echo "$t2 - $t1" | bc >>"$work/untar.txt"
done
tar_size="$(stat -c %s "$work/data.tar")"
snap_s="$(cut -d' ' -f1 "$work/snap.txt" | median)"
restore_s="$(cut -d' ' -f1 "$work/restore.txt" | median)"
tar_s="$(median <"$work/tar.txt")"
untar_s="$(median <"$work/untar.txt")"
echo "snapshot file: $size bytes; tar file: $tar_size bytes"
printf 'snapshot_s=%s snapshot_mb_s=%s restore_s=%s restore_mb_s=%s tar_s=%.3f tar_mb_s=%.0f untar_s=%.3f untar_mb_s=%.0f write_p50_ms=%s/%s write_p99_ms=%s/%s\n' \
    "$snap_s" "$(cut -d' ' -f2 "$work/snap.txt" | median)" \
    "$restore_s" "$(cut -d' ' -f2 "$work/restore.txt" | median)" \
    "$tar_s" "$(echo "$tar_size / $tar_s / 1000000" | bc -l)" \
    "$untar_s" "$(echo "$tar_size / $untar_s / 1000000" | bc -l)" \
    "$(cut -d' ' -f1 "$work/without.txt" | median)" "$(cut -d' ' -f1 "$work/with.txt" | median)" \
    "$(cut -d' ' -f2 "$work/without.txt" | median)" "$(cut -d' ' -f2 "$work/with.txt" | median)"
