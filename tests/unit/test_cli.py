"""The command-line tools themselves (no mount): what they load and how they answer."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cachefs.errors import UserError


def test_the_command_line_tools_load_no_engine():
    """`cachefs mount`'s own process (its daemon is another), `cachefs umount` and every
    `cachefs-ctl` command started by importing the whole engine (trio, pyfuse3,
    prometheus_client): ~0.2 s of CPU each, and `cachefs-ctl stats` waited for it."""
    code = ("import sys, cachefs_cli.main, cachefs_cli.ctl, cachefs_cli.client\n"
            "print(sorted(m for m in ('trio', 'pyfuse3', 'prometheus_client', 'tqdm', "
            "'cachefs.mount', 'cachefs.fs') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd="/", timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_stats_of_a_daemon_of_an_older_cachefs_is_a_sentence():
    """After the package is upgraded, the daemons already running are the older version's
    until remounted: their stats lack counters the table shows, and `cachefs-ctl stats`
    died with a KeyError traceback (a helper's hunt, against a schema-2 daemon)."""
    from cachefs_cli import ctl
    old = {"cache_used": 0, "cache_size": 1 << 30, "mountpoint": "/m", "backing": "/b",
           "mode": "write-through"}
    with pytest.raises(UserError, match=r"runs an older cachefs, which does not report "
                                         r"'cache_dir': `cachefs-ctl stats --json /m`"):
        ctl._rendered(old, "/m")
