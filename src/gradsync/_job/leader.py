"""Rank 0's side of the rendezvous: make a generation, answer every join with an offer,
read the confirmations, write the roster. Each round it answers and reads, then
:func:`decide_admit` says whether to write the roster, fail or wait."""

from __future__ import annotations

import contextlib
import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gradsync._errors import RendezvousError, error_note
from gradsync._names import (
    ABORT,
    GAVE_UP,
    RDZV,
    RIVAL,
    ROSTER,
    gen_name,
    heartbeat_name,
    is_leader_name,
    join_name,
    join_nonce,
    left_name,
    member_name,
    member_rank,
    offer_name,
)
from gradsync._store.dirs import is_own_dir, make_own_dir, remove_own_dir
from gradsync._store.files import Backoff, translate_oserror
from gradsync._store.read import names_below

from . import failures, notes
from .decisions import (
    Admit,
    AdmitLook,
    Confirmation,
    decide_admit,
    decide_confirmation,
    disagreement,
    settings,
)
from .generation import Generation
from .joiner import CHECK_EVERY_S
from .leaderlock import (
    check_claims,
    claimed_twice,
    offered_by_another,
    take_leader_lock,
)
from .liveness import Heartbeat, HeartbeatWatch, MemberInfo, judge
from .reaping import reap_stale_generations, remove_dead_joins

if TYPE_CHECKING:
    from gradsync._config import FileGradSyncConfig

__all__ = ["Leader"]

_log = logging.getLogger("gradsync")


class Leader:
    """Rank 0 forming a generation: what it has seen, and the steps it takes."""

    def __init__(
        self, cfg: FileGradSyncConfig, me: MemberInfo, closing: threading.Event | None = None
    ) -> None:
        self.cfg = cfg
        self.me = me
        self.closing = closing
        self.rdzv = cfg.sync_dir / RDZV
        self.gen_path = cfg.sync_dir / gen_name(me.nonce)
        self.leader_file = notes.leader_file(cfg.sync_dir, me.nonce)
        self.offered: set[str] = set()
        self.confirmed: dict[int, MemberInfo] = {}
        self.rivals: dict[str, MemberInfo] = {}
        self.watch = HeartbeatWatch(cfg.heartbeat_timeout_s)

    def run(self) -> Generation:
        """Form the generation; on failure, remove or abort it, and raise."""
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
        beat = Heartbeat(
            self.gen_path / heartbeat_name(self.me.nonce), self.cfg.heartbeat_interval_s
        )
        lock = None
        try:
            lock = take_leader_lock(self.cfg, self.me, self._lock_holder)
            info = {
                "member": self.me.to_json(),
                "world_size": self.cfg.world_size,
                "run_id": self.cfg.run_id,
                "gen": self.me.nonce,
            }
            notes.write_json(self.leader_file, info, "registering rank 0 in")
        except BaseException:
            beat.stop()
            if lock is not None:
                lock.release()
            # Nobody can have joined a generation without a leader file: remove it now,
            # rather than leave it to a reaper that waits out its heartbeat.
            remove_own_dir(self.cfg.sync_dir, self.gen_path.name)
            raise
        try:
            gen = self._admit()
        except BaseException:
            beat.stop()
            lock.release()
            raise
        return Generation(gen.path, gen.gen_id, gen.members, 0, beat, lock)

    def _admit(self) -> Generation:
        try:
            members = self._wait_for_ranks()
            return self._publish(members)
        except BaseException as exc:  # an interrupt too: the joiners must not wait it out
            # Requesters that already confirmed learn the reason instead of timing out.
            with contextlib.suppress(OSError):
                notes.write_note(self.gen_path / ABORT, notes.dump(error_note(exc)))
            # Rank 0 has left: nobody's rival now, and the next rank 0 on this host
            # removes the directory at once (as a generation whose members are gone).
            with contextlib.suppress(OSError):
                notes.write_note(self.gen_path / left_name(0), b"{}")
            raise

    def _wait_for_ranks(self) -> tuple[MemberInfo, ...]:
        """Answer joins and read confirmations until every rank has confirmed."""
        cfg = self.cfg
        backoff = Backoff()
        next_check = 0.0
        next_warn = cfg.warn_after_s
        while True:
            closing = self.closing is not None and self.closing.is_set()
            if not closing:
                self.offer()
                self.collect()
            elapsed = backoff.elapsed_s()
            if not closing and elapsed >= next_check:
                self.check_rivals()
                next_check = elapsed + CHECK_EVERY_S
            missing = tuple(r for r in range(1, cfg.world_size) if r not in self.confirmed)
            look = AdmitLook(
                closing=closing,
                missing=missing,
                rivals=bool(self.rivals),
                timed_out=elapsed >= cfg.max_wait_s,
                warn_due=elapsed >= next_warn,
            )
            step = decide_admit(look)
            if step is Admit.CLOSED:
                raise failures.closed(cfg)
            if step is Admit.ROSTER:
                self._last_look()
                return (self.me, *(self.confirmed[r] for r in range(1, cfg.world_size)))
            if step is Admit.MISSING:
                raise failures.unjoined_timeout(cfg, list(missing))
            if step is Admit.RIVAL:
                raise self._rival(next(iter(self.rivals.values())), "uses")
            if step is Admit.WARN:
                _log.warning(
                    "rendezvous: rank 0 has waited %.1f s for ranks %s to join in %s (are "
                    "they running, with the same sync_dir and run_id %r?)%s",
                    elapsed,
                    list(missing),
                    cfg.sync_dir,
                    cfg.run_id,
                    failures.unjoined_ends(cfg, list(missing)),
                )
                next_warn += cfg.warn_after_s
            backoff.pause()

    def _last_look(self) -> None:
        """Before the roster: a second live claimant of an admitted rank may be this
        job's own; no file can tell."""
        try:
            check_claims(self.rdzv, self.cfg.run_id, self.confirmed.values())
        except RendezvousError:
            self.offer()  # the other claimant too reads why, in this generation
            raise

    def _publish(self, members: tuple[MemberInfo, ...]) -> Generation:
        roster = {
            "members": [m.to_json() for m in members],
            "world_size": self.cfg.world_size,
            "run_id": self.cfg.run_id,
            "settings": settings(self.cfg),  # for an elastic joiner to check its own against
        }
        notes.write_json(self.gen_path / ROSTER, roster, "publishing the roster to")
        # A rank that gave up after confirming, as the roster was written, left a note
        # that collect() had not seen; it looks for the roster after its note (and
        # leaves the job if it is in it), this looks for notes after the roster: one
        # of the two sees the other.
        for name in names_below(self.gen_path):
            if name.startswith(GAVE_UP):
                raise failures.gave_up(self.gen_path / name)
        self._tidy()
        return Generation(self.gen_path, self.me.nonce, members, 0)

    def offer(self) -> None:
        """Offer every new join of this run a place in this generation."""
        for name in names_below(self.rdzv):
            nonce = join_nonce(name)
            if nonce is None or nonce in self.offered:
                continue
            data = notes.load(self.rdzv / name)
            if data is None or data.get("run_id") != self.cfg.run_id:
                continue
            other = offered_by_another(self.rdzv, name, self.me)
            if other is not None:
                raise self._rival(other, "is running in")  # it offered this join a place
            offer = {"gen": self.me.nonce, "member": self.me.to_json(), "run_id": self.cfg.run_id}
            notes.write_json(self.rdzv / offer_name(nonce), offer, "answering a join in")
            self.offered.add(nonce)

    def collect(self) -> None:
        """Read the new confirmations (and notes of ranks that gave up, or of rivals)."""
        # A confirmation does not change once written: read each only once (at 16 ranks
        # rank 0 opened ~800 files to form a job, each a round trip on a shared FS).
        seen = {member_name(m.rank, m.nonce) for m in self.confirmed.values()}
        for name in names_below(self.gen_path):
            if name.startswith(GAVE_UP):
                raise failures.gave_up(self.gen_path / name)
            if name.startswith(RIVAL):
                raise self._rival(
                    notes.member_of(notes.load(self.gen_path / name)), "is running in"
                )
            if name in seen or member_rank(name) is None:
                continue
            data = notes.load(self.gen_path / name)
            member = notes.member_of(data)
            if data is not None and member is not None:
                self._confirmation(name, member, data)

    def _confirmation(self, name: str, member: MemberInfo, data: dict[str, Any]) -> None:
        cfg = self.cfg
        known = self.confirmed.get(member.rank)
        known_alive = known is not None and judge(known).alive is not False
        mismatch = disagreement(cfg, member, data)
        step = decide_confirmation(
            member,
            known,
            member_alive=judge(member).alive is not False,
            known_alive=known_alive,
            agrees=mismatch is None,
            world_size=cfg.world_size,
        )
        if step is Confirmation.SEEN:
            return
        if step is Confirmation.DEAD:
            # Confirmed, then died before the roster (same host): a new process may
            # claim its rank.
            with contextlib.suppress(OSError):
                notes.unlink(self.gen_path / name)
            return
        if known is not None and not known_alive:
            del self.confirmed[member.rank]  # its process died: the rank is free
            with contextlib.suppress(OSError):
                notes.unlink(self.gen_path / member_name(known.rank, known.nonce))
        if mismatch is not None:
            raise mismatch
        if step is Confirmation.OUT_OF_RANGE:
            raise RendezvousError(
                f"rendezvous: {member.describe()} joined as rank {member.rank}, outside "
                f"1..{cfg.world_size - 1}",
                ranks=[member.rank],
                path=cfg.sync_dir,
            )
        if step is Confirmation.TWICE and known is not None:
            raise claimed_twice(known, member, cfg.sync_dir)
        self.confirmed[member.rank] = member

    def _rival(self, rival: MemberInfo | None, doing: str) -> RendezvousError:
        return failures.rival(self.cfg, self.me, rival, doing)

    def _lock_holder(self, holder: MemberInfo | None) -> RendezvousError:
        return self._rival(holder, "is running in")

    def check_rivals(self) -> None:
        """Find other live rank-0s of the same run id; stale ones are removed."""
        for name in names_below(self.rdzv):
            if not is_leader_name(name) or name == self.leader_file.name:
                continue
            path = self.rdzv / name
            data = notes.load(path)
            member = notes.member_of(data)
            if data is None or member is None:
                continue
            if data.get("run_id") != self.cfg.run_id or _left(self.cfg.sync_dir, data):
                continue
            gen = data.get("gen")
            hb = None
            if isinstance(gen, str) and gen.isascii() and gen.isalnum():
                hb = self.cfg.sync_dir / gen_name(gen) / heartbeat_name(member.nonce)
            elif not member.same_host:
                continue  # not a generation gradsync names: nothing to look at outside
            alive = judge(member, self.watch, hb).alive
            if alive is False:
                with contextlib.suppress(OSError):
                    notes.unlink(path)
                self.rivals.pop(member.nonce, None)
            elif alive:
                raise self._rival(member, "is running in" if member.same_host else "is beating in")
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
                    notes.unlink(self.rdzv / name)
        for path, _ in notes.ended_notes(self.cfg.sync_dir, self.cfg.run_id):
            with contextlib.suppress(OSError):
                notes.unlink(path)
        remove_dead_joins(self.rdzv)


def _left(sync_dir: Path, leader_data: dict[str, Any]) -> bool:
    """Whether the rank 0 of a ``leader-*.json`` has left its job (a session closed, or
    ended by a failure), or the job is being removed: it is nobody's rival. (A rank 0
    makes its directory before this file, and the last rank to leave removes the file
    first.)"""
    gen = sync_dir / gen_name(str(leader_data.get("gen")))
    return not is_own_dir(sync_dir, gen.name) or notes.has_left(gen, 0)
