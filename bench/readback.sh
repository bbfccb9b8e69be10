#!/usr/bin/env bash
# Files written through a write-through mount and read back once (git, compilers, a build
# after an extract): the first read of each is a miss whose bytes BACKING's page cache holds.
# Writes N files of SIZE_KB, then times their first read back. With TREE, that cachefs
# source tree (ln -s cli cachefs_cli in it) runs instead of the installed one, to compare two
# versions in one run:   bash bench/readback.sh [N] [SIZE_KB] [TREE]
# Which I/O bypasses the page cache: none (BACKING is a local directory).
set -euo pipefail
N=${1:-2000}; SIZE_KB=${2:-16}; TREE=${3:-}
PY=${PYTHON:-python3}
cd /tmp                           # so that the working directory does not shadow PYTHONPATH
D=$(mktemp -d /var/tmp/cachefs-readback.XXXX); mkdir -p "$D/b" "$D/c" "$D/m"
cleanup() { fusermount3 -u "$D/m" 2>/dev/null || true; sleep 1; rm -rf "$D"; }
trap cleanup EXIT
PYTHONPATH=${TREE:-${PYTHONPATH:-}} $PY -m cachefs_cli.main mount --cache-dir "$D/c" "$D/b" "$D/m"
$PY - "$D/m" "$N" "$SIZE_KB" <<'PY'
import os, sys, time
m, n, kb = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
blob = os.urandom(kb * 1024)
for i in range(n):
    with open(f"{m}/f{i}", "wb") as f:
        f.write(blob)
t = time.perf_counter()
for i in range(n):
    with open(f"{m}/f{i}", "rb") as f:
        assert f.read() == blob
print(f"read back {n} files of {kb} KiB: {time.perf_counter() - t:.3f} s")
PY
