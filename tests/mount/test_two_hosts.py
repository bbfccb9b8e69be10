"""Issue 17, item 6: two cachefs mounts of one BACKING stand in for two hosts. In
write-through, close-to-open holds both ways, also for a file the reader holds cached."""

import errno
import os
import time

import pytest

from tests.conftest import ctl_flush, read_blocks, warm

pytestmark = pytest.mark.fuse

SIZE = 512 * 1024


def write_at(path, off: int, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, data, off)
    finally:
        os.close(fd)


def whole(path) -> bytes:
    return b"".join(read_blocks(path, range(0, SIZE, 65536), 65536)[o]
                    for o in range(0, SIZE, 65536))


def test_close_to_open_between_two_write_through_mounts(make_mount, tmp_path):
    a = make_mount("--mode", "write-through", "--promote-after", "1", name="a")
    b = make_mount("--mode", "write-through", "--promote-after", "1", name="b",
                   backing=a.backing)
    data = bytearray(os.urandom(SIZE))
    (a.backing / "f").write_bytes(data)
    warm(a, "f", SIZE)
    warm(b, "f", SIZE)                               # both hold it cached
    for writer, reader, off in ((a, b, 4096), (b, a, 200_000), (a, b, SIZE - 100)):
        new = os.urandom(100)
        write_at(writer.path("f"), off, new)         # written and closed on one host
        data[off:off + 100] = new
        assert whole(reader.path("f")) == bytes(data)   # the other's next open sees it
        assert reader.path("f").read_bytes() == bytes(data)     # buffered too
        assert whole(writer.path("f")) == bytes(data)
    assert (a.backing / "f").read_bytes() == bytes(data)
    # a file the reader holds cached, replaced as a whole by the other host
    replacement = os.urandom(SIZE)
    tmp = a.path("f.tmp")
    tmp.write_bytes(replacement)
    os.rename(tmp, a.path("f"))
    assert whole(b.path("f")) == replacement


def test_write_back_host_reports_a_conflict_with_another_host(make_mount):
    """Write-back asks for a single writer; when another host writes a file this one holds
    dirty data of, the conflict is reported (log and stats), not passed over silently."""
    a = make_mount("--mode", "write-back", "--max-dirty-age", "600", "--dirty-high", "64M",
                   "--dirty-low", "32M", "--attr-timeout", "0", name="a")
    b = make_mount("--mode", "write-through", name="b", backing=a.backing)
    (a.backing / "f").write_bytes(bytes(SIZE))
    write_at(a.path("f"), 0, b"A" * 4096)             # dirty on host a only
    assert a.stats()["dirty_bytes"] == 4096
    write_at(b.path("f"), 8192, b"B" * 4096)           # host b writes the same file
    seen = whole(a.path("f"))                          # a's next open sees the change...
    assert seen[:4096] == b"A" * 4096 and seen[8192:12288] == b"B" * 4096
    s = a.stats()
    assert s["conflicts"] == 1                         # ...and reports the conflict
    assert s["stale_files"] == 1                       # a file changed behind the cache too
    assert "conflict: BACKING inode" in a.logs[-1].read_text()
    a.stop(check=False)                                # the WARNING is expected


@pytest.mark.parametrize("when", ["mounted", "unmounted"])
def test_a_file_shrunk_behind_dirty_data_shows_its_new_size_with_the_dirty_blocks(
        make_mount, when):
    """BACKING's file is rewritten shorter behind a write-back cache holding dirty data of
    it (here, or while cachefs is down): the dirty blocks win over the new file, which
    keeps its new size where they end before it. The mount showed the old size, with zeros
    where the dropped clean data had been, until a destage cut it (a helper's hunt, 8 of 8)."""
    m = make_mount("--mode", "write-back", "--max-dirty-age", "1h", "--dirty-high", "48M",
                   "--dirty-low", "40M", "--attr-timeout", "0.2")
    (m.backing / "f").write_bytes(os.urandom(200_000))
    fd = os.open(m.path("f"), os.O_WRONLY)
    try:
        os.pwrite(fd, b"D" * 8192, 65536)
        os.fsync(fd)
    finally:
        os.close(fd)
    if when == "unmounted":
        m.stop()
    (m.backing / "f").write_bytes(b"N" * 100_000)       # same inode, cut and rewritten
    if when == "unmounted":
        m.start()
    else:
        time.sleep(0.3)                                 # past --attr-timeout
    want = b"N" * 65536 + b"D" * 8192 + b"N" * (100_000 - 73728)
    assert m.path("f").read_bytes() == want
    assert os.stat(m.path("f")).st_size == 100_000
    ctl_flush(m)
    assert (m.backing / "f").read_bytes() == want
    m.stop(check=False)                                 # the conflict's WARNING is expected


@pytest.mark.parametrize("mode", ["write-through", "write-back"])
@pytest.mark.parametrize("change", ["append", "cut and rewrite"])
def test_close_to_open_sees_a_new_size_within_the_attribute_timeout(make_mount, mode, change):
    """Another host appends to a file, or cuts and rewrites it, that a program here read a
    moment ago (the kernel holds its size for --attr-timeout): the next open here reads
    exactly BACKING's bytes. The open found the change but the kernel kept its old size:
    reads stopped at it (the appended bytes missing, 10 of 20 in a helper's run) or went
    past the new end (zeros)."""
    m = make_mount("--mode", mode, "--attr-timeout", "30")
    size = 2 << 20
    for i in range(6):
        name = f"f{i}"
        (m.backing / name).write_bytes(os.urandom(size))
        for _ in range(2):                          # read (and cached) here
            assert len(m.path(name).read_bytes()) == size
        with open(m.backing / name, "r+b") as f:    # the other host
            if change == "append":
                f.seek(0, os.SEEK_END)
                f.write(os.urandom(70_000))
            else:
                f.truncate(size // 3)
                f.seek(size // 3)
                f.write(os.urandom(100_000))
        got, want = m.path(name).read_bytes(), (m.backing / name).read_bytes()
        assert len(got) == len(want) and got == want, \
            f"{name}: read {len(got)} bytes, BACKING has {len(want)}"


@pytest.mark.parametrize("mode", ["write-through", "write-back"])
def test_an_append_after_another_host_appended_keeps_both_lines(make_mount, mode):
    """A log both hosts append to: the other host appends a line and closes; `echo >> log`
    here must add its line after it. The kernel put an O_APPEND write at its own older size
    of the file, over the other host's line (10 of 10 in a helper's run, both modes)."""
    m = make_mount("--mode", mode, "--attr-timeout", "30")
    for i in range(5):
        log = f"log{i}"
        (m.backing / log).write_bytes(b"start\n")
        assert m.path(log).read_bytes() == b"start\n"       # the kernel holds its size
        with open(m.backing / log, "ab") as f:
            f.write(b"from the other host\n")
        fd = os.open(m.path(log), os.O_WRONLY | os.O_APPEND)    # as the shell's >> (no
        try:                                                    # lseek, as Python's "ab")
            os.write(fd, b"from this host\n")
            os.write(fd, b"and a second line\n")
        finally:
            os.close(fd)
        want = b"start\nfrom the other host\nfrom this host\nand a second line\n"
        assert m.path(log).read_bytes() == want
        if mode == "write-back":
            ctl_flush(m)
        assert (m.backing / log).read_bytes() == want


@pytest.mark.parametrize("mode", ["write-through", "write-back"])
def test_a_directory_moved_behind_the_mount_is_not_confused_with_its_successor(make_mount,
                                                                               mode):
    """A program holds directory `a` (a descriptor; a shell's cwd is the same); another
    host renames `a` to `b` and makes a new `a`. Opens, creates and removals relative to the
    held directory reached the new `a` (its files read, `h` created there: a helper's hunt,
    every time within --attr-timeout). cachefs keeps no handle of a directory: they fail
    with ESTALE instead, and never touch the new `a`."""
    m = make_mount("--mode", mode, "--attr-timeout", "30")
    a = m.backing / "a"
    a.mkdir()
    (a / "f").write_bytes(b"old f")
    (a / "g").write_bytes(b"old g")
    dfd = os.open(m.path("a"), os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert sorted(os.listdir(dfd)) == ["f", "g"]
        fd = os.open("f", os.O_RDONLY, dir_fd=dfd)
        os.close(fd)
        os.rename(a, m.backing / "b")                   # the other host
        a.mkdir()
        (a / "f").write_bytes(b"NEW f")
        (a / "g").write_bytes(b"NEW g")
        for name in ("f", "g"):
            try:
                fd = os.open(name, os.O_RDONLY, dir_fd=dfd)
            except OSError as exc:
                assert exc.errno == errno.ESTALE, exc
            else:
                try:
                    assert os.read(fd, 100).startswith(b"old"), name
                finally:
                    os.close(fd)
        for call in (lambda: os.close(os.open("h", os.O_WRONLY | os.O_CREAT, 0o644,
                                              dir_fd=dfd)),
                     lambda: os.mkdir("d", dir_fd=dfd),
                     lambda: os.unlink("g", dir_fd=dfd),
                     lambda: os.symlink("x", "s", dir_fd=dfd)):
            try:
                call()
            except OSError as exc:
                assert exc.errno == errno.ESTALE, exc
    finally:
        os.close(dfd)
    assert sorted(p.name for p in a.iterdir()) == ["f", "g"]       # the new `a` untouched
    assert (a / "g").read_bytes() == b"NEW g"


@pytest.fixture
def coarse_backing(tmp_path):
    """BACKING on an ext4 with 128-byte inodes: whole-second timestamps (as on ext3, FAT,
    many NFSv3 and SMB servers)."""
    import subprocess
    image, path = tmp_path / "coarse.img", tmp_path / "coarse"
    subprocess.run(["truncate", "-s", "64M", str(image)], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-I", "128", str(image)], check=True,
                   capture_output=True)
    path.mkdir()
    if subprocess.run(["mount", "-o", "loop", str(image), str(path)]).returncode != 0:
        pytest.skip("no loop device")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


@pytest.mark.parametrize("mode", ["write-through", "write-back"])
def test_a_rewrite_in_the_second_a_file_was_cached_is_seen_on_a_whole_second_backing(
        coarse_backing, make_mount, mode):
    """On a BACKING that keeps whole seconds, another writer's same-size rewrite in the
    second the file was cached left (size, mtime, ctime) as they were: the old bytes were
    served for good (a helper's hunt: 5 of 5, still 2.5 s later). An identity seen within
    the second of the file's last change is now racy: the next look at the file after that
    second drops what was cached in it."""
    m = make_mount("--mode", mode, "--attr-timeout", "0.2", backing=coarse_backing)
    f = coarse_backing / "f"
    time.sleep(1 - time.time() % 1 + 0.02)              # the start of a second
    f.write_bytes(b"a" * 100_000)
    assert m.path("f").read_bytes() == b"a" * 100_000   # cached (its identity seen)
    f.write_bytes(b"b" * 100_000)                       # same size, same second
    assert os.stat(f).st_mtime_ns % 1_000_000_000 == 0, "BACKING keeps sub-second times"
    if int(time.time()) != os.stat(f).st_mtime_ns // 1_000_000_000:
        pytest.skip("the steps did not fit into one second")
    time.sleep(2.3)
    assert m.path("f").read_bytes() == b"b" * 100_000
    assert m.path("f").read_bytes() == b"b" * 100_000


def test_dirty_data_of_a_file_another_host_removed_is_reported_not_flushed_in_silence(
        make_mount):
    """Another host removes a file this one holds write-back data of: the destage writes it
    into the removed file (nobody can reach it), and `flush` said "flushed; nothing is
    dirty" with no log line and no count (a helper's hunt). As at a mount that finds such a
    file gone: a WARNING and the `orphan` drop count."""
    m = make_mount("--mode", "write-back", "--max-dirty-age", "600")
    fd = os.open(m.path("f"), os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.write(fd, os.urandom(10 * 65536))
        os.fsync(fd)
    finally:
        os.close(fd)
    os.unlink(m.backing / "f")                      # the other host
    ctl_flush(m)
    assert m.stats()["drops"]["orphan"] == 10
    (m.path("g")).write_bytes(b"x")                 # a file unlinked through the mount is
    os.unlink(m.path("g"))                          # nobody's loss: no report
    ctl_flush(m)
    m.stop(check=False)
    log = m.logs[-1].read_text()
    assert "was removed behind cachefs while 640.0 KiB of it was dirty here" in log, log[-2000:]
    assert log.count("removed behind cachefs") == 1, log[-2000:]
