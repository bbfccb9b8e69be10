"""POSIX ACLs through the mount, as on BACKING itself: the kernel checks ACL entries (not only
the mode bits), and a new file or directory in a directory with a default ACL gets that ACL
instead of the caller's umask (fs.Operations.enable_acl, backingpaths.creating_under). Each
check runs on a plain directory of the same file system too, and the two must agree."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.fuse

NOBODY = 65534


def _acl_tools() -> str | None:
    if shutil.which("setfacl") is None or shutil.which("getfacl") is None:
        return "setfacl/getfacl are not installed (the acl package; make test installs it)"
    if os.geteuid() != 0:
        return "runs commands as another user (root needed)"
    return None


needs_acl = pytest.mark.skipif(_acl_tools() is not None, reason=str(_acl_tools()))


def backing_has_acls(path: Path) -> bool:
    probe = path / ".acl-probe"
    probe.write_bytes(b"")
    try:
        return subprocess.run(["setfacl", "-m", "u:nobody:r", str(probe)],
                              capture_output=True).returncode == 0
    finally:
        probe.unlink()


def open_to_others(path: Path) -> None:
    """Let another user reach `path` (pytest's directories are 0700)."""
    for d in [path, *path.parents][:-1]:
        os.chmod(d, stat.S_IMODE(os.stat(d).st_mode) | 0o011)


def run(cmd: list[str], umask: int, as_nobody: bool = False) -> subprocess.CompletedProcess:
    def child():
        os.umask(umask)
    kw = dict(user=NOBODY, group=NOBODY, extra_groups=[]) if as_nobody else {}
    return subprocess.run(cmd, preexec_fn=child, capture_output=True, text=True, timeout=30,
                          **kw)


def created(top: Path) -> dict[str, str]:
    """Make nodes under umask 022 in a directory with a default ACL and under 077 in one
    without; their modes and ACLs."""
    d, p = top / "dacl", top / "plain"
    d.mkdir()
    p.mkdir()
    subprocess.run(["setfacl", "-d", "-m", "u::rwx,g::rwx,o::rwx,u:nobody:rwx", str(d)],
                   check=True)
    for where, umask in ((d, 0o022), (p, 0o077)):
        script = (f"import os; open('{where}/f', 'w').close(); os.mkdir('{where}/sub'); "
                  f"os.mkfifo('{where}/fifo', 0o666)")
        res = run(["python3", "-c", script], umask)
        assert res.returncode == 0, res.stderr
    out = {}
    for where in (d, p):
        for name in ("f", "sub", "fifo"):
            node = where / name
            acl = subprocess.run(["getfacl", "-cp", str(node)], capture_output=True,
                                 text=True, check=True).stdout
            out[f"{where.name}/{name}"] = (stat.filemode(os.lstat(node).st_mode) + " "
                                           + " ".join(sorted(acl.split())))
    return out


@needs_acl
def test_a_default_acl_replaces_the_umask(mounted, tmp_path):
    plain = tmp_path / "plain-fs"
    plain.mkdir()
    if not backing_has_acls(plain):
        pytest.skip("the file system under the test's directories has no POSIX ACLs")
    want = created(plain)
    assert want["dacl/f"].startswith("-rw-rw-rw-") and "user:nobody:rwx" in want["dacl/f"]
    assert want["plain/f"].startswith("-rw-------")
    assert created(mounted.mnt) == want


@needs_acl
def test_acl_entries_are_enforced(mounted, tmp_path):
    """An ACL entry that denies what the mode bits allow, and one that allows what they
    deny, for another user: the mount answers as BACKING does (it checked mode bits only)."""
    plain = tmp_path / "plain-fs"
    plain.mkdir()
    if not backing_has_acls(plain):
        pytest.skip("the file system under the test's directories has no POSIX ACLs")
    open_to_others(tmp_path)
    answers = []
    for top in (plain, mounted.mnt):
        os.chmod(top, 0o755)
        (top / "denied").write_bytes(b"secret\n")
        os.chmod(top / "denied", 0o644)
        subprocess.run(["setfacl", "-m", "u:nobody:---", str(top / "denied")], check=True)
        (top / "granted").write_bytes(b"shared\n")
        os.chmod(top / "granted", 0o600)
        subprocess.run(["setfacl", "-m", "u:nobody:r--", str(top / "granted")], check=True)
        got = []
        for name in ("denied", "granted"):
            res = run(["cat", str(top / name)], 0o022, as_nobody=True)
            got.append((name, res.returncode, res.stdout))
        answers.append(got)
    assert answers[0] == [("denied", 1, ""), ("granted", 0, "shared\n")]
    assert answers[1] == answers[0]


@needs_acl
def test_an_access_acl_set_by_a_user_outside_the_group_drops_setgid(mounted, tmp_path):
    """Setting an access ACL changes the mode as a chmod does, and drops the setgid bit when
    the caller is not in the node's group and lacks CAP_FSETID. BACKING applied the ACL with
    the daemon's credentials and kept it (xfstests generic/375, found by a helper)."""
    plain = tmp_path / "plain-fs"
    plain.mkdir()
    if not backing_has_acls(plain):
        pytest.skip("the file system under the test's directories has no POSIX ACLs")
    open_to_others(tmp_path)
    os.chmod(plain, 0o755)
    os.chmod(mounted.mnt, 0o755)

    def modes(top: Path) -> list[str]:
        out = []
        for name, group in (("f-other", 0), ("d-other", 0), ("f-own", NOBODY)):
            node = top / name
            node.mkdir() if name.startswith("d") else node.write_bytes(b"x")
            os.chown(node, NOBODY, group)
            os.chmod(node, 0o2777)
            res = run(["setfacl", "-m", "u:0:rwx", str(node)], 0o022, as_nobody=True)
            assert res.returncode == 0, res.stderr
            out.append(stat.filemode(os.stat(node).st_mode))
        return out
    want = modes(plain)
    assert want == ["-rwxrwxrwx", "drwxrwxrwx", "-rwxrwsrwx"]
    assert modes(mounted.mnt) == want
