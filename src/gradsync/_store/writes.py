"""Writing runs of buffers to a file descriptor with as few system calls as it takes."""

from __future__ import annotations

import os
from collections.abc import Sequence

__all__ = ["write_runs", "writev_all"]

_IOV_BATCH = 512  # well under IOV_MAX (1024 on Linux)


def write_runs(
    fd: int, chunks: Sequence[bytes | memoryview | int], offset: int, end: int = 0
) -> tuple[int, int]:
    """Write ``chunks`` from ``offset``, skipping an int chunk's bytes; return where they
    end and where the last one written ends (at least ``end``)."""
    run: list[bytes | memoryview] = []
    at = offset
    for chunk in [*chunks, 0]:
        if not isinstance(chunk, int):
            if memoryview(chunk).nbytes:  # an empty one writes nothing, moves no end
                run.append(chunk)
            continue
        if run:
            at += writev_all(fd, run, at)
            end = max(end, at)
            run = []
        at += chunk
    return at, end


def writev_all(fd: int, chunks: Sequence[bytes | memoryview], offset: int | None = None) -> int:
    """Write ``chunks`` whole (at ``offset``, else at the file position); the bytes written."""
    views = [memoryview(c).cast("B") for c in chunks if len(c)]
    total = 0
    first = 0  # views[first:] are still to be written
    while first < len(views):
        batch = views[first : first + _IOV_BATCH]
        n = os.writev(fd, batch) if offset is None else os.pwritev(fd, batch, offset + total)
        total += n
        # Skip what was written (an index: popping the list's head moves all of it); a
        # short write leaves the rest of the batch to go again.
        for view in batch:
            if n < len(view):
                if n:
                    views[first] = view[n:]
                break
            n -= len(view)
            first += 1
    return total
