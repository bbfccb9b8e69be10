"""`cachefs-ctl stats --plot FILE.png`: draw a mount's recent history (the daemon's `history`
command) as four panels over a shared time axis: hit ratio, IOPS, latency percentiles per
tier, dirty bytes and cache used.

Owns the drawing only; matplotlib is imported here, so only `--plot` pays for it (the Agg
renderer of a bare `Figure`: no display, no pyplot state).
"""

from __future__ import annotations

import datetime
import math

TIER_NAMES = (("ssd_hit", "SSD hit", "tab:green"), ("backing_miss", "BACKING miss", "tab:red"),
              ("write", "write", "tab:blue"))
MIB = 1 << 20


def _per_s(col: list, t: list) -> list[float]:
    """Per-second rate between consecutive samples (len - 1 values)."""
    return [max(0, col[i] - col[i - 1]) / (t[i] - t[i - 1]) if t[i] > t[i - 1] else math.nan
            for i in range(1, len(t))]


def _ratio(hits: list, reads: list, k: int) -> list[float]:
    """Hit ratio over the last `k` intervals at each sample but the first; NaN without
    reads."""
    out = []
    for i in range(1, len(reads)):
        j = max(0, i - k)
        n = reads[i] - reads[j]
        out.append((hits[i] - hits[j]) / n if n > 0 else math.nan)
    return out


def _steps(ax, when: list, values: list[float], **kw) -> None:
    """Values of the intervals between samples as steps: interval i spans when[i] to
    when[i + 1] (the last value is repeated so a single interval still shows)."""
    if values:
        ax.plot(when, values + values[-1:], drawstyle="steps-post", **kw)
    else:
        ax.plot([], [], **kw)


def _us(col: list) -> list[float]:
    return [math.nan if v is None else v / 1e3 for v in col]


def smoothing(step_s: float, window_s: float) -> int:
    """How many sample intervals the plotted hit ratio spans: about 1/60 of the window
    (5 s of a 5-minute plot, a minute of an hour), at least one."""
    return max(1, round(window_s / 60 / step_s))


def draw(history: dict, path: str, title: str) -> int:
    """Write the plot of `history` (the daemon's answer) to `path`; the format follows the
    extension (png unless another one matplotlib knows). Returns the number of samples.
    Raises OSError if the file cannot be written, ValueError for an unknown format."""
    from matplotlib import dates
    from matplotlib.figure import Figure

    cols = history["columns"]
    step_s, window_s = history["step_s"], history["window_s"]
    t = cols["t"]
    when = [datetime.datetime.fromtimestamp(x) for x in t]
    k = smoothing(step_s, window_s)

    fig = Figure(figsize=(10, 9.5), dpi=100, layout="constrained")
    ax_hit, ax_iops, ax_lat, ax_dirty = fig.subplots(4, 1, sharex=True)
    fig.suptitle(title, fontsize=11)

    _steps(ax_hit, when, _ratio(cols["hit_ops"], cols["read_ops"], k), label="ops",
           color="tab:green")
    _steps(ax_hit, when, _ratio(cols["hit_bytes"], cols["read_bytes"], k), label="bytes",
           color="tab:olive", linestyle="--")
    ax_hit.set_ylim(-0.02, 1.02)
    span = k * step_s
    ax_hit.set_ylabel(f"hit ratio\n(over {span:g} s)" if span < 120 else
                      f"hit ratio\n(over {span / 60:g} min)")

    _steps(ax_iops, when, _per_s(cols["read_ops"], t), label="read", color="tab:green")
    _steps(ax_iops, when, _per_s(cols["write_ops"], t), label="write", color="tab:blue")
    ax_iops.set_ylabel("IOPS" if step_s <= 1 else f"IOPS\n(per {step_s:g} s)")
    ax_iops.set_ylim(bottom=0)

    drawn = False
    for tier, name, color in TIER_NAMES:
        p50, p99 = _us(cols[f"{tier}_p50_ns"]), _us(cols[f"{tier}_p99_ns"])
        if all(math.isnan(v) for v in p50):
            continue
        ax_lat.plot(when, p50, color=color, label=f"{name} p50", marker=".", markersize=4)
        ax_lat.plot(when, p99, color=color, label=f"{name} p99", linestyle=":", marker="x",
                    markersize=3)
        drawn = True
    if drawn:
        ax_lat.set_yscale("log")
    ax_lat.set_ylabel("latency (µs)")

    ax_dirty.plot(when, [v / MIB for v in cols["dirty_bytes"]], label="dirty",
                  color="tab:orange")
    ax_dirty.plot(when, [v / MIB for v in cols["cache_used"]], label="cache used",
                  color="tab:gray", linestyle="--")
    ax_dirty.set_ylabel("MiB")
    ax_dirty.set_ylim(bottom=0)

    for ax in (ax_hit, ax_iops, ax_lat, ax_dirty):
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best", fontsize=8, ncol=3)
    locator = dates.AutoDateLocator()
    ax_dirty.xaxis.set_major_locator(locator)
    ax_dirty.xaxis.set_major_formatter(dates.ConciseDateFormatter(locator))
    if not t:
        ax_hit.text(0.5, 0.5, "no samples yet", ha="center", va="center",
                    transform=ax_hit.transAxes)
    fig.savefig(path)
    return len(t)
