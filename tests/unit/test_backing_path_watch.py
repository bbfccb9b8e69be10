"""The daemon notices when BACKING's path stops leading to the directory it opened (BACKING
lazily unmounted, another filesystem or directory put in its place): it goes on serving and
destaging into the directory it holds, as any program would, and said nothing (a helper's
hunt: fsynced data went with a lazily unmounted tmpfs). One WARNING, one line back."""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace

import trio

from cachefs.errors import BackingTimeout
from cachefs.mount import Daemon


def test_a_backing_path_that_leads_elsewhere_is_said_once_and_its_return_too(tmp_path, caplog):
    held, other = tmp_path / "held", tmp_path / "other"
    held.mkdir()
    other.mkdir()
    path = tmp_path / "backing"
    path.symlink_to(held)
    fd = os.open(held, os.O_RDONLY | os.O_DIRECTORY)
    hung = []

    async def read_call(what, fn, *args):
        if hung:
            raise BackingTimeout("stat", 5.0)
        return fn(*args)

    daemon = SimpleNamespace(backing=SimpleNamespace(root_fd=fd, read_call=read_call),
                             cfg=SimpleNamespace(backing=str(path)), _backing_moved=False)
    check = Daemon._check_backing_path

    def step() -> list[str]:
        caplog.clear()
        trio.run(check, daemon)
        return [r.getMessage() for r in caplog.records]

    try:
        with caplog.at_level(logging.INFO, logger="cachefs"):
            assert step() == []
            path.unlink()
            path.symlink_to(other)                  # another directory in its place
            said = step()
            assert len(said) == 1 and "no longer leads to the directory" in said[0]
            assert step() == []                     # once
            hung.append(1)                          # a hung BACKING is not a move
            assert step() == [] and daemon._backing_moved
            hung.clear()
            path.unlink()
            path.symlink_to(held)
            said = step()
            assert len(said) == 1 and "leads to the directory this mount opened again" \
                in said[0]
            path.unlink()                           # gone
            assert "no longer leads" in step()[0]
    finally:
        os.close(fd)
