#!/usr/bin/env python3
"""Soak (issue 17, item 7): for a set time, random steps against one cachefs mount whose
data is many times its pool and dirty limit, checking after each that nothing acknowledged
was lost and nothing garbage was served.

    python3 bench/soak.py [--minutes M] [--pool SIZE] [--seed N] [--work DIR]

Steps, drawn at random:
  fio     3 jobs of `fio --verify=crc32c` random writes (libaio, O_DIRECT, QD 8), each
          verifying what it wrote; the files are re-verified (`--verify_only`) after every
          remount and kill
  model   200 operations of the random-operation tester (tests/mount/test_random_ops.py:
          writes, truncates, renames, links, xattrs, mmap, O_DIRECT...) against its model
  flush   cachefs-ctl flush; drop   cachefs-ctl drop
  verify  cachefs-ctl verify (every block against its checksum: must exit 0)
  remount unmount and mount again in the other mode (write-through <-> write-back)
  kill    write-back only: fsync what the checks rely on, kill -9 the daemon, remount
After every step `cachefs-ctl verify` must find nothing wrong; after a remount or a kill the
fio files and the model's whole tree must read back as expected. Exit 1 at the first failure
(the work directory is kept), 0 with a summary table after the time is up.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
from tests.mount.test_random_ops import Model  # noqa: E402

PY = sys.executable
FIO_JOBS, FIO_MIB = 3, 24


class Soak:
    def __init__(self, work: str, pool: str, seed: int):
        self.work = work
        self.backing, self.cache, self.mnt = (os.path.join(work, d)
                                              for d in ("backing", "cache", "mnt"))
        for d in (self.backing, self.cache, self.mnt):
            os.makedirs(d, exist_ok=True)
        self.pool = pool
        self.rng = random.Random(seed)
        self.mode = "write-back"
        self.counts: dict[str, int] = {}
        self.fio_done = False
        self.model: Model | None = None

    # -- the mount -------------------------------------------------------------------------

    def mount(self) -> None:
        run([PY, "-m", "cachefs_cli.main", "mount", "--mode", self.mode, "--cache-dir",
             self.cache, "--cache-size", self.pool, "--dirty-high", "4M", "--dirty-low", "2M",
             "--max-dirty-age", "2", "--promote-after", "1", self.backing, self.mnt])

    def umount(self) -> None:
        run([PY, "-m", "cachefs_cli.main", "umount", self.mnt])

    def ctl(self, *args: str) -> dict:
        out = run([PY, "-m", "cachefs_cli.ctl", *args, self.mnt, "--json"])
        return json.loads(out.stdout)

    # -- steps -----------------------------------------------------------------------------

    def fio(self, verify_only: bool = False) -> None:
        os.makedirs(os.path.join(self.mnt, "fio"), exist_ok=True)
        run(["fio", "--name=soak", f"--directory={self.mnt}/fio", "--rw=randwrite",
             "--bs=4k", f"--size={FIO_MIB}M", f"--numjobs={FIO_JOBS}", "--ioengine=libaio",
             "--iodepth=8", "--direct=1", "--verify=crc32c", "--verify_fatal=1",
             "--fsync_on_close=1", "--group_reporting", "--output-format=terse",
             "--verify_state_save=0",
             *(["--verify_only"] if verify_only else [])])
        self.fio_done = True

    def model_steps(self) -> None:
        if self.model is None:
            os.makedirs(os.path.join(self.mnt, "model"), exist_ok=True)
            self.model = Model(os.path.join(self.mnt, "model"), self.rng, max_size=2 << 20)
        for _ in range(200):
            self.model.step()
        self.model.close_all()
        self.model.check_all(self.model.root)

    def remount(self) -> None:
        self.settle()
        self.umount()
        self.mode = "write-through" if self.mode == "write-back" else "write-back"
        self.mount()
        self.check_data()

    def kill(self) -> None:
        if self.mode != "write-back":
            return self.remount()
        self.settle()
        pid = self.ctl("stats")["pid"]
        os.kill(pid, signal.SIGKILL)
        while _alive(pid):
            time.sleep(0.05)
        subprocess.run(["fusermount3", "-u", "-z", self.mnt], capture_output=True)
        self.mount()
        self.check_data()

    def settle(self) -> None:
        """What the checks after a remount or kill rely on is closed and fsynced."""
        if self.model is not None:
            self.model.close_all()
            for name in self.model.files:
                fd = os.open(os.path.join(self.model.root, name), os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)

    def check_data(self) -> None:
        if self.fio_done:
            self.fio(verify_only=True)
        if self.model is not None:
            self.model.check_all(self.model.root)

    def verify(self) -> None:
        out = subprocess.run([PY, "-m", "cachefs_cli.ctl", "verify", self.mnt, "--json"],
                             capture_output=True, text=True)
        if out.returncode != 0:
            raise AssertionError(f"cachefs-ctl verify found damage: {out.stdout}{out.stderr}")

    def step(self) -> str:
        name = self.rng.choice(["fio", "fio", "model", "model", "model", "flush", "drop",
                                "verify", "remount", "kill", "kill"])
        {"fio": self.fio, "model": self.model_steps, "remount": self.remount,
         "kill": self.kill, "verify": self.verify,
         "flush": lambda: self.ctl("flush"), "drop": lambda: self.ctl("drop")}[name]()
        self.verify()
        self.counts[name] = self.counts.get(name, 0) + 1
        return name


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise AssertionError(f"{' '.join(cmd[:6])}... failed ({out.returncode}): "
                             f"{out.stdout[-2000:]}{out.stderr[-2000:]}")
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=60)
    ap.add_argument("--pool", default="16M", help="cache size (the data is many times it)")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--work", help="work directory (default: a new one in /var/tmp)")
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    work = args.work or tempfile.mkdtemp(prefix="cachefs-soak.", dir="/var/tmp")
    soak = Soak(work, args.pool, seed)
    soak.mount()
    t0 = time.monotonic()
    steps = 0
    try:
        while time.monotonic() - t0 < args.minutes * 60:
            name = soak.step()
            steps += 1
            print(f"{time.monotonic() - t0:7.1f} s  step {steps}: {name} ({soak.mode}) ok",
                  flush=True)
        soak.remount()                              # a last check from a fresh mount
    except Exception as exc:
        print(f"soak FAILED after {time.monotonic() - t0:.0f} s, {steps} steps (seed {seed}, "
              f"work {work}): {exc}", file=sys.stderr)
        subprocess.run(["fusermount3", "-u", "-z", soak.mnt], capture_output=True)
        return 1
    stats = soak.ctl("stats")
    soak.umount()
    print(f"\nsoak: {args.minutes:g} min, {steps} steps, seed {seed}, pool {args.pool}; "
          f"nothing lost, nothing garbage\n")
    print("| step | times |")
    print("|---|---:|")
    for name, n in sorted(soak.counts.items()):
        print(f"| {name} | {n} |")
    life = stats.get("lifetime") or stats
    print(f"\nall mounts of the run: {life['write_bytes'] / 2**20:,.0f} MiB written, "
          f"{life['read_bytes'] / 2**20:,.0f} MiB read, {life['destaged_bytes'] / 2**20:,.0f} "
          f"MiB destaged, {life['evictions']:,} evictions, {life['verified_blocks']:,} blocks "
          f"verified, checksum errors {life['checksum_errors']} clean / "
          f"{life['checksum_dirty_errors']} dirty")
    subprocess.run(["rm", "-rf", work])
    return 0


if __name__ == "__main__":
    sys.exit(main())
