"""Catch ``buffers_like`` arrays averaged again without new gradients written into them.

The documented torch recipe makes the buffers the parameters' ``p.grad``. torch's
``zero_grad()`` sets ``p.grad = None`` by default, and ``backward()`` then puts the
gradients in new tensors: the buffers keep the mean of the last call, every rank
averages that again, and each optimizer steps with its own unaveraged gradients.
Nothing fails; the ranks' weights drift apart.

So each call given the buffers compares a few sampled elements with the ones the
last call's mean left there. Only where all are the same (which real gradients
practically never are) is the whole content compared, at the next such call, with
a copy of the mean kept for it; the same in full means nothing wrote the buffers.
Gradients that are all exactly zero are taken for this only while the buffers have
held nothing but zeros since they were made.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import numpy as np

from gradsync._errors import InvalidGradsError

__all__ = ["StaleWatch"]

SPREAD = 16  # elements sampled evenly over each run
PARAMS = 16  # params (spread over the run) whose middle element is sampled too
ZERO_CALLS = 3  # calls of all-zero buffers, untouched since they were made, that raise


class StaleWatch:
    """Watches one set of ``buffers_like`` arrays for calls that average them unwritten."""

    def __init__(
        self,
        arrays: Sequence[np.ndarray],
        runs: Sequence[np.ndarray],
        sampled: Sequence[tuple[np.ndarray, np.ndarray]],
        rank: int,
    ) -> None:
        """``runs``: 1-D views of all the arrays' memory; ``sampled``: (run, positions)."""
        self._arrays = tuple(arrays)
        self._spans = tuple((a.ctypes.data, a.nbytes) for a in arrays)
        self._runs = tuple(runs)
        self._sampled = tuple(sampled)
        self._rank = rank
        self._last = self._sample()  # zero-filled: gradsync's own writing
        self._kept: list[np.ndarray] | None = []  # the last mean in full; [] for all zeros
        self._suspect = False
        self._fresh = True  # nothing but zeros in them at every call so far
        self._calls = 0

    @classmethod
    def for_runs(
        cls,
        arrays: Sequence[np.ndarray],
        runs: Sequence[np.ndarray],
        params: Sequence[Sequence[tuple[int, int]]],
        rank: int,
    ) -> StaleWatch:
        """Mapped buffers: one 1-D run per dtype group, ``params`` its (first, count)."""
        sampled = []
        for run, spans in zip(runs, params, strict=True):
            spread = np.linspace(0, run.size - 1, min(run.size, SPREAD)).astype(np.intp)
            chosen = [spans[i] for i in _spread(len(spans)) if spans[i][1]]
            middles = np.array([first + count // 2 for first, count in chosen], np.intp)
            sampled.append((run, np.unique(np.concatenate([spread, middles]))))
        return cls(arrays, runs, sampled, rank)

    @classmethod
    def for_arrays(cls, arrays: Sequence[np.ndarray], rank: int) -> StaleWatch:
        """Plain arrays: the middle element of up to ``PARAMS`` params, spread."""
        runs = [a.reshape(-1) for a in arrays]
        sampled = [(runs[i], np.array([runs[i].size // 2], np.intp)) for i in _spread(len(runs))]
        return cls(arrays, runs, [(r, at) for r, at in sampled if r.size], rank)

    def _sample(self) -> bytes:
        return b"".join(run[at].tobytes() for run, at in self._sampled)

    def given(self, arrays: Sequence[np.ndarray]) -> bool:
        """Whether ``arrays`` are these arrays' memory, param for param."""
        if len(arrays) != len(self._spans):
            return False
        if all(map(operator.is_, arrays, self._arrays)):
            return True
        for a, mine, (address, nbytes) in zip(arrays, self._arrays, self._spans, strict=True):
            if a is not mine and (a.nbytes != nbytes or (nbytes and a.ctypes.data != address)):
                return False
        return True

    def before(self, step: int) -> None:
        """Check the arrays given to this call, before they are published.

        Raises:
            InvalidGradsError: they hold what the last call left there, in full.
        """
        if not self._last:
            return  # no element to sample: nothing to average either
        self._calls += 1
        self._suspect = self._sample() == self._last
        kept, self._kept = self._kept, None
        if not self._suspect:
            self._fresh = False
        elif kept:
            if all(_same_bits(r, k) for r, k in zip(self._runs, kept, strict=True)):
                raise self._error(step, zeros=False)
        elif kept is not None:  # the last mean was all zeros
            if any(r.any() for r in self._runs):
                self._fresh = False
            elif self._fresh and self._calls >= ZERO_CALLS:
                raise self._error(step, zeros=True)

    def after(self) -> None:
        """Note the mean just written into the arrays (kept in full if it looked stale)."""
        self._last = self._sample()
        if self._suspect:
            zero = not any(r.any() for r in self._runs)
            self._kept = [] if zero else [r.copy() for r in self._runs]
            self._fresh = self._fresh and zero

    def _error(self, step: int, *, zeros: bool) -> InvalidGradsError:
        held = (
            f"still hold only the zeros they were made with, {ZERO_CALLS} calls in a row"
            if zeros
            else "hold exactly the mean the last call wrote into them"
        )
        return InvalidGradsError(
            f"step {step}: the buffers_like arrays {held}: nothing wrote new gradients into "
            "them (torch: zero_grad() with set_to_none=True, its default, replaced the "
            "p.grad tensors that were these arrays). Call optimizer.zero_grad("
            "set_to_none=False), or average [p.grad.numpy() for p in model.parameters()] "
            "instead; as they are, each rank would step with its own gradients, never "
            "averaged (gradients that really are unchanged: average copies of them)",
            step=step,
            ranks=[self._rank],
        )


def _spread(n: int) -> list[int]:
    """Up to ``PARAMS`` indices of ``range(n)``, evenly spread."""
    return sorted({int(i) for i in np.linspace(0, n - 1, min(n, PARAMS))})


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    kind = np.dtype(f"u{a.dtype.itemsize}")
    return bool(np.array_equal(a.view(kind), b.view(kind)))
