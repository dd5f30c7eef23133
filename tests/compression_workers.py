"""Rank bodies for tests/test_compression.py (importable by spawned children)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

import gradsync
import ranks
from gradsync._names import data_name, gen_id_of

# Sharded (over 256 KiB per rank): three dtype groups, params crossing shard and block
# boundaries, one param far past float16's largest value (65504).
SHAPES: list[tuple[tuple[int, ...], str]] = [
    ((3, 5), "float32"),
    ((7,), "float16"),
    ((70_001,), "float32"),
    ((2, 2, 3), "float64"),
    ((3, 20_000), "float16"),
    ((5_000,), "float64"),
    ((1_000,), "float32"),
]
# Across hosts, each shard's part of an input in a file of its own (over 1 MiB a shard).
LARGE = [*SHAPES, ((3_200_003,), "float32")]
# Under 256 KiB: every rank reduces all.
SMALL = [*SHAPES[:2], ((1000,), "float32"), ((300,), "float64")]
LARGE_PARAM = 6  # of SHAPES: values around 1e6


def config(rank: int, world: int, sync_dir: str, **kw: Any) -> gradsync.FileGradSyncConfig:
    """A rank's config, compressing on this one host too unless ``kw`` says otherwise."""
    kw.setdefault("compress_local", True)
    return ranks.config(rank, world, sync_dir, **kw)


def grads_for(rank: int, step: int, shapes: list[tuple[tuple[int, ...], str]]) -> list[np.ndarray]:
    """Deterministic, rank- and step-dependent gradients (the last float32 param of
    SHAPES around 1e6)."""
    rng = np.random.default_rng([rank, step, 777])
    out = []
    for k, (shape, dtype) in enumerate(shapes):
        scale = 1e6 if shapes is SHAPES and k == LARGE_PARAM else 10.0 ** rng.integers(-3, 2)
        out.append((rng.standard_normal(shape) * scale).astype(dtype))
    return out


def steps(rank: int, world: int, sync_dir: str, count: int, small: bool, kw: dict[str, Any]) -> Any:
    """Average ``count`` steps; return each step's inputs and results (bytes). With
    ``kw["across_hosts"]`` the sync dir is taken for one other hosts share, except by the
    ranks in ``kw["local_ranks"]`` (an NFS server's host); with ``kw["large"]`` the
    gradients are LARGE."""
    local_ranks = kw.pop("local_ranks", [])
    if kw.pop("across_hosts", False):
        from gradsync._step import state as _state  # noqa: PLC0415

        _state.local_filesystem = lambda path: rank in local_ranks  # type: ignore[assignment]
    shapes = SMALL if small else LARGE if kw.pop("large", False) else SHAPES
    out = []
    with gradsync.GradSync(config(rank, world, sync_dir, **kw)) as gs:
        for step in range(count):
            grads = grads_for(rank, step, shapes)
            before = [g.copy() for g in grads]
            gs.average(grads, step=step)
            out.append((before, grads))
    return out


def function_form(rank: int, world: int, sync_dir: str, compression: str) -> Any:
    """One step through ``average_grads_file_sync``."""
    grads = grads_for(rank, 0, SHAPES)
    cfg = config(rank, world, sync_dir, compression=compression)
    gradsync.average_grads_file_sync(grads, None, cfg, step=0)
    return grads


def file_sizes(
    rank: int, world: int, sync_dir: str, compression: str | None, local: bool = True
) -> dict[str, Any]:
    """One step of a 4 MiB float32 gradient; the sizes of this rank's input and output
    files, read before closing, the codec the step says it used, and the mean."""
    grads = [np.random.default_rng(rank).standard_normal(1 << 20).astype(np.float32)]
    cfg = config(rank, world, sync_dir, compression=compression, compress_local=local)
    with gradsync.GradSync(cfg) as gs:
        stats = gs.average(grads, step=0)
        (gen,) = [p for p in Path(sync_dir).iterdir() if gen_id_of(p.name) is not None]
        sizes = {kind: os.stat(gen / data_name(rank, kind)).st_size for kind in ("in", "out")}
    return {**sizes, "codec": stats.compression, "mean": grads[0]}


def constant_steps(rank: int, world: int, sync_dir: str, count: int, feedback: bool) -> Any:
    """The same gradient ``count`` times under int8; the sum of the results."""
    grad = (np.random.default_rng([rank, 5]).standard_normal(100_000) * 1e-2).astype(np.float32)
    total = np.zeros(grad.shape, np.float64)
    cfg = config(rank, world, sync_dir, compression="int8", error_feedback=feedback)
    with gradsync.GradSync(cfg) as gs:
        for step in range(count):
            g = grad.copy()
            gs.average([g], step=step)
            total += g
    return grad, total


def nonfinite(rank: int, world: int, sync_dir: str, compression: str, check: bool) -> Any:
    """Rank 1 sends Inf and NaN in one param; the results (or the error)."""
    grads = grads_for(rank, 0, SHAPES)
    if rank == 1:
        grads[2][10] = np.inf
        grads[2][20] = np.nan
    cfg = config(rank, world, sync_dir, compression=compression, check_finite=check)
    with gradsync.GradSync(cfg) as gs:
        gs.average(grads, step=0)
    return grads


def near_float16_max(
    rank: int, world: int, sync_dir: str, count: int, size: int, poison: bool = False
) -> Any:
    """``count`` steps of int8 with error feedback over one float16 param of ``size``
    elements, a third of them within 512 of +-65504 (each block has one at 65504); each
    step's input and result. With ``poison`` rank 1 sends Inf at 10 and NaN at 20."""
    rng = np.random.default_rng([rank, 65504])
    out = []
    cfg = config(rank, world, sync_dir, compression="int8", error_feedback=True)
    with gradsync.GradSync(cfg) as gs:
        for step in range(count):
            g = rng.uniform(-65504, 65504, size)
            near = rng.random(size) < 1 / 3
            g[near] = np.copysign(65504 - rng.uniform(0, 512, near.sum()), g[near])
            g[step % 256 :: 256] = 65504
            grad = g.astype(np.float16)
            if poison and rank == 1:
                grad[10], grad[20] = np.inf, np.nan
            before = grad.copy()
            gs.average([grad], step=step)
            out.append((before, grad))
    return out


def taking_turns(rank: int, world: int, sync_dir: str, count: int, sizes: list[int]) -> Any:
    """``count`` rounds of int8 with error feedback, each a call per size (one float16
    param each, a layout each, taking turns); per size, each round's input and result."""
    rng = np.random.default_rng([rank, 16])
    out: list[list[Any]] = [[] for _ in sizes]
    cfg = config(rank, world, sync_dir, compression="int8", error_feedback=True)
    with gradsync.GradSync(cfg) as gs:
        for _ in range(count):
            for i, size in enumerate(sizes):
                grad = rng.standard_normal(size).astype(np.float16)
                before = grad.copy()
                gs.average([grad])
                out[i].append((before, grad))
    return out


def near_float32_max(rank: int, world: int, sync_dir: str, size: int, codec: str = "bf16") -> Any:
    """One step of ``codec`` over float32 values within 0.5% of +-float32's largest
    (most past bfloat16's largest, 3.3895e38), every 97th one +-float32's largest on
    every rank (so is their mean); the input and the result."""
    rng = np.random.default_rng([rank, 38])
    top = np.finfo(np.float32).max
    magnitude = rng.uniform(0.995, 1.0, size) * top
    grad = (np.sign(rng.uniform(-1, 1, size)) * magnitude).astype(np.float32)
    grad[::97] = np.where(np.arange(size)[::97] % 2 == 0, top, -top)
    before = grad.copy()
    with gradsync.GradSync(config(rank, world, sync_dir, compression=codec)) as gs:
        gs.average([grad], step=0)
    return before, grad


def near_float32_max_fed_back(rank: int, world: int, sync_dir: str, codec: str, count: int) -> Any:
    """``count`` steps of ``codec`` with error feedback over the same values at and near
    +-float32's largest, and a signalling NaN; each step's result."""
    top = np.finfo(np.float32).max
    grad = np.array([top, -top, top * 0.999, 1.0] * 300, np.float32)
    grad.view(np.uint32)[3] = 0x7F800001  # a signalling NaN: no warning, no error
    out = []
    cfg = config(rank, world, sync_dir, compression=codec, error_feedback=True)
    with gradsync.GradSync(cfg) as gs:
        for step in range(count):
            g = grad.copy()
            gs.average([g], step=step)
            out.append(g)
    return out
