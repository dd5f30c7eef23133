"""What ``gradsync launch`` tells its user: where the job's sync dir is, and how a failed
job ended (the failing rank's exception, how each rank ended, its last stderr lines)."""

from __future__ import annotations

import collections
import re
import shlex
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from gradsync._errors import clip

__all__ = [
    "Tail",
    "announce",
    "describe",
    "failure_summary",
    "restarts_summary",
    "signal_name",
    "stopped_by_launcher",
]

_TAIL_LINES = 10  # lines of the failing rank's stderr shown in the failure summary
# How soon after its traceback a rank must end for the exception to count as what
# ended it (at exit, sessions close and logging flushes first).
_AFTER_TRACEBACK_S = 2.0
# gradsync's messages name the step, ranks and path, and are meant to be read whole;
# another exception's line may be any size (a big object's repr), and is printed above.
_GRADSYNC_ERROR_LIMIT = 4000
_OTHER_ERROR_LIMIT = 200
_GRADSYNC_ERROR = re.compile(r"gradsync(\.\w+)*\.\w+: ")
# A traceback frame of gradsync's own modules (`.../gradsync/_step/engine.py`).
_GRADSYNC_FRAME = re.compile(r'File ".*[/\\]gradsync[/\\]_\w+([/\\]\w+)*\.py", line \d+')


def describe(returncode: int) -> str:
    """``exit code 3`` or ``killed by SIGKILL`` for a :class:`subprocess.Popen` return code."""
    if returncode >= 0:
        return f"exit code {returncode}"
    return f"killed by {signal_name(-returncode)}"


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def stopped_by_launcher(stopped: bool, returncode: int) -> bool:
    """Whether the launcher's signal ended a rank: it was running when the launcher
    began stopping the job and died of SIGTERM or SIGKILL (an exit code is its own)."""
    return stopped and returncode in (-signal.SIGTERM, -signal.SIGKILL)


def announce(directory: Path, run_id: str, nproc: int) -> None:
    """Say once, at start, where the sync dir the launcher made is and how to look in it."""
    print(
        f"gradsync launch: sync dir {directory} (run id {run_id}, {nproc} "
        f"rank{'s' if nproc != 1 else ''}); see it with: "
        f"gradsync status {shlex.quote(str(directory))}",
        file=sys.stderr,
        flush=True,
    )


def _indent(line: str) -> int:
    """How deep a traceback line is (an exception group's lines start with ``|``)."""
    return len(line) - len(line.lstrip(" |"))


class Tail:
    """The last lines a rank wrote to stderr, gradsync's own traceback frames hidden (the
    rank's output keeps them), and the exception its last Python traceback ended with
    (``ValueError: ...``), which the failure summary puts first: a deep traceback leaves
    the cause at the end of many frames, or beyond the last lines."""

    def __init__(self) -> None:
        self._lines: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
        self._exception: str | None = None
        self._exception_at = 0.0  # when its line came (time.monotonic)
        self._ended_at: float | None = None  # when the stream ended
        self._in_traceback = False
        self._previous = ""
        self._hidden = 0  # gradsync frames hidden in the run going on
        self._hidden_at = ""  # the first one's line: where the run's note goes

    def end(self) -> None:
        """The stream has ended (the rank's process has, mostly)."""
        self._ended_at = time.monotonic()

    def lines(self) -> list[str]:
        """The last lines, a run of gradsync frames shown as one note of how many."""
        lines = list(self._lines)
        if self._hidden:
            lines = [*lines, self._hidden_note()][-_TAIL_LINES:]
        return lines

    def append(self, line: str) -> None:
        self._keep(line)
        previous, self._previous = self._previous, line
        if line.lstrip(" +|").startswith("Exception Group Traceback"):
            # A group's members are indented under it: no one line says what it was.
            self._exception, self._in_traceback = None, False
        elif line.startswith("Traceback (most recent call last):"):
            # What the interpreter reports and lets the program go on after is no cause
            # of its end: a __del__ that raised, an atexit callback that did.
            ignored = previous.startswith(("Exception ignored", "Error in atexit"))
            self._in_traceback = not ignored
        elif self._in_traceback and line and not line[0].isspace():
            self._exception = line  # the first line after the (indented) frames
            self._exception_at = time.monotonic()
            self._in_traceback = False

    def _keep(self, line: str) -> None:
        """Add ``line`` to the last lines, unless it is (part of) a gradsync frame."""
        if self._hidden and _indent(line) > _indent(self._hidden_at):
            return  # the frame's source line, or the carets under it
        if _GRADSYNC_FRAME.search(line):
            if not self._hidden:
                self._hidden_at = line
            self._hidden += 1
            return
        if self._hidden:
            self._lines.append(self._hidden_note())
            self._hidden = 0
        self._lines.append(line)

    def _hidden_note(self) -> str:
        where = self._hidden_at[: _indent(self._hidden_at)]
        frames = "frame" if self._hidden == 1 else "frames"
        return f"{where}({self._hidden} gradsync {frames} hidden)"

    def exception(self, returncode: int) -> str | None:
        """The exception the rank ended with, if one likely did: it exited with 1 (as
        Python does after an uncaught one) within moments of printing its traceback (one
        logged before carrying on, or before a signal, is not what ended it)."""
        ended_at = time.monotonic() if self._ended_at is None else self._ended_at
        if returncode != 1 or self._exception is None:
            return None
        if ended_at - self._exception_at > _AFTER_TRACEBACK_S:
            return None
        ours = _GRADSYNC_ERROR.match(self._exception)
        return clip(self._exception, _GRADSYNC_ERROR_LIMIT if ours else _OTHER_ERROR_LIMIT)


class RankEnd(Protocol):
    """What the summary needs of a rank (the launcher's ``_Rank``)."""

    @property
    def rank(self) -> int: ...
    @property
    def local_rank(self) -> int: ...
    @property
    def pid(self) -> int: ...
    @property
    def returncode(self) -> int | None: ...
    @property
    def stopped(self) -> bool: ...
    @property
    def stderr_tail(self) -> Tail: ...
    @property
    def restarts(self) -> int: ...


def _ended(info: RankEnd) -> str:
    """How a rank other than the first to fail ended."""
    if info.returncode is None:
        how = "still running"  # it survived SIGKILL
    elif stopped_by_launcher(info.stopped, info.returncode):
        how = f"stopped by the launcher ({signal_name(-info.returncode)})"
    else:
        how = describe(info.returncode)
    return how + _after_restarts(info)


def _after_restarts(info: RankEnd) -> str:
    n = info.restarts
    return f", after {n} restart{'s' if n != 1 else ''}" if n else ""


def restarts_summary(ranks: Sequence[RankEnd]) -> str:
    """The line printed when every rank exited 0 in the end, some after restarts."""
    restarted = [f"rank {i.rank} ({i.restarts})" for i in ranks if i.restarts]
    return "gradsync launch: every rank exited 0; restarted (times): " + ", ".join(restarted) + "\n"


def failure_summary(failed: RankEnd, ranks: Sequence[RankEnd]) -> str:
    """The root-cause report printed when a rank fails."""
    assert failed.returncode is not None
    raised = failed.stderr_tail.exception(failed.returncode)
    lines = [
        f"gradsync launch: rank {failed.rank} failed first: {describe(failed.returncode)}"
        f" (local rank {failed.local_rank}, pid {failed.pid}{_after_restarts(failed)})"
        + (f", raising {raised}" if raised else "")
    ]
    others = [f"rank {info.rank}: {_ended(info)}" for info in ranks if info is not failed]
    if others:
        lines.append(f"gradsync launch: other ranks: {'; '.join(others)}")
    tail = failed.stderr_tail.lines()
    if tail:
        lines.append(f"gradsync launch: last {len(tail)} lines of rank {failed.rank}'s stderr:")
        lines.extend(f"    {line}" for line in tail)
    else:
        lines.append(f"gradsync launch: rank {failed.rank} wrote nothing to stderr")
    return "\n".join(lines) + "\n"
