"""Crash safety of write-back under every kind of file operation (issue 8, item 3).

Seeded rounds: on a few files, a random sequence of writes (random offsets and sizes, some
extending, some sub-4 KiB and unaligned), fallocates (allocating, punching and zeroing
ranges, some growing the file), truncates down and up (ftruncate, truncate by path,
O_TRUNC opens), renames (also over an existing file), unlinks (also of files still open),
fsyncs and fdatasyncs, reads, closes and reopens; then kill -9 of the daemon, either right
after the operations (after a random pause: before or after the next metadata commit and
destage) or while they are still running in a thread; remount, and check:

- the namespace is exactly BACKING's at the kill: cachefs performs BACKING's namespace
  operations synchronously, so the names are those after the last completed operation (or
  after the one in flight at the kill); an unlinked file never reappears, a renamed one is
  under its new name, a name replaced by a rename holds the file renamed onto it;
- every file's view is a state it had since its last fsync: its size is one of the sizes it
  had since then, and every 4 KiB block holds one of the versions that block had since then
  (a truncate down makes a new version of each block it cuts: zeros past the new end, and
  the truncate up that may follow reveals those zeros);
- `cachefs-ctl flush` succeeds, the view does not change, and after a clean unmount
  BACKING read directly holds exactly that view (names, sizes, bytes).

The model is checked on a plain directory too (test_model_accepts_a_plain_directory): there
every operation is real and nothing is lost, so any complaint would be a model bug; hence a
failure on cachefs is a cachefs bug.

Reproduce: CACHEFS_SEED=<seed printed in the failure> (CACHEFS_LONG=1 runs 50 rounds instead
of 6; CACHEFS_ROUNDS=N any number).
"""

from __future__ import annotations

import os
import random
import threading
import time
import traceback
from pathlib import Path

import pytest

from tests.conftest import (close_quietly, ctl_drop, ctl_flush, env_long, env_seed, tree_view,
                            wait_until)
from tests.mount.test_random_ops import FALLOC_MODES, fallocate, fallocate_works

BLK = 4096
NAMES = [f"f{i}" for i in range(5)]
MAX_SIZE = 768 * 1024
MAX_WRITE = 64 * 1024      # one FUSE request (no split mid-block), so one write is one change
MAX_HANDLES = 8
DEFAULT_SEED = 8003


def rounds() -> int:
    if os.environ.get("CACHEFS_ROUNDS"):
        return int(os.environ["CACHEFS_ROUNDS"])
    return 50 if env_long() else 6


# -- the model ---------------------------------------------------------------------------------

class FileState:
    """One file (an inode: it keeps its identity across renames and after unlink).

    `content` is what the file holds now; `sizes` every size it had since its last fsync;
    `old[b]` every version block b had since then (4 KiB, zero-padded past the end of the
    file), for the blocks that changed since; an unchanged block's only version is its
    current one.
    """

    _ids = 0

    def __init__(self, content: bytes = b""):
        FileState._ids += 1
        self.id = FileState._ids
        self.content = bytearray(content)
        self.sizes = {len(content)}
        self.old: dict[int, set[bytes]] = {}

    def __repr__(self) -> str:
        return f"<file #{self.id} {len(self.content)} B>"

    def block(self, b: int) -> bytes:
        return bytes(self.content[b * BLK:(b + 1) * BLK]).ljust(BLK, b"\0")

    def _change(self, off: int, end: int, mutate) -> None:
        blocks = range(off // BLK, (end + BLK - 1) // BLK)
        for b in blocks:
            if b not in self.old:
                self.old[b] = {self.block(b)}
        mutate()
        for b in blocks:
            self.old[b].add(self.block(b))
        self.sizes.add(len(self.content))

    def write(self, off: int, data: bytes) -> None:
        def mutate():
            if off > len(self.content):
                self.content.extend(bytes(off - len(self.content)))
            self.content[off:off + len(data)] = data
        self._change(off, off + len(data), mutate)

    def truncate(self, size: int) -> None:
        """Down: the blocks cut get a new version (zeros past `size`). Up: nothing changes in
        any block (past the end the model holds zeros), only the size."""
        old = len(self.content)

        def mutate():
            if size < old:
                del self.content[size:]
            else:
                self.content.extend(bytes(size - old))
        self._change(min(size, old), old if size < old else min(size, old), mutate)

    def fsynced(self) -> None:
        self.sizes = {len(self.content)}
        self.old.clear()

    def versions(self, b: int) -> set[bytes]:
        return self.old.get(b) or {self.block(b)}

    def check(self, name: str, size: int, data: bytes) -> list[str]:
        """What is wrong with a view (fstat size, bytes read) of this file after a crash."""
        errs = []
        if size != len(data):
            errs.append(f"{name}: fstat says {size} bytes, reading gave {len(data)}")
        if len(data) not in self.sizes:
            errs.append(f"{name}: size {len(data)} is none of the sizes the file had since "
                        f"its last fsync {sorted(self.sizes)}")
        for b in range((len(data) + BLK - 1) // BLK):
            got = data[b * BLK:(b + 1) * BLK]
            vs = self.versions(b)
            if not any(v[:len(got)] == got for v in vs):
                what = "zeros" if not got.strip(b"\0") else "data"
                now = "zeros" if not self.block(b).strip(b"\0") else "data"
                errs.append(f"{name}: block {b} [{b * BLK}, +{len(got)}) holds {what} that "
                            f"is none of its {len(vs)} versions since the last fsync "
                            f"(current: {now})")
                if len(errs) > 12:
                    break
        return errs


class Handle:
    def __init__(self, fd: int, f: FileState, name: str, direct: bool):
        self.fd, self.f, self.name, self.direct = fd, f, name, direct


class Runner:
    """Runs random operations on `root` and keeps the model: `ns` (name -> FileState) and the
    open handles. `pending` holds the namespace before an operation that has not returned
    (the kill may have come before or after it reached BACKING)."""

    def __init__(self, root: Path, rng: random.Random, direct_ok: bool):
        self.root = root
        self.rng = rng
        self.direct_ok = direct_ok
        self.ns: dict[str, FileState] = {}
        self.handles: list[Handle] = []
        self.trace: list[tuple] = []
        self.pending: dict[str, FileState] | None = None
        self.fallocate_ok: bool | None = None

    def p(self, name: str) -> str:
        return os.path.join(self.root, name)

    def open(self, name: str, extra: int = 0) -> Handle:
        direct = self.direct_ok and self.rng.random() < 0.5
        fd = os.open(self.p(name), os.O_RDWR | extra | (os.O_DIRECT if direct else 0), 0o644)
        h = Handle(fd, self.ns[name], name, direct)
        self.handles.append(h)
        return h

    def close_all(self) -> None:
        close_quietly(self.handles)

    def setup(self, nfiles: int) -> None:
        """Fresh files with random contents, fsynced: the durable starting point."""
        rng = self.rng
        for name in sorted(os.listdir(self.root)):
            os.unlink(self.p(name))
        self.ns.clear()
        if self.fallocate_ok is None:
            self.fallocate_ok = fallocate_works(self.root)
        for name in rng.sample(NAMES, nfiles):
            data = rng.randbytes(rng.choice([0, rng.randrange(1, 8192), rng.randrange(1, 600_000),
                                             rng.randrange(1, 150) * BLK]))
            fd = os.open(self.p(name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                for off in range(0, len(data), 1 << 20):
                    os.pwrite(fd, data[off:off + (1 << 20)], off)
                os.fsync(fd)
            finally:
                os.close(fd)
            self.ns[name] = FileState(data)
        self.trace.append(("setup", {n: len(f.content) for n, f in self.ns.items()}))

    def _write_args(self, f: FileState) -> tuple[int, int]:
        rng = self.rng
        size = len(f.content)
        n = rng.choice([rng.randrange(1, BLK), rng.randrange(1, BLK), BLK,
                        rng.randrange(1, MAX_WRITE + 1), rng.randrange(1, 17) * BLK])
        off = rng.choice([rng.randrange(0, size + 1), rng.randrange(0, size + 1) & ~(BLK - 1),
                          size, size + rng.randrange(1, 40_000)])
        off = min(off, MAX_SIZE - n)
        return off, n

    def step(self) -> None:
        rng = self.rng
        op = rng.choices(["write", "truncate", "otrunc", "create", "rename", "unlink", "fsync",
                          "close", "reopen", "read", "fallocate"],
                         [36, 10, 3, 4, 6, 5, 8, 4, 6, 8, 4])[0]
        names = sorted(self.ns)
        if op == "fallocate" and not self.fallocate_ok:
            op = "write"
        if op in ("write", "truncate", "fsync", "read", "close", "fallocate") and \
                not self.handles:
            op = "reopen"
        if op in ("reopen", "otrunc", "rename", "unlink") and not names:
            op = "create"
        if op == "create" and len(names) == len(NAMES):
            op = "write" if self.handles else "reopen"
        if len(self.handles) >= MAX_HANDLES and op in ("reopen", "otrunc", "create"):
            op = "close"
        before = dict(self.ns)
        self.pending = before
        if op == "write":
            h = rng.choice(self.handles)
            off, n = self._write_args(h.f)
            data = rng.randbytes(n)
            self.trace.append(("write", h.name, h.f.id, off, n))
            h.f.write(off, data)
            assert os.pwrite(h.fd, data, off) == n
        elif op == "truncate":
            h = rng.choice(self.handles)
            size = len(h.f.content)
            new = (rng.randrange(0, size + 1) if rng.random() < 0.6 or size >= MAX_SIZE
                   else min(MAX_SIZE, size + rng.randrange(1, 200_000)))
            by_path = h.name in self.ns and self.ns[h.name] is h.f and rng.random() < 0.3
            self.trace.append(("truncate" if by_path else "ftruncate", h.name, h.f.id, new))
            h.f.truncate(new)
            if by_path:
                os.truncate(self.p(h.name), new)
            else:
                os.ftruncate(h.fd, new)
        elif op == "fallocate":
            h = rng.choice(self.handles)
            mode = rng.choice(FALLOC_MODES)
            off, n = self._write_args(h.f)
            n = rng.choice([n, rng.randrange(1, 300_000)])
            end = min(off + n, MAX_SIZE)
            n = end - off
            if n <= 0:
                return
            self.trace.append(("fallocate", h.name, h.f.id, mode, off, n))
            if mode & 0x12:                         # PUNCH_HOLE, ZERO_RANGE: zeros
                hi = min(end, len(h.f.content))
                if off < hi:
                    h.f.write(off, bytes(hi - off))
            if not mode & 0x01 and end > len(h.f.content):
                h.f.truncate(end)                   # no KEEP_SIZE: the file may grow
            fallocate(h.fd, mode, off, n)
        elif op == "otrunc":
            name = rng.choice(names)
            self.trace.append(("open O_TRUNC", name, self.ns[name].id))
            self.ns[name].truncate(0)
            self.open(name, os.O_TRUNC)
        elif op == "create":
            name = rng.choice([n for n in NAMES if n not in self.ns])
            f = self.ns[name] = FileState()
            self.trace.append(("create", name, f.id))
            self.open(name, os.O_CREAT | os.O_EXCL)
        elif op == "rename":
            old = rng.choice(names)
            new = rng.choice([n for n in NAMES if n != old])
            self.trace.append(("rename", old, new, self.ns[old].id,
                               self.ns[new].id if new in self.ns else None))
            self.ns[new] = self.ns.pop(old)
            for h in self.handles:             # the names the handles were opened by, for
                if h.f is self.ns[new]:        # truncate by path (only while still true)
                    h.name = new
            os.rename(self.p(old), self.p(new))
        elif op == "unlink":
            name = rng.choice(names)
            self.trace.append(("unlink", name, self.ns[name].id,
                               sum(h.f is self.ns[name] for h in self.handles)))
            del self.ns[name]
            os.unlink(self.p(name))
        elif op == "fsync":
            h = rng.choice(self.handles)
            data_only = rng.random() < 0.4
            self.trace.append(("fdatasync" if data_only else "fsync", h.name, h.f.id))
            (os.fdatasync if data_only else os.fsync)(h.fd)
            h.f.fsynced()                      # only once it returned
        elif op == "read":
            h = rng.choice(self.handles)
            size = len(h.f.content)
            off = rng.randrange(0, size + 1)
            n = rng.choice([1, BLK, rng.randrange(1, 200_000)])
            self.trace.append(("read", h.name, h.f.id, off, n))
            got = os.pread(h.fd, n, off)
            want = bytes(h.f.content[off:off + n])
            if got != want and not getattr(self, "stopping", False):
                raise AssertionError(f"read of {h.name} (#{h.f.id}) [{off}, +{n}) of {size} "
                                     f"bytes returned {len(got)} bytes that differ from what "
                                     f"was written")
        elif op == "close":
            h = self.handles.pop(rng.randrange(len(self.handles)))
            self.trace.append(("close", h.name, h.f.id))
            os.close(h.fd)
        else:  # reopen: a fresh handle of an existing name
            name = rng.choice(names)
            self.trace.append(("open", name, self.ns[name].id))
            self.open(name)
        self.pending = None

    def candidates(self) -> list[dict[str, FileState]]:
        """The namespaces BACKING may hold now."""
        return [self.ns] if self.pending is None else [self.pending, self.ns]

    def trace_text(self, last: int = 60) -> str:
        lines = [repr(t) for t in self.trace[-last:]]
        if self.pending is not None:
            lines.append("(the last operation had not returned at the kill)")
        return "\n  ".join(lines)


def check_view(view: dict[str, tuple[int, bytes]], runner: Runner) -> list[str]:
    """Errors of a post-crash view against every namespace BACKING may hold; [] if one fits."""
    tried = []
    for ns in runner.candidates():
        if sorted(ns) != sorted(view):
            tried.append([f"names {sorted(view)} != {sorted(ns)} "
                          f"(ids {[(n, f.id) for n, f in sorted(ns.items())]})"])
            continue
        errs = []
        for name, (size, data) in view.items():
            errs += ns[name].check(name, size, data)
        if not errs:
            return []
        tried.append(errs)
    return [e for errs in tried for e in errs]


# -- targets: a cachefs mount, or (for the model's sanity check) a plain directory -------------

class MountTarget:
    direct_ok = True

    def __init__(self, m):
        self.m = m
        self.root = m.mnt

    def kill(self) -> None:
        self.m.kill()

    def restart_after_kill(self) -> None:
        self.m.start()

    def flush(self) -> None:
        ctl_flush(self.m)

    def drop(self) -> None:
        ctl_drop(self.m)

    def restart(self) -> None:
        self.m.restart()

    def recover(self) -> None:
        """After a failed round: a running mount again, whatever state the round left."""
        if self.m.proc is not None and self.m.proc.poll() is None:
            self.m.stop(check=False)
        self.m.cleanup()
        self.m.start()

    def backing_view_after_clean_stop(self) -> dict[str, tuple[int, bytes]]:
        self.m.stop()
        try:
            return tree_view(self.m.backing)
        finally:
            self.m.start()


class PlainTarget:
    """A plain directory: nothing is lost at a 'kill', so the view is the model's newest."""
    direct_ok = False

    def __init__(self, root: Path):
        self.root = root

    def kill(self) -> None:
        pass

    def restart_after_kill(self) -> None:
        pass

    flush = drop = restart = recover = restart_after_kill

    def backing_view_after_clean_stop(self) -> dict[str, tuple[int, bytes]]:
        return tree_view(self.root)


# -- the rounds --------------------------------------------------------------------------------

def run_round(target, seed: int) -> str:
    """One round; returns how the kill came (for the summary). Raises AssertionError with the
    seed and the trace on any failure."""
    holder: list = []
    try:
        return _run_round(target, seed, holder)
    except AssertionError as exc:
        if "reproduce with" in str(exc) or not holder:
            raise
        runner, how = holder
        raise AssertionError(f"seed {seed} ({how}): {exc}\nreproduce with CACHEFS_SEED={seed} "
                             f"CACHEFS_ROUNDS=1\noperations:\n  {runner.trace_text()}"
                             ) from None


def _run_round(target, seed: int, holder: list) -> str:
    rng = random.Random(seed)
    runner = Runner(target.root, rng, target.direct_ok)
    runner.setup(rng.randrange(2, 5))
    r = rng.random()
    if r < 0.4:
        target.flush()                          # clean cached data, overwritten in place
        if rng.random() < 0.5:
            target.drop()                       # nothing cached: fills from BACKING
    elif r < 0.55:
        target.restart()                        # a warm restart with dirty fsynced data
    nops = rng.randrange(15, 80)
    mode = rng.choice(["after", "after", "during"])
    delay = rng.choice([0, 0, 0.05, 0.4, 1.2, 2.2]) if mode == "after" \
        else rng.uniform(0.02, 1.5)
    how = f"kill {mode} the operations, {delay:.2f} s"
    holder += [runner, how]
    failure: list[str] = []

    def fail(msg: str) -> None:
        raise AssertionError(f"seed {seed} ({how}): {msg}\nreproduce with CACHEFS_SEED={seed} "
                             f"CACHEFS_ROUNDS=1\noperations:\n  {runner.trace_text()}")

    try:
        if mode == "after":
            for _ in range(nops):
                runner.step()
            if target.direct_ok:                # (a plain directory has nothing to wait for)
                time.sleep(delay)
            target.kill()
        else:
            stop = threading.Event()

            def work():
                try:
                    for _ in range(nops * 3):
                        if stop.is_set():
                            return
                        runner.step()
                except OSError as exc:
                    if not stop.is_set():
                        failure.append(f"{runner.trace[-1]} failed before the kill: {exc!r}")
                except AssertionError as exc:
                    if not stop.is_set():           # (a short write or read at the kill)
                        failure.append(str(exc))
                except BaseException:
                    failure.append(traceback.format_exc())

            t = threading.Thread(target=work, daemon=True)
            t.start()
            t.join(delay)
            runner.stopping = True
            stop.set()
            if not t.is_alive():
                holder[1] = how = how + " (all operations had returned)"
            target.kill()
            t.join(60)
            assert not t.is_alive(), "the operations thread hangs after the kill"
            if isinstance(target, PlainTarget) and runner.pending is not None:
                runner.pending = None           # nothing was interrupted there
            if failure:
                fail(failure[0])
    except OSError as exc:
        fail(f"{runner.trace[-1] if runner.trace else 'setup'} failed: {exc!r}")
    finally:
        runner.close_all()
    target.restart_after_kill()
    view = tree_view(target.root, direct=target.direct_ok)
    errs = check_view(view, runner)
    if errs:
        fail("after the remount, the view is not a state the files had since their last "
             "fsync:\n    " + "\n    ".join(errs[:20]))
    try:
        target.flush()
    except AssertionError as exc:
        fail(f"flush after recovery: {exc}")
    again = tree_view(target.root, direct=target.direct_ok)
    if again != view:
        fail("the view changed at the flush after recovery: "
             + describe_diff(view, again, "after the remount", "after the flush"))
    backing = target.backing_view_after_clean_stop()
    if backing != view:
        fail("after flush and a clean unmount BACKING differs from the view after the "
             "remount: " + describe_diff(view, backing, "view", "BACKING"))
    return how


def describe_diff(a: dict, b: dict, an: str, bn: str) -> str:
    if sorted(a) != sorted(b):
        return f"names {sorted(a)} ({an}) vs {sorted(b)} ({bn})"
    out = []
    for name in a:
        (sa, da), (sb, db) = a[name], b[name]
        if (sa, da) != (sb, db):
            first = next((i for i in range(min(len(da), len(db))) if da[i] != db[i]),
                         min(len(da), len(db)))
            out.append(f"{name}: {sa}/{len(da)} bytes ({an}) vs {sb}/{len(db)} bytes ({bn}), "
                       f"first difference at byte {first}")
    return "; ".join(out)


def seeds() -> list[int]:
    base = env_seed(DEFAULT_SEED)
    if os.environ.get("CACHEFS_SEED") and os.environ.get("CACHEFS_ROUNDS") == "1":
        return [base]
    return [base * 1000 + r for r in range(rounds())]


WB_ARGS = ("--mode", "write-back", "--attr-timeout", "0", "--cache-size", "16M",
           "--dirty-high", "4M", "--dirty-low", "2M", "--max-dirty-age", "1",
           "--promote-after", "1")


@pytest.mark.fuse
@pytest.mark.slow
def test_kill9_rounds_of_file_operations(make_mount):
    run_rounds(MountTarget(make_mount(*WB_ARGS)))


@pytest.mark.fuse
@pytest.mark.slow
def test_kill9_rounds_through_a_pool_much_smaller_than_the_data(make_mount):
    """Issue 15: the same rounds through a 1 MiB pool (the files hold up to 3.75 MiB) with a
    128 KiB dirty mark, so evictions, hole punching and destaging race the operations and
    the kill."""
    run_rounds(MountTarget(make_mount(
        "--mode", "write-back", "--attr-timeout", "0", "--cache-size", "1M",
        "--dirty-high", "128K", "--dirty-low", "64K", "--max-dirty-age", "1",
        "--promote-after", "1")), count=max(3, rounds() // 2))


def test_model_accepts_a_plain_directory(tmp_path):
    """The model's sanity check: the same rounds on a plain directory (where nothing is lost)
    pass, so a failure on cachefs is a cachefs bug, not a model bug."""
    run_rounds(PlainTarget(tmp_path))


def run_rounds(target, count: int | None = None) -> None:
    """Every round runs (the first `count`), even after a failing one (a mount again, fresh
    files); the failure lists each failing seed with its first problem, and the first
    failure in full."""
    failures: list[tuple[int, str]] = []
    done = []
    for seed in seeds()[:count]:
        try:
            done.append((seed, run_round(target, seed)))
        except AssertionError as exc:
            failures.append((seed, str(exc)))
            target.recover()
    print("rounds passed:", done)
    if failures:
        summary = "\n".join(f"  seed {seed}: {text.splitlines()[0][:400]}"
                             for seed, text in failures)
        pytest.fail(f"{len(failures)} of {len(failures) + len(done)} rounds failed:\n"
                    f"{summary}\n\nthe first in full:\n{failures[0][1]}", pytrace=False)


@pytest.mark.fuse
def test_kill9_after_truncate_shows_a_state_the_file_had(make_mount):
    """The deterministic case of issue 8: write 524,292 bytes and fsync; write 50,000 bytes
    at 300,000; ftruncate to 312,750; kill -9 (BACKING has the truncate); the remounted view
    is a state the file had since the fsync, and after a flush BACKING holds that view."""
    m = make_mount("--mode", "write-back", "--attr-timeout", "0", "--max-dirty-age", "100")
    rng = random.Random(8)
    f = FileState()
    runner = Runner(m.mnt, rng, direct_ok=False)
    runner.ns["f"] = f
    fd = os.open(m.path("f"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        data = rng.randbytes(524_292)
        for off in range(0, len(data), MAX_WRITE):
            os.pwrite(fd, data[off:off + MAX_WRITE], off)
            f.write(off, data[off:off + MAX_WRITE])
        os.fsync(fd)
        f.fsynced()
        more = rng.randbytes(50_000)
        os.pwrite(fd, more, 300_000)
        f.write(300_000, more)
        os.ftruncate(fd, 312_750)
        f.truncate(312_750)
        runner.trace += [("write 524,292 B", "fsync"), ("write", 300_000, 50_000),
                         ("ftruncate", 312_750)]
        assert os.stat(m.backing / "f").st_size == 312_750
        m.kill()
    finally:
        try:
            os.close(fd)
        except OSError:                 # ENOTCONN: the daemon is gone
            pass
    m.start()
    view = tree_view(m.mnt, direct=True)
    errs = check_view(view, runner)
    assert not errs, "after the remount: " + "; ".join(errs)
    ctl_flush(m)
    again = tree_view(m.mnt, direct=True)
    if again != view:
        pytest.fail("the view changed at the flush: " + describe_diff(
            view, again, "after the remount", "after the flush"))
    m.stop()
    backing = tree_view(m.backing)
    if backing != view:
        pytest.fail("BACKING after the flush differs from the view: " + describe_diff(
            view, backing, "view", "BACKING"))
    m.start()


@pytest.mark.fuse
@pytest.mark.parametrize("how", ["closed", "open", "written after unlink"])
def test_kill9_new_file_on_a_reused_inode_number_is_empty(make_mount, how):
    """Found by the rounds above: a file with committed dirty data is unlinked (while open or
    not), a new file gets its BACKING inode number, kill -9 before the next commit: the new
    file must be what it is (empty), not the dead file's dirty data or size. Also (seed 5036
    of the rounds): a file unlinked while open with nothing cached yet, then written through
    the open descriptor: its unlink needs the same guard."""
    m = make_mount("--mode", "write-back", "--attr-timeout", "0", "--max-dirty-age", "100")
    old = os.urandom(13_608)
    for attempt in range(20):
        fd = os.open(m.path("a"), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        ino = os.fstat(fd).st_ino
        if how == "written after unlink":
            os.unlink(m.path("a"))
        os.pwrite(fd, old, 0)
        commits = m.stats()["metadata_commits"]
        wait_until(lambda: m.stats()["metadata_commits"] > commits, 20, what="a commit")
        if how == "closed":
            os.close(fd)
        if how != "written after unlink":
            os.unlink(m.path("a"))
        if how != "closed":
            os.close(fd)
        fd = os.open(m.path("b"), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        os.close(fd)
        if os.stat(m.backing / "b").st_ino == ino:
            break
        os.unlink(m.path("b"))
    else:
        pytest.skip("BACKING never reused the inode number")
    m.kill()
    m.start()
    size, data = tree_view(m.mnt, direct=True)["b"]
    if (size, data) != (0, b""):
        pytest.fail(f"the new file b shows {size} bytes ({len(data)} read; the unlinked file "
                    f"a's bytes: {data == old}, all zeros: {not data.strip(bytes(1))}), a state "
                    f"the new file never had")
    ctl_flush(m)
    m.stop()
    assert os.stat(m.backing / "b").st_size == 0, "the flush wrote a's dirty data into b"
    m.start()
