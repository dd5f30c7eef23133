"""Removing what dead runs left in a sync directory.

Ranks killed by a signal never close their sessions, and a job whose hosts all died
leaves everything: its generation directory, its leader file, joins that got no
answer. A launcher that saw its rank's process end leaves the job on its behalf
(:func:`leave_for_ended`), so that peers on other hosts need not wait for the heartbeat.
Each new rank 0 removes, before it registers (on a full disk that frees space
first), every generation whose members are all gone; the launcher does the same
after a job it ran in a given directory. Members on this host are judged at
once by their process; members on other hosts by a heartbeat that stays still for
``heartbeat_timeout_s``, which a daemon thread waits out so that no job waits for it
(a removal it has begun is finished at exit).
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import logging
import os
import threading
import time
from pathlib import Path

from gradsync._names import (
    ENDED,
    GEN_PREFIX,
    RDZV,
    ROSTER,
    ended_name,
    gen_id_of,
    heartbeat_name,
    is_offer_name,
    join_nonce,
    join_prefix,
    leader_name,
    left_name,
    offer_name,
    seen_name,
)
from gradsync._store.api import store
from gradsync._store.dirs import dir_below, is_own_dir, remove_own_dir
from gradsync._store.files import list_names
from gradsync._store.read import file_below, names_below

from .leaderlock import remove_free_locks
from .liveness import HeartbeatWatch, MemberInfo, judge, read_counter
from .notes import (
    dump,
    has_left,
    leader_file,
    leader_gone,
    load,
    member_of,
    noted_at,
    write_json,
    write_note,
)

__all__ = [
    "leave_for_ended",
    "members_of",
    "reap_stale_generations",
    "remove_dead_jobs",
    "remove_dead_joins",
]

_log = logging.getLogger("gradsync")


# How long a launcher's note of a rank that ended while waiting to join is kept for a
# rank 0 of its run that has not started yet (a formed job removes its run's at once):
# with run ids unique per job, nobody else would.
_ENDED_KEEP_S = 24 * 3600.0


def remove_dead_joins(rdzv: Path) -> None:
    """Remove the join files of dead processes of this host, offers without a join,
    notes of ended joins older than a day, and rank 0 locks nobody holds."""
    names = names_below(rdzv)
    gone: list[str] = []
    for name in names:
        if name.startswith(ENDED):
            at = noted_at(load(rdzv / name) or {})
            fresh = at is not None and time.time() - at < _ENDED_KEEP_S
            if not fresh:
                gone.append(name)
    waiting = set()  # offers that the process of a join may still read
    for name in names:
        nonce = join_nonce(name)
        if nonce is None:
            continue
        stale = member_of(load(rdzv / name))
        if stale is not None and judge(stale).alive is False:
            gone.append(name)
        else:
            waiting.add(offer_name(nonce))
    # An offer names rank 0, not the joiner: it is stale once its join is gone.
    gone += [n for n in names if is_offer_name(n) and n not in waiting]
    if gone:
        with contextlib.suppress(OSError), dir_below(rdzv.parent, rdzv.name) as fd:
            for name in gone:
                with contextlib.suppress(OSError):
                    store().remove(fd, name)
    remove_free_locks(rdzv, names)


def remove_dead_jobs(sync_dir: Path) -> None:
    """Remove what jobs whose every member ran on this host, and is gone, left in
    ``sync_dir``: ranks stopped by a signal never close their session. Jobs with
    members on other hosts are left to the next rank 0, which waits out their
    heartbeats. Never raises: it only tidies."""
    try:
        names = list_names(sync_dir)
        for name in names:
            gen_path = sync_dir / name
            if not name.startswith(GEN_PREFIX) or not is_own_dir(sync_dir, name):
                continue
            members = members_of(gen_path)
            if members and all(_gone(gen_path, m) for m in members):
                _remove(gen_path)
        if RDZV in names:
            remove_dead_joins(sync_dir / RDZV)
    except OSError as exc:
        _log.debug("tidying %s stopped: %s", sync_dir, exc)


def leave_for_ended(sync_dir: Path, rank: int, pid: int, how: str) -> None:
    """Leave, for rank ``rank``'s process ``pid`` of this host, which has ended (its
    launcher reaped it), the jobs in ``sync_dir`` whose members list it by rank, pid and
    host (before a job's roster only its rank 0 is known) and that it has not left
    itself: a ``left-<rank>`` note saying ``how`` it ended ("was stopped by its launcher
    (killed by SIGTERM)"), which its peers on other hosts find at their next liveness
    check instead of after ``heartbeat_timeout_s``. A job whose every member has left is
    removed, as the last rank to leave would. Never raises: where no note could be
    written, the heartbeat tells."""
    try:
        names = sorted(
            n for n in list_names(sync_dir) if n.startswith(GEN_PREFIX) and is_own_dir(sync_dir, n)
        )
    except OSError as exc:
        _log.debug("no note for rank %d (pid %d) in %s: %s", rank, pid, sync_dir, exc)
        return
    for name in names:
        gen_path = sync_dir / name
        try:
            _leave_in(gen_path, rank, pid, how)
        except OSError as exc:
            _log.debug("no note for rank %d (pid %d) in %s: %s", rank, pid, gen_path, exc)
    try:
        _note_unjoined(sync_dir / RDZV, rank, pid, how)
    except OSError as exc:
        _log.debug("no note for rank %d (pid %d) in %s: %s", rank, pid, sync_dir / RDZV, exc)


def _note_unjoined(rdzv: Path, rank: int, pid: int, how: str) -> None:
    """For a join of the ended process still waiting in ``rdzv`` (its rank 0 has not
    admitted it), ``ended-<rank>-<nonce>.json`` says how it ended: a rank 0 waiting for
    that rank says so in its warnings and its timeout, where else it could only ask
    whether the rank runs at all."""
    for name in names_below(rdzv):
        nonce = join_nonce(name)
        if nonce is None or not name.startswith(join_prefix(rank)):
            continue
        data = load(rdzv / name)
        member = member_of(data)
        if data is None or member is None or member.pid != pid or not member.same_host:
            continue
        if judge(member).alive:
            continue  # the pid is a live process's by now (see _leave_in)
        note = {"member": member.to_json(), "run_id": data.get("run_id"), "ended": how}
        write_json(rdzv / ended_name(rank, nonce), {**note, "at": time.time()}, "noting in")


def _leave_in(gen_path: Path, rank: int, pid: int, how: str) -> None:
    rostered = file_below(gen_path / ROSTER)
    members = members_of(gen_path) or []  # before the roster, just rank 0
    started_as = _launch_ranks(gen_path, members)
    ended = [m for m in members if started_as[m.rank] == rank and m.pid == pid and m.same_host]
    # The pid was reaped before this runs: by now it may be a live process's, of a
    # rank of another job in this directory. Its start time tells them apart.
    if not ended or any(judge(m).alive for m in ended):
        return
    rank = ended[0].rank  # its rank in this generation: an elastic job renumbers
    note = gen_path / left_name(rank)
    if not has_left(gen_path, rank):  # else it closed its session (and may have died in it)
        write_note(note, dump({"ended": how}))
        if leader_gone(gen_path):
            # Removed meanwhile by someone who listed it before this note: it would
            # keep the directory, without a leader file to say whose it is.
            remove_own_dir(gen_path.parent, gen_path.name)
            return
    if rostered and all(has_left(gen_path, m.rank) for m in members):
        _remove(gen_path)


def _launch_ranks(gen_path: Path, members: list[MemberInfo]) -> dict[int, int]:
    """Each member's rank as its launcher started it: a re-formed elastic generation's
    roster lists them (``launch``), any other's ranks are those."""
    roster = load(gen_path / ROSTER) or {}
    launch = roster.get("launch")
    if isinstance(launch, list) and len(launch) == len(members):
        with contextlib.suppress(IndexError, TypeError, ValueError):
            return {m.rank: int(launch[m.rank]) for m in members}
    return {m.rank: m.rank for m in members}


def _gone(gen_path: Path, member: MemberInfo) -> bool | None:
    """Whether ``member`` of the generation at ``gen_path`` is gone: it left, or its
    process on this host has ended (True), or lives (False); None for a member on
    another host that has not left: only its heartbeat can tell."""
    if has_left(gen_path, member.rank):
        return True
    alive = judge(member).alive
    return None if alive is None else not alive


def members_of(gen_path: Path) -> list[MemberInfo] | None:
    """The members of an old generation (just its rank 0 before the roster), or None."""
    roster = load(gen_path / ROSTER)
    if roster is None:
        leader = member_of(load(leader_file(gen_path.parent, gen_id_of(gen_path.name) or "")))
        return [leader] if leader is not None else []
    raw = roster.get("members")
    if not isinstance(raw, list):
        return None
    try:
        return [MemberInfo.from_json(m) for m in raw]
    except ValueError:
        return None


def _remove(gen_path: Path) -> None:
    sync_dir = gen_path.parent
    if not is_own_dir(sync_dir, gen_path.name):
        return
    _log.debug("removing %s: every member of that run is gone", gen_path)
    with contextlib.suppress(OSError), dir_below(sync_dir, RDZV) as rdzv:
        store().remove(rdzv, leader_name(gen_id_of(gen_path.name) or ""))
    remove_own_dir(sync_dir, gen_path.name)


def _silent_since_last_look(gen_path: Path, beats: list[Path], timeout_s: float) -> bool:
    """Whether an earlier look from this host saw the same counters ``timeout_s`` ago.

    The note is keyed by host and boot, so the monotonic clock it holds is only ever
    compared with the same clock: no wall-clock times cross hosts.
    """
    counters = {hb.name: read_counter(hb) for hb in beats}
    key = hashlib.blake2b(MemberInfo.for_self(0, "").host_id.encode(), digest_size=8).hexdigest()
    note_path = gen_path / seen_name(key)
    note = load(note_path)
    now = time.monotonic()
    if note is not None and note.get("counters") == counters:
        seen_at = note.get("monotonic")
        return isinstance(seen_at, (int, float)) and now - seen_at >= timeout_s
    with contextlib.suppress(OSError):
        write_json(note_path, {"counters": counters, "monotonic": now}, "noting in")
    return False


def reap_stale_generations(sync_dir: Path, keep: Path, timeout_s: float) -> None:
    """Remove generations of earlier runs whose every member is gone.

    Members on this host are judged at once by their process; members on other
    hosts by a heartbeat that stays still for ``timeout_s`` of this host's clock,
    which a daemon thread waits out so that this job starts without delay. Jobs
    shorter than that still get there: each leaves a note of what it saw, which the
    next rank 0 on the same host compares with its own look.
    """
    pending: list[tuple[Path, list[Path]]] = []
    watch = HeartbeatWatch(timeout_s)
    for name in list_names(sync_dir):
        gen_path = sync_dir / name
        if not name.startswith(GEN_PREFIX) or gen_path == keep:
            continue
        if not is_own_dir(sync_dir, name):
            continue  # a user's, whatever its name: never looked into, written or removed
        members = members_of(gen_path)
        if members is None:
            continue
        gen_id = gen_id_of(name) or ""
        beats: list[Path] = [gen_path / heartbeat_name(gen_id)] if not members else []
        gone = [_gone(gen_path, m) for m in members]
        if False in gone:
            continue
        beats += [
            gen_path / heartbeat_name(m.nonce)
            for m, g in zip(members, gone, strict=True)
            if g is None
        ]
        if not beats:
            _remove(gen_path)
            continue
        for hb in beats:
            watch.silent_for_s(hb)
        if _silent_since_last_look(gen_path, beats, timeout_s):
            _remove(gen_path)
            continue
        pending.append((gen_path, beats))
    if pending:
        _reaper.add(pending, watch, timeout_s)


class _Reaper:
    """One daemon thread per process that removes, once their heartbeats have stayed
    silent long enough, the generations a rendezvous left pending (a thread per
    rendezvous piled up in a loop of retries)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # generation -> (its heartbeat files, the watch that first saw them, due)
        self._pending: dict[Path, tuple[list[Path], HeartbeatWatch, float]] = {}
        self._thread: threading.Thread | None = None
        # Held through each removal: exit waits for it, since a daemon thread stopped
        # halfway leaves a generation without the notes that say whose it is.
        self._removing = threading.Lock()
        self._exiting = False

    def add(
        self, pending: list[tuple[Path, list[Path]]], watch: HeartbeatWatch, timeout_s: float
    ) -> None:
        due = time.monotonic() + timeout_s * 1.1
        with self._lock:
            for gen_path, beats in pending:
                self._pending.setdefault(gen_path, (beats, watch, due))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="gradsync-reaper", daemon=True
                )
                self._thread.start()

    def _run(self) -> None:
        while True:
            with self._lock:
                now = time.monotonic()
                ready = {g: v for g, v in self._pending.items() if v[2] <= now}
                for gen_path in ready:
                    del self._pending[gen_path]
                if not self._pending and not ready:
                    self._thread = None
                    return
                next_due = min((v[2] for v in self._pending.values()), default=now)
            for gen_path, (beats, watch, _) in ready.items():
                if all(watch.is_lost(hb) is not None for hb in beats):
                    with self._removing:
                        if self._exiting:
                            return
                        _remove(gen_path)
            if not ready:
                time.sleep(max(next_due - now, 0.01))

    def finish_removal(self) -> None:
        """At exit: let a removal under way end, and start no other."""
        with self._removing:
            self._exiting = True


_reaper = _Reaper()


def _new_reaper() -> None:
    global _reaper  # a fork has none of the parent's threads, and maybe its lock held
    _reaper = _Reaper()


def _finish_removal() -> None:
    _reaper.finish_removal()


os.register_at_fork(after_in_child=_new_reaper)
atexit.register(_finish_removal)
