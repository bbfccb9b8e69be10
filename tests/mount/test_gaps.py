"""What cachefs does differently from BACKING (docs/operations.md, "What cachefs does
differently from BACKING"): one test per gap of the binding, checking that the answer is the
documented one and that the fallback programs take gives the right bytes, in both modes."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time

import pytest

from tests.conftest import CTL

pytestmark = pytest.mark.fuse

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE, FALLOC_FL_ZERO_RANGE = 0x01, 0x02, 0x10
FS_IOC_FIEMAP, FICLONE = 0xC020660B, 0x40049409


def _handled(op: str) -> bool:
    """Whether pyfuse3 has a handler for `op` (deps/passthrough's fallocate and lseek
    patches, built by `make install`): that gap is then closed (tests/mount/test_fallocate.py,
    test_seek_data.py) and its test here checks what the stock pyfuse3 gives."""
    try:
        import pyfuse3
    except ImportError:
        return False
    return hasattr(pyfuse3.Operations, op)


def _fallocate(fd: int, mode: int, off: int, size: int) -> int:
    """fallocate(2) itself (os.posix_fallocate may fall back in glibc): 0 or the errno."""
    return 0 if _libc.fallocate(fd, mode, off, size) == 0 else ctypes.get_errno()


def _write(path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


@pytest.mark.parametrize("mode_flags", [0, FALLOC_FL_KEEP_SIZE,
                                        FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                                        FALLOC_FL_ZERO_RANGE],
                         ids=["plain", "keep-size", "punch-hole", "zero-range"])
@pytest.mark.skipif(_handled("fallocate"), reason="pyfuse3 with the fallocate patch: "
                    "fallocate works (tests/mount/test_fallocate.py)")
def test_fallocate_answers_eopnotsupp_and_changes_nothing(mounted, mode_flags):
    data = os.urandom(200_000)
    _write(mounted.path("f"), data)
    fd = os.open(mounted.path("f"), os.O_RDWR)
    try:
        assert _fallocate(fd, mode_flags, 4096, 65536) == errno.EOPNOTSUPP
        assert os.fstat(fd).st_size == len(data)
    finally:
        os.close(fd)
    assert mounted.path("f").read_bytes() == data


def test_posix_fallocate_extends_with_zeros(mounted):
    data = os.urandom(10_000)
    _write(mounted.path("f"), data)
    assert mounted.path("f").read_bytes() == data           # cached (and dirty in write-back)
    fd = os.open(mounted.path("f"), os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, 300_000)                   # glibc writes a 0 per block
        assert os.fstat(fd).st_size == 300_000
        os.posix_fallocate(fd, 100_000, 50_000)              # inside: changes nothing
        assert os.fstat(fd).st_size == 300_000
        os.pwrite(fd, b"tail", 299_996)
    finally:
        os.close(fd)
    want = data + bytes(300_000 - len(data) - 4) + b"tail"
    assert mounted.path("f").read_bytes() == want
    mounted.restart()                                        # and from BACKING / the SSD
    assert mounted.path("f").read_bytes() == want
    subprocess.run([*CTL, "flush", str(mounted.mnt), "--json"], check=True, timeout=60,
                   capture_output=True)
    assert (mounted.backing / "f").read_bytes() == want


@pytest.mark.parametrize("flags", [os.O_WRONLY, os.O_RDWR | os.O_APPEND],
                         ids=["wronly", "append"])
def test_posix_fallocate_on_write_only_handles(mounted, flags):
    """With fallocate on the mount it allocates on any writable handle, as on BACKING.
    Without it, glibc's fallback needs to read the file and to write at an offset: it
    refuses such handles with EBADF, and nothing changes."""
    _write(mounted.path("f"), b"a" * 10_000)
    fd = os.open(mounted.path("f"), flags)
    try:
        if _handled("fallocate"):
            os.posix_fallocate(fd, 0, 50_000)
            want = b"a" * 10_000 + bytes(40_000)
        else:
            with pytest.raises(OSError) as exc:
                os.posix_fallocate(fd, 0, 50_000)
            assert exc.value.errno == errno.EBADF
            want = b"a" * 10_000
    finally:
        os.close(fd)
    assert mounted.path("f").read_bytes() == want


def test_copy_file_range_and_cp_copy_the_bytes(mounted, tmp_path):
    data = os.urandom(3 << 20)
    _write(mounted.path("src"), data)
    src = os.open(mounted.path("src"), os.O_RDONLY)
    dst = os.open(mounted.path("dst"), os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        done = 0
        while done < len(data):                              # the kernel copies (splice)
            n = os.copy_file_range(src, dst, len(data) - done, done, done)
            assert n > 0
            done += n
        assert os.copy_file_range(src, dst, 5000, 100_000, 8192) == 5000   # with offsets
    finally:
        os.close(src)
        os.close(dst)
    want = bytearray(data)
    want[8192:8192 + 5000] = data[100_000:105_000]
    assert mounted.path("dst").read_bytes() == bytes(want)
    for args in (["cp", "--reflink=auto"], ["cp"]):
        res = subprocess.run([*args, str(mounted.path("src")), str(mounted.path("cp"))],
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        assert mounted.path("cp").read_bytes() == data
        os.unlink(mounted.path("cp"))
    res = subprocess.run(["cp", "--reflink=always", str(mounted.path("src")),
                          str(mounted.path("cp"))], capture_output=True, text=True, timeout=60)
    assert res.returncode != 0 and "not supported" in res.stderr      # no clones
    shutil.copyfile(mounted.path("src"), mounted.path("sh"))
    assert mounted.path("sh").read_bytes() == data
    shutil.copyfile(mounted.path("src"), tmp_path / "out")               # to another fs
    assert (tmp_path / "out").read_bytes() == data
    shutil.copyfile(tmp_path / "out", mounted.path("in"))                # and back
    assert mounted.path("in").read_bytes() == data
    mounted.restart()
    for name in ("dst", "sh", "in"):
        got = mounted.path(name).read_bytes()
        assert got == (bytes(want) if name == "dst" else data), name


def test_ficlone_and_fiemap_are_not_supported(mounted):
    _write(mounted.path("a"), b"x" * 8192)
    a = os.open(mounted.path("a"), os.O_RDONLY)
    b = os.open(mounted.path("b"), os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        with pytest.raises(OSError) as exc:
            fcntl.ioctl(b, FICLONE, a)
        assert exc.value.errno in (errno.EOPNOTSUPP, errno.ENOTTY)
        buf = bytearray(32 + 56 * 4)
        struct.pack_into("QQIIII", buf, 0, 0, 2**64 - 1, 0, 0, 4, 0)
        with pytest.raises(OSError) as exc:                   # never "no extents"
            fcntl.ioctl(a, FS_IOC_FIEMAP, buf)
        assert exc.value.errno in (errno.EOPNOTSUPP, errno.ENOTTY)
    finally:
        os.close(a)
        os.close(b)
    assert mounted.path("b").read_bytes() == b""


def test_seek_data_and_hole(mounted, tmp_path):
    """Without an lseek handler the kernel answers as if the whole file were data: correct
    (a hole may be read as zeros). With one, the holes are BACKING's (and dirty blocks are
    data). Either way sparse-aware copies give the right bytes."""
    fd = os.open(mounted.path("sparse"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, b"x" * 4096, 1 << 20)
        size = (1 << 20) + 4096
        for off in (0, 4096, 1 << 20, size - 1):
            if _handled("lseek"):
                assert os.lseek(fd, off, os.SEEK_DATA) == max(off, 1 << 20)
                assert os.lseek(fd, off, os.SEEK_HOLE) == (off if off < 1 << 20 else size)
            else:
                assert os.lseek(fd, off, os.SEEK_DATA) == off
                assert os.lseek(fd, off, os.SEEK_HOLE) == size
        for whence in (os.SEEK_DATA, os.SEEK_HOLE):
            with pytest.raises(OSError) as exc:
                os.lseek(fd, size, whence)
            assert exc.value.errno == errno.ENXIO
    finally:
        os.close(fd)
    want = bytes(1 << 20) + b"x" * 4096
    for sparse in ("always", "auto"):
        out = tmp_path / f"copy-{sparse}"
        subprocess.run(["cp", f"--sparse={sparse}", str(mounted.path("sparse")), str(out)],
                       check=True, timeout=60)
        assert out.read_bytes() == want


def test_tar_sparse_archives_the_bytes(mounted, tmp_path):
    """A file written through the mount (write-back: only on the SSD yet) must not look like
    all holes: GNU tar --sparse takes st_blocks == 0 for an empty file and stores zeros."""
    data = os.urandom(300_000)
    _write(mounted.path("f"), data)
    st = os.stat(mounted.path("f"))
    assert st.st_blocks * 512 >= len(data) - 4096, st.st_blocks
    out = tmp_path / "x"
    out.mkdir()
    subprocess.run(["tar", "--sparse", "-cf", str(tmp_path / "a.tar"), "f"],
                   cwd=mounted.mnt, check=True, timeout=60)
    subprocess.run(["tar", "-xf", str(tmp_path / "a.tar")], cwd=out, check=True, timeout=60)
    assert (out / "f").read_bytes() == data


def test_mtime_moves_with_writes(mounted):
    """A write changes the mtime programs see (make, rsync) at once, also while the data is
    only on the SSD (write-back); an explicit mtime (touch -d, tar, cp -p) wins."""
    _write(mounted.backing / "e", b"old content")
    os.utime(mounted.backing / "e", ns=(10**18, 10**18))       # 2001
    assert os.stat(mounted.path("e")).st_mtime_ns == 10**18
    before = time.time_ns()
    fd = os.open(mounted.path("e"), os.O_RDWR)
    try:
        os.pwrite(fd, b"N", 0)                                   # same size
    finally:
        os.close(fd)
    st = os.stat(mounted.path("e"))
    assert st.st_mtime_ns >= before - 10**9 and st.st_size == 11
    os.utime(mounted.path("e"), ns=(2 * 10**18, 2 * 10**18 + 5))
    assert os.stat(mounted.path("e")).st_mtime_ns == 2 * 10**18 + 5
    assert mounted.path("e").read_bytes() == b"Nld content"


def test_o_tmpfile_is_refused_and_tempfile_falls_back(mounted):
    with pytest.raises(OSError) as exc:
        os.open(mounted.mnt, os.O_TMPFILE | os.O_RDWR, 0o600)
    assert exc.value.errno == errno.EOPNOTSUPP
    with tempfile.TemporaryFile(dir=mounted.mnt) as f:          # Python falls back
        f.write(b"temporary")
        f.seek(0)
        assert f.read() == b"temporary"
    assert list(mounted.mnt.iterdir()) == []


def test_locks_are_local_to_this_machine(mounted):
    """flock and fcntl locks work among programs using the mount (the kernel keeps them),
    but are not taken on BACKING: a lock holder on BACKING does not block the mount."""
    _write(mounted.path("l"), b"lock")
    a = os.open(mounted.path("l"), os.O_RDWR)
    b = os.open(mounted.path("l"), os.O_RDWR)
    on_backing = os.open(mounted.backing / "l", os.O_RDWR)
    try:
        fcntl.flock(a, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(BlockingIOError):
            fcntl.flock(b, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(on_backing, fcntl.LOCK_EX | fcntl.LOCK_NB)   # not forwarded
        fcntl.flock(a, fcntl.LOCK_UN)
        fcntl.flock(b, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(b, fcntl.LOCK_UN)
        fcntl.lockf(a, fcntl.LOCK_EX | fcntl.LOCK_NB, 2, 0)       # POSIX record lock
        code = ("import fcntl, os, sys\n"
                "fd = os.open(sys.argv[1], os.O_RDWR)\n"
                "try:\n    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 2, 0)\n"
                "except BlockingIOError:\n    sys.exit(3)\n")
        res = subprocess.run([sys.executable, "-c", code, str(mounted.path("l"))],
                             timeout=30)
        assert res.returncode == 3                                 # another process: blocked
        res = subprocess.run([sys.executable, "-c", code, str(mounted.backing / "l")],
                             timeout=30)
        assert res.returncode == 0                                 # BACKING never saw it
    finally:
        for fd in (a, b, on_backing):
            os.close(fd)


def test_birth_time_is_not_reported(mounted):
    _write(mounted.path("f"), b"x")
    out = subprocess.run(["stat", "-c", "%W", str(mounted.path("f"))], capture_output=True,
                         text=True, check=True, timeout=30).stdout.strip()
    assert out == "0"                                             # "unknown", never wrong


def test_syncfs_succeeds(mounted):
    """syncfs(2) on the mount returns 0 without reaching cachefs (the kernel sends no
    request to a FUSE server): fsync each file, or `cachefs-ctl flush` in write-back."""
    _write(mounted.path("f"), b"data")
    fd = os.open(mounted.path("f"), os.O_RDONLY)
    try:
        assert _libc.syncfs(fd) == 0
    finally:
        os.close(fd)
