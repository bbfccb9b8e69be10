#!/usr/bin/env python3
"""Wait until a cachefs mount holds at least N cached extents (a benchmark's warm-up).

    python3 bench/wait_cached.py MOUNTPOINT N [TIMEOUT_S]

Exit 0 once it does, 1 after TIMEOUT_S (default 60) with how many it holds."""

import sys
import time

from cachefs_cli import client


def main() -> int:
    mnt, want = sys.argv[1], int(sys.argv[2])
    deadline = time.monotonic() + (float(sys.argv[3]) if len(sys.argv) > 3 else 60)
    while True:
        n = client.request(mnt, "stats")["stats"]["extents_cached"]
        if n >= want:
            return 0
        if time.monotonic() > deadline:
            print(f"wait_cached: {mnt} holds {n} extents, not {want}", file=sys.stderr)
            return 1
        time.sleep(0.2)


if __name__ == "__main__":
    sys.exit(main())
