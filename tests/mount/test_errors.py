"""Operator mistakes: every bad input of `cachefs` and `cachefs-ctl` is one clear sentence on
stderr, a non-zero exit, no traceback, and nothing left mounted or running (DESIGN.md §1).

Mounts run in the background mode (no -f: the waiting parent must report the daemon's error)
and, where the error can come from either process, also in the foreground mode.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import shutil
import sqlite3
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cachefs.errors import UserError
from tests.conftest import CACHEFS, CTL, force_unmount, is_mounted, wait_until

pytestmark = pytest.mark.fuse

USER = 12345
BOTH = pytest.mark.parametrize("fg", [False, True], ids=["background", "foreground"])


def run(cmd: list[str], timeout: float = 90, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


def assert_sentence(res: subprocess.CompletedProcess, *needles: str, fg: bool = False) -> str:
    """A non-zero exit with one sentence on stderr that names what is wrong; no traceback.

    In the foreground mode the daemon's log lines (and libfuse's own messages) go to stderr
    too; then the sentence is the last line and the only one from the `cachefs:` prefix.
    """
    out = res.stderr + res.stdout
    assert res.returncode != 0, (res.returncode, res.stdout, res.stderr)
    assert "Traceback" not in out, res.stderr
    lines = res.stderr.strip().splitlines()
    assert lines, "nothing on stderr"
    if fg:
        ours = [ln for ln in lines if ln.startswith(("cachefs:", "cachefs-ctl:"))]
        assert ours == lines[-1:], f"not one closing sentence on stderr:\n{res.stderr}"
    else:
        assert len(lines) == 1, f"more than one line on stderr:\n{res.stderr}"
    err = lines[-1]
    for needle in needles:
        assert needle in err, f"{needle!r} not in {err!r}"
    return err


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _lock_pid(cache: Path) -> int | None:
    try:
        return int((cache / "lock").read_text().split("\n")[0].strip() or 0) or None
    except (OSError, ValueError):
        return None


class Env:
    """Directories for one test and the background mounts it started (always cleaned up)."""

    def __init__(self, tmp_path: Path):
        self.tmp = tmp_path
        self.backing = tmp_path / "backing"
        self.mnt = tmp_path / "mnt"
        self.cache = tmp_path / "cache"
        self.backing.mkdir()
        self.mnt.mkdir()
        self._started: list[tuple[Path, Path]] = []

    def mount(self, *args, backing=None, mnt=None, cache=None, fg=False, user_env=None,
              prefix=(), timeout: float = 90) -> subprocess.CompletedProcess:
        backing = self.backing if backing is None else backing
        mnt = self.mnt if mnt is None else mnt
        cache = self.cache if cache is None else cache
        cmd = [*prefix, *CACHEFS, "mount", *(["-f"] if fg else [])]
        if cache is not False:
            cmd += ["--cache-dir", str(cache)]
        cmd += [*args, str(backing), str(mnt)]
        self._started.append((Path(mnt), Path(cache) if cache else self.cache))
        return run(cmd, timeout=timeout, env=user_env)

    def assert_nothing_left(self, mnt=None, cache=None) -> None:
        """No daemon of ours still running, nothing mounted on the mountpoint."""
        mnt = self.mnt if mnt is None else mnt
        pid = _lock_pid(Path(self.cache if cache is None else cache))
        if pid is not None:
            wait_until(lambda: not _alive(pid) or not _serves(pid, mnt), 10,
                       what=f"daemon {pid} to exit")
        assert not is_mounted(mnt)

    def cleanup(self) -> None:
        for mnt, cache in self._started:
            force_unmount(mnt)
            pid = _lock_pid(cache)
            if pid is not None and _alive(pid) and _serves(pid, mnt):
                os.kill(pid, 9)


def _serves(pid: int, mnt: Path) -> bool:
    """Is `pid` a cachefs daemon started for the mountpoint `mnt` (so ours to stop)?"""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return False
    return b"cachefs_cli.main" in argv and os.fsencode(os.path.abspath(mnt)) in argv


@pytest.fixture
def env(tmp_path):
    e = Env(tmp_path)
    try:
        yield e
    finally:
        e.cleanup()


# -- BACKING and MOUNTPOINT ------------------------------------------------------------------

@BOTH
def test_backing_missing(env, fg):
    missing = env.tmp / "no-such-backing"
    res = env.mount(backing=missing, fg=fg)
    assert_sentence(res, str(missing), "does not exist", fg=fg)
    env.assert_nothing_left()


@BOTH
def test_backing_is_a_file(env, fg):
    f = env.tmp / "a-file"
    f.write_bytes(b"x")
    res = env.mount(backing=f, fg=fg)
    assert_sentence(res, str(f), "not a directory", fg=fg)
    env.assert_nothing_left()


@BOTH
def test_mountpoint_missing(env, fg):
    missing = env.tmp / "no-such-mnt"
    res = env.mount(mnt=missing, fg=fg)
    assert_sentence(res, str(missing), "does not exist", fg=fg)
    assert not missing.exists()
    assert not is_mounted(missing)


@BOTH
def test_mountpoint_not_a_directory(env, fg):
    f = env.tmp / "mnt-file"
    f.write_bytes(b"x")
    res = env.mount(mnt=f, fg=fg)
    assert_sentence(res, str(f), "not a directory", fg=fg)
    assert not is_mounted(f)


def test_backing_and_mountpoint_nested(env):
    inner = env.backing / "inner"
    inner.mkdir()
    res = env.mount(mnt=inner)
    assert_sentence(res, str(inner), "must not contain each other")
    assert not is_mounted(inner)


@BOTH
def test_mountpoint_already_mounted(make_mount, env, fg):
    m = make_mount()
    (m.backing / "f").write_bytes(b"still here")
    res = env.mount(mnt=m.mnt, fg=fg)
    assert_sentence(res, str(m.mnt), "already mounted", fg=fg)
    assert is_mounted(m.mnt)
    assert m.path("f").read_bytes() == b"still here"         # the first mount is untouched
    assert not env.cache.exists()
    m.stop()
    assert not is_mounted(m.mnt)


# -- the cache directory ---------------------------------------------------------------------

@BOTH
def test_cache_dir_inside_backing(env, fg):
    cache = env.backing / "cache"
    res = env.mount(cache=cache, fg=fg)
    assert_sentence(res, str(cache), "inside BACKING", fg=fg)
    assert not cache.exists()                                 # nothing written into BACKING
    env.assert_nothing_left()


def test_cache_dir_inside_backing_through_a_bind_mount(env):
    """The same directory as BACKING, reached through a bind mount, is BACKING: a cache
    directory in it was accepted, and the mount then cached its own files (a helper's
    hunt)."""
    bind = env.tmp / "bind"
    bind.mkdir()
    subprocess.run(["mount", "--bind", str(env.backing), str(bind)], check=True)
    try:
        cache = bind / "cache"
        res = env.mount(cache=cache)
        assert_sentence(res, str(cache), "inside BACKING")
        assert not cache.exists()
        env.assert_nothing_left()
    finally:
        subprocess.run(["umount", "-l", str(bind)], capture_output=True)


@BOTH
def test_cache_dir_inside_mountpoint(env, fg):
    cache = env.mnt / "cache"
    res = env.mount(cache=cache, fg=fg)
    assert_sentence(res, str(cache), "inside MOUNTPOINT", fg=fg)
    assert not cache.exists()
    env.assert_nothing_left()


@pytest.mark.parametrize("swapped", ["a-data-directory-as-cache", "a-cache-as-backing"])
def test_backing_and_cache_dir_swapped_are_refused(make_mount, env, swapped):
    """`cachefs mount /ssd/cache /mnt --cache-dir /srv/data`: the data directory was made
    0700 (every other user lost it) and its file named `lock` overwritten; the mirror
    mistake served a cache directory's database and data files as BACKING (a helper's
    hunt). Refused, before anything is changed."""
    if swapped == "a-data-directory-as-cache":
        data = env.tmp / "data-dir"
        data.mkdir(mode=0o755)
        (data / "lock").write_text("the user's own file\n")
        (data / "report.txt").write_text("x")
        os.chmod(data, 0o755)
        res = env.mount(cache=data)
        assert_sentence(res, str(data), "not empty", "no cache directory of cachefs")
        assert stat.S_IMODE(os.stat(data).st_mode) == 0o755
        assert (data / "lock").read_text() == "the user's own file\n"
        assert sorted(p.name for p in data.iterdir()) == ["lock", "report.txt"]
    else:
        other = make_mount(name="other")
        other.stop()
        res = env.mount(backing=other.cache)
        assert_sentence(res, str(other.cache), "is a cache directory of cachefs")
    assert not is_mounted(env.mnt)


def test_dotdot_after_a_symlink_is_the_directory_the_kernel_names(env):
    """`x/link/..` is the parent of link's target to the kernel, ls and cp; os.path.abspath
    dropped `link/..` as text and cachefs served, and wrote into, x (a helper's hunt)."""
    (env.tmp / "data" / "current").mkdir(parents=True)
    (env.tmp / "data" / "f").write_bytes(b"in data")
    (env.backing / "link").symlink_to(env.tmp / "data" / "current")
    (env.backing / "f").write_bytes(b"in x")
    res = env.mount(backing=env.backing / "link" / "..")
    assert res.returncode == 0, res.stderr
    assert (env.mnt / "f").read_bytes() == b"in data"
    assert run([*CACHEFS, "umount", str(env.mnt)]).returncode == 0


def test_a_relative_cache_dir_in_the_fstab_form_is_refused(env):
    """mount(8) runs from any directory (at boot, /): `cache_dir=ssdcache` named another,
    cold cache directory at each, and fsynced write-back data was stranded (a helper's
    hunt). The command line's --cache-dir is relative to where it is typed, as any path."""
    env._started.append((env.mnt, env.tmp / "ssdcache"))
    res = run([*CACHEFS, "mount", "-o", "cache_dir=ssdcache", str(env.backing), str(env.mnt)],
              cwd=env.tmp)                  # (not the suite's directory, should it mount)
    assert_sentence(res, "cache_dir=ssdcache", "relative path", "absolute")
    assert not (env.tmp / "ssdcache").exists()


def test_closed_standard_streams_still_get_the_mounts_answer(env):
    """With stdin and stdout closed (a script, a supervisor) the ready pipe took their
    numbers, the daemon's own stdin and stdout replaced it, and `cachefs mount` said the
    daemon exited before the mount was ready (exit 1) while the mount was made (a helper's
    hunt). The background daemon also leaves the operator's directory (it kept it busy)."""
    cmd = " ".join([*CACHEFS, "mount", "--cache-dir", str(env.cache), str(env.backing),
                    str(env.mnt)])
    env._started.append((env.mnt, env.cache))
    res = subprocess.run(["sh", "-c", f"exec {cmd} <&- >&-"], capture_output=False,
                         stderr=subprocess.PIPE, text=True, timeout=90, cwd=env.tmp)
    assert res.returncode == 0, res.stderr
    assert is_mounted(env.mnt)
    assert os.readlink(f"/proc/{_lock_pid(env.cache)}/cwd") == "/"
    assert run([*CACHEFS, "umount", str(env.mnt)]).returncode == 0


def test_cache_dir_is_a_file(env):
    cache = env.tmp / "cache-file"
    cache.write_bytes(b"x")
    res = env.mount(cache=cache)
    assert_sentence(res, str(cache), "not a directory")
    env.assert_nothing_left()


@BOTH
def test_cache_dir_of_another_backing(make_mount, env, fg):
    a = make_mount(name="a")
    (a.backing / "f").write_bytes(b"A")
    assert a.path("f").read_bytes() == b"A"
    a.stop()
    res = env.mount(cache=a.cache, fg=fg)                     # BACKING B, A's cache
    assert_sentence(res, str(a.cache), str(a.backing), str(env.backing), fg=fg)
    env.assert_nothing_left(cache=a.cache)
    a.start()                                                 # A's cache is still A's
    assert a.path("f").read_bytes() == b"A"


@BOTH
def test_cache_dir_in_use(make_mount, env, fg):
    a = make_mount(name="a")
    (a.backing / "f").write_bytes(b"A")
    other = env.tmp / "mnt2"
    other.mkdir()
    res = env.mount(backing=a.backing, mnt=other, cache=a.cache, fg=fg)
    err = assert_sentence(res, str(a.cache), "in use", fg=fg)
    assert f"pid {a.proc.pid}" in err
    assert not is_mounted(other)
    assert a.path("f").read_bytes() == b"A"                   # the running mount is unharmed
    assert _lock_pid(a.cache) == a.proc.pid


def test_cache_dir_in_use_with_its_lock_file_removed(make_mount, env):
    """An operator clearing a "stale lock" (or a cleaner) removed `lock`: a second daemon got
    in, SQLite's "database is locked" was called corruption, and --discard-dirty then set
    the live daemon's state aside; the two wrote one database over the other (a helper's
    hunt). The directory itself is locked too, and a locked database is "in use"."""
    a = make_mount("--mode", "write-back", "--max-dirty-age", "600", name="a")
    a.path("f").write_bytes(b"A" * 65536)
    (a.cache / "lock").unlink()
    other = env.tmp / "mnt2"
    other.mkdir()
    for extra in ((), ("--discard-dirty",)):
        res = env.mount(*extra, backing=a.backing, mnt=other, cache=a.cache)
        assert_sentence(res, str(a.cache), "in use by another cachefs", "lock")
        assert "corrupt" not in res.stderr
        assert not is_mounted(other)
    assert not any(p.name.startswith("damaged-") for p in a.cache.iterdir())
    assert a.path("f").read_bytes() == b"A" * 65536
    a.stop()


def test_a_locked_database_is_in_use_not_corrupt(tmp_path):
    from cachefs.store import MetadataStore
    root = os.stat(tmp_path)
    first = MetadataStore(str(tmp_path))
    first.open(str(tmp_path / "b"), root)
    try:
        with pytest.raises(UserError) as err:
            MetadataStore(str(tmp_path)).open(str(tmp_path / "b"), root, discard_dirty=True)
        assert "in use by another process (database is locked)" in str(err.value)
        assert not any(p.name.startswith("damaged-") for p in tmp_path.iterdir())
    finally:
        first.close(clean=True)


# -- option values ----------------------------------------------------------------------------

@pytest.mark.parametrize("args,needles", [
    (["--cache-size", "12Q"], ["--cache-size", "12Q"]),
    (["--cache-size", "abc"], ["--cache-size", "abc"]),
    (["-o", "cache_size=7X"], ["--cache-size", "7X"]),
    (["--mode", "fast"], ["fast", "write-through"]),
    (["--promote-after", "0"], ["--promote-after"]),
    (["--promote-after", "two"], ["--promote-after", "two"]),
    (["--sequential-cutoff", "-1"], ["--sequential-cutoff", "-1"]),
    (["--cache-size", "4K"], ["cache size", "too small"]),
], ids=["size-12Q", "size-abc", "o-size", "mode-fast", "promote-0", "promote-two",
        "cutoff-negative", "size-tiny"])
@BOTH
def test_invalid_option_values(env, fg, args, needles):
    res = env.mount(*args, fg=fg)
    assert_sentence(res, *needles, fg=fg)
    assert not env.cache.exists()                             # refused before any side effect
    env.assert_nothing_left()


# Values that used to be accepted and silently replaced by a default or by one of two
# settings (`--mode ''` mounted write-through, `-o mode=a,mode=b` took the first, a NaN
# --max-dirty-age never destaged): each is now refused with exit status 2.
def test_a_zero_dirty_high_is_named_not_the_dirty_low_it_was_not_given(env):
    """`--dirty-high 0` alone said "--dirty-low must be below --dirty-high" (a helper's
    hunt): no --dirty-low was given."""
    res = env.mount("--mode", "write-back", "--dirty-high", "0")
    assert_sentence(res, "--dirty-high 0 B holds no dirty data")
    env.assert_nothing_left()


@pytest.mark.parametrize("args,needles", [
    (["--mode", ""], ["--mode", "needs a value"]),
    (["-o", "mode="], ["-o mode", "needs a value"]),
    (["-o", "mode"], ["-o mode", "needs a value"]),
    (["--mode", " "], ["--mode", "needs a value"]),
    (["--eviction", ""], ["--eviction", "needs a value"]),
    (["--cache-size", ""], ["--cache-size", "needs a value"]),
    (["-o", "cache_size="], ["-o cache_size", "needs a value"]),
    (["--sequential-cutoff", ""], ["--sequential-cutoff", "needs a value"]),
    (["--max-dirty-age", "-1"], ["--max-dirty-age", "negative"]),
    (["--max-dirty-age", "nan"], ["--max-dirty-age", "nan", "not a duration"]),
    (["--attr-timeout", "inf"], ["--attr-timeout", "inf", "not a duration"]),
    (["--attr-timeout", "-0.5"], ["--attr-timeout", "negative"]),
    (["--backing-timeout", "-3"], ["--backing-timeout", "negative"]),
    (["--promote-after", "-2"], ["--promote-after"]),
    (["--dirty-high=-1M"], ["--dirty-high", "-1M", "not a size"]),
    (["--cache-size=-64M"], ["--cache-size", "-64M", "not a size"]),
    (["-o", "mode=write-back,mode=write-through"], ["--mode", "given twice"]),
    (["-o", "mode=write-back", "-o", "mode=write-back"], ["--mode", "given twice"]),
    (["--mode", "write-back", "-o", "mode=write-through"], ["--mode", "given twice"]),
    (["-o", "cache_size=64M,cache-size=32M"], ["--cache-size", "given twice"]),
], ids=["mode-empty", "o-mode-empty", "o-mode-bare", "mode-blank", "eviction-empty",
        "size-empty", "o-size-empty", "cutoff-empty", "dirty-age-negative", "dirty-age-nan",
        "attr-timeout-inf", "attr-timeout-negative", "backing-timeout-negative",
        "promote-negative", "dirty-high-negative", "size-negative", "o-mode-twice",
        "o-mode-twice-same", "mode-flag-and-o", "o-size-twice"])
@BOTH
def test_empty_negative_and_repeated_values(env, fg, args, needles):
    res = env.mount(*args, fg=fg)
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert_sentence(res, *needles, fg=fg)
    assert not env.cache.exists()                             # refused before any side effect
    env.assert_nothing_left()


@BOTH
def test_empty_cache_dir_is_refused(env, fg):
    for args in (["--cache-dir", ""], ["-o", "cache_dir="]):
        res = env.mount(*args, cache=False, fg=fg)
        assert res.returncode == 2, (args, res.returncode, res.stderr)
        assert_sentence(res, "cache", "needs a value", fg=fg)
        env.assert_nothing_left()


@BOTH
def test_empty_backing_or_mountpoint_is_refused(env, fg):
    for kw, what in (({"backing": ""}, "BACKING"), ({"mnt": ""}, "MOUNTPOINT")):
        res = env.mount(fg=fg, **kw)
        assert res.returncode == 2, (kw, res.returncode, res.stderr)
        assert_sentence(res, what, "empty", fg=fg)
        env.assert_nothing_left()


@BOTH
def test_backing_inside_the_cache_dir(env, fg):
    cache = env.tmp / "ssd"
    backing = cache / "slow"
    backing.mkdir(parents=True)
    (backing / "f").write_bytes(b"data")
    res = env.mount(backing=backing, cache=cache, fg=fg)
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert_sentence(res, f"BACKING {backing} is inside the cache directory {cache}", fg=fg)
    assert sorted(p.name for p in cache.iterdir()) == ["slow"]   # nothing written there
    assert [p.name for p in backing.iterdir()] == ["f"]
    env.assert_nothing_left(cache=cache)


@BOTH
def test_mountpoint_inside_the_cache_dir(env, fg):
    cache = env.tmp / "ssd"
    mnt = cache / "view"
    mnt.mkdir(parents=True)
    res = env.mount(mnt=mnt, cache=cache, fg=fg)
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert_sentence(res, f"MOUNTPOINT {mnt} is inside the cache directory {cache}", fg=fg)
    assert sorted(p.name for p in cache.iterdir()) == ["view"]
    env.assert_nothing_left(mnt=mnt, cache=cache)


@BOTH
@pytest.mark.parametrize("which", ["BACKING", "MOUNTPOINT"])
def test_cache_dir_is_backing_or_mountpoint(env, fg, which):
    target = env.backing if which == "BACKING" else env.mnt
    (env.backing / "f").write_bytes(b"data")
    res = env.mount(cache=target, fg=fg)
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert_sentence(res, str(target), f"is {which} itself", fg=fg)
    assert [p.name for p in env.backing.iterdir()] == ["f"]
    assert list(env.mnt.iterdir()) == []
    env.assert_nothing_left(cache=target)


def test_helper_refuses_an_empty_mode(env):
    res = run([sys.executable, "-m", "cachefs_cli.mount_helper", str(env.backing), str(env.mnt),
               "-o", f"cache_dir={env.cache},mode="])
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert_sentence(res, "-o mode", "needs a value")
    assert not env.cache.exists()
    env.assert_nothing_left()


@BOTH
def test_cache_size_larger_than_the_cache_filesystem(env, fg):
    res = env.mount("--cache-size", "100T", fg=fg)
    assert_sentence(res, "--cache-size", "100.0 TiB", "larger than the cache filesystem", fg=fg)
    assert not env.cache.exists()       # refused before a database or reserve file was made
    env.assert_nothing_left()
    res = env.mount("--cache-size", "64M")                     # the same cache dir still works
    assert res.returncode == 0, res.stderr
    assert is_mounted(env.mnt)
    assert run([*CACHEFS, "umount", str(env.mnt)]).returncode == 0
    env.assert_nothing_left()


@pytest.mark.parametrize("opt", ["max_read=65536", "subtype=foo", "fsname=x"])
def test_fuse_options_cachefs_sets_itself_are_refused(env, opt):
    """`-o max_read=N` mounted with exit 0 and "mounted" in the log, then libfuse ended the
    session at INIT: nothing was mounted (fstab's `mount -a` said success too). `-o
    subtype=` made a fuse.foo mount that `cachefs umount` called no cachefs mount (a
    helper's operator hunt)."""
    res = env.mount("-o", opt)
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert_sentence(res, f"-o {opt.partition('=')[0]}", "cannot be given")
    assert not env.cache.exists()
    env.assert_nothing_left()


def test_unknown_fuse_option(env):
    res = env.mount("-o", "bogus_opt_xyz", fg=True)
    assert_sentence(res, str(env.mnt), fg=True)
    assert "bogus_opt_xyz" in res.stderr                       # libfuse's own message
    env.assert_nothing_left()


def test_unknown_fuse_option_background_names_it(env):
    res = env.mount("-o", "bogus_opt_xyz")
    env.assert_nothing_left()
    assert_sentence(res, str(env.mnt), "bogus_opt_xyz")


def test_missing_arguments_is_a_usage_error(env):
    res = run([*CACHEFS, "mount", str(env.backing)])
    assert res.returncode == 2
    assert "Traceback" not in res.stderr
    assert "MOUNTPOINT" in res.stderr


# -- FUSE itself ------------------------------------------------------------------------------

def _fuse_restricted() -> str | None:
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse here"
    if stat.S_IMODE(os.stat("/dev/fuse").st_mode) & 0o006 == 0o006:
        return "/dev/fuse is world read-writable: a plain user may open it"
    if os.geteuid() != 0:
        return "needs root to switch to another user"
    if shutil.which("setpriv") is None:
        return "setpriv (util-linux) is missing"
    return None


@BOTH
def test_no_permission_on_dev_fuse(env, fg, tmp_path):
    reason = _fuse_restricted()
    if reason:
        pytest.skip(reason)
    home = tmp_path / "home"
    home.mkdir()
    os.chown(home, USER, USER)
    # The interpreter lives under /root (mode 0700): CAP_DAC_READ_SEARCH lets the user read
    # it, but opening /dev/fuse for writing still needs the user's own permission.
    prefix = ["setpriv", f"--reuid={USER}", f"--regid={USER}", "--clear-groups",
              "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search"]
    user_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home)}
    if "PYTHONPATH" in os.environ:
        user_env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    res = env.mount(prefix=prefix, fg=fg, cache=False, user_env=user_env)
    assert_sentence(res, "/dev/fuse", "permission", fg=fg)
    env.assert_nothing_left()


def test_dead_mount(make_mount, env):
    """A daemon killed with -9 leaves ENOTCONN behind: each command says so; `umount`, also
    with --flush (systemd's ExecStop), clears it; a mount onto it (systemd's restart) clears
    it itself. Before, `umount --flush` left it and every restart was refused for good."""
    m = make_mount()
    m.proc.kill()
    m.proc.wait()
    m.proc = None
    with pytest.raises(OSError) as exc:
        os.listdir(m.mnt)
    assert exc.value.errno == errno.ENOTCONN
    res = run([*CTL, "stats", str(m.mnt)])
    assert_sentence(res, str(m.mnt), "dead FUSE mount")
    res = run([*CTL, "pin", str(m.path("a"))])         # was: "does not exist"
    assert_sentence(res, "dead FUSE mount")
    res = run([*CACHEFS, "umount", "--flush", str(m.mnt)])
    assert res.returncode == 1, res.stderr
    assert "is gone" in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert not is_mounted(m.mnt)
    res = env.mount(backing=m.backing, mnt=m.mnt, cache=m.cache)    # mountable again
    assert res.returncode == 0, res.stderr
    os.kill(int((m.cache / "lock").read_text().split()[0]), 9)     # the daemon's pid
    wait_until(lambda: _enotconn(m.mnt), 10, what="the dead mount")
    res = env.mount(backing=m.backing, mnt=m.mnt, cache=m.cache)    # over the dead mount
    assert res.returncode == 0, res.stderr
    said = res.stderr + (m.cache / "cachefs.log").read_text()
    assert "was a dead cachefs mount" in said, said[-2000:]
    assert os.listdir(m.mnt) == []
    assert run([*CACHEFS, "umount", str(m.mnt)]).returncode == 0
    assert not is_mounted(m.mnt)
    res = env.mount(backing=m.backing, mnt=m.mnt, cache=m.cache)
    assert res.returncode == 0, res.stderr
    os.kill(int((m.cache / "lock").read_text().split()[0]), 9)
    wait_until(lambda: _enotconn(m.mnt), 10, what="the dead mount")
    res = run([*CACHEFS, "umount", str(m.mnt)])     # the unmount is done, the death told
    assert res.returncode == 0, res.stderr
    assert "is gone" in res.stderr and "nothing was flushed" not in res.stderr, res.stderr
    assert not is_mounted(m.mnt)


def test_a_mount_right_after_the_daemon_died_clears_the_dead_mount(env):
    """The kernel answers a stat of a mount's root from its attribute cache for up to
    --attr-timeout after the daemon died: `cachefs mount` right after a crash (systemd's
    restart, a script) said "already mounted" and exited 2 (a helper's database hunt)."""
    res = env.mount("--attr-timeout", "60")
    assert res.returncode == 0, res.stderr
    os.stat(env.mnt)                                    # the root's attributes are cached
    os.kill(_lock_pid(env.cache), 9)
    wait_until(lambda: _enotconn(env.mnt), 10, what="the dead mount")
    os.stat(env.mnt)                                    # still answered by the kernel
    res = env.mount("--attr-timeout", "60")
    assert res.returncode == 0, res.stderr
    assert "was a dead cachefs mount" in res.stderr + (env.cache / "cachefs.log").read_text()
    assert os.listdir(env.mnt) is not None
    assert run([*CACHEFS, "umount", str(env.mnt)]).returncode == 0
    env.assert_nothing_left()


def _enotconn(path) -> bool:
    try:
        os.listdir(path)
    except OSError as exc:
        return exc.errno == errno.ENOTCONN
    return False


# -- umount and cachefs-ctl on things that are not cachefs mounts ------------------------------

def test_umount_of_an_empty_name_is_refused(env):
    """`cachefs umount ""` acted on the current directory (a helper's CLI hunt)."""
    res = run([*CACHEFS, "umount", ""], cwd=env.mnt)
    assert_sentence(res, "MOUNTPOINT is empty")


@pytest.mark.parametrize("value", ["nan", "-1", "0"])
def test_umount_refuses_a_timeout_that_is_no_positive_number(env, value):
    """It unmounted, then said the daemon 'did not finish within -1 s' (a helper)."""
    res = run([*CACHEFS, "umount", "--timeout", value, str(env.mnt)])
    assert_sentence(res, "--timeout needs a positive number")


def test_umount_waits_out_a_short_busy_spell_and_names_a_long_one(env):
    """A stat or statfs of the mount by another program (df, a monitoring agent) holds it
    while the daemon answers: `cachefs umount` failed with EBUSY if it came then (seen in
    the suite). It tries again for a few seconds; a mount busy for longer (an open file)
    is a sentence saying what to look for."""
    res = env.mount()
    assert res.returncode == 0, res.stderr
    holder = subprocess.Popen([sys.executable, "-c", "import os, sys, time; "
                               "fd = os.open(sys.argv[1], os.O_RDONLY); print(1, flush=True); "
                               "time.sleep(float(sys.argv[2]))", str(env.mnt), "1"],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "1\n"           # it holds the mount for 1 s
    res = run([*CACHEFS, "umount", str(env.mnt)])
    holder.wait()
    assert res.returncode == 0, res.stderr
    assert not is_mounted(env.mnt)
    res = env.mount()
    assert res.returncode == 0, res.stderr
    fd = os.open(env.mnt, os.O_RDONLY)
    try:
        res = run([*CACHEFS, "umount", str(env.mnt)])
        assert_sentence(res, "busy", "fuser")
    finally:
        os.close(fd)
    assert run([*CACHEFS, "umount", str(env.mnt)]).returncode == 0


def test_umount_of_a_plain_directory(env):
    res = run([*CACHEFS, "umount", str(env.mnt)])
    assert_sentence(res, str(env.mnt), "not a cachefs mount")
    missing = env.tmp / "missing"
    res = run([*CACHEFS, "umount", str(missing)])
    assert_sentence(res, str(missing))


def test_ctl_on_a_plain_directory(env):
    for cmd in ("stats", "drop"):
        res = run([*CTL, cmd, str(env.mnt)])
        assert_sentence(res, str(env.mnt), "not a cachefs mount")
    missing = env.tmp / "missing"
    res = run([*CTL, "stats", str(missing)])
    assert_sentence(res, str(missing))


def test_ctl_on_a_subdirectory_of_a_mount(make_mount, env):
    """A directory inside a cachefs mount is not itself the mount: no socket there."""
    m = make_mount()
    m.path("sub").mkdir()
    res = run([*CTL, "stats", str(m.path("sub"))])
    assert_sentence(res, str(m.path("sub")), "not a cachefs mount")


@pytest.mark.parametrize("watch", ["0", "-1"])
def test_ctl_stats_watch_must_be_positive(make_mount, watch):
    m = make_mount()
    res = run([*CTL, "stats", str(m.mnt), "--watch", watch])
    assert_sentence(res, "--watch")
    res = run([*CTL, "stats", str(m.mnt), "--watch", "soon"])
    assert res.returncode == 2 and "Traceback" not in res.stderr and "soon" in res.stderr


# -- a corrupt metadata database -----------------------------------------------------------------

def _stopped_cache(make_mount) -> "object":
    m = make_mount(name="a")
    data = os.urandom(256 * 1024)
    (m.backing / "f").write_bytes(data)
    for _ in range(2):                                       # two reads earn promotion
        fd = os.open(m.path("f"), os.O_RDONLY | os.O_DIRECT)
        try:
            buf = mmap.mmap(-1, len(data))
            os.preadv(fd, [buf], 0)
        finally:
            os.close(fd)
    wait_until(lambda: m.stats()["extents_cached"] >= 4, 10, what="promotion")
    m.stop()
    return m


@BOTH
def test_corrupt_database_garbage(make_mount, env, fg):
    m = _stopped_cache(make_mount)
    db = m.cache / "cachefs.db"
    db.write_bytes(os.urandom(64 * 1024))
    for suffix in ("-wal", "-shm"):
        Path(str(db) + suffix).unlink(missing_ok=True)
    res = env.mount(backing=m.backing, cache=m.cache, fg=fg)
    assert_sentence(res, str(db), "corrupt", fg=fg)
    env.assert_nothing_left(cache=m.cache)
    assert (m.backing / "f").stat().st_size == 256 * 1024      # BACKING untouched



def damage_extents_page(db: Path, garbage) -> None:
    """Overwrite the page holding the root of the extents table with garbage(page size)."""
    con = sqlite3.connect(db)
    page_size = con.execute("PRAGMA page_size").fetchone()[0]
    root = con.execute("SELECT rootpage FROM sqlite_master WHERE name='extents'").fetchone()[0]
    con.close()
    with open(db, "r+b") as f:
        f.seek((root - 1) * page_size)
        f.write(garbage(page_size))

@BOTH
def test_corrupt_database_damaged_table_page(make_mount, env, fg):
    """A valid header and schema, but the page holding the extent table is garbage."""
    m = _stopped_cache(make_mount)
    db = m.cache / "cachefs.db"
    damage_extents_page(db, os.urandom)
    res = env.mount(backing=m.backing, cache=m.cache, fg=fg)
    assert_sentence(res, str(db), fg=fg)
    env.assert_nothing_left(cache=m.cache)


@pytest.mark.parametrize("damage", ["garbage", "empty", "missing", "wal-only"])
def test_damaged_database_is_refused_then_set_aside_with_discard_dirty(make_mount, env, damage):
    """Issue 17, item 4: a database that is garbage, empty, deleted, or gone with only its
    WAL left, in a directory holding cached data that may be dirty: one sentence naming
    --discard-dirty, nothing changed; with --discard-dirty the damaged state is moved aside
    and the mount starts cold, serving BACKING's bytes."""
    m = _stopped_cache(make_mount)
    db = m.cache / "cachefs.db"
    wal = Path(str(db) + "-wal")
    for suffix in ("-wal", "-shm"):
        Path(str(db) + suffix).unlink(missing_ok=True)
    if damage == "garbage":
        db.write_bytes(os.urandom(64 * 1024))
    elif damage == "empty":
        db.write_bytes(b"")
    elif damage == "missing":
        db.unlink()
    else:
        db.rename(wal)                          # a WAL (any bytes) without its database
    def state():
        return sorted((p.name, p.stat().st_size) for p in m.cache.iterdir()
                      if p.name not in ("cachefs.log", "lock"))    # (the lock names its taker)
    before = state()
    res = env.mount(backing=m.backing, cache=m.cache)
    assert_sentence(res, "--discard-dirty")
    env.assert_nothing_left(cache=m.cache)
    assert state() == before                            # nothing touched
    res = env.mount("--discard-dirty", backing=m.backing, cache=m.cache)
    assert res.returncode == 0, res.stderr
    try:
        aside = [p for p in m.cache.iterdir() if p.name.startswith("damaged-")]
        assert len(aside) == 1 and (aside[0] / "data").is_dir()
        assert (env.mnt / "f").read_bytes() == (m.backing / "f").read_bytes()
        stats = json.loads(run([*CTL, "stats", str(env.mnt), "--json"]).stdout)
        assert stats["extents_cached"] <= 4            # cold (what this read cached)
        log = (m.cache / "cachefs.log").read_text()
        assert "--discard-dirty: the damaged state was moved to" in log
    finally:
        run([*CACHEFS, "umount", str(env.mnt)])


@pytest.mark.parametrize("foreign", ["newer-schema", "other-backing"])
def test_foreign_cache_directory_is_refused(make_mount, env, tmp_path, foreign):
    """Issue 17, item 4: a cache directory written by a newer cachefs, or belonging to
    another BACKING: one sentence, nothing changed (its data stays for its owner)."""
    m = _stopped_cache(make_mount)
    backing = m.backing
    if foreign == "newer-schema":
        con = sqlite3.connect(m.cache / "cachefs.db")
        con.execute("PRAGMA user_version=99")
        con.close()
        needle = "newer cachefs"
    else:
        backing = tmp_path / "other-backing"
        backing.mkdir()
        needle = "belongs to BACKING"
    db = (m.cache / "cachefs.db").read_bytes()
    res = env.mount(backing=backing, cache=m.cache)
    assert_sentence(res, needle)
    env.assert_nothing_left(cache=m.cache)
    assert (m.cache / "cachefs.db").read_bytes() == db


# -- the background mode's success path --------------------------------------------------------

@pytest.mark.parametrize("name", [b"donn\xc3\xa9es", b"a,b", b"not\xffutf8", b"back\\slash"],
                         ids=["utf8", "comma", "not-utf8", "backslash"])
def test_a_backing_named_with_any_bytes_mounts(env, name):
    """BACKING's path is the mount's fsname: pyfuse3 passed it as ASCII and libfuse split it
    at commas, so `/srv/données` or `/data/a,b` failed to mount ("the daemon stopped before
    the mount was ready", a traceback in the log); a name not in UTF-8 also failed to be
    stored in the database. All are plain directory names."""
    backing = env.tmp / os.fsdecode(name)
    backing.mkdir()
    (backing / "f").write_bytes(b"from backing")
    for _ in range(2):                      # the second mount finds its own database
        res = env.mount("--mode", "write-back", backing=backing)
        assert res.returncode == 0, res.stderr
        assert (env.mnt / "f").read_bytes() == b"from backing"
        (env.mnt / "g").write_bytes(b"written")
        stats = run([*CTL, "stats", str(env.mnt), "--json"])
        assert stats.returncode == 0, stats.stderr
        res = run([*CACHEFS, "umount", "--flush", str(env.mnt)])
        assert res.returncode == 0, res.stderr
    assert (backing / "g").read_bytes() == b"written"
    log = (env.cache / "cachefs.log").read_text(errors="replace")
    assert "Traceback" not in log and " ERROR " not in log, log


def test_a_cache_directory_deeper_than_a_socket_path_takes_mounts_and_answers(env):
    """The control socket is control.sock in the cache directory, and an AF_UNIX address
    takes at most 107 bytes: with a cache directory deeper than ~95 bytes the daemon died at
    mount ("AF_UNIX path too long", "the daemon stopped before the mount was ready"), and
    cachefs-ctl could not have reached it. The socket is bound and reached through a
    descriptor of its directory; made again too when it is removed."""
    cache = env.tmp / ("c" * 100) / "cache"
    assert len(os.fsencode(str(cache / "control.sock"))) > 108
    res = env.mount("--mode", "write-back", cache=cache)
    assert res.returncode == 0, res.stderr
    (env.mnt / "f").write_bytes(b"dirty")
    stats = run([*CTL, "stats", str(env.mnt), "--json"])
    assert stats.returncode == 0, stats.stderr
    assert json.loads(stats.stdout)["dirty_bytes"] > 0
    (cache / "control.sock").unlink()
    wait_until(lambda: (cache / "control.sock").exists(), 15, what="control.sock again")
    res = run([*CACHEFS, "umount", "--flush", str(env.mnt)])
    assert res.returncode == 0, res.stderr
    assert (env.backing / "f").read_bytes() == b"dirty"
    log = (cache / "cachefs.log").read_text(errors="replace")
    assert "Traceback" not in log and " ERROR " not in log, log


def test_a_cache_directory_too_deep_for_sqlite_is_refused_with_a_sentence(env):
    """SQLite opens no database whose path passes ~500 bytes: such a cache directory was
    refused as holding a corrupt database that "may have named dirty write-back data",
    pointing to --discard-dirty."""
    cache = env.tmp / "/".join(["d" * 200] * 3) / "cache"
    cache.mkdir(parents=True)
    res = env.mount(cache=cache)
    out = assert_sentence(res, "too long a path", "SQLite")
    assert "corrupt" not in out and "discard" not in out, out
    assert not any(cache.iterdir())
    env.assert_nothing_left()


def test_two_mounts_of_one_mountpoint_started_together_give_one_mount(env):
    """Both passed the check that nothing is mounted there (it runs long before the mount)
    and stacked two cachefs mounts, the lower one hidden with its cache (an fstab line and
    a unit at boot, a retrying script: a helper's hunt, 2 of 3 rounds). The directory under
    MOUNTPOINT is locked from that check until the mount is there."""
    for i in range(3):
        starts = [subprocess.Popen([*CACHEFS, "mount", "--cache-dir", str(env.tmp / f"c{i}{k}"),
                                    str(env.backing), str(env.mnt)], stderr=subprocess.PIPE,
                                   text=True) for k in range(2)]
        env._started += [(env.mnt, env.tmp / f"c{i}{k}") for k in range(2)]
        res = [(p.wait(timeout=90), p.stderr.read()) for p in starts]
        with open("/proc/self/mounts", errors="surrogateescape") as f:
            stacked = sum(line.split()[1] == str(env.mnt) for line in f)
        assert stacked == 1, res
        assert sorted(rc for rc, _ in res) == [0, 2], res
        loser = next(err for rc, err in res if rc)
        assert ("already mounted" in loser or "being mounted by another cachefs" in loser) \
            and "Traceback" not in loser, loser
        assert run([*CACHEFS, "umount", str(env.mnt)]).returncode == 0


def test_a_default_cache_directory_is_not_made_anew_beside_stranded_dirty_data(make_mount):
    """With no --cache-dir the cache directory is named after BACKING's path: BACKING
    renamed (or reached through another path) got a new, empty one, the mount came up cold
    and silent, and the write-back data in the old one was stranded (a file truncated
    before the unmount read empty: a helper's hunt). preflight.stranded_elsewhere, run for
    a default cache directory, refuses while a sibling holds dirty data of this BACKING."""
    from cachefs.preflight import stranded_elsewhere
    m = make_mount("--mode", "write-back", "--max-dirty-age", "600")
    (m.path("doc")).write_bytes(b"new contents")
    m.stop()                                            # dirty data kept for the next mount
    moved = m.backing.with_name("backing-renamed")
    m.backing.rename(moved)
    new_default = str(m.cache.with_name("cache-of-the-new-path"))
    with pytest.raises(UserError) as err:
        stranded_elsewhere(str(moved), new_default)
    assert f"was mounted before as {m.backing}" in str(err.value), err.value
    assert f"--cache-dir {m.cache}" in str(err.value), err.value
    other = m.backing.with_name("other")
    other.mkdir()
    stranded_elsewhere(str(other), new_default)         # another BACKING: not its data
    moved.rename(m.backing)
    m.start()
    subprocess.run([*CACHEFS, "umount", "--flush", str(m.mnt)], check=True, timeout=60)
    m.proc.wait(timeout=60)
    m.proc = None
    m.backing.rename(moved)
    stranded_elsewhere(str(moved), new_default)         # nothing dirty left: a new one is fine


def test_a_notify_socket_that_leads_nowhere_is_ignored(env):
    """NOTIFY_SOCKET inherited from a unit's shell, or stale: `cachefs mount` said 0 and the
    daemon died of a traceback right after mounting (a helper's hunt)."""
    res = env.mount(user_env={**os.environ, "NOTIFY_SOCKET": str(env.tmp / "nowhere")})
    assert res.returncode == 0, res.stderr
    time.sleep(0.5)
    assert is_mounted(env.mnt)
    assert run([*CTL, "stats", str(env.mnt)]).returncode == 0
    assert run([*CACHEFS, "umount", str(env.mnt)]).returncode == 0
    log = (env.cache / "cachefs.log").read_text()
    assert "Traceback" not in log and "does not take systemd notifications" in log, log


def test_a_mount_named_in_bytes_not_utf8_on_the_host_stops_nothing(env):
    """Any mount on the host whose path is not UTF-8 (a USB stick's label, a helper's
    test) made every reader of the mount table fail with a UnicodeDecodeError traceback:
    `cachefs mount`, `cachefs-ctl`, `cachefs umount` and the daemon's own unmount. Ours
    may be named so too."""
    odd = env.tmp / os.fsdecode(b"other\xff dir")
    odd.mkdir()
    mnt = env.tmp / os.fsdecode(b"mnt\xfe")
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", str(odd)], check=True)
    try:
        res = env.mount(mnt=mnt)
        assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
        (env.backing / "in").write_bytes(b"from backing")
        assert (mnt / "in").read_bytes() == b"from backing"
        stats = run([*CTL, "stats", str(mnt), "--json"])
        assert stats.returncode == 0, stats.stderr
        res = run([*CACHEFS, "umount", str(mnt)])
        assert res.returncode == 0, res.stderr
        assert not is_mounted(mnt)
        log = (env.cache / "cachefs.log").read_text()
        assert "Traceback" not in log and " ERROR " not in log, log
    finally:
        force_unmount(mnt)
        subprocess.run(["umount", "-l", str(odd)], capture_output=True)


def test_background_mount_and_umount(env):
    t0 = time.monotonic()
    res = env.mount()
    assert res.returncode == 0, res.stderr
    assert res.stderr == ""
    assert is_mounted(env.mnt)
    (env.backing / "in").write_bytes(b"from backing")
    assert (env.mnt / "in").read_bytes() == b"from backing"
    (env.mnt / "out").write_bytes(b"through the mount")
    assert (env.backing / "out").read_bytes() == b"through the mount"
    stats = run([*CTL, "stats", str(env.mnt), "--json"])
    assert stats.returncode == 0, stats.stderr
    pid = _lock_pid(env.cache)
    assert pid and _alive(pid) and f'"pid": {pid}' in stats.stdout
    assert pid != os.getpid()

    res = run([*CACHEFS, "umount", str(env.mnt)])
    assert res.returncode == 0, res.stderr
    assert not is_mounted(env.mnt)
    assert not _alive(pid)                                   # umount waits for the daemon
    log = (env.cache / "cachefs.log").read_text()
    assert "Traceback" not in log and " ERROR " not in log, log
    assert "unmounted" in log
    assert time.monotonic() - t0 < 30
    res = run([*CACHEFS, "umount", str(env.mnt)])             # a second umount: a sentence
    assert_sentence(res, str(env.mnt), "not a cachefs mount")



def test_dirty_data_is_kept_when_backing_is_not_mounted(make_mount, tmp_path):
    """Write-back dirty data, a clean unmount, then BACKING's file system is not mounted
    (its empty mountpoint is there instead): the mount is refused with a sentence. It was
    accepted, and the destager found none of the files and discarded their fsync'd data."""
    real, b = tmp_path / "real", tmp_path / "b"
    real.mkdir()
    b.mkdir()
    subprocess.run(["mount", "--bind", str(real), str(b)], check=True)
    try:
        m = make_mount("--mode", "write-back", "--max-dirty-age", "600", backing=b)
        data = os.urandom(300_000)
        with open(m.path("f"), "wb") as f:
            f.write(data)
            os.fsync(f.fileno())
        m.stop()
        assert (real / "f").stat().st_size == 0 or (real / "f").read_bytes() != data
    finally:
        subprocess.run(["umount", str(b)], check=True)
    out = subprocess.run([*CACHEFS, "mount", "--cache-dir", str(m.cache), "--mode",
                          "write-back", str(b), str(m.mnt)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode != 0 and not is_mounted(m.mnt)
    assert "is BACKING's file system mounted?" in out.stderr and "Traceback" not in out.stderr
    subprocess.run(["mount", "--bind", str(real), str(b)], check=True)
    try:
        m.start()
        assert m.path("f").read_bytes() == data
        subprocess.run([*CTL, "flush", str(m.mnt)], check=True, capture_output=True, timeout=60)
        assert (real / "f").read_bytes() == data
        m.stop()
    finally:
        subprocess.run(["umount", str(b)], check=True)


def test_damage_inside_the_database_is_found_before_anything_is_written(make_mount):
    """A damaged page of the extents table: the mount is refused with a sentence and leaves
    the database as it was (it marked it not cleanly stopped first), and --discard-dirty
    starts cold (it was refused the same way: the damage was met after the database had
    been taken for sound)."""
    m = make_mount("--mode", "write-back", "--max-dirty-age", "600")
    data = {f"f{i}": os.urandom(70_000) for i in range(60)}
    for name, b in data.items():
        m.path(name).write_bytes(b)
    m.stop()
    db_path = m.cache / "cachefs.db"
    damage_extents_page(db_path, lambda n: b"\xa5" * n)
    out = subprocess.run([*CACHEFS, "mount", "--cache-dir", str(m.cache), str(m.backing),
                          str(m.mnt)], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and not is_mounted(m.mnt)
    assert "corrupt" in out.stderr and "--discard-dirty" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    db = sqlite3.connect(db_path)
    assert db.execute("SELECT value FROM meta WHERE key='clean'").fetchone()[0] == "1"
    db.close()
    m.args.append("--discard-dirty")
    m.start()
    for name in data:
        assert m.path(name).read_bytes() == (m.backing / name).read_bytes()


def test_a_mount_right_after_a_plain_umount_waits_for_the_old_daemon(env):
    """umount(8) returns once the kernel let go of the mount; the daemon then saves its
    state and exits. A mount of the same cache directory at once was refused ("in use by
    another cachefs"): `umount; mount` in scripts, xfstests, a unit's restart (a helper's
    xfstests run: 5 refusals in 5). It waits for that daemon now."""
    import signal
    import threading
    res = env.mount("--mode", "write-back", "--max-dirty-age", "600")
    assert res.returncode == 0, res.stderr
    data = os.urandom(1 << 20)
    for i in range(10):
        (env.mnt / f"f{i}").write_bytes(data)
    old = _lock_pid(env.cache)
    os.kill(old, signal.SIGSTOP)            # a daemon still busy saving its state
    resume = threading.Timer(1.5, os.kill, (old, signal.SIGCONT))
    try:
        # (lazy: a plain umount would wait for the stopped daemon's answer to its syncfs)
        assert subprocess.run(["umount", "-l", str(env.mnt)], timeout=30).returncode == 0
        resume.start()
        res = env.mount("--mode", "write-back", "--max-dirty-age", "600")
    finally:
        resume.cancel()
        os.kill(old, signal.SIGCONT)
    assert res.returncode == 0, res.stderr
    assert not _alive(old)
    assert (env.mnt / "f9").read_bytes() == data
    assert run([*CACHEFS, "umount", "--flush", str(env.mnt)]).returncode == 0
    env.assert_nothing_left()
