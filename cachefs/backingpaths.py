"""BACKING's tree: the system calls on BACKING's nodes by path, each synchronous.

Paths are relative to a descriptor of BACKING's root (`open_root`), reached with the *at
calls (`at` walks paths longer than PATH_MAX in pieces); xattrs go through /proc/self/fd
(Linux has no *at form of them). These functions never touch extents, the store or stats:
callers run them through `Backing` (backing.py), in its threads or, on a local BACKING,
inline.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import stat as stat_mod
import threading
from typing import Iterator

from .libc import libc
from .statx import birth_ns, fresh_fstat


# -- paths: relative to a descriptor of BACKING's root ----------------------------------------
#
# cachefs names BACKING files by their path relative to BACKING's root (`InodeTable.path`)
# and reaches them through a descriptor of that root opened once at mount (`*at` calls), so
# a path fits BACKING whenever it fits the mount, however long BACKING's own path is. A
# relative path of PATH_MAX or more (a tree nested deeper than PATH_MAX allows in one path,
# built with relative names as programs may) is walked in pieces (`at`).

PATH_MAX = 4096                 # bytes, the terminating NUL included (Linux)
RENAME_EXCHANGE = 2             # renameat2 (linux/fs.h)
_DIR_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC


def open_root(path: str) -> int:
    """The descriptor of BACKING's root that every BACKING path is relative to (O_PATH: it
    keeps nothing open for I/O and needs no read permission)."""
    return os.open(path, _DIR_FLAGS)


@contextlib.contextmanager
def at(root: int, rel: bytes) -> Iterator[tuple[int, bytes]]:
    """A directory fd and a path relative to it, for the BACKING path `rel` (relative to
    `root`), usable by the *at calls: `root` and `rel` when `rel` fits PATH_MAX, else the
    leading directories are opened a piece at a time (the fd is closed at the end)."""
    if len(rel) < PATH_MAX:
        yield root, rel
        return
    dfd = root
    owned = -1
    try:
        while len(rel) >= PATH_MAX:
            cut = rel.rfind(b"/", 0, PATH_MAX - 1)
            if cut <= 0:
                raise OSError(errno.ENAMETOOLONG, os.strerror(errno.ENAMETOOLONG))
            nfd = os.open(rel[:cut], _DIR_FLAGS, dir_fd=dfd)
            if owned >= 0:
                os.close(owned)
            dfd = owned = nfd
            rel = rel[cut + 1:]
        yield dfd, rel
    finally:
        if owned >= 0:
            os.close(owned)


def open_at(root: int, rel: bytes, flags: int, mode: int = 0o777) -> int:
    with at(root, rel) as (dfd, r):
        return os.open(r, flags, mode, dir_fd=dfd)


def open_by_ino(root: int, hint: bytes | None, ino: int, root_paths: tuple[bytes, ...] = (),
                birth: int = 0, walk: bool = True) -> int:
    """Open BACKING's file with inode `ino` for writing: at its path hint (relative to
    BACKING's root fd; older caches stored absolute paths under one of `root_paths`), or
    found by a walk of BACKING (it was renamed while cachefs was down). -1 if it no longer
    exists: two walks in a row did not find it, or the file with that number has another
    birth time than `birth` (0: unknown): it was deleted, and a new file got its number
    (ext4 reuses them at once; its dirty data went into that unrelated file: a helper's
    hunt)."""
    if hint and hint.startswith(b"/"):
        prefixes = [p.rstrip(b"/") + b"/" for p in root_paths]
        hint = next((hint[len(p):] for p in prefixes if hint.startswith(p)), None)
    if hint:
        try:
            fd = open_at(root, hint, os.O_WRONLY | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.ENOTDIR, errno.EISDIR):
                raise
        else:
            if os.fstat(fd).st_ino == ino:
                return _born(fd, birth)
            os.close(fd)
    if not walk:
        return -2                       # not at its path (and not looked for)
    # A walk can miss a file renamed meanwhile from a directory not yet walked into one
    # already walked; -1 throws the file's dirty data away, so it takes two walks that miss.
    for _ in range(2):
        for _, name, dfd, st in _regular_files(root):
            if st.st_ino == ino:
                return _born(os.open(name, os.O_WRONLY | os.O_CLOEXEC, dir_fd=dfd), birth)
    return -1


def root_paths(backing: str) -> tuple[bytes, ...]:
    """BACKING's path as given and resolved: older caches stored absolute path hints under
    one of them (open_by_ino)."""
    return os.fsencode(backing), os.fsencode(os.path.realpath(backing))


def find_by_ino(root: int, ino: int) -> bytes | None:
    """The path (relative to BACKING's root) of a regular file with inode `ino`, found by a
    walk of BACKING (renamed while cachefs was down); None if none."""
    return find_by_inos(root, {ino}).get(ino)


def find_by_inos(root: int, inos: set[int]) -> dict[int, bytes]:
    """ino -> path (relative to BACKING's root) of the regular files with those inode
    numbers, in one walk of BACKING."""
    found: dict[int, bytes] = {}
    for top, name, _, st in _regular_files(root):
        if st.st_ino in inos:
            found[st.st_ino] = os.path.normpath(os.path.join(top, name))
            if len(found) == len(inos):
                return found
    return found


def _regular_files(root: int):
    """(directory, name, its directory's fd, stat) of every regular file under BACKING's
    root, in one walk (names as bytes; files gone meanwhile are skipped)."""
    for top, _, names, dfd in os.fwalk(b".", dir_fd=root):
        for name in names:
            try:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat_mod.S_ISREG(st.st_mode):
                yield top, name, dfd, st


def _born(fd: int, birth: int) -> int:
    """`fd`, or -1 (closed) if its file's birth time is known and not `birth` (if known)."""
    if birth:
        try:
            now = birth_ns(fd)
        except BaseException:
            os.close(fd)
            raise
        if now and now != birth:
            os.close(fd)
            return -1
    return fd


def lstat(root: int, rel: bytes) -> os.stat_result:
    with at(root, rel) as (dfd, r):
        return os.stat(r, dir_fd=dfd, follow_symlinks=False)


def lstat_in(root: int, parent: bytes, name: bytes
             ) -> tuple[os.stat_result, os.stat_result | None]:
    """The stat of directory `parent` and the lstat of `name` in it (None: no such entry),
    both through one descriptor of that directory: the caller checks the directory is still
    the one it looked `name` up in (fs.lookup)."""
    with at(root, parent) as (dfd, r):
        d = os.open(r, _DIR_FLAGS, dir_fd=dfd)
    try:
        dst = os.fstat(d)
        try:
            return dst, os.stat(name, dir_fd=d, follow_symlinks=False)
        except FileNotFoundError:
            return dst, None
    finally:
        os.close(d)


def stat(root: int, rel: bytes) -> os.stat_result:
    with at(root, rel) as (dfd, r):
        return os.stat(r, dir_fd=dfd)


def readlink(root: int, rel: bytes) -> bytes:
    with at(root, rel) as (dfd, r):
        return os.readlink(r, dir_fd=dfd)


def statvfs(root: int) -> os.statvfs_result:
    return os.statvfs(root)



# -- namespace operations, each one thread call ---------------------------------------------
#
# A new node's mode: with POSIX ACLs on (fs.Operations.enable_acl, and FUSE_CAP_DONT_MASK from
# deps/passthrough's pyfuse3-acl-dont-mask.patch) the kernel passes the mode unmasked and the
# caller's umask apart, because a default ACL of the parent directory replaces the umask. The
# node is made under the caller's umask, so BACKING applies it exactly where Linux would. The
# umask belongs to a process's fs_struct, which its threads share: each thread that sets it
# first takes its own copy (unshare CLONE_FS), and puts the daemon's (0) back after the call.

CLONE_FS = 0x200                # linux/sched.h
_own_fs = threading.local()


@contextlib.contextmanager
def creating_under(umask: int) -> Iterator[None]:
    """Run a node's creation in this thread under `umask` (0, the daemon's own: as is)."""
    if not umask:
        yield
        return
    if not getattr(_own_fs, "done", False):
        if libc.unshare(CLONE_FS) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"unshare(CLONE_FS) for a caller's umask: {os.strerror(err)}")
        _own_fs.done = True
    old = os.umask(umask)
    try:
        yield
    finally:
        os.umask(old)


def chown_new(root: int, path: bytes, uid: int, gid: int, parent: bytes) -> os.stat_result:
    """Give a new node to the caller, as BACKING would if the caller had made it.

    Inside a set-group-ID directory the group is inherited (BACKING already set it).
    """
    with at(root, path) as (dfd, r):
        if os.geteuid() == 0:
            os.chown(r, uid, _new_gid(root, parent, gid), dir_fd=dfd, follow_symlinks=False)
        return os.stat(r, dir_fd=dfd, follow_symlinks=False)


def _new_gid(root: int, parent: bytes, gid: int) -> int:
    """The group to give a new node: -1 (keep BACKING's) inside a set-group-ID directory."""
    return -1 if stat(root, parent).st_mode & 0o2000 else gid


def create(root: int, path: bytes, flags: int, mode: int, uid: int, gid: int, parent: bytes,
           umask: int = 0) -> tuple[int, os.stat_result]:
    try:
        with creating_under(umask):
            fd = open_at(root, path, flags | os.O_CREAT | os.O_EXCL, mode)
    except FileExistsError:
        if flags & os.O_EXCL:
            raise
        # The kernel sends CREATE after looking the name up as absent: someone else made the
        # file since (another client of BACKING). It is not the caller's to own, nor to open
        # without the kernel's permission check: ESTALE makes the kernel look the name up
        # again and open the file as the existing file it is.
        raise OSError(errno.ESTALE, "created meanwhile by another: look it up again",
                      path) from None
    try:
        if os.geteuid() == 0:       # chown_new through the descriptor: no path lookups
            os.fchown(fd, uid, _new_gid(root, parent, gid))
            special = mode & (stat_mod.S_ISUID | stat_mod.S_ISGID)
            if special:             # the chown cleared them; the caller's create keeps them
                st = os.fstat(fd)
                if st.st_mode & special != special:
                    os.fchmod(fd, stat_mod.S_IMODE(st.st_mode) | special)
        return fd, os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise


def mknod(root: int, path: bytes, mode: int, rdev: int, uid: int, gid: int, parent: bytes,
          umask: int = 0) -> os.stat_result:
    with at(root, path) as (dfd, r), creating_under(umask):
        os.mknod(r, mode, rdev, dir_fd=dfd)
    st = chown_new(root, path, uid, gid, parent)
    special = mode & (stat_mod.S_ISUID | stat_mod.S_ISGID)
    if special and st.st_mode & special != special and os.geteuid() == 0:
        # The chown cleared them (as in create): the caller's mknod keeps them (the kernel
        # took out those the caller may not set before it sent the request).
        with at(root, path) as (dfd, r):
            os.chmod(r, stat_mod.S_IMODE(st.st_mode) | special, dir_fd=dfd,
                     follow_symlinks=False)
            st = os.stat(r, dir_fd=dfd, follow_symlinks=False)
    return st


def mkdir(root: int, path: bytes, mode: int, uid: int, gid: int, parent: bytes,
          umask: int = 0) -> os.stat_result:
    with at(root, path) as (dfd, r), creating_under(umask):
        os.mkdir(r, mode, dir_fd=dfd)
    return chown_new(root, path, uid, gid, parent)


def symlink(root: int, target: bytes, path: bytes, uid: int, gid: int, parent: bytes
            ) -> os.stat_result:
    with at(root, path) as (dfd, r):
        os.symlink(target, r, dir_fd=dfd)
    return chown_new(root, path, uid, gid, parent)


def unlink(root: int, path: bytes) -> tuple[os.stat_result, int]:
    """Remove a name; (its stat from just before, `_holder` of the node)."""
    return _remove(root, path, os.unlink)


def rmdir(root: int, path: bytes) -> tuple[os.stat_result, int]:
    """Remove a directory; (its stat from just before, `_holder` of it: a new directory
    made at once, as overlayfs remakes its work directory, must not get its number while
    the kernel still knows the removed one)."""
    return _remove(root, path, os.rmdir)


def _remove(root: int, path: bytes, remove) -> tuple[os.stat_result, int]:
    with at(root, path) as (dfd, r):
        st, fd = _holder(dfd, r)
        try:
            remove(r, dir_fd=dfd)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            raise
        return st, fd


def _holder(dfd: int, r: bytes) -> tuple[os.stat_result, int]:
    """The lstat of a name about to be removed and, for a regular file or a directory, an
    O_PATH descriptor of it (else -1). Held while the kernel still knows the inode
    (InodeTable.hold), it reaches the node when no name cachefs knows does (a file's other
    link, in a directory the kernel forgot; an open file's reopen through /proc/self/fd),
    and, of a node's last name, it keeps BACKING from giving the inode number to a new file
    meanwhile: with FUSE node ids being BACKING's numbers, the kernel would take
    the new file for the old one (an open of the old one, raced by the rename that
    replaced it, read the new file as it was being written). Out of descriptors (EMFILE),
    the removal goes on without one: a descriptor limit never fails an unlink."""
    try:
        fd = os.open(r, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    except OSError as exc:
        if exc.errno not in (errno.EMFILE, errno.ENFILE):
            raise
        return os.stat(r, dir_fd=dfd, follow_symlinks=False), -1
    st = os.fstat(fd)
    if not (stat_mod.S_ISREG(st.st_mode) or stat_mod.S_ISDIR(st.st_mode)):
        os.close(fd)
        fd = -1
    return st, fd


_AT_EMPTY_PATH = 0x1000


def link(root: int, old: bytes | None, new: bytes, fd: int | None = None) -> os.stat_result:
    """link(2) of `old`, or (old None) of descriptor `fd`'s node: linkat(AT_EMPTY_PATH), which
    needs CAP_DAC_READ_SEARCH (a node whose last name went stays unlinkable: ENOENT)."""
    with at(root, new) as (nfd, n):
        if old is None:
            if libc.linkat(fd, b"", nfd, n, _AT_EMPTY_PATH) != 0:
                err = ctypes.get_errno()
                raise OSError(err, os.strerror(err))
        else:
            with at(root, old) as (ofd, o):
                os.link(o, n, src_dir_fd=ofd, dst_dir_fd=nfd, follow_symlinks=False)
        return os.stat(n, dir_fd=nfd, follow_symlinks=False)




def rename(root: int, old: bytes, new: bytes, flags: int
           ) -> tuple[os.stat_result | None, os.stat_result, int]:
    """Rename with renameat2 flags; returns (the replaced target's stat or None, new stat,
    `_holder` of the replaced target or -1). With RENAME_EXCHANGE the first is the stat of
    the other node, now at `old`."""
    with at(root, old) as (ofd, o), at(root, new) as (nfd, n):
        try:
            target, held = _holder(nfd, n)
        except FileNotFoundError:
            target, held = None, -1
        try:
            if flags:
                if libc.renameat2(ofd, o, nfd, n, ctypes.c_uint(flags)) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, os.strerror(err))
            else:
                os.rename(o, n, src_dir_fd=ofd, dst_dir_fd=nfd)
            if flags & RENAME_EXCHANGE:
                target = os.stat(o, dir_fd=ofd, follow_symlinks=False)
            moved = os.stat(n, dir_fd=nfd, follow_symlinks=False)
        except BaseException:
            if held >= 0:
                os.close(held)
            raise
        if held >= 0 and (flags & RENAME_EXCHANGE or moved.st_ino == target.st_ino):
            os.close(held)                  # not removed: swapped, or renamed onto itself
            held = -1
        return target, moved, held


def setattr(root: int, path: bytes, fd: int | None, mode: int | None, uid: int, gid: int,
            times: tuple[int | None, int | None] | None, touch: bool = False,
            ino: int | None = None) -> os.stat_result:
    """chmod/chown/utimens in one thread call (size changes go through the engine);
    `touch`: nothing to change, but the ctime changes, as chown(-1, -1) does; `ino`: the
    inode the path must lead to (ESTALE if it leads elsewhere: renamed over meanwhile)."""
    if touch:
        uid = gid = -1
    if fd is not None:
        return _setattr_fd(fd, mode, uid, gid, times, touch)
    with at(root, path) as (dfd, r):
        st = os.stat(r, dir_fd=dfd, follow_symlinks=False)
        same_inode(st, ino)
        is_link = (st.st_mode & 0o170000) == 0o120000
        if mode is not None and not is_link:
            os.chmod(r, mode, dir_fd=dfd)
        if uid != -1 or gid != -1 or touch:
            os.chown(r, uid, gid, dir_fd=dfd, follow_symlinks=False)
        if times is not None:
            os.utime(r, ns=_times_ns(st, times), dir_fd=dfd, follow_symlinks=False)
        return os.stat(r, dir_fd=dfd, follow_symlinks=False)


def _setattr_fd(fd: int, mode: int | None, uid: int, gid: int,
                times: tuple[int | None, int | None] | None, touch: bool) -> os.stat_result:
    """Through an open handle's descriptor, or an O_PATH one (InodeTable.hold: a node no
    name reaches), which fchmod and fchown refuse: then through its /proc/self/fd link."""
    st = os.fstat(fd)
    node = _by_fd(fd)
    if mode is not None and not stat_mod.S_ISLNK(st.st_mode):
        os.chmod(node, mode)
    if uid != -1 or gid != -1 or touch:
        os.chown(node, uid, gid)
    if times is not None:
        os.utime(node, ns=_times_ns(st, times))
    return os.fstat(fd)


def _times_ns(st: os.stat_result, times: tuple[int | None, int | None]) -> tuple[int, int]:
    atime, mtime = times
    return (st.st_atime_ns if atime is None else atime,
            st.st_mtime_ns if mtime is None else mtime)


def same_inode(st: os.stat_result, ino: int | None) -> None:
    """ESTALE unless `st` is of inode `ino` (None: any)."""
    if ino is not None and st.st_ino != ino:
        raise OSError(errno.ESTALE, "the path leads to another file now")


def truncate_stat(root: int, path: bytes, fd: int | None, size: int, ino: int | None = None
                  ) -> os.stat_result:
    """Truncate through `fd` if given (the file may have no name any more), else by path
    (`ino`: the inode it must lead to, as for setattr)."""
    if fd is not None:
        os.ftruncate(fd, size)
        return fresh_fstat(fd)
    fd = open_at(root, path, os.O_WRONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        same_inode(os.fstat(fd), ino)
        os.ftruncate(fd, size)
        return fresh_fstat(fd)
    finally:
        os.close(fd)


def fallocate(fd: int, mode: int, off: int, size: int) -> None:
    """fallocate(2), any mode (Python has only posix_fallocate)."""
    libc.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_longlong,
                               ctypes.c_longlong)
    if libc.fallocate(fd, mode, off, size) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def fallocate_stat(fd: int, mode: int, off: int, size: int) -> os.stat_result:
    """fallocate(2) on a BACKING file; its stat after."""
    fallocate(fd, mode, off, size)
    return fresh_fstat(fd)


def scandir(root: int, path: bytes, ino: int | None = None
            ) -> list[tuple[bytes, os.stat_result]]:
    """A directory's entries with their lstat, as a snapshot; ESTALE if the path leads to
    a directory other than BACKING's inode `ino` (renamed meanwhile)."""
    fd = open_dir(root, path, ino)
    try:
        return scandir_fd(fd)
    finally:
        os.close(fd)


def open_dir(root: int, path: bytes, ino: int | None) -> int:
    """A descriptor of BACKING's directory at `path`, for listing it (scandir_fd) whatever
    happens to its name later; ESTALE if the path leads to another node than `ino`."""
    fd = open_at(root, path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if ino is not None:
            same_inode(os.fstat(fd), ino)
    except BaseException:
        os.close(fd)
        raise
    return fd


def scandir_fd(fd: int) -> list[tuple[bytes, os.stat_result]]:
    """The entries of the directory open as `fd` with their lstat, from its start."""
    out = []
    os.lseek(fd, 0, os.SEEK_SET)
    with os.scandir(fd) as it:
        for entry in it:
            try:
                out.append((os.fsencode(entry.name), entry.stat(follow_symlinks=False)))
            except FileNotFoundError:
                continue                                # removed while listing
    return out


def fsync_path(root: int, path: bytes, datasync: bool) -> None:
    fd = open_at(root, path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        (os.fdatasync if datasync else os.fsync)(fd)
    finally:
        os.close(fd)


# -- extended attributes --------------------------------------------------------------------
#
# Linux has no *at form of the xattr calls, and they fail with EBADF on an O_PATH fd. A node
# is named as /proc/self/fd/<dir fd>/<rest> and not followed (l*xattr): the magic link
# takes the walk into the directory, and the last component is the node itself, whatever
# its type (file, directory, symlink, fifo, socket, device). This needs /proc mounted. A node
# with no name any more (open and unlinked) is reached through a descriptor of an open
# handle (f*xattr). A call by path first checks that the name still leads to the node meant
# (`ino`, its BACKING inode number; 0: the root): a file renamed on BACKING behind the mount
# and another put at its name must not get the first one's xattrs (ESTALE instead).

_PROC_FD = b"/proc/self/fd/%d/%s"


@contextlib.contextmanager
def _xattr_path(root: int, rel: bytes, ino: int) -> Iterator[bytes]:
    with at(root, rel) as (dfd, r):
        if ino and os.stat(r, dir_fd=dfd, follow_symlinks=False).st_ino != ino:
            raise OSError(errno.ESTALE, os.strerror(errno.ESTALE))
        path = _PROC_FD % (dfd, r)
        if len(path) < PATH_MAX:
            yield path
            return
        parent, _, name = r.rpartition(b"/")
        pfd = os.open(parent, _DIR_FLAGS, dir_fd=dfd)
        try:
            yield _PROC_FD % (pfd, name)
        finally:
            os.close(pfd)


def _by_fd(fd: int) -> int | str:
    """What xattr calls take for `fd`: itself, or for an O_PATH descriptor (InodeTable.hold),
    which the f*xattr calls refuse, its /proc/self/fd link (followed: to the node)."""
    return f"/proc/self/fd/{fd}" if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_PATH else fd


def getxattr(root: int, rel: bytes, fd: int | None, name: bytes, ino: int = 0) -> bytes:
    if fd is not None:
        return os.getxattr(_by_fd(fd), name)
    with _xattr_path(root, rel, ino) as path:
        return os.getxattr(path, name, follow_symlinks=False)


def listxattr(root: int, rel: bytes, fd: int | None, ino: int = 0) -> list[str]:
    if fd is not None:
        return os.listxattr(_by_fd(fd))
    with _xattr_path(root, rel, ino) as path:
        return os.listxattr(path, follow_symlinks=False)


def setxattr(root: int, rel: bytes, fd: int | None, name: bytes, value: bytes,
             ino: int = 0) -> None:
    if fd is not None:
        return os.setxattr(_by_fd(fd), name, value)
    with _xattr_path(root, rel, ino) as path:
        os.setxattr(path, name, value, 0, follow_symlinks=False)


def removexattr(root: int, rel: bytes, fd: int | None, name: bytes, ino: int = 0) -> None:
    if fd is not None:
        return os.removexattr(_by_fd(fd), name)
    with _xattr_path(root, rel, ino) as path:
        os.removexattr(path, name, follow_symlinks=False)
