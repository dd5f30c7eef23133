"""Moving gradients between wgpu ``GPUBuffer``s and host numpy arrays.

wgpu is imported lazily: ``import gradsync`` never loads it. ``queue.read_buffer``
creates, maps and destroys a staging buffer on every call (wgpu-py issue #727), so
:class:`WgpuBridge` keeps one staging layout per set of buffers, encodes all copies
into one command buffer, submits once and maps once.

WebGPU moves buffer data in whole 4-byte words (``COPY_BUFFER_ALIGNMENT``): the last
``size % 4`` bytes of a buffer could never be read or written, so buffers whose size
is not a multiple of 4 are rejected (allocate them rounded up; the padding is averaged
too).
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from gradsync._errors import ConfigError, InvalidGradsError, WgpuBridgeError
from gradsync._step.header import Layout
from gradsync._step.overlap import overlap_message, repeated
from gradsync._step.parallel import Workers
from gradsync._step.reduce import SUPPORTED_DTYPES

from .checks import (
    COPY_BUFFER_ALIGNMENT,
    COPY_DST,
    COPY_SRC,
    buffer_problem,
    check_alive,
    check_into,
    check_types,
    describe,
    dtype_spec,
    resolve_dtypes,
    upload_sources,
)
from .copies import Fence, download_staged, upload_staged
from .layout import StagingLayout
from .wait import SPIN_S, adapter_type, import_wgpu, release, wgpu_errors

if TYPE_CHECKING:
    import wgpu

__all__ = [
    "SUPPORTED_DTYPES",
    "WgpuBridge",
    "WgpuBridgeError",
    "import_wgpu",
    "resolve_dtypes",
    "wgpu_errors",
]

_log = logging.getLogger("gradsync")

# A step's mean goes to the GPU by one queue.write_buffer per piece (a rank's shard of
# a param, straight from the mapped files: no host copy) when it is at most this many
# pieces and bytes. Bigger or more fragmented means are copied into the mapped upload
# buffer and go from there with one submit: write_buffer allocates fresh staging
# memory per call, and a hundred small calls cost more than one gather.
DIRECT_MAX_PIECES = 16
DIRECT_MAX_BYTES = 32 << 20


# -- the bridge -------------------------------------------------------------------


class WgpuBridge:
    """Copies gradient buffers of one ``GPUDevice`` to host arrays and back.

    ``threads`` (>= 1, settable between calls) share the host-side copy of large
    downloads out of the mapped staging buffer. Not thread-safe; one bridge per
    device and training loop.
    """

    def __init__(self, device: wgpu.GPUDevice, *, threads: int = 1) -> None:
        if not isinstance(device, import_wgpu().GPUDevice):
            raise InvalidGradsError(f"device must be a wgpu GPUDevice, got {type(device).__name__}")
        self._device = device
        self._workers = Workers(1)
        self.threads = threads
        self._layout: StagingLayout | None = None
        # The last buffer set, the dtype argument it came with, and its dtypes.
        self._resolved: tuple[tuple[Any, ...], object, list[np.dtype[Any]]] | None = None
        self._max_buffer_size = int(device.limits.get("max-buffer-size", 1 << 28))
        # The last arrays given to download(into=...) as a tuple, with their dtypes.
        self._into: tuple[object, object] = (None, None)
        self._fence = Fence(device)
        self._closed = False
        # How long a wait for the GPU polls from this thread first (see wait_for).
        self._spin_s = 0.0 if adapter_type(device) == "CPU" else SPIN_S
        # How upload() of arrays copies: "mapped" (one persistent MAP_WRITE buffer, kept
        # mapped while idle, then one encoder of copies) or "write_buffer" per param,
        # which allocates fresh staging memory on every call. Pieces choose per call.
        self.upload_mode: str = "mapped"

    @property
    def threads(self) -> int:
        """Threads copying large downloads to host memory."""
        return self._workers.threads

    @threads.setter
    def threads(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"threads must be an int >= 1, got {value!r}")
        if value != self._workers.threads:
            self._workers.close()
            self._workers = Workers(value)

    @property
    def device(self) -> wgpu.GPUDevice:
        """The device whose buffers this bridge copies."""
        return self._device

    # -- validation ----------------------------------------------------------------

    def _check_buffers(
        self, buffers: Sequence[Any], usage: int, flag: str, *, probe: bool = True
    ) -> None:
        for i, buf in enumerate(buffers):
            problem = buffer_problem(self._device, self._max_buffer_size, buf, usage, flag)
            if problem is not None:
                # Named only here: a description per buffer per step is a visible cost
                # with hundreds of buffers.
                raise InvalidGradsError(f"{describe(i, buf)}: {problem}")
            if probe:
                check_alive(self._device, i, buf)

    # -- layout --------------------------------------------------------------------

    def _get_layout(self, buffers: Sequence[Any], dtypes: Sequence[np.dtype[Any]]) -> StagingLayout:
        layout = self._layout
        # Per step, the same buffers and the list resolve() returned: no key to build.
        if layout is not None and dtypes is layout.dtypes and layout.buffers == tuple(buffers):
            return layout
        # id(): the layout keeps its buffers alive (layout.buffers), so no id in its key
        # can belong to another buffer meanwhile. (GPUBuffer.uid is wgpu-py >= 0.30.)
        key = tuple((id(b), int(b.size), dt.str) for b, dt in zip(buffers, dtypes, strict=True))
        if layout is not None and layout.key == key:
            layout.buffers, layout.dtypes = tuple(buffers), dtypes
            return layout
        self._destroy_staging()
        self._layout = StagingLayout.build(key, buffers, dtypes, self._max_buffer_size)
        return self._layout

    def _destroy_staging(self) -> None:
        """Destroy the staging buffers. Never raises and never waits: a pending mapping
        is cancelled by the destruction (a lost device would never resolve it), and on
        a lost device there is nothing left to release."""
        if self._layout is None:
            return
        for ch in self._layout.chunks:
            ch.remap = None
            for buf in (ch.read, ch.write):
                if buf is not None:
                    release(buf)
        self._layout = None

    # -- public API ----------------------------------------------------------------

    def resolve(
        self, buffers: Sequence[Any], dtype: npt.DTypeLike | Sequence[npt.DTypeLike] = np.float32
    ) -> list[np.dtype[Any]]:
        """The dtype of each buffer: ``dtype`` is one for all (None is float32) or one per
        buffer. Remembered for the last buffer set (a training loop passes the same
        buffers every step); the list returned is shared between calls: do not modify
        it, pass it back to :meth:`download` and :meth:`upload`.

        Raises:
            InvalidGradsError: as :func:`resolve_dtypes`; for ``buffers`` that are not
                a list or tuple of GPUBuffers, or a buffer passed twice.
        """
        if not isinstance(buffers, list | tuple):
            raise InvalidGradsError(
                f"grads must be a list or tuple of wgpu GPUBuffers, got {type(buffers).__name__}"
            )
        key = tuple(buffers)
        spec = dtype_spec(dtype)
        memo = self._resolved
        # Buffers by identity: == would compare a numpy array (or a tensor) passed by
        # mistake element-wise, and its truth value raises ValueError.
        if memo is not None and len(key) == len(memo[0]) and all(map(operator.is_, key, memo[0])):
            if dtype is memo[2]:
                return memo[2]
            try:
                # A per-buffer spec is never compared with one dtype: numpy takes some
                # tuples for a dtype (np.dtype("f4") == ("f4", "i4") is True).
                if isinstance(spec, tuple) == isinstance(memo[1], tuple) and bool(spec == memo[1]):
                    return memo[2]
            except (TypeError, ValueError):
                pass  # not comparable: resolved again below, and refused there if bad
        check_types(buffers)
        pair = repeated(buffers)
        if pair is not None:
            raise InvalidGradsError(overlap_message(*pair, "the same GPUBuffer"))
        dtypes = resolve_dtypes(buffers, dtype)
        self._resolved = (key, spec, dtypes)
        return dtypes

    def host_layout(self, buffers: Sequence[Any], dtypes: list[np.dtype[Any]]) -> Layout:
        """``(dtype str, (elements,))`` per buffer, as a step's layout is written;
        ``dtypes`` from :meth:`resolve`."""
        return self._get_layout(buffers, dtypes).host_layout

    def check(self, buffers: Sequence[wgpu.GPUBuffer], *, download: bool = True) -> None:
        """Check ``buffers`` as :meth:`upload` (and, with ``download``, :meth:`download`)
        would, copying nothing: a step checks its upload targets before it starts.

        Raises:
            InvalidGradsError: as :meth:`download` and :meth:`upload`.
        """
        self._check_open()
        if download:
            self._check_buffers(buffers, COPY_SRC, "COPY_SRC")
        self._check_buffers(buffers, COPY_DST, "COPY_DST", probe=False)

    def download(
        self,
        buffers: Sequence[wgpu.GPUBuffer],
        dtypes: npt.DTypeLike | Sequence[npt.DTypeLike] = np.float32,
        into: Sequence[npt.NDArray[Any]] | None = None,
    ) -> list[npt.NDArray[Any]]:
        """Copy each buffer's bytes to a host array of ``dtypes`` (one dtype for all
        buffers, float32 by default, or one per buffer; None is float32).

        Returns 1-D, C-contiguous, writeable arrays of ``buffer.size // itemsize``
        elements: ``into`` if given (arrays of exactly those dtypes and sizes),
        otherwise arrays that belong to the bridge, overwritten by the next
        ``download`` of the same buffer set and invalid after it changes or after
        :meth:`close`. They never alias mapped GPU memory.

        Raises:
            InvalidGradsError: naming the param for a missing ``COPY_SRC`` usage, a
                destroyed, mapped or foreign buffer, a size over the device limit or
                not a multiple of 4 bytes or of the element size, an unsupported dtype,
                an array of ``into`` that does not fit its buffer, a dtype count that
                differs from the buffer count.
            WgpuBridgeError: wgpu failed while copying.
        """
        self._check_open()
        if isinstance(dtypes, Iterable) and not isinstance(dtypes, str | bytes | Sequence):
            dtypes = list(dtypes)  # dict values, a numpy array of dtypes: one per buffer
        dts = self.resolve(buffers, dtypes)
        # A tuple of arrays checked for these dtypes (a step's shared arrays) fits again.
        if into is not None and not (into is self._into[0] and dts is self._into[1]):
            check_into(buffers, dts, into)
            self._into = (into, dts) if isinstance(into, tuple) else (None, None)
        # The buffers are checked every call: their mapping and liveness change.
        self._check_buffers(buffers, COPY_SRC, "COPY_SRC")
        layout = self._get_layout(buffers, dts)
        with wgpu_errors("downloading gradients"):
            download_staged(self._device, buffers, layout, into, self._workers, self._spin_s)
        return list(layout.views) if into is None else list(into)

    def upload(
        self,
        buffers: Sequence[wgpu.GPUBuffer],
        arrays: Sequence[npt.NDArray[Any]] | None = None,
        *,
        pieces: Sequence[tuple[int, int, npt.NDArray[Any]]] | None = None,
        dtypes: npt.DTypeLike | Sequence[npt.DTypeLike] = np.float32,
    ) -> None:
        """Overwrite each buffer with the bytes of ``arrays[i]``; wait until done.

        Each array must hold exactly ``buffer.size`` bytes of float16, float32 or
        float64; it is read, never modified. The copies have finished on return.

        With ``pieces`` ``(param, first element, elements)`` instead, of buffers of
        ``dtypes`` (as :meth:`download`'s) checked by :meth:`check` or a download: each
        piece is copied into its buffer, queued without waiting (work submitted later
        on this device's queue sees the new contents).

        Raises:
            InvalidGradsError: naming the param for a count or byte-size mismatch, an
                unsupported dtype, a missing ``COPY_DST`` usage, a destroyed, mapped or
                foreign buffer, or a size not a multiple of 4 bytes.
            WgpuBridgeError: wgpu failed while copying.
        """
        self._check_open()
        if pieces is not None:
            if arrays is not None:
                raise InvalidGradsError("upload takes arrays or pieces, not both")
            self._queue_pieces(buffers, self.resolve(buffers, dtypes), pieces)
            return
        if arrays is None:
            raise InvalidGradsError("upload needs arrays (or pieces)")
        host = upload_sources(buffers, arrays)
        self._check_buffers(buffers, COPY_DST, "COPY_DST")
        with wgpu_errors("uploading gradients"):
            if self.upload_mode == "mapped":
                layout = self._get_layout(buffers, [a.dtype for a in host])
                writes = layout.writes([(i, 0, a) for i, a in enumerate(host)])
                upload_staged(self._device, buffers, layout, writes, self._workers, self._spin_s)
            else:
                for buf, a in zip(buffers, host, strict=True):
                    if a.nbytes:
                        self._device.queue.write_buffer(buf, 0, a)
                self._fence.wait(self._spin_s)

    def _queue_pieces(
        self,
        buffers: Sequence[wgpu.GPUBuffer],
        dtypes: list[np.dtype[Any]],
        pieces: Sequence[tuple[int, int, npt.NDArray[Any]]],
    ) -> None:
        """:meth:`upload` of pieces: by ``write_buffer`` when few and small, otherwise
        gathered into the mapped staging buffers."""
        layout = self._get_layout(buffers, dtypes)
        with wgpu_errors("uploading gradients"):
            nbytes = sum(src.nbytes for _, _, src in pieces)
            offsets = [start * src.itemsize for _, start, src in pieces]
            if (
                len(pieces) <= DIRECT_MAX_PIECES
                and nbytes <= DIRECT_MAX_BYTES
                and not any(o % COPY_BUFFER_ALIGNMENT for o in offsets)
                and not any(src.nbytes % COPY_BUFFER_ALIGNMENT for _, _, src in pieces)
            ):
                for (param, _, src), offset in zip(pieces, offsets, strict=True):
                    if src.nbytes:
                        self._device.queue.write_buffer(buffers[param], offset, src)
                return
            writes = layout.writes(pieces)
            upload_staged(
                self._device, buffers, layout, writes, self._workers, self._spin_s, wait=False
            )

    def _check_open(self) -> None:
        if self._closed:
            raise WgpuBridgeError("WgpuBridge is closed")

    def close(self) -> None:
        """Destroy the staging buffers; the bridge is unusable afterwards. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._destroy_staging()
        self._resolved = None
        self._into = (None, None)
        self._workers.close()
        self._fence.close()

    def __enter__(self) -> WgpuBridge:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
