"""What an O_RDWR open that writes nothing costs next to a reader in FUSE passthrough.

    python3 bench/mapped_open_cost.py TREE MODE SIZE_MB

Mounts a SIZE_MB file (random bytes) with cachefs from TREE (put first on PYTHONPATH: a
checkout of another commit, with `cachefs_cli` linked to its `cli`; the installed cachefs
when TREE is this checkout), caches it whole, holds it open read-only (passthrough), then
opens it O_RDWR and closes it three times, each time waiting for the daemon to take the
open's end (`passthrough_syncs`). Prints one JSON line: each open's latency and the bytes
written to BACKING (write-through) or destaged after a flush (write-back) meanwhile.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time


def main() -> int:
    tree, mode, size_mb = sys.argv[1], sys.argv[2], int(sys.argv[3])
    env = dict(os.environ, PYTHONPATH=tree)
    d = tempfile.mkdtemp(dir="/var/tmp")
    b, c, m = (os.path.join(d, x) for x in "bcm")
    for x in (b, m):
        os.mkdir(x)
    with open(os.path.join(b, "f"), "wb") as f:
        for _ in range(size_mb):
            f.write(os.urandom(1 << 20))

    def stats() -> dict:
        out = subprocess.run([sys.executable, "-m", "cachefs_cli.ctl", "stats", m, "--json"],
                             env=env, capture_output=True, text=True, check=True).stdout
        return json.loads(out)

    subprocess.run([sys.executable, "-m", "cachefs_cli.main", "mount", "--mode", mode,
                    "--cache-dir", c, "--cache-size", f"{2 * size_mb + 64}M", b, m],
                   env=env, check=True)
    try:
        for _ in range(2):
            subprocess.run(["dd", f"if={m}/f", "of=/dev/null", "bs=1M", "iflag=direct",
                            "status=none"], check=True)
        deadline = time.time() + 60
        while stats()["extents_cached"] < size_mb * 16 and time.time() < deadline:
            time.sleep(0.2)
        r = os.open(f"{m}/f", os.O_RDONLY)
        s0 = stats()
        lat = []
        for _ in range(3):
            syncs = stats()["passthrough_syncs"]
            t0 = time.perf_counter()
            w = os.open(f"{m}/f", os.O_RDWR)
            lat.append(time.perf_counter() - t0)
            os.close(w)
            until = time.time() + 60
            while stats()["passthrough_syncs"] == syncs and time.time() < until:
                time.sleep(0.05)
        if mode == "write-back":
            subprocess.run([sys.executable, "-m", "cachefs_cli.ctl", "flush", m], env=env,
                           capture_output=True)
        s1 = stats()
        os.close(r)
        mib = 1 << 20
        print(json.dumps({
            "tree": tree, "mode": mode, "size_mb": size_mb,
            "open_ms": [round(x * 1000, 1) for x in lat],
            "backing_write_mb": round((s1["backing_write_bytes"]
                                       - s0["backing_write_bytes"]) / mib, 1),
            "destaged_mb": round((s1["destaged_bytes"] - s0["destaged_bytes"]) / mib, 1)}))
    finally:
        subprocess.run([sys.executable, "-m", "cachefs_cli.main", "umount", m], env=env)
        subprocess.run(["rm", "-rf", d])
    return 0


if __name__ == "__main__":
    sys.exit(main())
