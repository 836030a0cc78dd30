#!/usr/bin/env bash
# The nemesis over many seeds: rs/tarn/tests/cluster/nemesis.rs (a real etcd, three real nodes,
# 2 or 3 copies per shard by the seed, 16 writers and 3 searchers) with faults two at a time:
# kill -9, SIGSTOP, graceful restarts, a node's etcd link cut, the link between two nodes cut,
# a wiped data directory, ForgetNode, drains, a node's fsync slowed while it runs, etcd stopped,
# etcd restored from an earlier backup;
# per seed one node with a slow fsync and one with a late reconciliation. Each seed prints one
# line (`nemesis seed=... result=ok|FAILED`); the last line sums them:
#   nemesis_seeds=N failed=F acked=... lost=0 back=0 duplicates=0 dirty_reads=0 token_misses=0
#   divergent=0 max_unavailable_s=... faults=kill:..,stop:..
# A failed seed's whole log is kept in target/nemesis/seed-<seed>.log, and each node's log (of
# its last process) in target/nemesis/seed-<seed>-n<i>.log (TARN_NEMESIS_RUST_LOG=
# 'warn,tarn_dataplane=debug' logs more); run it again alone with
#   TARN_NEMESIS_SEED=<seed> cargo test -p tarn --all-features --test cluster \
#       processes_nemesis_two -- --ignored --nocapture
#
#   SEEDS=50 scripts/nemesis.sh      (about an hour; FIRST_SEED=1, SECONDS_PER_SEED=60)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib-etcd.sh
if ! ensure_etcd; then
    if [[ ${CI:-} == true ]]; then
        echo "nemesis: FAILED: etcd-server could not be installed" >&2
        exit 1
    fi
    echo "nemesis: SKIPPED: etcd-server could not be installed here"
    exit 0
fi
seeds=${SEEDS:-5}
first=${FIRST_SEED:-1}
seconds=${SECONDS_PER_SEED:-60}
cargo test --locked -p tarn --all-features --test cluster --no-run 2>&1 | tail -1
mkdir -p target/nemesis
results=target/nemesis/results.txt
: >"$results"
for ((seed = first; seed < first + seeds; seed++)); do
    log=target/nemesis/seed-$seed.log
    TARN_NEMESIS_SEED=$seed TARN_NEMESIS_SECONDS=$seconds TARN_NEMESIS_LOG_DIR=$PWD/target/nemesis \
        cargo test --locked -q -p tarn --all-features --test cluster processes_nemesis_two \
        -- --ignored --nocapture --test-threads 1 >"$log" 2>&1 || true
    line=$(grep -E '^nemesis seed=' "$log" | tail -1 || true)
    if [[ -z $line ]]; then
        line="nemesis seed=$seed result=FAILED (no result line: see $log)"
    elif [[ $line == *result=ok* ]]; then
        rm -f "$log"
    fi
    echo "$line" | tee -a "$results"
done
awk -v n="$seeds" '
    function field(name,   i, kv) {
        for (i = 1; i <= NF; i++) { split($i, kv, "="); if (kv[1] == name) return kv[2] }
        return ""
    }
    {
        if ($0 !~ /result=ok/) failed++
        acked += field("acked"); lost += field("lost"); back += field("back")
        dup += field("duplicates"); dirty += field("dirty_reads"); miss += field("token_misses")
        div += field("divergent"); u = field("max_unavailable_s"); if (u + 0 > maxu) maxu = u + 0
        split(field("faults"), kinds, ",")
        for (k in kinds) { split(kinds[k], kn, ":"); if (kn[1] != "") tally[kn[1]] += kn[2] }
    }
    END {
        faults = ""
        for (k in tally) faults = faults (faults == "" ? "" : ",") k ":" tally[k]
        printf "nemesis_seeds=%d failed=%d acked=%d lost=%d back=%d duplicates=%d dirty_reads=%d token_misses=%d divergent=%d max_unavailable_s=%.1f faults=%s\n",
            n, failed, acked, lost, back, dup, dirty, miss, div, maxu, faults
        exit failed > 0
    }' "$results"
