"""The daemon's recent history on a real mount: rates over windows and decaying hit ratios in
`cachefs-ctl stats` ("windows" in --json), the read-only `history` control command, and
`cachefs-ctl stats --plot FILE.png --window 5m`."""

from __future__ import annotations

import os
import subprocess

import pytest

from cachefs_cli import client
from tests.conftest import CTL, wait_until
from tests.mount.test_lifetime_stats import _read_direct

# These count the reads the daemon answers: FUSE passthrough reads never reach it.
pytestmark = [pytest.mark.fuse, pytest.mark.no_passthrough]

SIZE = 1 << 20
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _ctl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CTL, *args], capture_output=True, text=True, timeout=60)


def test_windows_history_and_plot(make_mount, tmp_path):
    m = make_mount("--mode", "write-back", "--promote-after", "1")
    data = os.urandom(SIZE)
    (m.backing / "f").write_bytes(data)
    assert _read_direct(m.path("f"), SIZE) == data             # misses, promoted
    wait_until(lambda: m.stats()["extents_cached"] >= 16, 20, m.proc, "the promotion")
    for _ in range(3):
        assert _read_direct(m.path("f"), SIZE) == data         # hits
    m.path("g").write_bytes(os.urandom(SIZE))

    def windows() -> dict:
        return m.stats()["windows"]

    wait_until(lambda: (windows()["rates"]["10s"] or {}).get("read_iops", 0) > 0, 10, m.proc,
               "the reads in the 10 s rate")
    w = windows()
    assert set(w["rates"]) == {"1s", "10s", "1m"}
    assert set(w["hit_ratio"]) == {"1m", "5m", "1h", "1d"}
    s = m.stats()
    assert w["rates"]["1m"]["read_iops"] > 0 and w["rates"]["1m"]["read_bytes_per_s"] > 0
    wait_until(lambda: (windows()["rates"]["10s"] or {}).get("write_iops", 0) > 0, 10, m.proc,
               "the writes in the 10 s rate")
    r = windows()["hit_ratio"]
    # 3 of the 4 passes hit: every decayed ratio is near the mount's own 3/4
    assert s["hit_ratio"] > 0.7
    for name in ("1m", "5m", "1h", "1d"):
        assert 0.6 < r[name]["ops"] <= 1 and 0.6 < r[name]["bytes"] <= 1, r

    text = _ctl("stats", str(m.mnt))
    assert text.returncode == 0, text.stderr
    assert "last 1 s / 10 s / 1 min" in text.stdout
    assert "hit ratio, decaying  1 min " in text.stdout, text.stdout

    hist = client.request(str(m.mnt), "history", window=300)["history"]
    cols = hist["columns"]
    assert hist["step_s"] == 1 and len(cols["t"]) >= 2
    assert cols["read_ops"][-1] >= s["read_ops"] and cols["read_ops"] == sorted(cols["read_ops"])
    assert max(c for c in cols["cache_used"]) >= SIZE
    assert any(v is not None for v in cols["ssd_hit_p50_ns"])

    out = tmp_path / "out.png"
    res = _ctl("stats", str(m.mnt), "--plot", str(out), "--window", "5m")
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(f"wrote {out} (") and res.stderr == ""
    head = out.read_bytes()[:8]
    assert head == PNG_SIGNATURE and out.stat().st_size > 10_000
    import matplotlib.image
    img = matplotlib.image.imread(out)
    assert img.shape[0] > 500 and img.shape[1] > 500

    day = tmp_path / "day.png"                 # beyond an hour: the per-minute ring
    res = _ctl("stats", str(m.mnt), "--plot", str(day), "--window", "1d", "--json")
    assert res.returncode == 0, res.stderr
    assert '"step_s": 60' in res.stdout and day.read_bytes()[:8] == PNG_SIGNATURE

    bare = tmp_path / "noext"                  # matplotlib adds .png: the message says so
    res = _ctl("stats", str(m.mnt), "--plot", str(bare))
    assert res.returncode == 0 and res.stdout.startswith(f"wrote {bare}.png ("), res
    assert (tmp_path / "noext.png").read_bytes()[:8] == PNG_SIGNATURE


PLOT_MISTAKES = [
    (["--plot", "x.png", "--window", "5x"],
     "--window takes a duration from 1s to 1d like 30s, 10m, 1h or 1d, not '5x'."),
    (["--plot", "x.png", "--window", "2d"],
     "--window takes a duration from 1s to 1d like 30s, 10m, 1h or 1d, not '2d'."),
    (["--window", "5m"], "--window is the span of a --plot; give --plot FILE.png with it."),
    (["--plot", "x.png", "--watch", "1"], "--plot draws once; it does not go with --watch."),
    (["--plot", ""], "--plot needs a file name such as history.png (got '')."),
    (["--plot", "."], "--plot needs a file name such as history.png (got '.')."),
]


def test_plot_mistakes(make_mount, tmp_path):
    """Each mistake a sentence and exit 2, nothing written (one mount for them all: a mount
    and a plot each cost the suite ~8 s)."""
    m = make_mount("--mode", "write-through")
    for args, sentence in PLOT_MISTAKES:
        res = subprocess.run([*CTL, "stats", str(m.mnt), *args], capture_output=True,
                             text=True, cwd=tmp_path, timeout=60)
        assert res.returncode == 2 and res.stderr == f"cachefs-ctl: {sentence}\n", (args, res)
        assert not (tmp_path / "x.png").exists()
    res = _ctl("stats", str(m.mnt), "--plot", str(tmp_path / "no" / "x.png"))
    assert res.returncode == 2
    assert res.stderr == f"cachefs-ctl: cannot write {tmp_path / 'no' / 'x.png'}: No such " \
        "file or directory.\n"


def test_history_command_rejects_a_bad_window(make_mount):
    m = make_mount("--mode", "write-through")
    for window in (0, -5, 86400 * 2, "1h", True):
        with pytest.raises(Exception) as err:
            client.request(str(m.mnt), "history", window=window)
        assert str(err.value) == "the history window is a number of seconds from 1 to 86400."
