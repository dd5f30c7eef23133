"""What a rank does next in a rendezvous, decided from what it has seen: pure functions
of a look, no files read or written here (the rank's loop carries the steps out)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gradsync._errors import MismatchError

from .failures import WORLD_SIZE_HINT
from .liveness import MemberInfo

if TYPE_CHECKING:
    from gradsync._config import FileGradSyncConfig

__all__ = [
    "Admit",
    "AdmitLook",
    "Confirmation",
    "Join",
    "JoinLook",
    "decide_admit",
    "decide_confirmation",
    "decide_join",
    "disagreement",
    "settings",
]


class Join(enum.Enum):
    """A step of a rank > 0 waiting to join."""

    CLOSED = "its session was closed: fail"
    CONFIRM = "an offer came: confirm a place in its generation"
    CHECK_OTHERS = "fail if a live job has its rank, or a rank 0 that left it is gone"
    ABORTED = "rank 0 wrote why it failed: raise that"
    ACCEPT = "the roster is there: take the place it gives"
    CHECK_LEADER = "fail if rank 0 is gone; wait anew if its generation was removed"
    TIME_OUT = "max_wait_s is over: fail"
    WARN = "say for whom it waits"
    PAUSE = "wait a little, then look again"


@dataclass(frozen=True)
class JoinLook:
    """What one look of a rank > 0 found."""

    closing: bool
    admitted: bool  # it has confirmed a place in a generation
    offer: bool = False  # not admitted: an offer it may take is there
    abort: bool = False  # admitted: rank 0 wrote why it failed
    roster: bool = False  # admitted: rank 0 wrote the roster
    check_due: bool = False
    timed_out: bool = False
    warn_due: bool = False


def decide_join(look: JoinLook) -> tuple[Join, ...]:
    """The steps of a rank > 0 after ``look``, in order (any may end its wait)."""
    if look.closing:
        return (Join.CLOSED,)
    if not look.admitted:
        if look.offer:
            return (Join.CONFIRM,)  # then look again at once: its generation now
        checks = (Join.CHECK_OTHERS,) if look.check_due else ()
    elif look.abort:
        return (Join.ABORTED,)
    elif look.roster:
        return (Join.ACCEPT,)
    else:
        checks = (Join.CHECK_LEADER,) if look.check_due else ()
    if look.timed_out:
        return (*checks, Join.TIME_OUT)
    return (*checks, *((Join.WARN,) if look.warn_due else ()), Join.PAUSE)


class Admit(enum.Enum):
    """What rank 0 does once it has answered the joins and read the confirmations."""

    CLOSED = "its session was closed: fail"
    ROSTER = "every rank has confirmed and no rival is undecided: write the roster"
    MISSING = "max_wait_s is over and ranks are missing: fail, naming them"
    RIVAL = "max_wait_s is over with another rank 0 still undecided: fail, naming it"
    WARN = "say for whom it waits, then wait"
    PAUSE = "wait a little, then look again"


@dataclass(frozen=True)
class AdmitLook:
    """What rank 0 knows after one round of answering joins and reading confirmations."""

    closing: bool
    missing: tuple[int, ...]  # ranks that have not confirmed
    rivals: bool  # another rank 0 of the run id, not known yet to live or not
    timed_out: bool = False
    warn_due: bool = False


def decide_admit(look: AdmitLook) -> Admit:
    if look.closing:
        return Admit.CLOSED
    if not look.missing and not look.rivals:
        return Admit.ROSTER
    if look.timed_out:
        return Admit.MISSING if look.missing else Admit.RIVAL
    return Admit.WARN if look.warn_due else Admit.PAUSE


class Confirmation(enum.Enum):
    """What rank 0 makes of a confirmation it reads."""

    SEEN = "the rank's confirmation, known already"
    DEAD = "its process on this host died before the roster: remove it, its rank is free"
    ADMIT = "admit the rank (after replacing a confirmation of it whose process died)"
    MISMATCH = "configured otherwise than rank 0 where ranks must agree: fail"
    OUT_OF_RANGE = "a rank outside 1..world_size - 1: fail"
    TWICE = "a second live process confirms a rank: fail"


def decide_confirmation(
    member: MemberInfo,
    known: MemberInfo | None,
    *,
    member_alive: bool,
    known_alive: bool,
    agrees: bool,
    world_size: int,
) -> Confirmation:
    """What a confirmation by ``member`` means, where ``known`` had confirmed its rank
    (``agrees``: with rank 0's settings)."""
    if known is not None and known.nonce == member.nonce:
        return Confirmation.SEEN
    if not member_alive:
        return Confirmation.DEAD
    if not agrees:
        return Confirmation.MISMATCH
    if not 0 < member.rank < world_size:
        return Confirmation.OUT_OF_RANGE
    if known is not None and known_alive:
        return Confirmation.TWICE
    return Confirmation.ADMIT


def settings(cfg: FileGradSyncConfig) -> dict[str, Any]:
    """The config fields every rank must share: they decide the file layout (strategy,
    compression, compress_local), the maths (wide_sum, error_feedback: where every rank
    reduces all, each encodes the mean with its own residual), what a reader can check, which
    only its publisher can make possible (check_finite: the publisher flags NaN/Inf;
    checksums: it writes the CRCs), and when a silent peer counts as lost: a rank that
    beats every 20 s was declared lost by a peer waiting 15 s for a beat; whether the
    job is elastic, and the fewest ranks it goes on with (whichever rank decides a
    re-form). The rest may differ between ranks."""
    return {
        "strategy": cfg.strategy,
        "wide_sum": cfg.wide_sum,
        "compression": cfg.compression,
        "check_finite": cfg.check_finite,
        "checksums": cfg.checksums,
        "heartbeat_interval_s": cfg.heartbeat_interval_s,
        "heartbeat_timeout_s": cfg.heartbeat_timeout_s,
        **({"compress_local": True} if _compress_local(cfg) else {}),
        **({"error_feedback": True} if _error_feedback(cfg) else {}),
        **({"elastic": True, "min_world_size": cfg.min_world_size} if cfg.elastic else {}),
    }


def _compress_local(cfg: FileGradSyncConfig) -> bool:
    return cfg.compress_local and cfg.compression is not None


def _error_feedback(cfg: FileGradSyncConfig) -> bool:
    return cfg.error_feedback and cfg.compression is not None


def disagreement(
    cfg: FileGradSyncConfig, member: MemberInfo, data: dict[str, Any]
) -> MismatchError | None:
    """Where ``member``'s confirmation ``data`` says it was configured otherwise than
    this rank (``cfg``) in what the ranks must share, the error; else None."""
    mine = settings(cfg)
    theirs = data.get("settings")
    if not isinstance(theirs, dict):
        # Written by a gradsync that sent no settings: nothing says it sums and lays
        # out its files as this one does, so it may not join.
        return MismatchError(
            f"rendezvous: rank {member.rank} ({member.describe()}) sent no settings "
            f"({', '.join(mine)}) in {cfg.sync_dir}: it runs an older "
            "gradsync; every rank must run the same gradsync version",
            ranks=[0, member.rank],
            path=cfg.sync_dir,
        )
    # Sent only where set: a rank without elastic says what it always said.
    theirs = {
        "elastic": False,
        "compress_local": False,
        "error_feedback": False,
        **theirs,
        "world_size": data.get("world_size"),
    }
    ours = {
        "world_size": cfg.world_size,
        **mine,
        "compress_local": _compress_local(cfg),
        "error_feedback": _error_feedback(cfg),
        "elastic": cfg.elastic,
    }
    for key, value in ours.items():
        if theirs.get(key) != value:
            return MismatchError(
                f"rendezvous: rank 0 has {key} {value!r} but rank {member.rank} "
                f"({member.describe()}) has {key} {theirs.get(key)!r} in {cfg.sync_dir}; "
                f"every rank must use the same {key}"
                + (WORLD_SIZE_HINT if key == "world_size" else ""),
                ranks=[0, member.rank],
                path=cfg.sync_dir,
            )
    return None
