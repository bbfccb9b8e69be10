"""How cachefs reaches BACKING: descriptors of open handles and paths (issue 8, items 2, 9,
10, 11).

- xattrs by descriptor on an open, unlinked file reach BACKING through a handle's fd;
- a handle's BACKING fd borrowed by getattr is never closed (and its number reused for
  another file) while the borrower uses it;
- released fds are closed as fast as programs open and close files, so the daemon's
  descriptors stay bounded and it unmounts cleanly;
- every path that fits the mount fits BACKING, however long BACKING's own path is (paths
  relative to a descriptor of BACKING's root, walked in pieces past PATH_MAX).
"""

from __future__ import annotations

import errno
import os
import subprocess
import threading
import time

import pytest

from tests.conftest import CTL, assert_clean_log

pytestmark = pytest.mark.fuse

NAME = "d" * 200                      # a 200-byte directory name
PATH_MAX = 4096


def flush(m) -> None:
    if "write-back" in m.args:
        res = subprocess.run([*CTL, "flush", str(m.mnt), "--json"], capture_output=True,
                             text=True, timeout=60)
        assert res.returncode == 0, res.stderr


# -- item 2: xattrs by descriptor on an open, unlinked file ---------------------------------

def test_xattrs_by_fd_on_open_unlinked_file(mounted):
    m = mounted
    f = m.path("doomed")
    f.write_bytes(b"x" * 5000)
    os.setxattr(f, "user.kept", b"before unlink")
    fd = os.open(f, os.O_RDWR)
    try:
        os.unlink(f)
        assert os.getxattr(fd, "user.kept") == b"before unlink"
        with pytest.raises(OSError) as exc:
            os.getxattr(fd, "user.absent")
        assert exc.value.errno == errno.ENODATA
        os.setxattr(fd, "user.new", b"after unlink")
        assert os.getxattr(fd, "user.new") == b"after unlink"
        assert sorted(os.listxattr(fd)) == ["user.kept", "user.new"]
        os.removexattr(fd, "user.kept")
        assert os.listxattr(fd) == ["user.new"]
        with pytest.raises(OSError) as exc:
            os.removexattr(fd, "user.kept")
        assert exc.value.errno == errno.ENODATA
        assert os.pread(fd, 5000, 0) == b"x" * 5000
    finally:
        os.close(fd)


# -- item 9: a borrowed descriptor is not closed (and reused) under its borrower ------------

def test_getattr_never_sees_another_files_attributes(make_mount):
    """Two threads stat `a` (getattr borrows a BACKING fd of one of a's open handles) while
    four threads open and close `a` and `b`: a release must not close the borrowed fd (its
    number is reused at once by an open of `b`, whose size a stat of `a` would then show)."""
    m = make_mount("--mode", "write-through", "--attr-timeout", "0")
    a, b = m.path("a"), m.path("b")
    a.write_bytes(b"a" * 1000)
    b.write_bytes(b"b" * 2000)
    stop = time.monotonic() + 5
    wrong: list[int] = []
    errors: list[str] = []
    stats = [0]

    def stat_a() -> None:
        while time.monotonic() < stop:
            try:
                size = os.stat(a).st_size
            except OSError as exc:
                errors.append(f"stat: {exc}")
                continue
            stats[0] += 1
            if size != 1000:
                wrong.append(size)

    def churn(path) -> None:
        while time.monotonic() < stop:
            try:
                os.close(os.open(path, os.O_RDONLY))
            except OSError as exc:
                errors.append(f"open/close: {exc}")

    threads = [threading.Thread(target=stat_a) for _ in range(2)]
    threads += [threading.Thread(target=churn, args=(p,)) for p in (a, b, a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert stats[0] > 100
    assert not errors, (len(errors), errors[:5])
    assert not wrong, f"{len(wrong)} of {stats[0]} stats of a showed another size: {wrong[:5]}"


# -- item 10: closes keep up with open/close churn --------------------------------------------

def daemon_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_open_close_churn_keeps_descriptors_bounded(make_mount):
    m = make_mount("--mode", "write-through")
    paths = [m.path(f"f{i}") for i in range(4)]
    for p in paths:
        p.write_bytes(b"z" * 100)
    pid = m.proc.pid
    base = daemon_fds(pid)
    stop = time.monotonic() + 4
    errors: list[str] = []
    opens = [0]
    peak = [base]

    def churn(path) -> None:
        while time.monotonic() < stop:
            try:
                os.close(os.open(path, os.O_RDWR))
                opens[0] += 1
            except OSError as exc:
                errors.append(str(exc))

    def watch() -> None:
        while time.monotonic() < stop:
            try:
                peak[0] = max(peak[0], daemon_fds(pid))
            except OSError:
                pass
            time.sleep(0.01)

    threads = [threading.Thread(target=churn, args=(p,)) for p in paths]
    threads.append(threading.Thread(target=watch))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, (len(errors), errors[:3])
    assert opens[0] > 1000
    # handles.MAX_PENDING_CLOSES (1024) released fds at most, plus the open handles' own.
    assert peak[0] < base + 1500, (base, peak[0], opens[0])
    m.stop()                            # rc 0, no Traceback
    assert_clean_log(m.logs[-1])


# -- item 11: paths longer than BACKING allows ------------------------------------------------

def long_backing(tmp_path):
    """A BACKING whose own path is about 1 KiB long."""
    b = tmp_path
    for i in range(5):
        b = b / (chr(ord("A") + i) * 200)
    b.mkdir(parents=True)
    return b


def open_dir_in_pieces(top: str, parts: list[str]) -> int:
    """A descriptor of top/parts..., opened one component at a time (no path limit)."""
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    for p in parts:
        nfd = os.open(p, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = nfd
    return fd


def test_mount_paths_fit_backing_with_long_backing_path(make_mount, mode, tmp_path):
    backing = long_backing(tmp_path / "b")
    m = make_mount("--mode", mode, "--attr-timeout", "0.2", backing=backing)
    depth = (PATH_MAX - len(str(m.mnt)) - 300) // (len(NAME) + 1)
    deep = m.mnt.joinpath(*[NAME] * depth)
    assert len(str(deep)) < PATH_MAX - 250
    assert len(str(backing)) + len(str(deep)) - len(str(m.mnt)) > PATH_MAX
    deep.mkdir(parents=True)
    f = deep / "file"
    data = os.urandom(300_000)
    f.write_bytes(data)
    assert f.read_bytes() == data
    assert f.stat().st_size == len(data)
    os.setxattr(f, "user.deep", b"value")
    assert os.getxattr(f, "user.deep") == b"value"
    assert os.listxattr(f) == ["user.deep"]
    os.symlink("file", deep / "link")
    assert os.readlink(deep / "link") == "file"
    os.link(f, deep / "hard")
    assert os.stat(deep / "hard").st_nlink == 2
    os.chmod(f, 0o640)
    os.truncate(f, 200_000)
    os.utime(f, ns=(1_000_000_000, 2_000_000_000))
    os.rename(f, deep / "renamed")
    assert sorted(os.listdir(deep)) == ["hard", "link", "renamed"]
    assert os.statvfs(deep).f_bsize > 0
    dfd = os.open(deep, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    renamed = deep / "renamed"
    assert renamed.read_bytes() == data[:200_000]
    st = renamed.stat()
    assert (st.st_mode & 0o777, st.st_mtime_ns) == (0o640, 2_000_000_000)
    flush(m)
    bfd = open_dir_in_pieces(str(backing), [NAME] * depth)
    try:
        with open(os.open("renamed", os.O_RDONLY, dir_fd=bfd), "rb") as g:
            assert g.read() == data[:200_000]
        assert os.getxattr(f"/proc/self/fd/{bfd}/renamed", "user.deep") == b"value"
        assert sorted(os.listdir(bfd)) == ["hard", "link", "renamed"]
    finally:
        os.close(bfd)
    os.unlink(deep / "renamed")
    os.unlink(deep / "hard")
    os.unlink(deep / "link")
    os.rmdir(deep)
    assert not deep.exists()


def test_tree_deeper_than_path_max_through_relative_names(make_mount, mode):
    """Programs may nest deeper than PATH_MAX with relative names (mkdir + chdir, *at
    calls): 30 levels of 200-byte names, 6 KiB below the mount, as on a plain directory."""
    m = make_mount("--mode", mode, "--attr-timeout", "0.2")
    fd = os.open(m.mnt, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(30):
            os.mkdir(NAME, dir_fd=fd)
            nfd = os.open(NAME, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nfd
        data = os.urandom(100_000)
        wfd = os.open("file", os.O_CREAT | os.O_RDWR, 0o644, dir_fd=fd)
        try:
            os.write(wfd, data)
            os.fsync(wfd)
        finally:
            os.close(wfd)
        os.rename("file", "moved", src_dir_fd=fd, dst_dir_fd=fd)
        assert os.stat("moved", dir_fd=fd).st_size == len(data)
        assert os.listdir(fd) == ["moved"]
        os.setxattr(f"/proc/self/fd/{fd}/moved", "user.x", b"1")
        assert os.getxattr(f"/proc/self/fd/{fd}/moved", "user.x") == b"1"
        rfd = os.open("moved", os.O_RDONLY, dir_fd=fd)
        try:
            assert os.pread(rfd, len(data), 0) == data
        finally:
            os.close(rfd)
        flush(m)
        bfd = open_dir_in_pieces(str(m.backing), [NAME] * 30)
        try:
            rfd = os.open("moved", os.O_RDONLY, dir_fd=bfd)
            try:
                assert os.pread(rfd, len(data), 0) == data
            finally:
                os.close(rfd)
        finally:
            os.close(bfd)
        os.unlink("moved", dir_fd=fd)
        assert os.listdir(fd) == []
    finally:
        os.close(fd)


def test_destage_after_restart_reaches_a_file_deeper_than_path_max(make_mount, tmp_path):
    """Write-back: dirty data of a file whose BACKING path exceeds PATH_MAX survives kill -9
    and is destaged after the restart (the destager opens it by its relative path hint)."""
    backing = long_backing(tmp_path / "b")
    m = make_mount("--mode", "write-back", backing=backing)
    depth = (PATH_MAX - len(str(m.mnt)) - 300) // (len(NAME) + 1)
    deep = m.mnt.joinpath(*[NAME] * depth)
    deep.mkdir(parents=True)
    f = deep / "file"
    f.write_bytes(b"old" * 1000)
    flush(m)
    data = os.urandom(200_000)
    with open(f, "r+b") as g:
        g.write(data)
        g.flush()
        os.fsync(g.fileno())
    m.kill()
    m.start()
    flush(m)
    bfd = open_dir_in_pieces(str(backing), [NAME] * depth)
    try:
        rfd = os.open("file", os.O_RDONLY, dir_fd=bfd)
        try:
            assert os.pread(rfd, len(data) + 10, 0) == data
        finally:
            os.close(rfd)
    finally:
        os.close(bfd)
