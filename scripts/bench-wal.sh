#!/usr/bin/env bash
# Runs the WalInsertion criterion benchmark (all strategies in one process) and prints the
# median table with ratios, ready for docs/BENCHMARKS.md. Usage: scripts/bench-wal.sh
set -euo pipefail
cd "$(dirname "$0")/.."
log=target/bench-wal.log
mkdir -p target
cargo bench -p tarn-benches --bench wal_insertion -- --noplot 2>&1 | tee "$log" >/dev/null
python3 - "$log" <<'PY'
import json, os, sys
root = "target/criterion"
def median_ms(strategy, n):
    path = os.path.join(root, f"WalInsertion_{strategy}", str(n), "new", "estimates.json")
    if not os.path.exists(path):
        path = os.path.join(root, f"WalInsertion/{strategy}", str(n), "new", "estimates.json")
    with open(path) as f:
        return json.load(f)["median"]["point_estimate"] / 1e6
strategies = ["floor", "write-group", "sync-on-batch", "sync-background", "sync-on-write"]
ns = [1, 10, 100, 1000]
print("| strategy | " + " | ".join(f"N={n}" for n in ns) + " |")
print("|---|" + "---|" * len(ns))
m = {(s, n): median_ms(s, n) for s in strategies for n in ns}
for s in strategies:
    print(f"| {s} | " + " | ".join(f"{m[(s, n)]:.3f} ms" for n in ns) + " |")
loaded = median_ms("write-group-loaded", 1000)
loaded500 = median_ms("write-group-loaded-500us", 1000)
print(f"| write-group-loaded (load yields every 100 us) | | | | {loaded:.3f} ms |")
print(f"| write-group-loaded-500us (load yields every 500 us) | | | | {loaded500:.3f} ms |")
hand = {k: median_ms("handoff-floor", k) for k in ["1000", "loaded-1000", "loaded-500us-1000"]}
print(f"| handoff-floor: no I/O, unloaded / 100 us load / 500 us load | | | | "
      f"{hand['1000']:.3f} / {hand['loaded-1000']:.3f} / {hand['loaded-500us-1000']:.3f} ms |")
print()
for n in ns:
    print(f"N={n}: write-group/floor = {m[('write-group', n)] / m[('floor', n)]:.2f}, "
          f"sync-on-batch/write-group = {m[('sync-on-batch', n)] / m[('write-group', n)]:.1f}x, "
          f"sync-on-write/write-group = {m[('sync-on-write', n)] / m[('write-group', n)]:.1f}x")
wg = m[('write-group', 1000)]
print(f"write-group-loaded/write-group at N=1000 = {loaded / wg:.2f} (500 us load: {loaded500 / wg:.2f})")
print(f"handoff-floor loaded/write-group at N=1000 = {hand['loaded-1000'] / wg:.2f} "
      f"(500 us load: {hand['loaded-500us-1000'] / wg:.2f}): the runtime's share alone")
print(f"write-group-loaded minus handoff-floor loaded = {loaded - hand['loaded-1000']:.3f} ms "
      f"(500 us load: {loaded500 - hand['loaded-500us-1000']:.3f} ms)")
for line in open(sys.argv[1]):
    if line.startswith("syncs: "):
        print(line.strip())
PY
