"""Forming a job: every rank registers a fresh nonce, rank 0 admits them into a new generation.

Nothing an earlier run left in the directory can be joined by mistake, and the
user passes no id:

1. Rank r > 0 writes ``rdzv/join-<r>-<nonce>.json`` with a nonce of its own.
2. Rank 0 makes ``gen-<its nonce>/`` and answers every join with
   ``rdzv/offer-<nonce>.json`` naming that generation.
3. A rank that reads an offer for *its* nonce confirms with
   ``gen-<id>/member-<r>-<nonce>.json``. Joins of dead runs get offers too, but
   nobody is left to confirm them.
4. Once every rank has confirmed, rank 0 writes ``gen-<id>/roster.json``; a rank
   whose nonce is not in it lost a race for its rank and says so.

Problems found by rank 0 (two processes for one rank, another live rank 0 with
the same run id, a world-size mismatch) are written to ``gen-<id>/abort.json``
so that every rank raises the same error.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gradsync._config import FileGradSyncConfig
from gradsync._errors import (
    GradSyncError,
    MismatchError,
    PeerAbortedError,
    PeerLostError,
    PeerTimeoutError,
    RendezvousError,
    SyncDirError,
    error_note,
    job_wide_error,
    note_reason,
    parse_note,
)
from gradsync._names import (
    ABORT,
    ENDED,
    GAVE_UP,
    GEN_PREFIX,
    RDZV,
    RIVAL,
    ROSTER,
    join_name,
    join_nonce,
    left_name,
    member_name,
    member_rank,
    offer_name,
)
from gradsync._store.dirs import dir_below, is_own_dir, make_own_dir, open_below, remove_own_dir
from gradsync._store.files import (
    DIR_MODE,
    Backoff,
    list_names,
    translate_oserror,
    warn_if_open,
)
from gradsync._store.makedir import make_sync_dir
from gradsync._store.read import file_below, names_below, read_below

from .leaderlock import (
    LeaderLock,
    check_claims,
    claimed_twice,
    hold_join,
    offered_by_another,
    release_join,
    take_leader_lock,
)
from .liveness import Heartbeat, HeartbeatWatch, MemberInfo
from .notes import (
    dump,
    how_it_ended,
    leader_file,
    leader_gone,
    load,
    member_of,
    noted_at,
    unlink,
    write_json,
    write_note,
)
from .reaping import reap_stale_generations, remove_dead_joins

__all__ = ["Generation", "calls_finished", "leave", "rendezvous"]

_log = logging.getLogger("gradsync")
_CHECK_EVERY_S = 0.2


# Where ranks of one job disagree, what gradsync launch made of its arguments is the
# likely cause: say how.
_WORLD_SIZE_HINT = (
    " (with gradsync launch it is --nnodes x --nproc: give every node the same --nnodes "
    "and --nproc)"
)
_NODE_RANK_HINT = " (or, within one job, each node its own --node-rank)"


@dataclass(frozen=True)
class Generation:
    """One formed job: its directory and its members, indexed by rank."""

    path: Path
    gen_id: str
    members: tuple[MemberInfo, ...]
    rank: int
    # Started as soon as the rank knew its generation: peers on other hosts judge it
    # by this during the rendezvous too.
    heartbeat: Heartbeat | None = field(default=None, compare=False, repr=False)
    # Rank 0's hold on its run id in the sync dir, until it leaves the job.
    lock: LeaderLock | None = field(default=None, compare=False, repr=False)

    @property
    def me(self) -> MemberInfo:
        return self.members[self.rank]

    @functools.cached_property
    def header_id(self) -> bytes:
        """The 16 bytes that data file headers of this generation carry."""
        return bytes.fromhex(self.gen_id).ljust(16, b"\0")[:16]

    def heartbeat_path(self, rank: int) -> Path:
        return self.path / f"hb-{self.members[rank].nonce}"

    def left_path(self, rank: int) -> Path:
        return self.path / left_name(rank)


def _settings(cfg: FileGradSyncConfig) -> dict[str, Any]:
    """The config fields every rank must share: they decide the file layout (strategy),
    the maths (wide_sum), what a reader can check, which only its publisher can make
    possible (check_finite: the publisher flags NaN/Inf; checksums: it writes the CRCs),
    and when a silent peer counts as lost: a rank that beats every 20 s was declared
    lost by a peer waiting 15 s for a beat. The rest may differ between ranks."""
    return {
        "strategy": cfg.strategy,
        "wide_sum": cfg.wide_sum,
        "check_finite": cfg.check_finite,
        "checksums": cfg.checksums,
        "heartbeat_interval_s": cfg.heartbeat_interval_s,
        "heartbeat_timeout_s": cfg.heartbeat_timeout_s,
    }


def rendezvous(cfg: FileGradSyncConfig, closing: threading.Event | None = None) -> Generation:
    """Form a new generation with ``cfg.world_size`` live ranks; block until it exists
    (or ``closing`` is set: GradSync.close() from another thread).

    Raises:
        PeerTimeoutError: ranks did not arrive within ``cfg.max_wait_s``; names them.
        PeerLostError: rank 0 died during the rendezvous.
        RendezvousError: a rank is claimed twice, or a live job with the same run id
            already uses the directory.
        MismatchError: ranks were started with different world sizes or settings
            (strategy, wide_sum, check_finite, checksums, the heartbeat's interval and
            timeout).
        SyncDirError: the sync directory cannot be created or written.
        GradSyncError: ``closing`` was set.
    """
    nonce = secrets.token_hex(8)
    me = MemberInfo.for_self(cfg.rank, nonce)
    make_sync_dir(cfg.sync_dir, f"sync_dir {cfg.sync_dir}")
    rdzv = cfg.sync_dir / RDZV
    try:
        cfg.sync_dir.mkdir(DIR_MODE, parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(rdzv, DIR_MODE)
        os.close(open_below(cfg.sync_dir, RDZV))  # a link in its place is refused, named
    except SyncDirError:
        raise
    except OSError as exc:
        raise translate_oserror(exc, "creating the rendezvous directory", rdzv) from exc
    warn_if_open(cfg.sync_dir)
    if cfg.rank == 0:
        return _Leader(cfg, me, closing).run()
    return _join(cfg, me, closing)


def _check_closing(cfg: FileGradSyncConfig, closing: threading.Event | None) -> None:
    if closing is not None and closing.is_set():
        raise GradSyncError(
            f"rendezvous: rank {cfg.rank}'s session was closed while it waited for the other "
            f"ranks in {cfg.sync_dir}",
            ranks=[cfg.rank],
            path=cfg.sync_dir,
        )


class _Leader:
    def __init__(
        self, cfg: FileGradSyncConfig, me: MemberInfo, closing: threading.Event | None = None
    ) -> None:
        self.cfg = cfg
        self.me = me
        self.closing = closing
        self.rdzv = cfg.sync_dir / RDZV
        self.gen_path = cfg.sync_dir / f"{GEN_PREFIX}{me.nonce}"
        self.leader_file = leader_file(cfg.sync_dir, me.nonce)
        self.offered: set[str] = set()
        self.confirmed: dict[int, MemberInfo] = {}
        self.rivals: dict[str, MemberInfo] = {}
        self.watch = HeartbeatWatch(cfg.heartbeat_timeout_s)

    def _info(self) -> dict[str, Any]:
        return {
            "member": self.me.to_json(),
            "world_size": self.cfg.world_size,
            "run_id": self.cfg.run_id,
            "gen": self.me.nonce,
        }

    def run(self) -> Generation:
        # First thing, so that the look at dead runs' heartbeats starts early, and
        # before this run makes anything: on a full disk (or one out of inodes) it
        # frees their space.
        reap_stale_generations(self.cfg.sync_dir, self.gen_path, self.cfg.heartbeat_timeout_s)
        try:
            make_own_dir(self.cfg.sync_dir, self.gen_path.name)
        except OSError as exc:
            raise translate_oserror(
                exc, "creating the generation directory", self.gen_path
            ) from exc
        heartbeat = Heartbeat(self.gen_path / f"hb-{self.me.nonce}", self.cfg.heartbeat_interval_s)
        lock = None
        try:
            lock = take_leader_lock(self.cfg, self.me, self._lock_holder)
            write_json(self.leader_file, self._info(), "registering rank 0 in")
        except BaseException:
            heartbeat.stop()
            if lock is not None:
                lock.release()
            # Nobody can have joined a generation without a leader file: remove it now,
            # rather than leave it to a reaper that waits out its heartbeat.
            remove_own_dir(self.cfg.sync_dir, self.gen_path.name)
            raise
        try:
            gen = self._admit()
        except BaseException:
            heartbeat.stop()
            lock.release()
            raise
        return Generation(gen.path, gen.gen_id, gen.members, 0, heartbeat, lock)

    def _admit(self) -> Generation:
        try:
            return self._admit_ranks()
        except BaseException as exc:  # an interrupt too: the joiners must not wait it out
            # Requesters that already confirmed learn the reason instead of timing out.
            with contextlib.suppress(OSError):
                write_note(self.gen_path / ABORT, dump(error_note(exc)))
            # Rank 0 has left: nobody's rival now, and the next rank 0 on this host
            # removes the directory at once (as a generation whose members are gone).
            with contextlib.suppress(OSError):
                write_note(self.gen_path / left_name(0), b"{}")
            raise

    def _admit_ranks(self) -> Generation:
        cfg = self.cfg
        backoff = Backoff()
        next_check = 0.0
        next_warn = cfg.warn_after_s
        while True:
            _check_closing(cfg, self.closing)
            self._offer()
            self._collect()
            elapsed = backoff.elapsed_s()
            if elapsed >= next_check:
                self._check_rivals()
                next_check = elapsed + _CHECK_EVERY_S
            missing = [r for r in range(1, cfg.world_size) if r not in self.confirmed]
            if not missing and not self.rivals:
                # Last look before the roster: a second live claimant of an admitted
                # rank may be this job's own; no file can tell.
                try:
                    check_claims(self.rdzv, cfg.run_id, self.confirmed.values())
                except RendezvousError:
                    self._offer()  # the other claimant too reads why, in this generation
                    raise
                break
            if elapsed >= cfg.max_wait_s:
                if missing:
                    raise PeerTimeoutError(
                        f"rendezvous: ranks {missing} did not join within {cfg.max_wait_s} s "
                        f"in {cfg.sync_dir} (are they running, with the same sync_dir and "
                        f"run_id {cfg.run_id!r}?){_unjoined_ends(cfg, missing)}",
                        ranks=missing,
                        path=cfg.sync_dir,
                    )
                raise self._rival(next(iter(self.rivals.values())), "uses")
            if elapsed >= next_warn:
                _log.warning(
                    "rendezvous: rank 0 has waited %.1f s for ranks %s to join in %s (are "
                    "they running, with the same sync_dir and run_id %r?)%s",
                    elapsed,
                    missing,
                    cfg.sync_dir,
                    cfg.run_id,
                    _unjoined_ends(cfg, missing),
                )
                next_warn += cfg.warn_after_s
            backoff.pause()
        members = (self.me, *(self.confirmed[r] for r in range(1, cfg.world_size)))
        roster = {
            "members": [m.to_json() for m in members],
            "world_size": cfg.world_size,
            "run_id": cfg.run_id,
        }
        write_json(self.gen_path / ROSTER, roster, "publishing the roster to")
        # A rank that gave up after confirming, as the roster was written, left a note
        # that _collect had not seen; it looks for the roster after its note (and
        # leaves the job if it is in it), this looks for notes after the roster: one
        # of the two sees the other.
        for name in names_below(self.gen_path):
            if name.startswith(GAVE_UP):
                self._raise_gave_up(self.gen_path / name)
        self._tidy()
        return Generation(self.gen_path, self.me.nonce, members, 0)

    def _offer(self) -> None:
        for name in names_below(self.rdzv):
            nonce = join_nonce(name)
            if nonce is None or nonce in self.offered:
                continue
            data = load(self.rdzv / name)
            if data is None or data.get("run_id") != self.cfg.run_id:
                continue
            other = offered_by_another(self.rdzv, name, self.me)
            if other is not None:
                raise self._rival(other, "is running in")  # it offered this join a place
            offer = {"gen": self.me.nonce, "member": self.me.to_json(), "run_id": self.cfg.run_id}
            write_json(self.rdzv / offer_name(nonce), offer, "answering a join in")
            self.offered.add(nonce)

    def _collect(self) -> None:
        cfg = self.cfg
        # A confirmation does not change once written: read each only once (at 16 ranks
        # rank 0 opened ~800 files to form a job, each a round trip on a shared FS).
        seen = {member_name(m.rank, m.nonce) for m in self.confirmed.values()}
        for name in names_below(self.gen_path):
            if name.startswith(GAVE_UP):
                self._raise_gave_up(self.gen_path / name)
            if name.startswith(RIVAL):
                raise self._rival(member_of(load(self.gen_path / name)), "is running in")
            if name in seen or member_rank(name) is None:
                continue
            data = load(self.gen_path / name)
            member = member_of(data)
            if data is None or member is None:
                continue
            known = self.confirmed.get(member.rank)
            if known is not None and known.nonce == member.nonce:
                continue
            if member.local_death() is not None:
                # Confirmed, then died before the roster (same host): a new process may
                # claim its rank.
                with contextlib.suppress(OSError):
                    unlink(self.gen_path / name)
                continue
            if known is not None and known.local_death() is not None:
                del self.confirmed[member.rank]
                with contextlib.suppress(OSError):
                    unlink(self.gen_path / member_name(known.rank, known.nonce))
                known = None
            self._check_agreement(member, data)
            if not 0 < member.rank < cfg.world_size:
                raise RendezvousError(
                    f"rendezvous: {member.describe()} joined as rank {member.rank}, outside "
                    f"1..{cfg.world_size - 1}",
                    ranks=[member.rank],
                    path=cfg.sync_dir,
                )
            if known is not None:
                raise claimed_twice(known, member, cfg.sync_dir)
            self.confirmed[member.rank] = member

    def _raise_gave_up(self, path: Path) -> None:
        """Raise what a rank that was offered a place reported when it gave up."""
        try:
            raw = read_below(path)
        except OSError:
            raw = None
        note = parse_note(raw or b"")
        rank = path.name[len(GAVE_UP) :].split("-")[0]
        member = member_of(note) if isinstance(note, dict) else None
        who = f"rank {rank}" + ("" if member is None else f" ({member.describe()})")
        message = f"rendezvous: {who} gave up joining: {note_reason(note)}"
        # A problem of the whole job (a rank that never came, a mismatch) keeps its type
        # and ranks: it is this rank's problem too.
        shared = job_wide_error(note, step=None, path=path)
        if shared is not None:
            raise type(shared)(message, ranks=shared.ranks, path=path)
        raise PeerAbortedError(message, ranks=[int(rank)] if rank.isdigit() else [], path=path)

    def _check_agreement(self, member: MemberInfo, data: dict[str, Any]) -> None:
        """Fail if ``member`` was configured differently where the ranks must agree."""
        cfg = self.cfg
        settings = data.get("settings")
        if not isinstance(settings, dict):
            # Written by a gradsync that sent no settings: nothing says it sums and lays
            # out its files as this one does, so it may not join.
            raise MismatchError(
                f"rendezvous: rank {member.rank} ({member.describe()}) sent no settings "
                f"({', '.join(_settings(cfg))}) in {cfg.sync_dir}: it runs an older "
                "gradsync; every rank must run the same gradsync version",
                ranks=[0, member.rank],
                path=cfg.sync_dir,
            )
        theirs = {**settings, "world_size": data.get("world_size")}
        for key, mine in {"world_size": cfg.world_size, **_settings(cfg)}.items():
            if theirs.get(key) != mine:
                raise MismatchError(
                    f"rendezvous: rank 0 has {key} {mine!r} but rank {member.rank} "
                    f"({member.describe()}) has {key} {theirs.get(key)!r} in {cfg.sync_dir}; "
                    f"every rank must use the same {key}"
                    + (_WORLD_SIZE_HINT if key == "world_size" else ""),
                    ranks=[0, member.rank],
                    path=cfg.sync_dir,
                )

    def _rival(self, rival: MemberInfo | None, doing: str) -> RendezvousError:
        if rival is not None and rival.pid == self.me.pid and rival.same_host:
            return _held_here(0, self.cfg.sync_dir)
        who = "" if rival is None else f" ({rival.describe()})"
        return RendezvousError(
            f"rendezvous: another rank 0{who} with run_id {self.cfg.run_id!r} "
            f"{doing} {self.cfg.sync_dir}; give each job its own sync_dir or run_id"
            f"{_NODE_RANK_HINT}",
            ranks=[0],
            path=self.cfg.sync_dir,
        )

    def _lock_holder(self, holder: MemberInfo | None) -> RendezvousError:
        return self._rival(holder, "is running in")

    def _check_rivals(self) -> None:
        """Find other live rank-0s of the same run id; stale ones are removed."""
        for name in names_below(self.rdzv):
            if not name.startswith("leader-") or name == self.leader_file.name:
                continue
            path = self.rdzv / name
            data = load(path)
            member = member_of(data)
            if data is None or member is None:
                continue
            if data.get("run_id") != self.cfg.run_id or _left(self.cfg.sync_dir, data):
                continue
            if member.same_host:
                if member.local_death() is not None:
                    with contextlib.suppress(OSError):
                        unlink(path)
                    self.rivals.pop(member.nonce, None)
                    continue
                raise self._rival(member, "is running in")
            gen = data.get("gen")
            if not (isinstance(gen, str) and gen.isascii() and gen.isalnum()):
                continue  # not a generation gradsync names: nothing to look at outside
            hb = self.cfg.sync_dir / f"{GEN_PREFIX}{gen}" / f"hb-{member.nonce}"
            silent = self.watch.silent_for_s(hb)
            if self.watch.moved(hb):
                raise self._rival(member, "is beating in")
            if silent >= self.cfg.heartbeat_timeout_s:
                with contextlib.suppress(OSError):
                    unlink(path)
                self.rivals.pop(member.nonce, None)
            else:
                # Undecided until its heartbeat either moves or stays silent long enough.
                self.rivals[member.nonce] = member

    def _tidy(self) -> None:
        """Remove this rendezvous's join/offer files, what launchers said of this run's
        ranks that ended before joining (the job is formed: they were replaced), and
        generations of dead runs."""
        for member in self.confirmed.values():
            for name in (join_name(member.rank, member.nonce), offer_name(member.nonce)):
                with contextlib.suppress(OSError):
                    unlink(self.rdzv / name)
        for path, _ in _ended_notes(self.cfg):
            with contextlib.suppress(OSError):
                unlink(path)
        remove_dead_joins(self.rdzv)


def _join(
    cfg: FileGradSyncConfig, me: MemberInfo, closing: threading.Event | None = None
) -> Generation:
    rdzv = cfg.sync_dir / RDZV
    join = rdzv / join_name(cfg.rank, me.nonce)
    offer_path = rdzv / offer_name(me.nonce)
    _register(cfg, join, me, closing)
    claim = hold_join(join)
    # This rank is here again: what a launcher said of an earlier process of it that
    # ended while waiting to join is over.
    for path, data in _ended_notes(cfg):
        member = member_of(data)
        if member is not None and member.rank == cfg.rank:
            with contextlib.suppress(OSError):
                unlink(path)
    backoff = Backoff()
    next_warn = cfg.warn_after_s
    leader: MemberInfo | None = None
    gen_path: Path | None = None
    watch = HeartbeatWatch(cfg.heartbeat_timeout_s)
    next_check = 0.0
    heartbeat: Heartbeat | None = None
    accepted: Generation | None = None
    stale: tuple[MemberInfo, Path] | None = None  # a rank 0 whose generation went
    try:
        while True:
            _check_closing(cfg, closing)
            elapsed = backoff.elapsed_s()
            if gen_path is None:
                offer = load(offer_path)
                if offer is not None and offer.get("run_id") == cfg.run_id:
                    leader = member_of(offer)
                    name = f"{GEN_PREFIX}{offer.get('gen')}"  # one plain name, or refused
                    candidate = cfg.sync_dir / name
                    if leader is not None and is_own_dir(cfg.sync_dir, name):
                        gen_path = candidate
                        heartbeat = Heartbeat(gen_path / f"hb-{me.nonce}", cfg.heartbeat_interval_s)
                        try:
                            write_json(
                                gen_path / member_name(cfg.rank, me.nonce),
                                {
                                    "member": me.to_json(),
                                    "world_size": cfg.world_size,
                                    "settings": _settings(cfg),
                                },
                                "confirming membership in",
                            )
                        except SyncDirError:
                            if is_own_dir(cfg.sync_dir, gen_path.name) and not leader_gone(
                                gen_path
                            ):
                                raise
                            # Removed since the look above: rank 0 gave up and a new
                            # session of it removed the generation. Wait for its offer,
                            # as below when that happens after confirming.
                            heartbeat.stop()
                            remove_own_dir(cfg.sync_dir, gen_path.name)  # what it wrote
                            stale = (leader, gen_path)
                            heartbeat = gen_path = leader = None
            if gen_path is None and elapsed >= next_check:
                next_check = elapsed + _CHECK_EVERY_S
                _check_not_taken(cfg, me, watch)
                if stale is not None:
                    _check_leader(cfg, *stale, watch)
            if gen_path is not None and leader is not None:
                try:
                    abort = read_below(gen_path / ABORT)
                except OSError:
                    abort = None
                if abort is not None:  # empty where rank 0's disk was full: still a note
                    _raise_abort(parse_note(abort), gen_path)
                roster = load(gen_path / ROSTER)
                if roster is not None:
                    accepted = _accept(cfg, me, gen_path, roster)
                    _unlink_all(join, offer_path)  # here, not in a finally an interrupt may skip
                    release_join(claim)
                    return Generation(
                        accepted.path, accepted.gen_id, accepted.members, accepted.rank, heartbeat
                    )
                if elapsed >= next_check:
                    next_check = elapsed + _CHECK_EVERY_S
                    _check_leader(cfg, leader, gen_path, watch)
                    if not is_own_dir(cfg.sync_dir, gen_path.name) or leader_gone(gen_path):
                        # Rank 0 failed and a new session of it already removed this
                        # generation: wait for its offer, as a rank that came later,
                        # while that process lives. (The directory stays where this
                        # rank's confirmation or heartbeat landed after the remover
                        # listed it: only the leader file, unlinked first, tells.)
                        if heartbeat is not None:
                            heartbeat.stop()
                        remove_own_dir(cfg.sync_dir, gen_path.name)
                        stale = (leader, gen_path)
                        heartbeat = gen_path = leader = None
            if elapsed >= cfg.max_wait_s:
                raise _join_timeout(cfg, gen_path)
            if elapsed >= next_warn:
                # Admitted, it waits for the ranks still to join, not for rank 0.
                waits_for = (
                    "rank 0 (is it running"
                    if gen_path is None
                    else "rank 0 to admit every rank (are they all running"
                )
                _log.warning(
                    "rendezvous: rank %d has waited %.1f s for %s, with the same sync_dir "
                    "and run_id %r?) in %s",
                    cfg.rank,
                    elapsed,
                    waits_for,
                    cfg.run_id,
                    cfg.sync_dir,
                )
                next_warn += cfg.warn_after_s
            backoff.pause()
    except BaseException as exc:
        if heartbeat is not None:
            heartbeat.stop()
        if accepted is None and gen_path is not None:
            accepted = _rostered(cfg, me, gen_path)
        if accepted is not None:
            leave(accepted, 0)  # in the roster already: the peers' first call learns it left
        elif gen_path is not None:
            # Rank 0 has offered this rank a place and would otherwise wait out
            # max_wait_s for it (its join file goes below): tell it why.
            note = {**error_note(exc), "member": me.to_json()}
            with contextlib.suppress(OSError):
                write_note(gen_path / f"{GAVE_UP}{cfg.rank}-{me.nonce}.json", dump(note))
            # Rank 0 may have written the roster, with this rank in it, before it saw the
            # note: then this rank leaves the job, which its peers see at once (rather
            # than wait max_wait_s for it), and its next session is not refused as a
            # second holder of its rank.
            accepted = _rostered(cfg, me, gen_path)
            if accepted is not None:
                leave(accepted, 0)
            else:
                _unless_removed(gen_path)
        _unlink_all(join, offer_path)
        release_join(claim)
        raise


def _register(
    cfg: FileGradSyncConfig, join: Path, me: MemberInfo, closing: threading.Event | None
) -> None:
    """Write this rank's join file; on a filesystem with no room for it, try again for
    up to ``max_wait_s``: rank 0 frees the space of dead jobs as it starts."""
    data = {"member": me.to_json(), "world_size": cfg.world_size, "run_id": cfg.run_id}
    backoff = Backoff()
    while True:
        try:
            write_json(join, data, "registering a join in")
            return
        except SyncDirError as exc:
            if exc.errno != errno.ENOSPC or backoff.elapsed_s() >= cfg.max_wait_s:
                raise
            _log.debug("rendezvous: %s; trying again", exc)
        _check_closing(cfg, closing)
        time.sleep(0.05)


def _unless_removed(gen_path: Path) -> None:
    """Remove the generation at ``gen_path`` if it is being removed: its leader file is
    gone (the last rank leaving, or a rank 0 reaping it, unlinks that first). What this
    rank wrote into it after the remover listed it would otherwise keep the directory,
    with no leader file to tell whose it was, as a job of another host (waited out for
    ``heartbeat_timeout_s``, and shown by ``gradsync status``)."""
    if leader_gone(gen_path):
        remove_own_dir(gen_path.parent, gen_path.name)


def _rostered(cfg: FileGradSyncConfig, me: MemberInfo, gen_path: Path) -> Generation | None:
    """The generation at ``gen_path`` if its roster (written meanwhile) lists this rank."""
    roster = load(gen_path / ROSTER)
    if roster is None:
        return None
    try:
        return _accept(cfg, me, gen_path, roster)
    except GradSyncError:
        return None


def _unlink_all(*paths: Path) -> None:
    for path in paths:
        with contextlib.suppress(OSError):
            unlink(path)


def _ended_notes(cfg: FileGradSyncConfig) -> list[tuple[Path, dict[str, Any]]]:
    """This run's ``rdzv/ended-*`` notes (``_reaping._note_unjoined``), oldest first."""
    rdzv = cfg.sync_dir / RDZV
    try:
        names = sorted(n for n in names_below(rdzv) if n.startswith(ENDED))
    except OSError:
        return []
    notes = []
    for name in names:
        data = load(rdzv / name)
        if data is not None and data.get("run_id") == cfg.run_id:
            notes.append((rdzv / name, data))
    return sorted(notes, key=lambda n: noted_at(n[1]) or 0.0)


def _unjoined_ends(cfg: FileGradSyncConfig, missing: list[int]) -> str:
    """What the launchers of ``missing`` ranks said of processes of theirs that ended
    while waiting to join, as clauses for rank 0's warning or timeout: without it, a
    rank that failed before rank 0 started cannot be told from one not started."""
    said: dict[int, str] = {}  # the latest note of each rank
    for _, data in _ended_notes(cfg):
        member = member_of(data)
        ended = data.get("ended")
        if member is None or member.rank not in missing or not isinstance(ended, str):
            continue
        at = noted_at(data)
        ago = "" if at is None else f" {max(0.0, time.time() - at):.0f} s ago"
        said[member.rank] = (
            f"rank {member.rank} ({member.describe()}) {ended} while waiting to join (noted{ago})"
        )
    return "".join(f"; {said[r]}" for r in sorted(said))


def _join_timeout(cfg: FileGradSyncConfig, gen_path: Path | None) -> PeerTimeoutError:
    """The error of a rank > 0 whose rendezvous ran out of time: the ranks that have
    not joined, where rank 0 has admitted this one (and waits for them), else rank 0."""
    if gen_path is not None:
        try:
            names = names_below(gen_path)
        except OSError:
            names = set()
        joined = {member_rank(n) for n in names}
        missing = [r for r in range(1, cfg.world_size) if r not in joined]
        if missing:
            return PeerTimeoutError(
                f"rendezvous: ranks {missing} did not join within {cfg.max_wait_s} s in "
                f"{cfg.sync_dir} (rank 0 admitted rank {cfg.rank} and waits for them; are they "
                f"running, with the same sync_dir and run_id {cfg.run_id!r}?)",
                ranks=missing,
                path=cfg.sync_dir,
            )
    what = "admit" if gen_path is None else "complete the roster for"
    return PeerTimeoutError(
        f"rendezvous: rank 0 did not {what} rank {cfg.rank} within {cfg.max_wait_s} s in "
        f"{cfg.sync_dir} (is rank 0 running, with the same sync_dir and run_id {cfg.run_id!r}?)",
        ranks=[0],
        path=cfg.sync_dir,
    )


def _raise_abort(note: object, gen_path: Path) -> None:
    shared = job_wide_error(note, step=None, path=gen_path)
    if shared is not None:
        raise shared  # rank 0 found a problem of the whole job: every rank raises it alike
    raise PeerAbortedError(
        f"rendezvous failed on rank 0: {note_reason(note)}", ranks=[0], path=gen_path
    )


def _check_not_taken(cfg: FileGradSyncConfig, me: MemberInfo, watch: HeartbeatWatch) -> None:
    """Fail if a running job with our run id already has a live process as our rank.

    Its rank 0 stopped admitting ranks when its roster was complete, so without this
    check a duplicate rank would wait out ``max_wait_s`` for an offer.
    """
    for name in list_names(cfg.sync_dir):
        if not name.startswith(GEN_PREFIX) or not is_own_dir(cfg.sync_dir, name):
            continue  # a user's gen-samples/ is never read
        gen_path = cfg.sync_dir / name
        roster = load(gen_path / ROSTER)
        if roster is None or roster.get("run_id") != cfg.run_id:
            continue
        members = roster.get("members")
        if not isinstance(members, list) or len(members) <= cfg.rank:
            continue
        try:
            leader, holder = (
                MemberInfo.from_json(members[0]),
                MemberInfo.from_json(members[cfg.rank]),
            )
        except (KeyError, TypeError, ValueError):
            continue
        if file_below(gen_path / left_name(cfg.rank)) or file_below(gen_path / left_name(0)):
            continue  # the rank, or the job's rank 0, has left (after a failure, say)
        # The last rank to leave a job unlinks its leader file before the rest: a job
        # without one is being removed (its "left" files may be gone already).
        registered = file_below(leader_file(cfg.sync_dir, name[len(GEN_PREFIX) :]))
        if all(_is_alive(m, gen_path, watch) for m in (leader, holder)) and registered:
            raise _taken(cfg.rank, holder, me, gen_path)


def _left(sync_dir: Path, leader_data: dict[str, Any]) -> bool:
    """Whether the rank 0 of a ``leader-*.json`` has left its job (a session closed, or
    ended by a failure), or the job is being removed: it is nobody's rival. (A rank 0
    makes its directory before this file, and the last rank to leave removes the file
    first.)"""
    gen = sync_dir / f"{GEN_PREFIX}{leader_data.get('gen')}"
    return not is_own_dir(sync_dir, gen.name) or file_below(gen / left_name(0))


def _held_here(rank: int, path: Path) -> RendezvousError:
    return RendezvousError(
        f"rendezvous: this process (pid {os.getpid()}) already holds rank {rank} of this job "
        f"in {path}, in a session that is still open: average through that session, or close "
        "it first",
        ranks=[rank],
        path=path,
    )


def _taken(rank: int, holder: MemberInfo, me: MemberInfo, gen_path: Path) -> RendezvousError:
    if holder.pid == me.pid and holder.same_host:
        return _held_here(rank, gen_path)
    return RendezvousError(
        f"rendezvous: rank {rank} is already taken by {holder.describe()} in {gen_path}; "
        f"this process ({me.describe()}) claimed the same rank; give each job its own "
        f"sync_dir or run_id{_NODE_RANK_HINT}",
        ranks=[rank],
        path=gen_path,
    )


def _is_alive(member: MemberInfo, gen_path: Path, watch: HeartbeatWatch) -> bool:
    if member.same_host:
        return member.local_death() is None
    hb = gen_path / f"hb-{member.nonce}"
    watch.silent_for_s(hb)
    return watch.moved(hb)


def _check_leader(
    cfg: FileGradSyncConfig, leader: MemberInfo, gen_path: Path, watch: HeartbeatWatch
) -> None:
    ended = how_it_ended(gen_path, 0)  # its launcher saw its process end
    if ended is not None:
        reason = ended
    elif leader.same_host:
        death = leader.local_death()
        if death is None:
            return
        reason = f"{death}"
    else:
        silent = watch.is_lost(gen_path / f"hb-{leader.nonce}")
        if silent is None:
            return
        reason = f"stopped its heartbeat {silent:.1f} s ago"
    raise PeerLostError(
        f"rendezvous: rank 0 ({leader.describe()}) {reason} before completing the "
        f"rendezvous in {gen_path}",
        ranks=[0],
        path=gen_path,
    )


def _accept(
    cfg: FileGradSyncConfig, me: MemberInfo, gen_path: Path, roster: dict[str, Any]
) -> Generation:
    raw = roster.get("members")
    try:
        members = tuple(MemberInfo.from_json(m) for m in raw)  # type: ignore[union-attr]
    except (KeyError, TypeError, ValueError) as exc:
        raise RendezvousError(
            f"rendezvous: unreadable roster in {gen_path}", path=gen_path
        ) from exc
    if len(members) != cfg.world_size:
        raise MismatchError(
            f"rendezvous: the roster in {gen_path} has {len(members)} ranks but rank "
            f"{cfg.rank} has world_size {cfg.world_size}",
            ranks=[cfg.rank],
            path=gen_path,
        )
    holder = members[cfg.rank]
    if holder.nonce != me.nonce:
        raise _taken(cfg.rank, holder, me, gen_path)
    return Generation(gen_path, gen_path.name[len(GEN_PREFIX) :], members, cfg.rank)


def leave(gen: Generation, calls: int, ended: str | None = None) -> None:
    """Mark this rank as gone after finishing ``calls`` averaging calls (and, for peers
    still waiting for it, how its session ``ended``, if not simply closed); the last
    rank to leave removes the generation directory."""
    note: dict[str, Any] = {"calls": calls} if ended is None else {"calls": calls, "ended": ended}
    try:
        with dir_below(gen.path.parent, gen.path.name) as fd:
            write_note(gen.left_path(gen.rank), json.dumps(note).encode(), dir_fd=fd)
            names = set(os.listdir(fd))
    except OSError:
        return  # not knowing who is left, leave the directory to the last rank
    finally:
        if gen.lock is not None:
            gen.lock.release()  # after the note: the next rank 0 sees this one left
    if all(left_name(r) in names for r in range(len(gen.members))):
        with contextlib.suppress(OSError):
            unlink(leader_file(gen.path.parent, gen.gen_id))
        remove_own_dir(gen.path.parent, gen.path.name)


def calls_finished(gen: Generation, rank: int) -> int | None:
    """How many calls ``rank`` had finished when it left, if it left and said so."""
    try:
        raw = read_below(gen.left_path(rank))
        calls = json.loads(raw)["calls"] if raw is not None else None
    except (OSError, ValueError, TypeError, KeyError, RecursionError):
        return None  # unreadable, or written by a gradsync that did not record it
    return calls if isinstance(calls, int) and not isinstance(calls, bool) else None
