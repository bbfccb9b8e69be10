#!/usr/bin/env bash
# Warm hits of issue 16 in one run: fio against a fully cached file through cachefs with FUSE
# passthrough (the default), cachefs without it (--no-passthrough: every hit through the
# daemon, as for partly cached files and read-write opens), a bare pyfuse3 passthrough of
# BACKING (bench/passthrough.py: what Python FUSE itself can do), and the raw cache directory.
#   bash bench/hits.sh [SIZE_MB] [RUNTIME_S]
# Which I/O bypasses the page cache: every fio job uses direct=1. On the raw directory and on
# cachefs's passthrough opens that reaches the virtual disk (the kernel reopens the cache file
# with the client's O_DIRECT); on cachefs --no-passthrough and passthrough.py it means every
# request reaches the daemon, which reads its file through the page cache.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SIZE_MB=${1:-1024}
RUNTIME=${2:-20}
D=$(mktemp -d /var/tmp/cachefs-bench.XXXX)
cleanup() {
    for m in "$D/mnt" "$D/nopt" "$D/pt"; do
        grep -q " $m fuse" /proc/mounts && { $PY -m cachefs_cli.main umount "$m" 2>/dev/null \
            || fusermount3 -u -z "$m"; } || true
    done
    sleep 1; rm -rf "$D"
}
trap cleanup EXIT
mkdir -p "$D/backing" "$D/cache" "$D/cache2" "$D/mnt" "$D/nopt" "$D/pt" "$D/raw"
head -c "${SIZE_MB}M" /dev/urandom > "$D/backing/data"
cp "$D/backing/data" "$D/raw/data"
sync

for m in mnt nopt; do
    extra=""; [ $m = nopt ] && extra="--no-passthrough"
    cache=cache; [ $m = nopt ] && cache=cache2
    $PY -m cachefs_cli.main mount --cache-dir "$D/$cache" --cache-size $((SIZE_MB * 2))M $extra \
        "$D/backing" "$D/$m"
    dd if="$D/$m/data" of=/dev/null bs=1M iflag=direct status=none     # one read warms it
    $PY bench/wait_cached.py "$D/$m" $((SIZE_MB * 16)) 20 || true
done
$PY bench/passthrough.py mount "$D/backing" "$D/pt"

fio_run() {  # $1 label, $2 file, $3 rw, $4 bs, $5 iodepth
    fio --name="$1" --filename="$2" --rw="$3" --bs="$4" --size="${SIZE_MB}M" --direct=1 \
        --ioengine=libaio --iodepth="$5" --runtime="$RUNTIME" --time_based --invalidate=0 \
        --output-format=json | $PY -c 'import json,sys; j=json.load(sys.stdin)["jobs"][0]["read"]
print("%s %.0f %.1f %.1f %.0f" % (sys.argv[1], j["iops"], j["lat_ns"]["mean"] / 1e3,
      j["clat_ns"]["percentile"]["99.000000"] / 1e3, j["bw_bytes"] / 1e6))' "$1"
}
snap() { $PY -m cachefs_cli.ctl stats "$D/$1" --json; }
snap mnt > "$D/mnt.before"; snap nopt > "$D/nopt.before"
{
fio_run "rand4k:raw-direct" "$D/raw/data" randread 4k 32
fio_run "rand4k:cachefs-passthrough" "$D/mnt/data" randread 4k 32
fio_run "rand4k:cachefs-no-passthrough" "$D/nopt/data" randread 4k 32
fio_run "rand4k:bare-pyfuse3-passthrough" "$D/pt/data" randread 4k 32
fio_run "seq1m:raw-direct" "$D/raw/data" read 1M 4
fio_run "seq1m:cachefs-passthrough" "$D/mnt/data" read 1M 4
fio_run "seq1m:cachefs-no-passthrough" "$D/nopt/data" read 1M 4
fio_run "seq1m:bare-pyfuse3-passthrough" "$D/pt/data" read 1M 4
} > "$D/results"
snap mnt > "$D/mnt.after"; snap nopt > "$D/nopt.after"
$PY - "$D" "$SIZE_MB" "$RUNTIME" <<'PYEOF'
import json, sys
d, size, runtime = sys.argv[1:]
rows = [l.split() for l in open(f"{d}/results")]
res = {r[0]: [float(x) for x in r[1:]] for r in rows}
print(f"fio, {size} MiB file fully cached, {runtime} s each, libaio direct=1; "
      "4 KiB random reads QD 32, 1 MiB sequential reads QD 4 (one run, ratios within it)\n")
print("| workload | system | IOPS | MB/s | mean lat us | p99 lat us | x raw | x bare pyfuse3 |")
print("|---|---|---:|---:|---:|---:|---:|---:|")
for name, (iops, mean, p99, mbs) in res.items():
    wl, system = name.split(":")
    raw, bare = res[f"{wl}:raw-direct"][0], res[f"{wl}:bare-pyfuse3-passthrough"][0]
    print(f"| {wl} | {system} | {iops:,.0f} | {mbs:,.0f} | {mean:.0f} | {p99:.0f} | "
          f"{iops / raw:.2f} | {iops / bare:.2f} |")
for m in ("mnt", "nopt"):
    a, b = json.load(open(f"{d}/{m}.before")), json.load(open(f"{d}/{m}.after"))
    dl = {k: b[k] - a[k] for k in ("read_ops", "hit_ops", "backing_read_ops",
                                   "passthrough_opens")}
    print(f"\n{'cachefs' if m == 'mnt' else 'cachefs --no-passthrough'} during its fio runs: "
          f"{dl['read_ops']} reads reached the daemon, {dl['hit_ops']} SSD hits, "
          f"{dl['backing_read_ops']} BACKING reads, {dl['passthrough_opens']} passthrough opens")
PYEOF
