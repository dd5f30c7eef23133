"""Rank bodies for the multi-process tests (importable by spawned children)."""

from __future__ import annotations

import contextlib
import errno
import gc
import logging
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import gradsync
from gradsync import _proc
from gradsync._names import ABORT
from ranks import WarningLog, config

SHAPES: list[tuple[tuple[int, ...], str]] = [
    ((3, 5), "float32"),
    ((7,), "float16"),
    ((0,), "float32"),
    ((1000,), "float32"),
    ((2, 2, 3), "float64"),
    ((33,), "float16"),
]


# Over 256 KiB per rank: reduced in shards rather than by every rank.
SHAPES_BIG: list[tuple[tuple[int, ...], str]] = [
    *SHAPES,
    ((70_001,), "float32"),
    ((3, 20_000), "float16"),
]


# Several MiB per rank, in params that cross shard boundaries: with threads > 1 the
# copies and the reduction are cut into pieces (of at least 1 MiB) run by workers.
SHAPES_HUGE: list[tuple[tuple[int, ...], str]] = [
    *SHAPES_BIG,
    ((1_000_003,), "float32"),
    ((5, 120_001), "float16"),
    ((300_007,), "float64"),
    ((9,), "float32"),
]


def grads_for(
    rank: int, step: int, shapes: list[tuple[tuple[int, ...], str]] = SHAPES
) -> list[np.ndarray]:
    """Deterministic, rank- and step-dependent gradients."""
    rng = np.random.default_rng([rank, step, 12345])
    return [
        (rng.standard_normal(shape) * 10.0 ** rng.integers(-3, 4)).astype(dtype)
        for shape, dtype in shapes
    ]


def mark_done(sync_dir: str, who: int | str) -> None:
    """Mark (beside the sync dir, not in it) that ``who`` (a rank's call, or the test's
    own step) is done."""
    Path(f"{sync_dir}.done-{who}").touch()


def linger(sync_dir: str, peers: list[int] | list[str], cap_s: float) -> None:
    """Stay alive, as a rank that caught its error would, until every one of ``peers``
    is marked done, or ``cap_s`` has passed (the fixed wait this replaced)."""
    deadline = time.monotonic() + cap_s
    while time.monotonic() < deadline:
        if all(Path(f"{sync_dir}.done-{r}").exists() for r in peers):
            return
        time.sleep(0.01)


def average_steps(
    rank: int, world: int, sync_dir: str, steps: int, kw: dict[str, Any]
) -> list[list[bytes]]:
    """Average ``steps`` rounds; return each round's results as bytes."""
    delay = kw.pop("jitter_s", 0.0)
    huge, big = kw.pop("huge", False), kw.pop("big", False)
    shapes = SHAPES_HUGE if huge else SHAPES_BIG if big else SHAPES
    rng = np.random.default_rng(rank + 99)
    results = []
    with gradsync.GradSync(config(rank, world, sync_dir, **kw)) as gs:
        for step in range(steps):
            if delay:
                time.sleep(float(rng.uniform(0, delay)))
            grads = grads_for(rank, step, shapes)
            gs.average(grads, step=step)
            results.append([g.tobytes() for g in grads])
    return results


def stats_of_steps(rank: int, world: int, sync_dir: str, big: bool) -> list[Any]:
    """Average two steps (1 KiB-ish or 280 KiB, reduced in shards) and return their
    StepStats and the text each prints."""
    out = []
    with gradsync.GradSync(config(rank, world, sync_dir)) as gs:
        for step in range(2):
            stats = gs.average(grads_for(rank, step, SHAPES_BIG if big else SHAPES))
            assert gs.last_stats is stats
            out.append((stats, str(stats)))
    return out


def function_form(rank: int, world: int, sync_dir: str, steps: int) -> list[list[bytes]]:
    cfg = config(rank, world, sync_dir)
    out = []
    for step in range(steps):
        grads = grads_for(rank, step)
        gradsync.average_grads_file_sync(grads, None, cfg, step)
        out.append([g.tobytes() for g in grads])
    return out


def die_at_step(rank: int, world: int, sync_dir: str, victim: int, die_step: int, how: str) -> Any:
    """Every rank averages; ``victim`` dies at ``die_step`` (before publishing)."""
    gs = gradsync.GradSync(config(rank, world, sync_dir, max_wait_s=60.0))
    for step in range(die_step + 1):
        if rank == victim and step == die_step:
            if how == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            os._exit(7)
        start = time.monotonic()
        try:
            gs.average(grads_for(rank, step), step=step)
        except gradsync.GradSyncError:
            raise
        finally:
            elapsed = time.monotonic() - start
    return elapsed


def stall(rank: int, world: int, sync_dir: str, sleeper: int, max_wait_s: float) -> Any:
    """``sleeper`` never calls average after step 0 but stays alive."""
    gs = gradsync.GradSync(config(rank, world, sync_dir, max_wait_s=max_wait_s))
    gs.average(grads_for(rank, 0), step=0)
    if rank == sleeper:
        linger(sync_dir, [r for r in range(world) if r != sleeper], max_wait_s + 3)
        return "slept"
    start = time.monotonic()
    try:
        gs.average(grads_for(rank, 1), step=1)
    finally:
        globals()["_elapsed"] = time.monotonic() - start
        mark_done(sync_dir, rank)
    return None


def mismatched(rank: int, world: int, sync_dir: str, kind: str) -> Any:
    shapes = list(SHAPES)
    step = 0
    if rank == world - 1:
        if kind == "shape":
            shapes[3] = ((999,), "float32")
        elif kind == "count":
            shapes = shapes[:-1]
        elif kind == "dtype":
            shapes[1] = ((7,), "float32")
        elif kind == "step":
            step = 5
    with gradsync.GradSync(config(rank, world, sync_dir)) as gs:
        gs.average(grads_for(rank, 0, shapes), step=step)


def with_nan(rank: int, world: int, sync_dir: str, check: bool) -> Any:
    grads = grads_for(rank, 0)
    if rank == 1:
        grads[1][2] = np.nan
    with gradsync.GradSync(config(rank, world, sync_dir, check_finite=check)) as gs:
        gs.average(grads, step=0)
    return [g.tobytes() for g in grads]


def over_header_limits(rank: int, world: int, sync_dir: str, limit: str) -> Any:
    """A first step within the header's limits, then one past ``limit`` (lowered here:
    the real ones take a million params)."""
    from gradsync._step import engine, state  # noqa: PLC0415

    with gradsync.GradSync(config(rank, world, sync_dir)) as gs:
        gs.average([np.ones(3), np.ones(2)], step=0)
        # The step checks the param count; the header writer, the header's length.
        module = engine if limit == "MAX_PARAMS" else state
        setattr(module, limit, {"MAX_PARAMS": 2, "MAX_META": 60}[limit])
        gs.average([np.ones(3), np.ones(2), np.ones(1)], step=1)


def buffers_past_the_header_limit(rank: int, world: int, sync_dir: str) -> Any:
    """``buffers_like`` for a mapped layout of three params under a lowered header
    limit, after a first step; returns the error's type and message."""
    from gradsync._step import state as _state  # noqa: PLC0415

    with gradsync.GradSync(config(rank, world, sync_dir)) as gs:
        gs.average([np.ones(3)], step=0)
        _state.MAX_META = 60  # type: ignore[attr-defined]
        try:
            gs.buffers_like([np.empty(1 << 18, np.float32) for _ in range(3)])
        except gradsync.GradSyncError as exc:
            return type(exc).__name__, str(exc)
    return None


def buffers_with_the_last_params_nonfinite(rank: int, world: int, sync_dir: str) -> Any:
    """``buffers_like`` arrays of 326 small params and a big one, check_finite, the last
    11 NaN on the last rank: a header longer than one listing params 0-9 (whose header
    ends 12 bytes short of a 4096-byte boundary). Returns the error's type and message."""
    layout = [np.empty(4, np.float32) for _ in range(326)] + [np.empty(100_000, np.float32)]
    with gradsync.GradSync(config(rank, world, sync_dir, check_finite=True)) as gs:
        grads = gs.buffers_like(layout)
        for i, g in enumerate(grads):
            g[...] = np.nan if rank == world - 1 and i >= len(grads) - 11 else 1.0
        try:
            gs.average(grads, step=0)
        except gradsync.GradSyncError as exc:
            return type(exc).__name__, str(exc)
    return None


def buffers_near_the_header_limit(rank: int, world: int, sync_dir: str) -> Any:
    """``buffers_like`` arrays for 150 params whose header fits the (lowered) limit only
    without a list of non-finite params, averaged twice; returns the results as bytes."""
    from gradsync._step import header as _format  # noqa: PLC0415
    from gradsync._step import state as _state  # noqa: PLC0415

    layout = tuple(("<f4", (512,)) for _ in range(150))
    fits = len(_format.encode_meta(_format.layout_json(layout)))
    _state.MAX_META = fits + 10  # type: ignore[attr-defined]
    with gradsync.GradSync(config(rank, world, sync_dir)) as gs:
        grads = gs.buffers_like([np.empty(512, np.float32) for _ in layout])
        results = []
        for step in range(2):
            for i, g in enumerate(grads):
                g[...] = rank + step + i
            gs.average(grads, step=step)
            results.append(b"".join(g.tobytes() for g in grads))
        return results


def nonfinite_past_the_header_limit(rank: int, world: int, sync_dir: str) -> Any:
    """150 params, every one NaN on the last rank, with check_finite, under a (lowered)
    header limit that their layout fits with 100 bytes to spare: not enough to list
    all 150. Returns the error's type and message."""
    from gradsync._step import header as _format  # noqa: PLC0415
    from gradsync._step import state as _state  # noqa: PLC0415

    layout = tuple(("<f4", (4,)) for _ in range(150))
    _state.MAX_META = len(_format.encode_meta(_format.layout_json(layout))) + 100  # type: ignore[attr-defined]
    grads = [np.full(4, np.nan if rank == world - 1 else 1.0, np.float32) for _ in layout]
    with gradsync.GradSync(config(rank, world, sync_dir, check_finite=True)) as gs:
        try:
            gs.average(grads, step=0)
        except gradsync.GradSyncError as exc:
            return type(exc).__name__, str(exc)
    return None


def fill_disk(directory: str) -> None:
    """Fill the filesystem of ``directory`` to the last byte (a filler file)."""
    with (
        open(os.path.join(directory, ".filler"), "wb", buffering=0) as f,
        contextlib.suppress(OSError),
    ):
        while True:
            f.write(b"\0" * 4096)


def disk_fills_mid_job(rank: int, world: int, sync_dir: str) -> Any:
    """Call 1 small; then rank 0 publishes a larger call 2, after which rank 1 fills the
    disk and finds no room for its own file. Rank 1 stays alive after failing, as a
    rank that catches the error would; rank 0 must hear of it, not wait max_wait_s."""
    gs = gradsync.GradSync(config(rank, world, sync_dir, max_wait_s=20.0))
    gs.average([np.ones(16, np.float32)], step=0)
    gen = Path(str(gs.generation_dir))
    if rank == 1:
        deadline = time.monotonic() + 10
        while not (gen / "s-2" / "in-0").exists() and time.monotonic() < deadline:
            time.sleep(0.005)
        fill_disk(sync_dir)
    try:
        gs.average([np.ones(100_000, np.float32)], step=1)
    except gradsync.GradSyncError:
        if rank == 1:
            linger(sync_dir, [0], 4.5)  # alive until rank 0 heard, never publishing
        raise
    finally:
        if rank == 0:
            mark_done(sync_dir, 0)
        gs.close()


def close_on_a_full_disk(rank: int, world: int, sync_dir: str) -> Any:
    """Fill the disk after three calls, make two more (files reused, markers renamed:
    no room needed), then close: the job's files must still all go."""
    with gradsync.GradSync(config(rank, world, sync_dir)) as gs:
        for step in range(5):
            if step == 3 and rank == 0:
                fill_disk(sync_dir)
            gs.average([np.full(100_000, rank + step, np.float32)], step=step)


def rendezvous_fails_on_a_full_disk(rank: int, world: int, sync_dir: str) -> Any:
    """Ranks 0 and 1 of 3 (rank 2 never comes). Once rank 1 has confirmed, rank 0 fills
    the disk, so its abort note (ranks [2] did not join within 1.5 s) is written empty;
    it stays alive after failing. Rank 1 must still hear of it at once."""
    if rank == 0:
        _on_first(sync_dir, "gen-*/member-1-*.json", lambda: fill_disk(sync_dir))
    cfg = config(rank, world, sync_dir, max_wait_s=1.5 if rank == 0 else 20.0)
    try:
        with gradsync.GradSync(cfg) as gs:
            gs.average([np.ones(4)], step=0)
    except gradsync.GradSyncError:
        if rank == 0:
            linger(sync_dir, [1], 4.5)  # alive until rank 1 heard
        raise
    finally:
        if rank == 1:
            mark_done(sync_dir, 1)


def _on_first(sync_dir: str, pattern: str, action: Callable[[], object]) -> None:
    """Run ``action`` in a daemon thread the moment a file matching ``pattern`` exists
    under ``sync_dir`` (looked for every 0.2 ms, for up to 10 s)."""

    def watch() -> None:
        deadline = time.monotonic() + 10
        while not list(Path(sync_dir).glob(pattern)):
            if time.monotonic() > deadline:
                return
            time.sleep(0.0002)
        action()

    threading.Thread(target=watch, daemon=True).start()


def _interrupt_self_in(seconds: float) -> None:
    threading.Timer(seconds, lambda: os.kill(os.getpid(), signal.SIGINT)).start()


def rank_0_interrupted_in_the_rendezvous(rank: int, world: int, sync_dir: str) -> Any:
    """Rank 0 is interrupted (SIGINT) 0.5 s into its rendezvous, before rank 1 comes
    (at 1.5 s), and calls again; both calls of the function form must then succeed."""
    cfg = config(rank, world, sync_dir, max_wait_s=10.0)
    grads = [np.full(4, float(rank))]
    if rank == 0:
        _interrupt_self_in(0.5)
        try:
            gradsync.average_grads_file_sync(grads, None, cfg, 0)
        except KeyboardInterrupt:
            pass
        else:
            raise AssertionError("not interrupted")
    else:
        time.sleep(1.5)
    gradsync.average_grads_file_sync(grads, None, cfg, 0)
    return grads[0].tolist()


def rank_0_interrupted_after_a_joiner_confirmed(rank: int, world: int, sync_dir: str) -> Any:
    """Ranks 0 and 1 of 3 (rank 2 never comes); rank 0 is interrupted once rank 1 has
    confirmed, and stays alive: rank 1 must hear of it, not wait max_wait_s."""
    if rank == 0:
        _on_first(sync_dir, "gen-*/member-1-*.json", lambda: os.kill(os.getpid(), signal.SIGINT))
    try:
        with gradsync.GradSync(config(rank, world, sync_dir, max_wait_s=20.0)) as gs:
            gs.average([np.ones(4)], step=0)
    except KeyboardInterrupt:
        linger(sync_dir, [1], 5)  # alive until rank 1 heard
        raise
    finally:
        if rank == 1:
            mark_done(sync_dir, 1)


def interrupted_as_the_engine_starts(rank: int, world: int, sync_dir: str) -> Any:
    """Rank 1's first call is interrupted just after the rendezvous (as its step engine
    starts); it calls again, and so does rank 0 once its call fails. Returns the mean
    and the heartbeat threads left once every session is closed."""
    from gradsync import _session  # noqa: PLC0415

    cfg = config(rank, world, sync_dir, max_wait_s=20.0)
    grads = [np.full(4, float(rank))]
    if rank == 1:
        real = _session.StepEngine

        def interrupted(*args: Any) -> Any:
            _session.StepEngine = real  # type: ignore[misc]
            raise KeyboardInterrupt

        _session.StepEngine = interrupted  # type: ignore[misc]
    try:
        gradsync.average_grads_file_sync(grads, None, cfg, 0)
    except (KeyboardInterrupt, gradsync.GradSyncError) as exc:
        first = type(exc).__name__
    else:
        first = "ok"
    gradsync.average_grads_file_sync(grads, None, cfg, 0)
    _session.close_all()
    beating = [t.name for t in threading.enumerate() if t.name == "gradsync-heartbeat"]
    return first, grads[0].tolist(), beating


def closed_during_a_step(rank: int, world: int, sync_dir: str, how: str) -> Any:
    """Rank 0 waits in its second call for rank 1 (late: until rank 0's call and close
    are over, at most 3 s) and is closed meanwhile: from a SIGTERM handler that then
    exits (``how="signal"``) or only closes ("signal-only"), or from another thread
    ("thread")."""
    gs = gradsync.GradSync(config(rank, world, sync_dir, max_wait_s=20.0))
    gs.average([np.ones(4)], step=0)
    if rank == 1:
        linger(sync_dir, [0], 3)
        try:
            gs.average([np.ones(4)], step=1)
        except gradsync.GradSyncError as exc:
            return type(exc).__name__, str(exc)
        finally:
            gs.close()
        return None
    start = time.monotonic()
    if how.startswith("signal"):
        if how == "signal":
            signal.signal(signal.SIGTERM, lambda *_: (gs.close(), sys.exit(3)))
        else:
            signal.signal(signal.SIGTERM, lambda *_: gs.close())
        timer = threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGTERM))
    else:
        timer = threading.Timer(0.5, gs.close)
    timer.start()
    try:
        gs.average([np.ones(4)], step=1)
    except (SystemExit, gradsync.GradSyncError) as exc:
        outcome = type(exc).__name__, str(exc)
    else:
        outcome = "averaged", ""
    seconds = round(time.monotonic() - start)
    timer.join(5)  # the closing thread finishes once the call has let go
    mark_done(sync_dir, 0)
    return (*outcome, seconds, repr(gs))


def rank_0_interrupted_then_calls_again(rank: int, world: int, sync_dir: str) -> Any:
    """Ranks 0-2; rank 0 is interrupted once rank 1 has confirmed (rank 2 comes 1 s
    later), and calls again at once; its new session may remove the old generation
    before rank 1 reads why it ended. A rank told of a failure calls again once. All
    must get the mean, long before max_wait_s."""
    from gradsync._job import notes as _jobfiles  # noqa: PLC0415

    if rank == 2:
        time.sleep(1.0)
    if rank == 1:
        # Rank 1 is slow to look: it never sees rank 0's abort note before the note's
        # generation is removed (a race that a real rank loses now and then).
        real_read = _jobfiles.read_raw

        def unseen_abort(path: Path) -> bytes | None:
            return None if path.name == ABORT else real_read(path)

        _jobfiles.read_raw = unseen_abort  # type: ignore[assignment]
    if rank == 0:
        _on_first(sync_dir, "gen-*/member-1-*.json", lambda: os.kill(os.getpid(), signal.SIGINT))
    cfg = config(rank, world, sync_dir, max_wait_s=20.0)
    grads = [np.full(4, float(rank))]
    try:
        gradsync.average_grads_file_sync(grads, None, cfg, 0)
    except (KeyboardInterrupt, gradsync.GradSyncError):
        gradsync.average_grads_file_sync(grads, None, cfg, 0)
    return grads[0].tolist()


def rank_0_fails_and_its_generation_goes(rank: int, world: int, sync_dir: str) -> Any:
    """Ranks 0 and 1 of 3 (rank 2 never comes). Rank 0 is interrupted once rank 1 has
    confirmed; rank 1 never sees its abort note, and the generation is removed (as the
    next job's rank 0 would); rank 0 exits 1 s later. Rank 1 must hear that rank 0 is
    gone, not wait out max_wait_s for a new offer."""
    from gradsync._job import notes as _jobfiles  # noqa: PLC0415
    from gradsync._job import reaping as _reaping  # noqa: PLC0415

    if rank == 1:
        real_read = _jobfiles.read_raw

        def unseen_abort(path: Path) -> bytes | None:
            return None if path.name == ABORT else real_read(path)

        _jobfiles.read_raw = unseen_abort  # type: ignore[assignment]
        with gradsync.GradSync(config(rank, world, sync_dir, max_wait_s=20.0)) as gs:
            gs.average([np.ones(4)], step=0)
        return None
    _on_first(sync_dir, "gen-*/member-1-*.json", lambda: os.kill(os.getpid(), signal.SIGINT))
    try:
        with gradsync.GradSync(config(rank, world, sync_dir, max_wait_s=20.0)) as gs:
            gs.average([np.ones(4)], step=0)
    except KeyboardInterrupt:
        _reaping.reap_stale_generations(Path(sync_dir), Path(sync_dir) / "gen-none", 15.0)
        time.sleep(1.0)
    return None


def joiner_closed_as_the_roster_appears(rank: int, world: int, sync_dir: str) -> Any:
    """Rank 1's session is closed from another thread the moment rank 0 writes the
    roster: in its rendezvous or just after, it must leave, and rank 0 hear of it."""
    gs = gradsync.GradSync(config(rank, world, sync_dir, max_wait_s=20.0))
    closed = threading.Event()
    if rank == 1:
        _on_first(sync_dir, "gen-*/roster.json", lambda: (gs.close(), closed.set()))
    start = time.monotonic()
    try:
        gs.average([np.ones(4)], step=0)
        if rank == 1:
            # On a loaded machine the watcher may only get a core once step 0 is done:
            # step 1 then meets the closed session (the close lands "just after").
            closed.wait(10)
        gs.average([np.ones(4)], step=1)
    except gradsync.GradSyncError as exc:
        return type(exc).__name__, time.monotonic() - start
    finally:
        gs.close()
    return "averaged", time.monotonic() - start


def interrupted_while_closing(rank: int, world: int, sync_dir: str) -> Any:
    """Rank 1 is interrupted (KeyboardInterrupt) while its close() stops its threads, and
    lives on: rank 0's next call must learn at once that it left."""
    from gradsync._step import engine as _protocol  # noqa: PLC0415

    gs = gradsync.GradSync(config(rank, world, sync_dir, max_wait_s=20.0))
    gs.average([np.ones(4)], step=0)
    if rank == 1:
        stop = _protocol.StepEngine.close

        def interrupted(self: Any) -> None:
            stop(self)
            raise KeyboardInterrupt

        _protocol.StepEngine.close = interrupted  # type: ignore[method-assign]
        try:
            gs.close()
        except KeyboardInterrupt:
            linger(sync_dir, [0], 4)  # alive until rank 0 heard
            return "interrupted"
        return "closed"
    start = time.monotonic()
    try:
        gs.average([np.ones(4)], step=1)
    except gradsync.GradSyncError as exc:
        return type(exc).__name__, time.monotonic() - start
    finally:
        mark_done(sync_dir, 0)
        gs.close()
    return None


def dropped_without_close(rank: int, world: int, sync_dir: str) -> Any:
    """Rank 1 drops its GradSync after one call, unclosed, and lives on: rank 0's next
    call must learn at once that it left."""
    gs = gradsync.GradSync(config(rank, world, sync_dir, max_wait_s=20.0))
    gs.average([np.ones(4)], step=0)
    if rank == 1:
        del gs
        gc.collect()
        beating = [t.name for t in threading.enumerate() if t.name == "gradsync-heartbeat"]
        linger(sync_dir, [0], 4)  # alive until rank 0 heard
        return beating
    start = time.monotonic()
    try:
        gs.average([np.ones(4)], step=1)
    except gradsync.GradSyncError as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start
    finally:
        mark_done(sync_dir, 0)
        gs.close()
    return None


def raises_in_its_with_block(rank: int, world: int, sync_dir: str) -> Any:
    """Rank 1's training code raises inside its ``with GradSync`` block after one call:
    rank 0's next call names the exception."""
    cfg = config(rank, world, sync_dir, max_wait_s=20.0)
    if rank == 1:
        with contextlib.suppress(ValueError), gradsync.GradSync(cfg) as gs:
            gs.average([np.ones(4)], step=0)
            raise ValueError("batch 7 is empty\n(second line)")
        return None
    with gradsync.GradSync(cfg) as gs:
        gs.average([np.ones(4)], step=0)
        try:
            gs.average([np.ones(4)], step=1)
        except gradsync.GradSyncError as exc:
            return type(exc).__name__, str(exc)
    return None


def membership_not_written(rank: int, world: int, sync_dir: str) -> Any:
    """Rank 1 is offered a place, then cannot write its membership file (ENOSPC)."""
    from gradsync._job import notes as _jobfiles  # noqa: PLC0415

    if rank == 1:
        write = _jobfiles.write_atomic

        def failing(path: Path, chunks: Any, **kw: Any) -> int:
            if path.name.startswith("member-"):
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
            return write(path, chunks, **kw)

        _jobfiles.write_atomic = failing  # type: ignore[assignment]
    with gradsync.GradSync(config(rank, world, sync_dir, max_wait_s=20.0)) as gs:
        gs.average([np.ones(4)], step=0)


def bad_input(rank: int, world: int, sync_dir: str) -> Any:
    grads = grads_for(rank, 0)
    with gradsync.GradSync(config(rank, world, sync_dir)) as gs:
        gs.average(grads, step=0)
        grads = grads_for(rank, 1)
        if rank == 1:
            grads[0] = np.asfortranarray(grads[0])
            grads[0] = grads[0][:, ::2]
        gs.average(grads, step=1)


def _tree_bytes(root: Path) -> int:
    """Bytes of every file under ``root`` (data files and markers); rank 0 may remove
    old step directories meanwhile, and what is gone no longer counts."""
    total = 0
    for folder, _dirs, files in os.walk(root):
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                total += os.stat(os.path.join(folder, name)).st_size
    return total


def _step_dirs(gen: Path) -> int:
    return sum(p.name.startswith("s-") for p in gen.iterdir())


def count_step_dirs(rank: int, world: int, sync_dir: str, steps: int) -> Any:
    """Average ``steps`` times; report the most step dirs and bytes seen on disk."""
    most_dirs = 0
    most_bytes = 0
    gs = gradsync.GradSync(config(rank, world, sync_dir))
    for step in range(steps):
        gs.average(grads_for(rank, step), step=step)
        gen = Path(gs.generation_dir or "")
        most_dirs = max(most_dirs, _step_dirs(gen))
        most_bytes = max(most_bytes, _tree_bytes(gen))
    gen_dir = gs.generation_dir
    gs.close()
    return most_dirs, most_bytes, gen_dir


def own_file_sizes(rank: int, world: int, sync_dir: str, plans: str) -> Any:
    """Average one call per letter of ``plans`` (b: big, h: huge; both one sharded file);
    report each call's result as bytes and, after it, the (inode, size) of this rank's
    input and output files."""
    results, files = [], []
    with gradsync.GradSync(config(rank, world, sync_dir)) as gs:
        for step, kind in enumerate(plans):
            grads = grads_for(rank, step, SHAPES_HUGE if kind == "h" else SHAPES_BIG)
            gs.average(grads, step=step)
            results.append([g.tobytes() for g in grads])
            gen = Path(gs.generation_dir or "")
            stats = [os.stat(gen / f"d-{rank}.{k}") for k in ("in", "out")]
            files.append([(st.st_ino, st.st_size) for st in stats])
    return results, files


def marker_creates(rank: int, world: int, sync_dir: str, plans: str) -> Any:
    """Average one call per letter of ``plans`` (s: small, replicated; b: big, sharded);
    report how many markers were created rather than moved, the most step dirs seen,
    each call's result as bytes, and how many plans were built."""
    from gradsync._step.plan import Plan  # noqa: PLC0415
    from gradsync._store import files as _fsio  # noqa: PLC0415

    created: list[str] = []
    original = _fsio.create_marker
    build = Plan.build.__func__  # type: ignore[attr-defined]
    built: list[int] = []

    def create(path: Path, **kw: Any) -> None:
        created.append(path.name)
        original(path, **kw)

    def counted_build(cls: type[Plan], *args: Any, **kwargs: Any) -> Plan:
        built.append(1)
        return build(cls, *args, **kwargs)  # type: ignore[no-any-return]

    _fsio.create_marker = create  # type: ignore[assignment]
    Plan.build = classmethod(counted_build)  # type: ignore[method-assign,assignment]
    most_dirs = 0
    results = []
    with gradsync.GradSync(config(rank, world, sync_dir)) as gs:
        for step, kind in enumerate(plans):
            grads = grads_for(rank, step, SHAPES_BIG if kind == "b" else SHAPES)
            gs.average(grads, step=step)
            results.append([g.tobytes() for g in grads])
            most_dirs = max(most_dirs, _step_dirs(Path(gs.generation_dir or "")))
    return created, most_dirs, results, len(built)


def late_reader_across_plans(rank: int, world: int, sync_dir: str) -> Any:
    """Three calls: big (one file a rank), small (two slots), big. Rank 1 opens its
    peers' files of the small call late, after rank 0 has written its next input."""
    from gradsync._step.peers import PeerFiles  # noqa: PLC0415

    if rank == 1:
        original = PeerFiles._open

        def late_open(self: PeerFiles, path: Path, q: int, kind: int, step: int, seq: int) -> Any:
            if seq == 2 and q != self.rank:
                time.sleep(0.5)
            return original(self, path, q, kind, step, seq)

        PeerFiles._open = late_open  # type: ignore[method-assign]
    results = []
    with gradsync.GradSync(config(rank, world, sync_dir)) as gs:
        for step, shapes in enumerate((SHAPES_BIG, SHAPES, SHAPES_BIG)):
            grads = grads_for(rank, step, shapes)
            gs.average(grads, step=step)
            results.append([g.tobytes() for g in grads])
    return results


def shifting_layouts(
    rank: int, world: int, sync_dir: str, seed: int, calls: int, kw: dict[str, Any]
) -> Any:
    """``calls`` calls whose layout changes at random (small, big, big in
    ``buffers_like`` arrays; the same choices on every rank, from ``seed``), each rank
    pausing at random (0-3 ms) before publishing and before opening a peer's file.
    Returns each call's result as bytes."""
    from gradsync._step.engine import StepEngine  # noqa: PLC0415
    from gradsync._step.peers import PeerFiles  # noqa: PLC0415

    shared = np.random.default_rng(seed)
    plans = shared.choice(["small", "big", "shared"], size=calls).tolist()
    local = np.random.default_rng([seed, rank])

    def pause() -> None:
        if local.random() < 0.5:
            time.sleep(float(local.uniform(0, 0.003)))

    publish, open_ = StepEngine._publish, PeerFiles._open

    def late_publish(self: StepEngine, *args: Any) -> Any:
        pause()
        return publish(self, *args)

    def late_open(self: PeerFiles, *args: Any) -> Any:
        pause()
        return open_(self, *args)

    StepEngine._publish = late_publish  # type: ignore[method-assign]
    PeerFiles._open = late_open  # type: ignore[method-assign]
    results = []
    with gradsync.GradSync(config(rank, world, sync_dir, **kw)) as gs:
        shared_arrays: list[np.ndarray] | None = None
        for call, plan in enumerate(plans):
            grads = grads_for(rank, call, SHAPES if plan == "small" else SHAPES_BIG)
            if plan == "shared":
                if shared_arrays is None:
                    shared_arrays = gs.buffers_like(grads)
                for dst, src in zip(shared_arrays, grads, strict=True):
                    dst[...] = src
                grads = shared_arrays
            gs.average(grads, step=call)
            results.append([g.tobytes() for g in grads])
    return plans, results


def crash_after_publish(rank: int, world: int, sync_dir: str) -> Any:
    """An earlier run: average one step, publish the next inputs, then die hard."""
    gs = gradsync.GradSync(config(rank, world, sync_dir))
    gs.average(grads_for(rank + 100, 0), step=0)
    engine = gs._session.engine
    assert engine is not None
    engine.seq += 1
    step_dir = engine.gen.path / f"s-{engine.seq}"
    plan = engine._plan_for(tuple((g.dtype.str, g.shape) for g in grads_for(rank + 100, 1)))
    flats = [g.reshape(-1) for g in grads_for(rank + 100, 1)]
    engine._publish(step_dir, plan, flats, 1, [], None)
    os.kill(os.getpid(), signal.SIGKILL)


def claim(rank: int, world: int, sync_dir: str, as_rank: int) -> Any:
    """Process ``rank`` claims rank ``as_rank``; a job that forms runs on (at most 3 s)
    until the processes it left out have failed: a running job, not one that has left."""
    try:
        with gradsync.GradSync(config(as_rank, world, sync_dir, max_wait_s=8.0)) as gs:
            gs.average(grads_for(as_rank, 0), step=0)
            linger(sync_dir, ["left-out"], 3.0)
    except gradsync.GradSyncError:
        mark_done(sync_dir, "left-out")
        raise
    return "joined"


def rendezvous_world(rank: int, world: int, sync_dir: str, worlds: list[int]) -> Any:
    with gradsync.GradSync(config(rank, worlds[rank], sync_dir, max_wait_s=8.0)) as gs:
        gs.average(grads_for(rank, 0), step=0)


# What a setting means something only with: elastic for min_world_size, compression for
# compress_local and error_feedback.
_SETTING_NEEDS: dict[str, dict[str, Any]] = {
    "min_world_size": {"elastic": True},
    "compress_local": {"compression": "int8"},
    "error_feedback": {"compression": "int8"},
}


def rendezvous_settings(rank: int, world: int, sync_dir: str, key: str, values: list[Any]) -> Any:
    needs = _SETTING_NEEDS.get(key, {})
    cfg = config(rank, world, sync_dir, max_wait_s=8.0, **{key: values[rank]}, **needs)
    with gradsync.GradSync(cfg) as gs:
        gs.average(grads_for(rank, 0, SHAPES_BIG), step=0)


def shared_buffer_steps(
    rank: int, world: int, sync_dir: str, big: bool, kw: dict[str, Any]
) -> dict[str, Any]:
    """Steps 0-4 on ``GradSync.buffers_like`` arrays, except step 2 (copies of the inputs)
    and step 4 (a second set of buffers). Returns every step's results as bytes, whether
    the rank's input file was a link to its buffers after each step, whether step 2 left
    the buffers as they were, and whether the first buffers survive the second set."""
    shapes = SHAPES_BIG if big else SHAPES
    out: dict[str, Any] = {"results": [], "linked": []}
    with gradsync.GradSync(config(rank, world, sync_dir, **kw)) as gs:
        bufs = gs.buffers_like(grads_for(rank, 0, shapes))
        assert [(b.shape, b.dtype.name) for b in bufs] == shapes
        assert all(not b.any() for b in bufs)
        gen = Path(str(gs.generation_dir))
        first = bufs
        for step in range(5):
            inputs = grads_for(rank, step, shapes)
            if step == 4:
                bufs = gs.buffers_like(inputs)
            if step == 2:
                before = [b.copy() for b in bufs]
                grads = [g.copy() for g in inputs]
            else:
                for b, g in zip(bufs, inputs, strict=True):
                    b[...] = g
                grads = bufs
            gs.average(grads, step=step)
            out["linked"].append((gen / f"d-{rank}.in").is_symlink())
            out["results"].append([g.tobytes() for g in grads])
            if step == 2:
                out["untouched"] = all(
                    a.tobytes() == b.tobytes() for a, b in zip(before, bufs, strict=True)
                )
        out["first_kept"] = [a.tobytes() for a in first] == out["results"][3]
    return out


def shared_buffers_then_fail(rank: int, world: int, sync_dir: str) -> dict[str, Any]:
    """Average SHAPES_BIG buffers twice; a fault set by the test ends the second step.

    Returns the error of the second step and whether the buffers still hold this
    rank's own inputs of it."""
    with gradsync.GradSync(config(rank, world, sync_dir, max_wait_s=20.0)) as gs:
        bufs = gs.buffers_like(grads_for(rank, 0, SHAPES_BIG))
        for step in range(2):
            inputs = grads_for(rank, step, SHAPES_BIG)
            for b, g in zip(bufs, inputs, strict=True):
                b[...] = g
            try:
                gs.average(bufs, step=step)
            except gradsync.GradSyncError as exc:
                kept = all(a.tobytes() == b.tobytes() for a, b in zip(inputs, bufs, strict=True))
                return {"step": step, "error": type(exc).__name__, "kept": kept}
    return {"step": None}


def torch_grads_in_buffers(rank: int, world: int, sync_dir: str) -> dict[str, Any]:
    """docs/pytorch.md's recipe: a torch model's ``p.grad`` are ``buffers_like`` arrays.

    Three SGD steps on rank-dependent data; per step, this rank's gradients before
    averaging, the averaged ones, whether every ``p.grad`` still lives in its buffer
    after ``backward()``, and whether the step was published through the link."""
    import torch  # noqa: PLC0415 - only this worker needs torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(300, 300), torch.nn.Tanh(), torch.nn.Linear(300, 2))
    params = list(model.parameters())
    out: dict[str, Any] = {"before": [], "after": [], "in_buffers": [], "linked": []}
    with gradsync.GradSync(config(rank, world, sync_dir)) as gs:
        grads = gs.buffers_like([p.detach().numpy() for p in params])
        for p, g in zip(params, grads, strict=True):
            p.grad = torch.from_numpy(g)
        opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
        gen = Path(str(gs.generation_dir))
        x = torch.from_numpy(np.random.default_rng(rank).standard_normal((16, 300)).astype("f4"))
        for step in range(3):
            opt.zero_grad(set_to_none=False)
            model(x).pow(2).mean().backward()
            out["in_buffers"].append(
                all(p.grad.data_ptr() == g.ctypes.data for p, g in zip(params, grads, strict=True))
            )
            out["before"].append([g.tobytes() for g in grads])
            gs.average(grads, step=step)
            out["linked"].append((gen / f"d-{rank}.in").is_symlink())
            out["after"].append([g.tobytes() for g in grads])
            opt.step()
    return out


def buffers_left_unwritten(rank: int, world: int, sync_dir: str) -> list[Any]:
    """``buffers_like`` arrays, mapped (SHAPES_BIG) then plain (SHAPES), each in a
    session of its own: written for step 0, then averaged as they are. Returns each
    session's error type, step and message, or ``None``."""
    out: list[Any] = []
    for i, shapes in enumerate((SHAPES_BIG, SHAPES)):
        with gradsync.GradSync(config(rank, world, f"{sync_dir}/{i}")) as gs:
            bufs = gs.buffers_like(grads_for(rank, 0, shapes))
            for b, g in zip(bufs, grads_for(rank, 0, shapes), strict=True):
                b[...] = g
            try:
                for step in range(4):
                    gs.average(bufs, step=step)
                out.append(None)
            except gradsync.GradSyncError as exc:
                out.append((type(exc).__name__, exc.step, str(exc)))
    return out


def torch_buffers_all(
    rank: int, world: int, sync_dir: str, runs: list[tuple[str, int, int | None]]
) -> dict[str, Any]:
    """:func:`torch_grads_in_buffers`, then :func:`torch_buffers_recipes` of ``runs``, in
    sync dirs of their own: one torch import for every torch test of buffers_like."""
    return {
        "in_buffers": torch_grads_in_buffers(rank, world, f"{sync_dir}/in-buffers"),
        "recipes": torch_buffers_recipes(rank, world, f"{sync_dir}/recipes", runs),
    }


def torch_buffers_recipes(
    rank: int, world: int, sync_dir: str, runs: list[tuple[str, int, int | None]]
) -> list[Any]:
    """Each run of ``runs`` in a session of its own (one torch import for them all):
    ``("ok", the parameters as bytes)``, or the error's type name, step and message."""
    out: list[Any] = []
    for i, (how, hidden, zero_from) in enumerate(runs):
        try:
            params = _torch_buffers_recipe(rank, world, f"{sync_dir}/{i}", how, hidden, zero_from)
            out.append(("ok", params))
        except gradsync.GradSyncError as exc:
            out.append((type(exc).__name__, exc.step, str(exc)))
    return out


def _torch_buffers_recipe(
    rank: int, world: int, sync_dir: str, how: str, hidden: int, zero_from: int | None
) -> list[bytes]:
    """Six SGD steps of docs/pytorch.md's torch recipe (``p.grad`` are ``buffers_like``
    arrays); ``how``: "keep" (``zero_grad(set_to_none=False)``, as documented), "top" or
    "end" (torch's default ``zero_grad()`` before ``backward()`` or after the step), on
    the rank given after a colon (else every rank). Besides the trained layers: a frozen
    one and an unused param, both in the buffers; from step ``zero_from`` the loss is
    scaled by 0 (every gradient exactly zero). Returns the parameters as bytes."""
    import torch  # noqa: PLC0415 - only this worker needs torch

    mode, _, only = how.partition(":")
    mode = mode if not only or int(only) == rank else "keep"
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 2)
    )
    frozen = torch.nn.Linear(64, 64).requires_grad_(False)
    unused = torch.nn.Parameter(torch.zeros(10))
    trained = [*model.parameters(), unused]
    every = [*trained, *frozen.parameters()]
    with gradsync.GradSync(config(rank, world, sync_dir)) as gs:
        grads = gs.buffers_like([p.detach().numpy() for p in every])
        for p, g in zip(every, grads, strict=True):
            p.grad = torch.from_numpy(g)
        opt = torch.optim.SGD(trained, lr=0.1)
        x = torch.from_numpy(np.random.default_rng(rank).standard_normal((16, 64)).astype("f4"))
        for step in range(6):
            if mode == "top":
                opt.zero_grad()
            elif mode == "keep":
                opt.zero_grad(set_to_none=False)
            scale = 0.0 if zero_from is not None and step >= zero_from else 1.0
            (model(frozen(x)).pow(2).mean() * scale).backward()
            gs.average(grads, step=step)
            opt.step()
            if mode == "end":
                opt.zero_grad()
    return [p.detach().numpy().tobytes() for p in every]


def without_proc(rank: int, world: int, sync_dir: str, late: int, victim: int | None) -> Any:
    """Ranks on a host without /proc (as on macOS): ``late`` publishes each call 0.3 s
    after the others, then ``victim`` (if any) exits before its third call (and stays
    a zombie: the test's process reaps it only at the end)."""
    _proc.set_root(Path(sync_dir) / "no-proc-here")
    cfg = config(
        rank, world, sync_dir, max_wait_s=60.0, heartbeat_interval_s=0.2, heartbeat_timeout_s=1.0
    )
    with gradsync.GradSync(cfg) as gs:
        for step in range(3):
            if rank == victim and step == 2:
                os._exit(7)
            if rank == late:
                time.sleep(0.3)
            grads = grads_for(rank, step)
            gs.average(grads, step=step)
    return [g.tobytes() for g in grads]


def fork_after_a_step(rank: int, world: int, sync_dir: str) -> Any:
    """After step 0, rank 0 forks a child that tries to average and then closes the
    session (explicitly and as at exit); rank 0 then arrives late at step 1, so that
    rank 1 checks whether it is still there. Returns step 1's result and, on rank 0,
    what the child saw."""
    from gradsync import _session  # noqa: PLC0415

    child_saw = None
    with gradsync.GradSync(config(rank, world, sync_dir)) as gs:
        gs.average(grads_for(rank, 0), step=0)
        if rank == 0:
            read, write = os.pipe()
            pid = os.fork()
            if pid == 0:  # the child: report, clean up as at exit, never return
                try:
                    gs.average(grads_for(rank, 1), step=1)
                    saw = "averaged"
                except gradsync.GradSyncError as exc:
                    saw = f"{type(exc).__name__}: {exc}"
                gs.close()
                _session.close_all()
                os.write(write, saw.encode())
                os._exit(0)
            os.close(write)
            with os.fdopen(read, "rb") as f:
                child_saw = f.read().decode()
            os.waitpid(pid, 0)
            time.sleep(0.3)
        grads = grads_for(rank, 1)
        gs.average(grads, step=1)
    return [g.tobytes() for g in grads], child_saw


# A thousand small params: the input files' header (the layout) is longer than the
# first read of a peer's file (HEADER_READ_BYTES).
SHAPES_MANY: list[tuple[tuple[int, ...], str]] = [((16, 16), "float32")] * 1100


def many_params(rank: int, world: int, sync_dir: str, kw: dict[str, Any]) -> Any:
    """Two steps of SHAPES_MANY, the second with every param of the last rank NaN."""
    out = []
    with gradsync.GradSync(config(rank, world, sync_dir, **kw)) as gs:
        grads = grads_for(rank, 0, SHAPES_MANY)
        gs.average(grads, step=0)
        out.append(b"".join(g.tobytes() for g in grads))
        grads = grads_for(rank, 1, SHAPES_MANY)
        if rank == world - 1:
            for g in grads:
                g[0, 0] = np.nan
        try:
            gs.average(grads, step=1)
        except gradsync.NonFiniteGradError as exc:
            out.append(str(exc))
    return out


class _FlagsRaise(np.ndarray):
    @property
    def flags(self) -> Any:
        raise RuntimeError("these flags cannot be read")


def bad_first_call(rank: int, world: int, sync_dir: str, how: str) -> Any:
    """The last rank's first call is bad; the others' are fine. ``how``: int64 gradients
    in ``average`` or in ``buffers_like``, ``"step"``: a step of 0.5, or ``"unforeseen"``:
    an array whose checks raise an error gradsync does not know (a RuntimeError)."""
    bad = rank == world - 1
    like = [np.zeros(3, np.int64 if bad and how not in ("step", "unforeseen") else np.float32)]
    if bad and how == "unforeseen":
        like = [like[0].view(_FlagsRaise)]
    with gradsync.GradSync(config(rank, world, sync_dir, max_wait_s=30.0)) as gs:
        if how == "buffers_like":
            like = gs.buffers_like(like)
        gs.average(like, step=0.5 if bad and how == "step" else 0)  # type: ignore[arg-type]


def recover_after_failure(rank: int, world: int, sync_dir: str, how: str) -> Any:
    """A call that fails on every rank (a shape mismatch), then a new session of the same
    job (same run_id). ``how``: "close late" (the last rank closes its failed session
    0.5 s after the others), "drop" (it never closes it), or "function" (the function
    form, called again with the same config)."""
    cfg = config(rank, world, sync_dir, run_id="job", max_wait_s=10.0)
    odd = [np.zeros(4 + (rank == world - 1), np.float32)]
    if how == "function":
        gradsync.average_grads_file_sync(grads_for(rank, 0), None, cfg, 0)
        with contextlib.suppress(gradsync.MismatchError):
            gradsync.average_grads_file_sync(odd, None, cfg, 1)
        grads = grads_for(rank, 5)
        gradsync.average_grads_file_sync(grads, None, cfg, 5)
        return [g.tobytes() for g in grads]
    gs = gradsync.GradSync(cfg)
    gs.average(grads_for(rank, 0), step=0)
    with contextlib.suppress(gradsync.MismatchError):
        gs.average(odd, step=1)
    if rank == world - 1:
        if how == "close late":
            time.sleep(0.5)
            gs.close()
    else:
        gs.close()
    with gradsync.GradSync(cfg) as again:
        grads = grads_for(rank, 5)
        again.average(grads, step=5)
    return [g.tobytes() for g in grads]


def first_call(rank: int, world: int, sync_dir: str, max_wait_s: float, late: int) -> Any:
    """One call; rank ``late`` starts 1.5 s after the others."""
    if rank == late:
        time.sleep(1.5)
    with gradsync.GradSync(config(rank, world, sync_dir, max_wait_s=max_wait_s)) as gs:
        gs.average(grads_for(rank, 0), step=0)


def replaced_member(index: int, world: int, sync_dir: str) -> Any:
    """A job of 3 whose rank 1 dies in the rendezvous, after confirming, and is replaced.

    Process 0 is rank 0; process 1 is rank 1 and kills itself once its member file is
    written; process 2 is the new rank 1, started once that happened; process 3 is rank
    2, started after it. Returns the mean of the one call.
    """
    # Rank 0 removes the dead member's file as soon as it sees it: the others wait for a
    # mark that stays (they used to look for that file, and could miss it for good).
    died = Path(sync_dir) / ".rank-1-died"
    if index == 1:

        def die() -> None:
            while not list(Path(sync_dir).glob("gen-*/member-1-*.json")):
                time.sleep(0.0005)
            died.touch()
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=die, daemon=True).start()
    elif index >= 2:
        while not died.exists():
            time.sleep(0.005)
        time.sleep(0.5 * index)
    rank = {0: 0, 1: 1, 2: 1, 3: 2}[index]
    grads = grads_for(rank, 0)
    with gradsync.GradSync(config(rank, 3, sync_dir, max_wait_s=20.0)) as gs:
        gs.average(grads, step=0)
    return [g.tobytes() for g in grads]


def across_the_switch(rank: int, world: int, sync_dir: str, call: int, use_mmap: bool) -> Any:
    """``call`` calls of 320 kB (reduced in shards), then one where the last rank passes
    80 kB (which ranks reduce whole): a mismatch whose files have different names."""
    with gradsync.GradSync(config(rank, world, sync_dir, use_mmap=use_mmap)) as gs:
        for step in range(call):
            gs.average([np.ones(80_000, np.float32)], step=step)
        grads = [np.full(20_000 if rank == world - 1 else 80_000, rank, np.float32)]
        try:
            gs.average(grads, step=call)
        finally:
            assert (grads[0] == rank).all()


def modes_of_what_a_job_creates(rank: int, world: int, sync_dir: str) -> dict[str, int]:
    """Average two steps under a group's umask (002); the permission bits of every name
    in ``sync_dir`` while the job runs, as rank 0 sees them after the last step."""
    os.umask(0o002)
    with gradsync.GradSync(config(rank, world, sync_dir)) as gs:
        for step in range(2):
            gs.average([np.full(1000, float(rank), np.float32)], step=step)
        modes = {}
        if rank == 0:
            root = Path(sync_dir)
            for path in [root, *root.rglob("*")]:
                with contextlib.suppress(FileNotFoundError):  # a peer's file moved on
                    modes[str(path.relative_to(root))] = path.lstat().st_mode & 0o777
        gs.average([np.zeros(1, np.float32)], step=2)  # rank 1 waits while rank 0 looks
    return modes


def stale_view(
    rank: int,
    world: int,
    sync_dir: str,
    stale_opens: int,
    max_wait_s: float,
    stale_s: float = 0.0,
    late_s: float = 0.0,
    missing: bool = False,
    warn_after_s: float = 10.0,
    shared: bool = True,
) -> dict[str, Any]:
    """Three calls of SHAPES_BIG through pread (one input file a rank). Rank 1's first
    ``stale_opens`` opens of rank 0's input in the third call (or, with ``stale_s``,
    its opens for that long from the first) show that file as it was in the first
    call, or with ``missing`` as not there (ENOENT, as NFS's cache of absent names
    does): a shared filesystem's stale view on rank 1's host, which gradsync takes
    for a shared one (``shared``) or a local one. Rank 0 starts the third call
    ``late_s`` late. Returns each call's result as bytes and the warnings logged."""
    from gradsync._step import state as _state  # noqa: PLC0415
    from gradsync._step.transport import Transport  # noqa: PLC0415

    _state.local_filesystem = lambda path: not shared  # type: ignore[assignment]
    if rank == 1:
        snapshot_name = "d-0.in-as-of-call-1"  # beside it: the transport opens by name
        # Rank 0's input of the first and third calls: one reused file, or (shared) one each.
        first_name, third_name = ("d-0-c1.in", "d-0-c3.in") if shared else ("d-0.in", "d-0.in")
        real_open = Transport.open
        opens = {"all": 0, "stale": 0}

        def stale_open(self: Transport, path: Path) -> Any:
            if path.name not in (first_name, third_name):
                return real_open(self, path)
            opens["all"] += 1
            snapshot = path.with_name(snapshot_name)
            if opens["all"] == 1:
                shutil.copyfile(path, snapshot)
            elif path.name == third_name and opens["all"] >= (2 if shared else 3):
                first = opens.setdefault("first_stale_at", time.monotonic())
                if time.monotonic() - first < stale_s if stale_s else opens["stale"] < stale_opens:
                    opens["stale"] += 1
                    if missing:
                        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(path))
                    return real_open(self, snapshot)
            return real_open(self, path)

        Transport.open = stale_open  # type: ignore[method-assign]
    results = []
    # Rank 0 waits longer: both timing out at once, either could report first.
    wait_s = max_wait_s if rank == 1 else max(max_wait_s, 30.0)
    cfg = config(
        rank, world, sync_dir, use_mmap=False, max_wait_s=wait_s, warn_after_s=warn_after_s
    )
    warnings = WarningLog()
    logging.getLogger("gradsync").addHandler(warnings)
    with gradsync.GradSync(cfg) as gs:
        for step in range(3):
            if rank == 0 and step == 2:
                time.sleep(late_s)
            grads = grads_for(rank, step, SHAPES_BIG)
            gs.average(grads, step=step)
            results.append([g.tobytes() for g in grads])
    return {"results": results, "warnings": warnings.messages}


def rendezvous_warnings(rank: int, world: int, sync_dir: str, late: int) -> list[str]:
    """Rank ``late`` starts 1.5 s after the others, which warn every 0.4 s while they
    wait: what each of them logged."""
    if rank == late:
        time.sleep(1.5)
    warnings = WarningLog()
    logging.getLogger("gradsync").addHandler(warnings)
    with gradsync.GradSync(config(rank, world, sync_dir, warn_after_s=0.4)) as gs:
        gs.average([np.ones(4)])
    return warnings.messages


def one_call(rank: int, world: int, sync_dir: str, run_id: str | None) -> None:
    """One averaging call of a job with ``run_id``."""
    with gradsync.GradSync(config(rank, world, sync_dir, run_id=run_id)) as gs:
        gs.average([np.ones(4)])


def per_call_files(
    rank: int, world: int, sync_dir: str, local_ranks: list[int], huge: bool = False
) -> dict[str, Any]:
    """Five calls, of SHAPES_BIG (or ``huge``: SHAPES_HUGE; sharded) but the third of
    SHAPES (small: no shards), with the sync dir taken for one other hosts share, except
    by ``local_ranks`` (an NFS server's own host, which maps the files and reuses them).
    Returns each call's result as bytes and the data files in the generation
    directory after each call."""
    from gradsync._step import state as _state  # noqa: PLC0415

    _state.local_filesystem = lambda path: rank in local_ranks  # type: ignore[assignment]
    results, files = [], []
    with gradsync.GradSync(config(rank, world, sync_dir, max_wait_s=30.0)) as gs:
        for step in range(5):
            big = SHAPES_HUGE if huge else SHAPES_BIG
            grads = grads_for(rank, step, SHAPES if step == 2 else big)
            gs.average(grads, step=step)
            results.append([g.tobytes() for g in grads])
            gen = next(Path(sync_dir).glob("gen-*"))
            files.append(sorted(p.name for p in gen.glob("d-*")))
    return {"results": results, "files": files}


def near_float64_max(rank: int, world: int, sync_dir: str, size: int, kw: dict[str, Any]) -> Any:
    """One step over float64 values within 1% of +-float64's largest (sums overflow)."""
    rng = np.random.default_rng([rank, 308])
    grad = np.sign(rng.uniform(-1, 1, size)) * rng.uniform(0.99, 1.0, size)
    grad *= np.finfo(np.float64).max
    before = grad.copy()
    with gradsync.GradSync(config(rank, world, sync_dir, **kw)) as gs:
        gs.average([grad])
    return before, grad
