"""A seeded random mix of reads, writes, truncates, renames, unlinks and reopenings over a
few files, checked against an in-memory model, with a small cache so promotion, eviction and
in-place updates all happen, and remounts in the middle."""

import os
import random

import subprocess

import pytest

from tests.conftest import CTL

pytestmark = pytest.mark.fuse

NAMES = [f"file{i}" for i in range(6)]
MAX_SIZE = 600 * 1024


def flush(m):
    out = subprocess.run([*CTL, "flush", str(m.mnt), "--json", "--timeout", "60"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert m.stats()["dirty_bytes"] == 0


class Model:
    def __init__(self, m, rng):
        self.m = m
        self.rng = rng
        self.files: dict[str, bytearray] = {}
        self.fds: dict[str, int] = {}
        self.trace: list[tuple] = []          # the recent operations, shown on a failure

    def fd(self, name):
        if name not in self.fds:
            flags = os.O_RDWR | (os.O_DIRECT if self.rng.random() < 0.7 else 0)
            self.fds[name] = os.open(self.m.path(name), flags)
        return self.fds[name]

    def close(self, name):
        fd = self.fds.pop(name, None)
        if fd is not None:
            os.close(fd)

    def close_all(self):
        for name in list(self.fds):
            self.close(name)

    def step(self):
        rng = self.rng
        existing = sorted(self.files)
        op = rng.choices(["create", "read", "read", "read", "write", "write", "truncate",
                          "rename", "unlink", "reopen"], k=1)[0]
        if op == "create" or not existing:
            name = rng.choice(NAMES)
            self.trace.append(("create", name))
            self.close(name)
            data = os.urandom(rng.randrange(0, MAX_SIZE))
            with open(self.m.path(name), "wb") as f:
                f.write(data)
            self.files[name] = bytearray(data)
            return
        name = rng.choice(existing)
        model = self.files[name]
        if op == "read":
            size = rng.choice([1, 512, 4096, 4096, 8192, 65536, 131072, rng.randrange(1, 200000)])
            off = rng.randrange(0, len(model) + 4096)
            if rng.random() < 0.5:
                off &= ~4095
            got = os.pread(self.fd(name), size, off)
            want = bytes(model[off:off + size])
            if got != want:
                bad = next(i for i in range(min(len(got), len(want)) + 1)
                           if i >= min(len(got), len(want)) or got[i] != want[i])
                raise AssertionError(f"read {name} [{off}, +{size}) of {len(model)}: got "
                                     f"{len(got)} bytes, first difference at {off + bad}; "
                                     f"recent operations: {self.trace[-25:]}")
        elif op == "write":
            size = rng.choice([1, 100, 4096, 4096, 10000, 65536, rng.randrange(1, 150000)])
            off = rng.randrange(0, min(len(model) + 8192, MAX_SIZE))
            if rng.random() < 0.5:
                off &= ~4095
            data = os.urandom(size)
            self.trace.append(("write", name, off, size))
            assert os.pwrite(self.fd(name), data, off) == size
            if off > len(model):
                model.extend(bytes(off - len(model)))
            model[off:off + size] = data
        elif op == "truncate":
            size = rng.randrange(0, MAX_SIZE)
            self.trace.append(("truncate", name, size))
            os.truncate(self.m.path(name), size)
            if size < len(model):
                del model[size:]
            else:
                model.extend(bytes(size - len(model)))
        elif op == "rename":
            new = rng.choice(NAMES)
            if new == name:
                return
            self.close(name)
            self.close(new)
            self.trace.append(("rename", name, new))
            os.rename(self.m.path(name), self.m.path(new))
            self.files[new] = self.files.pop(name)
        elif op == "unlink":
            self.close(name)
            self.trace.append(("unlink", name))
            os.unlink(self.m.path(name))
            del self.files[name]
        else:
            self.close(name)

    def check_all(self, root):
        assert sorted(p for p in os.listdir(root)) == sorted(self.files)
        for name, data in self.files.items():
            with open(os.path.join(root, name), "rb") as f:
                assert f.read() == bytes(data), name


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_operations_match_model(make_mount, mode, seed):
    m = make_mount("--mode", mode, "--cache-size", "1M", "--promote-after", "1",
                   "--sequential-cutoff", "512K", "--dirty-high", "256K", "--dirty-low", "128K",
                   "--max-dirty-age", "1")
    rng = random.Random(seed)
    model = Model(m, rng)
    totals = {"hit_ops": 0, "promotions": 0, "destaged_bytes": 0, "throttled_writes": 0}

    def add_stats():
        s = m.stats()
        for k in totals:
            totals[k] += s[k]

    for i in range(1500):
        model.step()
        if i % 500 == 499:
            model.close_all()
            model.check_all(m.mnt)
            add_stats()
            m.restart()
    model.close_all()
    model.check_all(m.mnt)
    add_stats()
    assert totals["hit_ops"] and totals["promotions"], totals   # the cache took part
    if mode == "write-back":
        assert totals["destaged_bytes"] and totals["throttled_writes"], totals
        flush(m)
    m.stop()
    model.check_all(m.backing)
