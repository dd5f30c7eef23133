"""Reducing this rank's shard of the mean, and gathering every rank's shard into the
arrays or handing it to a sink."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from gradsync._errors import GradSyncError
from gradsync._faults import fault_point
from gradsync._names import shard_data_name

from .header import decode_header, header_length
from .parallel import SMALL_COPY_BYTES, Workers, split_range
from .peers import Peer, reading
from .plan import Group, Plan
from .reduce import CHUNK_ELEMS, Fetch, mean_into
from .state import EngineState, others
from .transport import ChecksumError

__all__ = ["Gathering", "Piece", "Sink", "own_elements", "scaled_into", "to_the_end"]

_log = logging.getLogger("gradsync")
# Bigger chunks for a threaded reduce: small ones made it slower than one thread (GIL
# hand-overs between the many small numpy calls).
THREADED_CHUNK_ELEMS = 1 << 17

# A run of the mean: (param index, first element, the elements as a 1-D array).
Piece = tuple[int, int, np.ndarray]
# Where the mean goes instead of the arrays (GPU buffers): one call with every piece.
Sink = Callable[[list[Piece]], None]


class Gathering(EngineState):
    """The part of a step engine that computes and collects the mean."""

    def _reduce(
        self,
        plan: Plan,
        flats: list[np.ndarray],
        peers: dict[int, Peer],
        step: int,
        into: np.ndarray | None,
    ) -> np.ndarray:
        """This rank's shard of every group, as bytes (the output payload), in ``into``
        if given."""
        shard = np.empty(plan.out_lens[self.rank], dtype=np.uint8) if into is None else into
        own_from_arrays = not self._transport.mapped or self._skip_own(plan)
        jobs = []
        for group in plan.groups:
            lo, hi = group.shards[self.rank]
            if lo == hi:
                continue
            start = group.out_offsets[self.rank]
            out = shard[start : start + (hi - lo) * group.dtype.itemsize].view(group.dtype)
            fetch = [
                own_elements(group, lo, hi, flats)
                if q == self.rank and own_from_arrays
                else _peer_elements(group, q, lo, peers, step)
                for q in range(self.world)
            ]
            pieces = self.workers.pieces(out.nbytes)
            if own_from_arrays and pieces > 1:
                # Own elements spread over many small params are gathered chunk by chunk
                # in Python: threads would queue for the GIL.
                count = len(group.segments(lo, hi))
                if out.nbytes < count * SMALL_COPY_BYTES:
                    pieces = 1
            # Threads take turns at the GIL between numpy calls: bigger chunks, fewer turns.
            chunk = CHUNK_ELEMS if self.workers.threads == 1 else THREADED_CHUNK_ELEMS
            jobs += [
                _mean_job(fetch, a, b, out, chunk, self.cfg.wide_sum)
                for a, b in split_range(hi - lo, pieces, 1024)
            ]
        self.workers.run(jobs)
        return shard

    def _gather(
        self,
        plan: Plan,
        flats: list[np.ndarray],
        shard: np.ndarray,
        outs: dict[int, Peer],
        step: int,
        *,
        restore: bool,
    ) -> None:
        """Copy every rank's shard of the mean into the arrays.

        All shards are published before the first byte is copied, so only an I/O
        error can stop this half-way; the arrays are then restored (``restore``)
        from this rank's own published input, so a failed call never leaves a
        mixed result.
        """
        # Peers' shards first, this rank's own last: a failure then leaves the own range
        # untouched, and the rest is restored from the published input.
        ranks = [q for q in range(self.world) if q != self.rank and not plan.replicated]
        done = False

        def copy_all() -> None:
            nonlocal done
            batches = [ranks, [self.rank]]
            if not self._transport.mapped:
                # Read straight into the arrays, the peers' files at once (a thread each
                # where they are on another host's filesystem).
                self.writers.run(
                    [partial(self._shard_pairs, plan, q, flats, shard, outs, step) for q in ranks]
                )
                batches = [[self.rank]]
            for batch in batches:
                # Mapped shards are copied by the workers, a batch at a time: the own
                # range is only written once every peer's range is in.
                self.workers.copy(
                    [p for q in batch for p in self._shard_pairs(plan, q, flats, shard, outs, step)]
                )
            done = self._has_mean = True

        try:
            to_the_end(copy_all)
        except BaseException:
            # Arrays published in place hold no copy to restore from; a mapped gather
            # checks every source before copying, so a failure leaves them untouched.
            if restore and not done:
                self._restore(plan, flats)
            raise

    def _deliver(
        self,
        sink: Sink,
        plan: Plan,
        flats: list[np.ndarray],
        shard: np.ndarray,
        outs: dict[int, Peer],
        step: int,
    ) -> None:
        """Hand the whole mean to ``sink`` as pieces of params: those of mapped sources,
        then those that had to be read into the arrays (views of them)."""
        mapped: list[Piece] = []
        read_in: list[Piece] = []
        for q in [self.rank] if plan.replicated else range(self.world):
            for group in plan.groups:
                lo, hi = group.shards[q]
                whole = self._shard_source(group, q, flats, shard, outs, step)
                segments = group.segments(lo, hi)
                if whole is None:
                    read_in += [
                        (s.param, s.start, flats[s.param][s.start : s.stop]) for s in segments
                    ]
                else:
                    mapped += [
                        (s.param, s.start, whole[s.at : s.at + s.stop - s.start]) for s in segments
                    ]
        pieces = mapped + read_in

        def hand_over() -> None:
            sink(pieces)
            self._has_mean = True

        to_the_end(hand_over)

    def _shard_pairs(
        self,
        plan: Plan,
        q: int,
        flats: list[np.ndarray],
        shard: np.ndarray,
        outs: dict[int, Peer],
        step: int,
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """(array range, source) pairs of rank q's shard of the mean; an unmapped peer's
        is read into the arrays here instead, leaving none."""
        pairs: list[tuple[np.ndarray, np.ndarray]] = []
        for group in plan.groups:
            lo, hi = group.shards[q]
            whole = self._shard_source(group, q, flats, shard, outs, step)
            if whole is not None:
                pairs += [
                    (flats[param][start:stop], whole[at : at + stop - start])
                    for param, start, stop, at in group.segments(lo, hi)
                ]
        return pairs

    def _shard_source(
        self,
        group: Group,
        q: int,
        flats: list[np.ndarray],
        shard: np.ndarray,
        outs: dict[int, Peer],
        step: int,
    ) -> np.ndarray | None:
        """Rank q's shard of ``group`` as one 1-D array (this rank's own, or a mapped
        peer's); None when it is empty, or was read into the arrays (no mapping)."""
        lo, hi = group.shards[q]
        if lo == hi:
            return None
        start = group.out_offsets[q]
        if q == self.rank:
            return shard[start : start + (hi - lo) * group.dtype.itemsize].view(group.dtype)
        fault_point("mid_gather", self.rank, self.seq)
        peer = outs[q]
        at = peer.header.payload_offset + start
        itemsize = group.dtype.itemsize
        with reading(peer, q, step):
            # One view of the whole shard (bounds and checksums checked once), sliced
            # per param: with many small params, views per param cost more than copies.
            mapped = peer.reader.view(at, hi - lo, group.dtype)
            if mapped is None:
                for s in group.segments(lo, hi):
                    peer.reader.read_into(at + s.at * itemsize, flats[s.param][s.start : s.stop])
        return mapped

    def _restore(self, plan: Plan, flats: list[np.ndarray]) -> None:
        """Read this rank's gradients back from its published input after a gather that
        failed half-way: one file, or (``_shard_inputs``) the file of each peer's shard,
        whose ranges alone the gather had written."""
        if not self._shard_inputs(plan):
            self._restore_from(self.data_path(self.rank, "in"), None, plan, flats)
            return
        for q in range(self.world):
            if q != self.rank:
                path = self.gen.path / shard_data_name(self.rank, q, self.seq)
                self._restore_from(path, q, plan, flats)

    def _restore_from(
        self, path: Path, shard: int | None, plan: Plan, flats: list[np.ndarray]
    ) -> None:
        """Read the ranges of the arrays that ``path`` holds back from it: ``shard``'s
        (a file per shard), or all but this rank's own where the file leaves that out."""
        try:
            reader = self._transport.open(path)
        except OSError:
            _log.error("could not restore the gradients from %s after a failed step", path)
            return
        try:
            head = reader.head_of(header_length(reader.head))
            offset = decode_header(head, str(path)).payload_offset
            if shard is not None:
                reader.relocate(plan.input_spans(shard), offset)
            for group in plan.groups:
                if shard is not None:
                    ranges = [group.shards[shard]]
                elif self._skip_own(plan):
                    ranges = others(group, self.rank)
                else:
                    ranges = [(0, group.size)]
                for lo, hi in ranges:
                    for seg in group.segments(lo, hi):
                        at = offset + group.in_offset + (lo + seg.at) * group.dtype.itemsize
                        reader.read_into(at, flats[seg.param][seg.start : seg.stop])
        except (OSError, EOFError, GradSyncError, ChecksumError):
            _log.error("could not restore the gradients from %s after a failed step", path)
        finally:
            reader.close()


def own_elements(group: Group, lo: int, hi: int, flats: list[np.ndarray]) -> Fetch:
    """This rank's elements of ``group`` in ``[lo, hi)``, read from its arrays chunk by
    chunk (see mean_into)."""

    def own(start: int, stop: int, buf: np.ndarray) -> np.ndarray:
        # The plan keeps each chunk's segments: chunks fall at the same places every
        # step of a layout.
        segments = group.segments(lo + start, lo + stop)
        if len(segments) == 1:
            param, first, _, _ = segments[0]
            return flats[param][first : first + stop - start]
        # One numpy call for all the params of the chunk, not one each.
        out = buf[: stop - start]
        np.concatenate([flats[p][a:b] for p, a, b, _ in segments], out=out)
        return out

    return own


def _peer_elements(group: Group, q: int, lo: int, peers: dict[int, Peer], step: int) -> Fetch:
    """Rank q's elements of ``group`` from ``lo`` on, from its input file: one view of
    its mapping where it has one."""
    peer = peers[q]
    base = peer.header.payload_offset + group.in_offset + lo * group.dtype.itemsize
    itemsize = group.dtype.itemsize

    def theirs(start: int, stop: int, buf: np.ndarray) -> np.ndarray:
        out = buf[: stop - start]
        with reading(peer, q, step):
            mapped = peer.reader.view(base + start * itemsize, stop - start, group.dtype)
            if mapped is not None:
                return mapped
            peer.reader.read_into(base + start * itemsize, out)
        return out

    return theirs


def to_the_end(copy: Callable[[], None]) -> None:
    """Run ``copy``, which copies the mean out and may be repeated, to its end.

    An interrupt (Ctrl-C) half-way would leave a mix of gradient and mean; every shard
    is in by then, so the copy is made once more before the interrupt goes on.
    """
    try:
        copy()
    except GradSyncError:
        raise
    except BaseException:
        copy()
        raise


def _mean_job(
    fetch: Sequence[Fetch], a: int, b: int, out: np.ndarray, chunk: int, wide: bool
) -> Any:
    """A job computing elements ``[a, b)`` of ``mean_into(fetch, len(out), out, wide=wide)``."""

    def shifted(f: Fetch) -> Fetch:
        return lambda start, stop, buf: f(start + a, stop + a, buf)

    def job() -> None:
        mean_into(
            [shifted(f) for f in fetch] if a else fetch,
            b - a,
            out[a:b],
            chunk_elems=chunk,
            wide=wide,
        )

    return job


def scaled_into(flats: list[np.ndarray], scale: int, workers: Workers) -> Sink:
    """A sink writing the mean times ``scale`` into ``flats``: one pass over the
    elements, where a copy and then a multiply would take two."""

    def sink(pieces: list[Piece]) -> None:
        jobs = []
        for p, start, mean in pieces:
            dst = flats[p][start : start + len(mean)]
            for a, b in split_range(len(mean), workers.pieces(mean.nbytes), CHUNK_ELEMS):
                jobs.append(_scale_job(mean[a:b], scale, dst[a:b]))
        workers.run(jobs)

    return sink


def _scale_job(src: np.ndarray, scale: int, dst: np.ndarray) -> Callable[[], None]:
    def job() -> None:
        with np.errstate(over="ignore"):  # a sum past the dtype's range is inf, as gloo's
            np.multiply(src, scale, out=dst)

    return job
