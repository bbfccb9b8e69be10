"""`cachefs-ctl stats|metrics|top|flush|drop|prefetch|pin|unpin`: inspect and steer a running
cachefs mount."""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import sys
import time

from cachefs import mounttable
from cachefs.config import EXT_SIZE, format_size
from cachefs.errors import UserError

from . import client
from .statsview import render


def _bar(**kwargs):
    """A progress bar (tqdm, imported here: `cachefs-ctl stats` starts without it)."""
    import tqdm
    return tqdm.tqdm(**kwargs)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cachefs-ctl", description="Inspect and steer a "
                                "running cachefs mount.")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("stats", help="cache statistics: this mount's and lifetime totals")
    s.add_argument("mountpoint", metavar="MOUNTPOINT")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.add_argument("--watch", type=float, metavar="SECONDS", help="repeat every SECONDS")
    s.add_argument("--plot", metavar="FILE.png", help="draw hit ratio, IOPS, latency "
                   "percentiles and dirty bytes over time from the daemon's history")
    s.add_argument("--window", metavar="DURATION", help="the span --plot draws: 30s, 10m, 1h "
                   "(default), 1d at most (per-second samples up to an hour, per-minute beyond)")
    m = sub.add_parser("metrics", help="Prometheus exposition text (for node_exporter's "
                       "textfile collector)")
    m.add_argument("mountpoint", metavar="MOUNTPOINT")
    t = sub.add_parser("top", help="a live view: rates, hit ratio, occupancy, dirty data, "
                       "flow control, drops and errors, redrawn every interval (plain lines "
                       "when not on a terminal)")
    t.add_argument("mountpoint", metavar="MOUNTPOINT")
    t.add_argument("--interval", type=float, default=1.0, metavar="SECONDS",
                   help="seconds between polls (default 1)")
    t.add_argument("--count", type=int, metavar="N", help="stop after N screens (plain mode: "
                   "N-1 lines, since rates need two polls)")
    f = sub.add_parser("flush", help="destage every dirty byte to BACKING, with progress")
    f.add_argument("mountpoint", metavar="MOUNTPOINT")
    f.add_argument("--timeout", type=float, metavar="SECONDS", help="give up after SECONDS")
    f.add_argument("--json", action="store_true", help="machine-readable output, no bar")
    d = sub.add_parser("drop", help="evict all clean cached data (a cold cache on demand); "
                       "pinned files keep theirs")
    d.add_argument("mountpoint", metavar="MOUNTPOINT")
    d.add_argument("--pinned", action="store_true", help="drop pinned data too, and the pins")
    d.add_argument("--json", action="store_true", help="machine-readable output")
    v = sub.add_parser("verify", help="check cached blocks against their checksums (all, or "
                       "those of the named files and trees), with progress")
    v.add_argument("mountpoint", metavar="MOUNTPOINT")
    v.add_argument("paths", metavar="PATH", nargs="*", help="files or directories under it")
    v.add_argument("--against-backing", action="store_true", help="also compare clean "
                   "blocks with BACKING's bytes (reads BACKING)")
    v.add_argument("--json", action="store_true", help="machine-readable output, no bar")
    for name, text in (("prefetch", "load files or directory trees into the cache now"),
                       ("pin", "keep files or directory trees resident (and load them now)"),
                       ("unpin", "let pinned files be evicted again")):
        c = sub.add_parser(name, help=text)
        c.add_argument("paths", metavar="PATH", nargs="+", help="a path under a cachefs mount")
        c.add_argument("--json", action="store_true", help="machine-readable output, no bar")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "stats":
            return cmd_stats(args)
        if args.command == "metrics":
            return cmd_metrics(args)
        if args.command == "flush":
            return cmd_flush(args)
        if args.command == "top":
            from . import top
            if not 0 < args.interval < 86400 * 365:
                raise UserError("--interval needs a positive number of seconds.")
            return top.run(args.mountpoint, args.interval, args.count)
        if args.command in ("prefetch", "pin", "unpin"):
            return cmd_warm(args)
        if args.command == "verify":
            return cmd_verify(args)
        return cmd_drop(args)
    except UserError as exc:
        print(f"cachefs-ctl: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:             # `cachefs-ctl stats --json | head`: the reader left
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141                      # as a shell reports SIGPIPE


def cmd_metrics(args: argparse.Namespace) -> int:
    """The text the mount's --metrics endpoint serves, from the same snapshot (as JSON)."""
    from cachefs.metrics import exposition     # prometheus_client: only for this command
    stats = client.request(args.mountpoint, "stats")["stats"]
    sys.stdout.buffer.write(exposition(stats))
    return 0


def _rendered(stats: dict, mountpoint: str) -> str:
    """The table of `stats`; a daemon of an older cachefs (still running after the package
    was upgraded) lacks counters the table shows: a sentence, not a traceback."""
    try:
        return render(stats)
    except KeyError as exc:
        raise UserError(f"the daemon of {mountpoint} runs an older cachefs, which does not "
                        f"report {exc.args[0]!r}: `cachefs-ctl stats --json {mountpoint}` "
                        "shows what it reports (a remount runs this version).") from None


def cmd_stats(args: argparse.Namespace) -> int:
    if args.watch is not None and not 0 < args.watch < 86400 * 365:
        raise UserError("--watch needs a positive number of seconds.")
    if args.plot is not None:
        return cmd_plot(args)
    if args.window is not None:
        raise UserError("--window is the span of a --plot; give --plot FILE.png with it.")
    while True:
        stats = client.request(args.mountpoint, "stats")["stats"]
        if args.json:
            print(json.dumps(stats, indent=None if args.watch else 2), flush=True)
        else:
            print(_rendered(stats, args.mountpoint), flush=True)
        if args.watch is None:
            return 0
        time.sleep(args.watch)


DURATION_UNITS = {"s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400}
MAX_PLOT_WINDOW_S = 86400


def parse_duration(text: str) -> float:
    """'30s', '10m', '1h', '1d' (or plain seconds) -> seconds, up to a day."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(s|m|min|h|d)?\s*", text)
    seconds = float(m.group(1)) * DURATION_UNITS[m.group(2) or "s"] if m else 0
    if not 1 <= seconds <= MAX_PLOT_WINDOW_S:
        raise UserError(f"--window takes a duration from 1s to 1d like 30s, 10m, 1h or 1d, "
                        f"not {text!r}.")
    return seconds


def cmd_plot(args: argparse.Namespace) -> int:
    """Fetch the history of the last --window and draw it (cli/plot.py) into --plot."""
    if not args.plot.strip() or os.path.isdir(args.plot):
        raise UserError(f"--plot needs a file name such as history.png (got {args.plot!r}).")
    if not os.path.splitext(args.plot)[1]:
        args.plot += ".png"             # what matplotlib writes for a name without a type
    if args.watch is not None:
        raise UserError("--plot draws once; it does not go with --watch.")
    window_s = parse_duration(args.window or "1h")
    history = client.request(args.mountpoint, "history", window=window_s)["history"]
    s = client.request(args.mountpoint, "stats")["stats"]
    from . import plot
    span = args.window or "1h"
    title = f"cachefs {s['mountpoint']} <- {s['backing']} ({s['mode']}), last {span}"
    try:
        n = plot.draw(history, args.plot, title)
    except OSError as exc:
        raise UserError(f"cannot write {args.plot}: {exc.strerror or exc}.") from None
    except ValueError as exc:
        raise UserError(f"cannot write {args.plot}: {exc}.") from None
    if args.json:
        print(json.dumps({"plot": args.plot, "samples": n, "window_s": window_s,
                          "step_s": history["step_s"]}))
    else:
        print(f"wrote {args.plot} ({n} samples, one every {history['step_s']:g} s, "
              f"over the last {span})")
    return 0


def cmd_flush(args: argparse.Namespace) -> int:
    if args.timeout is not None and args.timeout <= 0:
        raise UserError("--timeout needs a positive number of seconds.")
    start = client.request(args.mountpoint, "stats")["stats"]
    bar = None
    if not args.json:
        bar = _bar(total=start["dirty_bytes"], unit="B", unit_scale=True,
                        unit_divisor=1024, desc="destaging", file=sys.stderr,
                        disable=start["dirty_bytes"] == 0)
    done = [0]

    def on_progress(p: dict) -> None:
        if bar is None:
            return
        left = p["dirty_bytes"]
        if left > bar.total:                 # writers keep adding: grow the total
            bar.total = bar.n + left
        bar.update(max(0, bar.total - left - bar.n))
        done[0] = bar.n

    try:
        client.request(args.mountpoint, "flush", timeout_s=None, on_progress=on_progress,
                       timeout=args.timeout)
        if bar is not None:
            bar.update(bar.total - bar.n)     # done: the last report may predate the end
        end = client.request(args.mountpoint, "stats")["stats"]
    except UserError:
        if mounttable.is_cachefs(mounttable.resolve(args.mountpoint)):
            raise
        raise UserError(f"{args.mountpoint} was unmounted during the flush; what was still "
                        "dirty stays in its cache directory and is destaged after the next "
                        "mount.") from None
    finally:
        if bar is not None:
            bar.close()
    moved = end["destaged_bytes"] - start["destaged_bytes"]
    if args.json:
        print(json.dumps({"flushed_bytes": moved, "dirty_bytes": end["dirty_bytes"]}))
    else:
        print(f"flushed {format_size(moved)}; nothing is dirty")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    """Exit 0 when every checked block is sound, 1 when anything was wrong."""
    mnt = os.path.realpath(args.mountpoint)
    rels = []
    for path in args.paths:
        if not os.path.lexists(path):
            raise UserError(_missing(path))
        real = os.path.realpath(path)
        if real != mnt and not real.startswith(mnt.rstrip("/") + "/"):
            raise UserError(f"{path} is not under the mount {args.mountpoint}.")
        rels.append(os.path.relpath(real, mnt))
    bar = None

    def on_progress(p: dict) -> None:
        nonlocal bar
        if bar is None:
            bar = _bar(total=p["total_bytes"], unit="B", unit_scale=True,
                            unit_divisor=1024, desc="verifying", file=sys.stderr,
                            disable=args.json or not sys.stderr.isatty())
        bar.total = max(bar.total, p["total_bytes"])
        bar.update(max(0, p["done_bytes"] - bar.n))

    request = {"against_backing": args.against_backing}
    if rels:
        request["paths"] = rels
    try:
        res = client.request(args.mountpoint, "verify", timeout_s=None, on_progress=on_progress,
                             **request)
    finally:
        if bar is not None:
            bar.close()
    res.pop("ok", None)
    wrong = (res["damaged_clean_blocks"] + res["damaged_dirty_blocks"] + res["stale_blocks"]
             + len(res["lost"]))
    if args.json:
        print(json.dumps(res))
        return 1 if wrong else 0
    print(f"verified {format_size(res['checked_bytes'])} in {res['blocks_checked']} blocks of "
          f"{res['files']} files ({res['checksums_taken']} blocks had no checksum yet and "
          "got one)")
    if not wrong:
        print("every checked block is sound")
        return 0
    if res["damaged_clean_blocks"]:
        print(f"{res['damaged_clean_blocks']} clean blocks failed their checksums: dropped "
              "(BACKING has them)")
    if res["stale_blocks"]:
        print(f"{res['stale_blocks']} clean blocks differed from BACKING: dropped")
    if res["damaged_dirty_blocks"] or res["lost"]:
        print(f"{res['damaged_dirty_blocks']} dirty blocks failed their checksums now; dirty "
              "data damaged on the SSD (not in BACKING, reads of it fail with EIO):")
        for lost in res["lost"]:
            print(f"  {lost['path']} at offset {lost['offset']}")
    return 1


def cmd_drop(args: argparse.Namespace) -> int:
    res = client.request(args.mountpoint, "drop", timeout_s=120, pinned=args.pinned)
    if args.json:
        print(json.dumps(res))
    elif args.pinned:
        print(f"dropped {res['dropped_extents']} clean extents "
              f"({format_size(res['dropped_bytes'])}), {res['dropped_pinned_extents']} of them "
              "pinned; nothing is pinned now")
    else:
        kept = (f"; {res['pinned_files']} pinned files keep "
                f"{format_size(res['pinned_bytes'])} (drop --pinned drops them too)"
                if res["pinned_files"] else "")
        held = res.get("kept_passthrough_extents", 0)
        if held:
            kept += (f"; {held} extents ({format_size(held * EXT_SIZE)}) of files the kernel "
                     "reads in passthrough are kept")
        print(f"dropped {res['dropped_extents']} clean extents "
              f"({format_size(res['dropped_bytes'])}){kept}")
    return 0


def cachefs_mounts() -> list[str]:
    """Mountpoints of FUSE filesystems (cachefs ones answer the control xattr)."""
    return [mnt for mnt, fstype in mounttable.mounts() if fstype.startswith("fuse")]


def _missing(path: str) -> str:
    """Why `path` cannot be found: it does not exist, or a mount on its way is dead."""
    try:
        os.lstat(path)
    except OSError as exc:
        if exc.errno == errno.ENOTCONN:
            return (f"{path} is on a dead FUSE mount (its daemon is gone); run cachefs umount "
                    "on its mountpoint.")
    return f"{path} does not exist."


def locate(paths: list[str]) -> dict[str, list[str]]:
    """Group paths by the cachefs mount holding them: {mountpoint: [relative paths]}.
    Raises UserError (exit 2) for a path that is missing or not under a cachefs mount."""
    mounts = cachefs_mounts()
    groups: dict[str, list[str]] = {}
    for path in paths:
        if not os.path.lexists(path):
            raise UserError(_missing(path))
        real = os.path.realpath(path)
        inside = [m for m in mounts if real == m or real.startswith(m.rstrip("/") + "/")]
        mnt = max(inside, key=len, default=None)
        if mnt is None:
            raise UserError(f"{path} is not inside a cachefs mount (prefetch, pin and unpin "
                            "take files or directories under a mountpoint).")
        client.control_path(mnt)                 # a sentence if that FUSE mount is not ours
        groups.setdefault(mnt, []).append(os.path.relpath(real, mnt))
    return groups


def cmd_warm(args: argparse.Namespace) -> int:
    """prefetch, pin, unpin: one request per mount; exit 0 only if everything was loaded."""
    groups = locate(args.paths)
    answers = {}
    ok = True
    for mnt, rels in groups.items():
        bar = None

        def on_progress(p: dict) -> None:
            nonlocal bar
            if bar is None:
                bar = _bar(total=p["total_bytes"], unit="B", unit_scale=True,
                                unit_divisor=1024, desc=args.command, file=sys.stderr,
                                disable=args.json or not sys.stderr.isatty())
            bar.total = p["total_bytes"]
            bar.update(max(0, p["done_bytes"] - bar.n))

        try:
            res = client.request(mnt, args.command, timeout_s=None, on_progress=on_progress,
                                 paths=rels)
        finally:
            if bar is not None:
                bar.close()
        res.pop("ok", None)
        answers[mnt] = res
        if args.command == "unpin":
            if not args.json:
                print(f"{mnt}: unpinned {res['unpinned_files']} files; "
                      f"{res['pinned_files']} files stay pinned")
            continue
        if res["missing_bytes"] or res["errors"]:
            ok = False
            print(f"cachefs-ctl: {mnt}: {res['message']}", file=sys.stderr)
        elif not args.json:
            extra = (f"; pinned {res['pinned_new']} files, {res['pinned_files']} in all "
                     f"({format_size(res['pinned_bytes'])} resident, limit "
                     f"{format_size(res['pinned_limit'])})" if args.command == "pin" else "")
            print(f"{mnt}: {format_size(res['total_bytes'])} in {res['files']} file(s) cached "
                  f"({format_size(res['loaded_bytes'])} loaded now){extra}")
    if args.json:
        print(json.dumps(answers[next(iter(answers))] if len(answers) == 1 else answers))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
