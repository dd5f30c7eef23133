"""GPU buffers as a step's source (their host view) and sink (the mean written back)."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from gradsync._errors import GradSyncError, InvalidGradsError
from gradsync._step.buffers import SharedBuffers
from gradsync._step.grads import HostView, host_view
from gradsync._step.header import Layout

from .wait import import_wgpu

if TYPE_CHECKING:
    from gradsync._step.engine import StepEngine
    from gradsync._step.gather import Sink

    from .bridge import WgpuBridge

__all__ = ["DeviceGrads"]

_log = logging.getLogger("gradsync")


class DeviceGrads:
    """A session's GPU gradients: the bridge to their device, and the shared host arrays
    (an input file of the engine's) they are downloaded into."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.bridge: WgpuBridge | None = None
        self._layout: Layout | None = None
        self._engine: StepEngine | None = None  # the one whose layout that is
        self._shared: SharedBuffers | None = None  # in use now
        self._mine: SharedBuffers | None = None  # the last set made here, not the caller's

    def dtypes(self, buffers: Sequence[Any], device: Any, dtype: Any) -> list[np.dtype[Any]]:
        """Each buffer's dtype, with the bridge for ``device`` (made if new).

        Raises:
            InvalidGradsError: no buffers, a ``device`` that is not a GPUDevice, or as
                :meth:`WgpuBridge.resolve`.
        """
        from .bridge import WgpuBridge  # noqa: PLC0415

        # Checked first: one rank has no step, and more ranks would otherwise copy
        # nothing from the GPU to find out.
        if isinstance(buffers, list | tuple) and not buffers:
            raise InvalidGradsError("grads is empty: pass at least one gradient buffer")
        if self.bridge is None or self.bridge.device is not device:
            if not isinstance(device, import_wgpu().GPUDevice):
                raise InvalidGradsError(
                    "device must be a wgpu GPUDevice (or None for numpy arrays), got "
                    f"{type(device).__name__}"
                )
            if self.bridge is not None:
                self.bridge.close()
            self.bridge = WgpuBridge(device)
        return self.bridge.resolve(buffers, np.float32 if dtype is None else dtype)

    def alone(
        self, buffers: Sequence[Any], dtypes: list[np.dtype[Any]], *, check_finite: bool
    ) -> list[np.ndarray] | None:
        """Check the buffers as a step would, copying nothing (one rank: the mean is the
        input), except to look for NaN/Inf when ``check_finite``: their host arrays."""
        assert self.bridge is not None
        if not check_finite:
            self.bridge.check(buffers)
            return None
        arrays = self.bridge.download(buffers, dtypes)
        self.bridge.check(buffers, download=False)
        return arrays

    def host_view(
        self, buffers: Sequence[Any], dtypes: list[np.dtype[Any]], engine: StepEngine | None
    ) -> tuple[HostView, float]:
        """The buffers downloaded into host arrays, checked for the upload that follows
        the step; and the seconds the download took."""
        bridge = self.bridge
        assert bridge is not None
        bridge.check(buffers, download=False)  # before the step, which the peers join
        if engine is not None:
            # Known once the peers are met (threads depend on the ranks on this host).
            bridge.threads = engine.workers.threads
        shared = self._shared_arrays(bridge, buffers, dtypes, engine)
        t0 = time.perf_counter()
        host = bridge.download(buffers, dtypes, shared)
        download_s = time.perf_counter() - t0
        return host_view(host), download_s

    def sink(self, buffers: Sequence[Any], dtypes: list[np.dtype[Any]]) -> Sink:
        """Where the mean goes: straight from the shared files to the GPU (queued, not
        waited for), never copied into the host arrays first."""
        bridge = self.bridge
        assert bridge is not None
        return lambda pieces: bridge.upload(buffers, pieces=pieces, dtypes=dtypes)

    def _shared_arrays(
        self,
        bridge: WgpuBridge,
        buffers: Sequence[Any],
        dtypes: list[np.dtype[Any]],
        engine: StepEngine | None,
    ) -> tuple[np.ndarray, ...] | None:
        """Shared host arrays for these GPU buffers, or None: on the first step (the
        ranks have not met), where sharing saves nothing, or where the caller's own
        ``buffers_like`` arrays hold the engine's one shared set (never taken over)."""
        if engine is None:
            return None
        layout = bridge.host_layout(buffers, dtypes)
        if layout != self._layout or engine is not self._engine:
            current = engine.shared
            self._layout, self._engine, self._shared = layout, engine, None
            if current is not None and current is self._mine and current.layout == layout:
                self._shared = current  # back to the buffers it was made for: still the engine's
            elif current is None or current is self._mine:
                try:
                    # Plain arrays (dropped) where nothing is saved; unwatched: a step
                    # delivers the mean to the GPU, never into them.
                    engine.buffers_like(layout, watch=False)
                except GradSyncError as exc:
                    # Outside a step no peer would hear of it: copy as before, and let the
                    # step itself fail (telling the peers) if the sync dir is unusable.
                    _log.warning("rank %d: GPU gradients will be copied: %s", self.rank, exc)
                if engine.shared is not current:
                    self._shared = self._mine = engine.shared
        shared = self._shared
        if shared is None or engine.shared is not shared:
            return None
        return shared.arrays

    def close(self) -> None:
        if self.bridge is not None:
            self.bridge.close()
