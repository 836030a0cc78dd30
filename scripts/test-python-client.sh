#!/usr/bin/env bash
# The Python client's tests against a real server: installs clients/python (its gRPC stubs are
# generated from proto/ by grpcio-tools during the install) with its test extras from PyPI into a
# virtualenv, then runs pytest, which starts TARN_BIN (default target/debug/tarn, built by
# `cargo test`) on an ephemeral port. Prints SKIPPED and exits 0 only when python3 is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v python3 >/dev/null; then
    echo "python-client: SKIPPED (no python3)"
    exit 0
fi
export TARN_BIN="${TARN_BIN:-$PWD/target/debug/tarn}"
[[ -x "$TARN_BIN" ]] || cargo build -p tarn
venv="${TARN_CLIENT_VENV:-target/venv-client}"
[[ -x "$venv/bin/python" ]] || python3 -m venv "$venv"
"$venv/bin/pip" install --quiet "./clients/python[test]"
rm -rf clients/python/build clients/python/*.egg-info
# From the repository root, so that the installed package (with its generated stubs) is imported,
# not the source directory.
"$venv/bin/pytest" -q -p no:cacheprovider clients/python/tests
