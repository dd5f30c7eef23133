"""Error feedback (``error_feedback``): what compressing lost, added to the next call.

Each rank keeps, per dtype group, ``x + e - decode(encode(x + e))`` of its input, and
each owner the same of its shard of the mean, in float32 (float64 for float64 groups),
for the last few layouts (DDP's buckets take turns). NaN and Inf are not carried over.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .header import Layout

__all__ = ["RESIDUAL_LAYOUTS_KEPT", "Clipped", "Residuals", "add_residual", "lost", "work_dtype"]

# Layouts whose residuals are kept (the least recently used goes first).
RESIDUAL_LAYOUTS_KEPT = 16
# Where x + e is clipped, per group dtype: float16's largest finite value (an int8 block
# whose largest magnitude is this decodes to at most it). None for float32 and float64,
# where only a sum that overflows is clipped (add_residual).
_LIMITS: dict[np.dtype[Any], np.floating[Any]] = {
    np.dtype(np.float16): np.float32(np.finfo(np.float16).max)
}

# Where a clip changed x + e, and the values it had there.
Clipped = tuple[np.ndarray, np.ndarray]


class Residuals:
    """What encoding lost, per layout (the last few), kind ("in", "out") and group."""

    def __init__(self) -> None:
        self._sets: dict[Layout, dict[str, dict[int, np.ndarray]]] = {}
        self._now: dict[str, dict[int, np.ndarray]] = {"in": {}, "out": {}}

    def use(self, layout: Layout) -> None:
        """Make ``layout``'s residuals the current ones (fresh for one not kept)."""
        found = self._sets.pop(layout, None)
        if found is None:
            found = {"in": {}, "out": {}}
            if len(self._sets) >= RESIDUAL_LAYOUTS_KEPT:
                del self._sets[next(iter(self._sets))]
        self._sets[layout] = self._now = found

    def get(self, kind: str, key: int) -> np.ndarray | None:
        return self._now[kind].get(key)

    def put(self, kind: str, key: int, residual: np.ndarray) -> None:
        self._now[kind][key] = residual


def work_dtype(dtype: np.dtype[Any]) -> np.dtype[Any]:
    """What a group's error feedback is kept in: float64 for float64, else float32."""
    return np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)


def add_residual(
    x: np.ndarray, dtype: np.dtype[Any], residual: np.ndarray | None
) -> tuple[np.ndarray, Clipped | None]:
    """``x + residual`` as a new array of the work dtype, its finite values clipped where
    the group's dtype could not hold them (x + e past float16's largest would decode to
    Inf, and past float32's largest is Inf); and what the clip changed."""
    wanted = x.astype(work_dtype(dtype))
    if residual is None:
        return wanted, None
    # A signalling NaN in x is no error; the overflow flag (no extra pass) marks a
    # finite x + e past the work dtype's largest.
    try:
        with np.errstate(invalid="ignore", over="raise"):
            wanted += residual
    except FloatingPointError:
        return _saturated_sum(x, wanted, residual)
    return wanted, _clip_finite(wanted, _LIMITS.get(dtype))


def _saturated_sum(
    x: np.ndarray, wanted: np.ndarray, residual: np.ndarray
) -> tuple[np.ndarray, Clipped]:
    """``x + residual`` into ``wanted``, the finite sums that overflowed clipped to the
    work dtype's largest; there the next residual is what encoding lost of x alone."""
    np.copyto(wanted, x, casting="same_kind")
    with np.errstate(all="ignore"):
        wanted += residual
    at = np.flatnonzero(np.isinf(wanted) & np.isfinite(x))
    unclipped = x[at].astype(wanted.dtype)
    wanted[at] = np.copysign(np.finfo(wanted.dtype).max, unclipped)
    return wanted, (at, unclipped)


def lost(wanted: np.ndarray, decoded: np.ndarray, clipped: Clipped | None) -> np.ndarray:
    """The next residual, in place of ``wanted``: what the encoding (and the clip) lost."""
    with np.errstate(invalid="ignore"):
        np.subtract(wanted, decoded, out=wanted)
    left = wanted
    if clipped is not None:
        spots, unclipped = clipped
        left[spots] = unclipped - decoded[spots]
    left[~np.isfinite(left)] = 0
    return left


def _clip_finite(wanted: np.ndarray, limit: np.floating[Any] | None) -> Clipped | None:
    """Clip the finite elements of ``wanted`` beyond +-``limit`` to it, in place (NaN
    and Inf stay); where it clipped and the values it clipped, or None where nothing
    was (or ``limit`` is None)."""
    if limit is None or not len(wanted):
        return None
    # Two passes that only read: a NaN or Inf fails them too, and takes the full check.
    if -limit <= np.minimum.reduce(wanted) and np.maximum.reduce(wanted) <= limit:
        return None
    magnitude = np.abs(wanted)
    at = np.flatnonzero((magnitude > limit) & (magnitude < np.inf))
    if not len(at):
        return None
    unclipped = wanted[at]
    wanted[at] = np.copysign(limit, unclipped)
    return at, unclipped
