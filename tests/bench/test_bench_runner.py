"""bench/run.py --quick on one cheap workload: a well-formed markdown table with numeric IOPS.

Mounts slowfs, cachefs (write-through, and write-back when it is available) and the bare
passthrough, so it needs root, /dev/fuse and fio; about 45 s.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.fuse,
    pytest.mark.slow,
    pytest.mark.skipif(not shutil.which("fio") or not shutil.which("fusermount3")
                       or os.geteuid() != 0, reason="needs fio, fusermount3 and root"),
]

COLUMNS = ["workload", "system", "IOPS", "MB/s", "read / write IOPS", "mean lat ms",
           "read / write mean ms", "read / write p99 ms", "x BACKING", "x raw",
           "BACKING MiB", "hit ratio", "daemon CPU %", "coherence drops"]


PREFIX = "/var/tmp/cachefs-bench."


def mounted_under(prefix: str) -> list[str]:
    with open("/proc/self/mounts", errors="surrogateescape") as f:
        return [ln.split()[1] for ln in f if ln.split()[1].startswith(prefix)]


def test_quick_runner_table(tmp_path):
    before = set(mounted_under(PREFIX))
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "bench" / "run.py"), "--quick", "--only", "nlvmug-read",
         "--size", "16M", "--runtime", "1", "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
        start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=150)
        left = set(mounted_under(PREFIX)) - before
    finally:
        # A runner stopped by the timeout left its mounts and daemons (a loaded CI run):
        # they go with it, also when the test fails.
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for mnt in set(mounted_under(PREFIX)) - before:
            subprocess.run(["fusermount3", "-u", "-z", mnt], capture_output=True)
    res = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    assert res.returncode == 0, res.stderr[-3000:]
    assert not left, f"runner left mounts: {left}"

    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("| nlvmug-read ")
             or ln.startswith("| workload ")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header == COLUMNS
    rows = {}
    for ln in lines[1:]:
        cells = [c.strip() for c in ln.strip().strip("|").split("|")]
        assert len(cells) == len(COLUMNS), ln
        rows[cells[1]] = dict(zip(COLUMNS, cells))
    expected = {"BACKING (slowfs)", "cachefs write-through", "cachefs write-back",
                "raw cache dir", "passthrough.py"}
    assert set(rows) == expected

    def num(cell: str) -> float:
        assert re.fullmatch(r"[\d,]+(\.\d+)?", cell), cell
        return float(cell.replace(",", ""))

    for name in expected - {"cachefs write-back"}:
        assert num(rows[name]["IOPS"]) > 0, rows[name]
        assert num(rows[name]["mean lat ms"]) > 0
    wb = rows["cachefs write-back"]
    assert wb["IOPS"].startswith("n/a") or num(wb["IOPS"]) > 0, wb
    wt = rows["cachefs write-through"]
    assert num(wt["hit ratio"]) >= 0.9              # warmed before measuring
    assert wt["coherence drops"] == "0 / 0"         # nobody else touches BACKING (issue 9)
    assert num(rows["BACKING (slowfs)"]["x BACKING"]) == 1.0
    assert num(rows["raw cache dir"]["x raw"]) == 1.0
    assert num(rows["BACKING (slowfs)"]["BACKING MiB"]) > 0

    results = json.loads((out / "results.json").read_text())
    assert results["rows"]["nlvmug-read"]["write-through"]["iops"] > 0
    assert (out / "img" / "bench-iops.png").stat().st_size > 1000
    assert "| target | measured | verdict |" in res.stdout
