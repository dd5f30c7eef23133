"""Local SGD with an outer Nesterov step every H inner steps: :class:`DiLoCo`."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ._api import GradSync
from ._errors import ConfigError, InvalidGradsError, MismatchError

__all__ = ["DiLoCo"]

_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))
# Bits of the start digest per float64 word: the sum of squares over 2**12 ranks stays exact.
_CHUNK_BITS = 20
_CHUNKS = 3


class DiLoCo:
    """Averages the ranks' progress every ``every`` inner steps and takes an outer step.

    DiLoCo (Douillard et al. 2023, arXiv:2311.08105), with the outer optimizer of the
    paper and OpenDiLoCo: SGD with Nesterov momentum, as ``torch.optim.SGD(lr=outer_lr,
    momentum=outer_momentum, nesterov=True)``. At a sync, with θ₀ the parameters of the
    last sync (identical on every rank) and θ this rank's parameters::

        Δ = mean over ranks of (θ₀ - θ)        # the pseudo-gradient, through gs.average
        v = outer_momentum * v + Δ             # v starts at zero
        θ = θ₀ - outer_lr * (Δ + outer_momentum * v)

    Every rank computes this from the same bits in the same order, so the new
    parameters are identical, bit for bit, on every rank (given one numpy version).
    Momentum is kept in the parameter's dtype, float32 for float16 parameters.

    The parameters must start identical on every rank: the constructor checks it
    (with ``check_start``) by averaging a digest of them, a collective call that every
    rank makes. If a sync fails, the parameters are as before it and ``gs`` is unusable.
    """

    def __init__(
        self,
        params: Sequence[np.ndarray],
        gs: GradSync,
        *,
        every: int,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        check_start: bool = True,
    ) -> None:
        """Wrap ``params`` (updated in place) and ``gs``, which averages the pseudo-gradient.

        Raises:
            ConfigError: ``gs`` is not a GradSync, or ``every``, ``outer_lr`` or
                ``outer_momentum`` is out of range.
            InvalidGradsError: a parameter is not a writeable C-contiguous float16/32/64
                numpy array.
            MismatchError: (``check_start``) the ranks' parameters differ.
            GradSyncError: the averaging call of ``check_start`` failed.
        """
        if not isinstance(gs, GradSync):
            raise ConfigError(f"gs must be a GradSync, got {type(gs).__name__}")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ConfigError(f"every must be an int >= 1, got {every!r}")
        if not _real(outer_lr) or not outer_lr > 0:
            raise ConfigError(f"outer_lr must be a finite number > 0, got {outer_lr!r}")
        if not _real(outer_momentum) or not 0 <= outer_momentum < 1:
            raise ConfigError(f"outer_momentum must be in [0, 1), got {outer_momentum!r}")
        self.params = _checked_params(params)
        self.gs = gs
        self.every = every
        self.outer_lr = float(outer_lr)
        self.outer_momentum = float(outer_momentum)
        self.calls = 0  # step() calls so far
        self.syncs = 0
        self._last = [p.copy() for p in self.params]
        self._momentum = [np.zeros(p.shape, _state_dtype(p.dtype)) for p in self.params]
        self._delta: list[np.ndarray] | None = None  # gs.buffers_like, made at the first sync
        if check_start:
            self._check_identical_start()

    def __repr__(self) -> str:
        return (
            f"DiLoCo({len(self.params)} params, every={self.every}, outer_lr={self.outer_lr}, "
            f"outer_momentum={self.outer_momentum}, calls={self.calls}, syncs={self.syncs})"
        )

    def step(self) -> bool:
        """Count one inner step; every ``every``-th call syncs. Whether it synced.

        Raises:
            GradSyncError: averaging failed (see :meth:`GradSync.average`); the
                parameters are left as they were.
        """
        self.calls += 1
        if self.calls % self.every:
            return False
        self.sync()
        return True

    def sync(self) -> None:
        """Average the pseudo-gradient now and take the outer step (collective)."""
        if self._delta is None:
            self._delta = self.gs.buffers_like(self.params)
        for last, p, d in zip(self._last, self.params, self._delta, strict=True):
            np.subtract(last, p, out=d)
        self.gs.average(self._delta)
        mu, lr = self.outer_momentum, self.outer_lr
        for last, p, d, v in zip(self._last, self.params, self._delta, self._momentum, strict=True):
            np.multiply(v, mu, out=v)
            np.add(v, d, out=v)
            update = np.multiply(v, mu)
            np.add(update, d, out=update)
            np.multiply(update, lr, out=update)
            np.subtract(last, update, out=p, casting="same_kind")
            np.copyto(last, p)
        self.syncs += 1

    def state_dict(self) -> dict[str, Any]:
        """Copies of the outer state: counters, the last synced parameters, the momentum."""
        return {
            "calls": self.calls,
            "syncs": self.syncs,
            "every": self.every,
            "last": [a.copy() for a in self._last],
            "momentum": [a.copy() for a in self._momentum],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` gave (the parameters themselves are the caller's).

        Raises:
            ConfigError: a key is missing, or the state was saved with another ``every``
                or with other shapes or dtypes.
        """
        try:
            calls, syncs, every = int(state["calls"]), int(state["syncs"]), int(state["every"])
            last, momentum = list(state["last"]), list(state["momentum"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"not a DiLoCo state_dict: {exc!r}") from exc
        if every != self.every:
            raise ConfigError(f"state saved with every={every}, this DiLoCo has {self.every}")
        for name, mine, theirs in (
            ("last", self._last, last),
            ("momentum", self._momentum, momentum),
        ):
            _check_like(name, mine, theirs)
        for dst, src in zip([*self._last, *self._momentum], [*last, *momentum], strict=True):
            np.copyto(dst, src)
        self.calls, self.syncs = calls, syncs

    def _check_identical_start(self) -> None:
        # mean(h*h) == mean(h)**2, all exact in float64, only where every rank's h is equal.
        h = hashlib.blake2b(digest_size=8)
        for p in self.params:
            h.update(str((p.dtype.str, p.shape)).encode())
            h.update(p.tobytes())
        digest = int.from_bytes(h.digest(), "little")
        mask = (1 << _CHUNK_BITS) - 1
        words = [float((digest >> (_CHUNK_BITS * i)) & mask) for i in range(_CHUNKS)]
        check = np.array(words + [w * w for w in words], dtype=np.float64)
        self.gs.average([check])
        mean, mean_sq = check[:_CHUNKS], check[_CHUNKS:]
        if not np.array_equal(mean * mean, mean_sq):
            raise MismatchError(
                "DiLoCo: the ranks' parameters differ at the start; initialize them "
                "identically (same seed, or load the same checkpoint) on every rank"
            )


def _real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _state_dtype(dtype: np.dtype[Any]) -> np.dtype[Any]:
    return np.dtype(np.float32) if dtype == np.float16 else dtype


def _checked_params(params: object) -> list[np.ndarray]:
    if isinstance(params, np.ndarray) or not isinstance(params, Sequence) or not params:
        raise InvalidGradsError("params must be a non-empty sequence of numpy arrays")
    for i, p in enumerate(params):
        if not isinstance(p, np.ndarray):  # a torch tensor, say: pass p.detach().numpy()
            raise InvalidGradsError(f"param {i} is a {type(p).__name__}, not a numpy array")
        if p.dtype not in _DTYPES:
            raise InvalidGradsError(f"param {i} has dtype {p.dtype}; use float16, 32 or 64")
        if not p.flags.c_contiguous or not p.flags.writeable:
            raise InvalidGradsError(f"param {i} must be C-contiguous and writeable")
    return list(params)


def _check_like(name: str, mine: list[np.ndarray], theirs: list[Any]) -> None:
    if len(theirs) != len(mine):
        raise ConfigError(f"state {name!r} has {len(theirs)} arrays, expected {len(mine)}")
    for i, (a, b) in enumerate(zip(mine, theirs, strict=True)):
        if not isinstance(b, np.ndarray) or b.shape != a.shape or b.dtype != a.dtype:
            got = (getattr(b, "shape", None), getattr(b, "dtype", type(b).__name__))
            raise ConfigError(f"state {name!r}[{i}] is {got}, expected ({a.shape}, {a.dtype})")
