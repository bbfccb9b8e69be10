#!/usr/bin/env bash
# Measure 4 KiB random reads (fio, libaio, QD 32) on a 1 GiB file through demo_passthrough.py
# with FUSE passthrough on and off, plus the raw directory as reference. Counts the READ
# requests that reach the daemon. Needs root and the patched pyfuse3 (build.sh).
#   bench_passthrough.sh [PYTHON] [WORKDIR] [RUNTIME_S]
# Defaults: /var/tmp/pt-build/venv/bin/python, /var/tmp/pt-build/bench, 20.
# Writes WORKDIR/results.md (a table) and WORKDIR/<run>.fio.json / <run>.daemon.json.
set -euo pipefail
PY=${1:-/var/tmp/pt-build/venv/bin/python}
WORK=${2:-/var/tmp/pt-build/bench}
RUNTIME=${3:-20}
HERE=$(cd "$(dirname "$0")" && pwd)
SRC=$WORK/src MNT=$WORK/mnt
DAEMON_PID=

die() { echo "bench_passthrough.sh: $*" >&2; exit 1; }
cleanup() {
    if mountpoint -q "$MNT" 2>/dev/null; then fusermount3 -u "$MNT" || umount -l "$MNT" || true; fi
    if [ -n "$DAEMON_PID" ] && kill -0 "$DAEMON_PID" 2>/dev/null; then kill "$DAEMON_PID" || true; fi
}
trap cleanup EXIT

[ "$(id -u)" = 0 ] || die "needs root (FUSE passthrough needs CAP_SYS_ADMIN)"
command -v fio >/dev/null || die "fio not found (apt-get install fio)"
"$PY" -c 'import pyfuse3; pyfuse3.passthrough_open' 2>/dev/null || die "$PY has no patched pyfuse3 (run build.sh)"
mkdir -p "$SRC" "$MNT"
if [ "$(stat -c %s "$SRC/big.bin" 2>/dev/null || echo 0)" != 1073741824 ]; then
    dd if=/dev/urandom of="$SRC/big.bin" bs=1M count=1024 status=none
fi

FIO_COMMON=(--name=randread --rw=randread --bs=4k --ioengine=libaio --iodepth=32 --numjobs=1
            --runtime="$RUNTIME" --time_based --size=1G --invalidate=0 --group_reporting --output-format=json)

cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }

# run NAME DIRECT DAEMON-ARGS... (no daemon args and NAME=raw*: fio on SRC directly)
run() {
    local name=$1 direct=$2; shift 2
    local target=$MNT/big.bin
    if [[ $name == raw* ]]; then
        target=$SRC/big.bin
    else
        "$PY" "$HERE/demo_passthrough.py" "$SRC" "$MNT" "$@" > "$WORK/$name.daemon.json" 2> "$WORK/$name.daemon.err" &
        DAEMON_PID=$!
        for _ in $(seq 100); do mountpoint -q "$MNT" && break; sleep 0.05; done
        mountpoint -q "$MNT" || die "$name: the demo did not mount (see $WORK/$name.daemon.err)"
        # allow more than the kernel's default 12 async requests in flight (as cachefs' bench does)
        echo 64 > "/sys/fs/fuse/connections/$(mountpoint -d "$MNT" | cut -d: -f2)/max_background"
    fi
    local t0; [ -n "$DAEMON_PID" ] && t0=$(cpu_ticks "$DAEMON_PID")
    fio "${FIO_COMMON[@]}" --direct="$direct" --filename="$target" > "$WORK/$name.fio.json" \
        || die "$name: fio failed (see $WORK/$name.fio.json)"
    local cpu=-
    if [ -n "$DAEMON_PID" ]; then
        cpu=$(( $(cpu_ticks "$DAEMON_PID") - t0 ))
        fusermount3 -u "$MNT"; wait "$DAEMON_PID" || die "$name: the demo failed (see $WORK/$name.daemon.err)"
        DAEMON_PID=
    fi
    "$PY" - "$WORK" "$name" "$direct" "$cpu" "$RUNTIME" "$*" <<'EOF'
import json, os, sys
work, name, direct, cpu, runtime, args = sys.argv[1:]
r = json.load(open(f'{work}/{name}.fio.json'))['jobs'][0]['read']
d = {}
if os.path.exists(f'{work}/{name}.daemon.json'):
    d = json.loads(open(f'{work}/{name}.daemon.json').read().strip().splitlines()[-1])
hz = os.sysconf('SC_CLK_TCK')
cpu_pct = '-' if cpu == '-' else f'{100 * int(cpu) / hz / int(runtime):.0f} %'
row = (f"| {name} | {args or '-'} | {direct} | {r['iops']:,.0f} | {r['clat_ns']['mean'] / 1000:,.0f} | "
       f"{r['clat_ns']['percentile']['99.000000'] / 1000:,.0f} | {r['total_ios']:,} | "
       f"{d.get('read', '-') if not d else format(d['read'], ',')} | {d.get('passthrough_open', '-')} | {cpu_pct} |")
print(row)
with open(f'{work}/results.md', 'a') as f:
    f.write(row + '\n')
EOF
}

: > "$WORK/results.md"
{
    echo "fio: $(fio --version), randread 4k, libaio, iodepth 32, ${RUNTIME} s, 1 GiB file; kernel $(uname -r)"
    echo
    echo "| run | demo options | fio direct | IOPS | mean clat us | p99 clat us | fio reads | READs at daemon | passthrough opens | daemon CPU |"
    echo "|---|---|---|---|---|---|---|---|---|---|"
} >> "$WORK/results.md"
cat "$WORK/results.md"
cat "$SRC/big.bin" > /dev/null                      # warm the page cache for the buffered runs
run raw-direct 1
run passthrough 1
run no-passthrough 1 --no-passthrough
run no-passthrough-odirect 1 --no-passthrough --honor-odirect
run raw-buffered 0
run passthrough-buffered 0
echo "results in $WORK/results.md"
