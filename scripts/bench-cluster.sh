#!/usr/bin/env bash
# Cluster mode on this machine: etcd and three tarn nodes on loopback (release build, metrics
# off), in one run:
#   1. what forwarding costs: a one-shard collection; durable single-vector inserts (8 clients)
#      and one-client searches sent to its owner, and to another node (which forwards);
#   2. what fanning out costs: the same vectors in an 8-shard DOC collection (every search goes to
#      8 shards on 3 nodes) against the one-shard collection, one client, through the same node;
#   3. what a shard move costs: the one-shard collection's owner is drained while 4 clients
#      insert into it, so its shard moves (snapshot, WAL tail, fence, flip) to another node; its
#      MB/s against a plain copy of the shard's directory (cp -a, then sync: the disk's floor),
#      and the write pause (fence to flip) from the taker's log.
#   4. what replicas cost: durable single-vector inserts (8 clients, FSYNC, through the primary)
#      into one-shard collections of 1, 2 and 3 copies, alternating rounds (p50, p99, requests/s,
#      ratio to 1 copy); searches through all three nodes at once (one client each) of a
#      3-copy collection (each node answers from its own copy) against a 1-copy one (two of the
#      three forward to the owner) — on one machine the copies share its cores, so this measures
#      the hops saved, not added capacity; then the failover time: kill -9 of a 2-copy
#      collection's primary, and single durable writes through another node until one is
#      acknowledged (the lease is the default 5 s). Also: replication lag under the insert load
#      (the primary's status, sampled every 0.2 s); catch-up MB/s of a replica restarted after the
#      whole data set was written while it was down (by log), and of a node restarted with
#      its data directory deleted (snapshot + tail of every copy it held); the write pause of a
#      primary handed over to its replica (a drain under 4 inserting clients).
# Data: ../shared/data/minilm-debian (60,733 x 384) when present, else 20,000 random 128-d rows.
#   scripts/bench-cluster.sh        (ROUNDS=3, alternating; medians; PARTS=replicas: part 4 only)
# Ends with one line:
#   forwarded_insert_rps_ratio=.. forwarded_search_qps_ratio=.. fanout8_search_qps_ratio=..
#   recall_1shard=.. recall_8shards=..  (ratios: forwarded / owner, 8 shards / 1 shard)
#   move_mb_per_s=.. copy_mb_per_s=.. move_ratio=.. move_write_pause_ms=..
#   replicas2_insert_rps_ratio=.. replicas3_insert_rps_ratio=.. spread3_search_qps_ratio=..
#   replicas2_lag_entries_p50=.. replicas3_lag_entries_p50=.. catchup_log_mb_per_s=..
#   catchup_snapshot_mb_per_s=.. handover_write_pause_ms=.. handover_insert_max_ms=..
#   failover_first_write_s=..
set -euo pipefail
cd "$(dirname "$0")/.."
rounds="${ROUNDS:-3}"
parts="${PARTS:-all}" # PARTS=replicas: only part 4
data="${TARN_MINILM_DIR:-../shared/data/minilm-debian}"
cargo build --release --locked -p tarn
tarn="$PWD/target/release/tarn"
source scripts/lib-etcd.sh
ensure_etcd
work="$(mktemp -d)"
pids=()
cleanup() {
    # SIGCONT first: a node left stopped (SIGSTOP) by a failed step would never take the TERM.
    for pid in "${pids[@]}"; do kill -CONT "$pid" 2>/dev/null || true; kill -TERM "$pid" 2>/dev/null || true; done
    # The nodes only: a bare `wait` would also wait for etcd, a child too, which stop_etcd stops.
    for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
    stop_etcd
    rm -rf "$work"
}
trap cleanup EXIT
start_etcd "$work/etcd"
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
addrs=()
for i in 1 2 3; do
    port="$(free_port)"
    RUST_LOG=info "$tarn" serve --data-dir "$work/n$i" --listen "127.0.0.1:$port" --advertise "127.0.0.1:$port" \
        --metrics-listen off --etcd "$ETCD_ENDPOINT" --node-id "n$i" >"$work/n$i.out" 2>"$work/n$i.err" &
    pids+=($!)
    for _ in $(seq 1 200); do grep -q 'gRPC listening' "$work/n$i.out" 2>/dev/null && break; sleep 0.05; done
    addrs+=("127.0.0.1:$port")
done
echo "== machine: $(nproc) cores, $(sed -n 's/^model name\s*: //p' /proc/cpuinfo | head -1); nodes ${addrs[*]}"
if [[ -f "$data/base.fvecs" ]]; then
    base="$data/base.fvecs"; query="$data/query.fvecs"; truth=(--ivecs "$data/groundtruth.ivecs"); dim=384
else
    echo "(no minilm-debian data: 20,000 random 128-d vectors, no recall)"
    python3 - "$work" <<'PY'
import random, struct, sys
rng = random.Random(7)
def write(path, n):
    with open(path, "wb") as f:
        for _ in range(n):
            f.write(struct.pack("<i", 128) + struct.pack("<128f", *[rng.uniform(-1, 1) for _ in range(128)]))
write(sys.argv[1] + "/base.fvecs", 20000)
write(sys.argv[1] + "/query.fvecs", 500)
PY
    base="$work/base.fvecs"; query="$work/query.fvecs"; truth=(); dim=128
fi
A="${addrs[0]}"
median() { sort -g | awk '{v[NR]=$1} END {print (NR%2) ? v[(NR+1)/2] : (v[NR/2]+v[NR/2+1])/2}'; }
json_field() { python3 -c 'import json,sys; print(json.loads(sys.stdin.readline())[sys.argv[1]])' "$1"; }
ratio() { python3 -c 'import sys; print(f"{float(sys.argv[1]) / float(sys.argv[2]):.2f}")' "$1" "$2"; }
owner_of() {
    "$tarn" cluster status --json --addr "$A" | python3 -c '
import json, sys
s = json.load(sys.stdin)
owner = next(x["node_id"] for x in s["shards"] if x["collection"] == sys.argv[1])
print(next(n["address"] for n in s["nodes"] if n["node_id"] == owner))' "$1"
}
other_than() { for a in "${addrs[@]}"; do [[ $a != "$1" ]] && { echo "$a"; return; }; done; }
if [[ $parts == all ]]; then
"$tarn" collection create one --dimension "$dim" --shards 1 --replicas 1 --addr "$A" >/dev/null
"$tarn" collection create eight --dimension "$dim" --shards 8 --shard-key doc --replicas 1 --addr "$A" >/dev/null
"$tarn" collection create ins --dimension 128 --shards 1 --replicas 1 --addr "$A" >/dev/null
one_owner="$(owner_of one)"
ins_owner="$(owner_of ins)"
one_other="$(other_than "$one_owner")"
ins_other="$(other_than "$ins_owner")"
echo "one-shard collection on $one_owner (forwarded through $one_other); inserts on $ins_owner (through $ins_other)"
"$tarn" insert --collection one --fvecs "$base" --batch 500 --concurrency 4 --addr "$one_owner"
"$tarn" insert --collection eight --fvecs "$base" --batch 500 --concurrency 4 --addr "$one_owner"
"$tarn" flush --collection one --addr "$A" >/dev/null
"$tarn" flush --collection eight --addr "$A" >/dev/null

search() { # collection addr -> one JSON line
    "$tarn" bench search --collection "$1" --fvecs "$query" "${truth[@]}" --clients 1 --ef 64 \
        --passes 2 --json --addr "$2"
}
first=1000000
for r in $(seq 1 "$rounds"); do
    for mode in owner forwarded; do
        addr="$ins_owner"; [[ $mode == forwarded ]] && addr="$ins_other"
        out="$("$tarn" bench insert --collection ins --clients 8 --requests 2000 --first-id "$first" --json --addr "$addr")"
        first=$((first + 10000))
        echo "insert $mode: $out"
        json_field requests_per_s <<<"$out" >>"$work/insert_$mode"
        addr="$one_owner"; [[ $mode == forwarded ]] && addr="$one_other"
        out="$(search one "$addr")"
        echo "search one-shard $mode: $out"
        json_field queries_per_s <<<"$out" >>"$work/search_$mode"
        json_field recall <<<"$out" >>"$work/recall_one"
    done
    out="$(search eight "$one_owner")"
    echo "search 8-shard via $one_owner: $out"
    json_field queries_per_s <<<"$out" >>"$work/search_eight"
    json_field recall <<<"$out" >>"$work/recall_eight"
done
ins_o="$(median <"$work/insert_owner")"; ins_f="$(median <"$work/insert_forwarded")"
s_o="$(median <"$work/search_owner")"; s_f="$(median <"$work/search_forwarded")"; s_8="$(median <"$work/search_eight")"
echo "medians: insert owner $ins_o req/s, forwarded $ins_f; search owner $s_o q/s, forwarded $s_f, 8 shards $s_8"
echo "forwarded_insert_rps_ratio=$(ratio "$ins_f" "$ins_o") forwarded_search_qps_ratio=$(ratio "$s_f" "$s_o") fanout8_search_qps_ratio=$(ratio "$s_8" "$s_o") recall_1shard=$(median <"$work/recall_one") recall_8shards=$(median <"$work/recall_eight")"

# 3. A shard move under writes: drain the one-shard collection's owner.
one_owner_id="$("$tarn" cluster status --json --addr "$A" | python3 -c '
import json, sys
print(next(x["node_id"] for x in json.load(sys.stdin)["shards"] if x["collection"] == "one"))')"
"$tarn" bench insert --collection one --dimension "$dim" --clients 4 --requests 4000 --first-id 50000000 --json --addr "$one_other" >"$work/move_inserts.json" &
inserter=$!
"$tarn" cluster drain "$one_owner_id" --no-wait --addr "$one_other"
moved() { sed 's/\x1b\[[0-9;]*m//g' "$work"/n*.err | grep 'shard moved here' | grep 'shard=one\.'; }
for _ in $(seq 1 1200); do
    moved >/dev/null && break
    sleep 0.25
done
wait "$inserter"
echo "inserts during the move: $(cat "$work/move_inserts.json")"
line="$(moved | head -1)"
echo "move: $line"
# The write pause's phases, on both sides (milliseconds from the fence on the taker).
sed 's/\x1b\[[0-9;]*m//g' "$work"/n*.err | grep -E 'hand-over phases|hand-over: fence seen' | grep 'one\.' | sed 's/^/hand-over: /' || true
field() { sed -n "s/.* $1=\([0-9.e+-]*\).*/\1/p" <<<"$line"; }
move_bytes="$(field bytes)"; move_s="$(field seconds)"; pause_s="$(field write_pause_s)"
# The baseline: the disk's floor for the same bytes, a plain copy of the moved shard's directory
# on its new owner (cp -a, then sync), same run.
shard_name="$(sed -n 's/.* shard=\([^ ]*\).*/\1/p' <<<"$line")"
shard_dir="$(ls -d "$work"/n*/collections/"$shard_name" | head -1)"
sync
t0="$(date +%s.%N)"
cp -a "$shard_dir" "$work/copy-of-shard"
sync -f "$work/copy-of-shard"
t1="$(date +%s.%N)"
snap_bytes="$(du -sb "$work/copy-of-shard" | cut -f1)"
python3 - "$move_bytes" "$move_s" "$snap_bytes" "$t0" "$t1" "$pause_s" <<'PY'
import sys
mb, ms, sb, t0, t1, pause = (float(x) for x in sys.argv[1:])
move = mb / ms / 1e6
snap = sb / (t1 - t0) / 1e6
print(f"move: {mb/1e6:.1f} MB in {ms:.2f} s; cp -a of its directory: {sb/1e6:.1f} MB in {t1-t0:.2f} s")
print(f"move_mb_per_s={move:.0f} copy_mb_per_s={snap:.0f} move_ratio={move/snap:.2f} move_write_pause_ms={pause*1000:.1f}")
PY
fi

# 4. Replicas.
# The largest replication lag (entries) of a collection's first shard, from its primary's status.
lag_sample() {
    "$tarn" cluster status --json --addr "$2" 2>/dev/null | python3 -c '
import json, sys
s = json.load(sys.stdin)
lags = [l["entries"] for x in s["shards"] if x["collection"] == sys.argv[1] for l in x["replication_lag"]]
print(max(lags) if lags else "")' "$1" || true
}
# Whether `node` is in the in-sync set of a collection's first shard (asked of `addr`).
in_sync_on() {
    "$tarn" cluster status --json --addr "$3" 2>/dev/null | python3 -c '
import json, sys
s = json.load(sys.stdin)
print(any(sys.argv[2] in x["in_sync"] for x in s["shards"] if x["collection"] == sys.argv[1]))' "$1" "$2" 2>/dev/null || echo False
}
for f in 1 2 3; do
    "$tarn" collection create "rep$f" --dimension 128 --shards 1 --replicas "$f" --addr "$A" >/dev/null
done
"$tarn" collection create spread1 --dimension "$dim" --shards 1 --replicas 1 --addr "$A" >/dev/null
"$tarn" collection create spread3 --dimension "$dim" --shards 1 --replicas 3 --addr "$A" >/dev/null
for c in spread1 spread3; do
    "$tarn" insert --collection "$c" --fvecs "$base" --batch 500 --concurrency 4 --addr "$A" >/dev/null
    "$tarn" flush --collection "$c" --addr "$A" >/dev/null
done
first=70000000
for r in $(seq 1 "$rounds"); do
    for f in 1 2 3; do
        primary="$(owner_of "rep$f")"
        if ((f > 1)); then
            # Replication lag under this load: the primary's status, sampled every 0.2 s.
            (while :; do lag_sample "rep$f" "$primary" >>"$work/rep${f}_lag"; sleep 0.2; done) &
            sampler=$!
        fi
        out="$("$tarn" bench insert --collection "rep$f" --clients 8 --requests 2000 --first-id "$first" --json --addr "$primary")"
        if ((f > 1)); then kill "$sampler"; wait "$sampler" 2>/dev/null || true; fi
        first=$((first + 10000))
        echo "insert, $f copies: $out"
        json_field requests_per_s <<<"$out" >>"$work/rep${f}_rps"
        json_field p50_ms <<<"$out" >>"$work/rep${f}_p50"
        json_field p99_ms <<<"$out" >>"$work/rep${f}_p99"
    done
    for c in spread1 spread3; do
        spids=()
        for a in "${addrs[@]}"; do
            "$tarn" bench search --collection "$c" --fvecs "$query" --clients 1 --ef 64 --passes 2 \
                --json --addr "$a" >"$work/$c-$(tr ':.' '__' <<<"$a").json" &
            spids+=($!)
        done
        for p in "${spids[@]}"; do wait "$p"; done
        total="$(cat "$work"/"$c"-*.json | python3 -c 'import json,sys; print(sum(json.loads(l)["queries_per_s"] for l in sys.stdin if l.strip()))')"
        echo "search $c through 3 nodes at once: $total q/s"
        echo "$total" >>"$work/${c}_qps"
        rm -f "$work"/"$c"-*.json
    done
done
for f in 1 2 3; do
    echo "medians, $f copies: $(median <"$work/rep${f}_rps") req/s, p50 $(median <"$work/rep${f}_p50") ms, p99 $(median <"$work/rep${f}_p99") ms"
done
echo "medians, searches through 3 nodes: 1 copy $(median <"$work/spread1_qps") q/s, 3 copies $(median <"$work/spread3_qps") q/s"
r1="$(median <"$work/rep1_rps")"
rep_line="replicas2_insert_rps_ratio=$(ratio "$(median <"$work/rep2_rps")" "$r1") replicas3_insert_rps_ratio=$(ratio "$(median <"$work/rep3_rps")" "$r1") spread3_search_qps_ratio=$(ratio "$(median <"$work/spread3_qps")" "$(median <"$work/spread1_qps")")"

for f in 2 3; do
    echo "replication lag under the $f-copy load (entries, sampled every 0.2 s): median $(grep . "$work/rep${f}_lag" | median), max $(grep . "$work/rep${f}_lag" | sort -g | tail -1)"
done
lag_line="replicas2_lag_entries_p50=$(grep . "$work/rep2_lag" | median) replicas3_lag_entries_p50=$(grep . "$work/rep3_lag" | median)"

# Catch-up: a 2-copy collection's replica killed (kill -9) while the whole data set is
# inserted, then restarted on its data directory: it catches up by the primary's log, which the
# primary kept for it (a SIGSTOP past the lease would not do: a node whose lease lapsed sets
# its copies aside when it returns). Then the same replica killed, its data directory deleted
# and restarted with the same id: every copy it held is rebuilt from its primaries (snapshot +
# tail); the bytes are its tarn_rereplication_bytes_total.
restart_node() { # index, node id, metrics address
    local port="${addrs[$1]##*:}"
    RUST_LOG=info "$tarn" serve --data-dir "$work/$2" --listen "127.0.0.1:$port" --advertise "127.0.0.1:$port" \
        --metrics-listen "$3" --etcd "$ETCD_ENDPOINT" --node-id "$2" >>"$work/$2.out" 2>>"$work/$2.err" &
    pids[$1]=$!
}
"$tarn" collection create catch --dimension "$dim" --shards 1 --replicas 2 --addr "$A" >/dev/null
catch_primary="$(owner_of catch)"
catch_replica="$("$tarn" cluster status --json --addr "$A" | python3 -c '
import json, sys
s = json.load(sys.stdin)
print(next(x["replicas"][0] for x in s["shards"] if x["collection"] == "catch"))')"
ri="${catch_replica#n}"; ri=$((ri - 1))
# A status node that stays up while the replica is away.
S="$catch_primary"
# A first write while both copies are up (the replica's copy then exists: without it, it would
# be seeded from a snapshot on its return, not follow the log).
"$tarn" insert --collection catch --fvecs "$query" --batch 100 --addr "$catch_primary" >/dev/null
kill -KILL "${pids[$ri]}"
wait "${pids[$ri]}" 2>/dev/null || true
"$tarn" insert --collection catch --fvecs "$base" --batch 500 --concurrency 4 --addr "$catch_primary" >/dev/null
behind="$(lag_sample catch "$catch_primary")"
tail_bytes="$(stat -c %s "$base")"
listening="$(grep -c 'gRPC listening' "$work/$catch_replica.out" || true)"
restart_node "$ri" "$catch_replica" off
# From when it serves (its own recovery of every copy it holds is not the catch-up).
for _ in $(seq 1 3000); do (($(grep -c 'gRPC listening' "$work/$catch_replica.out" || true) > listening)) && break; sleep 0.02; done
t0="$(date +%s.%N)"
for _ in $(seq 1 2400); do [[ "$(in_sync_on catch "$catch_replica" "$catch_primary")" == True ]] && break; sleep 0.05; done
[[ "$(in_sync_on catch "$catch_replica" "$catch_primary")" == True ]] || { echo "the replica did not rejoin within 2 minutes"; exit 1; }
t1="$(date +%s.%N)"
if sed 's/\x1b\[[0-9;]*m//g' "$work"/n*.err | grep 'cannot follow by log.*shard=catch\.'; then
    echo "the replica was seeded from a snapshot, not caught up by log"; exit 1
fi
tail_mb_s="$(python3 -c 'import sys; b, t0, t1 = map(float, sys.argv[1:]); print(f"{b / (t1 - t0) / 1e6:.0f}")' "$tail_bytes" "$t0" "$t1")"
echo "catch-up by log: $behind entries ($((tail_bytes / 1000000)) MB of vectors) in $(python3 -c "print(f'{$t1 - $t0:.2f}')") s from the restarted replica serving to in sync: $tail_mb_s MB/s"
kill -KILL "${pids[$ri]}"
wait "${pids[$ri]}" 2>/dev/null || true
rm -rf "${work:?}/$catch_replica"
mport="$(free_port)"
restart_node "$ri" "$catch_replica" "127.0.0.1:$mport"
# From its first seeded byte (its registration waits out the killed process's lease first).
seeded() { curl -s "http://127.0.0.1:$mport/metrics" 2>/dev/null | awk '/^tarn_rereplication_bytes_total/ {print $2}'; }
for _ in $(seq 1 3000); do [[ "$(seeded)" =~ ^[1-9] ]] && break; sleep 0.02; done
[[ "$(seeded)" =~ ^[1-9] ]] || { echo "the wiped node received no seed within a minute"; exit 1; }
t0="$(date +%s.%N)"
# Every shard it held a copy of: in sync again everywhere (within 2 minutes).
deadline=$((SECONDS + 120))
until ((SECONDS > deadline)) || "$tarn" cluster status --json --addr "$S" 2>/dev/null | python3 -c '
import json, sys
s = json.load(sys.stdin)
n = sys.argv[1]
sys.exit(0 if all(n in x["in_sync"] for x in s["shards"] if n in x["replicas"] or x["node_id"] == n) else 1)' "$catch_replica"; do sleep 0.1; done
((SECONDS <= deadline)) || { echo "the wiped node's copies were not all in sync within 2 minutes"; exit 1; }
t1="$(date +%s.%N)"
seed_bytes="$(seeded)"
seed_mb_s="$(python3 -c 'import sys; b, t0, t1 = map(float, sys.argv[1:]); print(f"{b / (t1 - t0) / 1e6:.0f}")' "$seed_bytes" "$t0" "$t1")"
echo "catch-up by snapshot (wiped data directory, every copy the node held): $((seed_bytes / 1000000)) MB in $(python3 -c "print(f'{$t1 - $t0:.2f}')") s from its first seeded byte to every copy in sync: $seed_mb_s MB/s"
catch_line="catchup_log_mb_per_s=$tail_mb_s catchup_snapshot_mb_per_s=$seed_mb_s"

# The failover: kill -9 of rep2's primary, then one durable write at a time through another
# node until one is acknowledged.
victim="$(owner_of rep2)"
via="$(other_than "$victim")"
for i in "${!addrs[@]}"; do
    if [[ ${addrs[$i]} == "$victim" ]]; then
        kill -KILL "${pids[$i]}"
    fi
done
t0="$(date +%s.%N)"
for n in $(seq 1 600); do
    if "$tarn" bench insert --collection rep2 --clients 1 --requests 1 --first-id $((90000000 + n)) --json --addr "$via" >/dev/null 2>&1; then
        break
    fi
    sleep 0.05
done
t1="$(date +%s.%N)"
failover_s="$(python3 -c 'import sys; print(f"{float(sys.argv[2]) - float(sys.argv[1]):.2f}")' "$t0" "$t1")"
echo "failover: first durable write acknowledged ${failover_s} s after kill -9 of the primary (lease 5 s)"
sed 's/\x1b\[[0-9;]*m//g' "$work"/n*.err | grep 'failover: an in-sync replica' | sed 's/^/failover log: /' || true
# A primary handed over: the primary of a 2-copy collection is drained while 4 clients insert
# durably into it through another node, so its primary moves to its in-sync replica (fence, the
# old primary drains its writes and its replicas' logs, promotion). The write pause from the
# coordinator's log (its fence to its view of the promotion) and the old primary's phases; the
# inserts' p99 and slowest over the drain. Last, on the two nodes the failover left (the other
# collections' moves the drain starts do not disturb the figures above); cancelled after.
"$tarn" collection create hand --dimension 128 --shards 1 --replicas 2 --addr "$via" >/dev/null
"$tarn" bench insert --collection hand --clients 4 --requests 400 --first-id 80000000 --addr "$via" >/dev/null
hand_primary_id="$("$tarn" cluster status --json --addr "$via" | python3 -c '
import json, sys
print(next(x["node_id"] for x in json.load(sys.stdin)["shards"] if x["collection"] == "hand"))')"
hand_primary="$("$tarn" cluster status --json --addr "$via" | python3 -c '
import json, sys
s = json.load(sys.stdin)
print(next(n["address"] for n in s["nodes"] if n["node_id"] == sys.argv[1]))' "$hand_primary_id")"
# The live node that is not the primary (the failover's victim stays down).
for a in "${addrs[@]}"; do [[ $a != "$victim" && $a != "$hand_primary" ]] && hand_via="$a"; done
handed() { sed 's/\x1b\[[0-9;]*m//g' "$work"/n*.err | grep "hand-over: the replica is the shard's primary" | grep 'shard=hand\.'; }
"$tarn" bench insert --collection hand --clients 4 --requests 12000 --first-id 81000000 --json --addr "$hand_via" >"$work/hand_inserts.json" &
inserter=$!
sleep 1
"$tarn" cluster drain "$hand_primary_id" --no-wait --addr "$hand_via" >/dev/null
for _ in $(seq 1 240); do handed >/dev/null && break; sleep 0.25; done
wait "$inserter"
"$tarn" cluster drain "$hand_primary_id" --cancel --addr "$hand_via" >/dev/null
line="$(handed | head -1)"
[[ -n $line ]] || { echo "the hand-over did not land within a minute"; exit 1; }
echo "hand-over: $line"
sed 's/\x1b\[[0-9;]*m//g' "$work"/n*.err | grep 'hand-over: writes drained' | grep 'shard=hand\.' | sed 's/^/hand-over, old primary: /' || true
echo "inserts during the hand-over: $(cat "$work/hand_inserts.json")"
handover_pause_ms="$(sed -n 's/.* write_pause_ms=\([0-9.e+-]*\).*/\1/p' <<<"$line" | xargs printf '%.1f')"
handover_p99_ms="$(json_field p99_ms <"$work/hand_inserts.json")"
handover_max_ms="$(json_field max_ms <"$work/hand_inserts.json" | xargs printf '%.1f')"
echo "hand-over: write pause ${handover_pause_ms} ms (coordinator), inserts p99 ${handover_p99_ms} ms, slowest ${handover_max_ms} ms"
handover_line="handover_write_pause_ms=$handover_pause_ms handover_insert_max_ms=$handover_max_ms"

echo "$rep_line $lag_line $catch_line $handover_line failover_first_write_s=$failover_s"
