#!/usr/bin/env bash
# First figures (issue #2): fio 4 KiB random reads of a warmed file through cachefs, against
# the raw cache directory (the upper limit) and a bare pyfuse3 passthrough, in one run.
#   bash bench/warm_randread.sh [SIZE_MB] [RUNTIME_S]
# Which I/O bypasses the page cache: fio uses direct=1 everywhere, so the FUSE mounts see
# every read; cachefs itself reads its cache file through the page cache (a hit is a
# buffered pread), so the raw directory is measured both with direct=1 (the disk) and
# buffered (page cache: what cachefs's hits actually read from).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SIZE_MB=${1:-1024}
RUNTIME=${2:-20}
D=$(mktemp -d /var/tmp/cachefs-bench.XXXX)
cleanup() {
    for m in "$D/mnt" "$D/pt"; do grep -q " $m fuse" /proc/mounts && fusermount3 -u "$m" || true; done
    sleep 1; rm -rf "$D"
}
trap cleanup EXIT
mkdir -p "$D/backing" "$D/cache" "$D/mnt" "$D/pt" "$D/raw"
head -c "${SIZE_MB}M" /dev/urandom > "$D/backing/data"
cp "$D/backing/data" "$D/raw/data"

cachefs mount --cache-dir "$D/cache" --cache-size $((SIZE_MB * 2))M --sequential-cutoff 0 \
    "$D/backing" "$D/mnt"
for _ in 1 2; do dd if="$D/mnt/data" of=/dev/null bs=64k iflag=direct status=none; done
sleep 2
$PY bench/passthrough.py mount "$D/backing" "$D/pt"

fio_iops() {  # $1 label, $2 file, $3 direct (buffered libaio is synchronous: use 4 psync jobs)
    if [ "$3" = 1 ]; then engine="--ioengine=libaio --iodepth=32 --numjobs=1"
    else engine="--ioengine=psync --numjobs=4 --group_reporting"; fi
    fio --name="$1" --filename="$2" --rw=randread --bs=4k --size="${SIZE_MB}M" --direct="$3" \
        $engine --runtime="$RUNTIME" --time_based \
        --output-format=json | $PY -c 'import json,sys; j=json.load(sys.stdin)["jobs"][0]["read"]
print("%s %.0f %.1f %.1f" % (sys.argv[1], j["iops"], j["lat_ns"]["mean"] / 1e3,
      j["clat_ns"]["percentile"]["99.000000"] / 1e3))' "$1"
}
cachefs-ctl stats "$D/mnt" --json > "$D/before.json"
{
fio_iops cachefs-warm "$D/mnt/data" 1
fio_iops passthrough "$D/pt/data" 1
fio_iops raw-direct "$D/raw/data" 1
fio_iops raw-buffered "$D/raw/data" 0
} > "$D/results"
cachefs-ctl stats "$D/mnt" --json > "$D/stats.json"
$PY - "$D/results" "$D/stats.json" "$SIZE_MB" "$RUNTIME" "$D/before.json" <<'PYEOF'
import json, sys
rows = [l.split() for l in open(sys.argv[1])]
after, before = json.load(open(sys.argv[2])), json.load(open(sys.argv[5]))
st = {k: after[k] - before[k] for k in ("read_ops", "hit_ops", "backing_read_ops")}
iops = {r[0]: float(r[1]) for r in rows}
print(f"fio randread 4k, {sys.argv[3]} MiB file, {sys.argv[4]} s each; libaio iodepth=32 "
      "direct=1, except raw-buffered: psync, 4 jobs, page cache")
print("| system | IOPS | mean lat (us) | p99 lat (us) | cachefs / system |")
print("|---|---:|---:|---:|---:|")
for name, i, mean, p99 in rows:
    print(f"| {name} | {float(i):,.0f} | {mean} | {p99} | {iops['cachefs-warm'] / float(i):.2f} |")
print(f"\ncachefs during its fio run: {st['read_ops']} reads, {st['hit_ops']} SSD hits, "
      f"{st['backing_read_ops']} BACKING reads")
PYEOF
