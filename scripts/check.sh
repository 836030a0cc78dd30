#!/usr/bin/env bash
# The whole test suite: format check, clippy with warnings denied, every test (fail points on),
# the real-process cluster scenarios (scripts/cluster-e2e.sh), the Python client's tests
# against a real server, and the Docker end-to-end tests (one node,
# and the three-node cluster) when a Docker
# engine answers (it says SKIPPED otherwise). This is the command the README gives and the one CI
# (.ci/run) calls. Needs Rust (rustup's default profile: cargo, rustfmt, clippy) and python3 with
# venv; the Python packages come from PyPI, into virtualenvs under target/; Debian's
# etcd-server (for the cluster tests) is installed when missing. Building needs nothing but cargo
# and the crate registry: every .proto is compiled by protox. To prove it, the builds below run
# with a `protoc` first on PATH that fails if anything calls it, and PROTOC unset.
set -euo pipefail
cd "$(dirname "$0")/.."
no_protoc="$PWD/target/no-protoc"
mkdir -p "$no_protoc"
cat > "$no_protoc/protoc" <<'SHIM'
#!/bin/sh
echo "check: something called protoc ($0 $*): tarn's build must need nothing but cargo" >&2
exit 97
SHIM
chmod +x "$no_protoc/protoc"
export PATH="$no_protoc:$PATH"
unset PROTOC PROTOC_INCLUDE
[[ "$(command -v protoc)" == "$no_protoc/protoc" ]]
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --all-features --locked -- -D warnings
# The cluster tests run a real etcd (Debian's etcd-server); they print SKIPPED without one,
# except under CI=true, where a missing etcd fails the run.
if ! bash -c 'source scripts/lib-etcd.sh && ensure_etcd'; then
    [[ ${CI:-} != true ]] || { echo "check: no etcd under CI=true: the cluster tests cannot run" >&2; exit 1; }
    echo "check: no etcd: the cluster tests will say SKIPPED"
fi
# The real-process cluster scenarios (tests named processes_*) run once, below, by
# scripts/cluster-e2e.sh.
cargo test --workspace --all-features --locked -- --skip processes_
scripts/cluster-e2e.sh
# Two seeds of the two-faults-at-a-time nemesis (50 in a row pass: docs/RELIABILITY.md).
SEEDS=2 FIRST_SEED=164 scripts/nemesis.sh
scripts/test-rust-client.sh
scripts/test-python-client.sh
# The generated vectors: what a user's clone, without ../shared/data, runs.
TARN_E2E_DATA=generated scripts/compose-e2e.sh
scripts/cluster-compose-e2e.sh
