"""Is a peer still alive? Process checks on this host, heartbeats across hosts.

A peer on this host (same boot, same PID namespace) is checked through
``/proc``: gone, a zombie, or a different process under a reused pid all count
as dead, within milliseconds. Where there is no ``/proc`` (macOS), ``kill(pid, 0)``
still tells at once that a process has exited, but not a zombie or a reused pid:
a waiting rank then also watches the peer's heartbeat, as for another host's. A
peer on another host cannot be checked through processes,
and flock does not exclude across NFS clients, so each rank rewrites a small
heartbeat counter; a peer whose counter has not moved for ``heartbeat_timeout_s``
of this host's monotonic clock is lost. No wall-clock times are compared
across hosts. :func:`judge` is the one judgment every caller in the job asks.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gradsync import _proc
from gradsync._store.api import store
from gradsync._store.dirs import job_dir, open_below
from gradsync._store.files import open_own, open_regular

__all__ = [
    "Heartbeat",
    "HeartbeatWatch",
    "MemberInfo",
    "Verdict",
    "exact_process_checks",
    "judge",
    "process_state",
]

_log = logging.getLogger("gradsync")
_COUNTER = struct.Struct("<Q")


def exact_process_checks() -> bool:
    """Whether a same-host check also tells zombies and reused pids (``/proc``)."""
    return _proc.has_proc()


def _host_id() -> str:
    return _proc.host_id()


def process_state(pid: int) -> tuple[str, int | None] | None:
    """``(state letter, start ticks)`` of a process on this host, or None if there is none.

    Without ``/proc`` the state is ``"?"`` and the start ticks ``None`` (unknown).
    """
    if pid <= 0:  # kill(0, 0) would signal this process group: never a member's pid
        return None
    if not _proc.has_proc():
        return ("?", None) if _proc.exists(pid) else None
    found = _proc.stat(pid)
    return None if found is None else (found.state, found.start_ticks)


@dataclass(frozen=True)
class MemberInfo:
    """Who a rank is: enough to tell whether it is alive and to name it in errors."""

    rank: int
    nonce: str
    hostname: str
    host_id: str
    pid: int
    start_ticks: int | None

    @classmethod
    def for_self(cls, rank: int, nonce: str) -> MemberInfo:
        pid = os.getpid()
        state = process_state(pid)
        ticks = None if state is None else state[1]
        return cls(rank, nonce, socket.gethostname(), _host_id(), pid, ticks)

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "nonce": self.nonce,
            "hostname": self.hostname,
            "host_id": self.host_id,
            "pid": self.pid,
            "start_ticks": self.start_ticks,
        }

    @classmethod
    def from_json(cls, data: object) -> MemberInfo:
        """Parse what :meth:`to_json` wrote.

        Raises:
            ValueError: for anything else (files may be garbled or from elsewhere).
        """
        if not isinstance(data, dict):
            raise ValueError(f"a member must be a JSON object, got {type(data).__name__}")
        ints = [data.get(k) for k in ("rank", "pid")]
        start = data.get("start_ticks")
        texts = [data.get(k) for k in ("nonce", "hostname", "host_id")]
        if not all(type(v) is int and v >= 0 for v in ints):
            raise ValueError(f"a member needs integer rank and pid, got {ints}")
        if start is not None and type(start) is not int:
            raise ValueError(f"start_ticks must be an integer or null, got {start!r}")
        if not all(isinstance(v, str) for v in texts):
            raise ValueError(f"a member needs string nonce, hostname and host_id, got {texts}")
        nonce, hostname, host_id = (str(v) for v in texts)
        return cls(int(data["rank"]), nonce, hostname, host_id, int(data["pid"]), start)

    @property
    def same_host(self) -> bool:
        return self.host_id == _host_id()

    def describe(self) -> str:
        return f"pid {self.pid} on {self.hostname}"

    def local_death(self) -> str | None:
        """Why this same-host process is dead, or None if it runs (or is on another host)."""
        if not self.same_host:
            return None
        state = process_state(self.pid)
        if state is None:
            return "has exited"
        letter, ticks = state
        if None not in (self.start_ticks, ticks) and ticks != self.start_ticks:
            return "has exited (its pid now belongs to another process)"
        if letter in _proc.DEAD:
            return "has exited"
        return None


class Heartbeat:
    """A daemon thread that rewrites this rank's counter every ``interval_s`` seconds.

    The file keeps one name and is rewritten in place (open, write, close): close
    makes the new value visible to other hosts' next open on NFS, and no rename
    is involved, whose replaced names some filesystems serve stale.
    """

    def __init__(self, path: Path, interval_s: float) -> None:
        self._path = path
        # Its directory (a generation's) held open: a link put in its place later is
        # never followed.
        self._dir_fd: int | None = None
        try:
            self._dir_fd = open_below(path.parent.parent, path.parent.name)
        except OSError as exc:
            _log.debug("heartbeat %s: no directory: %s", path, exc)
        self._interval_s = interval_s
        self._count = 0
        self._stop = threading.Event()
        self._beat()
        self._thread = threading.Thread(target=self._run, name="gradsync-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        self._count += 1
        if self._dir_fd is None:
            return
        try:
            fd = open_own(self._path, os.O_WRONLY, dir_fd=self._dir_fd)
            try:
                store().write_at(fd, _COUNTER.pack(self._count), 0)
            finally:
                os.close(fd)
        except OSError as exc:
            # Peers will notice a silent heartbeat and name this rank; the step's own
            # I/O reports the cause (full disk, removed directory) on this rank.
            _log.debug("heartbeat %s failed: %s", self._path, exc)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._beat()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        if not self._thread.is_alive() and self._dir_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._dir_fd)
            self._dir_fd = None


def read_counter(path: Path) -> int | None:
    """A heartbeat's counter; None if it cannot be read (missing, not a regular file:
    a FIFO in its place must not block every rank that watches it, a link in its place
    or its directory's, never followed)."""
    try:
        with job_dir(path) as dir_fd:
            fd, _ = open_regular(path, dir_fd=dir_fd, follow=False)
    except OSError:
        return None
    try:
        data = store().read_at(fd, _COUNTER.size, 0)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(data) != _COUNTER.size:
        return None
    return int(_COUNTER.unpack(data)[0])


class HeartbeatWatch:
    """Tracks peers' heartbeat counters against this host's monotonic clock."""

    def __init__(self, timeout_s: float) -> None:
        self._timeout_s = timeout_s
        self._seen: dict[Path, tuple[int | None, float]] = {}
        self._moved: set[Path] = set()

    def silent_for_s(self, path: Path) -> float:
        """Seconds since the counter at ``path`` was last seen to change (0 when it just did)."""
        now = time.monotonic()
        value = read_counter(path)
        last = self._seen.get(path)
        if last is None or last[0] != value:
            if last is not None:
                self._moved.add(path)
            self._seen[path] = (value, now)
            return 0.0
        return now - last[1]

    def moved(self, path: Path) -> bool:
        """Whether the counter at ``path`` has changed since it was first read."""
        return path in self._moved

    def is_lost(self, path: Path) -> float | None:
        """Seconds of silence if the peer is past the timeout, else None."""
        silent = self.silent_for_s(path)
        return silent if silent >= self._timeout_s else None


@dataclass(frozen=True)
class Verdict:
    """What a look tells of a peer: alive (True), gone (False, and ``why``), or not
    known yet (None)."""

    alive: bool | None
    why: str = ""


def judge(
    member: MemberInfo,
    watch: HeartbeatWatch | None = None,
    heartbeat: Path | None = None,
    *,
    holds: Callable[[], bool] | None = None,
) -> Verdict:
    """Whether ``member`` lives: on this host its process tells at once; on another,
    ``holds()`` where given (it holds a lock only a live process can), else its
    heartbeat at ``heartbeat`` as ``watch`` has seen it: gone once silent for the
    watch's timeout, alive once it has moved, not known before either (nor without a
    watch)."""
    if member.same_host:
        death = member.local_death()
        return Verdict(True) if death is None else Verdict(False, death)
    if holds is not None:
        return Verdict(holds())
    if watch is None or heartbeat is None:
        return Verdict(None)
    silent = watch.is_lost(heartbeat)
    if silent is not None:
        return Verdict(False, f"stopped its heartbeat {silent:.1f} s ago")
    return Verdict(True) if watch.moved(heartbeat) else Verdict(None)
