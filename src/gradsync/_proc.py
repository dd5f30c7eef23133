"""What ``/proc`` says of processes, this host and its mounts; the one reader of it.

Standard library only: the launcher's watchdog loads it without numpy.

Tests act as another host (macOS: no ``/proc``; a pid namespace whose ``/proc`` shows
another's pids) with :func:`set_root`, and undo it with ``set_root(None)``.
"""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass
from functools import cache
from pathlib import Path

__all__ = [
    "DEAD",
    "ProcStat",
    "exists",
    "filesystem_type",
    "has_proc",
    "host_id",
    "pids",
    "set_root",
    "shows_this_namespace",
    "stat",
    "thread_count",
]

_DEFAULT = Path("/proc")
_root = _DEFAULT
DEAD = ("Z", "X", "x")  # process states of a process that has ended


def set_root(path: Path | None) -> None:
    """Read process information below ``path`` instead of ``/proc`` (tests); None: ``/proc``."""
    global _root
    _root = _DEFAULT if path is None else path
    host_id.cache_clear()


def has_proc() -> bool:
    """Whether there is a ``/proc`` to read (Linux), which tells zombies and reused pids."""
    return (_root / "self" / "stat").exists()


def shows_this_namespace() -> bool:
    """Whether ``/proc`` shows this process's pid namespace (in a new namespace without
    its own ``/proc`` mounted, it shows another's pids)."""
    try:
        return os.readlink(_root / "self") == str(os.getpid())
    except OSError:
        return False


@dataclass(frozen=True)
class ProcStat:
    """Fields of ``/proc/<pid>/stat``."""

    state: str
    pgid: int
    start_ticks: int


def stat(pid: int | str) -> ProcStat | None:
    """Process ``pid``'s state, group and start time in clock ticks since boot; None if
    ``/proc`` has no such process or an unreadable line for it."""
    try:
        raw = (_root / str(pid) / "stat").read_bytes()
    except OSError:
        return None
    # The command name may hold spaces or parentheses: the fields follow the last ')'.
    fields = raw[raw.rfind(b")") + 2 :].split()
    try:
        return ProcStat(fields[0].decode(), int(fields[2]), int(fields[19]))
    except (IndexError, ValueError, UnicodeDecodeError):
        return None


def thread_count(pid: int) -> int | None:
    """How many threads process ``pid`` has; None where ``/proc`` cannot tell."""
    try:
        return len(os.listdir(_root / str(pid) / "task"))
    except OSError:
        return None


def pids() -> list[str] | None:
    """The pids ``/proc`` lists; None where it cannot be listed."""
    try:
        return [name for name in os.listdir(_root) if name.isdigit()]
    except OSError:
        return None


def exists(pid: int) -> bool:
    """Whether signal 0 reaches process ``pid`` (one of another user counts)."""
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except OSError:
        pass  # EPERM: it exists, under another user
    return True


@cache
def host_id() -> str:
    """Identifies one kernel and PID namespace: pids are only comparable within one."""
    if not has_proc():
        # No boot id to tell hosts of the same name apart: the hardware address does.
        # Where none is found, uuid.getnode() is random per process, so every peer
        # then counts as on another host and is watched through its heartbeat: slower
        # to notice a death, never a live peer taken for dead.
        return f"{socket.gethostname()}/node-{uuid.getnode():012x}"
    try:
        boot = (_root / "sys" / "kernel" / "random" / "boot_id").read_text().strip()
    except OSError:
        boot = "no-boot-id"
    try:
        pidns = str(os.stat(_root / "self" / "ns" / "pid").st_ino)
    except OSError:
        pidns = "no-pidns"
    return f"{socket.gethostname()}/{boot}/{pidns}"


def filesystem_type(path: Path) -> str | None:
    """The type of the filesystem ``path`` is on ("tmpfs", "nfs4"), by the longest mount
    point of /proc/self/mounts above it; None where that cannot be read (not Linux)."""
    try:
        real = os.path.realpath(path)
        with open(_root / "self" / "mounts") as f:
            mounts = [line.split() for line in f]
    except OSError:
        return None
    best, fstype = "", None
    for fields in mounts:
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, fstype = point, fields[2]
    return fstype
