"""gradsync touches nothing below its sync dir that it did not make, and follows no link
there: a user's ``gen-*`` directory survives every job, and a symbolic link planted
where gradsync's own directories are (before a job or during it) never leads a write,
a truncation or a removal outside the sync dir."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import syncdir_workers
import workers
from gradsync._job.liveness import MemberInfo
from gradsync._step.transport import Transport
from gradsync._store.dirs import OWN_MARK
from ranks import Outcome, run_ranks


def _snapshot(root: Path) -> dict[str, bytes | None]:
    """Every name below ``root`` (not following links), with each file's bytes."""
    seen: dict[str, bytes | None] = {}
    for where, dirs, files in os.walk(root):
        for name in dirs:
            seen[os.path.relpath(os.path.join(where, name), root)] = None
        for name in files:
            path = os.path.join(where, name)
            seen[os.path.relpath(path, root)] = Path(path).read_bytes()
    return seen


def _canary(root: Path) -> Path:
    """A user's directory outside the sync dir, holding names a job's files have."""
    root.mkdir()
    for name in ("d-0.in", "d-1.in", "d-0.out", "d-1.out", "left-0", "roster.json"):
        (root / name).write_bytes(b"precious " + name.encode())
    for k in range(1, 40):
        (root / f"s-{k}").mkdir()
    return root


def _user_gen_dirs(sync_dir: Path) -> dict[str, bytes | None]:
    samples = sync_dir / "gen-samples" / "epoch1"
    samples.mkdir(parents=True)
    for i in range(3):
        (samples / f"{i}.png").write_bytes(b"\x89PNG" + bytes([i]) * 100)
    (sync_dir / "gen-0123456789abcdef").mkdir()  # named like a generation, but the user's
    (sync_dir / "gen-0123456789abcdef" / "notes.txt").write_text("mine")
    (sync_dir / "gen-notes").write_text("a file")
    return {n: v for n, v in _snapshot(sync_dir).items() if n.startswith("gen-")}


def test_a_users_gen_directories_survive_jobs_and_their_reaping(tmp_path: Path) -> None:
    # gen-samples was taken for a generation whose rank 0 is on another host: the
    # first job wrote its note of heartbeats into it, its reaper thread removed it
    # heartbeat_timeout_s later, and a later job removed it at once.
    sync = tmp_path / "sync"
    before = _user_gen_dirs(sync)
    kw = {"heartbeat_interval_s": 0.1, "heartbeat_timeout_s": 0.3}
    for _ in range(2):
        results = run_ranks(syncdir_workers.steps_then_linger, 2, (2, str(sync), 2, 0.8, kw))
        assert all(r.ok for r in results.values()), results
        after = {n: v for n, v in _snapshot(sync).items() if n.startswith("gen-")}
        assert after == before
    assert sorted(os.listdir(sync)) == ["gen-0123456789abcdef", "gen-notes", "gen-samples", "rdzv"]


def _link_error(outcome: Outcome, link: Path) -> None:
    assert not outcome.ok
    assert outcome.error_type == "SyncDirError", outcome
    assert f"{link} is a symbolic link" in outcome.message, outcome.message
    assert outcome.attrs["errno"] == errno.ELOOP


def test_a_link_planted_as_rdzv_is_refused_and_named(tmp_path: Path) -> None:
    sync = tmp_path / "sync"
    sync.mkdir()
    canary = _canary(tmp_path / "canary")
    before = _snapshot(canary)
    (sync / "rdzv").symlink_to(canary)
    results = run_ranks(syncdir_workers.steps_then_linger, 2, (2, str(sync), 1, 0.0, {}))
    for outcome in results.values():
        _link_error(outcome, sync / "rdzv")
    assert _snapshot(canary) == before


@pytest.mark.parametrize("kind", ["symlink", "hardlink"])
def test_a_link_planted_as_rank_0s_lock_never_changes_its_target(tmp_path: Path, kind: str) -> None:
    # filelock 3.x before 3.30 truncated the file a symbolic link at the lock's name led
    # to; 3.30-3.32 truncate a file hard-linked there once they lock it.
    sync = tmp_path / "sync"
    (sync / "rdzv").mkdir(parents=True)
    canary = _canary(tmp_path / "canary")
    before = _snapshot(canary)
    lock = sync / "rdzv" / "lock-0.lock"
    if kind == "symlink":
        lock.symlink_to(canary / "d-0.in")
    else:
        os.link(canary / "d-0.in", lock)
    results = run_ranks(
        syncdir_workers.steps_then_linger, 2, (2, str(sync), 1, 0.0, {"max_wait_s": 2.0})
    )
    assert _snapshot(canary) == before
    assert results[0].error_type == "SyncDirError", results[0]
    assert str(lock) in results[0].message, results[0].message
    assert results[0].attrs["errno"] == (errno.ELOOP if kind == "symlink" else errno.EMLINK)


def test_a_lock_file_removed_as_rank_0_looks_at_it_is_no_planted_link(tmp_path: Path) -> None:
    # A rank 0 that lets the lock go removes its file: another one's stat of the name,
    # resolved just before, shows it with no links left. Taken for a hard link, that
    # failed one of 30 jobs started at once (tests/test_two_jobs.py).
    sync = tmp_path / "sync"
    (sync / "rdzv").mkdir(parents=True)
    (sync / "rdzv" / "lock-0.lock").touch()  # left by a rank 0 stopped by a signal
    results = run_ranks(syncdir_workers.lock_removed_as_looked, 2, (2, str(sync)))
    assert all(results[r].ok for r in range(2)), results
    assert results[0].value > 0
    assert results[1].value == 0


def test_a_link_planted_as_a_generation_is_never_followed(tmp_path: Path) -> None:
    # Taken for a dead job's generation, it made rank 0 write its note of heartbeats
    # into the link's target.
    sync = tmp_path / "sync"
    sync.mkdir()
    canary = _canary(tmp_path / "canary")
    before = _snapshot(canary)
    (sync / "gen-00000000000000aa").symlink_to(canary)
    kw = {"heartbeat_interval_s": 0.1, "heartbeat_timeout_s": 0.3}
    for _ in range(2):
        results = run_ranks(syncdir_workers.steps_then_linger, 2, (2, str(sync), 2, 0.8, kw))
        assert all(r.ok for r in results.values()), results
    assert _snapshot(canary) == before
    assert (sync / "gen-00000000000000aa").is_symlink()


def _job_in_a_thread(
    worker: Callable[..., Any], args: tuple[Any, ...]
) -> tuple[threading.Thread, dict[int, Outcome]]:
    """Two ranks of ``worker`` run in a thread, so the test can act on their files."""
    results: dict[int, Outcome] = {}
    job = threading.Thread(target=lambda: results.update(run_ranks(worker, 2, args)))
    job.start()
    return job, results


def _wait_until(what: Callable[[], bool], job: threading.Thread, results: object) -> None:
    deadline = time.monotonic() + 60
    while not what() and job.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert what(), results


@pytest.mark.parametrize("what", ["generation", "step"])
def test_a_link_put_in_place_of_a_jobs_directory_mid_run_is_never_followed(
    tmp_path: Path, what: str
) -> None:
    # A generation replaced by a link made the ranks truncate and overwrite the
    # target's files of the same names and remove its s-<k> directories, with no error.
    sync = tmp_path / "sync"
    canary = _canary(tmp_path / "canary")
    before = _snapshot(canary)
    ready = tmp_path / "ready"
    job, results = _job_in_a_thread(
        syncdir_workers.steps_until_it_fails, (2, str(sync), str(ready))
    )
    try:
        _wait_until(ready.exists, job, results)
        (gen,) = sync.glob("gen-*")
        if what == "generation":
            gen.rename(sync / "moved")
            gen.symlink_to(canary)
            link = gen
        else:
            seqs = [int(p.name[2:]) for p in gen.glob("s-*")]
            ahead = max(seqs, default=0) + 20
            for k in range(ahead, ahead + 300):
                try:
                    (gen / f"s-{k}").symlink_to(canary / f"s-{k % 39 + 1}")
                except FileNotFoundError:
                    break  # the ranks got to the first links and their job has ended
            link = gen / f"s-{ahead}"
    finally:
        job.join(90)
    assert not job.is_alive()
    # A rank may learn of the link from the abort note of the peer that found it first.
    found = [o for o in results.values() if o.error_type != "PeerAbortedError"]
    assert found, results
    for outcome in found:
        _link_error(outcome, link)
    for outcome in results.values():
        assert f"{link} is a symbolic link" in outcome.message, outcome.message
    assert _snapshot(canary) == before


@contextlib.contextmanager
def _few_inodes(where: Path, inodes: int) -> Iterator[Path]:
    where.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size=8m,nr_inodes={inodes}", "tmpfs", str(where)],
        capture_output=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def _use_every_inode(directory: Path) -> int:
    directory.mkdir(exist_ok=True)
    n = 0
    while True:
        try:
            (directory / f"f{n}").touch()
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            return n
        n += 1


def test_a_job_starts_where_a_dead_job_holds_the_last_inodes(tmp_path: Path) -> None:
    # The dead job's generation was removed only after the new one was made: the
    # next job could not start ("creating the generation directory: No space left").
    with _few_inodes(tmp_path / "fs", 96) as fs:
        sync = fs / "sync"
        run_ranks(syncdir_workers.steps_then_killed, 2, (2, str(sync)), expect=[])
        assert list(sync.glob("gen-*"))
        assert _use_every_inode(fs / "user") > 0
        # Rank 1, there first, waits for the room that rank 0 frees as it starts.
        kw = {"max_wait_s": 10.0, "delays": {0: 1.0}}
        results = run_ranks(syncdir_workers.steps_then_linger, 2, (2, str(sync), 1, 0.0, kw))
        assert all(r.ok for r in results.values()), [r.message for r in results.values()]
        _use_every_inode(fs / "user")
        kw = {"max_wait_s": 1.0}  # rank 1 waits that long for room, in vain
        results = run_ranks(syncdir_workers.steps_then_linger, 2, (2, str(sync), 1, 0.0, kw))
        for outcome in results.values():  # nothing left to free: each says what is out
            assert (outcome.ok, outcome.error_type) == (False, "SyncDirError"), outcome
            assert "filesystem is out of inodes" in outcome.message, outcome.message


@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "read"])
def test_a_reader_follows_only_a_ranks_link_to_its_shared_arrays(
    tmp_path: Path, mapped: bool
) -> None:
    # d-<rank>.in links to d-<rank>-b<n>.in (buffers_like); any other link there was
    # followed, anywhere.
    gen = tmp_path / "gen"
    gen.mkdir()
    (tmp_path / "outside").write_bytes(b"secret" * 10)
    (gen / "d-1-b3.in").write_bytes(b"H" * 40)
    (gen / "d-1.in").symlink_to("d-1-b3.in")
    (gen / "d-2.in").symlink_to(tmp_path / "outside")
    (gen / "d-3.in").symlink_to("../outside")
    (gen / "d-4.in").symlink_to("d-1-b3.in")  # another rank's arrays
    fd = os.open(gen, os.O_RDONLY | os.O_DIRECTORY)
    transport = Transport(mapped=mapped, head_bytes=8, dir_fd=fd)
    try:
        reader = transport.open(gen / "d-1.in")
        assert (reader.head, reader.size) == (b"H" * 8, 40)
        reader.close()
        for rank in (2, 3, 4):
            with pytest.raises(OSError, match=r"is a symbolic link to .*: refused") as info:
                transport.open(gen / f"d-{rank}.in")
            assert info.value.errno == errno.ELOOP
            assert str(gen / f"d-{rank}.in") in str(info.value)
    finally:
        transport.close()
        os.close(fd)


def test_a_rank_reads_its_own_written_file_again_through_no_link(tmp_path: Path) -> None:
    # Not mapped, a rank reads its own file again by name: a link put there meanwhile
    # was followed, and another file's bytes taken for its own.
    gen = tmp_path / "gen"
    gen.mkdir()
    (tmp_path / "outside").write_bytes(b"S" * 40)
    fd = os.open(gen, os.O_RDONLY | os.O_DIRECTORY)
    transport = Transport(mapped=False, head_bytes=8, dir_fd=fd)
    try:
        transport.write(gen / "d-0.in", [b"H" * 40], None, lambda pairs: None)
        (gen / "d-0.in").unlink()
        (gen / "d-0.in").symlink_to(tmp_path / "outside")
        reader = transport.open(gen / "d-0.in")
        out = np.zeros(8, np.uint8)
        with pytest.raises(OSError, match=r"is a symbolic link to .*: refused") as info:
            reader.read_into(8, out)
        assert info.value.errno == errno.ELOOP
        reader.close()
    finally:
        transport.close()
        os.close(fd)


def test_a_link_put_in_place_of_rdzv_mid_run_is_never_followed(tmp_path: Path) -> None:
    # The last rank to leave unlinks its job's leader file in rdzv/: through the link,
    # a file of that name in its target.
    sync = tmp_path / "sync"
    canary = _canary(tmp_path / "canary")
    ready, go = tmp_path / "ready", tmp_path / "go"
    job, results = _job_in_a_thread(
        syncdir_workers.steps_around_a_pause, (2, str(sync), str(ready), str(go))
    )
    try:
        _wait_until(ready.exists, job, results)
        (gen,) = sync.glob("gen-*")
        (canary / f"leader-{gen.name[4:]}.json").write_text("precious")
        before = _snapshot(canary)
        (sync / "rdzv").rename(sync / "rdzv-moved")
        (sync / "rdzv").symlink_to(canary)
    finally:
        go.touch()
        job.join(90)
    assert not job.is_alive()
    assert all(r.ok for r in results.values()), [r.message for r in results.values()]
    assert _snapshot(canary) == before


def test_a_link_put_in_place_of_a_step_dir_a_rank_waits_in_is_never_read(
    tmp_path: Path,
) -> None:
    # Listed by its path, the link's target was read: a peer's abort note planted there
    # made rank 0 fail with the planted reason, blaming rank 1.
    sync = tmp_path / "sync"
    planted = tmp_path / "planted"
    planted.mkdir()
    (planted / "abort-1").write_text(json.dumps({"type": "RuntimeError", "message": "PLANTED"}))
    ready = tmp_path / "ready"
    job, results = _job_in_a_thread(
        syncdir_workers.rank_1_late_for_call_4, (2, str(sync), str(ready))
    )
    try:
        _wait_until(ready.exists, job, results)
        (gen,) = sync.glob("gen-*")
        step_dir = gen / "s-4"
        _wait_until((step_dir / "in-0").exists, job, results)  # rank 0 waits in it
        step_dir.rename(gen / "moved")
        step_dir.symlink_to(planted)
    finally:
        workers.mark_done(str(ready), "test")
        job.join(90)
    assert not job.is_alive()
    assert "PLANTED" not in results[0].message
    _link_error(results[0], step_dir)
    assert sorted(os.listdir(planted)) == ["abort-1"]


def test_a_link_planted_as_a_join_file_is_never_read(tmp_path: Path) -> None:
    # Read through the link, a join of this run that nobody made was answered.
    sync = tmp_path / "sync"
    (sync / "rdzv").mkdir(parents=True)
    nonce = "00000000000000ee"
    join = tmp_path / "join.json"
    ghost = MemberInfo.for_self(1, nonce).to_json()
    join.write_text(json.dumps({"member": ghost, "run_id": None, "world_size": 2}))
    (sync / "rdzv" / f"join-1-{nonce}.json").symlink_to(join)
    results = run_ranks(syncdir_workers.steps_then_linger, 2, (2, str(sync), 1, 0.0, {}))
    assert all(r.ok for r in results.values()), [r.message for r in results.values()]
    assert not (sync / "rdzv" / f"offer-{nonce}.json").exists()


def _own_generation(sync_dir: Path, gen_id: str) -> Path:
    """An empty generation directory, marked as gradsync marks its own."""
    gen = sync_dir / f"gen-{gen_id}"
    gen.mkdir(parents=True)
    (gen / OWN_MARK).touch()
    return gen


@pytest.mark.parametrize("planted", ["link", "unmarked"])
def test_a_roster_planted_as_a_link_or_in_a_users_directory_is_never_read(
    tmp_path: Path, planted: str
) -> None:
    # Read through the link, or in a user's gen-* directory, a roster nobody wrote,
    # naming this live process as rank 1 of the same run, made rank 1 refuse to start.
    sync = tmp_path / "sync"
    gen = _own_generation(sync, "00000000000000aa")
    if planted == "unmarked":
        (gen / OWN_MARK).unlink()
    (sync / "rdzv").mkdir()
    members = [MemberInfo.for_self(r, f"00000000000000{r}{r}").to_json() for r in (0, 1)]
    leader = {"member": members[0], "run_id": "another", "gen": "00000000000000aa"}
    (sync / "rdzv" / "leader-00000000000000aa.json").write_text(json.dumps(leader))
    roster = tmp_path / "roster.json"
    roster.write_text(json.dumps({"members": members, "world_size": 2, "run_id": None}))
    if planted == "link":
        (gen / "roster.json").symlink_to(roster)
    else:
        roster.rename(gen / "roster.json")
    # Rank 0 late: rank 1 looks at the jobs in the directory before any offer.
    kw = {"delays": {0: 0.5}}
    results = run_ranks(syncdir_workers.steps_then_linger, 2, (2, str(sync), 1, 0.0, kw))
    assert all(r.ok for r in results.values()), [r.message for r in results.values()]


def _status_json(sync_dir: Path) -> dict[str, Any]:
    result = subprocess.run(
        [sys.executable, "-m", "gradsync", "status", str(sync_dir), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    report: dict[str, Any] = json.loads(result.stdout)
    return report


def test_status_reads_no_heartbeat_through_a_link(tmp_path: Path) -> None:
    # A rank on another host is judged by its heartbeat: one read through a link
    # showed the target's counter.
    sync = tmp_path / "sync"
    gen = _own_generation(sync, "00000000000000aa")
    me = MemberInfo.for_self(0, "00000000000000aa").to_json()
    far = {**MemberInfo.for_self(1, "00000000000000bb").to_json(), "host_id": "elsewhere/b/p"}
    (gen / "roster.json").write_text(json.dumps({"members": [me, far], "run_id": None}))
    counter = tmp_path / "counter"
    counter.write_bytes(struct.pack("<Q", 4242))
    (gen / "hb-00000000000000bb").symlink_to(counter)
    (job,) = _status_json(sync)["jobs"]
    assert job["state"] == "running"
    assert job["ranks"][1]["heartbeat"] is None


def test_status_shows_no_job_for_a_users_gen_directory(tmp_path: Path) -> None:
    # A user's gen-samples/ was listed as a job in its rendezvous.
    sync = tmp_path / "sync"
    (sync / "gen-samples" / "epoch1").mkdir(parents=True)
    (sync / "gen-samples" / "epoch1" / "0.png").write_bytes(b"\x89PNG")
    (sync / "gen-0123456789abcdef").mkdir()
    report = _status_json(sync)
    assert report["jobs"] == []


_HOLD_LOCK = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(60)
"""

_RANK_0 = """
import sys
import numpy as np
import gradsync
cfg = gradsync.FileGradSyncConfig(2, 0, sys.argv[1], max_wait_s=2)
try:
    gradsync.average_grads_file_sync([np.ones(3)], None, cfg, 0)
except gradsync.GradSyncError as exc:
    print(type(exc).__name__, exc)
"""


@pytest.mark.parametrize("gen", ["samples", "x/../../outside", "link"])
def test_a_rank_0_that_finds_the_lock_held_touches_no_generation_but_its_own_kind(
    tmp_path: Path, gen: str
) -> None:
    # A second rank 0 tells every forming job of its run that it came, through their
    # leader registrations: one naming a user's gen-samples/ had it removed, one naming
    # a path out of the sync dir had a directory there removed, and one whose
    # generation a link replaced had the note written through the link.
    sync = tmp_path / "sync"
    (sync / "rdzv").mkdir(parents=True)
    user = _user_gen_dirs(sync)
    (sync / "gen-x").mkdir()
    outside = _canary(tmp_path / "outside")
    before = _snapshot(outside)
    victim = tmp_path / "victim"  # a directory that looks like a generation still forming
    victim.mkdir()
    if gen == "link":
        (sync / "gen-00000000000000aa").symlink_to(victim)
        gen = "00000000000000aa"
    with subprocess.Popen(
        [sys.executable, "-c", _HOLD_LOCK, str(sync / "rdzv" / "lock-0.lock")],
        stdout=subprocess.PIPE,
        text=True,
    ) as holder:
        try:
            assert holder.stdout is not None
            assert holder.stdout.readline() == "held\n"
            member = {**MemberInfo.for_self(0, "00000000000000aa").to_json(), "pid": holder.pid}
            member.pop("start_ticks", None)
            leader = {"member": member, "world_size": 2, "run_id": None, "gen": gen}
            (sync / "rdzv" / "leader-00000000000000aa.json").write_text(json.dumps(leader))
            done = subprocess.run(
                [sys.executable, "-c", _RANK_0, str(sync)],
                check=False,
                capture_output=True,
                text=True,
                timeout=60,
            )
        finally:
            holder.kill()
    assert "RendezvousError" in done.stdout, (done.stdout, done.stderr[-2000:])
    assert _snapshot(outside) == before
    assert list(victim.iterdir()) == []
    assert {n: v for n, v in _snapshot(sync).items() if n in user} == user
