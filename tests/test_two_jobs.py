"""Two jobs of two ranks started together in one sync dir, with no run id or the same
one, never average each other's gradients: one of them forms, or neither, and every
other process raises RendezvousError."""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import socket
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gradsync
import gradsync._cli.status  # what `gradsync status --json` reports
from ranks import run_ranks

TRIALS = 15  # per case: the old code mixed the jobs in most trials
CASES: tuple[str | None, ...] = (None, "shared")
# Process i is rank i % 2 of job i // 2. Job A's ranks pass 1 and 2, job B's 100 and
# 110: each pairing has its own mean.
VALUES = (1.0, 2.0, 100.0, 110.0)
MEANS = {1.5: (0, 1), 105.0: (2, 3), 55.5: (0, 3), 51.0: (2, 1)}
# What a process that came after a job had formed is told.
LATE = ("is running in", "is already taken by")


def _two_jobs(index: int, base: str, start: Any, rank_0s: Any, staged: bool) -> list[Any]:
    """Every trial starts at the ``start`` barrier; ``staged``: both ranks 1 wait for a
    rank 0 before the two ranks 0 start at once. A formed job stays open until all four
    processes are done."""
    rank = index % 2
    results = []
    for trial in range(TRIALS):
        for run_id in CASES:
            sync_dir = Path(base) / f"{trial}-{run_id}"
            cfg = gradsync.FileGradSyncConfig(2, rank, sync_dir, run_id=run_id, max_wait_s=2.0)
            grads = [np.full(4, VALUES[index])]
            start.wait()
            if staged and rank == 0:
                if index == 0:
                    _wait_for_two_ranks_1(sync_dir, run_id)
                rank_0s.wait()
            got: dict[str, Any] = {"entered": time.time()}
            try:
                with gradsync.GradSync(cfg) as gs:
                    gs.average(grads)
                    got["mean"] = float(grads[0][0])
                    start.wait()
            except gradsync.GradSyncError as exc:
                got["left"] = time.time()
                got["error"] = f"{type(exc).__name__}: {exc}"
                start.wait()
            results.append(got)
    return results


def _wait_for_two_ranks_1(sync_dir: Path, run_id: str | None) -> None:
    """Until ``gradsync status`` shows two ranks 1 of ``run_id`` waiting for a rank 0."""
    while True:
        try:
            joining = gradsync._cli.status.describe(sync_dir, sample_s=0.0)["joining"]
        except FileNotFoundError:
            joining = []
        for run in joining:
            if run["run_id"] == run_id and [r["rank"] for r in run["ranks"]] == [1, 1]:
                return
        time.sleep(0.001)


def _judge(trial: list[dict[str, Any]], *, mixed_ok: bool) -> str | None:
    """What is wrong with one trial's four outcomes, if anything."""
    done = [i for i, got in enumerate(trial) if "mean" in got]
    if len(done) > 2:
        return f"processes {done} all returned a mean"
    # Where no job formed, a process that came after the others had failed and gone
    # waits for them in vain.
    allowed = ("RendezvousError",) if done else ("RendezvousError", "PeerTimeoutError")
    for i, got in enumerate(trial):
        if "error" in got and not got["error"].startswith(allowed):
            return f"process {i} raised {got['error']}"
    for i in done:
        members = MEANS.get(trial[i]["mean"])
        if members is None or i not in members:
            return f"process {i} returned {trial[i]['mean']}"
        if members[0] // 2 == members[1] // 2:
            continue
        if not mixed_ok:
            return f"processes {members} of two jobs averaged together"
        # The one case no file can tell: ranks of both jobs formed one before the
        # others came. Those must have been told that they came late, after that job's
        # first rank had started (a stamp taken before the call cannot order the claims).
        late = [j for j in range(4) if j not in members]
        first = min(trial[m]["entered"] for m in members)
        if not all(any(s in trial[j]["error"] for s in LATE) for j in late):
            return f"processes {members} formed one job, yet {late} were not late"
        if any(trial[j]["left"] < first for j in late):
            return f"processes {members} formed one job, yet one of {late} was told so first"
    return None


def _trials(base: Path, staged: bool) -> list[list[dict[str, Any]]]:
    ctx = mp.get_context("spawn")
    args = (str(base), ctx.Barrier(4, timeout=30.0), ctx.Barrier(2, timeout=30.0), staged)
    results = run_ranks(_two_jobs, 4, args, timeout_s=110.0)
    assert all(o.ok for o in results.values()), [o.value for o in results.values() if not o.ok]
    return [list(t) for t in zip(*(results[i].value for i in range(4)), strict=True)]


@pytest.mark.slow
def test_two_jobs_started_at_once_never_mix(tmp_path: Path) -> None:
    # All four start at one instant: a rank may come so late that the others have
    # formed a job already, of ranks of both jobs; that alone is allowed.
    trials = _trials(tmp_path, staged=False)
    wrong = [(n, why) for n, t in enumerate(trials) if (why := _judge(t, mixed_ok=True))]
    assert not wrong, f"{len(wrong)} of {len(trials)} trials went wrong: {wrong}"


@pytest.mark.slow
def test_two_rank_0s_started_at_once_never_mix_the_waiting_ranks(tmp_path: Path) -> None:
    # Both ranks 1 wait before the ranks 0 start: every rank has come before any job
    # can form, so no job of ranks of both may form.
    trials = _trials(tmp_path, staged=True)
    wrong = [(n, why) for n, t in enumerate(trials) if (why := _judge(t, mixed_ok=False))]
    assert not wrong, f"{len(wrong)} of {len(trials)} trials went wrong: {wrong}"


def _job_then_a_late_rank_0(index: int, base: str, formed: Any, tried: Any) -> Any:
    """Processes 0 and 1 form a job and average twice, the second time after process 2,
    a rank 0 of the same run id, has tried to join the directory."""
    if index == 2:
        formed.wait(30)
        try:
            with gradsync.GradSync(gradsync.FileGradSyncConfig(2, 0, base, max_wait_s=2.0)) as gs:
                gs.average([np.ones(4)])
        finally:
            tried.set()
    cfg = gradsync.FileGradSyncConfig(2, index, base, max_wait_s=20.0)
    with gradsync.GradSync(cfg) as gs:
        means = []
        for step in range(2):
            grads = [np.full(4, float(index))]
            gs.average(grads, step=step)
            means.append(float(grads[0][0]))
            formed.set()
            tried.wait(30)
    return {"means": means, "pid": os.getpid()}


def test_a_rank_0_coming_to_a_running_job_fails_at_once_and_the_job_runs_on(
    tmp_path: Path,
) -> None:
    ctx = mp.get_context("spawn")
    args = (str(tmp_path), ctx.Event(), ctx.Event())
    results = run_ranks(_job_then_a_late_rank_0, 3, args, timeout_s=60.0)
    assert results[0].value["means"] == results[1].value["means"] == [0.5, 0.5]
    assert (results[2].error_type, results[2].message) == (
        "RendezvousError",
        f"rendezvous: another rank 0 (pid {results[0].value['pid']} on {socket.gethostname()}) "
        f"with run_id None is running in {tmp_path}; give each job its own sync_dir or run_id "
        "(or, within one job, each node its own --node-rank)",
    )
    # The job's rank 0 removed its lock as it left: nothing stays behind.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rdzv"]
    assert list((tmp_path / "rdzv").iterdir()) == []


def _rank_0_then_another(index: int, base: str, started: Any) -> dict[str, Any]:
    """Process 0 is rank 0 of a job of 2 whose rank 1 never comes; process 1, another
    rank 0 of the same run, comes while it waits. What each raised, and its pid."""
    cfg = gradsync.FileGradSyncConfig(2, 0, base, max_wait_s=10.0)
    if index == 1:
        started.wait(30)
        time.sleep(0.3)  # process 0 is in its rendezvous by now
    else:
        started.set()
    got: dict[str, Any] = {"pid": os.getpid()}
    try:
        with gradsync.GradSync(cfg) as gs:
            gs.average([np.ones(4)])
    except gradsync.GradSyncError as exc:
        got["error"] = f"{type(exc).__name__}: {exc}"
    return got


def test_a_second_rank_0_fails_a_job_still_forming(tmp_path: Path) -> None:
    # Which job's rank 1 will come no file tells: both rank 0s fail, each naming the
    # other, long before max_wait_s.
    args = (str(tmp_path), mp.get_context("spawn").Event())
    results = run_ranks(_rank_0_then_another, 2, args, timeout_s=60.0)
    for me, other in ((0, 1), (1, 0)):
        assert results[me].value["error"] == (
            f"RendezvousError: rendezvous: another rank 0 (pid {results[other].value['pid']} on "
            f"{socket.gethostname()}) with run_id None is running in {tmp_path}; give each job "
            "its own sync_dir or run_id (or, within one job, each node its own --node-rank)"
        )


def _job_then_a_rank_2_of_3(index: int, base: str, formed: Any, tried: Any) -> Any:
    """Processes 0 and 1 form a job of 2 and stay in it until process 2, rank 2 of a job
    of 3 in the same sync dir and run, has tried to join: what it raised, how soon."""
    if index < 2:
        with gradsync.GradSync(gradsync.FileGradSyncConfig(2, index, base)) as gs:
            gs.average([np.ones(4)])
            formed.set()
            tried.wait(30)
            return {"pid": os.getpid()}
    formed.wait(30)
    start = time.monotonic()
    try:
        with gradsync.GradSync(gradsync.FileGradSyncConfig(3, 2, base, max_wait_s=10.0)) as gs:
            gs.average([np.ones(4)])
    except gradsync.GradSyncError as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "s": time.monotonic() - start}
    finally:
        tried.set()
    return {}


def test_a_rank_outside_a_running_job_of_fewer_ranks_fails_at_once(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    args = (str(tmp_path), ctx.Event(), ctx.Event())
    results = run_ranks(_job_then_a_rank_2_of_3, 3, args, timeout_s=60.0)
    late = results[2].value
    assert re.fullmatch(
        rf"RendezvousError: rendezvous: a job of 2 ranks with run_id None \(rank 0: pid "
        rf"{results[0].value['pid']} on {re.escape(socket.gethostname())}\) is running in "
        rf"{re.escape(str(tmp_path))}/gen-[0-9a-f]+; this process \(pid \d+ on \S+\) was "
        r"started as rank 2 of 3; give each job its own sync_dir or run_id, and every rank "
        r"of one job the same world size \(with gradsync launch .*\)",
        late["error"],
    ), late["error"]
    assert late["s"] < 5  # not max_wait_s (10 s)
