"""Whether two gradients share memory: averaging is in place, so the mean written into
one would change the other (and a float32 and a float64 view of one buffer would give
each rank different bits)."""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from typing import cast

import numpy as np

__all__ = ["overlap_message", "overlapping", "repeated"]


def repeated(items: Sequence[object]) -> tuple[int, int] | None:
    """The indices ``(i, j)``, ``i < j``, of the first object that ``items`` holds twice."""
    if len({id(item) for item in items}) == len(items):
        return None
    seen: dict[int, int] = {}
    for j, item in enumerate(items):
        i = seen.setdefault(id(item), j)
        if i != j:
            return i, j
    return None  # pragma: no cover - a repeated id always repeats in the loop


def overlapping(arrays: Sequence[np.ndarray], *, views: bool) -> tuple[int, int] | None:
    """The indices ``(i, j)``, ``i < j``, of two C-contiguous writable ``arrays`` whose
    bytes overlap, or None. ``views=False`` says each array owns its memory (numpy
    allocated it and no other array is its base): then only the same array twice can."""
    if not views:
        return repeated(arrays)
    # Byte ranges sorted by start: an overlap is a start before the furthest end so far.
    # from_buffer: a quarter of the cost of a.ctypes.data or __array_interface__.
    address = ctypes.addressof
    # numpy's stubs give ndarray no Buffer type for Python < 3.12; it has the protocol.
    at = cast(Callable[[np.ndarray], ctypes.c_char], ctypes.c_char.from_buffer)
    try:
        starts = [address(at(a)) for a in arrays]
    except ValueError:  # zero-size (no byte to point at) or a dtype buffers refuse (dates)
        starts = [a.ctypes.data if a.nbytes else 0 for a in arrays]
    end = owner = -1
    for k in sorted(range(len(arrays)), key=starts.__getitem__):
        nbytes = arrays[k].nbytes
        if not nbytes:
            continue
        if starts[k] < end:
            return min(k, owner), max(k, owner)
        if starts[k] + nbytes > end:
            end, owner = starts[k] + nbytes, k
    return None


def overlap_message(i: int, j: int, what: str) -> str:
    """What :class:`InvalidGradsError` says of params ``i`` and ``j`` sharing memory."""
    return (
        f"params {i} and {j} are {what}: averaging is in place, so each gradient must be "
        "passed once, in memory of its own"
    )
