import os

import pytest

from tests.conftest import flush_all as flush

pytestmark = pytest.mark.fuse


def test_read_back_bytes(mounted, mode):
    data = os.urandom(300_000)
    (mounted.backing / "f").write_bytes(data)
    assert mounted.path("f").read_bytes() == data
    mounted.path("g").write_bytes(data[:1000])
    assert mounted.path("g").read_bytes() == data[:1000]
    if mode == "write-back":
        assert (mounted.backing / "g").stat().st_size == 0       # not destaged yet
        flush(mounted)
    assert (mounted.backing / "g").read_bytes() == data[:1000]


def test_kernel_may_keep_more_requests_in_flight(mounted):
    """As root the mount raises FUSE's max_background (12 by default): hits are then not
    queued behind slow BACKING writes (see docs/benchmarks.md)."""
    if os.geteuid() != 0:
        pytest.skip("needs root")
    real = os.path.realpath(mounted.mnt)
    with open("/proc/self/mountinfo", errors="surrogateescape") as f:
        dev = next(line.split()[2].split(":")[1] for line in f if line.split()[4] == real)
    with open(f"/sys/fs/fuse/connections/{dev}/max_background") as f:
        assert int(f.read()) == 64


def test_ctl_stats_json_is_what_the_tests_read(mounted):
    """`cachefs-ctl stats --json` prints the daemon's stats as they are (the tests ask the
    control socket in-process, conftest.Mount.stats)."""
    import json
    import subprocess

    from tests.conftest import CTL
    out = subprocess.run([*CTL, "stats", str(mounted.mnt), "--json"], capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    printed = json.loads(out.stdout)
    asked = mounted.stats()
    assert set(printed) == set(asked)
    assert printed["mode"] == asked["mode"] and printed["cache_size"] == asked["cache_size"]
