"""Elastic membership: ranks lost mid-step, joiners, and the majority rule (no files)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import elastic_workers
import gradsync
from ranks import run_ranks
from test_faults import fault
from workers import SHAPES, SHAPES_BIG, grads_for

# Short heartbeats: a test waits for nothing longer.
FAST = {"heartbeat_interval_s": 0.05, "heartbeat_timeout_s": 3.0, "max_wait_s": 20.0}


def _records(results: dict[int, Any]) -> Iterator[tuple[int, dict[str, Any]]]:
    for proc, outcome in results.items():
        assert outcome.ok, outcome.value
        for rec in outcome.value["records"]:
            yield proc, rec


def _check_means(results: dict[int, Any], big: bool = False) -> dict[int, tuple[int, ...]]:
    """Every step's result is the same bits on every rank that reported it, and equals
    average_host_grads of the inputs of the ranks that took part; who took part."""
    shapes = SHAPES_BIG if big else SHAPES
    by_step: dict[int, list[dict[str, Any]]] = {}
    for _, rec in _records(results):
        by_step.setdefault(rec["step"], []).append(rec)
    taking_part = {}
    for step, recs in sorted(by_step.items()):
        members = recs[0]["members"]
        assert all(r["members"] == members for r in recs), step
        seeds = {r["members"][r["rank"]]: r["seed"] for r in recs}
        inputs = [grads_for(*seeds.get(launch, (launch, step)), shapes) for launch in members]
        want = [a.tobytes() for a in gradsync.average_host_grads(inputs)]
        for r in recs:
            assert r["after"] == want, (step, r["rank"])
        taking_part[step] = members
    return taking_part


@pytest.mark.parametrize(
    ("phase", "big"), [("after_publish", False), ("after_output", True), ("before_publish", True)]
)
def test_survivors_of_a_sigkilled_rank_redo_the_step_and_go_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, phase: str, big: bool
) -> None:
    with fault(f"{phase}@2@4=sigkill", monkeypatch):
        results = run_ranks(
            elastic_workers.train,
            4,
            (4, str(tmp_path), 6, FAST, big),
            expect=[0, 1, 3],
            timeout_s=60,
        )
    parts = _check_means(results, big)
    assert parts[0] == (0, 1, 2, 3)
    assert parts[5] == (0, 1, 3)
    for proc in (0, 1, 3):
        recs = results[proc].value["records"]
        lost = [r for r in recs if r["lost"]]
        assert len(lost) == 1, recs
        assert "rank 2" in lost[0]["lost"][0]
        assert lost[0]["elapsed_s"] < FAST["heartbeat_timeout_s"]
        assert recs[-1]["world"] == 3
        assert recs[-1]["epoch"] == 1
        assert any("rank 2" in w for w in results[proc].value["warnings"])
    assert [r["rank"] for r in results[3].value["records"]][-1] == 2  # renumbered densely
