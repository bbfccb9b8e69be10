"""The shipped cachefs@.service and what `cachefs install-unit` writes: both pass
`systemd-analyze verify` (which also checks that ExecStart= can be run), the drop-in orders
the unit after BACKING's and the cache directory's mounts, and mistakes get a sentence and
exit status 2. Files go under --root in tmp_path; systemctl is never run."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from cachefs_cli import unit

from ..conftest import CACHEFS, REPO

ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze is not installed "
                                   "(apt-get install systemd; make deps does)")


def verify(unit_dir, instance: str) -> None:
    """systemd-analyze verify of cachefs@INSTANCE.service from unit_dir (template plus
    drop-ins): exit 0 and not one warning."""
    res = subprocess.run([ANALYZE, "verify", os.path.join(unit_dir, f"cachefs@{instance}.service")],
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "SYSTEMD_UNIT_PATH": f"{unit_dir}:",
                              "SYSTEMD_LOG_LEVEL": "info"})
    assert res.returncode == 0 and not res.stderr.strip() and not res.stdout.strip(), \
        f"systemd-analyze verify: {res.returncode}\n{res.stdout}{res.stderr}"


def install(tmp_path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + ":" + os.environ["PATH"]}
    return subprocess.run([*CACHEFS, "install-unit", *args, "--root", str(tmp_path / "root")],
                          capture_output=True, text=True, timeout=60, env=env)


@pytest.fixture
def dirs(tmp_path):
    for name in ("backing", "mnt"):
        (tmp_path / name).mkdir()
    return tmp_path / "backing", tmp_path / "mnt"


def test_shipped_unit_is_the_template():
    shipped = (REPO / "systemd" / "cachefs@.service").read_text()
    assert shipped == unit.render_template(unit.SHIPPED_EXEC)
    assert "ExecStop=/usr/bin/env cachefs umount --flush ${MOUNTPOINT}" in shipped
    assert "TimeoutStopSec=1d" in shipped


@needs_analyze
def test_shipped_unit_verifies(tmp_path):
    shutil.copy(REPO / "systemd" / "cachefs@.service", tmp_path)
    verify(tmp_path, "slow")


@needs_analyze
def test_verify_catches_a_broken_unit(tmp_path):
    """The check above has teeth: a missing ExecStart= binary fails verification."""
    (tmp_path / "cachefs@.service").write_text(unit.render_template("/nonexistent/cachefs"))
    with pytest.raises(AssertionError, match="not executable"):
        verify(tmp_path, "slow")


@needs_analyze
def test_install_unit_writes_a_unit_that_verifies(tmp_path, dirs):
    backing, mnt = dirs
    cache = tmp_path / "ssd" / "cache"
    res = install(tmp_path, "slow-nfs", str(backing), str(mnt), "--cache-dir", str(cache),
                  "--mode", "write-back", "--cache-size", "2G", "-o", "max_dirty_age=10")
    assert res.returncode == 0, res.stderr
    assert "systemctl left alone" in res.stdout
    root = tmp_path / "root"
    conf = (root / "etc/cachefs/slow-nfs.conf").read_text()
    assert f"BACKING={backing}\n" in conf and f"MOUNTPOINT={mnt}\n" in conf
    assert (f"CACHEFS_OPTIONS=--cache-dir {cache} --mode write-back --cache-size 2G "
            "--max-dirty-age 10\n") in conf
    unit_dir = root / "etc/systemd/system"
    template = (unit_dir / "cachefs@.service").read_text()
    exe = unit.cachefs_executable()
    assert os.path.isabs(exe) and f"ExecStart={exe} mount -f" in template
    drop_in = (unit_dir / "cachefs@slow-nfs.service.d" / "cachefs.conf").read_text()
    assert f"RequiresMountsFor={backing} {cache} {tmp_path}\n" in drop_in
    verify(unit_dir, "slow-nfs")

    # the options really are `cachefs mount` options: the daemon's parser takes them
    words = conf.split("CACHEFS_OPTIONS=", 1)[1].split()
    check = subprocess.run([*CACHEFS, "mount", "--help"], capture_output=True, text=True)
    for flag in (w for w in words if w.startswith("--")):
        assert flag in check.stdout


@needs_analyze
def test_install_unit_stop_timeout_and_reinstall(tmp_path, dirs):
    backing, mnt = dirs
    assert install(tmp_path, "a", str(backing), str(mnt)).returncode == 0
    res = install(tmp_path, "a", str(backing), str(mnt), "--stop-timeout", "30min")
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("replaced ")
    unit_dir = tmp_path / "root/etc/systemd/system"
    assert "[Service]\nTimeoutStopSec=30min\n" in \
        (unit_dir / "cachefs@a.service.d/cachefs.conf").read_text()
    verify(unit_dir, "a")


@pytest.mark.parametrize("args, sentence", [
    (["a/b", "{backing}", "{mnt}"], "the unit name 'a/b' may hold only"),
    (["x@y", "{backing}", "{mnt}"], "may hold only letters"),
    (["x", "{tmp}/missing", "{mnt}"], "BACKING {tmp}/missing is not an existing directory"),
    (["x", "{backing}", "{tmp}/nomnt"], "MOUNTPOINT {tmp}/nomnt is not an existing"),
    (["x", "{backing}", "{mnt}", "--mode", "fast"], "mode 'fast' is not one of"),
    (["x", "{backing}", "{mnt}", "--stop-timeout", "soon"], "not a systemd time span"),
    (["x", "{backing}", "{mnt}", "--cache-dir", "{tmp}/my cache"], "contains a space"),
    (["x", "{backing}", "{mnt}", "-f"], "takes mount options only"),
])
def test_install_unit_mistakes(tmp_path, dirs, args, sentence):
    backing, mnt = dirs
    fill = {"backing": backing, "mnt": mnt, "tmp": tmp_path}
    res = install(tmp_path, *(a.format(**fill) for a in args))
    assert res.returncode == 2, res
    assert res.stderr.startswith("cachefs: ") and sentence.format(**fill) in res.stderr
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "root/etc/cachefs/x.conf").exists()


def test_install_unit_refuses_a_second_unit_for_a_mountpoint(tmp_path, dirs):
    backing, mnt = dirs
    assert install(tmp_path, "one", str(backing), str(mnt)).returncode == 0
    res = install(tmp_path, "two", str(backing), str(mnt))
    assert res.returncode == 2
    assert f"{mnt} is already the MOUNTPOINT of cachefs@one" in res.stderr


def test_install_unit_refuses_what_cachefs_mount_would(tmp_path, dirs):
    """install-unit wrote units `cachefs mount` refuses (they then restarted every 5 s for
    ever): a cache directory inside BACKING, one cache directory for two units, a symlink to
    another unit's mountpoint (a helper's hunt)."""
    backing, mnt = dirs
    res = install(tmp_path, "in", str(backing), str(mnt), "--cache-dir", str(backing / "c"))
    assert res.returncode == 2 and "is inside BACKING" in res.stderr, res.stderr
    assert install(tmp_path, "one", str(backing), str(mnt), "--cache-dir",
                   str(tmp_path / "c")).returncode == 0
    other_b, other_m = tmp_path / "b2", tmp_path / "m2"
    other_b.mkdir()
    other_m.mkdir()
    res = install(tmp_path, "two", str(other_b), str(other_m), "--cache-dir",
                  str(tmp_path / "c"))
    assert res.returncode == 2 and "is already the cache directory of cachefs@one" \
        in res.stderr, res.stderr
    (tmp_path / "link").symlink_to(mnt)
    res = install(tmp_path, "three", str(other_b), str(tmp_path / "link"))
    assert res.returncode == 2 and "is already the MOUNTPOINT of cachefs@one" in res.stderr, \
        res.stderr
    assert "Traceback" not in res.stderr


def test_activate_runs_systemctl_only_where_systemd_runs():
    said, ran = [], []

    def run(cmd, **kw):
        ran.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    assert unit.activate("cachefs@a.service", True, said.append, run, lambda: False) == 0
    assert ran == [] and said == ["systemd is not running here, so cachefs@a.service is not "
                                  "enabled; once it is, run: systemctl daemon-reload && "
                                  "systemctl enable --now cachefs@a.service"]
    said.clear()
    assert unit.activate("cachefs@a.service", True, said.append, run, lambda: True) == 0
    assert ran == [["systemctl", "daemon-reload"],
                   ["systemctl", "enable", "--now", "cachefs@a.service"]]
    assert said == ["enabled cachefs@a.service and started it"]

    def failing(cmd, **kw):
        return subprocess.CompletedProcess(cmd, 1, "", "Failed to connect to bus")

    said.clear()
    assert unit.activate("cachefs@a.service", False, said.append, failing, lambda: True) == 1
    assert said == ["systemctl daemon-reload failed (status 1): Failed to connect to bus"]


def test_install_unit_into_a_root_that_is_a_file_says_so(tmp_path, dirs):
    """--root naming a file ended in a NotADirectoryError traceback (a helper's CLI hunt)."""
    backing, mnt = dirs
    (tmp_path / "root").write_text("not a directory")
    res = install(tmp_path, "x", str(backing), str(mnt))
    assert res.returncode == 2, res
    assert res.stderr.startswith("cachefs: cannot write ") and "Not a directory" in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize("args", [["stats", "{mnt}", "--watch", "nan"],
                                  ["stats", "{mnt}", "--watch", "inf"],
                                  ["top", "{mnt}", "--interval", "nan"],
                                  ["top", "{mnt}", "--interval", "inf"]])
def test_ctl_refuses_nan_and_infinite_seconds(dirs, args):
    """NaN and inf passed the checks for 0 and -1 and ended in tracebacks from time.sleep
    and settimeout (a helper's CLI hunt)."""
    from tests.conftest import CTL
    _, mnt = dirs
    res = subprocess.run([*CTL, *(a.format(mnt=mnt) for a in args)], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 2, res
    assert "needs a positive number of seconds" in res.stderr and "Traceback" not in res.stderr
