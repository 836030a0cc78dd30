#!/usr/bin/env bash
# The whole test suite: format check, clippy with warnings denied, every test (fail points on),
# the Python client's tests against a real server, and the Docker end-to-end test when a Docker
# engine answers (it says SKIPPED otherwise). This is the command the README gives and the one CI
# (.ci/run) calls. Needs Rust (rustup's default profile: cargo, rustfmt, clippy) and python3 with
# venv; the Python packages come from PyPI, into virtualenvs under target/.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --all-features --locked -- -D warnings
cargo test --workspace --all-features --locked
scripts/test-rust-client.sh
scripts/test-python-client.sh
scripts/compose-e2e.sh
