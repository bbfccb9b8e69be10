"""Exception types of cachefs.

Engine code raises Python exceptions; `fs.py` maps them to FUSE errors once. `UserError` is a
mistake of the operator: the CLI prints its sentence and exits 2, never a traceback.
"""

import errno


class UserError(Exception):
    """A user mistake, explained in one sentence."""


class BackingTimeout(OSError):
    """A BACKING operation did not finish within the configured timeout."""

    def __init__(self, what: str, timeout_s: float):
        super().__init__(errno.EIO, f"BACKING {what} stalled for {timeout_s:g} s")


class CommandFailed(Exception):
    """A control command could not do what was asked; the sentence says why."""


class InvariantError(AssertionError):
    """The extent map broke one of its invariants (docs/concurrency.md): a bug. The daemon
    stops rather than risk serving or destaging wrong bytes; crash-safe metadata keeps the
    next mount correct."""
