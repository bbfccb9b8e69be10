#!/usr/bin/env python3
"""Measure what the slowfs emulator costs in CPU, against the bare passthrough and SOURCE.

Runs fio 4k randread, iodepth 32, direct=1 (libaio) on one file through: the SOURCE
directory itself, bench/passthrough.py, slowfs with --latency-ms 0, and slowfs with its
defaults; prints IOPS, mean/p99 completion latency and the daemon's CPU % (utime+stime
from /proc/PID/stat over the fio run).

    python3 bench/cpu_cost.py [--dir /tmp/slowfs-cpu] [--size-mib 512] [--runtime 15]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from slowfs_client import mounted_slowfs, unmount  # noqa: E402

BENCH = os.path.dirname(os.path.abspath(__file__))
TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK      # utime + stime


def fio(path: str, size: int, runtime: int, pid: int | None) -> dict:
    cmd = ["fio", "--name=randread", f"--filename={path}", "--rw=randread", "--bs=4k",
           "--direct=1", "--ioengine=libaio", "--iodepth=32", f"--size={size}",
           f"--runtime={runtime}", "--time_based", "--randrepeat=0", "--invalidate=0",
           "--output-format=json"]
    c0, t0 = (cpu_s(pid) if pid else 0.0), time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    c1, t1 = (cpu_s(pid) if pid else 0.0), time.monotonic()
    job = json.loads(out[out.index("{"):])["jobs"][0]["read"]
    return {"iops": job["iops"], "clat_mean_ms": job["clat_ns"]["mean"] / 1e6,
            "clat_p99_ms": job["clat_ns"]["percentile"]["99.000000"] / 1e6,
            "daemon_cpu_pct": 100 * (c1 - c0) / (t1 - t0) if pid else None}


def show(name: str, r: dict) -> None:
    cpu = "-" if r["daemon_cpu_pct"] is None else f"{r['daemon_cpu_pct']:.0f} %"
    print(f"| {name:34} | {r['iops']:9.0f} | {r['clat_mean_ms']:8.2f} | "
          f"{r['clat_p99_ms']:8.2f} | {cpu:>8} |", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/slowfs-cpu")
    ap.add_argument("--size-mib", type=int, default=512)
    ap.add_argument("--runtime", type=int, default=15)
    args = ap.parse_args()
    src, mnt = os.path.join(args.dir, "src"), os.path.join(args.dir, "mnt")
    os.makedirs(src, exist_ok=True)
    os.makedirs(mnt, exist_ok=True)
    size = args.size_mib << 20
    data = os.path.join(src, "f")
    if not os.path.exists(data) or os.path.getsize(data) != size:
        with open(data, "wb") as f:
            for _ in range(args.size_mib):
                f.write(os.urandom(1 << 20))
    target = os.path.join(mnt, "f")
    print(f"fio 4k randread iodepth=32 direct=1 libaio, {args.size_mib} MiB file, "
          f"{args.runtime} s, {os.cpu_count()} CPUs")
    print("| target | IOPS | clat mean ms | clat p99 ms | daemon CPU |")
    print("|---|---|---|---|---|")
    show("SOURCE directory (page cache)", fio(data, size, args.runtime, None))

    proc = subprocess.Popen([sys.executable, os.path.join(BENCH, "passthrough.py"), "mount",
                             "-f", src, mnt])
    try:
        deadline = time.monotonic() + 15
        while not os.path.ismount(mnt):
            assert proc.poll() is None and time.monotonic() < deadline, "passthrough failed"
            time.sleep(0.02)
        show("passthrough.py", fio(target, size, args.runtime, proc.pid))
    finally:
        unmount(mnt, proc)

    for name, params in (("slowfs --latency-ms 0", {"latency_ms": 0}),
                         ("slowfs --latency-ms 0 --bandwidth-mbs 0",
                          {"latency_ms": 0, "bandwidth_mbs": 0}),
                         ("slowfs defaults", {})):
        with mounted_slowfs(src, mnt, **params) as m:
            show(name, fio(target, size, args.runtime, m.proc.pid))
    return 0


if __name__ == "__main__":
    sys.exit(main())
