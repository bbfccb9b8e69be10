import os

import pytest

pytestmark = pytest.mark.fuse


def test_read_back_bytes(mounted):
    data = os.urandom(300_000)
    (mounted.backing / "f").write_bytes(data)
    assert mounted.path("f").read_bytes() == data
    mounted.path("g").write_bytes(data[:1000])
    assert (mounted.backing / "g").read_bytes() == data[:1000]
