"""`mount.cachefs` (the fstab form): options in -o, background daemon, clean umount."""

import errno
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import CACHEFS, CTL, force_unmount, is_mounted

pytestmark = pytest.mark.fuse
HELPER = [sys.executable, "-m", "cachefs_cli.mount_helper"]


def test_fstab_options_mount_and_umount(tmp_path):
    backing, cache, mnt = tmp_path / "b", tmp_path / "c", tmp_path / "m"
    for d in (backing, mnt):
        d.mkdir()
    (backing / "f").write_bytes(b"hello")
    try:
        out = subprocess.run([*HELPER, str(backing), str(mnt), "-o",
                              f"cache_dir={cache},cache_size=2M,promote_after=1,_netdev,noauto"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert is_mounted(mnt)
        assert (mnt / "f").read_bytes() == b"hello"
        st = json.loads(subprocess.run([*CTL, "stats", str(mnt), "--json"], capture_output=True,
                                       text=True, check=True).stdout)
        assert st["cache_size"] == 2 << 20 and st["cache_dir"] == str(cache)
        pid = st["pid"]
        out = subprocess.run([*CACHEFS, "umount", str(mnt)], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr
        assert not is_mounted(mnt)
        try:                      # gone, or a zombie waiting for a reaper that is not us
            assert open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
        except FileNotFoundError:
            pass
        assert "Traceback" not in (cache / "cachefs.log").read_text()
    finally:
        force_unmount(mnt)


def test_bad_fstab_option_is_a_sentence(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "m").mkdir()
    out = subprocess.run([*HELPER, str(tmp_path / "b"), str(tmp_path / "m"), "-o",
                          "cache_size=lots"], capture_output=True, text=True)
    assert out.returncode == 2
    assert "cache-size 'lots' is not a size" in out.stderr and "Traceback" not in out.stderr


def test_unknown_eviction_policy_is_a_sentence(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "m").mkdir()
    out = subprocess.run([*CACHEFS, "mount", "--eviction", "lru", str(tmp_path / "b"),
                          str(tmp_path / "m")], capture_output=True, text=True)
    assert out.returncode == 2
    assert "eviction policy 'lru' is not one of s3-fifo, clock" in out.stderr
    assert "Traceback" not in out.stderr


def _mount_flags(mnt) -> set[str]:
    for line in open("/proc/mounts", errors="surrogateescape"):
        fields = line.split()
        if fields[1] == str(mnt):
            return set(fields[3].split(","))
    raise AssertionError(f"{mnt} is not mounted")


@pytest.mark.skipif(os.geteuid() != 0, reason="device nodes need root")
def test_nosuid_nodev_by_default_and_suid_dev_when_asked(tmp_path):
    """As mount.fuse3 mounts for root: dev and suid unless `-o nodev,nosuid` asks, since
    mount(8) hands a helper no default flags (fstab's "dev,suid" arrived as nothing and the
    mount was always nosuid,nodev: a helper's xfstests run); `cachefs mount` keeps nosuid
    and nodev unless asked. The two options were once swallowed as meaning nothing to
    FUSE, so a device node on the mount could never be used, whatever the options."""
    backing, mnt = tmp_path / "b", tmp_path / "m"
    for d in (backing, mnt):
        d.mkdir()
    os.mknod(backing / "null", 0o20666, os.makedev(1, 3))
    for cmd, opts, dev in ((HELPER, f"cache_dir={tmp_path / 'c1'}", True),
                           (HELPER, f"cache_dir={tmp_path / 'c2'},nosuid,nodev", False),
                           ([*CACHEFS, "mount"], f"cache_dir={tmp_path / 'c3'}", False),
                           ([*CACHEFS, "mount"], f"cache_dir={tmp_path / 'c4'},suid,dev", True)):
        try:
            out = subprocess.run([*cmd, str(backing), str(mnt), "-o", opts],
                                 capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stderr
            flags = _mount_flags(mnt)
            assert ("nodev" not in flags and "nosuid" not in flags) == dev, flags
            if dev:
                (mnt / "null").write_bytes(b"into the null device")
            else:
                with pytest.raises(PermissionError):
                    (mnt / "null").write_bytes(b"x")
            out = subprocess.run([*CACHEFS, "umount", str(mnt)], capture_output=True,
                                 text=True, timeout=120)
            assert out.returncode == 0, out.stderr
        finally:
            force_unmount(mnt)


@pytest.mark.parametrize("how", ["helper", "mount(8)"])
def test_remount_read_only_and_back(make_mount, how):
    """`mount -o remount,ro MOUNTPOINT`: mount(8) calls the helper of the mount's type
    (fuse.cachefs: mount.fuse.cachefs, which `make install` puts next to mount.cachefs); it
    went to mount.fuse3, which ran `cachefs SOURCE MOUNTPOINT -o remount,ro` and failed
    ("cachefs: not found"), and the mount stayed writable (xfstests generic/294, a helper)."""
    if how == "mount(8)" and not os.path.exists("/usr/sbin/mount.fuse.cachefs"):
        pytest.skip("mount.fuse.cachefs is not installed (make install links it)")
    m = make_mount()
    m.path("f").write_bytes(b"before")

    def remount(opts: str) -> None:
        cmd = ([*HELPER, str(m.backing), str(m.mnt), "-o", opts] if how == "helper"
               else ["mount", "-o", opts, str(m.mnt)])
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
    remount("remount,ro")
    with pytest.raises(OSError) as exc:
        m.path("g").write_bytes(b"x")
    assert exc.value.errno == errno.EROFS
    assert m.path("f").read_bytes() == b"before"
    remount("remount,rw")
    m.path("g").write_bytes(b"after")
    assert (m.backing / "g").read_bytes() == b"after" or m.stats()["dirty_bytes"]


def test_a_remount_says_which_cachefs_options_it_does_not_apply(make_mount):
    """`mount -o remount,cache_size=32M MOUNTPOINT` exited 0 and the pool kept its size,
    nothing said so (a helper's hunt). The kernel's flags still change; each cachefs option
    whose value differs from the daemon's is named; one equal to it (an fstab line's
    options come back at every remount) is not."""
    if not os.path.exists("/usr/sbin/mount.fuse.cachefs"):
        pytest.skip("mount.fuse.cachefs is not installed (make install links it)")
    m = make_mount("--cache-size", "64M")
    out = subprocess.run(["mount", "-o", f"remount,ro,cache_size=32M,mode=write-through,"
                          f"cache_dir={m.cache}", str(m.mnt)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "cache_size=32.0 MiB is not applied by a remount (the mount keeps 64.0 MiB)" \
        in out.stderr, out.stderr
    assert "mode=" not in out.stderr and "cache_dir=" not in out.stderr, out.stderr
    assert "ro" in _mount_flags(m.mnt)
    assert m.stats()["cache_size"] == 64 << 20
    out = subprocess.run(["mount", "-o", "remount,rw", str(m.mnt)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and not out.stderr, out.stderr
