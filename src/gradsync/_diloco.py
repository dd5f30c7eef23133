"""Local SGD with an outer Nesterov step every H inner steps: :class:`DiLoCo`."""

from __future__ import annotations

import hashlib
import math
import operator
from collections.abc import Sequence
from typing import Any

import numpy as np

from ._api import GradSync
from ._errors import ConfigError, InvalidGradsError, MismatchError

__all__ = ["DiLoCo"]

_START = "parameters differ at the start (values, shapes or dtypes)"
_SETTINGS = "settings differ (every, outer_lr or outer_momentum)"
_SAME_START = "initialize them identically (same seed, or load the same checkpoint) on every rank"

_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))
_DIGEST_BYTES = 16  # of the start check's hash of the params


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

    The parameters and settings must start identical on every rank: the constructor
    checks it (with ``check_start``) by broadcasting rank 0's digest of them and
    averaging each rank's verdict, uncompressed: collective calls that every rank makes.
    :meth:`load_state_dict` checks the restored state the same way.
    If a sync fails, the parameters are as before it and ``gs`` is unusable.
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
            GradSyncError: a call of ``check_start`` (a broadcast, an average) failed.
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
        self._delta: list[np.ndarray] | None = None  # shared buffers, made at the first sync
        if check_start:
            self._check_same(self.params, _START, _SAME_START)

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
            # Unwatched: a zero delta is written here, not left stale (frozen params, lr 0).
            self._delta = self.gs._buffers_like(self.params, watch=False)
        for last, p, d in zip(self._last, self.params, self._delta, strict=True):
            np.subtract(last, p, out=d)
        self.gs.average(self._delta)
        mu, lr = self.outer_momentum, self.outer_lr
        for last, p, d, v in zip(self._last, self.params, self._delta, self._momentum, strict=True):
            np.multiply(v, mu, out=v)
            np.add(v, d, out=v)
            update = np.multiply(v, mu, out=np.empty_like(v))  # an array for 0-d params too
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

    def load_state_dict(self, state: dict[str, Any], *, check: bool = True) -> None:
        """Restore what :meth:`state_dict` gave (the parameters themselves are the caller's).

        With ``check`` a collective call, as the constructor's start check: every rank
        must restore the same state. ``check=False`` where only some ranks load one (a
        joiner taking the state that the members broadcast).

        Raises:
            ConfigError: a key is missing, or the state was saved with another ``every``
                or with other shapes or dtypes.
            MismatchError: (``check``) the ranks restored other states or settings.
            GradSyncError: a call of ``check`` failed.
        """
        try:
            # operator.index: a count, never a float truncated (3.7 is not 3 calls).
            calls, syncs, every = (operator.index(state[k]) for k in ("calls", "syncs", "every"))
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
        if check:
            restored = [*last, *momentum, np.array([calls, syncs], np.int64)]
            what = "restored states differ (last synced params, momentum, call or sync count)"
            self._check_same(restored, what, "restore the same checkpoint on every rank")
        for dst, src in zip([*self._last, *self._momentum], [*last, *momentum], strict=True):
            np.copyto(dst, src)
        self.calls, self.syncs = calls, syncs

    def _check_same(self, arrays: list[np.ndarray], what: str, advice: str) -> None:
        """Raise MismatchError on every rank if a rank's settings or ``arrays`` differ
        from rank 0's: rank 0's digests by broadcast (bit-exact), verdicts by average."""
        settings = repr((self.every, self.outer_lr, self.outer_momentum)).encode()
        mine = np.stack([_digest([np.frombuffer(settings, np.uint8)]), _digest(arrays)])
        first = mine.copy()
        self.gs.broadcast([first])  # from rank 0
        # Per rank: whether its settings, its arrays differ; averaged exactly (uncompressed).
        differs = np.zeros((2, self.gs.world_size), dtype=np.float64)
        differs[:, self.gs.rank] = (mine != first).any(axis=1)
        self.gs._average_exact_async([differs]).wait()
        found = differs[1]
        if differs[0].any():
            what, advice, found = _SETTINGS, "give every rank the same values", differs[0]
        ranks = [int(r) for r in np.flatnonzero(found)]
        if ranks:
            raise MismatchError(
                f"DiLoCo: the ranks' {what}: rank {', '.join(map(str, ranks))} "
                f"{'differs' if len(ranks) == 1 else 'differ'} from rank 0; {advice}",
                ranks=ranks,
            )


def _digest(arrays: list[np.ndarray]) -> np.ndarray:
    h = hashlib.blake2b(digest_size=_DIGEST_BYTES)
    for a in arrays:
        h.update(str((a.dtype.str, a.shape)).encode())
        h.update(a.tobytes())
    return np.frombuffer(h.digest(), dtype=np.uint8)


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
