"""The ranks of one node: their processes, the threads that read and reap them, the
signals to their process groups, and the notes left for those that end."""

from __future__ import annotations

import logging
import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gradsync._cli.watchdog import group_alive
from gradsync._job.reaping import leave_for_ended

from .output import Output, pump
from .report import Tail, describe, signal_name, stopped_by_launcher
from .signals import SignalCatcher
from .watchdoglink import ABANDON_S, WatchdogLink

__all__ = ["Job", "Rank"]

logger = logging.getLogger("gradsync.launch")

_DRAIN_S = 2.0  # after the ranks exit, how long their pipes may stay quiet before EOF
_LEAVE_S = 5.0  # after the ranks exit, how long to wait for their jobs to be left for them


@dataclass
class Rank:
    rank: int
    local_rank: int
    proc: subprocess.Popen[bytes]
    stderr_tail: Tail = field(default_factory=Tail)
    readers: list[threading.Thread] = field(default_factory=list)
    returncode: int | None = None
    stopped: bool = False  # still running when the launcher began stopping the job
    # Its leader was reaped and its group seen empty: the pid may now be reused by an
    # unrelated process group, which must never be signalled.
    group_gone: bool = False
    restarts: int = 0  # times this rank was started again after failing (--max-restarts)
    kill_at: float | None = None  # replaced: when what it left running gets SIGKILL

    @property
    def pid(self) -> int:
        return self.proc.pid

    def exited(self) -> bool:
        """Whether its process has exited, reaped or not: one not yet reaped by its
        waiter thread has ended on its own all the same."""
        if self.returncode is not None or self.proc.returncode is not None:
            return True
        try:
            return (
                os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
            )
        except ChildProcessError:
            return True  # reaped by its waiter thread meanwhile
        except (AttributeError, OSError):
            return False  # no waitid here: it looks running


def _reap(info: Rank) -> int:
    return info.proc.wait()


class Job:
    """The ranks of one node: starts them, signals them, leaves for those that end.

    Seams, for tests to record or delay what they do: ``leave`` (takes
    ``leave_for_ended``'s arguments), ``reap`` (waits for a rank's process and returns
    its exit status) and ``killpg`` (signals a process group, as :func:`os.killpg`).
    """

    def __init__(
        self,
        signals: SignalCatcher,
        grace_period_s: float,
        sync_dir: Path,
        *,
        own_dir: bool,
        max_restarts: int = 0,
        leave: Callable[[Path, int, int, str], object] = leave_for_ended,
        reap: Callable[[Rank], int] = _reap,
        killpg: Callable[[int, int], None] = os.killpg,
    ) -> None:
        self.signals = signals
        self.grace_period_s = grace_period_s
        self.max_restarts = max_restarts  # per rank
        self.output = Output()
        self.ranks: list[Rank] = []  # the last process of each rank
        self.replaced: list[Rank] = []  # failed processes of restarted ranks
        self._argv: list[str] = []
        self._envs: dict[int, dict[str, str]] = {}
        self._sync_dir = sync_dir
        self._leave = leave
        self._reap = reap
        self._killpg = killpg
        self._leaving: list[threading.Thread] = []  # threads of leave_for
        self._exits: queue.Queue[tuple[Rank, int]] = queue.Queue()
        self._watchdog = WatchdogLink(grace_period_s, sync_dir, own_dir=own_dir)

    def start(self, argv: list[str], envs: list[tuple[int, dict[str, str]]]) -> None:
        """Start one rank per ``(rank, env)``; stop early if the launcher got a signal."""
        self._watchdog.start()
        self._argv = argv
        for local_rank, (rank, env) in enumerate(envs):
            if self.signals.received:
                return
            self._envs[rank] = env
            try:
                self.ranks.append(self._start_rank(rank, local_rank, env, 0))
            except OSError:
                logger.error("could not start rank %d; stopping the ranks already started", rank)
                self._stop_now()
                self.release_watchdog(done=True)
                raise

    def restart(self, info: Rank) -> Rank:
        """Start ``info``'s rank again, with its environment and
        ``GRADSYNC_RESTART_COUNT`` one more; its new process replaces it in :attr:`ranks`.

        Raises:
            OSError: the process could not be started.
        """
        count = info.restarts + 1
        env = {**self._envs[info.rank], "GRADSYNC_RESTART_COUNT": str(count)}
        # What the failed process started goes first: SIGTERM, SIGKILL after the grace
        # period (stop_leftovers), as when the whole job stops.
        self.note_gone_groups()
        if not info.group_gone:
            self._signal_group(info.proc.pid, signal.SIGTERM)
            info.kill_at = time.monotonic() + self.grace_period_s
        new = self._start_rank(info.rank, info.local_rank, env, count)
        self.ranks[self.ranks.index(info)] = new
        self.replaced.append(info)
        return new

    def stop_leftovers(self, *, now: bool = False) -> None:
        """SIGKILL what failed processes of restarted ranks left running, once their
        grace period is over (``now``: at once, as the job ends)."""
        self.note_gone_groups()
        for info in self.replaced:
            due = info.kill_at is not None and (now or time.monotonic() >= info.kill_at)
            if due and not info.group_gone:
                self._signal_group(info.proc.pid, signal.SIGKILL)
                info.kill_at = None

    def _start_rank(self, rank: int, local_rank: int, env: dict[str, str], restarts: int) -> Rank:
        proc = _spawn(self._argv, env)
        self._watchdog.tell(f"add {proc.pid} {rank}")
        logger.debug("started rank %d as pid %d", rank, proc.pid)
        info = Rank(rank=rank, local_rank=local_rank, proc=proc, restarts=restarts)
        return self._follow(info)

    def _follow(self, info: Rank) -> Rank:
        """Start the threads that copy the rank's output and wait for its exit."""
        prefix = f"[rank {info.rank}] "
        assert info.proc.stdout is not None
        assert info.proc.stderr is not None
        for pipe, dest, tail in (
            (info.proc.stdout, "stdout", None),
            (info.proc.stderr, "stderr", info.stderr_tail),
        ):
            reader = threading.Thread(
                target=pump,
                args=(pipe, prefix, dest, self.output, tail),
                name=f"gradsync-launch-rank{info.rank}-{dest}",
                daemon=True,
            )
            reader.start()
            info.readers.append(reader)
        threading.Thread(
            target=lambda: self._exits.put((info, self._reap(info))),
            name=f"gradsync-launch-rank{info.rank}-wait",
            daemon=True,
        ).start()
        return info

    def next_exit(self, timeout_s: float) -> Rank | None:
        """The next rank whose exit is reported, its ``returncode`` set; None after
        ``timeout_s`` without one."""
        try:
            info, returncode = self._exits.get(timeout=timeout_s)
        except queue.Empty:
            return None
        info.returncode = returncode
        return info

    def running(self) -> list[Rank]:
        """The ranks whose exit has not been reported by :meth:`next_exit`."""
        return [info for info in self.ranks if info.returncode is None]

    def note_gone_groups(self) -> None:
        """Mark the groups of reaped ranks that have no process left. Linux reuses no pid
        still naming a group, so a group seen empty here (every poll) can only come
        back as an unrelated process that got the pid after the pids wrapped around."""
        for info in (*self.ranks, *self.replaced):
            # returncode first: a leader not yet reaped keeps its group alive.
            if not info.group_gone and info.proc.returncode is not None:
                info.group_gone = not group_alive(info.proc.pid)
                if info.group_gone:
                    self._watchdog.tell(f"gone {info.proc.pid}")

    def signal_all(self, signum: int) -> None:
        # Also the groups whose leader already exited: what the rank started may live on.
        self.note_gone_groups()
        for info in (*self.ranks, *self.replaced):
            if not info.group_gone:
                self._signal_group(info.proc.pid, signum)

    def _signal_group(self, pgid: int, signum: int) -> None:
        try:
            self._killpg(pgid, signum)
        except ProcessLookupError:
            pass
        except PermissionError as exc:
            logger.debug("cannot send %s to process group %d: %s", signal_name(signum), pgid, exc)

    def _stop_now(self) -> None:
        """SIGKILL every rank started so far and reap them (used when starting fails)."""
        self.signal_all(signal.SIGKILL)
        for info in self.ranks:
            try:
                info.proc.wait(timeout=ABANDON_S)
            except subprocess.TimeoutExpired:
                logger.warning("rank %d (pid %d) survived SIGKILL", info.rank, info.proc.pid)

    def release_watchdog(self, *, done: bool) -> None:
        """See :meth:`WatchdogLink.release`."""
        self._watchdog.release(done=done)

    def leave_for(self, info: Rank) -> None:
        """Leave the rank's jobs on its behalf, saying how it ended (unless it exited 0,
        below; a job whose session it closed itself keeps its own note): its peers on
        other hosts learn of it at once, not after their heartbeat timeout. In a
        thread: a hung shared filesystem must not keep the launcher from stopping the
        other ranks."""
        code = info.returncode
        assert code is not None
        if code == 0:
            # It finished (os._exit, say, skips closing): peers still in its last call
            # may not see yet, on a shared filesystem, what it published; told it is
            # gone they would fail that call. Its heartbeat tells, as before.
            return
        if stopped_by_launcher(info.stopped, code):
            how = f"was stopped by its launcher ({describe(code)})"
        else:
            how = f"has ended ({describe(code)})"
        thread = threading.Thread(
            target=self._leave,
            args=(self._sync_dir, info.rank, info.proc.pid, how),
            name=f"gradsync-launch-rank{info.rank}-leave",
            daemon=True,
        )
        thread.start()
        self._leaving.append(thread)

    def wait_for_helpers(self) -> None:
        """Give the ranks' pipes time to reach EOF (as long as lines keep coming, and
        ``_DRAIN_S`` more: a slow reader of the launcher's output gets all of it), and
        the notes left for them time to be written, within ``_LEAVE_S``."""
        readers = [r for info in (*self.replaced, *self.ranks) for r in info.readers]
        written, quiet_until = self.output.written, time.monotonic() + _DRAIN_S
        while alive := [r for r in readers if r.is_alive()]:
            now = time.monotonic()
            if self.output.written != written:
                written, quiet_until = self.output.written, now + _DRAIN_S
            elif now >= quiet_until:
                break  # a process the rank started keeps its pipe open, silent
            alive[0].join(timeout=max(0.0, min(0.1, quiet_until - now)))
        leave_until = time.monotonic() + _LEAVE_S
        for thread in self._leaving:
            thread.join(timeout=max(0.0, leave_until - time.monotonic()))


def _spawn(argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    # Each rank gets its own session, hence its own process group, so that:
    # - Ctrl-C in a terminal (SIGINT to the foreground group) reaches only the
    #   launcher, which then stops every rank in one orderly way (SIGTERM, SIGKILL
    #   after the grace period) instead of N ranks each raising KeyboardInterrupt
    #   wherever they happen to be and printing N tracebacks;
    # - killpg() reaches what a rank started itself (data loader workers...);
    # - ranks never touch the terminal (stdin is /dev/null), so they cannot be
    #   stopped by SIGTTIN.
    # The cost: a launcher killed by SIGKILL cannot stop the ranks; its watchdog,
    # told of every rank's group, does (watchdoglink.py).
    return subprocess.Popen(
        argv,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
