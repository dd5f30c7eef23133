"""Spreading a step's large copies and reductions over a few threads of this rank.

One thread copies at most about 10 GB/s; a server's memory gives many times that,
and numpy releases the GIL while it copies or adds. Work is split only into pieces
of at least ``MIN_PIECE_BYTES``, so small steps (latency-bound) stay on the calling
thread. Every job is element-wise on disjoint ranges: how the work is split never
changes a bit of the result.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

__all__ = [
    "MAX_AUTO_THREADS",
    "MIN_PIECE_BYTES",
    "SMALL_COPY_BYTES",
    "Workers",
    "auto_threads",
    "split_range",
]

# Below this a thread's start-up and hand-over cost more than the copy it would save.
MIN_PIECE_BYTES = 1 << 20
# Smaller copies stay on the calling thread (see Workers.copy).
SMALL_COPY_BYTES = 256 << 10
# Beyond this the memory bus, not the number of copying threads, is the limit.
MAX_AUTO_THREADS = 8


def auto_threads(local_ranks: int) -> int:
    """Threads per rank when the config leaves it to gradsync: this process's usable
    CPUs shared among the ``local_ranks`` ranks on this host, 1 to ``MAX_AUTO_THREADS``."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(MAX_AUTO_THREADS, cpus // max(local_ranks, 1)))


def split_range(n: int, parts: int, align: int = 1) -> list[tuple[int, int]]:
    """``[0, n)`` cut into at most ``parts`` contiguous ranges, inner cuts on multiples
    of ``align``; empty ranges are dropped."""
    parts = max(1, min(parts, n // max(align, 1)))
    if parts == 1:
        return [(0, n)] if n else []
    blocks, extra = divmod(n // align, parts)
    cuts = [align * (q * blocks + min(q, extra)) for q in range(parts)] + [n]
    return [(a, b) for a, b in itertools.pairwise(cuts) if a < b]


class Workers:
    """Runs batches of jobs on ``threads`` threads (the caller's included).

    With ``threads == 1`` everything runs inline and no thread is ever started.
    """

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._pool: ThreadPoolExecutor | None = None

    def pieces(self, nbytes: int) -> int:
        """How many pieces a job of ``nbytes`` is worth cutting into."""
        return max(1, min(self.threads, nbytes // MIN_PIECE_BYTES))

    def run(self, jobs: Sequence[Callable[[], object]]) -> None:
        """Run every job (what it returns is dropped); return when all have finished.

        Raises:
            The first job's exception (by position), after every job has stopped, so
            no job still writes into the arrays once the caller handles the error.
        """
        if len(jobs) <= 1 or self.threads <= 1:
            for job in jobs:
                job()
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="gradsync")
        futures: list[Future[object]] = [self._pool.submit(job) for job in jobs[1:]]
        first: BaseException | None = None
        try:
            jobs[0]()
        except BaseException as exc:  # re-raised below, once the others have stopped
            first = exc
        for fut in futures:
            while True:
                try:
                    failed = fut.exception()
                    break
                except BaseException as exc:  # an interrupt while waiting: the job runs on
                    first = first or exc
            if first is None and failed is not None:
                first = failed
        if first is not None:
            raise first

    def copy(self, pairs: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
        """``np.copyto(dst, src)`` for every pair of equal-size 1-D arrays of one dtype.

        Arrays of ``SMALL_COPY_BYTES`` or more are dealt to the threads in contiguous
        pieces of about equal bytes; smaller ones are all copied by the calling thread
        (many small copies on many threads queue for the GIL, slower than one).
        """
        if self.threads <= 1:  # nothing to deal out: skip sorting the pairs
            _copier(pairs)()
            return
        small = [(d, s) for d, s in pairs if d.nbytes < SMALL_COPY_BYTES]
        large = [(d, s) for d, s in pairs if d.nbytes >= SMALL_COPY_BYTES]
        total = sum(dst.nbytes for dst, _ in large)
        parts = self.pieces(total)
        if parts <= 1:
            self.run([_copier(pairs)])
            return
        share = -(-total // parts)
        batches: list[list[tuple[np.ndarray, np.ndarray]]] = [small]
        room = share
        for dst, src in large:
            at, size, item = 0, dst.size, max(dst.itemsize, 1)
            while at < size:
                if room <= 0:
                    batches.append([])
                    room = share
                take = min(size - at, max(room // item, 1))
                batches[-1].append((dst[at : at + take], src[at : at + take]))
                at += take
                room -= take * item
        self.run([_copier(batch) for batch in batches if batch])

    def pack(self, packs: Sequence[tuple[np.ndarray, Sequence[np.ndarray]]]) -> None:
        """For every ``(dst, srcs)``: copy the 1-D ``srcs`` back to back into ``dst``
        (all of one dtype; ``dst`` as long as all of them together).

        Sources under ``SMALL_COPY_BYTES`` in a row are copied with one
        ``np.concatenate`` on the calling thread (a Python-level copy per param
        would be the whole cost of a small param); larger ones are dealt out as
        :meth:`copy` deals them.
        """
        pairs: list[tuple[np.ndarray, np.ndarray]] = []
        for dst, srcs in packs:
            if self.threads <= 1:
                if srcs:
                    np.concatenate(srcs, out=dst)
                continue
            at = first = 0  # dst[first:at] is for the run of small sources in ``run``
            run: list[np.ndarray] = []
            for src in srcs:
                if src.nbytes >= SMALL_COPY_BYTES:
                    if run:
                        np.concatenate(run, out=dst[first:at])
                        run = []
                    pairs.append((dst[at : at + len(src)], src))
                elif not run:
                    first = at
                    run = [src]
                else:
                    run.append(src)
                at += len(src)
            if run:
                np.concatenate(run, out=dst[first:at])
        self.copy(pairs)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _copier(pairs: Sequence[tuple[np.ndarray, np.ndarray]]) -> Callable[[], None]:
    def job() -> None:
        # np.copyto for arrays of one dtype and shape, without its keyword handling,
        # which is a step's whole cost for a param of a few elements.
        for dst, src in pairs:
            dst[...] = src

    return job
