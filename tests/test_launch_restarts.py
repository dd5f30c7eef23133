"""``gradsync launch --elastic --max-restarts N``: a failed rank is started again alone."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gradsync._cli.main import main

LAUNCH = [sys.executable, "-m", "gradsync", "launch"]
TIMEOUT_S = 30.0

# Prints its restart count, then fails while it is below FAIL_RUNS (argv[1]) with exit
# code 3, else exits 0; rank 0 always exits 0 at once.
FLAKY = """\
import json, os, sys
count = os.environ.get("GRADSYNC_RESTART_COUNT")
print("RUN " + json.dumps({"count": count, "elastic": os.environ.get("GRADSYNC_ELASTIC"),
                           "rank": os.environ["GRADSYNC_RANK"]}), flush=True)
if os.environ["GRADSYNC_RANK"] == "1" and int(count or 0) < int(sys.argv[1]):
    print("failing on purpose", file=sys.stderr)
    sys.exit(3)
"""


def run_launch(args: list[str]) -> tuple[int, str, str]:
    proc = subprocess.run(
        [*LAUNCH, *args], capture_output=True, text=True, timeout=TIMEOUT_S, check=False
    )
    return proc.returncode, proc.stdout, proc.stderr


def runs(out: str) -> list[dict[str, str | None]]:
    return [json.loads(line.partition(" RUN ")[2]) for line in out.splitlines() if " RUN " in line]


@pytest.fixture
def flaky(tmp_path: Path) -> Path:
    script = tmp_path / "flaky.py"
    script.write_text(FLAKY)
    return script


def test_a_rank_failing_once_is_restarted_once_and_the_launch_exits_0(flaky: Path) -> None:
    code, out, err = run_launch(
        ["--nproc", "2", "--elastic", "--max-restarts", "2", str(flaky), "1"]
    )
    assert code == 0, err
    rank1 = [r for r in runs(out) if r["rank"] == "1"]
    assert [r["count"] for r in rank1] == ["0", "1"]
    assert {r["elastic"] for r in runs(out)} == {"1"}
    assert "WARNING: rank 1 failed (exit code 3); restarting it (restart 1 of 2)\n" in err
    assert err.endswith("gradsync launch: every rank exited 0; restarted (times): rank 1 (1)\n")
    assert "failed first" not in err


def test_exhausted_restarts_fail_the_launch_as_without_restarts(flaky: Path) -> None:
    code, out, err = run_launch(
        ["--nproc", "2", "--elastic", "--max-restarts", "2", str(flaky), "9"]
    )
    assert code == 3
    assert [r["count"] for r in runs(out) if r["rank"] == "1"] == ["0", "1", "2"]
    for n in (1, 2):
        assert f"restarting it (restart {n} of 2)\n" in err
    assert "restart 3" not in err
    assert "gradsync launch: rank 1 failed first: exit code 3 (local rank 1, pid " in err
    assert ", after 2 restarts)" in err
    assert "    failing on purpose\n" in err


def test_a_rank_that_exits_0_is_not_restarted(flaky: Path) -> None:
    code, out, err = run_launch(
        ["--nproc", "2", "--elastic", "--max-restarts", "3", str(flaky), "0"]
    )
    assert (code, sorted(r["count"] for r in runs(out))) == (0, ["0", "0"])
    assert "restart" not in err


def test_without_restarts_no_elastic_variables_are_set(flaky: Path) -> None:
    code, out, err = run_launch(["--nproc", "2", str(flaky), "1"])
    assert code == 3
    assert {(r["count"], r["elastic"]) for r in runs(out)} == {(None, None)}
    assert "restart" not in err


def test_a_signal_to_the_launcher_stops_ranks_with_restarts_left(tmp_path: Path) -> None:
    script = tmp_path / "sleepy.py"
    script.write_text(
        "import os, pathlib, sys, time\n"
        "pathlib.Path(sys.argv[1], 'rank-' + os.environ['RANK']).write_text('')\n"
        "time.sleep(30)\n"
    )
    args = ["--nproc", "2", "--elastic", "--max-restarts", "5", str(script), str(tmp_path)]
    with subprocess.Popen(
        [*LAUNCH, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as proc:
        try:
            deadline = time.monotonic() + TIMEOUT_S
            while not all((tmp_path / f"rank-{r}").exists() for r in (0, 1)):
                assert proc.poll() is None
                assert time.monotonic() < deadline
                time.sleep(0.02)
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=TIMEOUT_S)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert proc.returncode == 128 + signal.SIGTERM
    assert "received SIGTERM; stopping ranks" in err
    assert "restart" not in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-restarts", "1"], "--max-restarts 1 needs --elastic: a restarted rank"),
        (["--elastic", "--max-restarts", "-1"], "--max-restarts must be >= 0, got -1"),
    ],
)
def test_bad_restart_arguments(
    args: list[str], message: str, flaky: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["launch", "--nproc", "1", *args, str(flaky)]) == 2
    assert f"gradsync launch: error: {message}" in capsys.readouterr().err


# Rank 1's first process starts a child (its pid in argv[1]) and fails; later ones exit 0.
LEAVES_A_CHILD = """\
import os, subprocess, sys, time
if os.environ["RANK"] == "1" and os.environ["GRADSYNC_RESTART_COUNT"] == "0":
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    open(sys.argv[1], "w").write(str(child.pid))
    sys.exit(3)
time.sleep(0.5)
"""


def test_what_a_restarted_ranks_failed_process_started_is_stopped(tmp_path: Path) -> None:
    # It ran on after the restart, and after the launch exited 0.
    script = tmp_path / "leaves_a_child.py"
    script.write_text(LEAVES_A_CHILD)
    pid_file = tmp_path / "child.pid"
    code, _, err = run_launch(
        ["--nproc", "2", "--elastic", "--max-restarts", "1", str(script), str(pid_file)]
    )
    assert code == 0, err
    child = int(pid_file.read_text())
    try:
        state = Path(f"/proc/{child}/stat").read_text().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        state = "gone"
    assert state in ("gone", "Z"), f"the failed process's child still runs ({state})"


# First lives: both average once; rank 1 then dies, and rank 0 once rank 1's new process
# waits to join. Second lives average once and print the world size.
BOTH_KILLED = """\
import os, pathlib, signal, time
import numpy as np
import gradsync
cfg = gradsync.FileGradSyncConfig.from_env()
with gradsync.GradSync(cfg) as gs:
    gs.average([np.ones(4, "float32")])
    if os.environ["GRADSYNC_RESTART_COUNT"] == "0":
        while cfg.rank == 0 and not list(pathlib.Path(cfg.sync_dir, "rdzv").glob("ejoin-*")):
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)
    print("WORLD", gs.world_size, flush=True)
"""


def test_both_ranks_killed_in_turn_are_restarted_and_form_a_new_job(tmp_path: Path) -> None:
    # Restarted rank 1 waits to join a job whose members are all dead; restarted rank 0
    # forms a new one: rank 1 joins that, not waiting out --max-wait-s for the dead job.
    script = tmp_path / "both_killed.py"
    script.write_text(BOTH_KILLED)
    sync_dir = tmp_path / "sync"
    args = ["--nproc", "2", "--elastic", "--max-restarts", "1", "--max-wait-s", "12"]
    start = time.monotonic()
    code, out, err = run_launch([*args, "--sync-dir", str(sync_dir), str(script)])
    assert code == 0, err
    assert sorted(line.partition("] ")[2] for line in out.splitlines()) == ["WORLD 2"] * 2
    assert "restarted (times): rank 0 (1), rank 1 (1)" in err
    assert time.monotonic() - start < 10  # not --max-wait-s (12 s)
