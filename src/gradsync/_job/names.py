"""The names of a job's files in the sync directory, and the small JSON files among them.

Read by the rendezvous, by whoever removes dead runs' files, and by ``gradsync
status``: one place says where each file lives and what an unreadable one counts as.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from gradsync._errors import SyncDirError
from gradsync._store.dirs import job_dir
from gradsync._store.files import translate_oserror, write_atomic
from gradsync._store.files import write_note as _write_note
from gradsync._store.read import read_below

from .liveness import MemberInfo

__all__ = [
    "ABORT",
    "ENDED",
    "GAVE_UP",
    "GEN_PREFIX",
    "LOCK_PREFIX",
    "RDZV",
    "RIVAL",
    "ROSTER",
    "dump",
    "how_it_ended",
    "join_name",
    "join_nonce",
    "leader_file",
    "leader_gone",
    "left_name",
    "load",
    "lock_file",
    "member_name",
    "member_of",
    "member_rank",
    "noted_at",
    "offer_name",
    "parse",
    "rival_name",
    "unlink",
    "write_json",
    "write_note",
]

RDZV = "rdzv"
GEN_PREFIX = "gen-"
ROSTER = "roster.json"
ABORT = "abort.json"
# gave-up-<rank>-<nonce>.json: a rank that was offered a place, then failed, says why.
GAVE_UP = "gave-up-"
# rdzv/ended-<rank>-<nonce>.json: the launcher of a rank whose process ended while it
# waited to join (join-<rank>-<nonce>.json) says how, for a rank 0 waiting for it.
ENDED = "ended-"
LOCK_PREFIX = "lock-0"
# gen-<id>/rival-0-<nonce>.json: a second rank 0 of the run came while the job formed.
RIVAL = "rival-0-"


def leader_file(sync_dir: Path, gen_id: str) -> Path:
    """Rank 0's registration for generation ``gen_id``: it stays until the job is removed."""
    return sync_dir / RDZV / f"leader-{gen_id}.json"


def leader_gone(gen_path: Path) -> bool:
    """Whether the leader file of the generation at ``gen_path`` is gone: whoever removes
    a generation unlinks it first. False where that cannot be told (``Path.exists``
    raises for a stale handle or a denied lookup). No link is followed: one there is not
    gone."""
    leader = leader_file(gen_path.parent, gen_path.name[len(GEN_PREFIX) :])
    try:
        with job_dir(leader) as fd:
            os.stat(leader.name, dir_fd=fd, follow_symlinks=False)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return False


def lock_file(sync_dir: Path, run_id: str | None) -> Path:
    """The file whose flock the one rank 0 of run ``run_id`` holds for its job's life.
    Only its holder removes it, as it lets go: a process that opened it before would
    otherwise lock a gone file while a later one locked a new one, both "the" lock."""
    name = LOCK_PREFIX if run_id is None else f"{LOCK_PREFIX}-{run_id}"
    return sync_dir / RDZV / f"{name}.lock"


def rival_name(nonce: str) -> str:
    """The name, in a forming generation's directory, of the note that a rank 0 with
    ``nonce`` came for the same run id while that job's rank 0 held the lock."""
    return f"{RIVAL}{nonce}.json"


def join_name(rank: int, nonce: str) -> str:
    """The name, in ``rdzv/``, of the join file rank ``rank`` registers with ``nonce``."""
    return f"join-{rank}-{nonce}.json"


def join_nonce(name: str) -> str | None:
    """The nonce of a join file's ``name``; None if ``name`` is not a join file's."""
    if not (name.startswith("join-") and name.endswith(".json")):
        return None
    return name[: -len(".json")].rsplit("-", 1)[-1]


def member_name(rank: int, nonce: str) -> str:
    """The name, in a generation's directory, of rank ``rank``'s confirmation of its place
    (its process's ``nonce``)."""
    return f"member-{rank}-{nonce}.json"


def member_rank(name: str) -> int | None:
    """The rank of a confirmation's ``name`` (:func:`member_name`); None if ``name`` is
    not one's."""
    if not (name.startswith("member-") and name.endswith(".json")):
        return None
    rank = name.split("-")[1]
    return int(rank) if rank.isascii() and rank.isdigit() else None


def left_name(rank: int) -> str:
    """The name, in a generation's directory, of the note that rank ``rank`` has left the
    job: written by the rank as its session closes (``{"calls": N}``, the calls it
    finished, with ``"ended": "closed its gradsync session (raising ValueError: ...)"``
    when an exception closed it), or by its launcher once its process ended without
    closing it (``{"ended": "was stopped by its launcher (killed by SIGTERM)"}``)."""
    return f"left-{rank}"


def how_it_ended(gen_path: Path, rank: int) -> str | None:
    """How rank ``rank`` left the generation at ``gen_path``, as its ``left`` note says
    (its launcher's words, or what closed its session); None where it closed its
    session with nothing to say, or left no readable note."""
    note = load(gen_path / left_name(rank))
    ended = None if note is None else note.get("ended")
    return ended if isinstance(ended, str) and ended else None


def offer_name(nonce: str) -> str:
    """The name, in ``rdzv/``, of rank 0's answer to the join with ``nonce``."""
    return f"offer-{nonce}.json"


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
        os.unlink(path.name, dir_fd=fd)
