"""One job's state, read from its generation directory: its members, how each rank is,
the call it is in, and who waits for whom."""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gradsync._errors import CorruptFileError, note_reason, parse_note
from gradsync._job.liveness import MemberInfo, judge, read_counter
from gradsync._job.notes import how_it_ended, leader_file, load, member_of
from gradsync._names import (
    ABORT,
    ROSTER,
    abort_marker,
    call_data_name,
    data_name,
    gen_id_of,
    heartbeat_name,
    input_marker,
    left_name,
    member_rank,
    output_marker,
    shard_data_glob,
    step_dir_name,
)
from gradsync._step.header import HEADER_READ_BYTES, decode_header, header_length
from gradsync._step.transport import shared_target
from gradsync._store.api import store
from gradsync._store.dirs import dir_below
from gradsync._store.files import open_regular
from gradsync._store.read import file_below, read_below

__all__ = [
    "Listdir",
    "disk_bytes",
    "last_call",
    "list_dir",
    "names",
    "read_generation",
    "step_names",
]

# Lists a directory given by a descriptor or a path (os.listdir; tests pass one that fails).
Listdir = Callable[[int | str], list[str]]


def list_dir(path: int | str) -> list[str]:
    """:func:`os.listdir`, as a :data:`Listdir`."""
    return os.listdir(path)


def names(listdir: Listdir, top: Path, *below: str) -> list[str]:
    """The entries of ``top/below...``, each opened without following a link; none
    if it is gone: a running job removes its old step directories, and a finished one
    its whole directory, while this looks."""
    try:
        with dir_below(top, *below) as fd:
            return listdir(fd)
    except (FileNotFoundError, NotADirectoryError):
        return []
    # Other errors (EACCES, a link: ELOOP) are the caller's: that job is reported unreadable.


def disk_bytes(path: Path, *below: str) -> int:
    """The bytes of the files in ``path/below...``, walked by descriptors: no link followed."""
    total = 0
    with contextlib.suppress(OSError), dir_below(path, *below) as top:
        for _root, _dirs, files, fd in os.fwalk(dir_fd=top):
            for name in files:
                with contextlib.suppress(OSError):
                    total += store().stat(fd, name).st_size
    return total


def _step_seq(name: str) -> int | None:
    """The call of step directory ``name``; None if it is not one's."""
    seq = name.rpartition("-")[2]
    if not (seq.isascii() and seq.isdigit()):
        return None
    return int(seq) if step_dir_name(int(seq)) == name else None


def step_names(listdir: Listdir, gen: Path) -> dict[int, set[str]]:
    """The names in each step directory of ``gen`` still on disk, by call."""
    seqs = sorted(s for s in map(_step_seq, names(listdir, gen.parent, gen.name)) if s is not None)
    return {seq: set(names(listdir, gen.parent, gen.name, step_dir_name(seq))) for seq in seqs}


def last_call(by_call: dict[int, set[str]], rank: int) -> int | None:
    """``rank``'s last call with its input marker in ``by_call`` (:func:`step_names`)."""
    return max((seq for seq, found in by_call.items() if input_marker(rank) in found), default=None)


def _user_step(gen: Path, rank: int, call: int) -> int | None:
    """The step ``rank`` passed on call ``call``, from its data file's header, if kept.

    Large gradients reuse one file every call, small ones alternate two slots, and
    across hosts each call has its own (or one for each peer, the part it reduces):
    the file whose header is of ``call`` holds it.
    """
    names = [data_name(rank, "in", slot) for slot in (None, 0, 1)]
    parts = sorted(p.name for p in gen.glob(shard_data_glob(rank, call)))
    for name in [call_data_name(rank, "in", call), *parts[:1], *names]:
        path = gen / name
        try:
            # Never a plain open: a FIFO in the file's place would block it forever.
            with os.fdopen(_open_data(gen, path), "rb") as f:
                head = f.read(HEADER_READ_BYTES)
                if header_length(head) > len(head):
                    head += f.read(header_length(head) - len(head))
                header = decode_header(head, str(path))
        except (OSError, CorruptFileError):
            continue
        if header.seq == call:
            return header.step
    return None


def _open_data(gen: Path, path: Path) -> int:
    """A descriptor of a rank's data file ``path``, through the generation's: no link
    followed but ``d-<rank>.in``'s to its shared arrays beside it."""
    with dir_below(gen.parent, gen.name) as fd:
        try:
            return open_regular(path, dir_fd=fd, follow=False)[0]
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            return open_regular(shared_target(path, fd), dir_fd=fd, follow=False)[0]


def _setting(listdir: Listdir, gen: Path, key: str) -> object:
    """One of the job's settings, from those its ranks > 0 confirmed with (rank 0
    admitted them only if they matched its own); None if no member file says."""
    for name in sorted(names(listdir, gen.parent, gen.name)):
        if member_rank(name) is not None:
            data = load(gen / name)
            settings = data.get("settings") if data is not None else None
            if isinstance(settings, dict) and settings.get(key) is not None:
                return settings[key]
    return None


def read_generation(listdir: Listdir, gen: Path) -> dict[str, Any]:
    """A JSON-able description of the job in generation directory ``gen``.

    Raises:
        OSError: the job cannot be read (its roster is damaged, say).
    """
    info: dict[str, Any] = {"path": str(gen), "id": gen_id_of(gen.name)}
    members = _members(listdir, gen, info)
    abort = _abort(gen)
    if abort is not None:
        info["state"] = "failed"
        info["error"] = abort
        info.pop("waiting", None)  # the rendezvous is over: nobody waits to join
    by_call = step_names(listdir, gen)
    info["ranks"] = [_rank(gen, m, by_call) for m in members]
    interval = _setting(listdir, gen, "heartbeat_interval_s")
    if isinstance(interval, (int, float)) and not isinstance(interval, bool):
        info["heartbeat_interval_s"] = float(interval)
    if by_call and members:
        info["latest_call"] = max(by_call)
        waiting = _waiting_in_call(listdir, gen, members, by_call)
        if waiting is not None:
            info["waiting"] = waiting
    info["disk_bytes"] = disk_bytes(gen.parent, gen.name)
    return info


def _members(listdir: Listdir, gen: Path, info: dict[str, Any]) -> list[MemberInfo]:
    """The job's members, from its roster once running; else those that joined so far
    (with ``info``'s state, run id, and the ranks the rendezvous waits for)."""
    roster = load(gen / ROSTER)
    if roster is not None and isinstance(roster.get("members"), list):
        info["state"] = "running"
        info["run_id"] = roster.get("run_id")
        members = []
        for raw in roster["members"]:
            with contextlib.suppress(KeyError, TypeError, ValueError):
                members.append(MemberInfo.from_json(raw))
        return members
    if ROSTER in names(listdir, gen.parent, gen.name):
        # Written whole by one rename, so never seen half-written: damaged, not a
        # rendezvous still in progress (which has no roster yet).
        raise OSError(errno.EINVAL, "not a roster gradsync wrote", str(gen / ROSTER))
    info["state"] = "rendezvous"
    members = []
    for name in sorted(names(listdir, gen.parent, gen.name)):
        if member_rank(name) is not None:
            member = member_of(load(gen / name))
            if member is not None:
                members.append(member)
    leader_data = load(leader_file(gen.parent, info["id"]))
    if leader_data is not None:
        info["run_id"] = leader_data.get("run_id")
    leader = member_of(leader_data)
    if leader is not None:
        members.insert(0, leader)
    world = leader_data.get("world_size") if leader_data is not None else None
    if isinstance(world, int) and leader is not None:
        joined = sorted({m.rank for m in members})
        missing = [r for r in range(world) if r not in joined]
        if missing:
            info["waiting"] = {"for": missing, "by": joined, "what": "join"}
    return members


def _abort(gen: Path) -> str | None:
    """Why the job failed, if its abort note is there (empty where the disk was full)."""
    try:
        abort = read_below(gen / ABORT)
    except OSError:
        return None
    return None if abort is None else note_reason(parse_note(abort))


def _rank(gen: Path, m: MemberInfo, by_call: dict[int, set[str]]) -> dict[str, Any]:
    """How member ``m`` is: alive or beating, left, its last call and step, failed."""
    entry: dict[str, Any] = {
        "rank": m.rank,
        "host": m.hostname,
        "pid": m.pid,
        "same_host": m.same_host,
        "left": file_below(gen / left_name(m.rank)),
    }
    ended = how_it_ended(gen, m.rank) if entry["left"] else None
    if ended is not None:
        entry["ended"] = ended  # its launcher's words, or what closed its session
    if m.same_host:
        entry["alive"] = judge(m).alive is True
    elif not entry["left"]:  # a rank that left beats no more: nothing to watch
        entry["heartbeat"] = read_counter(gen / heartbeat_name(m.nonce))
        entry["hb_path"] = str(gen / heartbeat_name(m.nonce))
    last = last_call(by_call, m.rank)
    if last is not None:
        entry["last_call"] = last
        # The marker is empty; the header lives in the rank's reused data file.
        entry["last_step"] = _user_step(gen, m.rank, last)
    entry["failed"] = any(abort_marker(m.rank) in found for found in by_call.values())
    return entry


def _waiting_in_call(
    listdir: Listdir, gen: Path, members: list[MemberInfo], by_call: dict[int, set[str]]
) -> dict[str, Any] | None:
    """Who waits for whom in the latest call: for inputs, or for shards of the mean."""
    seq = max(by_call)
    present = by_call[seq]
    have_in = sorted(m.rank for m in members if input_marker(m.rank) in present)
    missing_in = sorted(m.rank for m in members if m.rank not in have_in)
    if missing_in and have_in:
        return {"for": missing_in, "by": have_in, "what": "gradients", "call": seq}
    if missing_in:
        return None
    # With strategy "root" only rank 0 publishes a shard (the whole mean), on every
    # call; otherwise every rank does, except in calls small enough for each rank to
    # reduce all (no shard at all: nobody waits once inputs are in).
    root = _setting(listdir, gen, "strategy") == "root"
    publishers = [0] if root else [m.rank for m in members]
    have_out = [r for r in publishers if output_marker(r) in present]
    missing_out = sorted(r for r in publishers if r not in have_out)
    if not (missing_out and (have_out or root)):
        return None
    return {
        "for": missing_out,
        "by": sorted(m.rank for m in members if m.rank not in missing_out),
        "what": "shards of the mean",
        "call": seq,
    }
