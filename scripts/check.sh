#!/usr/bin/env bash
# The whole test suite: format check, clippy with warnings denied, every test (fail points on).
# This is the command the README gives and the one CI (.ci/run) calls. Needs only Rust (rustup's
# default profile: cargo, rustfmt, clippy).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --all-features --locked -- -D warnings
cargo test --workspace --all-features --locked
