"""Power cuts of the cache filesystem: what was acknowledged durable survives, and nothing
read after the cut is stale or garbage.

kill -9 (test_kill9.py) leaves the kernel's page cache in place: whatever the daemon wrote
reaches the SSD later anyway. A power cut loses every write the SSD's filesystem had not
flushed, in any order the kernel happened to write the rest. Here the cache directory lives
on an ext4 of its own (a loop device) and a cut is EXT4_IOC_SHUTDOWN with
EXT4_GOING_FLAGS_NOLOGFLUSH (xfstests' godown): from that moment the filesystem writes
nothing more, neither data nor journal, and its next mount replays the journal as after a
power loss. The daemon is frozen (SIGSTOP) just before the cut and killed after it, so it
never sees its filesystem fail. BACKING (another filesystem, as an NFS server would be)
keeps what it acknowledged.

Write-back: each block must read back as its last fsynced version or a later one.
Write-through: every acknowledged write is in BACKING, so each block must read back as its
last version: a cache file that lost a write the database's checksum or identity still
vouches for would serve stale bytes. The data is 4x the pool and 16x the dirty limit, so
eviction and destaging run across the cuts.
"""

from __future__ import annotations

import fcntl
import os
import random
import signal
import struct
import subprocess
import time

import pytest

from tests.crash.test_crash_ops import MountTarget, rounds, run_rounds
from tests.conftest import Mount, ctl_flush, env_long, env_seed, force_unmount, pread_aligned

pytestmark = [pytest.mark.fuse, pytest.mark.slow]

BLK = 4096
FILES = 4
FILE_BLOCKS = 2048                          # 8 MiB each: 32 MiB against an 8 MiB pool
EXT4_IOC_SHUTDOWN = 0x8004587D              # _IOR('X', 125, __u32)
EXT4_GOING_FLAGS_NOLOGFLUSH = 2


class Ssd:
    """An ext4 on a loop device, mounted at `path`, that can lose power."""

    def __init__(self, image, path):
        self.image, self.path = image, path
        subprocess.run(["truncate", "-s", "256M", str(image)], check=True)
        # 1 KiB blocks (mkfs's choice for a filesystem this small, asked for explicitly): holes
        # in a cache file then come in pieces smaller than cachefs's 4 KiB blocks
        subprocess.run(["mkfs.ext4", "-q", "-F", "-b", "1024", str(image)], check=True,
                       capture_output=True)
        out = subprocess.run(["losetup", "-f", "--show", str(image)], capture_output=True,
                             text=True)
        if out.returncode != 0:
            pytest.skip(f"no loop device: {out.stderr.strip()}")
        self.dev = out.stdout.strip()
        path.mkdir()
        self.mount()

    def mount(self) -> None:
        subprocess.run(["mount", "-t", "ext4", self.dev, str(self.path)], check=True)

    def cut(self) -> None:
        fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.ioctl(fd, EXT4_IOC_SHUTDOWN, struct.pack("I", EXT4_GOING_FLAGS_NOLOGFLUSH))
        finally:
            os.close(fd)

    def power_on(self) -> None:
        """Unmount the dead filesystem and mount it again (the journal is replayed). Files
        still open on it (cache files the kernel holds for passthrough opens of the dead
        mount, until their programs close them) keep the dead instance alive, and a mount
        then gets it back: wait until a write works."""
        deadline = time.monotonic() + 30
        while True:
            subprocess.run(["umount", str(self.path)], check=True)
            self.mount()
            try:
                with open(self.path / ".alive", "wb") as f:
                    f.write(b"1")
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def remove(self) -> None:
        subprocess.run(["umount", "-l", str(self.path)], capture_output=True)
        subprocess.run(["losetup", "-d", self.dev], capture_output=True)


@pytest.fixture
def ssd(tmp_path):
    s = Ssd(tmp_path / "ssd.img", tmp_path / "ssd")
    try:
        yield s
    finally:
        s.remove()


class History:
    """Per file and block, every version written; `durable` is the index of the oldest
    version that may still be read (the last one synced, or acknowledged in write-through)."""

    def __init__(self):
        zero = bytes(BLK)
        self.versions = [[[zero] for _ in range(FILE_BLOCKS)] for _ in range(FILES)]
        self.durable = [[0] * FILE_BLOCKS for _ in range(FILES)]

    def write(self, f: int, blk: int, data: bytes, durable: bool) -> None:
        self.versions[f][blk].append(data)
        if durable:
            self.durable[f][blk] = len(self.versions[f][blk]) - 1

    def synced(self, f: int) -> None:
        for b in range(FILE_BLOCKS):
            self.durable[f][b] = len(self.versions[f][b]) - 1

    def check(self, f: int, content: bytes, when: str) -> None:
        assert len(content) == FILE_BLOCKS * BLK, f"{when}: f{f} has {len(content)} bytes"
        for b in range(FILE_BLOCKS):
            got = content[b * BLK:(b + 1) * BLK]
            if got in self.versions[f][b][self.durable[f][b]:]:
                continue
            older = any(got == v for v in self.versions[f][b])
            raise AssertionError(f"{when}: f{f} block {b} holds "
                                 + ("an older version than one acknowledged durable" if older
                                    else "bytes that were never written there"))

    def settle(self, f: int, content: bytes) -> None:
        """What the remount serves is the new truth (what BACKING gets)."""
        for b in range(FILE_BLOCKS):
            self.versions[f][b] = [content[b * BLK:(b + 1) * BLK]]
            self.durable[f][b] = 0


def read_all(path) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        return b"".join(pread_aligned(fd, 1 << 20, off)
                        for off in range(0, FILE_BLOCKS * BLK, 1 << 20))
    finally:
        os.close(fd)


def power_cut(m: Mount, ssd: Ssd) -> None:
    """The daemon and the SSD stop at once; power_on (after the test closed its files on
    the dead mount) brings the SSD back."""
    m.proc.send_signal(signal.SIGSTOP)       # the daemon stops with the power ...
    ssd.cut()                                # ... and so does the SSD
    m.proc.kill()
    m.proc.wait()
    m.proc = None
    force_unmount(m.mnt)


@pytest.mark.parametrize("mode", ["write-back", "write-through"])
def test_power_cuts_keep_what_was_acknowledged(tmp_path, ssd, mode):
    seed = env_seed(20261126) + (mode == "write-back")
    rng = random.Random(seed)
    backing, mnt = tmp_path / "backing", tmp_path / "mnt"
    backing.mkdir()
    mnt.mkdir()
    for i in range(FILES):
        (backing / f"f{i}").write_bytes(bytes(FILE_BLOCKS * BLK))
    m = Mount(backing, ssd.path / "cache", mnt,
              ["--mode", mode, "--cache-size", "8M", "--dirty-high", "2M", "--dirty-low", "1M",
               "--max-dirty-age", "2", "--promote-after", "1"], tmp_path / "daemon.log")
    hist = History()
    names = [m.path(f"f{i}") for i in range(FILES)]
    durable = mode == "write-through"
    try:
        m.start()
        for rnd in range(20 if env_long() else 3):
            for f in rng.sample(range(FILES), 2):        # cache some of it (clean)
                for off in rng.sample(range(0, FILE_BLOCKS * BLK, 1 << 20), 3):
                    fd = os.open(names[f], os.O_RDONLY | os.O_DIRECT)
                    pread_aligned(fd, 1 << 20, off)
                    os.close(fd)
            fds = [os.open(p, os.O_RDWR | os.O_DIRECT) for p in names]
            try:
                for _ in range(rng.randrange(150, 400)):
                    f = rng.randrange(FILES)
                    b0 = rng.randrange(FILE_BLOCKS)
                    n = min(rng.choice([1, 1, 2, 4, 16]), FILE_BLOCKS - b0)
                    blocks = [os.urandom(BLK) for _ in range(n)]
                    assert os.pwrite(fds[f], b"".join(blocks), b0 * BLK) == n * BLK
                    for i, data in enumerate(blocks):
                        hist.write(f, b0 + i, data, durable)
                    if rng.random() < 0.05:
                        os.fsync(fds[f])
                        hist.synced(f)
                time.sleep(rng.choice([0, 0.05, 0.3, 1.2, 2.5]))   # commits, destages
                power_cut(m, ssd)
            finally:
                for fd in fds:
                    try:
                        os.close(fd)
                    except OSError:                  # the daemon is gone
                        pass
            ssd.power_on()
            m.start()
            for f, p in enumerate(names):
                content = read_all(p)
                hist.check(f, content, f"{mode}, seed {seed}, after cut {rnd}")
                hist.settle(f, content)
        final = [read_all(p) for p in names]
        if mode == "write-back":
            ctl_flush(m)
        m.stop()
        for f in range(FILES):
            assert (backing / f"f{f}").read_bytes() == final[f], f"BACKING f{f} differs"
    finally:
        m.cleanup()


class PowerCutTarget(MountTarget):
    """test_crash_ops's rounds of file operations, ended by a power cut instead of kill -9."""

    def __init__(self, m: Mount, ssd: Ssd):
        super().__init__(m)
        self.ssd = ssd

    def kill(self) -> None:
        power_cut(self.m, self.ssd)

    def restart_after_kill(self) -> None:
        self.ssd.power_on()                     # the round closed its files first
        self.m.start()

    def recover(self) -> None:
        if self.m.proc is not None and self.m.proc.poll() is None:
            self.m.stop(check=False)
        self.m.cleanup()
        self.ssd.power_on()                     # whether or not the round had cut it
        self.m.start()


def test_power_cut_rounds_of_file_operations(tmp_path, ssd):
    """Writes, truncates, renames, unlinks and syncs through a 1 MiB pool, then a power cut:
    the view after the remount is a state each file had since its last fsync, and what a
    flush leaves in BACKING is that view (the model and checks of test_crash_ops.py)."""
    (tmp_path / "backing").mkdir()
    (tmp_path / "mnt").mkdir()
    m = Mount(tmp_path / "backing", ssd.path / "cache", tmp_path / "mnt",
              ["--mode", "write-back", "--attr-timeout", "0", "--cache-size", "1M",
               "--dirty-high", "128K", "--dirty-low", "64K", "--max-dirty-age", "1",
               "--promote-after", "1"], tmp_path / "daemon.log")
    try:
        m.start()
        run_rounds(PowerCutTarget(m, ssd), count=max(3, rounds() // 2))
        m.stop()
    finally:
        m.cleanup()


def test_a_partial_block_extended_past_survives_a_crash(tmp_path, ssd):
    """A block that held the end of the file after a truncate, extended since: the cache
    file has no bytes past the old end (a hole in the block's tail on a cache filesystem with
    blocks smaller than 4 KiB), which reads as the zeros the file has there. Recovery after a
    crash took that hole for missing data and forgot the block, fsynced dirty bytes
    included."""
    (tmp_path / "backing").mkdir()
    (tmp_path / "mnt").mkdir()
    m = Mount(tmp_path / "backing", ssd.path / "cache", tmp_path / "mnt",
              ["--mode", "write-back", "--max-dirty-age", "3600"], tmp_path / "daemon.log")
    head, tail = os.urandom(5000), os.urandom(3000)
    try:
        m.start()
        with open(m.path("f"), "wb") as f:
            f.write(head + os.urandom(3192))
            f.flush()
            f.truncate(len(head))                  # the cache file too: 5000 bytes
            os.fsync(f.fileno())
            f.seek(20000)
            f.write(tail)
            f.flush()
            os.fsync(f.fileno())
        want = head + bytes(20000 - len(head)) + tail
        assert m.path("f").read_bytes() == want
        m.kill()                               # (kill -9: no power cut here)
        assert (tmp_path / "backing" / "f").read_bytes() == bytes(len(head)), \
            "destaged (or not truncated there): nothing is proven"
        m.start()
        assert read_all_of(m.path("f")) == want
        ctl_flush(m)
        m.stop()
        assert (tmp_path / "backing" / "f").read_bytes() == want
    finally:
        m.cleanup()


def read_all_of(path) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        return pread_aligned(fd, 1 << 20, 0)
    finally:
        os.close(fd)
