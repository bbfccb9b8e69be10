"""`mount.cachefs BACKING MOUNTPOINT [-o OPTIONS]`: the helper mount(8) and fstab call.

    /srv/slow  /mnt/fast  cachefs  cache_dir=/ssd/cache,mode=write-back,_netdev  0 0

Installed as `mount.fuse.cachefs` too: mount(8) calls that one for `-t fuse.cachefs` and
for a remount of a mounted cachefs (`mount -o remount,ro MOUNTPOINT`), whose type in the
mount table is fuse.cachefs.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from cachefs.config import format_size
from cachefs.errors import UserError

from . import client
from . import main as cli_main
from .options import config_from_args


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mount.cachefs")
    p.add_argument("backing", metavar="BACKING")
    p.add_argument("mountpoint", metavar="MOUNTPOINT")
    p.add_argument("-o", dest="options", action="append", default=[])
    p.add_argument("-n", action="store_true", help="(mount(8): do not write mtab; ignored)")
    p.add_argument("-s", action="store_true", help="(mount(8): sloppy; ignored)")
    p.add_argument("-v", action="store_true", help="(mount(8): verbose; ignored)")
    p.add_argument("-f", "--foreground", action="store_true")
    args = p.parse_args(argv)
    opts = [o for arg in args.options for o in arg.split(",") if o]
    if "remount" in opts:
        return _remount(args.backing, args.mountpoint, opts)
    if os.geteuid() == 0:
        # mount(8) hands a helper no default flags (dev, suid: fstab's "dev,suid" arrive
        # as nothing), so, as mount.fuse3 does for root, they are the default here unless
        # nodev or nosuid is asked for (a device node on an fstab mount failed with EACCES).
        args.options += [o for o in ("dev", "suid") if "no" + o not in opts]
    try:
        cfg = config_from_args(args)
    except UserError as exc:
        print(f"mount.cachefs: {exc}", file=sys.stderr)
        return 2
    argv2 = cli_main.config_to_argv(cfg)
    if not args.foreground:
        argv2.remove("-f")
    return cli_main.main(argv2)


# What a remount can change: the kernel's flags of the mount (cachefs's own options are
# the daemon's, fixed until it is mounted again).
REMOUNT_FLAGS = {"remount", "ro", "rw", "suid", "nosuid", "dev", "nodev", "exec", "noexec",
                 "sync", "async", "dirsync", "atime", "noatime", "diratime", "nodiratime",
                 "relatime", "norelatime", "strictatime", "nostrictatime", "lazytime",
                 "nolazytime"}


def _remount(backing: str, mountpoint: str, opts: list[str]) -> int:
    """`mount -o remount,ro MOUNTPOINT` of a cachefs mount: the kernel's remount (mount -i:
    no helper again) with the kernel's flags; the rest (cachefs's options, which mount(8)
    hands over from fstab and the mount table each time) cannot change without unmounting
    and are left as they are (said for those that differ). mount.fuse3 ran `cachefs SOURCE
    MOUNTPOINT -o remount,...`, which is no cachefs command ("cachefs: not found" and the
    mount stayed rw)."""
    flags = [o for o in opts if o in REMOUNT_FLAGS]
    res = subprocess.run(["mount", "-i", "-o", ",".join(flags), mountpoint])
    if res.returncode == 0:
        for line in _not_applied(backing, mountpoint, [o for o in opts if o not in REMOUNT_FLAGS]):
            print(f"mount.cachefs: {line}", file=sys.stderr)
    return res.returncode


# cachefs options a remount names that the running daemon can be asked about: (the stats
# field, how a value is shown). mount(8) hands over an fstab line's options at every
# remount, so only a value other than the daemon's is said to be left as it was.
_COMPARED = {"mode": ("mode", str), "cache_size": ("cache_size", format_size),
             "cache_dir": ("cache_dir", str), "dirty_high": ("dirty_high", format_size),
             "dirty_low": ("dirty_low", format_size)}


def _not_applied(backing: str, mountpoint: str, given: list[str]) -> list[str]:
    """A sentence for each cachefs option of a remount whose value differs from the running
    daemon's: it is not applied (`mount -o remount,cache_size=32M` exited 0 and nothing said
    that the pool kept its size: a helper's hunt)."""
    if not given:
        return []
    try:
        cfg = config_from_args(argparse.Namespace(backing=backing, mountpoint=mountpoint,
                                                  options=[",".join(given)]))
        running = client.request(mountpoint, "stats", timeout_s=10)["stats"]
    except UserError:
        return []
    named = {o.partition("=")[0].replace("-", "_") for o in given}
    said = []
    for key, (field, show) in _COMPARED.items():
        want, have = getattr(cfg, key, None), running.get(field)
        if key not in named or want is None or have is None:
            continue
        if key == "cache_dir":
            want, have = os.path.realpath(want), os.path.realpath(have)
        if want != have:
            said.append(f"{key}={show(want)} is not applied by a remount (the mount keeps "
                        f"{show(have)}): unmount and mount again to change it.")
    return said


if __name__ == "__main__":
    sys.exit(main())
