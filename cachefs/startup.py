"""What a starting daemon tells whoever waits for it: `cachefs mount` (through the ready pipe)
and systemd (Type=notify). The long phases of a start (opening and loading the map of a large
pool, destaging write-back data before a write-through mount) report their progress every few
seconds while it moves; the waiters give up only after a while without any. Before, `cachefs
mount` killed any daemon not ready within 120 s and systemd any unit after 90 s: a 1 TiB pool,
or a write-through mount over much write-back data, could never be mounted (a helper's hunt).

    progress = Progress(send)      # send(line): a line for the waiting `cachefs mount`
    progress.start()
    progress.phase("loading the extent map", lambda: len(pool))
    ...
    progress.stop()                # before the ready answer
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Callable

log = logging.getLogger("cachefs")

PROGRESS = "progress: "      # a line of the ready pipe before the answer
BEAT_S = 5.0                 # how often a moving phase is reported
PATIENCE_S = 120.0           # how long the waiters wait after the last report
USER_MISTAKE = "user mistake: "     # how the ready answer marks a UserError for the CLI


def sd_notify(message: str) -> None:
    """Tell systemd (Type=notify) about our state, if it is listening. A NOTIFY_SOCKET that
    leads nowhere (inherited from a shell started by a unit, a stale one) is said once
    and ignored: the daemon died of it right after mounting (a helper's hunt)."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            s.sendall(message.encode(errors="surrogateescape"))
    except OSError as exc:
        log.warning("NOTIFY_SOCKET %s does not take systemd notifications (%s): ignored",
                    os.environ.pop("NOTIFY_SOCKET"), exc.strerror or exc)


class Progress:
    """Reports the current phase of a start while its measure changes (a thread)."""

    def __init__(self, send: Callable[[str], None] | None,
                 notify: Callable[[str], None] | None = None, beat_s: float = BEAT_S):
        self._send = send
        self._notify = notify
        self._beat_s = beat_s
        self._what: str | Callable[[], str] = ""
        self._measure: Callable[[], object] = time.process_time
        self._last: tuple[str, object] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cachefs-startup", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def phase(self, what: str | Callable[[], str],
              measure: Callable[[], object] = time.process_time) -> None:
        """From now on the start is doing `what` (a text, or a function giving one at each
        report); it moves while `measure()` changes (the daemon's CPU time by default: local
        work, never a hang)."""
        self._what, self._measure = what, measure

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self._beat_s):
            try:
                now = (self._what, self._measure())
            except Exception:       # a measure of a structure being built: next time
                continue
            if not self._what or now == self._last:
                continue
            self._last = now
            try:
                what = self._what() if callable(self._what) else self._what
                if self._send is not None:
                    self._send(what)
                if self._notify is not None:
                    self._notify(f"EXTEND_TIMEOUT_USEC={int(PATIENCE_S * 1e6)}\n"
                                 f"STATUS={what}")
            except Exception:       # nobody waits any more (OSError), or a text of a
                pass                # structure being built: next time
