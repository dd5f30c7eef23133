"""Test-only fault injection at the protocol's phase points.

``GRADSYNC_TEST_FAULT="PHASE@RANK[@CALL]=ACTION"`` (several separated by ``,``)
makes rank RANK perform ACTION when it reaches PHASE (on call number CALL, 1-based,
or on every call). ACTION is ``sigkill``, ``sigstop`` (the process stops itself;
a test resumes it with SIGCONT), ``exit`` (``os._exit(17)``) or ``sigint`` (the
process interrupts itself, as Ctrl-C does, the first time only). Phases, in order:

    before_publish   nothing of this step written yet
    mid_publish      half of this rank's input file written (in place: readers wait for its marker)
    after_publish    input published, peers' inputs not yet read
    mid_output       half of this rank's reduced shard written
    after_output     reduced shard published, peers' shards not yet read
    mid_gather       some of the mean copied into the arrays
    mid_decide       (elastic) the next membership claimed, not yet written down
    after_decide     (elastic) the next membership written down, the running job not yet named

Read once, at import: with the variable unset, each phase point costs one
dictionary lookup.
"""

from __future__ import annotations

import os
import signal

__all__ = ["PHASES", "fault_point"]

PHASES = (
    "before_publish",
    "mid_publish",
    "after_publish",
    "mid_output",
    "after_output",
    "mid_gather",
    "mid_decide",
    "after_decide",
)
_ACTIONS = ("sigkill", "sigstop", "exit", "sigint")


def _parse(spec: str) -> dict[tuple[str, int], list[tuple[int | None, str]]]:
    plan: dict[tuple[str, int], list[tuple[int | None, str]]] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        where, _, action = item.partition("=")
        parts = where.split("@")
        if action not in _ACTIONS or len(parts) not in (2, 3) or parts[0] not in PHASES:
            raise ValueError(
                f"GRADSYNC_TEST_FAULT entry {item!r} is not PHASE@RANK[@CALL]=ACTION with "
                f"PHASE in {PHASES} and ACTION in {_ACTIONS}"
            )
        call = int(parts[2]) if len(parts) == 3 else None
        plan.setdefault((parts[0], int(parts[1])), []).append((call, action))
    return plan


_PLAN = _parse(os.environ.get("GRADSYNC_TEST_FAULT", ""))
_interrupted: set[tuple[str, int, int | None]] = set()


def fault_point(phase: str, rank: int, call: int) -> None:
    """Perform the configured fault for ``phase`` on ``rank`` at call ``call``, if any."""
    if not _PLAN:
        return
    for when, action in _PLAN.get((phase, rank), ()):
        if when is not None and when != call:
            continue
        if action == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif action == "sigstop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif action == "sigint":
            if (phase, rank, when) not in _interrupted:
                _interrupted.add((phase, rank, when))
                os.kill(os.getpid(), signal.SIGINT)
        else:
            os._exit(17)
