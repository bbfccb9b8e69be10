"""Who may use the control socket (issue 11, access): with `--stats-group GROUP` a member of
GROUP who is not root reads statistics through a 0660 socket in /run/cachefs while the cache
directory stays 0700; flush, drop and pin stay for root and the mount's owner (checked on the
peer's credentials) and are refused with a sentence and exit status 2. Real mounts; the
non-root user is `nobody` through setpriv."""

from __future__ import annotations

import grp
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from ..conftest import CTL, ctl_flush, mount_factory, wait_until

pytestmark = pytest.mark.fuse

NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
# nobody in another group than the stats group: its primary group is `daemon`
NOBODY_OTHER = ["setpriv", "--reuid=nobody", "--regid=daemon", "--clear-groups"]
# When this python and its packages live where nobody cannot read (pyenv under /root),
# nobody gets CAP_DAC_READ_SEARCH: it may read and traverse anything, but connecting to a
# Unix socket needs write permission, which it still lacks: the checks below are unchanged.
READ_CAP = ["--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search"]


def _runs(prefix: list[str]) -> bool:
    res = subprocess.run([*prefix, sys.executable, "-c", "import cachefs_cli.ctl"],
                         capture_output=True, text=True)
    return res.returncode == 0


def _unusable() -> str | None:
    global NOBODY, NOBODY_OTHER
    if os.geteuid() != 0:
        return "needs root (mounts as root, runs cachefs-ctl as nobody)"
    if shutil.which("setpriv") is None:
        return "setpriv (util-linux) is not installed"
    if not _runs(NOBODY):
        NOBODY, NOBODY_OTHER = NOBODY + READ_CAP, NOBODY_OTHER + READ_CAP
        if not _runs(NOBODY):
            return "user nobody cannot run this python and its packages"
    return None


@pytest.fixture
def public_mount():
    """make(*args): a mount in a directory other users can reach (pytest's tmp_path is
    private to root)."""
    reason = _unusable()
    if reason:
        pytest.skip(reason)
    base = Path(tempfile.mkdtemp(prefix="cachefs-access-"))
    os.chmod(base, 0o755)
    counter = iter(range(1 << 30))
    try:
        with mount_factory(base) as make:
            yield lambda *args: make(*args, name=str(next(counter)))
    finally:
        shutil.rmtree(base, ignore_errors=True)


def ctl(prefix: list[str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*prefix, *CTL, *args], capture_output=True, text=True, timeout=60)


def test_stats_group_reads_and_is_refused_changes(public_mount):
    m = public_mount("--mode", "write-back", "--stats-group", "nogroup",
                     "--max-dirty-age", "3600")
    data = os.urandom(256 << 10)
    m.path("f").write_bytes(data)
    control = os.fsdecode(os.getxattr(m.mnt, "user.cachefs.control"))
    assert os.path.dirname(control) == "/run/cachefs"
    assert stat.S_IMODE(os.stat("/run/cachefs").st_mode) == 0o755
    st = os.stat(control)
    assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == grp.getgrnam("nogroup").gr_gid
    assert stat.S_IMODE(os.stat(m.cache).st_mode) == 0o700          # still private

    res = ctl(NOBODY, "stats", str(m.mnt), "--json")
    assert res.returncode == 0, res.stderr
    s = json.loads(res.stdout)
    assert s["mode"] == "write-back" and s["write_bytes"] == len(data)
    assert s["dirty_bytes"] > 0
    assert ctl(NOBODY, "stats", str(m.mnt)).returncode == 0
    with tempfile.TemporaryDirectory() as out:        # the history command is read-only
        os.chmod(out, 0o777)
        res = ctl(NOBODY, "stats", str(m.mnt), "--plot", f"{out}/p.png", "--window", "1m")
        assert res.returncode == 0, res.stderr
        assert Path(out, "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    cached = m.stats()["extents_cached"]
    for args in (["flush", str(m.mnt)], ["drop", str(m.mnt)], ["pin", str(m.path("f"))]):
        res = ctl(NOBODY, *args)
        assert res.returncode == 2, (args, res)
        assert res.stderr.splitlines()[-1] == (
            f"cachefs-ctl: {args[0]} changes the cache, so it is for root (the mount's "
            "owner); you (uid 65534) may only read statistics."), res.stderr
    s = m.stats()          # nothing moved (dirty data may have aged out to BACKING: 5 s)
    assert s["extents_cached"] == cached and s["pinned_files"] == 0

    ctl_flush(m)                                # root may, through the same socket
    assert m.stats()["dirty_bytes"] == 0
    assert (m.backing / "f").read_bytes() == data

    other = ctl(NOBODY_OTHER, "stats", str(m.mnt))        # not in the group
    assert other.returncode == 2
    assert "no permission to talk to the cachefs daemon" in other.stderr
    m.stop()
    wait_until(lambda: not os.path.exists(control), 5, what="the socket to go")
    log = m.logs[-1].read_text()            # one line per minute and user, then the count
    log = "\n".join(ln for ln in log.splitlines() if "refused" in ln)
    assert log.count("refused") == 2, log
    assert "refused flush from uid 65534: it changes the cache" in log
    assert "refused pin from uid 65534: it changes the cache, which only root and the " \
           "mount's owner may (and 2 similar lines suppressed)" in log


def test_without_stats_group_only_root_reads(public_mount):
    m = public_mount()
    control = os.fsdecode(os.getxattr(m.mnt, "user.cachefs.control"))
    assert control == str(m.cache / "control.sock")
    assert stat.S_IMODE(os.stat(control).st_mode) == 0o600
    res = ctl(NOBODY, "stats", str(m.mnt))
    assert res.returncode == 2 and "no permission to talk" in res.stderr, res
    assert "Traceback" not in res.stderr
    assert ctl([], "stats", str(m.mnt)).returncode == 0


def test_stats_group_mistakes(tmp_path):
    for d in ("b", "m"):
        (tmp_path / d).mkdir()
    res = subprocess.run([sys.executable, "-m", "cachefs_cli.main", "mount", "--stats-group",
                          "no-such-group-x", str(tmp_path / "b"), str(tmp_path / "m")],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    assert res.stderr == "cachefs: --stats-group 'no-such-group-x': there is no such group.\n"
