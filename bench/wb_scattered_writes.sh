#!/bin/bash
# Write-back under scattered 4 KiB writes: random writes over a 1 GiB file through a 256 MiB
# pool, so every write needs a new extent while the dirty bytes stay under --dirty-low.
# Usage: bench/wb_scattered_writes.sh BINDIR LABEL   (BINDIR holds the cachefs commands to
# measure, e.g. the dirname of `command -v cachefs`, or another checkout's venv bin/)
set -e
D=/tmp/rwb-$2; mkdir -p $D/b $D/m $D/c
head -c 1G /dev/zero > $D/b/f 2>/dev/null || true
$1/cachefs mount --mode write-back --cache-dir $D/c --cache-size 256M $D/b $D/m
fio --name=rw --filename=$D/m/f --rw=randwrite --bs=4k --size=1G --direct=1 --ioengine=psync --runtime=30 --time_based --output-format=json 2>/dev/null | python3 -c "
import json,sys; j=json.load(sys.stdin)['jobs'][0]['write']; print('$2', 'IOPS %.0f' % j['iops'], 'p99 %.1f ms' % (j['clat_ns']['percentile']['99.000000']/1e6), 'max %.1f ms' % (j['clat_ns']['max']/1e6))"
$1/cachefs-ctl stats $D/m | grep -E "flow control|^dirty"
$1/cachefs umount --flush $D/m >/dev/null 2>&1
sleep 1; rm -rf $D
