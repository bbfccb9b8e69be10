"""`cachefs-ctl top`: the live view on a pseudo-terminal (a screen redrawn in place, with
every label and the numbers of a real mount under load) and plain lines under a pipe."""

from __future__ import annotations

import errno
import fcntl
import os
import pty
import re
import struct
import subprocess
import termios
import threading

import pytest

from cachefs_cli import top

from ..conftest import CTL, pread_aligned

# These count the reads the daemon answers: FUSE passthrough reads never reach it.
pytestmark = [pytest.mark.fuse, pytest.mark.no_passthrough]

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
LABELS = ("reads", "writes", "hit ratio", "occupancy", "dirty", "destage", "flow control",
          "drops", "errors", "last error")


def reader(path, stop: threading.Event) -> None:
    """Read a cached file with O_DIRECT (past the page cache) until told to stop."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        while not stop.is_set():
            for off in range(0, 1 << 20, 64 << 10):
                pread_aligned(fd, 64 << 10, off)
    finally:
        os.close(fd)


@pytest.fixture
def busy_mount(make_mount):
    """A write-back mount holding 1 MiB of dirty data, read in a loop while the test runs."""
    m = make_mount("--mode", "write-back", "--cache-size", "64M", "--max-dirty-age", "3600")
    m.path("f").write_bytes(os.urandom(1 << 20))
    stop = threading.Event()
    t = threading.Thread(target=reader, args=(m.path("f"), stop), daemon=True)
    t.start()
    try:
        yield m
    finally:
        stop.set()
        t.join(timeout=30)


def run_on_pty(args: list[str], cols: int = 160, rows: int = 40) -> str:
    """Run a command with a pseudo-terminal as stdin/stdout/stderr; returns all it drew."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env["TERM"] = "xterm-256color"
    proc = subprocess.Popen(args, stdin=slave, stdout=slave, stderr=slave, env=env,
                            start_new_session=True)
    os.close(slave)
    chunks = []
    try:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError as exc:            # EIO: the other side is closed
                if exc.errno != errno.EIO:
                    raise
                break
            if not data:
                break
            chunks.append(data)
        assert proc.wait(timeout=60) == 0, b"".join(chunks).decode(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    return b"".join(chunks).decode(errors="replace")


def test_top_on_a_terminal(busy_mount):
    m = busy_mount
    raw = run_on_pty([*CTL, "top", str(m.mnt), "--interval", "0.5", "--count", "3"])
    assert "\x1b[" in raw                                   # drawn, not printed plainly
    text = ANSI.sub("", raw).replace("\r", "")
    screens = text.split("cachefs top: ")
    assert len(screens) >= 4, text          # three screens (rich draws the last again)
    last = screens[-1]
    flat = re.sub(r"\s+", " ", last)                       # long paths wrap the title
    assert flat.startswith(f"{m.mnt} <- {m.backing} (write-back), every 0.5 s, up "), last
    for label in LABELS:
        assert re.search(rf"^ ?{label}\s", last, re.M), (label, last)
    assert "(measuring...)" in screens[1] and "(measuring...)" not in last
    reads = re.search(r"^ ?reads\s+(\d+) IOPS, ([\d.]+) (B|KiB|MiB|GiB)/s", last, re.M)
    assert reads and int(reads.group(1)) > 0, last          # the reader thread, per second
    assert re.search(r"^ ?occupancy\s+1\.0 MiB of 64\.0 MiB \(1\.6 %\)", last, re.M), last
    assert re.search(r"^ ?dirty\s+1\.0 MiB in 16 extents", last, re.M), last
    assert re.search(r"^ ?flow control\s+off; 0 writes delayed", last, re.M), last
    assert re.search(r"^ ?drops\s+coherence 0, recovery 0, capacity 0, operator 0, "
                     r"cache error 0", last, re.M), last
    assert re.search(r"^ ?BACKING health\s+ok\s*$", last, re.M), last
    assert re.search(r"^ ?errors\s+BACKING 0, cache 0, destage 0, metadata 0", last, re.M)
    assert re.search(r"^ ?last error\s+none", last, re.M), last


def test_top_plain_lines_under_a_pipe(busy_mount):
    m = busy_mount
    res = subprocess.run([*CTL, "top", str(m.mnt), "--interval", "0.3", "--count", "3"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert len(lines) == 2, res.stdout                      # rates need two polls
    for ln in lines:
        assert "\x1b" not in ln
        assert re.match(r"\d\d:\d\d:\d\d \| read \d+ IOPS [\d.]+ (B|KiB|MiB|GiB)/s \| write 0 IOPS "
                        r"0 B/s \| hit [\d.]+ % \| hit since mount [\d.]+ % \| used 1\.0 MiB "
                        r"of 64\.0 MiB \(1\.6 %\) \| dirty 1\.0 MiB \| destage .* \| throttle "
                        r"off \| BACKING ok \| passthrough off \| drops 0 \| errors BACKING 0 "
                        r"cache 0 destage 0 metadata 0$",
                        ln), ln
    assert any(int(re.search(r"read (\d+) IOPS", ln).group(1)) > 0 for ln in lines)


@pytest.mark.parametrize("args, sentence", [
    (["--interval", "0"], "--interval needs a positive number of seconds."),
    (["--count", "0"], "--count needs a positive number of screens."),
])
def test_top_mistakes(tmp_path, args, sentence):
    res = subprocess.run([*CTL, "top", str(tmp_path), *args], capture_output=True, text=True)
    assert res.returncode == 2 and res.stderr == f"cachefs-ctl: {sentence}\n"
    res = subprocess.run([*CTL, "top", str(tmp_path)], capture_output=True, text=True)
    assert res.returncode == 2 and res.stderr == f"cachefs-ctl: {tmp_path} is not a cachefs " \
        "mount.\n"


def test_rates_from_two_polls():
    prev = {"read_ops": 100, "read_bytes": 1 << 20, "hit_ops": 50, "write_ops": 0,
            "drops": {"coherence": 1}, "backing_errors": 2}
    cur = {"read_ops": 300, "read_bytes": 5 << 20, "hit_ops": 200, "write_ops": 10,
           "drops": {"coherence": 4}, "backing_errors": 1}          # a restart: no negatives
    r = top.rates(prev, cur, 2.0)
    assert r["read_iops"] == 100 and r["read_bps"] == 2 << 20 and r["write_iops"] == 5
    assert r["hit_ratio"] == 0.75
    assert r["drops"]["coherence"] == 3 and r["errors"]["backing_errors"] == 0
