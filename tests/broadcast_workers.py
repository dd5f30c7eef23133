"""Rank bodies for tests/test_broadcast.py (importable by spawned children)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

import gradsync
from ranks import config

DTYPES = [
    "float32", "float64", "int64", "uint8", "bool", "float16", "datetime64[s]", "timedelta64[ns]",
]  # fmt: skip


def arrays_of(rank: int) -> list[np.ndarray]:
    """One array per dtype, different on every rank; floats hold NaNs with payloads,
    a signalling NaN, -0.0 and infinities, whose bits a broadcast must keep."""
    rng = np.random.default_rng(rank + 100)
    out: list[np.ndarray] = []
    for i, name in enumerate(DTYPES):
        shape = (3, 5 + i) if i % 2 else (11 + i,)
        raw = rng.integers(0, 256, size=int(np.prod(shape)) * np.dtype(name).itemsize)
        a = raw.astype(np.uint8).view(name).reshape(shape).copy()
        if name == "bool":
            a = raw[: a.size].astype(bool).reshape(shape)
        out.append(a)
    specials = {
        "float32": (np.uint32, [0x7FC00001 + rank, 0x7F800001, 0x80000000, 0x7F800000]),
        "float64": (np.uint64, [0x7FF8000000000ABC + rank, 0x7FF0000000000001, 1 << 63]),
        "float16": (np.uint16, [0x7E01 + rank, 0x7C01, 0x8000]),
    }
    for a in out:
        if a.dtype.name in specials:
            kind, bits = specials[a.dtype.name]
            a.reshape(-1).view(kind)[: len(bits)] = bits
    return out


def raw(arrays: list[np.ndarray]) -> list[bytes]:
    return [a.tobytes() for a in arrays]


def interleaved(rank: int, world: int, sync_dir: str, kw: dict[str, Any]) -> Any:
    """average, broadcast from rank 0, average, broadcast from rank 2 (default root
    then explicit), average: what each broadcast left and each mean."""
    got: list[Any] = []
    grads = [np.full(300_000 if kw.get("big") else 7, float(rank + 1))]
    cfg = config(rank, world, sync_dir, **{k: v for k, v in kw.items() if k != "big"})
    with gradsync.GradSync(cfg) as gs:
        for root in (None, 2, 1):
            gs.average(grads)
            got.append(float(grads[0][0]))
            arrays = arrays_of(rank)
            gs.broadcast(arrays, root=root)
            got.append(raw(arrays))
            grads[0][:] = rank + 1
        gs.average(grads)
        got.append(float(grads[0][-1]))
    return got


def mismatched(rank: int, world: int, sync_dir: str, kind: str) -> Any:
    arrays = arrays_of(0)
    root = None
    if rank == 1 and kind == "shape":
        arrays[2] = np.zeros(4, np.int64)
    if rank == 1 and kind == "dtype":
        arrays[2] = arrays[2].view(np.float64)
    if rank == 1 and kind == "root":
        root = 1
    with gradsync.GradSync(config(rank, world, sync_dir)) as gs:
        if kind == "average" and rank == 1:
            gs.average([np.zeros(3)])
        else:
            gs.broadcast(arrays, root=root)


def receiver_unchanged_on_a_mismatch(rank: int, world: int, sync_dir: str) -> Any:
    arrays = arrays_of(rank)
    before = raw(arrays)
    if rank == 1:
        arrays.append(np.zeros(2, np.uint8))
    with gradsync.GradSync(config(rank, world, sync_dir)) as gs:
        try:
            gs.broadcast(arrays)
        except gradsync.MismatchError:
            return raw(arrays[: len(DTYPES)]) == before
    return None


def from_a_dead_root(rank: int, world: int, sync_dir: str) -> Any:
    with gradsync.GradSync(config(rank, world, sync_dir)) as gs:
        gs.average([np.zeros(3)])
        if rank == 0:
            os._exit(0)
        gs.broadcast(arrays_of(rank))
