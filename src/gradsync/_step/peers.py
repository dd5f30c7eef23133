"""Waiting for the peers' files of a call: finding their markers, opening what they
published, and telling a slow peer from one that died, gave up or left.

A rank looks for ``<prefix>-<q>`` markers in the call's step directory (backing off
between looks) and opens a peer's data file once its marker is there. A file still
showing an earlier call is a stale view of a shared filesystem, looked at again for
``max_wait_s``. A peer still missing is checked (its process on this host, else its
heartbeat) after ``_FIRST_LIVENESS_CHECK_S`` (``_LIVENESS_EVERY_S`` on a shared
filesystem, where the check lists the generation and reads heartbeats through its client)
and then every ``_LIVENESS_EVERY_S``.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gradsync._config import FileGradSyncConfig
from gradsync._errors import (
    CorruptFileError,
    GradSyncError,
    PeerLostError,
    PeerTimeoutError,
    SyncDirError,
)
from gradsync._job.generation import why_lost
from gradsync._job.liveness import HeartbeatWatch
from gradsync._job.rendezvous import Generation
from gradsync._names import abort_marker, input_marker, output_marker
from gradsync._store.api import NotAFileError, store
from gradsync._store.dirs import GenDir, refuse_link
from gradsync._store.files import Backoff, translate_oserror
from gradsync._store.read import names_below, read_below

from .checks import (
    Peer,
    StaleError,
    abort_error,
    behind_marker,
    check_inputs,
    check_length,
    header_problem,
    kind_taken,
    nonfinite_error,
    reading,
    stale_clause,
    stale_error,
    unusable,
)
from .header import FLAG_CHECKSUMS, KIND_INPUT, KIND_OUTPUT, decode_header, header_length
from .transport import Transport

__all__ = ["Peer", "PeerFiles", "check_inputs", "check_length", "nonfinite_error", "reading"]

_log = logging.getLogger("gradsync")
_LIVENESS_EVERY_S = 0.1
# A peer missing at the first look is nearly always microseconds behind: whether it
# died (a listing of the generation directory, /proc) is checked only after this.
_FIRST_LIVENESS_CHECK_S = 0.01
# System calls of one directory listing (os.listdir: openat, fstat, getdents64 until
# empty, close): with two or three ranks, the first look's two or four stats cost fewer.
_LISTING_CALLS = 5
# A shared filesystem's look is a round trip its client also needs for the peers' writes.
_LOOK_GAP = 4  # times the last look's time between looks
_WAIT_SHARE = 8  # ...and at least 1/8 of the wait so far: a long wait's end is no surprise
_MAX_GAP_S = 0.005  # on a loaded host a look's time is mostly waiting for a CPU


@dataclass
class _Wait:
    """Where one :meth:`PeerFiles.wait_for` stands."""

    step_dir: Path
    prefix: str  # "in" or "out"
    step: int
    seq: int
    missing: list[int]
    # Marker there, file not yet shown to this host: what it showed, and since when.
    stale: dict[int, tuple[StaleError, float]] = field(default_factory=dict)
    last: int | None = None
    first_look: bool = True
    backoff: Backoff = field(default_factory=Backoff)
    next_check: float = _FIRST_LIVENESS_CHECK_S
    next_warn: float = 0.0
    gap_s: float = 0.0  # the least pause before the next look (_LOOK_GAP)

    @property
    def kind(self) -> int:
        return KIND_INPUT if self.prefix == "in" else KIND_OUTPUT

    @property
    def what(self) -> str:
        return "its gradients" if self.prefix == "in" else "its shard of the mean"

    def marker(self, rank: int) -> str:
        return input_marker(rank) if self.prefix == "in" else output_marker(rank)


class PeerFiles:
    """Finds, opens and checks the peers' files of this rank's calls."""

    def __init__(
        self,
        cfg: FileGradSyncConfig,
        gen: Generation,
        transport: Transport,
        path_of: Callable[[int, str], Path],
        data_names: Callable[[int, str, int], Sequence[Path]],
        dirs: GenDir,
        closing: threading.Event | None = None,
    ) -> None:
        self.cfg = cfg
        self._closing = closing  # set by GradSync.close() in another thread: stop waiting
        self.gen = gen
        self.rank = cfg.rank
        self.world = cfg.world_size
        self._transport = transport
        self._path_of = path_of  # (rank, "in" or "out") -> its file this rank reads this call
        self._data_names = data_names  # (rank, "in"/"out", call) -> every name it may have
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
        now = time.monotonic()
        if now >= self._next_link_check:
            # Its descriptors never see a link put in the generation's place: its name does.
            self._next_link_check = now + _LIVENESS_EVERY_S
            refuse_link(self.gen.path, step=step)
        wait = _Wait(step_dir, prefix, step, seq, [q for q in ranks if q not in found])
        wait.next_warn = self.cfg.warn_after_s
        if self._transport.shared:
            wait.next_check = _LIVENESS_EVERY_S
        if not wait.missing:
            return None
        names = self._look_up(wait)
        while True:
            self._open_arrived(wait, names, found)
            # Checked even when nothing is missing any more: a peer that gave up (timed
            # out, found a mismatch) must not leave this rank averaging without it.
            aborted = [q for q in range(self.world) if q != self.rank and abort_marker(q) in names]
            if aborted:
                self._raise_abort(step_dir, aborted[0], step, seq)
            if not wait.missing:
                return wait.last
            if self._closing is not None and self._closing.is_set():
                raise GradSyncError(
                    f"step {step}: rank {self.rank}'s session was closed while it waited for ranks "
                    f"{wait.missing} in {step_dir}",
                    step=step,
                    ranks=[self.rank],
                    path=step_dir,
                )
            elapsed = wait.backoff.elapsed_s()
            if elapsed >= wait.next_check:
                wait.next_check = elapsed + _LIVENESS_EVERY_S
                self._check_gone(wait, names, elapsed)
            self._check_time(wait, elapsed)
            wait.backoff.pause(wait.gap_s)
            looked = time.monotonic()
            names = self._step_names(step_dir, step, seq)
            if self._transport.shared:
                took = time.monotonic() - looked
                wait.gap_s = min(max(_LOOK_GAP * took, elapsed / _WAIT_SHARE), _MAX_GAP_S)
            wait.first_look = False

    def _open_arrived(self, wait: _Wait, names: set[str], found: dict[int, Peer]) -> None:
        """Open the file of every missing rank whose marker is in ``names`` into ``found``,
        unless this host still shows it stale."""
        for q in [q for q in wait.missing if wait.marker(q) in names]:
            try:
                found[q] = self._open_published(q, wait.prefix, wait.kind, wait.step, wait.seq)
            except StaleError as exc:
                if q not in wait.stale:
                    _log.debug("step %d: %s %s", wait.step, exc.path, exc.shown())
                since = wait.stale[q][1] if q in wait.stale else wait.backoff.elapsed_s()
                wait.stale[q] = (exc, since)
                continue
            wait.missing.remove(q)
            if not wait.first_look:
                wait.last = q

    def _check_gone(self, wait: _Wait, names: set[str], elapsed: float) -> None:
        """Raise if the generation or the step directory went, or a missing peer is lost."""
        refuse_link(self.gen.path, step=wait.step)
        if not self._dirs.has_step(wait.seq, wait.step) and not names:
            # This rank published into it: only removal explains its absence.
            raise SyncDirError(
                f"step {wait.step}: {wait.step_dir} disappeared while waiting for ranks "
                f"{wait.missing} (was the sync directory removed?)",
                errno=errno.ENOENT,
                step=wait.step,
                ranks=wait.missing,
                path=wait.step_dir,
            )
        self._check_alive(wait.missing, wait.step, wait.seq, wait.step_dir, wait.what, elapsed)

    def _check_time(self, wait: _Wait, elapsed: float) -> None:
        """Raise for a peer that published nothing, or stayed stale, past ``max_wait_s``;
        warn every ``warn_after_s``."""
        limit = self.cfg.max_wait_s
        unpublished = [q for q in wait.missing if q not in wait.stale]
        if unpublished and elapsed >= limit:
            raise PeerTimeoutError(
                f"step {wait.step}: ranks {unpublished} published nothing in {wait.step_dir} "
                f"within {limit} s (still alive, but not publishing {wait.what[4:]})",
                step=wait.step,
                ranks=unpublished,
                path=wait.step_dir,
            )
        # A stale view gets max_wait_s from when this host first saw the marker.
        expired = [
            q for q in wait.missing if q in wait.stale and elapsed - wait.stale[q][1] >= limit
        ]
        if expired:
            seen = wait.stale[expired[0]][0]
            raise stale_error(seen, expired, self.rank, wait.step, wait.seq, limit)
        if elapsed >= wait.next_warn:
            _log.warning(
                "step %d: rank %d has waited %.1f s for ranks %s (alive) to publish %s in %s%s",
                wait.step,
                self.rank,
                elapsed,
                wait.missing,
                wait.what[4:],
                wait.step_dir,
                stale_clause([q for q in wait.missing if q in wait.stale]),
            )
            wait.next_warn += self.cfg.warn_after_s

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

    def _look_up(self, wait: _Wait) -> set[str]:
        """The first look's names: by ``stat`` where that takes fewer system calls than a
        listing (5: open, fstat, two getdents, close), else listed. A stat finds the
        missing peers' markers and every peer's abort note, which a listing would show
        too; this rank's own marker is there: it placed it before waiting. Only where
        data files are mapped (host-local filesystems, by default): on a shared one each
        call is a round trip to a server, and one listing costs fewer than several."""
        peers = [q for q in range(self.world) if q != self.rank]
        wanted = [wait.marker(q) for q in wait.missing if q != self.rank]
        wanted += [abort_marker(q) for q in peers]
        if not self._transport.mapped or len(wanted) >= _LISTING_CALLS:
            return self._step_names(wait.step_dir, wait.step, wait.seq)
        names = {wait.marker(self.rank)} if self.rank in wait.missing else set()
        fd = self._dirs.step_fd(wait.seq)
        active = store()
        for name in wanted:
            try:
                active.stat(fd, name)
            except FileNotFoundError:
                continue
            except OSError as exc:
                where = wait.step_dir / name
                raise translate_oserror(exc, "looking up", where, step=wait.step) from exc
            names.add(name)
        return names

    def _open_published(self, rank: int, prefix: str, kind: int, step: int, seq: int) -> Peer:
        """Open the data file that ``rank``'s marker of call ``seq`` announces.

        A peer whose layout differs from this rank's may have put its input under
        another name (one file, or two alternating slots: StepEngine.data_path): found
        there, its header shows the mismatch (check_inputs), not a missing file. A peer
        that sees the filesystem as local where this rank does not (an NFS server's
        host) reuses its files where this rank expects one per call: looked for there.
        Only a header of this very call, rank and generation is taken, wherever found.
        """
        path = self._path_of(rank, prefix)
        try:
            return self._open(path, rank, kind, step, seq)
        except (SyncDirError, CorruptFileError, StaleError):
            for other in self._data_names(rank, prefix, seq):
                if other != path:
                    with contextlib.suppress(SyncDirError, CorruptFileError, StaleError):
                        return self._open(other, rank, kind, step, seq)
            raise

    def _open(self, path: Path, rank: int, kind: int, step: int, seq: int) -> Peer:
        try:
            reader = self._transport.open(path)
        except NotAFileError as exc:
            raise unusable(step, rank, path, f"is unusable: {exc.strerror}") from exc
        except OSError as exc:
            if isinstance(exc, FileNotFoundError) and self._transport.shared:
                # Its marker is there, so the file was written: this host may not see
                # it yet (NFS caches that a name is absent, for up to acdirmax, 60 s).
                raise StaleError(path, None) from exc
            raise translate_oserror(exc, "opening", path, step=step) from exc
        try:
            head = reader.head_of(header_length(reader.head))
            header = decode_header(head, str(path), parse_meta=False)
            if header.flags & FLAG_CHECKSUMS and rank != self.rank:  # trusts its own writes
                crc = header.crc(str(path))
                reader.expect_crcs(crc, header.payload_offset, header.payload_len)
        except CorruptFileError as exc:
            reader.close()
            raise unusable(step, rank, path, f"is unusable: {exc}") from exc
        except (OSError, EOFError) as exc:
            reader.close()
            raise translate_oserror(OSError(str(exc)), "reading", path, step=step) from exc
        kind = kind_taken(kind, header.kind)
        ours = (header.kind, header.rank, header.generation) == (kind, rank, self.gen.header_id)
        if ours and header.seq < seq:
            reader.close()
            raise behind_marker(path, header.seq, seq, step, rank, shared=self._transport.shared)
        problem = header_problem(
            header,
            reader.size,
            kind=kind,
            rank=rank,
            gen=self.gen.header_id,
            seq=seq,
            world=self.world,
        )
        if problem is not None:
            reader.close()
            raise unusable(step, rank, path, f"{path} {problem}")
        return Peer(reader, header, path)

    def _raise_abort(self, step_dir: Path, rank: int, step: int, seq: int) -> None:
        path = step_dir / abort_marker(rank)
        try:
            # Bounded, and never waiting on a FIFO or through a link: a few KiB at most.
            raw = read_below(path, dir_fd=self._dirs.step_fd(seq))
        except OSError:
            raw = None
        raise abort_error(raw, rank, self.gen.members[rank].describe(), step, path)

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
        lost = {
            q: why
            for q in missing
            if (why := why_lost(self.gen, self._watch, q, names, seq)) is not None
        }
        if not lost:
            return
        # A peer may publish, finish the step and exit between our listing and its
        # liveness check: only a marker still missing now means it never published.
        marker = input_marker if what == "its gradients" else output_marker
        present = self._step_names(step_dir, step, seq)
        lost = {q: r for q, r in lost.items() if marker(q) not in present}
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
