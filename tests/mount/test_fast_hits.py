"""Fast hits (cachefs/_hit.c through pyfuse3's read hook): on by default where pyfuse3 has the
hook, off with --no-fast-hits; hits it answers are the same bytes and are counted like the
Python handler's (hits, bytes, the latency histogram). Damaged blocks under it:
test_integrity.py (its 4 KiB reads go through the hook first)."""

import os

import pyfuse3
import pytest

from tests.conftest import read_blocks, warm

pytestmark = [pytest.mark.fuse, pytest.mark.no_passthrough]

SIZE = 1 << 20
HOOK = hasattr(pyfuse3, "set_read_hook")


@pytest.mark.parametrize("fast", [True, False], ids=["fast-hits", "no-fast-hits"])
def test_hits_are_the_same_and_counted_the_same_with_and_without_fast_hits(make_mount, mode,
                                                                           fast):
    m = make_mount("--mode", mode, "--promote-after", "1", *([] if fast else ["--no-fast-hits"]))
    data = os.urandom(SIZE)
    (m.backing / "f").write_bytes(data)
    warm(m, "f", SIZE)
    s = m.stats()
    assert s["fast_hits"] == ("on" if fast and HOOK else "off")
    offsets = [off * 4096 for off in range(SIZE // 4096)][::-1]     # 256 single-block reads
    before = m.stats()
    got = read_blocks(m.path("f"), offsets)
    assert all(got[off] == data[off:off + 4096] for off in offsets)
    after = m.stats()
    assert after["hit_ops"] - before["hit_ops"] == len(offsets)
    assert after["read_ops"] - before["read_ops"] == len(offsets)
    assert after["hit_bytes"] - before["hit_bytes"] == len(offsets) * 4096
    assert after["latency"]["ssd_hit"]["count"] - before["latency"]["ssd_hit"]["count"] \
        == len(offsets)
    assert after["backing_read_bytes"] == before["backing_read_bytes"]
    log = m.logs[-1].read_text()
    assert ("fast hits: on" in log) == (fast and HOOK)
