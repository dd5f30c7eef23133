"""Writing this rank's files: its input, its shard of the mean, their markers, and the
shared arrays of ``buffers_like`` that are its input file."""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from gradsync._errors import SyncDirError
from gradsync._faults import fault_point
from gradsync._job.ejoin import joins_waiting
from gradsync._names import JOINS, shard_data_name, shared_input_name
from gradsync._store.api import store
from gradsync._store.files import place_marker, translate_oserror

from .buffers import SharedBuffers
from .checks import Peer, check_inputs
from .datafile import DataReader
from .header import (
    KIND_INPUT,
    KIND_SHARD,
    Layout,
    block_crcs,
    crc_placeholder,
    decode_header,
    longest_nonfinite,
)
from .plan import Plan
from .stale import StaleWatch
from .state import EngineState, one_slot, others

__all__ = ["Publishing"]

_FAULTS_ON = bool(os.environ.get("GRADSYNC_TEST_FAULT"))
# Rank 0 of an elastic job looks for processes waiting to join at most this often.
_JOIN_LOOK_S = 0.1


class Publishing(EngineState):
    """The part of a step engine that writes and publishes this rank's files."""

    def _prune(self) -> None:
        """Rank 0 removes the directory of call seq-2, emptied by the ranks' renames."""
        if self.rank == 0 and self.seq > 2:
            self._dir.prune(self.seq - 2, self._marker_names)

    def _publish(
        self,
        step_dir: Path,
        plan: Plan,
        flats: list[np.ndarray],
        step: int,
        nonfinite: list[int],
        shared: SharedBuffers | None,
    ) -> None:
        """Publish this rank's input: only the header when ``shared`` holds the arrays."""
        self._make_step_dir(step_dir, step)
        if self._shard_inputs(plan):  # never with shared arrays: those are mapped
            self._write_shards(step_dir, plan, step, nonfinite, _plain_parts(plan, flats))
            return

        def payload() -> list[np.ndarray]:
            return [flats[i] for i in plan.ordered_params() if flats[i].size]

        crc = block_crcs([p.data for p in payload()], plan.in_len) if self.cfg.checksums else None
        if shared is not None:
            head = self._header(
                KIND_INPUT, step, plan, plan.in_len, nonfinite, crc, payload_offset=shared.offset
            )
            shared.mem[: len(head)] = np.frombuffer(head, dtype=np.uint8)
            self._link_input(shared.path, step)
            self._write(step_dir, "in", [], step)
            return
        self._unlink_input(step)
        head = self._header(KIND_INPUT, step, plan, plan.in_len, nonfinite, crc)
        if not self._skip_own(plan):
            self._write(step_dir, "in", [head, *payload()], step)
            return
        # Peers read only their own shards of this file: this rank's shard, which only it
        # reduces (from its arrays), is left out, saving 1/W of the copying.
        path = self.data_path(self.rank, "in")
        buf = self._reserve(path, len(head) + plan.in_len, step)
        buf[: len(head)] = np.frombuffer(head, dtype=np.uint8)
        packs: list[tuple[np.ndarray, list[np.ndarray]]] = []
        for group in plan.groups:
            base = len(head) + group.in_offset
            size = group.dtype.itemsize
            for lo, hi in others(group, self.rank):
                dst = buf[base + lo * size : base + hi * size].view(group.dtype)
                packs.append((dst, [flats[p][a:b] for p, a, b, _ in group.segments(lo, hi)]))
        self.workers.pack(packs)
        self._write(step_dir, "in", [], step)

    def _make_step_dir(self, step_dir: Path, step: int) -> None:
        try:
            self._dir.step_fd(self.seq, make=True)
        except SyncDirError:
            raise
        except OSError as exc:
            raise translate_oserror(
                exc, "creating the step directory", step_dir, step=step
            ) from exc

    def _write(
        self,
        step_dir: Path,
        kind: str,
        chunks: Sequence[bytes | memoryview | np.ndarray | int],
        step: int,
    ) -> None:
        """Write this rank's ``kind`` data in place (no ``chunks``: already written
        through a mapping; an int: that many bytes nobody reads), then publish its
        marker."""
        if chunks:
            self._write_file(self.data_path(self.rank, kind), chunks, step, kind)
        elif _FAULTS_ON:
            fault_point(f"mid_{'publish' if kind == 'in' else 'output'}", self.rank, self.seq)
        self._announce(step_dir, kind, step)

    def _write_shards(
        self,
        step_dir: Path,
        plan: Plan,
        step: int,
        nonfinite: list[int],
        parts: Callable[[int], list[np.ndarray]],
    ) -> None:
        """Write what each peer q reduces of this rank's input (``parts(q)``: the bytes
        of ``plan.input_spans(q)``) into a file of its own, then publish the marker.
        This rank reads its own part from memory: its file is only a header, kept here."""
        writes: list[Callable[[], None]] = []
        for q in range(self.world):
            payload = [p.reshape(-1).view(np.uint8) for p in parts(q)]
            size = sum(len(p) for p in payload)
            crc = block_crcs([p.data for p in payload], size) if self.cfg.checksums else None
            head = self._header(KIND_SHARD, step, plan, size, nonfinite, crc)
            path = self.gen.path / shard_data_name(self.rank, q, self.seq)
            if q == self.rank:
                reader = DataReader(path, head, len(head) + size, None, None)
                self.own_input = Peer(reader, decode_header(head, str(path)), path)
                continue
            chunks: list[bytes | np.ndarray] = [head, *payload]
            writes.append(functools.partial(self._write_file, path, chunks, step, "in"))
        self.writers.run(writes)
        self._announce(step_dir, "in", step)

    def _write_file(
        self,
        path: Path,
        chunks: Sequence[bytes | memoryview | np.ndarray | int],
        step: int,
        kind: str,
    ) -> None:
        def midway() -> None:
            fault_point(f"mid_{'publish' if kind == 'in' else 'output'}", self.rank, self.seq)

        views = [c if not isinstance(c, np.ndarray) else c.data for c in chunks]
        try:
            self._transport.write(path, views, midway if _FAULTS_ON else None, self.workers.copy)
        except OSError as exc:
            raise translate_oserror(exc, "writing", path, step=step) from exc
        if self._per_call:
            self._call_files.setdefault(self.seq, []).append(path)

    def _announce(self, step_dir: Path, kind: str, step: int) -> None:
        """Publish this rank's marker of ``kind`` data in this call's directory."""
        name = self._markers[kind]
        marker = step_dir / name
        # Nobody looks at this rank's marker of call seq-2 any more (docs/protocol.md).
        old = self._dir.held_step_fd(self.seq - 2)
        reuse = name if old is not None else None
        try:
            place_marker(marker, reuse, dir_fd=self._dir.step_fd(self.seq), reuse_dir_fd=old)
        except OSError as exc:
            raise translate_oserror(exc, "publishing", marker, step=step) from exc
        if self._per_call and kind == "in":
            self._remove_old(step)

    def _remove_old(self, step: int) -> None:
        """Remove this rank's files of call seq-2: all their readers have finished
        (StepEngine.data_path)."""
        for path in self._call_files.pop(self.seq - 2, []):
            self._transport.forget(path)
            try:
                store().remove(self._dir.fd, path.name)
            except FileNotFoundError:
                pass  # a new generation
            except OSError as exc:
                raise translate_oserror(exc, "removing", path, step=step) from exc

    def _link_input(self, target: Path, step: int) -> None:
        """Point this rank's input-file name at ``target`` (no reader is active: the
        previous call's readers all finished before any rank publishes this one)."""
        if self._linked == target:
            return
        name = self._input_name()
        temp = name.with_name(name.name + ".link")
        try:
            with contextlib.suppress(FileNotFoundError):
                store().remove(self._dir.fd, temp.name)
            store().symlink(self._dir.fd, target.name, temp.name)
            store().move(self._dir.fd, temp.name, self._dir.fd, name.name)
        except OSError as exc:
            raise translate_oserror(exc, "publishing", name, step=step) from exc
        self._transport.forget(name)
        self._linked = target

    def _unlink_input(self, step: int) -> None:
        """Make this rank's input-file name a file of its own again before writing it."""
        if self._linked is None:
            return
        name = self._input_name()
        try:
            store().remove(self._dir.fd, name.name)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise translate_oserror(exc, "writing", name, step=step) from exc
        self._transport.forget(name)
        self._linked = None

    # -- shared gradient arrays ---------------------------------------------------------

    def buffers_like(self, layout: Layout, *, watch: bool = True) -> list[np.ndarray]:
        """Zero-filled arrays of ``layout`` that later steps publish without copying.

        Plain arrays where that cannot work: a file that is not mapped (another
        host's filesystem), or a plan where readers of one call may still read
        when the next begins (small payloads, strategy "root"). With ``watch``, a
        later step given them unwritten since the last one fails (``_step/stale.py``).

        Raises:
            SyncDirError: the file could not be created or sized.
        """
        plan = self._plan_for(layout)
        # Compressed payloads are encoded from the arrays: nothing to publish in place.
        if not (self._transport.mapped and one_slot(plan)) or plan.wire is not None:
            arrays = [np.zeros(shape, dtype=np.dtype(dtype)) for dtype, shape in layout]
            if watch:
                self._watch = StaleWatch.for_arrays(arrays, self.rank)
            return arrays
        # Sized for the longest header this layout can have: the longest list of
        # non-finite params (only with check_finite: without it a layout near the
        # header's limit would be refused for a list it never has).
        crc = crc_placeholder(plan.in_len) if self.cfg.checksums else None
        flagged = longest_nonfinite(len(layout) if self.cfg.check_finite else 0)
        worst = self._header(KIND_INPUT, None, plan, plan.in_len, flagged, crc)
        self._shared_serial += 1
        path = self.gen.path / shared_input_name(self.rank, self._shared_serial)
        old = self._shared
        self._shared = SharedBuffers.create(
            path, plan, len(worst), lambda p, size: self._reserve(p, size, None)
        )
        if watch:
            spans = [[(first, count) for _, first, count in g.params] for g in plan.groups]
            self._watch = StaleWatch.for_runs(
                self._shared.arrays, self._shared.runs, spans, self.rank
            )
        if old is not None:
            # Arrays handed out before keep their memory (the mapping outlives the name).
            self._transport.forget(old.path)
            with contextlib.suppress(OSError):
                store().remove(self._dir.fd, old.path.name)
        return list(self._shared.arrays)

    @property
    def shared(self) -> SharedBuffers | None:
        """The arrays of the last :meth:`buffers_like` call that mapped a file, if any."""
        return self._shared

    def _publishes_in_place(
        self, shared: SharedBuffers, plan: Plan, arrays: list[np.ndarray]
    ) -> bool:
        return (
            self._transport.mapped
            and plan.layout == shared.layout
            and one_slot(plan)
            and shared.holds(arrays)
        )

    def _check_inputs(self, plan: Plan, peers: dict[int, Peer], step: int, step_dir: Path) -> None:
        """Check every rank's input (:func:`check_inputs`); elastic: note whether rank 0
        said in this call that joiners come in after it."""
        check_inputs(plan, self.rank, peers, step, step_dir)
        if self.cfg.elastic:
            self.joins_due = self._joins_announced()

    def _announce_joins(self, step_dir: Path, step: int) -> None:
        """Elastic rank 0: say in this call, before its input, that processes waiting to
        join come in after it (looking for them at most every ``_JOIN_LOOK_S``)."""
        self.joins_due = False
        now = time.monotonic()
        if self.rank != 0 or now < self._next_join_look:
            return
        self._next_join_look = now + _JOIN_LOOK_S
        if joins_waiting(self.cfg):
            try:
                store().create(self._dir.step_fd(self.seq, make=True), JOINS)
            except OSError as exc:
                raise translate_oserror(exc, "writing", step_dir / JOINS, step=step) from exc

    def _joins_announced(self) -> bool:
        """Whether rank 0 said in this call that joiners come in after it."""
        try:
            store().stat(self._dir.step_fd(self.seq), JOINS)
        except FileNotFoundError:
            return False
        return True


def _plain_parts(plan: Plan, flats: list[np.ndarray]) -> Callable[[int], list[np.ndarray]]:
    """The arrays holding rank q's shard of every group, in payload order."""

    def parts(q: int) -> list[np.ndarray]:
        pieces = (g.segments(*g.shards[q]) for g in plan.groups)
        return [flats[p][a:b] for segments in pieces for p, a, b, _ in segments]

    return parts
