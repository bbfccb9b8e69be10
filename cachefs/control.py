"""The control channel used by `cachefs-ctl`: JSON lines over a Unix socket in the cache dir.

Owns the socket server only; what a command does is a handler given by `mount.py`. A request
is one line `{"cmd": NAME, ...}`; the answer is one line `{"ok": true, ...}` or
`{"ok": false, "error": SENTENCE}`. Long commands may send progress lines
(`{"progress": {...}}`) before the answer.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Awaitable, Callable

import trio

from .errors import CommandFailed

log = logging.getLogger("cachefs.control")

Handler = Callable[[dict, Callable[[dict], Awaitable[None]]], Awaitable[dict]]
CONTROL_XATTR = "user.cachefs.control"   # the mount root's xattr naming the socket path
MAX_REQUEST = 64 * 1024


class ControlServer:
    def __init__(self, path: str, handlers: dict[str, Handler]):
        self.path = path
        self._handlers = handlers

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
        await sock.bind(self.path)
        os.chmod(self.path, 0o600)
        sock.listen(16)
        listener = trio.SocketListener(sock)
        task_status.started()
        try:
            await trio.serve_listeners(self._serve, [listener])
        finally:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    async def _serve(self, stream: trio.SocketStream) -> None:
        async with stream:
            buf = b""
            while b"\n" not in buf:
                chunk = await stream.receive_some(4096)
                if not chunk:
                    return
                buf += chunk
                if len(buf) > MAX_REQUEST:
                    return
            try:
                request = json.loads(buf.split(b"\n", 1)[0])
                handler = self._handlers[request["cmd"]]
            except (ValueError, KeyError, TypeError):
                await _send(stream, {"ok": False, "error": "unknown or malformed command"})
                return

            async def progress(info: dict) -> None:
                await _send(stream, {"progress": info})

            try:
                answer = await handler(request, progress)
            except CommandFailed as exc:
                answer = None
                error = str(exc)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return
            if answer is None:
                try:
                    await _send(stream, {"ok": False, "error": error})
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass
                return
            try:
                await _send(stream, {"ok": True, **answer})
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass


async def _send(stream: trio.SocketStream, obj: Any) -> None:
    await stream.send_all(json.dumps(obj).encode() + b"\n")
