"""cachefs: a FUSE host-side cache that puts a fast SSD directory in front of a slow mount."""

__version__ = "0.1.0"
