"""A real database on cachefs: PostgreSQL with data checksums, its data directory on the
mount, a pool a fraction of the database; pgbench and a client whose every acknowledged
commit is noted; kill -9 of the cachefs daemon mid-run (then of PostgreSQL), remount,
crash recovery from PostgreSQL's WAL, and the checks a DBA would run: every acknowledged
commit is there, pgbench's balances agree across its tables and with its history, amcheck
finds heap and indexes consistent, and pg_checksums finds no bad block.

Runs where PostgreSQL's server binaries are installed (Debian's postgresql package) and a
`postgres` user exists; skipped otherwise. Write-through runs in the long tier only
(CACHEFS_LONG=1). PostgreSQL refuses to run as root, so the mount's
directories are made traversable for that user.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests.conftest import env_long, mount_factory

pytestmark = [pytest.mark.fuse, pytest.mark.slow]
PORT = "5497"


def pg_bindir() -> str:
    dirs = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda d: int(d.split("/")[-2]))
    if not dirs or not os.path.exists(os.path.join(dirs[-1], "pgbench")):
        pytest.skip("PostgreSQL's server binaries are not installed")
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        pytest.skip("no postgres user to run PostgreSQL as")
    return dirs[-1]


class Postgres:
    def __init__(self, bindir: str, data: Path, sock: Path, log: Path):
        self.bindir, self.data, self.sock, self.log = bindir, data, sock, log

    def run(self, tool: str, *args: str, check: bool = True, timeout: float = 300
            ) -> subprocess.CompletedProcess:
        out = subprocess.run(["runuser", "-u", "postgres", "--",
                              os.path.join(self.bindir, tool), *args],
                             capture_output=True, text=True, timeout=timeout)
        if check:
            assert out.returncode == 0, f"{tool} {args}: {out.stdout[-2000:]}{out.stderr[-2000:]}"
        return out

    def client(self, tool: str, *args: str) -> list[str]:
        return [os.path.join(self.bindir, tool), "-h", str(self.sock), "-p", PORT, *args]

    def sql(self, query: str) -> str:
        return self.run("psql", "-h", str(self.sock), "-p", PORT, "-Atc", query,
                        "postgres").stdout.strip()

    def start(self) -> None:
        out = self.run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w", "-t", "300",
                       "-o", f"-p {PORT} -k {self.sock} -c listen_addresses=''", "start",
                       check=False, timeout=330)
        assert out.returncode == 0, f"{out.stdout}{out.stderr}; its log ends:\n" + \
            self.log.read_text(errors="replace")[-3000:]

    def stop(self, check: bool = True) -> None:
        self.run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop", check=check)

    def processes(self) -> list[int]:
        """PostgreSQL's processes of this cluster: every one works in its data directory."""
        pids = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if os.readlink(f"/proc/{pid}/cwd").startswith(str(self.data)):
                    pids.append(int(pid))
            except OSError:
                pass
        return pids

    def kill(self) -> None:
        """kill -9 the postmaster and every backend, and wait until all are gone (a new
        postmaster refuses to start while an old one's PID still exists, and a process
        on its way out has no working directory left to be found by)."""
        pids: set[int] = set()
        for _ in range(300):
            pids |= set(self.processes())
            for pid in list(pids):
                try:
                    os.kill(pid, 9)
                    with open(f"/proc/{pid}/stat") as f:
                        if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                            pids.discard(pid)               # dead, its parent to reap it
                except (ProcessLookupError, FileNotFoundError):
                    pids.discard(pid)
            if not pids:
                return
            time.sleep(0.1)
        raise AssertionError(f"PostgreSQL processes {sorted(pids)} did not exit")


@pytest.mark.parametrize("mode", ["write-back", "write-through"])
def test_postgres_survives_kill9_of_the_daemon(mode):
    if mode == "write-through" and not env_long():
        pytest.skip("long tier: CACHEFS_LONG=1 (write-back, the mode with data only on "
                    "the SSD, runs in every tier)")
    bindir = pg_bindir()
    root = Path(tempfile.mkdtemp(prefix="cachefs-pg-", dir="/var/tmp"))
    os.chmod(root, 0o755)
    sock = root / "sock"
    sock.mkdir()
    shutil.chown(sock, "postgres")
    log = root / "pg.log"
    log.touch()
    shutil.chown(log, "postgres")
    pg = None
    try:
        with mount_factory(root) as make:
            backing = root / "backing"
            backing.mkdir()
            shutil.chown(backing, "postgres")
            # ~50 MB of tables and indexes through a 16 MiB pool: evictions and destages
            # run all the time; the dirty marks are a fraction of the pool.
            m = make("--mode", mode, "--cache-size", "16M", "--dirty-high", "4M",
                     "--dirty-low", "2M", "--promote-after", "1", backing=backing)
            os.chmod(root / "m", 0o755)
            pg = Postgres(bindir, m.mnt / "pg", sock, log)
            pg.run("initdb", "-D", str(pg.data), "--data-checksums", "-A", "trust",
                   "--no-sync")
            pg.start()
            pg.run("pgbench", "-h", str(sock), "-p", PORT, "-i", "-s", "3", "postgres")
            pg.sql("CREATE TABLE acked (id int PRIMARY KEY)")
            pg.sql("CREATE EXTENSION amcheck")
            # -n: pgbench keeps its history, so the balances must sum to the history's deltas
            bench = subprocess.Popen(["runuser", "-u", "postgres", "--",
                                      *pg.client("pgbench", "-n", "-c", "4", "-T", "60",
                                                 "postgres")],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            acked = 0
            deadline = time.monotonic() + 8
            try:
                while time.monotonic() < deadline:   # one commit at a time, each acknowledged
                    pg.sql(f"INSERT INTO acked VALUES ({acked + 1})")
                    acked += 1
                m.proc.kill()                         # the daemon dies under a running database
                m.proc.wait()
            finally:
                bench.kill()
                bench.wait()
            pg.kill()               # while the dead mount is attached: their cwd names it
            m.kill()                                  # detach it
            assert acked > 10
            m.start()
            # Every process of the old cluster is dead; some may be zombies nobody reaps yet
            # (the container's init here is slow to), which PostgreSQL takes for a running
            # postmaster: the stale locks go, as an administrator would remove it.
            (pg.data / "postmaster.pid").unlink()
            for stale in (f".s.PGSQL.{PORT}", f".s.PGSQL.{PORT}.lock"):
                (sock / stale).unlink(missing_ok=True)
            pg.start()                                # crash recovery from the WAL
            assert "redo" in log.read_text(errors="replace")
            assert int(pg.sql("SELECT count(*) FROM acked WHERE id <= %d" % acked)) == acked
            sums = pg.sql("SELECT (SELECT sum(abalance) FROM pgbench_accounts), "
                          "(SELECT sum(tbalance) FROM pgbench_tellers), "
                          "(SELECT sum(bbalance) FROM pgbench_branches), "
                          "(SELECT coalesce(sum(delta), 0) FROM pgbench_history)").split("|")
            assert len(set(sums)) == 1, sums
            pg.run("pg_amcheck", "-h", str(sock), "-p", PORT, "--heapallindexed", "-d",
                   "postgres")
            pg.stop()
            out = pg.run("pg_checksums", "--check", "-D", str(pg.data))
            assert "Bad checksums:  0" in out.stdout, out.stdout
            pg = None
    finally:
        if pg is not None:
            pg.kill()
        shutil.rmtree(root, ignore_errors=True)
