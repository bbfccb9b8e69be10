"""The control channel used by `cachefs-ctl`: JSON lines over a Unix socket.

Owns the socket server, where it lives and who may do what; what a command does is a handler
given by `mount.py`. A request is one line `{"cmd": NAME, ...}`; the answer is one line
`{"ok": true, ...}` or `{"ok": false, "error": SENTENCE}`. Long commands may send progress
lines (`{"progress": {...}}`) before the answer.

Access: the socket is `control.sock` in the private cache directory (0600), or, with
`--stats-group GROUP`, `/run/cachefs/<cache dir name>-<hash>.sock` with mode 0660 and that
group, so the group's members can read statistics without root. Whoever can connect may run
the read-only commands (READ_ONLY); every other command (flush, drop, pin, ...) changes state
and is for root or the mount's owner only, checked on the peer's credentials (SO_PEERCRED).

Finding it: the mount root answers the xattr CONTROL_XATTR with the socket's path, and a
root daemon also links `/run/cachefs/mounts/<hash of the mountpoint>` to it (`register`), so
that cachefs-ctl reaches a daemon whose mount root cannot answer (BACKING hung).
"""

from __future__ import annotations

import errno
import grp
import json
import logging
import os
import socket
import sqlite3
import stat as stat_mod
import struct
from typing import Any, Awaitable, Callable

import trio

from .controlpath import MOUNTS_DIR, RUN_DIR, registry_path, unix_address
from .errors import CommandFailed
from .oplog import RateLimitedLog
from .statx import file_id

log = logging.getLogger("cachefs.control")

Handler = Callable[[dict, Callable[[dict], Awaitable[None]]], Awaitable[dict]]
MAX_REQUEST = 64 * 1024
SOCKET_CHECK_S = 5.0                          # how often the socket file is looked for
READ_ONLY = frozenset({"stats", "pid", "history"})   # commands anyone who can connect may run


def register(real_mountpoint: str, sock_path: str) -> str | None:
    """Link the mountpoint to its control socket, so that cachefs-ctl finds the daemon
    without a request to the mount (whose root waits on BACKING, which may hang). Only a
    daemon that may write RUN_DIR does; the others are found through CONTROL_XATTR.
    Returns the link, or None."""
    link = registry_path(real_mountpoint)
    tmp = f"{link}.{os.getpid()}"
    try:
        own_dir(RUN_DIR)
        own_dir(MOUNTS_DIR)
        os.symlink(sock_path, tmp)
        os.replace(tmp, link)
        return link
    except OSError:
        return None


def own_dir(path: str) -> None:
    """Make `path` (RUN_DIR, MOUNTS_DIR) a directory of this user's that only it may write.
    The daemon runs with umask 0: makedirs gave RUN_DIR, made on the way to MOUNTS_DIR, mode
    0777, and any user could then have put a socket or link of theirs in place of a mount's
    (cachefs-ctl run by root would talk to it). One left that way is made 0755; one of
    another user's, or not a directory, is refused (OSError)."""
    os.makedirs(path, mode=0o755, exist_ok=True)
    st = os.lstat(path)
    if not stat_mod.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise OSError(errno.EPERM, f"{path} is not a directory of this user's")
    if st.st_mode & 0o022:
        os.chmod(path, 0o755)


def unregister(link: str, sock_path: str) -> None:
    """Remove the link if it is still ours (a newer mount there may have replaced it)."""
    try:
        if os.readlink(link) == sock_path:
            os.unlink(link)
    except OSError:
        pass


def group_id(group: str) -> int:
    """The gid of a group name or number; KeyError if there is no such group."""
    return grp.getgrgid(int(group)).gr_gid if group.isdigit() else grp.getgrnam(group).gr_gid


def peer_uid(sock) -> int:
    """The uid of the process at the other end of a connected Unix socket."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


class ControlServer:
    def __init__(self, path: str, handlers: dict[str, Handler], group: str | None = None):
        """Serve `handlers` on the socket `path`; with `group` (a name or gid), the socket
        is 0660 for that group (its directory must let the group reach it)."""
        self.path = path
        self._handlers = handlers
        self._gid = None if group is None else group_id(group)
        self._owner = os.geteuid()
        self._limited = RateLimitedLog(log)          # a refused user may loop
        self._bound: tuple[int, int] | None = None   # the socket file made by _listen

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        listener = await self._listen()
        task_status.started()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(trio.serve_listeners, self._serve, [listener])
                while True:
                    await trio.sleep(SOCKET_CHECK_S)
                    if file_id(self.path) == self._bound:
                        continue
                    # Removed behind the daemon (a cleaner of old files, an operator): the
                    # mount could never be flushed, queried or stopped by `cachefs umount
                    # --flush` again (a unit's ExecStop; a helper's hunt). Made again.
                    try:
                        listener = await self._listen()
                    except OSError as exc:
                        self._limited.warning(("socket",), "the control socket %s was "
                                              "removed and cannot be made again: %s",
                                              self.path, exc)
                        continue
                    log.warning("the control socket %s was removed or replaced behind "
                                "cachefs: made again", self.path)
                    nursery.start_soon(trio.serve_listeners, self._serve, [listener])
        finally:
            self._limited.flush()
            try:
                os.unlink(self.path)
            except OSError:             # gone, or its filesystem failing (a dead cache SSD):
                pass                    # the daemon stops all the same

    async def _listen(self) -> trio.SocketListener:
        """A listening socket at `self.path`. It is made under a temporary name and renamed
        into place once it listens: a client finds no socket, or one that answers (made at
        the path itself, a client connecting between its bind and listen, as cachefs-ctl
        may while it is made again, was refused: ECONNREFUSED)."""
        if self._gid is not None:
            own_dir(os.path.dirname(self.path))
        tmp = f"{self.path}.{os.getpid()}"
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
        try:
            with unix_address(tmp) as address:
                await sock.bind(address)
            if self._gid is None:
                os.chmod(tmp, 0o600)
            else:
                os.chown(tmp, -1, self._gid)
                os.chmod(tmp, 0o660)
            sock.listen(16)
            os.rename(tmp, self.path)
        except BaseException:
            sock.close()
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        self._bound = file_id(self.path)
        return trio.SocketListener(sock)

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
            refusal = self._refusal(request["cmd"], stream)
            if refusal:
                self._limited.warning(("refused", refusal[1]), "refused %s from uid %d: it "
                                      "changes the cache, which only root and the mount's "
                                      "owner may", request["cmd"], refusal[1])
                await _send(stream, {"ok": False, "error": refusal[0]})
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
            except (OSError, sqlite3.Error) as exc:
                # The SSD or the database failed under the command (a full cache file system
                # at a flush's durable commit): the command fails and says why; the mount
                # goes on (it took the daemon down).
                log.error("%s failed: %s", request["cmd"], exc)
                answer = None
                error = f"{request['cmd']} failed: {exc}"
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


    def _refusal(self, cmd: str, stream: trio.SocketStream) -> tuple[str, int] | None:
        """(sentence, uid) if the peer may not run `cmd`: state changes are for root and
        the mount's owner."""
        if cmd in READ_ONLY:
            return None
        uid = peer_uid(stream.socket)
        if uid in (0, self._owner):
            return None
        owner = "root" if self._owner == 0 else f"root or uid {self._owner}"
        return (f"{cmd} changes the cache, so it is for {owner} (the mount's owner); "
                f"you (uid {uid}) may only read statistics.", uid)


async def _send(stream: trio.SocketStream, obj: Any) -> None:
    await stream.send_all(json.dumps(obj).encode() + b"\n")
