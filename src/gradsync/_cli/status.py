"""``gradsync status DIR``: who is in a sync directory, and which rank is everyone waiting for."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from gradsync._errors import CorruptFileError, note_reason, parse_note
from gradsync._job.liveness import HeartbeatWatch, MemberInfo, read_counter
from gradsync._job.notes import how_it_ended, leader_file, load, member_of
from gradsync._names import (
    ABORT,
    GEN_PREFIX,
    RDZV,
    ROSTER,
    join_nonce,
    left_name,
    member_rank,
    offer_name,
)
from gradsync._step.engine import data_name
from gradsync._step.header import HEADER_READ_BYTES, decode_header, header_length
from gradsync._step.transport import shared_target
from gradsync._store.dirs import dir_below, is_own_dir
from gradsync._store.files import open_regular
from gradsync._store.read import file_below, read_below

from .defaultdir import default_places, own_default_dirs

__all__ = ["describe", "status_main"]

# Long enough to see a heartbeat move at the default 1 s interval; a job that beats
# less often is watched for 1.5 intervals, but never longer than _MAX_SAMPLE_S.
_SAMPLE_S = 1.3
_MAX_SAMPLE_S = 5.0


def _disk_bytes(path: Path, *below: str) -> int:
    """The bytes of the files in ``path/below...``, walked by descriptors: no link followed."""
    total = 0
    with contextlib.suppress(OSError), dir_below(path, *below) as top:
        for _root, _dirs, files, fd in os.fwalk(dir_fd=top):
            for name in files:
                with contextlib.suppress(OSError):
                    total += os.stat(name, dir_fd=fd, follow_symlinks=False).st_size
    return total


def _names(sync_dir: Path, *below: str) -> list[str]:
    """The entries of ``sync_dir/below...``, each opened without following a link; none
    if it is gone: a running job removes its old step directories, and a finished one
    its whole directory, while this looks."""
    try:
        with dir_below(sync_dir, *below) as fd:
            return os.listdir(fd)
    except (FileNotFoundError, NotADirectoryError):
        return []
    # Other errors (EACCES, a link: ELOOP) are the caller's: that job is reported unreadable.


def _steps(gen: Path) -> list[int]:
    return sorted(
        int(n[2:]) for n in _names(gen.parent, gen.name) if n.startswith("s-") and n[2:].isdigit()
    )


def _user_step(gen: Path, rank: int, call: int) -> int | None:
    """The step ``rank`` passed on call ``call``, from its data file's header, if kept.

    Large gradients reuse one file every call, small ones alternate two slots: the
    file whose header is of ``call`` holds it.
    """
    for slot in (None, 0, 1):
        path = gen / data_name(rank, "in", slot)
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


def _setting(gen: Path, key: str) -> object:
    """One of the job's settings, from those its ranks > 0 confirmed with (rank 0
    admitted them only if they matched its own); None if no member file says."""
    for name in sorted(_names(gen.parent, gen.name)):
        if member_rank(name) is not None:
            data = load(gen / name)
            settings = data.get("settings") if data is not None else None
            if isinstance(settings, dict) and settings.get(key) is not None:
                return settings[key]
    return None


def _step_names(gen: Path) -> dict[int, set[str]]:
    """The names in each step directory of ``gen`` still on disk, by call."""
    return {seq: set(_names(gen.parent, gen.name, f"s-{seq}")) for seq in _steps(gen)}


def _last_calls(names: dict[int, set[str]]) -> dict[int, int]:
    """Each rank's last call with its input marker among ``names`` (:func:`_step_names`)."""
    last: dict[int, int] = {}
    for seq in sorted(names):
        for name in names[seq]:
            rank = name[3:]
            if name.startswith("in-") and rank.isascii() and rank.isdigit():
                last[int(rank)] = seq
    return last


def _generation(gen: Path, watch: HeartbeatWatch) -> dict[str, Any]:
    roster = load(gen / ROSTER)
    if roster is None or not isinstance(roster.get("members"), list):
        if ROSTER in _names(gen.parent, gen.name):
            # Written whole by one rename, so never seen half-written: damaged, not a
            # rendezvous still in progress (which has no roster yet).
            raise OSError(errno.EINVAL, "not a roster gradsync wrote", str(gen / ROSTER))
        roster = None
    info: dict[str, Any] = {"path": str(gen), "id": gen.name[len(GEN_PREFIX) :]}
    members: list[MemberInfo] = []
    if roster is not None:
        for raw in roster["members"]:
            try:
                members.append(MemberInfo.from_json(raw))
            except (KeyError, TypeError, ValueError):
                continue
        info["state"] = "running"
        info["run_id"] = roster.get("run_id")
    else:
        info["state"] = "rendezvous"
        for name in sorted(_names(gen.parent, gen.name)):
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
    try:
        abort = read_below(gen / ABORT)
    except OSError:
        abort = None
    if abort is not None:  # empty where the disk was full
        info["state"] = "failed"
        info["error"] = note_reason(parse_note(abort))
        info.pop("waiting", None)  # the rendezvous is over: nobody waits to join
    names = _step_names(gen)
    seqs = sorted(names)
    last_calls = _last_calls(names)
    ranks = []
    for m in members:
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
            death = m.local_death()
            entry["alive"] = death is None
        elif not entry["left"]:  # a rank that left beats no more: nothing to watch
            entry["heartbeat"] = read_counter(gen / f"hb-{m.nonce}")
            entry["hb_path"] = str(gen / f"hb-{m.nonce}")
        last = last_calls.get(m.rank)
        if last is not None:
            entry["last_call"] = last
            # The marker is empty; the header lives in the rank's reused data file.
            entry["last_step"] = _user_step(gen, m.rank, last)
        entry["failed"] = any(f"abort-{m.rank}" in names.get(seq, set()) for seq in seqs)
        ranks.append(entry)
    info["ranks"] = ranks
    interval = _setting(gen, "heartbeat_interval_s")
    if isinstance(interval, (int, float)) and not isinstance(interval, bool):
        info["heartbeat_interval_s"] = float(interval)
    if seqs and members:
        seq = seqs[-1]
        present = names.get(seq, set())
        have_in = sorted(m.rank for m in members if f"in-{m.rank}" in present)
        missing_in = sorted(m.rank for m in members if m.rank not in have_in)
        info["latest_call"] = seq
        if missing_in and have_in:
            info["waiting"] = {"for": missing_in, "by": have_in, "what": "gradients", "call": seq}
        elif not missing_in:
            # With strategy "root" only rank 0 publishes a shard (the whole mean), on
            # every call; otherwise every rank does, except in calls small enough for
            # each rank to reduce all (no shard at all: nobody waits once inputs are in).
            root = _setting(gen, "strategy") == "root"
            publishers = [0] if root else [m.rank for m in members]
            have_out = [r for r in publishers if f"out-{r}" in present]
            missing_out = sorted(r for r in publishers if r not in have_out)
            if missing_out and (have_out or root):
                info["waiting"] = {
                    "for": missing_out,
                    "by": sorted(m.rank for m in members if m.rank not in missing_out),
                    "what": "shards of the mean",
                    "call": seq,
                }
    info["disk_bytes"] = _disk_bytes(gen.parent, gen.name)
    return info


def _unreadable(gen: Path, exc: OSError) -> dict[str, Any]:
    where = exc.filename or gen
    return {
        "path": str(gen),
        "id": gen.name[len(GEN_PREFIX) :],
        "state": "unreadable",
        "error": f"cannot read {where}: {exc.strerror or exc}",
        "ranks": [],
        "disk_bytes": 0,
    }


def _gone(rank: dict[str, Any]) -> bool:
    """Whether a rank has left or its process is known to be gone. A rank on another
    host is not judged: its heartbeat may beat less often than status samples it."""
    if rank["left"]:
        return True
    return rank["same_host"] and not rank["alive"]


def _settle(job: dict[str, Any]) -> None:
    """A job whose every rank is gone is stopped, not running; the gone wait for nobody."""
    ranks = job["ranks"]
    if ranks and all(_gone(r) for r in ranks) and job["state"] in ("running", "rendezvous"):
        job["state"] = "stopped (every rank is gone: the next job in this directory removes it)"
    waiting = job.get("waiting")
    if waiting:
        gone = {r["rank"] for r in ranks if _gone(r)}
        waiting["by"] = [r for r in waiting["by"] if r not in gone]
        if not waiting["by"]:
            del job["waiting"]


def _joins_without_rank_0(sync_dir: Path, jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ranks > 0 waiting for a rank 0 that has not started the rendezvous of their run
    (its node not started yet, say): their join files, unanswered, with a run id no
    rendezvous in progress has. One entry per run id."""
    admitting = {job.get("run_id") for job in jobs if job["state"] == "rendezvous"}
    rdzv = sync_dir / RDZV
    names = set(_names(sync_dir, RDZV))
    runs: dict[str | None, dict[str, Any]] = {}
    for name in sorted(names):
        nonce = join_nonce(name)
        if nonce is None or offer_name(nonce) in names:
            continue  # not a join, or answered: that rank is joining a generation above
        data = load(rdzv / name)
        member = member_of(data)
        if data is None or member is None:
            continue
        run_id = data.get("run_id")
        if run_id in admitting or not (run_id is None or isinstance(run_id, str)):
            continue
        run = runs.setdefault(run_id, {"run_id": run_id, "ranks": []})
        if isinstance(data.get("world_size"), int):
            run["world_size"] = data["world_size"]
        entry: dict[str, Any] = {
            "rank": member.rank,
            "host": member.hostname,
            "pid": member.pid,
            "same_host": member.same_host,
        }
        if member.same_host:
            entry["alive"] = member.local_death() is None
        run["ranks"].append(entry)
    for run in runs.values():
        waiting = [r["rank"] for r in run["ranks"] if not r["same_host"] or r["alive"]]
        if waiting:
            run["waiting"] = {"for": [0], "by": sorted(waiting), "what": "rank 0"}
    return list(runs.values())


def describe(sync_dir: Path, *, sample_s: float = _SAMPLE_S) -> dict[str, Any]:
    """A JSON-able description of every job in ``sync_dir``.

    Members on other hosts are sampled twice, ``sample_s`` seconds apart, to tell
    whether their heartbeat still moves.
    """
    watch = HeartbeatWatch(timeout_s=3600.0)
    gens = sorted(sync_dir / n for n in os.listdir(sync_dir) if n.startswith(GEN_PREFIX))
    jobs = []
    for gen in gens:
        try:
            # Only what gradsync made (a user's gen-samples/ is no job), never through a
            # link: it would describe (and walk) whatever someone pointed it at.
            if is_own_dir(sync_dir, gen.name, strict=True):
                jobs.append(_generation(gen, watch))
        except OSError as exc:  # one unreadable job does not hide the others
            jobs.append(_unreadable(gen, exc))
    remote = [(job, r) for job in jobs for r in job["ranks"] if "hb_path" in r]
    if remote:
        # A rank beats every heartbeat_interval_s: sampled for less, a live one may
        # not have beaten (status called every rank of a 5 s interval NOT BEATING).
        def needed(job: dict[str, Any]) -> float:
            return 1.5 * float(job.get("heartbeat_interval_s", 0.0))

        watched = {job["path"]: job for job, _ in remote}  # each job once
        waited = max(sample_s, min(max(map(needed, watched.values())), _MAX_SAMPLE_S))
        time.sleep(waited)
        calls = {path: _last_calls(_step_names(Path(path))) for path in watched}
        for job, r in remote:
            later = read_counter(Path(r.pop("hb_path")))
            # A rank that published a later call meanwhile is alive, whatever its beat.
            published = calls[job["path"]].get(r["rank"], -1) > r.get("last_call", -1)
            beating = published or (later is not None and later != r["heartbeat"])
            r["beating"] = True if beating else False if waited >= needed(job) else None
            r["sampled_s"] = round(waited, 3)
    for job in jobs:
        _settle(job)
    report = {"sync_dir": str(sync_dir), "disk_bytes": _disk_bytes(sync_dir), "jobs": jobs}
    try:
        report["joining"] = _joins_without_rank_0(sync_dir, jobs)
    except OSError as exc:
        report["joining"] = []
        report["error"] = f"cannot read {exc.filename or sync_dir / RDZV}: {exc.strerror or exc}"
    return report


def _text(report: dict[str, Any]) -> str:
    lines = [f"{report['sync_dir']}: {len(report['jobs'])} job(s), {report['disk_bytes']} bytes"]
    for job in report["jobs"]:
        # Jobs sharing a directory are told apart by their run ids.
        run = f" (run id {job['run_id']!r})" if isinstance(job.get("run_id"), str) else ""
        lines.append(f"  generation {job['id']}{run}: {job['state']}, {job['disk_bytes']} bytes")
        if job.get("error"):
            lines.append(f"    error: {job['error']}")
        for r in job["ranks"]:
            if r["left"]:
                life = r.get("ended", "left")
            elif r["same_host"]:
                life = "alive" if r["alive"] else "DEAD"
            elif r.get("beating") is None:
                life = (
                    f"no beat seen in {r['sampled_s']:g} s (it beats every "
                    f"{job['heartbeat_interval_s']:g} s)"
                )
            else:
                life = "beating" if r.get("beating") else "NOT BEATING"
            last = (
                f"last published call {r['last_call']} (step {r['last_step']})"
                if "last_call" in r
                else "published nothing"
            )
            failed = ", FAILED a step" if r["failed"] else ""
            lines.append(
                f"    rank {r['rank']}: pid {r['pid']} on {r['host']}, {life}, {last}{failed}"
            )
        waiting = job.get("waiting")
        if waiting and waiting["what"] == "join":
            lines.append(
                f"    ranks {waiting['by']} are waiting for ranks {waiting['for']} to join"
            )
        elif waiting:
            lines.append(
                f"    ranks {waiting['by']} are waiting for ranks {waiting['for']} to publish "
                f"their {waiting['what']} (call {waiting['call']})"
            )
    for run in report.get("joining", []):
        name = f"run id {run['run_id']!r}" if run["run_id"] is not None else "no run id"
        lines.append(f"  {name}: no rendezvous yet")
        for r in run["ranks"]:
            life = ("alive" if r["alive"] else "DEAD") if r["same_host"] else "on another host"
            lines.append(f"    rank {r['rank']}: pid {r['pid']} on {r['host']}, {life}")
        if run.get("waiting"):
            lines.append(
                f"    ranks {run['waiting']['by']} are waiting for rank 0 to start the rendezvous"
            )
    if report.get("error"):
        lines.append(f"  error: {report['error']}")
    return "\n".join(lines)


def _read(sync_dir: Path) -> dict[str, Any] | None:
    """:func:`describe` ``sync_dir``, or say on stderr why it cannot be read."""
    try:
        if not sync_dir.is_dir():
            print(f"gradsync status: {sync_dir} is not a directory", file=sys.stderr)
            return None
        return describe(sync_dir)
    except OSError as exc:
        where = exc.filename or sync_dir
        print(f"gradsync status: cannot read {where}: {exc.strerror or exc}", file=sys.stderr)
        return None


def _failed(report: dict[str, Any]) -> bool:
    unreadable = any(job["state"] == "unreadable" for job in report["jobs"])
    return unreadable or bool(report.get("error"))


def _status_of_own(as_json: bool) -> int:
    """Print the state of this user's sync dirs that ``gradsync launch`` made."""
    reports = [_read(d) for d in own_default_dirs()]
    shown = [r for r in reports if r is not None]
    if as_json:
        print(json.dumps(shown, indent=2))
    elif shown:
        print("\n\n".join(_text(r) for r in shown))
    elif not reports:
        print(
            f"gradsync status: no sync dir of yours in {' or '.join(default_places())} (where "
            "`gradsync launch` without --sync-dir makes one); for a job given --sync-dir DIR, "
            "run: gradsync status DIR"
        )
    return 1 if any(r is None or _failed(r) for r in reports) else 0


def status_main(sync_dir: Path | None, *, as_json: bool) -> int:
    """Print the state of ``sync_dir`` (None: of this user's sync dirs that ``gradsync
    launch`` made); 0 if every job could be read, 1 if the directory does not exist or
    it, or a job in it, cannot be read."""
    if sync_dir is None:
        return _status_of_own(as_json)
    report = _read(sync_dir)
    if report is None:
        return 1
    print(json.dumps(report, indent=2) if as_json else _text(report))
    return 1 if _failed(report) else 0
