#!/usr/bin/env python3
"""Latency of cache hits while eviction runs (issue #10: durable commits off the event loop).

    python3 bench/hit_under_eviction.py [--runtime S] [--size MIB] [--mode MODE]

One cachefs mount over the slowfs emulator, with a pool of 1/4 of a large file: fio reads
the large file with zipf-hot's pattern (4 KiB random, Zipf 1.2, iodepth 32), so promotions
evict all the time and every commit punches holes (a synchronous=FULL SQLite commit each
second), while a second fio job reads a small pinned file (every read a hit) at iodepth 1:
its latency percentiles are those of hits while eviction runs. Prints one markdown table
row per job and the cachefs counters of the measured window. Everything is unmounted at the
end, also on failure (directories under /var/tmp/cachefs-hitlat.*).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH)
import slowfs_client  # noqa: E402

CACHEFS = [sys.executable, "-m", "cachefs_cli.main"]
CTL = [sys.executable, "-m", "cachefs_cli.ctl"]
MiB = 1 << 20


def ctl(*args: str) -> dict:
    res = subprocess.run([*CTL, *args, "--json"], capture_output=True, text=True, timeout=600,
                         check=True)
    try:
        return json.loads(res.stdout)                    # stats: one JSON document
    except json.JSONDecodeError:                         # pin: progress lines, then the answer
        return json.loads(res.stdout.strip().splitlines()[-1])


def measure(args: argparse.Namespace, mnt: str, d: str) -> None:
    ctl("pin", os.path.join(mnt, "hot"))         # every read of it is a hit
    out = os.path.join(d, "fio.json")
    before: dict = {}

    def sample() -> None:
        before.update(ctl("stats", mnt))
    timer = threading.Timer(args.ramp, sample)
    timer.start()
    subprocess.run([
        "fio", "--output-format=json", f"--output={out}", "--ioengine=libaio",
        "--direct=1", "--bs=4k", "--rw=randread", "--time_based=1",
        f"--runtime={args.runtime}", f"--ramp_time={args.ramp}", "--thread=1",
        "--randrepeat=0", "--invalidate=0", "--lat_percentiles=1",
        "--name=zipf", f"--filename={os.path.join(mnt, 'big')}",
        f"--size={args.size * MiB}", "--iodepth=32", "--random_distribution=zipf:1.2",
        "--name=hits", f"--filename={os.path.join(mnt, 'hot')}", f"--size={16 * MiB}",
        "--iodepth=1"], check=True, timeout=args.ramp + args.runtime + 300)
    timer.join()
    after = ctl("stats", mnt)
    with open(out) as f:
        jobs = {j["jobname"]: j["read"] for j in json.load(f)["jobs"]}
    print(f"| job | IOPS | p50 ms | p90 ms | p99 ms | p99.9 ms | max ms |  "
          f"({args.mode}, {args.size} MiB file, pool {args.size // 4} MiB, "
          f"{args.runtime} s after {args.ramp} s ramp)")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, r in jobs.items():
        pct = r["lat_ns"]["percentile"]
        print(f"| {name} | {r['iops']:,.0f} | " + " | ".join(
            f"{pct[k] / 1e6:.2f}" for k in ("50.000000", "90.000000", "99.000000",
                                             "99.900000"))
            + f" | {r['lat_ns']['max'] / 1e6:.1f} |")
    print("cachefs in the window: " + ", ".join(
        f"{k} {after[k] - before.get(k, 0)}" for k in (
            "hit_ops", "miss_ops", "evictions", "metadata_commits", "promotions")
        if k in after))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runtime", type=int, default=20)
    p.add_argument("--ramp", type=int, default=20)
    p.add_argument("--size", type=int, default=1024, help="large file, MiB")
    p.add_argument("--mode", default="write-through")
    args = p.parse_args()
    d = tempfile.mkdtemp(prefix="cachefs-hitlat.", dir="/var/tmp")
    src, slow, cache, mnt = (os.path.join(d, n) for n in ("src", "slow", "cache", "mnt"))
    for x in (src, slow, cache, mnt):
        os.mkdir(x)
    with open(os.path.join(src, "big"), "wb") as f:
        for _ in range(args.size):
            f.write(os.urandom(MiB))
    with open(os.path.join(src, "hot"), "wb") as f:
        f.write(os.urandom(16 * MiB))
    mounted = False
    try:
        with slowfs_client.mounted_slowfs(src, slow, log_path=os.path.join(d, "slowfs.log")):
            try:
                subprocess.run([*CACHEFS, "mount", "--mode", args.mode, "--cache-dir", cache,
                                "--cache-size", f"{args.size // 4}M", slow, mnt],
                               check=True, timeout=180)
                mounted = True
                measure(args, mnt, d)
            finally:
                if mounted:
                    subprocess.run([*CACHEFS, "umount", mnt], capture_output=True,
                                   timeout=300)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
