"""BACKING paths relative to a descriptor of BACKING's root (cachefs/backing.py `at`), and
the end of a FUSE session by ECONNABORTED (cachefs/mount.py `_fuse_main`)."""

import errno
import os

import pytest
import trio

from cachefs import backingpaths as bp
from cachefs import mount

NAME = b"n" * 250


def test_paths_longer_than_path_max_are_walked_in_pieces(tmp_path):
    root = bp.open_root(str(tmp_path))
    try:
        rel = b"."
        parts = []
        for _ in range(25):                        # 6.3 KB below the root
            parts.append(NAME)
            bp.mkdir(root, b"/".join(parts), 0o755, -1, -1, b"/".join(parts[:-1]) or b".")
        rel = b"/".join(parts)
        assert len(rel) > bp.PATH_MAX
        fd, st = bp.create(root, rel + b"/f", os.O_RDWR | os.O_CLOEXEC, 0o644, -1, -1, rel)
        os.write(fd, b"hello")
        os.close(fd)
        assert bp.lstat(root, rel + b"/f").st_size == 5
        bp.setxattr(root, rel + b"/f", None, b"user.k", b"v")
        assert bp.getxattr(root, rel + b"/f", None, b"user.k") == b"v"
        assert bp.listxattr(root, rel + b"/f", None) == ["user.k"]
        bp.rename(root, rel + b"/f", rel + b"/g", 0)
        assert [n for n, _ in bp.scandir(root, rel)] == [b"g"]
        assert bp.truncate_stat(root, rel + b"/g", None, 2).st_size == 2
        with pytest.raises(OSError) as exc:
            bp.getxattr(root, rel + b"/g", None, b"user.absent")
        assert exc.value.errno == errno.ENODATA
        st, held = bp.unlink(root, rel + b"/g")
        assert st.st_size == 2 and held >= 0
        os.close(held)
    finally:
        os.close(root)


def test_connection_aborted_ends_the_session_quietly(monkeypatch):
    """An unmount under load once ended the daemon with a ConnectionAbortedError traceback
    (the kernel answers a read of /dev/fuse with ECONNABORTED when the connection goes
    away while a request is being copied out): that is the end of the session too."""
    async def aborted():
        raise OSError(errno.ECONNABORTED, "fuse_session_receive_buf failed")
    monkeypatch.setattr(mount.pyfuse3, "main", aborted)
    trio.run(mount._fuse_main)


def test_create_never_takes_over_a_file_someone_else_made_meanwhile(tmp_path):
    """CREATE comes after the kernel looked the name up as absent. A file made in between
    (another client of BACKING) must not be chowned to the caller nor opened without the
    kernel's permission check: ESTALE (the kernel looks the name up again and opens the
    existing file); with O_EXCL, EEXIST as usual."""
    root = bp.open_root(str(tmp_path))
    try:
        (tmp_path / "theirs").write_bytes(b"secret")
        os.chmod(tmp_path / "theirs", 0o600)
        os.chown(tmp_path / "theirs", 0, 0)
        for flags, want in ((os.O_RDWR, errno.ESTALE), (os.O_RDWR | os.O_EXCL, errno.EEXIST)):
            with pytest.raises(OSError) as exc:
                bp.create(root, b"theirs", flags | os.O_CLOEXEC, 0o644, 12345, 12345, b".")
            assert exc.value.errno == want
        st = os.stat(tmp_path / "theirs")
        assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (0, 0, 0o600)
        assert (tmp_path / "theirs").read_bytes() == b"secret"
        fd, st = bp.create(root, b"mine", os.O_RDWR | os.O_CLOEXEC, 0o644, 12345, 12345, b".")
        os.close(fd)
        if os.geteuid() == 0:
            assert (st.st_uid, st.st_gid) == (12345, 12345)
    finally:
        os.close(root)


def test_nodes_are_made_under_the_callers_umask_in_that_thread_only(tmp_path):
    """creating_under: the caller's umask applies to the node (BACKING's rule), in the
    thread that makes it; the process's umask (the daemon's, and other threads') stays."""
    import threading
    root = bp.open_root(str(tmp_path))
    old = os.umask(0)
    try:
        seen = []
        go, hold = threading.Event(), threading.Event()

        def maker():
            with bp.creating_under(0o077):
                go.set()
                hold.wait(5)                    # the main thread looks meanwhile
                fd, _ = bp.create(root, b"f", os.O_RDWR | os.O_CLOEXEC, 0o666, -1, -1, b".")
            os.close(fd)
            bp.mkdir(root, b"d", 0o777, -1, -1, b".", 0o027)
            bp.mknod(root, b"p", 0o10666, 0, -1, -1, b".", 0o002)
            seen.append(os.umask(0o022))
            os.umask(seen[-1])
        t = threading.Thread(target=maker)
        t.start()
        assert go.wait(5)
        assert os.umask(0) == 0                 # another thread's umask is not ours
        hold.set()
        t.join(10)
        assert seen == [0]                      # and that thread's own is back to the daemon's
        modes = {n: os.stat(tmp_path / n).st_mode & 0o777 for n in ("f", "d", "p")}
        assert modes == {"f": 0o600, "d": 0o750, "p": 0o664}
    finally:
        os.umask(old)
        os.close(root)


def test_a_file_renamed_during_the_walk_is_still_found(tmp_path, monkeypatch):
    """open_by_ino walks BACKING for a file not at its path hint; a rename during the walk
    into a directory already walked must not make it look deleted (its dirty data would be
    discarded)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "z").mkdir()
    (tmp_path / "z" / "f").write_bytes(b"dirty")
    ino = (tmp_path / "z" / "f").stat().st_ino
    real_fwalk = os.fwalk
    moves = []

    def fwalk_with_a_rename(*args, **kwargs):
        for n, item in enumerate(real_fwalk(*args, **kwargs)):
            yield item
            if n == 0 and not moves:           # the root is walked: move the file into it
                os.rename(tmp_path / "z" / "f", tmp_path / "f")
                moves.append(1)

    monkeypatch.setattr(bp.os, "fwalk", fwalk_with_a_rename)
    root = bp.open_root(str(tmp_path))
    try:
        fd = bp.open_by_ino(root, b"z/old-name", ino)
        assert fd >= 0 and moves
        assert os.fstat(fd).st_ino == ino
        os.close(fd)
        os.unlink(tmp_path / "f")
        assert bp.open_by_ino(root, b"f", ino) == -1
    finally:
        os.close(root)


def test_removing_holds_the_number_unless_out_of_descriptors(tmp_path, monkeypatch):
    """unlink and rmdir hand back an O_PATH descriptor of what they removed (a file, one of
    its names or its last, a directory); out of descriptors they still remove it, without
    one."""
    root = bp.open_root(str(tmp_path))
    try:
        (tmp_path / "f").write_bytes(b"x")
        (tmp_path / "d").mkdir()
        st, held = bp.unlink(root, b"f")
        assert held >= 0 and os.fstat(held).st_ino == st.st_ino
        os.close(held)
        st, held = bp.rmdir(root, b"d")
        assert held >= 0
        os.close(held)
        (tmp_path / "g").write_bytes(b"x")
        os.link(tmp_path / "g", tmp_path / "g2")
        st, held = bp.unlink(root, b"g")
        assert held >= 0                    # another name is left: it reaches the file
        os.close(held)                      # when no name known to cachefs does
        real_open = os.open

        def no_fds(path, flags, *args, **kwargs):
            if flags & os.O_PATH:
                raise OSError(errno.EMFILE, "Too many open files")
            return real_open(path, flags, *args, **kwargs)

        monkeypatch.setattr(bp.os, "open", no_fds)
        assert bp.unlink(root, b"g2")[1] == -1 and not (tmp_path / "g2").exists()
        (tmp_path / "e").mkdir()
        assert bp.rmdir(root, b"e")[1] == -1 and not (tmp_path / "e").exists()
    finally:
        os.close(root)
