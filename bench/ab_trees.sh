#!/usr/bin/env bash
# Two versions of cachefs in one run: this tree against another source tree OLD (a checkout
# or `git archive` of cachefs/ and cli/ with `ln -s cli cachefs_cli`), both `--no-passthrough`,
# fio 4 KiB random I/O, O_DIRECT, libaio QD 32 on a fully cached file, ROUNDS alternated rounds
# (ABBA: one pair alone moves +-5 % on these machines). Prints each round and the ratio.
#   bash bench/ab_trees.sh OLD [SIZE_MB] [RUNTIME_S] [ROUNDS]
#   RW=randwrite MODE=write-back bash bench/ab_trees.sh /tmp/old
# The daemons run from /tmp so that the working directory does not shadow PYTHONPATH.
# Which I/O bypasses the page cache: none of the daemons' (they pread/pwrite their files).
set -euo pipefail
OLD=$(cd "${1:?usage: ab_trees.sh OLD_TREE [SIZE_MB] [RUNTIME_S] [ROUNDS]}" && pwd)
NEW=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
SIZE_MB=${2:-256}; RUNTIME=${3:-6}; ROUNDS=${4:-4}
RW=${RW:-randread}; MODE=${MODE:-write-through}
[ -d "$OLD/cachefs" ] && [ -e "$OLD/cachefs_cli" ] \
    || { echo "ab_trees.sh: $OLD has no cachefs/ and cachefs_cli (ln -s cli cachefs_cli)." >&2; exit 2; }
. "$NEW/bench/rounds.sh"
scratch cachefs-ab m-old m-new
cd /tmp
for v in old new; do
    mkdir -p "$D/b-$v" "$D/c-$v" "$D/m-$v"
    head -c "${SIZE_MB}M" /dev/urandom > "$D/b-$v/data"
    tree=$OLD; [ $v = new ] && tree=$NEW
    PYTHONPATH=$tree $PY -m cachefs_cli.main mount --cache-dir "$D/c-$v" \
        --cache-size $((SIZE_MB * 2))M --mode "$MODE" --no-passthrough "$D/b-$v" "$D/m-$v"
    dd if="$D/m-$v/data" of=/dev/null bs=1M iflag=direct status=none     # one read warms it
    PYTHONPATH=$tree $PY "$NEW/bench/wait_cached.py" "$D/m-$v" $((SIZE_MB * 16)) 20 || true
done
echo "$RW $MODE:"
alternate new "$D/m-new/data" old "$D/m-old/data"
