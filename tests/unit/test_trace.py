"""The --debug request trace (cachefs/trace.py): the duration it logs is the handler's."""

from __future__ import annotations

import logging
import re
import time

from cachefs import trace


class SlowToFormat:
    """A result whose formatting for the trace line takes 30 ms."""

    st_size = 0

    @property
    def st_ino(self) -> int:
        time.sleep(0.03)
        return 7


class Ops:
    async def getattr(self, inode, ctx=None):
        return SlowToFormat()


async def test_the_logged_duration_leaves_out_formatting_the_line(caplog):
    ops = Ops()
    trace.wrap(ops)
    with caplog.at_level(logging.DEBUG, logger="cachefs.trace"):
        await ops.getattr(5)
    line = next(r.getMessage() for r in caplog.records if "trace getattr" in r.getMessage())
    assert "ino=7" in line
    assert int(re.search(r"in (\d+) us", line).group(1)) < 20_000, line
