"""FUSE passthrough through real mounts: read-only opens of fully cached files are served by
the kernel from the cache file (no READ reaches the daemon: its read_ops stay still), and the
engine keeps its promise to them: writers joining in both modes, shared writable mappings,
drop and eviction pressure, outside changes, mappings that outlive their open, kill -9, and
the fallback when the capability is missing (openmode.py, docs/architecture.md)."""

from __future__ import annotations

import errno
import hashlib
import json
import mmap
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.conftest import (CACHEFS, CTL, ctl_drop, ctl_flush, dio_align_of, direct_passthrough,
                            pread_aligned, unmount_when_released, wait_until)

pytestmark = pytest.mark.fuse

EXT = 64 * 1024
MiB = 1 << 20


def _available() -> str | None:
    try:
        import pyfuse3
    except ImportError:
        return "pyfuse3 is not installed"
    if not hasattr(pyfuse3, "passthrough_open"):
        return "pyfuse3 without the passthrough patch (make install builds it)"
    if os.geteuid() != 0:
        return "passthrough needs CAP_SYS_ADMIN (run as root)"
    return None


def _slow_source(tmp_path, size: int):
    """(BACKING's source directory with `size` random bytes in f, the slowfs mount point,
    those bytes, bench/'s mounted_slowfs) for a test over a slow BACKING."""
    reason = _available()
    if reason:
        pytest.skip(reason)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from slowfs_client import mounted_slowfs
    src, slow = tmp_path / "src", tmp_path / "slow"
    src.mkdir()
    slow.mkdir()
    data = bytearray(os.urandom(size))
    (src / "f").write_bytes(data)
    return src, slow, data, mounted_slowfs


needs_passthrough = pytest.mark.skipif(_available() is not None,
                                       reason=str(_available()))


def read_all(path, direct: bool = False) -> bytes:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    try:
        parts, off = [], 0
        while True:
            chunk = pread_aligned(fd, MiB, off)
            if not chunk:
                return b"".join(parts)
            parts.append(chunk)
            off += len(chunk)
    finally:
        os.close(fd)


def cache_fully(m, name: str, size: int) -> None:
    """Read the file until every extent is cached (two passes, then wait)."""
    want = (size + EXT - 1) // EXT
    for _ in range(2):
        read_all(m.path(name), direct=True)
    wait_until(lambda: m.stats()["extents_cached"] >= want, 15, what="promotion")


def open_passthrough(m, name: str, timeout_s: float = 5) -> int:
    """Open read-only and check the daemon answered with passthrough. The kernel sends the
    RELEASE of an earlier open after its close(2) returns: until it arrives that open still
    fixes the inode's mode (a loaded CI machine), so a refused open is closed and retried."""
    deadline = time.monotonic() + timeout_s
    while True:
        before = m.stats()["passthrough_opens"]
        fd = os.open(m.path(name), os.O_RDONLY)
        if m.stats()["passthrough_opens"] == before + 1:
            return fd
        os.close(fd)
        assert time.monotonic() < deadline, "the open did not go passthrough"
        time.sleep(0.05)


def held_file(m, name: str) -> tuple[bytearray, int]:
    """1 MiB of random bytes in BACKING's `name`, cached whole and opened read-only in
    passthrough: (the bytes, the descriptor)."""
    data = bytearray(os.urandom(MiB))
    (m.backing / name).write_bytes(data)
    cache_fully(m, name, len(data))
    return data, open_passthrough(m, name)


def pread_all(fd: int, size: int) -> bytes:
    return os.pread(fd, size + 4096, 0)


@pytest.fixture
def pt_mount(make_mount, mode):
    reason = _available()
    if reason:
        pytest.skip(reason)
    m = make_mount("--mode", mode, "--attr-timeout", "0.2")
    assert m.stats()["passthrough"] == "on", m.stats()["passthrough_off_reason"]
    return m


def test_passthrough_reads_equal_backing_and_never_reach_the_daemon(pt_mount):
    m = pt_mount
    data = os.urandom(3 * MiB + 12345)
    (m.backing / "f").write_bytes(data)
    cache_fully(m, "f", len(data))
    ops = m.stats()["read_ops"]
    fd = open_passthrough(m, "f")
    try:
        assert pread_all(fd, len(data)) == data
        with mmap.mmap(fd, 0, prot=mmap.PROT_READ) as mp:
            assert mp[:] == data
        s = m.stats()
        assert s["passthrough_open_handles"] == 1 and s["passthrough_held_files"] == 1
        assert s["passthrough_held_bytes"] >= len(data)
    finally:
        os.close(fd)
    assert m.stats()["read_ops"] == ops, "reads of passthrough opens reached the daemon"
    assert read_all(m.path("f"), direct=True) == data      # O_DIRECT, passthrough too
    if direct_passthrough(m):                   # (where both filesystems state alignment)
        assert m.stats()["read_ops"] == ops, "O_DIRECT reads in passthrough reached the daemon"
    wait_until(lambda: m.stats()["passthrough_held_files"] == 0, 10, what="the release")


def test_partly_cached_file_keeps_the_cached_path_then_completes(pt_mount):
    m = pt_mount
    data = os.urandom(2 * MiB)
    (m.backing / "g").write_bytes(data)
    cache_fully(m, "g", len(data))
    # an outside append: the file is no longer fully cached (the tail is not)
    with open(m.backing / "g", "ab") as f:
        f.write(b"t" * 100000)
    time.sleep(0.3)                                 # attributes time out
    data += b"t" * 100000
    before = m.stats()
    assert read_all(m.path("g"), direct=True) == data
    assert m.stats()["passthrough_opens"] == before["passthrough_opens"]
    # the open completed the file in the background: a later open goes passthrough
    wait_until(lambda: m.stats()["extents_cached"] >= (len(data) + EXT - 1) // EXT, 15,
               what="background completion")
    fd = open_passthrough(m, "g")
    try:
        assert pread_all(fd, len(data)) == data
    finally:
        os.close(fd)


def test_writer_joins_readers_in_passthrough(pt_mount):
    """Readers in passthrough keep reading right while a writer opens, writes, extends and
    truncates the file; the writer's open never fails; BACKING ends up right."""
    m = pt_mount
    model = bytearray(os.urandom(MiB + 5000))
    (m.backing / "w").write_bytes(model)
    cache_fully(m, "w", len(model))
    r1 = open_passthrough(m, "w")
    r2 = open_passthrough(m, "w")
    try:
        w = os.open(m.path("w"), os.O_RDWR)     # joins: passthrough + direct I/O
        try:
            assert m.stats()["passthrough_joined"] >= 1
            steps = [("write", 4096 * 3 + 100, os.urandom(10000)),
                     ("write", len(model) + 70000, os.urandom(5000)),      # extends, gap
                     ("truncate", 300001, None),
                     ("write", 299000, os.urandom(9000)),
                     ("truncate", 700000, None)]                           # extends
            for op, off, buf in steps:
                if op == "write":
                    assert os.pwrite(w, buf, off) == len(buf)
                    if off > len(model):
                        model.extend(bytes(off - len(model)))
                    model[off:off + len(buf)] = buf
                else:
                    os.ftruncate(w, off)
                    del model[off:]
                    model.extend(bytes(off - len(model)))
                assert os.pread(w, len(model) + 10, 0) == model, op
                for r in (r1, r2):
                    assert os.fstat(r).st_size == len(model)
                    assert pread_all(r, len(model)) == model, (op, off)
        finally:
            os.close(w)
    finally:
        os.close(r1)
        os.close(r2)
    assert read_all(m.path("w")) == model
    ctl_flush(m)
    m.stop()
    assert (m.backing / "w").read_bytes() == model
    m.start()
    assert read_all(m.path("w"), direct=True) == model


def test_shared_writable_mmap_reaches_backing(pt_mount, mode):
    m = pt_mount
    data, r = held_file(m, "mm")
    try:
        w = os.open(m.path("mm"), os.O_RDWR)
        try:
            with mmap.mmap(w, 0) as mp:             # maps the cache file (the kernel's rule)
                patch = os.urandom(20000)
                mp[5000:25000] = patch
                data[5000:25000] = patch
                mp.flush()
        finally:
            os.close(w)
        assert pread_all(r, len(data)) == data       # the reader sees it at once
    finally:
        os.close(r)
    wait_until(lambda: m.stats()["passthrough_held_files"] == 0, 15, what="the release")
    assert m.stats()["passthrough_syncs"] >= 1
    if mode == "write-back":
        ctl_flush(m)
    wait_until(lambda: (m.backing / "mm").read_bytes() == data, 15, what="BACKING")
    m.stop()
    m.start()
    assert read_all(m.path("mm"), direct=True) == data



def test_a_mapped_write_reaches_backing_while_a_reader_still_holds_the_file(pt_mount, mode):
    """The mapping's writes were copied to BACKING (write-through) only once the last open
    of the file was gone: a reader keeping it open (tail -f, a log shipper, a second
    connection) kept an msync'd write off BACKING, and the mount showed the old mtime, for
    as long as it stayed open (a helper's differential hunt: 26 s and more)."""
    m = pt_mount
    data, r = held_file(m, "mm")
    try:
        syncs = m.stats()["passthrough_syncs"]
        w = os.open(m.path("mm"), os.O_RDWR)
        try:
            with mmap.mmap(w, 0) as mp:
                patch = os.urandom(20000)
                mp[5000:25000] = patch
                data[5000:25000] = patch
                mp.flush()
        finally:
            os.close(w)
        wait_until(lambda: m.stats()["passthrough_syncs"] > syncs, 10, what="the settle")
        if mode == "write-back":
            ctl_flush(m)
        wait_until(lambda: (m.backing / "mm").read_bytes() == data, 10, what="BACKING")
        assert m.stats()["passthrough_held_files"] == 1          # the reader holds it
        assert pread_all(r, len(data)) == data
        # a second writer maps it again: its writes are taken again at its end
        w = os.open(m.path("mm"), os.O_RDWR)
        try:
            syncs = m.stats()["passthrough_syncs"]
            with mmap.mmap(w, 0) as mp:
                mp[0:100] = b"x" * 100
                data[0:100] = b"x" * 100
        finally:
            os.close(w)
        wait_until(lambda: m.stats()["passthrough_syncs"] > syncs, 10, what="the settle")
        if mode == "write-back":
            ctl_flush(m)
        wait_until(lambda: (m.backing / "mm").read_bytes() == data, 10, what="BACKING again")
        assert pread_all(r, len(data)) == data
    finally:
        os.close(r)
    m.stop()
    m.start()
    assert read_all(m.path("mm"), direct=True) == data


def test_mapped_file_renamed_and_its_name_reused(pt_mount, mode):
    """A file mapped shared and writable is renamed and a new file takes its old name: the
    mapping's bytes reach the renamed file, and the new file is left alone (write-through
    copied the cache file over the new file by the old path, and left the renamed one old)."""
    m = pt_mount
    (m.backing / "f").write_bytes(os.urandom(MiB))
    cache_fully(m, "f", MiB)
    mapped = os.urandom(MiB)
    r = open_passthrough(m, "f")
    try:
        w = os.open(m.path("f"), os.O_RDWR)
        try:
            with mmap.mmap(w, 0) as mp:
                mp[:] = mapped
                mp.flush()
                os.rename(m.path("f"), m.path("g"))
                m.path("f").write_bytes(b"a new file under the old name\n")
        finally:
            os.close(w)
    finally:
        os.close(r)
    wait_until(lambda: m.stats()["passthrough_held_files"] == 0, 15, what="the release")
    if mode == "write-back":
        ctl_flush(m)
    assert (m.backing / "f").read_bytes() == b"a new file under the old name\n"
    assert (m.backing / "g").read_bytes() == mapped
    assert m.path("g").read_bytes() == mapped
    m.stop()
    assert (m.backing / "g").read_bytes() == mapped
    m.start()
    assert read_all(m.path("g"), direct=True) == mapped

def test_drop_pressure_and_outside_change_never_zero_a_reader(make_mount, mode):
    reason = _available()
    if reason:
        pytest.skip(reason)
    m = make_mount("--mode", mode, "--cache-size", "4M", "--attr-timeout", "0.1")
    data = os.urandom(2 * MiB)
    (m.backing / "keep").write_bytes(data)
    cache_fully(m, "keep", len(data))
    r = open_passthrough(m, "keep")
    try:
        ctl_drop(m)
        s = m.stats()
        assert s["drop_skipped_passthrough"] >= len(data) // EXT
        assert pread_all(r, len(data)) == data
        # pressure: other files cycle through the 4 MiB pool (3 MiB each: they never fit
        # beside the 2 MiB held, so they never go passthrough and are held themselves)
        for i in range(3):
            other = os.urandom(3 * MiB)
            (m.backing / f"o{i}").write_bytes(other)
            for _ in range(2):
                assert read_all(m.path(f"o{i}"), direct=True) == other
        # promotions run after the reads are answered
        wait_until(lambda: m.stats()["evictions"] > 0, 15, what="evictions")
        assert pread_all(r, len(data)) == data
        # an outside change: the open reader keeps its bytes (no zeros) until a new open
        # sees the new ones (close-to-open); that open is answered once the cache file the
        # kernel serves them both from holds them: the reader reads them too
        new = os.urandom(2 * MiB)
        (m.backing / "keep").write_bytes(new)
        assert pread_all(r, len(data)) == data
        time.sleep(0.3)
        assert read_all(m.path("keep"), direct=True) == new
        assert pread_all(r, len(data)) == new
    finally:
        os.close(r)
    assert read_all(m.path("keep")) == new


def test_mapping_outlives_its_open(pt_mount):
    """A mapping kept after close (as ld.so does) holds the file: drop leaves it, and its
    bytes stay right; once unmapped, the file is let go."""
    m = pt_mount
    data = os.urandom(MiB)
    (m.backing / "lib").write_bytes(data)
    cache_fully(m, "lib", len(data))
    fd = open_passthrough(m, "lib")
    mp = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
    os.close(fd)
    try:
        time.sleep(2.5)                              # the hold checks run meanwhile
        assert m.stats()["passthrough_held_files"] == 1
        ctl_drop(m)
        assert mp[:] == data
    finally:
        mp.close()
    wait_until(lambda: m.stats()["passthrough_held_files"] == 0, 10, what="the let-go")
    ctl_drop(m)
    assert m.stats()["extents_cached"] == 0
    assert read_all(m.path("lib"), direct=True) == data


def test_kill9_with_passthrough_opens(pt_mount):
    m = pt_mount
    data = os.urandom(MiB + 777)
    (m.backing / "k").write_bytes(data)
    cache_fully(m, "k", len(data))
    fd = open_passthrough(m, "k")
    try:
        m.kill()
    finally:
        try:
            os.close(fd)        # the descriptor goes; its flush meets a dead connection
        except OSError as exc:
            assert exc.errno == errno.ENOTCONN, exc
    m.start()
    assert read_all(m.path("k"), direct=True) == data
    cache_fully(m, "k", len(data))
    fd = open_passthrough(m, "k")
    try:
        assert pread_all(fd, len(data)) == data
    finally:
        os.close(fd)



@pytest.mark.parametrize("flush_between", [False, True])
def test_kill9_while_mapped_writable_keeps_the_mappings_writes(pt_mount, mode, flush_between):
    """kill -9 of the daemon while a file in passthrough is mapped shared and writable: the
    mapping wrote the cache file behind the engine, so the next mount takes the whole file
    as written and BACKING gets it (write-through: before the mount serves; write-back: by
    the destager). It came back as clean data BACKING never had (the mount and BACKING
    disagreed, and an eviction would have brought the old bytes back); in write-back also
    when a destage had cleaned the blocks before the mapping wrote them again."""
    m = pt_mount
    data, r = held_file(m, "mw")
    w = os.open(m.path("mw"), os.O_RDWR)
    mp = mmap.mmap(w, 0)
    try:
        mp[0:100_000] = data[0:100_000] = os.urandom(100_000)
        mp.flush()
        if flush_between:
            ctl_flush(m)                                 # destaged: clean, still mapped
        mp[500_000:700_000] = data[500_000:700_000] = os.urandom(200_000)
        mp.flush()
        m.kill()
    finally:
        mp.close()
        for fd in (w, r):
            try:
                os.close(fd)
            except OSError:
                pass
    m.start()
    if mode == "write-back":
        ctl_flush(m)
    assert (m.backing / "mw").read_bytes() == data
    assert read_all(m.path("mw"), direct=True) == data
    ctl_drop(m)
    assert read_all(m.path("mw"), direct=True) == data
    m.stop()
    assert (m.backing / "mw").read_bytes() == data

@pytest.mark.parametrize("how", ["regrow", "grow", "write-past-end"])
def test_mapped_writes_where_the_file_grew(pt_mount, mode, how):
    """A writer joining a passthrough reader grows the file (truncate to 0 and back up,
    truncate up, a write past the end) and writes the new part through a shared mapping of
    its open (which maps the cache file). The grown blocks were not in the map: a read
    through cachefs filled BACKING's zeros over the mapping's bytes, a write-back mapping's
    bytes there were never destaged, and a deferred hole punch of the truncated extents
    zeroed them in the writer's own mapping."""
    m = pt_mount
    data, r = held_file(m, "g")
    try:
        w = os.open(m.path("g"), os.O_RDWR)
        try:
            if how == "regrow":
                os.ftruncate(w, 0)
                os.ftruncate(w, MiB)
                data = bytearray(MiB)
                off = 0x40000
            elif how == "grow":
                os.ftruncate(w, 2 * MiB)
                data.extend(bytes(MiB))
                off = MiB + 0x40000
            else:
                tail = os.urandom(5000)
                os.pwrite(w, tail, 3 * MiB)
                data.extend(bytes(2 * MiB) + tail)
                off = MiB + 0x40000
            patch = os.urandom(0x5000)
            with mmap.mmap(w, 0) as mp:
                mp[off:off + len(patch)] = patch
                mp.flush()
            data[off:off + len(patch)] = patch
            time.sleep(0.5)                        # a commit and its hole punches
            assert os.pread(w, len(patch), off) == patch, "a read through cachefs"
            assert pread_all(r, len(data)) == data, "the passthrough reader"
        finally:
            os.close(w)
    finally:
        os.close(r)
    wait_until(lambda: m.stats()["passthrough_held_files"] == 0, 15, what="the release")
    assert read_all(m.path("g"), direct=True) == data
    if mode == "write-back":
        ctl_flush(m)
    assert (m.backing / "g").read_bytes() == data
    m.stop()
    assert (m.backing / "g").read_bytes() == data
    m.start()
    assert read_all(m.path("g"), direct=True) == data


def test_mapped_writes_before_a_truncate_into_their_extent(pt_mount, mode):
    """Write-through dropped the block holding a held file's new end at a truncate: a read
    through cachefs of that extent then went to BACKING, which has not got the mapping's
    bytes yet, and served them as zeros (fsx: a copy_file_range of the range)."""
    m = pt_mount
    data, r = held_file(m, "t")
    try:
        w = os.open(m.path("t"), os.O_RDWR)
        try:
            with mmap.mmap(w, 0) as mp:
                mp[0x40b1c:0x45c91] = data[0x40b1c:0x45c91] = os.urandom(0x45c91 - 0x40b1c)
                mp.flush()
            os.ftruncate(w, 0x45957)
            del data[0x45957:]
            assert os.pread(w, 0x450d3 - 0x3f0d9, 0x3f0d9) == data[0x3f0d9:0x450d3]
            assert pread_all(r, len(data)) == data
        finally:
            os.close(w)
    finally:
        os.close(r)
    wait_until(lambda: m.stats()["passthrough_held_files"] == 0, 15, what="the release")
    if mode == "write-back":
        ctl_flush(m)
    assert (m.backing / "t").read_bytes() == data


def test_unmount_or_flush_right_after_a_mapped_write_takes_it_to_backing(pt_mount, mode):
    """The mapping's bytes reached BACKING (write-through), or turned dirty (write-back),
    only at a check a second after the last close: a clean unmount before it left BACKING
    without them and the next mount took the file as written again (with a warning), and
    a flush before it did not destage them (`cachefs umount --flush`: BACKING without them)."""
    m = pt_mount
    data, r = held_file(m, "u")
    w = os.open(m.path("u"), os.O_RDWR)
    try:
        with mmap.mmap(w, 0) as mp:
            mp[4096:70000] = data[4096:70000] = os.urandom(70000 - 4096)
            mp.flush()
    finally:
        os.close(w)
        os.close(r)
    if mode == "write-back":
        ctl_flush(m)                            # at once: before that check
        assert (m.backing / "u").read_bytes() == data
    m.stop()
    assert (m.backing / "u").read_bytes() == data
    m.start()
    assert "shared and writable at the last stop" not in m.logs[-1].read_text()
    assert read_all(m.path("u"), direct=True) == data
    assert m.stats()["dirty_bytes"] == 0


def test_a_release_the_unmount_dropped_does_not_keep_a_mapped_file_marked(pt_mount, mode):
    """The kernel sends a file's RELEASE in the background and drops it when the unmount
    ends the connection before the daemon has read it (a busy daemon; a full suite run
    saw it): the daemon still counted the O_RDWR open, kept the file's mark and the next
    mount took the file as written ("mapped shared and writable at the last stop").
    Here the daemon is stopped from the munmap (the release) to the unmount."""
    m = pt_mount
    data, r = held_file(m, "u")
    w = os.open(m.path("u"), os.O_RDWR)
    mp = mmap.mmap(w, 0)
    try:
        mp[4096:70000] = data[4096:70000] = os.urandom(70000 - 4096)
        mp.flush()
    finally:
        os.close(w)                             # FLUSH answered; the mapping holds the file
    os.kill(m.proc.pid, signal.SIGSTOP)
    try:
        mp.close()                              # the RELEASEs, queued for a stopped daemon
        os.close(r)                             # (cachefs answers FLUSH with ENOSYS)
        unmount_when_released(m.mnt)            # ends the connection: the RELEASE dropped
    finally:
        os.kill(m.proc.pid, signal.SIGCONT)
    assert m.proc.wait(timeout=60) == 0, m.logs[-1].read_text()[-3000:]
    m.proc = None
    if mode == "write-through":
        assert (m.backing / "u").read_bytes() == data
    m.start()
    assert "shared and writable at the last stop" not in m.logs[-1].read_text()
    assert read_all(m.path("u"), direct=True) == data
    ctl_flush(m)
    assert (m.backing / "u").read_bytes() == data
    assert m.stats()["dirty_bytes"] == 0


def test_a_failing_backing_at_the_copy_back_keeps_the_mount(make_mount, tmp_path):
    """Write-through: copying a mapping's writes to BACKING failed with EIO, and the error
    left the task that lets held files go, which ended the daemon. It is logged and tried
    again until BACKING takes it."""
    src, slow, data, mounted_slowfs = _slow_source(tmp_path, MiB)
    with mounted_slowfs(src, slow, latency_ms=0, jitter_ms=0) as sf:
        m = make_mount("--attr-timeout", "0.2", backing=slow)
        cache_fully(m, "f", len(data))
        r = open_passthrough(m, "f")
        w = os.open(m.path("f"), os.O_RDWR)
        try:
            with mmap.mmap(w, 0) as mp:
                mp[0:50000] = data[0:50000] = os.urandom(50000)
                mp.flush()
        finally:
            os.close(w)
            os.close(r)
        sf.set(eio=1)
        try:
            wait_until(lambda: "copying what a shared mapping wrote to BACKING failed"
                       in m.logs[-1].read_text(), 15, m.proc, "the failed copy")
            time.sleep(1.5)                     # tried again meanwhile
            assert m.proc.poll() is None, "the daemon ended"
        finally:
            sf.set(eio=0)
        wait_until(lambda: (src / "f").read_bytes() == data, 15, m.proc, "the copy")
        m.stop()


def test_no_passthrough_option(make_mount):
    m = make_mount("--no-passthrough")
    data = os.urandom(MiB)
    (m.backing / "n").write_bytes(data)
    cache_fully(m, "n", len(data))
    ops = m.stats()["read_ops"]
    assert read_all(m.path("n"), direct=True) == data
    s = m.stats()
    assert s["passthrough"] == "off" and "--no-passthrough" in s["passthrough_off_reason"]
    assert s["passthrough_opens"] == 0 and s["read_ops"] > ops
    assert "FUSE passthrough: off: turned off (--no-passthrough)" in m.logs[-1].read_text()


FALLBACK = r"""
import hashlib, json, mmap, os, subprocess, sys, time
cachefs, ctl, base = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
b, c, m = (os.path.join(base, d) for d in "bcm")
with open(os.path.join(base, "daemon.log"), "wb") as log:
    proc = subprocess.Popen([*cachefs, "mount", "-f", "--cache-dir", c, b, m], stdout=log,
                            stderr=subprocess.STDOUT)
try:
    deadline = time.monotonic() + 20
    while not os.path.ismount(m):
        assert proc.poll() is None and time.monotonic() < deadline, "the mount failed"
        time.sleep(0.05)
    digests = []
    buf = mmap.mmap(-1, 4 << 20)                # O_DIRECT: the daemon answers every read
    for _ in range(3):
        fd = os.open(os.path.join(m, "f"), os.O_RDONLY | os.O_DIRECT)
        n = os.preadv(fd, [buf], 0)
        os.close(fd)
        digests.append(hashlib.sha256(buf[:n]).hexdigest())
        time.sleep(0.3)                         # promotion runs after the answer
    out = subprocess.run([*ctl, "stats", m, "--json"], capture_output=True, text=True)
    print(json.dumps({"digests": digests, "stats": json.loads(out.stdout)}))
finally:
    subprocess.run(["fusermount3", "-u", m], capture_output=True)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
"""


def test_fallback_without_cap_sys_admin(tmp_path):
    """A daemon without CAP_SYS_ADMIN in the initial user namespace (inside `unshare -U`, as
    in a rootless container: FUSE mounts work there, passthrough does not) runs as without
    passthrough: the same bytes, reads served by the daemon, one log line saying why."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare (util-linux)")
    for d in ("b", "c", "m"):
        (tmp_path / d).mkdir()
    data = os.urandom(MiB + 4321)
    (tmp_path / "b" / "f").write_bytes(data)
    # The mount lives in the new namespaces: when the script ends, so does the mount.
    out = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", sys.executable,
                          "-c", FALLBACK, json.dumps(CACHEFS), json.dumps(CTL), str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    text = (tmp_path / "daemon.log").read_text()
    assert out.returncode == 0, out.stderr + text[-3000:]
    res = json.loads(out.stdout)
    assert res["digests"] == [hashlib.sha256(data).hexdigest()] * 3
    s = res["stats"]
    assert s["passthrough"] == "off" and "CAP_SYS_ADMIN" in s["passthrough_off_reason"]
    assert s["passthrough_opens"] == 0 and s["hit_ops"] > 0        # today's cached path
    assert text.count("FUSE passthrough: off") == 1 and "CAP_SYS_ADMIN" in text, text[-3000:]
    assert "FUSE passthrough: on" not in text and "Traceback" not in text


def test_passthrough_is_visible_in_stats_top_metrics_drop_and_debug(make_mount):
    """stats, top, the Prometheus metrics and drop show the passthrough opens and the bytes
    they hold; --debug says which way each open went and why."""
    reason = _available()
    if reason:
        pytest.skip(reason)
    m = make_mount("--debug")
    data = os.urandom(MiB)
    (m.backing / "v").write_bytes(data)
    cache_fully(m, "v", len(data))
    fd = open_passthrough(m, "v")
    w = os.open(m.path("v"), os.O_RDWR)            # joins
    try:
        text = subprocess.run([*CTL, "stats", str(m.mnt)], capture_output=True, text=True,
                              check=True).stdout
        line = next(ln for ln in text.splitlines() if ln.startswith("passthrough "))
        assert "on; 2 opens of 1 files now, 1 files held (1.0 MiB)" in line, line
        top = subprocess.run([*CTL, "top", str(m.mnt), "--interval", "0.2", "--count", "1"],
                             capture_output=True, text=True, timeout=30)
        assert "2 opens of 1 files now" in top.stdout, top.stdout + top.stderr
        metrics = subprocess.run([*CTL, "metrics", str(m.mnt)], capture_output=True,
                                 text=True, check=True).stdout
        values = {ln.split("{")[0]: float(ln.rsplit(" ", 1)[1])
                  for ln in metrics.splitlines() if ln.startswith("cachefs_passthrough")}
        assert values["cachefs_passthrough_enabled"] == 1
        assert values["cachefs_passthrough_open_handles"] == 2
        assert values["cachefs_passthrough_held_bytes"] == len(data)
        assert values["cachefs_passthrough_opens_total"] >= 1
        assert values["cachefs_passthrough_joined_opens_total"] == 1
        out = subprocess.run([*CTL, "drop", str(m.mnt)], capture_output=True, text=True,
                             check=True).stdout
        assert "16 extents (1.0 MiB) of files the kernel reads in passthrough are kept" in out
    finally:
        os.close(w)
        os.close(fd)
    log = m.logs[-1].read_text()
    assert "passthrough, backing id" in log and "(fully cached, read-only)" in log
    assert "joined, backing id" in log and "(writable)" in log


def test_write_back_write_with_the_pool_full_of_held_files_goes_to_backing(make_mount):
    """A write-back write needing a cache slot while every slot holds data of files the
    kernel reads in passthrough (protected, never evicted) goes to BACKING instead of
    waiting for room that destaging can never free (it waited forever)."""
    reason = _available()
    if reason:
        pytest.skip(reason)
    m = make_mount("--mode", "write-back", "--cache-size", "1M", "--promote-after", "1")
    data = os.urandom(MiB)
    (m.backing / "held").write_bytes(data)
    cache_fully(m, "held", len(data))
    r = open_passthrough(m, "held")
    try:
        new = os.urandom(3 * 65536 + 100)
        script = ("import os,sys\n"
                  "fd=os.open(sys.argv[1],os.O_WRONLY|os.O_CREAT,0o644)\n"
                  "os.pwrite(fd,sys.stdin.buffer.read(),0)\n"
                  "os.close(fd)\n")
        out = subprocess.run([sys.executable, "-c", script, str(m.path("w"))], input=new,
                             capture_output=True, timeout=30)
        assert out.returncode == 0, out.stderr
        assert (m.backing / "w").read_bytes() == new          # went around the cache
        assert read_all(m.path("w")) == new
        assert pread_all(r, len(data)) == data
    finally:
        os.close(r)


def test_o_direct_goes_passthrough_only_where_backing_is_as_strict(make_mount):
    """A passthrough open reads the cache file with the reader's O_DIRECT. BACKING on tmpfs
    takes unaligned direct reads: there an O_DIRECT read-only open stays on the daemon (an
    unaligned read works, as on BACKING), unless --passthrough-odirect asks for passthrough
    (then reads must be aligned as on a local disk)."""
    reason = _available()
    if reason:
        pytest.skip(reason)
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm (tmpfs) for a BACKING without O_DIRECT alignment rules")
    shm = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="cachefs-test-"))
    try:
        data = os.urandom(MiB)
        for name, args, passthrough in (("strict", [], False),
                                        ("odirect", ["--passthrough-odirect"], True)):
            (shm / name).mkdir()
            (shm / name / "f").write_bytes(data)
            m = make_mount(*args, backing=shm / name, name=name)
            cache_fully(m, "f", len(data))
            before = m.stats()["passthrough_opens"]
            fd = os.open(m.path("f"), os.O_RDONLY | os.O_DIRECT)
            try:
                assert (m.stats()["passthrough_opens"] > before) == passthrough, name
                assert pread_aligned(fd, MiB, 0) == data
                if passthrough and dio_align_of(m.cache) != (0, 0):
                    with pytest.raises(OSError) as err:
                        os.pread(fd, 100, 1)                # unaligned: refused
                    assert err.value.errno == errno.EINVAL
                else:       # (a cache on btrfs takes it, as btrfs itself does)
                    assert os.pread(fd, 100, 1) == data[1:101]   # as BACKING takes it
            finally:
                os.close(fd)
            m.stop()
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def test_a_reused_inode_number_does_not_keep_the_next_file_unevictable(make_mount):
    """Files opened in passthrough are protected from eviction until cachefs lets go of
    them (about a second after their last close). A file removed meanwhile whose inode
    number BACKING gives to the next file (ext4 does, at once: a build's temporary files)
    left a second holder on that number that nothing ever let go: the next files with that
    number could never be evicted or dropped (a build filled a 24 MiB write-back pool with
    them, and ~2,700 of ~43,000 writes went around the cache to BACKING). Write-back: a
    file written through the mount is cached whole at once, so its read-only open goes
    passthrough right away, well within that second."""
    reason = _available()
    if reason:
        pytest.skip(reason)
    m = make_mount("--mode", "write-back")
    numbers: dict[int, int] = {}
    for i in range(20):
        m.path("t").write_bytes(os.urandom(2 * EXT))
        ino = os.stat(m.path("t")).st_ino
        numbers[ino] = numbers.get(ino, 0) + 1
        os.close(open_passthrough(m, "t"))
        os.unlink(m.path("t"))
    if max(numbers.values()) < 2:
        pytest.skip("BACKING gave every file a new inode number: nothing was reused")
    m.path("keep").write_bytes(os.urandom(2 * EXT))
    ctl_flush(m)
    wait_until(lambda: m.stats()["passthrough_held_files"] == 0, 15, what="the let-go")
    ctl_drop(m)
    s = m.stats()
    assert (s["extents_cached"], s["drop_operator"]) == (0, 2), (numbers, s["extents_cached"])


@pytest.mark.parametrize("mode", ["write-through", "write-back"])
def test_the_pool_returns_to_its_size_once_a_grown_held_file_is_let_go(make_mount, mode):
    """A file read in passthrough keeps every byte appended to it in its cache file, past
    --cache-size (the kernel reads that file itself). Once its last passthrough reader
    closed, the pool stayed over its size until the next mount: a 16 MiB pool held 55 MiB,
    and the cache filesystem stayed full (a `tail -f` of a growing log). The pool is trimmed
    back when the file is let go, its own data evicted like any other."""
    reason = _available()
    if reason:
        pytest.skip(reason)
    m = make_mount("--mode", mode, "--cache-size", "2M", "--promote-after", "1")
    data = os.urandom(MiB)
    (m.backing / "log").write_bytes(data)
    cache_fully(m, "log", len(data))
    r = open_passthrough(m, "log")
    added = os.urandom(4 * MiB)
    try:
        w = os.open(m.path("log"), os.O_WRONLY | os.O_APPEND)
        try:
            for i in range(0, len(added), 256 * 1024):
                os.write(w, added[i:i + 256 * 1024])
        finally:
            os.close(w)
        assert pread_all(r, 5 * MiB) == data + added          # the reader saw it all
        assert m.stats()["cache_used"] > 4 * MiB               # held past the pool
        assert m.stats()["passthrough_frozen"] == 0            # the filesystem has room
    finally:
        os.close(r)
    wait_until(lambda: m.stats()["passthrough_held_files"] == 0, 15, what="let go")
    wait_until(lambda: m.stats()["cache_used"] <= 2 * MiB, 15, what="the pool trimmed")
    s = m.stats()
    assert s["evictions"] >= (3 * MiB) // EXT
    assert read_all(m.path("log")) == data + added
    if mode == "write-back":
        ctl_flush(m)
    assert (m.backing / "log").read_bytes() == data + added
    assert "over the cache size" in m.logs[-1].read_text()


def _append(fd: int, data: bytes, chunk: int = 256 * 1024) -> None:
    for i in range(0, len(data), chunk):
        assert os.write(fd, data[i:i + chunk]) == len(data[i:i + chunk])


def _reader_sees_a_prefix(r: int, want: bytes, at_least: int) -> int:
    """What a passthrough reader reads is the file's first bytes (never zeros or other
    bytes past where its cache file stopped), at least `at_least` of them; how many."""
    seen = pread_all(r, len(want))
    assert len(seen) >= at_least, (len(seen), at_least)
    assert seen == want[:len(seen)]
    return len(seen)


def _on_a_small_cache(make_mount, make_tmpfs, *args: str):
    """A mount (with `args`) whose cache filesystem is a 64 MiB tmpfs: (mount, cache fs)."""
    reason = _available()
    if reason:
        pytest.skip(reason)
    cache = make_tmpfs("64M")
    return make_mount(*args, "--promote-after", "1", "--cache-dir", str(cache / "c")), cache


def _held_on_a_small_cache(make_mount, make_tmpfs, mode: str):
    """A mount whose cache filesystem is a 64 MiB tmpfs (a 40 MiB pool), and BACKING's `f`
    (1 MiB and 1,000 bytes: its end inside a block) cached whole and opened in passthrough:
    (mount, cache fs, bytes, reader fd)."""
    m, cache = _on_a_small_cache(make_mount, make_tmpfs, "--mode", mode, "--cache-size", "40M")
    want = bytearray(os.urandom(MiB + 1000))
    (m.backing / "f").write_bytes(want)
    cache_fully(m, "f", len(want))
    return m, cache, want, open_passthrough(m, "f")


@pytest.mark.parametrize("mode", ["write-through", "write-back"])
def test_a_held_file_stops_growing_before_the_cache_filesystem_fills(make_mount, make_tmpfs,
                                                                      mode):
    """A file read in passthrough kept every byte appended to it in its cache file, without
    bound: a `tail -f` of a log appended to for long filled the cache filesystem, and the
    appender then got ENOSPC (a helper's test: after 139 MB with a 32 MiB pool). Now its
    cache file stops growing while the filesystem still has a tenth of it free: the
    appender goes on (BACKING takes the rest), the passthrough reader sees the file up to
    there, other opens and the reader's next open see all of it. A truncate back within the
    cache file makes it whole again, and it grows again."""
    m, cache, want, r = _held_on_a_small_cache(make_mount, make_tmpfs, mode)
    try:
        w = os.open(m.path("f"), os.O_WRONLY | os.O_APPEND)
        try:
            added = os.urandom(72 * MiB)
            _append(w, added)               # no ENOSPC
            want += added
            sv = os.statvfs(cache)
            assert sv.f_bavail >= 0.09 * sv.f_blocks, (sv.f_bavail, sv.f_blocks)
            assert m.stats()["passthrough_frozen"] == 1
            out = subprocess.run([*CTL, "stats", str(m.mnt)], capture_output=True, text=True,
                                 timeout=60)
            assert "1 grown past the room for them" in out.stdout, out.stdout
            out = subprocess.run([*CTL, "metrics", str(m.mnt)], capture_output=True,
                                 text=True, timeout=60)
            assert [ln for ln in out.stdout.splitlines()
                    if ln.startswith("cachefs_passthrough_frozen_total{") and
                    ln.endswith(" 1.0")], out.stdout
            seen = _reader_sees_a_prefix(r, want, 30 * MiB)
            assert seen < len(want)
            # Another open (joined: served by the daemon) reads all of it, BACKING's part too.
            assert read_all(m.path("f")) == want
            # A shared writable mapping of an O_RDWR open writes the cache file, before the
            # limit: it reaches BACKING (write-through) or is destaged (write-back).
            rw = os.open(m.path("f"), os.O_RDWR)
            try:
                mapped = mmap.mmap(rw, 2 * EXT, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                patch = os.urandom(3000)
                mapped[EXT + 100:EXT + 3100] = patch
                mapped.flush()
                mapped.close()
                want[EXT + 100:EXT + 3100] = patch
            finally:
                os.close(rw)
            os.ftruncate(w, MiB // 2)
            del want[MiB // 2:]
            more = os.urandom(MiB)
            _append(w, more)
            want += more
            assert pread_all(r, len(want)) == want
            assert m.stats()["passthrough_frozen"] == 1
            assert read_all(m.path("f")) == want
        finally:
            os.close(w)
    finally:
        os.close(r)
    wait_until(lambda: m.stats()["passthrough_held_files"] == 0, 15, what="let go")
    assert read_all(m.path("f")) == want
    if mode == "write-back":
        ctl_flush(m)
    assert (m.backing / "f").read_bytes() == want
    m.restart()
    assert read_all(m.path("f")) == want
    assert "stops at" in m.logs[0].read_text()


@pytest.mark.parametrize("mode", ["write-through", "write-back"])
def test_a_held_file_on_a_full_cache_filesystem_stops_growing(make_mount, make_tmpfs, mode):
    """Where the cache filesystem is full before the held file reached its bound (another
    program filled it), its cache file stops growing there too: its writer never gets
    ENOSPC (it did, nothing written)."""
    m, cache, want, r = _held_on_a_small_cache(make_mount, make_tmpfs, mode)
    try:
        w = os.open(m.path("f"), os.O_WRONLY | os.O_APPEND)
        try:
            with open(cache / "filler", "wb") as f:
                try:
                    while True:
                        f.write(bytes(MiB))
                        f.flush()
                except OSError:
                    pass
            more = os.urandom(8 * MiB)
            _append(w, more)
            want += more
            assert m.stats()["passthrough_frozen"] == 1
            _reader_sees_a_prefix(r, want, MiB)
            assert read_all(m.path("f")) == want
        finally:
            os.close(w)
    finally:
        os.close(r)
        (cache / "filler").unlink(missing_ok=True)
    if mode == "write-back":
        ctl_flush(m)
    assert (m.backing / "f").read_bytes() == want
    assert read_all(m.path("f")) == want


@pytest.mark.parametrize("mode", ["write-through", "write-back"])
def test_writers_across_the_limit_of_a_held_file_then_kill9(make_mount, make_tmpfs, mode):
    """Two writers at random places of a held file grown past what its cache filesystem can
    hold, on both sides of where its cache file stopped growing (before it the blocks are
    the cache's, after it BACKING's alone), a passthrough reader open throughout; then
    fsync, kill -9 and a remount: every byte is the last one written."""
    import random
    import threading
    m, cache, want, r = _held_on_a_small_cache(make_mount, make_tmpfs, mode)
    size = 72 * MiB
    errors = []
    try:
        w0 = os.open(m.path("f"), os.O_RDWR)
        os.ftruncate(w0, size)                  # past what the filesystem has: it stops
        want += bytes(size - len(want))

        def writer(seed: int) -> None:
            rng = random.Random(seed)
            fd = os.open(m.path("f"), os.O_WRONLY)
            try:
                for _ in range(300):
                    # near the limit (1 MiB) or anywhere; each writer its own 32 KiB slots
                    span = 4 * MiB if rng.random() < 0.5 else size
                    slot = rng.randrange(span // (32 * 1024) // 2) * 2 + seed
                    off = slot * 32 * 1024 + rng.randrange(0, 28 * 1024)
                    data = os.urandom(rng.randrange(1, 4 * 1024))
                    assert os.pwrite(fd, data, off) == len(data)
                    want[off:off + len(data)] = data
                os.fsync(fd)
            except Exception as exc:                    # noqa: BLE001 (reported below)
                errors.append(exc)
            finally:
                os.close(fd)

        threads = [threading.Thread(target=writer, args=(i,)) for i in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert m.stats()["passthrough_frozen"] == 1
        _reader_sees_a_prefix(r, want, MiB)
        assert read_all(m.path("f")) == want
        os.close(w0)
    finally:
        os.close(r)
    m.kill()
    m.start()
    assert read_all(m.path("f")) == want
    if mode == "write-back":
        ctl_flush(m)
    assert (m.backing / "f").read_bytes() == want


def _detach_unlinked(m, w: int, want: bytearray) -> None:
    """Detach held `f`'s cache file: unlink it (still open as `w`), change BACKING's file
    behind the mount (through the daemon's own descriptor of it), wait for the detach."""
    os.unlink(m.path("f"))
    fds = [p for p in Path(f"/proc/{m.proc.pid}/fd").iterdir()
           if os.readlink(p) == f"{m.backing / 'f'} (deleted)"]
    time.sleep(1.1)                                     # another mtime
    with open(fds[0], "r+b") as f:                      # someone holding BACKING's file
        f.seek(10)
        f.write(b"OUTSIDE")
    want[10:17] = b"OUTSIDE"
    time.sleep(1.1)
    wait_until(lambda: os.fstat(w) and m.stats()["passthrough_detached"] == 1, 15,
               what="the detach")                       # seen at a revalidation


def test_a_detached_held_file_grows_as_an_ordinary_one(make_mount, make_tmpfs):
    """A held file's cache file is detached (set aside for the kernel's opens, a new one
    made) when BACKING's file changes behind it while it is unlinked. Its writes went on
    through the held paths into the new cache file, every byte kept past the pool with no
    bound, until the cache filesystem was full and the writer got ENOSPC (a helper's hunt:
    after 23 MiB with a 12 MiB pool). Now the new cache file is an ordinary one."""
    m, cache, want, r = _held_on_a_small_cache(make_mount, make_tmpfs, "write-through")
    w = os.open(m.path("f"), os.O_RDWR)
    try:
        _detach_unlinked(m, w, want)
        for _ in range(72):
            data = os.urandom(MiB)
            assert os.pwrite(w, data, len(want)) == len(data)      # no ENOSPC
            want += data
        sv = os.statvfs(cache)
        assert sv.f_bavail >= 0.09 * sv.f_blocks, (sv.f_bavail, sv.f_blocks)
        assert pread_all(w, len(want)) == want
    finally:
        os.close(w)
        os.close(r)


def test_a_detached_held_files_new_data_can_be_evicted(make_mount, make_tmpfs):
    """A detached held file's passthrough opens read its old cache file; its new cache file
    is an ordinary one. Its extents stayed protected all the same while those opens lasted:
    its new data filled the pool, no other file could be cached meanwhile, and `drop`
    skipped it. Now the new data is evicted and dropped as any other file's. (Reads in
    random order: the pool fills whatever --sequential-cutoff says.)"""
    m, cache, want, r = _held_on_a_small_cache(make_mount, make_tmpfs, "write-through")
    w = os.open(m.path("f"), os.O_RDWR)
    try:
        _detach_unlinked(m, w, want)
        for _ in range(48):
            data = os.urandom(MiB)
            assert os.pwrite(w, data, len(want)) == len(data)
            want += data
        rnd = random.Random(7)
        offs = list(range(0, len(want), EXT))
        for _ in range(2):                              # its new data fills the pool
            rnd.shuffle(offs)
            for off in offs:
                assert os.pread(w, EXT, off) == want[off:off + EXT]
        wait_until(lambda: m.stats()["extents_cached"] * EXT > 36 * MiB, 15,
                   what="a full pool")
        g = os.urandom(2 * MiB)
        (m.backing / "g").write_bytes(g)
        cache_fully(m, "g", len(g))
        assert m.stats()["extents_cached"] * EXT <= 40 * MiB
        ctl_drop(m)
        s = m.stats()
        assert (s["extents_cached"], s["drop_skipped_passthrough"]) == (0, 0)
        assert pread_all(w, len(want)) == want
    finally:
        os.close(w)
        os.close(r)


@pytest.mark.parametrize("mode", ["write-through", "write-back"])
def test_a_frozen_held_file_is_loaded_only_up_to_where_its_cache_file_stops(make_mount,
                                                                            make_tmpfs, mode):
    """A held file whose cache file stopped growing, changed behind the mount within it: the
    next open read BACKING's whole file again before it was answered (200 MiB for 1 MiB to
    read; every install past the limit refused: a helper's hunt), and `cachefs-ctl
    prefetch` of it said it had been written meanwhile. Now only the part before the limit
    is read, and prefetch says why the rest stays on BACKING."""
    m, cache, want, r = _held_on_a_small_cache(make_mount, make_tmpfs, mode)
    try:
        w = os.open(m.path("f"), os.O_WRONLY)
        try:
            os.ftruncate(w, 200 * MiB)                  # past the room: frozen at once
            want += bytes(200 * MiB - len(want))
        finally:
            os.close(w)
        assert m.stats()["passthrough_frozen"] == 1
        time.sleep(1.1)                                 # another mtime
        with open(m.backing / "f", "r+b") as f:          # a change behind the mount
            f.seek(10)
            f.write(b"OUTSIDE")
        want[10:17] = b"OUTSIDE"
        before = m.stats()["backing_read_bytes"]
        fd = os.open(m.path("f"), os.O_RDONLY)           # joined: refreshed first
        try:
            assert os.pread(fd, 2 * MiB, 0) == want[:2 * MiB]
        finally:
            os.close(fd)
        assert m.stats()["backing_read_bytes"] - before < 8 * MiB
        out = subprocess.run([*CTL, "prefetch", str(m.path("f"))], capture_output=True,
                             text=True, timeout=60)
        assert "read in passthrough and grown past the room for it" in out.stdout + out.stderr
        assert m.stats()["backing_read_bytes"] - before < 8 * MiB
        assert read_all(m.path("f")) == want
    finally:
        os.close(r)


@pytest.mark.parametrize("mode", ["write-through", "write-back"])
def test_a_held_file_grows_in_a_full_pool_by_evicting_other_data(make_mount, make_tmpfs, mode):
    """A warm pool is full, and with the default pool size its filesystem is at the tenth
    kept free: the growth bound's first version counted only the pool's free slots, so a
    held file stopped growing at its first append although clean data of other files could
    make room (as it did before the bound). It evicts that data and grows."""
    m, _ = _on_a_small_cache(make_mount, make_tmpfs, "--mode", mode, "--sequential-cutoff",
                             "1G")
    pool = m.stats()["cache_size"]
    for i in range(pool // (8 * MiB) + 1):                  # the pool full of clean data
        (m.backing / f"other{i}").write_bytes(os.urandom(8 * MiB))
        read_all(m.path(f"other{i}"), direct=True)
        read_all(m.path(f"other{i}"), direct=True)
    def full() -> bool:                     # (the pool may shrink: the filesystem fills)
        s = m.stats()
        return s["cache_used"] >= s["cache_size"] - 2 * MiB
    wait_until(full, 15, what="a full pool")
    want = bytearray(os.urandom(MiB))
    (m.backing / "log").write_bytes(want)
    deadline = time.monotonic() + 20
    while True:         # cached whole (other data evicted for it), then opened passthrough
        read_all(m.path("log"), direct=True)
        before = m.stats()["passthrough_opens"]
        r = os.open(m.path("log"), os.O_RDONLY)
        if m.stats()["passthrough_opens"] == before + 1:
            break
        os.close(r)
        assert time.monotonic() < deadline, "the log never went passthrough"
        time.sleep(0.2)
    try:
        w = os.open(m.path("log"), os.O_WRONLY | os.O_APPEND)
        try:
            added = os.urandom(8 * MiB)
            _append(w, added)
            want += added
        finally:
            os.close(w)
        s = m.stats()
        assert s["passthrough_frozen"] == 0, s["cache_used"]
        assert pread_all(r, len(want)) == want                  # the reader saw it all
    finally:
        os.close(r)
    assert read_all(m.path("log")) == want
