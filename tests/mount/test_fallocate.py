"""fallocate(2) through cachefs: space reserved on BACKING, holes punched, ranges zeroed, as on
BACKING itself, over cached, dirty and passthrough-read data.

Each case is also run on a plain file of the test's own filesystem, and cachefs must give
the same bytes and size: through the mount, in BACKING after a flush, and after a remount.
Needs a pyfuse3 with deps/passthrough's fallocate patch (without it the kernel answers
EOPNOTSUPP, as documented)."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import time

import pytest

from tests.conftest import ctl_flush, force_unmount, wait_until, is_mounted
from tests.mount.test_passthrough import _available, held_file, pread_all
from tests.mount.test_random_ops import fallocate, fallocate_works

pytestmark = pytest.mark.fuse

KiB = 1024
KEEP, PUNCH, ZERO = 0x01, 0x02, 0x10

# (mode, offset, length) over a 300 KiB file: inside, across its end, past it, unaligned
CASES = [
    (0, 100 * KiB, 500 * KiB),                 # grows the file
    (KEEP, 200 * KiB, 400 * KiB),              # reserves, size kept
    (PUNCH | KEEP, 64 * KiB, 128 * KiB),       # whole extents
    (PUNCH | KEEP, 5000, 70000),               # partial blocks at both ends
    (PUNCH | KEEP, 290 * KiB, 100 * KiB),      # across the end: size kept
    (ZERO, 10 * KiB + 7, 30 * KiB),
    (ZERO, 250 * KiB, 200 * KiB),              # across the end: grows
    (ZERO | KEEP, 250 * KiB, 200 * KiB),
]


@pytest.fixture
def fa_mount(make_mount, mode):
    m = make_mount("--mode", mode, "--cache-size", "4M", "--attr-timeout", "0.2")
    if not fallocate_works(m.mnt):
        pytest.skip("pyfuse3 without deps/passthrough's fallocate patch")
    return m


def apply(path, data: bytes, case, dirty: bytes | None) -> tuple[int, bytes]:
    """`data` in a file at `path` (already there), an optional write of `dirty` at 32 KiB,
    the fallocate; returns (size, bytes) read back."""
    mode, off, size = case
    fd = os.open(path, os.O_RDWR)
    try:
        if dirty is not None:
            os.pwrite(fd, dirty, 32 * KiB)
        fallocate(fd, mode, off, size)
        st = os.fstat(fd)
        return st.st_size, pread_all(fd, st.st_size + 100 * KiB)
    finally:
        os.close(fd)


def read_back(path) -> tuple[int, bytes]:
    with open(path, "rb") as f:
        return os.fstat(f.fileno()).st_size, f.read()


@pytest.mark.parametrize("cached", ["cold", "cached", "dirty"])
def test_fallocate_matches_a_plain_file(fa_mount, tmp_path, mode, cached):
    m = fa_mount
    wants = {}
    for i, case in enumerate(CASES):
        data = os.urandom(300 * KiB)
        dirty = os.urandom(200 * KiB) if cached == "dirty" else None
        ref = tmp_path / f"ref{i}"
        ref.write_bytes(data)
        want = wants[f"f{i}"] = apply(ref, data, case, dirty)
        (m.backing / f"f{i}").write_bytes(data)
        if cached != "cold":
            before = m.stats()["extents_cached"]
            for _ in range(2):
                m.path(f"f{i}").read_bytes()
            wait_until(lambda: m.stats()["extents_cached"] >= before + 5, 15, what="promotion")
        got = apply(m.path(f"f{i}"), data, case, dirty)
        assert got[0] == want[0], f"size after fallocate {case}"
        assert got[1] == want[1], f"bytes after fallocate {case}"
        assert read_back(m.path(f"f{i}")) == want, f"bytes read by a new open {case}"
    s = m.stats()
    assert s["fallocate_ops"] == len(CASES) + 1 and s["zeroed_bytes"] > 0, s   # + the probe
    if mode == "write-back":
        ctl_flush(m)
    m.restart()
    for name, want in wants.items():
        assert read_back(m.path(name)) == want, f"{name} after a remount"
        assert read_back(m.backing / name) == want, f"{name} in BACKING after the flush"


def test_a_punch_is_seen_by_passthrough_readers(fa_mount):
    m = fa_mount
    reason = _available()
    if reason:
        pytest.skip(reason)
    data, reader = held_file(m, "h")
    try:
        fd = os.open(m.path("h"), os.O_RDWR)
        try:
            fallocate(fd, PUNCH | KEEP, 100 * KiB, 300 * KiB)
            fallocate(fd, ZERO, 900 * KiB, 200 * KiB)         # grows it to 1100 KiB
        finally:
            os.close(fd)
        want = bytearray(data)
        want[100 * KiB:400 * KiB] = bytes(300 * KiB)
        want[900 * KiB:] = bytes(len(want) - 900 * KiB)
        want.extend(bytes(1100 * KiB - len(want)))
        assert pread_all(reader, len(want)) == bytes(want), "the passthrough reader's view"
    finally:
        os.close(reader)
    assert m.path("h").read_bytes() == bytes(want)
    ctl_flush(m)
    assert (m.backing / "h").read_bytes() == bytes(want)


def test_posix_fallocate_reserves_without_writing(fa_mount):
    """posix_fallocate(3) is one request, not a write of every block (glibc's fallback when
    a file system has no fallocate: 64 Ki writes for this 256 MiB)."""
    m = fa_mount
    before = m.stats()["write_ops"]
    fd = os.open(m.path("big"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.posix_fallocate(fd, 0, 256 << 20)
        assert os.fstat(fd).st_size == 256 << 20
    finally:
        os.close(fd)
    assert m.stats()["write_ops"] == before
    assert (m.backing / "big").stat().st_blocks * 512 >= 256 << 20, "BACKING reserved it"


def test_a_backing_without_fallocate_says_so_and_changes_nothing(make_mount, tmp_path):
    """A BACKING that has no fallocate (a Python FUSE file system here; NFSv3 in the field):
    EOPNOTSUPP, and write-back's dirty bytes in the range stay."""
    import pyfuse3
    if not hasattr(pyfuse3.Operations, "fallocate"):
        pytest.skip("pyfuse3 without deps/passthrough's fallocate patch")
    src, bare = tmp_path / "src", tmp_path / "bare"
    src.mkdir()
    bare.mkdir()
    proc = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(__file__), "..", "..",
                                                          "bench", "passthrough.py"),
                             "mount", "-f", str(src), str(bare)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: is_mounted(bare), 20, proc, "the bare passthrough")
        m = make_mount("--mode", "write-back", backing=bare)
        data = os.urandom(128 * KiB)
        fd = os.open(m.path("f"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)
            with pytest.raises(OSError) as exc:
                fallocate(fd, PUNCH | KEEP, 0, 64 * KiB)
            assert exc.value.errno == errno.EOPNOTSUPP
            assert os.pread(fd, len(data) + 1, 0) == data
        finally:
            os.close(fd)
        ctl_flush(m)
        assert (src / "f").read_bytes() == data
        m.stop()
    finally:
        force_unmount(bare)
        proc.wait(timeout=30)


def _mtime_moved_by_fallocate(path, mode: int) -> tuple[bool, int]:
    """Write 256 KiB at the start and at 1 MiB of the file at `path`, then fallocate the
    hole between: whether its mtime moved (on a coarse clock: 50 ms apart), and the mtime
    after."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.write(fd, os.urandom(256 * KiB))
        os.pwrite(fd, os.urandom(256 * KiB), 1024 * KiB)
        before = os.fstat(fd).st_mtime_ns
        time.sleep(0.05)
        fallocate(fd, mode, 512 * KiB, 256 * KiB)
        after = os.fstat(fd).st_mtime_ns
        return after != before, after
    finally:
        os.close(fd)


@pytest.mark.parametrize("fmode", [0, KEEP], ids=["default", "keep-size"])
def test_fallocate_of_a_file_with_dirty_data_moves_its_mtime_as_backing_does(
        fa_mount, tmp_path, mode, fmode):
    """Write-back kept the time of the last write for the destage to give BACKING: a
    fallocate that moved BACKING's mtime (ext4's does) showed and kept the older one
    (a helper's differential hunt; rsync -a and make then miss the change)."""
    m = fa_mount
    plain_moved, _ = _mtime_moved_by_fallocate(tmp_path / "plain", fmode)
    moved, shown = _mtime_moved_by_fallocate(m.path("f"), fmode)
    assert moved == plain_moved
    time.sleep(0.3)                             # past --attr-timeout
    assert os.stat(m.path("f")).st_mtime_ns == shown
    ctl_flush(m)
    assert os.stat(m.backing / "f").st_mtime_ns == shown


def test_a_fsynced_punch_of_dirty_data_survives_kill9(make_mount):
    m = make_mount("--mode", "write-back", "--max-dirty-age", "300")
    if not fallocate_works(m.mnt):
        pytest.skip("pyfuse3 without deps/passthrough's fallocate patch")
    data = os.urandom(256 * KiB)
    fd = os.open(m.path("f"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
        fallocate(fd, PUNCH | KEEP, 10 * KiB, 100 * KiB)
        os.fsync(fd)
    finally:
        os.close(fd)
    assert m.stats()["dirty_bytes"], "the data was destaged: the test needs it dirty"
    m.kill()
    m.start()
    want = data[:10 * KiB] + bytes(100 * KiB) + data[110 * KiB:]
    assert m.path("f").read_bytes() == want
    ctl_flush(m)
    assert (m.backing / "f").read_bytes() == want


def test_threads_punching_writing_and_reading_their_own_blocks_of_one_file(make_mount, mode):
    """Four threads own interleaved 4 KiB blocks of a 16 MiB file (a 4 MiB pool): each
    writes (buffered or O_DIRECT), punches and zeroes its own blocks and checks each read
    against its model, while the others do the same in the same extents (fills, evictions,
    destaging and the invariant checker run between). The mount and BACKING after a flush
    must hold every thread's model."""
    import mmap
    import random
    import threading
    import time
    m = make_mount("--mode", mode, "--cache-size", "4M", "--dirty-high", "1M", "--dirty-low",
                   "512K", "--max-dirty-age", "1", "--promote-after", "1")
    if not fallocate_works(m.mnt):
        pytest.skip("pyfuse3 without deps/passthrough's fallocate patch")
    nblk, threads = 4096, 4
    with open(m.path("f"), "wb") as f:
        f.truncate(nblk * 4 * KiB)
    errors: list[str] = []
    models: list[dict[int, bytes]] = [{} for _ in range(threads)]

    def worker(t: int) -> None:
        rng = random.Random(t)
        mine = list(range(t, nblk, threads))
        model = models[t]
        direct = t % 2 == 1
        fd = os.open(m.path("f"), os.O_RDWR | (os.O_DIRECT if direct else 0))
        buf = mmap.mmap(-1, 4 * KiB)                    # aligned, for O_DIRECT
        try:
            end = time.monotonic() + 4
            while time.monotonic() < end and not errors:
                b = rng.choice(mine)
                r = rng.random()
                if r < 0.45:
                    data = os.urandom(4 * KiB)
                    buf[:] = data
                    os.pwritev(fd, [buf], b * 4 * KiB)
                    model[b] = data
                elif r < 0.65:
                    fallocate(fd, rng.choice([PUNCH | KEEP, ZERO, ZERO | KEEP]), b * 4 * KiB,
                              4 * KiB)
                    model[b] = bytes(4 * KiB)
                else:
                    n = os.preadv(fd, [buf], b * 4 * KiB)
                    if bytes(buf[:n]) != model.get(b, bytes(4 * KiB)):
                        errors.append(f"thread {t}, block {b}: a read returned other bytes")
        except OSError as exc:
            errors.append(f"thread {t}: {exc!r}")
        finally:
            buf.close()
            os.close(fd)

    workers = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not errors, errors[:5]

    def check(data: bytes, where: str) -> None:
        bad = [b for t in range(threads) for b, want in models[t].items()
               if data[b * 4 * KiB:(b + 1) * 4 * KiB] != want]
        assert not bad, f"{where}: {len(bad)} blocks differ from their thread's model"

    check(m.path("f").read_bytes(), "the mount")
    if mode == "write-back":
        ctl_flush(m)
    check((m.backing / "f").read_bytes(), "BACKING")


def test_a_punch_of_dirty_blocks_leaves_backing_its_hole(make_mount):
    """Write-back: dirty blocks wholly inside a punched range of a file BACKING has got
    zeros in the cache and stayed dirty; their destage wrote the zeros to BACKING, which
    lost its hole (the space a VM image's discard frees came back), and SEEK_HOLE on the
    mount found no hole there (dirty blocks count as data; xfstests generic/539). Now they
    go from the cache once BACKING's punch is durable; partial blocks still get zeros."""
    m = make_mount("--mode", "write-back", "--max-dirty-age", "300")
    if not fallocate_works(m.mnt):
        pytest.skip("pyfuse3 without deps/passthrough's fallocate patch")
    data = bytearray(os.urandom(1024 * KiB))
    (m.backing / "f").write_bytes(data)
    fd = os.open(m.path("f"), os.O_RDWR)
    try:
        new = os.urandom(512 * KiB)
        assert os.pwrite(fd, new, 256 * KiB) == len(new)            # dirty
        data[256 * KiB:768 * KiB] = new
        assert m.stats()["dirty_bytes"] >= len(new)
        fallocate(fd, PUNCH | KEEP, 320 * KiB + 100, 256 * KiB)     # partial ends
        data[320 * KiB + 100:576 * KiB + 100] = bytes(256 * KiB)
        assert os.lseek(fd, 324 * KiB, os.SEEK_DATA) == 576 * KiB   # the hole is seen
        assert os.lseek(fd, 320 * KiB, os.SEEK_HOLE) == 324 * KiB
        assert pread_all(fd, len(data)) == data
        assert m.stats()["dirty_bytes"] <= 512 * KiB - 252 * KiB
    finally:
        os.close(fd)
    ctl_flush(m)
    assert (m.backing / "f").read_bytes() == data
    bfd = os.open(m.backing / "f", os.O_RDONLY)
    try:
        assert os.lseek(bfd, 324 * KiB, os.SEEK_HOLE) == 324 * KiB  # BACKING kept its hole
        assert os.lseek(bfd, 324 * KiB, os.SEEK_DATA) == 576 * KiB
    finally:
        os.close(bfd)
    m.stop()
    m.start()
    assert m.path("f").read_bytes() == data


def test_a_punch_of_a_new_files_dirty_blocks_leaves_backing_its_holes(make_mount):
    """Write-back, the usual case of generic/539: a file written through the mount and not
    destaged yet (BACKING's file shorter than the data), then punched in the middle and at
    its end (keeping the size). The dirty blocks past BACKING's end got zeros and were
    destaged: SEEK_DATA on the mount found no hole and BACKING got none. Now BACKING is
    made as long as the range (a hole) and they go from the cache; the size stays."""
    m = make_mount("--mode", "write-back", "--max-dirty-age", "300")
    if not fallocate_works(m.mnt):
        pytest.skip("pyfuse3 without deps/passthrough's fallocate patch")
    data = bytearray(os.urandom(1024 * KiB))
    fd = os.open(m.path("f"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        assert os.pwrite(fd, data, 0) == len(data)                  # all dirty
        assert os.fstat(os.open(m.backing / "f", os.O_RDONLY)).st_size < len(data)
        fallocate(fd, PUNCH | KEEP, 4 * KiB, 4 * KiB)               # generic/539's
        fallocate(fd, PUNCH | KEEP, 512 * KiB, 512 * KiB)           # the whole tail
        data[4 * KiB:8 * KiB] = bytes(4 * KiB)
        data[512 * KiB:] = bytes(512 * KiB)
        assert os.lseek(fd, 4 * KiB, os.SEEK_DATA) == 8 * KiB
        assert os.lseek(fd, 8 * KiB, os.SEEK_HOLE) == 512 * KiB
        assert os.fstat(fd).st_size == len(data)
        assert pread_all(fd, len(data)) == data
    finally:
        os.close(fd)
    m.stop()                                        # the dirty data stays on the SSD
    m.start()
    # The reads cached the hole's zeros as clean blocks between dirty ones: a destage pass
    # wrote them along with their neighbours (one write across a short gap), filling the
    # hole again. Blocks of zeros are not bridged now.
    assert m.path("f").read_bytes() == data
    ctl_flush(m)
    assert (m.backing / "f").read_bytes() == data
    bfd = os.open(m.backing / "f", os.O_RDONLY)
    try:
        assert os.lseek(bfd, 4 * KiB, os.SEEK_HOLE) == 4 * KiB      # BACKING's holes
        assert os.lseek(bfd, 4 * KiB, os.SEEK_DATA) == 8 * KiB
        assert os.lseek(bfd, 8 * KiB, os.SEEK_HOLE) == 512 * KiB
        assert os.fstat(bfd).st_size == len(data)
    finally:
        os.close(bfd)
    assert m.path("f").read_bytes() == data
