"""Why peers' data files stay mapped although mappings count in every rank's RSS.

Extra resident memory counts the tmpfs pages of peers' files that a rank has mapped
and touched (issue 5's "extra RSS <= 2x"). The two ways to keep them out of RSS, timed
in one process against copying through a kept mapping, median of 60 (40 for pread):

- ``pread`` of the cache-hot file into the destination (no mapping at all);
- the copy through the mapping, then ``madvise(MADV_DONTNEED)`` to drop the mapping's
  pages (the file keeps them), so the next step faults them in again.

This machine (2 cores, 2026-12-05, three runs), ms (ratio to the mapped copy)::

    1 MiB   map 0.016-0.018  pread 0.044-0.047 (2.5-2.9x)  dontneed 0.108-0.125 (6.1-7.8x)
    4 MiB   map 0.067-0.076  pread 0.190-0.196 (2.5-2.8x)  dontneed 0.395-0.402 (5.2-6.0x)
    16 MiB  map 0.455-0.503  pread 1.551-1.848 (3.4-3.7x)  dontneed 1.857-2.053 (4.1-4.2x)
    64 MiB  map 2.850-3.068  pread 7.950-8.594 (2.6-2.9x)  dontneed 8.760-9.085 (2.9-3.1x)

Usage: ``python benchmarks/mapping_probe.py [DIR]`` (DIR: a tmpfs, /dev/shm by default).
"""

from __future__ import annotations

import mmap
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np


def _median_ms(run: Callable[[], object], times: int) -> float:
    took = []
    for _ in range(times):
        start = time.perf_counter()
        run()
        took.append(time.perf_counter() - start)
    return statistics.median(took) * 1e3


def _probe(directory: Path, mib: int) -> str:
    nbytes = mib << 20
    path = directory / f"gradsync-mapping-probe-{os.getpid()}-{mib}"
    path.write_bytes(np.random.default_rng(mib).random(nbytes // 4, np.float32).tobytes())
    fd = os.open(path, os.O_RDONLY)
    mapping = mmap.mmap(fd, nbytes, prot=mmap.PROT_READ)
    try:
        src = np.frombuffer(mapping, np.float32)
        dst = np.ones(nbytes // 4, np.float32)

        def drop() -> None:
            np.copyto(dst, src)
            mapping.madvise(mmap.MADV_DONTNEED)

        mapped = _median_ms(lambda: np.copyto(dst, src), 60)
        pread = _median_ms(lambda: os.preadv(fd, [dst], 0), 40)
        dropped = _median_ms(drop, 60)
    finally:  # the mapping goes with the views of it, on return
        os.close(fd)
        path.unlink()
    return (
        f"{mib:>3} MiB  map {mapped:.3f}  pread {pread:.3f} ({pread / mapped:.1f}x)  "
        f"dontneed {dropped:.3f} ({dropped / mapped:.1f}x)"
    )


def main(directory: Path) -> None:
    for mib in (1, 4, 16, 64):
        print(_probe(directory, mib), flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "/dev/shm"))
