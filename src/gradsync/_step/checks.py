"""Checks of the peers' published files: against this rank's plan (one step number, one
layout and length, no non-finite values), and the errors that name what is wrong with
a file (unusable, stale, unreadable)."""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np

from gradsync._errors import (
    CorruptFileError,
    GradSyncError,
    MismatchError,
    NonFiniteGradError,
    PeerAbortedError,
    SyncDirError,
    job_wide_error,
    note_reason,
    parse_note,
)
from gradsync._store.files import translate_oserror

from .datafile import ChecksumError, DataReader
from .header import FLAG_NONFINITE, KIND_INPUT, KIND_SHARD, NONFINITE_LISTED, Header, Layout
from .plan import Plan

__all__ = [
    "Peer",
    "StaleError",
    "abort_error",
    "behind_marker",
    "call_mismatch",
    "check_inputs",
    "check_length",
    "header_problem",
    "kind_taken",
    "nonfinite_error",
    "reading",
    "stale_clause",
    "stale_error",
    "unusable",
]

_T = TypeVar("_T")


@dataclass
class Peer:
    """A peer's published file of one call, open, and its decoded header."""

    reader: DataReader
    header: Header
    path: Path


class StaleError(Exception):
    """A peer's marker of this call is there, but its file, as this host sees it, still
    holds an earlier call of this generation (``held``), or, on a shared filesystem,
    is not there at all (``held`` None). Never raised out of
    :class:`~gradsync._step.peers.PeerFiles`."""

    def __init__(self, path: Path, held: int | None) -> None:
        super().__init__(path, held)
        self.path = path
        self.held = held

    def shown(self) -> str:
        """What this host is shown of the file: ``is not there`` or ``still holds call 3``."""
        return "is not there" if self.held is None else f"still holds call {self.held}"


def behind_marker(
    path: Path, held: int, seq: int, step: int, rank: int, *, shared: bool
) -> StaleError | CorruptFileError:
    """What ``rank``'s file holding call ``held`` behind its marker of call ``seq`` means:
    on a shared filesystem, that this host is shown it stale (the caller looks again);
    on a host-local one, which shows no file late, that something overwrote it."""
    if shared:
        return StaleError(path, held)
    return unusable(
        step,
        rank,
        path,
        f"{path} holds call {held} behind its marker of call {seq}: something "
        "overwrote it (a host-local filesystem shows no file late)",
    )


@contextlib.contextmanager
def reading(peer: Peer, rank: int, step: int) -> Iterator[None]:
    """Translate a failed read of ``rank``'s file into the error that names it."""
    try:
        yield
    except (ChecksumError, EOFError) as exc:
        # A checksum error names the path and the bytes; an EOFError only the lengths.
        problem = "is unusable" if isinstance(exc, ChecksumError) else f"{peer.path} is truncated"
        raise unusable(step, rank, peer.path, f"{problem}: {exc}") from exc
    except OSError as exc:
        raise translate_oserror(exc, "reading", peer.path, step=step) from exc


def stale_clause(ranks: list[int]) -> str:
    if not ranks:
        return ""
    return f" (ranks {ranks} did, but this host is shown stale contents of their files)"


def stale_error(
    seen: StaleError, ranks: list[int], me: int, step: int, seq: int, limit_s: float
) -> GradSyncError:
    """The error of a peer file still shown stale to rank ``me`` ``limit_s`` after its
    marker: a CorruptFileError for an old call's contents, a SyncDirError (ENOENT) for
    no file. Peers see its message too (the CorruptFileError as is, the SyncDirError in
    a PeerAbortedError): it names rank ``me``'s host, not "this host"."""
    message = (
        f"step {step}: rank {ranks[0]}'s file {seen.path} {seen.shown()}"
        f"{'' if seen.held is None else f', not call {seq},'} {limit_s} s after rank {me} "
        f"first saw its marker of call {seq} (ranks {ranks}): rank {me}'s host is shown "
        "stale contents of the shared filesystem"
    )
    if seen.held is None:
        return SyncDirError(
            message, errno=errno.ENOENT, step=step, ranks=[ranks[0]], path=seen.path
        )
    return CorruptFileError(message, step=step, ranks=[ranks[0]], path=seen.path)


def kind_taken(expected: int, found: int) -> int:
    """The kind a reader expecting a file of kind ``expected`` checks one of kind ``found``
    as: a file holding the part of an input that it reduces (KIND_SHARD) stands for the
    input (check_inputs reads it so)."""
    return KIND_SHARD if (expected, found) == (KIND_INPUT, KIND_SHARD) else expected


def header_problem(
    header: Header, size: int, *, kind: int, rank: int, gen: bytes, seq: int, world: int
) -> str | None:
    """What is wrong with a peer's file of ``size`` bytes whose ``header`` should be of
    ``kind``, ``rank``, generation ``gen``, call ``seq`` and ``world`` ranks; None if
    nothing."""
    if header.kind != kind or header.rank != rank:
        return f"holds kind {header.kind} of rank {header.rank}"
    if header.generation != gen or header.seq != seq:
        return "belongs to another run or call"
    if header.world_size != world:
        return f"was written with world_size {header.world_size}"
    promised = header.payload_offset + header.payload_len
    # Longer is fine: a mapped writer keeps its file's pages across smaller calls.
    if size < promised:
        return f"is {size} bytes, its header promises {promised}"
    return None


def abort_error(raw: bytes | None, rank: int, who: str, step: int, path: Path) -> GradSyncError:
    """The error of ``rank`` (``who``: its process) that gave up on ``step`` with the
    abort note ``path`` reading ``raw`` (None: unreadable): the job-wide error it
    shared, or a PeerAbortedError with its reason."""
    note = None if raw is None else parse_note(raw)
    shared = job_wide_error(note, step=step, path=path.parent)
    if shared is not None:
        return shared
    # Its message names the step too, mostly: said once is enough.
    reason = note_reason(note).removeprefix(f"step {step}: ")
    return PeerAbortedError(
        f"step {step}: rank {rank} ({who}) gave up on this step: {reason}",
        step=step,
        ranks=[rank],
        path=path,
    )


def unusable(step: int, rank: int, path: Path, problem: str) -> CorruptFileError:
    return CorruptFileError(
        f"step {step}: rank {rank}'s file {problem}", step=step, ranks=[rank], path=path
    )


def check_length(peer: Peer, rank: int, expected: int, step: int) -> None:
    """Raise CorruptFileError unless ``peer`` holds ``expected`` payload bytes."""
    if peer.header.payload_len != expected:
        raise CorruptFileError(
            f"step {step}: rank {rank}'s file {peer.path} holds {peer.header.payload_len} "
            f"bytes of data, its layout needs {expected}",
            step=step,
            ranks=[rank],
            path=peer.path,
        )


def check_inputs(plan: Plan, rank: int, peers: dict[int, Peer], step: int, step_dir: Path) -> None:
    """Check every rank's input against this rank's ``plan``: one step number, one
    layout and length, and no non-finite values reported. A file holding only the
    part of an input that this rank reduces is then read at the whole input's offsets.

    Raises:
        MismatchError, CorruptFileError, NonFiniteGradError.
    """
    steps = {q: p.header.step for q, p in peers.items()}
    if len(set(steps.values())) > 1:
        raise MismatchError(
            f"step {step}: ranks disagree on the step number in {step_dir}: "
            + ", ".join(f"rank {q} is at step {s}" for q, s in sorted(steps.items())),
            step=step,
            ranks=sorted(steps),
            path=step_dir,
        )
    for q in range(len(peers)):
        other = peers[q].header
        if other.layout_digest != plan.digest:
            theirs = _checked_meta(peers[q], q, step, Header.layout)
            if theirs == plan.layout:
                # Equal layouts have equal digests: the header contradicts itself (its
                # CRC holds, so it was written so), and there is no differing param to name.
                raise unusable(
                    step,
                    q,
                    peers[q].path,
                    f"{peers[q].path} has a layout digest that is not its layout's",
                )
            if not theirs and "broadcast" in _checked_meta(peers[q], q, step, Header.full_meta):
                raise call_mismatch(rank, "average", q, step, step_dir)
            raise _mismatch(plan.layout, theirs, rank, q, step, step_dir)
        if other.kind == KIND_SHARD:
            check_length(peers[q], q, plan.input_shard_len(rank), step)
            peers[q].reader.relocate(plan.input_spans(rank), other.payload_offset)
        else:
            check_length(peers[q], q, plan.in_len, step)
    bad: list[tuple[int, int]] = []
    unlisted: dict[int, int] = {}
    for q in range(len(peers)):
        if peers[q].header.flags & FLAG_NONFINITE:
            meta = _checked_meta(peers[q], q, step, Header.full_meta)
            bad += [(q, i) for i in meta.get("nonfinite", [])]
            unlisted[q] = meta.get("nonfinite_more", 0)
    if bad:
        raise nonfinite_error(bad, step, step_dir, unlisted)


def _checked_meta(peer: Peer, rank: int, step: int, read: Callable[[Header, str], _T]) -> _T:
    """``read(header, path)`` of ``rank``'s file, which parses its meta (skipped when the
    file was opened): a malformed meta is a CorruptFileError naming the rank and step."""
    try:
        return read(peer.header, str(peer.path))
    except CorruptFileError as exc:
        raise unusable(step, rank, peer.path, f"is unusable: {exc}") from exc


def nonfinite_error(
    bad: Sequence[tuple[int, int]],
    step: int,
    path: Path | None,
    unlisted: Mapping[int, int] | None = None,
) -> NonFiniteGradError:
    """The error of a step whose ``(rank, param)`` pairs in ``bad`` hold NaN or Inf, and
    ``unlisted[rank]`` more params of that rank (not named by its file's header)."""
    ranks = sorted({q for q, _ in bad})
    more = unlisted or {}
    listing = "; ".join(
        _param_list(q, [i for p, i in bad if p == q], more.get(q, 0)) for q in ranks
    )
    return NonFiniteGradError(
        f"step {step}: non-finite gradients (NaN or Inf) in {listing}",
        step=step,
        ranks=ranks,
        path=path,
    )


def call_mismatch(rank: int, call: str, q: int, step: int, step_dir: Path) -> MismatchError:
    """The error of rank ``rank`` making ``call`` ("average" or "broadcast") where rank
    ``q`` made the other."""
    lo, hi = sorted((rank, q))
    other = "broadcast" if call == "average" else "average"
    calls = {rank: call, q: other}
    return MismatchError(
        f"step {step}: rank {lo} called {calls[lo]} but rank {hi} called {calls[hi]} (every "
        "rank must make its calls in the same order)",
        step=step,
        ranks=[lo, hi],
        path=step_dir,
    )


def _mismatch(
    mine: Layout, theirs: Layout, rank: int, q: int, step: int, step_dir: Path
) -> MismatchError:
    lo, hi = sorted((rank, q))
    first, second = (mine, theirs) if rank == lo else (theirs, mine)
    if len(first) != len(second):
        detail = f"rank {lo} has {len(first)} params but rank {hi} has {len(second)}"
    else:
        i = next(i for i, (a, b) in enumerate(zip(first, second, strict=True)) if a != b)
        detail = (
            f"param {i}: rank {lo} has shape {first[i][1]} {np.dtype(first[i][0])} but rank "
            f"{hi} has shape {second[i][1]} {np.dtype(second[i][0])}"
        )
    return MismatchError(f"step {step}: {detail}", step=step, ranks=[lo, hi], path=step_dir)


def _param_list(rank: int, params: list[int], unlisted: int) -> str:
    """A non-finite step of a big model names ``NONFINITE_LISTED`` params a rank, then
    counts the rest."""
    if len(params) + unlisted == 1:
        return f"rank {rank} param {params[0]}"
    shown = params[:NONFINITE_LISTED]
    more = len(params) + unlisted - len(shown)
    listed = ", ".join(str(i) for i in shown)
    return f"rank {rank} params {listed}" + (f" and {more} more" if more > 0 else "")
