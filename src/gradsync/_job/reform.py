"""Elastic membership over files: re-forming the job after a rank is lost or before
joiners are admitted.

The members of generation G that go on each write ``G/stay-<rank>.json``; the lowest
of them that lives waits until every member stayed or is gone, decides
(:mod:`gradsync._job.membership`), claims the decision (``G/next.claim``, created
exclusively: one decision per membership; ``next.claim.<n>`` once every claimant of
the attempt before died without deciding), makes the next generation with its roster
and writes ``G/next.json``, then ``rdzv/current[-<run id>].json`` naming it. Every
member reads ``next.json`` and takes its new, dense rank. Joiners:
:mod:`gradsync._job.ejoin`. docs/elastic.md says why and what is guaranteed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import secrets
import threading
import time
from typing import Any

from gradsync._config import FileGradSyncConfig
from gradsync._errors import GradSyncError, PeerLostError
from gradsync._faults import fault_point
from gradsync._names import (
    NEXT,
    ROSTER,
    claim_name,
    gen_name,
    intent_name,
    left_name,
    stay_name,
)
from gradsync._store.api import store
from gradsync._store.dirs import dir_below, make_own_dir, remove_own_dir
from gradsync._store.read import names_below

from . import notes
from .decisions import settings
from .ejoin import Membership, decision, join_requests, name_running
from .liveness import HeartbeatWatch, judge
from .membership import Reform, ReformLook, Standing, decide_reform, refusal, survivors

__all__ = ["Reformer"]

_log = logging.getLogger("gradsync")
_LOOK_EVERY_S = 0.002


class Reformer:
    """One member's part in re-forming the job: stay, decide if it leads, adopt."""

    def __init__(
        self,
        cfg: FileGradSyncConfig,
        current: Membership,
        completed: int,
        closing: threading.Event | None,
        *,
        admit: bool,
        next_step: int | None = None,
        known_lost: dict[int, str] | None = None,
    ) -> None:
        self.cfg = cfg
        self.cur = current
        self.gen = current.gen
        self.completed = completed
        self._closing = closing
        self._admit = admit  # a change at a step boundary: joiners come in
        self._next_step = next_step
        self._watch = HeartbeatWatch(cfg.heartbeat_timeout_s)
        self._stays: dict[int, int] = {self.gen.rank: completed}
        # Ranks the failed step found lost already: their heartbeats need not be
        # waited out again (a member on this host is judged by its process anyway).
        self._known_lost = known_lost or {}
        self._attempt = 0  # of claiming the decision (see _claim)
        self._lost_attempts: set[int] = set()

    def run(self) -> Membership:
        """The next membership, once decided.

        Raises:
            PeerLostError: the survivors may not go on within ``max_wait_s`` (no
                majority, fewer than ``min_world_size``), or this rank was left out.
            GradSyncError: the session was closed.
        """
        note = {"member": self.gen.me.to_json(), "completed": self.completed}
        notes.write_json(self.gen.path / stay_name(self.gen.rank), note, "staying in")
        start = time.monotonic()
        while True:
            timed_out = time.monotonic() - start >= self.cfg.max_wait_s
            standings = self._standings()
            joiners = join_requests(self.cfg) if self._admit else []
            decided = notes.load(self.gen.path / NEXT)
            look = ReformLook(
                closing=self._closing is not None and self._closing.is_set(),
                decided=decided is not None,
                me=self.gen.rank,
                standings=standings,
                joiners=len(joiners),
                min_world_size=self.cfg.min_world_size,
                timed_out=timed_out,
            )
            action = decide_reform(look)
            if action is Reform.CLOSED:
                raise GradSyncError(
                    f"rank {self.gen.rank}'s session was closed while the job re-formed",
                    ranks=[self.gen.rank],
                )
            if action is Reform.ADOPT and decided is not None:
                return self._adopt(decided)
            if action is Reform.DECIDE:
                self._decide(standings, joiners)
                continue
            if action is Reform.FAIL:
                raise self._failure(standings, len(joiners))
            time.sleep(_LOOK_EVERY_S)

    def _standings(self) -> tuple[Standing, ...]:
        names = names_below(self.gen.path)
        found = []
        for member in self.gen.members:
            q = member.rank
            if q not in self._stays and stay_name(q) in names:
                data = notes.load(self.gen.path / stay_name(q))
                done = None if data is None else data.get("completed")
                if isinstance(done, int) and notes.member_of(data) == member:
                    self._stays[q] = done
            if q in self._stays:
                # One that stayed and then died (the decider, say) is gone for sure only
                # by its note or its process on this host: a silent one may be deciding.
                ended = left_name(q) in names or (member.same_host and member.local_death())
                why = (notes.how_it_ended(self.gen.path, q) or "has exited") if ended else None
                found.append(Standing(q, stayed=self._stays[q], gone=why, certain=bool(ended)))
            elif left_name(q) in names:
                why = notes.how_it_ended(self.gen.path, q) or "closed its gradsync session"
                found.append(Standing(q, gone=why, certain=True))
            elif q in self._known_lost and not member.same_host:
                found.append(Standing(q, gone=self._known_lost[q]))
            else:
                verdict = judge(member, self._watch, self.gen.heartbeat_path(q))
                gone = None if verdict.alive is not False else verdict.why
                found.append(Standing(q, gone=gone, certain=gone is not None and member.same_host))
        return tuple(found)

    def _decide(self, standings: tuple[Standing, ...], joiners: list[dict[str, Any]]) -> None:
        """Claim the one decision of this membership and write it; if another member
        claimed it first, leave it to that member."""
        with dir_below(self.cfg.sync_dir, self.gen.path.name) as fd:
            if not self._claim(fd, standings):
                return
        if self._attempt > 0:
            if notes.load(self.gen.path / NEXT) is not None:
                return  # the dead claimant wrote it before dying: adopt it
            self._remove_unfinished()
        gen_id = secrets.token_hex(8)
        # Named in the claim: a survivor that decides in place of this one, dead, removes it.
        notes.write_note(self.gen.path / claim_name(self._attempt), gen_id.encode())
        make_own_dir(self.cfg.sync_dir, gen_name(gen_id))
        fault_point("mid_decide", self.gen.rank, self.completed + 1)
        going = survivors(standings)
        members = [self.gen.members[q] for q in going]
        members += [m for j in joiners if (m := notes.member_of(j)) is not None]
        launch = [self.cur.launch[q] for q in going] + [int(j["launch"]) for j in joiners]
        gone = {s.rank: s.gone or "was left behind" for s in standings if s.rank not in going}
        lost = [
            f"rank {self.cur.launch[q]} ({self.gen.members[q].describe()}) {why}"
            for q, why in gone.items()
        ]
        ranked = [dataclasses.replace(m, rank=r).to_json() for r, m in enumerate(members)]
        data = {
            "gen": gen_id,
            "epoch": self.cur.epoch + 1,
            "members": ranked,
            "launch": launch,
            "next_step": self._next_step,
            "lost": lost,
            "joined": launch[len(going) :],
            "world_size": len(members),
            "run_id": self.cfg.run_id,
            "settings": settings(self.cfg),
        }
        new_path = self.cfg.sync_dir / gen_name(gen_id)
        # As a rank 0 forming a job registers it: a generation without one is taken
        # for one being removed (a launcher's note for a lost member would remove it).
        leader = {"member": ranked[0], "world_size": len(members), "gen": gen_id}
        leader_file = notes.leader_file(self.cfg.sync_dir, gen_id)
        notes.write_json(leader_file, {**leader, "run_id": self.cfg.run_id}, "registering in")
        notes.write_json(new_path / ROSTER, data, "publishing the roster to")
        for q in gone:
            if standings[q].gone is not None and not notes.has_left(self.gen.path, q):
                # For the last survivor to leave, which then removes this generation.
                note = notes.dump({"calls": 0, "ended": standings[q].gone or ""})
                notes.write_note(self.gen.path / left_name(q), note)
        notes.write_json(self.gen.path / NEXT, data, "deciding the next membership in")
        fault_point("after_decide", self.gen.rank, self.completed + 1)
        name_running(self.cfg, gen_id, self.cur.epoch + 1)

    def _claim(self, fd: int, standings: tuple[Standing, ...]) -> bool:
        """Whether this rank won the claim of the decision: of the first attempt, or of
        a later one once every claimant of the one before died without deciding (gone
        for sure: a process of this host that ended, or one that left)."""
        while True:
            attempt = self._attempt
            if attempt not in self._lost_attempts:
                with contextlib.suppress(FileExistsError):
                    store().create(fd, intent_name(attempt, self.gen.rank))
                try:
                    store().create(fd, claim_name(attempt))
                    return True
                except FileExistsError:
                    self._lost_attempts.add(attempt)
                    with contextlib.suppress(FileNotFoundError):
                        store().remove(fd, intent_name(attempt, self.gen.rank))
            names = store().list(fd)
            claimants = [s for s in standings if intent_name(attempt, s.rank) in names]
            if not claimants or not all(s.gone is not None and s.certain for s in claimants):
                return False
            _log.warning(
                "gradsync elastic: rank %s claimed the next membership and %s before "
                "deciding; rank %d decides in its place",
                ", ".join(str(self.cur.launch[s.rank]) for s in claimants),
                "; ".join(s.gone or "" for s in claimants),
                self.cur.launch[self.gen.rank],
            )
            self._attempt += 1

    def _remove_unfinished(self) -> None:
        """Remove the generations that the claimants of the attempts before this one
        made, dead before deciding: nobody ever takes a place in them."""
        for attempt in range(self._attempt):
            raw = notes.read_raw(self.gen.path / claim_name(attempt)) or b""
            gen_id = raw.decode(errors="replace")
            if not (gen_id.isascii() and gen_id.isalnum()):
                continue  # it died before naming one
            with contextlib.suppress(OSError):
                notes.unlink(notes.leader_file(self.cfg.sync_dir, gen_id))
            remove_own_dir(self.cfg.sync_dir, gen_name(gen_id))

    def _adopt(self, data: dict[str, Any]) -> Membership:
        try:
            found = decision(data, self.cfg.sync_dir, self.gen.me)
        except (KeyError, TypeError, ValueError) as exc:
            raise PeerLostError(
                f"rank {self.gen.rank}: unreadable decision in {self.gen.path / NEXT}",
                ranks=[self.gen.rank],
                path=self.gen.path,
            ) from exc
        if found is None:
            raise PeerLostError(
                f"rank {self.gen.rank} ({self.gen.me.describe()}) was left out of the job's "
                f"next membership in {self.gen.path / NEXT} (taken for lost, or behind the "
                "others): it cannot go on",
                ranks=[self.gen.rank],
                path=self.gen.path,
            )
        # Where its decider died before naming it: else its joiners never find it and
        # its members wait max_wait_s for them.
        name_running(self.cfg, found.gen.gen_id, found.epoch)
        return found

    def _failure(self, standings: tuple[Standing, ...], joiners: int) -> PeerLostError:
        # The ranks whose loss is why: not those that stayed and gave up or died since.
        gone = [s.rank for s in standings if s.gone is not None and s.stayed is None] or [
            s.rank for s in standings if s.gone is not None
        ]
        pending = [s.rank for s in standings if s.gone is None and s.stayed is None]
        why = refusal(standings, joiners, self.cfg.min_world_size) or (
            f"ranks {pending} neither went on nor were found gone"
        )
        described = "; ".join(f"rank {s.rank} {s.gone}" for s in standings if s.gone)
        return PeerLostError(
            f"the job could not go on within {self.cfg.max_wait_s} s after losing ranks "
            f"{gone} ({described}): {why}",
            ranks=gone,
            path=self.gen.path,
        )
