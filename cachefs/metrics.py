"""Prometheus: the exposition text of a stats snapshot, and the daemon's HTTP endpoint.

One text for both routes: `cachefs-ctl metrics` builds it from the stats JSON of the control
socket, and the endpoint of `--metrics ADDR` from the daemon's own snapshot, both with
`exposition()` (prometheus_client: a custom Collector on its own CollectorRegistry).

Every sample carries `mount` and `backing` labels, so several mounts on one host (scraped or
written to node_exporter's textfile directory) stay distinct. The latency histogram's `le`
bounds are the powers of two from 2**10 ns (about 1 us) to 2**36 ns (about 69 s): the
daemon's log-linear buckets (cachefs/latency.py) split exactly at powers of two, so these
cumulative counts are exact.

The endpoint is a minimal HTTP/1.x responder on a socket bound at start-up (a port in use is
a user mistake found before the mount is ready): `GET /metrics` (or `/`) answers the text,
other paths 404, other methods 405; one request per connection, then close. A client gets
HEAD_TIMEOUT_S for its whole exchange and at most MAX_CLIENTS connections are served at once
(others are closed at once), so a slow, silent or flooding client holds nothing. It never
touches the engine beyond the snapshot, built on the event loop like `cachefs-ctl stats`.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import socket
from typing import Callable

import trio

from .config import format_address
from .errors import UserError

log = logging.getLogger("cachefs.metrics")

# generate_latest writes the text format 0.0.4 (our names are all legacy-valid); newer
# prometheus_client's CONTENT_TYPE_LATEST announces 1.0.0, which older servers do not know.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
HEAD_TIMEOUT_S = 10.0        # a client's whole exchange: request head in, answer out
MAX_HEAD = 8192              # bytes of request line and headers
MAX_CLIENTS = 64             # connections served at once; more are closed unanswered
LINGER_S = 1.0               # after the answer, reading what the client still sends
LE_NS = tuple(1 << k for k in range(10, 37))
TIER_COUNTERS = (("ssd", "hit"), ("backing", "miss"), ("bypass", "bypass"))
COUNTERS = (    # (metric name without cachefs_ and _total, stats key, help)
    ("write_ops", "write_ops", "Write requests."),
    ("fallocate_ops", "fallocate_ops", "fallocate(2) requests (reserve, punch, zero)."),
    ("zeroed_bytes", "zeroed_bytes", "Bytes punched or zeroed by fallocate(2)."),
    ("write_bytes", "write_bytes", "Bytes written."),
    ("backing_read_ops", "backing_read_ops", "Read calls to BACKING."),
    ("backing_read_bytes", "backing_read_bytes", "Bytes read from BACKING."),
    ("backing_write_ops", "backing_write_ops", "Write calls to BACKING."),
    ("backing_write_bytes", "backing_write_bytes", "Bytes written to BACKING."),
    ("promotions", "promotions", "Extents copied into the cache."),
    ("promotions_dropped", "promotions_dropped", "Promotions given up."),
    ("evictions", "evictions", "Extents evicted."),
    ("stale_files", "stale_files", "Files found changed behind the cache."),
    ("backing_errors", "backing_errors", "Failed BACKING calls."),
    ("cache_errors", "cache_errors", "Failed SSD calls."),
    ("cache_files_restored", "cache_files_restored", "Cache files removed behind cachefs "
     "while open, whose data was written again under their names at the last close."),
    ("checksum_errors", "checksum_errors", "Clean cached blocks that failed their checksums "
     "(dropped, read from BACKING)."),
    ("checksum_dirty_errors", "checksum_dirty_errors", "Dirty cached blocks that failed "
     "their checksums (data lost on the SSD)."),
    ("verified_blocks", "verified_blocks", "Cached blocks checked by verify and the scrub."),
    ("scrubs", "scrubs", "Background scrub passes completed."),
    ("metadata_errors", "metadata_errors", "Failed metadata commits."),
    ("internal_errors", "internal_errors", "Reads failed with EIO, and metadata rows left "
     "out of a commit, by an error in cachefs itself (a bug; the log says what)."),
    ("conflicts", "conflicts", "Write-back: BACKING changed while dirty here."),
    ("writes_around", "writes_around", "Write-back writes sent straight to BACKING."),
    ("destage_ops", "destage_ops", "Destage passes."),
    ("destaged_bytes", "destaged_bytes", "Bytes destaged to BACKING."),
    ("destage_errors", "destage_errors", "Failed destage passes."),
    ("throttled_writes", "throttled_writes", "Writes delayed by flow control."),
    ("prefetched_bytes", "prefetched_bytes", "Bytes loaded by prefetch/pin."),
    ("punch_waits", "punch_waits", "Write-back writes that waited for an evicted extent's "
     "space to be released."),
    ("overlay_rereads", "overlay_rereads", "Misses that read BACKING again: a dirty block "
     "in their range was destaged and dropped during the read."),
    ("passthrough_opens", "passthrough_opens", "Opens served by the kernel from the cache "
     "file (FUSE passthrough)."),
    ("passthrough_joined_opens", "passthrough_joined", "Other opens of files in passthrough "
     "(passthrough with direct I/O: reads and writes reach cachefs)."),
    ("passthrough_refused", "passthrough_failed", "Cache files the kernel refused as "
     "backing files."),
    ("passthrough_detached", "passthrough_detached", "Cache files read by the kernel "
     "set aside (unlinked, not emptied) when their data had to go."),
    ("passthrough_frozen", "passthrough_frozen", "Files read in passthrough whose cache "
     "file stopped growing (grown past the room for them): their passthrough readers see "
     "them end early."),
    ("passthrough_refreshed", "passthrough_refreshed", "Cache files read by the kernel read "
     "again from BACKING after it changed behind them."),
    ("passthrough_syncs", "passthrough_syncs", "Files a shared writable mapping may have "
     "written, made dirty or copied to BACKING."),
)
GAUGES = (
    ("cache_used_bytes", "cache_used", "Bytes of the SSD cache in use."),
    ("cache_size_bytes", "cache_size", "Size of the SSD cache."),
    ("dirty_bytes", "dirty_bytes", "Write-back data not yet on BACKING."),
    ("files_cached", "files_cached", "Files with cached extents."),
    ("extents_cached", "extents_cached", "Cached extents."),
    ("lost_dirty_blocks", "lost_dirty_blocks", "Dirty blocks damaged on the SSD: reads of "
     "them fail, they are never destaged (cachefs-ctl stats names them)."),
    ("pinned_bytes", "pinned_bytes", "Resident bytes of pinned files."),
    ("oldest_dirty_age_seconds", "oldest_dirty_age_s", "Age of the oldest dirty data."),
    ("destage_rate_bytes", "destage_rate", "Recent destage rate, bytes per second."),
    ("throttling", "throttling", "1 while flow control slows writers."),
    ("uptime_seconds", "uptime_s", "Seconds since the mount."),
    ("resident_memory_bytes", "resident_bytes", "The daemon's resident memory (RSS); its "
     "extent map takes about 1.5 KiB per 64 KiB extent of a full pool."),
    ("passthrough_enabled", "passthrough_on", "1 while FUSE passthrough is on."),
    ("killpriv_v2_enabled", "killpriv_v2_on", "1 while FUSE_HANDLE_KILLPRIV_V2 is on (no "
     "security.capability request before each write)."),
    ("direct_io_mmap_enabled", "direct_io_mmap_on", "1 while shared mappings of O_DIRECT "
     "opens work (FUSE_CAP_DIRECT_IO_ALLOW_MMAP)."),
    ("fast_hits_enabled", "fast_hits_on", "1 while 4 KiB cache hits are answered in C "
     "(pyfuse3's read hook)."),
    ("passthrough_open_handles", "passthrough_open_handles", "Open handles in passthrough."),
    ("passthrough_held_files", "passthrough_held_files", "Files the kernel may read by "
     "itself (passthrough opens, mappings)."),
    ("passthrough_held_bytes", "passthrough_held_bytes", "Cached bytes of those files, "
     "kept from eviction and drop."),
)


class StatsCollector:
    """Yields the metric families of one stats snapshot."""

    def __init__(self, stats: dict):
        self.s = stats

    def collect(self):
        # prometheus_client is imported when a text is first asked for, not by every daemon
        # start (a tenth of a start's CPU, most mounts never serve metrics).
        from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                            HistogramMetricFamily)
        s = self.s
        names = ["mount", "backing"]
        base = [str(s["mountpoint"]), str(s["backing"])]
        ops = CounterMetricFamily("cachefs_read_ops", "Read requests answered, by tier.",
                                  labels=names + ["tier"])
        nbytes = CounterMetricFamily("cachefs_read_bytes", "Bytes read, by tier.",
                                     labels=names + ["tier"])
        for tier, key in TIER_COUNTERS:
            ops.add_metric(base + [tier], s.get(key + "_ops", 0))
            nbytes.add_metric(base + [tier], s.get(key + "_bytes", 0))
        yield ops
        yield nbytes
        for name, key, text in COUNTERS:
            if key in s:
                c = CounterMetricFamily("cachefs_" + name, text, labels=names)
                c.add_metric(base, s[key])
                yield c
        drops = CounterMetricFamily("cachefs_dropped_extents", "Cached extents dropped, by "
                                    "reason.", labels=names + ["reason"])
        for reason, n in s.get("drops", {}).items():
            drops.add_metric(base + [reason], n)
        yield drops
        for name, key, text in GAUGES:
            if s.get(key) is not None:
                g = GaugeMetricFamily("cachefs_" + name, text, labels=names)
                g.add_metric(base, float(s[key]))
                yield g
        health = s.get("backing_health")
        if health:
            g = GaugeMetricFamily("cachefs_backing_healthy", "1 while BACKING answers, 0 "
                                  "while its calls fail (see the daemon log).", labels=names)
            g.add_metric(base, 1.0 if health["state"] == "ok" else 0.0)
            yield g
            c = CounterMetricFamily("cachefs_backing_timeouts", "BACKING calls that ran past "
                                    "--backing-timeout.", labels=names)
            c.add_metric(base, health["timeouts"])
            yield c
            c = CounterMetricFamily("cachefs_backing_failures", "Failed BACKING calls that "
                                    "count against its health, by errno.",
                                    labels=names + ["errno"])
            for name, n in sorted(health["errors"].items()):
                c.add_metric(base + [name], n)
            yield c
        lat = HistogramMetricFamily("cachefs_latency_seconds", "Request latency by tier "
                                    "(ssd_hit, backing_miss, bypass, write, fsync, destage).",
                                    labels=names + ["tier"])
        for tier, h in s.get("latency", {}).items():
            lat.add_metric(base + [tier], _buckets(h), h["sum_ns"] / 1e9)
        yield lat


def _buckets(h: dict) -> list[tuple[str, int]]:
    out = []
    for le in LE_NS:
        out.append((repr(le / 1e9), sum(n for _, hi, n in h["buckets"] if hi <= le)))
    out.append(("+Inf", h["count"]))
    return out


def exposition(stats: dict) -> bytes:
    """The exposition text (UTF-8) of one stats snapshot: `Daemon.snapshot()` or its JSON."""
    from prometheus_client import CollectorRegistry, generate_latest
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatsCollector(stats))
    return generate_latest(registry)


def bind(addr: tuple[str, int]) -> socket.socket:
    """A listening TCP socket on `addr` (host, port), bound now so that a port in use stops
    the mount before it is ready. Raises UserError (one sentence) when it cannot bind."""
    host, port = addr
    what = f"--metrics {format_address(addr)}"
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise UserError(f"{what}: cannot resolve {host!r} ({exc.strerror}).") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # a remount in TIME_WAIT
        sock.bind(sockaddr)
        sock.listen(MAX_CLIENTS)
    except OSError as exc:
        sock.close()
        why = {errno.EADDRINUSE: "the port is in use (another mount or program listens "
                                 "there; choose another port)",
               errno.EACCES: "permission denied (ports below 1024 need root)",
               errno.EADDRNOTAVAIL: f"{host} is not an address of this host"}
        raise UserError(f"{what}: cannot listen: "
                        f"{why.get(exc.errno, exc.strerror)}.") from None
    return sock


class MetricsServer:
    """The HTTP endpoint of one mount: the exposition of `snapshot()` at /metrics."""

    def __init__(self, sock: socket.socket, snapshot: Callable[[], dict],
                 timeout_s: float = HEAD_TIMEOUT_S, max_clients: int = MAX_CLIENTS):
        self._sock = sock
        self._snapshot = snapshot
        self._timeout_s = timeout_s
        self._max_clients = max_clients
        self._clients = 0
        host, port = sock.getsockname()[:2]
        self.url = f"http://{format_address((host, port))}/metrics"
        self.loopback = ipaddress.ip_address(host.split("%")[0]).is_loopback

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled; the listening socket is closed on the way out."""
        listener = trio.SocketListener(trio.socket.from_stdlib_socket(self._sock))
        log.info("metrics on %s%s", self.url, "" if self.loopback else " (not loopback, and "
                 "without authentication: whoever reaches it reads this mount's activity)")
        task_status.started()
        await trio.serve_listeners(self.serve_client, [listener])

    async def serve_client(self, stream: trio.abc.HalfCloseableStream) -> None:
        """One connection: read the request head, answer, close (all within timeout_s)."""
        async with stream:
            if self._clients >= self._max_clients:
                return
            self._clients += 1
            try:
                with trio.move_on_after(self._timeout_s):
                    await self._exchange(stream)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass                             # the client went away
            finally:
                self._clients -= 1

    async def _exchange(self, stream: trio.abc.HalfCloseableStream) -> None:
        head = b""
        while b"\r\n\r\n" not in head and b"\n\n" not in head and len(head) <= MAX_HEAD:
            chunk = await stream.receive_some(4096)
            if not chunk:
                return                           # closed before a whole request
            head += chunk
        if len(head) > MAX_HEAD:
            await _send(stream, 431, "Request Header Fields Too Large")
        else:
            await self._answer(stream, head.split(b"\n", 1)[0].strip())
        # Half-close, then read until the client closes: closing with unread bytes (a body
        # we did not want, a long head) would reset the connection and could lose the answer.
        await stream.send_eof()
        with trio.move_on_after(LINGER_S):
            while await stream.receive_some(4096):
                pass

    async def _answer(self, stream: trio.abc.HalfCloseableStream, line: bytes) -> None:
        parts = line.split()
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
            await _send(stream, 400, "Bad Request")
        elif parts[0] not in (b"GET", b"HEAD"):
            await _send(stream, 405, "Method Not Allowed", extra=b"Allow: GET, HEAD\r\n")
        elif parts[1].split(b"?", 1)[0] not in (b"/metrics", b"/"):
            await _send(stream, 404, "Not Found")
        else:
            body = exposition(self._snapshot())
            await _send(stream, 200, "OK", body, CONTENT_TYPE, head_only=parts[0] == b"HEAD")


async def _send(stream: trio.abc.SendStream, status: int, reason: str, body: bytes = b"",
                ctype: str = "text/plain; charset=utf-8", extra: bytes = b"",
                head_only: bool = False) -> None:
    if not body and status != 200:
        body = f"{status} {reason}\n".encode()
    head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: {ctype}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n").encode()
    await stream.send_all(head + extra + b"\r\n" + (b"" if head_only else body))
