"""The launcher's watchdog: stops the ranks of a launcher that died without stopping them.

Ranks run in sessions of their own (``_launch``), so a launcher killed by SIGKILL (or
the OOM killer) leaves them running: quiet ones until they finish, holding their GPU.
``gradsync launch`` starts this script first, in a session of its own too, and tells it
through its stdin which process groups it started (``add PGID RANK``), which are gone
(``gone PGID``) and that it ended normally (``done``). End of file without ``done``
means the launcher is gone: every group gets SIGTERM, then SIGKILL after the grace
period, as the launcher itself would have done.

Run as a script (``python -I _watchdog.py LAUNCHER_PID GRACE_PERIOD_S``), standard
library only: it starts in a few milliseconds, importing neither gradsync nor numpy.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterable

__all__ = ["group_alive", "main", "watch"]

_POLL_S = 0.05


def group_alive(pgid: int) -> bool:
    """Whether process group ``pgid`` has a process (one we may not signal counts)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal(groups: dict[int, str], signum: int) -> None:
    for pgid in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signum)


def watch(lines: Iterable[bytes], launcher_pid: int, grace_period_s: float) -> int:
    """Follow the launcher's messages in ``lines`` (an iterable of bytes); return 0 when
    it said ``done``, else 1 after stopping the groups it had started."""
    groups: dict[int, str] = {}  # process group -> the rank it runs
    for raw in lines:
        words = raw.decode("ascii", "replace").split()
        if words == ["done"]:
            return 0
        if len(words) == 3 and words[0] == "add" and words[1].isdigit():
            groups[int(words[1])] = words[2]
        elif len(words) == 2 and words[0] == "gone" and words[1].isdigit():
            groups.pop(int(words[1]), None)
    if not groups:
        return 1
    _signal(groups, signal.SIGTERM)
    ranks = ", ".join(sorted(groups.values(), key=lambda r: (len(r), r)))
    with contextlib.suppress(OSError):  # the launcher's stderr may be gone with it
        print(
            f"gradsync launch: the launcher (pid {launcher_pid}) ended without stopping its "
            f"ranks; stopping ranks {ranks} (SIGTERM, SIGKILL after {grace_period_s:g} s)",
            file=sys.stderr,
            flush=True,
        )
    deadline = time.monotonic() + grace_period_s
    while groups and time.monotonic() < deadline:
        time.sleep(_POLL_S)
        groups = {g: r for g, r in groups.items() if group_alive(g)}
    _signal(groups, signal.SIGKILL)
    return 1


def main(argv: list[str]) -> int:
    # Stopping the job is the launcher's business while it lives; only its death counts.
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    return watch(sys.stdin.buffer, int(argv[0]), float(argv[1]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
