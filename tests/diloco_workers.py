"""Rank bodies for tests/test_diloco.py (importable by spawned children)."""

from __future__ import annotations

from typing import Any

import numpy as np

import gradsync
from ranks import config

SHAPES: list[tuple[tuple[int, ...], str]] = [
    ((3, 5), "float32"),
    ((7,), "float16"),
    ((4,), "float64"),
]


def start_params(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(dtype) for shape, dtype in SHAPES]


def inner_step(params: list[np.ndarray], rank: int, step: int) -> None:
    """A stand-in for the inner optimizer: a rank- and step-dependent move, in place."""
    rng = np.random.default_rng([rank, step, 99])
    for p in params:
        np.subtract(p, (0.01 * rng.standard_normal(p.shape)).astype(p.dtype), out=p)


def train(
    rank: int, world: int, sync_dir: str, every: int, steps: int, stop_at: int | None = None
) -> dict[str, Any]:
    """``steps`` inner steps with DiLoCo; the params' bytes before and after every sync.

    With ``stop_at``, the DiLoCo is saved after that many steps and a fresh one,
    restored from the save, goes on (as after a restart from a checkpoint).
    """
    params = start_params()
    before: list[list[bytes]] = []
    after: list[list[bytes]] = []
    with gradsync.GradSync(config(rank, world, sync_dir)) as gs:
        dl = gradsync.DiLoCo(params, gs, every=every)
        for step in range(steps):
            if step == stop_at:
                saved = dl.state_dict()
                dl = gradsync.DiLoCo(params, gs, every=every, check_start=False)
                dl.load_state_dict(saved)
            inner_step(params, rank, step)
            snapshot = [p.tobytes() for p in params]
            if dl.step():
                before.append(snapshot)
                after.append([p.tobytes() for p in params])
        state = dl.state_dict()
    return {
        "before": before,
        "after": after,
        "calls": state["calls"],
        "syncs": state["syncs"],
        "momentum": [m.tobytes() for m in state["momentum"]],
    }


def start_differently(rank: int, world: int, sync_dir: str) -> str:
    """Rank 1 starts from other parameters: the error every rank gets."""
    with gradsync.GradSync(config(rank, world, sync_dir)) as gs:
        try:
            gradsync.DiLoCo(start_params(seed=rank % 2), gs, every=2)
        except gradsync.MismatchError as exc:
            return str(exc)
    return "no error"


def start_compressed(
    rank: int, world: int, sync_dir: str, compression: str, error_feedback: bool, apart: bool
) -> str:
    """The start check under ``compression`` (on one host too); with ``apart``, the last
    rank starts from other parameters."""
    cfg = config(
        rank,
        world,
        sync_dir,
        compression=compression,
        error_feedback=error_feedback,
        compress_local=True,
    )
    with gradsync.GradSync(cfg) as gs:
        if error_feedback:  # a residual this leaves in a (world,) layout must not tip the check
            gs.average([np.full(world, 0.1 * (rank + 1))])
        try:
            gradsync.DiLoCo(start_params(seed=int(apart and rank == world - 1)), gs, every=2)
        except gradsync.MismatchError as exc:
            return str(exc)
    return "no error"


def frozen(rank: int, world: int, sync_dir: str, syncs: int) -> list[bytes]:
    """``syncs`` syncs with params no inner step moved (frozen, or lr=0 warm-up)."""
    params = start_params()
    with gradsync.GradSync(config(rank, world, sync_dir)) as gs:
        dl = gradsync.DiLoCo(params, gs, every=1)
        for _ in range(syncs):
            assert dl.step()
    return [p.tobytes() for p in params]


def settings_apart(rank: int, world: int, sync_dir: str, which: str) -> str:
    """Rank 1 gives ``which`` (every, outer_lr, outer_momentum) another value."""
    kw: dict[str, Any] = {"every": 2, "outer_lr": 0.7, "outer_momentum": 0.9}
    if rank == 1:
        kw[which] = {"every": 3, "outer_lr": 0.5, "outer_momentum": 0.8}[which]
    with gradsync.GradSync(config(rank, world, sync_dir)) as gs:
        try:
            gradsync.DiLoCo(start_params(), gs, **kw)
        except gradsync.MismatchError as exc:
            return str(exc)
    return "no error"


def restore_apart(rank: int, world: int, sync_dir: str, which: str) -> str:
    """A resume in which rank 1 restores another state: ``which`` is "last" (another
    last synced state) or "calls" (saved an inner step earlier, in the same sync window)."""
    params = start_params()
    with gradsync.GradSync(config(rank, world, sync_dir)) as gs:
        dl = gradsync.DiLoCo(params, gs, every=2)
        for step in range(3):
            inner_step(params, rank, step)
            dl.step()
        saved = dl.state_dict()
        if rank == 1 and which == "last":
            saved["last"][0] += 1
        if rank == 1 and which == "calls":
            saved["calls"] -= 1
        dl = gradsync.DiLoCo(params, gs, every=2, check_start=False)
        try:
            dl.load_state_dict(saved)
        except gradsync.MismatchError as exc:
            return str(exc)
    return "no error"


def load_on_one_rank(rank: int, world: int, sync_dir: str) -> list[bytes]:
    """Rank 1 alone reloads its own state unchecked (as a joiner takes the state the
    members broadcast); the syncs go on; the params after the last."""
    params = start_params()
    with gradsync.GradSync(config(rank, world, sync_dir)) as gs:
        dl = gradsync.DiLoCo(params, gs, every=2)
        for step in range(6):
            if rank == 1 and step == 3:
                dl.load_state_dict(dl.state_dict(), check=False)
            inner_step(params, rank, step)
            dl.step()
    return [p.tobytes() for p in params]
