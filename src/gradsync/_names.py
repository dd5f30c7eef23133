"""Every name gradsync gives a file or directory in the sync dir, and nothing else.

Standard library only (the launcher's watchdog reads it without numpy)::

    <sync dir>/
      rdzv/                          the rendezvous, shared by every run
        join-<rank>-<nonce>.json     a process asks for rank <rank>
        offer-<nonce>.json           rank 0's answer to that join
        leader-<gen>.json            rank 0's registration of generation <gen>
        lock-0[-<run id>].lock       rank 0's lock for its job's life
        ended-<rank>-<nonce>.json    the launcher: a waiting joiner's process ended
        ejoin-<nonce>.json           elastic: a process asks to join the running job
        current[-<run id>].json      elastic: the running job's generation
      gen-<gen>/                     one job
        .gradsync-own                gradsync made this directory (only such are removed)
        roster.json, abort.json      rank 0's roster; why the job failed to form
        member-<rank>-<nonce>.json   a rank confirms its place
        gave-up-<rank>-<nonce>.json  a rank offered a place failed, and why
        rival-0-<nonce>.json         a second rank 0 of the run came
        hb-<nonce>                   a member's heartbeat
        left-<rank>                  rank <rank> left (and how it ended)
        seen-<host key>.json         a rank 0's look at the heartbeats of a dead job
        d-<rank>[-<slot>].in|.out    a rank's input and its shard of the mean
        d-<rank>-c<seq>.in|.out      the same, new for call <seq> (shared filesystems)
        d-<rank>-b<n>.in             a rank's buffers_like file
        s-<seq>/                     call <seq>: in-<rank>, out-<rank>, abort-<rank>,
                                     joins (elastic: rank 0 admits joiners after it)
        stay-<rank>.json             elastic: rank <rank> goes on into a new membership
        next.claim, next.json        elastic: the one decision of the next membership
"""

from __future__ import annotations

import re

__all__ = [
    "ABORT",
    "EJOIN_PREFIX",
    "ENDED",
    "GAVE_UP",
    "GEN_PREFIX",
    "JOINS",
    "LOCK_PREFIX",
    "NEXT",
    "OWN_MARK",
    "RDZV",
    "RIVAL",
    "ROSTER",
    "abort_marker",
    "call_data_name",
    "claim_name",
    "current_name",
    "data_name",
    "ejoin_name",
    "ended_name",
    "gave_up_name",
    "gen_id_of",
    "gen_name",
    "heartbeat_name",
    "input_marker",
    "intent_name",
    "is_call_data_name",
    "is_leader_name",
    "is_offer_name",
    "join_name",
    "join_nonce",
    "join_prefix",
    "leader_name",
    "left_name",
    "lock_name",
    "member_name",
    "member_rank",
    "offer_name",
    "output_marker",
    "rival_name",
    "seen_name",
    "shard_data_glob",
    "shard_data_name",
    "shared_input_name",
    "shared_input_rank",
    "stay_name",
    "step_dir_name",
]

RDZV = "rdzv"
GEN_PREFIX = "gen-"
OWN_MARK = ".gradsync-own"
ROSTER = "roster.json"
ABORT = "abort.json"
GAVE_UP = "gave-up-"
ENDED = "ended-"
LOCK_PREFIX = "lock-0"
RIVAL = "rival-0-"
EJOIN_PREFIX = "ejoin-"
JOINS = "joins"
NEXT = "next.json"
_SHARED_INPUT = re.compile(r"d-(\d+)-b\d+\.in")
_CALL_DATA = re.compile(r"d-\d+-c\d+(-s\d+\.in|\.(in|out))")


def gen_name(gen_id: str) -> str:
    return f"{GEN_PREFIX}{gen_id}"


def gen_id_of(name: str) -> str | None:
    """The generation id of directory ``name``; None if it is not a generation's name."""
    return name[len(GEN_PREFIX) :] if name.startswith(GEN_PREFIX) else None


def leader_name(gen_id: str) -> str:
    return f"leader-{gen_id}.json"


def is_leader_name(name: str) -> bool:
    return name.startswith("leader-") and name.endswith(".json")


def lock_name(run_id: str | None) -> str:
    return f"{LOCK_PREFIX}.lock" if run_id is None else f"{LOCK_PREFIX}-{run_id}.lock"


def join_prefix(rank: int) -> str:
    return f"join-{rank}-"


def join_name(rank: int, nonce: str) -> str:
    return f"{join_prefix(rank)}{nonce}.json"


def join_nonce(name: str) -> str | None:
    """The nonce of a join file's ``name``; None if ``name`` is not a join file's."""
    if not (name.startswith("join-") and name.endswith(".json")):
        return None
    return name[: -len(".json")].rsplit("-", 1)[-1]


def offer_name(nonce: str) -> str:
    return f"offer-{nonce}.json"


def is_offer_name(name: str) -> bool:
    return name.startswith("offer-") and name.endswith(".json")


def ended_name(rank: int, nonce: str) -> str:
    return f"{ENDED}{rank}-{nonce}.json"


def member_name(rank: int, nonce: str) -> str:
    return f"member-{rank}-{nonce}.json"


def member_rank(name: str) -> int | None:
    """The rank of a confirmation's ``name``; None if ``name`` is not one's."""
    if not (name.startswith("member-") and name.endswith(".json")):
        return None
    rank = name.split("-")[1]
    return int(rank) if rank.isascii() and rank.isdigit() else None


def gave_up_name(rank: int, nonce: str) -> str:
    return f"{GAVE_UP}{rank}-{nonce}.json"


def rival_name(nonce: str) -> str:
    return f"{RIVAL}{nonce}.json"


def heartbeat_name(nonce: str) -> str:
    return f"hb-{nonce}"


def seen_name(host_key: str) -> str:
    return f"seen-{host_key}.json"


def left_name(rank: int) -> str:
    return f"left-{rank}"


def data_name(rank: int, kind: str, slot: int | None = None) -> str:
    """Rank ``rank``'s data file of ``kind`` "in" or "out", in ``slot`` if it has two."""
    return f"d-{rank}.{kind}" if slot is None else f"d-{rank}-{slot}.{kind}"


def call_data_name(rank: int, kind: str, seq: int) -> str:
    """Rank ``rank``'s data file of ``kind`` made for call ``seq`` alone."""
    return f"d-{rank}-c{seq}.{kind}"


def shard_data_name(rank: int, shard: int, seq: int) -> str:
    """The part of rank ``rank``'s input of call ``seq`` that the reducer of shard
    ``shard`` reads, in a file of its own."""
    return f"d-{rank}-c{seq}-s{shard}.in"


def shard_data_glob(rank: int, seq: int) -> str:
    """A glob pattern of every :func:`shard_data_name` of ``rank``'s input of call ``seq``."""
    return f"d-{rank}-c{seq}-s*.in"


def is_call_data_name(name: str) -> bool:
    """Whether ``name`` is a data file of one call (:func:`call_data_name`,
    :func:`shard_data_name`)."""
    return _CALL_DATA.fullmatch(name) is not None


def shared_input_name(rank: int, serial: int) -> str:
    """Rank ``rank``'s ``serial``-th buffers_like file (its input name links to it)."""
    return f"d-{rank}-b{serial}.in"


def shared_input_rank(name: str) -> int | None:
    """The rank whose buffers_like file ``name`` is; None if it is not one."""
    found = _SHARED_INPUT.fullmatch(name)
    return None if found is None else int(found.group(1))


def step_dir_name(seq: int) -> str:
    return f"s-{seq}"


def input_marker(rank: int) -> str:
    return f"in-{rank}"


def output_marker(rank: int) -> str:
    return f"out-{rank}"


def abort_marker(rank: int) -> str:
    return f"abort-{rank}"


def stay_name(rank: int) -> str:
    return f"stay-{rank}.json"


def claim_name(attempt: int) -> str:
    """The claim of a membership's decision, created exclusively: one per attempt (a
    later attempt only after every claimant of the earlier one died without deciding)."""
    return "next.claim" if attempt == 0 else f"next.claim.{attempt}"


def intent_name(attempt: int, rank: int) -> str:
    """Rank ``rank`` is about to claim attempt ``attempt`` (kept by its winner)."""
    return f"next.intent-{attempt}-{rank}"


def ejoin_name(nonce: str) -> str:
    return f"{EJOIN_PREFIX}{nonce}.json"


def current_name(run_id: str | None) -> str:
    return "current.json" if run_id is None else f"current-{run_id}.json"
