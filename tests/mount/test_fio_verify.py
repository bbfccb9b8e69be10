"""fio's own verification through a pool much smaller than the data (issue 15).

fio writes blocks with a checksummed header (`--verify=crc32c`) and reads them back through
the mount as it goes (`--verify_backlog`) and at the end (`--do_verify`), checking each
block's checksum, offset and write sequence. The pool is ¼ (or ½) of the file and the dirty
marks far below it, so eviction, hole punching, promotions, fills and destaging all race the
writes. Then the file's bytes through the mount are hashed, `cachefs-ctl flush` and unmount,
and BACKING must hold exactly those bytes, every block with a valid fio header and checksum
(a sequential read with verification: the file was laid out by fio first, so every block
has one), and a remount serves them again. Nothing of cachefs checks anything here: fio and
hashes do.

The default tier runs a short version in both modes; CACHEFS_LONG=1 runs the full set of
variations of the issue (pool ¼ and ½ of a 256 MiB file, psync and libaio at depth 16,
randwrite and randrw, 1 and 4 jobs, O_DIRECT and buffered, the file laid out through the
mount or already in BACKING).
"""

from __future__ import annotations

import hashlib
import mmap
import os
import shutil
import subprocess

import pytest

from tests.conftest import ctl_flush, env_long

pytestmark = [pytest.mark.fuse, pytest.mark.slow,
              pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed")]

MiB = 1 << 20


def fio(filename, size: int, rw: str, *, engine: str = "psync", depth: int = 1,
        jobs: int = 1, ios: int = 0, direct: bool = True, seed: int = 7
        ) -> subprocess.CompletedProcess:
    """One fio run with crc32c verification. `jobs` split the file into disjoint regions (no
    job overwrites blocks another one verifies). Writes are verified as they go and at the
    end; `rw="read"` checks every block's header and checksum."""
    region = size // jobs
    # Layout and read passes go 1 MiB at a time with a header every 4 KiB (as the random
    # writes leave them): the same check, far fewer requests.
    bs = "--bs=4k" if rw.startswith("rand") else "--bs=1M --verify_interval=4096"
    args = ["fio", "--name=v", f"--filename={filename}", f"--size={region}",
            f"--offset_increment={region}", f"--numjobs={jobs}", *bs.split(),
            f"--direct={int(direct)}", f"--ioengine={engine}", f"--iodepth={depth}",
            f"--rw={rw}", f"--randseed={seed}", "--verify=crc32c", "--verify_fatal=1",
            "--group_reporting", "--output-format=terse", "--verify_state_save=0"]
    if ios:
        args.append(f"--number_ios={ios // jobs}")
    if rw == "randrw":
        args.append("--rwmixread=30")
    if rw in ("randwrite", "randrw"):
        args += ["--verify_backlog=1024", "--do_verify=1"]
    elif rw == "write":
        args.append("--do_verify=0")
    return subprocess.run(args, capture_output=True, text=True, timeout=1800)


def check(out: subprocess.CompletedProcess, what: str) -> None:
    text = out.stdout + out.stderr
    assert out.returncode == 0 and "verify:" not in text, \
        f"{what}: fio found bad data:\n{text[-3000:]}"


def file_hash(path) -> str:
    """SHA-256 of a file read with O_DIRECT (through a mount: what the daemon serves)."""
    h = hashlib.sha256()
    buf = mmap.mmap(-1, 4 * MiB)                 # page-aligned, as O_DIRECT wants
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        off = 0
        while n := os.preadv(fd, [buf], off):
            h.update(buf[:n])
            off += n
    finally:
        os.close(fd)
        buf.close()
    return h.hexdigest()


def run_case(make_mount, mode: str, *, file_mib: int, pool_mib: int, ios: int,
             rw: str = "randwrite", engine: str = "psync", depth: int = 1, jobs: int = 1,
             direct: bool = True, in_backing: bool = True) -> dict:
    m = make_mount("--mode", mode, "--cache-size", f"{pool_mib}M",
                   "--dirty-high", f"{max(1, pool_mib // 4)}M",
                   "--dirty-low", f"{max(1, pool_mib // 8)}M")
    size = file_mib * MiB
    # Every block gets a fio header first: in BACKING behind the mount's back (the mount
    # has not seen the file yet), or laid out through the mount (sequential writes).
    layout = m.backing / "v.bin" if in_backing else m.path("v.bin")
    check(fio(layout, size, "write"), "laying out the file")
    out = fio(m.path("v.bin"), size, rw, engine=engine, depth=depth, jobs=jobs, ios=ios,
              direct=direct)
    check(out, "writing and verifying through the mount")
    stats = m.stats()
    seen = file_hash(m.path("v.bin"))
    if mode == "write-back":
        ctl_flush(m, 600)
    m.stop()
    assert file_hash(m.backing / "v.bin") == seen, "BACKING differs from what the mount served"
    check(fio(m.backing / "v.bin", size, "read"), "reading BACKING after flush and unmount")
    m.start()
    check(fio(m.path("v.bin"), size, "read", direct=True),
          "reading through the mount after a remount")
    assert file_hash(m.path("v.bin")) == seen
    return stats


def test_random_writes_through_a_quarter_size_pool(make_mount, mode):
    """The issue's case, shortened: 4 KiB random O_DIRECT writes over a file 4x the pool,
    verified as they go, then BACKING checked after flush. On the code before the fix,
    write-back lost blocks to the hole punch of evicted extents (zeros read back)."""
    stats = run_case(make_mount, mode, file_mib=64, pool_mib=16, ios=16000)
    assert stats["evictions"] > 1000, stats          # the pool really turned over


def test_random_mixes_of_jobs_through_a_small_pool(make_mount, mode):
    """4 jobs of random reads and writes with libaio at depth 16, the file laid out by fio
    through the mount."""
    run_case(make_mount, mode, file_mib=64, pool_mib=16, ios=16000, rw="randrw",
             engine="libaio", depth=16, jobs=4, in_backing=False)


LONG_CASES = [
    dict(pool_mib=pool, rw=rw, engine=engine, depth=depth, jobs=jobs, direct=direct,
         in_backing=in_backing)
    for pool in (64, 128)
    for rw, engine, depth, jobs, direct, in_backing in (
        ("randwrite", "psync", 1, 1, True, True),
        ("randwrite", "libaio", 16, 1, True, False),
        ("randrw", "psync", 1, 4, True, True),
        ("randrw", "libaio", 16, 4, True, False),
        ("randwrite", "psync", 1, 4, False, True),
        ("randrw", "psync", 1, 1, False, False),
    )
]


@pytest.mark.skipif(not env_long(), reason="long tier: CACHEFS_LONG=1")
@pytest.mark.parametrize("case", LONG_CASES, ids=lambda c: "-".join(
    f"{v}" for v in (f"pool{c['pool_mib']}M", c["rw"], c["engine"], f"qd{c['depth']}",
                     f"{c['jobs']}jobs", "direct" if c["direct"] else "buffered",
                     "inbacking" if c["in_backing"] else "laidout")))
def test_long_variations(make_mount, mode, case):
    """The issue's full set: a 256 MiB file, 40,000 ios, pool ¼ and ½ of it."""
    run_case(make_mount, mode, file_mib=256, ios=40000, **case)
