"""Gradient arrays that live in this rank's published data file, so publishing copies nothing.

:meth:`GradSync.buffers_like` hands out numpy views into a mapped file laid out as an
input file: a header region reserved for the largest header the layout can need,
then the params in payload order. A step given exactly these arrays writes only the
header and points the rank's input-file name at this file (a symlink); peers read
it as they read any input file.

Why a separate file and a link rather than the reused input file itself: a step
given other arrays (or a plan that alternates two files) must be able to write
an input file without touching memory the caller still holds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .header import Layout
from .plan import Plan

__all__ = ["SharedBuffers"]

# The reserved header region is rounded up to whole pages: the params then start on
# a page boundary, aligned for every dtype (unless a float16 group leaves an odd
# number of elements before a float32 one).
HEAD_ROOM_ALIGN = 4096


@dataclass(frozen=True)
class SharedBuffers:
    """One set of shared gradient arrays and the file that holds them."""

    path: Path
    layout: Layout
    offset: int  # bytes of reserved header region; the payload starts here
    mem: np.ndarray  # uint8 view of the whole mapped file
    arrays: tuple[np.ndarray, ...]
    spans: tuple[tuple[int, int], ...]  # (address, bytes) per param
    runs: tuple[np.ndarray, ...]  # per dtype group of the plan: all its params, 1-D

    @classmethod
    def create(
        cls,
        path: Path,
        plan: Plan,
        worst_header_bytes: int,
        reserve: Callable[[Path, int], np.ndarray],
    ) -> SharedBuffers:
        """Map a new file at ``path`` and lay ``plan``'s params out in it, zero-filled.

        ``reserve(path, size)`` creates, sizes and maps the file (the transport's).
        """
        offset = -(-worst_header_bytes // HEAD_ROOM_ALIGN) * HEAD_ROOM_ALIGN
        mem = reserve(path, offset + plan.in_len)
        arrays: list[np.ndarray | None] = [None] * len(plan.layout)
        for group in plan.groups:
            itemsize = group.dtype.itemsize
            for index, first, count in group.params:
                at = offset + group.in_offset + first * itemsize
                flat = mem[at : at + count * itemsize].view(group.dtype)
                arrays[index] = flat.reshape(plan.layout[index][1])
        done = tuple(a for a in arrays if a is not None)
        assert len(done) == len(arrays)
        spans = tuple((a.ctypes.data, a.nbytes) for a in done)
        runs = tuple(
            mem[offset + g.in_offset : offset + g.in_offset + g.size * g.dtype.itemsize].view(
                g.dtype
            )
            for g in plan.groups
        )
        return cls(path, plan.layout, offset, mem, done, spans, runs)

    def holds(self, arrays: Sequence[np.ndarray]) -> bool:
        """Whether ``arrays`` are these arrays' memory, param for param (these very
        arrays, or other views of all of it, such as ``torch.from_numpy(a).numpy()``)."""
        if len(arrays) != len(self.spans):
            return False
        for a, mine, (address, nbytes) in zip(arrays, self.arrays, self.spans, strict=True):
            if a is mine:  # the common case, and far cheaper than asking for the address
                continue
            if a.nbytes != nbytes or (nbytes and a.ctypes.data != address):
                return False
        return True
