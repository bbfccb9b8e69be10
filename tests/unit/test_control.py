"""The control channel's server (cachefs/control.py): a command that fails on an SSD or
database error answers with the error and the server goes on (it ended the daemon: a flush
whose durable commit met a full cache file system unmounted everything)."""

from __future__ import annotations

import json
import socket
import sqlite3

import trio

from cachefs.control import ControlServer


async def _ask(path: str, cmd: str) -> dict:
    def call() -> dict:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(path)
            s.sendall(json.dumps({"cmd": cmd}).encode() + b"\n")
            return json.loads(s.makefile().readline())
    return await trio.to_thread.run_sync(call)


async def test_a_command_failing_on_the_ssd_answers_and_the_server_goes_on(tmp_path):
    async def full(request, progress):
        raise sqlite3.OperationalError("database or disk is full")

    async def eio(request, progress):
        raise OSError(5, "Input/output error")

    async def stats(request, progress):
        return {"fine": 1}

    path = str(tmp_path / "control.sock")
    server = ControlServer(path, {"flush": full, "drop": eio, "stats": stats})
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        a = await _ask(path, "flush")
        assert a == {"ok": False, "error": "flush failed: database or disk is full"}
        b = await _ask(path, "drop")
        assert b["ok"] is False and "Input/output error" in b["error"]
        assert await _ask(path, "stats") == {"ok": True, "fine": 1}
        nursery.cancel_scope.cancel()


def test_the_run_directory_is_writable_by_its_owner_only(tmp_path, monkeypatch):
    """The daemon runs with umask 0: making /run/cachefs/mounts made /run/cachefs 0777 on
    the way (found by the suite's own access test after a fresh boot), and any user could
    put a socket or link there in place of a mount's. Made 0755, and put back to it."""
    import os
    import stat

    from cachefs import control

    run = tmp_path / "run"
    monkeypatch.setattr(control, "RUN_DIR", str(run))
    monkeypatch.setattr(control, "MOUNTS_DIR", str(run / "mounts"))
    old = os.umask(0)
    try:
        assert control.register("/some/mountpoint", str(tmp_path / "x.sock")) is not None
        assert stat.S_IMODE(os.stat(run).st_mode) == 0o755
        assert stat.S_IMODE(os.stat(run / "mounts").st_mode) == 0o755
        os.chmod(run, 0o777)                    # left so by another program
        assert control.register("/other/mountpoint", str(tmp_path / "y.sock")) is not None
        assert stat.S_IMODE(os.stat(run).st_mode) == 0o755
    finally:
        os.umask(old)


async def test_a_control_socket_removed_behind_the_daemon_is_made_again(tmp_path, monkeypatch):
    """A cleaner of old files (or an operator) removed control.sock: the mount could never be
    flushed, queried or stopped by `cachefs umount --flush` (a unit's ExecStop) again (a
    helper's hunt)."""
    import os

    from cachefs import control
    monkeypatch.setattr(control, "SOCKET_CHECK_S", 0.05)

    async def stats(request, progress):
        return {"fine": 1}

    path = str(tmp_path / "control.sock")
    server = ControlServer(path, {"stats": stats})
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        os.unlink(path)
        with trio.fail_after(5):
            while not os.path.exists(path):
                await trio.sleep(0.02)
        assert await _ask(path, "stats") == {"ok": True, "fine": 1}
        nursery.cancel_scope.cancel()


async def test_the_control_socket_path_never_names_a_socket_that_refuses(tmp_path, monkeypatch):
    """The socket was bound at its path and listened a moment later: a cachefs-ctl
    connecting in between (while it is made again, the suite under load) was refused
    (ECONNREFUSED). It is made under another name and renamed into place once it listens:
    whenever the path names a socket, it takes connections. Checked at the one step between
    the two, the chmod of the new socket."""
    import os

    from cachefs import control
    monkeypatch.setattr(control, "SOCKET_CHECK_S", 0.05)
    path = str(tmp_path / "control.sock")
    refused = []
    chmod = os.chmod

    def probing_chmod(target, mode, *args, **kwargs):
        if os.path.exists(path):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                try:
                    s.connect(path)
                except ConnectionRefusedError:
                    refused.append(target)
        return chmod(target, mode, *args, **kwargs)

    async def stats(request, progress):
        return {"fine": 1}

    monkeypatch.setattr(control.os, "chmod", probing_chmod)
    server = ControlServer(path, {"stats": stats})
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        for _ in range(3):
            first = os.stat(path).st_ino
            os.unlink(path)
            with trio.fail_after(5):
                while not os.path.exists(path):
                    await trio.sleep(0.01)
            assert os.stat(path).st_ino != first
            assert await _ask(path, "stats") == {"ok": True, "fine": 1}
        nursery.cancel_scope.cancel()
    assert refused == []
    assert not os.path.exists(path)
    assert os.listdir(tmp_path) == []

