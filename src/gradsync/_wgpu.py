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

import contextlib
import functools
import importlib
import logging
import operator
import time
from collections.abc import Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from ._errors import ConfigError, GradSyncError, InvalidGradsError, WgpuBridgeError
from ._overlap import overlap_message, repeated
from ._parallel import Workers

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

COPY_BUFFER_ALIGNMENT = 4
# read_mapped/write_mapped offsets must be multiples of 8 in wgpu-py, and 8 also keeps
# every float64 host view aligned.
_SLOT_ALIGNMENT = 8
# Longest a wait for the GPU polls from the waiting thread (see _wait): round trips of
# downloads up to ~32 MiB on the H200 (16 MiB: 2.3-2.9 ms); longer ones then block.
SPIN_S = 0.005

SUPPORTED_DTYPES: tuple[np.dtype[Any], ...] = (
    np.dtype(np.float16),
    np.dtype(np.float32),
    np.dtype(np.float64),
)
# Common spellings of the supported dtypes, checked without building an error context.
_NATIVE: dict[object, np.dtype[Any]] = {
    like: dt for dt in SUPPORTED_DTYPES for like in (dt, dt.type, dt.name, dt.str, dt.char)
}

# wgpu BufferUsage bits (WebGPU spec values), so validation needs no wgpu import.
_MAP_READ = 0x0001
_MAP_WRITE = 0x0002
_COPY_SRC = 0x0004
_COPY_DST = 0x0008

# A step's mean goes to the GPU by one queue.write_buffer per piece (a rank's shard of
# a param, straight from the mapped files: no host copy) when it is at most this many
# pieces and bytes. Bigger or more fragmented means are copied into the mapped upload
# buffer and go from there with one submit: write_buffer allocates fresh staging
# memory per call, and a hundred small calls cost more than one gather. On the H200
# (W=2, step returned / step + waiting for the GPU): direct 1.08 / 1.72 ms at 1 MiB,
# 5.6 / 6.3 at 16 MiB, 27 / 90 at 64 MiB; gathered 1.6 / 2.2, 7.4 / 8.1, 22 / 80.
DIRECT_MAX_PIECES = 16
DIRECT_MAX_BYTES = 32 << 20


def _writable_mapping(buf: Any, nbytes: int) -> npt.NDArray[np.uint8] | None:
    """A writable uint8 view of the first ``nbytes`` of mapped ``buf``, or None.

    wgpu-py's public ``write_mapped`` copies from a host array on one thread: staging
    the mean there first costs a second pass over it (on the H200 at 256 MiB, W=2, the
    upload took 43 ms that way, 17 ms straight into the mapping). Its
    ``_experimental_get_mapped_range`` (wgpu-py 0.19 to 0.32 at least) is the only
    writable view of a mapping; without it (a later wgpu-py) this returns None.
    """
    get = getattr(buf, "_experimental_get_mapped_range", None)
    if get is None:
        return None
    view: npt.NDArray[np.uint8] = np.frombuffer(get(0, nbytes), np.uint8)
    return view if view.flags.writeable else None


@functools.cache
def import_wgpu() -> Any:
    # Deferred so that ``import gradsync`` works (and stays fast) without wgpu; cached
    # because the liveness probe asks once per buffer per step.
    return importlib.import_module("wgpu")


def _map_for_reading(buffer: Any, device: Any, spin_s: float) -> None:
    """Map ``buffer`` for reading; return once it is mapped (see :func:`_wait`).

    wgpu-py's ``map_sync`` for reading first submits an empty command buffer: a guard
    for a buffer written through its own mapping and mapped again with no submit in
    between, which reads zeros (wgpu-native#305, wgpu#5173). The bridge's read buffers
    are only ever written by copies it has submitted before mapping, so it skips the
    guard ("READ_NOSYNC"; plain ``map_sync`` where wgpu-py refuses that mode).
    lavapipe, 1 MiB download: 242 -> 192 us; H200: within its noise (0.05 ms at 4
    ranks). (A *blocking* poll from this thread, beside wgpu-py's poll thread, stalled
    H200 steps ~10 ms, one in two: benchmarks/h200/2026-12-03-h; :func:`_wait` polls
    without blocking.)
    """
    global _nosync_reads
    if _nosync_reads:
        try:
            promise = buffer.map_async("READ_NOSYNC")
        except (KeyError, ValueError, TypeError):  # an unknown mode: checked before mapping
            _nosync_reads = False
        else:
            _wait(promise, device, spin_s)
            return
    buffer.map_sync(import_wgpu().MapMode.READ)


def _wait(promise: Any, device: Any, spin_s: float) -> None:
    """Wait for a wgpu-py promise, first polling ``device`` from this thread without
    blocking for up to ``spin_s`` seconds.

    wgpu-py resolves promises from a per-device thread that blocks in the driver until
    the GPU finishes, then wakes the waiting thread: on the H200 (Vulkan) a 1 MiB
    download's round trip took 321 us that way against 248 us polled from here (one
    process; 2 processes sharing the GPU 556-567 against 442-463, 4 processes 673-746
    against 572-615: benchmarks/h200/2026-12-03-l). Polling burns this core meanwhile,
    so the spin is bounded, and off (``spin_s`` 0) on CPU adapters, whose "GPU" work
    runs on the cores it would take (lavapipe, 2 processes on 2 cores: p90 1.6 ms).
    ``device._poll`` and ``promise._state`` are wgpu-py's internals: without them
    this is a plain wait. ``_poll()`` does not block: wgpu-py 0.27-0.28 take no
    argument, 0.29 on a ``block`` that defaults to False.
    """
    poll = getattr(device, "_poll", None)
    if spin_s > 0 and poll is not None and getattr(promise, "_state", None) == "pending":
        deadline = time.perf_counter() + spin_s
        while promise._state == "pending" and time.perf_counter() < deadline:
            poll()
    promise.sync_wait()


# Whether this wgpu-py takes map_async("READ_NOSYNC"); cleared at the first refusal.
_nosync_reads = True


def _adapter_type(device: Any) -> str | None:
    """``device``'s adapter type ("DiscreteGPU", "CPU"...), None where unknown."""
    try:
        return str(device.adapter.info["adapter_type"])
    except (AttributeError, KeyError, TypeError):
        return None


def _round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def _check_types(buffers: Sequence[Any]) -> None:
    """Raise InvalidGradsError naming the first of ``buffers`` that is no GPUBuffer."""
    gpu_buffer = import_wgpu().GPUBuffer
    for i, buf in enumerate(buffers):
        if not isinstance(buf, gpu_buffer):
            raise InvalidGradsError(
                f"param {i} is a {type(buf).__name__}, not a wgpu GPUBuffer (numpy "
                "arrays are averaged with device=None)"
            )


def _describe(index: int, buffer: Any) -> str:
    label = getattr(buffer, "label", "") or ""
    return f"param {index} (label {label!r})" if label else f"param {index}"


def _check_dtype(dtype: npt.DTypeLike, where: str) -> np.dtype[Any]:
    try:
        dt = np.dtype(dtype)
    except TypeError as exc:
        raise InvalidGradsError(
            f"{where}: {dtype!r} is not a numpy dtype; supported: float16, float32, float64"
        ) from exc
    # isnative first: newbyteorder raises TypeError for new-style dtypes (StringDType).
    if not dt.isnative or dt not in SUPPORTED_DTYPES:
        raise InvalidGradsError(
            f"{where}: unsupported dtype {dt}; supported: float16, float32, float64 "
            "(native byte order)"
        )
    return dt


def _dtype_spec(dtype: object) -> object:
    """``dtype`` as :meth:`WgpuBridge._resolve` compares it with the last call's: a list
    by value (the caller may have changed it since), and None as float32, its meaning
    here. numpy reads None as float64, so np.dtype("f8") == None: compared as given, a
    None after a float64 (or the reverse) would reuse the other's dtypes."""
    if isinstance(dtype, list | tuple):
        return tuple(np.float32 if d is None else d for d in dtype)
    return np.float32 if dtype is None else dtype


def resolve_dtypes(
    buffers: Sequence[wgpu.GPUBuffer],
    dtype: npt.DTypeLike | Sequence[npt.DTypeLike] = np.float32,
) -> list[np.dtype[Any]]:
    """Return one numpy dtype per buffer.

    Args:
        buffers: The gradient buffers.
        dtype: One dtype for all buffers (float32 by default; float16 and float64 are
            also supported) or a sequence with one dtype per buffer; None is float32.

    Raises:
        InvalidGradsError: naming the param index (and label) for an unsupported
            dtype, a dtype count that differs from the buffer count, or a buffer size
            in bytes that is not a whole number of elements.
    """
    if isinstance(dtype, Sequence) and not isinstance(dtype, (str, bytes)):
        if len(dtype) != len(buffers):
            raise InvalidGradsError(
                f"got {len(dtype)} dtypes for {len(buffers)} buffers; pass one dtype "
                "or one per buffer"
            )
        raw: list[npt.DTypeLike] = list(dtype)
    else:
        raw = [dtype] * len(buffers)
    # None means the default, float32, everywhere (numpy would read it as float64).
    raw = [np.float32 if d is None else d for d in raw]
    out: list[np.dtype[Any]] = []
    for i, (buf, dt_like) in enumerate(zip(buffers, raw, strict=True)):
        # The common case without building the param's description (see _check_dtype).
        dt = _NATIVE.get(dt_like) if isinstance(dt_like, Hashable) else None
        if dt is None:
            dt = _check_dtype(dt_like, _describe(i, buf))
        size = int(buf.size)
        if size % dt.itemsize:
            raise InvalidGradsError(
                f"{_describe(i, buf)}: buffer size {size} bytes is not a whole number of "
                f"{dt} elements ({dt.itemsize} bytes each)"
            )
        out.append(dt)
    return out


# -- error translation ------------------------------------------------------------


@contextlib.contextmanager
def wgpu_errors(what: str) -> Iterator[None]:
    """The one place where wgpu exceptions become gradsync errors."""
    wgpu = import_wgpu()

    try:
        yield
    except GradSyncError:
        raise
    except (wgpu.GPUError, RuntimeError) as exc:
        raise WgpuBridgeError(f"wgpu failed while {what}: {exc}") from exc


# -- the bridge -------------------------------------------------------------------


@dataclass
class _Chunk:
    """One staging buffer (and its host mirror) holding a run of params."""

    nbytes: int
    host: npt.NDArray[np.uint8]
    read: Any = None  # MAP_READ | COPY_DST, created lazily by download()
    write: Any = None  # MAP_WRITE | COPY_SRC, kept mapped while idle
    remap: Any = None  # the promise of write's mapping, asked for after an upload


@dataclass
class _Layout:
    key: tuple[tuple[int, int, str], ...]
    slots: list[tuple[int, int, int]]  # (chunk, byte offset, copy size) per param
    chunks: list[_Chunk]
    views: list[npt.NDArray[Any]]
    # The buffer objects and the dtype list it was last asked for (see _get_layout).
    buffers: tuple[Any, ...] = ()
    dtypes: object = None

    @functools.cached_property
    def host_layout(self) -> tuple[tuple[str, tuple[int]], ...]:
        """``(dtype str, (elements,))`` per param, as gradsync's layouts are written."""
        return tuple((v.dtype.str, (v.size,)) for v in self.views)

    def writes(
        self, pieces: Sequence[tuple[int, int, npt.NDArray[Any]]]
    ) -> list[tuple[int, int, npt.NDArray[Any]]]:
        """``(param, first element, elements)`` pieces as ``(chunk, byte offset, elements)``
        in the staging buffers."""
        out = []
        for param, start, src in pieces:
            c, off, _ = self.slots[param]
            out.append((c, off + start * src.itemsize, src))
        return out


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
        self._layout: _Layout | None = None
        # The last buffer set, the dtype argument it came with, and its dtypes.
        self._resolved: tuple[tuple[Any, ...], object, list[np.dtype[Any]]] | None = None
        self._max_buffer_size = int(device.limits.get("max-buffer-size", 1 << 28))
        self._fence_src: Any = None
        self._fence_dst: Any = None
        self._closed = False
        # How long a wait for the GPU polls from this thread first (see _wait).
        self._spin_s = 0.0 if _adapter_type(device) == "CPU" else SPIN_S
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
            problem = self._problem(buf, usage, flag)
            if problem is not None:
                # Named only here: a description per buffer per step is a visible cost
                # with hundreds of buffers.
                raise InvalidGradsError(f"{_describe(i, buf)}: {problem}")
            if probe:
                self._check_alive(i, buf)

    def _problem(self, buf: Any, usage: int, flag: str) -> str | None:
        """What makes ``buf`` unusable here (short of being destroyed), or None."""
        if getattr(buf, "_device", self._device) is not self._device:
            return "buffer belongs to another GPUDevice than the bridge's"
        if not int(buf.usage) & usage:
            return f"buffer usage lacks {flag}; create it with usage=... | wgpu.BufferUsage.{flag}"
        size = int(buf.size)
        if size > self._max_buffer_size:
            return (
                f"buffer size {size} bytes exceeds the device's "
                f"max-buffer-size limit {self._max_buffer_size}"
            )
        if size % COPY_BUFFER_ALIGNMENT:
            return (
                f"buffer size {size} bytes is not a multiple of 4; wgpu copies whole 4-byte "
                "words, so allocate the buffer with its size rounded up to "
                f"{_round_up(size, COPY_BUFFER_ALIGNMENT)} bytes"
            )
        if str(buf.map_state) != "unmapped":
            return f"buffer is {buf.map_state}; unmap it before syncing"
        return None

    def _check_alive(self, index: int, buf: Any) -> None:
        # Submitting a destroyed buffer aborts the whole process in wgpu-native 0.32
        # (a Rust panic in wgpuQueueSubmit), and wgpu-py keeps no "destroyed" flag.
        # A 1-byte write_buffer is checked for destruction and device before its
        # alignment, and is always rejected for alignment, so it never writes.
        wgpu = import_wgpu()

        try:
            self._device.queue.write_buffer(buf, 0, _PROBE)
        except wgpu.GPUValidationError as exc:
            msg = str(exc)
            if "destroyed" in msg:
                raise InvalidGradsError(
                    f"{_describe(index, buf)}: buffer has been destroyed"
                ) from exc
            if "match" in msg and "Device" in msg:
                raise InvalidGradsError(
                    f"{_describe(index, buf)}: buffer belongs to another GPUDevice "
                    "than the bridge's"
                ) from exc
        except ValueError:
            # wgpu-py's own range check: an empty buffer, which is never submitted (a
            # destroyed one would abort the process) as it has nothing to copy.
            pass

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
        spec = _dtype_spec(dtype)
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
        _check_types(buffers)
        pair = repeated(buffers)
        if pair is not None:
            raise InvalidGradsError(overlap_message(*pair, "the same GPUBuffer"))
        dtypes = resolve_dtypes(buffers, dtype)
        self._resolved = (key, spec, dtypes)
        return dtypes

    def _get_layout(self, buffers: Sequence[Any], dtypes: Sequence[np.dtype[Any]]) -> _Layout:
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
        slots: list[tuple[int, int, int]] = []
        sizes: list[int] = []
        offset = end = 0
        for b in buffers:
            size = int(b.size)
            if offset and offset + size > self._max_buffer_size:
                sizes.append(end)  # not rounded up: a chunk may end at the limit itself
                offset = 0
            slots.append((len(sizes), offset, size))
            end = offset + size
            offset = _round_up(end, _SLOT_ALIGNMENT)
        sizes.append(max(end, _SLOT_ALIGNMENT))
        chunks = [_Chunk(n, np.empty(n, np.uint8)) for n in sizes]
        views = [
            chunks[c].host[off : off + size].view(dt)
            for (c, off, size), dt in zip(slots, dtypes, strict=True)
        ]
        self._layout = _Layout(key, slots, chunks, views, tuple(buffers), dtypes)
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
                    _release(buf)
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
            if len(into) != len(buffers):
                raise InvalidGradsError(
                    f"got {len(into)} arrays to fill for {len(buffers)} buffers"
                )
            for i, (dst, dt, buf) in enumerate(zip(into, dts, buffers, strict=True)):
                if (
                    dst.dtype != dt
                    or dst.nbytes != int(buf.size)
                    or not (dst.flags.c_contiguous and dst.flags.writeable)
                ):
                    raise InvalidGradsError(
                        f"{_describe(i, buf)}: into[{i}] is {dst.shape} {dst.dtype}, not a "
                        f"writeable, contiguous array of {int(buf.size)} bytes of {dt}"
                    )
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
        self._check_buffers(buffers, _COPY_SRC, "COPY_SRC")
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
                _map_for_reading(ch.read, self._device, self._spin_s)
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
        if len(arrays) != len(buffers):
            raise InvalidGradsError(f"got {len(arrays)} arrays for {len(buffers)} buffers")
        # Before buffer.size is read: a numpy array has one too (in elements).
        _check_types(buffers)
        host: list[npt.NDArray[Any]] = []
        for i, (buf, arr) in enumerate(zip(buffers, arrays, strict=True)):
            a = np.asarray(arr)
            where = _describe(i, buf)
            _check_dtype(a.dtype, where)
            if a.nbytes != int(buf.size):
                raise InvalidGradsError(
                    f"{where}: array has {a.nbytes} bytes ({a.size} x {a.dtype}) but the "
                    f"buffer has {int(buf.size)} bytes"
                )
            host.append(np.ascontiguousarray(a).reshape(-1))
        self._check_buffers(buffers, _COPY_DST, "COPY_DST")
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
        self._check_buffers(buffers, _COPY_DST, "COPY_DST", probe=False)

    def _check_without_copying(self, buffers: Sequence[wgpu.GPUBuffer]) -> None:
        """Check ``buffers`` as a step's download and upload would (a job of one rank
        copies nothing, and must fail where a larger one would).

        Raises:
            InvalidGradsError: as :meth:`download` and :meth:`upload`.
        """
        self._check_buffers(buffers, _COPY_SRC, "COPY_SRC")
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
        layout: _Layout,
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
                _wait(remap, self._device, self._spin_s)
            if str(ch.write.map_state) != "mapped":
                ch.write.map_sync(wgpu.MapMode.WRITE)
        self._write_staging(layout, writes)
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

    def _write_staging(
        self, layout: _Layout, writes: Sequence[tuple[int, int, npt.NDArray[Any]]]
    ) -> None:
        """Copy ``writes`` into the mapped upload buffers: straight into the mappings, on
        the bridge's threads, where wgpu-py gives a writable view of them; otherwise
        into the host mirrors first, then one ``write_mapped`` a chunk."""
        mapped = [_writable_mapping(ch.write, ch.nbytes) for ch in layout.chunks]
        targets = [m for m in mapped if m is not None]
        direct = len(targets) == len(mapped)
        if not direct:
            targets = [ch.host for ch in layout.chunks]
        try:
            self._workers.copy(
                [
                    (targets[c][off : off + src.nbytes], src.reshape(-1).view(np.uint8))
                    for c, off, src in writes
                    if src.nbytes
                ]
            )
        finally:
            # No numpy view of mapped memory may outlive unmap().
            del mapped, targets
        if not direct:
            for ch in layout.chunks:
                ch.write.write_mapped(ch.host, 0)

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
        _map_for_reading(self._fence_dst, self._device, self._spin_s)
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
                _release(buf)
        self._fence_src = self._fence_dst = None

    def __enter__(self) -> WgpuBridge:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_PROBE = np.zeros(1, np.uint8)


def _release(buf: Any) -> None:
    """Unmap and destroy a buffer of the bridge's own, on a lost device too."""
    with contextlib.suppress(Exception):  # a lost device: wgpu errors, nothing to free
        if str(buf.map_state) == "mapped":
            buf.unmap()
    with contextlib.suppress(Exception):
        buf.destroy()
