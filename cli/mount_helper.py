"""`mount.cachefs BACKING MOUNTPOINT [-o OPTIONS]`: the helper mount(8) and fstab call.

    /srv/slow  /mnt/fast  cachefs  cache_dir=/ssd/cache,mode=write-back,_netdev  0 0
"""

from __future__ import annotations

import argparse
import sys

from cachefs.errors import UserError

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
    try:
        cfg = config_from_args(args)
    except UserError as exc:
        print(f"mount.cachefs: {exc}", file=sys.stderr)
        return 2
    argv2 = cli_main.config_to_argv(cfg)
    if not args.foreground:
        argv2.remove("-f")
    return cli_main.main(argv2)


if __name__ == "__main__":
    sys.exit(main())
