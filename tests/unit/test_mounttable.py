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


def test_unescape_keeps_utf8_names_and_decodes_octal_escapes():
    """A mountpoint with a space (\\040) and a non-ASCII letter was decoded as Latin-1:
    `cachefs umount` said it was no cachefs mount, and a second mount stacked on it (a
    helper's CLI hunt)."""
    from cachefs.mounttable import unescape
    assert unescape("/tmp/mnt\\040sp\\040\u00e9") == "/tmp/mnt sp \u00e9"
    assert unescape("/a\\134b\\012c\\011d") == "/a\\b\nc\td"
    assert unescape("/plain\u00e9") == "/plain\u00e9"
    assert unescape("/bad\\377") == os.fsdecode(b"/bad\xff")     # not UTF-8: surrogates
