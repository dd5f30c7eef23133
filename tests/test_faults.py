"""The fault matrix: real rank processes killed, stopped, starved of their files or disk.

Every case asserts what each surviving rank sees (exception type, exact message,
how fast) and that no rank ever ends a call with a wrong or partial average: after
a call, a rank's arrays are either the exact mean (the call succeeded) or exactly
what it passed in (the call failed).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fault_workers
import gradsync
from gradsync._job import failures as _failures
from gradsync._job import generation as _generation
from gradsync._job import joiner as _joiner
from gradsync._job import notes as _jobfiles
from gradsync._job import reaping as _reaping
from gradsync._job import rendezvous as rdzv
from gradsync._job.liveness import HeartbeatWatch, MemberInfo
from gradsync._names import GAVE_UP, GEN_PREFIX, ROSTER, abort_marker
from gradsync._step.engine import StepEngine
from gradsync._step.header import (
    FIXED_SIZE,
    FLAG_NONFINITE,
    KIND_INPUT,
    encode_header,
    encode_meta,
    layout_hash,
    layout_json,
)
from gradsync._store.dirs import OWN_MARK, GenDir, make_own_dir
from gradsync._testing import FaultyStore, use_store
from ranks import Outcome, run_ranks
from workers import SHAPES, SHAPES_BIG, SHAPES_HUGE, grads_for

FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
PID = r"pid \d+ on \S+"


# -- helpers ---------------------------------------------------------------------------------


def _shapes(big: bool, huge: bool = False) -> list[tuple[tuple[int, ...], str]]:
    return SHAPES_HUGE if huge else SHAPES_BIG if big else SHAPES


def mean_of(
    world: int, step: int, offset: int = 0, big: bool = False, huge: bool = False
) -> list[bytes]:
    per_rank = [grads_for(r + offset, step, _shapes(big, huge)) for r in range(world)]
    return [a.tobytes() for a in gradsync.average_host_grads(per_rank)]


def own(
    rank: int, step: int, offset: int = 0, big: bool = False, huge: bool = False
) -> list[bytes]:
    return [a.tobytes() for a in grads_for(rank + offset, step, _shapes(big, huge))]


def reported(results: dict[int, Outcome], ranks: tuple[int, ...]) -> None:
    """Every rank in ``ranks`` reported (run_ranks stops at as many reports as expected)."""
    others = {
        r: o.value["records"][-1]["message"] if o.ok else o.message
        for r, o in results.items()
        if r not in ranks
    }
    assert sorted(results) == sorted(ranks), f"unexpected reports: {others}"


def records(out: Outcome) -> list[dict[str, Any]]:
    assert out.ok, f"rank {out.rank} crashed: {out.message}\n{out.value}"
    return out.value["records"]  # type: ignore[no-any-return]


def check_arrays(
    rank: int,
    recs: list[dict[str, Any]],
    world: int,
    offset: int = 0,
    big: bool = False,
    huge: bool = False,
) -> None:
    """A successful call leaves the exact mean, a failed one the rank's own input."""
    for rec in recs:
        step = rec["step"]
        if rec["ok"]:
            want = mean_of(world, step, offset, big, huge)
        else:
            want = own(rank, step, offset, big, huge)
        what = "the exact mean" if rec["ok"] else f"restored after {rec['type']}"
        assert rec["after"] == want, f"rank {rank} step {rec['step']}: arrays not {what}"


def failure(recs: list[dict[str, Any]]) -> dict[str, Any]:
    """The rank's one failed call, which must be its last."""
    assert recs, "no call made"
    assert all(r["ok"] for r in recs[:-1])
    assert not recs[-1]["ok"], "every call succeeded"
    return recs[-1]


@contextlib.contextmanager
def fault(spec: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Children spawned inside inherit ``GRADSYNC_TEST_FAULT=spec`` (read at their import)."""
    with monkeypatch.context() as m:
        m.setenv("GRADSYNC_TEST_FAULT", spec)
        yield


def _children() -> dict[int, str]:
    """pid -> state letter of this process's children."""
    found = {}
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            raw = Path(f"/proc/{entry}/stat").read_bytes()
        except OSError:
            continue
        fields = raw[raw.rfind(b")") + 2 :].split()
        if int(fields[1]) == me:
            found[int(entry)] = fields[0].decode()
    return found


class StopWatcher(threading.Thread):
    """Waits for a child to stop itself (fault action sigstop), then acts on it.

    ``hold_s`` after the stop (or once ``until()`` is true, if given, within those
    ``hold_s``) it calls ``before_cont()`` (if given) and sends SIGCONT.
    """

    def __init__(
        self, hold_s: float, before_cont: Any = None, until: Callable[[], bool] | None = None
    ) -> None:
        super().__init__(daemon=True)
        self.hold_s = hold_s
        self.before_cont = before_cont
        self.until = until
        self.stopped_at: float | None = None
        self.pid: int | None = None
        self.done = threading.Event()

    def run(self) -> None:
        deadline = time.monotonic() + 60
        while self.pid is None and time.monotonic() < deadline:
            stopped = [p for p, s in _children().items() if s == "T"]
            if stopped:
                self.pid = stopped[0]
                self.stopped_at = time.time()
            else:
                time.sleep(0.01)
        if self.pid is None:
            return
        resume_at = time.monotonic() + self.hold_s
        while time.monotonic() < resume_at and not (self.until and self.until()):
            time.sleep(0.01)
        if self.before_cont is not None:
            self.before_cont()
        os.kill(self.pid, signal.SIGCONT)
        self.done.set()

    def __enter__(self) -> StopWatcher:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.join(timeout=1)
        if self.pid is not None and not self.done.is_set():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


# -- 1. a rank killed at each phase of a step --------------------------------------------------

# Rank 1 of 3 kills itself (SIGKILL) in call 2 (step 1), with payloads large enough to be
# reduced in shards (SHAPES_BIG). Before its input is whole and published, nobody can
# finish step 1. After its input but before its shard of the mean, the survivors have
# reduced their shards but cannot gather rank 1's: they fail step 1. Once its shard is
# published (after_output, mid_gather) the survivors need nothing more from it: they
# complete step 1 with the exact mean and fail step 2, naming it.
KILL_CASES = [
    ("before_publish", 1, "its gradients", 2),
    ("mid_publish", 1, "its gradients", 2),
    ("after_publish", 1, "its shard of the mean", 2),
    ("mid_output", 1, "its shard of the mean", 2),
    ("after_output", 2, "its gradients", 3),
    ("mid_gather", 2, "its gradients", 3),
]
# Small payloads (SHAPES) are reduced whole by every rank: no shard is published or
# gathered (mid_output and mid_gather never happen), so once rank 1's input is published
# the survivors need nothing more from it in step 1.
REPLICATED_KILL_CASES = [
    ("before_publish", 1, "its gradients", 2),
    ("mid_publish", 1, "its gradients", 2),
    ("after_publish", 2, "its gradients", 3),
    ("after_output", 2, "its gradients", 3),
]


@pytest.mark.parametrize(
    ("big", "phase", "fail_step", "what", "call"),
    [(True, *case) for case in KILL_CASES] + [(False, *case) for case in REPLICATED_KILL_CASES],
    ids=[f"sharded-{c[0]}" for c in KILL_CASES]
    + [f"replicated-{c[0]}" for c in REPLICATED_KILL_CASES],
)
def test_sigkill_at_each_phase(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    big: bool,
    phase: str,
    fail_step: int,
    what: str,
    call: int,
) -> None:
    with fault(f"{phase}@1@2=sigkill", monkeypatch):
        results = run_ranks(
            fault_workers.steps_until_error,
            3,
            (3, str(tmp_path), 4, {"max_wait_s": 30.0}, 0, 0.0, big),
            expect=[0, 2],
        )
    reported(results, (0, 2))
    for r in (0, 2):
        recs = records(results[r])
        check_arrays(r, recs, 3, big=big)
        rec = failure(recs)
        assert rec["step"] == fail_step
        assert rec["type"] == "PeerLostError", rec["message"]
        assert re.fullmatch(
            rf"step {fail_step}: rank 1 \({PID}\) has exited before publishing {what} in "
            rf"{re.escape(str(tmp_path))}/gen-[0-9a-f]+/s-{call} \(waited \d+\.\d s\)",
            rec["message"],
        ), rec["message"]
        assert rec["ranks"] == (1,)
        assert rec["err_step"] == fail_step
        assert rec["elapsed_s"] < 5.0


@pytest.mark.parametrize("use_mmap", [True, False], ids=["mmap", "pread"])
def test_ctrl_c_during_the_gather_leaves_the_whole_mean(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, use_mmap: bool
) -> None:
    # Rank 2 of 3 is interrupted once its first peer shard is in its arrays (pread) or
    # just before the copies (mmap). Every shard is in by then: it finishes the copies,
    # then lets the KeyboardInterrupt through, instead of leaving a mix. Its peers had
    # all they needed of it: they finish the call, and fail the next one at once.
    with fault("mid_gather@2=sigint", monkeypatch):
        results = run_ranks(
            fault_workers.interrupted_step, 3, (3, str(tmp_path), {"use_mmap": use_mmap})
        )
    want = mean_of(3, 0, big=True)
    for r in range(3):
        assert results[r].ok, results[r].message
        assert results[r].value["raised"] == ("KeyboardInterrupt" if r == 2 else "")
        assert results[r].value["after"] == want, f"rank {r}"
    for r in (0, 1):
        assert re.fullmatch(
            rf"PeerAbortedError: step 1: rank 2 \({PID}\) gave up on this step: "
            r"KeyboardInterrupt",
            results[r].value["next"],
        ), results[r].value["next"]


def test_sigkill_of_rank_0_mid_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Rank 0 also removes old step directories; its death is reported like any other.
    with fault("mid_output@0@2=sigkill", monkeypatch):
        results = run_ranks(
            fault_workers.steps_until_error,
            3,
            (3, str(tmp_path), 4, {}, 0, 0.0, True),
            expect=[1, 2],
        )
    reported(results, (1, 2))
    for r in (1, 2):
        recs = records(results[r])
        check_arrays(r, recs, 3, big=True)
        rec = failure(recs)
        assert rec["type"] == "PeerLostError"
        assert re.fullmatch(
            rf"step 1: rank 0 \({PID}\) has exited before publishing its shard of the mean in "
            r"\S+/s-2 \(waited \d+\.\d s\)",
            rec["message"],
        ), rec["message"]
        assert rec["elapsed_s"] < 5.0


@pytest.mark.parametrize("big", [False, True], ids=["small", "big"])
def test_root_strategy_needs_no_shard_from_rank_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, big: bool
) -> None:
    # With strategy "root" only rank 0 publishes a shard (whatever the payload size): rank
    # 1's data is complete once its input is published, so the survivors finish step 1 and
    # fail step 2.
    with fault("after_publish@1@2=sigkill", monkeypatch):
        results = run_ranks(
            fault_workers.steps_until_error,
            3,
            (3, str(tmp_path), 4, {"strategy": "root"}, 0, 0.0, big),
            expect=[0, 2],
        )
    reported(results, (0, 2))
    for r in (0, 2):
        recs = records(results[r])
        check_arrays(r, recs, 3, big=big)
        rec = failure(recs)
        assert rec["step"] == 2
        assert re.fullmatch(
            rf"step 2: rank 1 \({PID}\) has exited before publishing its gradients in "
            r"\S+/s-3 \(waited \d+\.\d s\)",
            rec["message"],
        ), rec["message"]


# -- 2. stragglers -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("phase", "what", "call", "big"),
    # Only sharded (big) payloads have a shard of the mean to publish.
    [("before_publish", "gradients", 2, False), ("mid_output", "shard of the mean", 2, True)],
)
def test_stopped_rank_resumed_completes_and_is_named_in_warnings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, phase: str, what: str, call: int, big: bool
) -> None:
    watcher = StopWatcher(hold_s=3.0)
    kw = {"warn_after_s": 1.0, "max_wait_s": 20.0}
    with fault(f"{phase}@1@2=sigstop", monkeypatch), watcher:
        results = run_ranks(
            fault_workers.steps_until_error, 3, (3, str(tmp_path), 3, kw, 0, 0.0, big)
        )
    assert watcher.done.is_set(), "rank 1 never stopped"
    for r in range(3):
        recs = records(results[r])
        assert [rec["ok"] for rec in recs] == [True, True, True], recs[-1]["message"]
        check_arrays(r, recs, 3, big=big)
    for r in (0, 2):
        assert results[r].value["records"][1]["elapsed_s"] >= 2.5
        warnings = results[r].value["warnings"]
        pattern = (
            rf"step 1: rank {r} has waited (\d+\.\d) s for ranks \[1\] \(alive\) to publish "
            rf"{what} in {re.escape(str(tmp_path))}/gen-[0-9a-f]+/s-{call}"
        )
        waits = [re.fullmatch(pattern, w) for w in warnings]
        assert waits, f"rank {r} logged no warning"
        assert all(waits), warnings
        # One warning per warn_after_s of waiting: at about 1, 2 (and 3) s.
        assert 2 <= len(waits) <= 4, warnings
        assert float(waits[0].group(1)) == pytest.approx(1.0, abs=0.2)  # type: ignore[union-attr]
    # The straggler itself waited for nobody.
    assert results[1].value["warnings"] == []


@pytest.mark.parametrize("big", [False, True], ids=["replicated", "sharded"])
def test_stopped_rank_past_max_wait_is_a_timeout_naming_only_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, big: bool
) -> None:
    # Rank 1, resumed after ranks 0 and 2 gave up on step 1, finds their inputs of step 1
    # published and their abort notes beside them. It must fail step 1 like them: a rank
    # that applied the mean of a step its peers failed would leave the replicas diverged.

    def gave_up() -> bool:  # both survivors' notes are in step 1's directory
        return all(list(tmp_path.glob(f"gen-*/s-2/{abort_marker(r)}")) for r in (0, 2))

    watcher = StopWatcher(hold_s=4.0, until=gave_up)  # resumed after the survivors gave up
    with fault("before_publish@1@2=sigstop", monkeypatch), watcher:
        results = run_ranks(
            fault_workers.steps_until_error,
            3,
            (3, str(tmp_path), 3, {"max_wait_s": 2.0}, 0, 0.0, big),
        )
    assert watcher.done.is_set(), "rank 1 never stopped"
    message = (
        rf"step 1: ranks \[1\] published nothing in {re.escape(str(tmp_path))}/gen-[0-9a-f]+/s-2 "
        r"within 2\.0 s \(still alive, but not publishing gradients\)"
    )
    for r in range(3):
        recs = records(results[r])
        check_arrays(r, recs, 3, big=big)
        rec = failure(recs)
        assert rec["step"] == 1, f"rank {r}: {rec['message']}"
        assert rec["type"] == "PeerTimeoutError", rec["message"]
        assert re.fullmatch(message, rec["message"]), rec["message"]
        assert rec["ranks"] == (1,)
    # The first survivor to give up waited the whole max_wait_s; the other may raise its
    # note a moment before its own 2.0 s are up (it started waiting a little later).
    waited = [failure(records(results[r]))["elapsed_s"] for r in (0, 2)]
    assert 2.0 <= max(waited) < 4.0, waited
    assert min(waited) >= 1.9, waited
    # Every rank raised the same message: the survivors' own and the straggler's copy of it.
    assert len({results[r].value["records"][-1]["message"] for r in range(3)}) == 1


# -- 3. corrupted files --------------------------------------------------------------------------

# Rank 1 of 3 damages its data file d-1.<name> of call 2 (step 1) on disk before
# publishing its marker; ranks 0 and 2 read it. SHAPES_BIG, so that shards (out) exist.
CORRUPT_CASES = [
    ("in", "header", r"is unusable: {path} has a corrupt header \(checksum mismatch\)"),
    ("in", "short", rf"is unusable: {{path}} is truncated: 40 bytes, a header needs {FIXED_SIZE}"),
    ("in", "truncate", r"{path} is \d+ bytes, its header promises \d+"),
    ("out", "header", r"is unusable: {path} has a corrupt header \(checksum mismatch\)"),
    ("out", "truncate", r"{path} is \d+ bytes, its header promises \d+"),
]


def _damaged_file(
    results: dict[int, Outcome], tmp_path: Path, name: str, per_call: bool = False
) -> str:
    """The path rank 1 damaged: its data file for call 2 (one file a rank, or with
    ``per_call`` the file of that call), never a marker.

    Fails with ``pytest.fail`` (not an AssertionError, which the payload xfail expects).
    """
    crashed = [r for r in range(3) if not results[r].ok]
    if crashed:
        pytest.fail(f"ranks {crashed} crashed: {results[crashed[0]].value}")
    path = results[1].value["damaged"]
    file = f"d-1-c2\\.{name}" if per_call else f"d-1\\.{name}"
    pattern = rf"{re.escape(str(tmp_path))}/gen-[0-9a-f]+/{file}"
    if path is None or not re.fullmatch(pattern, path):
        pytest.fail(f"rank 1 damaged {path!r}, not its data file d-1.{name} of call 2")
    return str(path)


@pytest.mark.parametrize(("name", "how", "detail"), CORRUPT_CASES)
def test_corrupt_file_is_detected_by_every_reader(
    tmp_path: Path, name: str, how: str, detail: str
) -> None:
    results = run_ranks(fault_workers.corrupt_own_file, 3, (3, str(tmp_path), 1, name, how, 2))
    path = re.escape(_damaged_file(results, tmp_path, name))
    message = rf"step 1: rank 1's file {detail.format(path=path)}"
    for r in (0, 2):
        recs = records(results[r])
        check_arrays(r, recs, 3, big=True)
        rec = failure(recs)
        assert rec["step"] == 1
        assert rec["type"] == "CorruptFileError", rec["message"]
        assert re.fullmatch(message, rec["message"]), rec["message"]
        assert rec["ranks"] == (1,)
    recs = records(results[1])
    check_arrays(1, recs, 3, big=True)
    if name == "in":
        # Every rank opens every input, its own included: the writer finds it too.
        rec = failure(recs)
        assert rec["type"] == "CorruptFileError", rec["message"]
        assert re.fullmatch(message, rec["message"]), rec["message"]
    elif not recs[-1]["ok"]:
        # Nobody reads its own output: the writer learns from a reader's abort note (the
        # same error, naming its file), or, already holding every shard it needs,
        # finishes step 1.
        rec = failure(recs)
        assert rec["type"] == "CorruptFileError", rec["message"]
        assert re.fullmatch(message, rec["message"]), rec["message"]


def test_a_rank_whose_shard_its_peers_cannot_read_hears_why(tmp_path: Path) -> None:
    # Ranks 0 and 2 fail reading rank 1's damaged shard of the mean in step 1, when rank 1
    # already has all it needs of them: it finishes step 1 (with the right mean, from its
    # own mapping). Its next call used to say only that they "closed their sessions".
    results = run_ranks(
        fault_workers.corrupt_own_file, 3, (3, str(tmp_path), 1, "out", "truncate", 2, False, 3)
    )
    path = re.escape(_damaged_file(results, tmp_path, "out"))
    message = rf"step 1: rank 1's file {path} is \d+ bytes, its header promises \d+"
    for r in range(3):
        recs = records(results[r])
        check_arrays(r, recs, 3, big=True)
        rec = failure(recs)
        assert rec["type"] == "CorruptFileError", rec["message"]
        assert re.fullmatch(message, rec["message"]), rec["message"]
        assert rec["ranks"] == (1,)


@pytest.mark.parametrize("name", ["in", "out"])
def test_flipped_payload_byte_is_detected_with_checksums(tmp_path: Path, name: str) -> None:
    results = run_ranks(
        fault_workers.corrupt_own_file, 3, (3, str(tmp_path), 1, name, "payload", 2, True)
    )
    path = re.escape(_damaged_file(results, tmp_path, name))
    # No rank may end step 1 with a wrong mean; every reader names rank 1 and its file.
    for r in range(3):
        check_arrays(r, records(results[r]), 3, big=True)
    for r in (0, 2):
        rec = failure(records(results[r]))
        assert rec["type"] == "CorruptFileError", rec["message"]
        assert rec["ranks"] == (1,)
        assert re.fullmatch(
            rf"step 1: rank 1's file is unusable: {path} fails its checksum in bytes \d+\.\.\d+",
            rec["message"],
        ), rec["message"]


def test_a_gather_failing_half_way_across_hosts_leaves_the_gradients_as_they_were(
    tmp_path: Path,
) -> None:
    # Across hosts the gather reads the peers' shards straight into the arrays: rank 2
    # has rank 0's in when rank 1's fails its checksum. Its gradients are put back from
    # the files of its input (past 1 MiB a shard, one per peer; its own shard, in no
    # file, is only written once every peer's is in).
    args = (3, str(tmp_path), 1, "out", "payload", 2, True, 2, True)
    results = run_ranks(fault_workers.corrupt_own_file, 3, args)
    path = re.escape(_damaged_file(results, tmp_path, "out", per_call=True))
    for r in range(3):
        check_arrays(r, records(results[r]), 3, huge=True)
    for r in (0, 2):
        rec = failure(records(results[r]))
        assert rec["type"] == "CorruptFileError", rec["message"]
        assert re.fullmatch(
            rf"step 1: rank 1's file is unusable: {path} fails its checksum in bytes "
            r"\d+\.\.\d+, read again past this host's cache",
            rec["message"],
        ), rec["message"]


@pytest.mark.parametrize("name", ["in", "out"])
def test_without_checksums_a_flipped_payload_byte_goes_unseen(tmp_path: Path, name: str) -> None:
    # The documented cost of checksums=False: only headers are checked.
    results = run_ranks(
        fault_workers.corrupt_own_file, 3, (3, str(tmp_path), 1, name, "payload", 2)
    )
    _damaged_file(results, tmp_path, name)
    assert all(results[r].value["records"][-1]["ok"] for r in range(3))


# -- 4. the environment --------------------------------------------------------------------------


def _remove_tree(path: Path) -> None:
    # Ranks may add files while rm -rf runs (rmdir then fails with ENOTEMPTY): repeat.
    deadline = time.monotonic() + 10
    while path.exists() and time.monotonic() < deadline:
        shutil.rmtree(path, ignore_errors=True)
    assert not path.exists()


def _wait_for(path: Path, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.01)


class Removal:
    """``rm -rf`` of a directory, timed: ``started``/``ended`` in wall-clock seconds."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.started: float | None = None
        self.ended: float | None = None

    def __call__(self) -> None:
        self.started = time.time()
        _remove_tree(self.path)
        self.ended = time.time()

    def check_noticed(self, at: float, within_s: float) -> None:
        """A rank that ended its call at ``at`` noticed the removal within ``within_s``."""
        assert self.started is not None, "never removed"
        assert self.ended is not None
        assert at >= self.started, f"failed {self.started - at:.2f} s before the removal"
        assert at - self.ended < within_s, f"noticed {at - self.ended:.2f} s after the removal"


# The ranks poll a missing step directory's existence every 0.1 s: allow for a loaded
# machine, but stay far below max_wait_s (what the waits lasted before the fix).
NOTICE_S = 2.0


def _disappeared(step: int, sync: Path, seq: int, ranks: str) -> str:
    return (
        rf"step {step}: {re.escape(str(sync))}/gen-[0-9a-f]+/s-{seq} disappeared while waiting "
        rf"for ranks {ranks} \(was the sync directory removed\?\)"
    )


def test_sync_dir_removed_while_one_rank_is_about_to_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # rm -rf while rank 2 is about to start step 2 (stopped before publishing) and ranks 0
    # and 1 wait for it in s-3: rank 2 cannot create s-3 and exits; the waiters see s-3
    # go (they look for the directory before they look at rank 2's process).
    sync = tmp_path / "sync"
    removal = Removal(sync)
    watcher = StopWatcher(hold_s=1.0, before_cont=removal)
    with fault("before_publish@2@3=sigstop", monkeypatch), watcher:
        results = run_ranks(
            fault_workers.steps_until_error, 3, (3, str(sync), 5, {"max_wait_s": 20.0})
        )
    assert watcher.done.is_set(), "rank 2 never stopped"
    rec = failure(records(results[2]))
    assert rec["type"] == "SyncDirError"
    assert rec["errno"] == errno.ENOENT
    assert re.fullmatch(
        rf"step 2: creating the step directory {re.escape(str(sync))}/gen-[0-9a-f]+/s-3 failed: "
        r"No such file or directory",
        rec["message"],
    ), rec["message"]
    for r in range(3):
        recs = records(results[r])
        check_arrays(r, recs, 3)
        rec = failure(recs)
        assert rec["step"] == 2
        assert rec["err_step"] == 2
        removal.check_noticed(rec["at"], NOTICE_S)
        if r != 2:
            assert rec["type"] == "SyncDirError", rec["message"]
            assert rec["errno"] == errno.ENOENT
            assert re.fullmatch(_disappeared(2, sync, 3, r"\[2\]"), rec["message"]), rec["message"]
            assert rec["ranks"] == (2,)


def test_sync_dir_removed_while_every_rank_waits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Sharded payloads (SHAPES_BIG). Rank 2 stops right after publishing its shard of step
    # 1 (s-2). Ranks 0 and 1 finish step 1 and wait for rank 2's input in s-3; rank 2,
    # resumed after the removal, waits for their shards in s-2. Nobody has anything left to
    # write, nobody exits: only noticing the missing directory can end the wait. (This is
    # what happens in a free running loop whenever the removal catches every rank inside a
    # wait.)
    sync = tmp_path / "sync"
    removal = Removal(sync)
    watcher = StopWatcher(hold_s=1.0, before_cont=removal)
    with fault("after_output@2@2=sigstop", monkeypatch), watcher:
        results = run_ranks(
            fault_workers.steps_until_error,
            3,
            (3, str(sync), 4, {"max_wait_s": 20.0}, 0, 0.0, True),
        )
    assert watcher.done.is_set(), "rank 2 never stopped"
    for r in range(3):
        recs = records(results[r])
        check_arrays(r, recs, 3, big=True)
        rec = failure(recs)
        assert rec["type"] == "SyncDirError", rec["message"]
        assert rec["errno"] == errno.ENOENT
        step, seq, waited_for = (1, 2, (0, 1)) if r == 2 else (2, 3, (2,))
        assert rec["step"] == rec["err_step"] == step
        assert rec["ranks"] == waited_for
        assert re.fullmatch(
            _disappeared(step, sync, seq, re.escape(str(list(waited_for)))), rec["message"]
        ), rec["message"]
        removal.check_noticed(rec["at"], NOTICE_S)


@contextlib.contextmanager
def mounted(args: list[str], target: Path, what: str) -> Iterator[None]:
    target.mkdir(exist_ok=True)
    done = subprocess.run(["mount", *args, str(target)], capture_output=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount {what} here: {done.stderr.decode().strip()}")
    try:
        yield
    finally:
        subprocess.run(["umount", str(target)], check=True)


@pytest.mark.parametrize(
    ("kind", "message0", "message1"),
    [
        # An empty read-only filesystem: nothing can even be created.
        (
            "tmpfs",
            r"creating the rendezvous directory {mnt}/rdzv failed: Read-only file system",
            r"creating the rendezvous directory {mnt}/rdzv failed: Read-only file system",
        ),
        # A read-only view of a directory an earlier run left: rdzv/ already exists.
        (
            "bind",
            r"creating the generation directory {mnt}/gen-[0-9a-f]+ failed: Read-only file system",
            r"registering a join in {mnt}/rdzv/join-1-[0-9a-f]+\.json failed: Read-only file "
            r"system",
        ),
    ],
)
def test_read_only_sync_dir(tmp_path: Path, kind: str, message0: str, message1: str) -> None:
    mnt = tmp_path / "mnt"
    if kind == "tmpfs":
        args, what = ["-t", "tmpfs", "-o", "ro,size=1m", "tmpfs"], "a read-only tmpfs"
    else:
        source = tmp_path / "source"
        (source / "rdzv").mkdir(parents=True)
        args, what = ["--bind", "-o", "ro", str(source)], "a read-only bind mount"
    with mounted(args, mnt, what):
        if os.access(mnt, os.W_OK) and kind == "bind":
            # Some kernels ignore "ro" on the first bind: remount it read-only.
            subprocess.run(["mount", "-o", "remount,bind,ro", str(mnt)], check=False)
        results = run_ranks(
            fault_workers.steps_until_error, 2, (2, str(mnt), 1, {"max_wait_s": 5.0})
        )
    hint = r" \(the sync directory is not writable by this process\)"
    for r, message in ((0, message0), (1, message1)):
        rec = failure(records(results[r]))
        assert rec["type"] == "SyncDirError", rec["message"]
        assert rec["errno"] == errno.EROFS
        assert re.fullmatch(message.format(mnt=re.escape(str(mnt))) + hint, rec["message"]), rec[
            "message"
        ]
        assert rec["elapsed_s"] < 2.0
        check_arrays(r, records(results[r]), 2)


def test_two_jobs_with_run_ids_share_a_sync_dir(tmp_path: Path) -> None:
    results = run_ranks(fault_workers.two_jobs, 4, (str(tmp_path), ["job-a", "job-b"], 5))
    for p in range(4):
        job, local = divmod(p, 2)
        recs = records(results[p])
        assert [r["ok"] for r in recs] == [True] * 5, recs[-1]["message"]
        check_arrays(local, recs, 2, offset=50 * job)
    assert results[0].value["gen"] == results[1].value["gen"] != results[2].value["gen"]
    assert results[2].value["gen"] == results[3].value["gen"]


def test_two_jobs_without_run_id_never_mix_within_a_formed_job(tmp_path: Path) -> None:
    # Without run_id the ranks of two jobs are indistinguishable: whichever processes meet
    # first form a job (possibly one rank of each "job"). What must hold: every formed job
    # averages exactly its own members' inputs, and every other process fails clearly.
    results = run_ranks(fault_workers.two_jobs, 4, (str(tmp_path), [None, None], 3))
    by_gen: dict[str, list[int]] = {}
    for p in range(4):
        recs = records(results[p])
        if recs[-1]["ok"]:
            by_gen.setdefault(results[p].value["gen"], []).append(p)
            continue
        rec = failure(recs)
        assert rec["step"] == 0
        assert rec["type"] in ("RendezvousError", "PeerTimeoutError", "PeerLostError"), rec[
            "message"
        ]
        assert re.fullmatch(
            rf"rendezvous: (another rank 0 \({PID}\) with run_id None is running in \S+; give "
            r"each job its own sync_dir or run_id \(or, within one job, each node its own "
            r"--node-rank\)"
            rf"|rank 1 is already taken by {PID} in \S+; this process "
            rf"\({PID}\) claimed the same rank; give each job its own sync_dir or run_id "
            r"\(or, within one job, each node its own --node-rank\)"
            r"|ranks \[1\] did not join within 4\.0 s in \S+ \(.*\)"
            r"|rank 0 did not admit rank 1 within 4\.0 s in \S+ \(.*\)"
            rf"|two processes claim rank 1: {PID} and {PID} in \S+"
            rf"|rank 0 \({PID}\) has exited before completing the rendezvous in \S+)",
            rec["message"],
        ), rec["message"]
        assert own(p % 2, 0, 50 * (p // 2)) == rec["after"]
    # No job at all is allowed too: two rank 0s that start together both refuse (above).
    for gen, members in by_gen.items():
        assert len(members) == 2, (gen, members)
        assert sorted(p % 2 for p in members) == [0, 1]  # one rank 0, one rank 1
        inputs = {p % 2: p for p in members}
        for step in range(3):
            per_rank = [grads_for(inputs[q] % 2 + 50 * (inputs[q] // 2), step) for q in (0, 1)]
            want = [a.tobytes() for a in gradsync.average_host_grads(per_rank)]
            for p in members:
                assert results[p].value["records"][step]["after"] == want


# -- 5. fuzzing the JSON loaders ----------------------------------------------------------------
# (decode_header is fuzzed in test_format.py; these are the rendezvous files and abort notes.)

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(1 << 70), 1 << 70),
    # Infinity/NaN are valid input to json.loads: see the xfail tests below.
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
SELF = MemberInfo.for_self(1, "feedfacefeedface").to_json()
member_fields = st.one_of(json_values, st.integers(-3, 3), st.sampled_from(list(SELF.values())))
member_dicts = st.one_of(
    st.fixed_dictionaries({}, optional=dict.fromkeys(SELF, member_fields)),
    st.just(SELF),
    st.builds(lambda d: {**SELF, **d}, st.dictionaries(st.sampled_from(list(SELF)), json_values)),
)


def _file(directory: Path, name: str, content: bytes) -> Path:
    path = directory / name
    path.write_bytes(content)
    return path


@FUZZ
@given(st.one_of(st.binary(max_size=300), json_values.map(lambda v: json.dumps(v).encode())))
def test_fuzz_rendezvous_load_returns_a_dict_or_none(content: bytes) -> None:
    with tempfile.TemporaryDirectory() as d:
        data = _jobfiles.load(_file(Path(d), "x.json", content))
    assert data is None or isinstance(data, dict)


@FUZZ
@given(st.one_of(json_values, member_dicts, st.builds(lambda m: {"member": m}, member_dicts)))
def test_fuzz_rendezvous_member_returns_member_or_none(value: Any) -> None:
    with tempfile.TemporaryDirectory() as d:
        member = _jobfiles.member_of(
            _jobfiles.load(_file(Path(d), "m.json", json.dumps(value).encode()))
        )
    assert member is None or isinstance(member, MemberInfo)


rosters = st.fixed_dictionaries(
    {"members": st.lists(member_dicts, max_size=4)},
    optional={"world_size": json_values, "run_id": st.none()},
)


@FUZZ
@given(st.one_of(rosters, json_values))
def test_fuzz_roster_readers_raise_only_gradsync_errors(roster: Any) -> None:
    _need_roster_readers()
    with tempfile.TemporaryDirectory() as d:
        sync = Path(d)
        gen = sync / "gen-0123456789abcdef"
        gen.mkdir()
        (gen / OWN_MARK).touch()  # gradsync made it: its roster is read
        _file(gen, "roster.json", json.dumps(roster).encode())
        cfg = gradsync.FileGradSyncConfig(2, 1, sync, max_wait_s=1.0)
        me = MemberInfo.for_self(1, "0000000000000000")
        with contextlib.suppress(gradsync.RendezvousError):
            _joiner.check_not_taken(cfg, me, HeartbeatWatch(1.0))
        if isinstance(roster, dict):
            with contextlib.suppress(gradsync.RendezvousError, gradsync.MismatchError):
                _generation.accept(cfg, me, gen, roster)
        members = _reaping.members_of(gen)
        assert members is None or all(isinstance(m, MemberInfo) for m in members), members
        # Any cross-host member is judged later, in a daemon thread: make that at once.
        _reaping.reap_stale_generations(sync, sync / "gen-keep", 0.0)
        _reaping.leave_for_ended(sync, 1, os.getpid(), "has ended (exit code 0)")


ROSTER_READERS = (
    (_joiner, "check_not_taken"),
    (_generation, "accept"),
    (_reaping, "members_of"),
    (_reaping, "reap_stale_generations"),
    (_reaping, "leave_for_ended"),
)


def _need_roster_readers() -> None:
    # An AttributeError from a renamed helper must not pass for a crash of the helper.
    missing = [f"{m.__name__}.{f}" for m, f in ROSTER_READERS if not hasattr(m, f)]
    if missing:
        pytest.fail(f"{missing} no longer exist: adapt these tests")


def _job(sync: Path, gen_id: str, pids: list[int], *, roster: bool = True) -> Path:
    """A generation of ranks of this host with processes ``pids`` (rank 0 registered)."""
    gen = sync / f"gen-{gen_id}"
    gen.mkdir(parents=True)
    (gen / OWN_MARK).touch()  # gradsync made it
    members = [
        {**MemberInfo.for_self(r, f"{r:016x}").to_json(), "pid": p} for r, p in enumerate(pids)
    ]
    (sync / "rdzv").mkdir(exist_ok=True)
    _file(sync / "rdzv", f"leader-{gen_id}.json", json.dumps({"member": members[0]}).encode())
    if roster:
        _file(gen, "roster.json", json.dumps({"members": members, "run_id": None}).encode())
    return gen


def test_a_launcher_leaves_for_its_ended_rank_only_the_jobs_it_was_in(tmp_path: Path) -> None:
    ended = {"ended": "was stopped by its launcher (killed by SIGTERM)"}
    mine = _job(tmp_path, "00000000000000a1", [4000001, os.getpid()])
    other = _job(tmp_path, "00000000000000a2", [4000002, os.getpid()])  # another process
    done = _job(tmp_path, "00000000000000a3", [os.getpid(), 4000001])
    (done / "left-0").write_text('{"calls":7}')
    forming = _job(tmp_path, "00000000000000a4", [4000001], roster=False)
    (tmp_path / "gen-00000000000000a5").write_text("not a directory")
    _reaping.leave_for_ended(tmp_path, 0, 4000001, ended["ended"])
    _reaping.leave_for_ended(tmp_path, 1, 4000001, "has ended (killed by SIGKILL)")
    assert json.loads((mine / "left-0").read_text()) == ended
    assert _jobfiles.how_it_ended(mine, 0) == ended["ended"]
    assert not (other / "left-0").exists()
    assert json.loads((forming / "left-0").read_text()) == ended  # rank 0, before its roster
    # The last to leave a job removes it, its leader file first.
    assert not done.exists()
    assert not (tmp_path / "rdzv" / "leader-00000000000000a3.json").exists()
    assert (tmp_path / "rdzv" / "leader-00000000000000a1.json").exists()
    # A rank that closed its session said so itself: its note stays as it wrote it.
    (mine / "left-1").write_text('{"calls":3}')
    _reaping.leave_for_ended(tmp_path, 1, os.getpid(), "has ended (exit code 0)")
    assert (mine / "left-1").read_text() == '{"calls":3}'
    assert _jobfiles.how_it_ended(mine, 1) is None


def test_a_joiner_names_how_a_rank_0_of_another_host_ended_as_its_launcher_says(
    tmp_path: Path,
) -> None:
    # Without the note, a joiner on another host would wait out heartbeat_timeout_s.
    gen = _job(tmp_path, "00000000000000b1", [4000001], roster=False)
    leader = MemberInfo.from_json(
        {**MemberInfo.for_self(0, "00").to_json(), "host_id": "elsewhere/boot/ns", "pid": 7}
    )
    cfg = gradsync.FileGradSyncConfig(2, 1, tmp_path, max_wait_s=1.0)
    watch = HeartbeatWatch(3600.0)
    _joiner.check_leader(cfg, leader, gen, watch)  # beating as far as it can tell
    (gen / "left-0").write_text('{"ended": "has ended (killed by SIGSEGV)"}')
    with pytest.raises(gradsync.PeerLostError) as info:
        _joiner.check_leader(cfg, leader, gen, watch)
    assert str(info.value) == (
        f"rendezvous: rank 0 (pid 7 on {socket.gethostname()}) has ended (killed by SIGSEGV) "
        f"before completing the rendezvous in {gen}"
    )


def test_a_launcher_says_how_a_rank_waiting_to_join_ended(tmp_path: Path) -> None:
    rdzv = tmp_path / "rdzv"
    rdzv.mkdir()
    for rank, pid in ((1, 4000001), (2, os.getpid())):  # rank 2: a live process
        member = {**MemberInfo.for_self(rank, f"{rank:016x}").to_json(), "pid": pid}
        join = {"member": member, "world_size": 3, "run_id": "r"}
        _file(rdzv, f"join-{rank}-{rank:016x}.json", json.dumps(join).encode())
    before = time.time()
    _reaping.leave_for_ended(tmp_path, 1, 4000001, "has ended (killed by SIGKILL)")
    _reaping.leave_for_ended(tmp_path, 2, os.getpid(), "has ended (killed by SIGKILL)")
    note = json.loads((rdzv / "ended-1-0000000000000001.json").read_text())
    assert (note["ended"], note["run_id"], note["member"]["pid"]) == (
        "has ended (killed by SIGKILL)",
        "r",
        4000001,
    )
    assert before <= note["at"] <= time.time()
    assert sorted(p.name for p in rdzv.glob("ended-*")) == ["ended-1-0000000000000001.json"]
    # Kept a day for a rank 0 of its run still to start, then tidied like dead joins.
    _file(rdzv, "ended-3-old.json", json.dumps({**note, "at": time.time() - 86401}).encode())
    _file(rdzv, "ended-4-garbled.json", b"{")
    huge = json.dumps({**note, "member": {**note["member"], "rank": 5}, "at": 10**400})
    _file(rdzv, "ended-5-huge.json", huge.encode())  # valid JSON: no float holds it
    cfg = gradsync.FileGradSyncConfig(6, 0, tmp_path, run_id="r")
    assert _failures.unjoined_ends(cfg, [1, 5]).endswith(
        f"; rank 5 (pid 4000001 on {socket.gethostname()}) has ended (killed by SIGKILL) "
        "while waiting to join (noted)"
    )
    _reaping.remove_dead_joins(rdzv)
    assert sorted(p.name for p in rdzv.glob("ended-*")) == ["ended-1-0000000000000001.json"]


def test_a_peer_gone_since_the_listing_is_named_by_the_note_it_left(tmp_path: Path) -> None:
    # Rank 1 closes its session (its note says why) and exits between rank 0's listing
    # and its look at rank 1's process: the note's reason, not just "has exited".
    from gradsync._step.peers import PeerFiles  # noqa: PLC0415
    from gradsync._step.transport import Transport  # noqa: PLC0415

    gen_path = tmp_path / "gen-00000000000000a1"
    (gen_path / "s-3").mkdir(parents=True)
    me = MemberInfo.for_self(0, "00000000000000a1")
    gone = MemberInfo.from_json(
        {**MemberInfo.for_self(1, "00000000000000b1").to_json(), "pid": 4000001}
    )
    gen = rdzv.Generation(gen_path, "00000000000000a1", (me, gone), 0)
    (gen_path / "left-1").write_text(
        '{"calls": 2, "ended": "closed its gradsync session (raising KeyboardInterrupt)"}'
    )

    class Lagging(FaultyStore):
        """Lists the generation as it was before rank 1 left."""

        def list(self, handle: int) -> set[str]:
            return set() if self.name_of(handle) == gen_path.name else super().list(handle)

    cfg = gradsync.FileGradSyncConfig(2, 0, tmp_path)
    with use_store(Lagging()):
        peers = PeerFiles(
            cfg,
            gen,
            Transport(mapped=False, head_bytes=64),
            lambda r, k: tmp_path,
            lambda r, k, s: [],
            GenDir(gen_path),
        )
        with pytest.raises(gradsync.PeerLostError) as info:
            peers._check_alive([1], 3, 3, gen_path / "s-3", "its gradients", 0.5)
    assert str(info.value) == (
        f"step 3: rank 1 (pid 4000001 on {socket.gethostname()}) closed its gradsync session "
        f"(raising KeyboardInterrupt) before publishing its gradients in {gen_path / 's-3'} "
        "(waited 0.5 s)"
    )


def test_a_launcher_leaves_nothing_for_a_live_process_that_has_its_ended_ranks_pid(
    tmp_path: Path,
) -> None:
    # The launcher passes the pid of a process it has already reaped: that pid may by
    # now belong to another process, here a live rank 1 of another job in the same dir.
    live = _job(tmp_path, "00000000000000c1", [4000001, os.getpid()])  # rank 1: this process
    (live / "left-0").write_text('{"calls":3}')
    _reaping.leave_for_ended(tmp_path, 1, os.getpid(), "has ended (killed by SIGKILL)")
    assert not (live / "left-1").exists()
    assert live.exists()


def test_a_launcher_finishes_the_removal_of_a_job_its_rank_was_leaving(tmp_path: Path) -> None:
    # Killed inside leave(): its own note written, the job not yet removed.
    dying = _job(tmp_path, "00000000000000d1", [4000001, 4000002])
    (dying / "left-0").write_text('{"calls":5}')
    (dying / "left-1").write_text('{"calls":5}')
    # Removed by someone who listed it before the launcher's note: no leader file.
    removing = _job(tmp_path, "00000000000000d2", [4000001, 4000003])
    (tmp_path / "rdzv" / "leader-00000000000000d2.json").unlink()
    _reaping.leave_for_ended(tmp_path, 1, 4000002, "has ended (killed by SIGKILL)")
    _reaping.leave_for_ended(tmp_path, 0, 4000001, "has ended (killed by SIGKILL)")
    assert not dying.exists()
    assert not removing.exists()


DEEP = b"[" * 100_000 + b"]" * 100_000
NON_DICT_MEMBERS = json.dumps({"members": [[1], "x"], "run_id": None}).encode()
INF_MEMBERS = json.dumps({"members": [{**SELF, "rank": float("inf")}] * 2, "run_id": None}).encode()


def test_deeply_nested_rendezvous_file_loads_as_none(tmp_path: Path) -> None:
    assert _jobfiles.load(_file(tmp_path, "join-1-00.json", DEEP)) is None


def test_member_with_infinite_rank_is_none(tmp_path: Path) -> None:
    content = json.dumps({"member": {**SELF, "rank": float("inf")}}).encode()
    assert _jobfiles.member_of(_jobfiles.load(_file(tmp_path, "m.json", content))) is None


@pytest.mark.parametrize("entry", [[1], "x", None, {**SELF, "rank": float("inf")}])
def test_member_from_json_rejects_garbage_with_value_error(entry: Any) -> None:
    with pytest.raises(ValueError, match=r"^a member (must be a JSON object|needs integer)"):
        MemberInfo.from_json(entry)


@pytest.mark.parametrize("content", [NON_DICT_MEMBERS, INF_MEMBERS], ids=["non-dict", "inf"])
@pytest.mark.parametrize("reader", ["check_not_taken", "members_of", "reap", "accept"])
def test_garbled_roster_entries_are_not_crashes(
    tmp_path: Path, content: bytes, reader: str
) -> None:
    _need_roster_readers()
    gen = tmp_path / "gen-0123456789abcdef"
    gen.mkdir()
    (gen / OWN_MARK).touch()  # gradsync made it: its roster is read
    _file(gen, "roster.json", content)
    cfg = gradsync.FileGradSyncConfig(2, 1, tmp_path, max_wait_s=1.0)
    me = MemberInfo.for_self(1, "0000000000000000")
    if reader == "check_not_taken":
        # Garbled entries name nobody: no rank is taken, nothing raised.
        assert _joiner.check_not_taken(cfg, me, HeartbeatWatch(1.0)) is None
    elif reader == "members_of":
        # Unreadable members: unknown (None), never an empty list (which means "all gone").
        assert _reaping.members_of(gen) is None
    elif reader == "reap":
        # Members unknown: the generation may be alive, so it is kept.
        _reaping.reap_stale_generations(tmp_path, tmp_path / "gen-keep", 0.0)
        time.sleep(0.05)  # (a reaper thread, had one been started, acts at once)
        assert (gen / "roster.json").read_bytes() == content
    else:
        with pytest.raises(gradsync.RendezvousError) as info:
            _generation.accept(cfg, me, gen, json.loads(content))
        assert str(info.value) == f"rendezvous: unreadable roster in {gen}"
        assert isinstance(info.value.__cause__, ValueError)


def _engine(sync: Path, max_wait_s: float, **kw: Any) -> StepEngine:
    """Rank 0 of a 2-rank generation whose rank 1 (this process too) never publishes."""
    gen_path = sync / "gen-00000000000000ab"
    gen_path.mkdir()
    members = (MemberInfo.for_self(0, "00000000000000ab"), MemberInfo.for_self(1, "cd" * 8))
    gen = rdzv.Generation(gen_path, "00000000000000ab", members, 0)
    return StepEngine(gradsync.FileGradSyncConfig(2, 0, sync, max_wait_s=max_wait_s, **kw), gen)


def _first_call_raises(engine: StepEngine, error: type[BaseException], match: str) -> None:
    """Rank 0's first call raises ``error`` matching ``match``; the engine is closed after."""
    try:
        with pytest.raises(error, match=match):
            engine.step([grads_for(0, 0)[0]], 0)
    finally:
        engine.close()


@pytest.fixture(scope="module")
def lone_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StepEngine]:
    engine = _engine(tmp_path_factory.mktemp("engine"), 2.0)
    yield engine
    engine.close()


def test_an_abort_note_there_at_the_first_look_is_raised_without_a_listing(
    tmp_path: Path,
) -> None:
    # With two ranks the first look stats the peer's marker and abort note (2 system
    # calls) instead of listing the step (5); it must still find the note.
    with use_store(FaultyStore()) as store:
        engine = _engine(tmp_path, 20.0)
        step_dir = engine.gen.path / "s-1"
        step_dir.mkdir()
        _file(step_dir, "abort-1", json.dumps({"type": "", "message": "out of memory"}).encode())
        _first_call_raises(
            engine,
            gradsync.PeerAbortedError,
            match=r"^step 0: rank 1 \(pid \d+ on \S+\) gave up on this step: out of memory$",
        )
    assert ("stat", "abort-1") in store.calls
    assert ("list", "s-1") not in store.calls


def test_a_step_directory_that_cannot_be_listed_is_a_sync_dir_error(tmp_path: Path) -> None:
    def failing(op: str, name: str) -> OSError | None:
        if op == "list" and name.startswith("s-"):
            return OSError(errno.EIO, os.strerror(errno.EIO))
        return None

    with use_store(FaultyStore(failing)):
        _first_call_raises(
            _engine(tmp_path, 20.0),
            gradsync.SyncDirError,
            match=rf"^step 0: listing \S+/s-1 failed: {os.strerror(errno.EIO)}$",
        )


@pytest.mark.parametrize("content", [b'{"calls": 0}', b"{}", b"not json", b'{"calls": true}'])
def test_a_peer_that_left_before_this_call_is_lost(tmp_path: Path, content: bytes) -> None:
    engine = _engine(tmp_path, 20.0)
    _file(engine.gen.path, "left-1", content)
    start = time.monotonic()
    _first_call_raises(
        engine,
        gradsync.PeerLostError,
        match=r"^step 0: rank 1 \(pid \d+ on \S+\) closed its gradsync session before "
        r"publishing its gradients in \S+/s-1 \(waited \d+\.\d s\)$",
    )
    assert time.monotonic() - start < 5


def test_a_peer_that_left_after_finishing_this_call_is_waited_for(tmp_path: Path) -> None:
    # Its "left" file says it finished call 1: it published all of it, and a shared
    # filesystem may show the step's files later than that file. No PeerLostError:
    # the markers are waited for (here they never come: a timeout).
    engine = _engine(tmp_path, 1.0)
    _file(engine.gen.path, "left-1", b'{"calls": 1}')
    _first_call_raises(engine, gradsync.PeerTimeoutError, match=r"^step 0: ranks \[1\] published")


@pytest.mark.parametrize("where", ["data", "abort"])
@pytest.mark.parametrize("use_mmap", [False, True], ids=["pread", "mmap"])
def test_a_fifo_in_place_of_a_peers_file_is_an_error_not_a_hang(
    tmp_path: Path, where: str, use_mmap: bool
) -> None:
    # Opening a FIFO for reading waits for a writer: without O_NONBLOCK every rank would
    # hang in open(), past max_wait_s and deaf to close().
    engine = _engine(tmp_path, 20.0, use_mmap=use_mmap)
    step_dir = engine.gen.path / "s-1"
    step_dir.mkdir()
    fifo = engine.gen.path / "d-1-1.in" if where == "data" else step_dir / "abort-1"
    os.mkfifo(fifo)
    if where == "data":
        _file(step_dir, "in-1", b"")
    raised: list[BaseException] = []

    def call() -> None:
        try:
            engine.step([grads_for(0, 0)[0]], 0)
        except BaseException as exc:  # handed to the test thread
            raised.append(exc)

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(5.0)
    try:
        if thread.is_alive():
            # Let the blocked open() return (a writer appears and goes) before failing.
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            thread.join(5.0)
            pytest.fail(f"the step hung opening the FIFO {fifo}")
    finally:
        engine.close()
    (exc,) = raised
    if where == "data":
        assert type(exc) is gradsync.CorruptFileError, exc
        assert str(exc) == (
            f"step 0: rank 1's file is unusable: {fifo} is a FIFO, not a regular file"
        )
        assert (exc.step, exc.ranks, exc.path) == (0, (1,), str(fifo))
    else:
        assert type(exc) is gradsync.PeerAbortedError, exc
        assert re.fullmatch(
            rf"step 0: rank 1 \({PID}\) gave up on this step: \(its reason is unreadable\)",
            str(exc),
        ), str(exc)


@pytest.mark.parametrize("use_mmap", [False, True], ids=["pread", "mmap"])
def test_a_directory_in_place_of_a_peers_file_names_the_rank(
    tmp_path: Path, use_mmap: bool
) -> None:
    engine = _engine(tmp_path, 20.0, use_mmap=use_mmap)
    step_dir = engine.gen.path / "s-1"
    step_dir.mkdir()
    (engine.gen.path / "d-1-1.in").mkdir()
    _file(step_dir, "in-1", b"")
    path = engine.gen.path / "d-1-1.in"
    _first_call_raises(
        engine,
        gradsync.CorruptFileError,
        match=rf"^step 0: rank 1's file is unusable: {re.escape(str(path))} is a directory, "
        "not a regular file$",
    )


def _crafted_input(
    engine: StepEngine, digest: bytes | None, meta: bytes | None, flags: int
) -> Path:
    """Rank 1's input of call 1 for rank 0's first call (grads_for(0, 0)[0]), with a
    valid header CRC but the given layout digest, meta and flags, and its marker."""
    grad = grads_for(0, 0)[0]
    layout = ((grad.dtype.str, grad.shape),)
    head = encode_header(
        kind=KIND_INPUT,
        rank=1,
        world_size=2,
        seq=1,
        step=0,
        generation=engine.gen.header_id,
        layout_digest=layout_hash(layout) if digest is None else digest,
        meta=encode_meta(layout_json(layout)) if meta is None else meta,
        payload_len=grad.nbytes,
        flags=flags,
    )
    step_dir = engine.gen.path / "s-1"
    step_dir.mkdir()
    path = _file(engine.gen.path, "d-1-1.in", head + grad.tobytes())
    _file(step_dir, "in-1", b"")
    return path


@pytest.mark.parametrize(
    ("digest", "meta", "flags", "detail"),
    [
        # Its layout is rank 0's, its digest another's: no param differs to be named.
        (b"x" * 16, None, 0, "{path} has a layout digest that is not its layout's"),
        (b"x" * 16, b'{"layout":5}', 0, "is unusable: {path} has a malformed header meta"),
        (
            None,
            b'{"nonfinite":"x"}',
            FLAG_NONFINITE,
            "is unusable: {path} has a malformed header meta",
        ),
    ],
    ids=["digest", "layout-meta", "nonfinite-meta"],
)
def test_a_self_contradicting_header_is_a_corrupt_file_naming_the_rank(
    tmp_path: Path, digest: bytes | None, meta: bytes | None, flags: int, detail: str
) -> None:
    # The meta is parsed only when the layouts differ or non-finite params are flagged:
    # what it says then must be reported as rank 1's corrupt file, not a StopIteration
    # (no param differs) or an error naming neither the step nor the rank.
    engine = _engine(tmp_path, 20.0)
    path = _crafted_input(engine, digest, meta, flags)
    grads = [grads_for(0, 0)[0]]
    try:
        with pytest.raises(gradsync.CorruptFileError) as info:
            engine.step(grads, 0)
    finally:
        engine.close()
    assert str(info.value) == f"step 0: rank 1's file {detail.format(path=path)}"
    assert (info.value.step, info.value.ranks, info.value.path) == (0, (1,), str(path))
    assert grads[0].tobytes() == grads_for(0, 0)[0].tobytes()


def _step_with_abort_note(engine: StepEngine, note: bytes) -> BaseException:
    step_dir = engine.gen.path / f"s-{engine.seq + 1}"
    # The engine's own failed call (hypothesis reuses it) told peers of it there too.
    step_dir.mkdir(exist_ok=True)
    _file(step_dir, "abort-1", note)
    grads = [grads_for(0, 0)[0]]
    start = time.monotonic()
    with pytest.raises(gradsync.GradSyncError) as info:
        engine.step(grads, 0)
    assert time.monotonic() - start < 1.5, "the note was not acted on: waited for a timeout"
    assert grads[0].tobytes() == grads_for(0, 0)[0].tobytes()
    return info.value


ERROR_NAMES = ["PeerLostError", "PeerTimeoutError", "MismatchError", "CorruptFileError", "", "x"]


@FUZZ
@given(
    st.one_of(
        st.binary(max_size=200),
        json_values.map(lambda v: json.dumps(v).encode()),
        st.fixed_dictionaries(
            {"type": st.sampled_from(ERROR_NAMES), "message": json_values, "ranks": json_values}
        ).map(lambda v: json.dumps(v).encode()),
    )
)
def test_fuzz_abort_note_raises_a_gradsync_error(lone_engine: StepEngine, note: bytes) -> None:
    exc = _step_with_abort_note(lone_engine, note)
    # A peer's job-wide error comes back as its own type; anything else as PeerAbortedError.
    assert type(exc).__name__ in [*ERROR_NAMES[:4], "PeerAbortedError"], exc


def test_deeply_nested_abort_note_is_a_peer_aborted_error(lone_engine: StepEngine) -> None:
    exc = _step_with_abort_note(lone_engine, DEEP)
    assert type(exc) is gradsync.PeerAbortedError
    assert re.fullmatch(
        rf"step 0: rank 1 \({PID}\) gave up on this step: \(its reason is unreadable\)", str(exc)
    ), str(exc)
    assert exc.ranks == (1,)
    assert exc.step == 0


# -- 6. soak (the full run is benchmarks/soak.py: W=4, 10,000 steps) --------------------------


def test_short_soak_leaks_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # spawned ranks import soak from there too
    import soak  # noqa: PLC0415

    reports = soak.run(2, 300, tmp_path / "sync", timeout_s=60)
    assert soak.check(reports) == [], soak.table(reports)
    for rep in reports:
        assert rep["end"]["fds"] == rep["start"]["fds"]
    assert soak.dir_usage(tmp_path / "sync")["files"] == 0  # a clean close removes the run


def _remove_but(gen: Path, late: Any) -> None:
    """A remover's one pass over ``gen``, with ``late()`` writing into it after its
    listing: it unlinks what it listed, its mark last; its rmdir fails on the late
    file, and it puts the mark back (the directory stays gradsync's)."""
    listed = sorted(os.listdir(gen), key=lambda n: n == OWN_MARK)
    for name in listed:
        os.unlink(gen / name)
    late()
    try:
        os.rmdir(gen)
    except OSError:
        (gen / OWN_MARK).touch()


def test_a_gave_up_note_racing_the_removal_of_its_generation_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 gives up its rendezvous (a rank never came) and, starting over at once,
    removes that generation, while rank 1, offered a place there, writes its gave-up
    note into it: written after the remover listed the directory, the note kept it
    forever as a job of nobody (no leader file: taken for another host's, waited out
    for heartbeat_timeout_s by every later rank 0, and shown by `gradsync status` as a
    rendezvous). Found by a chaos run (rank 0 stopped through its rendezvous)."""
    sync = tmp_path / "sync"
    original = _jobfiles.write_note

    def write_note(path: Path, data: bytes, **kw: Any) -> None:
        if not path.name.startswith(GAVE_UP):
            original(path, data, **kw)
            return
        # A remover (the next rank 0's reaper) has unlinked the leader file and listed
        # the directory, and removes what it listed; this note comes in between.
        gen = path.parent
        _jobfiles.leader_file(sync, gen.name[len(GEN_PREFIX) :]).unlink()
        _remove_but(gen, lambda: original(path, data, **kw))

    monkeypatch.setattr(_jobfiles, "write_note", write_note)
    errors: dict[int, BaseException] = {}

    def rank(r: int, max_wait_s: float) -> None:
        try:
            rdzv.rendezvous(gradsync.FileGradSyncConfig(3, r, sync, max_wait_s=max_wait_s))
        except gradsync.GradSyncError as exc:
            errors[r] = exc

    leader = threading.Thread(target=rank, args=(0, 1.0))
    leader.start()
    rank(1, 10.0)
    leader.join()
    assert type(errors[0]) is gradsync.PeerTimeoutError, errors
    # Rank 0's reason (rank 2 never came), raised by rank 1 too.
    assert type(errors[1]) is gradsync.PeerTimeoutError, errors
    assert "gen-" not in " ".join(os.listdir(sync)), [
        (name, os.listdir(sync / name)) for name in os.listdir(sync) if name.startswith("gen-")
    ]


def test_a_joiner_that_gives_up_as_rank_0_writes_the_roster_leaves_the_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 confirms its place and gives up at once (its session closed from another
    thread here; in a chaos run, a rank stopped past max_wait_s that found rank 0's
    offer on waking), while rank 0 writes the roster before it sees the gave-up note.
    The job then holds a rank that is not in it: rank 0 waited max_wait_s for it, and
    every new session of rank 1's process failed at once with a RendezvousError
    ("already holds rank 1 ... in a session that is still open"). Rank 1 must leave
    the job it turned out to be in (or rank 0 give up on it)."""
    sync = tmp_path / "sync"
    closing = threading.Event()
    rostered = threading.Event()
    write_json, write_note, load = _jobfiles.write_json, _jobfiles.write_note, _jobfiles.load

    checked = threading.Event()

    def looked(path: Path, **kw: Any) -> Any:
        found = load(path, **kw)
        if path.name == ROSTER and closing.is_set():
            checked.set()  # rank 1 looked for the roster once it had given up: none yet
        return found

    def confirm(path: Path, data: dict[str, Any], what: str) -> None:
        if path.name == ROSTER:
            assert checked.wait(10.0)
        write_json(path, data, what)
        if path.name.startswith("member-1-"):
            closing.set()  # closed from another thread just after confirming
        if path.name == ROSTER:
            rostered.set()

    def note(path: Path, data: bytes, **kw: Any) -> None:
        if path.name.startswith(GAVE_UP):
            assert rostered.wait(10.0)  # rank 0 wrote the roster before it saw the note
        write_note(path, data, **kw)

    monkeypatch.setattr(_jobfiles, "write_json", confirm)
    monkeypatch.setattr(_jobfiles, "write_note", note)
    monkeypatch.setattr(_jobfiles, "load", looked)
    gens: list[rdzv.Generation | gradsync.GradSyncError] = []

    def rank_0() -> None:
        try:
            gens.append(rdzv.rendezvous(gradsync.FileGradSyncConfig(2, 0, sync, max_wait_s=10.0)))
        except gradsync.GradSyncError as exc:
            gens.append(exc)

    leader = threading.Thread(target=rank_0)
    leader.start()
    cfg = gradsync.FileGradSyncConfig(2, 1, sync, max_wait_s=10.0)
    with pytest.raises(gradsync.GradSyncError, match="closed while it waited"):
        rdzv.rendezvous(cfg, closing)
    leader.join()
    gen = gens[0]
    if isinstance(gen, rdzv.Generation):  # rank 0 formed the job with rank 1 in it ...
        assert gen.heartbeat is not None
        gen.heartbeat.stop()
        # ... which it learns from its first step: rank 1 has left (no wait) ...
        assert (gen.path / "left-1").exists(), sorted(os.listdir(gen.path))
    else:  # ... or it saw the note after writing the roster, and gave up on rank 1.
        assert "rank 1 (pid" in str(gen), gen
        assert "gave up joining" in str(gen), gen
    # A new session of rank 1's process is not refused as a second holder of rank 1.
    me = MemberInfo.for_self(1, "feedfeedfeedfeed")
    _joiner.check_not_taken(cfg, me, HeartbeatWatch(1.0))


def _rank_0_of_2(sync: Path, max_wait_s: float, outcomes: list[object]) -> None:
    """Rank 0's rendezvous of a job of 2 (in a thread): its Generation, or its error,
    appended to ``outcomes``."""
    try:
        gen = rdzv.rendezvous(gradsync.FileGradSyncConfig(2, 0, sync, max_wait_s=max_wait_s))
    except gradsync.GradSyncError as exc:
        outcomes.append(exc)
        return
    assert gen.heartbeat is not None
    gen.heartbeat.stop()
    outcomes.append(gen)


def _rank_1_meets_a_second_rank_0(
    monkeypatch: pytest.MonkeyPatch,
    sync: Path,
    confirm: Callable[[Path, dict[str, Any], str], None],
    leaders: list[threading.Thread],
    outcomes: list[object],
    first_wait_s: float,
    max_wait_s: float,
) -> Path:
    """Rank 1's rendezvous while a first rank 0 (waiting ``first_wait_s``) gives up and
    ``confirm``, patched over write_json, starts a second one in ``leaders``: the
    generation rank 1 joined, which must be the one the second rank 0 formed."""
    monkeypatch.setattr(_jobfiles, "write_json", confirm)
    leaders.append(threading.Thread(target=_rank_0_of_2, args=(sync, first_wait_s, outcomes)))
    leaders[0].start()
    gen = rdzv.rendezvous(gradsync.FileGradSyncConfig(2, 1, sync, max_wait_s=max_wait_s))
    assert gen.heartbeat is not None
    gen.heartbeat.stop()
    for leader in leaders:
        leader.join()
    formed = [o for o in outcomes if isinstance(o, rdzv.Generation)]
    assert [g.path for g in formed] == [gen.path], outcomes
    return gen.path


def test_a_generation_removed_as_a_joiner_confirms_is_waited_past(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 offered rank 1 a place, gave up its rendezvous and, starting over, removed
    that generation between rank 1's look at it and its confirmation: rank 1 failed
    with SyncDirError ("confirming membership in ... failed: No such file or
    directory", as if the sync dir were gone). It must wait for the new rank 0's offer,
    as it does when the generation goes after it confirmed. Found by a chaos run."""
    sync = tmp_path / "sync"
    write_json = _jobfiles.write_json
    leaders: list[threading.Thread] = []
    outcomes: list[object] = []

    def confirm(path: Path, data: dict[str, Any], what: str) -> None:
        if path.name.startswith("member-1-") and not leaders[1:]:
            # The first rank 0 has given up (and let its lock go); the next one removes
            # its generation now.
            leaders[0].join()
            _reaping._remove(path.parent)
            leaders.append(threading.Thread(target=_rank_0_of_2, args=(sync, 10.0, outcomes)))
            leaders[-1].start()
        write_json(path, data, what)

    _rank_1_meets_a_second_rank_0(monkeypatch, sync, confirm, leaders, outcomes, 1.0, 10.0)


def test_a_confirmation_racing_the_removal_of_its_generation_is_waited_past(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As test_a_generation_removed_as_a_joiner_confirms_is_waited_past, but rank 1's
    confirmation lands between the remover's listing and its rmdir (as the gave-up note
    of test_a_gave_up_note_racing_the_removal_of_its_generation_leaves_nothing does):
    the write succeeds and the directory stays, with no leader file, so rank 1 waited
    in it for a roster nobody writes (max_wait_s) while the new rank 0 waited for its
    confirmation."""
    sync = tmp_path / "sync"
    write_json = _jobfiles.write_json
    leaders: list[threading.Thread] = []
    outcomes: list[object] = []

    def confirm(path: Path, data: dict[str, Any], what: str) -> None:
        if not path.name.startswith("member-1-") or leaders[1:]:
            write_json(path, data, what)
            return
        # The first rank 0 has given up; the next one removes its generation: it
        # unlinks the leader file and lists the directory, and removes what it listed;
        # this confirmation comes in between.
        leaders[0].join()
        gen = path.parent
        _jobfiles.leader_file(sync, gen.name[len(GEN_PREFIX) :]).unlink()
        _remove_but(gen, lambda: write_json(path, data, what))
        leaders.append(threading.Thread(target=_rank_0_of_2, args=(sync, 6.0, outcomes)))
        leaders[-1].start()

    gen = _rank_1_meets_a_second_rank_0(monkeypatch, sync, confirm, leaders, outcomes, 0.5, 6.0)
    assert sorted(n for n in os.listdir(sync) if n.startswith("gen-")) == [gen.name]


def test_a_gave_up_joiner_that_cannot_look_up_the_leader_file_keeps_its_error(
    tmp_path: Path,
) -> None:
    """After its gave-up note a joiner looks for its generation's leader file: a lookup
    that fails otherwise than "not found" (a stale NFS handle) raised that OSError out of
    its except clause, instead of the rendezvous's own error, and left its join and
    offer files behind; nor may it take the generation for removed."""
    gen = tmp_path / f"{GEN_PREFIX}abc"
    make_own_dir(tmp_path, gen.name)  # gradsync's: removed if taken for removed
    leader = _jobfiles.leader_file(tmp_path, "abc")
    leader.parent.mkdir()
    leader.write_text("{}")

    def stale(op: str, name: str) -> OSError | None:
        if name in (leader.name, leader.parent.name):  # the leader file, or its directory
            return OSError(errno.ESTALE, os.strerror(errno.ESTALE), name)
        return None

    with use_store(FaultyStore(stale)) as store:
        _joiner.unless_removed(gen)
    assert ("open_dir", leader.parent.name) in store.calls
    assert gen.is_dir()
