"""Work split over threads: ranges, batches, errors (the maths is in test_reduce)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gradsync._step.parallel import (
    MIN_PIECE_BYTES,
    SMALL_COPY_BYTES,
    Workers,
    auto_threads,
    split_range,
)


@given(st.integers(0, 10**7), st.integers(1, 64), st.sampled_from([1, 16, 1024]))
def test_split_range_tiles_in_order_on_aligned_cuts(n: int, parts: int, align: int) -> None:
    ranges = split_range(n, parts, align)
    assert len(ranges) <= parts
    if n == 0:
        assert ranges == []
        return
    assert [a for a, _ in ranges] == [0, *(b for _, b in ranges[:-1])]
    assert ranges[-1][1] == n
    assert all(a < b for a, b in ranges)
    assert all(a % align == 0 for a, _ in ranges)


@pytest.mark.parametrize("threads", [1, 2, 5])
def test_copy_many_pairs_of_all_sizes(threads: int) -> None:
    rng = np.random.default_rng(0)
    sizes = [0, 1, 7, 1000, MIN_PIECE_BYTES // 4 + 3, 3 * MIN_PIECE_BYTES // 8, 5, 2_000_001]
    dtypes = [np.float32, np.float16, np.float64, np.uint8]
    srcs = [rng.standard_normal(n).astype(dtypes[i % 4]) for i, n in enumerate(sizes)]
    dsts = [np.zeros_like(s) for s in srcs]
    workers = Workers(threads)
    try:
        workers.copy(list(zip(dsts, srcs, strict=True)))
    finally:
        workers.close()
    for d, s in zip(dsts, srcs, strict=True):
        assert d.tobytes() == s.tobytes()


@pytest.mark.parametrize("threads", [1, 2, 5])
def test_pack_copies_sources_back_to_back(threads: int) -> None:
    # Runs of small sources (one np.concatenate each) between large ones (dealt to the
    # threads), in several destinations at once.
    rng = np.random.default_rng(0)
    big = SMALL_COPY_BYTES // 4  # float32 elements of a source that is not small
    layouts = [[1, 5, big, 3, 2, big * 3, 7], [big * 2], [4, 4, 4], [big, big], []]
    packs = []
    for sizes in layouts:
        srcs = [rng.standard_normal(n).astype(np.float32) for n in sizes]
        packs.append((np.zeros(sum(sizes), np.float32), srcs))
    workers = Workers(threads)
    try:
        workers.pack(packs)
    finally:
        workers.close()
    for dst, srcs in packs:
        expected = np.concatenate(srcs) if srcs else np.zeros(0, np.float32)
        assert dst.tobytes() == expected.tobytes()


def test_one_thread_starts_no_thread() -> None:
    before = threading.active_count()
    workers = Workers(1)
    a = np.arange(3 * MIN_PIECE_BYTES, dtype=np.uint8)
    b = np.empty_like(a)
    workers.copy([(b, a)])
    assert threading.active_count() == before
    assert workers.pieces(10 * MIN_PIECE_BYTES) == 1


def test_small_copies_stay_on_the_calling_thread() -> None:
    # 64 copies just under the limit: 16 MiB in all, and still no thread.
    before = threading.active_count()
    srcs = [np.full(SMALL_COPY_BYTES - 1, i, np.uint8) for i in range(64)]
    dsts = [np.zeros_like(a) for a in srcs]
    workers = Workers(4)
    try:
        workers.copy(list(zip(dsts, srcs, strict=True)))
        assert threading.active_count() == before
    finally:
        workers.close()
    assert all(d.tobytes() == s.tobytes() for d, s in zip(dsts, srcs, strict=True))


def test_pieces_are_never_smaller_than_the_minimum() -> None:
    workers = Workers(8)
    assert workers.pieces(MIN_PIECE_BYTES - 1) == 1
    assert workers.pieces(3 * MIN_PIECE_BYTES) == 3
    assert workers.pieces(100 * MIN_PIECE_BYTES) == 8


def test_first_error_by_position_is_raised_after_every_job_stopped() -> None:
    finished: list[int] = []

    def ok(i: int, delay_s: float) -> None:
        time.sleep(delay_s)
        finished.append(i)

    def fail(message: str) -> None:
        raise OSError(message)

    workers = Workers(3)
    try:
        jobs = [
            lambda: ok(0, 0.0),
            lambda: fail("second job"),
            lambda: ok(2, 0.2),
            lambda: fail("fourth job"),
        ]
        with pytest.raises(OSError, match=r"^second job$"):
            workers.run(jobs)
        # The slow job had finished before run() raised: nothing writes afterwards.
        assert sorted(finished) == [0, 2]
    finally:
        workers.close()


def test_auto_threads_shares_the_cpus_among_local_ranks() -> None:
    assert auto_threads(10**6) == 1
    assert 1 <= auto_threads(1) <= 8
    assert auto_threads(0) == auto_threads(1)
