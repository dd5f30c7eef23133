"""What the GPU bridge checks of the buffers and dtypes it is given."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from gradsync._errors import InvalidGradsError
from gradsync._step.reduce import SUPPORTED_DTYPES

from .wait import import_wgpu

if TYPE_CHECKING:
    import wgpu

__all__ = [
    "COPY_BUFFER_ALIGNMENT",
    "COPY_DST",
    "COPY_SRC",
    "buffer_problem",
    "check_alive",
    "check_dtype",
    "check_types",
    "describe",
    "dtype_spec",
    "resolve_dtypes",
    "round_up",
]

COPY_BUFFER_ALIGNMENT = 4

# wgpu BufferUsage bits (WebGPU spec values), so validation needs no wgpu import.
COPY_SRC = 0x0004
COPY_DST = 0x0008

# Common spellings of the supported dtypes, checked without building an error context.
_NATIVE: dict[object, np.dtype[Any]] = {
    like: dt for dt in SUPPORTED_DTYPES for like in (dt, dt.type, dt.name, dt.str, dt.char)
}
_PROBE = np.zeros(1, np.uint8)


def round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def check_types(buffers: Sequence[Any]) -> None:
    """Raise InvalidGradsError naming the first of ``buffers`` that is no GPUBuffer."""
    gpu_buffer = import_wgpu().GPUBuffer
    for i, buf in enumerate(buffers):
        if not isinstance(buf, gpu_buffer):
            raise InvalidGradsError(
                f"param {i} is a {type(buf).__name__}, not a wgpu GPUBuffer (numpy "
                "arrays are averaged with device=None)"
            )


def describe(index: int, buffer: Any) -> str:
    label = getattr(buffer, "label", "") or ""
    return f"param {index} (label {label!r})" if label else f"param {index}"


def check_dtype(dtype: npt.DTypeLike, where: str) -> np.dtype[Any]:
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


def dtype_spec(dtype: object) -> object:
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
        # The common case without building the param's description (see check_dtype).
        dt = _NATIVE.get(dt_like) if isinstance(dt_like, Hashable) else None
        if dt is None:
            dt = check_dtype(dt_like, describe(i, buf))
        size = int(buf.size)
        if size % dt.itemsize:
            raise InvalidGradsError(
                f"{describe(i, buf)}: buffer size {size} bytes is not a whole number of "
                f"{dt} elements ({dt.itemsize} bytes each)"
            )
        out.append(dt)
    return out


def buffer_problem(device: Any, max_size: int, buf: Any, usage: int, flag: str) -> str | None:
    """What makes ``buf`` unusable by ``device`` (short of being destroyed), or None."""
    if getattr(buf, "_device", device) is not device:
        return "buffer belongs to another GPUDevice than the bridge's"
    if not int(buf.usage) & usage:
        return f"buffer usage lacks {flag}; create it with usage=... | wgpu.BufferUsage.{flag}"
    size = int(buf.size)
    if size > max_size:
        return f"buffer size {size} bytes exceeds the device's max-buffer-size limit {max_size}"
    if size % COPY_BUFFER_ALIGNMENT:
        return (
            f"buffer size {size} bytes is not a multiple of 4; wgpu copies whole 4-byte "
            "words, so allocate the buffer with its size rounded up to "
            f"{round_up(size, COPY_BUFFER_ALIGNMENT)} bytes"
        )
    if str(buf.map_state) != "unmapped":
        return f"buffer is {buf.map_state}; unmap it before syncing"
    return None


def check_alive(device: Any, index: int, buf: Any) -> None:
    """Raise InvalidGradsError if ``buf`` is destroyed or of another device."""
    # Submitting a destroyed buffer aborts the whole process in wgpu-native 0.32
    # (a Rust panic in wgpuQueueSubmit), and wgpu-py keeps no "destroyed" flag.
    # A 1-byte write_buffer is checked for destruction and device before its
    # alignment, and is always rejected for alignment, so it never writes.
    wgpu = import_wgpu()

    try:
        device.queue.write_buffer(buf, 0, _PROBE)
    except wgpu.GPUValidationError as exc:
        msg = str(exc)
        if "destroyed" in msg:
            raise InvalidGradsError(f"{describe(index, buf)}: buffer has been destroyed") from exc
        if "match" in msg and "Device" in msg:
            raise InvalidGradsError(
                f"{describe(index, buf)}: buffer belongs to another GPUDevice than the bridge's"
            ) from exc
    except ValueError:
        # wgpu-py's own range check: an empty buffer, which is never submitted (a
        # destroyed one would abort the process) as it has nothing to copy.
        pass


def check_into(
    buffers: Sequence[Any], dtypes: Sequence[np.dtype[Any]], into: Sequence[npt.NDArray[Any]]
) -> None:
    """Raise InvalidGradsError unless each of ``into`` fits its buffer's bytes and dtype."""
    if len(into) != len(buffers):
        raise InvalidGradsError(f"got {len(into)} arrays to fill for {len(buffers)} buffers")
    for i, (dst, dt, buf) in enumerate(zip(into, dtypes, buffers, strict=True)):
        if (
            dst.dtype != dt
            or dst.nbytes != int(buf.size)
            or not (dst.flags.c_contiguous and dst.flags.writeable)
        ):
            raise InvalidGradsError(
                f"{describe(i, buf)}: into[{i}] is {dst.shape} {dst.dtype}, not a "
                f"writeable, contiguous array of {int(buf.size)} bytes of {dt}"
            )


def upload_sources(
    buffers: Sequence[Any], arrays: Sequence[npt.NDArray[Any]]
) -> list[npt.NDArray[Any]]:
    """``arrays`` as 1-D contiguous arrays, each checked to hold its buffer's bytes."""
    if len(arrays) != len(buffers):
        raise InvalidGradsError(f"got {len(arrays)} arrays for {len(buffers)} buffers")
    # Before buffer.size is read: a numpy array has one too (in elements).
    check_types(buffers)
    host: list[npt.NDArray[Any]] = []
    for i, (buf, arr) in enumerate(zip(buffers, arrays, strict=True)):
        a = np.asarray(arr)
        where = describe(i, buf)
        check_dtype(a.dtype, where)
        if a.nbytes != int(buf.size):
            raise InvalidGradsError(
                f"{where}: array has {a.nbytes} bytes ({a.size} x {a.dtype}) but the "
                f"buffer has {int(buf.size)} bytes"
            )
        host.append(np.ascontiguousarray(a).reshape(-1))
    return host
