#!/usr/bin/env bash
# Issue 16, item 6: a stream over cached data after concurrent writes, in write-through.
# A 1 GiB file on the slow-disk emulator (slowfs defaults), cached whole through cachefs;
# fio hitachi-web (8k, 95 % reads, 75 % random, 2 jobs x QD 8) for 8 s, then seq-read-1m
# (1 MiB sequential reads, QD 4) for 8 s; the bytes the stream made cachefs read from BACKING
# (slowfs's counters and cachefs's backing_read_bytes) against what fio read.
#   bash bench/stream_after_writes.sh [MODE] [SIZE_MB]
# Which I/O bypasses the page cache: fio uses direct=1, so every request reaches cachefs
# (the file is opened read-write by hitachi-web, read-only by the stream: the stream goes
# FUSE passthrough once the file is wholly cached again, --no-passthrough keeps it on the
# daemon so that what it reads from BACKING is counted by cachefs too).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
MODE=${1:-write-through}
SIZE_MB=${2:-1024}
D=$(mktemp -d /var/tmp/cachefs-bench.XXXX)
cleanup() {
    grep -q " $D/mnt fuse" /proc/mounts && $PY -m cachefs_cli.main umount "$D/mnt" || true
    grep -q " $D/slow fuse" /proc/mounts && fusermount3 -u "$D/slow" || true
    sleep 1; rm -rf "$D"
}
trap cleanup EXIT
mkdir -p "$D/src" "$D/slow" "$D/cache" "$D/mnt"
head -c "${SIZE_MB}M" /dev/urandom > "$D/src/data"
$PY bench/slowfs.py mount "$D/src" "$D/slow"
$PY -m cachefs_cli.main mount --mode "$MODE" --no-passthrough --cache-dir "$D/cache" \
    --cache-size $((SIZE_MB * 2))M "$D/slow" "$D/mnt"
dd if="$D/mnt/data" of=/dev/null bs=1M iflag=direct status=none
$PY bench/wait_cached.py "$D/mnt" $((SIZE_MB * 16)) 60 || true
export FILENAME="$D/mnt/data" SIZE=$((SIZE_MB << 20)) RUNTIME=8 RAMP=0
fio bench/jobs/hitachi-web.fio --output-format=json > "$D/web.json"
$PY -m cachefs_cli.ctl stats "$D/mnt" --json > "$D/a.json"
$PY -c 'import json,sys; sys.path.insert(0, "bench"); import slowfs_client as s; print(json.dumps(s.stats(sys.argv[1])))' "$D/slow" > "$D/sa.json"
fio bench/jobs/seq-read-1m.fio --time_based --output-format=json > "$D/seq.json"
$PY -m cachefs_cli.ctl stats "$D/mnt" --json > "$D/b.json"
$PY -c 'import json,sys; sys.path.insert(0, "bench"); import slowfs_client as s; print(json.dumps(s.stats(sys.argv[1])))' "$D/slow" > "$D/sb.json"
$PY - "$D" "$MODE" "$SIZE_MB" <<'PYEOF'
import json, sys
d, mode, size = sys.argv[1:]
j = lambda n: json.load(open(f"{d}/{n}"))
web, seq = j("web.json")["jobs"][0], j("seq.json")["jobs"][0]
a, b, sa, sb = j("a.json"), j("b.json"), j("sa.json"), j("sb.json")
read = seq["read"]["io_bytes"]
cf = b["backing_read_bytes"] - a["backing_read_bytes"]
slow = sb["read_bytes"] - sa["read_bytes"]
print(f"{mode}, {size} MiB file on slowfs: hitachi-web 8 s "
      f"({web['read']['iops'] + web['write']['iops']:,.0f} IOPS, "
      f"{web['write']['total_ios']:,} writes), then seq-read-1m 8 s: "
      f"{seq['read']['iops']:,.0f} IOPS, {read / 2**20:,.0f} MiB read; from BACKING during "
      f"the stream: {cf / 2**20:,.1f} MiB by cachefs ({100 * cf / max(read, 1):.2f} % of the "
      f"stream), {slow / 2**20:,.1f} MiB on slowfs; mixed reads {b['mixed_ops'] - a['mixed_ops']}")
PYEOF
