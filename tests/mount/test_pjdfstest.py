"""pjdfstest (POSIX conformance of file system calls) on a cachefs mount, in both modes.

Runs only where pjdfstest is built and named by CACHEFS_PJDFSTEST (it is not downloaded):

    git clone https://github.com/pjd/pjdfstest /opt/pjdfstest
    cd /opt/pjdfstest && autoreconf -ifs && ./configure && make   # autoconf automake libacl1-dev
    sudo CACHEFS_PJDFSTEST=/opt/pjdfstest pytest tests/mount/test_pjdfstest.py

It must run as root (pjdfstest changes owners; cachefs mounts with allow_other and
default_permissions as root) and takes several minutes per mode. On a plain directory every
one of its tests passes; on cachefs they must too (docs/operations.md).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = [pytest.mark.fuse, pytest.mark.slow]


def pjdfstest_dir() -> Path:
    top = os.environ.get("CACHEFS_PJDFSTEST")
    if not top:
        pytest.skip("set CACHEFS_PJDFSTEST to a built pjdfstest checkout to run it")
    top = Path(top)
    if not (top / "pjdfstest").is_file() or not (top / "tests").is_dir():
        pytest.skip(f"{top} has no built pjdfstest binary (autoreconf -ifs && ./configure "
                    "&& make)")
    if os.geteuid() != 0:
        pytest.skip("pjdfstest must run as root")
    if shutil.which("prove") is None:
        pytest.skip("prove (perl) is not installed")
    return top


def test_pjdfstest_passes(make_mount, mode):
    top = pjdfstest_dir()
    m = make_mount("--mode", mode)
    res = subprocess.run(["prove", "-r", str(top / "tests")], cwd=m.mnt, capture_output=True,
                         text=True, timeout=3 * 3600)
    failed = [line for line in res.stdout.splitlines()
              if "Failed" in line or "Wstat" in line or "not ok" in line]
    assert res.returncode == 0 and "Result: PASS" in res.stdout, \
        "\n".join(failed[:60]) + "\n" + res.stdout[-3000:]
