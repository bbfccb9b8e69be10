"""Small files (issue 16, item 7): `tar x` and `git clone` into the mount give the same tree
as into BACKING, in both modes, and the shortcuts taken for them stay right: the kernel's
security.capability asks before each write are answered without BACKING only while BACKING
is known to have none."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
import sysconfig

import pytest

from tests.conftest import ctl_flush

pytestmark = pytest.mark.fuse

CAPS = "security.capability"
# VFS_CAP_REVISION_2 with CAP_NET_BIND_SERVICE (10) permitted and effective
CAPS_VALUE = struct.pack("<IIIII", 0x02000001, 1 << 10, 0, 0, 0)


def tree(root) -> dict:
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            rel = os.path.relpath(p, root)
            data = open(p, "rb").read() if os.path.isfile(p) and not os.path.islink(p) else None
            out[rel] = (st.st_mode, st.st_size, data)
    return out


def test_tar_x_gives_the_same_tree_as_on_backing(tmp_path, make_mount, mode):
    m = make_mount("--mode", mode)
    tar = tmp_path / "small.tar"
    subprocess.run(["tar", "cf", str(tar), "-C", sysconfig.get_paths()["stdlib"], "json",
                    "email"], check=True)
    plain = tmp_path / "plain"
    plain.mkdir()
    subprocess.run(["tar", "xf", str(tar), "-C", str(plain)], check=True)
    (m.mnt / "x").mkdir()
    subprocess.run(["tar", "xf", str(tar), "-C", str(m.mnt / "x")], check=True)
    want = tree(plain)
    assert len(want) > 100
    assert tree(m.mnt / "x") == want
    if mode == "write-back":
        ctl_flush(m)
    assert tree(m.backing / "x") == want


def test_a_write_removes_a_capability_set_through_the_mount(make_mount, mode):
    """A file created here is known to have no capability; once one is set through the
    mount, the kernel's ask before the next write must see it (and the write removes it,
    as on any filesystem)."""
    m = make_mount("--mode", mode)
    p = m.path("tool")
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o755)
    try:
        os.write(fd, b"x" * 100)
        os.setxattr(p, CAPS, CAPS_VALUE)
        assert os.getxattr(p, CAPS) == CAPS_VALUE
        os.pwrite(fd, b"y", 0)
    finally:
        os.close(fd)
    with pytest.raises(OSError) as err:
        os.getxattr(p, CAPS)
    assert err.value.errno == 61          # ENODATA: the write removed it
    assert CAPS not in os.listxattr(m.backing / "tool")


def test_a_capability_set_on_backing_is_seen_within_the_attribute_timeout(make_mount):
    m = make_mount("--attr-timeout", "0.2")
    p = m.path("t2")
    with open(p, "wb") as f:
        f.write(b"z")
    with pytest.raises(OSError):
        os.getxattr(p, CAPS)
    os.setxattr(m.backing / "t2", CAPS, CAPS_VALUE)        # behind the cache's back
    deadline = 50
    while deadline:
        try:
            assert os.getxattr(p, CAPS) == CAPS_VALUE
            break
        except OSError:
            deadline -= 1
            subprocess.run(["sleep", "0.05"])
    assert deadline, "the capability set on BACKING was not seen"


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_git_clone_into_the_mount(tmp_path, make_mount, mode):
    m = make_mount("--mode", mode)
    src = tmp_path / "src"
    shutil.copytree(os.path.join(sysconfig.get_paths()["stdlib"], "json"), src)
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t",
               GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@t")
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "x"]):
        subprocess.run(["git", "-C", str(src), *cmd], check=True, env=env)
    subprocess.run(["git", "clone", "-q", str(src), str(m.mnt / "c")], check=True)
    out = subprocess.run(["git", "-C", str(m.mnt / "c"), "fsck", "--strict"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    files = subprocess.run(["git", "-C", str(src), "ls-files"], capture_output=True,
                           text=True, check=True).stdout.split()
    assert len(files) > 5
    for f in files:
        assert (m.mnt / "c" / f).read_bytes() == (src / f).read_bytes(), f


def _direct_fds_of(pid: int, target: str) -> list[bool]:
    """For each descriptor of process `pid` open on `target`: whether it has O_DIRECT."""
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") != target:
                continue
            with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                flags = int(next(x for x in f if x.startswith("flags:")).split()[1], 8)
        except (OSError, StopIteration):
            continue
        out.append(bool(flags & os.O_DIRECT))
    return out


def test_write_through_twins_only_where_backing_is_fuse(make_mount, tmp_path):
    """The O_DIRECT twin of a write-through open (AIO, for BACKINGs whose direct writes the
    kernel serialises) is for FUSE and network BACKINGs only: on a local filesystem it sent
    every aligned small-file write to the disk (tar x, bench/smallfiles.py)."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
    from slowfs_client import mounted_slowfs        # noqa: PLC0415 (bench/ is not a package)

    local = make_mount("--mode", "write-through", name="local")
    with open(local.path("f"), "wb") as f:
        f.write(b"x" * 8192)
        f.flush()
        fds = _direct_fds_of(local.proc.pid, str(local.backing / "f"))
    assert fds and not any(fds)
    assert (local.backing / "f").read_bytes() == b"x" * 8192

    src, slow = tmp_path / "src", tmp_path / "slow"
    src.mkdir()
    slow.mkdir()
    with mounted_slowfs(src, slow, latency_ms=0, jitter_ms=0):
        fm = make_mount("--mode", "write-through", backing=slow, name="fuse")
        with open(fm.path("f"), "wb") as f:
            f.write(b"y" * 8192)
            f.flush()
            assert any(_direct_fds_of(fm.proc.pid, str(slow / "f")))
        assert (src / "f").read_bytes() == b"y" * 8192
        fm.stop()
