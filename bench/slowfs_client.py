"""Client helpers for the slowfs emulator (bench/slowfs.py), for tests and benchmarks.

Owns talking to a running slowfs daemon through its control xattrs on the mount root and
the lifecycle of a throw-away mount (`mounted_slowfs`). Standard library only; it must not
import pyfuse3 or trio, so test processes stay light.

    from slowfs_client import mounted_slowfs, stats, set, reset
    with mounted_slowfs(src, mnt, latency_ms=20) as m:
        ...                       # m.mnt, m.source, m.proc, m.log_path
        print(stats(mnt)["read_ops"])
        set(mnt, eio=0.5)
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Iterator

SLOWFS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "slowfs.py")
XATTR_STATS = "user.slowfs.stats"
XATTR_SET = "user.slowfs.set"
XATTR_RESET = "user.slowfs.reset"


class MountError(RuntimeError):
    """The slowfs daemon did not become ready (message says why)."""


def stats(mnt: str | os.PathLike) -> dict:
    """Return the daemon's counters and current parameters (a JSON object)."""
    return json.loads(os.getxattr(mnt, XATTR_STATS))


def set(mnt: str | os.PathLike, **params: float) -> None:  # noqa: A001 (API name)
    """Change model parameters / fault switches, e.g. ``set(mnt, eio=0.1, hang=1)``.

    Raises:
        OSError: EINVAL if the daemon rejected a key or value (its log says which).
    """
    words = []
    for key, value in params.items():
        if isinstance(value, bool):
            value = int(value)
        words.append(f"{key}={value}")
    os.setxattr(mnt, XATTR_SET, " ".join(words).encode())


def reset(mnt: str | os.PathLike) -> None:
    """Zero the daemon's counters."""
    os.setxattr(mnt, XATTR_RESET, b"1")


def is_mounted(mnt: str | os.PathLike) -> bool:
    """True if *mnt* appears in /proc/self/mountinfo (also when its daemon is dead)."""
    target = os.path.abspath(mnt)
    with open("/proc/self/mountinfo", errors="surrogateescape") as f:
        for line in f:
            field = line.split()[4]
            field = (field.replace("\\040", " ").replace("\\011", "\t")
                     .replace("\\012", "\n").replace("\\134", "\\"))
            if field == target:
                return True
    return False


def wait_ready(mnt: str | os.PathLike, proc: subprocess.Popen, timeout_s: float = 15) -> None:
    """Wait until *mnt* is mounted and answers a stats call.

    Raises:
        MountError: the daemon exited, or the mount was not ready within timeout_s.
    """
    deadline = time.monotonic() + timeout_s
    delay = 0.01
    while True:
        rc = proc.poll()
        if rc is not None:
            raise MountError(f"slowfs daemon exited with status {rc} before {mnt} was ready")
        if os.path.ismount(mnt):
            try:
                stats(mnt)
                return
            except OSError:
                pass
        if time.monotonic() > deadline:
            raise MountError(f"slowfs on {mnt} not ready after {timeout_s:g} s")
        time.sleep(delay)
        delay = min(delay * 2, 0.1)


def unmount(mnt: str | os.PathLike, proc: subprocess.Popen | None = None,
            timeout_s: float = 20) -> None:
    """Unmount *mnt* (lazily if busy) and reap *proc*, killing it if it lingers."""
    mnt = os.fspath(mnt)
    try:
        if is_mounted(mnt):
            res = subprocess.run(["fusermount3", "-u", mnt], capture_output=True)
            if res.returncode != 0 and is_mounted(mnt):
                subprocess.run(["fusermount3", "-u", "-z", mnt], capture_output=True)
    finally:
        if proc is not None:
            try:
                proc.wait(timeout=timeout_s)    # fusermount3 returns before the daemon exits
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@dataclass
class Mounted:
    source: str
    mnt: str
    proc: subprocess.Popen
    log_path: str

    def stats(self) -> dict:
        return stats(self.mnt)

    def set(self, **params: float) -> None:
        set(self.mnt, **params)

    def reset(self) -> None:
        reset(self.mnt)

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()


@contextlib.contextmanager
def mounted_slowfs(source: str | os.PathLike, mnt: str | os.PathLike, *,
                   timeout_s: float = 15, log_path: str | None = None,
                   **params: float) -> Iterator[Mounted]:
    """Mount slowfs (``slowfs.py mount -f``) for the duration of a with-block.

    Args:
        params: model parameters / faults, as for ``set`` (e.g. ``latency_ms=20``).
        log_path: daemon output file (default: a temporary file, removed after the block unless
            the block raised or the daemon could not be mounted).

    Yields:
        a `Mounted` (source, mnt, proc, log_path, and stats/set/reset shortcuts).

    Raises:
        MountError: the daemon failed or was not ready in time (the log tail is included).
    """
    source, mnt = os.fspath(source), os.fspath(mnt)
    own_log = log_path is None
    if own_log:
        fd, log_path = tempfile.mkstemp(prefix="slowfs-", suffix=".log")
        os.close(fd)
    cmd = [sys.executable, SLOWFS, "mount", "-f"]
    for key, value in params.items():
        if isinstance(value, bool):
            value = int(value)
        cmd += ["--" + key.replace("_", "-"), str(value)]
    cmd += [source, mnt]
    with open(log_path, "ab") as logf:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf)
    try:
        try:
            wait_ready(mnt, proc, timeout_s)
        except MountError as exc:
            with open(log_path, errors="replace") as f:
                raise MountError(f"{exc}\n--- daemon log ---\n{f.read()[-4000:]}") from None
        yield Mounted(source, mnt, proc, log_path)
    except BaseException:
        own_log = False                 # a failed block keeps its log for inspection
        raise
    finally:
        unmount(mnt, proc)
        if own_log:
            os.unlink(log_path)
