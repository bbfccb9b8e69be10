"""Where a mount's control socket lives and how to reach it, for the daemon (control.py)
and for `cachefs-ctl` alike: light (no trio, no engine), so the command-line tools start
fast.

- `socket_path`: control.sock in the private cache directory, or in RUN_DIR for a mount
  whose `--stats-group` may use it;
- `registry_path`: the link RUN_DIR/mounts/<hash of the mountpoint> -> that socket, and
  CONTROL_XATTR, the mount root's xattr naming it;
- `unix_address`: a socket path of any length as an AF_UNIX address (the kernel takes at
  most 107 bytes: a cache directory deeper than that made the daemon die at mount with
  "AF_UNIX path too long", and cachefs-ctl could not reach it).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from typing import Iterator

CONTROL_XATTR = "user.cachefs.control"   # the mount root's xattr naming the socket path
RUN_DIR = "/run/cachefs"                     # sockets shared with a --stats-group
MOUNTS_DIR = os.path.join(RUN_DIR, "mounts")  # mountpoint -> socket links (register())
SUN_PATH_MAX = 108                           # struct sockaddr_un's sun_path, NUL included


def socket_path(cache_dir: str, stats_group: str | None) -> str:
    """Where the control socket of the mount of `cache_dir` lives: in the private cache
    directory, or in RUN_DIR (reachable by others) when a stats group may use it."""
    if stats_group is None:
        return os.path.join(cache_dir, "control.sock")
    real = os.path.realpath(cache_dir)
    tag = hashlib.sha256(os.fsencode(real)).hexdigest()[:10]
    return os.path.join(RUN_DIR, f"{os.path.basename(real)[-40:]}-{tag}.sock")


def registry_path(real_mountpoint: str) -> str:
    """The link RUN_DIR/mounts/<hash of the mountpoint> -> the mount's control socket."""
    tag = hashlib.sha256(os.fsencode(real_mountpoint)).hexdigest()[:16]
    return os.path.join(MOUNTS_DIR, tag)


@contextlib.contextmanager
def unix_address(path: str) -> Iterator[str]:
    """`path` as an address to bind or connect an AF_UNIX socket to: itself when it fits
    sun_path, else the same name reached through a descriptor of its directory
    (/proc/self/fd/N/NAME, valid while the block runs)."""
    if len(os.fsencode(path)) < SUN_PATH_MAX:
        yield path
        return
    fd = os.open(os.path.dirname(path) or ".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{fd}/{os.path.basename(path)}"
    finally:
        os.close(fd)
