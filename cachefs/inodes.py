"""Inode numbers <-> BACKING paths, lookup counts, forget, rename.

FUSE inode numbers are BACKING's st_ino (BACKING's root is ROOT_INODE), so hard links share an
inode and cached data, and numbers are stable across remounts. Each inode remembers the
directory entries (parent inode, name) it is known under; a path is rebuilt by walking up to
the root, so renaming a directory needs no update of its descendants. Paths are relative to
BACKING's root (b"." is the root), to be used with its descriptor (`backingpaths.at`).
"""

from __future__ import annotations

import errno
import os

ROOT_INODE = 1


class Inode:
    __slots__ = ("ino", "names", "lookups", "is_dir", "seq", "held", "hold_later")

    def __init__(self, ino: int, is_dir: bool):
        self.ino = ino
        self.names: list[tuple[int, bytes]] = []
        self.lookups = 0
        self.is_dir = is_dir
        self.seq = 0            # a directory: bumped when one of its entries goes (dir_seq)
        self.held = -1          # an O_PATH fd keeping a removed file's number (hold)
        self.hold_later = False # hold from its last open handle (defer_hold)


class InodeTable:
    def __init__(self, root_st: os.stat_result):
        self.root_st_ino = root_st.st_ino
        self.root_dev = root_st.st_dev
        self._inodes: dict[int, Inode] = {ROOT_INODE: Inode(ROOT_INODE, True)}
        self._entries: dict[tuple[int, bytes], int] = {}      # (parent, name) -> ino

    def __len__(self) -> int:
        return len(self._inodes)

    def ino_of(self, st: os.stat_result) -> int:
        return ROOT_INODE if st.st_ino == self.root_st_ino else st.st_ino

    def foreign(self, st: os.stat_result) -> bool:
        """Is `st` of another filesystem than BACKING's root (a filesystem mounted inside
        BACKING, a btrfs subvolume)? Its inode numbers are its own: taken as node ids they
        would alias BACKING's (reads and write-back writes reaching the other file), so
        cachefs does not cross into it."""
        return st.st_dev != self.root_dev

    def path(self, ino: int) -> bytes:
        """BACKING path of an inode, relative to BACKING's root; raises ESTALE (OSError) for
        an unknown inode or one with no name left (the kernel then looks the name up again
        where a path led it here, as for a file renamed over meanwhile).

        A file with hard links is known under each name the kernel looked it up by; the
        kernel may forget the directory of one of them (pruning its caches) while it keeps
        the file through another, so each name is tried until one's directory is known."""
        if ino == ROOT_INODE:
            return b"."
        node = self._inodes.get(ino)
        if node is not None:
            for i, (parent, name) in enumerate(node.names):
                head = self._dir_path(parent)
                if head is None:
                    continue
                if i:                       # the next call takes the good name at once
                    node.names.insert(0, node.names.pop(i))
                return name if parent == ROOT_INODE else head + b"/" + name
        raise OSError(errno.ESTALE, "stale inode")

    def _dir_path(self, ino: int) -> bytes | None:
        """The path of directory `ino` (a directory has one name), or None if the walk up
        meets a directory the kernel has forgotten."""
        parts = []
        while ino != ROOT_INODE:
            node = self._inodes.get(ino)
            if node is None or not node.names:
                return None
            ino, name = node.names[0]
            parts.append(name)
            if len(parts) > 4096:
                raise OSError(errno.ELOOP, "inode path loop")
        return b"/".join(reversed(parts)) if parts else b"."

    def parent_of(self, ino: int) -> int:
        """The directory an inode is known in (the root for the root, or if unknown)."""
        node = self._inodes.get(ino)
        return node.names[0][0] if node is not None and node.names else ROOT_INODE

    def child_path(self, parent: int, name: bytes) -> bytes:
        if parent == ROOT_INODE:
            return name
        return self.path(parent) + b"/" + name

    def remember(self, parent: int, name: bytes, st: os.stat_result, lookup: bool = True) -> int:
        """Record that (parent, name) refers to the inode `st`; count one lookup if asked."""
        ino = self.ino_of(st)
        node = self._inodes.get(ino)
        if node is None:
            node = self._inodes[ino] = Inode(ino, (st.st_mode & 0o170000) == 0o040000)
        if ino != ROOT_INODE:
            entry = (parent, name)
            old = self._entries.get(entry)
            if old != ino:
                if old is not None:
                    self._drop_entry(entry)
                if node.is_dir:
                    for stale in node.names:          # a directory has one name
                        self._entries.pop(stale, None)
                    node.names = []
                node.names.append(entry)
                self._entries[entry] = ino
        if lookup:
            node.lookups += 1
        return ino

    def forget(self, ino: int, nlookup: int) -> None:
        node = self._inodes.get(ino)
        if node is None or ino == ROOT_INODE:
            return
        node.lookups -= nlookup
        if node.lookups <= 0:
            for entry in node.names:
                if self._entries.get(entry) == ino:
                    del self._entries[entry]
            del self._inodes[ino]
            if node.held >= 0:
                os.close(node.held)

    def hold(self, ino: int, fd: int) -> None:
        """`fd` (O_PATH, or -1) is of BACKING's node `ino`, a name of which cachefs just
        removed: keep it open while the kernel knows the inode (until its forget): when it
        was the last name, BACKING cannot give the number to a new file the kernel would
        take for this one; and it reaches the node when no name known here does
        (held_fd). Closed at once if the kernel does not know the inode."""
        if fd < 0:
            return
        node = self._inodes.get(ino)
        if node is None or node.lookups <= 0 or node.held >= 0:
            os.close(fd)
            return
        node.held = fd

    def defer_hold(self, ino: int) -> None:
        """A name of `ino` was removed while handles of it are open (they keep the node):
        hold it from the last one, at its release (hold_deferred)."""
        node = self._inodes.get(ino)
        if node is not None and node.lookups > 0 and node.held < 0:
            node.hold_later = True

    def hold_deferred(self, ino: int) -> bool:
        """Whether `ino` waits for a holder from its last handle (and stops waiting)."""
        node = self._inodes.get(ino)
        if node is None or not node.hold_later:
            return False
        node.hold_later = False
        return True

    def held_fd(self, ino: int) -> int:
        """The O_PATH descriptor kept since a name of `ino` went (hold), or -1: it reaches
        the node when no known name does (open unlinked, or its other links' directories
        forgotten by the kernel)."""
        node = self._inodes.get(ino)
        return node.held if node is not None else -1

    def dir_seq(self, parent: int) -> int:
        """Changes when an entry of directory `parent` is unlinked or renamed: a listing
        taken before may name what is no longer there (fs.Operations.readdir)."""
        node = self._inodes.get(parent)
        return node.seq if node is not None else -1

    def _drop_entry(self, entry: tuple[int, bytes]) -> int | None:
        parent = self._inodes.get(entry[0])
        if parent is not None:
            parent.seq += 1
        ino = self._entries.pop(entry, None)
        node = self._inodes.get(ino) if ino is not None else None
        if node is not None and entry in node.names:
            node.names.remove(entry)
        return ino

    def unlinked(self, parent: int, name: bytes) -> None:
        """Forget the entry (parent, name) (its inode stays until the kernel forgets it)."""
        self._drop_entry((parent, name))

    def child(self, parent: int, name: bytes) -> int | None:
        """The inode known under (parent, name), if any."""
        return self._entries.get((parent, name))

    def renamed(self, old_parent: int, old_name: bytes, new_parent: int, new_name: bytes,
                exchange: bool = False) -> None:
        old_entry, new_entry = (old_parent, old_name), (new_parent, new_name)
        moved = self._drop_entry(old_entry)
        other = self._drop_entry(new_entry)
        if moved is not None:
            self._inodes[moved].names.append(new_entry)
            self._entries[new_entry] = moved
        if exchange and other is not None:
            self._inodes[other].names.append(old_entry)
            self._entries[old_entry] = other
