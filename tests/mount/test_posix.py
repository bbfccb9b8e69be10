"""POSIX operations through a real cachefs mount, one family per test.

Every result is checked twice: through the mount (what programs see) and directly in BACKING
(what the slow filesystem really holds), because the contract is that the mount is a plain
directory tree identical to BACKING (DESIGN.md §1).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import shutil
import stat
import subprocess
import sys
import time

import pytest

from tests.conftest import CTL, ctl_flush, wait_until

pytestmark = pytest.mark.fuse

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
USER = 12345                      # an unprivileged uid/gid for ownership and permission tests
SGID_GROUP = 4242

_libc = ctypes.CDLL(None, use_errno=True)
AT_FDCWD = -100
RENAME_NOREPLACE, RENAME_EXCHANGE, RENAME_WHITEOUT = 1, 2, 4


def renameat2(old, new, flags: int) -> None:
    if _libc.renameat2(AT_FDCWD, os.fsencode(old), AT_FDCWD, os.fsencode(new),
                       ctypes.c_uint(flags)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(old))


def same_stat(m, rel: str) -> os.stat_result:
    """lstat through the mount and in BACKING agree on everything a program can see."""
    b = os.lstat(flushed(m) / rel)
    a = os.lstat(m.path(rel))
    for f in ("st_mode", "st_uid", "st_gid", "st_size", "st_nlink", "st_mtime_ns"):
        assert getattr(a, f) == getattr(b, f), (rel, f, getattr(a, f), getattr(b, f))
    return a


def flushed(m):
    """BACKING, once it holds everything written through the mount.

    Write-through: it always does. Write-back: after `cachefs-ctl flush` destaged every dirty
    byte (DESIGN.md §2); only then may BACKING be compared with the mount.
    """
    if "write-back" in m.args:
        res = subprocess.run([*CTL, "flush", str(m.mnt), "--json"], capture_output=True,
                             text=True, timeout=60)
        assert res.returncode == 0, res.stderr
    return m.backing


def as_user(cwd, script: str, uid: int = USER, gid: int = USER) -> subprocess.CompletedProcess:
    """Run a shell script as uid:gid with its working directory inside the mount.

    The chdir happens while still root (subprocess does it before setuid), so the user needs
    no access to the root-only directories above the mount.
    """
    return subprocess.run(["/bin/sh", "-c", script], cwd=cwd, user=uid, group=gid,
                          extra_groups=[], capture_output=True, text=True, timeout=30)


def direct_read_twice(path, size: int) -> None:
    """Two reads that reach the daemon (O_DIRECT skips the page cache): promotes extents."""
    buf = mmap.mmap(-1, size)
    for _ in range(2):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            assert os.preadv(fd, [buf], 0) == size
        finally:
            os.close(fd)


# -- lookup / getattr / readdir -------------------------------------------------------------

def test_large_directory_listed_completely_once(mounted):
    m = mounted
    (m.backing / "big").mkdir()
    names = {f"f{i:05d}" for i in range(3000)}
    for i, n in enumerate(sorted(names)):
        if i % 10:
            (m.backing / "big" / n).write_bytes(b"")           # made behind the cache
        else:
            m.path("big", n).write_bytes(b"x")                  # made through the mount
    listed = os.listdir(m.path("big"))
    assert len(listed) == len(set(listed)) == 3000
    assert set(listed) == names

    # scandir: inode numbers and types come with the entries; add files mid-listing.
    seen = []
    with os.scandir(m.path("big")) as it:
        for k, entry in enumerate(it):
            seen.append(entry.name)
            assert entry.is_file(follow_symlinks=False)
            assert entry.inode() == os.lstat(m.backing / "big" / entry.name).st_ino
            if k == 1000:
                for j in range(50):
                    m.path("big", f"new{j:03d}").write_bytes(b"")
    assert len(seen) == len(set(seen))
    assert names <= set(seen) <= names | {f"new{j:03d}" for j in range(50)}

    ls = subprocess.run(["ls", "-f", str(m.path("big"))], capture_output=True, text=True,
                        check=True).stdout.split()
    ls = [n for n in ls if n not in (".", "..")]
    assert len(ls) == len(set(ls)) == 3050
    assert set(ls) == set(os.listdir(m.backing / "big"))
    assert same_stat(m, "big/f00001").st_size == 0
    assert same_stat(m, "big/f00000").st_size == 1


def test_lookup_of_missing_and_nested_entries(mounted):
    m = mounted
    (m.backing / "a" / "b" / "c").mkdir(parents=True)
    (m.backing / "a" / "b" / "c" / "f").write_bytes(b"deep")
    assert m.path("a", "b", "c", "f").read_bytes() == b"deep"
    with pytest.raises(FileNotFoundError):
        os.stat(m.path("a", "nope"))
    with pytest.raises(NotADirectoryError):
        os.stat(m.path("a", "b", "c", "f", "x"))
    same_stat(m, "a/b/c")
    same_stat(m, "a/b/c/f")


# -- setattr ----------------------------------------------------------------------------------

def test_chmod_chown_utimens(mounted):
    m = mounted
    f = m.path("f")
    f.write_bytes(b"data")
    os.chmod(f, 0o640)
    assert stat.S_IMODE(same_stat(m, "f").st_mode) == 0o640
    os.chown(f, 1234, 5678)
    st = same_stat(m, "f")
    assert (st.st_uid, st.st_gid) == (1234, 5678)
    os.chown(f, -1, 91)                                   # group only
    assert (same_stat(m, "f").st_uid, same_stat(m, "f").st_gid) == (1234, 91)

    atime, mtime = 1_000_000_001_123_456_789, 1_100_000_000_987_654_321
    os.utime(f, ns=(atime, mtime))
    for st in (os.stat(f), os.stat(m.backing / "f")):
        assert (st.st_atime_ns, st.st_mtime_ns) == (atime, mtime)

    # the same through an open descriptor (fchmod/fchown/futimens carry a file handle)
    fd = os.open(f, os.O_RDWR)
    try:
        os.fchmod(fd, 0o604)
        os.fchown(fd, 4321, 8765)
        os.utime(fd, ns=(atime + 1, mtime + 1))
    finally:
        os.close(fd)
    st = same_stat(m, "f")
    assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o604, 4321, 8765)
    assert os.stat(m.backing / "f").st_mtime_ns == mtime + 1

    d = m.path("d")
    d.mkdir()
    os.chmod(d, 0o2750)
    assert stat.S_IMODE(same_stat(m, "d").st_mode) == 0o2750

    os.symlink("f", m.path("l"))
    os.chown(m.path("l"), 777, 778, follow_symlinks=False)
    st = same_stat(m, "l")
    assert (st.st_uid, st.st_gid) == (777, 778)
    assert os.stat(m.backing / "f").st_uid == 4321        # the target did not change
    assert f.read_bytes() == b"data"


def test_truncate_by_path_and_fd(mounted):
    m = mounted
    data = os.urandom(200 * KiB)
    f = m.path("f")
    f.write_bytes(data)
    os.truncate(f, 70_000)                                         # shrink, not block aligned
    assert f.read_bytes() == data[:70_000]
    assert (flushed(m) / "f").read_bytes() == data[:70_000]
    os.truncate(f, 300 * KiB)                                      # grow: zeros
    want = data[:70_000] + bytes(300 * KiB - 70_000)
    assert f.read_bytes() == want
    assert (flushed(m) / "f").read_bytes() == want
    assert same_stat(m, "f").st_size == 300 * KiB

    fd = os.open(f, os.O_RDWR)
    try:
        os.ftruncate(fd, 5000)
        assert os.fstat(fd).st_size == 5000
        assert os.pread(fd, 10_000, 0) == data[:5000]
        os.ftruncate(fd, 9000)
        assert os.pread(fd, 10_000, 0) == data[:5000] + bytes(4000)
        os.ftruncate(fd, 0)
        assert os.pread(fd, 10, 0) == b""
    finally:
        os.close(fd)
    assert (flushed(m) / "f").read_bytes() == b""
    assert same_stat(m, "f").st_size == 0


def test_truncate_of_cached_file_drops_stale_blocks(mounted):
    m = mounted
    data = os.urandom(256 * KiB)
    (m.backing / "f").write_bytes(data)
    direct_read_twice(m.path("f"), len(data))
    wait_until(lambda: m.stats()["extents_cached"] >= 4, 10, what="promotion of 4 extents")
    os.truncate(m.path("f"), 100_001)
    os.truncate(m.path("f"), 256 * KiB)
    want = data[:100_001] + bytes(256 * KiB - 100_001)
    fd = os.open(m.path("f"), os.O_RDONLY | os.O_DIRECT)
    try:
        buf = mmap.mmap(-1, 256 * KiB)
        assert os.preadv(fd, [buf], 0) == 256 * KiB
        assert bytes(buf) == want
    finally:
        os.close(fd)
    assert m.path("f").read_bytes() == want
    assert (flushed(m) / "f").read_bytes() == want


# -- open / create flags ------------------------------------------------------------------------

def test_o_append(mounted):
    m = mounted
    f = m.path("log")
    f.write_bytes(b"start\n")
    a = os.open(f, os.O_WRONLY | os.O_APPEND)
    b = os.open(f, os.O_WRONLY | os.O_APPEND)
    try:
        os.write(a, b"one\n")
        os.write(b, b"two\n")
        os.write(a, b"three\n")
        os.lseek(b, 0, os.SEEK_SET)                      # O_APPEND ignores the position
        os.write(b, b"four\n")
    finally:
        os.close(a)
        os.close(b)
    want = b"start\none\ntwo\nthree\nfour\n"
    assert f.read_bytes() == want
    assert (flushed(m) / "log").read_bytes() == want
    with open(f, "ab") as fh:                           # a fresh O_APPEND|O_CREAT open
        fh.write(b"five\n")
    assert (flushed(m) / "log").read_bytes() == want + b"five\n"


def test_o_trunc(mounted):
    m = mounted
    data = os.urandom(128 * KiB)
    (m.backing / "f").write_bytes(data)
    direct_read_twice(m.path("f"), len(data))                     # cached before truncation
    wait_until(lambda: m.stats()["extents_cached"] >= 2, 10, what="promotion")
    fd = os.open(m.path("f"), os.O_RDWR | os.O_TRUNC)
    try:
        assert os.fstat(fd).st_size == 0
        assert os.pread(fd, 100, 0) == b""
        os.write(fd, b"new")
    finally:
        os.close(fd)
    assert m.path("f").read_bytes() == b"new"
    assert (flushed(m) / "f").read_bytes() == b"new"
    assert same_stat(m, "f").st_size == 3


@pytest.mark.parametrize("creat", [0, os.O_CREAT])
def test_o_trunc_with_o_rdonly_truncates_as_linux_does(mounted, creat):
    """POSIX leaves O_RDONLY | O_TRUNC open; Linux truncates (given write permission).
    cachefs kept the data (and with O_CREAT failed: BACKING's read-only descriptor cannot
    be truncated)."""
    m = mounted
    data = os.urandom(128 * KiB)
    (m.backing / "f").write_bytes(data)
    (m.backing / "f").chmod(0o444)              # root may write: the kernel lets it truncate
    direct_read_twice(m.path("f"), len(data))
    fd = os.open(m.path("f"), os.O_RDONLY | os.O_TRUNC | creat, 0o644)
    try:
        assert os.fstat(fd).st_size == 0
        assert os.pread(fd, 100, 0) == b""
    finally:
        os.close(fd)
    assert m.path("f").read_bytes() == b""
    assert (flushed(m) / "f").read_bytes() == b""
    m.path("g").write_bytes(data)
    os.chmod(m.path("g"), 0o644)
    os.chmod(m.mnt, 0o755)
    res = subprocess.run(["/usr/bin/python3", "-c", f"import os; os.open({str(m.path('g'))!r}, "
                          "os.O_RDONLY | os.O_TRUNC)"], user=USER, group=USER, cwd="/",
                         capture_output=True, text=True, timeout=30)
    assert res.returncode != 0 and "PermissionError" in res.stderr, res.stderr
    assert m.path("g").read_bytes() == data     # a user without write permission: EACCES


def test_a_shared_mapping_of_an_o_direct_open(mounted):
    """mmap(MAP_SHARED) of a file opened with O_DIRECT works on a local filesystem. cachefs
    answers such opens with direct_io, whose shared mappings the kernel refused with ENODEV
    (xfstests generic/091, 263: fsx -Z with mapped reads or writes) until the mount asked
    for FUSE_CAP_DIRECT_IO_ALLOW_MMAP. The mapping sees direct writes, and its own writes
    reach the daemon's reads and BACKING."""
    m = mounted
    if not m.stats()["direct_io_mmap_on"]:
        pytest.skip("FUSE_CAP_DIRECT_IO_ALLOW_MMAP is not in effect (the mount's log says why)")
    size = 256 * KiB
    want = bytearray(os.urandom(size))
    m.path("d").write_bytes(want)
    fd = os.open(m.path("d"), os.O_RDWR | os.O_DIRECT)
    try:
        with mmap.mmap(fd, size, mmap.MAP_SHARED) as mapped:
            assert mapped[:] == want
            patch = mmap.mmap(-1, 4096)
            patch.write(b"\xab" * 4096)
            assert os.pwrite(fd, patch, 8192) == 4096               # a direct write...
            want[8192:12288] = b"\xab" * 4096
            assert mapped[8192:12288] == want[8192:12288]           # ...seen by the mapping
            mapped[70000:70005] = b"HELLO"                          # a write through it...
            want[70000:70005] = b"HELLO"
            mapped.flush()
            buf = mmap.mmap(-1, size)
            assert os.preadv(fd, [buf], 0) == size                  # ...seen by direct reads
            assert bytes(buf) == want
        ro = os.open(m.path("d"), os.O_RDONLY | os.O_DIRECT)
        try:
            with mmap.mmap(ro, size, mmap.MAP_SHARED, mmap.PROT_READ) as mapped:
                assert mapped[:] == want
        finally:
            os.close(ro)
    finally:
        os.close(fd)
    assert (flushed(m) / "d").read_bytes() == want


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed")
def test_mapped_buffered_and_direct_writes_of_one_file_do_not_hang(mounted):
    """xfstests generic/095: fio jobs writing two files at once with O_DIRECT (sync, libaio,
    posixaio, splice), buffered and mmap writes, one of them mmap through an O_DIRECT open.
    With FUSE_CAP_DIRECT_IO_ALLOW_MMAP the kernel's writeback of that mapping reaches the
    daemon as writes through the direct_io open, after which cachefs dropped the file's
    pages: that waited for pages the kernel held until the write was answered, a deadlock
    (write-through, 4 of 4). ext4 runs it in about 2 s."""
    m = mounted
    jobs = [("job1", "sync", "randread", 1, "4096"), ("job2", "libaio", "randwrite", 1, "8k"),
            ("job3", "posixaio", "randwrite", 1, "4096"), ("job4", "splice", "randwrite", 1,
                                                           "8k"),
            ("job5", "sync", "randread", 0, "1k"), ("job6", "posixaio", "randwrite", 0, "8k"),
            ("job7", "splice", "randwrite", 0, "8k"), ("job8", "mmap", "randwrite", 0, "1k"),
            ("job9", "mmap", "randwrite", 1, "4096")]
    if not m.stats()["direct_io_mmap_on"]:
        jobs = jobs[:-1]        # (the kernel refuses job9's mapping: ENODEV)
    cmd = ["fio", "--iodepth=16", "--iodepth_batch=8", "--randrepeat=1", "--size=1m",
           f"--directory={m.mnt}", "--numjobs=5"]
    for name, engine, rw, direct, bs in jobs:
        cmd += [f"--name={name}", f"--ioengine={engine}", f"--rw={rw}", f"--direct={direct}",
                f"--bs={bs}", "--filename=file1:file2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        conn = f"/sys/fs/fuse/connections/{os.stat(m.mnt).st_dev}"
        with open(f"{conn}/abort", "w") as f:          # the hung requests fail: fio ends
            f.write("1")
        proc.kill()
        proc.communicate()
        raise AssertionError("fio hung on the mount (its FUSE connection was aborted)")
    assert proc.returncode == 0, out[-3000:]
    for name in ("file1", "file2"):
        assert (flushed(m) / name).read_bytes() == m.path(name).read_bytes(), name


def test_o_excl(mounted):
    m = mounted
    fd = os.open(m.path("x"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    os.close(fd)
    assert (m.backing / "x").exists()
    with pytest.raises(FileExistsError):
        os.open(m.path("x"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    (m.backing / "behind").write_bytes(b"b")                       # never looked up yet
    with pytest.raises(FileExistsError):
        os.open(m.path("behind"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    assert (flushed(m) / "behind").read_bytes() == b"b"
    m.path("dir").mkdir()
    with pytest.raises(FileExistsError):
        os.open(m.path("dir"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)


def test_o_direct(mounted):
    m = mounted
    size = 256 * KiB
    wbuf = mmap.mmap(-1, size)                           # page aligned, as O_DIRECT wants
    wbuf.write(os.urandom(size))
    fd = os.open(m.path("d"), os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    try:
        assert os.pwrite(fd, wbuf, 0) == size
        patch = mmap.mmap(-1, 4096)
        patch.write(b"\xab" * 4096)
        assert os.pwrite(fd, patch, 64 * KiB + 4096) == 4096      # an aligned overwrite
    finally:
        os.close(fd)
    want = bytearray(wbuf)
    want[64 * KiB + 4096:64 * KiB + 8192] = b"\xab" * 4096
    assert (flushed(m) / "d").read_bytes() == want

    rbuf = mmap.mmap(-1, size)
    for i in range(3):                                  # miss, miss (promotes), then hits
        if i == 2:
            wait_until(lambda: m.stats()["extents_cached"] >= 4, 10, what="promotion")
            s = m.stats()
            hits, pt = s["hit_ops"], s["passthrough_opens"]
        fd = os.open(m.path("d"), os.O_RDONLY | os.O_DIRECT)
        try:
            assert os.preadv(fd, [rbuf], 0) == size
            assert bytes(rbuf) == want
            part = mmap.mmap(-1, 8192)
            assert os.preadv(fd, [part], 60 * KiB) == 8192          # across an extent edge
            assert bytes(part) == want[60 * KiB:60 * KiB + 8192]
        finally:
            os.close(fd)
    s = m.stats()                                        # the last round came from the SSD:
    assert s["hit_ops"] > hits or s["passthrough_opens"] > pt    # daemon hits, or the kernel's
    assert m.path("d").read_bytes() == want              # the buffered view agrees


def test_o_sync(mounted):
    m = mounted
    fd = os.open(m.path("s"), os.O_WRONLY | os.O_CREAT | os.O_SYNC, 0o600)
    try:
        os.write(fd, b"durable")
        assert (flushed(m) / "s").read_bytes() == b"durable"    # before close
        os.write(fd, b" too")
    finally:
        os.close(fd)
    assert (flushed(m) / "s").read_bytes() == b"durable too"
    fd = os.open(m.path("s"), os.O_RDWR | os.O_DSYNC)
    try:
        os.pwrite(fd, b"D", 0)
    finally:
        os.close(fd)
    assert (flushed(m) / "s").read_bytes() == b"Durable too"


# -- namespace --------------------------------------------------------------------------------

def test_mkdir_rmdir(mounted):
    m = mounted
    os.mkdir(m.path("d"), 0o750)
    assert stat.S_ISDIR(same_stat(m, "d").st_mode)
    assert stat.S_IMODE(os.stat(m.backing / "d").st_mode) == 0o750
    with pytest.raises(FileExistsError):
        os.mkdir(m.path("d"))
    m.path("d", "f").write_bytes(b"x")
    with pytest.raises(OSError) as exc:
        os.rmdir(m.path("d"))
    assert exc.value.errno == errno.ENOTEMPTY
    assert (m.backing / "d" / "f").exists()
    with pytest.raises(NotADirectoryError):
        os.rmdir(m.path("d", "f"))
    os.unlink(m.path("d", "f"))
    os.rmdir(m.path("d"))
    assert not m.path("d").exists()
    assert not (m.backing / "d").exists()
    assert "d" not in os.listdir(m.mnt)
    with pytest.raises(FileNotFoundError):
        os.rmdir(m.path("d"))


def test_unlink(mounted):
    m = mounted
    m.path("f").write_bytes(b"x")
    os.unlink(m.path("f"))
    assert not (m.backing / "f").exists()
    assert "f" not in os.listdir(m.mnt)
    with pytest.raises(FileNotFoundError):
        os.unlink(m.path("f"))
    m.path("d").mkdir()
    with pytest.raises(IsADirectoryError):
        os.unlink(m.path("d"))


def test_unlink_open_file_leaves_the_listing(mounted):
    m = mounted
    m.path("f").write_bytes(b"old")
    fd = os.open(m.path("f"), os.O_RDWR)
    try:
        os.unlink(m.path("f"))
        assert "f" not in os.listdir(m.mnt)
        assert not m.path("f").exists()
        assert not (m.backing / "f").exists()
        m.path("f").write_bytes(b"a new file under the old name")
    finally:
        os.close(fd)
    assert m.path("f").read_bytes() == b"a new file under the old name"
    assert (flushed(m) / "f").read_bytes() == b"a new file under the old name"


def test_unlinked_open_file_stays_usable_through_its_fd(mounted):
    m = mounted
    data = os.urandom(100 * KiB)
    m.path("f").write_bytes(data)
    fd = os.open(m.path("f"), os.O_RDWR)
    try:
        os.unlink(m.path("f"))
        assert os.pread(fd, len(data), 0) == data
        os.pwrite(fd, b"after unlink", 10)
        assert os.pread(fd, 12, 10) == b"after unlink"
        assert os.fstat(fd).st_size == len(data)
        os.ftruncate(fd, 22)
        assert os.pread(fd, 100, 0) == data[:10] + b"after unlink"
    finally:
        os.close(fd)


def test_a_hard_link_stays_usable_when_the_kernel_forgets_the_other_names_directory(mounted):
    """d1/f and d2/g are one file; the kernel drops its unused dentries and inodes (memory
    pressure; here drop_caches), forgetting d1 while d2/g is held. Opening d2/g and reading
    its xattrs failed with ESTALE: the file's path was built from its first name only."""
    if os.geteuid() != 0:
        pytest.skip("drop_caches needs root")
    m = mounted
    for d in ("d1", "d2"):
        m.path(d).mkdir()
    m.path("d1", "f").write_bytes(b"linked" * 1000)
    os.setxattr(m.path("d1", "f"), "user.k", b"v")
    os.link(m.path("d1", "f"), m.path("d2", "g"))
    held = os.open(m.path("d2", "g"), os.O_PATH)        # keeps d2/g, not d1
    try:
        for _ in range(3):
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("2")
        assert os.getxattr(m.path("d2", "g"), "user.k") == b"v"
        assert m.path("d2", "g").read_bytes() == b"linked" * 1000
        assert m.path("d1", "f").read_bytes() == b"linked" * 1000
    finally:
        os.close(held)


def test_an_unlinked_open_file_reopens_through_its_descriptor(mounted):
    """`exec 3<f; rm f; cat /dev/fd/3`: the kernel opens the inode, which has no name left.
    cachefs answered ESTALE (it opened BACKING by path); it opens it through the handle."""
    m = mounted
    m.path("f").write_bytes(b"hello" * 1000)
    fd = os.open(m.path("f"), os.O_RDONLY)
    try:
        os.unlink(m.path("f"))
        with open(f"/proc/self/fd/{fd}", "rb") as again:
            assert again.read() == b"hello" * 1000
    finally:
        os.close(fd)


def _link_fd(fd: int, new) -> int:
    """linkat(fd, "", AT_FDCWD, new, AT_EMPTY_PATH): 0 or the errno."""
    libc = ctypes.CDLL(None, use_errno=True)
    return 0 if libc.linkat(fd, b"", -100, os.fsencode(new), 0x1000) == 0 else ctypes.get_errno()


def test_a_hard_link_held_through_the_name_that_went(mounted):
    """A/a and B/b are one file; a process holds it through A/a (O_PATH), and A/a is
    removed. The kernel never looked B/b up, so cachefs knew no name of the file: fstat,
    xattrs and reopening through the descriptor answered ESTALE. It reaches the file through
    the descriptor it kept when the name went."""
    m = mounted
    for d in ("A", "B"):
        (m.backing / d).mkdir()
    (m.backing / "A" / "a").write_bytes(b"linked" * 100)
    os.link(m.backing / "A" / "a", m.backing / "B" / "b")       # behind the mount
    os.setxattr(m.backing / "A" / "a", "user.k", b"v")
    fd = os.open(m.path("A", "a"), os.O_PATH)
    try:
        os.unlink(m.path("A", "a"))
        proc = f"/proc/self/fd/{fd}"
        assert os.fstat(fd).st_nlink == 1
        assert os.getxattr(proc, "user.k") == b"v"
        with open(proc, "rb") as f:
            assert f.read() == b"linked" * 100
        assert _link_fd(fd, m.path("C")) == 0
        assert os.stat(m.path("C")).st_nlink == 2
    finally:
        os.close(fd)
    assert m.path("B", "b").read_bytes() == b"linked" * 100
    assert m.path("C").read_bytes() == b"linked" * 100
    assert os.stat(m.backing / "C").st_ino == os.stat(m.backing / "B" / "b").st_ino


def test_chmod_chown_utime_through_a_descriptor_of_a_nameless_node(mounted):
    """A file held through an O_PATH descriptor (no open handle) loses its last name:
    chmod, chown and utime through /proc/self/fd reach it, as on ext4 (they answered ESTALE:
    cachefs knew no name of it, and an O_PATH descriptor takes no fchmod). (Flushed first: in
    write-back a nameless node's unwritten bytes went with its last name, size included.)"""
    m = mounted
    m.path("f").write_bytes(b"data")
    flushed(m)
    pfd = os.open(m.path("f"), os.O_PATH)
    try:
        os.unlink(m.path("f"))
        proc = f"/proc/self/fd/{pfd}"
        os.chmod(proc, 0o604)
        os.chown(proc, 1234, 5678)
        os.utime(proc, ns=(1_000_000_000, 2_000_000_000))
        st = os.stat(proc)
        assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o604, 1234, 5678)
        assert (st.st_atime_ns, st.st_mtime_ns) == (1_000_000_000, 2_000_000_000)
        assert st.st_size == 4 and st.st_nlink == 0
        assert _link_fd(pfd, m.path("g")) == errno.ENOENT   # as on ext4: no name, no link
        if "write-back" in m.args:      # its data (unwritten bytes too) went with its name
            with pytest.raises(OSError) as exc:
                open(proc, "rb")
            assert exc.value.errno == errno.ESTALE
        else:                           # BACKING has every byte: reopened through it
            for _ in range(2):
                with open(proc, "rb") as f:
                    assert f.read() == b"data"
    finally:
        os.close(pfd)


def test_xattrs_through_a_descriptor_reach_its_file_after_a_rename_behind_the_mount(mounted):
    """f is open; on BACKING (behind the mount) f is renamed to f.old and a new f made.
    fsetxattr on the descriptor must reach the open file (f.old), not the new f: cachefs
    named it by its old path."""
    m = mounted
    m.path("f").write_bytes(b"old")
    fd = os.open(m.path("f"), os.O_RDONLY)
    try:
        os.rename(m.backing / "f", m.backing / "f.old")
        (m.backing / "f").write_bytes(b"new")
        os.setxattr(fd, "user.who", b"fd-of-old")
        assert os.getxattr(fd, "user.who") == b"fd-of-old"
    finally:
        os.close(fd)
    assert os.getxattr(m.backing / "f.old", "user.who") == b"fd-of-old"
    assert "user.who" not in os.listxattr(m.backing / "f")


def test_xattrs_by_path_never_reach_another_file_put_at_the_name_behind_the_mount(mounted):
    """The same with no open handle (an O_PATH descriptor never reaches the daemon): cachefs
    names the node by its path, which now leads to the new f. The call must not change or
    report the new file's xattrs: ESTALE (the name is no longer this file's)."""
    m = mounted
    m.path("f").write_bytes(b"old")
    os.setxattr(m.path("f"), "user.old", b"1")
    pfd = os.open(m.path("f"), os.O_PATH)
    try:
        os.rename(m.backing / "f", m.backing / "f.old")
        (m.backing / "f").write_bytes(b"new")
        os.setxattr(m.backing / "f", "user.new", b"2")
        proc = f"/proc/self/fd/{pfd}"
        for call in (lambda: os.setxattr(proc, "user.who", b"opath-of-old"),
                     lambda: os.removexattr(proc, "user.new"),
                     lambda: os.getxattr(proc, "user.new"),
                     lambda: os.listxattr(proc)):
            try:
                got = call()
            except OSError as exc:
                assert exc.errno == errno.ESTALE, exc
            else:
                assert got in (None, b"1", ["user.old"]), got      # only ever the old file's
    finally:
        os.close(pfd)
    assert os.listxattr(m.backing / "f") == ["user.new"]
    assert os.getxattr(m.backing / "f", "user.new") == b"2"
    assert "user.who" not in os.listxattr(m.backing / "f.old")


def test_rename_file_and_over_existing_target(mounted):
    m = mounted
    m.path("a").write_bytes(b"A" * 5000)
    m.path("b").write_bytes(b"B")
    os.rename(m.path("a"), m.path("c"))
    assert not m.path("a").exists() and not (m.backing / "a").exists()
    assert m.path("c").read_bytes() == b"A" * 5000
    assert (flushed(m) / "c").read_bytes() == b"A" * 5000

    os.rename(m.path("c"), m.path("b"))                      # replaces b
    assert m.path("b").read_bytes() == b"A" * 5000
    assert (flushed(m) / "b").read_bytes() == b"A" * 5000
    assert sorted(os.listdir(m.mnt)) == ["b"]
    assert sorted(os.listdir(m.backing)) == ["b"]

    m.path("b2").write_bytes(b"x")
    os.rename(m.path("b"), m.path("b2"))                     # into the kernel-known target
    assert m.path("b2").read_bytes() == b"A" * 5000
    with pytest.raises(FileNotFoundError):
        os.rename(m.path("nope"), m.path("b3"))


def test_rename_directory_with_children(mounted):
    m = mounted
    m.path("d", "sub").mkdir(parents=True)
    m.path("d", "sub", "f").write_bytes(b"child")
    fd = os.open(m.path("d", "sub", "f"), os.O_RDWR)         # looked up before the rename
    try:
        os.rename(m.path("d"), m.path("e"))
        assert m.path("e", "sub", "f").read_bytes() == b"child"
        assert not m.path("d").exists()
        os.pwrite(fd, b"C", 0)
        assert (flushed(m) / "e" / "sub" / "f").read_bytes() == b"Child"
    finally:
        os.close(fd)
    m.path("e", "sub", "g").write_bytes(b"new child")
    assert (flushed(m) / "e" / "sub" / "g").read_bytes() == b"new child"
    os.rename(m.path("e", "sub"), m.path("top"))
    assert sorted(os.listdir(m.path("top"))) == ["f", "g"]
    assert m.path("top", "f").read_bytes() == b"Child"
    same_stat(m, "top/g")
    m.path("full").mkdir()
    m.path("full", "x").write_bytes(b"")
    with pytest.raises(OSError) as exc:
        os.rename(m.path("top"), m.path("full"))
    assert exc.value.errno in (errno.ENOTEMPTY, errno.EEXIST)


def test_rename_noreplace_and_exchange(mounted):
    m = mounted
    m.path("a").write_bytes(b"AAA")
    m.path("b").write_bytes(b"BB")
    with pytest.raises(FileExistsError):
        renameat2(m.path("a"), m.path("b"), RENAME_NOREPLACE)
    assert m.path("a").read_bytes() == b"AAA" and m.path("b").read_bytes() == b"BB"
    renameat2(m.path("a"), m.path("c"), RENAME_NOREPLACE)
    assert m.path("c").read_bytes() == b"AAA" and not (flushed(m) / "a").exists()

    ino_b, ino_c = os.stat(m.path("b")).st_ino, os.stat(m.path("c")).st_ino
    renameat2(m.path("b"), m.path("c"), RENAME_EXCHANGE)
    assert m.path("b").read_bytes() == b"AAA" and m.path("c").read_bytes() == b"BB"
    assert (flushed(m) / "b").read_bytes() == b"AAA"
    assert (flushed(m) / "c").read_bytes() == b"BB"
    assert (os.stat(m.path("b")).st_ino, os.stat(m.path("c")).st_ino) == (ino_c, ino_b)

    m.path("dir").mkdir()
    m.path("dir", "inside").write_bytes(b"in")
    renameat2(m.path("dir"), m.path("b"), RENAME_EXCHANGE)           # a file <-> a directory
    assert m.path("b", "inside").read_bytes() == b"in"
    assert m.path("dir").read_bytes() == b"AAA"
    assert (flushed(m) / "b" / "inside").read_bytes() == b"in"
    m.path("b", "inside").write_bytes(b"IN")
    assert (flushed(m) / "b" / "inside").read_bytes() == b"IN"
    with pytest.raises(FileNotFoundError):
        renameat2(m.path("dir"), m.path("missing"), RENAME_EXCHANGE)



def test_rename_whiteout_leaves_a_whiteout(mounted):
    """renameat2(RENAME_WHITEOUT), as overlayfs does on its upper directory: the file moves
    and a whiteout (a character device 0:0) takes its old name, on the mount and BACKING."""
    m = mounted
    data = os.urandom(100_000)
    m.path("a").write_bytes(data)
    assert m.path("a").read_bytes() == data
    renameat2(m.path("a"), m.path("b"), RENAME_WHITEOUT)
    for st in (os.lstat(m.path("a")), os.lstat(flushed(m) / "a")):
        assert stat.S_ISCHR(st.st_mode) and st.st_rdev == 0
    assert m.path("b").read_bytes() == data and (flushed(m) / "b").read_bytes() == data
    assert sorted(os.listdir(m.mnt)) == ["a", "b"]
    os.unlink(m.path("a"))
    assert not os.path.lexists(flushed(m) / "a")


def test_rename_exchange_of_cached_files_is_cachefs_own_change(mounted, mode):
    """RENAME_EXCHANGE moves two files: both new ctimes are cachefs's own change, so neither
    file's cached data is dropped as changed behind the cache nor reported as a conflict
    (both were, for the node swapped to the old name)."""
    m = mounted
    a, b = os.urandom(200_000), os.urandom(300_000)
    m.path("a").write_bytes(a)
    m.path("b").write_bytes(b)
    for _ in range(2):
        assert m.path("a").read_bytes() == a and m.path("b").read_bytes() == b
    time.sleep(0.3)
    before = m.stats()
    assert before["extents_cached"] >= 8
    renameat2(m.path("a"), m.path("b"), RENAME_EXCHANGE)
    time.sleep(0.3)                                 # past the attribute timeout: revalidation
    assert os.stat(m.path("a")).st_size == len(b) and os.stat(m.path("b")).st_size == len(a)
    assert m.path("a").read_bytes() == b and m.path("b").read_bytes() == a
    after = m.stats()
    assert (after["conflicts"], after["stale_files"], after["drop_coherence"]) == \
        (before["conflicts"], before["stale_files"], before["drop_coherence"])
    assert after["extents_cached"] == before["extents_cached"]
    assert (flushed(m) / "a").read_bytes() == b and (flushed(m) / "b").read_bytes() == a


def test_removed_directory_that_is_a_cwd(mounted, tmp_path):
    """A process whose working directory is removed can still stat, open and list "." (nlink
    0, no entries), as on Linux; cachefs answered ENOENT (`ls` failed there)."""
    script = ("import os, stat; os.rmdir('../d'); st = os.stat('.'); "
              "fd = os.open('.', os.O_RDONLY | os.O_DIRECTORY); os.close(fd); "
              "x = os.getxattr('.', 'user.k'); "    # its xattrs too (were ESTALE)
              "print(st.st_nlink, stat.S_ISDIR(st.st_mode), os.listdir('.'), x)")
    outs = []
    for top in (tmp_path, mounted.mnt):
        (top / "d").mkdir()
        os.setxattr(top / "d", "user.k", b"v")
        res = subprocess.run([sys.executable, "-c", script], cwd=top / "d",
                             capture_output=True, text=True, timeout=30)
        assert res.returncode == 0, res.stderr
        outs.append(res.stdout)
    assert outs[1] == outs[0] == "0 True [] b'v'\n"
    mounted.path("d").mkdir()                       # the name again: a new directory
    assert os.stat(mounted.path("d")).st_nlink == os.stat(mounted.backing / "d").st_nlink
    assert os.listdir(mounted.path("d")) == []      # (nlink: 2 on ext4, 1 on btrfs)


def test_a_listing_continued_after_a_rename_does_not_misroute(mounted):
    """A directory listing spans several readdir requests; its entries are a snapshot. A
    directory renamed (and its old name taken by a new one) while the listing goes on must
    not get its old name back from the rest of the listing: operations inside the renamed
    directory, by its inode, went to the new directory of that name."""
    m = mounted
    top = m.path("big")
    top.mkdir()
    for i in range(1500):                           # long names: many readdir requests
        (top / (f"d{i:04d}_" + "x" * 100)).mkdir()
    victim = os.listdir(top)[-1]                    # returned by the last requests
    (top / victim / "orig").write_bytes(b"orig")
    it = os.scandir(top)
    next(it)                                        # the listing has started
    os.rename(top / victim, top / "moved")
    dfd = os.open(top / "moved", os.O_RDONLY | os.O_DIRECTORY)
    try:
        (top / victim).mkdir()                      # a new directory takes the old name
        for _ in it:                                # the listing goes on
            pass
        it.close()
        fd = os.open("new_file", os.O_CREAT | os.O_WRONLY, 0o644, dir_fd=dfd)
        os.write(fd, b"into moved")
        os.close(fd)
        assert sorted(os.listdir(dfd)) == ["new_file", "orig"]
    finally:
        os.close(dfd)
    assert sorted(os.listdir(top / "moved")) == ["new_file", "orig"]
    assert os.listdir(top / victim) == []
    assert sorted(os.listdir(m.backing / "big" / "moved")) == ["new_file", "orig"]
    assert os.listdir(m.backing / "big" / victim) == []

def test_hard_link(mounted):
    m = mounted
    m.path("a").write_bytes(b"hello world")
    os.link(m.path("a"), m.path("b"))
    sa, sb = os.stat(m.path("a")), os.stat(m.path("b"))
    assert sa.st_ino == sb.st_ino
    assert sa.st_nlink == sb.st_nlink == 2
    assert os.stat(m.backing / "b").st_ino == os.stat(m.backing / "a").st_ino
    with open(m.path("a"), "r+b") as f:
        f.seek(6)
        f.write(b"WORLD")
    assert m.path("b").read_bytes() == b"hello WORLD"
    assert (flushed(m) / "b").read_bytes() == b"hello WORLD"
    with open(m.path("b"), "ab") as f:
        f.write(b"!")
    assert m.path("a").read_bytes() == b"hello WORLD!"
    os.unlink(m.path("a"))
    assert m.path("b").read_bytes() == b"hello WORLD!"
    assert same_stat(m, "b").st_nlink == 1
    with pytest.raises(FileExistsError):
        os.link(m.path("b"), m.path("b"))


def test_symlink_readlink(mounted):
    m = mounted
    m.path("target").write_bytes(b"T")
    os.symlink("target", m.path("rel"))
    os.symlink("/definitely/not/here", m.path("dangling"))
    assert os.readlink(m.path("rel")) == "target"
    assert os.readlink(m.backing / "rel") == "target"
    assert os.readlink(m.path("dangling")) == "/definitely/not/here"
    assert stat.S_ISLNK(same_stat(m, "rel").st_mode)
    assert m.path("rel").read_bytes() == b"T"
    with pytest.raises(FileNotFoundError):
        m.path("dangling").read_bytes()
    os.symlink("rel", m.path("chain"))
    assert m.path("chain").read_bytes() == b"T"
    os.unlink(m.path("rel"))
    assert (m.backing / "target").exists()
    assert not os.path.lexists(m.backing / "rel")


def test_mkfifo(mounted):
    m = mounted
    os.mkfifo(m.path("p"), 0o640)
    st = same_stat(m, "p")
    assert stat.S_ISFIFO(st.st_mode)
    assert stat.S_ISFIFO(os.stat(m.backing / "p").st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o640
    r = os.open(m.path("p"), os.O_RDONLY | os.O_NONBLOCK)
    try:
        w = os.open(m.path("p"), os.O_WRONLY | os.O_NONBLOCK)
        try:
            os.write(w, b"through the pipe")
            assert os.read(r, 100) == b"through the pipe"
        finally:
            os.close(w)
    finally:
        os.close(r)


# -- xattrs, statfs, fsync, mmap, fallocate, sparse and large files ---------------------------

def test_xattrs(mounted):
    m = mounted
    f = m.path("f")
    f.write_bytes(b"x")
    os.setxattr(f, "user.color", b"blue")
    os.setxattr(f, "user.empty", b"")
    assert os.getxattr(f, "user.color") == b"blue"
    assert os.getxattr(m.backing / "f", "user.color") == b"blue"
    assert os.getxattr(f, "user.empty") == b""
    assert set(os.listxattr(f)) >= {"user.color", "user.empty"}
    os.setxattr(f, "user.color", b"red" * 1000)
    assert os.getxattr(f, "user.color") == b"red" * 1000
    os.removexattr(f, "user.color")
    assert "user.color" not in os.listxattr(f)
    assert "user.color" not in os.listxattr(m.backing / "f")
    with pytest.raises(OSError) as exc:
        os.getxattr(f, "user.color")
    assert exc.value.errno == errno.ENODATA
    with pytest.raises(OSError) as exc:
        os.removexattr(f, "user.color")
    assert exc.value.errno == errno.ENODATA

    # directories and BACKING-made xattrs
    m.path("d").mkdir()
    os.setxattr(m.backing / "d", "user.behind", b"b")
    assert os.getxattr(m.path("d"), "user.behind") == b"b"

    # the root: the control attribute answers but is never listed, and cannot be changed
    assert os.getxattr(m.mnt, "user.cachefs.control")
    assert "user.cachefs.control" not in os.listxattr(m.mnt)
    os.setxattr(m.mnt, "user.root", b"r")
    assert os.getxattr(m.backing, "user.root") == b"r"
    assert "user.root" in os.listxattr(m.mnt)
    assert "user.cachefs.control" not in os.listxattr(m.mnt)
    with pytest.raises(PermissionError):
        os.setxattr(m.mnt, "user.cachefs.control", b"/tmp/evil")


def test_xattr_create_replace_flags(mounted):
    m = mounted
    f = m.path("f")
    f.write_bytes(b"x")
    os.setxattr(f, "user.a", b"1")
    with pytest.raises(FileExistsError):
        os.setxattr(f, "user.a", b"2", os.XATTR_CREATE)
    with pytest.raises(OSError) as exc:
        os.setxattr(f, "user.b", b"2", os.XATTR_REPLACE)
    assert exc.value.errno == errno.ENODATA


def test_statfs(mounted):
    m = mounted
    a, b = os.statvfs(m.mnt), os.statvfs(m.backing)
    assert a.f_blocks == b.f_blocks
    assert a.f_frsize == b.f_frsize
    assert a.f_files == b.f_files
    assert a.f_namemax == b.f_namemax
    assert abs(a.f_bfree - b.f_bfree) * b.f_frsize < 256 * MiB       # others use the disk too
    assert abs(a.f_bavail - b.f_bavail) * b.f_frsize < 256 * MiB


def test_fsync_fdatasync(mounted):
    m = mounted
    fd = os.open(m.path("f"), os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"a" * 10_000)
        os.fsync(fd)
        assert (flushed(m) / "f").read_bytes() == b"a" * 10_000
        os.pwrite(fd, b"b", 10_000)
        os.fdatasync(fd)
        assert (flushed(m) / "f").read_bytes() == b"a" * 10_000 + b"b"
    finally:
        os.close(fd)
    dfd = os.open(m.mnt, os.O_RDONLY | os.O_DIRECTORY)          # fsync of a directory
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def test_mmap_shared_write_and_read(mounted):
    m = mounted
    data = bytearray(os.urandom(3 * 4096 + 100))
    m.path("f").write_bytes(data)
    with open(m.path("f"), "r+b") as fh:
        mm = mmap.mmap(fh.fileno(), len(data), mmap.MAP_SHARED,
                       mmap.PROT_READ | mmap.PROT_WRITE)
        try:
            assert mm[:] == data
            mm[5000:5011] = b"mmap wrote!"
            mm[len(data) - 3:] = b"END"
            mm.flush()                                            # msync
        finally:
            mm.close()
    data[5000:5011] = b"mmap wrote!"
    data[len(data) - 3:] = b"END"
    assert (flushed(m) / "f").read_bytes() == data
    assert m.path("f").read_bytes() == data

    (m.backing / "g").write_bytes(b"G" * 20_000)                   # read-only map of BACKING data
    with open(m.path("g"), "rb") as fh:
        with mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ) as mm:
            assert mm[:] == b"G" * 20_000


def test_posix_fallocate(mounted):
    m = mounted
    fd = os.open(m.path("f"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"keep me")
        os.posix_fallocate(fd, 0, 1 * MiB)
        assert os.fstat(fd).st_size == 1 * MiB
        assert os.pread(fd, 7, 0) == b"keep me"
        os.posix_fallocate(fd, 0, 4096)                   # inside the file: size unchanged
        assert os.fstat(fd).st_size == 1 * MiB
    finally:
        os.close(fd)
    assert same_stat(m, "f").st_size == 1 * MiB
    want = b"keep me" + bytes(1 * MiB - 7)
    assert (flushed(m) / "f").read_bytes() == want
    assert m.path("f").read_bytes() == want


def test_sparse_file_beyond_4gib(mounted):
    m = mounted
    payload = os.urandom(4096)
    edge = os.urandom(8192)
    fd = os.open(m.path("big"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        assert os.pwrite(fd, payload, 5 * GiB) == 4096
        assert os.pwrite(fd, edge, 4 * GiB - 4096) == 8192       # straddles 2**32
        assert os.fstat(fd).st_size == 5 * GiB + 4096
        for _ in range(3):                        # misses, then (promoted) hits
            assert os.pread(fd, 4096, 5 * GiB) == payload
            assert os.pread(fd, 8192, 4 * GiB - 4096) == edge
            assert os.pread(fd, 4096, 0) == bytes(4096)
            assert os.pread(fd, 4096, 2 * GiB + 123) == bytes(4096)
            assert os.pread(fd, 100, 5 * GiB + 4000) == payload[4000:]
        assert os.pread(fd, 10, 5 * GiB + 4096) == b""
    finally:
        os.close(fd)
    st = same_stat(m, "big")
    assert st.st_size == 5 * GiB + 4096
    bst = os.stat(flushed(m) / "big")
    assert bst.st_blocks * 512 < 16 * MiB                       # BACKING stayed sparse
    with open(flushed(m) / "big", "rb") as f:
        f.seek(5 * GiB)
        assert f.read() == payload
        f.seek(4 * GiB - 4096)
        assert f.read(8192) == edge
    os.truncate(m.path("big"), 6 * GiB)
    assert same_stat(m, "big").st_size == 6 * GiB
    with open(m.path("big"), "rb") as f:
        f.seek(6 * GiB - 4096)
        assert f.read() == bytes(4096)


# -- ownership and permissions ------------------------------------------------------------------

def test_new_nodes_belong_to_the_caller(mounted):
    m = mounted
    m.path("pub").mkdir()
    os.chmod(m.path("pub"), 0o777)
    r = as_user(m.path("pub"), "set -e; echo data > file; mkdir dir; ln -s file sym; "
                "mkfifo fifo; echo orig > orig; ln orig hard; : > dir/inner")
    assert r.returncode == 0, r.stderr
    for name in ("file", "dir", "sym", "fifo", "orig", "hard", "dir/inner"):
        for st in (os.lstat(m.backing / "pub" / name), os.lstat(m.path("pub", name))):
            assert (st.st_uid, st.st_gid) == (USER, USER), (name, st)
    assert os.stat(m.path("pub", "hard")).st_ino == os.stat(m.path("pub", "orig")).st_ino
    assert (flushed(m) / "pub" / "file").read_bytes() == b"data\n"


def test_setgid_directory_passes_its_group(mounted):
    m = mounted
    m.path("sg").mkdir()
    os.chown(m.path("sg"), 0, SGID_GROUP)
    os.chmod(m.path("sg"), 0o2777)
    assert stat.S_IMODE(os.stat(m.backing / "sg").st_mode) == 0o2777
    r = as_user(m.path("sg"), "set -e; echo x > f; mkdir d; ln -s f l; mkfifo p")
    assert r.returncode == 0, r.stderr
    for name in ("f", "d", "l", "p"):
        for st in (os.lstat(m.backing / "sg" / name), os.lstat(m.path("sg", name))):
            assert (st.st_uid, st.st_gid) == (USER, SGID_GROUP), (name, st)
    for st in (os.stat(m.backing / "sg" / "d"), os.stat(m.path("sg", "d"))):
        assert st.st_mode & stat.S_ISGID                 # subdirectories inherit the bit


def test_permission_checks_for_other_users(mounted):
    m = mounted
    m.path("pub").mkdir()
    os.chmod(m.path("pub"), 0o755)
    m.path("pub", "secret").write_bytes(b"root only")
    os.chmod(m.path("pub", "secret"), 0o600)
    m.path("pub", "open").write_bytes(b"everyone")
    os.chmod(m.path("pub", "open"), 0o644)

    r = as_user(m.path("pub"), "cat secret")
    assert r.returncode != 0 and "Permission denied" in r.stderr, r
    r = as_user(m.path("pub"), "echo x >> secret")
    assert r.returncode != 0 and "Permission denied" in r.stderr, r
    r = as_user(m.path("pub"), "chmod 666 secret")
    assert r.returncode != 0 and "not permitted" in r.stderr, r
    r = as_user(m.path("pub"), "echo x > newfile")                    # 0755 dir of root
    assert r.returncode != 0 and "Permission denied" in r.stderr, r
    r = as_user(m.path("pub"), "rm -f open")
    assert r.returncode != 0, r
    r = as_user(m.path("pub"), "cat open")
    assert r.returncode == 0 and r.stdout == "everyone", r
    assert (flushed(m) / "pub" / "secret").read_bytes() == b"root only"
    assert stat.S_IMODE(os.stat(m.backing / "pub" / "secret").st_mode) == 0o600
    assert sorted(os.listdir(m.backing / "pub")) == ["open", "secret"]


@pytest.mark.skipif(os.geteuid() != 0, reason="creates as another user")
def test_create_keeps_setuid_and_setgid_bits(mounted, tmp_path):
    """open(O_CREAT) with 04755 or 02755 gives the file those bits, as on BACKING, for root
    and for another user; cachefs's chown of the new file to its creator cleared them."""
    script = ("import os, sys; os.umask(0o022); "
              "[os.close(os.open(f'{sys.argv[1]}/{m:o}', os.O_CREAT | os.O_WRONLY, m)) "
              "for m in (0o4755, 0o2755, 0o6755, 0o755)]; "
              "print(sorted(f'{n} {os.stat(sys.argv[1] + \"/\" + n).st_mode:o}' "
              "for n in os.listdir(sys.argv[1])))")
    outs = _as_root_and_nobody(script, tmp_path, mounted, (False,))
    assert outs[2:] == outs[:2]
    assert "4755 104755" in outs[0] and "2755 102755" in outs[1]


def _as_root_and_nobody(script: str, tmp_path, mounted, setgid_dirs) -> list[str]:
    """Run `script DIR` as root and as nobody, in a new directory of a plain directory and
    then of the mount, for each of `setgid_dirs` (True: a set-group-ID directory of group
    100): their outputs, the plain directory's first."""
    python = "/usr/bin/python3"                     # one the other user may run
    if not os.path.exists(python):
        pytest.skip("no /usr/bin/python3 for the other user")
    for d in [tmp_path, *tmp_path.parents][:-1]:     # pytest's directories are 0700
        os.chmod(d, stat.S_IMODE(os.stat(d).st_mode) | 0o011)
    outs = []
    for top in (tmp_path / "plain", mounted.mnt):
        top.mkdir(exist_ok=True)
        for who, kw in (("root", {}), ("nobody", dict(user=65534, group=65534,
                                                       extra_groups=[]))):
            for setgid_dir in setgid_dirs:
                d = top / f"{who}{'-sgid' if setgid_dir else ''}"
                d.mkdir()
                os.chown(d, 0, 100 if setgid_dir else 0)
                os.chmod(d, 0o2777 if setgid_dir else 0o777)
                res = subprocess.run([python, "-c", script, str(d)], capture_output=True,
                                     text=True, timeout=30, **kw)
                assert res.returncode == 0, res.stderr
                outs.append(res.stdout)
    return outs


def test_mknod_keeps_setuid_and_setgid_bits(mounted, tmp_path):
    """mknod(2) of regular files and FIFOs with setuid/setgid bits, by root and by another
    user, in a plain and in a set-group-ID directory, gives the nodes those bits as on
    BACKING; cachefs's chown of the new node to its creator cleared them (as it did for
    create, above: xfstests generic/633, vfstest's setgid_create)."""
    script = ("import os, stat, sys; os.umask(0o022); "
              "[os.mknod(f'{sys.argv[1]}/{k}{m:o}', t | m) "
              "for k, t in (('r', stat.S_IFREG), ('p', stat.S_IFIFO)) "
              "for m in (0o4755, 0o2755, 0o6755, 0o2010, 0o755)]; "
              "print(sorted(f'{n} {os.stat(sys.argv[1] + \"/\" + n).st_mode:o} "
              "{os.stat(sys.argv[1] + \"/\" + n).st_gid}' for n in os.listdir(sys.argv[1])))")
    outs = _as_root_and_nobody(script, tmp_path, mounted, (False, True))
    assert outs[4:] == outs[:4]
    assert "r2010 102010 100" in outs[1] and "p4755 14755 0" in outs[0]


class _Dirent(ctypes.Structure):
    _fields_ = [("d_ino", ctypes.c_uint64), ("d_off", ctypes.c_int64),
                ("d_reclen", ctypes.c_ushort), ("d_type", ctypes.c_ubyte),
                ("d_name", ctypes.c_char * 256)]


def raw_listing(path) -> dict[bytes, tuple[int, int]]:
    """Every entry readdir(3) returns, "." and ".." included: name -> (d_ino, d_type)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.opendir.restype = ctypes.c_void_p
    libc.readdir.restype = ctypes.POINTER(_Dirent)
    libc.readdir.argtypes = libc.closedir.argtypes = [ctypes.c_void_p]
    d = libc.opendir(os.fsencode(path))
    assert d, os.strerror(ctypes.get_errno())
    out = {}
    try:
        while True:
            ent = libc.readdir(d)
            if not ent:
                return out
            out[ent.contents.d_name] = (ent.contents.d_ino, ent.contents.d_type)
    finally:
        libc.closedir(d)


def test_listings_have_dot_and_dotdot(mounted):
    """readdir returns "." and ".." as on BACKING (`ls -a` showed neither), with the
    directory's and its parent's inode numbers, and a removed directory lists nothing."""
    m = mounted
    (m.path("a") / "b").mkdir(parents=True)
    (m.path("a") / "f").write_bytes(b"x")
    DT_DIR, DT_REG = 4, 8
    got = raw_listing(m.path("a", "b"))
    assert got == {b".": (os.stat(m.path("a", "b")).st_ino, DT_DIR),
                   b"..": (os.stat(m.path("a")).st_ino, DT_DIR)}, got
    got = raw_listing(m.path("a"))
    assert set(got) == {b".", b"..", b"b", b"f"} and got[b"f"][1] == DT_REG, got
    assert got[b"."][0] == os.stat(m.path("a")).st_ino
    assert got[b".."][0] == os.stat(m.mnt).st_ino
    assert set(raw_listing(m.mnt)) == {b".", b"..", b"a"}
    assert sorted(os.listdir(m.path("a"))) == ["b", "f"]     # (Python leaves them out)
    fd = os.open(m.path("a", "b"), os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.rmdir(m.path("a", "b"))
        assert os.listdir(fd) == [] and raw_listing(f"/proc/self/fd/{fd}") == {}
    finally:
        os.close(fd)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs inside BACKING")
@pytest.mark.parametrize("mode", ["write-through", "write-back"])
def test_a_filesystem_mounted_inside_backing_is_not_crossed_into(make_mount, make_tmpfs, mode):
    """Node ids are BACKING's inode numbers; another filesystem mounted inside BACKING has
    numbers of its own. Taken as node ids they aliased BACKING's files: reads returned the
    other file's bytes and a write-back write landed in the other file (a helper's hunt:
    two tmpfs files of inode 3), and a tmpfs root (inode 1, the root's node id) gave EIO.
    Its mount point is not listed; looking it up fails with EXDEV, and a line says why."""
    backing, other = make_tmpfs("16M"), make_tmpfs("16M")
    (backing / "sub").mkdir()
    (backing / "a").write_bytes(b"1" * 300_000)
    (other / "d").mkdir()
    (other / "d" / "a").write_bytes(b"2" * 200_000)
    subprocess.run(["mount", "--bind", str(other / "d"), str(backing / "sub")], check=True)
    try:
        m = make_mount("--mode", mode, backing=backing)
        assert os.listdir(m.mnt) == ["a"]
        with pytest.raises(OSError) as err:
            os.stat(m.path("sub"))
        assert err.value.errno == errno.EXDEV
        with pytest.raises(OSError) as err:
            open(m.path("sub/a"), "rb")
        assert err.value.errno == errno.EXDEV
        assert m.path("a").read_bytes() == b"1" * 300_000
        with open(m.path("a"), "r+b") as f:
            f.write(b"Z" * 10)
        flushed(m)
        assert (backing / "a").read_bytes()[:11] == b"Z" * 10 + b"1"
        assert (other / "d" / "a").read_bytes() == b"2" * 200_000
        wait_until(lambda: "does not cross into it" in m.logs[-1].read_text(), 5)
    finally:
        subprocess.run(["umount", "-l", str(backing / "sub")], capture_output=True)


def test_a_read_the_cache_answers_moves_atime_as_relatime_does(mounted):
    """Reads the cache answered never reached BACKING, so atime stayed where it was (a
    helper's differential hunt): "new mail" checks, tmpwatch and find -atime go by it. Now
    a read-open reads a block of BACKING when relatime would move the atime."""
    m = mounted
    data = os.urandom(128 * KiB)
    m.path("f").write_bytes(data)
    direct_read_twice(m.path("f"), len(data))                     # cached
    subprocess.run(["touch", "-a", "-d", "2020-01-01", str(m.path("f"))], check=True)
    subprocess.run(["touch", "-m", "-d", "2021-01-01", str(m.path("f"))], check=True)
    old = os.stat(m.backing / "f").st_atime
    assert old < time.time() - 86400
    start = time.time() - 2
    assert m.path("f").read_bytes() == data
    wait_until(lambda: os.stat(m.path("f")).st_atime >= start, 5, what="atime through the mount")
    assert os.stat(m.backing / "f").st_atime >= start
    # appended (in write-back, BACKING's mtime moves only at the destage), then read: the
    # atime is not before the mtime, as on ext4
    with open(m.path("f"), "ab") as f:
        f.write(b"more")
    time.sleep(0.05)
    assert m.path("f").read_bytes() == data + b"more"
    flushed(m)
    st = os.stat(m.backing / "f")
    # (BACKING's atime comes from the kernel's coarse clock, up to a tick behind the fine
    # one a write-back write's mtime is taken from)
    assert st.st_atime_ns >= st.st_mtime_ns - 20_000_000, (st.st_atime_ns, st.st_mtime_ns)


def test_reads_through_a_noatime_mount_move_no_atime(make_mount, mode):
    """`-o noatime` (or a remount with it): reads move no atime, as on any filesystem so
    mounted; cachefs still read a byte of BACKING to move BACKING's atime, and its misses
    read BACKING with the atime moving there (xfstests generic/120). A remount without it
    moves atimes again."""
    m = make_mount("--mode", mode, "-o", "noatime")
    data = os.urandom(128 * KiB)
    for name in ("hit", "miss"):
        (m.backing / name).write_bytes(data)
        os.utime(m.backing / name, ns=(1_577_836_800 * 10**9, 1_609_459_200 * 10**9))
    direct_read_twice(m.path("hit"), len(data))                   # cached (atime: noatime)
    for _ in range(2):
        assert m.path("hit").read_bytes() == data
        assert m.path("miss").read_bytes() == data
        time.sleep(1.2)                                            # past --attr-timeout
        for name in ("hit", "miss"):
            assert os.stat(m.backing / name).st_atime_ns == 1_577_836_800 * 10**9, name
            assert os.stat(m.path(name)).st_atime_ns == 1_577_836_800 * 10**9, name
    subprocess.run(["mount", "-o", "remount,strictatime", str(m.mnt)], check=True,
                   capture_output=True, timeout=30)
    time.sleep(1.1)                                                # its flag is looked at
    start = time.time() - 2
    assert m.path("hit").read_bytes() == data
    wait_until(lambda: os.stat(m.backing / "hit").st_atime >= start, 5, what="the atime")


def test_a_read_after_an_in_place_write_moves_atime_past_the_mtime(mounted):
    """Write-back: an in-place write (no size change) does not reach BACKING before the
    destage, so BACKING's own relatime check (by its older mtime) let the read change
    nothing: atime stayed before the mtime, on the mount and on BACKING after the destage
    (a re-verifying helper, 3 of 3 runs). Mail readers take that for unread mail."""
    m = mounted
    data = bytearray(os.urandom(128 * KiB))
    m.path("f").write_bytes(data)
    flushed(m)
    os.utime(m.path("f"), ns=(1_577_836_800 * 10**9,) * 2)          # 2020
    assert m.path("f").read_bytes() == data                            # atime moves
    time.sleep(1.1)
    with open(m.path("f"), "r+b") as f:
        f.seek(10)
        f.write(b"1234567")
    data[10:17] = b"1234567"
    time.sleep(1.1)
    assert m.path("f").read_bytes() == data
    wait_until(lambda: os.stat(m.path("f")).st_atime_ns >= os.stat(m.path("f")).st_mtime_ns,
               5, what="atime through the mount")
    flushed(m)
    st = os.stat(m.backing / "f")
    assert st.st_atime_ns >= st.st_mtime_ns - 20_000_000, (st.st_atime_ns, st.st_mtime_ns)


def test_times_past_2262_are_kept(mounted):
    """ext4 keeps times up to 2446; past 2262-04-11 their nanoseconds do not fit SQLite's
    64-bit INTEGER: the commit of such a file's record raised OverflowError, the daemon
    ended, and in write-back every file's data not yet on BACKING was lost (xfstests
    generic/634; a read of a BACKING file so dated ended a write-through mount too). Then
    they were stored wrapped, and times past about 2319 came back as times before 1970: a
    remount took the file for changed on BACKING (its cache dropped; a conflict in
    write-back)."""
    m = mounted
    late = 10_413_792_000 * 10**9                                   # 2300-01-01
    later = 14_831_769_600 * 10**9                                  # 2440-01-01
    data = os.urandom(100 * KiB)
    m.path("f").write_bytes(data)
    m.path("g").write_bytes(b"other file")
    os.utime(m.path("f"), ns=(late, late))
    (m.backing / "h").write_bytes(data)
    os.utime(m.backing / "h", ns=(later, later))
    direct_read_twice(m.path("h"), len(data))                       # cached: its record
    assert m.path("h").read_bytes() == data
    time.sleep(1.5)                                                 # a commit
    cached = m.stats()["extents_cached"]
    assert cached > 0                                               # alive
    m.stop()
    m.start()
    assert m.path("f").read_bytes() == data
    assert m.path("g").read_bytes() == b"other file"
    assert m.path("h").read_bytes() == data
    assert os.stat(m.path("f")).st_mtime_ns == late
    assert os.stat(m.path("h")).st_mtime_ns == later
    s = m.stats()
    assert s["conflicts"] == 0 and s["drop_coherence"] == 0, s      # seen unchanged
    assert s["extents_cached"] >= cached
    ctl_flush(m)
    assert (m.backing / "f").read_bytes() == data
    assert os.stat(m.backing / "f").st_mtime_ns == late
