#!/usr/bin/env bash
# The quick-start demo: an emulated slow disk (5 ms per random request, 110 MB/s), cachefs
# mounted over it, random 4 KiB reads measured cold, warming and warm, then the cache's stats.
#   bash bench/demo.sh         mount and run the demo (mounts stay up to explore)
#   bash bench/demo.sh stop    unmount everything the demo mounted
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
D=${CACHEFS_DEMO_DIR:-/tmp/cachefs-demo}

stop() {
    if grep -q " $D/mnt fuse.cachefs" /proc/mounts; then cachefs umount "$D/mnt"; fi
    if grep -q " $D/slow fuse" /proc/mounts; then fusermount3 -u "$D/slow"; fi
}
if [ "${1:-}" = stop ]; then stop; echo "demo unmounted"; exit 0; fi
stop
mkdir -p "$D/source" "$D/slow" "$D/cache" "$D/mnt"
[ -s "$D/source/data.bin" ] || head -c 64M /dev/urandom > "$D/source/data.bin"

echo "== slow disk: $D/slow (emulated: 5 ms random access, 110 MB/s, 8 in service)"
$PY bench/slowfs.py mount "$D/source" "$D/slow"
echo "== cachefs: $D/mnt (cache in $D/cache, 256 MiB)"
cachefs mount --cache-dir "$D/cache" --cache-size 256M "$D/slow" "$D/mnt"
cachefs-ctl drop "$D/mnt" >/dev/null          # start cold, also when run again

run() {   # $1: label; 4 KiB random reads over the 64 MiB file, O_DIRECT, 4 s
    fio --name=demo --filename="$D/mnt/data.bin" --rw=randread --bs=4k --size=64M \
        --direct=1 --ioengine=psync --numjobs=4 --runtime=4 --time_based --group_reporting \
        --output-format=json | $PY -c 'import json,sys; j=json.load(sys.stdin)["jobs"][0]["read"]
print("%-10s %9.0f IOPS   mean latency %8.0f us" % (sys.argv[1], j["iops"], j["lat_ns"]["mean"] / 1e3))' "$1"
}
echo "== fio 4k random reads, 64 MiB file, O_DIRECT, 4 jobs"
run cold
run warming
run warm
echo "== cachefs-ctl stats $D/mnt"
cachefs-ctl stats "$D/mnt"
cat <<TXT

The demo stays mounted: explore $D/mnt, watch 'cachefs-ctl stats $D/mnt --watch 1',
then unmount with: make demo-stop
TXT
