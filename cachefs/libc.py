"""The C library handle for the few syscalls Python lacks (io_submit, fallocate's hole
punching, renameat2, statx): one ctypes handle for the package. Owns nothing else."""

from __future__ import annotations

import ctypes

libc = ctypes.CDLL(None, use_errno=True)
