#!/usr/bin/env python3
"""The cachefs benchmark runner (issue #4): one command, one markdown table.

    python3 bench/run.py [--quick] [--only NAME,...] [--out DIR] [--size SIZE] [--runtime S]
                         [--docs | --no-docs] [--from-json RESULTS.json]

For each workload (fio job files in bench/jobs/) and each system:

- ``backing``      BACKING alone: the slowfs emulator mount (bench/slowfs.py, its defaults);
- ``write-through`` / ``write-back``: cachefs over that emulator mount, after a warm-up;
- ``raw``          the raw cache directory (same disk as the cache), the upper limit;
- ``passthrough``  (nlvmug-read only) bench/passthrough.py, what Python FUSE can do here;

it creates fresh directories under /var/tmp, mounts, warms up, runs fio with
``--output-format=json`` and collects: IOPS, MB/s, read/write split, mean and p99 latency,
the ratio against BACKING alone and against the raw directory, the bytes that reached
BACKING (slowfs counters), the cachefs hit ratio (delta of ``cachefs-ctl stats --json`` over
the measured part of the run) and the daemon's CPU (utime+stime from /proc/PID/stat). Then
the density experiment (rate-limited clients added until the mean latency passes a 15 ms
SLA) and the plots (docs/img/). Everything is unmounted in ``finally``.

Write-back rows are probed: while ``cachefs mount --mode write-back`` refuses (exit 2,
"not available"), they read "n/a (not available)"; once it mounts, they are measured.

Output: the table on stdout, OUT/results.json (every figure and the raw fio JSON file
names), OUT/results.md, OUT/img/*.png. A full run (no --quick, no --only) also rewrites the
section of docs/benchmarks.md between the runner markers and copies the plots to docs/img/.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
JOBS = os.path.join(BENCH, "jobs")
sys.path.insert(0, BENCH)
import slowfs_client  # noqa: E402
import warming  # noqa: E402

CACHEFS = [sys.executable, "-m", "cachefs_cli.main"]
CTL = [sys.executable, "-m", "cachefs_cli.ctl"]
TICK = os.sysconf("SC_CLK_TCK")
MiB = 1 << 20
SLA_MS = 15.0
CLIENT_IOPS = 84 + 36           # bench/jobs/density.fio rate_iops
MIN_DELIVERED = 0.95            # a step fits only if it also delivers >= 95 % of that rate
BEGIN, END = "<!-- runner:begin -->", "<!-- runner:end -->"

SYSTEMS = ("backing", "write-through", "write-back", "raw", "passthrough")
LABEL = {"backing": "BACKING (slowfs)", "write-through": "cachefs write-through",
         "write-back": "cachefs write-back", "raw": "raw cache dir",
         "passthrough": "passthrough.py"}


@dataclass
class Workload:
    name: str
    job: str                     # file in bench/jobs/
    warm: str                    # "passes": warm-up passes; "ramp": the job's own ramp; "none"
    cache_mult: float = 2.0      # cachefs --cache-size as a multiple of the file size
    timed: bool = True           # time based (else one pass / one burst, RUNTIME caps)
    quick: bool = False          # part of --quick
    passthrough: bool = False    # add the bare passthrough row
    note: str = ""


WORKLOADS = [
    Workload("flashsoft-70-30", "flashsoft-70-30.fio", "passes", quick=True),
    Workload("nlvmug-read", "nlvmug-read.fio", "passes", quick=True, passthrough=True),
    Workload("nlvmug-rw", "nlvmug-rw.fio", "passes"),
    Workload("hitachi-sql", "hitachi-sql.fio", "passes"),
    Workload("hitachi-web", "hitachi-web.fio", "passes"),
    Workload("hitachi-exchange", "hitachi-exchange.fio", "passes"),
    Workload("hitachi-oltp", "hitachi-oltp.fio", "passes"),
    Workload("zipf-hot", "zipf-hot.fio", "ramp", cache_mult=0.25, quick=True),
    Workload("seq-read-1m-cold", "seq-read-1m.fio", "none", timed=False, quick=True),
    Workload("seq-read-1m-warm", "seq-read-1m.fio", "passes", timed=False),
    Workload("write-burst", "write-burst.fio", "none", timed=False, quick=True),
]
EXTRA = ("density",) + warming.NAMES   # not fio workload rows: density, warming (issue 9)


@dataclass
class Settings:
    quick: bool
    size: int                    # workload file size
    runtime: int                 # measured seconds per time-based run
    ramp: int                    # discarded seconds before measuring
    zipf_ramp: int               # zipf-hot warm-up (its own ramp)
    max_passes: int              # warm-up passes at most
    density_runtime: int
    density_ramp: int
    density_max_steps: int
    density_max_clients: int
    burst: int                   # write-burst bytes
    dirty_high: int
    dirty_low: int
    only: list[str] = field(default_factory=list)


def settings(args) -> Settings:
    if args.quick:
        size = args.size or 128 * MiB
        s = Settings(True, size, args.runtime or 5, 2, 5, 3, 3, 1, 3, 64, size // 2,
                     size // 8, size // 16)
    else:
        size = args.size or 1024 * MiB
        s = Settings(False, size, args.runtime or 25, 3, 30, 4, 10, 2, 14, 128, size // 2,
                     size // 8, size // 16)
    if args.runtime:
        s.density_runtime = min(s.density_runtime, args.runtime)
    return s


def parse_size(text: str) -> int:
    m = re.fullmatch(r"(\d+)([KMG]?)i?B?", text.strip(), re.I)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 64M, 1G)")
    return int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2).upper()]


# -- small helpers -------------------------------------------------------------------------

def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def cpu_s(pid: int | None) -> float | None:
    if not pid:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / TICK     # utime + stime


def is_mounted(path: str) -> bool:
    return slowfs_client.is_mounted(path)


def ctl_socket_stats(mnt: str, timeout_s: float = 5.0) -> dict:
    """The stats `cachefs-ctl stats --json` prints, over the same control socket, without
    starting a Python process (used to poll every 0.5 s on a 2-core machine)."""
    path = os.fsdecode(os.getxattr(mnt, "user.cachefs.control"))
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        s.connect(path)
        s.sendall(b'{"cmd": "stats"}\n')
        buf = b""
        while b"\n" not in buf:
            chunk = s.recv(65536)
            if not chunk:
                raise OSError("control socket closed")
            buf += chunk
    msg = json.loads(buf.split(b"\n", 1)[0])
    if not msg.get("ok"):
        raise OSError(msg.get("error", "stats refused"))
    return msg["stats"]


def ctl_stats(mnt: str) -> dict:
    res = subprocess.run(CTL + ["stats", "--json", mnt], capture_output=True, text=True,
                         timeout=30)
    if res.returncode != 0:
        raise RuntimeError(f"cachefs-ctl stats failed: {res.stderr.strip()}")
    return json.loads(res.stdout)


def machine() -> dict:
    mem = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
    fio_v = subprocess.run(["fio", "--version"], capture_output=True, text=True).stdout.strip()
    commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "cachefs", "cli"],
                           capture_output=True, text=True).stdout.strip()
    return {"nproc": os.cpu_count(), "mem_gib": round(mem / (1 << 30), 1),
            "kernel": platform.release(), "python": platform.python_version(), "fio": fio_v,
            "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
            "commit": commit + (" (cachefs/ or cli/ modified)" if dirty else "")}


# -- mounts ----------------------------------------------------------------------------------

class Mounts:
    """Every mount made for one measurement; `close()` unmounts them in reverse order and
    waits for their daemons."""

    def __init__(self):
        self._stack: list[tuple[str, str, object]] = []

    def slowfs(self, source: str, mnt: str, logf: str) -> int:
        cm = slowfs_client.mounted_slowfs(source, mnt, log_path=logf)
        m = cm.__enter__()
        self._stack.append(("slowfs", mnt, cm))
        return m.proc.pid

    def cachefs(self, backing: str, mnt: str, cache: str, opts: list[str]) -> int:
        res = subprocess.run(CACHEFS + ["mount", "--cache-dir", cache, *opts, backing, mnt],
                             capture_output=True, text=True, timeout=180)
        if res.returncode != 0:
            raise MountFailed(res.returncode, (res.stderr or res.stdout).strip())
        self._stack.append(("cachefs", mnt, None))
        return ctl_stats(mnt)["pid"]

    def passthrough(self, source: str, mnt: str, logf: str) -> int:
        with open(logf, "ab") as lf:
            proc = subprocess.Popen([sys.executable, os.path.join(BENCH, "passthrough.py"),
                                     "mount", "-f", source, mnt], stdin=subprocess.DEVNULL,
                                    stdout=lf, stderr=lf)
        self._stack.append(("passthrough", mnt, proc))
        deadline = time.monotonic() + 15
        while not os.path.ismount(mnt):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"passthrough.py did not mount {mnt}; see {logf}")
            time.sleep(0.02)
        return proc.pid

    def close(self) -> None:
        errors = []
        while self._stack:
            kind, mnt, obj = self._stack.pop()
            try:
                if kind == "slowfs":
                    obj.__exit__(None, None, None)
                elif kind == "passthrough":
                    slowfs_client.unmount(mnt, obj)
                elif is_mounted(mnt):
                    res = subprocess.run(CACHEFS + ["umount", mnt], capture_output=True,
                                         text=True, timeout=360)
                    if res.returncode != 0 and is_mounted(mnt):
                        errors.append(f"cachefs umount {mnt}: {res.stderr.strip()}")
                        subprocess.run(["fusermount3", "-u", "-z", mnt], capture_output=True)
            except Exception as exc:                       # keep unmounting the rest
                errors.append(f"{kind} {mnt}: {exc}")
                if is_mounted(mnt):
                    subprocess.run(["fusermount3", "-u", "-z", mnt], capture_output=True)
        for e in errors:
            log(f"cleanup: {e}")


class MountFailed(RuntimeError):
    def __init__(self, rc: int, msg: str):
        super().__init__(msg)
        self.rc = rc


def probe_write_back(work: str) -> tuple[bool, str]:
    """Try `cachefs mount --mode write-back` on throw-away directories."""
    d = tempfile.mkdtemp(prefix="wb-probe.", dir=work)
    for sub in ("b", "c", "m"):
        os.mkdir(os.path.join(d, sub))
    mounts = Mounts()
    try:
        mounts.cachefs(f"{d}/b", f"{d}/m", f"{d}/c", ["--mode", "write-back"])
        return True, "available"
    except MountFailed as exc:
        if "not available" in str(exc):
            return False, "n/a (not available)"
        return False, f"n/a (mount failed: {str(exc)[:80]})"
    finally:
        mounts.close()
        shutil.rmtree(d, ignore_errors=True)


# -- fio -------------------------------------------------------------------------------------

def fio_env(filename: str, st: Settings, runtime: int, ramp: int, **extra) -> dict:
    env = {**os.environ, "FILENAME": filename, "SIZE": str(st.size), "RUNTIME": str(runtime),
           "RAMP": str(ramp), "BURST": str(st.burst), "CLIENTS": "1"}
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_fio(job: str, env: dict, out_json: str, extra: list[str] = (),
            timeout_s: float = 900) -> dict:
    cmd = ["fio", os.path.join(JOBS, job), "--output-format=json", f"--output={out_json}",
           *extra]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s,
                         cwd=JOBS)
    if res.returncode != 0:
        raise RuntimeError(f"fio {job} failed ({res.returncode}): {res.stderr.strip()[-800:]}")
    with open(out_json) as f:
        text = f.read()
    return json.loads(text[text.index("{"):])


def summarize(fio: dict) -> dict:
    j = fio["jobs"][0]
    r, w = j["read"], j["write"]

    def p99(d):
        pct = d["lat_ns"].get("percentile") or d["clat_ns"].get("percentile") or {}
        return pct.get("99.000000", 0) / 1e6 if d["total_ios"] else None

    n = r["total_ios"] + w["total_ios"]
    mean = ((r["lat_ns"]["mean"] * r["total_ios"] + w["lat_ns"]["mean"] * w["total_ios"])
            / n / 1e6) if n else None
    return {
        "iops": r["iops"] + w["iops"], "read_iops": r["iops"], "write_iops": w["iops"],
        "mbs": (r["bw_bytes"] + w["bw_bytes"]) / 1e6,
        "mean_ms": mean,
        "read_mean_ms": r["lat_ns"]["mean"] / 1e6 if r["total_ios"] else None,
        "write_mean_ms": w["lat_ns"]["mean"] / 1e6 if w["total_ios"] else None,
        "read_p99_ms": p99(r), "write_p99_ms": p99(w),
        "runtime_s": max(r["runtime"], w["runtime"]) / 1e3,
        "read_ios": r["total_ios"], "write_ios": w["total_ios"],
        "io_bytes": r["io_bytes"] + w["io_bytes"], "read_io_bytes": r["io_bytes"],
    }


class Probes:
    """Counters sampled at the start of the measured window (after fio's ramp) and at its
    end: cachefs stats, slowfs stats, daemon CPU."""

    def __init__(self, cachefs_mnt: str | None, slow_mnt: str | None, pid: int | None):
        self.cachefs_mnt, self.slow_mnt, self.pid = cachefs_mnt, slow_mnt, pid

    def snap(self) -> dict:
        s = {"t": time.monotonic(), "cpu": cpu_s(self.pid)}
        if self.cachefs_mnt:
            s["cachefs"] = ctl_stats(self.cachefs_mnt)
        if self.slow_mnt:
            s["slowfs"] = slowfs_client.stats(self.slow_mnt)
        return s

    @staticmethod
    def delta(a: dict, b: dict) -> dict:
        out = {"window_s": b["t"] - a["t"]}
        if a["cpu"] is not None and b["cpu"] is not None:
            out["cpu_pct"] = 100 * (b["cpu"] - a["cpu"]) / max(b["t"] - a["t"], 1e-6)
        if "slowfs" in a:
            sa, sb = a["slowfs"], b["slowfs"]
            out["backing_read_bytes"] = sb["read_bytes"] - sa["read_bytes"]
            out["backing_write_bytes"] = sb["write_bytes"] - sa["write_bytes"]
            out["backing_bytes"] = out["backing_read_bytes"] + out["backing_write_bytes"]
        if "cachefs" in a:
            ca, cb = a["cachefs"], b["cachefs"]
            d = {k: cb[k] - ca[k] for k in cb
                 if isinstance(cb[k], int) and isinstance(ca.get(k), int) and k != "pid"}
            out["cachefs"] = d
            out["hit_ratio"] = d["hit_ops"] / d["read_ops"] if d.get("read_ops") else None
            out["drops"] = {k: v - ca.get("drops", {}).get(k, 0)
                            for k, v in cb.get("drops", {}).items()}
        return out


def measured_fio(job: str, env: dict, out_json: str, probes: Probes, ramp: int,
                 extra: list[str] = (), timeout_s: float = 900) -> dict:
    """Run fio; sample the probes when its ramp ends and when it exits."""
    snaps: dict = {}

    def first():
        try:
            snaps["a"] = probes.snap()
        except Exception as exc:                 # noqa: BLE001 (reported below)
            snaps["err"] = exc

    timer = None
    if ramp > 0:
        timer = threading.Timer(ramp, first)
        timer.start()
    else:
        first()
    try:
        fio = run_fio(job, env, out_json, extra, timeout_s)
    finally:
        if timer:
            timer.cancel()
            timer.join()
    b = probes.snap()
    if "err" in snaps:
        raise RuntimeError(f"sampling counters failed: {snaps['err']}")
    a = snaps.get("a") or b
    res = {**summarize(fio), **Probes.delta(a, b)}
    d = res.get("cachefs")
    if d is not None and not d.get("read_ops") and res.get("read_io_bytes"):
        # FUSE passthrough: the kernel served the reads, the daemon saw none of them. The hit
        # ratio is then the share of bytes fio read that cachefs did not read from BACKING.
        res["hit_ratio"] = max(0.0, 1 - d.get("backing_read_bytes", 0) / res["read_io_bytes"])
        res["passthrough"] = True
    return res


# -- one measurement ---------------------------------------------------------------------------

class Bench:
    def __init__(self, st: Settings, work: str, out: str, wb: tuple[bool, str]):
        self.st, self.work, self.out, self.wb = st, work, out, wb
        self.master = os.path.join(work, "master.dat")
        os.makedirs(os.path.join(out, "fio"), exist_ok=True)

    def make_master(self) -> None:
        log(f"writing the {self.st.size // MiB} MiB workload file {self.master}")
        chunk = os.urandom(MiB)
        with open(self.master, "wb") as f:
            for i in range(self.st.size // MiB):
                f.write(chunk[i % 4096:] + chunk[:i % 4096])    # not dedupable by accident
            f.flush()
            os.fsync(f.fileno())                               # so direct I/O reads the disk

    def fresh(self, name: str) -> dict:
        d = tempfile.mkdtemp(prefix=f"{name}.", dir=self.work)
        paths = {k: os.path.join(d, k) for k in ("src", "slow", "cache", "mnt", "raw")}
        for p in paths.values():
            os.mkdir(p)
        os.link(self.master, os.path.join(paths["src"], "data"))   # same bytes, no copy
        paths["dir"] = d
        return paths

    def cachefs_opts(self, wl_cache_mult: float, mode: str) -> list[str]:
        cache = max(int(self.st.size * wl_cache_mult), 16 * MiB)
        opts = ["--mode", mode, "--cache-size", str(cache)]
        if mode == "write-back":             # --dirty-high must leave room in a small cache
            high = min(self.st.dirty_high, cache // 4)
            low = min(self.st.dirty_low, high // 2)
            opts += ["--dirty-high", str(high), "--dirty-low", str(low)]
        return opts

    def warm_up(self, wl: Workload, target: str, mnt: str, tag: str) -> dict:
        """Warm-up passes (see bench/jobs/warmup.fio) until one pass is >= 95 % hits."""
        passes = []
        for i in range(self.st.max_passes):
            a = ctl_stats(mnt)
            t0 = time.monotonic()
            run_fio("warmup.fio", fio_env(target, self.st, 3600, 0),
                    os.path.join(self.out, "fio", f"{tag}.warmup{i}.json"))
            self.settle(mnt)
            b = ctl_stats(mnt)
            reads = b["read_ops"] - a["read_ops"]
            hr = (b["hit_ops"] - a["hit_ops"]) / reads if reads else 0.0
            passes.append({"hit_ratio": round(hr, 4), "s": round(time.monotonic() - t0, 1)})
            if hr >= 0.95:
                break
        return {"passes": passes, "cache_used": b["cache_used"]}

    @staticmethod
    def settle(mnt: str, timeout_s: float = 30) -> None:
        """Wait until the promoter has installed what it was handed (promotions stop
        changing for 0.5 s)."""
        last, deadline = None, time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            s = ctl_socket_stats(mnt)
            cur = (s["promotions"], s["promotions_dropped"], s.get("dirty_bytes"))
            if cur == last:
                return
            last = cur
            time.sleep(0.5)

    def measure(self, wl: Workload, system: str) -> dict:
        st = self.st
        if system == "write-back" and not self.wb[0]:
            return {"na": self.wb[1]}
        tag = f"{wl.name}.{system}"
        p = self.fresh(tag)
        mounts = Mounts()
        try:
            slow_pid = None
            if system in ("backing", "write-through", "write-back"):
                slow_pid = mounts.slowfs(p["src"], p["slow"],
                                         os.path.join(p["dir"], "slowfs.log"))
            cmnt = None
            if system == "backing":
                target, pid = os.path.join(p["slow"], "data"), slow_pid
            elif system == "raw":
                os.link(self.master, os.path.join(p["raw"], "data"))
                target, pid = os.path.join(p["raw"], "data"), None
            elif system == "passthrough":
                pid = mounts.passthrough(p["src"], p["mnt"], os.path.join(p["dir"], "pt.log"))
                target = os.path.join(p["mnt"], "data")
            else:
                try:
                    pid = mounts.cachefs(p["slow"], p["mnt"], p["cache"],
                                         self.cachefs_opts(wl.cache_mult, system))
                except MountFailed as exc:
                    return {"na": f"n/a (mount failed: {str(exc)[:80]})"}
                cmnt, target = p["mnt"], os.path.join(p["mnt"], "data")
            res: dict = {}
            if cmnt and wl.warm == "passes":
                res["warmup"] = self.warm_up(wl, target, cmnt, tag)
                log(f"  warm-up {tag}: {res['warmup']['passes']}")
            ramp = st.zipf_ramp if wl.warm == "ramp" else (st.ramp if wl.timed else 0)
            runtime = st.runtime if wl.timed else 3600
            probes = Probes(cmnt, p["slow"] if slow_pid else None, pid)
            extra: list[str] = []
            poller = None
            if wl.name == "write-burst":
                bwlog = os.path.join(self.out, "fio", f"{tag}")
                extra = [f"--write_bw_log={bwlog}", "--log_avg_msec=500"]
                if cmnt:
                    poller = Poller(cmnt)
                    poller.start()
            try:
                res.update(measured_fio(wl.job, fio_env(target, st, runtime, ramp),
                                        os.path.join(self.out, "fio", f"{tag}.json"), probes,
                                        ramp, extra))
            finally:
                if poller:
                    poller.drain_and_stop(timeout_s=300 if not st.quick else 60)
            if wl.name == "write-burst":
                res["timeline"] = self.burst_timeline(f"{bwlog}_bw.1.log", poller)
            if cmnt:
                res["mount_drops"] = self.mount_drops(cmnt, target)
            return res
        finally:
            mounts.close()
            shutil.rmtree(p["dir"], ignore_errors=True)

    @staticmethod
    def mount_drops(mnt: str, target: str) -> dict:
        """Cached data dropped over the whole life of the mount (warm-up included), after
        one more open and read of the file (the next open is where BACKING's identity is
        checked again): drops by reason, stale_files, conflicts (issue 9: 0 coherence drops
        when nobody else touches BACKING)."""
        fd = os.open(target, os.O_RDONLY)
        try:
            os.pread(fd, 4096, 0)
        finally:
            os.close(fd)
        s = ctl_stats(mnt)
        return {**s.get("drops", {}), "stale_files": s.get("stale_files"),
                "conflicts": s.get("conflicts")}

    @staticmethod
    def burst_timeline(bwlog: str, poller: "Poller | None") -> dict:
        writer = []
        try:
            with open(bwlog) as f:
                for line in f:
                    parts = [x.strip() for x in line.split(",")]
                    if len(parts) >= 2:
                        writer.append((int(parts[0]) / 1e3, int(parts[1]) * 1024 / 1e6))
        except OSError:
            pass
        tl = {"writer_mbs": writer}
        if poller:
            tl["polls"] = poller.samples
            tl["drain_s"] = poller.drain_s
        return tl

    # -- density ------------------------------------------------------------------------------

    def density(self, system: str) -> dict:
        st = self.st
        if system == "write-back" and not self.wb[0]:
            return {"na": self.wb[1]}
        tag = f"density.{system}"
        p = self.fresh(tag)
        mounts = Mounts()
        try:
            slow_pid = mounts.slowfs(p["src"], p["slow"], os.path.join(p["dir"], "slowfs.log"))
            cmnt = None
            if system == "backing":
                target, pid = os.path.join(p["slow"], "data"), slow_pid
            else:
                try:
                    pid = mounts.cachefs(p["slow"], p["mnt"], p["cache"],
                                         self.cachefs_opts(2.0, system))
                except MountFailed as exc:
                    return {"na": f"n/a (mount failed: {str(exc)[:80]})"}
                cmnt, target = p["mnt"], os.path.join(p["mnt"], "data")
                warm = self.warm_up(WORKLOADS[0], target, cmnt, tag)
                log(f"  warm-up {tag}: {warm['passes']}")
            probes = Probes(cmnt, p["slow"], pid)
            steps: dict[int, dict] = {}

            def step(n: int) -> bool:
                r = measured_fio("density.fio",
                                 fio_env(target, st, st.density_runtime, st.density_ramp,
                                         CLIENTS=n),
                                 os.path.join(self.out, "fio", f"{tag}.{n}.json"), probes,
                                 st.density_ramp)
                steps[n] = r
                ok = step_fits(n, r)
                log(f"  density {system} {n} clients: {r['iops']:.0f} IOPS, mean "
                    f"{r['mean_ms']:.2f} ms -> {'ok' if ok else 'over SLA or short of rate'}")
                return ok

            # grow geometrically until the SLA breaks, then bisect (monotone latency)
            good, bad, n = 0, None, 1
            while len(steps) < st.density_max_steps and n <= st.density_max_clients:
                if step(n):
                    good = n
                    if st.quick:
                        n *= 4                            # 1, 4, 16: few steps
                    else:
                        n = n + 1 if n < 4 else int(n * 1.5)   # 1, 2, 3, 4, 6, 9, 13, 19, ...
                else:
                    bad = n
                    break
            while bad is not None and bad - good > 1 and len(steps) < st.density_max_steps:
                mid = (good + bad) // 2
                if step(mid):
                    good = mid
                else:
                    bad = mid
            out = {"steps": {str(k): v for k, v in sorted(steps.items())}}
            out["fits"], out["first_over"], out["exact"] = density_fit(out)
            return out
        finally:
            mounts.close()
            shutil.rmtree(p["dir"], ignore_errors=True)


def step_fits(n: int, r: dict) -> bool:
    """A density step fits: mean latency within the SLA and the clients got their rate (QD-1
    clients slow down instead of queueing, so latency alone can hide a saturated BACKING)."""
    return (r.get("mean_ms") is not None and r["mean_ms"] <= SLA_MS
            and r["iops"] >= MIN_DELIVERED * CLIENT_IOPS * n)


def density_fit(r: dict) -> tuple[int, int | None, bool]:
    """(clients that fit, first step that did not, exact?) from the measured steps."""
    steps = {int(k): v for k, v in r["steps"].items()}
    bad = min((n for n, v in steps.items() if not step_fits(n, v)), default=None)
    good = max((n for n, v in steps.items() if (bad is None or n < bad) and step_fits(n, v)),
               default=0)
    return good, bad, bad is not None and bad - good == 1


class Poller(threading.Thread):
    """Polls cachefs stats every 0.5 s during a write burst and after it until nothing is
    dirty (when the stats have `dirty_bytes`)."""

    def __init__(self, mnt: str):
        super().__init__(daemon=True)
        self.mnt = mnt
        self.samples: list[dict] = []
        self.t0 = time.monotonic()
        self._halt = threading.Event()
        self.drain_s: float | None = None

    def run(self) -> None:
        while not self._halt.is_set():
            self.sample()
            self._halt.wait(0.5)

    def sample(self) -> dict | None:
        try:
            s = ctl_socket_stats(self.mnt)
        except (OSError, ValueError):
            return None
        keep = {k: s[k] for k in ("dirty_bytes", "destage_rate", "backing_write_bytes",
                                  "write_bytes") if k in s}
        keep["t"] = time.monotonic() - self.t0
        self.samples.append(keep)
        return keep

    def drain_and_stop(self, timeout_s: float) -> None:
        t_end = time.monotonic()
        deadline = t_end + timeout_s
        if self.samples and "dirty_bytes" in self.samples[-1]:
            while time.monotonic() < deadline:
                last = self.samples[-1] if self.samples else {}
                if last.get("dirty_bytes", 0) == 0 and last.get("t", 0) > t_end - self.t0:
                    self.drain_s = round(last["t"] - (t_end - self.t0), 1)
                    break
                time.sleep(0.5)
        self._halt.set()
        self.join()


# -- the run -----------------------------------------------------------------------------------

def systems_for(wl: Workload) -> list[str]:
    out = ["backing", "write-through", "write-back", "raw"]
    if wl.passthrough:
        out.append("passthrough")
    return out


def run(st: Settings, out: str, argv: list[str]) -> dict:
    work = tempfile.mkdtemp(prefix="cachefs-bench.", dir="/var/tmp")
    t0 = time.monotonic()
    results = {"command": " ".join(["python3 bench/run.py", *argv]), "machine": machine(),
               "settings": st.__dict__, "rows": {}, "density": {}}
    try:
        wb = probe_write_back(work)
        log(f"write-back: {wb[1]}")
        results["write_back"] = wb[1]
        bench = Bench(st, work, out, wb)
        bench.make_master()
        names = st.only or ([w.name for w in WORKLOADS if w.quick or not st.quick] + ["density"]
                            + ([] if st.quick else list(warming.NAMES)))
        for wl in WORKLOADS:
            if wl.name not in names:
                continue
            results["rows"][wl.name] = rows = {}
            for system in systems_for(wl):
                log(f"{wl.name} / {system}")
                try:
                    rows[system] = bench.measure(wl, system)
                except Exception as exc:               # one failed row does not end the run
                    log(f"  FAILED: {exc}")
                    rows[system] = {"na": f"failed: {str(exc)[:120]}"}
                r = rows[system]
                if "iops" in r:
                    log(f"  {r['iops']:.0f} IOPS, {r['mbs']:.1f} MB/s, mean {r['mean_ms']:.2f} ms"
                        + (f", hits {r['hit_ratio']:.3f}" if r.get("hit_ratio") is not None
                           else ""))
        if any(n in names for n in warming.NAMES):
            results["warming"] = warming.run_all(bench, sys.modules[__name__], names)
        if "density" in names:
            for system in ("backing", "write-through", "write-back"):
                log(f"density / {system}")
                try:
                    results["density"][system] = bench.density(system)
                except Exception as exc:
                    log(f"  FAILED: {exc}")
                    results["density"][system] = {"na": f"failed: {str(exc)[:120]}"}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results["elapsed_s"] = round(time.monotonic() - t0, 1)
    return results


# -- report --------------------------------------------------------------------------------------

def f_num(x, fmt="{:,.0f}") -> str:
    return "-" if x is None else fmt.format(x)


def pair(a, b, fmt="{:.2f}") -> str:
    if a is None and b is None:
        return "-"
    return f"{f_num(a, fmt)} / {f_num(b, fmt)}"


COLUMNS = ["workload", "system", "IOPS", "MB/s", "read / write IOPS", "mean lat ms",
           "read / write mean ms", "read / write p99 ms", "x BACKING", "x raw",
           "BACKING MiB", "hit ratio", "daemon CPU %", "coherence drops"]


def coherence_cell(r: dict) -> str:
    """'window / mount' coherence drops (+ stale files, conflicts if any) of a cachefs row."""
    md = r.get("mount_drops")
    if md is None:
        return "-"
    cell = f"{(r.get('drops') or {}).get('coherence', '-')} / {md.get('coherence', '-')}"
    extra = [f"{k} {md[k]}" for k in ("stale_files", "conflicts") if md.get(k)]
    return cell + (f" ({', '.join(extra)})" if extra else "")


def table(results: dict) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |",
             "|" + "|".join("---" if i < 2 else "---:" for i in range(len(COLUMNS))) + "|"]
    for wl, rows in results["rows"].items():
        base = rows.get("backing", {}).get("iops")
        raw = rows.get("raw", {}).get("iops")
        for system, r in rows.items():
            if "iops" not in r:
                lines.append(f"| {wl} | {LABEL[system]} | {r.get('na', 'n/a')} |"
                             + " |" * (len(COLUMNS) - 3))
                continue
            cells = [wl, LABEL[system], f_num(r["iops"]), f_num(r["mbs"], "{:,.1f}"),
                     f"{r['read_iops']:,.0f} / {r['write_iops']:,.0f}",
                     f_num(r["mean_ms"], "{:.2f}"),
                     pair(r["read_mean_ms"], r["write_mean_ms"]),
                     pair(r["read_p99_ms"], r["write_p99_ms"], "{:.1f}"),
                     f_num(r["iops"] / base if base else None, "{:.2f}"),
                     f_num(r["iops"] / raw if raw else None, "{:.3f}"),
                     f_num(r["backing_bytes"] / MiB if "backing_bytes" in r else None,
                           "{:,.0f}"),
                     f_num(r.get("hit_ratio"), "{:.3f}"),
                     f_num(r.get("cpu_pct"), "{:.0f}"), coherence_cell(r)]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def density_table(results: dict) -> str:
    d = results.get("density") or {}
    if not d:
        return ""
    lines = ["| system | clients that fit | first that did not | steps (clients: IOPS, mean ms; "
             "✗ = over the SLA or < 95 % of the rate) |",
             "|---|---:|---:|---|"]
    for system, r in d.items():
        if "steps" not in r:
            lines.append(f"| {LABEL[system]} | {r.get('na', 'n/a')} | | |")
            continue
        good, bad, exact = density_fit(r)
        steps = ", ".join(f"{n}: {s['iops']:.0f}, {s['mean_ms']:.1f}"
                          + ("" if step_fits(int(n), s) else " ✗")
                          for n, s in sorted(r["steps"].items(), key=lambda kv: int(kv[0])))
        fits = (f"{good}" if exact else
                f"{good}" + (f" to {bad - 1}" if bad else "+") + " (not bisected to 1)")
        lines.append(f"| {LABEL[system]} | {fits} | {f_num(bad, '{}')} | {steps} |")
    return "\n".join(lines)


def get(results, wl, system, key="iops"):
    return results["rows"].get(wl, {}).get(system, {}).get(key)


def targets(results: dict) -> list[tuple[str, str, str]]:
    """(target, figures, met/missed/not measured) for the issue's targets."""
    out = []

    def ratio(a, b):
        return a / b if a is not None and b else None

    def verdict(ok):
        return "not measured" if ok is None else ("met" if ok else "missed")

    wt, wb = "write-through", "write-back"
    r_pt = ratio(get(results, "nlvmug-read", wt), get(results, "nlvmug-read", "passthrough"))
    r_bk = ratio(get(results, "nlvmug-read", wt), get(results, "nlvmug-read", "backing"))
    out.append(("warmed nlvmug-read >= 90 % of the bare passthrough",
                f"{f_num(r_pt and 100 * r_pt, '{:.0f}')} %", verdict(r_pt and r_pt >= 0.9)))
    out.append(("warmed nlvmug-read >= 20x BACKING", f"{f_num(r_bk, '{:.1f}')}x",
                verdict(r_bk and r_bk >= 20)))
    f_wt = ratio(get(results, "flashsoft-70-30", wt), get(results, "flashsoft-70-30", "backing"))
    l_wt, l_bk = (get(results, "flashsoft-70-30", wt, "mean_ms"),
                  get(results, "flashsoft-70-30", "backing", "mean_ms"))
    ok = None if f_wt is None or l_wt is None or l_bk is None else (f_wt >= 2.4 and l_wt < l_bk)
    out.append(("flashsoft-70-30 write-through >= 2.4x BACKING IOPS, lower 70/30 latency",
                f"{f_num(f_wt, '{:.1f}')}x; mean {f_num(l_wt, '{:.2f}')} vs "
                f"{f_num(l_bk, '{:.2f}')} ms", verdict(ok)))
    f_wb = ratio(get(results, "flashsoft-70-30", wb), get(results, "flashsoft-70-30", "backing"))
    out.append(("flashsoft-70-30 write-back >= 10x BACKING IOPS",
                f"{f_num(f_wb, '{:.1f}')}x" if f_wb else
                results["rows"].get("flashsoft-70-30", {}).get(wb, {}).get("na", "-"),
                verdict(f_wb and f_wb >= 10)))
    z = ratio(get(results, "zipf-hot", wt), get(results, "zipf-hot", "backing"))
    zh = get(results, "zipf-hot", wt, "hit_ratio")
    out.append(("zipf-hot (cache = 1/4 of the file) >= 5x BACKING",
                f"{f_num(z, '{:.1f}')}x, hit ratio {f_num(zh, '{:.3f}')}", verdict(z and z >= 5)))
    c = ratio(get(results, "seq-read-1m-cold", wt, "mbs"),
              get(results, "seq-read-1m-cold", "backing", "mbs"))
    out.append(("seq-read-1m cold within 10 % of BACKING", f"{f_num(c, '{:.2f}')}x",
                verdict(c and c >= 0.9)))
    w = ratio(get(results, "seq-read-1m-warm", wt, "mbs"),
              get(results, "seq-read-1m-warm", "backing", "mbs"))
    out.append(("seq-read-1m warm >= 3x BACKING", f"{f_num(w, '{:.1f}')}x", verdict(w and w >= 3)))
    d = results.get("density") or {}
    for mode in (wt, wb):
        if "steps" not in d.get("backing", {}) or "steps" not in d.get(mode, {}):
            out.append((f"density >= 4x clients ({mode} vs BACKING)",
                        d.get(mode, {}).get("na", "-"), "not measured"))
            continue
        nb, bb, eb = density_fit(d["backing"])
        nw, bw, ew = density_fit(d[mode])
        span = lambda n, b, e: f"{n}" if e else f"{n}-{b - 1 if b else '?'}"   # noqa: E731
        ok = None                                  # the brackets may leave it open
        if bb and nw >= 4 * (bb - 1):
            ok = True
        elif bw and (bw - 1) < 4 * nb:
            ok = False
        out.append((f"density >= 4x clients ({mode} vs BACKING)",
                    f"{span(nw, bw, ew)} vs {span(nb, bb, eb)} clients = "
                    f"{f_num(ratio(nw, nb), '{:.1f}')}x", "not determined" if ok is None
                    else verdict(ok)))
    return out


def markdown(results: dict, plots: dict[str, str], img_prefix: str) -> str:
    m, st = results["machine"], results["settings"]
    parts = [
        f"Command: `{results['command']}` ({m['date']}, commit {m['commit']}; "
        f"{results['elapsed_s'] / 60:.1f} min).",
        "",
        f"Machine: {m['nproc']} CPUs, {m['mem_gib']} GiB RAM, kernel {m['kernel']}, Python "
        f"{m['python']}, {m['fio']}. Workload file {st['size'] // MiB} MiB; time-based runs "
        f"{st['runtime']} s measured after {st['ramp']} s ramp (zipf-hot: {st['zipf_ramp']} s "
        f"ramp as its warm-up); BACKING is `bench/slowfs.py` with its defaults (5 ± 1 ms per "
        f"random request, 8 slots, 110 MB/s link, 0.1 ms sequential). cachefs: "
        f"`--cache-size` 2x the file (zipf-hot: 1/4 of it), other options default; write-back "
        f"also `--dirty-high {st['dirty_high'] // MiB}M --dirty-low {st['dirty_low'] // MiB}M` "
        f"(at most 1/4 and 1/8 of the cache); write-burst writes {st['burst'] // MiB} MiB. "
        f"Write-back: {results.get('write_back', '?')}.",
        "",
        "Which I/O bypasses the page cache: fio opens every target with `direct=1` (libaio). "
        "On the FUSE mounts (slowfs, cachefs, passthrough) that means every request reaches "
        "the daemon (FUSE direct I/O, no kernel page cache in front of the mount); on the raw "
        "cache directory it bypasses the page cache and reads/writes the virtual disk. Behind "
        "the daemons nothing bypasses it: slowfs reads/writes its SOURCE with buffered "
        "`pread`/`pwrite` (its cost is its latency model, not the disk), and cachefs reads "
        "hits from and installs extents into its cache files with buffered I/O (its persister "
        "`fdatasync`s the cache files once a second). The SSD directory and the emulated slow "
        "disk share one virtual disk and 24 GiB of page cache, so a cachefs hit is a page-cache "
        "read while `raw cache dir` is the disk itself with O_DIRECT. The kernel keeps at most "
        "`max_background` asynchronous FUSE requests in flight per mount: cachefs, slowfs and "
        "passthrough.py all raise it from the kernel's 12 to 64 (through fusectl).",
        "",
        "Columns: IOPS = read + write; mean latency is over all I/Os (for 70/30 that is the "
        "70/30-weighted mean the FlashSoft paper reports); p99 is fio's total-latency p99 per "
        "direction; x BACKING / x raw = IOPS ratio against those rows of the same workload; "
        "BACKING MiB = bytes read + written on the slowfs mount (its counters) during the "
        "measured window; hit ratio = cachefs `hit_ops / read_ops` delta over the window (when "
        "FUSE passthrough served every read, so the daemon saw none: 1 - the bytes cachefs "
        "read from BACKING / the bytes fio read); "
        "daemon CPU = utime+stime of the daemon serving the row (cachefs, or slowfs for "
        "BACKING, or passthrough.py) over the window, in % of one CPU. Warm-up: 64 KiB random "
        "reads over the whole file until a pass is >= 95 % hits (bench/jobs/warmup.fio). "
        "coherence drops = cached extents cachefs dropped because BACKING looked changed "
        "(`cachefs-ctl stats --json` drops.coherence): in the measured window / over the whole "
        "mount, warm-up included, after one more open and read of the file; stale files and "
        "conflicts are shown when not 0. Nobody else touches BACKING here, so all should be 0.",
        "",
        table(results),
        "",
    ]
    warm = []
    for wl, rows in results["rows"].items():
        for system, r in rows.items():
            if "warmup" in r:
                warm.append(f"{wl}/{system}: " + ", ".join(
                    f"{p['hit_ratio']:.2f} in {p['s']:.0f} s" for p in r["warmup"]["passes"]))
    if warm:
        parts += ["Warm-up passes (hit ratio of each pass, duration): " + "; ".join(warm) + ".",
                  ""]
    burst = (results["rows"].get("write-burst") or {}).get("write-back", {})
    polls = [q for q in burst.get("timeline", {}).get("polls", []) if "dirty_bytes" in q]
    if polls:
        peak = max(q["dirty_bytes"] for q in polls)
        rate = max((q.get("destage_rate", 0) for q in polls), default=0)
        drain = burst["timeline"].get("drain_s")
        parts += [f"write-burst, write-back: peak dirty {peak / MiB:.0f} MiB (--dirty-high "
                  f"{min(st['dirty_high'], st['size'] * 2 // 4) // MiB} MiB), highest destage "
                  f"rate {rate / 1e6:.1f} MB/s; dirty data reached zero "
                  + (f"{drain:.1f} s after the writer finished." if drain is not None else
                     "not within the wait (see results.json)."), ""]
    if results.get("warming"):
        parts += [warming.markdown(results["warming"]), ""]
    dt = density_table(results)
    if dt:
        steps = "1, 4, 16" if st["quick"] else "1, 2, 3, 4, then x1.5"
        parts += ["### Density",
                  "",
                  f"Rate-limited clients (bench/jobs/density.fio: each 84 reads + 36 writes/s, "
                  f"4 KiB random, QD 1, all on the one warmed file), {st['density_runtime']} s "
                  f"per step; clients are added ({steps}) until a step does not "
                  f"fit, then the boundary is bisected (at most {st['density_max_steps']} "
                  f"steps). A step fits when the mean latency is within the {SLA_MS:g} ms SLA "
                  f"of the Hitachi report and the clients got >= {100 * MIN_DELIVERED:.0f} % of "
                  f"their rate (QD-1 clients slow down instead of queueing, so a saturated "
                  f"BACKING can stay under 15 ms while delivering far less; FlashSoft read the "
                  f"same IOPS drop as the bottleneck). A range means the search did not bisect "
                  f"down to one client.", "", dt, ""]
    parts += ["### Targets (issue #4)", "", "| target | measured | verdict |", "|---|---|---|"]
    parts += [f"| {a} | {b} | {c} |" for a, b, c in targets(results)]
    parts.append("")
    if plots:
        parts += ["### Plots", ""]
        for key, (fname, title) in plots.items():
            if fname:
                parts.append(f"![{title}]({img_prefix}{fname})")
                if "skipped" in title:
                    parts += ["", f"Note: {title}.", ""]
            else:
                parts.append(f"- {title}")
        parts.append("")
    return "\n".join(parts)


def update_docs(md: str, path: str) -> None:
    with open(path) as f:
        text = f.read()
    section = f"{BEGIN}\n{md}\n{END}"
    if BEGIN in text and END in text:
        text = text[:text.index(BEGIN)] + section + text[text.index(END) + len(END):]
    else:
        text = (text.rstrip("\n") + "\n\n## Full runner results (issue #4)\n\n"
                "Regenerated by `python3 bench/run.py` between the markers below; do not edit "
                "by hand.\n\n" + section + "\n")
    with open(path, "w") as f:
        f.write(text)


def _on_sigterm(signum, frame):
    raise KeyboardInterrupt("SIGTERM")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="bench/run.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small file, short runs, a subset")
    ap.add_argument("--only", default="", help="comma-separated workloads (and/or 'density'): "
                    + ", ".join([w.name for w in WORKLOADS] + list(EXTRA)))
    ap.add_argument("--out", default=None, help="results directory "
                    "(default /var/tmp/cachefs-bench-results)")
    ap.add_argument("--size", type=parse_size, default=None, help="workload file size "
                    "(default 1G, --quick 256M)")
    ap.add_argument("--runtime", type=int, default=None, help="measured seconds per run "
                    "(default 30, --quick 5)")
    docs = ap.add_mutually_exclusive_group()
    docs.add_argument("--docs", action="store_true", default=None,
                      help="rewrite docs/benchmarks.md's runner section and docs/img/")
    docs.add_argument("--no-docs", dest="docs", action="store_false")
    ap.add_argument("--from-json", help="re-render a results.json (no measurements)")
    args = ap.parse_args(argv)

    out = os.path.abspath(args.out or "/var/tmp/cachefs-bench-results")
    os.makedirs(out, exist_ok=True)
    if args.from_json:
        with open(args.from_json) as f:
            results = json.load(f)
    else:
        if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
            print("bench/run.py: needs root and /dev/fuse (it mounts FUSE filesystems).",
                  file=sys.stderr)
            return 2
        for tool in ("fio", "fusermount3"):
            if not shutil.which(tool):
                print(f"bench/run.py: {tool} is not installed.", file=sys.stderr)
                return 2
        st = settings(args)
        known = {w.name for w in WORKLOADS} | set(EXTRA)
        st.only = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in st.only if n not in known]
        if unknown:
            print(f"bench/run.py: unknown workload(s) {', '.join(unknown)}; known: "
                  f"{', '.join(sorted(known))}.", file=sys.stderr)
            return 2
        signal.signal(signal.SIGTERM, _on_sigterm)        # unmount in `finally` on kill
        results = run(st, out, argv)
        with open(os.path.join(out, "results.json"), "w") as f:
            json.dump(results, f, indent=1)

    for r in (results.get("density") or {}).values():      # the current fit rule
        if "steps" in r:
            r["fits"], r["first_over"], r["exact"] = density_fit(r)
    write_docs = args.docs if args.docs is not None else (
        not results["settings"]["quick"] and not results["settings"]["only"]
        and not args.from_json)
    img = os.path.join(out, "img")
    try:
        import plot                                         # bench/plot.py
        plots = plot.make_all(results, img)
    except ImportError as exc:
        log(f"no plots: {exc} (pip install matplotlib)")
        plots = {}
    md = markdown(results, plots, "img/")
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(md + "\n")
    print(md)
    if write_docs:
        dimg = os.path.join(REPO, "docs", "img")
        os.makedirs(dimg, exist_ok=True)
        for fname, _ in plots.values():
            if fname:
                shutil.copy(os.path.join(img, fname), os.path.join(dimg, fname))
        update_docs(markdown(results, plots, "img/"), os.path.join(REPO, "docs",
                                                                   "benchmarks.md"))
        log("docs/benchmarks.md and docs/img/ updated")
    log(f"results in {out} ({results['elapsed_s'] / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
