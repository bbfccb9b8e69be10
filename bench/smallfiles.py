#!/usr/bin/env python3
"""Small files through cachefs (issue 16, item 7): `tar x` of 757 small files (Python's
`encodings`, `email`, `asyncio` and `json` packages, with their __pycache__) and `git clone`
of a local repository of a few thousand files, into the plain BACKING directory, through the
bare pyfuse3 passthrough (bench/passthrough.py: what Python FUSE costs with no cache logic)
and into cachefs over it (write-through and write-back), in one run.

    python3 bench/smallfiles.py [--rounds N] [--clone-files N] [--modes bare,write-through,...]

`--modes c=PATH,...` adds a C FUSE daemon run as `PATH BACKING MNT`: libfuse's own
passthrough_hp (`bash bench/c_passthrough.sh` builds it and prints its path), what FUSE
itself costs per file with a daemon in C.

BACKING is a plain directory here (no slow-disk emulator): what is measured is what cachefs
adds per file. Each figure is the median of N rounds, each into a fresh directory; the
page cache is warm for the sources (they are read once before). Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
PACKAGES = ("encodings", "email", "asyncio", "json")


def run(cmd: list[str], **kw) -> None:
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, **kw)


def make_tar(work: str) -> str:
    tar = os.path.join(work, "small.tar")
    run(["tar", "cf", tar, "-C", sysconfig.get_paths()["stdlib"], *PACKAGES])
    return tar


def make_repo(work: str, nfiles: int) -> str:
    """A local git repository of `nfiles` small files (copies of the stdlib's .py files)."""
    repo = os.path.join(work, "repo")
    os.makedirs(repo)
    lib = sysconfig.get_paths()["stdlib"]
    n = 0
    for root, dirs, files in os.walk(lib):
        dirs[:] = [d for d in dirs if d not in ("site-packages", "__pycache__", "test")]
        for f in files:
            if not f.endswith(".py") or n >= nfiles:
                continue
            rel = os.path.relpath(os.path.join(root, f), lib)
            os.makedirs(os.path.join(repo, os.path.dirname(rel)), exist_ok=True)
            shutil.copyfile(os.path.join(root, f), os.path.join(repo, rel))
            n += 1
    env = dict(os.environ, GIT_AUTHOR_NAME="b", GIT_AUTHOR_EMAIL="b@b",
               GIT_COMMITTER_NAME="b", GIT_COMMITTER_EMAIL="b@b")
    run(["git", "init", "-q", repo])
    run(["git", "-C", repo, "add", "-A"])
    run(["git", "-C", repo, "commit", "-q", "-m", "files"], env=env)
    return repo


def timed(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    run(cmd)
    return time.perf_counter() - t0


def _code(target: str) -> tuple[str, dict | None]:
    """MODE@DIR: MODE run with the cachefs source tree DIR first on PYTHONPATH (a checkout
    with `ln -s cli cachefs_cli`), to compare two versions in one run."""
    mode, _, tree = target.partition("@")
    return mode, (dict(os.environ, PYTHONPATH=tree) if tree else None)


def _mounted(mnt: str) -> bool:
    with open("/proc/self/mounts", errors="surrogateescape") as f:
        return any(line.split()[1] == mnt for line in f)


def mount(backing: str, cache: str, mnt: str, target: str) -> None:
    if target == "bare":                        # the bare pyfuse3 passthrough: Python FUSE's floor
        run([sys.executable, os.path.join(HERE, "passthrough.py"), "mount", backing, mnt])
        return
    if target.startswith("c="):                 # a C daemon (it daemonizes once mounted)
        run([target[2:], backing, mnt])
        deadline = time.monotonic() + 10
        while not _mounted(mnt):
            if time.monotonic() > deadline:
                raise SystemExit(f"{target[2:]} did not mount {mnt} within 10 s")
            time.sleep(0.02)
        return
    mode, env = _code(target)
    run([sys.executable, "-m", "cachefs_cli.main", "mount", "--mode", mode, "--cache-dir",
         cache, backing, mnt], env=env)


def umount(mnt: str, target: str) -> None:
    if target == "bare" or target.startswith("c="):
        run(["fusermount3", "-u", mnt])
        while _mounted(mnt):
            time.sleep(0.02)
        return
    run([sys.executable, "-m", "cachefs_cli.main", "umount", mnt], env=_code(target)[1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clone-files", type=int, default=3000)
    ap.add_argument("--modes", default="bare,write-through,write-back",
                    help="targets beside the plain directory; bare is bench/passthrough.py; "
                    "MODE@DIR runs MODE from the source tree DIR; c=PATH a C FUSE daemon "
                    "run as PATH BACKING MNT")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="cachefs-small.", dir="/var/tmp")
    try:
        tar = make_tar(work)
        repo = make_repo(work, args.clone_files)
        nfiles = int(subprocess.run(["git", "-C", repo, "ls-files"], capture_output=True,
                                    text=True).stdout.count("\n"))
        run(["tar", "tf", tar])
        ops = {
            "tar x": lambda dst: ["tar", "xf", tar, "-C", dst],
            "git clone": lambda dst: ["git", "clone", "-q", repo, os.path.join(dst, "r")],
        }
        results: dict[str, dict[str, list[float]]] = {}
        # Round-robin over the targets, and nothing deleted until the end: ext4 skips the
        # inodes of files deleted in the last ~30 s when it allocates new ones (perf:
        # `recently_deleted` under ext4_create), so creates right after an rmtree of the
        # previous round's tree cost up to ~1 ms each, whoever makes them.
        for i in range(args.rounds):
            for target in ["plain", *args.modes.split(",")]:
                for op, cmd in ops.items():
                    base = tempfile.mkdtemp(dir=work)
                    backing = os.path.join(base, "backing")
                    os.makedirs(backing)
                    dst = backing
                    if target != "plain":
                        dst = os.path.join(base, "mnt")
                        os.makedirs(dst)
                        mount(backing, os.path.join(base, "cache"), dst, target)
                    try:
                        t = timed(cmd(dst))
                    finally:
                        if target != "plain":
                            umount(dst, target)
                    results.setdefault(op, {}).setdefault(target, []).append(t)
        print(f"tar x: {len(PACKAGES)} stdlib packages, 757 files; git clone: a local "
              f"repository of {nfiles} files; median of {args.rounds} rounds (s)\n")
        names = ["C " + os.path.basename(m[2:]) if m.startswith("c=") else m
                 for m in args.modes.split(",")]
        print("| operation | plain BACKING | " + " | ".join(names) + " |")
        print("|---|---:|" + "---:|" * len(args.modes.split(",")))
        for op, by in results.items():
            plain = statistics.median(by["plain"])
            cells = [f"{plain:.2f}"]
            for mode in args.modes.split(","):
                t = statistics.median(by[mode])
                cells.append(f"{t:.2f} ({t / plain:.1f}x)")
            print(f"| {op} | " + " | ".join(cells) + " |")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
