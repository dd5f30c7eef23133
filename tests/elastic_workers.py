"""Rank bodies for tests/test_elastic.py (importable by spawned children)."""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np

import gradsync
from gradsync import _proc
from ranks import WarningLog, config
from workers import SHAPES, SHAPES_BIG, grads_for

_log = logging.getLogger("gradsync")


def train(
    rank: int,
    world: int,
    sync_dir: str,
    steps: int,
    kw: dict[str, Any],
    big: bool = False,
    pause_s: float = 0.0,
    late: dict[int, tuple[int, float]] | None = None,
    own_host: bool = False,
    pid_dir: str | None = None,
) -> dict[str, Any]:
    """Average ``grads_for(rank, step)`` in an elastic job until step ``steps``; every
    call's members, ranks, inputs' seed and results, how long each took, and the
    warnings logged. ``late``: process -> (rank it is started as, seconds it starts late).
    ``own_host``: this process acts as the one rank of a host of its own. ``pid_dir``:
    where it writes its pid, after its first call (for a test to kill it)."""
    if own_host:
        _act_as_own_host(Path(sync_dir).parent / f"host-{rank}")
    shapes = SHAPES_BIG if big else SHAPES
    handler = WarningLog()
    _log.addHandler(handler)
    records = []
    as_rank, delay_s = (late or {}).get(rank, (rank, 0.0))
    time.sleep(delay_s)
    cfg = config(as_rank, max(world, as_rank + 1), sync_dir, elastic=True, **kw)
    try:
        with gradsync.GradSync(cfg) as gs:
            step = 0
            while step < steps:
                grads = grads_for(as_rank, step, shapes)
                start = time.monotonic()
                stats = gs.average(grads)
                records.append(
                    {
                        "step": stats.step,
                        "members": stats.members,
                        "seed": (as_rank, step),
                        "lost": stats.lost,
                        "joined": stats.joined,
                        "epoch": stats.epoch,
                        "rank": gs.rank,
                        "world": gs.world_size,
                        "elapsed_s": time.monotonic() - start,
                        "after": [g.tobytes() for g in grads],
                    }
                )
                step = stats.step + 1
                if pid_dir is not None and len(records) == 1:
                    (Path(pid_dir) / f"pid-{rank}").write_text(str(os.getpid()))
                time.sleep(pause_s)
    finally:
        _log.removeHandler(handler)
    return {"records": records, "warnings": handler.messages}


def _act_as_own_host(root: Path) -> None:
    """Read process information below ``root``: this process's own ``/proc`` entries and
    a boot id of its own, so its peers count as on other hosts (judged by heartbeats)."""
    me = str(os.getpid())
    (root / "sys" / "kernel" / "random").mkdir(parents=True)
    (root / "sys" / "kernel" / "random" / "boot_id").write_text(f"boot-{root.name}\n")
    (root / me).symlink_to(f"/proc/{me}")
    (root / "self").symlink_to(me)
    _proc.set_root(root)


def first_call(rank: int, world: int, sync_dir: str, elastic_ranks: list[int]) -> None:
    """One averaging call, elastic only on ``elastic_ranks``."""
    cfg = config(rank, world, sync_dir, elastic=rank in elastic_ranks, max_wait_s=10.0)
    with gradsync.GradSync(cfg) as gs:
        gs.average(grads_for(rank, 0))


def broadcast_at(
    rank: int, world: int, sync_dir: str, kw: dict[str, Any], steps: int, at: int
) -> dict[str, Any]:
    """Average ``steps`` steps, and broadcast a state that differs by rank after step
    ``at``; the state then, the membership at the end, and each call's ``lost``."""
    cfg = config(rank, world, sync_dir, elastic=True, **kw)
    state = np.full(64, float(rank + 1))
    lost = []
    with gradsync.GradSync(cfg) as gs:
        for step in range(steps):
            lost.append(gs.average(grads_for(rank, step)).lost)
            if step == at:
                gs.broadcast([state])
        return {"state": state.tobytes(), "members": gs.members, "epoch": gs.epoch, "lost": lost}


def a_job_that_ends_before_admitting(rank: int, sync_dir: str, kw: dict[str, Any]) -> Any:
    """Processes 0 and 1 average once and close once process 2 has asked to join (no
    call of theirs comes to admit it); process 2 asks after their first call."""
    rdzv = Path(sync_dir) / "rdzv"
    if rank < 2:
        with gradsync.GradSync(config(rank, 2, sync_dir, elastic=True, **kw)) as gs:
            gs.average(grads_for(rank, 0))
            (Path(sync_dir) / f"done-{rank}").touch()
            while not list(rdzv.glob("ejoin-*")):
                time.sleep(0.01)
        return None
    while not all((Path(sync_dir) / f"done-{r}").exists() for r in (0, 1)):
        time.sleep(0.01)
    with gradsync.GradSync(config(2, 3, sync_dir, elastic=True, **kw)) as gs:
        gs.average(grads_for(2, 0))
    return None


def members_and_a_joiner(
    rank: int, sync_dir: str, kw: dict[str, Any], pid_dir: str
) -> dict[str, Any] | None:
    """Processes 0 and 1 train as a job of 2 for 80 steps; process 2 asks to join it.
    Each writes its pid in ``pid_dir`` (the members after their first call)."""
    if rank < 2:
        return train(rank, 2, sync_dir, 80, kw, pause_s=0.05, pid_dir=pid_dir)
    time.sleep(0.5)
    (Path(pid_dir) / "pid-2").write_text(str(os.getpid()))
    cfg = config(2, 3, sync_dir, elastic=True, **kw)
    with gradsync.GradSync(cfg) as gs:
        gs.average(grads_for(2, 0))
    return None


def broadcast_from_a_second_rank_1(proc: int, world: int, sync_dir: str, kw: dict[str, Any]) -> Any:
    """Processes 0-2 form a job; process 3, started as rank 1 too (a joiner may take any
    rank) with its own world size, joins it. Then all broadcast from rank 3 now: its
    state, not the first rank 1's, must reach every process."""
    started_as = 1 if proc == 3 else proc
    if proc == 3:
        time.sleep(1.0)
    with gradsync.GradSync(config(started_as, world, sync_dir, elastic=True, **kw)) as gs:
        while proc != 3 and gs.world_size < 4:
            gs.average(grads_for(started_as, 0))
            time.sleep(0.02)
        state = np.full(8, 100.0 + proc)
        gs.broadcast([state], root=3)
        return {"rank": gs.rank, "members": gs.members, "state": float(state[0])}


def members_killed_while_one_waits_to_join(proc: int, sync_dir: str, kw: dict[str, Any]) -> Any:
    """Processes 0 and 1 average once as a job of 2, then SIGKILL themselves once process
    2 (started as rank 1) asks to join it; process 3 then starts as rank 0. Processes 2
    and 3 average once: the rank, world size and members, the mean, and how long it took."""
    root = Path(sync_dir)
    if proc < 2:
        with gradsync.GradSync(config(proc, 2, sync_dir, elastic=True, **kw)) as gs:
            gs.average(grads_for(proc, 0))
            (root / f"done-{proc}").touch()
            while not list((root / "rdzv").glob("ejoin-*")):
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGKILL)
    while not all((root / f"done-{r}").exists() for r in (0, 1)):
        time.sleep(0.01)
    if proc == 3:
        while not list((root / "rdzv").glob("ejoin-*")):
            time.sleep(0.01)
        time.sleep(0.5)  # the members are gone by then
    start, as_rank = time.monotonic(), 3 - proc
    grads = grads_for(as_rank, 0)
    with gradsync.GradSync(config(as_rank, 2, sync_dir, elastic=True, **kw)) as gs:
        gs.average(grads)
        seen = (gs.rank, gs.world_size, gs.members)
    return {"seen": seen, "after": [g.tobytes() for g in grads], "s": time.monotonic() - start}


def joiner_with_other_settings(proc: int, sync_dir: str, kw: dict[str, Any]) -> Any:
    """Processes 0 and 1 average as an elastic job until process 2, started as rank 2
    with wide_sum on, is done trying to join: its error, and how long it took."""
    root = Path(sync_dir)
    if proc < 2:
        with gradsync.GradSync(config(proc, 2, sync_dir, elastic=True, **kw)) as gs:
            gs.average(grads_for(proc, 0))  # the first call forms the job
            (root / f"formed-{proc}").touch()
            while not (root / "tried").exists():
                gs.average(grads_for(proc, 0))
                time.sleep(0.02)
            return gs.world_size
    while not all((root / f"formed-{r}").exists() for r in (0, 1)):
        time.sleep(0.01)
    start = time.monotonic()
    try:
        with gradsync.GradSync(config(2, 3, sync_dir, elastic=True, wide_sum=True, **kw)) as gs:
            gs.average(grads_for(2, 0))
        return "admitted"
    except gradsync.GradSyncError as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "s": time.monotonic() - start}
    finally:
        (root / "tried").touch()


def a_joiner_after_a_stale_decider(proc: int, sync_dir: str, kw: dict[str, Any], marks: str) -> Any:
    """Processes 0-3, each as a host of its own, form a job of 4 and average until
    process 4 is done joining; process 4, started as rank 3 once ``marks``/go exists,
    joins: its members, or its error, and how long it took."""
    root = Path(marks)
    _act_as_own_host(Path(sync_dir).parent / f"host-{proc}")
    if proc < 4:
        with gradsync.GradSync(config(proc, 4, sync_dir, elastic=True, **kw)) as gs:
            while not (root / "tried").exists():
                gs.average(grads_for(proc, 0))
                if not (root / f"pid-{proc}").exists():
                    (root / f"pid-{proc}").write_text(str(os.getpid()))
                time.sleep(0.02)
            return gs.members
    while not (root / "go").exists():
        time.sleep(0.01)
    start = time.monotonic()
    try:
        with gradsync.GradSync(config(3, 4, sync_dir, elastic=True, **kw)) as gs:
            gs.average(grads_for(3, 0))
            return {"members": gs.members, "s": time.monotonic() - start}
    except gradsync.GradSyncError as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "s": time.monotonic() - start}
    finally:
        (root / "tried").touch()


def hosts_killed_then_a_next_run(proc: int, sync_dir: str, kw: dict[str, Any]) -> Any:
    """Processes 0 and 1, each as a host of its own, average once as an elastic job of
    2 and SIGKILL themselves (no launcher leaves for them); then processes 2 and 3, as
    two more hosts, run the same job again (ranks 0 and 1): their first call's world
    size, or error, and how long it took."""
    root = Path(sync_dir)
    _act_as_own_host(root.parent / f"host-{proc}")
    rank = proc % 2
    if proc < 2:
        with gradsync.GradSync(config(rank, 2, sync_dir, elastic=True, **kw)) as gs:
            gs.average(grads_for(rank, 0))
            (root.parent / f"done-{proc}").touch()
            os.kill(os.getpid(), signal.SIGKILL)
    while not all((root.parent / f"done-{r}").exists() for r in (0, 1)):
        time.sleep(0.01)
    time.sleep(0.5)  # both killed by then
    start = time.monotonic()
    try:
        with gradsync.GradSync(config(rank, 2, sync_dir, elastic=True, **kw)) as gs:
            gs.average(grads_for(rank, 0))
            return {"world": gs.world_size, "s": time.monotonic() - start}
    except gradsync.GradSyncError as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "s": time.monotonic() - start}
