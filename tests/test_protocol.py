"""The protocol's guarantees, each shown with real spawned rank processes."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gradsync
import workers
from gradsync._job import notes as _jobfiles
from gradsync._job.decisions import disagreement, settings
from gradsync._job.leader import Leader
from gradsync._job.liveness import MemberInfo
from gradsync._step.gather import own_elements
from gradsync._step.grads import nonfinite_params, validate_grads
from gradsync._step.plan import Group, Plan
from gradsync._step.transport import SHRINK_AFTER_CALLS
from ranks import Outcome, SharedRanks, run_ranks


def expected(
    world: int,
    step: int,
    offset: int = 0,
    big: bool = False,
    huge: bool = False,
    wide_sum: bool = False,
) -> list[bytes]:
    shapes = workers.SHAPES_HUGE if huge else workers.SHAPES_BIG if big else workers.SHAPES
    per_rank = [workers.grads_for(r + offset, step, shapes) for r in range(world)]
    return [a.tobytes() for a in gradsync.average_host_grads(per_rank, wide_sum=wide_sum)]


def assert_ok(results: dict[int, object]) -> None:
    bad = {r: o for r, o in results.items() if not o.ok}  # type: ignore[attr-defined]
    assert not bad, "\n".join(f"rank {r}: {o.message}\n{o.value}" for r, o in bad.items())  # type: ignore[attr-defined]


def test_reducing_from_many_small_params_looks_at_each_piece_a_bounded_number_of_times(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A rank reduces its own shard from its arrays chunk by chunk; each chunk must look
    only at the params it covers. Slicing the rest of the params' pieces off for every
    chunk made a step O(chunks x params): 143 ms more a step at 200,000 params in 512 MiB."""
    looked = 0

    class Counted(tuple[Any, ...]):
        def __getitem__(self, key: Any) -> Any:
            nonlocal looked
            item = super().__getitem__(key)
            looked += len(item) if isinstance(key, slice) else 1
            return item

    real = Group.segments
    monkeypatch.setattr(Group, "segments", lambda g, lo, hi: Counted(real(g, lo, hi)))
    params, size, chunk = 3000, 7, 64
    plan = Plan.build(tuple(("<f4", (size,)) for _ in range(params)), 2, False)
    flats = [np.arange(i * size, (i + 1) * size, dtype=np.float32) for i in range(params)]
    group = plan.groups[0]
    lo, hi = group.shards[0]
    own = own_elements(group, lo, hi, flats)
    buf = np.empty(chunk, np.float32)
    starts = range(0, hi - lo, chunk)
    got = np.concatenate([own(a, min(a + chunk, hi - lo), buf).copy() for a in starts])
    np.testing.assert_array_equal(got, np.arange(lo, hi, dtype=np.float32))
    pieces = len(real(group, lo, hi))
    assert looked <= 2 * (pieces + len(starts)), (looked, pieces, len(starts))


# -- 1. the mean, bit-identical on every rank, whatever the order and strategy -----------

STRATEGIES = [("sharded", False), ("sharded", True), ("root", False), ("root", True)]
WIDE_SUM_KINDS = [
    ("sharded", False, 1),
    ("sharded", True, 1),
    ("root", True, 1),
    ("sharded", True, 3),
]
# Every workers.average_steps job of the tests below, as (world, steps, kw): the jobs of
# one world size run one after another in one set of rank processes (see average_jobs).
AVERAGE_JOBS: list[tuple[int, int, dict[str, Any]]] = [
    *(
        (world, 3, {"strategy": strategy, "jitter_s": 0.05, "big": big, "use_mmap": use_mmap})
        for world in (2, 3)
        for strategy, big in STRATEGIES
        for use_mmap in (True, False)
    ),
    *(
        (3, 2, {"strategy": strategy, "big": big, "wide_sum": True, "threads": threads})
        for strategy, big, threads in WIDE_SUM_KINDS
    ),
    *(
        (3, 2, {"big": True, "checksums": True, "use_mmap": use_mmap, "strategy": strategy})
        for strategy in ("sharded", "root")
        for use_mmap in (True, False)
    ),
]


@pytest.fixture(scope="module")
def average_jobs(tmp_path_factory: pytest.TempPathFactory) -> SharedRanks:
    jobs = [(world, (steps, kw)) for world, steps, kw in AVERAGE_JOBS]
    return SharedRanks(workers.average_steps, jobs, tmp_path_factory.mktemp("average"))


@pytest.mark.parametrize(
    ("strategy", "big"),
    STRATEGIES,
    ids=["small-replicated", "big-sharded", "small-root", "big-root"],
)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("use_mmap", [True, False], ids=["mmap", "pread"])
def test_every_rank_gets_the_same_bits_as_average_host_grads(
    average_jobs: SharedRanks, strategy: str, big: bool, world: int, use_mmap: bool
) -> None:
    # Small payloads are reduced whole by every rank, big ones in shards or by rank 0:
    # all of them must give exactly average_host_grads's bits (float32 in float32 in
    # rank order: one multiply by 0.5 at world 2, a division at 3).
    steps = 3
    kw = {"strategy": strategy, "jitter_s": 0.05, "big": big, "use_mmap": use_mmap}
    results = average_jobs(world, steps, kw)
    assert_ok(results)
    for step in range(steps):
        want = expected(world, step, big=big)
        for r in range(world):
            assert results[r].value[step] == want, f"rank {r} step {step}"


@pytest.mark.parametrize(
    ("strategy", "big", "threads"),
    WIDE_SUM_KINDS,
    ids=["small-replicated", "big-sharded", "big-root", "big-threads"],
)
def test_float64_sums_give_every_rank_average_host_grads_bits(
    average_jobs: SharedRanks, strategy: str, big: bool, threads: int
) -> None:
    # wide_sum=True: float32 summed in float64, by whichever rank reduces each element;
    # the same bits everywhere, and not the float32 sum's.
    kw = {"strategy": strategy, "big": big, "wide_sum": True, "threads": threads}
    results = average_jobs(3, 2, kw)
    assert_ok(results)
    for step in range(2):
        want = expected(3, step, big=big, wide_sum=True)
        for r in range(3):
            assert results[r].value[step] == want, f"rank {r} step {step}"
    assert want != expected(3, 1, big=big), "no float32 param whose two sums differ"


@pytest.mark.parametrize(
    ("size", "strategy"), [(7, "sharded"), (100_000, "sharded"), (100_000, "root")]
)
def test_float64_sums_that_overflow_give_every_rank_the_finite_mean(
    tmp_path: Path, size: int, strategy: str
) -> None:
    args = [2, str(tmp_path), size, {"strategy": strategy}]
    results = run_ranks(workers.near_float64_max, 2, args)
    assert_ok(results)
    inputs = [results[r].value[0] for r in range(2)]
    [want] = gradsync.average_host_grads([[x] for x in inputs])
    assert np.isfinite(want).all()
    for r in range(2):
        assert results[r].value[1].tobytes() == want.tobytes(), r


THREADED = [
    (2, "sharded", True, False),
    (3, "sharded", True, False),
    (2, "root", True, False),
    (2, "sharded", True, True),
    (2, "sharded", False, False),
]


def _threaded(strategy: str, use_mmap: bool, checksums: bool) -> dict[str, Any]:
    return {
        "huge": True,
        "threads": 3,
        "strategy": strategy,
        "use_mmap": use_mmap,
        "checksums": checksums,
    }


@pytest.fixture(scope="module")
def threaded_jobs(tmp_path_factory: pytest.TempPathFactory) -> SharedRanks:
    jobs = [(world, (2, _threaded(*case))) for world, *case in THREADED]
    return SharedRanks(workers.average_steps, jobs, tmp_path_factory.mktemp("threaded"))


@pytest.mark.parametrize(
    ("world", "strategy", "use_mmap", "checksums"),
    THREADED,
    ids=["w2-mmap", "w3-mmap", "w2-root", "w2-checksums", "w2-pread"],
)
def test_threads_change_no_bits(
    threaded_jobs: SharedRanks, world: int, strategy: str, use_mmap: bool, checksums: bool
) -> None:
    # ~7 MiB per rank with 3 threads: copies and reductions run in pieces on workers,
    # params straddle the pieces' and the shards' boundaries.
    results = threaded_jobs(world, 2, _threaded(strategy, use_mmap, checksums))
    assert_ok(results)
    for step in range(2):
        want = expected(world, step, huge=True)
        for r in range(world):
            assert results[r].value[step] == want, f"rank {r} step {step}"


@pytest.mark.parametrize("use_mmap", [True, False], ids=["mmap", "pread"])
@pytest.mark.parametrize("strategy", ["sharded", "root"])
def test_checksums_change_no_bits(average_jobs: SharedRanks, use_mmap: bool, strategy: str) -> None:
    kw = {"big": True, "checksums": True, "use_mmap": use_mmap, "strategy": strategy}
    results = average_jobs(3, 2, kw)
    assert_ok(results)
    for step in range(2):
        for r in range(3):
            assert results[r].value[step] == expected(3, step, big=True)


def test_function_form_matches_and_needs_nothing_else(tmp_path: Path) -> None:
    results = run_ranks(workers.function_form, 2, (2, str(tmp_path), 3))
    assert_ok(results)
    for step in range(3):
        assert results[0].value[step] == results[1].value[step] == expected(2, step)


def test_float32_mean_is_within_2e6_of_float64_mean(tmp_path: Path) -> None:
    results = run_ranks(workers.average_steps, 4, (4, str(tmp_path), 1, {}))
    assert_ok(results)
    per_rank = [workers.grads_for(r, 0) for r in range(4)]
    for i, (shape, dtype) in enumerate(workers.SHAPES):
        got = np.frombuffer(results[2].value[0][i], dtype=dtype).reshape(shape)
        ref = np.mean([g[i].astype(np.float64) for g in per_rank], axis=0)
        if dtype == "float32":
            np.testing.assert_allclose(got, ref, rtol=2e-6, atol=0)


@pytest.mark.parametrize("big", [False, True])
def test_step_stats_add_up_and_print_every_phase(tmp_path: Path, big: bool) -> None:
    results = run_ranks(workers.stats_of_steps, 2, (2, str(tmp_path), big))
    assert_ok(results)
    nbytes = sum(
        g.nbytes for g in workers.grads_for(0, 0, workers.SHAPES_BIG if big else workers.SHAPES)
    )
    for r in range(2):
        for step, (stats, text) in enumerate(results[r].value):
            assert (stats.step, stats.world_size, stats.bytes_per_rank) == (step, 2, nbytes)
            phases = [
                stats.publish_s,
                stats.wait_inputs_s,
                stats.reduce_s,
                stats.wait_outputs_s,
                stats.gather_s,
            ]
            assert stats.download_s == 0.0  # numpy arrays are not downloaded
            assert min(phases) >= 0
            assert stats.total_s == pytest.approx(sum(phases), abs=1e-9)
            assert stats.last_rank in (None, 0, 1)
            waited = "" if stats.last_rank is None else f" for rank {stats.last_rank}"
            assert re.fullmatch(
                rf"step {step}: {nbytes} B/rank, total \d+\.\d\d ms \(publish \d+\.\d\d, "
                rf"wait \d+\.\d\d{waited}, reduce \d+\.\d\d, wait \d+\.\d\d, "
                rf"gather \d+\.\d\d\)",
                text,
            ), text


def test_step_stats_text_names_the_download_of_gpu_buffers() -> None:
    stats = gradsync.StepStats(
        step=7,
        world_size=2,
        bytes_per_rank=64,
        download_s=0.5e-3,
        publish_s=0.25e-3,
        total_s=0.75e-3,
        last_rank=1,
    )
    assert str(stats) == (
        "step 7: 64 B/rank, total 0.75 ms (download 0.50, publish 0.25, wait 0.00 for rank 1, "
        "reduce 0.00, wait 0.00, gather 0.00)"
    )


def test_one_rank_is_a_no_op_and_writes_nothing(tmp_path: Path) -> None:
    grads = workers.grads_for(0, 0)
    before = [g.copy() for g in grads]
    with gradsync.GradSync(gradsync.FileGradSyncConfig(1, 0, tmp_path / "sync")) as gs:
        stats = gs.average(grads)
    assert all((a == b).all() for a, b in zip(grads, before, strict=True))
    assert stats.world_size == 1
    assert not (tmp_path / "sync").exists()


def test_one_rank_with_check_finite_still_stops_a_non_finite_step(tmp_path: Path) -> None:
    # Nothing to average, but NaN/Inf must fail the step as they do with peers: a job
    # debugged on one rank would otherwise train on through them.
    grads = [np.ones(3, np.float32), np.array([1.0, np.inf], np.float16), np.array([np.nan])]
    cfg = gradsync.FileGradSyncConfig(1, 0, tmp_path / "sync", check_finite=True)
    with gradsync.GradSync(cfg) as gs, pytest.raises(gradsync.NonFiniteGradError) as info:
        gs.average(grads, step=7)
    assert str(info.value) == "step 7: non-finite gradients (NaN or Inf) in rank 0 params 1, 2"
    assert (info.value.step, info.value.ranks) == (7, (0,))
    assert not (tmp_path / "sync").exists()
    finite = [np.ones(3, np.float32)]
    with gradsync.GradSync(cfg) as gs:
        assert gs.average(finite).world_size == 1


# -- 2. never reads another run's files ---------------------------------------------------


def test_crashed_run_with_other_world_size_is_never_read(tmp_path: Path) -> None:
    # An earlier job of 3 ranks publishes step 1's inputs, then every rank dies hard.
    old = run_ranks(workers.crash_after_publish, 3, (3, str(tmp_path)), expect=[])
    assert old == {}
    (gen,) = (p for p in tmp_path.iterdir() if p.name.startswith("gen-"))
    assert sorted(p.name for p in (gen / "s-2").iterdir()) == ["in-0", "in-1", "in-2"]
    # A new job of 2 ranks in the same directory sees only its own data.
    results = run_ranks(workers.average_steps, 2, (2, str(tmp_path), 3, {}))
    assert_ok(results)
    for step in range(3):
        assert results[0].value[step] == results[1].value[step] == expected(2, step)


def test_finished_run_same_world_size_then_new_run(tmp_path: Path) -> None:
    first = run_ranks(workers.average_steps, 2, (2, str(tmp_path), 2, {}))
    assert_ok(first)
    again = run_ranks(workers.average_steps, 2, (2, str(tmp_path), 2, {}))
    assert_ok(again)
    assert again[0].value == first[0].value  # reproducible, run to run
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("gen-")] == []


def test_a_failed_rendezvous_is_removed_by_the_next_job(tmp_path: Path) -> None:
    # Rank 0 alone runs out of time; the next job on this host removes what it left at
    # once (its rank 0 has left), and leaves nothing behind itself.
    alone = run_ranks(workers.first_call, 2, (2, str(tmp_path), 0.5, -1), ranks=[0])
    assert alone[0].error_type == "PeerTimeoutError"
    assert len([p for p in tmp_path.iterdir() if p.name.startswith("gen-")]) == 1
    assert_ok(run_ranks(workers.average_steps, 2, (2, str(tmp_path), 1, {})))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rdzv"]
    assert list((tmp_path / "rdzv").iterdir()) == []


# -- 3. a dead peer is reported in seconds ------------------------------------------------


def test_a_forked_child_neither_uses_nor_closes_the_parents_session(tmp_path: Path) -> None:
    # Closing the child's copy used to write left-0 and stop nothing else: rank 1 then
    # took rank 0, late for step 1, for a rank that had closed its session.
    res = run_ranks(workers.fork_after_a_step, 2, (2, str(tmp_path)), timeout_s=60)
    assert_ok(res)
    assert res[0].value[0] == res[1].value[0] == expected(2, 1)
    assert re.fullmatch(
        r"GradSyncError: this GradSync \(rank 0\) belongs to process \d+; process \d+ is a "
        r"fork of it and cannot average with it \(create a GradSync in the child, as a rank "
        r"of its own\)",
        res[0].value[1],
    ), res[0].value[1]


@pytest.mark.parametrize("how", ["sigkill", "exit"])
def test_dead_peer_is_named_within_5_seconds(tmp_path: Path, how: str) -> None:
    results = run_ranks(
        workers.die_at_step, 3, (3, str(tmp_path), 2, 3, how), expect=[0, 1], timeout_s=60
    )
    for r in (0, 1):
        out = results[r]
        assert not out.ok
        assert out.error_type == "PeerLostError", out.value
        assert "ConnectionError" in out.attrs["mro"]
        assert re.search(
            r"^step 3: rank 2 \(pid \d+ on \S+\) has exited before publishing its gradients in ",
            out.message,
        ), out.message
        assert out.attrs["step"] == 3
        assert out.attrs["ranks"] == (2,)
        assert out.elapsed_s < 30  # includes spawn and 3 steps; detection itself is sub-second


def test_a_rank_that_never_starts_is_named_by_every_rank_that_waited(tmp_path: Path) -> None:
    # Rank 2 of 3 never starts. Rank 1, admitted by rank 0 (which starts 1.5 s later),
    # waits for the roster and runs out of time first: it names rank 2 too, not rank 0,
    # which is alive and waiting as well. Rank 0 hears of it then, before its own time
    # is up, and names rank 2 as well.
    results = run_ranks(workers.first_call, 3, (3, str(tmp_path), 3.0, 0), ranks=[0, 1])
    timeout = (
        f"rendezvous: ranks [2] did not join within 3.0 s in {tmp_path} (rank 0 admitted "
        "rank 1 and waits for them; are they running, with the same sync_dir and run_id None?)"
    )
    assert results[1].message == timeout
    assert re.fullmatch(
        r"rendezvous: rank 1 \(pid \d+ on \S+\) gave up joining: " + re.escape(timeout),
        results[0].message,
    ), results[0].message
    assert results[0].elapsed_s < 4.2  # its own time would be up at 1.5 + 3.0 s
    for r in (0, 1):
        assert results[r].error_type == "PeerTimeoutError"
        assert results[r].attrs["ranks"] == (2,)


def test_a_rank_that_died_in_the_rendezvous_can_be_replaced(tmp_path: Path) -> None:
    # Rank 1 confirms its membership and dies before rank 2 arrives; a new process for
    # rank 1 takes its place instead of being refused as a second claimant.
    results = run_ranks(
        workers.replaced_member, 4, (3, str(tmp_path)), expect=[0, 2, 3], timeout_s=60
    )
    assert_ok({r: results[r] for r in (0, 2, 3)})
    for r in (0, 2, 3):
        assert results[r].value == expected(3, 0), f"process {r}"


def test_live_straggler_times_out_naming_exactly_the_missing_rank(tmp_path: Path) -> None:
    results = run_ranks(workers.stall, 3, (3, str(tmp_path), 1, 1.5), expect=[0, 2], timeout_s=60)
    for r in (0, 2):
        out = results[r]
        assert out.error_type == "PeerTimeoutError", out.value
        assert "TimeoutError" in out.attrs["mro"]
        assert re.search(
            r"^step 1: ranks \[1\] published nothing in \S+/s-2 within 1\.5 s", out.message
        ), out.message
        assert out.attrs["ranks"] == (1,)


# -- 4. mismatches are errors, on every rank ----------------------------------------------


MISMATCHES = ["shape", "count", "dtype", "step"]


@pytest.fixture(scope="module")
def mismatch_jobs(tmp_path_factory: pytest.TempPathFactory) -> SharedRanks:
    jobs = [(3, (kind,)) for kind in MISMATCHES]
    return SharedRanks(workers.mismatched, jobs, tmp_path_factory.mktemp("mismatched"))


@pytest.mark.parametrize(
    ("kind", "pattern"),
    [
        (
            "shape",
            r"step 0: param 3: rank [01] has shape \(1000,\) float32 "
            r"but rank 2 has shape \(999,\) float32",
        ),
        ("count", r"step 0: rank [01] has 6 params but rank 2 has 5"),
        (
            "dtype",
            r"step 0: param 1: rank [01] has shape \(7,\) float16 "
            r"but rank 2 has shape \(7,\) float32",
        ),
        (
            "step",
            # Each rank names its own step first, as every step error does.
            r"^step [05]: ranks disagree on the step number in \S+: "
            r"rank 0 is at step 0, rank 1 is at step 0, rank 2 is at step 5",
        ),
    ],
)
def test_mismatch_fails_every_rank(mismatch_jobs: SharedRanks, kind: str, pattern: str) -> None:
    results = mismatch_jobs(3, kind)
    for r in range(3):
        out = results[r]
        assert out.error_type in ("MismatchError", "PeerAbortedError"), out.value
        if out.error_type == "MismatchError":
            assert re.search(pattern, out.message), out.message
    # Each rank sees every header, so each detects the mismatch itself.
    assert all(results[r].error_type == "MismatchError" for r in range(3))


SWITCHES = [(2, 0, True), (3, 3, True), (2, 2, False)]


@pytest.fixture(scope="module")
def switch_jobs(tmp_path_factory: pytest.TempPathFactory) -> SharedRanks:
    jobs = [(world, (call, use_mmap)) for world, call, use_mmap in SWITCHES]
    return SharedRanks(workers.across_the_switch, jobs, tmp_path_factory.mktemp("switch"))


@pytest.mark.parametrize(("world", "call", "use_mmap"), SWITCHES)
def test_a_mismatch_across_the_small_payload_threshold(
    switch_jobs: SharedRanks, world: int, call: int, use_mmap: bool
) -> None:
    # Below 256 KiB every rank reduces all, and inputs alternate two files; above, one
    # file a rank: the ranks look for each other's inputs under different names.
    results = switch_jobs(world, call, use_mmap)
    last = world - 1
    for r in range(world):
        assert results[r].error_type == "MismatchError", results[r].message
        assert re.fullmatch(
            rf"step {call}: param 0: rank [01] has shape \(80000,\) float32 but rank {last} "
            r"has shape \(20000,\) float32",
            results[r].message,
        ), results[r].message


def test_world_size_mismatch_at_rendezvous(tmp_path: Path) -> None:
    results = run_ranks(workers.rendezvous_world, 2, (2, str(tmp_path), [2, 3]))
    assert results[0].error_type == "MismatchError"
    assert re.search(
        r"rendezvous: rank 0 has world_size 2 but rank 1 \(pid \d+ on \S+\) has world_size 3 "
        r"in \S+; every rank must use the same world_size \(with gradsync launch it is "
        r"--nnodes x --nproc: give every node the same --nnodes and --nproc\)$",
        results[0].message,
    )
    assert results[1].error_type == "MismatchError"
    assert results[1].message == results[0].message


SETTINGS = [
    ("strategy", ["root", "sharded"], ("'root'", "'sharded'")),
    ("wide_sum", [True, False], ("True", "False")),
    # Only a publisher can flag its NaN/Inf or write its CRCs: a rank that asked for
    # the check would otherwise take a peer's unchecked data silently.
    ("check_finite", [True, False], ("True", "False")),
    ("checksums", [False, True], ("False", "True")),
    # A peer beating every 20 s was declared lost by one waiting 15 s for a beat.
    ("heartbeat_interval_s", [1.0, 2.0], ("1.0", "2.0")),
    ("heartbeat_timeout_s", [15.0, 60.0], ("15.0", "60.0")),
    # Whichever rank decides a re-form applies its own: below another's minimum, silently.
    ("min_world_size", [1, 2], ("1", "2")),
    # Compression on: whether it applies on one host decides the files' layout.
    ("compress_local", [True, False], ("True", "False")),
    # Where every rank reduces a small payload, each encoded the mean with its own
    # residual, or none: the ranks' means differed from the second step on.
    ("error_feedback", [True, False], ("True", "False")),
]


@pytest.fixture(scope="module")
def settings_jobs(tmp_path_factory: pytest.TempPathFactory) -> SharedRanks:
    jobs = [(2, (key, values)) for key, values, _ in SETTINGS]
    return SharedRanks(workers.rendezvous_settings, jobs, tmp_path_factory.mktemp("settings"))


@pytest.mark.parametrize(("key", "values", "shown"), SETTINGS)
def test_settings_mismatch_at_rendezvous(
    settings_jobs: SharedRanks, key: str, values: list[object], shown: tuple[str, str]
) -> None:
    # Both decide what the ranks read and compute: ranks that disagree fail at once, on
    # every rank and with one message, before any step reads another's files.
    results = settings_jobs(2, key, values)
    assert results[0].error_type == "MismatchError", results[0].message
    assert re.fullmatch(
        rf"rendezvous: rank 0 has {key} {re.escape(shown[0])} but rank 1 \(pid \d+ on \S+\) "
        rf"has {key} {re.escape(shown[1])} in \S+; every rank must use the same {key}",
        results[0].message,
    ), results[0].message
    assert results[1].error_type == "MismatchError"
    assert results[1].message == results[0].message


@pytest.mark.parametrize(
    ("data", "pattern"),
    [
        # A member file of a gradsync that sent no settings: it may sum differently.
        (
            {"world_size": 2},
            r"rendezvous: rank 1 \(pid \d+ on \S+\) sent no settings \(strategy, wide_sum, "
            r"compression, check_finite, checksums, heartbeat_interval_s, "
            r"heartbeat_timeout_s\) in \S+: it runs an older gradsync; every rank must run "
            r"the same gradsync version",
        ),
        # Settings without one of the keys this gradsync needs agreed on.
        (
            {"world_size": 2, "settings": {"strategy": "sharded"}},
            r"rendezvous: rank 0 has wide_sum False but rank 1 \(pid \d+ on \S+\) has "
            r"wide_sum None in \S+; every rank must use the same wide_sum",
        ),
    ],
    ids=["no-settings", "missing-key"],
)
def test_member_without_settings_is_refused(
    tmp_path: Path, data: dict[str, object], pattern: str
) -> None:
    cfg = gradsync.FileGradSyncConfig(2, 0, tmp_path)
    joiner = MemberInfo.for_self(1, "1" * 16)
    error = disagreement(cfg, joiner, {"member": joiner.to_json(), **data})
    assert isinstance(error, gradsync.MismatchError)
    assert re.fullmatch(pattern, str(error)), str(error)
    assert error.ranks == (0, 1)
    assert error.path == str(tmp_path)
    same = {"strategy": "sharded", "wide_sum": False, "check_finite": False}
    heartbeat = {"heartbeat_interval_s": 1.0, "heartbeat_timeout_s": 15.0}
    same = {**same, "checksums": False, **heartbeat}
    assert disagreement(cfg, joiner, {"world_size": 2, "settings": same}) is None


def test_rank_0_reads_each_confirmation_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Rank 0 looks for confirmations until every rank has one; reading the ones it has
    # again on every look cost ~800 file reads to form a 16-rank job.
    cfg = gradsync.FileGradSyncConfig(4, 0, tmp_path)
    leader = Leader(cfg, MemberInfo.for_self(0, "0" * 16))
    leader.gen_path.mkdir()

    def confirm(rank: int) -> None:
        member = MemberInfo.for_self(rank, str(rank) * 16)
        data = {"member": member.to_json(), "world_size": 4, "settings": settings(cfg)}
        (leader.gen_path / f"member-{rank}-{member.nonce}.json").write_text(json.dumps(data))

    real_load = _jobfiles.load
    loaded: list[str] = []

    def counted(path: Path) -> Any:
        loaded.append(path.name)
        return real_load(path)

    monkeypatch.setattr(_jobfiles, "load", counted)
    confirm(1)
    leader.collect()
    confirm(2)
    leader.collect()
    leader.collect()
    assert sorted(leader.confirmed) == [1, 2]
    assert loaded == [f"member-1-{'1' * 16}.json", f"member-2-{'2' * 16}.json"]


def test_two_processes_claiming_one_rank(tmp_path: Path) -> None:
    # Processes 0, 1 and 2 start as ranks 0, 1, 1 of a 2-rank job: whichever way the
    # race goes, the process that lost it fails, naming the rank and both claimants.
    results = run_ranks(_claims, 3, (str(tmp_path),))
    errors = [o for o in results.values() if not o.ok]
    assert errors, "a duplicate rank went unnoticed"
    assert all(o.error_type == "RendezvousError" for o in errors), [o.message for o in errors]
    pattern = (
        r"two processes claim rank 1: pid \d+ on \S+ and pid \d+ on \S+"
        r"|rank 1 is already taken by pid \d+"
    )
    assert all(re.search(pattern, o.message) for o in errors), [o.message for o in errors]
    # Never a mixed job: if anyone succeeded, it was ranks 0 and exactly one claimant.
    assert len([o for o in results.values() if o.ok]) in (0, 2)


def _claims(rank: int, sync_dir: str) -> object:
    return workers.claim(rank, 2, sync_dir, [0, 1, 1][rank])


def test_nan_check_names_rank_and_param_on_every_rank(tmp_path: Path) -> None:
    results = run_ranks(workers.with_nan, 2, (2, str(tmp_path), True))
    for r in range(2):
        assert results[r].error_type == "NonFiniteGradError"
        assert results[r].message.startswith(
            "step 0: non-finite gradients (NaN or Inf) in rank 1 param 1"
        )
    off = run_ranks(workers.with_nan, 2, (2, str(tmp_path), False))
    assert_ok(off)
    got = np.frombuffer(off[0].value[1], dtype=np.float16)
    assert np.isnan(got[2])
    assert np.isfinite(np.delete(got, 2)).all()


@pytest.mark.parametrize(
    ("limit", "message"),
    [
        (
            "MAX_PARAMS",
            "step 1: 3 params, more than the 2 a gradsync file describes: concatenate "
            "small params into fewer arrays",
        ),
        (
            "MAX_META",
            "step 1: the gradients' layout takes 63 bytes in the file header, more than "
            "the 60 a header holds: concatenate small params into fewer arrays",
        ),
    ],
)
def test_a_layout_past_the_header_limits_is_refused_before_publishing(
    tmp_path: Path, limit: str, message: str
) -> None:
    # Readers used to take such a file for corrupt (CorruptFileError, no step named).
    results = run_ranks(workers.over_header_limits, 2, (2, str(tmp_path), limit))
    for r in range(2):
        assert (results[r].error_type, results[r].message) == ("InvalidGradsError", message)


def test_buffers_for_a_layout_past_the_header_limit_name_no_step(tmp_path: Path) -> None:
    # buffers_like sizes a header before any step: its refusal said "step 0:".
    results = run_ranks(workers.buffers_past_the_header_limit, 2, (2, str(tmp_path)))
    for r in range(2):
        assert results[r].value == (
            "InvalidGradsError",
            "the gradients' layout takes 78 bytes in the file header, more than the 60 a "
            "header holds: concatenate small params into fewer arrays",
        )


def test_buffers_for_a_layout_near_the_header_limit_without_check_finite(
    tmp_path: Path,
) -> None:
    # buffers_like sizes the header for every param flagged non-finite, a list only
    # check_finite writes: without it, a layout whose header fits was refused.
    results = run_ranks(workers.buffers_near_the_header_limit, 2, (2, str(tmp_path)))
    assert_ok(results)
    for step in range(2):
        want = b"".join(
            np.full(512, (0 + 1) / 2 + step + i, np.float32).tobytes() for i in range(150)
        )
        assert results[0].value[step] == results[1].value[step] == want


def test_bad_input_on_one_rank_fails_the_peers_fast(tmp_path: Path) -> None:
    results = run_ranks(workers.bad_input, 2, (2, str(tmp_path)))
    assert results[1].error_type == "InvalidGradsError"
    assert "param 0 (shape (3, 3)) is not C-contiguous" in results[1].message
    assert results[0].error_type == "PeerAbortedError"
    assert re.search(
        r"^step 1: rank 1 \(pid \d+ on \S+\) gave up on this step: param 0", results[0].message
    )
    assert results[0].elapsed_s < 20


@pytest.mark.parametrize("use_mmap", [True, False], ids=["mmap", "pread"])
def test_a_thousand_params_whose_header_outgrows_the_first_read(
    tmp_path: Path, use_mmap: bool
) -> None:
    # 1100 params: the layout in each input file's header takes ~20 KiB, more than a
    # reader's first read of a peer's file, and the NaN list of step 1 more still.
    results = run_ranks(
        workers.many_params, 2, (2, str(tmp_path), {"use_mmap": use_mmap, "check_finite": True})
    )
    assert_ok(results)
    per_rank = [workers.grads_for(r, 0, workers.SHAPES_MANY) for r in range(2)]
    want = b"".join(a.tobytes() for a in gradsync.average_host_grads(per_rank))
    for r in range(2):
        mean, error = results[r].value
        assert mean == want, f"rank {r}"
        assert error == (
            "step 1: non-finite gradients (NaN or Inf) in rank 1 params 0, 1, 2, 3, 4, 5, 6, "
            "7, 8, 9 and 1090 more"
        )


@pytest.mark.parametrize(
    ("worker", "listing"),
    [
        # A million NaN params used to push the header past its limit: InvalidGradsError
        # ("concatenate small params") instead of NonFiniteGradError.
        (workers.nonfinite_past_the_header_limit, "0, 1, 2, 3, 4, 5, 6, 7, 8, 9 and 140 more"),
        # buffers_like sized its header for params 0-9 listed: the header of params
        # 316-325 outgrew its room (a bare ValueError from encode_header).
        (
            workers.buffers_with_the_last_params_nonfinite,
            "316, 317, 318, 319, 320, 321, 322, 323, 324, 325 and 1 more",
        ),
    ],
    ids=["past-the-header-limit", "buffers-last-params"],
)
def test_a_long_nonfinite_list_is_counted_not_listed(
    tmp_path: Path, worker: Callable[..., Any], listing: str
) -> None:
    results = run_ranks(worker, 2, (2, str(tmp_path)))
    message = f"step 0: non-finite gradients (NaN or Inf) in rank 1 params {listing}"
    assert results[0].value == results[1].value == ("NonFiniteGradError", message)


_INT64 = "param 0 has dtype int64; gradsync averages only float16, float32, float64"


@pytest.mark.parametrize(
    ("how", "error_type", "message"),
    [
        ("average", "InvalidGradsError", _INT64),
        ("buffers_like", "InvalidGradsError", _INT64),
        ("step", "ConfigError", "step must be an int, got 0.5"),
        ("unforeseen", "RuntimeError", "RuntimeError: these flags cannot be read"),
    ],
)
def test_bad_input_in_a_first_call_fails_the_peers_fast(
    tmp_path: Path, how: str, error_type: str, message: str
) -> None:
    # The bad rank has not met its peers yet: it meets them to tell them, then raises.
    results = run_ranks(workers.bad_first_call, 2, (2, str(tmp_path), how))
    assert results[1].error_type == error_type
    # Its own error names the step of the call (buffers_like has none); its peers' does too.
    own = {"average": f"step 0: {message}", "unforeseen": "these flags cannot be read"}
    assert results[1].message == own.get(how, message)
    assert results[0].error_type == "PeerAbortedError", results[0].message
    assert re.fullmatch(
        rf"step 0: rank 1 \(pid \d+ on \S+\) gave up on this step: {re.escape(message)}",
        results[0].message,
    ), results[0].message
    assert results[0].elapsed_s < 10


@pytest.mark.parametrize("how", ["close late", "drop", "function"])
def test_a_new_session_of_the_same_job_after_a_failed_step(tmp_path: Path, how: str) -> None:
    # docs/errors.md's recovery: after a failed step every rank starts a new session. The
    # failed one has left the job by then, even where it is closed late or never.
    results = run_ranks(workers.recover_after_failure, 2, (2, str(tmp_path), how))
    assert_ok(results)
    for r in range(2):
        assert results[r].value == expected(2, 5), f"rank {r}"


# -- 5. disk use is bounded ------------------------------------------------------------


def test_at_most_three_steps_on_disk_and_clean_shutdown_removes_the_run(tmp_path: Path) -> None:
    results = run_ranks(workers.count_step_dirs, 2, (2, str(tmp_path), 12))
    assert_ok(results)
    per_step = sum(g.nbytes for g in workers.grads_for(0, 0))
    for r in range(2):
        most_dirs, most_bytes, gen_dir = results[r].value
        assert most_dirs <= 3
        # Two slots of every rank's input and shard of the mean, plus headers.
        assert most_bytes <= 2 * 2 * (per_step + per_step // 2 + 2 * 4096)
        assert not Path(gen_dir).exists()


@pytest.mark.parametrize(
    ("plans", "created"),
    [
        ("bbbbbbb", ["in-{r}", "out-{r}"] * 2),  # calls 1 and 2; later calls move them
        ("sssssss", ["in-{r}"] * 2),
        # A replicated call publishes no out marker, so a sharded call two calls later
        # has none to move (call 6 here) and creates one.
        ("bsbsbbs", ["in-{r}", "out-{r}", "in-{r}", "out-{r}"]),
    ],
)
def test_markers_are_moved_from_call_to_call(
    tmp_path: Path, plans: str, created: list[str]
) -> None:
    results = run_ranks(workers.marker_creates, 2, (2, str(tmp_path), plans))
    assert_ok(results)
    per_rank = [results[r].value[2] for r in range(2)]
    for r in range(2):
        names, most_dirs, _, _ = results[r].value
        assert names == [n.format(r=r) for n in created]
        assert most_dirs <= 3
    for step, kind in enumerate(plans):
        for r in range(2):
            assert per_rank[r][step] == expected(2, step, big=kind == "b")


def test_alternating_layouts_build_each_plan_once(tmp_path: Path) -> None:
    # Two models averaged in turn (a GAN's, say): a plan per layout, not one per call.
    plans = "bsbsbsbs"
    results = run_ranks(workers.marker_creates, 2, (2, str(tmp_path), plans))
    assert_ok(results)
    for r in range(2):
        assert results[r].value[3] == 2
        for step, kind in enumerate(plans):
            assert results[r].value[2][step] == expected(2, step, big=kind == "b")


def test_alternating_sizes_keep_the_larger_file_and_shrink_once_small_for_long(
    tmp_path: Path,
) -> None:
    # DDP's buckets alternate sizes: resizing the mapped file every call faulted in its
    # pages again (a 4 MiB call 1.2 -> 4.4 ms). Readers take the longer file by its header.
    plans = "hbhbhb" + "b" * SHRINK_AFTER_CALLS
    results = run_ranks(workers.own_file_sizes, 2, (2, str(tmp_path), plans))
    assert_ok(results)
    for r in range(2):
        per_call, files = results[r].value
        for step, kind in enumerate(plans):
            assert per_call[step] == expected(2, step, big=True, huge=kind == "h"), step
        assert len(set(map(tuple, files[:6]))) == 1, files[:6]  # same inodes, same sizes
        assert files[-1][0][1] < files[5][0][1], "the input file never shrank"
        assert files[-1][1][1] < files[5][1][1], "the output file never shrank"


def test_a_layout_change_never_overwrites_a_file_still_being_read(tmp_path: Path) -> None:
    # A small call (two slots) leaves readers behind; the big call after it used to
    # write its input into slot 0 while they read it ("belongs to another run or call").
    results = run_ranks(workers.late_reader_across_plans, 2, (2, str(tmp_path)))
    assert_ok(results)
    for step, big in enumerate((True, False, True)):
        for r in range(2):
            assert results[r].value[step] == expected(2, step, big=big)


def _assert_three_calls_averaged(results: dict[int, Outcome]) -> None:
    assert_ok(results)
    for step in range(3):
        for r in range(2):
            assert results[r].value["results"][step] == expected(2, step, big=True)


@pytest.mark.parametrize(
    ("world", "local_ranks", "huge"),
    [(2, [], False), (3, [0], False), (2, [], True), (3, [], True), (3, [0], True)],
    ids=["shared", "one-host-local", "shared-big", "shared-big-3-ranks", "one-host-local-big"],
)
def test_across_hosts_each_call_has_data_files_of_its_own(
    tmp_path: Path, world: int, local_ranks: list[int], huge: bool
) -> None:
    # A file rewritten in place piles up JuiceFS slices that readers merge: across
    # hosts each call writes new files and removes its own of two calls before. Past
    # 1 MiB a shard an input is a file for each peer, holding only what that peer
    # reduces (a reader of a range fetches whole blocks). A rank whose filesystem is
    # local (an NFS server's host) reuses its files: peers find them all the same.
    args = (world, str(tmp_path / "sync"), local_ranks, huge)
    results = run_ranks(workers.per_call_files, world, args)
    assert_ok(results)
    for step in range(5):
        for r in range(world):
            want = expected(world, step, big=step != 2 and not huge, huge=step != 2 and huge)
            assert results[r].value["results"][step] == want

    def written(seq: int) -> list[str]:
        if seq == 3:  # small: every rank reduces all of every input, and no shard is published
            return ["d-1-c3.in"]
        if not huge:
            return [f"d-1-c{seq}.in", f"d-1-c{seq}.out"]
        return [f"d-1-c{seq}-s{q}.in" for q in range(world) if q != 1] + [f"d-1-c{seq}.out"]

    # After call seq (step + 1) a rank's own files of calls seq-1 and seq are left.
    for step, names in enumerate(results[1].value["files"][1:], start=1):
        mine = [n for n in names if n.startswith("d-1-")]
        assert mine == sorted(written(step) + written(step + 1)), names


def test_a_stale_view_of_a_peers_file_is_looked_at_again(tmp_path: Path) -> None:
    # A shared filesystem may show one host a rewritten file's previous contents for a
    # moment after the marker (JuiceFS did, to one of two ranks opening it at once).
    results = run_ranks(workers.stale_view, 2, (2, str(tmp_path / "sync"), 3, 30.0))
    _assert_three_calls_averaged(results)


def test_a_stale_view_is_given_max_wait_s_from_when_the_marker_was_seen(
    tmp_path: Path,
) -> None:
    # Rank 0 publishes its last call 1.5 s into rank 1's 3 s wait, and rank 1 sees its
    # file stale for 2 s after: the old limit (from the wait's start) failed the step.
    args = (2, str(tmp_path / "sync"), 0, 3.0, 2.0, 1.5)
    _assert_three_calls_averaged(run_ranks(workers.stale_view, 2, args))


def _shown_wrong_for_good(tmp_path: Path, shared: bool, missing: bool, error: str) -> Outcome:
    """Rank 1 is shown rank 0's input of call 3 as of call 1 (or, ``missing``, not at
    all) for good, on a filesystem it takes for shared or local: rank 1's outcome,
    checked to be ``error`` naming that file, on a local one at once."""
    wait_s = 1.0 if shared else 20.0
    args = (2, str(tmp_path / "sync"), 10**9, wait_s, 0.0, 0.0, missing, 30.0, shared)
    results = run_ranks(workers.stale_view, 2, args)
    out = results[1]
    assert out.error_type == error, out.value
    assert out.attrs["path"].endswith("/d-0-c3.in" if shared else "/d-0.in")
    if not shared:
        assert out.elapsed_s < wait_s / 2
    assert not results[0].ok
    return out


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "local"])
def test_a_view_that_stays_stale_fails_the_step_naming_the_file(
    tmp_path: Path, shared: bool
) -> None:
    # On a shared filesystem only after max_wait_s; on a local one at once: nothing there
    # shows a file late, so it was overwritten (before, the local one waited max_wait_s).
    out = _shown_wrong_for_good(tmp_path, shared, False, "CorruptFileError")
    path = re.escape(str(out.attrs["path"]))
    if shared:
        assert re.fullmatch(
            rf"step 2: rank 0's file {path} still holds call 1, not call 3, 1.0 s after rank 1 "
            r"first saw its marker of call 3 \(ranks \[0\]\): rank 1's host is shown stale "
            r"contents of the shared filesystem",
            out.message,
        ), out.message
    else:
        assert re.fullmatch(
            rf"step 2: rank 0's file {path} holds call 1 behind its marker of call 3: "
            r"something overwrote it \(a host-local filesystem shows no file late\)",
            out.message,
        ), out.message
    assert (out.attrs["step"], out.attrs["ranks"]) == (2, (0,))


@pytest.mark.parametrize("late", [0, 2])
def test_ranks_waiting_to_form_a_job_say_for_whom_and_what_to_check(
    tmp_path: Path, late: int
) -> None:
    results = run_ranks(workers.rendezvous_warnings, 3, (3, str(tmp_path), late))
    assert_ok(results)
    sync = re.escape(str(tmp_path))
    check = r", with the same sync_dir and run_id None\?\)"

    def joining(r: int) -> tuple[str, str]:
        """Rank r's warnings: waiting for rank 0; admitted, waiting for every rank."""
        waited = rf"rank {r} has waited \d+\.\d s for rank 0 "
        return (
            rf"{waited}\(is it running{check} in {sync}",
            rf"{waited}to admit every rank \(are they all running{check} in {sync}",
        )

    # A rank > 0 waits for rank 0 (first), then, once admitted, for rank 0 to admit all.
    # Which of them a warning comes in depends on the machine's load, not their order.
    # Rank 2 late: rank 0 waits for it (and rank 1, admitted or not yet, warns too).
    # Rank 0 late: ranks 1 and 2 warn that they wait for it, first of all.
    for r in {2: [1], 0: [1, 2]}[late]:
        warned = results[r].value
        assert warned, f"rank {r} warned nothing"
        either = "(?:{}|{})".format(*joining(r))
        assert all(re.fullmatch(f"rendezvous: {either}", w) for w in warned), warned
        if late == 0:
            assert re.fullmatch(f"rendezvous: {joining(r)[0]}", warned[0]), warned
        else:
            assert re.fullmatch(f"rendezvous: {joining(r)[1]}", warned[-1]), warned
    if late == 2:
        rank_0 = (
            rf"rank 0 has waited \d+\.\d s for ranks \[2\] to join in {sync} \(are they "
            r"running, with the same sync_dir and run_id None\?\)"
        )
        assert results[0].value, "rank 0 warned nothing"
        assert all(re.fullmatch(f"rendezvous: {rank_0}", w) for w in results[0].value)
    assert results[late].value == []


def _ended_while_joining(sync_dir: Path, notes: list[tuple[int, str]]) -> Path:
    """Launchers' notes (rdzv/ended-<rank>-<run id>.json) of ranks that ended while
    waiting to join runs; the rdzv directory."""
    rdzv = sync_dir / "rdzv"
    rdzv.mkdir()
    for rank, run_id in notes:
        member = MemberInfo.for_self(rank, "00000000000000aa").to_json()
        note = {"member": member, "run_id": run_id, "ended": "has ended (exit code 1)"}
        (rdzv / f"ended-{rank}-{run_id}.json").write_text(json.dumps({**note, "at": time.time()}))
    return rdzv


def test_a_formed_job_removes_what_launchers_said_of_its_run_before(tmp_path: Path) -> None:
    # Once the job is formed those ranks were replaced; another run's notes stay for
    # its rank 0.
    rdzv = _ended_while_joining(tmp_path, [(1, "split"), (1, "other")])
    assert_ok(run_ranks(workers.one_call, 2, (2, str(tmp_path), "split")))
    assert sorted(p.name for p in rdzv.glob("ended-*")) == ["ended-1-other.json"]


def test_a_rank_joining_again_clears_what_was_said_of_its_earlier_process(
    tmp_path: Path,
) -> None:
    rdzv = _ended_while_joining(tmp_path, [(1, "split"), (2, "split"), (1, "other")])
    cfg = gradsync.FileGradSyncConfig(3, 1, tmp_path, run_id="split", max_wait_s=0.3)
    with pytest.raises(gradsync.PeerTimeoutError), gradsync.GradSync(cfg) as gs:
        gs.average([np.ones(4)])  # rank 0 never comes
    assert sorted(p.name for p in rdzv.glob("ended-*")) == [
        "ended-1-other.json",
        "ended-2-split.json",
    ]


def test_a_file_not_yet_shown_behind_its_marker_is_looked_for_again(tmp_path: Path) -> None:
    # NFS caches that a name is absent: a host that looked the name up before a peer
    # created the file can be told it is not there for up to a minute after.
    args = (2, str(tmp_path / "sync"), 0, 5.0, 2.0, 0.0, True, 1.0)
    results = run_ranks(workers.stale_view, 2, args)
    _assert_three_calls_averaged(results)
    sync = re.escape(str(tmp_path / "sync"))
    waits = [
        re.fullmatch(
            r"step 2: rank 1 has waited \d+\.\d s for ranks \[0\] \(alive\) to publish "
            rf"gradients in {sync}/gen-[0-9a-f]+/s-3 \(ranks \[0\] did, but this host is "
            r"shown stale contents of their files\)",
            w,
        )
        for w in results[1].value["warnings"]
    ]
    assert waits, "rank 1 logged no warning"
    assert all(waits), results[1].value["warnings"]


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "local"])
def test_a_file_missing_behind_its_marker_fails_the_step_naming_it(
    tmp_path: Path, shared: bool
) -> None:
    # On a shared filesystem only after max_wait_s; on a local one at once: nothing
    # there can show a file late, so it was removed.
    out = _shown_wrong_for_good(tmp_path, shared, True, "SyncDirError")
    assert out.attrs["errno"] == errno.ENOENT
    path = re.escape(str(out.attrs["path"]))
    if shared:
        assert re.fullmatch(
            rf"step 2: rank 0's file {path} is not there 1.0 s after rank 1 first saw "
            r"its marker of call 3 \(ranks \[0\]\): rank 1's host is shown stale contents "
            r"of the shared filesystem",
            out.message,
        ), out.message
        assert (out.attrs["step"], out.attrs["ranks"]) == (2, (0,))
    else:
        assert re.fullmatch(
            rf"step 2: opening {path} failed: No such file or directory", out.message
        ), out.message


@pytest.mark.parametrize(
    "kw",
    [{}, {"strategy": "root"}, {"checksums": True}, {"use_mmap": False}],
    ids=["sharded", "root", "checksums", "pread"],
)
def test_layouts_that_change_at_random_under_random_delays(
    tmp_path: Path, kw: dict[str, object]
) -> None:
    results = run_ranks(workers.shifting_layouts, 3, (3, str(tmp_path), 7, 24, kw))
    assert_ok(results)
    plans = results[0].value[0]
    for call, plan in enumerate(plans):
        want = expected(3, call, big=plan != "small")
        for r in range(3):
            assert results[r].value[1][call] == want, (call, plan, r)


# -- 7. bad environment -----------------------------------------------------------------


def test_sync_dir_that_cannot_be_created(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    cfg = gradsync.FileGradSyncConfig(2, 0, blocker / "sync", max_wait_s=1.0)
    with gradsync.GradSync(cfg) as gs, pytest.raises(gradsync.SyncDirError) as info:
        gs.average(workers.grads_for(0, 0))
    assert isinstance(info.value, OSError)
    assert info.value.errno == errno.ENOTDIR
    assert (
        str(info.value)
        == f"sync_dir {blocker}/sync cannot be created: {blocker} is not a directory"
    )


def test_a_sync_dir_that_is_a_file_is_named(tmp_path: Path) -> None:
    # mkdir said only "File exists", of the rendezvous directory inside it.
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    cfg = gradsync.FileGradSyncConfig(2, 0, blocker, max_wait_s=1.0)
    with gradsync.GradSync(cfg) as gs, pytest.raises(gradsync.SyncDirError) as info:
        gs.average([np.ones(2)])
    assert (str(info.value), info.value.errno) == (
        f"sync_dir {blocker} is not a directory",
        errno.ENOTDIR,
    )


def test_a_missing_sync_dir_is_created_with_its_parents(tmp_path: Path) -> None:
    # As docs/errors.md says: missing is no SyncDirError, a file in its way is.
    sync_dir = tmp_path / "a" / "b" / "sync"
    cfg = gradsync.FileGradSyncConfig(2, 0, sync_dir, max_wait_s=0.3)
    with gradsync.GradSync(cfg) as gs, pytest.raises(gradsync.PeerTimeoutError):
        gs.average([np.ones(2)])
    assert sync_dir.is_dir()


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs, to be filled by the test."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.system(f"mount -t tmpfs -o size=2m tmpfs {mnt} 2>/dev/null") != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root and CAP_SYS_ADMIN)")
    try:
        yield mnt
    finally:
        os.system(f"umount {mnt}")


def test_full_disk_is_a_sync_dir_error(tmp_path: Path, small_tmpfs: Path) -> None:
    results = run_ranks(_big_average, 2, (str(small_tmpfs),))  # 4 MiB a rank
    for r in range(2):
        assert results[r].error_type in ("SyncDirError", "PeerAbortedError"), results[r].value
    failed = [o for o in results.values() if o.error_type == "SyncDirError"]
    assert failed
    assert all(o.attrs["errno"] == 28 for o in failed)
    assert all("(the sync directory's filesystem is full)" in o.message for o in failed)
    assert all(o.elapsed_s < 15 for o in results.values())
    # The same job in a roomy directory then works.
    again = run_ranks(_big_average, 2, (str(tmp_path / "roomy"),))
    assert_ok(again)


def test_a_rank_that_finds_the_disk_full_tells_its_peers(small_tmpfs: Path) -> None:
    # The abort note's reason does not fit on the disk, but its name does: rank 0 used to
    # wait out max_wait_s (20 s) for a rank that stayed alive.
    results = run_ranks(workers.disk_fills_mid_job, 2, (2, str(small_tmpfs)))
    assert results[1].error_type == "SyncDirError"
    assert "(the sync directory's filesystem is full)" in results[1].message
    assert results[0].error_type == "PeerAbortedError"
    assert re.fullmatch(
        r"step 1: rank 1 \(pid \d+ on \S+\) gave up on this step: \(its note is empty: no "
        r"room for the reason; is the sync directory's disk full\?\)",
        results[0].message,
    ), results[0].message
    assert results[0].elapsed_s < 4


def test_closing_on_a_full_disk_removes_the_job(small_tmpfs: Path) -> None:
    # Closing writes a leave note per rank, whose bytes no longer fit: the job's files
    # used to stay, and no later job on that disk could start (its leader file did not
    # fit either).
    assert_ok(run_ranks(workers.close_on_a_full_disk, 2, (2, str(small_tmpfs))))
    assert sorted(p.name for p in small_tmpfs.rglob("*")) == [".filler", "rdzv"]


def test_a_rank_0_that_cannot_register_leaves_nothing_behind(small_tmpfs: Path) -> None:
    # Its generation directory used to stay until a later rank 0 had waited out its
    # heartbeat (15 s), which jobs shorter than that never did.
    workers.fill_disk(str(small_tmpfs))
    results = run_ranks(workers.average_steps, 2, (2, str(small_tmpfs), 1, {}), ranks=[0])
    assert results[0].error_type == "SyncDirError"
    assert re.fullmatch(
        rf"registering rank 0 in {small_tmpfs}/rdzv/leader-[0-9a-f]+\.json failed: No space "
        r"left on device \(the sync directory's filesystem is full\)",
        results[0].message,
    ), results[0].message
    assert sorted(p.name for p in small_tmpfs.rglob("*")) == [".filler", "rdzv"]


def test_rank_0s_empty_abort_note_still_ends_the_rendezvous(small_tmpfs: Path) -> None:
    # Its reason did not fit on the full disk: rank 1 used to wait for rank 0's process
    # to exit (or out max_wait_s, 20 s).
    results = run_ranks(
        workers.rendezvous_fails_on_a_full_disk, 3, (3, str(small_tmpfs)), ranks=[0, 1]
    )
    assert results[0].error_type == "PeerTimeoutError"
    assert (results[1].error_type, results[1].message) == (
        "PeerAbortedError",
        "rendezvous failed on rank 0: (its note is empty: no room for the reason; is the "
        "sync directory's disk full?)",
    )
    assert results[1].elapsed_s < 5


def test_a_rank_that_fails_after_its_offer_tells_rank_0(tmp_path: Path) -> None:
    # Its join file goes when it fails: rank 0, which had offered it a place, used to
    # wait out max_wait_s (20 s) and then say it had not joined.
    results = run_ranks(workers.membership_not_written, 2, (2, str(tmp_path)))
    assert results[1].error_type == "SyncDirError"
    assert results[0].error_type == "PeerAbortedError"
    assert re.fullmatch(
        r"rendezvous: rank 1 \(pid \d+ on \S+\) gave up joining: confirming membership in "
        rf"{tmp_path}/gen-[0-9a-f]+/member-1-[0-9a-f]+\.json failed: No space left on "
        r"device \(the sync directory's filesystem is full\)",
        results[0].message,
    ), results[0].message
    assert results[0].elapsed_s < 10


def _big_average(rank: int, sync_dir: str) -> None:
    with gradsync.GradSync(gradsync.FileGradSyncConfig(2, rank, sync_dir, max_wait_s=20)) as gs:
        gs.average([np.ones(1 << 20, dtype=np.float32)])


def test_empty_grads_list(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The test mode: the rank meets its absent peer to tell it for 0.2 s, not 10 s.
    monkeypatch.setenv("GRADSYNC_TEST_WAIT_S", "0.2")
    with (
        gradsync.GradSync(gradsync.FileGradSyncConfig(2, 0, tmp_path)) as gs,
        pytest.raises(
            gradsync.InvalidGradsError,
            match=r"^step 3: grads is empty: pass at least one gradient array$",
        ) as info,
    ):
        gs.average([], step=3)
    # A rank's own input error names its call's step and itself, as its peers' does.
    assert (info.value.step, info.value.ranks) == (3, (0,))
    (told,) = [r.getMessage() for r in caplog.records if "could not tell" in r.getMessage()]
    assert re.fullmatch(
        r"rank 0 could not tell its peers why it failed: rendezvous: ranks \[1\] did not join "
        rf"within 0\.2 s in {re.escape(str(tmp_path))} \(.*\)",
        told,
    ), told


def test_a_bad_test_wait_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("GRADSYNC_TEST_WAIT_S", "soon")
    cfg = gradsync.FileGradSyncConfig(2, 0, tmp_path)
    with gradsync.GradSync(cfg) as gs, pytest.raises(gradsync.InvalidGradsError):
        gs.average([])
    assert [r.getMessage() for r in caplog.records if "could not tell" in r.getMessage()] == [
        "rank 0 could not tell its peers why it failed: environment variable "
        "GRADSYNC_TEST_WAIT_S must be a number, got 'soon'"
    ]


# -- 8. what a step accepts -------------------------------------------------------------


def _read_only() -> np.ndarray:
    a = np.zeros(3, np.float32)
    a.flags.writeable = False
    return a


@pytest.mark.parametrize(
    ("grads", "message"),
    [
        (np.zeros(3), "grads must be a sequence (list or tuple) of numpy arrays, got ndarray"),
        ([], "grads is empty: pass at least one gradient array"),
        (
            [np.zeros(2), [1.0, 2.0]],
            "param 1 is a list, not a numpy array (averaging is in place, so a converted "
            "copy would never reach you)",
        ),
        (
            [np.zeros(2, np.int64)],
            "param 0 has dtype int64; gradsync averages only float16, float32, float64",
        ),
        ([np.zeros(2), np.zeros(2, ">f4")], "param 1 has non-native byte order >f4"),
        (
            [np.zeros((3, 3), np.float32).T],
            "param 0 (shape (3, 3)) is not C-contiguous; averaging is in place, so make the "
            "gradient itself contiguous and pass it (torch: p.grad = p.grad.contiguous(), then "
            "p.grad.numpy()); np.ascontiguousarray(g) would average a copy that the optimizer "
            "never sees",
        ),
        ([_read_only()], "param 0 (shape (3,)) is read-only"),
    ],
    ids=["array", "empty", "list", "int", "big-endian", "transposed", "read-only"],
)
def test_unusable_grads_are_named(grads: object, message: str) -> None:
    with pytest.raises(gradsync.InvalidGradsError, match=f"^{re.escape(message)}$"):
        validate_grads(grads)


_FLAT = np.zeros(16, np.float32)
_OWN = np.zeros(4)
_VIEWS = "views of overlapping memory"


def _through_torch() -> list[np.ndarray]:
    # Two arrays of one memory whose bases differ (each the tensor it came from).
    torch = pytest.importorskip("torch")
    return [torch.from_numpy(_OWN).numpy(), torch.from_numpy(_OWN[1:]).numpy()]


@pytest.mark.parametrize(
    ("grads", "pair", "what"),
    [
        # The case: a float32 and a float64 view of one memory gave different bits.
        (lambda: [np.zeros(3), _FLAT[:8], _FLAT[:8].view(np.float64)], (1, 2), _VIEWS),
        (lambda: [_OWN, np.ones(2), _OWN], (0, 2), "the same array"),
        (lambda: [_FLAT[8:], _FLAT[:4], _FLAT[3:6]], (1, 2), _VIEWS),
        (lambda: [_FLAT[15:], _FLAT], (0, 1), _VIEWS),
        (_through_torch, (0, 1), _VIEWS),
    ],
    ids=["float32-and-float64-views", "same-array-twice", "slices", "slice-and-whole", "torch"],
)
def test_params_sharing_memory_are_invalid_grads(
    grads: Callable[[], list[np.ndarray]], pair: tuple[int, int], what: str
) -> None:
    message = (
        f"params {pair[0]} and {pair[1]} are {what}: averaging is in place, so each gradient "
        "must be passed once, in memory of its own"
    )
    with pytest.raises(gradsync.InvalidGradsError, match=f"^{re.escape(message)}$"):
        validate_grads(grads())


def test_params_side_by_side_in_one_buffer_are_fine() -> None:
    # Views of one flat buffer that do not overlap (a fused gradient buffer) are usual.
    flat = np.zeros(16, np.float32)
    parts = [flat[12:], flat[:4], flat[4:12].reshape(2, 4), flat[4:4]]
    assert len(validate_grads(parts)) == 4
    assert len(validate_grads([np.zeros(3), np.zeros(3)])) == 2


@pytest.mark.skipif(not hasattr(getattr(np, "dtypes", None), "StringDType"), reason="numpy < 2")
def test_a_new_style_dtype_is_invalid_grads() -> None:
    # newbyteorder raises TypeError for StringDType: it must not escape as one (a first
    # call tells its peers only of a GradSyncError; they would wait max_wait_s).
    grads = [np.zeros(2), np.array(["a"], np.dtypes.StringDType())]
    message = "param 1 has dtype StringDType(); gradsync averages only float16, float32, float64"
    with pytest.raises(gradsync.InvalidGradsError, match=f"^{re.escape(message)}$"):
        validate_grads(grads)


@pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")
def test_array_subclasses_are_averaged_as_their_memory() -> None:
    # np.matrix reshapes to (1, n): the step must see a plain 1-D view of its memory.
    m = np.asmatrix(np.arange(12, dtype=np.float32).reshape(3, 4))
    (g,) = validate_grads([m])
    assert type(g) is np.ndarray
    assert np.shares_memory(g, m)
    assert g.reshape(-1).shape == (12,)


@pytest.mark.parametrize("step", [2**63, -(2**63) - 1])
def test_a_step_beyond_64_bits_is_refused(tmp_path: Path, step: int) -> None:
    with (
        gradsync.GradSync(gradsync.FileGradSyncConfig(1, 0, tmp_path)) as gs,
        pytest.raises(
            gradsync.ConfigError, match=rf"^step must fit in a signed 64-bit integer, got {step}$"
        ),
    ):
        gs.average([np.zeros(2)], step=step)


def test_float_dtypes_with_metadata_are_accepted() -> None:
    g = np.zeros(4, np.dtype(np.float32, metadata={"unit": "1/s"}))
    assert validate_grads([g]) == [g]


def test_nonfinite_params_names_each_bad_array_in_order() -> None:
    # Small arrays are checked in batches (flattened side by side, in the widest dtype):
    # every bad one must still be named, whatever its batch, dtype or shape.
    rng = np.random.default_rng(0)
    dtypes = [np.float16, np.float32, np.float64]
    sizes = [1, 0, 3, 1000, 70_000, 5, 200_000, 2, 17, 40_000, 1, 9]
    arrays = [
        rng.standard_normal(n).astype(dtypes[i % 3]).reshape((n, 1) if i % 2 else n)
        for i, n in enumerate(sizes * 3)
    ]
    assert nonfinite_params(arrays) == []
    bad = [0, 3, 4, 6, 10, 14, 18, 31, 35]
    for i, value in zip(
        bad, [np.nan, np.inf, -np.inf, np.nan, np.inf, -np.nan, np.nan, np.inf, np.nan], strict=True
    ):
        arrays[i].reshape(-1)[-1] = value
    assert nonfinite_params(arrays) == bad
    # The largest float16 and float64 values are finite, also side by side with others.
    assert nonfinite_params([np.full(3, 65504, np.float16), np.full(2, 1e308)]) == []


# -- a session's life in its process ------------------------------------------------------


def test_rank_0_interrupted_in_the_rendezvous_can_call_again(tmp_path: Path) -> None:
    # Its leader file used to stay, naming a live process (itself): the second call
    # found "another rank 0 (pid <its own>)" and failed.
    results = run_ranks(workers.rank_0_interrupted_in_the_rendezvous, 2, (2, str(tmp_path)))
    assert_ok(results)
    assert results[0].value == results[1].value == [0.5] * 4


def test_rank_0_interrupted_after_a_joiner_confirmed_tells_it(tmp_path: Path) -> None:
    # Rank 1 used to wait out max_wait_s (20 s) while rank 0 lived on.
    results = run_ranks(
        workers.rank_0_interrupted_after_a_joiner_confirmed, 3, (3, str(tmp_path)), ranks=[0, 1]
    )
    assert results[0].error_type == "KeyboardInterrupt"
    assert (results[1].error_type, results[1].message) == (
        "PeerAbortedError",
        "rendezvous failed on rank 0: KeyboardInterrupt",
    )
    assert results[1].elapsed_s < 5


def test_an_interrupt_as_the_session_starts_leaves_the_job(tmp_path: Path) -> None:
    # The generation was dropped with its heartbeat thread running: rank 0 waited out
    # max_wait_s (20 s), and rank 1's next calls met its own stale membership.
    results = run_ranks(workers.interrupted_as_the_engine_starts, 2, (2, str(tmp_path)))
    assert_ok(results)
    assert results[1].value == ("KeyboardInterrupt", [0.5] * 4, [])
    assert results[0].value == ("PeerLostError", [0.5] * 4, [])
    assert results[0].elapsed_s < 10


@pytest.mark.parametrize("how", ["signal", "signal-only", "thread"])
def test_closing_a_session_during_a_step(tmp_path: Path, how: str) -> None:
    # From a SIGTERM handler, close() used to deadlock on the lock its own thread held
    # in average(), and, deferred, did not end the wait; from another thread it waited
    # for the step to end (here 3 s).
    results = run_ranks(workers.closed_during_a_step, 2, (2, str(tmp_path), how), timeout_s=30)
    assert_ok(results)
    kind, message, seconds, state = results[0].value
    if how == "signal":
        assert (kind, message) == ("SystemExit", "3")
    else:
        assert kind == "GradSyncError"
        assert re.fullmatch(
            rf"step 1: rank 0's session was closed while it waited for ranks \[1\] in "
            rf"{tmp_path}/gen-[0-9a-f]+/s-2",
            message,
        ), message
    assert seconds < 2
    assert state.endswith(", closed)")
    # Rank 1, 3 s late, finds that rank 0 gave up on the step.
    kind, message = results[1].value
    assert kind == "PeerAbortedError"
    reason = (
        "SystemExit: 3"
        if how == "signal"
        # Its own message's "step 1: " is not repeated.
        else rf"rank 0's session was closed while it waited for ranks \[1\] in {tmp_path}/\S+"
    )
    assert re.fullmatch(
        rf"step 1: rank 0 \(pid \d+ on \S+\) gave up on this step: {reason}", message
    ), message


def test_rank_0_interrupted_then_calling_again_at_once(tmp_path: Path) -> None:
    # Its new session removed the old generation before rank 1 had read why it ended:
    # rank 1 then waited out max_wait_s (20 s). It now joins the new session.
    results = run_ranks(workers.rank_0_interrupted_then_calls_again, 3, (3, str(tmp_path)))
    assert_ok(results)
    assert results[0].value == results[1].value == results[2].value == [1.0] * 4
    assert max(o.elapsed_s for o in results.values()) < 10


def test_a_joiner_whose_generation_went_still_watches_its_rank_0(tmp_path: Path) -> None:
    # Waiting for a new offer, it used to stop watching the rank 0 that had made the
    # old one: that process exited, and the joiner waited out max_wait_s (20 s).
    results = run_ranks(
        workers.rank_0_fails_and_its_generation_goes, 3, (3, str(tmp_path)), ranks=[0, 1]
    )
    assert results[0].ok
    assert results[1].error_type == "PeerLostError"
    assert re.fullmatch(
        r"rendezvous: rank 0 \(pid \d+ on \S+\) (has exited|is a zombie)[^)]*\)? before "
        rf"completing the rendezvous in {tmp_path}/gen-[0-9a-f]+",
        results[1].message,
    ), results[1].message
    assert results[1].elapsed_s < 8


def test_signal_handlers_never_hang_on_the_session_registry(tmp_path: Path) -> None:
    # A handler closing one session while its thread held the registry's lock (the
    # function form, in another session's call) waited for that lock forever.
    cfg = gradsync.FileGradSyncConfig(1, 0, tmp_path / "a")
    box = {"other": gradsync.GradSync(gradsync.FileGradSyncConfig(1, 0, tmp_path / "b"))}

    def handler(signum: int, frame: object) -> None:
        box["other"].close()
        box["other"] = gradsync.GradSync(gradsync.FileGradSyncConfig(1, 0, tmp_path / "b"))

    old = signal.signal(signal.SIGPROF, handler)
    signal.setitimer(signal.ITIMER_PROF, 0.0002, 0.0002)
    try:
        deadline = time.monotonic() + 2.0
        step = 0
        while time.monotonic() < deadline:
            gradsync.average_grads_file_sync([np.ones(4)], None, cfg, step)
            step += 1
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, old)
        gradsync._session.close_all()


def test_a_call_from_a_signal_handler_inside_a_call_is_refused(tmp_path: Path) -> None:
    # It waited, forever, for the lock its own thread held.
    gs = gradsync.GradSync(gradsync.FileGradSyncConfig(1, 0, tmp_path / "sync"))
    refused: list[str] = []

    def handler(signum: int, frame: object) -> None:
        try:
            gs.average([np.ones(4)])
        except gradsync.GradSyncError as exc:
            refused.append(str(exc))

    old = signal.signal(signal.SIGPROF, handler)
    signal.setitimer(signal.ITIMER_PROF, 0.0002, 0.0002)
    try:
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and not refused:
            gs.average([np.ones(4)])
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, old)
        gs.close()
    assert refused
    assert refused[0] == (
        "GradSync (rank 0) was called from within one of its own calls on this thread (a "
        "signal handler?); only close() may be called there"
    )


def test_a_close_interrupted_while_it_stops_its_threads_still_leaves_the_job(
    tmp_path: Path,
) -> None:
    # The session counted as left before it wrote its "left" note: a Ctrl-C in between
    # (stopping the heartbeat and worker threads) left no note, and its live peer
    # waited out max_wait_s (20 s).
    results = run_ranks(workers.interrupted_while_closing, 2, (2, str(tmp_path)))
    assert_ok(results)
    assert results[1].value == "interrupted"
    kind, seconds = results[0].value
    assert kind == "PeerLostError"
    assert seconds < 3


def test_a_joiner_closed_as_the_roster_appears_leaves_the_job(tmp_path: Path) -> None:
    # Closed after rank 0 wrote the roster but before it read it, rank 1 used to leave
    # only a note rank 0 no longer read: rank 0 waited out max_wait_s (20 s).
    results = run_ranks(workers.joiner_closed_as_the_roster_appears, 2, (2, str(tmp_path)))
    assert_ok(results)
    kind, seconds = results[0].value
    assert kind in ("PeerLostError", "PeerAbortedError")
    assert seconds < 10


# The in-process signal tests below use SIGPROF (a CPU-time timer): pytest-timeout
# keeps SIGALRM, so a hang fails the test instead of stopping the suite.


def test_signal_handlers_that_close_never_hang_a_call(tmp_path: Path) -> None:
    # A handler ran between taking the lock and marking its owner (or between the two
    # on the way out) then waited for the lock its own thread held, forever.
    cfg = gradsync.FileGradSyncConfig(1, 0, tmp_path / "sync")
    box = {"gs": gradsync.GradSync(cfg)}
    closes = 0

    def handler(signum: int, frame: object) -> None:
        nonlocal closes
        box["gs"].close()
        closes += 1

    old = signal.signal(signal.SIGPROF, handler)
    signal.setitimer(signal.ITIMER_PROF, 0.0002, 0.0002)
    try:
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            try:
                box["gs"].average([np.ones(4)])
            except gradsync.GradSyncError:
                box["gs"] = gradsync.GradSync(cfg)
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, old)
    assert closes > 100


def test_a_session_abandoned_at_exit_refuses_later_calls(tmp_path: Path) -> None:
    gs = gradsync.GradSync(gradsync.FileGradSyncConfig(2, 0, tmp_path))
    gs._finalizer()  # as at interpreter exit, with a daemon thread still to call
    with pytest.raises(gradsync.GradSyncError, match=r"^this GradSync \(rank 0\) is closed$"):
        gs.average([np.ones(4)])


def test_a_closed_session_cannot_be_entered_again(tmp_path: Path) -> None:
    with gradsync.GradSync(gradsync.FileGradSyncConfig(1, 0, tmp_path)) as gs:
        gs.average([np.ones(4)])
    closed = r"^this GradSync \(rank 0\) is closed$"
    with pytest.raises(gradsync.GradSyncError, match=closed), gs:
        pass


def test_a_session_dropped_without_close_leaves_the_job(tmp_path: Path) -> None:
    results = run_ranks(workers.dropped_without_close, 2, (2, str(tmp_path)))
    assert_ok(results)
    assert results[1].value == []  # no heartbeat thread left
    kind, message, seconds = results[0].value
    assert kind == "PeerLostError"
    assert "closed its gradsync session" in message, message
    assert seconds < 2


def test_peers_are_told_which_exception_closed_a_session(tmp_path: Path) -> None:
    results = run_ranks(workers.raises_in_its_with_block, 2, (2, str(tmp_path)))
    assert_ok(results)
    kind, message = results[0].value
    assert kind == "PeerLostError"
    assert re.fullmatch(
        r"step 1: rank 1 \(pid \d+ on .+\) closed its gradsync session \(raising "
        r"ValueError: batch 7 is empty\) before publishing its gradients in .+/s-2 "
        r"\(waited \d+\.\d s\)",
        message,
    ), message


@pytest.mark.parametrize("exit_by", ["exception", "sys.exit"])
def test_peers_are_told_which_uncaught_exception_ended_a_rank(tmp_path: Path, exit_by: str) -> None:
    # The function form's sessions are closed at exit: after an uncaught exception the
    # interpreter keeps it in sys.last_value; sys.exit is no exception to report.
    script = Path(__file__).parent / "scripts" / "average_forever.py"
    env = {**os.environ, "GRADSYNC_WORLD_SIZE": "2", "GRADSYNC_SYNC_DIR": str(tmp_path / "s")}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(tmp_path), *([f"--end-by={exit_by}"] * rank)],
            env={**env, "GRADSYNC_RANK": str(rank)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        errs = [p.communicate(timeout=60)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert [p.returncode for p in procs] == [1, 1 if exit_by == "exception" else 3], errs
    why = " (at exit, after an uncaught ZeroDivisionError: division by zero)"
    expected = (
        f"gradsync._errors.PeerLostError: step 1: rank 1 (pid {procs[1].pid} on "
        f"{socket.gethostname()}) closed its gradsync session"
        f"{why if exit_by == 'exception' else ''} before publishing its gradients in "
    )
    assert expected in errs[0], errs[0]


def test_the_function_form_refuses_a_second_config_for_the_same_rank(tmp_path: Path) -> None:
    cfg = gradsync.FileGradSyncConfig(1, 0, tmp_path / "sync")
    other = dataclasses.replace(cfg, max_wait_s=6.0)
    gradsync.average_grads_file_sync([np.ones(2)], None, cfg, 0)
    try:
        with pytest.raises(
            gradsync.ConfigError,
            match=re.escape(
                f"rank 0 of the job in {tmp_path / 'sync'} (run_id None) is averaged in this "
                "process with another config (max_wait_s 600.0 then 6.0): pass the same "
                "config on every call"
            ),
        ):
            gradsync.average_grads_file_sync([np.ones(2)], None, other, 1)
        same = dataclasses.replace(cfg)  # equal, not identical: the same session
        gradsync.average_grads_file_sync([np.ones(2)], None, same, 1)
    finally:
        gradsync._session.close_all()


@pytest.mark.parametrize(
    ("exc", "told"),
    [
        (None, None),
        (SystemExit(), None),
        (SystemExit(0), None),
        (GeneratorExit(), None),
        (SystemExit(3), "raising SystemExit(3)"),
        (SystemExit("bad config"), "raising SystemExit('bad config')"),
        (KeyboardInterrupt(), "raising KeyboardInterrupt"),
        (ValueError("  batch 7\nline two"), "raising ValueError: batch 7"),
        (gradsync.PeerLostError("step 3: rank 2 (...) has exited"), "raising PeerLostError"),
        (ValueError("x" * 300), "raising ValueError: " + "x" * 185 + "..."),
    ],
)
def test_what_peers_are_told_of_an_exception_leaving_a_with_block(
    exc: BaseException | None, told: str | None
) -> None:
    assert gradsync._session.closing_reason(exc) == told


def test_a_failed_pytest_test_is_no_uncaught_exception_at_exit(tmp_path: Path) -> None:
    # pytest keeps a failed test's exception in sys.last_value, as the interpreter does
    # with the one ending a script: the rank's peer must not be told of it.
    sync = str(tmp_path / "s")
    (tmp_path / "test_it.py").write_text(
        "import numpy as np, gradsync\n"
        "def test_trains():\n"
        f"    cfg = gradsync.FileGradSyncConfig(2, 1, {sync!r})\n"
        "    gradsync.average_grads_file_sync([np.ones(1 << 17, np.float32)], None, cfg, 0)\n"
        "def test_unrelated():\n"
        "    assert False, 'unrelated'\n"
    )
    env = {**os.environ, "GRADSYNC_WORLD_SIZE": "2", "GRADSYNC_RANK": "0"}
    script = Path(__file__).parent / "scripts" / "average_forever.py"
    peer = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path)],
        env={**env, "GRADSYNC_SYNC_DIR": sync},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        pytest_run = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_it.py"]
        subprocess.run(pytest_run, cwd=tmp_path, capture_output=True, timeout=60, check=False)
        err = peer.communicate(timeout=60)[1]
    finally:
        peer.kill()
        peer.wait()
    assert "closed its gradsync session before publishing" in err, err


def test_an_exception_that_cannot_be_shown_still_closes_the_session(tmp_path: Path) -> None:
    class UnprintableError(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no")

    gs = gradsync.GradSync(gradsync.FileGradSyncConfig(1, 0, tmp_path))
    with pytest.raises(UnprintableError), gs:
        raise UnprintableError
    assert repr(gs).endswith(", closed)")
