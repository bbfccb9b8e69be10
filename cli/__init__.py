"""Entry points of cachefs: `cachefs`, `cachefs-ctl`, `mount.cachefs` (import name cachefs_cli)."""
