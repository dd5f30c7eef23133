"""What GradSync checks of its calls' arguments, and a step of a job of one rank."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ._config import FileGradSyncConfig
from ._errors import ConfigError
from ._stats import StepStats
from ._step.grads import nonfinite_params
from ._step.peers import nonfinite_error

__all__ = ["alone", "check_config", "checked_step"]


def checked_step(step: object) -> int:
    """``step`` as an int, or ConfigError: headers keep it as a signed 64-bit integer."""
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
        raise ConfigError(f"step must be an int, got {step!r}")
    value = int(step)
    if not -(2**63) <= value < 2**63:
        raise ConfigError(f"step must fit in a signed 64-bit integer, got {value}")
    return value


def check_config(cfg: object) -> None:
    """Raise ConfigError unless ``cfg`` is a FileGradSyncConfig."""
    if not isinstance(cfg, FileGradSyncConfig):
        raise ConfigError(f"cfg must be a FileGradSyncConfig, got {type(cfg).__name__}")


def alone(
    cfg: FileGradSyncConfig, arrays: Sequence[np.ndarray] | None, step: int, nbytes: int
) -> StepStats:
    """A step of a job of one rank: nothing to average, but check_finite still stops a
    step with NaN/Inf in ``arrays``, as it would with peers."""
    if cfg.check_finite and arrays is not None:
        bad = nonfinite_params(arrays)
        if bad:
            raise nonfinite_error([(cfg.rank, i) for i in bad], step, None)
    return StepStats(step=step, world_size=1, bytes_per_rank=nbytes)
