#!/usr/bin/env bash
# The cluster through Docker: builds the tarn and etcd images offline (scripts/docker-image.sh,
# scripts/docker-etcd-image.sh), `docker compose -f docker-compose.cluster.yml up -d`, waits for
# the three nodes to be healthy, loads a 6-shard collection through every node and checks exact
# search on each (scripts/py/cluster_e2e.py), SIGKILLs one node's container under writes (its
# shards refuse, naming the shard and the node, until replicas are promoted; the writes' last 5 s
# must all be taken: the failover), restarts it, waits until every shard's 2 copies are in sync
# again (the node rejoined), checks that every acknowledged write is back exactly once, and
# `down -v`. Prints `cluster-compose-e2e: SKIPPED (...)` and
# exits 0 when no Docker engine answers.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib-docker.sh
source scripts/lib-docker.sh
find_compose cluster-compose-e2e
scripts/docker-image.sh tarn:e2e
scripts/docker-etcd-image.sh tarn-etcd:e2e
venv="${TARN_CLIENT_VENV:-target/venv-client}"
[[ -x "$venv/bin/python" ]] || python3 -m venv "$venv"
"$venv/bin/pip" install --quiet "./clients/python[test]"
rm -rf clients/python/build clients/python/*.egg-info

project="tarn-cluster-e2e-$$"
port="${TARN_CLUSTER_E2E_PORT:-50171}"
export TARN_IMAGE=tarn:e2e TARN_ETCD_IMAGE=tarn-etcd:e2e TARN_CLUSTER_PORT="$port" \
    TARN_CLUSTER_PORT_2="$((port + 1))" TARN_CLUSTER_PORT_3="$((port + 2))"
dc() { "${compose[@]}" -f docker-compose.cluster.yml -p "$project" "$@"; }
state="$(mktemp)"
cleanup() { dc down -v --remove-orphans >/dev/null 2>&1 || true; rm -f "$state" "$state.writing"; }
trap cleanup EXIT
wait_healthy() {
    local service id status
    for service in "$@"; do
        for _ in $(seq 1 120); do
            id="$(dc ps -q "$service")"
            status="$(docker inspect -f '{{.State.Health.Status}}' "$id" 2>/dev/null || echo missing)"
            [[ $status == healthy ]] && break
            sleep 1
        done
        if [[ $status != healthy ]]; then
            echo "cluster-compose-e2e: $service not healthy ($status)" >&2
            dc logs "$service" >&2 || true
            return 1
        fi
    done
    echo "cluster-compose-e2e: healthy: $*"
}
dc up -d
wait_healthy tarn1 tarn2 tarn3
addrs=("127.0.0.1:$port" "127.0.0.1:$((port + 1))" "127.0.0.1:$((port + 2))")
py="$venv/bin/python"
"$py" scripts/py/cluster_e2e.py load "${addrs[@]}" "$state"
dc exec -T tarn1 /usr/local/bin/tarn cluster status --addr http://127.0.0.1:50051
# Writes through n1 and n2 while n3's container is SIGKILLed (a second after the first is
# acknowledged), long enough for its shards to fail over (5 s lease) and be written to on their
# new primaries.
rm -f "$state.writing"
"$py" scripts/py/cluster_e2e.py writes "${addrs[@]}" "$state" 16 &
writer=$!
for _ in $(seq 1 600); do
    [[ -e "$state.writing" ]] || ! kill -0 "$writer" 2>/dev/null && break
    sleep 0.1
done
sleep 1
docker kill -s KILL "$(dc ps -q tarn3)" >/dev/null
wait "$writer"
dc exec -T tarn1 /usr/local/bin/tarn cluster status --addr http://127.0.0.1:50051
dc start tarn3 >/dev/null
wait_healthy tarn3
# n3 rejoins: its copies catch up and are listed in sync again.
for i in $(seq 1 90); do
    if dc exec -T tarn1 /usr/local/bin/tarn cluster status --json --addr http://127.0.0.1:50051 |
        "$py" scripts/py/cluster_e2e.py in-sync; then
        echo "cluster-compose-e2e: every shard's 2 copies in sync again after ${i} s"
        break
    fi
    if [[ $i == 90 ]]; then
        echo "cluster-compose-e2e: copies not back in sync after 90 s" >&2
        dc exec -T tarn1 /usr/local/bin/tarn cluster status --addr http://127.0.0.1:50051 >&2
        exit 1
    fi
    sleep 1
done
"$py" scripts/py/cluster_e2e.py verify "${addrs[@]}" "$state"
echo "cluster-compose-e2e: PASSED"
