#!/usr/bin/env bash
# S3-FIFO against CLOCK (the LRU approximation) on zipf-hot: 4 KiB random reads with
# random_distribution=zipf:1.2 over a file four times the cache, BACKING = the emulator.
#   bash bench/eviction_compare.sh [SIZE_MB] [RUNTIME_S]
# fio direct=1 (every read reaches cachefs); hits are page-cache reads of the cache files.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SIZE_MB=${1:-1024}
RUNTIME=${2:-30}
D=$(mktemp -d /var/tmp/cachefs-evict.XXXX)
cleanup() {
    grep -q " $D/mnt fuse" /proc/mounts && cachefs umount "$D/mnt" || true
    grep -q " $D/slow fuse" /proc/mounts && fusermount3 -u "$D/slow" || true
    sleep 1; rm -rf "$D"
}
trap cleanup EXIT
mkdir -p "$D/src" "$D/slow" "$D/mnt"
head -c "${SIZE_MB}M" /dev/urandom > "$D/src/data"
$PY bench/slowfs.py mount "$D/src" "$D/slow" >/dev/null
echo "| eviction | IOPS | mean lat ms | hit ratio | evictions |"
echo "|---|---:|---:|---:|---:|"
for policy in s3-fifo clock; do
    rm -rf "$D/cache"
    cachefs mount --cache-dir "$D/cache" --cache-size $((SIZE_MB / 4))M --eviction "$policy" \
        "$D/slow" "$D/mnt"
    # warm-up (the same distribution), then the measured window
    fio --name=warm --filename="$D/mnt/data" --rw=randread --bs=4k --direct=1 \
        --ioengine=libaio --iodepth=32 --random_distribution=zipf:1.2 --size="${SIZE_MB}M" \
        --runtime="$RUNTIME" --time_based --output-format=terse >/dev/null
    before=$(cachefs-ctl stats "$D/mnt" --json)
    out=$(fio --name=zipf --filename="$D/mnt/data" --rw=randread --bs=4k --direct=1 \
        --ioengine=libaio --iodepth=32 --random_distribution=zipf:1.2 --size="${SIZE_MB}M" \
        --runtime="$RUNTIME" --time_based --output-format=json)
    after=$(cachefs-ctl stats "$D/mnt" --json)
    $PY - "$policy" "$out" "$before" "$after" <<'PYEOF'
import json, sys
policy, out, b, a = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), json.loads(sys.argv[4])
r = out["jobs"][0]["read"]
hits = a["hit_ops"] - b["hit_ops"]; reads = a["read_ops"] - b["read_ops"]
print(f"| {policy} | {r['iops']:,.0f} | {r['lat_ns']['mean'] / 1e6:.2f} | "
      f"{hits / reads:.3f} | {a['evictions'] - b['evictions']:,} |")
PYEOF
    cachefs umount "$D/mnt"
done
