"""The test mode: ``GRADSYNC_TEST_WAIT_S`` caps gradsync's own fixed waits, so a test
suite need not sit them out. An environment variable, so ranks spawned by a test (or
by ``gradsync launch``) inherit it."""

from __future__ import annotations

import os

from ._config import check_seconds, parse_float

__all__ = ["TEST_WAIT_VAR", "fixed_wait"]

TEST_WAIT_VAR = "GRADSYNC_TEST_WAIT_S"


def fixed_wait(seconds: float) -> float:
    """``seconds``, or at most ``GRADSYNC_TEST_WAIT_S`` seconds where that is set.

    Raises:
        ConfigError: naming the variable, for a value that is not a number > 0.
    """
    raw = os.environ.get(TEST_WAIT_VAR)
    if not raw:
        return seconds
    name = f"environment variable {TEST_WAIT_VAR}"
    return min(seconds, check_seconds(name, parse_float(TEST_WAIT_VAR, raw)))
