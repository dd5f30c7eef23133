"""The errors a rendezvous raises, worded in one place: every rank says the same."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from gradsync._errors import (
    GradSyncError,
    PeerAbortedError,
    PeerLostError,
    PeerTimeoutError,
    RendezvousError,
    job_wide_error,
    note_reason,
    parse_note,
)
from gradsync._names import GAVE_UP, member_rank
from gradsync._store.read import names_below

from . import notes
from .liveness import MemberInfo

if TYPE_CHECKING:
    from gradsync._config import FileGradSyncConfig

__all__ = [
    "NODE_RANK_HINT",
    "WORLD_SIZE_HINT",
    "aborted",
    "closed",
    "gave_up",
    "held_here",
    "join_timeout",
    "leader_lost",
    "other_world",
    "rival",
    "taken",
    "unjoined_ends",
    "unjoined_timeout",
]

# Where ranks of one job disagree, what gradsync launch made of its arguments is the
# likely cause: say how.
WORLD_SIZE_HINT = (
    " (with gradsync launch it is --nnodes x --nproc: give every node the same --nnodes "
    "and --nproc)"
)
NODE_RANK_HINT = " (or, within one job, each node its own --node-rank)"


def closed(cfg: FileGradSyncConfig) -> GradSyncError:
    return GradSyncError(
        f"rendezvous: rank {cfg.rank}'s session was closed while it waited for the other "
        f"ranks in {cfg.sync_dir}",
        ranks=[cfg.rank],
        path=cfg.sync_dir,
    )


def held_here(rank: int, path: Path) -> RendezvousError:
    return RendezvousError(
        f"rendezvous: this process (pid {os.getpid()}) already holds rank {rank} of this job "
        f"in {path}, in a session that is still open: average through that session, or close "
        "it first",
        ranks=[rank],
        path=path,
    )


def taken(rank: int, holder: MemberInfo, me: MemberInfo, gen_path: Path) -> RendezvousError:
    if holder.pid == me.pid and holder.same_host:
        return held_here(rank, gen_path)
    return RendezvousError(
        f"rendezvous: rank {rank} is already taken by {holder.describe()} in {gen_path}; "
        f"this process ({me.describe()}) claimed the same rank; give each job its own "
        f"sync_dir or run_id{NODE_RANK_HINT}",
        ranks=[rank],
        path=gen_path,
    )


def other_world(
    cfg: FileGradSyncConfig, leader: MemberInfo, world: int, me: MemberInfo, gen_path: Path
) -> RendezvousError:
    """A running job of ``world`` ranks, fewer than rank ``cfg.rank`` needs, of our run id."""
    return RendezvousError(
        f"rendezvous: a job of {world} ranks with run_id {cfg.run_id!r} (rank 0: "
        f"{leader.describe()}) is running in {gen_path}; this process ({me.describe()}) was "
        f"started as rank {cfg.rank} of {cfg.world_size}; give each job its own sync_dir or "
        f"run_id, and every rank of one job the same world size{WORLD_SIZE_HINT}",
        ranks=[cfg.rank],
        path=gen_path,
    )


def rival(
    cfg: FileGradSyncConfig, me: MemberInfo, other: MemberInfo | None, doing: str
) -> RendezvousError:
    """Another rank 0 ``other`` (None: not known which) of rank 0 ``me``'s run id."""
    if other is not None and other.pid == me.pid and other.same_host:
        return held_here(0, cfg.sync_dir)
    who = "" if other is None else f" ({other.describe()})"
    return RendezvousError(
        f"rendezvous: another rank 0{who} with run_id {cfg.run_id!r} "
        f"{doing} {cfg.sync_dir}; give each job its own sync_dir or run_id"
        f"{NODE_RANK_HINT}",
        ranks=[0],
        path=cfg.sync_dir,
    )


def leader_lost(leader: MemberInfo, reason: str, gen_path: Path) -> PeerLostError:
    return PeerLostError(
        f"rendezvous: rank 0 ({leader.describe()}) {reason} before completing the "
        f"rendezvous in {gen_path}",
        ranks=[0],
        path=gen_path,
    )


def aborted(raw: bytes, gen_path: Path) -> GradSyncError:
    """What rank 0's ``abort.json`` (``raw``) says went wrong."""
    note = parse_note(raw)
    shared = job_wide_error(note, step=None, path=gen_path)
    if shared is not None:
        return shared  # rank 0 found a problem of the whole job: every rank raises it alike
    return PeerAbortedError(
        f"rendezvous failed on rank 0: {note_reason(note)}", ranks=[0], path=gen_path
    )


def gave_up(path: Path) -> GradSyncError:
    """What a rank that was offered a place reported, at ``path``, when it gave up."""
    note = parse_note(notes.read_raw(path) or b"")
    rank = path.name[len(GAVE_UP) :].split("-")[0]
    member = notes.member_of(note) if isinstance(note, dict) else None
    who = f"rank {rank}" + ("" if member is None else f" ({member.describe()})")
    message = f"rendezvous: {who} gave up joining: {note_reason(note)}"
    # A problem of the whole job (a rank that never came, a mismatch) keeps its type
    # and ranks: it is this rank's problem too.
    shared = job_wide_error(note, step=None, path=path)
    if shared is not None:
        return type(shared)(message, ranks=shared.ranks, path=path)
    return PeerAbortedError(message, ranks=[int(rank)] if rank.isdigit() else [], path=path)


def unjoined_ends(cfg: FileGradSyncConfig, missing: list[int]) -> str:
    """What the launchers of ``missing`` ranks said of processes of theirs that ended
    while waiting to join, as clauses for rank 0's warning or timeout: without it, a
    rank that failed before rank 0 started cannot be told from one not started."""
    said: dict[int, str] = {}  # the latest note of each rank
    for _, data in notes.ended_notes(cfg.sync_dir, cfg.run_id):
        member = notes.member_of(data)
        ended = data.get("ended")
        if member is None or member.rank not in missing or not isinstance(ended, str):
            continue
        at = notes.noted_at(data)
        ago = "" if at is None else f" {max(0.0, time.time() - at):.0f} s ago"
        said[member.rank] = (
            f"rank {member.rank} ({member.describe()}) {ended} while waiting to join (noted{ago})"
        )
    return "".join(f"; {said[r]}" for r in sorted(said))


def unjoined_timeout(cfg: FileGradSyncConfig, missing: list[int]) -> PeerTimeoutError:
    """Rank 0's error when ``missing`` ranks did not join in time."""
    return PeerTimeoutError(
        f"rendezvous: ranks {missing} did not join within {cfg.max_wait_s} s "
        f"in {cfg.sync_dir} (are they running, with the same sync_dir and "
        f"run_id {cfg.run_id!r}?){unjoined_ends(cfg, missing)}",
        ranks=missing,
        path=cfg.sync_dir,
    )


def join_timeout(cfg: FileGradSyncConfig, gen_path: Path | None) -> PeerTimeoutError:
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
