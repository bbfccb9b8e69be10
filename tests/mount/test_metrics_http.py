"""The `--metrics ADDR` endpoint on real mounts: the same families and label sets as
`cachefs-ctl metrics`, distinct `mount` labels for two mounts, answers while the mount is
busy, gone after the unmount, and bad addresses refused with one sentence (exit 2)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import CTL, ctl_flush, force_unmount, is_mounted, read_blocks, wait_until
from tests.mount.test_errors import BOTH, assert_sentence, env  # noqa: F401 (fixture)

pytestmark = pytest.mark.fuse

HELPER = [sys.executable, "-m", "cachefs_cli.mount_helper"]
SIZE = 1 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int, path: str = "/metrics") -> tuple[str, str]:
    """(Content-Type, body) of one GET."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
        return r.headers["Content-Type"], r.read().decode()


def ctl_metrics(m) -> str:
    out = subprocess.run([*CTL, "metrics", str(m.mnt)], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout


def samples(text: str) -> dict[str, dict[tuple, float]]:
    """family name (type) -> {(sample name, sorted labels): value}."""
    return {f"{f.name} ({f.type})": {(s.name, tuple(sorted(s.labels.items()))): s.value
                                     for s in f.samples}
            for f in text_string_to_metric_families(text)}


@pytest.mark.no_passthrough     # counts the hits the daemon answers
def test_http_scrape_and_ctl_metrics_are_the_same_text(make_mount, mode):
    port = free_port()
    m = make_mount("--mode", mode, "--promote-after", "1", "--metrics", str(port))
    data = os.urandom(SIZE)
    with open(m.path("f"), "wb") as f:
        f.write(data)
    ctl_flush(m)
    assert b"".join(read_blocks(m.path("f"), range(0, SIZE, 65536), 65536).values()) == data
    wait_until(lambda: m.stats()["extents_cached"] >= SIZE // 65536, 20, m.proc, "promotion")
    ctype, text = scrape(port)
    assert ctype == "text/plain; version=0.0.4; charset=utf-8"
    http, ctl = samples(text), samples(ctl_metrics(m))
    assert http.keys() == ctl.keys()
    for fam in http:
        assert http[fam].keys() == ctl[fam].keys(), fam
        if "(gauge)" not in fam:         # no I/O runs: counters and histograms stand still
            assert http[fam] == ctl[fam], fam
    labels = {"mount": str(m.mnt), "backing": str(m.backing)}
    assert {dict(lab)["mount"] for fam in http.values() for _, lab in fam} == {labels["mount"]}
    assert sum(http["cachefs_read_ops (counter)"].values()) == m.stats()["read_ops"] > 0
    assert scrape(port, "/")[1].startswith("# HELP cachefs_")
    with pytest.raises(urllib.error.HTTPError) as exc:
        scrape(port, "/other")
    assert exc.value.code == 404
    m.stop()
    with pytest.raises(ConnectionRefusedError):           # the endpoint went with the mount
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_two_mounts_expose_distinct_mount_labels(make_mount):
    ports = free_port(), free_port()
    mounts = [make_mount("--metrics", f"127.0.0.1:{port}", name=name)
              for port, name in zip(ports, "ab")]
    seen = []
    for port in ports:
        fams = text_string_to_metric_families(scrape(port)[1])
        seen.append({(s.labels["mount"], s.labels["backing"]) for f in fams for s in f.samples})
    assert seen == [{(str(m.mnt), str(m.backing))} for m in mounts]


def test_the_endpoint_answers_while_the_mount_is_busy(make_mount):
    port = free_port()
    m = make_mount("--mode", "write-back", "--metrics", str(port))
    (m.backing / "r").write_bytes(os.urandom(8 * SIZE))
    stop = threading.Event()
    errors: list[BaseException] = []

    def busy() -> None:           # O_DIRECT reads and writes, without pause
        try:
            fd = os.open(m.path("w"), os.O_RDWR | os.O_CREAT, 0o644)
            try:
                i = 0
                while not stop.is_set():
                    read_blocks(m.path("r"), [(i * 4096) % (8 * SIZE)])
                    os.pwrite(fd, os.urandom(4096), (i * 4096) % SIZE)
                    i += 1
            finally:
                os.close(fd)
        except BaseException as exc:
            errors.append(exc)

    workers = [threading.Thread(target=busy) for _ in range(2)]
    for w in workers:
        w.start()
    silent = socket.create_connection(("127.0.0.1", port))   # holds nothing
    try:
        reads = []
        for _ in range(5):
            wait_until(lambda: not reads or _reads(scrape(port)[1]) > reads[-1], 20, m.proc,
                       "the read counter to move in a scrape")
            reads.append(_reads(scrape(port)[1]))
        assert reads == sorted(reads)
    finally:
        silent.close()
        stop.set()
        for w in workers:
            w.join()
    assert not errors, errors


def _reads(text: str) -> float:
    return sum(s.value for f in text_string_to_metric_families(text)
               if f.name == "cachefs_read_ops" for s in f.samples)


def test_fstab_metrics_option(tmp_path):
    backing, cache, mnt = tmp_path / "b", tmp_path / "c", tmp_path / "m"
    for d in (backing, mnt):
        d.mkdir()
    port = free_port()
    try:
        out = subprocess.run([*HELPER, str(backing), str(mnt), "-o",
                              f"cache_dir={cache},metrics={port},_netdev"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert is_mounted(mnt)
        assert f"metrics on http://127.0.0.1:{port}/metrics" in (
            cache / "cachefs.log").read_text()
        fams = text_string_to_metric_families(scrape(port)[1])
        assert {s.labels["mount"] for f in fams for s in f.samples} == {str(mnt)}
    finally:
        force_unmount(mnt)


@BOTH
@pytest.mark.parametrize("addr,needle", [
    ("99999", "--metrics '99999': the port must be a number from 1 to 65535."),
    ("nohost.invalid:9533", "--metrics nohost.invalid:9533: cannot resolve 'nohost.invalid'"),
    ("in-use", "the port is in use"),
])
def test_bad_metrics_address_is_a_sentence(env, fg, addr, needle):  # noqa: F811
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        if addr == "in-use":
            addr = str(taken.getsockname()[1])
        res = env.mount("--metrics", addr, fg=fg)
        assert res.returncode == 2, res.stderr
        assert_sentence(res, needle, fg=fg)
        env.assert_nothing_left()
    finally:
        taken.close()
