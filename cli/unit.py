"""`cachefs install-unit NAME BACKING MOUNTPOINT [mount options]`: a persistent mount under
systemd.

Owns the text of the `cachefs@.service` template (systemd/cachefs@.service is this text with
`/usr/bin/env cachefs`; a test keeps the two equal) and the files the install step writes:
/etc/cachefs/NAME.conf (the mount's paths and options), the template with ExecStart= pointing
at the cachefs that ran the install, and the drop-in cachefs@NAME.service.d/cachefs.conf
holding what the template cannot know: RequiresMountsFor= BACKING, the cache directory and
the mountpoint's parent, so that the unit starts after those mounts and stops (draining
write-back data) before they go. Never touches a mount.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from typing import Callable

from cachefs import preflight
from cachefs.errors import UserError

from .options import _O_NAMES, _flag, _gather, add_mount_arguments, config_from_args

TEMPLATE_NAME = "cachefs@.service"
SHIPPED_EXEC = "/usr/bin/env cachefs"
STOP_TIMEOUT = "1d"

TEMPLATE = """\
# cachefs@NAME.service: a persistent cachefs mount configured in /etc/cachefs/NAME.conf
# (BACKING, MOUNTPOINT, CACHEFS_OPTIONS; see example.conf). Install with
#   cachefs install-unit NAME BACKING MOUNTPOINT [mount options]
# which writes that file, this template (ExecStart= pointing at the cachefs it ran from) and
# the drop-in cachefs@NAME.service.d/cachefs.conf with RequiresMountsFor= BACKING, the cache
# directory and the mountpoint's parent (the template cannot know them), then enables it.
# Type=notify: the unit is active only once the mount is usable. A long start (loading the
# map of a large pool, destaging write-back data before a write-through mount) reports its
# progress (EXTEND_TIMEOUT_USEC): systemd waits while it moves, past TimeoutStartSec=, and
# gives up after 120 s without progress. Exit status 2 is a mistake in the configuration
# (a sentence in the journal): no restart until it is fixed.
# Stop: `cachefs umount --flush` destages every dirty byte of a write-back mount before
# unmounting, which takes dirty bytes / destage rate, so a stop (and a shutdown) may wait up
# to TimeoutStopSec= for it. A flush that stops making progress (BACKING failing) gives up by
# itself; the daemon is then stopped by SIGTERM and its dirty data stays safe on the SSD, to
# be destaged at the next mount. See docs/operations.md, "systemd".
[Unit]
Description=cachefs SSD cache mount %i
After=network-online.target remote-fs.target local-fs.target
Wants=network-online.target

[Service]
Type=notify
NotifyAccess=main
EnvironmentFile=/etc/cachefs/%i.conf
ExecStart={exec} mount -f $CACHEFS_OPTIONS ${{BACKING}} ${{MOUNTPOINT}}
ExecStop={exec} umount --flush ${{MOUNTPOINT}}
TimeoutStopSec={stop_timeout}
Restart=on-failure
RestartSec=5
RestartPreventExitStatus=2

[Install]
WantedBy=multi-user.target
"""

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
# Characters systemd or its environment files would interpret (quotes, escapes, variables,
# word splitting) have no place in the paths and options we write.
_UNSAFE = re.compile(r"[\s\"'\\$`;]")
_TIMESPAN = re.compile(r"infinity|(\d+(\.\d+)?\s*(us|ms|s|sec|min|m|h|hr|d|w)?\s*)+")


def render_template(exec_cmd: str, stop_timeout: str = STOP_TIMEOUT) -> str:
    """The cachefs@.service text that runs `exec_cmd` (an absolute path, or
    '/usr/bin/env cachefs' as shipped)."""
    return TEMPLATE.format(exec=exec_cmd, stop_timeout=stop_timeout)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", metavar="NAME", help="the instance: cachefs@NAME.service, "
                   "/etc/cachefs/NAME.conf")
    add_mount_arguments(p)
    p.add_argument("--root", default="/", metavar="DIR", help="write the files under DIR "
                   "(DIR/etc/...) and leave systemctl alone (for images and tests)")
    p.add_argument("--stop-timeout", default=STOP_TIMEOUT, metavar="TIMESPAN",
                   help="how long a stop may drain write-back data before the daemon is "
                   "stopped with its dirty data kept on the SSD, e.g. 30min, 1d, infinity "
                   f"(default {STOP_TIMEOUT})")
    p.add_argument("--now", action="store_true", help="also start the unit")


def cachefs_executable() -> str:
    """The absolute path of the `cachefs` script of this installation."""
    for folder in (sysconfig.get_path("scripts"), os.path.dirname(os.path.abspath(
            sys.executable))):
        path = os.path.join(folder, "cachefs")
        if os.access(path, os.X_OK):
            return path
    path = shutil.which("cachefs")
    if path is None:
        raise UserError("the cachefs command is not installed where systemd can run it "
                        "(pip install the cachefs package first).")
    return os.path.abspath(path)


def _check_word(what: str, text: str) -> str:
    if _UNSAFE.search(text):
        raise UserError(f"{what} {text!r} contains a space, quote, backslash, '$', '`' or "
                        "';', which a systemd unit cannot carry; choose a plainer path.")
    return text


def _mount_options(args: argparse.Namespace, cache_dir: str) -> list[str]:
    """The `cachefs mount` options the operator gave, as words (--cache-dir always)."""
    values, fuse = _gather(args)
    words = ["--cache-dir", cache_dir]
    for key in dict.fromkeys(_O_NAMES.values()):
        if key in values and key != "cache_dir":
            words += [_flag(key), values[key]]
    if fuse:
        words += ["-o", ",".join(fuse)]
    if args.debug:
        words.append("--debug")
    for w in words:
        _check_word("the mount option", w)
    return words


def _same_path(a: str | None, b: str) -> bool:
    """The same directory, symlinks followed (a link to another unit's mountpoint was taken
    for a new one: a helper's hunt)."""
    return a is not None and (a == b or os.path.realpath(a) == os.path.realpath(b))


def _conf_values(path: str) -> dict[str, str]:
    out = {}
    try:
        with open(path) as f:
            for line in f:
                key, sep, value = line.strip().partition("=")
                if sep and not key.startswith("#"):
                    out[key.strip()] = value.strip()
    except OSError:
        pass
    return out


def _write(path: str, text: str, mode: int = 0o644) -> None:
    try:
        os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except OSError as exc:
        raise UserError(f"cannot write {path}: {exc.strerror}.") from None


def systemd_running() -> bool:
    """sd_booted(): systemd is this system's init (not a container without it)."""
    return os.path.isdir("/run/systemd/system")


def install(args: argparse.Namespace, out=print) -> int:
    """Write NAME.conf, the template and the drop-in; reload and enable when systemd runs.
    Raises UserError for a bad name, a missing BACKING or MOUNTPOINT, a mountpoint another
    unit already uses, or a path a unit cannot carry."""
    name = args.name
    if not _NAME.fullmatch(name):
        raise UserError(f"the unit name {name!r} may hold only letters, digits, '.', '_' and "
                        "'-' (at most 64, starting with a letter or digit), e.g. slow-nfs.")
    if not _TIMESPAN.fullmatch(args.stop_timeout.strip()):
        raise UserError(f"--stop-timeout {args.stop_timeout!r} is not a systemd time span "
                        "(e.g. 30min, 12h, 1d or infinity).")
    if args.foreground:
        raise UserError("install-unit takes mount options only; -f is what the unit runs.")
    cfg = config_from_args(args)
    for what, path in (("BACKING", cfg.backing), ("MOUNTPOINT", cfg.mountpoint)):
        _check_word(what, path)
        if not os.path.isdir(path):
            raise UserError(f"{what} {path} is not an existing directory"
                            + (" (mount it first, or create the mountpoint)."
                               if what == "BACKING" else " (create it first)."))
    cache_dir = _check_word("the cache directory", cfg.cache_dir)
    preflight.check_overlaps(cfg)
    options = _mount_options(args, cache_dir)
    root = os.path.abspath(args.root)
    conf_dir = os.path.join(root, "etc/cachefs")
    unit_dir = os.path.join(root, "etc/systemd/system")
    conf_path = os.path.join(conf_dir, f"{name}.conf")
    if os.path.isdir(conf_dir):
        for entry in sorted(os.listdir(conf_dir)):
            if not entry.endswith(".conf") or entry == f"{name}.conf":
                continue
            other = _conf_values(os.path.join(conf_dir, entry))
            where = f"cachefs@{entry[:-5]} ({os.path.join(conf_dir, entry)})"
            if _same_path(other.get("MOUNTPOINT"), cfg.mountpoint):
                raise UserError(f"{cfg.mountpoint} is already the MOUNTPOINT of {where}; "
                                "one unit per mountpoint.")
            words = other.get("CACHEFS_OPTIONS", "").split()
            theirs = words[words.index("--cache-dir") + 1] \
                if "--cache-dir" in words[:-1] else None
            if _same_path(theirs, cache_dir):
                raise UserError(f"{cache_dir} is already the cache directory of {where}; "
                                "one cache directory per unit (give --cache-dir).")
    replaced = os.path.exists(conf_path)
    exec_cmd = cachefs_executable()
    _check_word("the cachefs command", exec_cmd)
    _write(conf_path, (
        f"# cachefs@{name}.service, written by cachefs install-unit (run it again to change)\n"
        f"BACKING={cfg.backing}\nMOUNTPOINT={cfg.mountpoint}\n"
        f"CACHEFS_OPTIONS={' '.join(options)}\n"))
    _write(os.path.join(unit_dir, TEMPLATE_NAME), render_template(exec_cmd))
    needs = [cfg.backing, cache_dir, os.path.dirname(cfg.mountpoint.rstrip("/")) or "/"]
    drop_in = os.path.join(unit_dir, f"cachefs@{name}.service.d", "cachefs.conf")
    _write(drop_in, (
        f"# Written by cachefs install-unit {name}: start after the mounts holding BACKING,\n"
        "# the cache directory and the mountpoint, and stop (draining write-back data)\n"
        "# before they are unmounted.\n"
        "[Unit]\n"
        f"RequiresMountsFor={' '.join(p.replace('%', '%%') for p in dict.fromkeys(needs))}\n"
        + ("" if args.stop_timeout == STOP_TIMEOUT else
           f"\n[Service]\nTimeoutStopSec={args.stop_timeout.strip()}\n")))
    unit = f"cachefs@{name}.service"
    out(f"{'replaced' if replaced else 'wrote'} {conf_path}, "
        f"{os.path.join(unit_dir, TEMPLATE_NAME)} and {drop_in}")
    if root != "/":
        out(f"--root {root}: systemctl left alone; on that system run: systemctl "
            f"daemon-reload && systemctl enable {'--now ' if args.now else ''}{unit}")
        return 0
    return activate(unit, args.now, out)


def activate(unit: str, now: bool, out=print, run=subprocess.run,
             booted: Callable[[], bool] = systemd_running) -> int:
    """systemctl daemon-reload and enable [--now] UNIT if systemd runs here; otherwise say
    what to run once it does. Returns the exit status."""
    if not booted():
        out(f"systemd is not running here, so {unit} is not enabled; once it is, run: "
            f"systemctl daemon-reload && systemctl enable --now {unit}")
        return 0
    for cmd in (["systemctl", "daemon-reload"],
                ["systemctl", "enable", *(["--now"] if now else []), unit]):
        res = run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            out(f"{' '.join(cmd)} failed (status {res.returncode}): {res.stderr.strip()}")
            return 1
    out(f"enabled {unit}" + (" and started it" if now else
                             f"; start it with systemctl start {unit}"))
    return 0
