"""The test mode.

``GRADSYNC_TEST_WAIT_S`` caps gradsync's own fixed waits, so a test suite need not sit
them out. An environment variable, so ranks spawned by a test (or by ``gradsync
launch``) inherit it.

``use_store(store)`` runs gradsync in this process on another store until the block
ends: a :class:`FaultyStore` records what gradsync does to its sync dir and fails the
operations a test names (a full disk, an I/O error, a denied listing)::

    def eio(op: str, name: str) -> OSError | None:
        return OSError(errno.EIO, "Input/output error") if op == "list" else None

    with use_store(FaultyStore(eio)) as store:
        ...
    assert ("list", "s-1") in store.calls
"""

from __future__ import annotations

import os

from ._config import check_seconds
from ._env import parse_float
from ._store.api import Store, use_store
from ._store.faulty import FaultyStore
from ._store.posix import PosixStore

__all__ = ["TEST_WAIT_VAR", "FaultyStore", "PosixStore", "Store", "fixed_wait", "use_store"]

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
