"""mounttable.resolve: a path as the mount table names it, symlinks followed by readlink
alone (realpath stats the mount's root, which waits on a hung BACKING)."""

import os

from cachefs.mounttable import resolve


def test_resolve_agrees_with_realpath(tmp_path, monkeypatch):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "rel").symlink_to("a/b")
    (tmp_path / "abs").symlink_to(tmp_path / "a")
    (tmp_path / "a" / "up").symlink_to("..")
    (tmp_path / "loop").symlink_to("loop")
    monkeypatch.chdir(tmp_path)
    for p in ("rel", "rel/", f"{tmp_path}/abs/b/../b", "a/up/rel", "rel/..", "abs/..",
              "missing/x", "/", ".", "a/./b"):
        assert resolve(p) == os.path.realpath(p), p
    assert resolve("loop") == str(tmp_path / "loop")        # no endless loop


def test_resolve_does_not_stat(tmp_path, monkeypatch):
    (tmp_path / "a").mkdir()
    (tmp_path / "l").symlink_to("a")

    def no_stat(*args, **kw):
        raise AssertionError("stat called")
    monkeypatch.setattr(os, "stat", no_stat)
    monkeypatch.setattr(os, "lstat", no_stat)
    assert resolve(str(tmp_path / "l")) == str(tmp_path / "a")
