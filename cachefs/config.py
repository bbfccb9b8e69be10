"""Mount options: parsing of human sizes, defaults, and the frozen Config every module reads."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re

from .errors import UserError

EXT_SIZE = 64 * 1024
BLK_SIZE = 4096

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
MODES = ("write-through", "write-back")
EVICTIONS = ("s3-fifo", "clock")
MIN_BACKING_TIMEOUT_S = 1.0


def parse_size(text: str, what: str = "size") -> int:
    """Parse '512M', '20G', '4096', '1.5G' (binary units, optional 'iB'/'B') into bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise UserError(f"{what} {text!r} is not a size (use a number with an optional "
                        "K, M, G or T suffix, e.g. 512M or 20G).")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def format_size(nbytes: float) -> str:
    """Human-readable binary size: 1.5 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} TiB"


def default_cache_root() -> str:
    """The system's cache location: /var/cache/cachefs for root, XDG cache dir otherwise."""
    if os.geteuid() == 0:
        return "/var/cache/cachefs"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(base, "cachefs")


def default_cache_dir(backing: str) -> str:
    """A cache directory keyed to BACKING's real path: readable name plus a short hash."""
    real = os.path.realpath(backing)
    slug = re.sub(r"[^A-Za-z0-9]+", "-", real).strip("-")[-40:] or "root"
    digest = hashlib.sha256(os.fsencode(real)).hexdigest()[:10]
    return os.path.join(default_cache_root(), f"{slug}-{digest}")


@dataclasses.dataclass(frozen=True)
class Config:
    backing: str
    mountpoint: str
    cache_dir: str
    mode: str = "write-through"
    cache_size: int | None = None          # None: leave the cache filesystem 10 % free
    promote_after: int = 2
    sequential_cutoff: int = 4 << 20
    dirty_high: int | None = None
    dirty_low: int | None = None
    max_dirty_age_s: float = 30.0
    foreground: bool = False
    fuse_options: tuple[str, ...] = ()
    attr_timeout_s: float = 1.0
    entry_timeout_s: float = 1.0
    backing_timeout_s: float = 60.0          # at least MIN_BACKING_TIMEOUT_S
    backing_threads: int = 16
    commit_interval_s: float = 1.0
    debug: bool = False
    check_invariants: bool = False        # check the extent map after every change (tests)
    passthrough: bool = True              # FUSE passthrough for fully cached read-only opens
    passthrough_odirect: bool = False     # ... O_DIRECT ones too where BACKING takes any
    read_checksums: bool = True           # daemon hits check their blocks (integrity.py)
    fast_hits: bool = True                # 4 KiB hits answered in C (hit.install_fast_hits)
    discard_dirty: bool = False           # a damaged database: set it aside, start cold
    scrub_interval_s: float = 7 * 86400   # background verification of every block (0: off)
    scrub_rate: int = 16 << 20            # bytes/s the scrub reads
                                          # alignment (unaligned reads then fail: EINVAL)
    eviction: str = "s3-fifo"             # or "clock" (LRU approximation; for comparisons)
    promote_all_below: float = 0.90       # pool fill below which every miss is admitted
    max_pinned_pct: float = 50.0          # share of the pool `cachefs-ctl pin` may hold
    stats_group: str | None = None        # group that may read stats (cachefs-ctl stats, top)
    metrics: tuple[str, int] | None = None    # (host, port) of the Prometheus endpoint

    def validate(self) -> None:
        if self.mode not in MODES:
            raise UserError(f"mode {self.mode!r} is not one of {', '.join(MODES)}.")
        if self.cache_size is not None and self.cache_size < 16 * EXT_SIZE:
            raise UserError(f"cache size {self.cache_size} bytes is too small: "
                            f"the minimum is {format_size(16 * EXT_SIZE)}.")
        if self.eviction not in EVICTIONS:
            raise UserError(f"eviction policy {self.eviction!r} is not one of "
                            f"{', '.join(EVICTIONS)}.")
        if not 0 <= self.promote_all_below <= 1:
            raise UserError("--promote-all-below must be a percentage from 0 to 100.")
        if not 0 <= self.max_pinned_pct <= 90:
            raise UserError("--max-pinned must be a share of the pool from 0% to 90%.")
        if self.promote_after < 1:
            raise UserError("--promote-after must be at least 1.")
        if self.sequential_cutoff < 0:
            raise UserError("--sequential-cutoff must not be negative.")
        if self.dirty_high is not None and self.dirty_low is not None \
                and self.dirty_low >= self.dirty_high:
            raise UserError("--dirty-low must be below --dirty-high.")
        if self.max_dirty_age_s <= 0:
            raise UserError("--max-dirty-age must be a positive number of seconds.")
        if self.scrub_rate < 64 << 10:
            raise UserError("--scrub-rate must be at least 64K (bytes per second).")
        if self.stats_group is not None:
            _check_stats_group(self.stats_group)
        if self.attr_timeout_s < 0 or self.entry_timeout_s < 0 or self.backing_timeout_s <= 0:
            raise UserError("timeouts must be positive numbers of seconds.")
        if self.backing_timeout_s < MIN_BACKING_TIMEOUT_S:
            raise UserError(f"--backing-timeout must be at least {MIN_BACKING_TIMEOUT_S:g} s: "
                            "a shorter one fails calls that a healthy network filesystem "
                            "may take.")


def _check_stats_group(group: str) -> None:
    import grp
    try:
        grp.getgrgid(int(group)) if group.isdigit() else grp.getgrnam(group)
    except KeyError:
        raise UserError(f"--stats-group {group!r}: there is no such group.") from None
    if os.geteuid() != 0:
        raise UserError("--stats-group needs a mount run by root (its socket goes to "
                        "/run/cachefs).")


def parse_share(text: str, what: str) -> float:
    """Parse '50%' or '50' (percent of the pool) into a number of percent."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*%?\s*", str(text))
    if not m:
        raise UserError(f"{what} {text!r} is not a share of the pool (use a percentage, "
                        "e.g. 50%).")
    return float(m.group(1))


METRICS_HOST = "127.0.0.1"               # a bare --metrics PORT listens on loopback only


def parse_address(text: str, what: str) -> tuple[str, int]:
    """Parse PORT (on METRICS_HOST), HOST:PORT or [V6]:PORT into (host, port); the host is
    resolved only when bound (metrics.bind)."""
    text = text.strip()
    m = re.fullmatch(r"\[([^\[\]\s]+)\]:(\w+)|([^\[\]:\s]+):(\w+)|(\w+)", text)
    if m is None:
        raise UserError(f"{what} {text!r} is not an address: give PORT, HOST:PORT or "
                        "[IPv6]:PORT, e.g. 9533 or 127.0.0.1:9533.")
    host = m.group(1) or m.group(3) or METRICS_HOST
    port = m.group(2) or m.group(4) or m.group(5)
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise UserError(f"{what} {text!r}: the port must be a number from 1 to 65535.")
    return host, int(port)


def format_address(addr: tuple[str, int]) -> str:
    """(host, port) as an operator writes it: HOST:PORT, [V6]:PORT for IPv6."""
    host, port = addr
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def dirty_marks(cfg: Config, capacity: int) -> tuple[int, int]:
    """--dirty-high/--dirty-low, defaulted from the pool size: a quarter of the pool (at
    most 1 GiB) and half of that. Raises UserError if dirty data could fill the pool."""
    high = cfg.dirty_high if cfg.dirty_high is not None else min(capacity // 4, 1 << 30)
    low = cfg.dirty_low if cfg.dirty_low is not None else high // 2
    if high > capacity * 0.9:
        raise UserError(f"--dirty-high {format_size(high)} leaves no room in a cache of "
                        f"{format_size(capacity)}: keep it below 90 % of --cache-size.")
    if low >= high:
        if cfg.dirty_low is None:       # only --dirty-high given (0, or too small to halve)
            raise UserError(f"--dirty-high {format_size(high)} holds no dirty data: give "
                            "a size above 0 (or mount in write-through mode).")
        raise UserError("--dirty-low must be below --dirty-high.")
    return high, low
