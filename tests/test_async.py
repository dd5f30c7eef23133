"""GradSync.average_async: steps in the background, completed in the order they were made."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

import gradsync
from ranks import config, run_ranks

STEPS = 6


def _grads(rank: int, step: int) -> list[np.ndarray]:
    rng = np.random.default_rng([rank, step, 7])
    return [
        rng.standard_normal(1000).astype(np.float32),
        rng.standard_normal((3, 5)).astype(np.float64),
    ]


def _async_then_sync(rank: int, world: int, sync_dir: str) -> dict[str, object]:
    """Starts STEPS steps at once, then one blocking one: all in order, same bits."""
    with gradsync.GradSync(config(rank, world, sync_dir)) as gs:
        grads = [_grads(rank, s) for s in range(STEPS + 1)]
        handles = [gs.average_async(g) for g in grads[:STEPS]]
        last = gs.average(grads[STEPS])  # waits behind the steps in flight
        steps = [h.wait().step for h in handles]
        return {
            "steps": [*steps, last.step],
            "done": [h.done() for h in handles],
            "means": [[a.tobytes() for a in g] for g in grads],
        }


def test_async_steps_complete_in_order_with_the_mean_on_every_rank(tmp_path: Path) -> None:
    world = 3
    out = run_ranks(_async_then_sync, world, (world, str(tmp_path)), timeout_s=60)
    assert all(o.ok for o in out.values()), {r: o.value for r, o in out.items()}
    for step in range(STEPS + 1):
        want = gradsync.average_host_grads([_grads(r, step) for r in range(world)])
        for r in range(world):
            assert out[r].value["means"][step] == [a.tobytes() for a in want], (r, step)
    for r in range(world):
        assert out[r].value["steps"] == list(range(STEPS + 1))
        assert out[r].value["done"] == [True] * STEPS


def _one_rank_poisons(rank: int, world: int, sync_dir: str) -> list[str]:
    """Rank 1's second step holds NaN: with check_finite, both ranks' wait() raise."""
    errors = []
    with gradsync.GradSync(config(rank, world, sync_dir, check_finite=True)) as gs:
        grads = [_grads(rank, s) for s in range(3)]
        if rank == 1:
            grads[1][0][5] = np.nan
        handles = [gs.average_async(g) for g in grads]
        for h in handles:
            try:
                h.wait()
                errors.append("")
            except gradsync.GradSyncError as exc:
                errors.append(type(exc).__name__)
    return errors


def test_a_failed_async_step_raises_in_wait_and_fails_the_later_ones(tmp_path: Path) -> None:
    out = run_ranks(_one_rank_poisons, 2, (2, str(tmp_path)), timeout_s=60)
    for r in range(2):
        assert out[r].ok, out[r].value
        assert out[r].value == ["", "NonFiniteGradError", "GradSyncError"], r


def test_close_fails_the_steps_in_flight_and_queued(tmp_path: Path) -> None:
    # Rank 1 of 2 alone: its first step waits for a rank 0 that never comes.
    gs = gradsync.GradSync(config(1, 2, str(tmp_path), max_wait_s=60.0))
    handles = [gs.average_async(_grads(1, s)) for s in range(3)]
    assert not handles[2].done()
    gs.close()
    for h in handles:
        assert h.done()
        with pytest.raises(gradsync.GradSyncError):
            h.wait()
    with pytest.raises(gradsync.GradSyncError, match="is closed"):
        gs.average_async(_grads(1, 3))


def test_one_rank_async_steps_are_the_input_and_run_callbacks_on_gradsync_thread(
    tmp_path: Path,
) -> None:
    gs = gradsync.GradSync(config(0, 1, str(tmp_path)))
    grads = _grads(0, 0)
    before = [a.copy() for a in grads]
    seen: list[tuple[int, str]] = []
    handle = gs.average_async(grads, step=41)
    handle.add_done_callback(
        lambda h: seen.append((h.wait().step, threading.current_thread().name))
    )
    assert handle.wait().step == 41
    gs.close()
    assert [a.tobytes() for a in grads] == [a.tobytes() for a in before]
    assert seen[0] == (41, "gradsync rank 0")
    handle.add_done_callback(lambda h: seen.append((h.wait().step, "late")))
    assert seen[1] == (41, "late")  # a callback added after the end runs at once


def _step_from_a_callback(rank: int, world: int, sync_dir: str) -> list[int]:
    """A callback of step 0 starts a step and waits for it: it runs right after step 0."""
    with gradsync.GradSync(config(rank, world, sync_dir)) as gs:
        inner: list[int] = []
        first = gs.average_async(_grads(rank, 0))
        first.add_done_callback(
            lambda h: inner.append(gs.average_async(_grads(rank, 1)).wait().step)
        )
        last = gs.average_async(_grads(rank, 2))
        steps = [first.wait().step, last.wait().step]  # step 2 starts after the callback
        return [steps[0], *inner, steps[1]]


def test_a_step_started_from_a_callback_runs_right_after_that_step(tmp_path: Path) -> None:
    out = run_ranks(_step_from_a_callback, 2, (2, str(tmp_path)), timeout_s=60)
    for r in range(2):
        assert out[r].ok, out[r].value
        assert out[r].value == [0, 1, 2]


def _gpu_async(rank: int, world: int, sync_dir: str) -> list[bytes]:
    import wgpu  # noqa: PLC0415

    dev = gradsync.request_device_for_rank(local_rank=rank)
    usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
    with gradsync.GradSync(config(rank, world, sync_dir)) as gs:
        bufs = [[dev.create_buffer_with_data(data=a, usage=usage) for a in _grads(rank, s)]
                for s in range(3)]  # fmt: skip
        dtypes = [np.float32, np.float64]
        handles = [gs.average_async(b, device=dev, dtype=dtypes) for b in bufs]
        for h in handles:
            h.wait()
        return [b"".join(bytes(dev.queue.read_buffer(b)) for b in step) for step in bufs]


@pytest.mark.wgpu
def test_async_steps_of_gpu_buffers_deliver_the_mean(tmp_path: Path) -> None:
    wgpu = pytest.importorskip("wgpu")
    if not wgpu.gpu.enumerate_adapters_sync():
        pytest.skip("no wgpu adapter")
    out = run_ranks(_gpu_async, 2, (2, str(tmp_path)), timeout_s=90)
    for step in range(3):
        want = gradsync.average_host_grads([_grads(r, step) for r in range(2)])
        for r in range(2):
            assert out[r].ok, out[r].value
            assert out[r].value[step] == b"".join(a.tobytes() for a in want), (r, step)
