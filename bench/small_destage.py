#!/usr/bin/env python3
"""Destaging many small files: write-back over the emulator (bench/slowfs.py, its default
model: 5 ms a random request, 8 in service), FILES files of 4 KiB written through the mount
with destaging held off, then `cachefs-ctl flush` timed. Every file is checked on BACKING.

    python3 bench/small_destage.py [--files 500] [--rounds 3] [--trees TREE,...]

--trees: source trees to compare in one run (a checkout or `git archive` of cachefs/ and
cli/ with `ln -s cli cachefs_cli`), alternated round by round; default: this tree.
Which I/O bypasses the page cache: BACKING's (the emulator charges every request its model
time, page cache or not); the cache directory's does not.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from slowfs_client import mounted_slowfs  # noqa: E402


def one_round(tree: str, files: int) -> tuple[float, float]:
    """(seconds to write, seconds to flush) for one fresh mount of `tree`."""
    env = {**os.environ, "PYTHONPATH": tree}
    cachefs = [sys.executable, "-m", "cachefs_cli.main"]
    ctl = [sys.executable, "-m", "cachefs_cli.ctl"]
    d = tempfile.mkdtemp(prefix="small-destage-")
    src, slow, cache, mnt = (os.path.join(d, x) for x in ("src", "slow", "cache", "mnt"))
    for p in (src, slow, cache, mnt):
        os.mkdir(p)
    try:
        with mounted_slowfs(src, slow):
            subprocess.run([*cachefs, "mount", slow, mnt, "--cache-dir", cache,
                            "--cache-size", "1G", "--mode", "write-back",
                            "--max-dirty-age", "600"], check=True, env=env, cwd="/tmp")
            try:
                data = os.urandom(4096)
                t = time.monotonic()
                for i in range(files):
                    with open(f"{mnt}/f{i}", "wb") as f:
                        f.write(data)
                written = time.monotonic() - t
                t = time.monotonic()
                subprocess.run([*ctl, "flush", mnt], check=True, capture_output=True,
                               env=env, cwd="/tmp")
                flushed = time.monotonic() - t
                for i in range(files):
                    with open(f"{src}/f{i}", "rb") as f:
                        if f.read() != data:
                            sys.exit(f"small_destage.py: {src}/f{i} is not what was written")
            finally:
                subprocess.run(["fusermount3", "-u", mnt], check=False)
                for _ in range(100):            # the daemon exits after the unmount
                    if subprocess.run(["pgrep", "-f", f"--cache-dir {cache} "],
                                      capture_output=True).returncode:
                        break
                    time.sleep(0.1)
        return written, flushed
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--trees", default=os.path.dirname(HERE))
    args = ap.parse_args()
    trees = [os.path.abspath(t) for t in args.trees.split(",")]
    results: dict[str, list[float]] = {t: [] for t in trees}
    for r in range(args.rounds):
        for tree in trees if r % 2 == 0 else trees[::-1]:
            written, flushed = one_round(tree, args.files)
            results[tree].append(flushed)
            print(f"round {r + 1} {tree}: written in {written:.2f} s, flushed in "
                  f"{flushed:.2f} s ({args.files / flushed:.0f} files/s)", flush=True)
    for tree, times in results.items():
        med = statistics.median(times)
        print(f"{tree}: median flush {med:.2f} s = {args.files / med:.0f} files/s")


if __name__ == "__main__":
    main()
