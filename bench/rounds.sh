# Sourced by daemon_hits.sh and ab_trees.sh: a scratch directory whose mounts go at exit, fio
# 4 KiB random I/O (RW), O_DIRECT, libaio QD 32 on SIZE_MB of a file for RUNTIME seconds, and
# alternated rounds of two targets. Needs PY, RW, SIZE_MB, RUNTIME, ROUNDS set by the caller.

# scratch NAME MOUNT...: D, a new directory under /var/tmp; at exit its mounts D/MOUNT are
# unmounted (lazily if busy) and D is removed.
scratch() {
    D=$(mktemp -d "/var/tmp/$1.XXXX")
    shift
    SCRATCH_MOUNTS=("$@")
    trap _scratch_cleanup EXIT
}
_scratch_cleanup() {
    local m
    for m in "${SCRATCH_MOUNTS[@]}"; do
        grep -q " $D/$m fuse" /proc/mounts && { fusermount3 -u "$D/$m" || fusermount3 -u -z "$D/$m"; }
    done
    # fusermount3 -u returns before a daemon has exited: wait for them (they still write
    # their cache directories under $D), or the removal races them and leaves files behind.
    for _ in $(seq 60); do pgrep -f -- "$D/" > /dev/null || break; sleep 0.5; done
    rm -rf "$D"
}

fio_iops() {        # fio_iops FILE: prints the IOPS (reads and writes together)
    fio --name=x --filename="$1" --rw="$RW" --bs=4k --size="${SIZE_MB}M" --direct=1 \
        --ioengine=libaio --iodepth=32 --runtime="$RUNTIME" --time_based --invalidate=0 \
        --output-format=json | $PY -c 'import json,sys; j = json.load(sys.stdin)["jobs"][0]; print(round(j["read"]["iops"] + j["write"]["iops"]))'
}

# alternate NAME1 FILE1 NAME2 FILE2: ROUNDS rounds in ABBA order (on these machines one pair
# alone moves +-5 % and later runs tend to be faster); prints each round and the ratio of the
# sums, the first target's over the second's.
alternate() {
    local i a b
    for i in $(seq "$ROUNDS"); do
        if [ $((i % 2)) = 1 ]; then a=$(fio_iops "$2"); b=$(fio_iops "$4")
        else b=$(fio_iops "$4"); a=$(fio_iops "$2"); fi
        echo "$a $b"
    done | $PY -c '
import sys
n1, n2 = sys.argv[1:3]
rows = [tuple(map(int, l.split())) for l in sys.stdin]
for i, (a, b) in enumerate(rows, 1):
    print(f"round {i}: {n1} {a:,} IOPS, {n2} {b:,} IOPS, {a / b:.3f}x")
a, b = sum(r[0] for r in rows), sum(r[1] for r in rows)
print(f"all rounds: {a / len(rows):,.0f} vs {b / len(rows):,.0f} IOPS = {a / b:.3f}x")' "$1" "$3"
}
