"""The kernel's mount table, read from /proc: one parser for the daemon and the CLI."""

from __future__ import annotations

import os
import re


_OCTAL = re.compile(rb"\\([0-7]{3})")


def unescape(field: str) -> str:
    """A path field of /proc/self/mounts or mountinfo: the kernel writes space, tab, newline
    and backslash as octal escapes (\\040) and every other byte as it is (UTF-8 names
    too, which a unicode_escape decoding took for Latin-1)."""
    if "\\" not in field:
        return field
    raw = _OCTAL.sub(lambda m: bytes([int(m.group(1), 8)]), os.fsencode(field))
    return os.fsdecode(raw)


def mounts() -> list[tuple[str, str]]:
    """(mountpoint, fstype) of every mount, mountpoints unescaped."""
    out = []
    with open("/proc/self/mounts", errors="surrogateescape") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 2:
                out.append((unescape(fields[1]), fields[2]))
    return out


def device_of(real_mountpoint: str) -> str | None:
    """The minor device number (the fusectl connection name) of the mount on
    `real_mountpoint` (a real path), from /proc/self/mountinfo; None if not mounted."""
    dev = None
    with open("/proc/self/mountinfo", errors="surrogateescape") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 4 and unescape(fields[4]) == real_mountpoint:
                dev = fields[2].split(":")[1]
    return dev


def noatime(real_mountpoint: str) -> bool:
    """The mount on `real_mountpoint` has the kernel's `noatime` flag (`-o noatime`, or a
    remount with it since); False if it is not mounted."""
    flag = False
    with open("/proc/self/mountinfo", errors="surrogateescape") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 5 and unescape(fields[4]) == real_mountpoint:
                flag = "noatime" in fields[5].split(",")
    return flag


def users_of(real_mountpoint: str) -> list[str]:
    """Other mounts that keep the filesystem on `real_mountpoint` in use: bind mounts of it
    (the same device) and mounts whose options name a path in it (overlayfs's lowerdir,
    upperdir, workdir). Unmounting it then only detaches it; the daemon serves them on."""
    rows = []
    with open("/proc/self/mountinfo", errors="surrogateescape") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 4 and "-" in fields:
                rows.append((fields[2], unescape(fields[4]), fields[fields.index("-") + 3:]))
    dev = next((d for d, mp, _ in rows if mp == real_mountpoint), None)
    inside = real_mountpoint.rstrip("/") + "/"
    out = []
    for d, mp, opts in rows:
        if mp == real_mountpoint:
            continue
        words = [unescape(w) for o in opts for w in re.split(r"[=,:]", o)]
        if d == dev or any(w == real_mountpoint or w.startswith(inside) for w in words):
            out.append(mp)
    return out


def resolve(path: str) -> str:
    """`path` absolute, with its symlinks followed, as the mount table names mountpoints,
    by readlink alone: os.path.realpath stats every component, the mount's root included,
    whose attributes a cachefs daemon asks BACKING for (a hung BACKING would hang us)."""
    parts = (path if path.startswith("/") else os.getcwd() + "/" + path).split("/")
    out, hops = "/", 0
    while parts:
        name = parts.pop(0)
        if name in ("", "."):
            continue
        if name == "..":
            out = os.path.dirname(out)
            continue
        here = os.path.join(out, name)
        try:
            target = os.readlink(here)          # EINVAL: not a link (no getattr is asked)
        except OSError:
            out = here
            continue
        hops += 1
        if hops > 40:                           # a loop: the caller's checks say what is wrong
            return os.path.abspath(path)
        if target.startswith("/"):
            out = "/"
        parts = target.split("/") + parts
    return out


def is_cachefs(real_mountpoint: str) -> bool:
    """A cachefs mount is at `real_mountpoint` (a path as resolve() gives it)."""
    return (real_mountpoint, "fuse.cachefs") in mounts()
