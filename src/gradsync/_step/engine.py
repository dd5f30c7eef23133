"""One averaging step over files: publish, wait, reduce a shard, gather the mean.

Each rank owns reused data files in the generation directory (``d-<r>.in``,
``d-<r>.out``, or two alternating slots of each), and each call ``seq`` has a
directory ``s-<seq>/`` of empty markers (``in-<r>``, ``out-<r>``) and abort notes
(``abort-<r>``). Why the slots are safe to reuse, and why markers move by rename:
docs/protocol.md.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from gradsync._errors import InvalidGradsError, error_note
from gradsync._faults import fault_point
from gradsync._names import abort_marker, step_dir_name
from gradsync._stats import StepStats
from gradsync._store.files import write_note

from .broadcast import Broadcasting, BroadcastView
from .compressed import Compressing
from .gather import Gathering, Sink, scaled_into
from .grads import HostView, host_view, nonfinite_params
from .header import KIND_OUTPUT, MAX_PARAMS, block_crcs, crc_placeholder
from .peers import Peer, check_length
from .plan import Plan

__all__ = ["Stages", "StepEngine"]

_log = logging.getLogger("gradsync")


class StepEngine(Broadcasting, Compressing, Gathering):
    """Runs averaging steps for one rank of one generation."""

    def step(
        self,
        grads: HostView | Sequence[Any],
        step: int,
        sink: Sink | None = None,
        *,
        scale: int | None = None,
        exact: bool = False,
    ) -> StepStats:
        """Average ``grads`` (a :func:`host_view`, or arrays to validate) in place with
        every rank's call of the same sequence number.

        With ``sink``, the mean is handed to it instead of being copied into the
        arrays: one call, once every shard is in, with pieces that cover every element
        once. Their arrays are valid only during the call; the arrays are then scratch
        (a source that cannot be mapped is read into them first). With ``scale``, the
        arrays get the mean times ``scale`` instead, in the same pass. ``exact``: never
        compressed (the torch backend's bytes carried in float64 words).

        On any error this rank tells its peers (``abort-<rank>``) before raising, so
        they fail at once with the same error instead of waiting for it.
        """

        def call(step_dir: Path) -> StepStats:
            view = grads if isinstance(grads, HostView) else host_view(grads)
            into = sink if scale is None else scaled_into(view.flats, scale, self.workers)
            return self._step(view, step, step_dir, into, exact)

        return self._run(call)

    def broadcast(self, view: BroadcastView, root: int, step: int) -> StepStats:
        """Copy ``root``'s arrays of ``view`` into every other rank's, in place: one call
        of the same sequence as :meth:`step`."""

        def call(step_dir: Path) -> StepStats:
            stats = self._broadcast(view, root, step, step_dir)
            self._prune()
            return stats

        return self._run(call)

    def _run(self, call: Callable[[Path], StepStats]) -> StepStats:
        """Run the next call (its sequence number, its step directory), telling the peers
        of its failure before raising."""
        self.seq += 1
        step_dir = self.gen.path / step_dir_name(self.seq)
        self._has_mean = self._peers_served = False
        try:
            stats = call(step_dir)
        except BaseException as exc:
            # A rank interrupted once it has the whole mean lets its peers, which had all
            # they needed of it, finish the call too (whether they would see a note now
            # is a race): they hear of it at the next call. Otherwise the peers fail this
            # call with it; those that had all they needed of it (it failed reading a
            # peer's shard, say) may have finished it already, and hear why at their next
            # call rather than only that it closed its session.
            later = self.seq + 1
            if self._has_mean:
                note_seqs = [later]
            else:
                note_seqs = [self.seq, later] if self._peers_served else [self.seq]
            for seq in note_seqs:
                self._tell_peers(seq, exc)
            raise
        self.completed = self.seq
        self._dir.release_before(self.seq - 1)
        return stats

    def give_up(self, exc: BaseException) -> None:
        """Tell the peers that this rank's next call will not take place (it failed
        before publishing anything): they raise ``exc``'s reason at once."""
        self._tell_peers(self.seq + 1, exc)

    def _tell_peers(self, seq: int, exc: BaseException) -> None:
        with contextlib.suppress(OSError):
            note = self._dir.step_path(seq) / abort_marker(self.rank)
            data = json.dumps(error_note(exc)).encode()
            write_note(note, data, dir_fd=self._dir.step_fd(seq, make=True))

    def _step(
        self, view: HostView, step: int, step_dir: Path, sink: Sink | None, exact: bool
    ) -> StepStats:
        """The pipeline: plan, publish the input, wait for the peers' inputs, reduce and
        publish this rank's shard, wait for the peers' shards, write the mean back.
        What is published and how (as is, or encoded) is the call's :class:`Stages`."""
        t0 = time.perf_counter()
        plan = self._plan_of(view, step, exact)
        nonfinite = nonfinite_params(view.flats) if self.cfg.check_finite else []
        if self.cfg.elastic:
            self._announce_joins(step_dir, step)
        stages = self._stages(plan, view, step, sink)
        self.own_input = None
        fault_point("before_publish", self.rank, self.seq)
        stages.publish(step_dir, nonfinite)
        fault_point("after_publish", self.rank, self.seq)
        # Its input is all the peers read of a rank that publishes no shard of the mean.
        self._peers_served = plan.replicated or not plan.out_lens[self.rank]
        t1 = time.perf_counter()
        peers: dict[int, Peer] = {} if self.own_input is None else {self.rank: self.own_input}
        outs: dict[int, Peer] = {}
        try:
            last_in = self._peers.wait_for(step_dir, "in", range(self.world), step, self.seq, peers)
            self._check_inputs(plan, peers, step, step_dir)
            t2 = time.perf_counter()
            stages.reduce(peers, step_dir)
            self._peers_served = True
            fault_point("after_output", self.rank, self.seq)
            t3 = time.perf_counter()
            self._peers.wait_for(step_dir, "out", self._publishers, step, self.seq, outs)
            for q, peer in outs.items():
                check_length(peer, q, plan.out_lens[q], step)
            t4 = time.perf_counter()
            stages.gather(outs)
            self._prune()
            t5 = time.perf_counter()
        finally:
            for peer in (*peers.values(), *outs.values()):
                peer.reader.close()
        times = (t0, t1, t2, t3, t4, t5)
        stats = StepStats.timed(step, self.world, plan.in_len, times, last_in, stages.codec)
        _log.debug("%s", stats)
        return stats

    def _stages(self, plan: Plan, view: HostView, step: int, sink: Sink | None) -> Stages:
        """How this call publishes, reduces and gathers: encoded when the plan has a wire
        codec, else as is."""
        if plan.wire is not None:
            return self._encoded_stages(plan, view.flats, step, sink)
        return _PlainStages(self, plan, view, step, sink)

    def _plan_of(self, view: HostView, step: int, exact: bool) -> Plan:
        if len(view.arrays) > MAX_PARAMS:
            raise InvalidGradsError(
                f"step {step}: {len(view.arrays)} params, more than the {MAX_PARAMS} a "
                "gradsync file describes: concatenate small params into fewer arrays"
            )
        return self._plan_for(view.layout, exact=exact)

    def _reduce_and_publish(
        self,
        plan: Plan,
        flats: list[np.ndarray],
        peers: dict[int, Peer],
        step: int,
        step_dir: Path,
    ) -> np.ndarray:
        """Reduce this rank's shard and, unless every rank reduces all, publish it."""
        publishes = bool(plan.out_lens[self.rank]) and not plan.replicated
        out_len = plan.out_lens[self.rank]
        placeholder = crc_placeholder(out_len) if self.cfg.checksums else None
        head = self._header(KIND_OUTPUT, step, plan, out_len, (), placeholder)
        # Mapped: reduce straight into this rank's output file, saving a copy.
        target = None
        if publishes and self._transport.mapped:
            target = self._reserve(self.data_path(self.rank, "out"), len(head) + out_len, step)
        shard = self._reduce(
            plan, flats, peers, step, None if target is None else target[len(head) :]
        )
        if publishes and self.cfg.checksums:
            # Same length as the placeholder: the payload does not move.
            head = self._header(
                KIND_OUTPUT, step, plan, out_len, (), block_crcs([shard.data], out_len)
            )
        if target is not None:
            target[: len(head)] = np.frombuffer(head, dtype=np.uint8)
            self._write(step_dir, "out", [], step)
        elif publishes:
            half = len(shard) // 2
            self._write(step_dir, "out", [head, shard[:half], shard[half:]], step)
        return shard


class Stages(Protocol):
    """One call's publishing, reducing and gathering, which :meth:`StepEngine._step`
    runs around its waits for the peers' files."""

    codec: str | None  # the wire codec's name, None when published as is

    def publish(self, step_dir: Path, nonfinite: list[int]) -> None:
        """Write and publish this rank's input."""

    def reduce(self, peers: dict[int, Peer], step_dir: Path) -> None:
        """Reduce this rank's shard from every rank's input and publish it."""

    def gather(self, outs: dict[int, Peer]) -> None:
        """Write the whole mean back (or hand it to the sink)."""


class _PlainStages:
    """A call published as is: from the shared arrays in place, or copied."""

    codec: str | None = None

    def __init__(
        self, engine: StepEngine, plan: Plan, view: HostView, step: int, sink: Sink | None
    ) -> None:
        self._engine, self._plan, self._step, self._sink = engine, plan, step, sink
        self._flats = view.flats
        shared = engine.shared
        if shared is not None and not engine._publishes_in_place(shared, plan, view.arrays):
            shared = None
        self._shared = shared
        watch = engine._watch if sink is None else None
        if watch is not None and (shared is not None or watch.given(view.arrays)):
            watch.before(step)
        else:
            watch = None
        self._watch = watch
        # Arrays published in place lie in payload order in one file: the reduce and the
        # gather take one run of elements per dtype group, not a piece per param.
        self._work = plan if shared is None else plan.runs
        self._runs = view.flats if shared is None else list(shared.runs)
        self._shard: np.ndarray | None = None

    def publish(self, step_dir: Path, nonfinite: list[int]) -> None:
        self._engine._publish(
            step_dir, self._plan, self._flats, self._step, nonfinite, self._shared
        )

    def reduce(self, peers: dict[int, Peer], step_dir: Path) -> None:
        self._shard = self._engine._reduce_and_publish(
            self._work, self._runs, peers, self._step, step_dir
        )

    def gather(self, outs: dict[int, Peer]) -> None:
        assert self._shard is not None
        if self._sink is not None:
            self._engine._deliver(
                self._sink, self._plan, self._flats, self._shard, outs, self._step
            )
            return
        self._engine._gather(
            self._work, self._runs, self._shard, outs, self._step, restore=self._shared is None
        )
        if self._watch is not None:
            self._watch.after()
