"""FUSE_HANDLE_KILLPRIV_V2 (deps/passthrough's kill-suidgid patches): the kernel stops asking
for security.capability before every write(2), and cachefs drops setuid/setgid bits itself
where Linux would: a write, truncate or O_TRUNC open by a caller without CAP_FSETID drops the
setuid bit and the setgid bit of a group-executable file; root keeps them; chown drops them
(BACKING does). Checked through the mount and in BACKING, in both modes."""

from __future__ import annotations

import errno
import mmap
import os
import stat
import struct
import subprocess

import pytest

from tests.conftest import CTL, ctl_flush

pytestmark = pytest.mark.fuse

USER = 12345


def _killpriv_built() -> bool:
    import pyfuse3
    return hasattr(pyfuse3, "killpriv_v2_enabled")


needs_killpriv = pytest.mark.skipif(
    not _killpriv_built(), reason="pyfuse3 without deps/passthrough/pyfuse3-kill-suidgid.patch")


def as_user(cwd, script: str) -> None:
    out = subprocess.run(["/bin/sh", "-c", script], cwd=cwd, user=USER, group=USER,
                         extra_groups=[], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr


def modes(m, name: str, mode: str) -> tuple[int, int]:
    """The permission bits of `name` through the mount and in BACKING."""
    if mode == "write-back":
        ctl_flush(m)
    return (stat.S_IMODE(os.stat(m.path(name)).st_mode),
            stat.S_IMODE(os.stat(m.backing / name).st_mode))


@needs_killpriv
def test_buffered_writes_send_no_capability_requests(make_mount):
    m = make_mount("--debug")
    assert m.stats()["killpriv_v2"] == "on"
    text = subprocess.run([*CTL, "stats", str(m.mnt)], capture_output=True, text=True,
                          check=True).stdout
    assert "killpriv v2          on" in text, text
    metrics = subprocess.run([*CTL, "metrics", str(m.mnt)], capture_output=True, text=True,
                             check=True).stdout
    assert any(ln.startswith("cachefs_killpriv_v2_enabled{") and ln.endswith(" 1.0")
               for ln in metrics.splitlines()), metrics
    with open(m.path("f"), "wb") as f:              # 200 write(2) calls
        for _ in range(200):
            f.write(b"x" * 4096)
            f.flush()
    with open(m.path("f"), "r+b") as f:             # and an existing file reopened
        for i in range(100):
            f.seek(i * 4096)
            f.write(b"y" * 100)
            f.flush()
    assert m.path("f").read_bytes()[:100] == b"y" * 100
    asks = sum(1 for line in m.logs[-1].read_text().splitlines()
               if "trace getxattr" in line and "security.capability" in line)
    assert asks <= 4, f"{asks} security.capability requests for 300 writes"


@needs_killpriv
@pytest.mark.parametrize("mode", ["write-through", "write-back"])
@pytest.mark.parametrize("how", ["write", "write-direct", "truncate", "open-trunc"])
def test_a_change_by_a_user_drops_setuid_and_group_exec_setgid(make_mount, mode, how):
    m = make_mount("--mode", mode)
    (m.mnt / "d").mkdir()
    os.chown(m.mnt / "d", USER, USER)
    cases = {"suid": 0o4755, "sgid": 0o2775, "sgid-noexec": 0o2764, "both": 0o6775}
    for name, bits in cases.items():
        p = m.path("d", name)
        p.write_bytes(b"a" * 10000)
        os.chown(p, USER, USER)
        os.chmod(p, bits)
        assert stat.S_IMODE(os.stat(p).st_mode) == bits
    # A buffered write: the kernel asks for the kill with a setattr before it; an O_DIRECT
    # write only says so in the write request itself (FUSE_WRITE_KILL_SUIDGID).
    script = {"write": "printf z | dd of={n} bs=1 seek=5 conv=notrunc status=none",
              "write-direct": "head -c 4096 /dev/zero | dd of={n} bs=4096 seek=1 oflag=direct "
                              "conv=notrunc status=none",
              "truncate": "truncate -s 100 {n}",
              "open-trunc": ": > {n}"}[how]
    for name in cases:
        as_user(m.path("d"), script.format(n=name))
    want = {"suid": 0o755, "sgid": 0o775, "sgid-noexec": 0o2764, "both": 0o775}
    for name, bits in want.items():
        assert modes(m, f"d/{name}", mode) == (bits, bits), (name, how)
    if how == "write":
        assert m.path("d", "suid").read_bytes()[4:7] == b"aza"


@needs_killpriv
@pytest.mark.parametrize("mode", ["write-through", "write-back"])
@pytest.mark.parametrize("how", ["write", "write-direct", "truncate", "open-trunc",
                                 "fallocate"])
def test_a_change_by_a_user_outside_the_group_drops_setgid(make_mount, mode, how):
    """Linux >= 6.2 (setattr_should_drop_sgid) drops the setgid bit of a file whose group is
    not executable too, when the caller is not in that group (xfstests generic/683-685,
    found by a helper); cachefs followed the older rule (group-executable only)."""
    m = make_mount("--mode", mode)
    os.chmod(m.mnt, 0o777)
    names = {"other-group": 0, "own-group": USER}
    for name, group in names.items():
        p = m.path(name)
        p.write_bytes(b"a" * 10000)
        os.chown(p, USER, group)
        os.chmod(p, 0o2666)
    script = {"write": "printf z | dd of={n} bs=1 seek=5 conv=notrunc status=none",
              "write-direct": "head -c 4096 /dev/zero | dd of={n} bs=4096 seek=1 oflag=direct "
                              "conv=notrunc status=none",
              "truncate": "truncate -s 100 {n}",
              "open-trunc": ": > {n}",
              "fallocate": "fallocate -l 65536 {n}"}[how]
    for name in names:
        as_user(m.mnt, script.format(n=name))
    assert modes(m, "other-group", mode) == (0o666, 0o666)
    assert modes(m, "own-group", mode) == (0o2666, 0o2666)      # in its group: kept


@needs_killpriv
@pytest.mark.parametrize("mode", ["write-through", "write-back"])
def test_the_mode_an_o_direct_write_drops_is_seen_at_once(make_mount, mode):
    """An O_DIRECT write says "kill" in the write request, not in a setattr whose reply
    would give the kernel the new mode: a statx asking for the mode alone (`stat -c %a`)
    showed the old setuid bits until --attr-timeout (xfstests generic/355)."""
    m = make_mount("--mode", mode, "--attr-timeout", "60")
    p = m.path("f")
    p.write_bytes(b"a" * 8192)
    os.chown(p, USER, USER)
    os.chmod(p, 0o6644)
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o6644       # cached by the kernel
    as_user(m.mnt, "head -c 4096 /dev/zero | dd of=f bs=4096 oflag=direct conv=notrunc "
                   "status=none")
    shown = subprocess.run(["stat", "-c", "%a", str(p)], capture_output=True, text=True,
                           check=True).stdout.strip()
    assert shown == "2644"
    assert stat.S_IMODE(os.stat(m.backing / "f").st_mode) == 0o2644


@needs_killpriv
@pytest.mark.parametrize("mode", ["write-through", "write-back"])
def test_root_keeps_setuid_and_chown_drops_it(make_mount, mode):
    m = make_mount("--mode", mode)
    p = m.path("tool")
    p.write_bytes(b"b" * 5000)
    os.chown(p, USER, USER)
    os.chmod(p, 0o4755)
    with open(p, "r+b") as f:                       # root has CAP_FSETID: the bit stays
        f.write(b"root")
    os.truncate(p, 4000)
    assert modes(m, "tool", mode) == (0o4755, 0o4755)
    os.chown(p, 0, 0)                               # chown drops it (in BACKING)
    assert modes(m, "tool", mode) == (0o755, 0o755)
    assert p.read_bytes() == b"root" + b"b" * 3996
    # A setuid bit set again through the mount is seen by the next write of a user (an
    # O_DIRECT one: no setattr from the kernel before it, the write's flag alone says so).
    os.chmod(p, 0o4777)
    as_user(m.mnt, "head -c 4096 /dev/zero | dd of=tool bs=4096 oflag=direct conv=notrunc "
                   "status=none")
    assert modes(m, "tool", mode) == (0o777, 0o777)


CAPS = "security.capability"
CAPS_VALUE = struct.pack("<IIIII", 0x02000001, 1 << 10, 0, 0, 0)     # CAP_NET_BIND_SERVICE


@pytest.mark.parametrize("mode", ["write-through", "write-back"])
@pytest.mark.parametrize("direct", [False, True])
def test_a_write_drops_a_capability_at_once(make_mount, mode, direct):
    """Any write drops the file's capability, O_DIRECT ones too (the kernel asks before
    buffered writes only) and in write-back before any destage (BACKING's own write would
    drop it only then): an exec meanwhile must not run new bytes with the old capability."""
    m = make_mount("--mode", mode, "--max-dirty-age", "600")
    p = m.path("tool")
    p.write_bytes(b"c" * 8192)
    os.chmod(p, 0o6755)
    os.setxattr(p, CAPS, CAPS_VALUE)
    assert os.getxattr(p, CAPS) == CAPS_VALUE
    fd = os.open(p, os.O_WRONLY | (os.O_DIRECT if direct else 0))
    try:
        buf = mmap.mmap(-1, 4096)
        buf.write(b"n" * 4096)
        assert os.pwritev(fd, [buf], 4096) == 4096
    finally:
        os.close(fd)
    for where in (p, m.backing / "tool"):           # no flush: BACKING has no new data yet
        with pytest.raises(OSError) as err:
            os.getxattr(where, CAPS)
        assert err.value.errno == errno.ENODATA, where
    assert p.read_bytes() == b"c" * 4096 + b"n" * 4096
    # Buffered: the kernel's empty setattr after it removed the capability cannot be told
    # from a chown(-1, -1), which drops the setuid and setgid bits (documented: ext4 keeps
    # them for a root writer). O_DIRECT: cachefs drops the capability itself, nothing else.
    # A chown(-1, -1) of a file with a capability must drop them.
    want = 0o6755 if direct else 0o755
    assert modes(m, "tool", mode) == (want, want)
    os.chmod(p, 0o6755)
    os.setxattr(p, CAPS, CAPS_VALUE)
    os.chown(p, -1, -1)
    assert modes(m, "tool", mode) == (0o755, 0o755)
    with pytest.raises(OSError):
        os.getxattr(p, CAPS)


@pytest.mark.parametrize("mode", ["write-through", "write-back"])
def test_a_capability_set_after_the_write_survives_the_destage(make_mount, mode):
    """cp + setcap, tar --xattrs, rsync -X: the capability comes after the data. In
    write-back the destage's write of that data to BACKING dropped it (as any write does):
    every capability was lost (a helper's differential hunt). A write or a truncate after
    the capability still drops it, as on ext4."""
    m = make_mount("--mode", mode, "--max-dirty-age", "600")
    for name in ("keep", "written", "cut"):
        m.path(name).write_bytes(os.urandom(100_000))
        os.setxattr(m.path(name), CAPS, CAPS_VALUE)
    with open(m.path("written"), "r+b") as f:
        f.write(b"new")
    os.truncate(m.path("cut"), 5000)
    ctl_flush(m)
    for where in (m.path("keep"), m.backing / "keep"):
        assert os.getxattr(where, CAPS) == CAPS_VALUE, where
    for name in ("written", "cut"):
        for where in (m.path(name), m.backing / name):
            with pytest.raises(OSError) as err:
                os.getxattr(where, CAPS)
            assert err.value.errno == errno.ENODATA, where
    m.restart()
    assert os.getxattr(m.path("keep"), CAPS) == CAPS_VALUE


def test_a_capability_set_after_the_write_survives_a_kill_before_the_destage(make_mount):
    """The capability to put back after the destage is durable before setxattr returns:
    kill -9 before the destage, then the next mount destages the data and puts it back."""
    m = make_mount("--mode", "write-back", "--max-dirty-age", "600")
    data = os.urandom(100_000)
    with open(m.path("tool"), "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())                    # the data survives the kill (dirty)
    os.setxattr(m.path("tool"), CAPS, CAPS_VALUE)
    m.kill()
    m.start()
    assert m.stats()["dirty_bytes"] >= len(data)
    ctl_flush(m)
    assert (m.backing / "tool").read_bytes() == data
    for where in (m.path("tool"), m.backing / "tool"):
        assert os.getxattr(where, CAPS) == CAPS_VALUE, where


@needs_killpriv
def test_a_file_system_that_did_not_ask_gets_the_write_it_always_got(tmp_path):
    """deps/passthrough's pyfuse3 patch passed write(..., kill_suidgid=True) for an O_DIRECT
    write by a user to any file system, also one that never asked for KILLPRIV_V2 and whose
    write() takes no such argument (bench/passthrough.py): the TypeError ended its main
    loop (a helper's xfstests baseline). The flags go only to those that asked."""
    import sys
    from tests.conftest import force_unmount, is_mounted, wait_until
    src, bare = tmp_path / "src", tmp_path / "bare"
    src.mkdir()
    bare.mkdir()
    for d in [tmp_path, *tmp_path.parents][:-1]:     # pytest's directories are 0700
        os.chmod(d, stat.S_IMODE(os.stat(d).st_mode) | 0o011)
    (src / "f").write_bytes(bytes(8192))
    os.chown(src / "f", USER, USER)
    proc = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(__file__), "..",
                                                          "..", "bench", "passthrough.py"),
                             "mount", "-f", str(src), str(bare)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: is_mounted(bare), 20, proc, "the bare passthrough")
        os.chmod(bare, 0o777)
        as_user(bare, "head -c 4096 /dev/zero | tr '\\0' z | dd of=f bs=4096 oflag=direct "
                      "conv=notrunc status=none")
        assert proc.poll() is None, "the bare passthrough ended"
        assert (src / "f").read_bytes()[:4096] == b"z" * 4096
    finally:
        force_unmount(bare)
        proc.wait(timeout=30)
