"""Warming on purpose: `cachefs-ctl prefetch` (load files into the cache now) and
`cachefs-ctl pin` / `unpin` (keep files resident).

Owns the pins (in memory, and their rows in the store's `pins` table), the set of protected
inodes the eviction policy never chooses from (pinned files, and files while a prefetch loads
them: a prefetch never evicts what it has just loaded), the mapping of the client's paths to
BACKING files, and the keeper task that re-loads pinned data that is missing: dropped because
BACKING changed behind the cache, or not there after a remount. The loading itself is
`loader.Loader`'s.

Paths arrive from the control client relative to the mountpoint and are mapped to BACKING
here; nothing here touches the mount itself (a stat through our own mount from the daemon
would deadlock). BACKING is read only through `Backing` (threads, limiter, timeouts).
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import stat as stat_mod
import time
from typing import Awaitable, Callable

import trio

from . import backingpaths as bp
from .backing import Backing
from .cache import Cache
from .config import EXT_SIZE, Config, format_size
from .errors import CommandFailed
from .inodes import InodeTable
from .loader import Job, Loader, Target, exts
from .stats import Stats
from .store import MetadataStore

log = logging.getLogger("cachefs.warm")

KEEP_INTERVAL_S = 0.5       # how often the keeper looks for missing pinned data (in memory)
RETRY_S = 30.0              # a pin that could not be loaded is retried after this long
SHOWN = 10                  # files named in a sentence


def _files(n: int) -> str:
    return f"{n} file" if n == 1 else f"{n} files"


def _pool_bytes(size: int) -> int:
    """What a file of `size` bytes holds of the pool when fully cached."""
    return exts(size) * EXT_SIZE


@dataclasses.dataclass
class Pin:
    ino: int
    rel: bytes                  # path relative to BACKING's root, as last seen
    size: int                   # BACKING's size when last loaded
    retry_s: float = 0.0        # monotonic time before which the keeper leaves it alone


COMPLETE_QUEUE = 64         # files waiting to be completed in the background


class Warm:
    """Prefetch, pins and the keeper of one mount."""

    def __init__(self, cfg: Config, cache: Cache, backing: Backing, store: MetadataStore,
                 stats: Stats, inodes: InodeTable):
        self.cfg = cfg
        self.cache = cache
        self.backing = backing
        self.store = store
        self.stats = stats
        self.inodes = inodes
        self.pins: dict[int, Pin] = {}
        self._busy: dict[int, int] = {}          # ino -> loads in progress
        self._loader = Loader(cache, backing, stats, self._show)
        # files to complete in the background (openmode: the next open can go passthrough)
        self._complete_send, self._complete_recv = trio.open_memory_channel(COMPLETE_QUEUE)
        self._completing: set[int] = set()
        cache.modes.completer = self.complete
        cache.modes.refresher = self.refresh

    # -- state ---------------------------------------------------------------------------

    def load(self) -> None:
        """Restore the pins recorded by earlier mounts; the keeper verifies them."""
        for ino, rel, size in self.store.load_pins():
            self.pins[ino] = Pin(ino, rel, size)
            self.cache.pool.protect(ino)
        over = []
        while self.pins and self.pinned_size() > self.limit_bytes():
            over.append(self.pins[next(reversed(self.pins))])
            self._unpin([over[-1].ino])
        if over:
            # A smaller pool or --max-pinned than when they were pinned: the latest pins
            # beyond the limit go (their data stays cached, evictable); they filled the
            # whole pool before (a helper's hunt).
            self.stats.pins_lost += len(over)
            log.warning("%d pinned files are over the limit of %s (--max-pinned of this "
                        "pool) and are no longer pinned (their data stays cached until "
                        "evicted): %s", len(over), format_size(self.limit_bytes()),
                        ", ".join(self._show(p.rel) for p in over[:10])
                        + (" ..." if len(over) > 10 else ""))
        if self.pins:
            log.info("%d pinned files (%s) restored", len(self.pins),
                     format_size(self.pinned_size()))

    def _hold(self, ino: int) -> None:
        # The pool counts holders: warm holds an inode once, pinned or busy or both.
        if ino not in self._busy and ino not in self.pins:
            self.cache.pool.protect(ino)
        self._busy[ino] = self._busy.get(ino, 0) + 1

    def _release(self, ino: int) -> None:
        n = self._busy[ino] - 1
        if n:
            self._busy[ino] = n
            return
        del self._busy[ino]
        if ino not in self.pins:
            self.cache.pool.unprotect(ino)

    def _unpin(self, inos: list[int]) -> None:
        for ino in inos:
            del self.pins[ino]
            if ino not in self._busy:
                self.cache.pool.unprotect(ino)
        self.store.remove_pins(inos)

    def holders(self) -> set[int]:
        """Inodes warm protects from eviction (pinned, or being loaded): one hold each."""
        return set(self.pins) | set(self._busy)

    def pinned_size(self) -> int:
        """Pool bytes the pins claim (whole extents of each pinned file's size)."""
        total = 0
        for pin in self.pins.values():
            cf = self.cache.files.get(pin.ino)
            size = cf.identity[1] if cf is not None and cf.identity else pin.size
            total += _pool_bytes(max(size, pin.size))
        return total

    def limit_bytes(self) -> int:
        """--max-pinned of the pool; in write-back never so much that pinned data and
        --dirty-high together pass 90 % of the pool (writers would find no room)."""
        cap = self.cache.capacity_exts * EXT_SIZE
        limit = int(cap * self.cfg.max_pinned_pct / 100)
        if self.cache.write_back and self.cfg.dirty_high is not None:
            limit = min(limit, max(0, int(cap * 0.9) - self.cfg.dirty_high))
        return limit

    def status(self) -> dict:
        resident = 0
        for ino in self.pins:
            cf = self.cache.files.get(ino)
            if cf is not None:
                resident += len(cf.extents)
        return {"pinned_files": len(self.pins), "pinned_bytes": resident * EXT_SIZE,
                "pinned_limit": self.limit_bytes()}

    # -- engine hooks (sync) ----------------------------------------------------------------

    def unlinked(self, ino: int) -> None:
        """The last link of a BACKING file is gone: so is its pin."""
        pin = self.pins.get(ino)
        if pin is not None:
            self._lose(pin, "was unlinked")

    def renamed(self, ino: int, new_path: bytes) -> None:
        pin = self.pins.get(ino)
        rel = self._rel_of(new_path)
        if pin is not None and rel is not None and rel != pin.rel:
            pin.rel = rel
            self.store.set_pins([(ino, rel, pin.size)])

    def _lose(self, pin: Pin, why: str) -> None:
        self.stats.pins_lost += 1
        log.info("pinned file %s (BACKING inode %d) %s; its pin is removed",
                 self._show(pin.rel), pin.ino, why)
        self._unpin([pin.ino])

    # -- paths -----------------------------------------------------------------------------

    def _show(self, rel: bytes) -> str:
        """How a user names the file: its path under the mountpoint."""
        name = os.fsdecode(rel)
        return self.cfg.mountpoint if name == "." else os.path.join(self.cfg.mountpoint, name)

    def _rel_of(self, path: bytes) -> bytes | None:
        """BACKING paths are relative to its root already (backingpaths.at)."""
        return path or b"."

    def _backing_path(self, rel: str) -> tuple[bytes, bytes]:
        """(rel, BACKING path) of a path relative to the mountpoint; CommandFailed if it
        leaves the mount."""
        relb = os.path.normpath(os.fsencode(rel))
        if relb.startswith(b"/") or relb == b".." or relb.startswith(b"../"):
            raise CommandFailed(f"{rel} is outside the mount {self.cfg.mountpoint}.")
        return relb, relb

    async def scan(self, rels: list[str]) -> list[Target]:
        """The regular files named by `rels` (files or directory trees), BACKING's view."""
        found: dict[int, Target] = {}
        for rel in rels:
            relb, path = self._backing_path(rel)
            try:
                st = await self.backing.lstat(path)
            except OSError as exc:
                raise CommandFailed(f"cannot read {self._show(relb)} in BACKING: "
                                    f"{exc.strerror or exc}.") from None
            if stat_mod.S_ISREG(st.st_mode):
                found.setdefault(st.st_ino, Target(relb, path, st.st_ino, st.st_size))
            elif stat_mod.S_ISDIR(st.st_mode):
                await self._walk(relb, path, found)
            else:
                raise CommandFailed(f"{self._show(relb)} is not a regular file or a directory.")
        return list(found.values())

    async def _walk(self, rel: bytes, path: bytes, found: dict[int, Target]) -> None:
        todo = [(rel, path)]
        while todo:
            rel, path = todo.pop()
            try:
                entries = await self.backing.read_call("readdir", bp.scandir,
                                                       self.backing.root_fd, path)
            except OSError as exc:
                raise CommandFailed(f"cannot list {self._show(rel)} in BACKING: "
                                    f"{exc.strerror or exc}.") from None
            for name, st in sorted(entries):
                crel = name if rel == b"." else rel + b"/" + name
                cpath = name if path == b"." else path + b"/" + name
                if stat_mod.S_ISREG(st.st_mode):
                    found.setdefault(st.st_ino, Target(crel, cpath, st.st_ino, st.st_size))
                elif stat_mod.S_ISDIR(st.st_mode):
                    todo.append((crel, cpath))

    # -- commands --------------------------------------------------------------------------

    async def prefetch(self, rels: list[str], progress: Callable[[dict], Awaitable[None]]
                       ) -> dict:
        """cachefs-ctl prefetch: load files now; evicts only unprotected clean data."""
        targets = await self.scan(rels)
        job = await self._load(targets, progress)
        return self._answer(targets, job, "prefetch")

    async def pin(self, rels: list[str], progress: Callable[[dict], Awaitable[None]]
                  ) -> dict:
        """cachefs-ctl pin: refuse beyond --max-pinned, record the pins, load the files."""
        targets = await self.scan(rels)
        new = [t for t in targets if t.ino not in self.pins]
        need = sum(_pool_bytes(t.size) for t in new)
        have = self.pinned_size()
        limit = self.limit_bytes()
        if have + need > limit:
            cap = self.cache.capacity_exts * EXT_SIZE
            raise CommandFailed(
                f"refused: pinning {format_size(need)} more ({_files(len(new))}) would pin "
                f"{format_size(have + need)}, more than the {format_size(limit)} allowed "
                f"(--max-pinned {self.cfg.max_pinned_pct:g}% of the {format_size(cap)} pool"
                + (", less --dirty-high" if limit < cap * self.cfg.max_pinned_pct / 100
                   else "")
                + f"); {format_size(have)} is pinned now. Unpin files or mount with a larger "
                "--max-pinned or --cache-size.")
        for t in new:
            self.pins[t.ino] = Pin(t.ino, t.rel, t.size)
            if t.ino not in self._busy:
                self.cache.pool.protect(t.ino)
        self.store.set_pins([(t.ino, t.rel, t.size) for t in new])
        if new:
            log.info("pinned %s (%s): %s", _files(len(new)), format_size(need),
                     ", ".join(self._show(t.rel) for t in new[:SHOWN])
                     + (f" and {len(new) - SHOWN} more" if len(new) > SHOWN else ""))
        job = await self._load(targets, progress)
        self._note_sizes(targets)
        answer = self._answer(targets, job, "pin")
        answer.update(pinned_new=len(new), pinned_already=len(targets) - len(new),
                      **self.status())
        if job.missing_bytes():
            answer["message"] += (" The pins are kept: what is missing is loaded in the "
                                  "background when room frees up.")
        return answer

    async def unpin(self, rels: list[str]) -> dict:
        """cachefs-ctl unpin: the files' data stays cached, but may be evicted again."""
        gone: set[int] = set()
        for rel in rels:
            relb, _ = self._backing_path(rel)
            for pin in self.pins.values():          # by the recorded path, even if gone
                if relb == b"." or pin.rel == relb or pin.rel.startswith(relb + b"/"):
                    gone.add(pin.ino)
            try:
                targets = await self.scan([rel])
            except CommandFailed:
                continue
            gone.update(t.ino for t in targets if t.ino in self.pins)
        gone = {ino for ino in gone if ino in self.pins}      # (a load may have ended)
        names = [self._show(self.pins[ino].rel) for ino in gone]
        self._unpin(sorted(gone))
        if gone:
            log.info("unpinned %d files: %s", len(gone), ", ".join(names[:SHOWN])
                     + (f" and {len(gone) - SHOWN} more" if len(gone) > SHOWN else ""))
        return {"unpinned_files": len(gone), **self.status()}

    def unpin_all(self, why: str) -> int:
        """Remove every pin (cachefs-ctl drop --pinned); returns the pinned extents."""
        resident = self.status()["pinned_bytes"] // EXT_SIZE
        if self.pins:
            log.info("%s: removing %d pins (%d extents resident)", why, len(self.pins),
                     resident)
            self._unpin(list(self.pins))
        return resident

    def _note_sizes(self, targets: list[Target]) -> None:
        changed = []
        for t in targets:
            pin = self.pins.get(t.ino)
            if pin is not None and pin.size != t.size:
                pin.size = t.size
                changed.append((t.ino, pin.rel, t.size))
        self.store.set_pins(changed)

    def _answer(self, targets: list[Target], job: Job, what: str) -> dict:
        missing = job.missing_bytes()
        names = [self._show(rel) for rel in sorted(job.missing)]
        errors = job.errors + [f"{self._show(rel)} changed while loading (written meanwhile)"
                               for rel in sorted(job.overtaken)]
        shown = ", ".join(names[:SHOWN]) + (f" and {len(names) - SHOWN} more"
                                            if len(names) > SHOWN else "")
        if not missing and not errors:
            message = (f"{what}: {format_size(job.total)} in {_files(len(targets))} cached "
                       f"({format_size(job.loaded)} loaded now).")
        elif job.full:
            cap = self.cache.capacity_exts * EXT_SIZE
            message = (f"{what}: {format_size(missing)} of {format_size(job.total)} did not "
                       f"fit: the rest of the {format_size(cap)} pool holds pinned "
                       f"({format_size(self.status()['pinned_bytes'])}), dirty "
                       f"({format_size(self.cache.dirty_bytes())}) and just loaded data, "
                       f"which {what} never evicts; not loaded: {shown}.")
        else:
            message = (f"{what}: {format_size(missing)} of {format_size(job.total)} not "
                       f"loaded ({shown}): " + "; ".join(errors[:SHOWN]) + ".")
        return {"files": len(targets), "total_bytes": job.total, "cached_bytes": job.cached,
                "loaded_bytes": job.loaded, "missing_bytes": missing,
                "not_loaded": names, "errors": errors, "full": job.full,
                "message": message}

    async def _load(self, targets: list[Target],
                    progress: Callable[[dict], Awaitable[None]] | None) -> Job:
        """Load every target (Loader.load); its files are protected from eviction meanwhile."""
        for t in targets:
            self._hold(t.ino)
        try:
            return await self._loader.load(targets, progress)
        finally:
            for t in targets:
                self._release(t.ino)

    # -- the keeper --------------------------------------------------------------------------

    def complete(self, ino: int, path: bytes, size: int) -> None:
        """Load the missing extents of a mostly cached file in the background (a read-only
        open found it not fully cached: the next one can then go passthrough)."""
        if ino in self._completing:
            return
        try:
            self._complete_send.send_nowait(Target(path, path, ino, size))
        except trio.WouldBlock:
            return
        self._completing.add(ino)

    async def refresh(self, ino: int, path: bytes, size: int) -> str:
        """Load what is not valid of a file now (openmode: a held file BACKING changed
        behind, before an open is answered); what stopped it, or ''."""
        job = await self._load([Target(path, path, ino, size)], None)
        if job.errors:
            return job.errors[0]
        return "no room in the pool" if job.full else ""

    async def _completer(self) -> None:
        async for t in self._complete_recv:
            try:
                job = await self._load([t], None)
                log.debug("inode %d completed in the background: %d bytes loaded%s", t.ino,
                          job.loaded, f" ({job.errors[0]})" if job.errors else "")
            finally:
                self._completing.discard(t.ino)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """The keeper (_keep) and the background completion of files (_completer)."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._completer)
            await nursery.start(self._keep)
            task_status.started()

    async def _keep(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Verify the pins once (after a remount: still the same files, data resident),
        then re-load pinned data whenever some is missing (dropped for coherence) - in the
        background, within KEEP_INTERVAL_S of the drop being noticed."""
        task_status.started()
        first = True
        while True:
            for pin in list(self.pins.values()):
                if self.pins.get(pin.ino) is pin and (first or self._short(pin)):
                    await self._reload(pin, first)
            first = False
            await trio.sleep(KEEP_INTERVAL_S)

    def _short(self, pin: Pin) -> bool:
        """In memory only (no BACKING call): does the pinned file lack extents?"""
        if time.monotonic() < pin.retry_s or pin.ino in self._busy:
            return False
        cf = self.cache.files.get(pin.ino)
        if cf is None:
            return pin.size > 0
        if cf.doomed:
            return False
        size = cf.identity[1] if cf.identity else pin.size
        return len(cf.extents) < exts(size)

    async def _reload(self, pin: Pin, verify: bool) -> None:
        path = await self._resolve(pin)
        if path is None:
            return
        t = Target(pin.rel, path, pin.ino, pin.size)
        try:
            job = await self._load([t], None)
        except trio.BrokenResourceError:        # (no client: cannot happen)
            return
        self._note_sizes([t])
        if job.loaded:
            self.stats.pin_reloads += 1
            log.info("pinned file %s: %s re-loaded from BACKING (its cached data had been "
                     "dropped%s)", self._show(pin.rel), format_size(job.loaded),
                     " or was missing after the remount" if verify else "")
        if job.missing_bytes():
            pin.retry_s = time.monotonic() + RETRY_S
            why = "; ".join(job.errors) or ("no room: the pool holds only pinned, dirty or "
                                            "loading data" if job.full else "written meanwhile")
            say = log.warning if job.full or job.errors else log.info
            say("pinned file %s: %s could not be loaded (%s); retrying in %g s",
                self._show(pin.rel), format_size(job.missing_bytes()), why, RETRY_S)

    async def _resolve(self, pin: Pin) -> bytes | None:
        """The BACKING path of a pinned inode: its recorded path, or the one the mount knows
        it by now. No path: the file is gone and loses its pin."""
        candidates = [pin.rel]
        try:
            candidates.append(self.inodes.path(pin.ino))
        except OSError:
            pass
        cf = self.cache.files.get(pin.ino)
        if cf is not None and cf.path:
            candidates.append(cf.path)
        for path in dict.fromkeys(candidates):
            try:
                st = await self.backing.lstat(path)
            except OSError as exc:
                if exc.errno in (errno.ENOENT, errno.ENOTDIR):
                    continue
                pin.retry_s = time.monotonic() + RETRY_S       # BACKING trouble: later
                return None
            if self.pins.get(pin.ino) is not pin:
                return None                                  # unpinned meanwhile
            if st.st_ino == pin.ino and stat_mod.S_ISREG(st.st_mode):
                self.renamed(pin.ino, path)
                return path
        try:
            # Renamed while cachefs was down: a walk of BACKING finds it by number (the pin
            # was lost, logged as a file that "no longer exists": a helper's hunt).
            found = await self.backing.read_call("stat", bp.find_by_ino,
                                                 self.backing.root_fd, pin.ino)
        except OSError:
            pin.retry_s = time.monotonic() + RETRY_S            # BACKING trouble: later
            return None
        if self.pins.get(pin.ino) is not pin:
            return None                                      # unpinned meanwhile
        if found is not None:
            log.info("pinned file %s (BACKING inode %d) was renamed to %s", self._show(pin.rel),
                     pin.ino, self._show(found))
            self.renamed(pin.ino, found)
            return found
        self._lose(pin, "no longer exists in BACKING (removed or replaced)")
        return None
