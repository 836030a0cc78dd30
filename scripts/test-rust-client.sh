#!/usr/bin/env bash
# The Rust client's quickstart example (rs/client/examples/quickstart.rs) against a real server:
# starts TARN_BIN (default target/debug/tarn) on an ephemeral port and runs the example with the
# address in its plain host:port form. Fails if the example exits non-zero. Both binaries are
# those `cargo test --workspace --all-features` builds (same features: nothing is rebuilt).
set -euo pipefail
cd "$(dirname "$0")/.."
export TARN_BIN="${TARN_BIN:-$PWD/target/debug/tarn}"
example=target/debug/examples/quickstart
[[ -x "$TARN_BIN" && -x "$example" ]] || cargo build --locked --workspace --all-features --bins --examples
# shellcheck source=scripts/lib-server.sh
source scripts/lib-server.sh
dir="$(mktemp -d)"
trap 'stop_tarn; rm -rf "$dir"' EXIT
start_tarn "$dir/data"
"$example" "${TARN_ADDR#http://}"
echo "rust-client quickstart: PASSED"
