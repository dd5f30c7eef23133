"""Run functions as real rank processes (spawn), collect what each returned or raised.

Children are always reaped: on any exit path, survivors are terminated, then killed.
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
from typing import Any

import gradsync

_CTX = mp.get_context("spawn")


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
) -> dict[int, Outcome]:
    """Start ``target(rank, *args)`` in one spawned process per rank and wait for them.

    ``expect`` lists the ranks expected to report (default: all started); others
    (e.g. ranks that kill themselves) only need to exit.
    """
    started = list(range(world)) if ranks is None else list(ranks)
    expect = started if expect is None else list(expect)
    out = _CTX.Queue()
    procs = {r: _CTX.Process(target=_child, args=(target, r, tuple(args), out)) for r in started}
    results: dict[int, Outcome] = {}
    try:
        for p in procs.values():
            p.start()
        deadline = time.monotonic() + timeout_s
        while len(results) < len(expect):
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
