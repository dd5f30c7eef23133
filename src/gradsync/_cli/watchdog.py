"""The launcher's watchdog: stops the ranks of a launcher that died without stopping them.

Ranks run in sessions of their own (``launch``), so a launcher killed by SIGKILL (or
the OOM killer) leaves them running: quiet ones until they finish, holding their GPU.
``gradsync launch`` starts this script first, in a session of its own too, and tells it
through its stdin which process groups it started (``add PGID RANK``), which are gone
(``gone PGID``) and that it ended normally (``done``). End of file without ``done``
means the launcher is gone: every group gets SIGTERM, then SIGKILL after the grace
period, as the launcher itself would have done, and once they are gone it leaves their
jobs in the sync directory for them, as the launcher would have too.

Run as a script (``python -I watchdog.py LAUNCHER_PID GRACE_PERIOD_S [SYNC_DIR [own]]``),
standard library only until then (gradsync's ``_proc`` is): it starts in a few
milliseconds, importing neither gradsync's package nor numpy while the launcher lives.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import time
import types
from collections.abc import Callable, Iterable
from pathlib import Path


def _standalone_package() -> None:
    """Run as a script, import gradsync's modules from the tree this script is in (the
    launcher's, whatever the environment says), not through the package's __init__,
    which imports numpy: where numpy comes only through PYTHONPATH (environment
    modules), ``python -I`` cannot see it. Imported as part of gradsync: nothing to do."""
    package = types.ModuleType("gradsync")
    package.__path__ = [str(Path(__file__).resolve().parent.parent)]
    sys.modules.setdefault("gradsync", package)


_standalone_package()
from gradsync import _proc  # noqa: E402  (standard library only)

__all__ = ["group_alive", "main", "watch"]

_POLL_S = 0.05
_GONE_S = 5.0  # after SIGKILL, how long to wait for the groups before leaving for them
# How a rank stopped by the watchdog ended, as its peers are told.
_STOPPED = "was stopped by its launcher's watchdog (the launcher died)"


def group_alive(pgid: int) -> bool:
    """Whether process group ``pgid`` has a process (one we may not signal counts)."""
    return _exists(os.killpg, pgid)


def _process_alive(pid: int) -> bool:
    """Whether process ``pid`` (a rank, the leader of its group) still runs: exists and
    is no zombie. A zombie is dead, but stays (signal 0 reaching it) until its parent
    reaps it: the launcher is gone, and the init of a container may never."""
    found = _proc.stat(pid) if _proc.shows_this_namespace() else None
    if found is not None and found.state in _proc.DEAD:
        # A leader whose main thread ended is a zombie while its other threads run.
        return (_proc.thread_count(pid) or 0) > 1
    return _exists(os.kill, pid)


def _live(groups: dict[int, str]) -> dict[int, str]:
    """The groups that may still have a running process: their leader runs, or, where
    it has ended, signal 0 reaches the group and ``/proc`` shows a member that is no
    zombie (or cannot show). Only to stop waiting early: a group left out here still
    gets SIGKILL if signal 0 reaches it."""
    live = {}
    members: set[int] | None = None  # groups with a process that is no zombie
    for pgid, rank in groups.items():
        if _process_alive(pgid):
            live[pgid] = rank
        elif group_alive(pgid):
            if members is None:
                members = _running_groups()
            if members is None or pgid in members:
                live[pgid] = rank
    return live


def _running_groups() -> set[int] | None:
    """The process groups with a process that is no zombie, by ``/proc``; None where it
    cannot tell."""
    names = _proc.pids() if _proc.shows_this_namespace() else None
    if names is None:
        return None
    groups = set()
    for name in names:
        found = _proc.stat(name)
        if found is not None and found.state not in _proc.DEAD:
            groups.add(found.pgid)
    return groups


def _exists(send: Callable[[int, int], None], target: int) -> bool:
    try:
        send(target, 0)  # signal 0: only whether it could be sent
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal(groups: dict[int, str], signum: int) -> None:
    for pgid in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signum)


def _follow(lines: Iterable[bytes]) -> dict[int, str] | None:
    """The process groups (to the rank each runs) that the launcher's messages in
    ``lines`` left running; None if it said ``done``."""
    groups: dict[int, str] = {}
    for raw in lines:
        words = raw.decode("ascii", "replace").split()
        if words == ["done"]:
            return None
        if len(words) == 3 and words[0] == "add" and words[1].isdigit():
            groups[int(words[1])] = words[2]
        elif len(words) == 2 and words[0] == "gone" and words[1].isdigit():
            groups.pop(int(words[1]), None)
    return groups


def watch(
    lines: Iterable[bytes],
    launcher_pid: int,
    grace_period_s: float,
    sync_dir: str | None = None,
    *,
    own_dir: bool = False,
) -> int:
    """Follow the launcher's messages in ``lines`` (an iterable of bytes); return 0 when
    it said ``done``, else 1 after stopping the groups it had started (and leaving
    their ranks' jobs in ``sync_dir`` for them; with ``own_dir``, the launcher made
    ``sync_dir`` for this job, and it is removed once every rank is gone)."""
    groups = _follow(lines)
    if groups is None:
        return 0
    if not groups:
        if own_dir and sync_dir is not None:
            shutil.rmtree(sync_dir, ignore_errors=True)  # the ranks ended first: as above
        return 1
    # Only ranks running now are stopped by it: how one that ended before (exit 0, or
    # the OOM killer) ended is not known here, so nothing is said for it.
    stopped = {g: r for g, r in groups.items() if _process_alive(g)}
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
    running = dict(groups)
    while running and time.monotonic() < deadline:
        time.sleep(_POLL_S)
        running = _live(running)
    # Every group signal 0 still reaches: one judged gone may hide a process /proc
    # did not show (SIGKILL to a group of zombies does no harm).
    _signal({g: r for g, r in groups.items() if group_alive(g)}, signal.SIGKILL)
    if sync_dir is None:
        return 1
    deadline = time.monotonic() + _GONE_S
    while True:
        running = _live(groups)
        if not running or time.monotonic() >= deadline:
            break
        time.sleep(_POLL_S)
    _leave_for(Path(sync_dir), {g: r for g, r in stopped.items() if g not in running})
    if own_dir and not running:
        shutil.rmtree(sync_dir, ignore_errors=True)  # as the launcher would have
    return 1


def _leave_for(sync_dir: Path, ranks: dict[int, str]) -> None:
    """Leave the jobs of ranks (by process group, which is each rank's pid) on their
    behalf, as the launcher does (``_reaping.leave_for_ended``): peers on other hosts
    learn at once. _reaping is imported only now (without numpy: see
    _standalone_package)."""
    try:
        from gradsync._job.reaping import leave_for_ended  # noqa: PLC0415
    except Exception as exc:  # the ranks are stopped: only the note is lost
        with contextlib.suppress(OSError):
            print(f"gradsync launch: watchdog: cannot import gradsync: {exc}", file=sys.stderr)
        return
    for pgid, rank in ranks.items():
        if rank.isascii() and rank.isdigit():
            leave_for_ended(sync_dir, int(rank), pgid, _STOPPED)


def main(argv: list[str]) -> int:
    # Stopping the job is the launcher's business while it lives; only its death counts.
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    sync_dir = argv[2] if len(argv) > 2 else None
    own_dir = argv[3:] == ["own"]
    return watch(sys.stdin.buffer, int(argv[0]), float(argv[1]), sync_dir, own_dir=own_dir)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
