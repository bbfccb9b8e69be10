"""Plots for bench/run.py (matplotlib, Agg backend): PNG files from a results dict.

    make_all(results, img_dir) -> {key: (file name or None, title or note)}

Also usable alone: ``python3 bench/plot.py RESULTS.json IMG_DIR``.
"""

from __future__ import annotations

import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ORDER = ("backing", "write-through", "write-back", "raw", "passthrough")
LABEL = {"backing": "BACKING (slowfs)", "write-through": "cachefs write-through",
         "write-back": "cachefs write-back", "raw": "raw cache dir (O_DIRECT)",
         "passthrough": "passthrough.py"}
COLOR = {"backing": "#888888", "write-through": "#1f77b4", "write-back": "#2ca02c",
         "raw": "#ff7f0e", "passthrough": "#9467bd"}
SLA_MS = 15.0


def _bars(results: dict, key: str, ylabel: str, title: str, path: str) -> bool:
    rows = results.get("rows") or {}
    wls = [w for w, r in rows.items() if any(key in v and v[key] for v in r.values())]
    if not wls:
        return False
    systems = [s for s in ORDER if any(s in rows[w] and key in rows[w][s] for w in wls)]
    width = 0.8 / max(len(systems), 1)
    fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(wls) + 3), 4.8))
    for i, s in enumerate(systems):
        xs, ys = [], []
        for j, w in enumerate(wls):
            v = rows[w].get(s, {}).get(key)
            if v:
                xs.append(j + (i - (len(systems) - 1) / 2) * width)
                ys.append(v)
        ax.bar(xs, ys, width, label=LABEL[s], color=COLOR[s])
    ax.set_xticks(range(len(wls)))
    ax.set_xticklabels(wls, rotation=30, ha="right")
    ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _density(results: dict, path: str) -> bool:
    d = {s: r for s, r in (results.get("density") or {}).items() if "steps" in r}
    if not d:
        return False
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.3))
    for s, r in d.items():
        pts = sorted((int(n), v) for n, v in r["steps"].items())
        xs = [n for n, _ in pts]
        a1.plot(xs, [v["mean_ms"] for _, v in pts], "o-", color=COLOR[s],
                label=f"{LABEL[s]} (fits {r['fits']})")
        a2.plot(xs, [v["iops"] for _, v in pts], "o-", color=COLOR[s], label=LABEL[s])
    allx = [int(n) for r in d.values() for n in r["steps"]]
    a2.plot(sorted(allx), [120 * n for n in sorted(allx)], ":", color="black",
            label="target (120 IOPS per client)")
    a1.axhline(SLA_MS, color="red", ls="--", label=f"SLA {SLA_MS:g} ms")
    a1.set_yscale("log")
    a1.set_xlabel("clients (84 r + 36 w IOPS each, QD 1)")
    a1.set_ylabel("mean latency, ms")
    a1.set_title("Density: mean latency vs clients")
    a2.set_xlabel("clients")
    a2.set_ylabel("total IOPS")
    a2.set_title("Density: IOPS delivered")
    for a in (a1, a2):
        a.grid(alpha=0.3, which="both")
        a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _burst(results: dict, path: str) -> tuple[bool, str]:
    rows = (results.get("rows") or {}).get("write-burst") or {}
    tls = {s: r["timeline"] for s, r in rows.items() if r.get("timeline", {}).get("writer_mbs")}
    if not tls:
        return False, "write-burst timeline: no writer throughput log"
    wb = tls.get("write-back", {})
    polls = [p for p in wb.get("polls", []) if "dirty_bytes" in p]
    has_dirty = bool(polls)
    fig, axes = plt.subplots(2 if has_dirty else 1, 1, figsize=(9, 6.5 if has_dirty else 3.8),
                             sharex=True, squeeze=False)
    ax = axes[0][0]
    for s in ORDER:
        if s in tls:
            pts = tls[s]["writer_mbs"]
            ax.plot([t for t, _ in pts], [v for _, v in pts], "-", color=COLOR[s],
                    label=LABEL[s])
    ax.set_ylabel("writer MB/s")
    ax.set_title("write-burst: writer throughput (fio, 0.5 s averages)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    note = "write-burst timeline"
    if has_dirty:
        ax2 = axes[1][0]
        ts = [p["t"] for p in polls]
        ax2.plot(ts, [p["dirty_bytes"] / 2**20 for p in polls], color="#2ca02c",
                 label="dirty MiB")
        ax2.set_ylabel("dirty MiB")
        st = results.get("settings", {})
        if st.get("dirty_high"):
            ax2.axhline(st["dirty_high"] / 2**20, color="red", ls="--", label="--dirty-high")
            ax2.axhline(st["dirty_low"] / 2**20, color="orange", ls=":", label="--dirty-low")
        if any("destage_rate" in p for p in polls):
            ax3 = ax2.twinx()
            ax3.plot(ts, [p.get("destage_rate", 0) / 1e6 for p in polls], color="#d62728",
                     label="destage MB/s")
            ax3.set_ylabel("destage MB/s")
            ax3.legend(fontsize=8, loc="upper right")
        ax2.set_xlabel("seconds since the burst started")
        ax2.set_title("cachefs write-back: dirty bytes and destage rate (stats every 0.5 s)")
        ax2.grid(alpha=0.3)
        ax2.legend(fontsize=8, loc="upper left")
    else:
        ax.set_xlabel("seconds since the burst started")
        note = ("write-burst timeline (writer throughput only: no write-back mount with "
                "`dirty_bytes`/`destage_rate` in its stats, so the dirty/destage panel is "
                "skipped)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True, note


def _warming(results: dict, path: str) -> bool:
    w = (results.get("warming") or {}).get("warming") or {}
    if "cachefs" not in w:
        return False
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(9, 7), sharex=True,
                                  gridspec_kw={"height_ratios": [3, 2]})
    for key, color, label in (("cachefs", COLOR["write-through"], "cachefs (fresh mount)"),
                              ("backing", COLOR["backing"], "BACKING (slowfs) alone")):
        if key in w:
            pts = w[key]["iops_per_s"]
            ax.plot([t for t, _ in pts], [v for _, v in pts], "-", color=color, label=label)
    c = w["cachefs"]
    if c.get("warm_iops"):
        ax.axhline(0.9 * c["warm_iops"], color="#1f77b4", ls=":",
                   label=f"90 % of warm IOPS ({0.9 * c['warm_iops']:,.0f})")
    if c.get("t90_first_s") is not None:
        ax.axvline(c["t90_first_s"], color="#1f77b4", ls="--",
                   label=f"reached at {c['t90_first_s']:.0f} s")
    ax.axvline(w["target_s"], color="red", ls="--", label=f"target {w['target_s']:.1f} s")
    ax.set_ylabel("IOPS (fio, 1 s averages)")
    ax.set_title("Warming: 4 KiB random reads QD 32 on a fresh mount over a "
                 f"{results['settings']['size'] // 2**20} MiB file")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="center right")
    polls = [p for p in c.get("polls", []) if p.get("hit_ratio") is not None]
    ax2.plot([p["t"] for p in polls], [p["hit_ratio"] for p in polls], color="#2ca02c",
             label="cachefs hit ratio per second")
    ax2.set_ylim(0, 1.02)
    ax2.set_ylabel("hit ratio")
    ax2.set_xlabel("seconds since fio started")
    ax3 = ax2.twinx()
    ax3.plot([p["t"] for p in polls], [p.get("backing_mbs", 0) for p in polls], color="#888888",
             ls="-", alpha=0.7, label="BACKING MB/s read (slowfs)")
    ax3.set_ylabel("BACKING MB/s")
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=8, loc="center left")
    ax3.legend(fontsize=8, loc="center right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def make_all(results: dict, img_dir: str) -> dict:
    os.makedirs(img_dir, exist_ok=True)
    out = {}
    if _bars(results, "iops", "IOPS (log)", "IOPS per workload and system",
             os.path.join(img_dir, "bench-iops.png")):
        out["iops"] = ("bench-iops.png", "IOPS per workload and system")
    if _bars(results, "mean_ms", "mean latency, ms (log)",
             "Mean latency per workload and system (all I/Os)",
             os.path.join(img_dir, "bench-latency.png")):
        out["latency"] = ("bench-latency.png", "mean latency per workload and system")
    if _density(results, os.path.join(img_dir, "bench-density.png")):
        out["density"] = ("bench-density.png", "density curve")
    if "write-burst" in (results.get("rows") or {}):
        ok, note = _burst(results, os.path.join(img_dir, "bench-write-burst.png"))
        out["burst"] = ("bench-write-burst.png" if ok else None, note)
    if _warming(results, os.path.join(img_dir, "bench-warming.png")):
        out["warming"] = ("bench-warming.png", "warming: IOPS and hit ratio per second")
    return out


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print(make_all(json.load(f), sys.argv[2]))
