"""`--debug`: one DEBUG line per FUSE request in the daemon's log, with the request's
arguments, its result and its duration; none without --debug (real mounts, real log)."""

from __future__ import annotations

import os
import re

import pytest

pytestmark = pytest.mark.fuse


def exercise(m) -> None:
    fd = os.open(m.path("f"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        assert os.pwrite(fd, b"x" * 8192, 0) == 8192
        assert os.pread(fd, 4096, 4096) == b"x" * 4096
    finally:
        os.close(fd)
    os.stat(m.path("f"))
    (m.backing / "g").write_bytes(b"y" * 100)
    assert os.stat(m.path("g")).st_size == 100
    with pytest.raises(FileNotFoundError):
        os.stat(m.path("missing"))


def test_debug_traces_every_request_with_result_and_duration(make_mount):
    m = make_mount("--debug", "--attr-timeout", "0")
    exercise(m)
    m.stop()
    log = m.logs[-1].read_text()
    traces = re.findall(r"^.* DEBUG cachefs\.trace: trace (\w+) (.*) -> (.*) in (\d+) us$",
                        log, re.M)
    ops = {op for op, *_ in traces}
    assert {"create", "write", "read", "getattr", "lookup", "release"} <= ops, ops
    assert any(op == "write" and re.search(r"off=0\b.*buf=8192 B", a) and r == "8192 B"
               for op, a, r, _ in traces), traces
    assert any(op == "read" and re.search(r"off=4096 size=4096", a) and r == "4096 B"
               for op, a, r, _ in traces), traces
    assert any(op == "lookup" and "name='missing'" in a and r == "ENOENT"
               for op, a, r, _ in traces), traces
    assert any(op == "lookup" and "name='g'" in a and r.startswith("ino=")
               and r.endswith("size=100") for op, a, r, _ in traces), traces
    assert all(int(us) >= 0 for *_, us in traces)
    assert "unique:" not in log                 # libfuse's raw trace: only with -o debug


def test_no_trace_without_debug(make_mount):
    m = make_mount()
    exercise(m)
    m.stop()
    log = m.logs[-1].read_text()
    assert "cachefs.trace" not in log and " DEBUG " not in log, log[-2000:]


def test_libfuse_raw_trace_is_dash_o_debug(make_mount):
    m = make_mount("-o", "debug")
    os.stat(m.path())
    m.stop()
    log = m.logs[-1].read_text()
    assert "unique:" in log and "cachefs.trace" not in log, log[-2000:]
