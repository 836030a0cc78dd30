#!/usr/bin/env bash
# Cluster mode end to end against real processes: a real etcd (Debian's etcd-server, installed
# when missing) and real `tarn` nodes, driven by the `processes_*` tests of
# rs/tarn/tests/cluster.rs:
#   - three nodes: DOC-sharded exact search through every node equals brute force, graph recall,
#     50 USER tenants isolated, drop and re-create;
#   - kill -9 of a node under writes (UNAVAILABLE naming the shard and the node, partial
#     searches, its shards stay its own past its lease, everything back after its restart);
#     etcd stopped and restarted;
#   - a second node with a live id refused;
#   - shard moves under writes through every node: a joining node killed while catching up,
#     the old owner killed between fence and flip, the placement settling with the new node,
#     a SIGSTOPped node routing with a stale map while a node is drained;
#   - cluster identity: nodes with data refuse an empty etcd and another cluster's, set their
#     shards aside (never delete them) against an etcd rolled back behind their back, and
#     --force-new-cluster; set-aside copies listed, imported whole, dropped;
#   - a node cut off from etcd by a silent proxy partition stops acknowledging writes before
#     its lease can lapse; forget, then the healed node sets its copies aside;
#   - failed moves shown in status and retried with a doubling backoff;
#   - replicas: failover after kill -9 and SIGSTOP of primaries (every acknowledged write readable
#     through each survivor, copies identical after they rejoin), a deposed primary cutting its
#     unacknowledged tail (KIP-101), the last in-sync copy promoted and refusing writes below
#     min_in_sync, no promotion while etcd is down, catch-up by snapshot past the log and
#     after a wiped disk, re-replication of a dead node's copies after --replace-dead-after,
#     in-sync incarnations (issue 31: a replica back on a wiped disk never promoted when its
#     primary dies before probing it, and seeded again; a primary back on a wiped disk
#     promoted over);
#   - the seeded nemesis, one fault at a time: writers and searchers through three nodes while
#     kill -9 and restart, SIGSTOP, etcd connections cut, graceful restarts, drains and
#     cancels follow one another (TARN_NEMESIS_SEED, TARN_NEMESIS_SECONDS, default 90 s; the
#     seed is printed); run twice, with 1 copy per shard and with 2 (afterwards every shard's
#     copies in sync and identical). The nemesis with two faults at a time
#     (rs/tarn/tests/cluster/nemesis.rs) is run by scripts/nemesis.sh, not here.
# Every scenario checks each acknowledged write (present once, with its vector) and fails the
# script (non-zero exit) on any lost or duplicated one. Run by scripts/check.sh.
#   scripts/cluster-e2e.sh [a test name filter; default: processes_, all of them]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib-etcd.sh
if ! ensure_etcd; then
    if [[ ${CI:-} == true ]]; then
        echo "cluster-e2e: FAILED: etcd-server could not be installed, and CI must run the cluster tests" >&2
        exit 1
    fi
    echo "cluster-e2e: SKIPPED: etcd-server could not be installed here"
    exit 0
fi
cargo test --locked -p tarn --all-features --test cluster "${1:-processes_}" -- --test-threads 1
if [[ -z ${1:-} ]]; then
    TARN_NEMESIS_REPLICAS=2 cargo test --locked -p tarn --all-features --test cluster \
        processes_nemesis_one_fault -- --test-threads 1
fi
