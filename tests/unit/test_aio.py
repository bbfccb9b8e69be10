"""Linux AIO writes (cachefs/aio.py): aligned writes go through io_submit on an O_DIRECT fd,
the rest through pwrite; the bytes land either way."""

import os
import random

import pytest

from cachefs import aio


@pytest.mark.parametrize("use_direct", [True, False])
def test_pwrite_all_writes_every_byte(tmp_path, use_direct):
    path = tmp_path / "f"
    path.write_bytes(bytes(1 << 20))
    fd = os.open(path, os.O_RDWR)
    direct = aio.open_direct(fd) if use_direct else -1
    if use_direct and direct < 0:
        pytest.skip("no O_DIRECT on this filesystem")
    rng = random.Random(3)
    model = bytearray(1 << 20)
    items = []
    for _ in range(60):                      # aligned and unaligned, more than MAX_INFLIGHT
        if rng.random() < 0.7:
            off, size = rng.randrange(0, 200) * 4096, rng.choice([4096, 8192, 65536])
        else:
            off, size = rng.randrange(0, 900_000), rng.randrange(1, 5000)
        data = os.urandom(size)
        items.append((data, off))
        model[off:off + size] = data
    # no two items overlap in time order issues: apply them in order, as pwrite_all may not
    for data, off in items:
        aio.pwrite_all(fd, direct, [(data, off)])
    assert path.read_bytes()[:len(model)] == bytes(model)
    # a batch of non-overlapping aligned writes submitted together
    batch = [(os.urandom(4096), i * 8192) for i in range(40)]
    aio.pwrite_all(fd, direct, batch)
    got = path.read_bytes()
    assert all(got[o:o + 4096] == d for d, o in batch)
    os.close(fd)
    if direct >= 0:
        os.close(direct)
