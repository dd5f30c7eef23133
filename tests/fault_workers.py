"""Rank bodies for tests/test_faults.py (importable by spawned children).

Fault injection (``GRADSYNC_TEST_FAULT``) is read when gradsync is imported, so the
tests set it in the parent's environment before ``run_ranks`` spawns the children;
every child inherits it and only the rank it names acts on it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gradsync
from gradsync._step import publish as _protocol
from gradsync._step.engine import StepEngine
from gradsync._step.header import HEADER_READ_BYTES, decode_header
from ranks import WarningLog, config
from workers import SHAPES, SHAPES_BIG, SHAPES_HUGE, grads_for

_log = logging.getLogger("gradsync")


def _record(
    gs: gradsync.GradSync, rank: int, step: int, offset: int = 0, shapes: Any = None
) -> dict[str, Any]:
    """One averaging call: what it raised (if anything), how long it took, the arrays after."""
    grads = grads_for(rank + offset, step, SHAPES if shapes is None else shapes)
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
    big: bool = False,
    huge: bool = False,
) -> dict[str, Any]:
    """Average ``steps`` rounds, stopping at the first error.

    Returns every call's record and the warnings logged by logger ``gradsync``.
    ``hold_s``: after an error, stay alive this long (a process that does not exit
    at once), so that peers cannot learn of the failure from its death.
    ``big``: use ``SHAPES_BIG``, large enough to be reduced in shards (every rank
    publishes a shard of the mean); the default ``SHAPES`` are small enough that every
    rank reduces everything itself and no ``out`` file is written. ``huge``: use
    ``SHAPES_HUGE`` (shards over 1 MiB).
    """
    shapes = SHAPES_HUGE if huge else SHAPES_BIG if big else SHAPES
    handler = WarningLog()
    _log.addHandler(handler)
    records = []
    gen_dir = None
    try:
        with gradsync.GradSync(config(rank, world, sync_dir, **kw)) as gs:
            for step in range(steps):
                rec = _record(gs, rank, step, offset, shapes)
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
    checksums: bool = False,
    steps: int = 2,
    across_hosts: bool = False,
) -> dict[str, Any]:
    """Average ``steps`` steps (``SHAPES_BIG``); ``victim`` publishes a damaged ``name`` on
    call ``call``. With ``across_hosts`` the sync dir is taken for one other hosts share,
    and the steps are of ``SHAPES_HUGE`` (an input is a file per shard).

    ``name`` is ``in`` or ``out``: the victim's data file (``d-<victim>.<name>``: one file a rank)
    is replaced by a damaged copy after it is written and closed, just before its marker
    ``s-<call>/<name>-<victim>`` is created, so every reader sees the damage.
    ``how``: ``header`` flips a byte of the fixed header (the step field), ``truncate``
    cuts the file inside its payload, ``short`` cuts it inside the fixed header,
    ``payload`` flips the sign/exponent byte of the first payload element.
    The result's ``damaged`` names the file damaged (None in other ranks).
    """
    damaged: list[str] = []
    if rank == victim:
        original = StepEngine._write

        def write(self: StepEngine, step_dir: Path, kind: str, chunks: Any, step: int) -> None:
            if kind != name or self.seq != call:
                original(self, step_dir, kind, chunks, step)
                return
            path = self.data_path(self.rank, kind)
            with _before_marker(lambda: _damage(path, how)):
                original(self, step_dir, kind, chunks, step)
            damaged.append(str(path))

        StepEngine._write = write  # type: ignore[method-assign]
    if across_hosts:
        from gradsync._step import state as _state  # noqa: PLC0415

        _state.local_filesystem = lambda path: False  # type: ignore[assignment]
    kw = {"max_wait_s": 20.0, "checksums": checksums}
    result = steps_until_error(rank, world, sync_dir, steps, kw, big=True, huge=across_hosts)
    result["damaged"] = damaged[0] if damaged else None
    return result


@contextlib.contextmanager
def _before_marker(action: Any) -> Iterator[None]:
    """Run ``action()`` just before the engine creates its next marker file."""
    original = _protocol.place_marker

    def place(path: Path, reuse: str | None, **kw: Any) -> None:
        action()
        original(path, reuse, **kw)

    _protocol.place_marker = place  # type: ignore[assignment]
    try:
        yield
    finally:
        _protocol.place_marker = original


def _damage(path: Path, how: str) -> None:
    """Replace the complete, closed data file ``path`` by a damaged copy."""
    data = bytearray(path.read_bytes())
    offset = decode_header(bytes(data[:HEADER_READ_BYTES]), str(path)).payload_offset
    if how == "header":
        data[24] ^= 0x01  # the low byte of the step number
    elif how == "truncate":
        del data[offset + 4 :]
    elif how == "short":
        del data[40:]
    elif how == "payload":
        data[offset + 3] ^= 0x40  # exponent bits of the first element
    else:
        raise ValueError(how)
    # Replace the file rather than rewrite it: the writer may keep its own data mapped
    # (and read its shard back from the mapping), as a writer that wrote a damaged file
    # would still hold the right bytes in memory. Readers open the damaged file by name.
    temp = path.with_name(path.name + ".damaged")
    temp.write_bytes(data)
    os.replace(temp, path)


def two_jobs(rank: int, sync_dir: str, run_ids: list[str | None], steps: int) -> Any:
    """Processes 0,1 are job A's ranks 0,1; processes 2,3 job B's (inputs offset by 50)."""
    job, local = divmod(rank, 2)
    kw = {"max_wait_s": 4.0, "run_id": run_ids[job]}
    return steps_until_error(local, 2, sync_dir, steps, kw, offset=50 * job)


def interrupted_step(rank: int, world: int, sync_dir: str, kw: dict[str, Any]) -> dict[str, Any]:
    """A call on SHAPES_BIG: what it raised (a KeyboardInterrupt too) and the arrays; a
    rank that got through it makes another call, and reports what that one raised."""
    grads = grads_for(rank, 0, SHAPES_BIG)
    raised = ""
    with gradsync.GradSync(config(rank, world, sync_dir, **kw)) as gs:
        try:
            gs.average(grads, step=0)
        except KeyboardInterrupt:
            return {"raised": "KeyboardInterrupt", "after": [g.tobytes() for g in grads]}
        try:
            gs.average(grads_for(rank, 1, SHAPES_BIG), step=1)
        except gradsync.GradSyncError as exc:
            raised = f"{type(exc).__name__}: {exc}"
    return {"raised": "", "after": [g.tobytes() for g in grads], "next": raised}
