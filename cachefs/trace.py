"""`--debug` request tracing: one DEBUG line per FUSE request, with its arguments, its result
(bytes, an inode, a handle, or the errno name) and its duration in microseconds.

    trace read fh=3 off=131072 size=4096 -> 4096 B in 14 us
    trace lookup parent=1 name='cold' -> ino=1837 size=524288 in 412 us
    trace getattr inode=77 -> ENOENT in 95 us

Owns the wrapping only: `wrap(ops)` replaces each request handler of an `Operations`
instance by a traced one (an instance attribute over the bound method, which pyfuse3 finds
first). It is called only when --debug is given, so a mount without it runs the handlers
unwrapped: no test, no timing, no cost per request. The wrapper re-raises whatever the
handler raised, unchanged (FUSEError stays the only exception leaving a handler), and keeps
the handler's name and signature (functools.wraps). It never imports pyfuse3: results and
errors are recognised by their attributes.
"""

from __future__ import annotations

import errno
import functools
import inspect
import logging
import os
from time import perf_counter_ns
from typing import Any

log = logging.getLogger("cachefs.trace")

HANDLERS = ("lookup", "forget", "getattr", "setattr", "readlink", "mknod", "mkdir", "symlink",
            "unlink", "rmdir", "rename", "link", "open", "create", "read", "write", "flush",
            "release", "fsync", "opendir", "readdir", "releasedir", "fsyncdir", "statfs",
            "getxattr", "listxattr", "setxattr", "removexattr")
_SKIP = frozenset(("ctx", "token", "attr"))     # request context, readdir token, setattr's
_SIZES = frozenset(("buf", "value"))            # payloads: shown by length
_SETATTR = (("update_size", "size", "st_size", "%d"), ("update_mode", "mode", "st_mode", "%o"),
            ("update_uid", "uid", "st_uid", "%d"), ("update_gid", "gid", "st_gid", "%d"),
            ("update_atime", "atime", None, ""), ("update_mtime", "mtime", None, ""))


def wrap(ops: Any) -> None:
    """Trace every request handler of `ops` (present on it) from now on."""
    for name in HANDLERS:
        handler = getattr(ops, name, None)
        if handler is not None and inspect.iscoroutinefunction(handler):
            setattr(ops, name, _traced(name, handler))


def _traced(op: str, handler):
    params = tuple(inspect.signature(handler).parameters)
    unit = " B" if op == "write" else ""        # write returns the count of bytes written

    @functools.wraps(handler)
    async def traced(*args, **kwargs):
        t0 = perf_counter_ns()
        try:
            result = await handler(*args, **kwargs)
        except BaseException as exc:
            us = (perf_counter_ns() - t0) // 1000      # before formatting the line
            log.debug("trace %s %s -> %s in %d us", op, _args(params, args), _error(exc), us)
            raise
        us = (perf_counter_ns() - t0) // 1000
        log.debug("trace %s %s -> %s%s in %d us", op, _args(params, args), _result(result),
                  unit, us)
        return result
    return traced


def _args(params: tuple[str, ...], args: tuple) -> str:
    out = []
    named = dict(zip(params, args))
    for name, v in named.items():
        if name in _SKIP or v is None:
            continue
        if name == "fields":
            out.append(_setattr_fields(v, named.get("attr")))
        elif isinstance(v, (bytes, bytearray, memoryview)):
            out.append(f"{name}={len(v)} B" if name in _SIZES else f"{name}={_name(v)}")
        elif isinstance(v, int):
            out.append(f"{name}={v:#o}" if name in ("mode", "flags") else f"{name}={v}")
        elif isinstance(v, list):
            out.append(f"{name}={v[:4]!r}{'...' if len(v) > 4 else ''}")
        else:
            out.append(f"{name}={type(v).__name__}")
    return " ".join(out)


def _name(b: bytes) -> str:
    text = repr(os.fsdecode(bytes(b)))
    return text if len(text) <= 80 else text[:77] + "...'"


def _setattr_fields(fields: Any, attr: Any) -> str:
    parts = []
    for flag, label, field, fmt in _SETATTR:
        if getattr(fields, flag, False):
            if field is None or attr is None:
                parts.append(label)
            else:
                parts.append(f"{label}={fmt % getattr(attr, field)}")
    return "set=" + (",".join(parts) or "nothing")


def _result(r: Any) -> str:
    if r is None:
        return "ok"
    if isinstance(r, (bytes, bytearray, memoryview)):
        return f"{len(r)} B"
    if isinstance(r, bool):
        return str(r)
    if isinstance(r, int):
        return str(r)
    if isinstance(r, tuple):
        return " ".join(_result(x) for x in r)
    if isinstance(r, list):
        return f"{len(r)} items"
    if hasattr(r, "st_ino"):                    # EntryAttributes
        return f"ino={r.st_ino} size={r.st_size}"
    if hasattr(r, "fh"):                        # FileInfo
        return f"fh={r.fh}"
    return type(r).__name__


def _error(exc: BaseException) -> str:
    err = getattr(exc, "errno", None)
    if isinstance(err, int):
        return errno.errorcode.get(err, str(err))
    return f"{type(exc).__name__}: {exc}"
