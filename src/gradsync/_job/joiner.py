"""A rank > 0's side of the rendezvous: ask for a place, confirm rank 0's offer, wait
for the roster. Each round it looks (:meth:`_Joiner._look`), :func:`decide_join`
picks the steps, and :meth:`_Joiner._do` carries them out."""

from __future__ import annotations

import contextlib
import errno
import logging
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from gradsync._errors import SyncDirError, error_note
from gradsync._names import (
    ABORT,
    GEN_PREFIX,
    RDZV,
    ROSTER,
    gave_up_name,
    gen_id_of,
    gen_name,
    heartbeat_name,
    join_name,
    member_name,
    offer_name,
)
from gradsync._store.dirs import is_own_dir, remove_own_dir
from gradsync._store.files import Backoff, list_names
from gradsync._store.read import file_below

from . import failures, notes
from .decisions import Join, JoinLook, decide_join, settings
from .generation import Generation, accept, leave, rostered
from .leaderlock import hold_join, release_join
from .liveness import Heartbeat, HeartbeatWatch, MemberInfo, judge

if TYPE_CHECKING:
    from gradsync._config import FileGradSyncConfig

__all__ = ["CHECK_EVERY_S", "check_leader", "check_not_taken", "join", "unless_removed"]

_log = logging.getLogger("gradsync")
CHECK_EVERY_S = 0.2


def join(
    cfg: FileGradSyncConfig, me: MemberInfo, closing: threading.Event | None = None
) -> Generation:
    """Rank ``cfg.rank`` > 0's rendezvous (see :func:`.rendezvous.rendezvous`)."""
    return _Joiner(cfg, me, closing).run()


class _Joiner:
    """What a waiting rank > 0 knows, and the one place its steps touch files."""

    def __init__(
        self, cfg: FileGradSyncConfig, me: MemberInfo, closing: threading.Event | None
    ) -> None:
        self.cfg = cfg
        self.me = me
        self.closing = closing
        rdzv = cfg.sync_dir / RDZV
        self.join = rdzv / join_name(cfg.rank, me.nonce)
        self.offer_path = rdzv / offer_name(me.nonce)
        self.claim: int | None = None
        self.backoff = Backoff()
        self.elapsed = 0.0
        self.next_check = 0.0
        self.next_warn = cfg.warn_after_s
        self.watch = HeartbeatWatch(cfg.heartbeat_timeout_s)
        self.leader: MemberInfo | None = None
        self.gen_path: Path | None = None  # the generation it confirmed a place in
        self.heartbeat: Heartbeat | None = None
        self.accepted: Generation | None = None
        self.stale: tuple[MemberInfo, Path] | None = None  # a rank 0 whose generation went
        # What the last look read.
        self.offered: tuple[MemberInfo, Path] | None = None
        self.abort: bytes | None = None
        self.roster: dict[str, object] | None = None

    def run(self) -> Generation:
        _register(self.cfg, self.join, self.me, self.closing)
        self.claim = hold_join(self.join)
        # This rank is here again: what a launcher said of an earlier process of it that
        # ended while waiting to join is over.
        for path, data in notes.ended_notes(self.cfg.sync_dir, self.cfg.run_id):
            member = notes.member_of(data)
            if member is not None and member.rank == self.cfg.rank:
                with contextlib.suppress(OSError):
                    notes.unlink(path)
        try:
            while True:
                for step in decide_join(self._look()):
                    gen = self._do(step)
                    if gen is not None:
                        return gen
        except BaseException as exc:
            self._give_up(exc)
            raise

    def _look(self) -> JoinLook:
        self.elapsed = self.backoff.elapsed_s()
        closing = self.closing is not None and self.closing.is_set()
        self.offered, self.abort, self.roster = None, None, None
        if closing:
            pass
        elif self.gen_path is None:
            self.offered = self._read_offer()
        else:
            self.abort = notes.read_raw(self.gen_path / ABORT)
            if self.abort is None:
                self.roster = notes.load(self.gen_path / ROSTER)
        return JoinLook(
            closing=closing,
            admitted=self.gen_path is not None,
            offer=self.offered is not None,
            abort=self.abort is not None,  # empty where rank 0's disk was full: still a note
            roster=self.roster is not None,
            check_due=self.elapsed >= self.next_check,
            timed_out=self.elapsed >= self.cfg.max_wait_s,
            warn_due=self.elapsed >= self.next_warn,
        )

    def _read_offer(self) -> tuple[MemberInfo, Path] | None:
        """Rank 0 and the generation of an offer to this rank, if one of its run is there."""
        offer = notes.load(self.offer_path)
        if offer is None or offer.get("run_id") != self.cfg.run_id:
            return None
        leader = notes.member_of(offer)
        name = gen_name(str(offer.get("gen")))  # one plain name, or refused
        if leader is None or not is_own_dir(self.cfg.sync_dir, name):
            return None
        return leader, self.cfg.sync_dir / name

    def _do(self, step: Join) -> Generation | None:
        cfg = self.cfg
        if step is Join.CLOSED:
            raise failures.closed(cfg)
        if step is Join.CONFIRM:
            assert self.offered is not None
            self._confirm(*self.offered)
        elif step is Join.CHECK_OTHERS:
            self.next_check = self.elapsed + CHECK_EVERY_S
            check_not_taken(cfg, self.me, self.watch)
            if self.stale is not None:
                check_leader(cfg, *self.stale, self.watch)
        elif step is Join.ABORTED:
            assert self.abort is not None
            assert self.gen_path is not None
            raise failures.aborted(self.abort, self.gen_path)
        elif step is Join.ACCEPT:
            return self._accept()
        elif step is Join.CHECK_LEADER:
            self._check_leader()
        elif step is Join.TIME_OUT:
            raise failures.join_timeout(cfg, self.gen_path)
        elif step is Join.WARN:
            self._warn()
        else:
            self.backoff.pause()
        return None

    def _confirm(self, leader: MemberInfo, gen_path: Path) -> None:
        """Take rank 0's offer of a place in ``gen_path``: beat there, and confirm."""
        cfg, me = self.cfg, self.me
        self.leader, self.gen_path = leader, gen_path
        self.heartbeat = Heartbeat(gen_path / heartbeat_name(me.nonce), cfg.heartbeat_interval_s)
        data = {"member": me.to_json(), "world_size": cfg.world_size, "settings": settings(cfg)}
        try:
            notes.write_json(
                gen_path / member_name(cfg.rank, me.nonce), data, "confirming membership in"
            )
        except SyncDirError:
            if is_own_dir(cfg.sync_dir, gen_path.name) and not notes.leader_gone(gen_path):
                raise
            # Removed since the look: rank 0 gave up and a new session of it removed the
            # generation. Wait for its offer, as when that happens after confirming.
            self._forget()

    def _forget(self) -> None:
        """Rank 0 failed and a new session of it removed this generation: wait for its
        offer, as a rank that came later, while that process lives."""
        assert self.leader is not None
        assert self.gen_path is not None
        if self.heartbeat is not None:
            self.heartbeat.stop()
        remove_own_dir(self.cfg.sync_dir, self.gen_path.name)  # what this rank wrote there
        self.stale = (self.leader, self.gen_path)
        self.heartbeat = self.gen_path = self.leader = None

    def _accept(self) -> Generation:
        assert self.roster is not None
        assert self.gen_path is not None
        self.accepted = accept(self.cfg, self.me, self.gen_path, self.roster)
        _unlink_all(self.join, self.offer_path)  # here, not in a finally an interrupt may skip
        release_join(self.claim)
        gen = self.accepted
        return Generation(gen.path, gen.gen_id, gen.members, gen.rank, self.heartbeat)

    def _check_leader(self) -> None:
        assert self.leader is not None
        assert self.gen_path is not None
        self.next_check = self.elapsed + CHECK_EVERY_S
        check_leader(self.cfg, self.leader, self.gen_path, self.watch)
        # The directory stays where this rank's confirmation or heartbeat landed after
        # the remover listed it: only the leader file, unlinked first, tells.
        if not is_own_dir(self.cfg.sync_dir, self.gen_path.name) or notes.leader_gone(
            self.gen_path
        ):
            self._forget()

    def _warn(self) -> None:
        cfg = self.cfg
        # Admitted, it waits for the ranks still to join, not for rank 0.
        waits_for = (
            "rank 0 (is it running"
            if self.gen_path is None
            else "rank 0 to admit every rank (are they all running"
        )
        _log.warning(
            "rendezvous: rank %d has waited %.1f s for %s, with the same sync_dir "
            "and run_id %r?) in %s",
            cfg.rank,
            self.elapsed,
            waits_for,
            cfg.run_id,
            cfg.sync_dir,
        )
        self.next_warn += cfg.warn_after_s

    def _give_up(self, exc: BaseException) -> None:
        """Leave what this rank wrote, and tell rank 0 why, once its wait failed."""
        cfg, me, gen_path = self.cfg, self.me, self.gen_path
        if self.heartbeat is not None:
            self.heartbeat.stop()
        accepted = self.accepted
        if accepted is None and gen_path is not None:
            accepted = rostered(cfg, me, gen_path)
        if accepted is not None:
            leave(accepted, 0)  # in the roster already: the peers' first call learns it left
        elif gen_path is not None:
            # Rank 0 has offered this rank a place and would otherwise wait out
            # max_wait_s for it (its join file goes below): tell it why.
            note = {**error_note(exc), "member": me.to_json()}
            with contextlib.suppress(OSError):
                notes.write_note(gen_path / gave_up_name(cfg.rank, me.nonce), notes.dump(note))
            # Rank 0 may have written the roster, with this rank in it, before it saw the
            # note: then this rank leaves the job, which its peers see at once (rather
            # than wait max_wait_s for it), and its next session is not refused as a
            # second holder of its rank.
            accepted = rostered(cfg, me, gen_path)
            if accepted is not None:
                leave(accepted, 0)
            else:
                unless_removed(gen_path)
        _unlink_all(self.join, self.offer_path)
        release_join(self.claim)


def _register(
    cfg: FileGradSyncConfig, join: Path, me: MemberInfo, closing: threading.Event | None
) -> None:
    """Write this rank's join file; on a filesystem with no room for it, try again for
    up to ``max_wait_s``: rank 0 frees the space of dead jobs as it starts."""
    data = {"member": me.to_json(), "world_size": cfg.world_size, "run_id": cfg.run_id}
    backoff = Backoff()
    while True:
        try:
            notes.write_json(join, data, "registering a join in")
            return
        except SyncDirError as exc:
            if exc.errno != errno.ENOSPC or backoff.elapsed_s() >= cfg.max_wait_s:
                raise
            _log.debug("rendezvous: %s; trying again", exc)
        if closing is not None and closing.is_set():
            raise failures.closed(cfg)
        time.sleep(0.05)


def unless_removed(gen_path: Path) -> None:
    """Remove the generation at ``gen_path`` if it is being removed: its leader file is
    gone (the last rank leaving, or a rank 0 reaping it, unlinks that first). What this
    rank wrote into it after the remover listed it would otherwise keep the directory,
    with no leader file to tell whose it was, as a job of another host (waited out for
    ``heartbeat_timeout_s``, and shown by ``gradsync status``)."""
    if notes.leader_gone(gen_path):
        remove_own_dir(gen_path.parent, gen_path.name)


def _unlink_all(*paths: Path) -> None:
    for path in paths:
        with contextlib.suppress(OSError):
            notes.unlink(path)


def check_not_taken(cfg: FileGradSyncConfig, me: MemberInfo, watch: HeartbeatWatch) -> None:
    """Fail if a running job with our run id already has a live process as our rank,
    or is smaller than our rank (a job of another world size).

    Its rank 0 stopped admitting ranks when its roster was complete, so without this
    check a duplicate rank would wait out ``max_wait_s`` for an offer.
    """
    for name in list_names(cfg.sync_dir):
        if not name.startswith(GEN_PREFIX) or not is_own_dir(cfg.sync_dir, name):
            continue  # a user's gen-samples/ is never read
        gen_path = cfg.sync_dir / name
        holders = _holders(cfg, gen_path)
        if holders is None:
            continue
        if notes.has_left(gen_path, cfg.rank) or notes.has_left(gen_path, 0):
            continue  # the rank, or the job's rank 0, has left (after a failure, say)
        # The last rank to leave a job unlinks its leader file before the rest: a job
        # without one is being removed (its "left" files may be gone already).
        registered = file_below(notes.leader_file(cfg.sync_dir, gen_id_of(name) or ""))
        leader, holder, world = holders
        named = [m for m in (leader, holder) if m is not None]
        alive = all(judge(m, watch, gen_path / heartbeat_name(m.nonce)).alive for m in named)
        if not (alive and registered):
            continue
        if holder is None:
            raise failures.other_world(cfg, leader, world, me, gen_path)
        raise failures.taken(cfg.rank, holder, me, gen_path)


def _holders(
    cfg: FileGradSyncConfig, gen_path: Path
) -> tuple[MemberInfo, MemberInfo | None, int] | None:
    """Rank 0, the holder of rank ``cfg.rank`` (None: the job has fewer ranks) and the
    number of ranks, in the roster at ``gen_path``, if it is one of ``cfg.run_id``."""
    roster = notes.load(gen_path / ROSTER)
    if roster is None or roster.get("run_id") != cfg.run_id:
        return None
    members = roster.get("members")
    if not isinstance(members, list) or not members:
        return None
    if len(members) <= cfg.rank and "launch" in roster:
        return None  # an elastic job's re-formed roster: its ranks were renumbered
    try:
        leader = MemberInfo.from_json(members[0])
        holder = MemberInfo.from_json(members[cfg.rank]) if cfg.rank < len(members) else None
    except (KeyError, TypeError, ValueError):
        return None
    return leader, holder, len(members)


def check_leader(
    cfg: FileGradSyncConfig, leader: MemberInfo, gen_path: Path, watch: HeartbeatWatch
) -> None:
    """Fail if rank 0 ``leader`` of the generation at ``gen_path`` is gone (its
    launcher's note says how it ended, or its process or heartbeat tells).

    Raises:
        PeerLostError: naming rank 0 and how it ended.
    """
    reason = notes.how_it_ended(gen_path, 0)  # its launcher saw its process end
    if reason is None:
        verdict = judge(leader, watch, gen_path / heartbeat_name(leader.nonce))
        if verdict.alive is not False:
            return
        reason = verdict.why
    raise failures.leader_lost(leader, reason, gen_path)
