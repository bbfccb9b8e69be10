"""`cachefs mount|umount|install-unit`: the operator's entry point."""

from __future__ import annotations

import argparse
import errno
import logging
import os
import select
import signal
import subprocess
import sys
import time

from cachefs import __version__
from cachefs import mounttable, preflight
from cachefs.config import format_size
from cachefs.errors import UserError
from cachefs.startup import PATIENCE_S, PROGRESS, USER_MISTAKE, Progress, sd_notify

from . import client, unit
from .options import add_mount_arguments, config_from_args, config_to_argv

READY_ENV = "CACHEFS_READY_FD"
READY_WARNING = "warning: "     # a line of the ready answer after "ok"
LOG_ENV = "CACHEFS_LOG_FILE"    # the daemon's stdout and stderr: reopened at SIGHUP (logrotate)
PROGRESS_SHOWN_S = 30          # how often `cachefs mount` shows a long start's progress
# `cachefs umount` tries again this long while the mount is busy: a stat or statfs of the
# mount by another program (df, a monitoring agent's every-mount scan) holds it for as long
# as the daemon takes to answer, and the unmount failed with EBUSY (seen in the suite).
BUSY_RETRY_S = 3.0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cachefs", description="An SSD cache in front of a slow "
                                "mount, as a FUSE filesystem.")
    p.add_argument("--version", action="version", version=f"cachefs {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("mount", help="mount BACKING through a cache on MOUNTPOINT")
    add_mount_arguments(m)
    u = sub.add_parser("umount", help="unmount cleanly, waiting for in-flight work")
    u.add_argument("mountpoint", metavar="MOUNTPOINT")
    u.add_argument("--timeout", type=float, default=300, help="seconds to wait for the "
                   "daemon to persist its state (default 300)")
    u.add_argument("--flush", action="store_true", help="destage all dirty data first")
    i = sub.add_parser("install-unit", help="a persistent mount under systemd: write "
                       "/etc/cachefs/NAME.conf and the cachefs@NAME unit, and enable it")
    unit.add_arguments(i)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "mount":
            return cmd_mount(args)
        if args.command == "install-unit":
            return unit.install(args)
        return cmd_umount(args)
    except UserError as exc:
        print(f"cachefs: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def cmd_mount(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    if cfg.foreground:
        return _run_foreground(cfg)
    preflight.check_paths(cfg)
    preflight.prepare_cache_dir(cfg, data_files=False)     # the daemon walks data/ itself
    log_path = os.path.join(cfg.cache_dir, "cachefs.log")
    for fd in (0, 1, 2):
        # Closed by a script or supervisor: the ready pipe took 0 or 1, the daemon's stdin
        # and stdout replaced it, and a mount that was made said "exited before the mount
        # was ready", exit 1 (a helper's hunt). /dev/null takes the lowest free number.
        try:
            os.fstat(fd)
        except OSError:
            os.open(os.devnull, os.O_RDWR)
    r, w = os.pipe()
    log_start = os.path.getsize(log_path) if os.path.exists(log_path) else 0
    log_fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    os.fchmod(log_fd, 0o600)                # private like the rest of the cache directory
    with open(log_fd, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "cachefs_cli.main", *config_to_argv(cfg)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, pass_fds=(w,),
            env={**os.environ, READY_ENV: str(w), LOG_ENV: log_path}, start_new_session=True)
    os.close(w)
    try:
        answer = _read_ready(r, proc)
    except KeyboardInterrupt:
        # Ctrl-C: the daemon (in a session of its own) went on, mounted, found nobody to
        # tell and unmounted, with a traceback (a helper's hunt). It is stopped now.
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        print("cachefs: interrupted: the daemon was stopped before the mount was ready; "
              "nothing is mounted.", file=sys.stderr)
        return 130
    if answer == "ok" or answer.startswith("ok\n"):
        for line in answer.splitlines()[1:]:        # the daemon's warnings, also in its log
            if line.startswith(READY_WARNING):
                print(f"cachefs: warning: {line[len(READY_WARNING):]}", file=sys.stderr)
        return 0
    status = 1
    if answer.startswith(USER_MISTAKE):              # the daemon found a user mistake
        answer = answer[len(USER_MISTAKE):]
        status = 2
    libfuse = _libfuse_lines(log_path, log_start)      # e.g. "fuse: unknown option(s)"
    if answer and libfuse:
        answer = answer.replace("libfuse says why above", "libfuse said: " + "; ".join(libfuse))
    if answer:
        print(f"cachefs: {answer}", file=sys.stderr)
    else:
        print(f"cachefs: the daemon exited (status {proc.poll()}) before the mount was ready; "
              f"see {log_path}.", file=sys.stderr)
    return status


def _libfuse_lines(log_path: str, start: int) -> list[str]:
    try:
        with open(log_path, "rb") as f:
            f.seek(start)
            text = f.read(1 << 20).decode(errors="replace")
    except OSError:
        return []
    return [line for line in text.splitlines() if line.startswith("fuse:")]


def _read_ready(fd: int, proc: subprocess.Popen) -> str:
    """The daemon's answer: waits while the daemon reports progress (cachefs/startup.py),
    and gives up after PATIENCE_S without any."""
    deadline = time.monotonic() + PATIENCE_S
    shown = 0.0
    data = b""
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 1.0)
            if not ready:
                continue
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            data += chunk
            while data.startswith(PROGRESS.encode()) and b"\n" in data:
                line, data = data.split(b"\n", 1)
                deadline = time.monotonic() + PATIENCE_S
                if time.monotonic() - shown >= PROGRESS_SHOWN_S:
                    shown = time.monotonic()
                    what = line[len(PROGRESS):].decode(errors='replace')
                    print(f"cachefs: still starting: {what}", file=sys.stderr)
        else:
            proc.kill()
            return (f"the daemon was not ready, and reported no progress, for {PATIENCE_S:g} "
                    "s: it was stopped (see the log; nothing is lost).")
    finally:
        os.close(fd)
    return data.decode(errors="replace").strip()


def _run_foreground(cfg) -> int:
    logging.basicConfig(level=logging.DEBUG if cfg.debug else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ready_fd = int(os.environ.pop(READY_ENV, "-1"))
    if ready_fd >= 0:
        # The background daemon: its paths are absolute (config_to_argv). It kept the
        # operator's working directory busy for its whole life (a USB stick, an NFS home
        # could not be unmounted: a helper's hunt).
        os.chdir("/")
    stopped_by: list[str] = []
    # Before the mount exists (a start may take minutes: a large map, a destage before a
    # write-through mount) a SIGHUP (logrotate's) killed the daemon, and SIGTERM ended it
    # without a word; the mount's own handlers take over once it is up (Daemon._signals).
    signal.signal(signal.SIGHUP, signal.SIG_IGN)

    def stop_on(signum, frame) -> None:
        stopped_by.append(signal.Signals(signum).name)
        os.kill(os.getpid(), signal.SIGINT)         # trio stops safely on SIGINT

    signal.signal(signal.SIGTERM, stop_on)

    def send(line: str) -> None:
        if ready_fd >= 0:
            os.write(ready_fd, f"{PROGRESS}{line}\n".encode(errors="surrogateescape"))

    progress = Progress(send, sd_notify)

    def ready(error: str | None, warnings: tuple[str, ...] | list[str] = ()) -> None:
        nonlocal ready_fd
        progress.stop()
        if ready_fd >= 0:
            said = "".join(f"{READY_WARNING}{w}\n" for w in warnings)
            try:
                os.write(ready_fd, f"ok\n{said}".encode(errors="surrogateescape") if error is None
                         else error.encode(errors="surrogateescape") + b"\n")
            except BrokenPipeError:     # `cachefs mount` is gone: nobody to tell
                pass
            finally:
                os.close(ready_fd)
                ready_fd = -1

    progress.start()
    try:
        from cachefs import mount as mnt    # the engine: only the daemon loads it
        return mnt.run(cfg, ready, progress)
    except KeyboardInterrupt:
        why = stopped_by[-1] if stopped_by else "SIGINT"
        logging.getLogger("cachefs").warning("stopped by %s before the mount was ready", why)
        ready(f"the daemon was stopped by {why} before the mount was ready; nothing is lost "
              "(the next mount goes on from where it stopped).")
        return 130
    finally:
        ready("the daemon stopped before the mount was ready.")


def cmd_umount(args: argparse.Namespace) -> int:
    if not 0 < args.timeout < float("inf"):             # (NaN too)
        raise UserError("--timeout needs a positive number of seconds.")
    if not args.mountpoint.strip():                     # ("" would be the current directory)
        raise UserError("MOUNTPOINT is empty; give the mount's directory.")
    mountpoint = mounttable.resolve(args.mountpoint)     # (no stat: BACKING may hang)
    if not mounttable.is_cachefs(mountpoint):
        raise UserError(f"{mountpoint} is not a cachefs mount.")
    users = mounttable.users_of(mountpoint)
    if users:
        raise UserError(f"{mountpoint} is still used by the mount on {users[0]} (an overlay "
                        "or bind mount of a path in it): unmount that first.")
    dead = _dead(mountpoint)
    if dead:
        # Its daemon is gone (a crash, kill -9): nothing can be flushed, but the dead mount
        # must go, or a restart (systemd's ExecStop, then ExecStart) meets it again.
        print(f"cachefs: the daemon of {mountpoint} is gone (it crashed or was killed; its "
              f"log says why): {'nothing was flushed; ' if args.flush else ''}write-back data "
              "not yet on BACKING stays on the SSD and is destaged at the next mount.",
              file=sys.stderr)
    elif args.flush:
        from . import ctl
        rc = ctl.main(["flush", mountpoint])
        if rc:
            return rc
    try:
        stats = client.request(mountpoint, "stats", timeout_s=10)["stats"]
        pid = stats["pid"]
    except UserError:
        # A dead daemon (unmounting is still right), or one that cannot answer through the
        # mount (its BACKING hangs): then it is found by its command line, to be waited for.
        stats, pid = None, preflight.daemon_pid(mountpoint)
    deadline = time.monotonic() + BUSY_RETRY_S
    while True:
        res = subprocess.run(["fusermount3", "-u", mountpoint], capture_output=True, text=True)
        if res.returncode == 0 or "busy" not in res.stderr or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    if res.returncode != 0:
        busy = (f" (for {BUSY_RETRY_S:g} s: a program has a file or its working directory "
                "in it; `fuser -vm MOUNTPOINT` names them)" if "busy" in res.stderr else "")
        raise UserError(f"unmounting {mountpoint} failed{busy}: {res.stderr.strip()}")
    if pid is not None and not _wait_exit(pid, args.timeout):
        raise UserError(f"the cachefs daemon (pid {pid}) did not finish within "
                        f"{args.timeout:g} s; it keeps persisting in the background.")
    if dead and args.flush:             # (the unmount asked for was done: 0 without --flush)
        return 1
    if stats and stats["dirty_bytes"]:
        print(f"cachefs: write-back data not yet on BACKING stays on the SSD in "
              f"{stats['cache_dir']} ({format_size(stats['dirty_bytes'])} when the unmount "
              "began); it is destaged at the next mount (use --flush to destage before "
              "unmounting).")
    return 0


def _dead(mountpoint: str) -> bool:
    """A cachefs mount whose daemon is gone: no daemon process for it, and the mount
    answers ENOTCONN."""
    if preflight.daemon_pid(mountpoint) is not None:
        return False
    try:
        os.statvfs(mountpoint)          # (a stat may come from the kernel's attribute cache)
    except OSError as exc:
        return exc.errno == errno.ENOTCONN
    return False


def _wait_exit(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not os.path.exists(f"/proc/{pid}") or _is_zombie(pid):
            return True
        time.sleep(0.05)
    return False


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


if __name__ == "__main__":
    sys.exit(main())
