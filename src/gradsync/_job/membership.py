"""Elastic membership decisions: who goes on after a rank is lost, and whether the job
may go on at all. Pure functions of a look, no files read or written here (the
re-forming loop, :mod:`gradsync._job.reform`, carries them out)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = [
    "Reform",
    "ReformLook",
    "Standing",
    "decide_reform",
    "leader_of",
    "refusal",
    "survivors",
]


class Reform(enum.Enum):
    """A step of a member re-forming the job after its membership changed."""

    CLOSED = "its session was closed: fail"
    ADOPT = "the next membership is decided: take the place it gives (or fail, left out)"
    DECIDE = "it leads, every member stayed or is gone, the rest may go on: decide"
    WAIT = "wait a little, then look again"
    FAIL = "max_wait_s is over without a membership that may go on: fail"


@dataclass(frozen=True)
class Standing:
    """What one look found of one member of the membership being left."""

    rank: int
    stayed: int | None = None  # its stay note's count of calls completed; None: no note
    gone: str | None = None  # why it is gone, if it is (None: alive, or not known yet)
    certain: bool = False  # gone for sure (it left, or its process on this host ended)


@dataclass(frozen=True)
class ReformLook:
    """What one look of a re-forming member found."""

    closing: bool
    decided: bool  # the next membership's decision is there
    me: int  # this member's rank in the membership being left
    standings: tuple[Standing, ...]
    joiners: int = 0  # processes waiting to join, admitted with the survivors
    min_world_size: int = 1
    timed_out: bool = False


def survivors(standings: tuple[Standing, ...]) -> tuple[int, ...]:
    """The ranks that go on: those that stayed and live, with the most calls completed
    (a member behind the others could only redo a call they finished: it is left out)."""
    stayed = [s for s in standings if s.stayed is not None and s.gone is None]
    if not stayed:
        return ()
    most = max(s.stayed for s in stayed if s.stayed is not None)
    return tuple(s.rank for s in stayed if s.stayed == most)


def leader_of(standings: tuple[Standing, ...]) -> int | None:
    """The member that decides: the lowest rank that stayed and is not known gone."""
    ranks = [s.rank for s in standings if s.stayed is not None and s.gone is None]
    return min(ranks) if ranks else None


def refusal(standings: tuple[Standing, ...], joiners: int, min_world_size: int) -> str | None:
    """Why the survivors may not go on (None: they may). A new membership needs more
    than half of the members not known for sure to be gone: of two halves cut apart,
    at most one has that, so they never both go on. And at least ``min_world_size``."""
    going = survivors(standings)
    counted = [s for s in standings if not s.certain]
    if 2 * len(going) <= len(counted):
        return (
            f"only {len(going)} of the {len(counted)} ranks that may still live can go on, "
            "not a majority (the others may be cut off rather than dead)"
        )
    if len(going) + joiners < min_world_size:
        return (
            f"only {len(going) + joiners} ranks can go on, fewer than min_world_size "
            f"{min_world_size}"
        )
    return None


def decide_reform(look: ReformLook) -> Reform:
    """What a re-forming member does after ``look``."""
    if look.closing:
        return Reform.CLOSED
    if look.decided:
        return Reform.ADOPT
    settled = all(s.stayed is not None or s.gone is not None for s in look.standings)
    leads = (settled or look.timed_out) and leader_of(look.standings) == look.me
    if leads and refusal(look.standings, look.joiners, look.min_world_size) is None:
        return Reform.DECIDE
    return Reform.FAIL if look.timed_out else Reform.WAIT
