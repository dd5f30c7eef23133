"""``gradsync status``: which rank is everyone waiting for?"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import gradsync
import gradsync._cli.status
import gradsync._job.liveness
import workers
from gradsync._names import member_rank
from gradsync._store.dirs import OWN_MARK
from ranks import run_ranks


def _own(gen: Path) -> Path:
    """Make the generation directory ``gen`` as gradsync does: with its mark."""
    gen.mkdir(parents=True, exist_ok=True)
    (gen / OWN_MARK).touch()
    return gen


def _listed(path: object) -> str:
    """What ``os.listdir`` was given: a path, or a descriptor (its path, from /proc)."""
    return os.readlink(f"/proc/self/fd/{path}") if isinstance(path, int) else str(path)


def _status(sync_dir: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gradsync", "status", str(sync_dir), *extra],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _stuck(rank: int, world: int, sync_dir: str, big: bool, across_hosts: bool = False) -> object:
    """Ranks 0 and 1 average two steps; rank 2 stops after one and idles, alive, until
    the test has read the status (at most 30 s), then makes its second call. With
    ``across_hosts`` the sync dir is taken for one other hosts share."""
    if across_hosts:
        from gradsync._step import state as _state  # noqa: PLC0415

        _state.local_filesystem = lambda path: False  # type: ignore[assignment]
    gs = gradsync.GradSync(gradsync.FileGradSyncConfig(world, rank, sync_dir, max_wait_s=40.0))
    shapes = workers.SHAPES_HUGE if across_hosts else workers.SHAPES_BIG if big else workers.SHAPES
    gs.average(workers.grads_for(rank, 0, shapes), step=7)
    if rank == 2:
        workers.linger(sync_dir, ["status"], 30.0)
    gs.average(workers.grads_for(rank, 1, shapes), step=8)
    gs.close()
    return "averaged"


@pytest.mark.parametrize(
    ("big", "across_hosts"),
    [(False, False), (True, False), (True, True)],
    ids=["two-slots", "one-slot", "a-file-per-shard"],
)
def test_status_names_the_rank_everyone_waits_for(
    tmp_path: Path, big: bool, across_hosts: bool
) -> None:
    # Small gradients alternate two data files per rank, large ones reuse one, and
    # across hosts a huge one is a file per peer: the step of every rank's last call
    # is read from whichever holds that call.
    box: dict[str, object] = {}
    args = (3, str(tmp_path), big, across_hosts)
    thread = threading.Thread(target=lambda: box.update(run_ranks(_stuck, 3, args, timeout_s=60)))
    thread.start()
    try:
        deadline = 30
        text = ""
        start = time.monotonic()
        while time.monotonic() - start < deadline:
            result = _status(tmp_path)
            text = result.stdout
            if "are waiting for ranks [2] to publish" in text:  # not "to join", earlier
                break
            time.sleep(0.2)
        assert re.search(r"generation \w+: running", text), text
        assert re.search(r"rank 0: pid \d+ on \S+, alive, last published call 2 \(step 8\)", text)
        assert re.search(r"rank 2: pid \d+ on \S+, alive, last published call 1 \(step 7\)", text)
        assert "ranks [0, 1] are waiting for ranks [2] to publish their gradients (call 2)" in text
        report = json.loads(_status(tmp_path, "--json").stdout)
        (job,) = report["jobs"]
        assert job["waiting"] == {"for": [2], "by": [0, 1], "what": "gradients", "call": 2}
        assert [r["alive"] for r in job["ranks"]] == [True, True, True]
    finally:
        workers.mark_done(str(tmp_path), "status")
        thread.join(60)
    assert {r: o.value for r, o in box.items()} == {0: "averaged", 1: "averaged", 2: "averaged"}


def test_status_of_a_missing_directory(tmp_path: Path) -> None:
    result = _status(tmp_path / "nope")
    assert result.returncode == 1
    assert result.stderr == f"gradsync status: {tmp_path / 'nope'} is not a directory\n"


def test_status_while_the_job_removes_what_it_lists(tmp_path: Path) -> None:
    # A running job removes its old step directories (and, at its end, everything)
    # between status's listing of a directory and its look inside.
    gen = tmp_path / "gen-0123456789abcdef"
    for seq in (1, 2, 3):
        (_own(gen) / f"s-{seq}").mkdir(parents=True)
    (gen / "s-3" / "in-0").touch()
    me = gradsync._job.liveness.MemberInfo.for_self(0, "0123456789abcdef")
    (gen / "roster.json").write_text(json.dumps({"members": [me.to_json()], "run_id": None}))
    real = os.listdir

    def racing(path: object) -> list[str]:
        if _listed(path).endswith(("s-1", "s-2")):
            raise FileNotFoundError(2, "No such file or directory", str(path))
        return real(path)  # type: ignore[arg-type]

    report = gradsync._cli.status.describe(tmp_path, sample_s=0.0, listdir=racing)
    (job,) = report["jobs"]
    assert job["ranks"][0]["last_call"] == 3


def test_status_of_an_unreadable_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def denied(path: object) -> list[str]:
        raise PermissionError(13, "Permission denied", str(path))

    assert gradsync._cli.status.status_main(tmp_path, as_json=False, listdir=denied) == 1
    assert capsys.readouterr().err == (
        f"gradsync status: cannot read {tmp_path}: Permission denied\n"
    )


def test_status_of_a_job_whose_ranks_all_died(tmp_path: Path) -> None:
    # Every rank published call 2 and died hard: nobody is running or waiting any more.
    assert run_ranks(workers.crash_after_publish, 3, (3, str(tmp_path)), expect=[]) == {}
    report = gradsync._cli.status.describe(tmp_path, sample_s=0.0)
    (job,) = report["jobs"]
    assert job["state"] == "stopped (every rank is gone: the next job in this directory removes it)"
    assert [r["alive"] for r in job["ranks"]] == [False, False, False]
    assert "waiting" not in job


def _rendezvous_of_3(sync_dir: Path) -> Path:
    """A job of 3 in its rendezvous, whose rank 0 is this live process: its directory."""
    gen = _own(sync_dir / "gen-00000000000000aa")
    (sync_dir / "rdzv").mkdir()
    leader = gradsync._job.liveness.MemberInfo.for_self(0, "00000000000000aa")
    (sync_dir / "rdzv" / "leader-00000000000000aa.json").write_text(
        json.dumps({"member": leader.to_json(), "world_size": 3, "run_id": None})
    )
    return gen


def test_status_names_the_ranks_a_rendezvous_waits_for(tmp_path: Path) -> None:
    # Ranks 0 and 2 of 3 are in (both this live process); rank 1 never came.
    gen = _rendezvous_of_3(tmp_path)
    joiner = gradsync._job.liveness.MemberInfo.for_self(2, "00000000000000bb")
    (gen / "member-2-00000000000000bb.json").write_text(json.dumps({"member": joiner.to_json()}))
    report = gradsync._cli.status.describe(tmp_path, sample_s=0.0)
    (job,) = report["jobs"]
    assert job["state"] == "rendezvous"
    assert job["waiting"] == {"for": [1], "by": [0, 2], "what": "join"}
    assert "    ranks [0, 2] are waiting for ranks [1] to join" in gradsync._cli.status.render(
        report
    )


def test_ranks_waiting_for_a_rank_0_not_started_are_shown(tmp_path: Path) -> None:
    # Node 1 started before node 0: its ranks 2 and 3 wait for a rank 0 that has no
    # generation yet; only their join files say so. A join already answered by an offer,
    # or of a run whose rendezvous is in progress, is not waiting for rank 0.
    rdzv = tmp_path / "rdzv"
    rdzv.mkdir()
    for rank, nonce, run_id in [(2, "a2", "J"), (3, "a3", "J"), (1, "b1", "K")]:
        me = gradsync._job.liveness.MemberInfo.for_self(rank, nonce.rjust(16, "0"))
        (rdzv / f"join-{rank}-{me.nonce}.json").write_text(
            json.dumps({"member": me.to_json(), "world_size": 4, "run_id": run_id})
        )
    (rdzv / f"offer-{'b1'.rjust(16, '0')}.json").write_text("{}")
    result = _status(tmp_path)
    assert result.returncode == 0, result.stderr
    assert "  run id 'J': no rendezvous yet\n" in result.stdout
    assert "    ranks [2, 3] are waiting for rank 0 to start the rendezvous" in result.stdout
    assert "'K'" not in result.stdout
    (run,) = gradsync._cli.status.describe(tmp_path, sample_s=0.0)["joining"]
    assert run["waiting"] == {"for": [0], "by": [2, 3], "what": "rank 0"}
    assert [r["alive"] for r in run["ranks"]] == [True, True]


def _a_job_and_a_joiner(proc: int, sync_dir: str) -> object:
    """Processes 0 and 1 average once as an elastic job of 2, then again once the test
    has read the status (at most 30 s), and once more; process 2, started as rank 1, asks
    to join meanwhile and is admitted at that second call. The world size each ends with."""
    cfg = gradsync.FileGradSyncConfig(2, min(proc, 1), sync_dir, elastic=True, max_wait_s=20.0)
    if proc == 2:
        while not Path(f"{sync_dir}.done-formed").exists():
            time.sleep(0.01)
    with gradsync.GradSync(cfg) as gs:
        gs.average(workers.grads_for(proc, 0))
        if proc == 0:
            workers.mark_done(sync_dir, "formed")
        if proc < 2:
            workers.linger(sync_dir, ["status"], 30.0)
            gs.average(workers.grads_for(proc, 1))
            gs.average(workers.grads_for(proc, 2))  # the joiner's first call
        return gs.world_size


def test_processes_waiting_to_join_a_running_elastic_job_are_shown(tmp_path: Path) -> None:
    box: dict[int, object] = {}
    args = (str(tmp_path),)
    thread = threading.Thread(target=lambda: box.update(run_ranks(_a_job_and_a_joiner, 3, args)))
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not list((tmp_path / "rdzv").glob("ejoin-*")) and time.monotonic() < deadline:
            time.sleep(0.01)
        result = _status(tmp_path)
        assert result.returncode == 0, result.stderr
        assert "  no run id: asking to join the running elastic job\n" in result.stdout
        assert re.search(r"\n    rank 1: pid \d+ on \S+, alive\n", result.stdout), result.stdout
        assert "    ranks [1] are waiting for its rank 0 to admit them" in result.stdout
        (run,) = json.loads(_status(tmp_path, "--json").stdout)["joining"]
        assert run["elastic"] is True
        assert run["waiting"] == {"for": [0], "by": [1], "what": "admission"}
        assert [r["alive"] for r in run["ranks"]] == [True]
    finally:
        workers.mark_done(str(tmp_path), "status")
        thread.join(timeout=60)
    assert {p: o.value for p, o in box.items()} == {0: 3, 1: 3, 2: 3}  # type: ignore[attr-defined]


def test_jobs_sharing_a_directory_are_shown_with_their_run_ids(tmp_path: Path) -> None:
    # A running job (its roster names its run id) beside one in its rendezvous (its
    # leader file does); a job without a run id shows none.
    gen = _own(tmp_path / "gen-00000000000000cc")
    me = gradsync._job.liveness.MemberInfo.for_self(0, "00000000000000cc")
    (gen / "roster.json").write_text(json.dumps({"members": [me.to_json()], "run_id": "alpha"}))
    _rendezvous_of_3(tmp_path)
    leader = tmp_path / "rdzv" / "leader-00000000000000aa.json"
    leader.write_text(json.dumps({**json.loads(leader.read_text()), "run_id": "beta"}))
    _own(tmp_path / "gen-00000000000000dd")
    report = gradsync._cli.status.describe(tmp_path, sample_s=0.0)
    assert [job.get("run_id") for job in report["jobs"]] == ["beta", "alpha", None]
    lines = [ln for ln in gradsync._cli.status.render(report).splitlines() if "generation" in ln]
    assert [ln.split(",")[0] for ln in lines] == [
        "  generation 00000000000000aa (run id 'beta'): rendezvous",
        "  generation 00000000000000cc (run id 'alpha'): running",
        "  generation 00000000000000dd: rendezvous",
    ]


def test_one_unreadable_job_is_named_and_the_others_shown(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in ("gen-00000000000000aa", "gen-00000000000000bb"):
        _own(tmp_path / name)
    locked = tmp_path / "gen-00000000000000aa"
    real = os.listdir

    def denied(path: object) -> list[str]:
        if _listed(path) == str(locked):
            raise PermissionError(13, "Permission denied", str(locked))
        return real(path)  # type: ignore[arg-type]

    assert gradsync._cli.status.status_main(tmp_path, as_json=False, listdir=denied) == 1
    out = capsys.readouterr().out
    assert (
        "  generation 00000000000000aa: unreadable, 0 bytes\n"
        f"    error: cannot read {locked}: Permission denied\n" in out
    )
    assert "  generation 00000000000000bb: rendezvous" in out


def test_status_of_a_directory_that_cannot_be_looked_up(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Where a parent may not be searched, looking the directory up fails with EACCES:
    # that is no missing directory.
    def denied(path: object) -> list[str]:
        raise PermissionError(13, "Permission denied", str(path))

    inner = tmp_path / "inner"
    assert gradsync._cli.status.status_main(inner, as_json=False, listdir=denied) == 1
    assert capsys.readouterr().err == (
        f"gradsync status: cannot read {tmp_path / 'inner'}: Permission denied\n"
    )


def test_a_rank_on_another_host_is_never_judged_gone(tmp_path: Path) -> None:
    # Its heartbeat may beat less often than status samples it (heartbeat_interval_s
    # up to 1e9 s): a live two-host job used to show as stopped.
    gen = _own(tmp_path / "gen-00000000000000aa")
    me = gradsync._job.liveness.MemberInfo.for_self(0, "00000000000000aa").to_json()
    far = {**gradsync._job.liveness.MemberInfo.for_self(1, "00000000000000bb").to_json()}
    far["host_id"] = "elsewhere/boot/pidns"
    (gen / "roster.json").write_text(json.dumps({"members": [me, far], "run_id": None}))
    (gen / "left-0").write_text("{}")
    report = gradsync._cli.status.describe(tmp_path, sample_s=0.0)
    (job,) = report["jobs"]
    assert job["state"] == "running"
    assert job["ranks"][1]["beating"] is False


def _two_host_job(sync_dir: Path, interval_s: float, gen_id: str = "00000000000000aa") -> Path:
    """A running job of two ranks, rank 1 on another host, beating every ``interval_s``
    (its confirmation says so) and last published in call 4."""
    gen = sync_dir / f"gen-{gen_id}"
    (_own(gen) / "s-4").mkdir(parents=True)
    me = gradsync._job.liveness.MemberInfo.for_self(0, "00000000000000aa").to_json()
    far = {**gradsync._job.liveness.MemberInfo.for_self(1, "00000000000000bb").to_json()}
    far["host_id"] = "elsewhere/boot/pidns"
    (gen / "roster.json").write_text(json.dumps({"members": [me, far], "run_id": None}))
    settings = {"strategy": "sharded", "heartbeat_interval_s": interval_s}
    confirmation = {"member": far, "settings": settings}
    (gen / "member-1-00000000000000bb.json").write_text(json.dumps(confirmation))
    (gen / "hb-00000000000000bb").write_text("7")
    (gen / "s-4" / "in-1").touch()
    return gen


@pytest.mark.parametrize("publishes", [False, True], ids=["quiet", "publishing"])
def test_a_remote_rank_beating_less_often_than_status_can_wait_is_not_called_dead(
    tmp_path: Path, publishes: bool
) -> None:
    # Sampled 1.3 s apart, a rank beating every 5 s was shown NOT BEATING 5 times in 6
    # while it published call after call.
    gen = _two_host_job(tmp_path, interval_s=60.0)
    later = gen / "s-5"
    publish = threading.Timer(0.1, lambda: later.mkdir() or (later / "in-1").touch())
    if publishes:  # its next call, while status watches
        publish.start()
    report = gradsync._cli.status.describe(tmp_path, sample_s=0.05, max_sample_s=0.3)
    (job,) = report["jobs"]
    assert job["heartbeat_interval_s"] == 60.0
    far = job["ranks"][1]
    assert (far["beating"], far["sampled_s"]) == (True if publishes else None, 0.3)
    if publishes:
        publish.join()
    text = gradsync._cli.status.render(report)
    life = "beating" if publishes else "no beat seen in 0.3 s (it beats every 60 s)"
    assert f"    rank 1: pid {far['pid']} on {far['host']}, {life}, last published" in text


def test_a_remote_rank_sampled_long_enough_and_silent_is_not_beating(tmp_path: Path) -> None:
    # Judged by its own job's interval, even beside a job status cannot wait for.
    _two_host_job(tmp_path, interval_s=0.1)
    _two_host_job(tmp_path, interval_s=60.0, gen_id="00000000000000cc")
    report = gradsync._cli.status.describe(tmp_path, sample_s=0.2, max_sample_s=0.3)
    fast, slow = report["jobs"]
    assert (fast["ranks"][1]["beating"], fast["ranks"][1]["sampled_s"]) == (False, 0.3)
    assert (slow["ranks"][1]["beating"], slow["ranks"][1]["sampled_s"]) == (None, 0.3)


@pytest.mark.parametrize("note", ['{"calls": 4}', "", '{"ended": 3}', '{"ended": "E"}'])
def test_a_rank_left_by_its_launcher_is_shown_with_how_it_ended(tmp_path: Path, note: str) -> None:
    gen = _two_host_job(tmp_path, interval_s=60.0)
    ended = "was stopped by its launcher (killed by SIGTERM)"
    (gen / "left-1").write_text(note.replace("E", ended))
    (job,) = gradsync._cli.status.describe(tmp_path, sample_s=0.0)["jobs"]
    far = job["ranks"][1]
    by_launcher = note.endswith('"E"}')
    assert far.get("ended") == (ended if by_launcher else None)
    assert "beating" not in far  # a rank that left is not watched (nor waited for)
    life = ended if by_launcher else "left"
    expected = f"    rank 1: pid {far['pid']} on {far['host']}, {life}, last published call 4 "
    assert expected in gradsync._cli.status.render({"sync_dir": "", "disk_bytes": 0, "jobs": [job]})


def test_a_failed_rendezvous_with_an_empty_note_is_failed(tmp_path: Path) -> None:
    # On a full disk rank 0's abort note is written empty: it used to count as no note.
    gen = _rendezvous_of_3(tmp_path)
    (gen / "abort.json").write_bytes(b"")
    report = gradsync._cli.status.describe(tmp_path, sample_s=0.0)
    (job,) = report["jobs"]
    assert job["state"] == "failed"
    assert job["error"] == (
        "(its note is empty: no room for the reason; is the sync directory's disk full?)"
    )
    assert "waiting" not in job  # nobody waits to join a failed rendezvous


def test_a_damaged_roster_is_unreadable_not_a_rendezvous(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gen = _rendezvous_of_3(tmp_path)
    for damage in (b"\x00" * 16, b'{"members": "none"}'):
        (gen / "roster.json").write_bytes(damage)
        assert gradsync._cli.status.status_main(tmp_path, as_json=False) == 1
        out = capsys.readouterr().out
        assert (
            f"  generation {gen.name[4:]}: unreadable, 0 bytes\n"
            f"    error: cannot read {gen / 'roster.json'}: not a roster gradsync wrote\n" in out
        ), out


def test_an_unreadable_abort_note_is_failed(tmp_path: Path) -> None:
    gen = _rendezvous_of_3(tmp_path)
    (gen / "abort.json").write_bytes(b"\xff\xfe not json")  # status used to crash here
    (job,) = gradsync._cli.status.describe(tmp_path, sample_s=0.0)["jobs"]
    assert (job["state"], job["error"]) == ("failed", "(its reason is unreadable)")


def _running_job_of_3(sync_dir: Path, strategy: str, markers: list[str]) -> None:
    """A formed job of 3 (every rank this live process) whose latest call, 1, holds
    ``markers``; its ranks > 0 confirmed with ``strategy``."""
    gen = sync_dir / "gen-00000000000000aa"
    (_own(gen) / "s-1").mkdir(parents=True)
    nonces = ["00000000000000aa", "00000000000000bb", "00000000000000cc"]
    members = [gradsync._job.liveness.MemberInfo.for_self(r, n) for r, n in enumerate(nonces)]
    (gen / "roster.json").write_text(
        json.dumps({"members": [m.to_json() for m in members], "world_size": 3, "run_id": None})
    )
    for m in members[1:]:
        (gen / f"member-{m.rank}-{m.nonce}.json").write_text(
            json.dumps(
                {
                    "member": m.to_json(),
                    "world_size": 3,
                    "settings": {"strategy": strategy, "wide_sum": False},
                }
            )
        )
    for name in markers:
        (gen / "s-1" / name).touch()


@pytest.mark.parametrize(
    ("strategy", "markers", "waiting"),
    [
        # Root: ranks 1 and 2 never publish a shard; with rank 0's out, the call is over
        # (every rank idles between steps: evaluating, checkpointing...).
        ("root", ["in-0", "in-1", "in-2", "out-0"], None),
        # Root: rank 0, which reduces everything, has not published the mean yet.
        ("root", ["in-0", "in-1", "in-2"], {"for": [0], "by": [1, 2]}),
        # Sharded: rank 1 has not published its shard; it does not wait for itself.
        ("sharded", ["in-0", "in-1", "in-2", "out-0", "out-2"], {"for": [1], "by": [0, 2]}),
        # Sharded, small call (every rank reduces all: no shards), or all shards in.
        ("sharded", ["in-0", "in-1", "in-2"], None),
        ("sharded", ["in-0", "in-1", "in-2", "out-0", "out-1", "out-2"], None),
    ],
)
def test_status_waits_only_for_ranks_that_publish_a_shard(
    tmp_path: Path, strategy: str, markers: list[str], waiting: dict[str, list[int]] | None
) -> None:
    _running_job_of_3(tmp_path, strategy, markers)
    (job,) = gradsync._cli.status.describe(tmp_path, sample_s=0.0)["jobs"]
    assert job["state"] == "running"
    if waiting is None:
        assert "waiting" not in job
    else:
        assert job["waiting"] == {**waiting, "what": "shards of the mean", "call": 1}


def _unblocked(fn: Callable[[], object], fifo: Path) -> object:
    """``fn()``, failing the test if it is still blocked after 5 s (then a writer opens
    ``fifo`` and goes, so that the blocked open returns)."""
    out: list[object] = []
    thread = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    thread.start()
    thread.join(5.0)
    if thread.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(5.0)
        pytest.fail(f"blocked opening the FIFO {fifo}")
    (result,) = out
    return result


def test_a_fifo_in_place_of_a_data_file_or_heartbeat_is_no_hang(tmp_path: Path) -> None:
    # The ranks refuse a FIFO in place of a peer's data file (O_NONBLOCK, then fstat);
    # status read that same file, and every reader a heartbeat, with a plain open, which
    # waits for a writer forever: the tool that names a stuck rank hung itself.
    _running_job_of_3(tmp_path, "sharded", ["in-0", "in-1"])
    gen = tmp_path / "gen-00000000000000aa"
    fifo = gen / "d-1.in"
    os.mkfifo(fifo)
    report = _unblocked(lambda: gradsync._cli.status.describe(tmp_path, sample_s=0.0), fifo)
    (job,) = report["jobs"]  # type: ignore[index]
    assert (job["ranks"][1]["last_call"], job["ranks"][1]["last_step"]) == (1, None)
    text = gradsync._cli.status.render(report)  # type: ignore[arg-type]
    assert re.search(r"rank 1: .*, last published call 1 \(step unknown\)", text), text
    hb = gen / "hb-00000000000000bb"
    os.mkfifo(hb)
    assert _unblocked(lambda: gradsync._job.liveness.read_counter(hb), hb) is None
    # wait_for_path promises an answer within max_wait_s: a FIFO can be opened, at once.
    assert _unblocked(lambda: gradsync.wait_for_path(hb, 0.5), hb) is True


def test_a_generation_name_that_is_a_symbolic_link_is_not_followed(tmp_path: Path) -> None:
    # Someone who can write the directory points a generation's name at a large tree:
    # status neither describes nor walks it (it used to count the bytes of all of "/").
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "deep").mkdir(parents=True)
    (elsewhere / "deep" / "big").write_bytes(b"x" * 1000)
    sync = tmp_path / "sync"
    sync.mkdir()
    (sync / ("gen-" + "ab" * 8)).symlink_to(elsewhere)
    report = gradsync._cli.status.describe(sync, sample_s=0.0)
    assert report["jobs"] == []
    assert report["disk_bytes"] == 0


@pytest.mark.parametrize(
    ("name", "rank"),
    [
        ("member-3-ab12.json", 3),
        ("member-12-x.json", 12),
        ("member-²-x.json", None),  # a digit to str.isdigit, not to int()
        ("member--x.json", None),
        ("member-3-ab12.json.tmp", None),
        ("gave-up-3-ab12.json", None),
    ],
)
def test_member_file_names_are_parsed_or_skipped(name: str, rank: int | None) -> None:
    assert member_rank(name) == rank
