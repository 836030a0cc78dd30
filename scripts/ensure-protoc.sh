#!/usr/bin/env bash
# Cluster mode talks to etcd through the etcd-client crate, whose build script compiles etcd's
# .proto files with `protoc` (tarn's own protos need none: protox). Installs Debian's
# protobuf-compiler when `protoc` is missing (as root, or with sudo), and says so.
set -euo pipefail
if command -v protoc >/dev/null || [[ -n ${PROTOC:-} && -x ${PROTOC:-} ]]; then
    exit 0
fi
echo "ensure-protoc: installing Debian's protobuf-compiler (needed to build etcd-client)"
sudo=
[[ $(id -u) -eq 0 ]] || sudo=sudo
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get install -y -q protobuf-compiler >/dev/null ||
    { $sudo apt-get update -q >/dev/null && $sudo apt-get install -y -q protobuf-compiler >/dev/null; }
command -v protoc >/dev/null || { echo "ensure-protoc: protoc is still missing" >&2; exit 1; }
