"""Elastic GradSync calls: a step whose peer was lost is redone by the ranks that remain,
and joiners come in after a call (docs/elastic.md)."""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from ._config import FileGradSyncConfig
from ._errors import GradSyncError, PeerAbortedError, PeerLostError, PeerTimeoutError, clip
from ._job import notes
from ._job.ejoin import Membership, job_pointer, join_running, running_job
from ._job.rendezvous import rendezvous
from ._stats import StepStats

if TYPE_CHECKING:
    from ._session import Session

__all__ = ["MembershipView", "member_config", "run_elastic", "start_elastic"]

_log = logging.getLogger("gradsync")

# A peer lost, silent past max_wait_s, or that gave up (its note says why): the
# others go on without it. Anything else (a mismatch, NaN, a damaged file) fails the
# step on every rank, as without elastic.
_REFORMABLE = (PeerLostError, PeerTimeoutError, PeerAbortedError)


def start_elastic(cfg: FileGradSyncConfig, closing: threading.Event | None) -> Membership:
    """Join this run's running job if there is one; else form it as every job forms."""
    running = running_job(cfg)
    if running is not None:
        joined = join_running(cfg, running, closing)
        if joined is not None:
            return joined
        _log.warning(
            "gradsync elastic: rank %d: every member of the job it waited to join in %s is "
            "gone; forming a new job of %d ranks",
            cfg.rank,
            cfg.sync_dir,
            cfg.world_size,
        )
    gen = rendezvous(cfg, closing)
    if gen.rank == 0:
        notes.write_json(job_pointer(cfg), {"gen": gen.gen_id}, "naming the running job in")
    return Membership(gen, tuple(range(cfg.world_size)))


def member_config(cfg: FileGradSyncConfig, membership: Membership) -> FileGradSyncConfig:
    """``cfg`` with the rank and world size this membership gives."""
    world = len(membership.gen.members)
    return dataclasses.replace(
        cfg,
        rank=membership.gen.rank,
        world_size=world,
        min_world_size=min(cfg.min_world_size, world),
    )


def run_elastic(
    session: Session,
    cfg: FileGradSyncConfig,
    closing: threading.Event,
    call: Callable[[], StepStats],
    next_step: int | None,
) -> StepStats:
    """``call()`` (one averaging step, or a broadcast), redone after re-forming the job
    each time a peer is lost; then, if rank 0 said so in it (an averaging step), the
    joiners come in, to take part from call ``next_step`` on."""
    lost: list[str] = []
    while True:
        try:
            stats = call()
        except GradSyncError as exc:
            engine = session.engine
            if session.membership is None or engine is None or not isinstance(exc, _REFORMABLE):
                raise
            engine.give_up(exc)  # a peer one call ahead hears it too
            _log.info("rank %d re-forms the job after: %s", engine.rank, exc)
            known = {q: f"was lost ({clip(str(exc))})" for q in exc.ranks}
            if not isinstance(exc, PeerLostError):
                known = {}
            new = session.reform(cfg, closing, admit=False, known_lost=known)
            lost += new.lost
            for why in new.lost:
                _log.warning("gradsync elastic: %s; %d ranks go on", why, len(new.launch))
            continue
        break
    took_part = session.membership
    assert took_part is not None
    joined: tuple[int, ...] = ()
    if next_step is not None:
        # Lost while joiners came in after the last averaging call, or in a broadcast
        # since: this one is without them.
        lost, session.lost_since = session.lost_since + lost, []
        joined = _admit_joiners(session, cfg, closing, next_step)
    else:
        # A broadcast returns no StepStats: the next averaging call's names them.
        session.lost_since += lost
    return dataclasses.replace(
        stats, members=took_part.launch, epoch=took_part.epoch, lost=tuple(lost), joined=joined
    )


def _admit_joiners(
    session: Session, cfg: FileGradSyncConfig, closing: threading.Event, next_step: int
) -> tuple[int, ...]:
    """The joiners admitted after this averaging call, if rank 0 marked it for them."""
    if session.engine is None or not session.engine.joins_due:
        return ()
    new = session.reform(cfg, closing, admit=True, next_step=next_step)
    # Those lost meanwhile took part in this call (its mean holds their input): the next says so.
    session.lost_since = list(new.lost)
    _log.info("gradsync elastic: ranks %s joined; %d ranks now", new.joined, len(new.launch))
    for why in new.lost:
        _log.warning("gradsync elastic: %s; %d ranks go on", why, len(new.launch))
    return new.joined


class MembershipView:
    """A GradSync's rank, world size and members now (an elastic job changes them)."""

    cfg: FileGradSyncConfig
    _session: Session

    @property
    def rank(self) -> int:
        """This process's rank now: ``cfg.rank``, until an elastic job renumbers it."""
        member = self._session.membership
        return self.cfg.rank if member is None else member.gen.rank

    @property
    def world_size(self) -> int:
        """The number of ranks now: ``cfg.world_size``, until an elastic job changes it."""
        member = self._session.membership
        return self.cfg.world_size if member is None else len(member.gen.members)

    @property
    def members(self) -> tuple[int, ...]:
        """Each rank's ``cfg.rank`` as it was started, in the order of the ranks now."""
        member = self._session.membership
        return tuple(range(self.cfg.world_size)) if member is None else member.launch

    @property
    def epoch(self) -> int:
        """How many times the membership of an elastic job has changed (0: never)."""
        member = self._session.membership
        return 0 if member is None else member.epoch
