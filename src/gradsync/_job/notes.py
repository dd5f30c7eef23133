"""The small JSON files of a job in the sync dir: where they are, how they are read
and written, and what an unreadable one counts as. Their names: :mod:`gradsync._names`.

The rendezvous reads and writes them through this module's functions, looked up on
the module at each call: a test wraps one (``monkeypatch.setattr(notes, "write_json",
...)``) to put a race between two of its steps."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from gradsync._errors import SyncDirError
from gradsync._names import ENDED, RDZV, gen_id_of, leader_name, left_name, lock_name
from gradsync._store.api import store
from gradsync._store.dirs import job_dir
from gradsync._store.files import translate_oserror, write_atomic
from gradsync._store.files import write_note as _write_note
from gradsync._store.read import file_below, names_below, read_below

from .liveness import MemberInfo

__all__ = [
    "dump",
    "ended_notes",
    "has_left",
    "how_it_ended",
    "leader_file",
    "leader_gone",
    "load",
    "lock_file",
    "member_of",
    "noted_at",
    "parse",
    "read_raw",
    "unlink",
    "write_json",
    "write_note",
]


def leader_file(sync_dir: Path, gen_id: str) -> Path:
    """Rank 0's registration for generation ``gen_id``: it stays until the job is removed."""
    return sync_dir / RDZV / leader_name(gen_id)


def leader_gone(gen_path: Path) -> bool:
    """Whether the leader file of the generation at ``gen_path`` is gone: whoever removes
    a generation unlinks it first. False where that cannot be told (``Path.exists``
    raises for a stale handle or a denied lookup). No link is followed: one there is not
    gone."""
    leader = leader_file(gen_path.parent, gen_id_of(gen_path.name) or "")
    try:
        with job_dir(leader) as fd:
            store().stat(fd, leader.name)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return False


def lock_file(sync_dir: Path, run_id: str | None) -> Path:
    """The file whose flock the one rank 0 of run ``run_id`` holds for its job's life.
    Only its holder removes it, as it lets go: a process that opened it before would
    otherwise lock a gone file while a later one locked a new one, both "the" lock."""
    return sync_dir / RDZV / lock_name(run_id)


def has_left(gen_path: Path, rank: int) -> bool:
    """Whether rank ``rank`` left the generation at ``gen_path`` (its ``left`` note is there)."""
    return file_below(gen_path / left_name(rank))


def how_it_ended(gen_path: Path, rank: int) -> str | None:
    """How rank ``rank`` left the generation at ``gen_path``, as its ``left`` note says
    (its launcher's words, or what closed its session); None where it closed its
    session with nothing to say, or left no readable note."""
    note = load(gen_path / left_name(rank))
    ended = None if note is None else note.get("ended")
    return ended if isinstance(ended, str) and ended else None


def noted_at(note: dict[str, Any]) -> float | None:
    """A note's ``at`` (its writer's wall clock, in seconds), if it holds a finite number."""
    at = note.get("at")
    if not isinstance(at, (int, float)) or isinstance(at, bool):
        return None
    try:
        seconds = float(at)
    except OverflowError:  # JSON integers have no bound
        return None
    return seconds if math.isfinite(seconds) else None


def dump(data: dict[str, Any]) -> bytes:
    return json.dumps(data, separators=(",", ":")).encode()


def load(path: Path, *, dir_fd: int | None = None) -> dict[str, Any] | None:
    """A JSON object from the job's file ``path``; None if missing or not one (torn writes
    never happen), or if a link is in its place or its directory's: never followed.
    ``dir_fd``: its directory, held open (else opened below the sync dir)."""
    try:
        raw = read_below(path, dir_fd=dir_fd)
    except OSError:
        return None
    return None if raw is None else parse(raw)


def read_raw(path: Path) -> bytes | None:
    """The bytes of the job's file ``path`` (a note may be empty: rank 0's disk was
    full); None if it cannot be read."""
    try:
        return read_below(path)
    except OSError:
        return None


def ended_notes(sync_dir: Path, run_id: str | None) -> list[tuple[Path, dict[str, Any]]]:
    """Run ``run_id``'s ``rdzv/ended-*`` notes (``reaping._note_unjoined``), oldest first."""
    rdzv = sync_dir / RDZV
    try:
        names = sorted(n for n in names_below(rdzv) if n.startswith(ENDED))
    except OSError:
        return []
    notes = []
    for name in names:
        data = load(rdzv / name)
        if data is not None and data.get("run_id") == run_id:
            notes.append((rdzv / name, data))
    return sorted(notes, key=lambda n: noted_at(n[1]) or 0.0)


def parse(raw: bytes) -> dict[str, Any] | None:
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def member_of(data: dict[str, Any] | None) -> MemberInfo | None:
    """The member a join, member or leader file describes; None if it describes none."""
    if data is None or not isinstance(data.get("member"), dict):
        return None
    try:
        return MemberInfo.from_json(data["member"])
    except ValueError:
        return None


def write_json(path: Path, data: dict[str, Any], what: str) -> None:
    """Write ``data`` to ``path`` atomically.

    Raises:
        SyncDirError: naming ``what`` was being done and the path.
    """
    try:
        with job_dir(path) as fd:
            write_atomic(path, [dump(data)], dir_fd=fd)
    except SyncDirError:
        raise  # a link in place of its directory, named
    except OSError as exc:
        raise translate_oserror(exc, what, path) from exc


def write_note(path: Path, data: bytes, *, dir_fd: int | None = None) -> None:
    """:func:`gradsync._store.files.write_note` of a job's file, through ``dir_fd`` (its
    directory) or else its directory opened without following links. Raises OSError."""
    if dir_fd is not None:
        _write_note(path, data, dir_fd=dir_fd)
        return
    with job_dir(path) as fd:
        _write_note(path, data, dir_fd=fd)


def unlink(path: Path) -> None:
    """Unlink the job's file ``path``, its directory reached without following links.

    Raises:
        OSError: as the system reported it (FileNotFoundError...).
    """
    with job_dir(path) as fd:
        store().remove(fd, path.name)
