"""xfstests' fsstress on a cachefs mount: random concurrent namespace and data operations
(creat, write, truncate, rename, link, unlink, mkdir, symlink, fsync, fdatasync, mmap reads
and writes, punch and zero ranges, copy_file_range, direct, AIO and io_uring I/O, setxattr)
through a tiny pool, in both modes, while `cachefs-ctl drop` and `flush` run every second.

fsstress checks no bytes itself: afterwards every file must read to its stat size, BACKING
(after `cachefs-ctl flush`) must equal what the mount showed (type, mode, size, link count,
bytes, symlink targets, xattrs), and so must a remount; no ERROR or traceback in the log
(every test mount runs with --check-invariants). Runs only where an fsstress binary is named
by CACHEFS_FSSTRESS (it is not downloaded); built from xfstests' ltp/fsstress.c with a
hand-written config.h (HAVE_COPY_FILE_RANGE, HAVE_RENAMEAT2, HAVE_LINUX_FALLOC_H, ...) and
-DAIO -DURING against libaio-dev, liburing-dev and xfslibs-dev:

    sudo CACHEFS_FSSTRESS=/opt/fsstress/fsstress pytest tests/mount/test_fsstress.py
"""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import threading

import pytest

from tests.conftest import CTL, flush_all

pytestmark = [pytest.mark.fuse, pytest.mark.slow]
OPS = int(os.environ.get("CACHEFS_FSSTRESS_OPS", "1000"))
# The ops cachefs answers EOPNOTSUPP/ENOTTY for (no ioctl handler; the kernel sends FUSE no
# collapse/insert/unshare ranges), or that only XFS and btrfs have.
UNSUPPORTED = ("collapse", "insert", "fiemap", "clonerange", "deduperange", "exchangerange",
               "unshare", "resvsp", "unresvsp", "getattr", "setattr")


def fsstress_binary() -> str:
    path = os.environ.get("CACHEFS_FSSTRESS")
    if not path:
        pytest.skip("set CACHEFS_FSSTRESS to an fsstress binary to run it")
    if not os.access(path, os.X_OK):
        pytest.skip(f"{path} is not an executable fsstress")
    return path


def tree(root: str) -> dict:
    """path -> what a program sees of it (a file also reads to its stat size)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            entry = [stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), st.st_nlink]
            if stat.S_ISREG(st.st_mode):
                with open(p, "rb") as f:
                    data = f.read()
                assert len(data) == st.st_size, p
                entry += [st.st_size, hashlib.md5(data).hexdigest()]
            elif stat.S_ISLNK(st.st_mode):
                entry.append(os.readlink(p))
            if not stat.S_ISLNK(st.st_mode):
                entry.append(sorted((n, os.getxattr(p, n)) for n in os.listxattr(p)
                                    if n.startswith("user.")))
            out[os.path.relpath(p, root)] = entry
    return out


@pytest.mark.parametrize("mode", ["write-through", "write-back"])
@pytest.mark.parametrize("seed", [31, 32])
def test_fsstress_through_a_tiny_pool(make_mount, mode, seed):
    fsstress = fsstress_binary()
    m = make_mount("--mode", mode, "--cache-size", "8M", "--dirty-high", "4M",
                   "--dirty-low", "2M", "--max-dirty-age", "2s")
    stop = threading.Event()

    def churn():
        while not stop.wait(1.0):
            for cmd in ("drop", "flush"):
                subprocess.run([*CTL, cmd, str(m.mnt)], capture_output=True, timeout=120)

    t = threading.Thread(target=churn)
    t.start()
    try:
        out = subprocess.run([fsstress, "-d", str(m.path("t")), "-n", str(OPS), "-p", "4",
                              "-s", str(seed),
                              *[a for op in UNSUPPORTED for a in ("-f", f"{op}=0")]],
                             capture_output=True, text=True, timeout=900)
    finally:
        stop.set()
        t.join()
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    stats = m.stats()
    for key in ("internal_errors", "destage_errors", "cache_errors"):
        assert not stats.get(key), (key, stats.get(key))
    shown = tree(str(m.mnt))
    assert len(shown) > 50
    flush_all(m)                        # every dirty byte in BACKING
    assert tree(str(m.backing)) == shown
    m.stop()
    m.start()
    assert tree(str(m.mnt)) == shown
