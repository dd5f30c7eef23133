"""A formed job (a generation): its directory, its members, and a rank's leaving it."""

from __future__ import annotations

import contextlib
import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gradsync._errors import GradSyncError, MismatchError, RendezvousError
from gradsync._names import ROSTER, gen_id_of, heartbeat_name, left_name
from gradsync._store.api import store
from gradsync._store.dirs import dir_below, remove_own_dir
from gradsync._store.read import file_below

from . import failures, notes
from .liveness import Heartbeat, HeartbeatWatch, MemberInfo, exact_process_checks

if TYPE_CHECKING:
    from gradsync._config import FileGradSyncConfig

    from .leaderlock import LeaderLock

__all__ = ["Generation", "accept", "calls_finished", "leave", "rostered", "why_lost"]


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
        return self.path / heartbeat_name(self.members[rank].nonce)

    def left_path(self, rank: int) -> Path:
        return self.path / left_name(rank)


def accept(
    cfg: FileGradSyncConfig, me: MemberInfo, gen_path: Path, roster: dict[str, Any]
) -> Generation:
    """The generation at ``gen_path`` as its ``roster`` gives it to rank ``me``.

    Raises:
        RendezvousError: the roster is unreadable, or gives this rank to another process.
        MismatchError: the roster has another number of ranks.
    """
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
        raise failures.taken(cfg.rank, holder, me, gen_path)
    return Generation(gen_path, gen_id_of(gen_path.name) or "", members, cfg.rank)


def rostered(cfg: FileGradSyncConfig, me: MemberInfo, gen_path: Path) -> Generation | None:
    """The generation at ``gen_path`` if its roster (written meanwhile) lists this rank."""
    roster = notes.load(gen_path / ROSTER)
    if roster is None:
        return None
    try:
        return accept(cfg, me, gen_path, roster)
    except GradSyncError:
        return None


def leave(gen: Generation, calls: int, ended: str | None = None) -> None:
    """Mark this rank as gone after finishing ``calls`` averaging calls (and, for peers
    still waiting for it, how its session ``ended``, if not simply closed); the last
    rank to leave removes the generation directory."""
    note: dict[str, Any] = {"calls": calls} if ended is None else {"calls": calls, "ended": ended}
    try:
        with dir_below(gen.path.parent, gen.path.name) as fd:
            notes.write_note(gen.left_path(gen.rank), json.dumps(note).encode(), dir_fd=fd)
            names = store().list(fd)
    except OSError:
        return  # not knowing who is left, leave the directory to the last rank
    finally:
        if gen.lock is not None:
            gen.lock.release()  # after the note: the next rank 0 sees this one left
    if all(left_name(r) in names for r in range(len(gen.members))):
        with contextlib.suppress(OSError):
            notes.unlink(notes.leader_file(gen.path.parent, gen.gen_id))
        remove_own_dir(gen.path.parent, gen.path.name)


def calls_finished(gen: Generation, rank: int) -> int | None:
    """How many calls ``rank`` had finished when it left, if it left and said so."""
    note = notes.load(gen.left_path(rank))
    calls = None if note is None else note.get("calls")  # None: written by an older gradsync
    return calls if isinstance(calls, int) and not isinstance(calls, bool) else None


def why_lost(
    gen: Generation, watch: HeartbeatWatch, q: int, names: set[str], seq: int
) -> str | None:
    """How rank ``q`` ended, if it is gone without finishing call ``seq``; ``names``:
    the generation directory's."""
    member = gen.members[q]
    left = left_name(q) in names
    reason: str | None = None
    if not left:
        if member.same_host:
            reason = member.local_death()
            if reason is None and not exact_process_checks():
                # kill(pid, 0) takes a zombie or a reused pid for alive: the
                # heartbeat tells within heartbeat_timeout_s.
                reason = _heartbeat_stopped(gen, watch, q)
        else:
            reason = _heartbeat_stopped(gen, watch, q)
        # Gone since the listing: the note it left on its way out says why.
        left = reason is not None and file_below(gen.left_path(q))
    if left:
        finished = calls_finished(gen, q)
        if finished is not None and finished >= seq:
            # It finished this call, so it published all of it: a shared
            # filesystem's listing of the step can lag behind its "left" file.
            return None
        reason = notes.how_it_ended(gen.path, q) or "closed its gradsync session"
    return reason


def _heartbeat_stopped(gen: Generation, watch: HeartbeatWatch, rank: int) -> str | None:
    silent = watch.is_lost(gen.heartbeat_path(rank))
    return None if silent is None else f"stopped its heartbeat {silent:.1f} s ago"
