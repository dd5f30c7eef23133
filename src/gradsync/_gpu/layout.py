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

__all__ = [
    "MAX_PARTS",
    "PART_MIN_BYTES",
    "PIPELINE_MIN_BYTES",
    "StagingChunk",
    "StagingLayout",
    "write_staging",
]

# read_mapped/write_mapped offsets must be multiples of 8 in wgpu-py, and 8 also keeps
# every float64 host view aligned.
_SLOT_ALIGNMENT = 8


# A host mirror of this many bytes or more is staged in parts, each with its own
# staging buffers, so that the GPU copies one part while the host copies another.
PIPELINE_MIN_BYTES = 32 << 20
# Parts are at least this big (below, a part's submit and mapping cost more than the
# overlap saves), and at most MAX_PARTS to a mirror.
PART_MIN_BYTES = 8 << 20
MAX_PARTS = 8
# Where parts are cut: a multiple of the copy and mapping alignments.
_PART_ALIGNMENT = 1 << 16

# (param, byte offset in its buffer, byte offset in the staging buffer, bytes)
Copy = tuple[int, int, int, int]


@dataclass
class StagingChunk:
    """One pair of staging buffers, for the bytes ``[lo, lo + nbytes)`` of a host mirror
    (``host`` is that range of it)."""

    nbytes: int
    host: npt.NDArray[np.uint8]
    lo: int = 0
    copies: list[Copy] = field(default_factory=list)  # what this chunk stages
    read: Any = None  # MAP_READ | COPY_DST, created lazily by download()
    write: Any = None  # MAP_WRITE | COPY_SRC, kept mapped while idle
    remap: Any = None  # the promise of write's mapping, asked for after an upload


@dataclass
class StagingLayout:
    key: tuple[tuple[int, int, str], ...]
    slots: list[tuple[int, int, int]]  # (mirror, byte offset, copy size) per param
    chunks: list[StagingChunk]
    views: list[npt.NDArray[Any]]
    mirror_chunks: list[list[int]]  # the chunks of each host mirror, in order
    # The buffer objects and the dtype list it was last asked for (see _get_layout).
    buffers: tuple[Any, ...] = ()
    dtypes: object = None

    @functools.cached_property
    def host_layout(self) -> tuple[tuple[str, tuple[int]], ...]:
        """``(dtype str, (elements,))`` per param, as gradsync's layouts are written."""
        return tuple((v.dtype.str, (v.size,)) for v in self.views)

    def writes(
        self, pieces: Sequence[tuple[int, int, npt.NDArray[Any]]]
    ) -> list[list[tuple[int, npt.NDArray[np.uint8]]]]:
        """``(param, first element, elements)`` pieces as ``(byte offset, bytes)`` to copy
        into each chunk's staging buffer, a list per chunk."""
        out: list[list[tuple[int, npt.NDArray[np.uint8]]]] = [[] for _ in self.chunks]
        whole = len(self.chunks) == len(self.mirror_chunks)  # a chunk per mirror
        for param, start, src in pieces:
            m, off, _ = self.slots[param]
            data = src.reshape(-1).view(np.uint8)
            lo = off + start * src.itemsize
            if whole:
                out[m].append((lo, data))
                continue
            hi = lo + data.nbytes
            for c in self.mirror_chunks[m]:
                ch = self.chunks[c]
                a, b = max(lo, ch.lo), min(hi, ch.lo + ch.nbytes)
                if a < b:
                    out[c].append((a - ch.lo, data[a - lo : b - lo]))
        return out

    @classmethod
    def build(
        cls,
        key: tuple[tuple[int, int, str], ...],
        buffers: Sequence[Any],
        dtypes: Sequence[np.dtype[Any]],
        max_buffer_size: int,
        *,
        pipelined: bool = True,
    ) -> StagingLayout:
        """Lay ``buffers`` out in host mirrors of at most ``max_buffer_size`` bytes, each
        staged in one chunk or, ``pipelined`` and from ``PIPELINE_MIN_BYTES``, in
        several."""
        slots: list[tuple[int, int, int]] = []
        sizes: list[int] = []
        offset = end = 0
        for b in buffers:
            size = int(b.size)
            if offset and offset + size > max_buffer_size:
                sizes.append(end)  # not rounded up: a mirror may end at the limit itself
                offset = 0
            slots.append((len(sizes), offset, size))
            end = offset + size
            offset = round_up(end, _SLOT_ALIGNMENT)
        sizes.append(max(end, _SLOT_ALIGNMENT))
        mirrors = [np.empty(n, np.uint8) for n in sizes]
        chunks: list[StagingChunk] = []
        mirror_chunks: list[list[int]] = []
        for m, host in enumerate(mirrors):
            mirror_chunks.append([])
            for lo, hi in _parts(len(host)) if pipelined else [(0, len(host))]:
                mirror_chunks[m].append(len(chunks))
                chunks.append(StagingChunk(hi - lo, host[lo:hi], lo, _copies(slots, m, lo, hi)))
        views = [
            mirrors[m][off : off + size].view(dt)
            for (m, off, size), dt in zip(slots, dtypes, strict=True)
        ]
        return cls(key, slots, chunks, views, mirror_chunks, tuple(buffers), dtypes)


def _parts(nbytes: int) -> list[tuple[int, int]]:
    """Where a host mirror of ``nbytes`` is cut into chunks."""
    if nbytes < PIPELINE_MIN_BYTES:
        return [(0, nbytes)]
    return split_range(nbytes, min(MAX_PARTS, nbytes // PART_MIN_BYTES), _PART_ALIGNMENT)


def _copies(slots: Sequence[tuple[int, int, int]], mirror: int, lo: int, hi: int) -> list[Copy]:
    """The copies between the params' buffers and the bytes ``[lo, hi)`` of a mirror."""
    out = []
    for param, (m, off, size) in enumerate(slots):
        a, b = max(off, lo), min(off + size, hi)
        if m == mirror and a < b:
            out.append((param, a - off, a - lo, b - a))
    return out


def write_staging(
    chunk: StagingChunk, writes: Sequence[tuple[int, npt.NDArray[np.uint8]]], workers: Workers
) -> None:
    """Copy ``writes`` into the chunk's mapped upload buffer: straight into the mapping,
    on the bridge's threads, where wgpu-py gives a writable view of it; otherwise into
    the host mirror first, then one ``write_mapped``."""
    mapped = writable_mapping(chunk.write, chunk.nbytes)
    direct = mapped is not None
    target = chunk.host if mapped is None else mapped
    try:
        workers.copy([(target[off : off + src.nbytes], src) for off, src in writes if src.nbytes])
    finally:
        # No numpy view of mapped memory may outlive unmap().
        del mapped, target
    if not direct:
        chunk.write.write_mapped(chunk.host, 0)
