"""Where each gradient buffer sits in the bridge's staging buffers."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from gradsync._step.parallel import Workers

from .checks import round_up
from .wait import writable_mapping

__all__ = ["StagingChunk", "StagingLayout", "write_staging"]

# read_mapped/write_mapped offsets must be multiples of 8 in wgpu-py, and 8 also keeps
# every float64 host view aligned.
_SLOT_ALIGNMENT = 8


@dataclass
class StagingChunk:
    """One staging buffer (and its host mirror) holding a run of params."""

    nbytes: int
    host: npt.NDArray[np.uint8]
    read: Any = None  # MAP_READ | COPY_DST, created lazily by download()
    write: Any = None  # MAP_WRITE | COPY_SRC, kept mapped while idle
    remap: Any = None  # the promise of write's mapping, asked for after an upload


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
        chunks = [StagingChunk(n, np.empty(n, np.uint8)) for n in sizes]
        views = [
            chunks[c].host[off : off + size].view(dt)
            for (c, off, size), dt in zip(slots, dtypes, strict=True)
        ]
        return cls(key, slots, chunks, views, tuple(buffers), dtypes)


def write_staging(
    layout: StagingLayout, writes: Sequence[tuple[int, int, npt.NDArray[Any]]], workers: Workers
) -> None:
    """Copy ``writes`` into the mapped upload buffers: straight into the mappings, on
    the bridge's threads, where wgpu-py gives a writable view of them; otherwise
    into the host mirrors first, then one ``write_mapped`` a chunk."""
    mapped = [writable_mapping(ch.write, ch.nbytes) for ch in layout.chunks]
    targets = [m for m in mapped if m is not None]
    direct = len(targets) == len(mapped)
    if not direct:
        targets = [ch.host for ch in layout.chunks]
    try:
        workers.copy(
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
