"""Elastic membership: ranks lost mid-step, joiners, and the majority rule (no files)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import elastic_workers
import gradsync
from gradsync._job.membership import (
    Reform,
    ReformLook,
    Standing,
    decide_reform,
    refusal,
    survivors,
)
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
        # Keyed by the rank each was started as: gs.rank after a re-form is a new one.
        seeds = {r["seed"][0]: r["seed"] for r in recs}
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


def test_a_decider_killed_mid_decision_is_replaced_and_the_others_go_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Rank 3 dies in call 4; rank 0 claims the next membership and dies before writing it.
    with fault("before_publish@3@4=sigkill,mid_decide@0=sigkill", monkeypatch):
        results = run_ranks(
            elastic_workers.train,
            4,
            (4, str(tmp_path), 6, {**FAST, "max_wait_s": 10.0}),
            expect=[1, 2],
            timeout_s=60,
        )
    parts = _check_means(results)
    assert parts[0] == (0, 1, 2, 3)
    assert parts[5] == (1, 2)
    for proc in (1, 2):
        recs = results[proc].value["records"]
        lost = [r for r in recs if r["lost"]]
        assert len(lost) == 1, recs
        assert lost[0]["elapsed_s"] < FAST["heartbeat_timeout_s"]
        assert recs[-1]["world"] == 2
    warnings = " ".join(results[1].value["warnings"])
    assert "rank 0 claimed the next membership" in warnings
    assert "rank 1 decides in its place" in warnings
    # The generation rank 0 made before dying is removed too (before, it stayed).
    assert not list(tmp_path.glob("gen-*"))


def test_a_late_joiner_comes_in_at_a_step_boundary_and_averages_with_the_others(
    tmp_path: Path,
) -> None:
    late = {3: (3, 1.5)}  # process 3 starts as rank 3, 1.5 s after the others formed a job of 3
    results = run_ranks(
        elastic_workers.train,
        4,
        (3, str(tmp_path), 40, FAST, False, 0.05, late),
        timeout_s=60,
    )
    parts = _check_means(results)
    assert parts[0] == (0, 1, 2)
    assert parts[39] == (0, 1, 2, 3)
    first = results[3].value["records"][0]
    assert first["members"] == (0, 1, 2, 3)
    assert first["rank"] == 3  # joiners come after the members that were there
    boundary = [r for r in results[0].value["records"] if r["joined"]]
    assert len(boundary) == 1
    assert boundary[0]["joined"] == (3,)
    assert boundary[0]["members"] == (0, 1, 2)  # the call itself ran without the joiner
    assert boundary[0]["step"] + 1 == first["step"]


@pytest.mark.parametrize("phase", ["mid_decide", "after_decide"])
def test_a_decider_killed_while_admitting_a_joiner_is_replaced_and_the_others_go_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, phase: str
) -> None:
    # Rank 0 decides the change that admits process 3 and dies: before writing it
    # (mid_decide), or after, before naming the new generation the running job
    # (after_decide). Either way it took part in the call before the change.
    late = {3: (3, 1.5)}
    kw = {**FAST, "max_wait_s": 10.0}
    with fault(f"{phase}@0=sigkill", monkeypatch):
        results = run_ranks(
            elastic_workers.train,
            4,
            (3, str(tmp_path), 40, kw, False, 0.05, late),
            expect=[1, 2, 3],
            timeout_s=60,
        )
    for proc in (1, 2):
        assert results[proc].ok, results[proc].value
        recs = results[proc].value["records"]
        (at,) = [i for i, r in enumerate(recs) if r["joined"]]
        slowest = max(recs[at:], key=lambda r: r["elapsed_s"])
        # Not max_wait_s (10 s): a stall waiting for the joiner took that long.
        assert slowest["elapsed_s"] < 2 * FAST["heartbeat_timeout_s"], {**slowest, "after": None}
        assert recs[at]["joined"] == (3,)
        assert recs[at]["members"] == (0, 1, 2)
        assert recs[at]["lost"] == ()  # rank 0's input is in this call's mean
        after = recs[at + 1]
        assert after["members"] == (1, 2, 3)
        (why,) = after["lost"]
        assert why.startswith("rank 0 "), why
    assert _check_means(results)[39] == (1, 2, 3)
    assert results[3].value["records"][0]["members"] == (1, 2, 3)


def test_a_late_joiner_comes_into_a_compressed_job_at_a_step_boundary(tmp_path: Path) -> None:
    late = {3: (3, 1.5)}
    kw = {**FAST, "compression": "int8", "compress_local": True}
    results = run_ranks(
        elastic_workers.train,
        4,
        (3, str(tmp_path), 40, kw, False, 0.05, late),
        timeout_s=60,
    )
    by_step: dict[int, set[bytes]] = {}
    for _, rec in _records(results):
        by_step.setdefault(rec["step"], set()).add(b"".join(rec["after"]))
    assert all(len(means) == 1 for means in by_step.values())
    boundary = [r for r in results[0].value["records"] if r["joined"]]
    assert [r["joined"] for r in boundary] == [(3,)]
    assert results[3].value["records"][0]["members"] == (0, 1, 2, 3)


def test_a_rank_killed_in_a_broadcast_is_left_behind_and_the_broadcast_redone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Calls 1-3 average, call 4 broadcasts: rank 2 dies halfway through publishing.
    with fault("mid_publish@2@4=sigkill", monkeypatch):
        results = run_ranks(
            elastic_workers.broadcast_at,
            4,
            (4, str(tmp_path), FAST, 5, 2),
            expect=[0, 1, 3],
            timeout_s=60,
        )
    for proc in (0, 1, 3):
        assert results[proc].ok, results[proc].value
        value = results[proc].value
        assert value["state"] == np.full(64, 1.0).tobytes()  # rank 0's
        assert value["members"] == (0, 1, 3)
        assert value["epoch"] == 1
        # broadcast() returns no StepStats: the next averaging call says who was lost
        # (before, none did: a loop that re-shards on stats.lost never learned of it).
        (why,) = value["lost"][3]
        assert why.startswith("rank 2 "), why
        assert value["lost"][:3] == [(), (), ()]
        assert value["lost"][4] == ()


def test_below_min_world_size_the_survivors_wait_then_fail_naming_the_lost_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Long enough for the first rendezvous of ranks spawned on a loaded machine.
    kw = {**FAST, "max_wait_s": 3.0, "min_world_size": 3}
    with fault("after_publish@2@3=sigkill", monkeypatch):
        results = run_ranks(
            elastic_workers.train, 3, (3, str(tmp_path), 6, kw), expect=[0, 1], timeout_s=60
        )
    for proc in (0, 1):
        assert results[proc].error_type == "PeerLostError", results[proc].value
        assert "min_world_size 3" in results[proc].message
        assert results[proc].attrs["ranks"] == (2,)


def _look(standings: list[Standing], **kw: Any) -> ReformLook:
    return ReformLook(closing=False, decided=False, me=0, standings=tuple(standings), **kw)


def test_the_lowest_live_member_decides_once_every_member_stayed_or_is_gone() -> None:
    stayed = [Standing(0, stayed=4), Standing(1, stayed=4)]
    assert decide_reform(_look([*stayed, Standing(2)])) is Reform.WAIT  # 2 not known yet
    gone = Standing(2, gone="has exited", certain=True)
    assert decide_reform(_look([*stayed, gone])) is Reform.DECIDE
    assert decide_reform(dataclasses.replace(_look([*stayed, gone]), me=1)) is Reform.WAIT
    assert decide_reform(dataclasses.replace(_look([*stayed, gone]), decided=True)) is Reform.ADOPT


def test_a_member_gone_before_deciding_passes_the_lead_to_the_next() -> None:
    look = ReformLook(
        closing=False,
        decided=False,
        me=1,
        standings=(Standing(0, gone="has exited", certain=True), Standing(1, 3), Standing(2, 3)),
    )
    assert decide_reform(look) is Reform.DECIDE


def test_half_of_the_members_never_go_on_when_the_others_may_live() -> None:
    # Two halves cut apart: each sees the other's heartbeats stop.
    half = [
        Standing(0, stayed=7),
        Standing(1, stayed=7),
        Standing(2, gone="stopped its heartbeat 5.0 s ago"),
        Standing(3, gone="stopped its heartbeat 5.0 s ago"),
    ]
    other_half = [
        Standing(0, gone="stopped its heartbeat 5.0 s ago"),
        Standing(1, gone="stopped its heartbeat 5.0 s ago"),
        Standing(2, stayed=7),
        Standing(3, stayed=7),
    ]
    assert "not a majority" in (refusal(tuple(half), 0, 1) or "")
    assert "not a majority" in (refusal(tuple(other_half), 0, 1) or "")
    assert decide_reform(_look(half)) is Reform.WAIT
    assert decide_reform(_look(half, timed_out=True)) is Reform.FAIL


def test_members_known_dead_for_sure_do_not_count_against_the_majority() -> None:
    dead = [Standing(q, gone="has exited", certain=True) for q in (2, 3)]
    assert refusal((Standing(0, 7), Standing(1, 7), *dead), 0, 1) is None
    assert "min_world_size 3" in (refusal((Standing(0, 7), Standing(1, 7), *dead), 0, 3) or "")
    assert refusal((Standing(0, 7), Standing(1, 7), *dead), 1, 3) is None  # a joiner makes up


def test_a_member_behind_the_others_is_left_out() -> None:
    standings = (Standing(0, stayed=5), Standing(1, stayed=6), Standing(2, stayed=6))
    assert survivors(standings) == (1, 2)


def test_a_live_member_that_never_stays_is_left_out_once_max_wait_s_is_over() -> None:
    standings = [Standing(0, 2), Standing(1, 2), Standing(2, 2), Standing(3)]
    assert decide_reform(_look(standings)) is Reform.WAIT
    assert decide_reform(_look(standings, timed_out=True)) is Reform.DECIDE
    assert survivors(tuple(standings)) == (0, 1, 2)


def test_a_closed_session_stops_re_forming() -> None:
    look = dataclasses.replace(_look([Standing(0, 1)]), closing=True, decided=True)
    assert decide_reform(look) is Reform.CLOSED


def test_a_host_that_stops_beating_is_left_behind_within_the_heartbeat_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each rank acts as a host of its own: a peer's death shows only in its heartbeat.
    kw = {**FAST, "heartbeat_timeout_s": 2.0}
    sync_dir = tmp_path / "sync"
    with fault("after_publish@1@4=sigkill", monkeypatch):
        results = run_ranks(
            elastic_workers.train,
            4,
            (4, str(sync_dir), 6, kw, False, 0.0, None, True),
            expect=[0, 2, 3],
            timeout_s=60,
        )
    parts = _check_means(results)
    assert parts[5] == (0, 2, 3)
    for proc in (0, 2, 3):
        (lost,) = [r for r in results[proc].value["records"] if r["lost"]]
        assert "stopped its heartbeat" in lost["lost"][0]
        assert lost["elapsed_s"] < 2 * kw["heartbeat_timeout_s"]


@pytest.mark.parametrize("elastic_ranks", [[0], [1]])
def test_ranks_that_disagree_on_elastic_fail_the_first_call_naming_it(
    tmp_path: Path, elastic_ranks: list[int]
) -> None:
    results = run_ranks(elastic_workers.first_call, 2, (2, str(tmp_path), elastic_ranks))
    for outcome in results.values():
        assert outcome.error_type == "MismatchError", outcome.value
        assert "elastic" in outcome.message


def _kill_when_running(pid_file: Path, after_s: float) -> None:
    while not pid_file.exists():
        time.sleep(0.01)
    time.sleep(after_s)
    os.kill(int(pid_file.read_text()), signal.SIGKILL)


def test_a_killed_rank_started_again_rejoins_and_averages_with_the_others(
    tmp_path: Path,
) -> None:
    # Process 2 is killed at whatever point of a step it is in 0.5 s after its first
    # call; process 4, started as rank 2 again, joins the survivors.
    late = {4: (2, 2.5)}
    killer = threading.Thread(target=_kill_when_running, args=(tmp_path / "pid-2", 0.5))
    killer.start()
    sync_dir = tmp_path / "sync"
    args = (4, str(sync_dir), 80, FAST, False, 0.05, late, False, str(tmp_path))
    try:
        results = run_ranks(elastic_workers.train, 5, args, expect=[0, 1, 3, 4], timeout_s=90)
    finally:
        killer.join(timeout=30)
    parts = _check_means(results)
    assert parts[0] == (0, 1, 2, 3)
    assert parts[79] == (0, 1, 3, 2)  # the restarted rank 2 comes after the survivors
    assert results[4].value["records"][0]["rank"] == 3


def test_the_request_of_a_joiner_killed_while_waiting_is_removed(tmp_path: Path) -> None:
    sync_dir = tmp_path / "sync"

    pids = [tmp_path / f"pid-{p}" for p in range(3)]

    def kill_once_asked() -> None:
        while not list((sync_dir / "rdzv").glob("ejoin-*")) or not all(p.exists() for p in pids):
            time.sleep(0.01)
        members = [int(p.read_text()) for p in pids[:2]]
        # Stopped (well within their heartbeat timeout), the members admit nobody while
        # the joiner is killed: its request is left for rank 0 to find dead.
        for pid in members:
            os.kill(pid, signal.SIGSTOP)
        try:
            os.kill(int(pids[2].read_text()), signal.SIGKILL)
            time.sleep(0.2)
        finally:
            for pid in members:
                os.kill(pid, signal.SIGCONT)

    killer = threading.Thread(target=kill_once_asked)
    killer.start()
    try:
        results = run_ranks(
            elastic_workers.members_and_a_joiner,
            3,
            (str(sync_dir), FAST, str(tmp_path)),
            expect=[0, 1],
            timeout_s=60,
        )
    finally:
        killer.join(timeout=30)
    assert all(len(results[p].value["records"]) == 80 for p in (0, 1))
    assert {r["world"] for p in (0, 1) for r in results[p].value["records"]} == {2}
    assert not list((sync_dir / "rdzv").glob("ejoin-*"))


def test_a_joiner_is_told_at_once_that_the_job_ended_before_admitting_it(
    tmp_path: Path,
) -> None:
    kw = {**FAST, "max_wait_s": 60.0}
    args = (str(tmp_path), kw)
    results = run_ranks(elastic_workers.a_job_that_ends_before_admitting, 3, args, timeout_s=90)
    assert all(results[p].ok for p in (0, 1)), results
    joiner = results[2]
    assert joiner.error_type == "RendezvousError", joiner
    assert re.fullmatch(
        r"rank 2 \(pid \d+ on \S+\) asked to join the running job in .+, which ended "
        r"\(its last member closed\) before admitting it",
        joiner.message,
    ), joiner.message
    assert joiner.elapsed_s < 20  # not max_wait_s (60 s)
    assert not list((tmp_path / "rdzv").glob("ejoin-*"))


def test_a_joiner_whose_job_was_killed_forms_a_new_one_with_a_fresh_rank_0(
    tmp_path: Path,
) -> None:
    # Every member SIGKILLed: the note naming the job stays, and nobody would admit the
    # joiner; it forms a job of world_size ranks with the next rank 0 instead.
    kw = {**FAST, "max_wait_s": 10.0}
    args = (str(tmp_path), kw)
    results = run_ranks(
        elastic_workers.members_killed_while_one_waits_to_join,
        4,
        args,
        expect=[2, 3],
        timeout_s=40,
    )
    assert all(results[p].ok for p in (2, 3)), results
    want = [a.tobytes() for a in gradsync.average_host_grads([grads_for(r, 0) for r in (0, 1)])]
    for proc in (2, 3):
        assert results[proc].value["seen"] == (3 - proc, 2, (0, 1))
        assert results[proc].value["after"] == want
        assert results[proc].value["s"] < 5  # not max_wait_s (10 s)
    assert not list((tmp_path / "rdzv").glob("ejoin-*"))


def test_a_joiner_with_other_settings_fails_at_once_naming_them(tmp_path: Path) -> None:
    # Before, rank 0 only logged that it would not admit it, and it waited max_wait_s.
    kw = {**FAST, "max_wait_s": 20.0}
    results = run_ranks(
        elastic_workers.joiner_with_other_settings, 3, (str(tmp_path), kw), timeout_s=60
    )
    assert all(results[p].ok for p in range(3)), results
    assert results[0].value == results[1].value == 2
    got = results[2].value
    assert got["s"] < 5, got  # not max_wait_s (20 s)
    assert re.fullmatch(
        r"MismatchError: rank 2 \(pid \d+ on \S+\) cannot join the running job in \S+: "
        r"it has wide_sum False \(this process: True\); every rank must use the same settings",
        got["error"],
    ), got["error"]


def _launch_rejoin(tmp_path: Path, nproc: int, *script_args: str) -> list[tuple[str, ...]]:
    """Run tests/scripts/elastic_rejoin.py under ``gradsync launch --elastic
    --max-restarts 1``: each process's (rank, restart, world, digest) at the end."""
    script = Path(__file__).parent / "scripts" / "elastic_rejoin.py"
    env = {**os.environ, "GRADSYNC_SYNC_DIR": str(tmp_path)}
    command = [sys.executable, "-m", "gradsync", "launch", "--elastic", "--max-restarts", "1"]
    done = subprocess.run(
        [*command, "--nproc", str(nproc), str(script), *script_args],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "restarting it (restart 1 of 1)" in done.stderr
    return sorted(re.findall(r"rank (\d) restart (\d) world (\d) digest (\w+)", done.stdout))


def test_a_rank_restarted_by_the_launcher_rejoins_and_ends_with_the_same_state(
    tmp_path: Path,
) -> None:
    lines = _launch_rejoin(tmp_path, 3)
    assert [(r, k, w) for r, k, w, _ in lines] == [
        ("0", "0", "3"),
        ("1", "0", "3"),
        ("2", "1", "3"),
    ]
    assert len({digest for *_, digest in lines}) == 1


def test_a_rank_lost_after_a_re_form_leaves_the_new_generation_to_the_others(
    tmp_path: Path,
) -> None:
    # Rank 3 exits, the others re-form; then rank 2 exits in the re-formed generation.
    # Its launcher's note must not remove that generation from under the survivors.
    lines = _launch_rejoin(tmp_path, 4, "80", "3:10", "2:25")
    assert [(r, k) for r, k, _, _ in lines] == [("0", "0"), ("1", "0"), ("2", "1"), ("3", "1")]
    assert len({digest for *_, digest in lines}) == 1


@pytest.mark.slow
def test_a_short_chaos_run_ends_with_every_rank_alive_and_the_same_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # benchmarks/chaos.py, 4 random SIGKILLs instead of 30: restarted, rejoined, converged.
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import chaos  # noqa: PLC0415

    args = chaos.parse_args(
        ["--kills", "4", "--steps", "400", "--kills-only", "--timeout-s", "120"]
    )
    _, result = chaos.chaos_run(args, tmp_path)
    assert result["problems"] == [], (tmp_path / "chaos" / "launcher.log").read_text()
    assert result["kills"] == result["restarts"] == 4
    assert result["tracebacks"] == 0
    assert result["test_acc"] > 0.9


_GPU_RANK = """
import json, sys
import numpy as np
import wgpu
import gradsync
from test_wgpu_bridge import _WGPU_LAYOUT, _wgpu_inputs

world, rank, sync_dir, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
dev = gradsync.request_device_for_rank(local_rank=rank)
usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
dtypes = [dt for _, dt in _WGPU_LAYOUT]
cfg = gradsync.FileGradSyncConfig(world, rank, sync_dir, elastic=True, **json.loads(sys.argv[5]))
bufs = [dev.create_buffer(size=n * np.dtype(dt).itemsize, usage=usage) for n, dt in _WGPU_LAYOUT]
records = []
with gradsync.GradSync(cfg) as gs:
    for step in range(5):
        for b, d in zip(bufs, _wgpu_inputs(rank, step)):
            dev.queue.write_buffer(b, 0, d)
        stats = gs.average(bufs, device=dev, dtype=dtypes)
        after = b"".join(bytes(dev.queue.read_buffer(b)) for b in bufs)
        records.append({"step": stats.step, "members": stats.members, "after": after.hex()})
with open(out, "w") as f:
    json.dump(records, f)
"""


@pytest.mark.wgpu
@pytest.mark.parametrize("phase", ["after_publish", "after_output"])
def test_gpu_buffers_of_the_survivors_of_a_lost_rank_get_the_mean_of_the_rest(
    tmp_path: Path, phase: str
) -> None:
    from test_wgpu_bridge import _adapter_reason, _run_rank_scripts, _wgpu_inputs  # noqa: PLC0415

    if (reason := _adapter_reason()) is not None:
        pytest.skip(reason)
    outs = _run_rank_scripts(
        tmp_path,
        _GPU_RANK,
        3,
        [json.dumps(FAST)],
        fault=f"{phase}@2@3=sigkill",
        returncodes={2: -signal.SIGKILL},
    )
    survivors = [json.loads(outs[r].read_text()) for r in (0, 1)]
    assert survivors[0] == survivors[1]  # the same members and bits on both
    members = [tuple(rec["members"]) for rec in survivors[0]]
    assert members[:2] == [(0, 1, 2)] * 2, members
    assert members[3:] == [(0, 1)] * 2, members
    for rec in survivors[0]:
        inputs = [_wgpu_inputs(r, rec["step"]) for r in rec["members"]]
        want = b"".join(a.tobytes() for a in gradsync.average_host_grads(inputs))
        assert bytes.fromhex(rec["after"]) == want, rec["step"]


def test_a_broadcast_comes_from_the_process_at_the_root_rank_when_two_share_a_started_rank(
    tmp_path: Path,
) -> None:
    # The root was looked up by the rank it was started as: the first rank 1 sent its
    # state; and a joiner started with a smaller world size refused root 3.
    results = run_ranks(
        elastic_workers.broadcast_from_a_second_rank_1, 4, (3, str(tmp_path), FAST),
        timeout_s=60, spawn=True,
    )  # fmt: skip
    for proc in range(4):
        assert results[proc].ok, results[proc].value
        assert results[proc].value["members"] == (0, 1, 2, 1)
        assert results[proc].value["state"] == 103.0, (proc, results[proc].value)


def _state(pid: int) -> str | None:
    """The state letter of process ``pid`` (None once it is gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _named_epoch(sync_dir: Path) -> int | None:
    """The epoch of the generation ``rdzv/current.json`` names, if its roster says."""
    try:
        gen = json.loads((sync_dir / "rdzv" / "current.json").read_text())["gen"]
        return int(json.loads((sync_dir / f"gen-{gen}" / "roster.json").read_text())["epoch"])
    except (OSError, ValueError, KeyError):
        return None


def _resume_the_stale_decider(sync_dir: Path, marks: Path) -> None:
    """Once rank 0 stopped after deciding the first change and the others made the
    second without it, resume it; once it has failed, let the joiner start."""
    deadline = time.monotonic() + 60
    while not (marks / "pid-0").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    pid = int((marks / "pid-0").read_text())
    while _named_epoch(sync_dir) != 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(pid, signal.SIGCONT)
    while _state(pid) not in (None, "Z") and time.monotonic() < deadline:
        time.sleep(0.01)
    (marks / "go").touch()


def test_a_decider_resumed_after_a_later_change_leaves_the_job_named_for_joiners(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Rank 3 dies in call 3; rank 0 decides the change and stops before naming the new
    # generation. The others name it, find it silent (each is a host of its own: by its
    # heartbeat) and go on without it (epoch 2); then rank 0 resumes. Before, it named
    # its own generation, dead by then, as the running job (removing the note as it
    # failed), and a joiner found no job: it waited max_wait_s.
    sync_dir, marks = tmp_path / "sync", tmp_path / "marks"
    marks.mkdir()
    kw = {**FAST, "max_wait_s": 10.0}
    resumer = threading.Thread(target=_resume_the_stale_decider, args=(sync_dir, marks))
    resumer.start()
    try:
        with fault("before_publish@3@3=sigkill,after_decide@0@3=sigstop", monkeypatch):
            results = run_ranks(
                elastic_workers.a_joiner_after_a_stale_decider,
                5,
                (str(sync_dir), kw, str(marks)),
                expect=[1, 2, 4],
                timeout_s=90,
            )
    finally:
        resumer.join(timeout=60)
    joiner = results[4].value
    assert "error" not in joiner, joiner
    assert joiner["members"] == (1, 2, 3)
    assert joiner["s"] < kw["max_wait_s"]


def test_a_next_run_after_every_host_was_killed_forms_once_their_heartbeats_are_still(
    tmp_path: Path,
) -> None:
    # Before, its processes took the dead job (members on other hosts, no left notes,
    # rdzv/current.json naming it) for a running one and each waited max_wait_s to join.
    kw = {**FAST, "heartbeat_timeout_s": 2.0, "max_wait_s": 20.0}
    results = run_ranks(
        elastic_workers.hosts_killed_then_a_next_run,
        4,
        (str(tmp_path / "sync"), kw),
        expect=[2, 3],
        timeout_s=60,
    )
    for proc in (2, 3):
        value = results[proc].value
        assert "error" not in value, value
        assert value["world"] == 2
        assert value["s"] < kw["max_wait_s"] / 2
