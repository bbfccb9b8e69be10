#!/usr/bin/env bash
# What checking block checksums on the daemon's hit path costs (issue 17, item 1), in one
# run: two cachefs mounts of one BACKING file, both --no-passthrough (every hit is a daemon
# read), one with --no-read-checksums; fio against each, alternated over ROUNDS rounds so
# that drift on the machine hits both alike.
#   bash bench/checksum_cost.sh [SIZE_MB] [RUNTIME_S] [ROUNDS]
# Which I/O bypasses the page cache: fio uses direct=1, so every request reaches the daemon;
# the daemon reads its cache file through the page cache (the file is warm there).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SIZE_MB=${1:-256}
RUNTIME=${2:-10}
ROUNDS=${3:-3}
D=$(mktemp -d /var/tmp/cachefs-bench.XXXX)
cleanup() {
    for m in "$D/on" "$D/off"; do
        grep -q " $m fuse" /proc/mounts && { $PY -m cachefs_cli.main umount "$m" 2>/dev/null \
            || fusermount3 -u -z "$m"; } || true
    done
    sleep 1; rm -rf "$D"
}
trap cleanup EXIT
mkdir -p "$D/backing" "$D/c-on" "$D/c-off" "$D/on" "$D/off"
head -c "${SIZE_MB}M" /dev/urandom > "$D/backing/data"
sync
for m in on off; do
    extra=""; [ $m = off ] && extra="--no-read-checksums"
    $PY -m cachefs_cli.main mount --cache-dir "$D/c-$m" --cache-size $((SIZE_MB * 2))M \
        --no-passthrough $extra "$D/backing" "$D/$m"
    dd if="$D/$m/data" of=/dev/null bs=1M iflag=direct status=none     # one read warms it
    $PY bench/wait_cached.py "$D/$m" $((SIZE_MB * 16)) 20 || true
done
fio_run() {  # $1 label, $2 file, $3 rw, $4 bs, $5 iodepth
    fio --name="$1" --filename="$2" --rw="$3" --bs="$4" --size="${SIZE_MB}M" --direct=1 \
        --ioengine=libaio --iodepth="$5" --runtime="$RUNTIME" --time_based --invalidate=0 \
        --output-format=json | $PY -c 'import json,sys; j=json.load(sys.stdin)["jobs"][0]["read"]
print("%s %.0f %.1f" % (sys.argv[1], j["iops"], j["lat_ns"]["mean"] / 1e3))' "$1"
}
{
for _ in $(seq "$ROUNDS"); do
    for m in on off; do fio_run "rand4k:$m" "$D/$m/data" randread 4k 32; done
    for m in off on; do fio_run "seq128k:$m" "$D/$m/data" read 128k 4; done
done
} > "$D/results"
$PY - "$D/results" "$SIZE_MB" "$RUNTIME" "$ROUNDS" <<'PYEOF'
import statistics, sys
path, size, runtime, rounds = sys.argv[1:]
res = {}
for line in open(path):
    name, iops, lat = line.split()
    res.setdefault(name, []).append(float(iops))
print(f"fio, {size} MiB file fully cached, --no-passthrough, {runtime} s each, libaio "
      f"direct=1, median of {rounds} alternated rounds\n")
print("| workload | checksums checked | not checked | cost |")
print("|---|---:|---:|---:|")
for wl in ("rand4k", "seq128k"):
    on, off = statistics.median(res[f"{wl}:on"]), statistics.median(res[f"{wl}:off"])
    print(f"| {wl} | {on:,.0f} IOPS | {off:,.0f} IOPS | {100 * (1 - on / off):.1f} % |")
PYEOF
