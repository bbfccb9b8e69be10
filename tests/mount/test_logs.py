"""The daemon's log says what an operator needs at mount and unmount: the mode and the sizes
at mount, what was done and what stays dirty at unmount (real mount, real log)."""

from __future__ import annotations

import os
import re

import pytest

pytestmark = pytest.mark.fuse


def test_mount_and_unmount_lines(make_mount):
    m = make_mount("--mode", "write-back", "--cache-size", "64M", "--max-dirty-age", "3600")
    m.path("f").write_bytes(os.urandom(1 << 20))
    m.stop()
    log = m.logs[-1].read_text()
    assert re.search(rf"INFO cachefs: mounted {m.backing} on {m.mnt} \(write-back\): cache "
                     rf"64\.0 MiB in {m.cache}, 0 B in 0 extents warm; dirty high 16\.0 MiB, "
                     r"low 8\.0 MiB, 0 B dirty now\n", log), log
    assert re.search(rf"INFO cachefs: unmounted {m.mnt} \(write-back\) after \d+ s: \d+ reads "
                     r".*, \d+ writes \(1\.0 MiB\); cache 1\.0 MiB of 64\.0 MiB; 1\.0 MiB dirty "
                     r"kept on the SSD, destaged after the next mount; metadata persisted\n",
                     log), log

    m.start()                                   # the next mount says what it found
    m.stop()
    log = m.logs[-1].read_text()
    assert "1.0 MiB in 16 extents warm; dirty high 16.0 MiB, low 8.0 MiB, 1.0 MiB dirty " \
           "now" in log, log
