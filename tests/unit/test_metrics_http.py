"""The Prometheus endpoint's HTTP responder (cachefs/metrics.py) without FUSE: answers on a
real loopback socket, and the limits (a silent or slow client, a flood of connections) on
memory streams with trio's autojump clock."""

from __future__ import annotations

import socket

import pytest
import trio
import trio.testing
from prometheus_client.parser import text_string_to_metric_families

from cachefs import metrics
from cachefs.config import parse_address
from cachefs.errors import UserError
from cachefs.stats import Stats

SNAPSHOT = {"mountpoint": "/mnt/a", "backing": "/srv/a", "cache_used": 4096, "dirty_bytes": 0,
            **Stats().snapshot()}


async def _exchange(port: int, request: bytes) -> tuple[bytes, dict[str, str], bytes]:
    """Send `request`, read until the server closes: (status line, headers, body)."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(request)
        data = b""
        with trio.fail_after(10):
            while chunk := await stream.receive_some(65536):
                data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status, *lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines)}
    return status.encode(), headers, body


@pytest.fixture
async def server(nursery):
    sock = metrics.bind(("127.0.0.1", 0))
    srv = metrics.MetricsServer(sock, lambda: SNAPSHOT)
    await nursery.start(srv.run)
    return sock.getsockname()[1]


async def test_get_metrics_is_the_exposition_of_the_snapshot(server):
    want = metrics.exposition(SNAPSHOT)
    for target in (b"/metrics", b"/", b"/metrics?name[]=x"):
        for version in (b"HTTP/1.1", b"HTTP/1.0"):
            status, headers, body = await _exchange(
                server, b"GET " + target + b" " + version + b"\r\nHost: x\r\n"
                b"Accept: text/plain\r\n\r\n")
            assert status == b"HTTP/1.1 200 OK"
            assert headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
            assert headers["connection"] == "close"
            assert int(headers["content-length"]) == len(body)
            assert body == want
    fams = {f.name for f in text_string_to_metric_families(want.decode())}
    assert {"cachefs_read_ops", "cachefs_cache_used_bytes", "cachefs_latency_seconds"} <= fams
    status, headers, body = await _exchange(server, b"HEAD /metrics HTTP/1.1\r\n\r\n")
    assert status == b"HTTP/1.1 200 OK" and body == b""
    assert int(headers["content-length"]) == len(want)


async def test_other_paths_methods_and_garbage(server):
    status, _, body = await _exchange(server, b"GET /nope HTTP/1.1\r\n\r\n")
    assert status == b"HTTP/1.1 404 Not Found" and body == b"404 Not Found\n"
    status, headers, _ = await _exchange(
        server, b"POST /metrics HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello")
    assert status == b"HTTP/1.1 405 Method Not Allowed" and headers["allow"] == "GET, HEAD"
    status, _, _ = await _exchange(server, b"hello there\n\n")
    assert status == b"HTTP/1.1 400 Bad Request"
    status, _, _ = await _exchange(server, b"GET /metrics HTTP/1.1\r\nX: " + b"y" * 20000)
    assert status == b"HTTP/1.1 431 Request Header Fields Too Large"
    status, _, _ = await _exchange(server, b"GET /metrics HTTP/1.1\n\n")   # bare newlines
    assert status == b"HTTP/1.1 200 OK"


async def test_a_silent_client_does_not_hold_the_endpoint(server):
    silent = await trio.open_tcp_stream("127.0.0.1", server)
    async with silent:
        await silent.send_all(b"GET /metr")                  # and nothing more
        status, _, _ = await _exchange(server, b"GET /metrics HTTP/1.1\r\n\r\n")
        assert status == b"HTTP/1.1 200 OK"


def _server(max_clients: int = metrics.MAX_CLIENTS) -> metrics.MetricsServer:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return metrics.MetricsServer(sock, lambda: SNAPSHOT, max_clients=max_clients)


async def test_silent_and_slow_clients_are_closed_after_the_timeout(autojump_clock, nursery):
    srv = _server()
    silent, silent_end = trio.testing.memory_stream_pair()
    slow, slow_end = trio.testing.memory_stream_pair()
    nursery.start_soon(srv.serve_client, silent_end)
    nursery.start_soon(srv.serve_client, slow_end)

    async def drip():                     # one byte a second, never a whole request
        for byte in b"GET /metrics HTTP/1.1\r\nX: " + b"y" * 100:
            try:
                await slow.send_all(bytes([byte]))
            except trio.BrokenResourceError:
                return
            await trio.sleep(1)

    nursery.start_soon(drip)
    start = trio.current_time()
    assert await silent.receive_some() == b""             # closed, unanswered
    assert await slow.receive_some() == b""
    assert trio.current_time() - start == pytest.approx(metrics.HEAD_TIMEOUT_S)


async def test_connections_beyond_the_limit_are_closed_at_once(autojump_clock, nursery):
    srv = _server(max_clients=2)
    held = []
    for _ in range(2):
        client, end = trio.testing.memory_stream_pair()
        nursery.start_soon(srv.serve_client, end)
        held.append(client)
    await trio.testing.wait_all_tasks_blocked()
    client, end = trio.testing.memory_stream_pair()
    nursery.start_soon(srv.serve_client, end)
    start = trio.current_time()
    assert await client.receive_some() == b""
    assert trio.current_time() == start


@pytest.mark.parametrize("text,want", [
    ("9533", ("127.0.0.1", 9533)), ("0.0.0.0:80", ("0.0.0.0", 80)),
    ("localhost:9533", ("localhost", 9533)), ("[::1]:9533", ("::1", 9533)),
])
def test_addresses(text, want):
    assert parse_address(text, "--metrics") == want


@pytest.mark.parametrize("text,needle", [
    ("99999", "from 1 to 65535"), ("0", "from 1 to 65535"), ("::1:9533", "[IPv6]:PORT"),
    (":9533", "is not an address"), ("host:", "is not an address"),
    ("host:http", "from 1 to 65535"),
])
def test_bad_addresses(text, needle):
    with pytest.raises(UserError) as exc:
        parse_address(text, "--metrics")
    assert needle in str(exc.value)


def test_bind_errors_are_sentences():
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        with pytest.raises(UserError) as exc:
            metrics.bind(("127.0.0.1", taken.getsockname()[1]))
        assert "the port is in use" in str(exc.value)
    finally:
        taken.close()
    with pytest.raises(UserError) as exc:
        metrics.bind(("nohost.invalid", 9533))
    assert "cannot resolve 'nohost.invalid'" in str(exc.value)
