#!/usr/bin/env bash
# Builds the `tarn` Docker image without any registry: the binary is compiled on the host,
# statically linked (glibc's crt-static, explicit target so build scripts and proc macros stay
# dynamic), checked to be static, and copied into a `scratch` image by the Dockerfile's
# `prebuilt` stage. Usage: scripts/docker-image.sh [TAG]   (default tarn:dev)
set -euo pipefail
cd "$(dirname "$0")/.."
tag="${1:-tarn:dev}"
RUSTFLAGS='-C target-feature=+crt-static' \
    cargo build --release --locked --target x86_64-unknown-linux-gnu -p tarn
binary=target/x86_64-unknown-linux-gnu/release/tarn
# Static: no program interpreter and no shared libraries needed (readelf is in binutils).
if readelf -lW "$binary" | grep -q INTERP || readelf -dW "$binary" | grep -q NEEDED; then
    echo "docker-image: $binary is not statically linked:" >&2
    readelf -dW "$binary" | grep NEEDED >&2 || true
    exit 1
fi
docker build --target prebuilt -t "$tag" .
echo "docker-image: built $tag"
