"""The reaper: what removes generations whose members on other hosts went silent."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

from gradsync._job import reaping as _reaping
from gradsync._job.liveness import MemberInfo
from gradsync._names import OWN_MARK

_GEN = "gen-00000000000000aa"


def _gen_of_a_far_member(sync_dir: Path, files: int = 0) -> Path:
    """A generation gradsync made, whose one member ran on another host."""
    gen = sync_dir / _GEN
    gen.mkdir()
    (gen / OWN_MARK).touch()
    far = MemberInfo.for_self(0, _GEN.removeprefix("gen-")).to_json()
    far["host_id"] = "elsewhere/boot/pidns"
    (gen / "roster.json").write_text(json.dumps({"members": [far], "run_id": None}))
    for i in range(files):
        (gen / f"d-{i}").touch()
    return gen


def test_one_reaper_thread_however_many_rendezvous_leave_a_generation_pending(
    tmp_path: Path,
) -> None:
    # Each rank-0 rendezvous used to start a thread of its own to wait out a heartbeat,
    # and retry loops piled thousands of them up.
    gen = _gen_of_a_far_member(tmp_path)
    for _ in range(5):
        _reaping.reap_stale_generations(tmp_path, tmp_path / "gen-keep", 0.3)
    reapers = [t for t in threading.enumerate() if t.name == "gradsync-reaper"]
    assert len(reapers) == 1
    reapers[0].join(10)
    assert not reapers[0].is_alive()
    assert not gen.exists()  # its heartbeat stayed silent for 0.3 s


_EXIT_MID_REMOVAL = """
    import os, sys, time
    from pathlib import Path
    from gradsync._job import reaping

    sync, files = Path(sys.argv[1]), int(sys.argv[2])
    gen = sync / {gen!r}
    reaping.reap_stale_generations(sync, sync / "gen-keep", 0.2)
    deadline = time.monotonic() + 30
    while len(os.listdir(gen)) > files and time.monotonic() < deadline:
        time.sleep(0.002)
    print(len(os.listdir(gen)), flush=True)  # the reaper has begun: exit now
"""


def test_a_process_that_exits_while_its_reaper_removes_a_generation_removes_all_of_it(
    tmp_path: Path,
) -> None:
    # A daemon thread stopped at exit halfway through left the roster gone and the step
    # files there: a later job could no longer tell whose it was and kept it.
    files = 20_000
    gen = _gen_of_a_far_member(tmp_path, files)
    code = textwrap.dedent(_EXIT_MID_REMOVAL.format(gen=_GEN))
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path), str(files)],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    left_at_exit = int(out.stdout)
    assert 0 < left_at_exit < files + 2, out
    assert not gen.exists(), f"{len(list(gen.iterdir()))} names left of {left_at_exit}"
