"""Turning command-line and fstab options into a Config (shared by `cachefs` and
`mount.cachefs`)."""

from __future__ import annotations

import argparse
import math
import os

from cachefs import mounttable, preflight
from cachefs.config import (Config, default_cache_dir, format_address, parse_address,
                            parse_share, parse_size)
from cachefs.errors import UserError

# -o names understood by cachefs itself (fstab form); everything else goes to FUSE.
_O_NAMES = {
    "cache_dir": "cache_dir", "mode": "mode", "cache_size": "cache_size",
    "promote_after": "promote_after", "sequential_cutoff": "sequential_cutoff",
    "dirty_high": "dirty_high", "dirty_low": "dirty_low", "max_dirty_age": "max_dirty_age",
    "attr_timeout": "attr_timeout", "backing_timeout": "backing_timeout",
    "eviction": "eviction", "promote_all_below": "promote_all_below",
    "max_pinned": "max_pinned", "stats_group": "stats_group",
    "metrics": "metrics", "scrub_interval": "scrub_interval", "scrub_rate": "scrub_rate",
}
# mount(8) and systemd options that mean nothing to FUSE.
_IGNORED = {"defaults", "rw", "auto", "noauto", "user", "users", "nouser", "_netdev", "nofail",
            "exec", "async"}


def add_mount_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("backing", metavar="BACKING", help="the slow directory to cache")
    p.add_argument("mountpoint", metavar="MOUNTPOINT", help="where the cached view appears")
    p.add_argument("--cache-dir", help="cache directory on the fast disk "
                   "(default: one per BACKING under /var/cache/cachefs)")
    p.add_argument("--mode", help="write-through (default) or write-back")
    p.add_argument("--cache-size", help="cache pool size, e.g. 512M or 20G "
                   "(default: leave the cache filesystem 10%% free)")
    p.add_argument("--promote-after", help="reads of an extent before it is cached (default 2)")
    p.add_argument("--promote-all-below", metavar="PERCENT",
                   help="while the pool is less full than this, every miss is cached at once, "
                   "sequential streams too; --promote-after and --sequential-cutoff apply "
                   "above it (default 90%%; 0 always applies them)")
    p.add_argument("--sequential-cutoff", help="sequential streams longer than this bypass "
                   "the cache (default 4M; 0 disables)")
    p.add_argument("--dirty-high", help="write-back: dirty data above which writers are slowed")
    p.add_argument("--dirty-low", help="write-back: dirty data below which writers run free")
    p.add_argument("--max-dirty-age", metavar="DURATION", help="write-back: how long data "
                   "may stay only on the SSD (seconds, or with s, m, h, d; default 30)")
    p.add_argument("--attr-timeout", metavar="DURATION", help="how long the kernel caches "
                   "attributes (seconds, or with a unit; default 1)")
    p.add_argument("--backing-timeout", metavar="DURATION", help="how long before a stalled "
                   "BACKING read fails with EIO (seconds, or with a unit; default 60)")
    p.add_argument("--eviction", help="eviction policy: s3-fifo (default) or clock "
                   "(an LRU approximation, for comparisons)")
    p.add_argument("--max-pinned", help="share of the pool pinned files may hold "
                   "(cachefs-ctl pin), e.g. 25%% (default 50%%)")
    p.add_argument("--scrub-interval", metavar="DURATION", help="check every cached block "
                   "against its checksum in the background this often (seconds, or with s, "
                   "m, h, d; default 7d; 0 never), also across remounts")
    p.add_argument("--scrub-rate", metavar="SIZE", help="how fast the background scrub reads "
                   "the cache, per second (default 16M)")
    p.add_argument("--stats-group", metavar="GROUP", help="members of GROUP may read "
                   "statistics (cachefs-ctl stats, top) without root; changes stay for root "
                   "and the mount's owner")
    p.add_argument("--metrics", metavar="ADDR", help="serve Prometheus metrics over HTTP at "
                   "ADDR: PORT (on 127.0.0.1), HOST:PORT or [IPv6]:PORT; no authentication, "
                   "so keep it on loopback unless the network is trusted (default: off)")
    p.add_argument("-f", "--foreground", action="store_true", help="stay in the foreground")
    p.add_argument("-o", dest="options", action="append", default=[], metavar="OPTIONS",
                   help="comma-separated cachefs (name=value) or FUSE mount options")
    p.add_argument("--debug", action="store_true", help="log every FUSE request with its "
                   "result and duration (DEBUG lines `trace ...`; -o debug adds libfuse's "
                   "raw trace on stderr)")
    p.add_argument("--no-passthrough", dest="passthrough", action="store_false",
                   help="never answer an open with FUSE passthrough (by default a read-only "
                   "open of a fully cached file is served by the kernel from the cache file "
                   "when the kernel, libfuse and privileges allow it; -o no_passthrough)")
    p.add_argument("--passthrough-odirect", action="store_true",
                   help="let read-only O_DIRECT opens of fully cached files use FUSE "
                   "passthrough also where BACKING accepts unaligned direct I/O (NFS, FUSE): "
                   "such reads must then be aligned as on a local disk, or fail with EINVAL "
                   "(-o passthrough_odirect)")
    p.add_argument("--discard-dirty", action="store_true",
                   help="when the cache directory's database is damaged, missing or "
                   "unreadable, move the damaged state aside (damaged-TIME/ in the cache "
                   "directory) and start cold, although it may have held dirty write-back "
                   "data not yet in BACKING; without it such a mount is refused")
    p.add_argument("--no-read-checksums", dest="read_checksums", action="store_false",
                   help="do not check blocks' checksums on the daemon's cache hits (they are "
                   "still kept, and checked by the destager and `cachefs-ctl verify`); for "
                   "measuring what the check costs (-o no_read_checksums)")
    p.add_argument("--no-fast-hits", dest="fast_hits", action="store_false",
                   help="answer every cache hit in the Python read handler, not 4 KiB ones "
                   "in C first; for comparisons (-o no_fast_hits)")
    p.add_argument("--check-invariants", action="store_true", help="after every change of "
                   "the extent map, check the invariants of docs/concurrency.md (costs CPU; "
                   "for tests and bug hunts: a violation stops the daemon with the reason)")


def _number(value: str, what: str, kind=float) -> float:
    try:
        n = kind(value)
    except ValueError:
        raise UserError(f"{what} {value!r} is not a number.") from None
    if not math.isfinite(n):
        raise UserError(f"{what} {value!r} is not a finite number.")
    return n


_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(value: str, what: str) -> float:
    """Seconds, or a number with ms, s, m, h or d."""
    text = value.strip().lower()
    unit = next((u for u in ("ms", "s", "m", "h", "d") if text.endswith(u)), None)
    try:
        n = float(text[:-len(unit)] if unit else text)
    except ValueError:
        n = math.nan
    if not math.isfinite(n):
        raise UserError(f"{what} {value!r} is not a duration; give seconds, or a number "
                        "with ms, s, m, h or d (30s, 5m, 7d).")
    if n < 0:
        raise UserError(f"{what} {value!r} is negative; give a duration such as 30s or 5m.")
    seconds = n * _UNITS[unit or "s"]
    if not math.isfinite(seconds):
        raise UserError(f"{what} {value!r} is not a finite duration; give one such as 30s "
                        "or 7d.")
    return seconds


# FUSE options cachefs sets itself: given, the mount failed after `cachefs mount` had said
# it was ready (max_read: libfuse ends the session at INIT) or stopped being cachefs's to
# the tools (subtype, fsname: `cachefs umount`, cachefs-ctl and the clearing of a dead
# mount look for fuse.cachefs).
_OURS = {
    "max_read": "cachefs sets the size of FUSE requests itself (libfuse refuses the mount "
                "at its start when this is given).",
    "subtype": "the mount's type is always fuse.cachefs (its tools find their mounts by it).",
    "fsname": "the mount's source is always BACKING's path.",
}


def _absolute(path: str) -> str:
    """`path` absolute. `..` after a symlink is the symlink's target's parent, as the kernel
    takes it: os.path.abspath dropped `link/..` by its text, and `cachefs mount x/link/..`
    served and wrote into x instead of the directory named (a helper's hunt)."""
    try:
        cwd = os.getcwd()
    except FileNotFoundError:
        if not path.startswith("/"):
            raise UserError(f"{path} is relative and the current directory no longer exists; "
                            "give absolute paths.") from None
        cwd = "/"
    if ".." in path.split("/"):
        return mounttable.resolve(path if path.startswith("/") else os.path.join(cwd, path))
    return os.path.normpath(os.path.join(cwd, path))


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def _gather(args: argparse.Namespace) -> tuple[dict[str, str], list[str]]:
    """cachefs values from flags and -o (each named once, none empty) and the FUSE options.

    Raises UserError for an empty value (`--mode ''`, `-o mode=`) and for a cachefs option
    given twice in -o or both as a flag and in -o: silently picking one would mount with a
    setting the operator did not mean.
    """
    values: dict[str, str] = {}
    for key in _O_NAMES.values():
        value = getattr(args, key, None)
        if value is not None:
            if not value.strip():
                raise UserError(f"{_flag(key)} needs a value.")
            values[key] = value
    fuse = []
    for group in args.options:
        for opt in filter(None, group.split(",")):
            name, _, value = opt.partition("=")
            key = _O_NAMES.get(name.replace("-", "_"))
            if key:
                if not value.strip():
                    raise UserError(f"-o {name} needs a value ({name}=...).")
                if key == "cache_dir" and not os.path.isabs(value):
                    # fstab's form: mount(8) runs from any directory (at boot, /), so a
                    # relative one named another, cold cache at each (a helper's hunt).
                    raise UserError(f"-o {name}={value} is a relative path; give the cache "
                                    "directory as an absolute path (mount(8) and fstab run "
                                    "from any directory).")
                if key in values:
                    raise UserError(f"{_flag(key)} is given twice (-o {name}={value} and "
                                    f"{values[key]!r}); give it once.")
                values[key] = value
            elif name in _OURS:
                raise UserError(f"-o {name} cannot be given: {_OURS[name]}")
            elif name not in _IGNORED and not name.startswith(("x-", "comment=")):
                fuse.append(opt)
    return values, fuse


def config_from_args(args: argparse.Namespace) -> Config:
    """Merge flags and -o options into a Config; raises UserError on a bad value."""
    values, fuse = _gather(args)
    no_passthrough = "no_passthrough" in fuse
    odirect = "passthrough_odirect" in fuse
    no_read_sums = "no_read_checksums" in fuse
    no_fast_hits = "no_fast_hits" in fuse
    fuse = [o for o in fuse if o not in ("no_passthrough", "passthrough_odirect",
                                         "no_read_checksums", "no_fast_hits")]
    for what, path in (("BACKING", args.backing), ("MOUNTPOINT", args.mountpoint)):
        if not path.strip():
            raise UserError(f"{what} is empty; give a directory.")
    backing = _absolute(args.backing)
    if not values.get("cache_dir"):
        preflight.stranded_elsewhere(backing, default_cache_dir(backing))
    kw = dict(
        backing=backing,
        mountpoint=_absolute(args.mountpoint),
        cache_dir=_absolute(values.get("cache_dir") or default_cache_dir(backing)),
        foreground=bool(getattr(args, "foreground", False)),
        fuse_options=tuple(fuse),
        debug=bool(getattr(args, "debug", False)),
        check_invariants=bool(getattr(args, "check_invariants", False)),
        passthrough=bool(getattr(args, "passthrough", True)) and not no_passthrough,
        passthrough_odirect=bool(getattr(args, "passthrough_odirect", False)) or odirect,
        read_checksums=bool(getattr(args, "read_checksums", True)) and not no_read_sums,
        fast_hits=bool(getattr(args, "fast_hits", True)) and not no_fast_hits,
        discard_dirty=bool(getattr(args, "discard_dirty", False)),
    )
    if "mode" in values:
        kw["mode"] = values["mode"]
    if "cache_size" in values:
        kw["cache_size"] = parse_size(values["cache_size"], "--cache-size")
    if "promote_after" in values:
        kw["promote_after"] = int(_number(values["promote_after"], "--promote-after", int))
    if "sequential_cutoff" in values:
        kw["sequential_cutoff"] = parse_size(values["sequential_cutoff"], "--sequential-cutoff")
    if "dirty_high" in values:
        kw["dirty_high"] = parse_size(values["dirty_high"], "--dirty-high")
    if "dirty_low" in values:
        kw["dirty_low"] = parse_size(values["dirty_low"], "--dirty-low")
    if "max_dirty_age" in values:
        kw["max_dirty_age_s"] = parse_duration(values["max_dirty_age"], "--max-dirty-age")
    if "eviction" in values:
        kw["eviction"] = values["eviction"]
    if "promote_all_below" in values:
        kw["promote_all_below"] = parse_share(values["promote_all_below"],
                                              "--promote-all-below") / 100
    if "max_pinned" in values:
        kw["max_pinned_pct"] = parse_share(values["max_pinned"], "--max-pinned")
    if "stats_group" in values:
        kw["stats_group"] = values["stats_group"].strip()
    if "metrics" in values:
        kw["metrics"] = parse_address(values["metrics"], "--metrics")
    if "attr_timeout" in values:
        t = parse_duration(values["attr_timeout"], "--attr-timeout")
        kw["attr_timeout_s"] = kw["entry_timeout_s"] = t
    if "backing_timeout" in values:
        kw["backing_timeout_s"] = parse_duration(values["backing_timeout"],
                                                 "--backing-timeout")
    if "scrub_interval" in values:
        kw["scrub_interval_s"] = parse_duration(values["scrub_interval"], "--scrub-interval")
    if "scrub_rate" in values:
        kw["scrub_rate"] = parse_size(values["scrub_rate"], "--scrub-rate")
    cfg = Config(**kw)
    cfg.validate()
    return cfg


def config_to_argv(cfg: Config) -> list[str]:
    """The `cachefs mount -f` command line that runs this Config as a daemon."""
    argv = ["mount", "-f", "--cache-dir", cfg.cache_dir, "--mode", cfg.mode,
            "--promote-after", str(cfg.promote_after),
            "--sequential-cutoff", str(cfg.sequential_cutoff),
            "--promote-all-below", repr(cfg.promote_all_below * 100),
            "--max-dirty-age", repr(cfg.max_dirty_age_s),
            "--attr-timeout", repr(cfg.attr_timeout_s),
            "--backing-timeout", repr(cfg.backing_timeout_s), "--eviction", cfg.eviction,
            "--max-pinned", f"{cfg.max_pinned_pct:g}%",
            "--scrub-interval", repr(cfg.scrub_interval_s), "--scrub-rate", str(cfg.scrub_rate)]
    if cfg.cache_size is not None:
        argv += ["--cache-size", str(cfg.cache_size)]
    if cfg.dirty_high is not None:
        argv += ["--dirty-high", str(cfg.dirty_high)]
    if cfg.dirty_low is not None:
        argv += ["--dirty-low", str(cfg.dirty_low)]
    if cfg.stats_group is not None:
        argv += ["--stats-group", cfg.stats_group]
    if cfg.metrics is not None:
        argv += ["--metrics", format_address(cfg.metrics)]
    if cfg.fuse_options:
        argv += ["-o", ",".join(cfg.fuse_options)]
    if cfg.debug:
        argv.append("--debug")
    if cfg.check_invariants:
        argv.append("--check-invariants")
    if not cfg.passthrough:
        argv.append("--no-passthrough")
    if cfg.passthrough_odirect:
        argv.append("--passthrough-odirect")
    if not cfg.read_checksums:
        argv.append("--no-read-checksums")
    if not cfg.fast_hits:
        argv.append("--no-fast-hits")
    if cfg.discard_dirty:
        argv.append("--discard-dirty")
    return argv + [cfg.backing, cfg.mountpoint]
