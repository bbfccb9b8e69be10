"""fsx (the file system exerciser) on a cachefs mount, in both modes, through a tiny pool.

fsx runs random reads, writes, mmap reads and writes, truncates and close/open cycles on
one file and checks every byte it reads against its own model. Runs only where an fsx
binary is named by CACHEFS_FSX (it is not downloaded): the Apple/FreeBSD fsx.c (one file;
on 64-bit Linux its `check_eofpage` needs `unsigned long` for `last_page` and
`should_be_zero`) or xfstests' ltp/fsx; both take the flags used here.

    sudo CACHEFS_FSX=/usr/local/bin/fsx pytest tests/mount/test_fsx.py

A 1 MiB pool (16 extents) under 8 MB files and 300 KB operations keeps evicting, filling
partial blocks and, in write-back, destaging while writes wait for room.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.conftest import flush_all

pytestmark = [pytest.mark.fuse, pytest.mark.slow]
OPS = int(os.environ.get("CACHEFS_FSX_OPS", "3000"))


def fsx_binary() -> str:
    path = os.environ.get("CACHEFS_FSX")
    if not path:
        pytest.skip("set CACHEFS_FSX to an fsx binary to run it")
    if not os.access(path, os.X_OK):
        pytest.skip(f"{path} is not an executable fsx")
    return path


def run_fsx(fsx: str, cwd: str, name: str, seed: int, *flags: str) -> None:
    out = subprocess.run([fsx, "-q", "-N", str(OPS), "-S", str(seed), "-l", "8000000",
                          "-o", "300000", *flags, name],
                         cwd=cwd, capture_output=True, text=True, timeout=900)
    text = out.stdout + out.stderr
    # what went wrong comes first, then fsx's log of the operations before it
    assert out.returncode == 0, text[:3000] + "\n...\n" + text[-3000:]
    # Apple's fsx says "All operations completed A-OK!", xfstests' "All 3000 operations ..."
    assert re.search(r"All (\d+ )?operations completed A-OK!", out.stdout), text[-3000:]


@pytest.mark.parametrize("mode", ["write-through", "write-back"])
@pytest.mark.parametrize("seed", [11, 12])
def test_fsx_through_a_tiny_pool(make_mount, mode, seed):
    fsx = fsx_binary()
    m = make_mount("--mode", mode, "--cache-size", "1M", "--promote-after", "1")
    name = f"fsx{seed}"
    run_fsx(fsx, m.mnt, name, seed, "-c", "20")
    flush_all(m)
    view = Path(m.path(name)).read_bytes()
    assert (m.backing / name).read_bytes() == view      # BACKING holds what the mount shows


@pytest.mark.parametrize("mode", ["write-through", "write-back"])
def test_fsx_with_direct_io_through_a_tiny_pool(make_mount, mode):
    """O_DIRECT reads, writes and truncates on 4 KiB boundaries (xfstests' fsx only: -Z)."""
    fsx = fsx_binary()
    usage = subprocess.run([fsx, "-h"], capture_output=True, text=True)
    usage = usage.stdout + usage.stderr
    if "-Z" not in usage:
        pytest.skip(f"{fsx} has no O_DIRECT mode (-Z)")
    m = make_mount("--mode", mode, "--cache-size", "1M", "--promote-after", "1")
    run_fsx(fsx, m.mnt, "fsxd", 13, "-Z", "-R", "-W", "-r", "4096", "-w", "4096",
            "-t", "4096")
    flush_all(m)
    view = Path(m.path("fsxd")).read_bytes()
    assert (m.backing / "fsxd").read_bytes() == view


@pytest.mark.parametrize("mode", ["write-through", "write-back"])
def test_fsx_with_direct_io_and_mappings_through_a_tiny_pool(make_mount, mode):
    """O_DIRECT I/O and shared mappings of the same O_DIRECT open (xfstests generic/091 and
    263 run fsx -Z with mapped reads and writes; the kernel refused those mappings with
    ENODEV before the mount asked for FUSE_CAP_DIRECT_IO_ALLOW_MMAP)."""
    fsx = fsx_binary()
    usage = subprocess.run([fsx, "-h"], capture_output=True, text=True)
    if "-Z" not in usage.stdout + usage.stderr:
        pytest.skip(f"{fsx} has no O_DIRECT mode (-Z)")
    m = make_mount("--mode", mode, "--cache-size", "1M", "--promote-after", "1")
    if not m.stats().get("direct_io_mmap_on"):
        pytest.skip("FUSE_CAP_DIRECT_IO_ALLOW_MMAP is not in effect (tests/mount/test_posix.py "
                    "test_a_shared_mapping_of_an_o_direct_open says why)")
    run_fsx(fsx, m.mnt, "fsxdm", 14, "-Z", "-r", "4096", "-w", "4096", "-t", "4096")
    flush_all(m)
    view = Path(m.path("fsxdm")).read_bytes()
    assert (m.backing / "fsxdm").read_bytes() == view
