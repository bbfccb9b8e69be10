#!/usr/bin/env bash
# Stress of the write-back and eviction paths with data many times the pool (issue 15):
# for DURATION seconds, rounds of the long tier of the fio-verify, random-operation and
# kill -9 tests through small pools, each round with new seeds. Stops at the first failure
# (its log is kept) and prints one line per round.
#   bash bench/stress.sh [DURATION_S] [LOG_DIR]        e.g. bash bench/stress.sh 1800
set -u
cd "$(dirname "$0")/.."
duration=${1:-1800}
logs=${2:-/var/tmp/cachefs-stress}
mkdir -p "$logs"
end=$(( $(date +%s) + duration ))
round=0
pass=0
while [ "$(date +%s)" -lt "$end" ]; do
  round=$((round + 1))
  seed=$(( $(date +%s) % 100000 + round ))
  log="$logs/round-$round.log"
  start=$(date +%s)
  if CACHEFS_LONG=1 CACHEFS_SEED=$seed python3 -m pytest -q -x -p no:cacheprovider \
       tests/mount/test_fio_verify.py \
       "tests/mount/test_random_ops.py::test_random_operations_through_a_pool_much_smaller_than_the_data" \
       "tests/crash/test_crash_ops.py::test_kill9_rounds_through_a_pool_much_smaller_than_the_data" \
       tests/mount/test_concurrency.py >"$log" 2>&1; then
    pass=$((pass + 1))
    echo "round $round (CACHEFS_SEED=$seed): passed in $(( $(date +%s) - start )) s: $(tail -n 1 "$log")"
    rm -f "$log"
  else
    echo "round $round (CACHEFS_SEED=$seed): FAILED, log in $log"
    tail -n 30 "$log"
    exit 1
  fi
done
echo "stress: $pass of $round rounds passed in $duration s"
