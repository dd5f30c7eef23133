"""A sync dir's state: every job in it, its remote ranks' heartbeats sampled, ranks
waiting for a rank 0 that has not started their rendezvous, and processes waiting to
join a running elastic job."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from gradsync._job.liveness import MemberInfo, judge, read_counter
from gradsync._job.notes import load, member_of
from gradsync._names import EJOIN_PREFIX, RDZV, gen_id_of, join_nonce, offer_name
from gradsync._store.dirs import is_own_dir

from .generation import Listdir, disk_bytes, last_call, list_dir, names, read_generation, step_names

__all__ = ["MAX_SAMPLE_S", "SAMPLE_S", "describe"]

# Long enough to see a heartbeat move at the default 1 s interval; a job that beats
# less often is watched for 1.5 intervals, but never longer than MAX_SAMPLE_S.
SAMPLE_S = 1.3
MAX_SAMPLE_S = 5.0


def describe(
    sync_dir: Path,
    *,
    sample_s: float = SAMPLE_S,
    max_sample_s: float = MAX_SAMPLE_S,
    listdir: Listdir = list_dir,
) -> dict[str, Any]:
    """A JSON-able description of every job in ``sync_dir``.

    Members on other hosts are sampled twice, ``sample_s`` seconds apart (longer for a
    job that beats less often, up to ``max_sample_s``), to tell whether their heartbeat
    still moves. ``listdir`` lists a directory (a seam for tests).

    Raises:
        OSError: ``sync_dir`` cannot be listed.
    """
    gens = sorted(sync_dir / n for n in listdir(str(sync_dir)) if gen_id_of(n) is not None)
    jobs = []
    for gen in gens:
        try:
            # Only what gradsync made (a user's gen-samples/ is no job), never through a
            # link: it would describe (and walk) whatever someone pointed it at.
            if is_own_dir(sync_dir, gen.name, strict=True):
                jobs.append(read_generation(listdir, gen))
        except OSError as exc:  # one unreadable job does not hide the others
            jobs.append(_unreadable(gen, exc))
    _sample_heartbeats(jobs, sample_s, max_sample_s, listdir)
    for job in jobs:
        _settle(job)
    report = {"sync_dir": str(sync_dir), "disk_bytes": disk_bytes(sync_dir), "jobs": jobs}
    try:
        joining = _joins_without_rank_0(sync_dir, jobs, listdir)
        report["joining"] = joining + _elastic_joins(sync_dir, listdir)
    except OSError as exc:
        report["joining"] = []
        report["error"] = f"cannot read {exc.filename or sync_dir / RDZV}: {exc.strerror or exc}"
    return report


def _sample_heartbeats(
    jobs: list[dict[str, Any]], sample_s: float, max_sample_s: float, listdir: Listdir
) -> None:
    """Read the heartbeat of each rank on another host again, after a while: whether it
    moved (``beating``; None where it was not watched long enough to tell)."""
    remote = [(job, r) for job in jobs for r in job["ranks"] if "hb_path" in r]
    if not remote:
        return

    # A rank beats every heartbeat_interval_s: sampled for less, a live one may not
    # have beaten.
    def needed(job: dict[str, Any]) -> float:
        return 1.5 * float(job.get("heartbeat_interval_s", 0.0))

    watched = {job["path"]: job for job, _ in remote}  # each job once
    waited = max(sample_s, min(max(map(needed, watched.values())), max_sample_s))
    time.sleep(waited)
    calls = {path: step_names(listdir, Path(path)) for path in watched}
    for job, r in remote:
        later = read_counter(Path(r.pop("hb_path")))
        # A rank that published a later call meanwhile is alive, whatever its beat.
        latest = last_call(calls[job["path"]], r["rank"])
        published = (-1 if latest is None else latest) > r.get("last_call", -1)
        beating = published or (later is not None and later != r["heartbeat"])
        r["beating"] = True if beating else False if waited >= needed(job) else None
        r["sampled_s"] = round(waited, 3)


def _unreadable(gen: Path, exc: OSError) -> dict[str, Any]:
    where = exc.filename or gen
    return {
        "path": str(gen),
        "id": gen_id_of(gen.name),
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


def _joins_without_rank_0(
    sync_dir: Path, jobs: list[dict[str, Any]], listdir: Listdir
) -> list[dict[str, Any]]:
    """Ranks > 0 waiting for a rank 0 that has not started the rendezvous of their run
    (its node not started yet, say): their join files, unanswered, with a run id no
    rendezvous in progress has. One entry per run id."""
    admitting = {job.get("run_id") for job in jobs if job["state"] == "rendezvous"}
    rdzv = sync_dir / RDZV
    found = set(names(listdir, sync_dir, RDZV))
    runs: dict[str | None, dict[str, Any]] = {}
    for name in sorted(found):
        nonce = join_nonce(name)
        if nonce is None or offer_name(nonce) in found:
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
        run["ranks"].append(_entry(member))
    return _waiting(runs, "rank 0")


def _elastic_joins(sync_dir: Path, listdir: Listdir) -> list[dict[str, Any]]:
    """Processes waiting to be admitted into a running elastic job of their run (their
    ``ejoin-`` files), one entry per run id."""
    runs: dict[str | None, dict[str, Any]] = {}
    for name in sorted(names(listdir, sync_dir, RDZV)):
        if not name.startswith(EJOIN_PREFIX):
            continue
        data = load(sync_dir / RDZV / name)
        member = member_of(data)
        if data is None or member is None:
            continue
        run_id = data.get("run_id")
        if not (run_id is None or isinstance(run_id, str)):
            continue
        runs.setdefault(run_id, {"run_id": run_id, "elastic": True, "ranks": []})
        runs[run_id]["ranks"].append(_entry(member))
    return _waiting(runs, "admission")


def _entry(member: MemberInfo) -> dict[str, Any]:
    """A waiting process as status shows it: whether it lives, where that can be told."""
    entry: dict[str, Any] = {
        "rank": member.rank,
        "host": member.hostname,
        "pid": member.pid,
        "same_host": member.same_host,
    }
    if member.same_host:
        entry["alive"] = judge(member).alive is True
    return entry


def _waiting(runs: dict[str | None, dict[str, Any]], what: str) -> list[dict[str, Any]]:
    """``runs``, each saying which of its ranks still wait (for rank 0, to be admitted)."""
    for run in runs.values():
        waiting = [r["rank"] for r in run["ranks"] if not r["same_host"] or r["alive"]]
        if waiting:
            run["waiting"] = {"for": [0], "by": sorted(waiting), "what": what}
    return list(runs.values())
