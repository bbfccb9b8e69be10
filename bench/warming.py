"""The warming scenarios of the runner (issue 9): how fast a fresh cachefs mount gets warm and
whether it stays warm. Called by bench/run.py (``--only warming,after-cat,after-prefetch,
scan-resist``); each returns a dict stored under ``results["warming"][name]``.

- ``warming``: fresh mount (default options, ``--cache-size`` 2x the file), 4 KiB random reads
  at QD 32 from the first second; fio's per-second IOPS log and cachefs's hit ratio per second
  (stats polled every second). Warm IOPS = mean of the last 10 s; time to 90 % of it. The same
  curve for BACKING alone as reference.
- ``after-cat`` / ``after-prefetch``: fresh mount, one ``cat FILE > /dev/null`` through it (or
  ``cachefs-ctl prefetch FILE``), wait until promotions stop, then 4 KiB random reads at QD 32;
  compared with a mount warmed by the runner's warm-up passes (``warm-ref``, same fio job).
- ``scan-resist``: a hot file half the workload size in a pool 1.09x its size (so the pool is
  above ``--promote-all-below``), warmed by random 64 KiB passes; then a one-pass ``cat`` of a
  file 4x the workload size, then one pass of 64 KiB random reads over a second such file;
  after each, one 64 KiB random pass over the hot file: its hit ratio is the share of the hot
  set still cached.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time

import slowfs_client

MiB = 1 << 20
NAMES = ("warming", "after-cat", "after-prefetch", "scan-resist")


class StatsPoller(threading.Thread):
    """Samples cachefs stats (over its control socket) and slowfs counters every second."""

    KEYS = ("read_ops", "hit_ops", "miss_ops", "bypass_ops", "extents_cached", "promotions",
            "promotions_dropped", "promotion_waits", "evictions", "backing_read_bytes")

    def __init__(self, run, cachefs_mnt: str | None, slow_mnt: str | None,
                 period_s: float = 1.0):
        super().__init__(daemon=True)
        self.run_mod, self.cmnt, self.smnt, self.period = run, cachefs_mnt, slow_mnt, period_s
        self.samples: list[dict] = []
        self.t0 = time.monotonic()
        self._halt = threading.Event()

    def run(self) -> None:
        nxt = time.monotonic()
        while not self._halt.is_set():
            s = {"t": time.monotonic() - self.t0}
            try:
                if self.cmnt:
                    c = self.run_mod.ctl_socket_stats(self.cmnt)
                    s.update({k: c.get(k) for k in self.KEYS})
                if self.smnt:
                    s["slow_read_bytes"] = slowfs_client.stats(self.smnt)["read_bytes"]
            except (OSError, ValueError):
                pass
            self.samples.append(s)
            nxt += self.period
            self._halt.wait(max(0.0, nxt - time.monotonic()))

    def stop(self) -> list[dict]:
        self._halt.set()
        self.join()
        return self.samples


def per_second(samples: list[dict], t_start: float) -> list[dict]:
    """Deltas between consecutive polls: hit ratio, BACKING MB/s, extents cached."""
    out = []
    for a, b in zip(samples, samples[1:]):
        dt = b["t"] - a["t"]
        if dt <= 0:
            continue
        row = {"t": round(b["t"] - t_start, 2)}
        if a.get("read_ops") is not None and b.get("read_ops") is not None:
            reads = b["read_ops"] - a["read_ops"]
            row["hit_ratio"] = (b["hit_ops"] - a["hit_ops"]) / reads if reads else None
            row["extents_cached"] = b["extents_cached"]
            row["promotion_waits"] = b["promotion_waits"] - a["promotion_waits"]
        if a.get("slow_read_bytes") is not None and b.get("slow_read_bytes") is not None:
            row["backing_mbs"] = (b["slow_read_bytes"] - a["slow_read_bytes"]) / dt / 1e6
        out.append(row)
    return out


def iops_log(path: str) -> list[tuple[float, float]]:
    """fio --write_iops_log with log_avg_msec=1000: (end of the second, IOPS) pairs."""
    pts = []
    with open(path) as f:
        for line in f:
            parts = [x.strip() for x in line.split(",")]
            if len(parts) >= 2:
                pts.append((int(parts[0]) / 1e3, float(parts[1])))
    return pts


def time_to(pts: list[tuple[float, float]], level: float) -> tuple[float | None, float | None]:
    """(first second at or above `level`, second from which every later one stays there)."""
    first = next((t for t, v in pts if v >= level), None)
    stays = None
    for i, (t, _) in enumerate(pts):
        if all(v >= level for _, v in pts[i:]):
            stays = t
            break
    return first, stays


def curve(bench, run, target: str, cmnt: str | None, smnt: str, tag: str,
          runtime: int) -> dict:
    """4 KiB random reads QD 32 (jobs/nlvmug-read.fio, no ramp) for `runtime` s with the IOPS
    log and the per-second poll."""
    prefix = os.path.join(bench.out, "fio", tag)
    poller = StatsPoller(run, cmnt, smnt)
    poller.start()
    time.sleep(0.2)
    t_start = time.monotonic() - poller.t0
    try:
        fio = run.run_fio("nlvmug-read.fio", run.fio_env(target, bench.st, runtime, 0),
                          prefix + ".json", [f"--write_iops_log={prefix}", "--log_avg_msec=1000"])
    finally:
        samples = poller.stop()
    pts = iops_log(f"{prefix}_iops.1.log")
    warm = pts[-10:] if len(pts) >= 10 else pts
    warm_iops = sum(v for _, v in warm) / len(warm) if warm else None
    first, stays = time_to(pts, 0.9 * warm_iops) if warm_iops else (None, None)
    polls = per_second(samples, t_start)
    res = {**run.summarize(fio), "iops_per_s": pts, "polls": polls, "warm_iops": warm_iops,
           "t90_first_s": first, "t90_stays_s": stays}
    if len(samples) >= 2 and samples[-1].get("slow_read_bytes") is not None:
        res["backing_read_bytes"] = samples[-1]["slow_read_bytes"] - samples[0]["slow_read_bytes"]
    return res


def _mount_pair(bench, run, mounts, p: dict, cache_size: int, extra: list[str] = ()):
    mounts.slowfs(p["src"], p["slow"], os.path.join(p["dir"], "slowfs.log"))
    pid = mounts.cachefs(p["slow"], p["mnt"], p["cache"],
                         ["--cache-size", str(cache_size), *extra])
    return pid


def settle(run, mnt: str, timeout_s: float = 120) -> float:
    """Wait until promotions and extents_cached stop changing for 1 s; returns the wait."""
    t0 = time.monotonic()
    last, same = None, 0
    while time.monotonic() - t0 < timeout_s:
        s = run.ctl_socket_stats(mnt)
        cur = (s["promotions"], s["extents_cached"], s["promotions_dropped"])
        same = same + 1 if cur == last else 0
        if same >= 2:
            break
        last = cur
        time.sleep(0.5)
    return round(time.monotonic() - t0, 1)


def warming(bench, run) -> dict:
    st = bench.st
    runtime = 20 if st.quick else max(40, st.runtime * 2)
    out: dict = {"runtime_s": runtime}
    for system in ("cachefs", "backing"):
        p = bench.fresh(f"warming.{system}")
        mounts = run.Mounts()
        try:
            if system == "cachefs":
                _mount_pair(bench, run, mounts, p, 2 * st.size)
                target, cmnt = os.path.join(p["mnt"], "data"), p["mnt"]
                rt = runtime
            else:
                mounts.slowfs(p["src"], p["slow"], os.path.join(p["dir"], "slowfs.log"))
                target, cmnt = os.path.join(p["slow"], "data"), None
                rt = min(runtime, 20)
            bw = slowfs_client.stats(p["slow"])["params"]["bandwidth_mbs"]
            r = curve(bench, run, target, cmnt, p["slow"], f"warming.{system}", rt)
            if cmnt:
                fin = run.ctl_stats(cmnt)
                r["final_stats"] = {k: fin.get(k) for k in (
                    "extents_cached", "promotions", "promotions_dropped", "promotion_waits",
                    "evictions", "hit_ratio", "drops")}
            out[system] = r
            out["bandwidth_mbs"] = bw
            run.log(f"  warming {system}: warm {r['warm_iops']:.0f} IOPS, 90 % at "
                    f"{r['t90_first_s']} s (stays from {r['t90_stays_s']} s)")
        finally:
            mounts.close()
            shutil.rmtree(p["dir"], ignore_errors=True)
    out["target_s"] = 1.5 * st.size / (out["bandwidth_mbs"] * 1e6)
    return out


def _random_phase(bench, run, target: str, cmnt: str, smnt: str, tag: str) -> dict:
    runtime = 5 if bench.st.quick else 20
    probes = run.Probes(cmnt, smnt, None)
    return run.measured_fio("nlvmug-read.fio", run.fio_env(target, bench.st, runtime, 0),
                            os.path.join(bench.out, "fio", tag + ".json"), probes, 0)


def after(bench, run, how: str) -> dict:
    """how: "warm-ref" (the runner's warm-up passes), "cat" or "prefetch"; then random reads."""
    st = bench.st
    p = bench.fresh(f"after-{how}")
    mounts = run.Mounts()
    try:
        _mount_pair(bench, run, mounts, p, 2 * st.size)
        cmnt, target = p["mnt"], os.path.join(p["mnt"], "data")
        a = slowfs_client.stats(p["slow"])
        t0 = time.monotonic()
        res: dict = {}
        if how == "warm-ref":
            res["warmup"] = bench.warm_up(run.WORKLOADS[1], target, cmnt, "after-warm-ref")
        elif how == "cat":
            with open(os.devnull, "wb") as null:
                subprocess.run(["cat", target], stdout=null, check=True, timeout=1800)
        else:
            r = subprocess.run(run.CTL + ["prefetch", "--json", target], capture_output=True,
                               text=True, timeout=1800)
            res["prefetch_rc"], res["prefetch_out"] = r.returncode, r.stdout.strip()[-400:]
            if r.returncode:
                raise RuntimeError(f"cachefs-ctl prefetch: {r.stderr.strip()}")
        res["load_s"] = round(time.monotonic() - t0, 1)
        res["settle_s"] = settle(run, cmnt)
        b = slowfs_client.stats(p["slow"])
        res["load_backing_mb"] = (b["read_bytes"] - a["read_bytes"]) / 1e6
        before = run.ctl_stats(cmnt)
        res["extents_cached"] = before["extents_cached"]
        res["file_extents"] = -(-st.size // (64 * 1024))
        res.update(_random_phase(bench, run, target, cmnt, p["slow"], f"after-{how}"))
        run.log(f"  after {how}: loaded in {res['load_s']} s (+{res['settle_s']} s settle), "
                f"{res['extents_cached']} extents; random {res['iops']:.0f} IOPS, hits "
                f"{res.get('hit_ratio')}, BACKING read {res.get('backing_read_bytes')} B")
        return res
    finally:
        mounts.close()
        shutil.rmtree(p["dir"], ignore_errors=True)


def _one_pass(bench, run, target: str, size: int, cmnt: str, tag: str) -> dict:
    """One pass of 64 KiB random reads over `target` (jobs/warmup.fio); cachefs deltas."""
    a = run.ctl_stats(cmnt)
    t0 = time.monotonic()
    run.run_fio("warmup.fio", {**run.fio_env(target, bench.st, 3600, 0), "SIZE": str(size)},
                os.path.join(bench.out, "fio", tag + ".json"))
    settle(run, cmnt)
    b = run.ctl_stats(cmnt)
    reads = b["read_ops"] - a["read_ops"]
    return {"hit_ratio": (b["hit_ops"] - a["hit_ops"]) / reads if reads else None,
            "s": round(time.monotonic() - t0, 1), "extents_cached": b["extents_cached"],
            "evictions": b["evictions"] - a["evictions"],
            "promotions": b["promotions"] - a["promotions"]}


def scan_resist(bench, run) -> dict:
    st = bench.st
    hot_size = st.size // 2
    scan_size = 4 * st.size
    cache = hot_size * 35 // 32                   # 512 MiB hot -> 560 MiB pool (91 % full)
    p = bench.fresh("scan-resist")
    mounts = run.Mounts()
    try:
        with open(bench.master, "rb") as src, open(os.path.join(p["src"], "hot"), "wb") as dst:
            dst.write(src.read(hot_size))
            dst.flush()
            os.fsync(dst.fileno())
        for name in ("scan", "scan2"):            # sparse: the emulator charges every read
            with open(os.path.join(p["src"], name), "wb") as f:   # by its size, holes too
                f.truncate(scan_size)
        _mount_pair(bench, run, mounts, p, cache)
        cmnt = p["mnt"]
        hot = os.path.join(cmnt, "hot")
        out: dict = {"hot_bytes": hot_size, "scan_bytes": scan_size, "cache_bytes": cache}
        out["warmup"] = [_one_pass(bench, run, hot, hot_size, cmnt, f"scan.warm{i}")
                         for i in range(3)]
        out["hot_check0"] = _one_pass(bench, run, hot, hot_size, cmnt, "scan.check0")
        s0 = run.ctl_stats(cmnt)
        out["hot_extents"] = s0["extents_cached"]
        out["fill"] = s0["extents_cached"] * 64 * 1024 / cache
        for how, name in (("cat", "scan"), ("random", "scan2")):
            a = run.ctl_stats(cmnt)
            sa = slowfs_client.stats(p["slow"])
            t0 = time.monotonic()
            if how == "cat":
                with open(os.devnull, "wb") as null:
                    subprocess.run(["cat", os.path.join(cmnt, name)], stdout=null, check=True,
                                   timeout=3600)
                r = {}
            else:
                r = _one_pass(bench, run, os.path.join(cmnt, name), scan_size, cmnt,
                              "scan.random")
            settle(run, cmnt)
            b = run.ctl_stats(cmnt)
            sb = slowfs_client.stats(p["slow"])
            check = _one_pass(bench, run, hot, hot_size, cmnt, f"scan.check.{how}")
            out[how] = {"s": round(time.monotonic() - t0, 1),
                        "backing_mb": (sb["read_bytes"] - sa["read_bytes"]) / 1e6,
                        "evictions": b["evictions"] - a["evictions"],
                        "promotions": b["promotions"] - a["promotions"],
                        "bypass_ops": b["bypass_ops"] - a["bypass_ops"],
                        "extents_before": a["extents_cached"],
                        "extents_after": b["extents_cached"],
                        "hot_hit_ratio_after": check["hit_ratio"],
                        "hot_check": check, "scan_pass": r}
            run.log(f"  scan {how}: {out[how]['evictions']} evictions, hot set hit ratio after "
                    f"{check['hit_ratio']:.3f}")
        return out
    finally:
        mounts.close()
        shutil.rmtree(p["dir"], ignore_errors=True)


def run_all(bench, run, names: list[str]) -> dict:
    out: dict = {}
    for name in NAMES:
        if name not in names:
            continue
        run.log(f"{name}")
        try:
            if name == "warming":
                out[name] = warming(bench, run)
            elif name == "scan-resist":
                out[name] = scan_resist(bench, run)
            else:
                if "warm-ref" not in out:
                    out["warm-ref"] = after(bench, run, "warm-ref")
                out[name] = after(bench, run, name.split("-", 1)[1])
        except Exception as exc:                  # one failed scenario does not end the run
            run.log(f"  FAILED: {exc}")
            out[name] = {"na": f"failed: {str(exc)[:160]}"}
    return out


def fmt(x, f="{:,.0f}") -> str:
    return "-" if x is None else f.format(x)


def markdown(w: dict) -> str:
    """The warming section of results.md."""
    parts = []
    wm = w.get("warming")
    if wm and "cachefs" in wm:
        c, bk = wm["cachefs"], wm.get("backing", {})
        ok = c["t90_first_s"] is not None and c["t90_first_s"] <= wm["target_s"]
        parts += ["### Warming (issue 9)", "",
                  f"Fresh mount, 4 KiB random reads QD 32 for {wm['runtime_s']} s "
                  f"(fio IOPS log, 1 s averages; cachefs stats polled every second).", "",
                  "| system | warm IOPS (last 10 s) | 90 % of warm reached at | stays >= 90 % "
                  "from | target | verdict | BACKING MB read | extents cached at end |",
                  "|---|---:|---:|---:|---:|---|---:|---:|",
                  f"| cachefs (default options) | {fmt(c['warm_iops'])} | "
                  f"{fmt(c['t90_first_s'], '{:.0f} s')} | {fmt(c['t90_stays_s'], '{:.0f} s')} | "
                  f"<= {wm['target_s']:.1f} s | {'met' if ok else 'missed'} | "
                  f"{fmt(c.get('backing_read_bytes', 0) / 1e6)} | "
                  f"{fmt(c.get('final_stats', {}).get('extents_cached'))} |"]
        if bk:
            parts.append(f"| BACKING (slowfs) | {fmt(bk['warm_iops'])} | - | - | - | - | "
                         f"{fmt(bk.get('backing_read_bytes', 0) / 1e6)} | - |")
        parts.append("")
    rows = [(k, w[k]) for k in ("warm-ref", "after-cat", "after-prefetch") if k in w]
    if rows:
        ref = (w.get("warm-ref") or {}).get("iops")
        parts += ["### After one cat / after prefetch (issue 9)", "",
                  "| mount warmed by | load s | settle s | BACKING MB during load | extents "
                  "cached | random IOPS | x warm-ref | hit ratio | BACKING bytes during random "
                  "reads |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for k, r in rows:
            if "iops" not in r:
                parts.append(f"| {k} | {r.get('na', 'n/a')} | | | | | | | |")
                continue
            parts.append(f"| {k} | {r['load_s']} | {r['settle_s']} | "
                         f"{fmt(r['load_backing_mb'])} | {r['extents_cached']:,} / "
                         f"{r['file_extents']:,} | {fmt(r['iops'])} | "
                         f"{fmt(r['iops'] / ref if ref else None, '{:.2f}')} | "
                         f"{fmt(r.get('hit_ratio'), '{:.4f}')} | "
                         f"{fmt(r.get('backing_read_bytes'))} |")
        parts.append("")
    sr = w.get("scan-resist")
    if sr and "cat" in sr:
        parts += ["### Scan resistance (issue 9)", "",
                  f"Hot file {sr['hot_bytes'] // MiB} MiB in a {sr['cache_bytes'] // MiB} MiB "
                  f"pool ({100 * sr['fill']:.1f} % full, {sr['hot_extents']:,} extents) after "
                  f"random 64 KiB passes (hit ratios "
                  + ", ".join(f"{x['hit_ratio']:.3f}" for x in sr["warmup"])
                  + f", check pass {sr['hot_check0']['hit_ratio']:.3f}); then one pass over a "
                  f"{sr['scan_bytes'] // MiB} MiB file.", "",
                  "| scan | s | BACKING MB | promotions | evictions | extents before / after | "
                  "hot-set hit ratio after | hot set evicted |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for how in ("cat", "random"):
            r = sr.get(how)
            if not r:
                continue
            parts.append(f"| {how} | {r['s']} | {fmt(r['backing_mb'])} | {r['promotions']:,} | "
                         f"{r['evictions']:,} | {r['extents_before']:,} / "
                         f"{r['extents_after']:,} | {fmt(r['hot_hit_ratio_after'], '{:.4f}')} | "
                         f"{fmt(100 * (1 - r['hot_hit_ratio_after']), '{:.1f} %')} |")
        parts.append("")
    for k, r in w.items():
        if isinstance(r, dict) and "na" in r:
            parts.append(f"- {k}: {r['na']}")
    return "\n".join(parts)
