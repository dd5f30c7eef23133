"""gradsync: data-parallel gradient averaging through files in a shared directory.

Every rank calls :func:`average_grads_file_sync` (or :meth:`GradSync.average`)
once per optimizer step and gets back the same element-wise mean, bit for bit.
"""

from __future__ import annotations

from ._api import GradSync
from ._config import FileGradSyncConfig
from ._diloco import DiLoCo
from ._errors import (
    ConfigError,
    CorruptFileError,
    GradSyncError,
    InvalidGradsError,
    MismatchError,
    NonFiniteGradError,
    PeerAbortedError,
    PeerLostError,
    PeerTimeoutError,
    RendezvousError,
    SyncDirError,
    WgpuBridgeError,
)
from ._function import average_grads_file_sync
from ._gpu.adapters import request_device_for_rank, select_adapter
from ._gpu.bridge import WgpuBridge
from ._stats import StepStats
from ._step.reduce import average_host_grads, shard_indices
from ._store.files import atomic_write_bytes, wait_for_path

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "CorruptFileError",
    "DiLoCo",
    "FileGradSyncConfig",
    "GradSync",
    "GradSyncError",
    "InvalidGradsError",
    "MismatchError",
    "NonFiniteGradError",
    "PeerAbortedError",
    "PeerLostError",
    "PeerTimeoutError",
    "RendezvousError",
    "StepStats",
    "SyncDirError",
    "WgpuBridge",
    "WgpuBridgeError",
    "__version__",
    "atomic_write_bytes",
    "average_grads_file_sync",
    "average_host_grads",
    "request_device_for_rank",
    "select_adapter",
    "shard_indices",
    "wait_for_path",
]
