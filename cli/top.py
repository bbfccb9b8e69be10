"""`cachefs-ctl top MOUNTPOINT`: a live view of one mount, redrawn every interval.

Owns the view only: it polls the daemon's `stats` command (read-only, so a member of the
mount's --stats-group may run it) and derives the interval's rates from the difference of two
polls; beside them it shows the daemon's own 10 s / 1 min rates and decaying hit ratios
(cachefs/history.py). On a terminal one screen is redrawn in place with rich; when
stdout is not a terminal (a pipe, a log file) it prints one plain line per interval.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Callable, Iterator

from cachefs.config import format_size
from cachefs.errors import UserError
from cachefs.health import summary as health_summary

from . import client
from .statsview import latency_rows, passthrough_summary, window_rows

DROP_REASONS = ("coherence", "recovery", "capacity", "operator", "cache_error")
ERRORS = (("BACKING", "backing_errors"), ("cache", "cache_errors"),
          ("destage", "destage_errors"), ("metadata", "metadata_errors"))


@dataclasses.dataclass
class View:
    """What one screen or line shows: the latest stats and the rates since the poll before
    (None on the first poll)."""

    s: dict
    rates: dict | None
    interval_s: float


def rates(prev: dict, cur: dict, dt: float) -> dict:
    """Per-second rates and the interval's hit ratio from two stats polls `dt` seconds apart.
    A counter that went down (the daemon restarted) counts as 0."""

    def per_s(name: str) -> float:
        return max(0, cur.get(name, 0) - prev.get(name, 0)) / dt if dt > 0 else 0.0

    def delta(name: str) -> int:
        return max(0, cur.get(name, 0) - prev.get(name, 0))

    reads = delta("read_ops")
    return {
        "read_iops": per_s("read_ops"), "read_bps": per_s("read_bytes"),
        "write_iops": per_s("write_ops"), "write_bps": per_s("write_bytes"),
        "hit_iops": per_s("hit_ops"), "miss_iops": per_s("miss_ops"),
        "bypass_iops": per_s("bypass_ops"),
        "hit_ratio": delta("hit_ops") / reads if reads else None,
        "destaged_bps": per_s("destaged_bytes"),
        "promotions_s": per_s("promotions"), "evictions_s": per_s("evictions"),
        "throttled": delta("throttled_writes"),
        "drops": {r: max(0, cur.get("drops", {}).get(r, 0) - prev.get("drops", {}).get(r, 0))
                  for r in DROP_REASONS},
        "errors": {key: delta(key) for _, key in ERRORS},
    }


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f} %"


def _rate(bps: float) -> str:
    return f"{format_size(bps)}/s"


def rows(v: View) -> list[tuple[str, str, str]]:
    """(label, text, style) rows of the screen; style is a rich style or ''."""
    s, r = v.s, v.rates
    used, size = s["cache_used"], s["cache_size"]
    wait = "(measuring...)"
    out = [
        ("reads", wait if r is None else f"{r['read_iops']:.0f} IOPS, {_rate(r['read_bps'])}"
         f"  (SSD {r['hit_iops']:.0f}, BACKING {r['miss_iops']:.0f}, bypass "
         f"{r['bypass_iops']:.0f} IOPS)", ""),
        ("writes", wait if r is None else
         f"{r['write_iops']:.0f} IOPS, {_rate(r['write_bps'])}", ""),
        ("hit ratio", f"{_pct(None if r is None else r['hit_ratio'])} now, "
                      f"{_pct(s['hit_ratio'])} since mount ({_pct(s['byte_hit_ratio'])} of "
                      f"bytes)" + (f", {_pct(s['lifetime']['hit_ratio'])} lifetime"
                                   if s.get("lifetime") else ""), ""),
        ("occupancy", f"{format_size(used)} of {format_size(size)} "
                      f"({100 * used / size if size else 0:.1f} %), {s['extents_cached']} "
                      f"extents in {s['files_cached']} files"
                      + ("" if r is None else f"; promotions {r['promotions_s']:.0f}/s, "
                         f"evictions {r['evictions_s']:.0f}/s"), ""),
    ]
    out += [(label, text, "") for label, text in window_rows(s.get("windows"), ("10s", "1m"))]
    out += [(label, text, "") for label, text in latency_rows(s.get("latency"))]
    if s["mode"] == "write-back" or s["dirty_bytes"]:
        eta = s.get("eta_s")
        out += [
            ("dirty", f"{format_size(s['dirty_bytes'])} in {s['dirty_extents']} extents "
                      f"(high {format_size(s['dirty_high'])}, low {format_size(s['dirty_low'])})"
                      f", oldest {s['oldest_dirty_age_s']:.1f} s",
             "yellow" if s["dirty_bytes"] > s["dirty_high"] else ""),
            ("destage", f"{_rate(s['destage_rate'])}, ETA "
                        f"{'-' if eta is None else f'{eta:.0f} s'}"
                        + ("" if r is None else f"; {_rate(r['destaged_bps'])} this interval"),
             ""),
            ("flow control", ("THROTTLING" if s["throttling"] else "off")
             + f"; {s['throttled_writes']} writes delayed {s['throttle_delay_s']:.1f} s in all"
             + ("" if r is None else f" (+{r['throttled']} now)"),
             "bold red" if s["throttling"] else ""),
        ]
    out.append(("passthrough", passthrough_summary(s), ""))
    drops = s.get("drops", {})
    new_drops = sum(r["drops"].values()) if r else 0
    out.append(("drops", ", ".join(f"{k.replace('_', ' ')} {drops.get(k, 0)}"
                                   + (f" (+{r['drops'][k]})" if r and r["drops"][k] else "")
                                   for k in DROP_REASONS), "yellow" if new_drops else ""))
    health = s.get("backing_health")
    out.append(("BACKING health", health_summary(health),
                "bold red" if health and health["state"] != "ok" else ""))
    new_errors = sum(r["errors"].values()) if r else 0
    out.append(("errors", ", ".join(f"{label} {s.get(key, 0)}"
                                    + (f" (+{r['errors'][key]})" if r and r["errors"][key]
                                       else "") for label, key in ERRORS),
                "bold red" if new_errors else ""))
    out.append(("last error", s.get("last_destage_error") or "none",
                "red" if s.get("last_destage_error") else ""))
    return out


def line(v: View) -> str:
    """One plain line for logs and pipes (rates over the last interval)."""
    s, r = v.s, v.rates
    used, size = s["cache_used"], s["cache_size"]
    parts = [time.strftime("%H:%M:%S")]
    if r is not None:
        parts += [f"read {r['read_iops']:.0f} IOPS {_rate(r['read_bps'])}",
                  f"write {r['write_iops']:.0f} IOPS {_rate(r['write_bps'])}",
                  f"hit {_pct(r['hit_ratio'])}"]
    parts += [f"hit since mount {_pct(s['hit_ratio'])}",
              f"used {format_size(used)} of {format_size(size)} "
              f"({100 * used / size if size else 0:.1f} %)"]
    if s["mode"] == "write-back" or s["dirty_bytes"]:
        eta = s.get("eta_s")
        parts += [f"dirty {format_size(s['dirty_bytes'])}",
                  f"destage {_rate(s['destage_rate'])} ETA "
                  f"{'-' if eta is None else f'{eta:.0f} s'}",
                  f"throttle {'ON' if s['throttling'] else 'off'}"]
    parts.append(f"BACKING {health_summary(s.get('backing_health'))}")
    parts.append("passthrough " + (f"{s['passthrough_open_handles']} opens of "
                                   f"{s['passthrough_open_files']} files now"
                                   if s.get("passthrough") == "on" else "off"))
    parts += [f"drops {sum(s.get('drops', {}).values())}",
              "errors " + " ".join(f"{label} {s.get(key, 0)}" for label, key in ERRORS)]
    if s.get("last_destage_error"):
        parts.append(f"last error: {s['last_destage_error']}")
    return " | ".join(parts)


def views(fetch: Callable[[], dict], interval_s: float, count: int | None,
          sleep=time.sleep, clock=time.monotonic) -> Iterator[View]:
    """Poll `fetch` every interval; yields `count` views (forever if None), the first with
    no rates yet."""
    prev, prev_t = None, None
    n = 0
    while count is None or n < count:
        s, t = fetch(), clock()
        yield View(s, None if prev is None else rates(prev, s, t - prev_t), interval_s)
        prev, prev_t = s, t
        n += 1
        if count is None or n < count:
            sleep(interval_s)


def run(mountpoint: str, interval_s: float, count: int | None, out=None) -> int:
    """The live view on a terminal, plain lines otherwise; Ctrl-C ends it (status 0)."""
    if interval_s <= 0:
        raise UserError("--interval needs a positive number of seconds.")
    if count is not None and count < 1:
        raise UserError("--count needs a positive number of screens.")
    out = out or sys.stdout

    def fetch() -> dict:
        return client.request(mountpoint, "stats", timeout_s=max(10.0, interval_s))["stats"]

    try:
        if not out.isatty():
            skip_first = count is None or count > 1      # rates need two polls
            for i, v in enumerate(views(fetch, interval_s, count)):
                if i == 0 and skip_first:
                    continue
                print(line(v), file=out, flush=True)
            return 0
        _live(fetch, interval_s, count, out)
    except KeyboardInterrupt:
        pass
    return 0


def _live(fetch: Callable[[], dict], interval_s: float, count: int | None, out) -> None:
    from rich.console import Console, Group
    from rich.live import Live
    from rich.table import Table
    from rich.text import Text

    console = Console(file=out)

    def screen(v: View) -> Group:
        s = v.s
        title = Text(f"cachefs top: {s['mountpoint']} <- {s['backing']} ({s['mode']}), "
                     f"every {v.interval_s:g} s, up {s['uptime_s']:.0f} s", style="bold")
        t = Table(show_header=False, box=None, padding=(0, 1))
        t.add_column(style="bold", no_wrap=True)
        t.add_column(overflow="fold")
        for label, text, style in rows(v):
            t.add_row(Text(label), Text(text), style=style or None)
        return Group(title, t, Text("Ctrl-C quits", style="dim"))

    with Live(console=console, auto_refresh=False, transient=False) as live:
        for v in views(fetch, interval_s, count):
            live.update(screen(v), refresh=True)
