#!/usr/bin/env bash
# Hits through the daemon (issue 16's target for partly cached files and read-write opens):
# cachefs --no-passthrough against the bare pyfuse3 passthrough (bench/passthrough.py) on
# 4 KiB random reads, O_DIRECT, libaio QD 32, of a fully cached file, in ROUNDS alternated
# rounds (ABBA order: on these machines a single pair moves +-5 % and later runs tend to be
# faster). Prints each round and the ratio of the sums.
#   bash bench/daemon_hits.sh [SIZE_MB] [RUNTIME_S] [ROUNDS]
# Writes instead (the issue's write-back target): RW=randwrite MODE=write-back bash ...
# (the bare daemon then writes a copy of the file, so that cachefs never sees its file change
# behind it; cachefs keeps its default dirty marks and write-back delay, so its destager
# runs during the later rounds).
# CACHEFS_OPTS="--no-fast-hits" adds options to the cachefs mount.
# BARE_PYTHONPATH=DIR runs the bare daemon with DIR first on PYTHONPATH: a pyfuse3 installed
# there without deps/passthrough/pyfuse3-queued-requests.patch gives the reference as the issue
# measured it (a stock pyfuse3 loop: two scheduler passes per request).
# Which I/O bypasses the page cache: none of the daemons' reads (O_DIRECT only makes every
# request reach the daemon, which preads its file from the page cache).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SIZE_MB=${1:-256}; RUNTIME=${2:-8}; ROUNDS=${3:-6}
RW=${RW:-randread}; MODE=${MODE:-write-through}
. bench/rounds.sh
scratch cachefs-dhits nopt pt
mkdir -p "$D/backing" "$D/cache" "$D/nopt" "$D/pt"
head -c "${SIZE_MB}M" /dev/urandom > "$D/backing/data"
BARE=data
if [ "$RW" != randread ]; then BARE=bare; cp "$D/backing/data" "$D/backing/bare"; fi
sync
$PY -m cachefs_cli.main mount --cache-dir "$D/cache" --cache-size $((SIZE_MB * 2))M \
    --mode "$MODE" --no-passthrough ${CACHEFS_OPTS:-} "$D/backing" "$D/nopt"
dd if="$D/nopt/data" of=/dev/null bs=1M iflag=direct status=none     # one read warms it
$PY bench/wait_cached.py "$D/nopt" $((SIZE_MB * 16)) 20 || true
PYTHONPATH=${BARE_PYTHONPATH:-${PYTHONPATH:-}} $PY bench/passthrough.py mount "$D/backing" "$D/pt"
alternate "cachefs --no-passthrough" "$D/nopt/data" "bare pyfuse3" "$D/pt/$BARE"
