"""Run functions as real rank processes, collect what each returned or raised.

Children are always reaped: on any exit path, survivors are terminated, then killed.
They start from a fork server that imported gradsync once (a spawn imports it again for
every rank, most of a typical test's time), so they never inherit the test process's
threads or patched globals; where the test changed the environment since that server
started (fault plans are read at import), or asks for children of its own process
(``spawn=True``: the fork server reaps its children, so none stays a zombie), they are
spawned instead.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing import forkserver
from pathlib import Path
from typing import Any

import gradsync

_SPAWN = mp.get_context("spawn")
_FORK_SERVER = mp.get_context("forkserver")
_FORK_SERVER.set_forkserver_preload(["numpy", "gradsync"])
_FORK_SERVER_ENV: dict[str, str] | None = None


def start_fork_server() -> None:
    """Start the fork server with the environment as it is now (conftest: the session's)."""
    global _FORK_SERVER_ENV
    forkserver.ensure_running()
    _FORK_SERVER_ENV = _environment()


def _environment() -> dict[str, str]:
    # pytest names the running test in the environment: no rank reads it.
    return {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}


def _context(spawn: bool) -> Any:
    """The fork server while the environment is the one it started with, else spawn."""
    return _FORK_SERVER if not spawn and _environment() == _FORK_SERVER_ENV else _SPAWN


@dataclass
class Outcome:
    rank: int
    ok: bool
    value: Any = None
    error_type: str = ""
    message: str = ""
    attrs: dict[str, Any] = field(default_factory=dict)
    elapsed_s: float = 0.0
    exitcode: int | None = None


def _child(target: Callable[..., Any], rank: int, args: tuple[Any, ...], out: Any) -> None:
    start = time.monotonic()
    try:
        value = target(rank, *args)
    except BaseException as exc:  # everything goes back to the test
        attrs = {k: getattr(exc, k, None) for k in ("step", "ranks", "path", "errno")}
        mro = [c.__name__ for c in type(exc).__mro__]
        out.put(
            (rank, False, mro, f"{exc}", attrs, time.monotonic() - start, traceback.format_exc())
        )
        return
    out.put((rank, True, value, "", {}, time.monotonic() - start, ""))


def run_ranks(
    target: Callable[..., Any],
    world: int,
    args: Sequence[Any] = (),
    *,
    ranks: Sequence[int] | None = None,
    timeout_s: float = 60.0,
    expect: Sequence[int] | None = None,
    spawn: bool = False,
) -> dict[int, Outcome]:
    """Start ``target(rank, *args)`` in one process per rank and wait for them.

    ``expect`` lists the ranks expected to report (default: all started); others
    (e.g. ranks that kill themselves) only need to exit. ``spawn``: the ranks are
    children of this process, so one that exits stays a zombie until this one reaps it.
    """
    started = list(range(world)) if ranks is None else list(ranks)
    expect = started if expect is None else list(expect)
    ctx = _context(spawn)
    out = ctx.Queue()
    procs = {r: ctx.Process(target=_child, args=(target, r, tuple(args), out)) for r in started}
    results: dict[int, Outcome] = {}
    try:
        for p in procs.values():
            p.start()
        deadline = time.monotonic() + timeout_s
        while not set(expect) <= results.keys():  # a rank not expected may report too
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"ranks {sorted(set(expect) - set(results))} did not report")
            try:
                rank, ok, value, message, attrs, elapsed, tb = out.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                continue
            if ok:
                results[rank] = Outcome(rank, True, value, elapsed_s=elapsed)
            else:
                results[rank] = Outcome(rank, False, tb, value[0], message, attrs, elapsed, None)
                results[rank].attrs["mro"] = value
        for p in procs.values():
            p.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs.values():
            if p.is_alive():
                p.terminate()
                p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
        out.close()
        out.join_thread()
    for r, p in procs.items():
        if r in results:
            results[r].exitcode = p.exitcode
    return results


def _each(
    rank: int, world: int, sync_dir: str, target: Callable[..., Any], arg_list: list[Any]
) -> list[Outcome]:
    """``target(rank, world, <sync_dir>/<i>, *args)`` for the ``i``-th ``args`` of
    ``arg_list``, one after another in this process: the outcome of each."""
    out = []
    for i, args in enumerate(arg_list):
        start = time.monotonic()
        try:
            value = target(rank, world, f"{sync_dir}/{i}", *args)
        except Exception as exc:  # each job's failure goes back to its own test
            attrs = {k: getattr(exc, k, None) for k in ("step", "ranks", "path", "errno")}
            attrs["mro"] = [c.__name__ for c in type(exc).__mro__]
            tb = traceback.format_exc()
            elapsed = time.monotonic() - start
            out.append(Outcome(rank, False, tb, type(exc).__name__, f"{exc}", attrs, elapsed))
        else:
            out.append(Outcome(rank, True, value, elapsed_s=time.monotonic() - start))
    return out


class SharedRanks:
    """Jobs of ``target``, each ``(world, args)``, of several tests: those of one world
    size run one after another, each in a sync dir of its own under ``base``, in one set
    of rank processes spawned at the first call for that world size (a spawn costs more
    than most jobs)."""

    def __init__(
        self,
        target: Callable[..., Any],
        jobs: Sequence[tuple[int, tuple[Any, ...]]],
        base: Path,
        timeout_s: float = 110.0,
    ) -> None:
        self._target, self._jobs, self._base, self._timeout_s = target, jobs, base, timeout_s
        self._done: dict[int, dict[int, Outcome]] = {}

    def __call__(self, world: int, *args: Any) -> dict[int, Outcome]:
        """Each rank's outcome of the job ``(world, args)``, as ``run_ranks`` gives it."""
        mine = [a for w, a in self._jobs if w == world]
        if world not in self._done:
            sync_dir = self._base / f"w{world}"
            every = (world, str(sync_dir), self._target, mine)
            results = run_ranks(_each, world, every, timeout_s=self._timeout_s)
            bad = {r: o.value for r, o in results.items() if not o.ok}
            assert not bad, bad
            self._done[world] = {r: o.value for r, o in results.items()}
        index = mine.index(args)
        return {r: outcomes[index] for r, outcomes in self._done[world].items()}


def config(rank: int, world: int, sync_dir: str, **kw: Any) -> gradsync.FileGradSyncConfig:
    kw.setdefault("max_wait_s", 30.0)
    return gradsync.FileGradSyncConfig(world, rank, sync_dir, **kw)


def pid() -> int:
    return os.getpid()


class WarningLog(logging.Handler):
    """Collects the messages of warnings (and worse) logged while attached."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())
