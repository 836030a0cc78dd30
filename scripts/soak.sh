#!/usr/bin/env bash
# Mixed-load soak: a release `tarn serve` and the Python client's load (scripts/py/soak.py:
# 4 writer threads upserting/removing over a fixed 20,000-document space in 4 tenants, both
# durability modes, 2 searcher threads) for SECONDS (default 600), with the server's resident
# memory and latency percentiles sampled every 30 s. Fails on any error, on memory still growing
# in the last third, or on p99 latency growing. Usage: scripts/soak.sh [SECONDS]
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-600}"
cargo build --release -p tarn
venv="${TARN_CLIENT_VENV:-target/venv-client}"
[[ -x "$venv/bin/python" ]] || python3 -m venv "$venv"
"$venv/bin/pip" install --quiet "./clients/python"
rm -rf clients/python/build clients/python/*.egg-info
source scripts/lib-server.sh
work="$(mktemp -d)"
trap 'stop_tarn; rm -rf "$work"' EXIT
start_tarn "$work/data"
"$venv/bin/python" scripts/py/soak.py --address "${TARN_ADDR#http://}" --pid "$TARN_PID" --seconds "$seconds"
