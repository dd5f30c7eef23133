"""An elastic job across three simulated hosts (the rig in ``rig/``) losing hosts.

Three hosts of two ranks, ``gradsync launch --elastic`` on each: when one host's
processes are SIGKILLed, the four ranks of the other two are a majority and go on
within the heartbeat timeout, every later step the same bits on all of them and equal
to :func:`gradsync.average_host_grads` of the inputs of the ranks that took part.
(With two hosts, losing one leaves exactly half: that job must stop, docs/elastic.md.)

Runs where test_multihost.py runs (same skips); uses its own results directory, and
the rig's settings (``MH_NS``, ``MH_DIR``, ``MH_MOUNT``) from the environment.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mh_cluster import MOUNT, Cluster, Job, running_cluster, steps_of
from mh_data import grads_for

import gradsync

THREE_HOSTS = {"h1": 0, "h2": 1, "h3": 2}
NPROC = 2
SEED = 4
HB_TIMEOUT_S = 2.0
ARGS = ["--seed", str(SEED), "--step-sleep", "0.1", "--raw", "--expect-loss"]
ARGS += ["--hb-interval", "0.25", "--hb-timeout", str(HB_TIMEOUT_S)]

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with running_cluster(3, "gradsync-mh-elastic-tests") as c:
        yield c


def _pids(out: Path, ranks: list[int], launcher: bool) -> list[int]:
    """The ranks' pids as their host numbers them, and their launcher's if ``launcher``."""
    pids: set[int] = set()
    for r in ranks:
        info = json.loads((out / f"pid-{r}.json").read_text())
        pids.update((info["pid"], info["ppid"]) if launcher else (info["pid"],))
    return sorted(pids)


def _start(cluster: Cluster, label: str, steps: int) -> tuple[Job, Path]:
    run_id = f"{label}-{uuid.uuid4().hex[:10]}"
    out = cluster.base / run_id
    out.mkdir()
    job = cluster.launch(
        THREE_HOSTS,
        NPROC,
        f"{MOUNT}/{run_id}",
        run_id,
        [*ARGS, "--steps", str(steps)],
        out,
        launcher_args=("--elastic",),
    )
    return job, out


def _check_survivors(out: Path, survivors: list[int], steps: int, job: Job) -> list[dict[str, Any]]:
    """Every step of every survivor: done, the same members, and the mean of their
    inputs bit for bit. The records of the calls that lost ranks."""
    losses = []
    for s in range(steps):
        recs = {r: steps_of(out, r) for r in survivors}
        for r, got in recs.items():
            assert [g["step"] for g in got] == list(range(steps)), f"rank {r}\n{job.log_text()}"
        members = recs[survivors[0]][s]["members"]
        assert all(recs[r][s]["members"] == members for r in survivors), s
        want = gradsync.average_host_grads([grads_for(SEED, q, s, "mixed") for q in members])
        raw = b"".join(a.tobytes() for a in want)
        for r in survivors:
            assert (out / f"raw-{r}-{s}").read_bytes() == raw, f"rank {r} step {s}"
        losses += [recs[r][s] for r in survivors if recs[r][s]["lost"]]
    return losses


def test_losing_one_of_three_hosts_the_others_go_on_with_identicalsteps_of(
    cluster: Cluster,
) -> None:
    steps = 60
    job, out = _start(cluster, "lose-h3", steps)
    try:
        job.wait_until(
            lambda: all(len(steps_of(out, r)) >= 3 for r in range(6)),
            60,
            "3 steps",
            launchers_live=False,
        )
        t_kill = time.time()
        cluster.kill_in_host("h3", _pids(out, [4, 5], launcher=True))
        codes = job.wait(120)
    finally:
        job.stop()
    assert codes["h1"] == 0, f"{codes}\n{job.log_text()}"
    assert codes["h2"] == 0, f"{codes}\n{job.log_text()}"
    losses = _check_survivors(out, [0, 1, 2, 3], steps, job)
    assert steps_of(out, 0)[-1]["members"] == [0, 1, 2, 3]
    assert {r for rec in losses for r in (4, 5) if f"rank {r} " in " ".join(rec["lost"])} == {4, 5}
    delays = [rec["t"] - t_kill for rec in losses]
    # Within the heartbeat timeout of noticing, plus a step and the re-form.
    assert max(delays) < 3 * HB_TIMEOUT_S, (delays, job.log_text())
    print(f"\nthe 4 survivors went on {max(delays):.2f} s after h3 was killed (timeout 2 s)")


def test_a_hosts_ranks_killed_after_a_re_form_are_known_gone_from_their_launchers_note(
    cluster: Cluster,
) -> None:
    """h1's rank 1 is killed (its launcher stops rank 0): ranks 2-5 go on as 0-3. Then
    h2's ranks are SIGKILLed, not its launcher: its note in the re-formed generation
    must name them by their new ranks, or their loss counts only by heartbeat, and 2 of
    4 are not a majority."""
    steps = 120
    job, out = _start(cluster, "reform-h2", steps)
    try:
        job.wait_until(
            lambda: all(len(steps_of(out, r)) >= 3 for r in range(6)),
            60,
            "3 steps",
            launchers_live=False,
        )
        cluster.kill_in_host("h1", _pids(out, [1], launcher=False))

        def renumbered() -> bool:
            return any(rec["members"] == [2, 3, 4, 5] for rec in steps_of(out, 5))

        job.wait_until(renumbered, 60, "ranks 2-5 to go on", launchers_live=False)
        t_kill = time.time()
        cluster.kill_in_host("h2", _pids(out, [2, 3], launcher=False))
        codes = job.wait(120)
    finally:
        job.stop()
    assert codes["h3"] == 0, f"{codes}\n{job.log_text()}"
    losses = _check_survivors(out, [4, 5], steps, job)
    assert steps_of(out, 4)[-1]["members"] == [4, 5]
    late = [rec for rec in losses if rec["t"] > t_kill]
    assert late, job.log_text()
    assert all("heartbeat" not in why for rec in late for why in rec["lost"]), late
    delays = [rec["t"] - t_kill for rec in late]
    print(f"\nranks 4, 5 went on {max(delays):.2f} s after h2's ranks were killed")
