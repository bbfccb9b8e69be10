"""Client side of the control channel: find a mount's socket and talk JSON lines to it."""

from __future__ import annotations

import errno
import json
import os
import socket
import stat
from typing import Callable, Iterator

from cachefs import mounttable
from cachefs.controlpath import CONTROL_XATTR, registry_path, unix_address
from cachefs.errors import UserError


def control_paths(mountpoint: str) -> Iterator[str]:
    """Where the control socket may be: the link a root daemon registered (no request to
    the mount, whose root may be waiting on a hung BACKING), then the mount root's xattr."""
    registered = _registered(mountpoint)
    if registered is not None:
        yield registered
    yield control_path(mountpoint)


def _registered(mountpoint: str) -> str | None:
    where = mounttable.resolve(mountpoint)
    try:
        on_top = [fstype for mp, fstype in mounttable.mounts() if mp == where]
        if not on_top or on_top[-1] != "fuse.cachefs":
            return None
        return os.readlink(registry_path(where))
    except OSError:
        return None


def control_path(mountpoint: str) -> str:
    try:
        is_dir = stat.S_ISDIR(os.stat(mountpoint).st_mode)
    except OSError as exc:
        if exc.errno == errno.ENOTCONN:     # (os.path.isdir says False: not a directory)
            raise UserError(f"{mountpoint} is a dead FUSE mount (its daemon is gone); "
                            f"run fusermount3 -u {mountpoint}.") from None
        is_dir = False
    if not is_dir:
        raise UserError(f"{mountpoint} is not a directory.")
    try:
        return os.fsdecode(os.getxattr(mountpoint, CONTROL_XATTR))
    except OSError as exc:
        if exc.errno == errno.ENOTCONN:
            raise UserError(f"{mountpoint} is a dead FUSE mount (its daemon is gone); "
                            f"run fusermount3 -u {mountpoint}.") from None
        raise UserError(f"{mountpoint} is not a cachefs mount.") from None


def request(mountpoint: str, cmd: str, timeout_s: float | None = 30.0,
            on_progress: Callable[[dict], None] | None = None, **args) -> dict:
    """Send one command; returns the answer, calling on_progress for progress lines."""
    try:
        with _connect(mountpoint) as s:
            s.settimeout(timeout_s)
            s.sendall(json.dumps({"cmd": cmd, **args}).encode() + b"\n")
            for msg in _lines(s):
                if "progress" in msg:
                    if on_progress:
                        on_progress(msg["progress"])
                    continue
                if not msg.get("ok"):
                    raise UserError(msg.get("error", "the cachefs daemon refused the command."))
                return msg
    except PermissionError:
        raise UserError(f"no permission to talk to the cachefs daemon of {mountpoint} "
                        "(run as root, or as a member of the group the mount names with "
                        "--stats-group).") from None
    except socket.timeout:
        raise UserError(f"the cachefs daemon of {mountpoint} did not answer within "
                        f"{timeout_s:g} s.") from None
    except OSError as exc:
        raise UserError(f"cannot reach the cachefs daemon of {mountpoint}: "
                        f"{exc.strerror or exc}.") from None
    raise UserError(f"the cachefs daemon of {mountpoint} closed the connection.")


def _connect(mountpoint: str) -> socket.socket:
    error = None
    for path in control_paths(mountpoint):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with unix_address(path) as address:
                s.connect(address)
            return s
        except (ConnectionRefusedError, FileNotFoundError) as exc:   # a stale link: next
            s.close()
            error = exc
        except BaseException:
            s.close()
            raise
    raise error


def _lines(s: socket.socket) -> Iterator[dict]:
    buf = b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            return
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            yield json.loads(line)
