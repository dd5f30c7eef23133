"""Waiting for the peers' files of a call: finding their markers, opening and checking
what they published, and telling a slow peer from one that died, gave up or left.

A rank lists the call's step directory for ``<prefix>-<q>`` markers (backing off
between looks) and opens a peer's reused data file once its marker is there; the
file's header must name that peer, this generation and this call; one that still
shows an earlier call of this generation is a stale view of a shared filesystem,
looked at again for ``max_wait_s`` from the first such look. A peer still missing is
checked after ``_FIRST_LIVENESS_CHECK_S`` and then every ``_LIVENESS_EVERY_S``: on this
host through its process, elsewhere through its heartbeat; a rank that closed its
session is lost unless it finished the call.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np

from gradsync._config import FileGradSyncConfig
from gradsync._errors import (
    CorruptFileError,
    GradSyncError,
    MismatchError,
    NonFiniteGradError,
    PeerAbortedError,
    PeerLostError,
    PeerTimeoutError,
    SyncDirError,
    job_wide_error,
    note_reason,
    parse_note,
)
from gradsync._job.liveness import HeartbeatWatch, exact_process_checks
from gradsync._job.notes import how_it_ended
from gradsync._job.rendezvous import Generation, calls_finished
from gradsync._names import left_name
from gradsync._store.dirs import GenDir, refuse_link
from gradsync._store.files import Backoff, NotAFileError, translate_oserror
from gradsync._store.read import file_below, names_below, read_below

from .header import (
    FLAG_CHECKSUMS,
    FLAG_NONFINITE,
    KIND_INPUT,
    KIND_OUTPUT,
    NONFINITE_LISTED,
    Header,
    Layout,
    decode_header,
    header_length,
)
from .plan import Plan
from .transport import ChecksumError, DataReader, Transport

__all__ = ["Peer", "PeerFiles", "check_inputs", "check_length", "nonfinite_error", "reading"]

_log = logging.getLogger("gradsync")
_T = TypeVar("_T")
_LIVENESS_EVERY_S = 0.1
# A peer missing at the first look is nearly always microseconds behind; checking at
# once whether it died (a listing of the generation directory, /proc) cost 33 us in
# most steps of a small gradient here. The first check waits this long instead.
_FIRST_LIVENESS_CHECK_S = 0.01
# System calls of one directory listing (os.listdir: openat, fstat, getdents64 until
# empty, close): with two or three ranks, the first look's two or four stats cost fewer.
_LISTING_CALLS = 5


class _StaleError(Exception):
    """A peer's marker of this call is there, but its file, as this host sees it, still
    holds an earlier call of this generation (``held``), or, on a shared filesystem,
    is not there at all (``held`` None). Never raised out of PeerFiles."""

    def __init__(self, path: Path, held: int | None) -> None:
        super().__init__(path, held)
        self.path = path
        self.held = held

    def shown(self) -> str:
        """What this host is shown of the file: ``is not there`` or ``still holds call 3``."""
        return "is not there" if self.held is None else f"still holds call {self.held}"


@dataclass
class Peer:
    """A peer's published file of one call, open, and its decoded header."""

    reader: DataReader
    header: Header
    path: Path


@contextlib.contextmanager
def reading(peer: Peer, rank: int, step: int) -> Iterator[None]:
    """Translate a failed read of ``rank``'s file into the error that names it."""
    try:
        yield
    except (ChecksumError, EOFError) as exc:
        # A checksum error names the path and the bytes; an EOFError only the lengths.
        problem = "is unusable" if isinstance(exc, ChecksumError) else f"{peer.path} is truncated"
        raise _unusable(step, rank, peer.path, f"{problem}: {exc}") from exc
    except OSError as exc:
        raise translate_oserror(exc, "reading", peer.path, step=step) from exc


def _stale_clause(ranks: list[int]) -> str:
    if not ranks:
        return ""
    return f" (ranks {ranks} did, but this host is shown stale contents of their files)"


def _stale_error(
    seen: _StaleError, ranks: list[int], me: int, step: int, seq: int, limit_s: float
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


def _unusable(step: int, rank: int, path: Path, problem: str) -> CorruptFileError:
    return CorruptFileError(
        f"step {step}: rank {rank}'s file {problem}", step=step, ranks=[rank], path=path
    )


class PeerFiles:
    """Finds, opens and checks the peers' files of this rank's calls."""

    def __init__(
        self,
        cfg: FileGradSyncConfig,
        gen: Generation,
        transport: Transport,
        path_of: Callable[[int, str], Path],
        input_names: Callable[[int, int], Sequence[Path]],
        dirs: GenDir,
        closing: threading.Event | None = None,
    ) -> None:
        self.cfg = cfg
        self._closing = closing  # set by GradSync.close() in another thread: stop waiting
        self.gen = gen
        self.rank = cfg.rank
        self.world = cfg.world_size
        self._transport = transport
        self._path_of = path_of  # (rank, "in" or "out") -> its data file for this call
        self._input_names = input_names  # (rank, call) -> every name its input may have
        self._dirs = dirs  # the generation's directory and this rank's step dirs, held open
        self._watch = HeartbeatWatch(cfg.heartbeat_timeout_s)
        self._next_link_check = 0.0

    def wait_for(
        self,
        step_dir: Path,
        prefix: str,
        ranks: Sequence[int] | range,
        step: int,
        seq: int,
        found: dict[int, Peer],
    ) -> int | None:
        """Open ``<prefix>-<q>`` of call ``seq`` for every rank q in ``ranks`` into
        ``found``; return the last to arrive (None if all were there at the first look).

        Raises:
            PeerLostError, PeerTimeoutError, SyncDirError, CorruptFileError, or the
            error a peer gave up with (PeerAbortedError, or a job-wide one it shared).
        """
        kind = KIND_INPUT if prefix == "in" else KIND_OUTPUT
        now = time.monotonic()
        if now >= self._next_link_check:
            # Its descriptors never see a link put in the generation's place: its name does.
            self._next_link_check = now + _LIVENESS_EVERY_S
            refuse_link(self.gen.path, step=step)
        what = "its gradients" if prefix == "in" else "its shard of the mean"
        missing = [q for q in ranks if q not in found]
        # Marker there, file not yet shown to this host: what it showed, and since when.
        stale: dict[int, tuple[_StaleError, float]] = {}
        last: int | None = None
        first_look = True
        backoff = Backoff()
        next_check = _FIRST_LIVENESS_CHECK_S
        next_warn = self.cfg.warn_after_s
        while missing:
            looked_up = self._look_up(step_dir, prefix, missing, step, seq) if first_look else None
            names = looked_up if looked_up is not None else self._step_names(step_dir, step, seq)
            for q in [q for q in missing if f"{prefix}-{q}" in names]:
                try:
                    found[q] = self._open_published(q, prefix, kind, step, seq)
                except _StaleError as exc:
                    if q not in stale:
                        _log.debug("step %d: %s %s", step, exc.path, exc.shown())
                    stale[q] = (exc, stale[q][1] if q in stale else backoff.elapsed_s())
                    continue
                missing.remove(q)
                if not first_look:
                    last = q
            first_look = False
            # Checked even when nothing is missing any more: a peer that gave up (timed
            # out, found a mismatch) must not leave this rank averaging without it.
            aborted = [q for q in range(self.world) if q != self.rank and f"abort-{q}" in names]
            if aborted:
                self._raise_abort(step_dir, aborted[0], step, seq)
            if not missing:
                break
            if self._closing is not None and self._closing.is_set():
                raise GradSyncError(
                    f"step {step}: rank {self.rank}'s session was closed while it waited for ranks "
                    f"{missing} in {step_dir}",
                    step=step,
                    ranks=[self.rank],
                    path=step_dir,
                )
            elapsed = backoff.elapsed_s()
            if elapsed >= next_check:
                next_check = elapsed + _LIVENESS_EVERY_S
                refuse_link(self.gen.path, step=step)
                if not self._dirs.has_step(seq, step) and not names:
                    # This rank published into it: only removal explains its absence.
                    raise SyncDirError(
                        f"step {step}: {step_dir} disappeared while waiting for ranks {missing} "
                        "(was the sync directory removed?)",
                        errno=errno.ENOENT,
                        step=step,
                        ranks=missing,
                        path=step_dir,
                    )
                self._check_alive(missing, step, seq, step_dir, what, elapsed)
            unpublished = [q for q in missing if q not in stale]
            if unpublished and elapsed >= self.cfg.max_wait_s:
                raise PeerTimeoutError(
                    f"step {step}: ranks {unpublished} published nothing in {step_dir} within "
                    f"{self.cfg.max_wait_s} s (still alive, but not publishing {what[4:]})",
                    step=step,
                    ranks=unpublished,
                    path=step_dir,
                )
            # A stale view gets max_wait_s from when this host first saw the marker.
            expired = [
                q for q in missing if q in stale and elapsed - stale[q][1] >= self.cfg.max_wait_s
            ]
            if expired:
                seen = stale[expired[0]][0]
                raise _stale_error(seen, expired, self.rank, step, seq, self.cfg.max_wait_s)
            if elapsed >= next_warn:
                _log.warning(
                    "step %d: rank %d has waited %.1f s for ranks %s (alive) to publish %s in %s%s",
                    step,
                    self.rank,
                    elapsed,
                    missing,
                    what[4:],
                    step_dir,
                    _stale_clause([q for q in missing if q in stale]),
                )
                next_warn += self.cfg.warn_after_s
            backoff.pause()
        return last

    def _step_names(self, step_dir: Path, step: int, seq: int) -> set[str]:
        """The names in call ``seq``'s step directory, through its descriptor: the one held
        open, or on a shared filesystem one opened anew (its client may answer a listing
        of a held one from its cache)."""
        try:
            return self._dirs.step_names(seq, fresh=self._transport.shared)
        except SyncDirError as exc:
            exc.step = step
            raise
        except OSError as exc:
            raise translate_oserror(exc, "listing", step_dir, step=step) from exc

    def _look_up(
        self, step_dir: Path, prefix: str, missing: Sequence[int], step: int, seq: int
    ) -> set[str] | None:
        """The first look's names by ``stat`` where that takes fewer system calls than a
        listing (5: open, fstat, two getdents, close), else None: the missing peers'
        markers and every peer's abort note, which a listing would show too. This
        rank's own marker is there: it placed it before waiting. Only where data files
        are mapped (host-local filesystems, by default): on a shared one each call is
        a round trip to a server, and one listing costs fewer than several lookups."""
        if not self._transport.mapped:
            return None
        peers = [q for q in range(self.world) if q != self.rank]
        wanted = [f"{prefix}-{q}" for q in missing if q != self.rank]
        wanted += [f"abort-{q}" for q in peers]
        if len(wanted) >= _LISTING_CALLS:
            return None
        names = {f"{prefix}-{self.rank}"} if self.rank in missing else set()
        fd = self._dirs.step_fd(seq)
        for name in wanted:
            try:
                os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise translate_oserror(exc, "looking up", step_dir / name, step=step) from exc
            names.add(name)
        return names

    def _open_published(self, rank: int, prefix: str, kind: int, step: int, seq: int) -> Peer:
        """Open the data file that ``rank``'s marker of call ``seq`` announces.

        A peer whose layout differs from this rank's may have put its input under the
        other name (one file, or two alternating slots: StepEngine.data_path): found
        there, its header shows the mismatch (check_inputs), not a missing file.
        """
        path = self._path_of(rank, prefix)
        try:
            return self._open(path, rank, kind, step, seq)
        except (SyncDirError, CorruptFileError, _StaleError):
            if kind != KIND_INPUT:
                raise
            for other in self._input_names(rank, seq):
                if other != path:
                    with contextlib.suppress(SyncDirError, CorruptFileError, _StaleError):
                        return self._open(other, rank, kind, step, seq)
            raise

    def _open(self, path: Path, rank: int, kind: int, step: int, seq: int) -> Peer:
        try:
            reader = self._transport.open(path)
        except NotAFileError as exc:
            raise _unusable(step, rank, path, f"is unusable: {exc.strerror}") from exc
        except OSError as exc:
            if isinstance(exc, FileNotFoundError) and self._transport.shared:
                # Its marker is there, so the file was written: this host may not see
                # it yet (NFS caches that a name is absent, for up to acdirmax, 60 s).
                raise _StaleError(path, None) from exc
            raise translate_oserror(exc, "opening", path, step=step) from exc
        try:
            head = reader.head_of(header_length(reader.head))
            header = decode_header(head, str(path), parse_meta=False)
            size = reader.size
            if header.flags & FLAG_CHECKSUMS and rank != self.rank:  # trusts its own writes
                crc = header.crc(str(path))
                reader.expect_crcs(crc, header.payload_offset, header.payload_len)
        except CorruptFileError as exc:
            reader.close()
            raise _unusable(step, rank, path, f"is unusable: {exc}") from exc
        except (OSError, EOFError) as exc:
            reader.close()
            raise translate_oserror(OSError(str(exc)), "reading", path, step=step) from exc
        problem = None
        ours = (header.kind, header.rank, header.generation) == (kind, rank, self.gen.header_id)
        if ours and header.seq < seq:
            # Its marker of call seq is there, so it wrote this file before: what this
            # host sees is older than the filesystem (the caller looks again).
            reader.close()
            raise _StaleError(path, header.seq)
        if header.kind != kind or header.rank != rank:
            problem = f"holds kind {header.kind} of rank {header.rank}"
        elif header.generation != self.gen.header_id or header.seq != seq:
            problem = "belongs to another run or call"
        elif header.world_size != self.world:
            problem = f"was written with world_size {header.world_size}"
        elif size != header.payload_offset + header.payload_len:
            problem = (
                f"is {size} bytes, its header promises {header.payload_offset + header.payload_len}"
            )
        if problem is not None:
            reader.close()
            raise _unusable(step, rank, path, f"{path} {problem}")
        return Peer(reader, header, path)

    def _raise_abort(self, step_dir: Path, rank: int, step: int, seq: int) -> None:
        path = step_dir / f"abort-{rank}"
        try:
            # Bounded, and never waiting on a FIFO or through a link: a few KiB at most.
            raw = read_below(path, dir_fd=self._dirs.step_fd(seq))
        except OSError:
            raw = None
        note = None if raw is None else parse_note(raw)
        shared = job_wide_error(note, step=step, path=step_dir)
        if shared is not None:
            raise shared
        member = self.gen.members[rank]
        # Its message names the step too, mostly: said once is enough.
        reason = note_reason(note).removeprefix(f"step {step}: ")
        raise PeerAbortedError(
            f"step {step}: rank {rank} ({member.describe()}) gave up on this step: {reason}",
            step=step,
            ranks=[rank],
            path=path,
        )

    def _check_alive(
        self,
        missing: Sequence[int],
        step: int,
        seq: int,
        step_dir: Path,
        what: str,
        elapsed: float,
    ) -> None:
        """Raise PeerLostError naming every missing rank that is gone for good."""
        names = names_below(self.gen.path, step=step)
        lost: dict[int, str] = {}
        for q in missing:
            member = self.gen.members[q]
            left = left_name(q) in names
            reason: str | None = None
            if not left:
                if member.same_host:
                    reason = member.local_death()
                    if reason is None and not exact_process_checks():
                        # kill(pid, 0) takes a zombie or a reused pid for alive: the
                        # heartbeat tells within heartbeat_timeout_s.
                        reason = self._heartbeat_stopped(q)
                else:
                    reason = self._heartbeat_stopped(q)
                # Gone since the listing: the note it left on its way out says why.
                left = reason is not None and file_below(self.gen.left_path(q))
            if left:
                finished = calls_finished(self.gen, q)
                if finished is not None and finished >= seq:
                    # It finished this call, so it published all of it: a shared
                    # filesystem's listing of the step can lag behind its "left" file.
                    continue
                reason = how_it_ended(self.gen.path, q) or "closed its gradsync session"
            if reason is not None:
                lost[q] = reason
        if not lost:
            return
        # A peer may publish, finish the step and exit between our listing and its
        # liveness check: only a marker still missing now means it never published.
        prefix = "in" if what == "its gradients" else "out"
        present = self._step_names(step_dir, step, seq)
        lost = {q: r for q, r in lost.items() if f"{prefix}-{q}" not in present}
        if not lost:
            return
        described = "; ".join(
            f"rank {q} ({self.gen.members[q].describe()}) {r}" for q, r in sorted(lost.items())
        )
        raise PeerLostError(
            f"step {step}: {described} before publishing {what} in {step_dir} "
            f"(waited {elapsed:.1f} s)",
            step=step,
            ranks=sorted(lost),
            path=step_dir,
        )

    def _heartbeat_stopped(self, rank: int) -> str | None:
        silent = self._watch.is_lost(self.gen.heartbeat_path(rank))
        return None if silent is None else f"stopped its heartbeat {silent:.1f} s ago"


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
    layout and length, and no non-finite values reported.

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
                raise _unusable(
                    step,
                    q,
                    peers[q].path,
                    f"{peers[q].path} has a layout digest that is not its layout's",
                )
            raise _mismatch(plan.layout, theirs, rank, q, step, step_dir)
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
        raise _unusable(step, rank, peer.path, f"is unusable: {exc}") from exc


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
