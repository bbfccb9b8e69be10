"""`cachefs-ctl stats|drop`: inspect and steer a running cachefs mount."""

from __future__ import annotations

import argparse
import json
import sys
import time

from cachefs.config import format_size
from cachefs.errors import UserError

from . import client


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cachefs-ctl", description="Inspect and steer a "
                                "running cachefs mount.")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("stats", help="cache statistics")
    s.add_argument("mountpoint", metavar="MOUNTPOINT")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.add_argument("--watch", type=float, metavar="SECONDS", help="repeat every SECONDS")
    d = sub.add_parser("drop", help="evict all clean cached data (a cold cache on demand)")
    d.add_argument("mountpoint", metavar="MOUNTPOINT")
    d.add_argument("--json", action="store_true", help="machine-readable output")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "stats":
            return cmd_stats(args)
        return cmd_drop(args)
    except UserError as exc:
        print(f"cachefs-ctl: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def cmd_stats(args: argparse.Namespace) -> int:
    if args.watch is not None and args.watch <= 0:
        raise UserError("--watch needs a positive number of seconds.")
    while True:
        stats = client.request(args.mountpoint, "stats")["stats"]
        if args.json:
            print(json.dumps(stats, indent=None if args.watch else 2), flush=True)
        else:
            print(render(stats), flush=True)
        if args.watch is None:
            return 0
        time.sleep(args.watch)


def render(s: dict) -> str:
    used, size = s["cache_used"], s["cache_size"]
    rows = [
        ("mount", f"{s['mountpoint']} <- {s['backing']} ({s['mode']})"),
        ("cache", f"{s['cache_dir']}: {format_size(used)} of {format_size(size)} used "
                  f"({100 * used / size if size else 0:.1f} %), {s['extents_cached']} extents "
                  f"in {s['files_cached']} files"),
        ("reads", f"{s['read_ops']} ops, {format_size(s['read_bytes'])}; hit ratio "
                  f"{100 * s['hit_ratio']:.1f} % ({100 * s['byte_hit_ratio']:.1f} % of bytes)"),
        ("  from SSD", f"{s['hit_ops']} ops, {format_size(s['hit_bytes'])}"),
        ("  from BACKING", f"{s['miss_ops']} ops, {format_size(s['miss_bytes'])}"),
        ("  sequential bypass", f"{s['bypass_ops']} ops, {format_size(s['bypass_bytes'])}"),
        ("writes", f"{s['write_ops']} ops, {format_size(s['write_bytes'])}"),
        ("promotions", f"{s['promotions']} (+{s['promotions_dropped']} dropped), "
                       f"evictions {s['evictions']}"),
        ("coherence", f"{s['stale_files']} files changed behind the cache"),
        ("errors", f"BACKING {s['backing_errors']}, cache {s['cache_errors']}"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def cmd_drop(args: argparse.Namespace) -> int:
    res = client.request(args.mountpoint, "drop", timeout_s=120)
    if args.json:
        print(json.dumps(res))
    else:
        print(f"dropped {res['dropped_extents']} clean extents "
              f"({format_size(res['dropped_bytes'])})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
