"""Rank bodies for tests/test_sync_dir_safety.py (importable by spawned children)."""

from __future__ import annotations

import os
import signal
import stat
import time
from pathlib import Path
from typing import Any

import gradsync
from gradsync._testing import FaultyStore, use_store
from ranks import config
from workers import grads_for, linger


def steps_then_linger(
    rank: int, world: int, sync_dir: str, steps: int, linger_s: float, kw: dict[str, Any]
) -> int:
    """Average ``steps`` calls, then keep the session (and rank 0's reaper) for
    ``linger_s`` before closing it; start ``kw["delays"][rank]`` seconds late."""
    time.sleep(kw.pop("delays", {}).get(rank, 0.0))
    with gradsync.GradSync(config(rank, world, sync_dir, **kw)) as gs:
        for step in range(steps):
            gs.average(grads_for(rank, step), step=step)
        time.sleep(linger_s)
    return steps


def steps_then_killed(rank: int, world: int, sync_dir: str) -> None:
    """Average two calls, then die without closing (SIGKILL): the job stays behind."""
    gs = gradsync.GradSync(config(rank, world, sync_dir))
    for step in range(2):
        gs.average(grads_for(rank, step), step=step)
    os.kill(os.getpid(), signal.SIGKILL)


def steps_until_it_fails(rank: int, world: int, sync_dir: str, ready: str) -> int:
    """Average calls until one fails (at most 2000, a few ms apart); rank 0 creates
    ``ready`` after the third, for the test to tamper with the sync dir."""
    with gradsync.GradSync(config(rank, world, sync_dir, max_wait_s=5.0)) as gs:
        for step in range(2000):
            gs.average(grads_for(rank, step), step=step)
            if step == 2 and rank == 0:
                Path(ready).touch()
            time.sleep(0.005)
    return 2000


def steps_around_a_pause(rank: int, world: int, sync_dir: str, ready: str, go: str) -> int:
    """Average three calls; rank 0 creates ``ready``; every rank waits for ``go`` (the
    test tampers with the sync dir meanwhile), averages two more calls and closes."""
    with gradsync.GradSync(config(rank, world, sync_dir, max_wait_s=20.0)) as gs:
        for step in range(3):
            gs.average(grads_for(rank, step), step=step)
        if rank == 0:
            Path(ready).touch()
        while not os.path.exists(go):
            time.sleep(0.01)
        for step in range(3, 5):
            gs.average(grads_for(rank, step), step=step)
    return 5


def rank_1_late_for_call_4(rank: int, world: int, sync_dir: str, ready: str) -> int:
    """Average four calls; before the fourth, rank 1 creates ``ready`` and waits (until
    the test marks ``ready`` done, at most 3 s) while rank 0 waits for it in that call's
    step directory (which the test tampers with)."""
    with gradsync.GradSync(config(rank, world, sync_dir, max_wait_s=10.0)) as gs:
        for step in range(4):
            if step == 3 and rank == 1:
                Path(ready).touch()
                linger(ready, ["test"], 3.0)
            gs.average(grads_for(rank, step), step=step)
    return 4


class LockRemovedAsLooked(FaultyStore):
    """Shows rank 0's lock file as a file with no links left (a rank 0 removed it between
    this one's lookup of the name and its stat), each time it is looked at."""

    shown = 0

    def stat(self, dir_fd: int | None, name: Any) -> os.stat_result:
        st = super().stat(dir_fd, name)
        if Path(name).name.startswith("lock-0"):
            self.shown += 1
            fields = list(st)
            fields[stat.ST_NLINK] = 0
            return os.stat_result(fields)
        return st


def lock_removed_as_looked(rank: int, world: int, sync_dir: str) -> int:
    """One call, rank 0 through a :class:`LockRemovedAsLooked` store; how often its store
    showed the lock so."""
    store = LockRemovedAsLooked()
    with use_store(store), gradsync.GradSync(config(rank, world, sync_dir)) as gs:
        gs.average(grads_for(rank, 0), step=0)
    return store.shown
