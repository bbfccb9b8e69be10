"""A seeded random mix of reads, writes, truncates, fallocates (allocate, punch, zero), seeks
for data and holes, renames, unlinks, reopenings and xattrs over
a few files, checked against an in-memory model, with a small cache so promotion, eviction and
in-place updates all happen, and remounts in the middle.

Handles are O_RDWR, O_RDONLY, O_WRONLY and O_WRONLY|O_APPEND (appending to a file whose data
is not cached is the write-back case that needs BACKING's bytes of a partial block), some with
O_DIRECT. A handle keeps its file across renames and unlinks: an unlinked file stays readable,
writable, fstat-able and has xattrs through its descriptors (the model keeps files apart from
the namespace). xattrs are set, read, listed and removed by descriptor (and sometimes by
path). The model is checked on a plain directory too (test_model_accepts_a_plain_directory),
so a failure on cachefs is a cachefs bug, not a model bug.
"""

from __future__ import annotations

import ctypes
import errno
import os
import random

import pytest

from tests.conftest import close_quietly, env_long, env_seed, flush_all, pread_aligned

NAMES = [f"file{i}" for i in range(6)]
MAX_SIZE = 600 * 1024
XATTRS = ["user.a", "user.b", "user.c"]
MAX_HANDLES = 10


# fallocate(2) modes the kernel passes to FUSE: default, KEEP_SIZE, PUNCH_HOLE|KEEP_SIZE,
# ZERO_RANGE, ZERO_RANGE|KEEP_SIZE
FALLOC_MODES = [0, 0x01, 0x03, 0x10, 0x11]
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong)


def fallocate(fd: int, mode: int, off: int, size: int) -> None:
    if _libc.fallocate(fd, mode, off, size) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def fallocate_works(root) -> bool:
    """Whether `root` takes fallocate(2) (a cachefs on a pyfuse3 without deps/passthrough's
    fallocate patch does not: the kernel answers EOPNOTSUPP)."""
    p = os.path.join(root, ".fallocate-probe")
    fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fallocate(fd, 0x03, 0, 4096)
        return True
    except OSError as exc:
        if exc.errno != errno.EOPNOTSUPP:
            raise
        return False
    finally:
        os.close(fd)
        os.unlink(p)


def flush(m):
    """Kept for the modules that import it from here (prefer conftest.flush_all)."""
    flush_all(m)


class File:
    """One file (an inode): its bytes and its user xattrs; it outlives its names while open."""

    _ids = 0

    def __init__(self, data: bytes = b""):
        File._ids += 1
        self.id = File._ids
        self.data = bytearray(data)
        self.xattrs: dict[str, bytes] = {}

    def write(self, off: int, data: bytes) -> None:
        if off > len(self.data):
            self.data.extend(bytes(off - len(self.data)))
        self.data[off:off + len(data)] = data

    def truncate(self, size: int) -> None:
        if size < len(self.data):
            del self.data[size:]
        else:
            self.data.extend(bytes(size - len(self.data)))


class Handle:
    def __init__(self, fd: int, f: File, name: str, acc: str, direct: bool = False):
        self.fd, self.f, self.name, self.acc = fd, f, name, acc     # acc: rw, r, w, a
        self.direct = direct

    @property
    def readable(self) -> bool:
        return self.acc in ("rw", "r")

    @property
    def writable(self) -> bool:
        return self.acc != "r"


class Model:
    def __init__(self, root, rng, direct_ok: bool = True, max_size: int = MAX_SIZE):
        self.root = str(root)
        self.max_size = max_size                # largest file (writes and truncates)
        self.rng = rng
        self.direct_ok = direct_ok
        self.files: dict[str, File] = {}       # the namespace
        self.handles: list[Handle] = []
        self.trace: list[tuple] = []           # the recent operations, shown on a failure
        self.counts: dict[str, int] = {}
        self.fallocate_ok = fallocate_works(root)

    def p(self, name: str) -> str:
        return os.path.join(self.root, name)

    def fail(self, msg: str) -> None:
        raise AssertionError(f"{msg}; recent operations: {self.trace[-30:]}")

    def open(self, name: str, acc: str | None = None) -> Handle:
        rng = self.rng
        acc = acc or rng.choices(["rw", "r", "w", "a"], [5, 2, 2, 2])[0]
        flags = {"rw": os.O_RDWR, "r": os.O_RDONLY, "w": os.O_WRONLY,
                 "a": os.O_WRONLY | os.O_APPEND}[acc]
        if self.direct_ok and rng.random() < 0.6:
            flags |= os.O_DIRECT
        self.trace.append(("open", name, self.files[name].id, acc, bool(flags & os.O_DIRECT)))
        h = Handle(os.open(self.p(name), flags), self.files[name], name, acc,
                   bool(flags & os.O_DIRECT))
        self.handles.append(h)
        return h

    def handle(self, need: str = "") -> Handle | None:
        """A random open handle that can read ("r") or write ("w"); opens one if needed."""
        ok = [h for h in self.handles if (need != "r" or h.readable)
              and (need != "w" or h.writable)]
        if ok and self.rng.random() < 0.85:
            return self.rng.choice(ok)
        if not self.files or len(self.handles) >= MAX_HANDLES:
            return self.rng.choice(ok) if ok else None
        name = self.rng.choice(sorted(self.files))
        acc = {"r": self.rng.choice(["rw", "r"]), "w": self.rng.choice(["rw", "w", "a", "a"]),
               "": None}[need]
        return self.open(name, acc)

    def close(self, h: Handle) -> None:
        self.handles.remove(h)
        os.close(h.fd)

    def close_file(self, f: File) -> None:
        for h in [h for h in self.handles if h.f is f]:
            self.close(h)

    def close_all(self) -> None:
        for h in list(self.handles):
            self.close(h)

    def abandon(self) -> None:
        """After a failure: close every handle, whatever errors (the mount must unmount)."""
        close_quietly(self.handles)

    def step(self) -> None:
        rng = self.rng
        op = rng.choices(["create", "read", "write", "truncate", "rename", "unlink", "reopen",
                          "close", "xattr", "fstat", "fallocate", "seek"],
                         [1, 3, 3, 1, 1, 1, 1, 1, 1.2, 0.5, 0.8, 0.6])[0]
        if op == "create" or (not self.files and not self.handles):
            op = "create"
        if op == "fallocate" and not self.fallocate_ok:
            op = "write"
        self.counts[op] = self.counts.get(op, 0) + 1
        try:
            getattr(self, "op_" + op)()
        except OSError as exc:
            self.fail(f"{self.trace[-1] if self.trace else op} raised {exc!r}")

    def op_create(self) -> None:
        rng = self.rng
        name = rng.choice(NAMES)
        data = os.urandom(rng.randrange(0, self.max_size))
        f = self.files.get(name)
        self.trace.append(("create", name, f.id if f else None, len(data)))
        with open(self.p(name), "wb") as fh:        # O_TRUNC: an existing file stays itself
            fh.write(data)
        if f is None:
            f = self.files[name] = File()
        f.data = bytearray(data)

    def op_read(self) -> None:
        rng = self.rng
        h = self.handle("r")
        if h is None:
            return
        model = h.f.data
        size = rng.choice([1, 512, 4096, 4096, 8192, 65536, 131072, rng.randrange(1, 200000)])
        off = rng.randrange(0, len(model) + 4096)
        if rng.random() < 0.5:
            off &= ~4095
        if h.direct and h.acc == "r":
            # A read-only O_DIRECT open of a fully cached file is served by FUSE passthrough
            # from the cache file with O_DIRECT: aligned, as on BACKING (a local disk) and
            # as programs using O_DIRECT do.
            off &= ~4095
            size = max(4096, size & ~4095)
            self.trace.append(("read", h.name, h.f.id, off, size))
            got = pread_aligned(h.fd, size, off)
        else:
            self.trace.append(("read", h.name, h.f.id, off, size))
            got = os.pread(h.fd, size, off)
        want = bytes(model[off:off + size])
        if got != want:
            bad = next(i for i in range(min(len(got), len(want)) + 1)
                       if i >= min(len(got), len(want)) or got[i] != want[i])
            self.fail(f"read {h.name} (#{h.f.id}{'' if self.named(h.f) else ', unlinked'}) "
                      f"[{off}, +{size}) of {len(model)}: got {len(got)} bytes, first "
                      f"difference at {off + bad}")

    def named(self, f: File) -> bool:
        return any(g is f for g in self.files.values())

    def op_write(self) -> None:
        rng = self.rng
        h = self.handle("w")
        if h is None:
            return
        model = h.f.data
        size = rng.choice([1, 100, 4096, 4096, 10000, 65536, rng.randrange(1, 150000)])
        data = os.urandom(size)
        if h.acc == "a":
            self.trace.append(("append", h.name, h.f.id, len(model), size))
            written = os.write(h.fd, data)
            off = len(model)
        else:
            off = rng.randrange(0, min(len(model) + 8192, self.max_size))
            if rng.random() < 0.5:
                off &= ~4095
            self.trace.append(("write", h.name, h.f.id, off, size, h.acc))
            written = os.pwrite(h.fd, data, off)
        if written != size:
            self.fail(f"short write: {written} of {size}")
        h.f.write(off, data)

    def op_truncate(self) -> None:
        rng = self.rng
        size = rng.randrange(0, self.max_size)
        if rng.random() < 0.5 and self.files:
            name = rng.choice(sorted(self.files))
            f = self.files[name]
            self.trace.append(("truncate", name, f.id, size))
            os.truncate(self.p(name), size)
        else:
            h = self.handle("w")
            if h is None:
                return
            f = h.f
            self.trace.append(("ftruncate", h.name, f.id, size, h.acc))
            os.ftruncate(h.fd, size)
        f.truncate(size)

    def op_fallocate(self) -> None:
        rng = self.rng
        h = self.handle("w")
        if h is None:
            return
        f = h.f
        mode = rng.choice(FALLOC_MODES)
        off = rng.randrange(0, min(len(f.data) + 8192, self.max_size))
        if rng.random() < 0.5:
            off &= ~4095
        size = rng.choice([1, 4096, 10000, 65536, rng.randrange(1, 200000)])
        self.trace.append(("fallocate", h.name, f.id, mode, off, size, h.acc))
        fallocate(h.fd, mode, off, size)
        end = off + size
        if mode & 0x12:                             # PUNCH_HOLE, ZERO_RANGE: zeros in the file
            hi = min(end, len(f.data))
            if off < hi:
                f.data[off:hi] = bytes(hi - off)
        if not mode & 0x01 and end > len(f.data):   # no KEEP_SIZE: the file may grow
            f.truncate(end)

    def op_seek(self) -> None:
        """SEEK_DATA/SEEK_HOLE may answer coarsely (all data is a valid answer) but never
        call a range without data that has some: a copy would skip real bytes."""
        rng = self.rng
        h = self.handle()
        if h is None:
            return
        model = h.f.data
        size = len(model)
        off = rng.randrange(0, size + 8192)
        whence = rng.choice([os.SEEK_DATA, os.SEEK_HOLE])
        self.trace.append(("seek", h.name, h.f.id, off, "data" if whence == os.SEEK_DATA
                           else "hole"))
        try:
            got = os.lseek(h.fd, off, whence)
        except OSError as exc:
            if exc.errno != errno.ENXIO:
                raise
            if off < size and (whence == os.SEEK_HOLE or any(model[off:])):
                kind = "SEEK_DATA" if whence == os.SEEK_DATA else "SEEK_HOLE"
                self.fail(f"lseek({off}, {kind}) of {size} bytes said ENXIO")
            return
        if off >= size or not off <= got <= size:
            self.fail(f"lseek({off}) of {size} bytes returned {got}")
        if whence == os.SEEK_DATA and (got == size or any(model[off:got])):
            self.fail(f"SEEK_DATA from {off} skipped data to {got} (size {size})")
        if whence == os.SEEK_HOLE and got < size and model[got]:
            self.fail(f"SEEK_HOLE from {off} said {got} is a hole; it holds data")

    def op_rename(self) -> None:
        rng = self.rng
        if not self.files:
            return
        name = rng.choice(sorted(self.files))
        new = rng.choice(NAMES)
        if new == name:
            return
        if rng.random() < 0.3:          # as before: no handle of either file stays open
            self.close_file(self.files[name])
            if new in self.files:
                self.close_file(self.files[new])
        gone = self.files.get(new)
        self.trace.append(("rename", name, new, self.files[name].id, gone.id if gone else None,
                           sum(1 for h in self.handles if h.f is gone)))
        os.rename(self.p(name), self.p(new))
        self.files[new] = self.files.pop(name)

    def op_unlink(self) -> None:
        rng = self.rng
        if not self.files:
            return
        name = rng.choice(sorted(self.files))
        f = self.files[name]
        if rng.random() < 0.4:
            self.close_file(f)
        elif not any(h.f is f for h in self.handles) and len(self.handles) < MAX_HANDLES:
            self.open(name)                     # an open, unlinked file to keep using
        self.trace.append(("unlink", name, f.id, sum(1 for h in self.handles if h.f is f)))
        os.unlink(self.p(name))
        del self.files[name]

    def op_reopen(self) -> None:
        if self.handles and (self.rng.random() < 0.5 or len(self.handles) >= MAX_HANDLES):
            self.op_close()
        if self.files and len(self.handles) < MAX_HANDLES:
            self.open(self.rng.choice(sorted(self.files)))

    def op_close(self) -> None:
        if self.handles:
            h = self.rng.choice(self.handles)
            self.trace.append(("close", h.name, h.f.id))
            self.close(h)

    def op_fstat(self) -> None:
        h = self.handle()
        if h is None:
            return
        self.trace.append(("fstat", h.name, h.f.id))
        st = os.fstat(h.fd)
        if st.st_size != len(h.f.data):
            self.fail(f"fstat of {h.name} (#{h.f.id}{'' if self.named(h.f) else ', unlinked'}) "
                      f"says {st.st_size} bytes, the file has {len(h.f.data)}")

    def op_xattr(self) -> None:
        rng = self.rng
        by_path = rng.random() < 0.2 and self.files
        if by_path:
            name = rng.choice(sorted(self.files))
            f, target, where = self.files[name], self.p(name), name
        else:
            h = self.handle()
            if h is None:
                return
            f, target, where = h.f, h.fd, f"fd of {h.name}"
        key = rng.choice(XATTRS)
        what = rng.choices(["set", "get", "list", "remove"], [3, 3, 2, 2])[0]
        self.trace.append(("xattr", what, where, f.id, key))
        if what == "set":
            value = os.urandom(rng.choice([0, 1, 50, 300]))
            os.setxattr(target, key, value)
            f.xattrs[key] = value
        elif what == "list":
            got = sorted(n for n in os.listxattr(target) if n.startswith("user."))
            if got != sorted(f.xattrs):
                self.fail(f"listxattr({where}) = {got}, want {sorted(f.xattrs)}")
        else:
            try:
                got = (os.getxattr if what == "get" else os.removexattr)(target, key)
            except OSError as exc:
                if exc.errno != errno.ENODATA or key in f.xattrs:
                    raise
                return
            if key not in f.xattrs:
                self.fail(f"{what}xattr({where}, {key}) succeeded on an absent name")
            if what == "get" and got != f.xattrs[key]:
                self.fail(f"getxattr({where}, {key}) returned other bytes")
            if what == "remove":
                del f.xattrs[key]

    def check_all(self, root) -> None:
        names = sorted(os.listdir(root))
        assert names == sorted(self.files), (names, sorted(self.files))
        for name, f in self.files.items():
            path = os.path.join(root, name)
            with open(path, "rb") as fh:
                assert fh.read() == bytes(f.data), f"{name} in {root}"
            xs = {n: os.getxattr(path, n) for n in os.listxattr(path) if n.startswith("user.")}
            assert xs == f.xattrs, f"xattrs of {name} in {root}: {sorted(xs)} vs {sorted(f.xattrs)}"


def run_model(model: Model, steps: int, checkpoint) -> None:
    try:
        for i in range(steps):
            model.step()
            if i % 500 == 499:
                model.close_all()
                model.check_all(model.root)
                checkpoint()
        model.close_all()
        model.check_all(model.root)
    finally:
        model.abandon()


SEEDS = [1, 2, 3]


@pytest.mark.fuse
@pytest.mark.parametrize("seed", SEEDS)
def test_random_operations_match_model(make_mount, mode, seed):
    m = make_mount("--mode", mode, "--cache-size", "1M", "--promote-after", "1",
                   "--sequential-cutoff", "512K", "--dirty-high", "256K", "--dirty-low", "128K",
                   "--max-dirty-age", "1")
    param, seed = seed, env_seed(0) * 1000 + seed
    model = Model(m.mnt, random.Random(seed))
    totals = {"hit_ops": 0, "promotions": 0, "destaged_bytes": 0, "throttled_writes": 0}

    def add_stats():
        s = m.stats()
        for k in totals:
            totals[k] += s[k]

    def checkpoint():
        add_stats()
        m.restart()

    try:
        run_model(model, 1500, checkpoint)
    except AssertionError as exc:
        raise AssertionError(f"seed {seed} ({mode}; replay: CACHEFS_SEED={seed // 1000} and "
                             f"the test parameter seed={param}): {exc}") from None
    add_stats()
    assert totals["hit_ops"] and totals["promotions"], totals   # the cache took part
    for op in ("xattr", "unlink", "rename", "write", "read") + (
            ("fallocate",) if model.fallocate_ok else ()):
        assert model.counts.get(op, 0) > 20, model.counts
    if mode == "write-back":
        assert totals["destaged_bytes"] and totals["throttled_writes"], totals
        flush_all(m)
    m.stop()
    model.check_all(m.backing)


@pytest.mark.fuse
@pytest.mark.slow
@pytest.mark.parametrize("seed", [4])
def test_random_operations_through_a_pool_much_smaller_than_the_data(make_mount, mode, seed):
    """Issue 15: the model with files up to 4 MiB (up to 24 MiB of data) through a 1 MiB pool
    and a 128 KiB dirty mark: eviction, hole punching, fills and destaging race every step.
    CACHEFS_LONG=1 runs 3 seeds of 3,000 steps."""
    m = make_mount("--mode", mode, "--cache-size", "1M", "--promote-after", "1",
                   "--sequential-cutoff", "1M", "--dirty-high", "128K", "--dirty-low", "64K",
                   "--max-dirty-age", "1")
    seeds = [seed, seed + 1, seed + 2] if env_long() else [seed]
    evictions = []

    def checkpoint():
        evictions.append(m.stats()["evictions"])
        m.restart()

    for s in seeds:
        full = env_seed(0) * 1000 + s
        model = Model(m.mnt, random.Random(full), max_size=4 << 20)
        try:
            run_model(model, 3000 if env_long() else 1500, checkpoint)
        except AssertionError as exc:
            raise AssertionError(f"seed {full} ({mode}; replay: CACHEFS_SEED={full // 1000} "
                                 f"and seed={s}): {exc}") from None
        for name in list(model.files):
            os.unlink(model.p(name))
        model.files.clear()
    # The pool (16 extents) cycled over: how often varies with the seed and the timing of
    # promotions (write-through fills it by reads only: 38-41 evictions with some seeds).
    assert sum(evictions) + m.stats()["evictions"] > 32, evictions
    if mode == "write-back":
        flush_all(m)


@pytest.mark.parametrize("seed", SEEDS)
def test_model_accepts_a_plain_directory(tmp_path, seed):
    """The model's sanity check: the same operations on a plain directory pass."""
    model = Model(tmp_path, random.Random(env_seed(0) * 1000 + seed), direct_ok=False)
    run_model(model, 1500, lambda: None)
