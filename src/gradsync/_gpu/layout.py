"""Where each gradient buffer sits in the bridge's staging buffers."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from gradsync._step.parallel import Workers, split_range

from .checks import round_up
from .wait import writable_mapping

__all__ = ["StagingChunk", "StagingLayout", "write_staging"]

# read_mapped/write_mapped offsets must be multiples of 8 in wgpu-py, and 8 also keeps
# every float64 host view aligned.
_SLOT_ALIGNMENT = 8
# A large copy goes through several staging buffers, each copied on as soon as it is
# ready, so the GPU copies one part while the host copies the other (parts of at
# least PART_BYTES, at most MAX_PARTS a chunk, cut on multiples of 4 KiB).
PART_BYTES = 32 << 20
MAX_PARTS = 4
_PART_ALIGNMENT = 4096

# One GPU copy: (param, byte offset in the staging part, byte offset in the param, bytes).
PartCopy = tuple[int, int, int, int]


@dataclass
class StagingChunk:
    """One staging buffer (and its host mirror) holding a run of params."""

    nbytes: int
    host: npt.NDArray[np.uint8]
    # Byte ranges of the chunk, each with its own staging buffers.
    parts: list[tuple[int, int]] = field(default_factory=list)
    # Per part: MAP_READ | COPY_DST, created lazily by download().
    reads: list[Any] = field(default_factory=list)
    # Per part: MAP_WRITE | COPY_SRC, kept mapped while idle; created lazily by upload.
    writes: list[Any] = field(default_factory=list)
    # Per part: the promise of its mapping, asked for after an upload (or None).
    remaps: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.reads = [None] * len(self.parts)
        self.writes = [None] * len(self.parts)
        self.remaps = [None] * len(self.parts)


@dataclass
class StagingLayout:
    key: tuple[tuple[int, int, str], ...]
    slots: list[tuple[int, int, int]]  # (chunk, byte offset, copy size) per param
    chunks: list[StagingChunk]
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

    @classmethod
    def build(
        cls,
        key: tuple[tuple[int, int, str], ...],
        buffers: Sequence[Any],
        dtypes: Sequence[np.dtype[Any]],
        max_buffer_size: int,
        *,
        in_parts: bool = True,
    ) -> StagingLayout:
        """Lay ``buffers`` out in chunks of at most ``max_buffer_size`` bytes."""
        slots: list[tuple[int, int, int]] = []
        sizes: list[int] = []
        offset = end = 0
        for b in buffers:
            size = int(b.size)
            if offset and offset + size > max_buffer_size:
                sizes.append(end)  # not rounded up: a chunk may end at the limit itself
                offset = 0
            slots.append((len(sizes), offset, size))
            end = offset + size
            offset = round_up(end, _SLOT_ALIGNMENT)
        sizes.append(max(end, _SLOT_ALIGNMENT))
        chunks = [StagingChunk(n, np.empty(n, np.uint8), _parts(n, in_parts)) for n in sizes]
        views = [
            chunks[c].host[off : off + size].view(dt)
            for (c, off, size), dt in zip(slots, dtypes, strict=True)
        ]
        return cls(key, slots, chunks, views, tuple(buffers), dtypes)

    @functools.cached_property
    def part_copies(self) -> list[list[list[PartCopy]]]:
        """Per chunk and upload part, the GPU copies that take the part to the params."""
        out: list[list[list[PartCopy]]] = [[[] for _ in ch.parts] for ch in self.chunks]
        for param, (c, off, size) in enumerate(self.slots):
            for p, (a, b) in enumerate(self.chunks[c].parts):
                lo, hi = max(off, a), min(off + size, b)
                if lo < hi:
                    out[c][p].append((param, lo - a, lo - off, hi - lo))
        return out


def _parts(nbytes: int, in_parts: bool) -> list[tuple[int, int]]:
    count = max(1, min(MAX_PARTS, nbytes // PART_BYTES)) if in_parts else 1
    return split_range(nbytes, count, _PART_ALIGNMENT)


def part_writes(
    writes: Sequence[tuple[int, int, npt.NDArray[Any]]], chunk: int, a: int, b: int
) -> list[tuple[int, npt.NDArray[np.uint8]]]:
    """The bytes of ``writes`` (``(chunk, byte offset, array)``) that fall in bytes
    ``[a, b)`` of ``chunk``, as ``(offset from a, bytes)``."""
    out = []
    for c, off, src in writes:
        end = off + src.nbytes
        if c != chunk or end <= a or off >= b or not src.nbytes:
            continue
        lo, hi = max(off, a), min(end, b)
        out.append((lo - a, src.reshape(-1).view(np.uint8)[lo - off : hi - off]))
    return out


def write_staging(
    buf: Any,
    mirror: npt.NDArray[np.uint8],
    writes: list[tuple[int, npt.NDArray[np.uint8]]],
    workers: Workers,
) -> None:
    """Copy ``writes`` (``(byte offset, bytes)``) into the mapped upload buffer ``buf``:
    straight into the mapping, on the bridge's threads, where wgpu-py gives a
    writable view of it; otherwise into ``mirror`` (its size) first, then one
    ``write_mapped``."""
    mapped = writable_mapping(buf, mirror.nbytes)
    direct = mapped is not None
    target = mirror if mapped is None else mapped
    try:
        workers.copy([(target[off : off + src.nbytes], src) for off, src in writes])
    finally:
        # No numpy view of mapped memory may outlive unmap().
        del mapped, target
    if not direct:
        buf.write_mapped(mirror, 0)
