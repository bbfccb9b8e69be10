"""pyfuse3's ERROR for a reply the kernel no longer waits for (seen in CI: a RELEASE racing
the unmount under load) is logged as INFO; other pyfuse3 errors stay errors."""

import logging

from cachefs import oplog


def test_late_reply_errors_become_info(caplog):
    oplog.quiet_late_replies()
    log = logging.getLogger("pyfuse3")
    with caplog.at_level(logging.INFO, logger="pyfuse3"):
        log.error("fuse_%s(): fuse_reply_* failed with %s", "release",
                  "No such file or directory")
        log.error("fuse_%s(): fuse_reply_* failed with %s", "read", "Invalid argument")
    assert [r.levelname for r in caplog.records] == ["INFO", "ERROR"]
