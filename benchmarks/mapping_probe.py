"""Why peers' data files stay mapped although mappings count in every rank's RSS.

Extra resident memory counts the tmpfs pages of peers' files that a rank has mapped
and touched (issue 5's "extra RSS <= 2x"). The two ways to keep them out of RSS, timed
in one process against copying through a kept mapping, median of 60 (40 for pread):

- ``pread`` of the cache-hot file into the destination (no mapping at all);
- the copy through the mapping, then ``madvise(MADV_DONTNEED)`` to drop the mapping's
  pages (the file keeps them), so the next step faults them in again.

Figures: benchmarks/RESULTS.md, 2026-12-05, "the two ways out of extra RSS".

Usage: ``python benchmarks/mapping_probe.py [DIR]`` (DIR: a tmpfs, /dev/shm by default).
"""

from __future__ import annotations

import mmap
import os
import sys
from pathlib import Path

import numpy as np
from timing import median_ms


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

        mapped = median_ms(lambda: np.copyto(dst, src), 60)
        pread = median_ms(lambda: os.preadv(fd, [dst], 0), 40)
        dropped = median_ms(drop, 60)
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
