"""GradSync.average_async: steps in the background, completed in the order they were made."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
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


def _callback_added_after_a_later_step(rank: int, world: int, sync_dir: str) -> list[float]:
    """Steps A, B started; then A's callback starts C. Rank 0 adds it while A waits for
    rank 1, rank 1 once A is over: C must follow B on both, whatever the timing."""
    with gradsync.GradSync(config(rank, world, sync_dir)) as gs:
        a, b, c = ([np.full(4, k * (rank + 1), np.float32)] for k in (1.0, 10.0, 100.0))
        if rank == 1:
            time.sleep(1.0)  # rank 0's A waits for this rank meanwhile
        first = gs.average_async(a)
        second = gs.average_async(b)
        if rank == 1:
            first.wait()
        started: list[tuple[int, int]] = []
        first.add_done_callback(
            lambda h: started.append((gs.average_async(c).wait().step, second.wait().step))
        )
        second.wait()
        deadline = time.monotonic() + 30
        while not started and time.monotonic() < deadline:
            time.sleep(0.01)
        assert started == [(2, 1)], started
        return [float(x[0][0]) for x in (a, b, c)]


def test_a_step_started_by_a_callback_added_after_a_later_step_runs_after_it(
    tmp_path: Path,
) -> None:
    # Rank 0 ran C before B and rank 1 after it: each averaged its C with the other's B.
    out = run_ranks(_callback_added_after_a_later_step, 2, (2, str(tmp_path)), timeout_s=60)
    for r in range(2):
        assert out[r].ok, out[r].value
        assert out[r].value == [1.5, 15.0, 150.0], (r, out[r].value)


def test_a_callback_raising_system_exit_leaves_the_later_steps_running(tmp_path: Path) -> None:
    # It ended gradsync's thread, and every later step waited forever.
    gs = gradsync.GradSync(config(0, 1, str(tmp_path)))
    gate = threading.Event()
    ran: list[str] = []
    held = gs.average_async(_grads(0, 0))
    held.add_done_callback(lambda h: gate.wait(10))  # the thread waits: the next is added first
    exiting = gs.average_async(_grads(0, 1))
    exiting.add_done_callback(lambda h: sys.exit("a callback exits"))
    exiting.add_done_callback(lambda h: ran.append("after"))
    gate.set()
    exiting.wait()
    later = gs.average_async(_grads(0, 2))
    waiter = threading.Thread(target=later.wait, daemon=True)
    waiter.start()
    waiter.join(10)
    assert later.done()
    assert ran == ["after"]
    gs.close()


_CLOSE_IN_A_HANDLER = """
    import signal, sys, threading
    import numpy as np
    import gradsync

    gs = gradsync.GradSync(gradsync.FileGradSyncConfig(1, 0, sys.argv[1], max_wait_s=5))
    closed = threading.Event()

    def on_alarm(signum, frame):
        gs.close()
        closed.set()

    signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, float(sys.argv[2]))
    grads = [np.ones(1000, np.float32)]
    try:
        while not closed.is_set():
            gs.average_async(grads).add_done_callback(lambda h: None)
    except gradsync.GradSyncError:
        pass
    print("closed")
"""


@pytest.mark.parametrize("after_s", [0.1, 0.2, 0.3, 0.4])
def test_close_from_a_signal_handler_amid_async_calls_returns(
    tmp_path: Path, after_s: float
) -> None:
    # The handler interrupting the main thread inside a lock the background thread needs
    # joined that thread, which waited for the lock: 3 hangs in 6 tries.
    code = textwrap.dedent(_CLOSE_IN_A_HANDLER)
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path), str(after_s)],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out
    assert out.stdout.strip() == "closed", out


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
