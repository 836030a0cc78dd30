#!/usr/bin/env bash
# Builds an etcd image without any registry, from Debian's etcd-server package on this host
# (installed by scripts/lib-etcd.sh when missing): /usr/bin/etcd and the shared libraries it
# links (glibc), copied into an empty image. Usage: scripts/docker-etcd-image.sh [TAG]
# (default tarn-etcd:dev). docker-compose.cluster.yml runs it.
set -euo pipefail
cd "$(dirname "$0")/.."
tag="${1:-tarn-etcd:dev}"
source scripts/lib-etcd.sh
ensure_etcd
etcd="$(command -v etcd)"
ctx="$(mktemp -d)"
trap 'rm -rf "$ctx"' EXIT
mkdir -p "$ctx/rootfs/usr/bin" "$ctx/rootfs/data" "$ctx/rootfs/tmp"
cp "$etcd" "$ctx/rootfs/usr/bin/etcd"
# The program interpreter and every library ldd lists, at their own paths.
for lib in $(ldd "$etcd" | grep -o '/[^ ]*'); do
    mkdir -p "$ctx/rootfs$(dirname "$lib")"
    cp -L "$lib" "$ctx/rootfs$lib"
done
cat >"$ctx/Dockerfile" <<'DOCKERFILE'
FROM scratch
COPY rootfs/ /
VOLUME ["/data"]
EXPOSE 2379 2380
ENTRYPOINT ["/usr/bin/etcd"]
DOCKERFILE
docker build -q -t "$tag" "$ctx" >/dev/null
echo "docker-etcd-image: built $tag from $etcd ($("$etcd" --version | head -1))"
