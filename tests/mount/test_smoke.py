import os

import pytest

from tests.mount.test_random_ops import flush

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
