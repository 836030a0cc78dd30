#!/usr/bin/env bash
# Runs each fuzz target (fuzz/fuzz_targets: WAL recovery on arbitrary segment bytes, manifest
# and collection-config decoding, WAL payload decoding, snapshot decoding, filtered search's attribute and filter decoding, sealed segments behind their checksum) for SECONDS (default
# 60) with cargo-fuzz on the nightly toolchain (libFuzzer needs its sanitizer flags; the product
# builds on stable).
# Starts from the committed corpus in fuzz/corpus/<target> and adds what raises coverage there.
# Installs cargo-fuzz from crates.io when missing. Usage: scripts/fuzz.sh [SECONDS]
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
seconds="${1:-60}"
if ! rustup toolchain list | grep -q '^nightly'; then
    echo "fuzz: SKIPPED (no nightly toolchain: rustup toolchain install nightly)"
    exit 0
fi
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
for target in wal_segment manifest operation snapshot attributes segment; do
    mkdir -p "corpus/$target"
    cargo +nightly fuzz run "$target" "corpus/$target" -- \
        -max_total_time="$seconds" -max_len=8192 -print_final_stats=1 2>&1 |
        grep -E '^(#[0-9]+.*DONE|stat::number_of_executed_units|stat::peak_rss_mb|==[0-9]+== ERROR|SUMMARY)' || true
    # A crash leaves fuzz/artifacts/<target>/crash-*: fail loudly.
    if compgen -G "artifacts/$target/crash-*" >/dev/null; then
        echo "fuzz: $target CRASHED: $(ls artifacts/$target/crash-*)" >&2
        exit 1
    fi
    echo "fuzz: $target ran ${seconds} s, no crash"
done
