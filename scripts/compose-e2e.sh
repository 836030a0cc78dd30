#!/usr/bin/env bash
# End to end through Docker: builds the image offline (scripts/docker-image.sh), `docker compose
# up -d`, waits for the container to be healthy, inserts 10,000 vectors for two tenants with the
# Python client, checks recall@10 (after a flush, so the sealed graph's) against exact answers
# computed by the script, and tenant isolation, SIGKILLs the container,
# brings it back, checks that every acknowledged document is there, stops it with SIGTERM (exit
# 0), then `docker compose down -v`. Also checks the non-root user and that the static binary
# resolves compose service names.
# The vectors: ../shared/data/minilm-debian (or TARN_MINILM_DIR) when present; otherwise, as on
# a user's clone, 10,000 seeded synthetic 384-d embeddings-like vectors (scripts/py/compose_e2e.py
# `generate`); TARN_E2E_DATA=generated forces those. Prints `compose-e2e: SKIPPED (...)` and exits
# 0 only when no Docker engine answers. Usage: scripts/compose-e2e.sh
set -euo pipefail
cd "$(dirname "$0")/.."

# shellcheck source=scripts/lib-docker.sh
source scripts/lib-docker.sh
find_compose compose-e2e
data="${TARN_MINILM_DIR:-../shared/data/minilm-debian}"
if [[ ${TARN_E2E_DATA:-} == generated || ! -f "$data/base.fvecs" ]]; then
    data=generated
else
    data="$(cd "$data" && pwd)"
fi

scripts/docker-image.sh tarn:e2e

venv="${TARN_CLIENT_VENV:-target/venv-client}"
[[ -x "$venv/bin/python" ]] || python3 -m venv "$venv"
"$venv/bin/pip" install --quiet "./clients/python[test]"
rm -rf clients/python/build clients/python/*.egg-info

project="tarn-e2e-$$"
port="${TARN_E2E_PORT:-50151}"
export TARN_IMAGE=tarn:e2e TARN_PORT="$port" TARN_METRICS_PORT="$((port + 1))"
dc() { "${compose[@]}" -p "$project" "$@"; }
cleanup() { dc down -v --remove-orphans >/dev/null 2>&1 || true; }
trap cleanup EXIT

wait_healthy() {
    local id status
    id="$(dc ps -q tarn)"
    for _ in $(seq 1 120); do
        status="$(docker inspect -f '{{.State.Health.Status}}' "$id" 2>/dev/null || echo missing)"
        if [[ "$status" == healthy ]]; then
            echo "compose-e2e: container healthy"
            return 0
        fi
        sleep 1
    done
    echo "compose-e2e: container not healthy (last status: $status)" >&2
    dc logs tarn >&2 || true
    return 1
}

dc up -d
wait_healthy
user="$(docker inspect -f '{{.Config.User}}' "$(dc ps -q tarn)")"
[[ "$user" == 65532:65532 ]] || { echo "compose-e2e: FAILED: runs as '$user', not 65532:65532" >&2; exit 1; }
# The static binary resolves compose's service names: a second container of the image checks
# the server by its DNS name.
dc run --rm --no-deps tarn healthcheck --addr http://tarn:50051 >/dev/null
echo "compose-e2e: non-root (65532), service name 'tarn' resolves from another container"
"$venv/bin/python" scripts/py/compose_e2e.py load --address "127.0.0.1:$port" --data "$data" \
    --state target/compose-e2e-state.json

# A crash, not a stop: SIGKILL the server (PID 1 of the container), then start it again.
id="$(dc ps -q tarn)"
docker kill --signal KILL "$id" >/dev/null
echo "compose-e2e: sent SIGKILL to the container"
dc up -d
# `restart: unless-stopped` may already have restarted it; either way wait until healthy.
wait_healthy
"$venv/bin/python" scripts/py/compose_e2e.py verify --address "127.0.0.1:$port" --data "$data" \
    --state target/compose-e2e-state.json
# A clean stop: SIGTERM, and tarn exits 0 well within the grace period.
id="$(dc ps -q tarn)"
dc stop -t 30 tarn
code="$(docker inspect -f '{{.State.ExitCode}}' "$id")"
[[ "$code" == 0 ]] || { echo "compose-e2e: FAILED: exit code $code after SIGTERM" >&2; exit 1; }
echo "compose-e2e: SIGTERM -> exit 0"
echo "compose-e2e: PASSED"
