"""Moving gradients between wgpu ``GPUBuffer``s and host numpy arrays.

wgpu is imported lazily: ``import gradsync`` never loads it.

Why not ``queue.read_buffer``: in wgpu-py it creates, maps and destroys a staging
buffer on every call (wgpu-py issue #727), about 9x slower for large gradients than
one persistent staging buffer. :class:`WgpuBridge` keeps one staging layout per set
of buffers, encodes all copies into one command buffer, submits once and maps once.

WebGPU moves buffer data in whole 4-byte words (``COPY_BUFFER_ALIGNMENT``): a copy,
a ``write_buffer`` and a map must all have sizes that are multiples of 4 and may not
run past ``buffer.size``. The last ``size % 4`` bytes of a buffer whose size is not a
multiple of 4 (a float16 buffer of 3 elements is 6 bytes) can therefore never be read
or written by a transfer, so such buffers are rejected: allocate them with the size
rounded up to a multiple of 4 bytes (the padding elements are then averaged too).
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from gradsync._errors import ConfigError, InvalidGradsError, WgpuBridgeError
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
from .layout import StagingLayout, write_staging
from .wait import (
    SPIN_S,
    adapter_type,
    import_wgpu,
    map_for_reading,
    release,
    wait_for,
    wgpu_errors,
)

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
        self._fence_src: Any = None
        self._fence_dst: Any = None
        self._closed = False
        # How long a wait for the GPU polls from this thread first (see wait_for).
        self._spin_s = 0.0 if adapter_type(device) == "CPU" else SPIN_S
        # How upload() copies ("mapped" or "write_buffer"; a step's upload chooses per
        # call, see DIRECT_MAX_BYTES). "mapped" (one persistent MAP_WRITE buffer, kept
        # mapped while idle, then one encoder of copies) measured 4x faster than
        # queue.write_buffer per param at 256 MiB on lavapipe, because write_buffer
        # allocates fresh staging memory on every call.
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

    def _resolve(
        self, buffers: Sequence[Any], dtype: npt.DTypeLike | Sequence[npt.DTypeLike]
    ) -> list[np.dtype[Any]]:
        """:func:`resolve_dtypes`, remembered for the last buffer set: a training loop
        passes the same buffers every step, and a buffer's size never changes. The
        list returned is shared between calls; callers must not modify it.

        Raises:
            InvalidGradsError: as :func:`resolve_dtypes`; for ``buffers`` that are not
                a list or tuple of GPUBuffers.
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

    def _get_layout(self, buffers: Sequence[Any], dtypes: Sequence[np.dtype[Any]]) -> StagingLayout:
        layout = self._layout
        # Per step, the same buffers and the list _resolve() returned: no key to build
        # (a few us a buffer with hundreds of them).
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
        dts = self._resolve(buffers, dtypes)
        if into is not None:
            check_into(buffers, dts, into)
        return self._download(buffers, dts, into)

    def _download(
        self,
        buffers: Sequence[wgpu.GPUBuffer],
        dtypes: list[np.dtype[Any]],
        into: Sequence[npt.NDArray[Any]] | None,
    ) -> list[npt.NDArray[Any]]:
        """:meth:`download` of arguments known to be right: ``dtypes`` from
        :meth:`_resolve`, ``into`` None or arrays made for this layout. The buffers are
        still checked: their mapping and liveness change between calls.

        Raises:
            InvalidGradsError, WgpuBridgeError: as :meth:`download`.
        """
        self._check_open()
        self._check_buffers(buffers, COPY_SRC, "COPY_SRC")
        layout = self._get_layout(buffers, dtypes)
        wgpu = import_wgpu()

        with wgpu_errors("downloading gradients"):
            for ch in layout.chunks:
                if ch.read is None:
                    ch.read = self._device.create_buffer(
                        label="gradsync-download",
                        size=ch.nbytes,
                        usage=wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST,
                    )
            enc = self._device.create_command_encoder(label="gradsync-download")
            for buf, (c, off, size) in zip(buffers, layout.slots, strict=True):
                if size:  # an empty buffer has nothing to copy (and cannot be probed)
                    enc.copy_buffer_to_buffer(buf, 0, layout.chunks[c].read, off, size)
            self._device.queue.submit([enc.finish()])
            for c, ch in enumerate(layout.chunks):
                map_for_reading(ch.read, self._device, self._spin_s)
                try:
                    mapped = np.frombuffer(ch.read.read_mapped(0, ch.nbytes, copy=False), np.uint8)
                    if into is None:
                        pairs = [(ch.host, mapped)]
                    else:
                        pairs = [
                            (dst.reshape(-1).view(np.uint8), mapped[off : off + size])
                            for dst, (cc, off, size) in zip(into, layout.slots, strict=True)
                            if cc == c
                        ]
                    self._workers.copy(pairs)
                    # No numpy view of mapped memory may outlive unmap().
                    del mapped, pairs
                finally:
                    ch.read.unmap()
        return list(layout.views) if into is None else list(into)

    def upload(self, buffers: Sequence[wgpu.GPUBuffer], arrays: Sequence[npt.NDArray[Any]]) -> None:
        """Overwrite each buffer with the bytes of ``arrays[i]``; wait until done.

        Each array must hold exactly ``buffer.size`` bytes of float16, float32 or
        float64; it is read, never modified. The copies have finished on return.

        Raises:
            InvalidGradsError: naming the param for a count or byte-size mismatch, an
                unsupported dtype, a missing ``COPY_DST`` usage, a destroyed, mapped or
                foreign buffer, or a size not a multiple of 4 bytes.
            WgpuBridgeError: wgpu failed while copying.
        """
        self._check_open()
        host = upload_sources(buffers, arrays)
        self._check_buffers(buffers, COPY_DST, "COPY_DST")
        with wgpu_errors("uploading gradients"):
            if self.upload_mode == "mapped":
                layout = self._get_layout(buffers, [a.dtype for a in host])
                writes = layout.writes([(i, 0, a) for i, a in enumerate(host)])
                self._upload_mapped(buffers, layout, writes)
            else:
                for buf, a in zip(buffers, host, strict=True):
                    if a.nbytes:
                        self._device.queue.write_buffer(buf, 0, a)
                self._fence()

    def _check_upload_target(self, buffers: Sequence[wgpu.GPUBuffer]) -> None:
        """Check, before a step starts, what :meth:`_upload_pieces` will need (the
        buffers' liveness is probed by the step's download).

        Raises:
            InvalidGradsError: as :meth:`upload`.
        """
        self._check_buffers(buffers, COPY_DST, "COPY_DST", probe=False)

    def _check_without_copying(self, buffers: Sequence[wgpu.GPUBuffer]) -> None:
        """Check ``buffers`` as a step's download and upload would (a job of one rank
        copies nothing, and must fail where a larger one would).

        Raises:
            InvalidGradsError: as :meth:`download` and :meth:`upload`.
        """
        self._check_buffers(buffers, COPY_SRC, "COPY_SRC")
        self._check_upload_target(buffers)

    def _upload_pieces(
        self,
        buffers: Sequence[wgpu.GPUBuffer],
        dtypes: Sequence[np.dtype[Any]],
        pieces: Sequence[tuple[int, int, npt.NDArray[Any]]],
    ) -> None:
        """Queue the copy of each piece ``(param, first element, elements)`` into its
        buffer; return without waiting for the GPU (work submitted later on this
        device's queue sees the new contents). The buffers were checked by this
        step's :meth:`download` and :meth:`_check_upload_target`.

        Raises:
            WgpuBridgeError: wgpu failed while copying.
        """
        self._check_open()
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
            self._upload_mapped(buffers, layout, layout.writes(pieces), wait=False)

    def _upload_mapped(
        self,
        buffers: Sequence[Any],
        layout: StagingLayout,
        writes: Sequence[tuple[int, int, npt.NDArray[Any]]],
        *,
        wait: bool = True,
    ) -> None:
        """Upload through ``layout``'s mapped staging buffers: each ``(chunk, byte
        offset, array)`` of ``writes`` is copied there, then every buffer from its slot.
        Without ``wait``, return once the copies are submitted; the staging buffers
        are mapped again in the background and waited for at their next use."""
        wgpu = import_wgpu()

        for ch in layout.chunks:
            if ch.write is None:
                ch.write = self._device.create_buffer(
                    label="gradsync-upload",
                    size=ch.nbytes,
                    usage=wgpu.BufferUsage.MAP_WRITE | wgpu.BufferUsage.COPY_SRC,
                    mapped_at_creation=True,
                )
            if ch.remap is not None:
                remap, ch.remap = ch.remap, None
                wait_for(remap, self._device, self._spin_s)
            if str(ch.write.map_state) != "mapped":
                ch.write.map_sync(wgpu.MapMode.WRITE)
        write_staging(layout, writes, self._workers)
        for ch in layout.chunks:
            ch.write.unmap()
        enc = self._device.create_command_encoder(label="gradsync-upload")
        for buf, (c, off, size) in zip(buffers, layout.slots, strict=True):
            if size:
                enc.copy_buffer_to_buffer(layout.chunks[c].write, off, buf, 0, size)
        self._device.queue.submit([enc.finish()])
        # Mapping again waits for the copies (no separate fence needed) and leaves the
        # buffer ready for the next upload. Asked for now and waited for at the next
        # upload, it costs the step no round trip to the GPU.
        for ch in layout.chunks:
            if wait:
                ch.write.map_sync(wgpu.MapMode.WRITE)
            else:
                ch.remap = ch.write.map_async(wgpu.MapMode.WRITE)

    def _fence(self) -> None:
        # queue.on_submitted_work_done_sync() raises a cffi TypeError in wgpu-py 0.32;
        # mapping a buffer written by a later submit waits for all earlier work.
        wgpu = import_wgpu()

        if self._fence_src is None:
            self._fence_src = self._device.create_buffer(
                label="gradsync-fence-src", size=8, usage=wgpu.BufferUsage.COPY_SRC
            )
            self._fence_dst = self._device.create_buffer(
                label="gradsync-fence",
                size=8,
                usage=wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST,
            )
        enc = self._device.create_command_encoder(label="gradsync-fence")
        enc.copy_buffer_to_buffer(self._fence_src, 0, self._fence_dst, 0, 8)
        self._device.queue.submit([enc.finish()])
        map_for_reading(self._fence_dst, self._device, self._spin_s)
        self._fence_dst.unmap()

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
        self._workers.close()
        for buf in (self._fence_src, self._fence_dst):
            if buf is not None:
                release(buf)
        self._fence_src = self._fence_dst = None

    def __enter__(self) -> WgpuBridge:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
