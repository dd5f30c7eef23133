"""Telling whether a same-host peer still runs, with and without /proc."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import workers
from gradsync import _proc
from gradsync._job.liveness import MemberInfo, process_state
from gradsync._step.reduce import average_host_grads
from ranks import run_ranks


@pytest.fixture
def no_proc(tmp_path: Path) -> Iterator[None]:
    """This process behaves as on a host without /proc (macOS)."""
    _proc.set_root(tmp_path / "absent")
    try:
        yield
    finally:
        _proc.set_root(None)


def _exited_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: the pid names no process now (until it is reused)
    return child.pid


def test_proc_gives_state_and_start_ticks() -> None:
    state = process_state(os.getpid())
    assert state is not None
    assert state[0] in "RS"
    assert isinstance(state[1], int)
    assert process_state(_exited_pid()) is None
    assert process_state(0) is None


@pytest.mark.usefixtures("no_proc")
def test_without_proc_a_signal_tells_whether_a_process_exists() -> None:
    assert process_state(os.getpid()) == ("?", None)
    assert process_state(1) == ("?", None)  # init: another user's process (EPERM) or ours
    assert process_state(_exited_pid()) is None
    assert process_state(0) is None  # kill(0, 0) would ask about the process group


@pytest.mark.usefixtures("no_proc")
def test_without_proc_a_live_peer_is_alive_and_an_exited_one_dead() -> None:
    me = MemberInfo.for_self(0, "ab" * 8)
    assert me.start_ticks is None
    assert "/node-" in me.host_id  # no boot id: the hardware address tells hosts apart
    assert me.same_host
    assert me.local_death() is None
    gone = MemberInfo(1, "cd" * 8, me.hostname, me.host_id, _exited_pid(), None)
    assert gone.local_death() == "has exited"


def test_without_proc_a_late_peer_is_waited_for(tmp_path: Path) -> None:
    # Before, every same-host peer counted as exited once /proc/<pid>/stat could not be
    # read: the first liveness check (10 ms into a wait) raised PeerLostError.
    res = run_ranks(workers.without_proc, 2, (2, str(tmp_path), 1, None), timeout_s=60)
    assert all(o.ok for o in res.values()), res
    grads = [workers.grads_for(r, 2) for r in range(2)]
    expected = [m.tobytes() for m in average_host_grads(grads)]
    assert res[0].value == res[1].value == expected


def test_without_proc_a_zombie_peer_is_lost_once_its_heartbeat_stops(tmp_path: Path) -> None:
    # kill(pid, 0) succeeds on a zombie; without the heartbeat this waited max_wait_s (60 s).
    args = (3, str(tmp_path), 2, 1)
    res = run_ranks(workers.without_proc, 3, args, expect=[0, 2], timeout_s=60, spawn=True)
    for rank in (0, 2):
        outcome = res[rank]
        assert not outcome.ok
        assert outcome.error_type == "PeerLostError", outcome
        assert tuple(outcome.attrs["ranks"]) == (1,)
        assert re.fullmatch(
            r"step 2: rank 1 \(pid \d+ on .+\) stopped its heartbeat \d+\.\d s ago before "
            r"publishing its gradients in .+/s-3 \(waited \d+\.\d s\)",
            outcome.message,
        ), outcome.message
        assert outcome.elapsed_s < 20  # heartbeat_timeout_s 1 s, not max_wait_s 60 s
