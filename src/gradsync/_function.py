"""The function form: :func:`average_grads_file_sync`, one :class:`GradSync` per config."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy.typing as npt

from ._api import GradSync
from ._calls import check_config
from ._config import FileGradSyncConfig
from ._session import forget, registered
from ._stats import StepStats

__all__ = ["average_grads_file_sync"]


def average_grads_file_sync(
    grads: Sequence[Any],
    device: Any,
    cfg: FileGradSyncConfig,
    step: int,
    *,
    dtype: npt.DTypeLike | Sequence[npt.DTypeLike] | None = None,
) -> StepStats:
    """Average ``grads`` in place over all ranks of ``cfg``'s job; call once per step.

    The first call for a given ``cfg`` meets the other ranks; later calls reuse
    that session, which is closed at interpreter exit. After a call that failed, the
    next call for ``cfg`` meets the other ranks anew (each of them must call again).
    ``device`` is None for numpy arrays, or the wgpu ``GPUDevice`` that owns the
    ``GPUBuffer``s in ``grads``. See :meth:`GradSync.average` for arguments, return
    value and errors.
    """
    check_config(cfg)  # before the registry: an unhashable cfg would raise TypeError
    sync = registered(cfg, GradSync)
    try:
        return sync.average(grads, step=step, device=device, dtype=dtype)
    except BaseException:
        if sync._failure is not None:
            forget(sync)  # ended: the next call starts a new session
        raise
