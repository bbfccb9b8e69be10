"""Mount options: every duration takes the same forms (a number of seconds, or with s, m,
h, d), as flags and in -o (`--backing-timeout 5s` was refused while `--scrub-interval 7d`
was taken)."""

import argparse

import pytest

from cachefs.errors import UserError
from cachefs_cli.options import add_mount_arguments, config_from_args


def config(*argv: str):
    p = argparse.ArgumentParser()
    add_mount_arguments(p)
    return config_from_args(p.parse_args([*argv, "/b", "/m"]))


@pytest.mark.parametrize("flag,field", [("--backing-timeout", "backing_timeout_s"),
                                        ("--attr-timeout", "attr_timeout_s"),
                                        ("--max-dirty-age", "max_dirty_age_s"),
                                        ("--scrub-interval", "scrub_interval_s")])
def test_durations_take_units(flag, field):
    for text, seconds in (("5", 5), ("5s", 5), ("2m", 120), ("1.5h", 5400), ("1d", 86400),
                          ("1500ms", 1.5), ("1.5", 1.5)):
        assert getattr(config(flag, text), field) == seconds, (flag, text)
    assert getattr(config("-o", f"{flag[2:].replace('-', '_')}=3m"), field) == 180
    for bad in ("5x", "s", "-5", "nan", "inf", "ms"):
        with pytest.raises(UserError) as err:
            config(flag, bad)
        assert f"{flag} {bad!r}" in str(err.value), str(err.value)   # the value as given


def test_a_backing_timeout_too_short_to_work_is_refused():
    """--backing-timeout 0.0001s was taken, and then every listing failed with EIO."""
    for short in ("0.0001s", "500ms", "0.5"):
        with pytest.raises(UserError) as err:
            config("--backing-timeout", short)
        assert "at least 1 s" in str(err.value)
    assert config("--backing-timeout", "1s").backing_timeout_s == 1


def test_durations_that_overflow_are_refused_with_a_sentence():
    """1e305d passed the finiteness check before the unit multiplied it to inf; the daemon
    then refused 'inf' (a value nobody typed) and the mount exited 1 (a helper's CLI hunt)."""
    import pytest

    from cachefs.errors import UserError
    from cachefs_cli.options import parse_duration
    with pytest.raises(UserError, match="not a finite duration"):
        parse_duration("1e305d", "--max-dirty-age")
    assert parse_duration("7d", "--max-dirty-age") == 7 * 86400
