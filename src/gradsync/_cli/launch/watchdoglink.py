"""The launcher's side of its watchdog (``watchdog.py``): starts it, tells it of every
rank's process group, and lets it go at the end."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
from pathlib import Path

from gradsync._cli import watchdog

__all__ = ["ABANDON_S", "WatchdogLink"]

logger = logging.getLogger("gradsync.launch")

ABANDON_S = 10.0  # after SIGKILL, how long to wait for ranks before giving up on them


class WatchdogLink:
    """The pipe to the process that stops the ranks if this launcher dies."""

    def __init__(self, grace_period_s: float, sync_dir: Path, *, own_dir: bool) -> None:
        self._grace_period_s = grace_period_s
        self._sync_dir = sync_dir
        self._own_dir = own_dir  # made for this job: removed after it
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        try:
            self._proc = subprocess.Popen(
                [
                    sys.executable,
                    "-I",
                    str(Path(watchdog.__file__)),
                    str(os.getpid()),
                    repr(self._grace_period_s),
                    str(self._sync_dir),
                    *(["own"] if self._own_dir else []),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                start_new_session=True,  # out of reach of a Ctrl-C meant for the launcher
            )
        except OSError as exc:
            logger.warning(
                "could not start the watchdog (%s): if this launcher is killed with "
                "SIGKILL, its ranks will keep running",
                exc,
            )

    def tell(self, message: str) -> None:
        """Send one line: ``add PGID RANK``, ``gone PGID`` or ``done``."""
        proc = self._proc
        if proc is None or proc.stdin is None or proc.stdin.closed:
            return
        try:
            proc.stdin.write(f"{message}\n".encode())
            proc.stdin.flush()
        except OSError as exc:
            logger.warning(
                "the watchdog (pid %d) is gone (%s): if this launcher is killed with "
                "SIGKILL, its ranks will keep running",
                proc.pid,
                exc,
            )
            with contextlib.suppress(OSError):
                proc.stdin.close()

    def release(self, *, done: bool) -> None:
        """Let the watchdog go: with ``done``, the ranks are stopped or finished and it
        exits; otherwise it stops what is left of them, as after this launcher's death."""
        proc = self._proc
        if proc is None:
            return
        if done:
            self.tell("done")
        self._proc = None
        with contextlib.suppress(OSError):
            assert proc.stdin is not None
            proc.stdin.close()
        try:
            # It exits at once after "done"; else after its grace period.
            proc.wait(timeout=1.0 if done else self._grace_period_s + ABANDON_S)
        except subprocess.TimeoutExpired:
            logger.warning("the watchdog (pid %d) did not exit; leaving it", proc.pid)
