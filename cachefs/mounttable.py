"""The kernel's mount table, read from /proc: one parser for the daemon and the CLI."""

from __future__ import annotations


def unescape(field: str) -> str:
    """A path field of /proc/self/mounts or mountinfo (spaces and such come as \\040)."""
    return field.encode().decode("unicode_escape") if "\\" in field else field


def mounts() -> list[tuple[str, str]]:
    """(mountpoint, fstype) of every mount, mountpoints unescaped."""
    out = []
    with open("/proc/self/mounts") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 2:
                out.append((unescape(fields[1]), fields[2]))
    return out


def device_of(real_mountpoint: str) -> str | None:
    """The minor device number (the fusectl connection name) of the mount on
    `real_mountpoint` (a real path), from /proc/self/mountinfo; None if not mounted."""
    dev = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 4 and unescape(fields[4]) == real_mountpoint:
                dev = fields[2].split(":")[1]
    return dev
