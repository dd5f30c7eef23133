"""An elastic job's membership as its members and joiners read it, and a late process
joining the running job: its join request, the running generation, admission.

A joiner writes ``rdzv/ejoin-<nonce>.json`` and waits for a roster of the current
generation (``rdzv/current[-<run id>].json``) that lists it; the running job's rank 0
admits it at a step boundary (:mod:`gradsync._job.reform`).
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gradsync._config import FileGradSyncConfig
from gradsync._errors import GradSyncError, MismatchError, PeerTimeoutError, RendezvousError
from gradsync._names import (
    EJOIN_PREFIX,
    NEXT,
    RDZV,
    ROSTER,
    current_name,
    ejoin_name,
    gen_name,
    heartbeat_name,
)
from gradsync._store.read import file_below, names_below

from . import notes
from .decisions import settings
from .generation import Generation
from .liveness import HeartbeatWatch, MemberInfo, judge

__all__ = [
    "Membership",
    "decision",
    "forget_job",
    "job_pointer",
    "join_requests",
    "join_running",
    "joins_waiting",
    "name_running",
    "running_job",
]

_log = logging.getLogger("gradsync")
_LOOK_EVERY_S = 0.01
_ENDED_EVERY_S = 0.2
_refused: set[str] = set()  # join requests this process warned it does not admit


@dataclass(frozen=True)
class Membership:
    """A generation of an elastic job, with who its members were started as."""

    gen: Generation
    launch: tuple[int, ...]  # each member's rank as started (cfg.rank), in rank order
    epoch: int = 0
    next_step: int | None = None  # the step of the members' next call (for joiners)
    lost: tuple[str, ...] = ()  # who left at this change, and why
    joined: tuple[int, ...] = ()  # launch ranks admitted at this change


def decision(data: dict[str, Any], sync_dir: Path, me: MemberInfo) -> Membership | None:
    """The membership ``data`` (a decision, or a new generation's roster) gives ``me``;
    None if it does not list ``me``. Raises ValueError for a garbled one."""
    members = [MemberInfo.from_json(m) for m in data["members"]]
    launch = tuple(int(r) for r in data["launch"])
    for rank, member in enumerate(members):
        if member.nonce == me.nonce:
            gen_id = str(data["gen"])
            gen = Generation(sync_dir / gen_name(gen_id), gen_id, tuple(members), rank)
            step = data.get("next_step")
            return Membership(
                gen,
                launch,
                int(data["epoch"]),
                step if isinstance(step, int) else None,
                tuple(str(x) for x in data.get("lost", ())),
                tuple(int(r) for r in data.get("joined", ())),
            )
    return None


def job_pointer(cfg: FileGradSyncConfig) -> Path:
    """The note that names this run's running generation (``rdzv/current[-<run id>].json``)."""
    return cfg.sync_dir / RDZV / current_name(cfg.run_id)


def name_running(cfg: FileGradSyncConfig, gen_id: str, epoch: int) -> None:
    """Name generation ``gen_id`` (of membership ``epoch``) this run's running job,
    unless the note names a later one already; then, where that generation was left
    meanwhile (its ``next.json`` is there), the one it went on to, and so on.

    Reading the note and writing it are two steps: a member that stalls between them
    (or a decider stalled after deciding) writes late. Looking for ``next.json`` after
    writing undoes that: a later change writes its decision before naming it, so either
    this look finds it, or that change names its generation after this write did.

    Raises:
        SyncDirError: the note could not be written.
    """
    pointer = job_pointer(cfg)
    while True:
        if _named_epoch(cfg, notes.load(pointer)) < epoch:
            notes.write_json(pointer, {"gen": gen_id, "epoch": epoch}, "naming the running job in")
        later = notes.load(cfg.sync_dir / gen_name(gen_id) / NEXT)
        gen, next_epoch = (later or {}).get("gen"), (later or {}).get("epoch")
        if not isinstance(gen, str) or not isinstance(next_epoch, int) or next_epoch <= epoch:
            return
        gen_id, epoch = gen, next_epoch


def _named_epoch(cfg: FileGradSyncConfig, named: dict[str, Any] | None) -> int:
    """The membership epoch of the generation the note ``named`` names; -1 for none."""
    if named is None or not isinstance(named.get("gen"), str):
        return -1
    epoch = named.get("epoch")
    if not isinstance(epoch, int):
        # Written as the job formed (epoch 0), or by a gradsync that wrote no epoch there.
        roster = notes.load(cfg.sync_dir / gen_name(named["gen"]) / ROSTER) or {}
        epoch = roster.get("epoch", 0)
    return epoch if isinstance(epoch, int) else 0


def join_requests(cfg: FileGradSyncConfig) -> list[dict[str, Any]]:
    """The join requests of this run from live processes that share its settings."""
    rdzv = cfg.sync_dir / RDZV
    found = []
    for name in sorted(names_below(rdzv)):
        if not name.startswith(EJOIN_PREFIX):
            continue
        data = notes.load(rdzv / name)
        member = notes.member_of(data)
        if data is None or member is None or data.get("run_id") != cfg.run_id:
            continue
        if judge(member).alive is False:
            # Its process on this host ended while it waited (SIGKILLed, say): nobody
            # else would remove its request.
            with contextlib.suppress(OSError):
                notes.unlink(rdzv / name)
            continue
        if not isinstance(data.get("launch"), int):
            continue
        if data.get("settings") != settings(cfg):
            if name in _refused:
                continue  # said once: rank 0 looks every 0.1 s
            _refused.add(name)
            _log.warning(
                "rank %d: not admitting %s (%s): its settings %s differ from %s",
                cfg.rank,
                name,
                member.describe(),
                data.get("settings"),
                settings(cfg),
            )
            continue
        found.append(data)
    return sorted(found, key=lambda d: (d["launch"], d["member"]["nonce"]))


def joins_waiting(cfg: FileGradSyncConfig) -> bool:
    """Whether a process waits to join this run (checked by its rank 0 between calls)."""
    return bool(join_requests(cfg))


def running_job(cfg: FileGradSyncConfig, watch: HeartbeatWatch | None = None) -> Path | None:
    """The generation of this run that still has a live member, if the run is going.
    A member on another host counts as live unless ``watch`` has seen its heartbeat
    still for its timeout."""
    pointer = notes.load(job_pointer(cfg))
    if pointer is None or not isinstance(pointer.get("gen"), str):
        return None
    gen_path = cfg.sync_dir / gen_name(pointer["gen"])
    roster = notes.load(gen_path / ROSTER)
    if roster is None or not isinstance(roster.get("members"), list):
        return None
    for raw in roster["members"]:
        try:
            member = MemberInfo.from_json(raw)
        except ValueError:
            continue
        beat = gen_path / heartbeat_name(member.nonce)
        if (
            not notes.has_left(gen_path, member.rank)
            and judge(member, watch, beat).alive is not False
        ):
            return gen_path
    return None


def forget_job(cfg: FileGradSyncConfig, gen: Generation) -> None:
    """Remove the note naming ``gen`` as the running job once ``gen`` is gone (its last
    member left). Never raises: it only tidies."""
    pointer = job_pointer(cfg)
    named = notes.load(pointer)
    if named is None or named.get("gen") != gen.gen_id or names_below(gen.path):
        return
    with contextlib.suppress(OSError):
        notes.unlink(pointer)


def join_running(
    cfg: FileGradSyncConfig, running: Path, closing: threading.Event | None
) -> Membership | None:
    """Ask to join this run's running job (its generation ``running``) and wait
    (``max_wait_s``) to be admitted at one of its step boundaries; None once no member
    of it is alive (all killed: its note stays), for the caller to form a job as if
    none had been running.

    Raises:
        MismatchError: the running job's settings are not this process's.
        PeerTimeoutError: not admitted within ``max_wait_s``.
        RendezvousError: the running job ended (its last member closed) first.
        GradSyncError: ``closing`` was set.
    """
    me = MemberInfo.for_self(cfg.rank, secrets.token_hex(8))
    _check_settings(cfg, me, running)
    request = cfg.sync_dir / RDZV / ejoin_name(me.nonce)
    data = {
        "member": me.to_json(),
        "run_id": cfg.run_id,
        "settings": settings(cfg),
        "launch": cfg.rank,
    }
    notes.write_json(request, data, "asking to join in")
    start = looked_s = time.monotonic()
    gone_looks = dead_looks = 0  # the note missing, or naming no live member, on looks in a row
    # Members on other hosts, all killed without a launcher to leave for them: only
    # their heartbeats tell (else every process of a next run waits max_wait_s, fails).
    watch = HeartbeatWatch(cfg.heartbeat_timeout_s)
    try:
        while time.monotonic() - start < cfg.max_wait_s:
            if closing is not None and closing.is_set():
                raise GradSyncError(
                    f"rank {cfg.rank}'s session was closed while it waited to join",
                    ranks=[cfg.rank],
                )
            found = _admitted(cfg, me)
            if found is not None:
                return found
            if time.monotonic() - looked_s >= _ENDED_EVERY_S:
                looked_s = time.monotonic()
                named = _job_named(cfg)
                gone_looks = 0 if named else gone_looks + 1
                dead_looks = dead_looks + 1 if named and running_job(cfg, watch) is None else 0
                if gone_looks == 2:  # twice: one failed look is no proof
                    raise _ended(cfg, me)
                if dead_looks == 2:  # twice: a clean end removes the note between looks
                    return None
            time.sleep(_LOOK_EVERY_S)
    finally:
        with contextlib.suppress(OSError):
            notes.unlink(request)
    raise PeerTimeoutError(
        f"rank {cfg.rank} ({me.describe()}) was not admitted into the running job in "
        f"{cfg.sync_dir} within {cfg.max_wait_s} s",
        ranks=[cfg.rank],
        path=cfg.sync_dir,
    )


def _check_settings(cfg: FileGradSyncConfig, me: MemberInfo, gen_path: Path) -> None:
    """Raise MismatchError where the running job's roster (at ``gen_path``) shows
    settings other than this process's: its rank 0 would never admit it."""
    roster = notes.load(gen_path / ROSTER)
    theirs = roster.get("settings") if roster is not None else None
    if not isinstance(theirs, dict):
        return  # written by a gradsync that kept none there: rank 0 judges
    mine = settings(cfg)
    differ = sorted(k for k in {*mine, *theirs} if mine.get(k) != theirs.get(k))
    if differ:
        shown = ", ".join(f"{k} {theirs.get(k)!r} (this process: {mine.get(k)!r})" for k in differ)
        raise MismatchError(
            f"rank {cfg.rank} ({me.describe()}) cannot join the running job in {gen_path}: "
            f"it has {shown}; every rank must use the same settings",
            ranks=[cfg.rank],
            path=gen_path,
        )


def _job_named(cfg: FileGradSyncConfig) -> bool:
    """Whether a running job is named: only its last member, on closing, removes the
    note (:func:`forget_job`)."""
    return file_below(job_pointer(cfg))


def _ended(cfg: FileGradSyncConfig, me: MemberInfo) -> RendezvousError:
    return RendezvousError(
        f"rank {cfg.rank} ({me.describe()}) asked to join the running job in "
        f"{cfg.sync_dir}, which ended (its last member closed) before admitting it",
        ranks=[cfg.rank],
        path=cfg.sync_dir,
    )


def _admitted(cfg: FileGradSyncConfig, me: MemberInfo) -> Membership | None:
    pointer = notes.load(job_pointer(cfg))
    if pointer is None or not isinstance(pointer.get("gen"), str):
        return None
    roster = notes.load(cfg.sync_dir / gen_name(pointer["gen"]) / ROSTER)
    if roster is None:
        return None
    try:
        return decision(roster, cfg.sync_dir, me)
    except (KeyError, TypeError, ValueError):
        return None
