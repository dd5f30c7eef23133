"""One forming or running job per run id in a sync dir, and no job formed while a rank
it admits is claimed twice.

Rank 0 holds an ``flock`` on ``rdzv/lock-0[-<run id>].lock`` from before it offers a
place until it leaves the job; the OS lets it go when the process dies. A rank 0 that
cannot take it leaves a ``rival-0-<nonce>.json`` note in every generation of its run id
still forming (so a holder that has not written its roster yet aborts), then fails,
naming the holder. A joiner holds a shared ``flock`` on its join file while it waits, so
that rank 0 can tell a live second claimant of a rank on another host from a dead one.

Rank 0's lock is filelock's ``UnixFileLock``, tried without waiting and without its
fallback to a marker file where ``flock`` is missing (rank 0 then warns and goes on);
its holder removes the file just before letting it go. The joiners' shared locks are
taken with ``fcntl``: filelock has no shared ``flock``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from filelock import Timeout, UnixFileLock

from gradsync._errors import RendezvousError
from gradsync._names import (
    LOCK_PREFIX,
    RDZV,
    ROSTER,
    gen_name,
    heartbeat_name,
    is_leader_name,
    join_nonce,
    join_prefix,
    offer_name,
    rival_name,
)
from gradsync._store.api import store
from gradsync._store.dirs import is_own_dir, job_dir, remove_own_dir
from gradsync._store.files import Backoff, translate_oserror
from gradsync._store.read import file_below, names_below

from .liveness import HeartbeatWatch, MemberInfo, judge
from .notes import dump, has_left, leader_gone, load, lock_file, member_of, write_note

if TYPE_CHECKING:  # the launcher's watchdog imports this module without numpy
    from gradsync._config import FileGradSyncConfig

__all__ = [
    "LeaderLock",
    "check_claims",
    "claimed_twice",
    "hold_join",
    "offered_by_another",
    "release_join",
    "remove_free_locks",
    "take_leader_lock",
]

_log = logging.getLogger("gradsync")
_LOCK_MODE = 0o660
_HELD = (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)  # some filesystems say EACCES
_NOT_THERE = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EBADF, errno.EINVAL)


class LeaderLock:
    """Rank 0's hold on its run id in a sync dir (none where ``flock`` is missing)."""

    def __init__(self, lock: UnixFileLock | None, path: Path) -> None:
        self._lock = lock
        self._path = path
        self._guard = threading.Lock()

    def release(self) -> None:
        """Remove the lock file, then let the lock go; only the first call acts."""
        with self._guard:
            lock, self._lock = self._lock, None
        if lock is not None:
            _remove_held(lock, self._path)


def _new_lock(path: Path) -> UnixFileLock:
    """filelock's ``flock`` lock on ``path``: never waits, never falls back to a marker
    file, may be let go by another thread; read-write for the group (another user of it
    must open the file for writing to lock it), nothing for other users."""
    return UnixFileLock(
        path, mode=_LOCK_MODE, thread_local=False, blocking=False, fallback_to_soft=False
    )


def _remove_held(lock: UnixFileLock, path: Path) -> None:
    """Remove the file of ``lock``, held, then let it go."""
    # Safe while held: filelock drops a lock it wins on an unlinked file (st_nlink == 0).
    with contextlib.suppress(OSError), job_dir(path) as dir_fd:
        store().remove(dir_fd, path.name)
    with contextlib.suppress(OSError):
        lock.release()


def _try_lock(lock: UnixFileLock, path: Path) -> bool | None:
    """True: locked; False: held by another; None: this filesystem has no ``flock``.

    Raises:
        SyncDirError: the lock file cannot be opened or locked (a link at its name).
    """
    try:
        _check_plain(path)
        for _ in range(2):  # filelock also gives up on a file removed as it was locked
            with contextlib.suppress(Timeout):
                lock.acquire(blocking=False)
                return True
        return False
    except NotImplementedError:
        return None
    except OSError as exc:  # Timeout, also an OSError, is handled above
        if exc.errno in _NOT_THERE:
            return None
        raise translate_oserror(exc, "taking rank 0's lock in", path) from exc


def _check_plain(path: Path) -> None:
    """Raise OSError if ``path`` is a hard link or no regular file (filelock 3.x
    truncates the file it locks; filelock itself refuses a symbolic link)."""
    try:
        st = store().stat(None, path)
    except FileNotFoundError:
        return
    # No links at all: a rank 0 removed it as this one looked (it then locks a new one).
    if not stat.S_ISLNK(st.st_mode) and (not stat.S_ISREG(st.st_mode) or st.st_nlink > 1):
        raise OSError(errno.EMLINK, f"{path} is not a plain file gradsync made", str(path))


def take_leader_lock(
    cfg: FileGradSyncConfig, me: MemberInfo, rival: Callable[[MemberInfo | None], Exception]
) -> LeaderLock:
    """Hold rank 0's lock for ``cfg.run_id`` in ``cfg.sync_dir``; this rank's generation
    directory must exist already (a rival's note must find it).

    Raises:
        Exception: ``rival(holder)``: another live rank 0 of the run holds it (at once on
            this host; for one on another host, once its heartbeat moves, or after
            ``max_wait_s``; None where none could be named).
        SyncDirError: the lock file cannot be opened.
    """
    path = lock_file(cfg.sync_dir, cfg.run_id)
    lock = _new_lock(path)
    got = _try_lock(lock, path)
    if got is None:
        _log.warning(
            "rendezvous: %s has no working flock: rank 0 cannot lock out another job "
            "with run_id %r there and relies on its slower checks of other rank 0s' files",
            path.parent,
            cfg.run_id,
        )
        return LeaderLock(None, path)
    if not got:
        holder, freed = _wait_for_holder(cfg, me, lock, path)
        # Never taken once a rank 0 of the run was seen with it: it may have formed with
        # ranks that came for this one, or failed and left them to it. A holder that
        # registered none was tidying (remove_free_locks), or failed before offering.
        if holder is not None or not freed:
            if freed:
                _remove_held(lock, path)
            raise rival(holder)
    return LeaderLock(lock, path)


def _wait_for_holder(
    cfg: FileGradSyncConfig, me: MemberInfo, lock: UnixFileLock, path: Path
) -> tuple[MemberInfo | None, bool]:
    """Tell every generation of the run still forming that this rank 0 came; the lock's
    holder once it is known to live, else (once the lock is let go, or after
    ``max_wait_s``) the last rank 0 of the run seen, None if none was; and whether the
    lock was let go (and is now held by ``lock``)."""
    backoff = Backoff()
    watch = HeartbeatWatch(cfg.heartbeat_timeout_s)
    told: set[str] = set()
    seen: MemberInfo | None = None
    while True:
        for gen_path, leader, left in _registered(cfg):
            seen = seen or leader
            if leader.same_host and leader.pid == me.pid and not left:
                return leader, False  # a session of this process: it goes on
            if left:
                continue
            if gen_path.name not in told:
                _tell(gen_path, me, cfg.run_id)
                told.add(gen_path.name)
            if judge(leader, watch, gen_path / heartbeat_name(leader.nonce)).alive:
                return leader, False
        if _try_lock(lock, path):
            return seen, True
        if backoff.elapsed_s() >= cfg.max_wait_s:
            return seen, False
        backoff.pause()


def _tell(gen_path: Path, me: MemberInfo, run_id: str | None) -> None:
    """Leave a rival's note in the generation at ``gen_path``, if it is gradsync's."""
    if not is_own_dir(gen_path.parent, gen_path.name):
        return
    note = dump({"member": me.to_json(), "run_id": run_id})
    with contextlib.suppress(OSError):
        write_note(gen_path / rival_name(me.nonce), note)
    if leader_gone(gen_path):
        # Removed meanwhile: the note must not keep its directory.
        remove_own_dir(gen_path.parent, gen_path.name)


def _registered(cfg: FileGradSyncConfig) -> list[tuple[Path, MemberInfo, bool]]:
    """The generations of ``cfg.run_id`` with their rank 0 (on this host, only those
    whose rank 0 lives) and whether it has left them; those not yet formed first (the
    lock's holder is among them, or has formed)."""
    rdzv = cfg.sync_dir / RDZV
    found = []
    for name in sorted(names_below(rdzv)):
        if not is_leader_name(name):
            continue
        data = load(rdzv / name)
        leader = member_of(data)
        if data is None or leader is None or data.get("run_id") != cfg.run_id:
            continue
        if judge(leader).alive is False:
            continue
        gen = data.get("gen")
        if not (isinstance(gen, str) and gen.isascii() and gen.isalnum()):
            continue  # not a generation gradsync names: nothing to look at outside
        gen_path = cfg.sync_dir / gen_name(gen)
        found.append((gen_path, leader, has_left(gen_path, 0)))
    return sorted(found, key=lambda g: file_below(g[0] / ROSTER))


def remove_free_locks(rdzv: Path, names: Iterable[str]) -> None:
    """Remove the rank 0 locks among ``names`` in ``rdzv`` that no rank 0 holds (one
    stopped by a signal leaves its file): each locked, then removed while held, as its
    holder does. Never raises."""
    for name in names:
        if not (name.startswith(LOCK_PREFIX) and name.endswith(".lock")):
            continue
        path = rdzv / name
        lock = _new_lock(path)
        with contextlib.suppress(OSError):  # SyncDirError too
            if _try_lock(lock, path):
                _remove_held(lock, path)


def _open_existing(path: Path) -> int | None:
    """``path``, opened without following a link, for writing where allowed (NFS takes an
    exclusive flock as a write lock); None if it cannot be."""
    flags = os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
    try:
        with job_dir(path) as dir_fd:
            try:
                return os.open(path.name, os.O_RDWR | flags, dir_fd=dir_fd)
            except PermissionError:
                return os.open(path.name, os.O_RDONLY | flags, dir_fd=dir_fd)
    except OSError:
        return None


# The joiners' side stays on fcntl: filelock has no shared flock, and its lock would
# create (3.x: truncate) a join file where only a look at another's is wanted.
def _try_flock(fd: int, how: int) -> bool | None:
    """True: locked; False: held by another; None: this filesystem has no ``flock``."""
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in _HELD:
            return False
        if exc.errno in _NOT_THERE:
            return None
        raise
    return True


def hold_join(path: Path) -> int | None:
    """Hold a shared ``flock`` on this rank's join file while it waits for a place: the
    sign to rank 0 that it lives. None where it cannot be taken."""
    try:
        with job_dir(path) as dir_fd:
            fd = os.open(
                path.name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd
            )
    except OSError:
        return None
    for _ in range(100):  # a rank 0's look (_join_held) holds it for an instant
        try:
            got = _try_flock(fd, fcntl.LOCK_SH)
        except OSError:
            break
        if got is None:
            break
        if got:
            return fd
        time.sleep(0.001)
    os.close(fd)
    return None


def release_join(fd: int | None) -> None:
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)


def check_claims(rdzv: Path, run_id: str | None, members: Iterable[MemberInfo]) -> None:
    """Fail if another live process waits in ``rdzv`` to join run ``run_id`` as the rank
    of one of ``members``.

    Raises:
        RendezvousError: naming the rank and both processes.
    """
    names = names_below(rdzv)
    for member in members:
        other = _live_rival_join(rdzv, run_id, member, names)
        if other is not None:
            raise claimed_twice(member, other, rdzv.parent)


def claimed_twice(first: MemberInfo, second: MemberInfo, sync_dir: Path) -> RendezvousError:
    """The error of two live processes claiming one rank."""
    return RendezvousError(
        f"rendezvous: two processes claim rank {first.rank}: {first.describe()} and "
        f"{second.describe()} in {sync_dir}",
        ranks=[first.rank],
        path=sync_dir,
    )


def _live_rival_join(
    rdzv: Path, run_id: str | None, member: MemberInfo, names: set[str]
) -> MemberInfo | None:
    """Another live process waiting to join run ``run_id`` as ``member``'s rank, among
    the join files ``names`` of ``rdzv``: on this host its process lives, on another
    it holds its join file's lock."""
    prefix = join_prefix(member.rank)
    for name in names:
        nonce = join_nonce(name)
        if not name.startswith(prefix) or nonce is None or nonce == member.nonce:
            continue
        data = load(rdzv / name)
        other = member_of(data)
        if data is None or other is None or data.get("run_id") != run_id:
            continue
        if other.rank == member.rank and _lives(rdzv / name, other):
            return other
    return None


def _join_held(path: Path) -> bool:
    """Whether the process of the join file at ``path`` holds its lock (it waits)."""
    fd = _open_existing(path)
    if fd is None:
        return False
    try:
        return _try_flock(fd, fcntl.LOCK_EX) is False
    except OSError:
        return False
    finally:
        os.close(fd)  # drops the probe's own lock, if it got one


def offered_by_another(rdzv: Path, name: str, me: MemberInfo) -> MemberInfo | None:
    """Another live rank 0 of this host that offered the live process of the join file
    ``name`` a place: that joiner may have come for it (which job it belongs to no file
    tells), so it is not this rank 0's to take. A new session of this same process may
    take it; a rank 0 on another host cannot be told from a dead one at a look."""
    nonce = join_nonce(name)
    other = member_of(load(rdzv / offer_name(nonce))) if nonce is not None else None
    if other is None or not other.same_host or other.pid == me.pid:
        return None
    if judge(other).alive is False or not _lives(rdzv / name, member_of(load(rdzv / name))):
        return None
    return other


def _lives(join: Path, joiner: MemberInfo | None) -> bool:
    """Whether ``joiner``, the process of the join file at ``join``, lives."""
    if joiner is None:
        return False
    return judge(joiner, holds=lambda: _join_held(join)).alive is True
