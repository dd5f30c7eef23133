"""Rank bodies for tests/test_faults.py (importable by spawned children).

Fault injection (``GRADSYNC_TEST_FAULT``) is read when gradsync is imported, so the
tests set it in the parent's environment before ``run_ranks`` spawns the children;
every child inherits it and only the rank it names acts on it.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import numpy as np

import gradsync
from gradsync._format import KIND_INPUT, KIND_OUTPUT, MAGIC, decode_header
from gradsync._protocol import StepEngine
from ranks import config
from workers import grads_for

_log = logging.getLogger("gradsync")


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _record(
    gs: gradsync.GradSync, rank: int, step: int, offset: int = 0, shapes: Any = None
) -> dict[str, Any]:
    """One averaging call: what it raised (if anything), how long it took, the arrays after."""
    grads = (
        grads_for(rank + offset, step) if shapes is None else grads_for(rank + offset, step, shapes)
    )
    start = time.monotonic()
    rec: dict[str, Any] = {"step": step, "ok": True, "type": "", "message": "", "ranks": ()}
    try:
        gs.average(grads, step=step)
    except gradsync.GradSyncError as exc:
        rec.update(
            ok=False,
            type=type(exc).__name__,
            message=str(exc),
            ranks=exc.ranks,
            err_step=exc.step,
            errno=getattr(exc, "errno", None),
        )
    rec["elapsed_s"] = time.monotonic() - start
    rec["at"] = time.time()
    rec["after"] = [g.tobytes() for g in grads]
    return rec


def steps_until_error(
    rank: int,
    world: int,
    sync_dir: str,
    steps: int,
    kw: dict[str, Any],
    offset: int = 0,
    hold_s: float = 0.0,
) -> dict[str, Any]:
    """Average ``steps`` rounds, stopping at the first error.

    Returns every call's record and the warnings logged by logger ``gradsync``.
    ``hold_s``: after an error, stay alive this long (a process that does not exit
    at once), so that peers cannot learn of the failure from its death.
    """
    handler = _Collect()
    _log.addHandler(handler)
    records = []
    gen_dir = None
    try:
        with gradsync.GradSync(config(rank, world, sync_dir, **kw)) as gs:
            for step in range(steps):
                rec = _record(gs, rank, step, offset)
                gen_dir = gs.generation_dir
                records.append(rec)
                if not rec["ok"]:
                    time.sleep(hold_s)
                    break
    finally:
        _log.removeHandler(handler)
    return {"pid": os.getpid(), "gen": gen_dir, "records": records, "warnings": handler.messages}


def corrupt_own_file(
    rank: int,
    world: int,
    sync_dir: str,
    victim: int,
    name: str,
    how: str,
    call: int,
) -> dict[str, Any]:
    """Average 2 steps; ``victim`` publishes a damaged ``<name>-<victim>`` on call ``call``.

    ``how``: ``header`` flips a byte of the fixed header (the step field), ``truncate``
    cuts the file inside its payload, ``short`` cuts it inside the fixed header,
    ``payload`` flips the sign/exponent byte of the first payload element.
    """
    if rank == victim:
        kind = KIND_INPUT if name == "in" else KIND_OUTPUT
        original = StepEngine._write

        def damaged(self: StepEngine, *args: Any, **kwargs: Any) -> None:
            # Whatever _write's signature, one argument is the chunk list, header first.
            args = tuple(_damage(a, kind, call, how) for a in args)
            kwargs = {k: _damage(v, kind, call, how) for k, v in kwargs.items()}
            original(self, *args, **kwargs)

        StepEngine._write = damaged  # type: ignore[method-assign]
    return steps_until_error(rank, world, sync_dir, 2, {"max_wait_s": 20.0})


def _damage(arg: Any, kind: int, call: int, how: str) -> Any:
    """``arg`` damaged if it is the chunk list of a ``kind`` file for call ``call``."""
    if not isinstance(arg, (list, tuple)) or not arg:
        return arg
    first = arg[0]
    if not isinstance(first, (bytes, bytearray, memoryview)) or bytes(first[:4]) != MAGIC:
        return arg
    header = decode_header(bytes(first), "chunk")
    if header.kind != kind or header.seq != call:
        return arg
    data = bytearray(b"".join(c.tobytes() if isinstance(c, np.ndarray) else bytes(c) for c in arg))
    offset = header.payload_offset
    if how == "header":
        data[24] ^= 0x01  # the low byte of the step number
    elif how == "truncate":
        del data[offset + 4 :]
    elif how == "short":
        del data[40:]
    elif how == "payload":
        data[offset + 3] ^= 0x40  # exponent bits of the first element
    return [bytes(data)]


def two_jobs(rank: int, sync_dir: str, run_ids: list[str | None], steps: int) -> Any:
    """Processes 0,1 are job A's ranks 0,1; processes 2,3 job B's (inputs offset by 50)."""
    job, local = divmod(rank, 2)
    kw = {"max_wait_s": 4.0, "run_id": run_ids[job]}
    return steps_until_error(local, 2, sync_dir, steps, kw, offset=50 * job)
