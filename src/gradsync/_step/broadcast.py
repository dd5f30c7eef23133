"""Broadcast: one rank's arrays, bit for bit, into every other rank's, as one call of the
step sequence.

Every rank publishes an input file (``d-<r>-<seq % 2>.in``) and its ``in-<r>`` marker,
as an averaging call does: the root's file holds its arrays' bytes, the others' only a
header. Every header carries the root and the layout, so every rank checks every other's
and all of them fail alike on a mismatch; then the others copy the root's payload.
Nothing tells the root when the others have read its file, so its data alternates two
slots, as a replicated averaging call's does (docs/protocol.md).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from gradsync._config import check_int
from gradsync._errors import CorruptFileError, InvalidGradsError, MismatchError
from gradsync._stats import StepStats

from .checks import Peer, call_mismatch, check_length, reading, unusable
from .gather import to_the_end
from .header import (
    FLAG_CHECKSUMS,
    KIND_INPUT,
    Layout,
    block_crcs,
    encode_header,
    layout_text_hash,
)
from .overlap import overlap_message, overlapping
from .publish import Publishing

__all__ = ["BroadcastView", "Broadcasting", "broadcast_root", "broadcast_view"]

# Element kinds whose bytes are the value: bool, integers, floats, complex, dates.
_KINDS = frozenset("biufcmM")


class BroadcastView(NamedTuple):
    """A broadcast's arrays: themselves, their bytes (1-D uint8 views) and layout."""

    arrays: list[np.ndarray]
    data: list[np.ndarray]
    layout: Layout

    @property
    def nbytes(self) -> int:
        return sum(d.nbytes for d in self.data)


def broadcast_root(root: int | None, members: Sequence[int]) -> int:
    """The rank whose arrays a broadcast copies: ``root``, or by default the
    lowest-numbered member of the job.

    Raises:
        ConfigError: ``root`` is not a member's rank.
    """
    if root is None:
        return min(members)
    check_int("root", root, minimum=min(members), maximum=max(members))
    return int(root)


def broadcast_view(arrays: object, *, receiving: bool) -> BroadcastView:
    """Check ``arrays`` for a broadcast (``receiving``: written in place, so writeable and
    not overlapping); their view.

    Raises:
        InvalidGradsError: naming the param and what is wrong with it.
    """
    if isinstance(arrays, np.ndarray) or not isinstance(arrays, Sequence):
        raise InvalidGradsError(
            f"arrays must be a sequence (list or tuple) of numpy arrays, got "
            f"{type(arrays).__name__}"
        )
    if not arrays:
        raise InvalidGradsError("arrays is empty: pass at least one array")
    checked: list[np.ndarray] = []
    for i, a in enumerate(arrays):
        if not isinstance(a, np.ndarray):
            raise InvalidGradsError(
                f"param {i} is a {type(a).__name__}, not a numpy array (a broadcast "
                "copies into the arrays in place)"
            )
        if a.dtype.kind not in _KINDS:
            raise InvalidGradsError(f"param {i} has dtype {a.dtype}, which cannot be broadcast")
        if not a.flags.c_contiguous:
            raise InvalidGradsError(f"param {i} (shape {a.shape}) is not C-contiguous")
        if receiving and not a.flags.writeable:
            raise InvalidGradsError(f"param {i} (shape {a.shape}) is read-only")
        checked.append(a if type(a) is np.ndarray else a.view(np.ndarray))
    pair = overlapping(checked, views=True) if receiving else None
    if pair is not None:
        raise InvalidGradsError(overlap_message(*pair, "views of overlapping memory"))
    data = [a.reshape(-1).view(np.uint8) for a in checked]
    return BroadcastView(checked, data, tuple((a.dtype.str, a.shape) for a in checked))


class Broadcasting(Publishing):
    """The part of a step engine that broadcasts."""

    def _broadcast(self, view: BroadcastView, root: int, step: int, step_dir: Path) -> StepStats:
        t0 = time.perf_counter()
        # No plan: data_path gives the two alternating slots (see the module's docstring).
        self._plan = None
        nbytes = view.nbytes
        payload = [d for d in view.data if d.size] if self.rank == root else []
        head, digest = self._broadcast_head(view, root, step, payload)
        self._make_step_dir(step_dir, step)
        self._write(step_dir, "in", [head, *payload], step)
        self._peers_served = True  # its file is all its peers read of it
        t1 = time.perf_counter()
        peers: dict[int, Peer] = {}
        try:
            last = self._peers.wait_for(step_dir, "in", range(self.world), step, self.seq, peers)
            t2 = time.perf_counter()
            for q in range(self.world):
                _check_peer(peers[q], q, self.rank, digest, view.layout, root, step, step_dir)
                check_length(peers[q], q, nbytes if q == root else 0, step)
            if self.rank != root:
                self._copy_from(peers[root], root, view, step)
            self._has_mean = True
        finally:
            for peer in peers.values():
                peer.reader.close()
        t3 = time.perf_counter()
        return StepStats(
            step=step,
            world_size=self.world,
            bytes_per_rank=nbytes,
            publish_s=t1 - t0,
            wait_inputs_s=t2 - t1,
            gather_s=t3 - t2,
            total_s=t3 - t0,
            last_rank=last,
        )

    def _broadcast_head(
        self, view: BroadcastView, root: int, step: int, payload: list[np.ndarray]
    ) -> tuple[bytes, bytes]:
        """This rank's header (the root and the layout, for every rank to check) and the
        digest of both."""
        text = json.dumps(
            {"root": root, "layout": [[d, list(s)] for d, s in view.layout]},
            separators=(",", ":"),
        )
        digest = layout_text_hash("broadcast:" + text)
        nbytes = sum(p.nbytes for p in payload)
        crc = block_crcs([p.data for p in payload], nbytes) if self.cfg.checksums else None
        meta = '{"broadcast":' + text + ("" if crc is None else f',"crc":"{crc}"') + "}"
        head = encode_header(
            kind=KIND_INPUT,
            rank=self.rank,
            world_size=self.world,
            seq=self.seq,
            step=step,
            generation=self.gen.header_id,
            layout_digest=digest,
            meta=meta.encode(),
            payload_len=nbytes,
            flags=FLAG_CHECKSUMS if crc is not None else 0,
        )
        return head, digest

    def _copy_from(self, peer: Peer, root: int, view: BroadcastView, step: int) -> None:
        """Copy the root's payload into the arrays: all of it read (and checked) first, so
        that a failure leaves them as they were."""
        offset = peer.header.payload_offset
        with reading(peer, root, step):
            whole = peer.reader.view(offset, view.nbytes, np.dtype(np.uint8))
            if whole is None:
                whole = np.empty(view.nbytes, np.uint8)
                peer.reader.read_into(offset, whole)
        pairs = []
        at = 0
        for dst in view.data:
            pairs.append((dst, whole[at : at + dst.nbytes]))
            at += dst.nbytes
        to_the_end(lambda: self.workers.copy(pairs))


def _check_peer(
    peer: Peer,
    q: int,
    rank: int,
    digest: bytes,
    layout: Layout,
    root: int,
    step: int,
    step_dir: Path,
) -> None:
    """Raise MismatchError unless rank ``q``'s call is this rank's broadcast: same root,
    same layout (CorruptFileError for a header that cannot say)."""
    if peer.header.layout_digest == digest:
        return
    try:
        theirs: Any = peer.header.full_meta(str(peer.path)).get("broadcast")
        if theirs is not None:
            their_root = int(theirs["root"])
            their_layout = tuple((str(d), tuple(int(x) for x in s)) for d, s in theirs["layout"])
    except (CorruptFileError, KeyError, TypeError, ValueError) as exc:
        raise unusable(step, q, peer.path, f"is unusable: {exc}") from exc
    if theirs is None:
        raise call_mismatch(rank, "broadcast", q, step, step_dir)
    lo, hi = sorted((rank, q))
    if their_root != root:
        roots = {rank: root, q: their_root}
        detail = (
            f"ranks disagree on the broadcast's root: rank {lo} gives {roots[lo]}, "
            f"rank {hi} {roots[hi]}"
        )
    else:
        detail = _layout_detail(layout, their_layout, rank, q)
    raise MismatchError(f"step {step}: {detail}", step=step, ranks=[lo, hi], path=step_dir)


def _layout_detail(mine: Layout, theirs: Layout, rank: int, q: int) -> str:
    lo, hi = sorted((rank, q))
    first, second = (mine, theirs) if rank == lo else (theirs, mine)
    if len(first) != len(second):
        return f"broadcast: rank {lo} has {len(first)} params but rank {hi} has {len(second)}"
    i = next((i for i, (a, b) in enumerate(zip(first, second, strict=True)) if a != b), 0)
    return (
        f"broadcast: param {i}: rank {lo} has shape {first[i][1]} {np.dtype(first[i][0])} but "
        f"rank {hi} has shape {second[i][1]} {np.dtype(second[i][0])}"
    )
