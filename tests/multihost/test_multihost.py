"""gradsync across two simulated hosts sharing a JuiceFS volume (the rig in ``rig/``).

Each host has its own PID/UTS/IPC/mount/net namespaces and its own JuiceFS client
at /mnt/shared. Every job runs ``python -m gradsync launch --nnodes 2 --node-rank K
--nproc 2`` inside each host (through on.sh) with ``worker.py`` as the script; the
ranks write their results to a directory outside the hosts' private /tmp, and the
test compares them with :func:`gradsync.average_host_grads` of the same inputs.

Runs only where it can (root, /dev/fuse, unshare and ip netns working, what
``rig/deps.sh`` checks installed); otherwise every test is skipped with what is missing.
``GRADSYNC_MULTIHOST=require`` turns the skip into a failure (CI sets it),
``GRADSYNC_MULTIHOST=0`` skips it. The cluster is brought up afresh once for the
module (whatever a killed earlier run left is removed first) and torn down (down.sh)
whatever happens.
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from mh_cluster import MOUNT, Cluster, Job, running_cluster, steps_of
from mh_data import digest, grads_for

import gradsync

W = 4  # 2 hosts x 2 ranks
TWO_HOSTS = {"h1": 0, "h2": 1}
HB_TIMEOUT_S = 5.0
HB = ["--hb-interval", "0.5", "--hb-timeout", str(HB_TIMEOUT_S)]
JOB_TIMEOUT_S = 60.0

pytestmark = pytest.mark.timeout(180)


# ---------------------------------------------------------------- fixtures and helpers


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with running_cluster(2, "gradsync-mh-tests") as c:
        yield c


def _unique(label: str) -> str:
    return f"{label}-{uuid.uuid4().hex[:10]}"


def _out(cluster: Cluster, label: str) -> Path:
    out = cluster.base / _unique(label)
    out.mkdir()
    return out


def _json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())  # type: ignore[no-any-return]
    except (FileNotFoundError, ValueError):
        return None


def _expected(seed: int, steps: int, layout: str = "mixed") -> list[list[np.ndarray]]:
    return [
        gradsync.average_host_grads([grads_for(seed, r, s, layout) for r in range(W)])
        for s in range(steps)
    ]


def _run(cluster: Cluster, job: Job, timeout_s: float = JOB_TIMEOUT_S) -> None:
    codes = job.wait(timeout_s)
    assert all(c == 0 for c in codes.values()), f"exit codes {codes}\n{job.log_text()}"


def _check_results(out: Path, seed: int, steps: int, job: Job, layout: str = "mixed") -> None:
    """Every rank's every step equals average_host_grads of the inputs, bit for bit."""
    expected = _expected(seed, steps, layout)
    for r in range(W):
        got = steps_of(out, r)
        assert [g["step"] for g in got] == list(range(steps)), f"rank {r}\n{job.log_text()}"
        for s in range(steps):
            raw = (out / f"raw-{r}-{s}").read_bytes()
            want = b"".join(a.tobytes() for a in expected[s])
            assert raw == want, f"rank {r} step {s}: mean differs from average_host_grads"
            assert got[s]["sha256"] == digest(expected[s])


def _pids(out: Path, ranks: list[int]) -> list[int]:
    """Launcher and rank pids (host PID namespace numbering) of ``ranks``."""
    pids: set[int] = set()
    for r in ranks:
        info = _json(out / f"pid-{r}.json")
        assert info is not None, f"rank {r} wrote no pid file"
        pids.update((info["pid"], info["ppid"]))
    return sorted(pids)


def _listing(cluster: Cluster, host: str, path: str) -> list[str]:
    r = cluster.on(
        host, "find", path, "-mindepth", "1", "-maxdepth", "3", "-printf", "%P %s\n", timeout_s=30
    )
    return r.stdout.splitlines()


# ---------------------------------------------------------------- 1 and 4: correct bits


@pytest.fixture(scope="module")
def two_host_run(cluster: Cluster) -> tuple[Path, int, int]:
    seed, steps = 1, 5
    out = _out(cluster, "two-host")
    run_id = _unique("two")
    job = cluster.launch(TWO_HOSTS, 2, f"{MOUNT}/{run_id}", run_id, [
        "--seed", str(seed), "--steps", str(steps), "--raw", *HB,
    ], out)  # fmt: skip
    _run(cluster, job)
    _check_results(out, seed, steps, job)
    return out, seed, steps


def test_two_hosts_bit_identical_means(two_host_run: tuple[Path, int, int]) -> None:
    out, _, steps = two_host_run
    hosts = {_json(out / f"pid-{r}.json")["host"] for r in range(W)}  # type: ignore[index]
    assert hosts == {"h1", "h2"}, "ranks did not run in two hosts"
    for s in range(steps):
        assert len({(out / f"raw-{r}-{s}").read_bytes() for r in range(W)}) == 1


def test_one_host_matches_two_hosts(cluster: Cluster, two_host_run: tuple[Path, int, int]) -> None:
    """The same job with 4 ranks on one host (tmpfs sync dir) gives the same bits."""
    two_out, seed, steps = two_host_run
    out = _out(cluster, "one-host")
    run_id = _unique("one")
    job = cluster.launch({"h1": 0}, 4, f"/dev/shm/{run_id}", run_id, [
        "--seed", str(seed), "--steps", str(steps), "--raw", *HB,
    ], out)  # fmt: skip
    _run(cluster, job)
    _check_results(out, seed, steps, job)
    for r in range(W):
        for s in range(steps):
            assert (out / f"raw-{r}-{s}").read_bytes() == (two_out / f"raw-{r}-{s}").read_bytes()


def test_compression_applies_across_hosts_and_not_on_one_host(
    cluster: Cluster, two_host_run: tuple[Path, int, int]
) -> None:
    """int8 across two hosts: every rank the same bits, not the exact ones; the same job
    on one host over tmpfs runs uncompressed, giving the exact bits of the plain run."""
    plain, seed, _ = two_host_run
    steps = 2
    runs = {}
    for label, placement, nproc, root in (
        ("int8-two", TWO_HOSTS, 2, MOUNT),
        ("int8-one", {"h1": 0}, 4, "/dev/shm"),
    ):
        out = _out(cluster, label)
        run_id = _unique(label)
        job = cluster.launch(placement, nproc, f"{root}/{run_id}", run_id, [
            "--seed", str(seed), "--steps", str(steps), "--raw", "--compression", "int8", *HB,
        ], out)  # fmt: skip
        _run(cluster, job)
        runs[label] = out
    for s in range(steps):
        exact = (plain / f"raw-0-{s}").read_bytes()
        two = {(runs["int8-two"] / f"raw-{r}-{s}").read_bytes() for r in range(W)}
        assert len(two) == 1
        assert two != {exact}
        for r in range(W):
            assert (runs["int8-one"] / f"raw-{r}-{s}").read_bytes() == exact
    for r in range(W):
        assert {g["compression"] for g in steps_of(runs["int8-two"], r)} == {"int8"}
        assert {g["compression"] for g in steps_of(runs["int8-one"], r)} == {None}


def _across_hosts_and_on_one(
    cluster: Cluster, tag: str, seed: int, steps: int, layout: str, codec: str | None
) -> list[bytes]:
    """Each step's mean of ``layout`` over 2 hosts x 2 ranks (the shared volume) and over
    one host x 4 (tmpfs, compress_local): the same bytes on all 8 ranks, returned."""
    mount = os.environ.get("MH_MOUNT", MOUNT)
    args = ["--seed", str(seed), "--steps", str(steps), "--raw", "--layout", layout, *HB]
    args += [] if codec is None else ["--compression", codec]
    outs = []
    for placement, nproc, root, more in (
        (TWO_HOSTS, 2, mount, []),
        ({"h1": 0}, 4, "/dev/shm", [] if codec is None else ["--compress-local"]),
    ):
        out = _out(cluster, f"{tag}-{codec}")
        run_id = _unique(f"{tag}-{codec}")
        job = cluster.launch(placement, nproc, f"{root}/{run_id}", run_id, args + more, out)
        _run(cluster, job)
        outs.append(out)
    means = []
    for s in range(steps):
        got = {(outs[0] / f"raw-{r}-{s}").read_bytes() for r in range(W)}
        assert got == {(outs[1] / f"raw-{r}-{s}").read_bytes() for r in range(W)}
        assert len(got) == 1, f"step {s}: ranks differ"
        means.append(got.pop())
    return means


@pytest.mark.parametrize("codec", ["bf16", "int8"])
def test_compressed_steps_across_hosts_give_one_hosts_bits(cluster: Cluster, codec: str) -> None:
    """Across hosts a rank's input is a file for each peer, holding what that peer
    reduces, read by pread; on one host (tmpfs, compress_local) files are mapped and
    written whole: same bits."""
    # 1 MiB and a bit of float32: sharded, and the last shard ends the payload unpadded.
    seed, steps, layout = 3, 3, "f32:1049600"
    means = _across_hosts_and_on_one(cluster, "compressed", seed, steps, layout, codec)
    exact = _expected(seed, steps, layout)
    for s, raw in enumerate(means):
        mean = np.frombuffer(raw, dtype=np.float32)
        assert np.allclose(mean, exact[s][0], rtol=0, atol=0.05 * np.abs(exact[s][0]).max())


@pytest.mark.parametrize("codec", [None, "int8"])
def test_a_payload_every_rank_reduces_across_hosts_gives_one_hosts_bits(
    cluster: Cluster, codec: str | None
) -> None:
    """1 MiB and a bit: across hosts (W=4) under 4 MiB / (W - 1), so every rank reduces
    all of it and publishes no shard; on one host (tmpfs) over 256 KiB, so sharded."""
    seed, steps, layout = 7, 3, "f32:262400"
    means = _across_hosts_and_on_one(cluster, "replicated", seed, steps, layout, codec)
    if codec is None:
        assert means == [step[0].tobytes() for step in _expected(seed, steps, layout)]


@pytest.mark.parametrize("codec", [None, "int8"])
def test_a_file_per_shard_across_hosts_gives_one_hosts_bits(
    cluster: Cluster, codec: str | None
) -> None:
    """Past 1 MiB a shard, across hosts a rank's input is a file per peer holding what
    that peer reduces (16 MiB and a bit of float32: int8's shards too); on one host
    (tmpfs) one file a rank, mapped: same bits."""
    seed, steps, layout = 5, 3, "f32:16781312"
    means = _across_hosts_and_on_one(cluster, "shard-files", seed, steps, layout, codec)
    if codec is None:
        assert means == [step[0].tobytes() for step in _expected(seed, steps, layout)]


def test_layout_changes_between_steps_across_hosts(cluster: Cluster) -> None:
    """Big (one file a rank) and small (two alternating slots) steps in turn, one rank
    late to every step: the files of one never overwrite what a reader of the other
    still reads, and the markers moved from step to step show up on the other host."""
    seed, steps = 3, 7
    layout = "cycle:f32:524288+mixed"
    out = _out(cluster, "layouts")
    run_id = _unique("layouts")
    job = cluster.launch(TWO_HOSTS, 2, f"{MOUNT}/{run_id}", run_id, [
        "--seed", str(seed), "--steps", str(steps), "--raw", "--layout", layout,
        "--stall", "3:2:0.3", *HB,
    ], out)  # fmt: skip
    _run(cluster, job)
    _check_results(out, seed, steps, job, layout)


# ---------------------------------------------------------------- 2: earlier runs ignored


@pytest.fixture(scope="module")
def killed_then_rerun(cluster: Cluster) -> dict[str, Any]:
    """Kill a job hard mid-run, then run a new one in the same dir with the same run id.

    The second job swaps the hosts' node ranks, so its rank 0 (now on h2) meets the
    dead rank 0 of h1 only through its heartbeat, the cross-host path.
    """
    run_id = _unique("requeue")
    sync_dir = f"{MOUNT}/{run_id}"
    out_a = _out(cluster, "killed")
    job_a = cluster.launch(TWO_HOSTS, 2, sync_dir, run_id, [
        "--seed", "7", "--steps", "1000", "--step-sleep", "0.05", "--raw", *HB,
    ], out_a)  # fmt: skip
    try:
        job_a.wait_until(
            lambda: all(len(steps_of(out_a, r)) >= 3 for r in range(W)),
            JOB_TIMEOUT_S,
            "3 steps of the first job",
        )
        for host, ranks in (("h1", [0, 1]), ("h2", [2, 3])):
            cluster.kill_in_host(host, _pids(out_a, ranks))
        codes = job_a.wait(20)
    finally:
        job_a.stop()
    assert all(c != 0 for c in codes.values()), codes  # killed, not finished
    assert not any((out_a / f"done-{r}.json").exists() for r in range(W))
    left = _listing(cluster, "h1", sync_dir)
    assert any("/s-" in line for line in left), f"the killed job left no step files: {left}"

    seed_b, steps_b = 8, 4
    out_b = _out(cluster, "after-kill")
    t0 = time.monotonic()
    job_b = cluster.launch({"h2": 0, "h1": 1}, 2, sync_dir, run_id, [
        "--seed", str(seed_b), "--steps", str(steps_b), "--raw", *HB,
    ], out_b)  # fmt: skip
    _run(cluster, job_b)
    t_b_end = time.monotonic()
    print(f"\nsecond job after a hard kill took {t_b_end - t0:.1f} s (hb timeout 5 s)")
    return {
        "sync_dir": sync_dir, "run_id": run_id, "t_b_end": t_b_end, "out_a": out_a,
        "out_b": out_b, "job_b": job_b, "seed_b": seed_b, "steps_b": steps_b,
    }  # fmt: skip


def test_killed_run_is_never_read(killed_then_rerun: dict[str, Any]) -> None:
    k = killed_then_rerun
    _check_results(k["out_b"], k["seed_b"], k["steps_b"], k["job_b"])
    gen_a = {s["gen"] for r in range(W) for s in steps_of(k["out_a"], r)}
    gen_b = {s["gen"] for r in range(W) for s in steps_of(k["out_b"], r)}
    assert len(gen_a) == 1, gen_a
    assert len(gen_b) == 1, gen_b
    assert gen_a != gen_b


def test_killed_multihost_runs_files_are_removed(
    cluster: Cluster, killed_then_rerun: dict[str, Any]
) -> None:
    """A later job on the host of the second one's rank 0 removes it, once that job's look
    at its heartbeats is a heartbeat timeout old."""
    k = killed_then_rerun
    gen_a = next(s["gen"] for s in steps_of(k["out_a"], 0))
    # The second job's look came before it ended; timed from the kill instead, a second
    # job slow to start would leave the third too short a span to judge.
    time.sleep(max(0.0, k["t_b_end"] + HB_TIMEOUT_S + 0.2 - time.monotonic()))
    out_c = _out(cluster, "cleanup")
    job_c = cluster.launch({"h2": 0, "h1": 1}, 2, k["sync_dir"], k["run_id"], [
        "--seed", "9", "--steps", "1", *HB,
    ], out_c)  # fmt: skip
    _run(cluster, job_c)
    left = _listing(cluster, "h1", k["sync_dir"])
    assert not any(Path(gen_a).name in line for line in left), "\n".join(left)


# ---------------------------------------------------------------- 3: losing a host


def _lost_host_job(cluster: Cluster, label: str) -> tuple[Job, Path]:
    run_id = _unique(label)
    out = _out(cluster, label)
    job = cluster.launch(TWO_HOSTS, 2, f"{MOUNT}/{run_id}", run_id, [
        "--seed", "3", "--steps", "1000", "--step-sleep", "0.05", "--expect-loss", *HB,
    ], out)  # fmt: skip
    job.wait_until(
        lambda: all(len(steps_of(out, r)) >= 2 for r in range(W)), JOB_TIMEOUT_S, "2 steps"
    )
    return job, out


def _assert_survivors_name_lost_ranks(out: Path, t_kill: float, job: Job) -> list[float]:
    delays = []
    for r in (0, 1):
        err = _json(out / f"error-{r}.json")
        assert err is not None, f"rank {r} on h1 recorded no error\n{job.log_text()}"
        assert err["type"] == "PeerLostError", err
        assert err["ranks"], err
        assert set(err["ranks"]) <= {2, 3}, err
        assert any(f"rank {q}" in err["message"] for q in err["ranks"]), err
        assert "h2" in err["message"], err
        delays.append(err["t"] - t_kill)
        assert delays[-1] < 30.0, f"rank {r} took {delays[-1]:.1f} s to notice: {err}"
    return delays


def test_killing_a_hosts_processes_is_reported(cluster: Cluster) -> None:
    """SIGKILL the launcher and both ranks of h2: h1's ranks raise PeerLostError naming them."""
    job, out = _lost_host_job(cluster, "host-procs")
    try:
        t_kill = time.time()
        cluster.kill_in_host("h2", _pids(out, [2, 3]))
        codes = job.wait(40)
    finally:
        job.stop()
    assert codes["h1"] == 0, f"h1's launcher: {codes}\n{job.log_text()}"
    delays = _assert_survivors_name_lost_ranks(out, t_kill, job)
    print(f"\nh1's ranks raised PeerLostError {max(delays):.1f} s after h2's processes died")


def test_stopping_a_hosts_launcher_is_reported_as_such_at_once(cluster: Cluster) -> None:
    """SIGTERM to h2's launcher: it stops its ranks and leaves the job on their behalf, so
    h1's ranks name them stopped, without waiting out their heartbeats."""
    job, out = _lost_host_job(cluster, "host-stop")
    try:
        t_stop = time.time()
        job.procs["h2"].send_signal(signal.SIGKILL)  # nsenter dies -> launcher gets SIGTERM
        codes = job.wait(40)
    finally:
        job.stop()
    assert codes["h1"] == 0, f"h1's launcher: {codes}\n{job.log_text()}"
    delays = _assert_survivors_name_lost_ranks(out, t_stop, job)
    for r in (0, 1):
        message = _json(out / f"error-{r}.json")["message"]
        assert "was stopped by its launcher (killed by SIGTERM)" in message, message
        assert "heartbeat" not in message, message
    print(f"\nh1's ranks raised PeerLostError {max(delays):.1f} s after h2's launcher was stopped")


def test_killing_a_hosts_juicefs_client_is_reported(cluster: Cluster) -> None:
    """SIGKILL h2's JuiceFS client (its ranks live on, cut off): h1's ranks raise in time."""
    job, out = _lost_host_job(cluster, "host-jfs")
    try:
        pids = cluster.juicefs_pids("h2")
        assert pids, "found no JuiceFS client in h2"
        t_kill = time.time()
        for pid in pids:
            os.kill(pid, 9)
        codes = job.wait(40)
        delays = _assert_survivors_name_lost_ranks(out, t_kill, job)
        assert codes["h1"] == 0, f"h1's launcher: {codes}\n{job.log_text()}"
        print(f"\nh1's ranks raised PeerLostError {max(delays):.1f} s after h2's client died")
    finally:
        job.stop()
        cluster.up()  # h2's mount is dead: up.sh rebuilds the cluster for later tests


# ---------------------------------------------------------------- heartbeats do cross


def test_slow_peer_on_other_host_is_not_declared_lost(cluster: Cluster) -> None:
    """Rank 3 (h2) stalls 2.5x the heartbeat timeout; its heartbeat keeps the others waiting."""
    run_id = _unique("slow")
    out = _out(cluster, "slow")
    job = cluster.launch(TWO_HOSTS, 2, f"{MOUNT}/{run_id}", run_id, [
        "--seed", "5", "--steps", "3", "--raw", "--stall", "3:1:5",
        "--hb-interval", "0.25", "--hb-timeout", "2",
    ], out)  # fmt: skip
    _run(cluster, job)
    _check_results(out, 5, 3, job)
