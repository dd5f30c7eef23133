"""Supervising a node's ranks: one poll loop that waits for every rank, restarts a failed
one that has restarts left, and stops all of them at the first other failure or launcher
signal (SIGTERM, then SIGKILL after the grace period), with each way out of it explicit."""

from __future__ import annotations

import logging
import signal
import time

from .job import Job, Rank
from .report import describe, failure_summary, restarts_summary, signal_name
from .watchdoglink import ABANDON_S

__all__ = ["run", "supervise"]

logger = logging.getLogger("gradsync.launch")

_POLL_S = 0.05  # how often the supervisor looks at launcher signals and deadlines


def run(job: Job, argv: list[str], envs: list[tuple[int, dict[str, str]]]) -> int:
    """Start the job's ranks and supervise them to the end: the launcher's exit code."""
    done = False
    try:
        job.start(argv, envs)
        code = supervise(job)
        done = True
    finally:
        # Not done (an error of the launcher's own): the watchdog stops the ranks.
        job.release_watchdog(done=done)
    return code


def supervise(job: Job) -> int:
    """Wait for every rank, restarting a failed one with restarts left, stopping all of
    them at the first other failure or signal.

    Returns:
        The launcher's exit code, as documented in :func:`launch`.
    """
    stop = _Stop(job)
    while True:
        if not stop.begun and job.signals.received:
            stop.signalled()  # perhaps while the ranks were starting
        info = job.next_exit(_POLL_S)
        if info is not None:
            stop.exited(info)
            continue  # collect every exit already queued before looking at the clock
        job.stop_leftovers()
        running = job.running()
        if not stop.begun:
            if not running:
                job.stop_leftovers(now=True)  # nothing a failed process started outlives it
                break  # every rank exited 0
        elif stop.abandon_at is None:
            if not running and all(i.group_gone for i in (*job.ranks, *job.replaced)):
                break  # stopped, and so is every process they started
            hurry = stop.hurried()
            if hurry or time.monotonic() >= stop.kill_at:
                stop.kill(running, "launcher signalled again" if hurry else "grace period over")
        elif not running:
            break  # stopped by SIGKILL
        elif time.monotonic() >= stop.abandon_at:
            job.output.settle()
            left = ", ".join(str(i.rank) for i in running)
            logger.error("ranks %s survived SIGKILL; leaving them behind", left)
            break
    job.wait_for_helpers()
    if stop.first_failure is not None:
        job.output.write("stderr", failure_summary(stop.first_failure, job.ranks))
    elif stop.signal is None and job.replaced:
        job.output.write("stderr", restarts_summary(job.ranks))
    return stop.exit_code()


class _Stop:
    """Whether and why the job is being stopped, and when SIGKILL and giving up come."""

    def __init__(self, job: Job) -> None:
        self._job = job
        self.begun = False
        self.first_failure: Rank | None = None
        self.signal: int | None = None  # the launcher's signal that began it
        self.kill_at = 0.0
        self.abandon_at: float | None = None  # set once SIGKILL is sent
        self._signals_seen = 0

    def signalled(self) -> None:
        self.signal = self._job.signals.received[0]
        self._begin(f"received {signal_name(self.signal)}")

    def exited(self, info: Rank) -> None:
        """Note a rank's exit: leave its jobs for it; a failure restarts it if it has
        restarts left, else stops the others."""
        code = info.returncode
        assert code is not None
        logger.info("rank %d exited: %s", info.rank, describe(code))
        self._job.leave_for(info)
        if code != 0 and not self.begun and not self._restarted(info):
            self.first_failure = info
            self._begin(f"rank {info.rank} failed ({describe(code)})")

    def _restarted(self, info: Rank) -> bool:
        """Start a failed rank again if it has restarts left and no signal came."""
        job = self._job
        if info.restarts >= job.max_restarts or job.signals.received:
            return False
        assert info.returncode is not None
        job.output.settle()
        logger.warning(
            "rank %d failed (%s); restarting it (restart %d of %d)",
            info.rank,
            describe(info.returncode),
            info.restarts + 1,
            job.max_restarts,
        )
        try:
            job.restart(info)
        except OSError as exc:
            logger.error("could not restart rank %d: %s", info.rank, exc)
            return False
        return True

    def hurried(self) -> bool:
        """Whether the launcher got another signal since stopping began."""
        return len(self._job.signals.received) > self._signals_seen

    def _begin(self, reason: str) -> None:
        job = self._job
        self.begun = True
        self._signals_seen = len(job.signals.received)
        self.kill_at = time.monotonic() + job.grace_period_s
        for info in job.ranks:
            # A rank that exited on its own a moment ago may not be reaped, or its
            # exit may still be queued: it was not running.
            info.stopped = not info.exited()
        # Signalled before anything is written: a stuck stdout must not keep them running.
        job.signal_all(signal.SIGTERM)
        names = ", ".join(str(i.rank) for i in job.ranks if i.stopped)
        job.output.settle()  # the launcher's own lines must not overwrite a bar
        if names:
            logger.warning(
                "%s; stopping ranks (still running: %s) with SIGTERM, SIGKILL after %g s",
                reason,
                names,
                job.grace_period_s,
            )
        else:  # what they started may still run: it is stopped all the same
            other = "other " if self.first_failure is not None else ""
            logger.warning("%s; no %srank is still running", reason, other)

    def kill(self, running: list[Rank], why: str) -> None:
        self._job.signal_all(signal.SIGKILL)
        self.abandon_at = time.monotonic() + ABANDON_S
        left = ", ".join(str(i.rank) for i in running)
        self._job.output.settle()
        logger.warning(
            "sent SIGKILL (%s); ranks still running: %s",
            why,
            left or "none, only processes they started",
        )

    def exit_code(self) -> int:
        """0, the first failed rank's exit code (128 + N for signal N), or 128 + N for
        the launcher's signal N."""
        if self.first_failure is not None:
            code = self.first_failure.returncode
            assert code is not None
            return code if code > 0 else 128 - code
        if self.signal is not None:
            return 128 + self.signal
        return 0
