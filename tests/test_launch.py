"""``gradsync launch``, run for real: ``python -m gradsync launch`` starting scripts/*.py."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from gradsync import _proc
from gradsync._cli import watchdog as _watchdog
from gradsync._cli.launch.args import rank_envs
from gradsync._cli.launch.job import Job, Rank
from gradsync._cli.launch.signals import SignalCatcher
from gradsync._cli.launch.supervise import run as run_job
from gradsync._cli.main import main
from gradsync._step import transport as _transport

SCRIPTS = Path(__file__).parent / "scripts"
LAUNCH = [sys.executable, "-m", "gradsync", "launch"]
TIMEOUT_S = 30.0


@contextmanager
def launcher(args: list[str], **kwargs: Any) -> Iterator[subprocess.Popen[str]]:
    """Start ``gradsync launch ARGS``; on the way out make sure it and its ranks are gone."""
    proc = subprocess.Popen(
        [*LAUNCH, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        encoding="utf-8",
        **kwargs,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # lets the launcher stop its ranks
            try:
                proc.communicate(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()


def run_launch(args: list[str], **kwargs: Any) -> tuple[int, str, str, float]:
    """Run ``gradsync launch ARGS`` to the end: exit code, stdout, stderr, seconds taken."""
    start = time.monotonic()
    with launcher(args, **kwargs) as proc:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    return proc.returncode, out, err, time.monotonic() - start


def env_reports(out: str) -> dict[str, dict[str, Any]]:
    """print_env.py's reports by the prefix of the line that carried them."""
    reports = {}
    for line in out.splitlines():
        prefix, sep, payload = line.partition(" ENV ")
        if sep:
            reports[prefix] = json.loads(payload)
    return reports


def wait_for_files(directory: Path, names: list[str], proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not all((directory / name).exists() for name in names):
        assert proc.poll() is None, f"launcher exited early: {proc.communicate()}"
        assert time.monotonic() < deadline, f"ranks never wrote {names} in {directory}"
        time.sleep(0.02)


def unannounced(err: str) -> str:
    """``err`` less its first line, where the launcher says which sync dir it made."""
    first, _, rest = err.partition("\n")
    announced = r"gradsync launch: sync dir (\S+) \(run id \w+, \d+ ranks?\); see it with: "
    assert re.fullmatch(announced + r"gradsync status \1", first), err
    return rest


def assert_gone(pid: int) -> None:
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


# ---------------------------------------------------------------------------- success


def test_env_vars_argv_and_exit_code_0() -> None:
    code, out, err, _ = run_launch(
        [
            "--nproc",
            "3",
            "--max-wait-s",
            "7.5",
            str(SCRIPTS / "print_env.py"),
            "--nproc",
            "9",
            "--",
            "x y",
        ]
    )
    assert code == 0
    reports = env_reports(out)
    assert sorted(reports) == ["[rank 0]", "[rank 1]", "[rank 2]"]
    run_ids = {r["env"]["GRADSYNC_RUN_ID"] for r in reports.values()}
    sync_dirs = {r["env"]["GRADSYNC_SYNC_DIR"] for r in reports.values()}
    assert len(run_ids) == 1
    assert len(sync_dirs) == 1
    (run_id,) = run_ids
    (sync_dir,) = sync_dirs
    # The one line the launcher writes: where the sync dir it made is.
    assert err == (
        f"gradsync launch: sync dir {sync_dir} (run id {run_id}, 3 ranks); "
        f"see it with: gradsync status {sync_dir}\n"
    )
    assert isinstance(run_id, str)
    assert len(run_id) == 16
    int(run_id, 16)
    for rank in range(3):
        report = reports[f"[rank {rank}]"]
        assert report["argv"] == ["--nproc", "9", "--", "x y"]
        assert report["env"] == {
            "GRADSYNC_RANK": str(rank),
            "GRADSYNC_WORLD_SIZE": "3",
            "GRADSYNC_SYNC_DIR": sync_dir,
            "GRADSYNC_RUN_ID": run_id,
            "GRADSYNC_MAX_WAIT_S": "7.5",
            "RANK": str(rank),
            "WORLD_SIZE": "3",
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": "3",
            "PYTHONUNBUFFERED": "1",
        }


def test_fresh_run_id_per_launch_and_no_max_wait_by_default() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADSYNC_")}
    args = ["--nproc", "1", str(SCRIPTS / "print_env.py")]
    first = env_reports(run_launch(args, env=env)[1])["[rank 0]"]["env"]
    second = env_reports(run_launch(args, env=env)[1])["[rank 0]"]["env"]
    assert first["GRADSYNC_RUN_ID"] != second["GRADSYNC_RUN_ID"]
    assert first["GRADSYNC_MAX_WAIT_S"] is None


def test_dash_dash_before_script_and_module_flag() -> None:
    code, out, err, _ = run_launch(
        ["--nproc", "1", "-m", "--", "print_env", "-m", "--nproc"], cwd=SCRIPTS
    )
    assert (code, unannounced(err)) == (0, "")
    assert env_reports(out)["[rank 0]"]["argv"] == ["-m", "--nproc"]


def test_a_directory_with_main_runs_as_python_runs_it(tmp_path: Path) -> None:
    app = tmp_path / "app"
    app.mkdir()
    (app / "__main__.py").write_text((SCRIPTS / "print_env.py").read_text())
    code, out, err, _ = run_launch(["--nproc", "2", str(app), "x"])
    assert (code, unannounced(err)) == (0, "")
    assert {k: v["argv"] for k, v in env_reports(out).items()} == {
        "[rank 0]": ["x"],
        "[rank 1]": ["x"],
    }


def test_nnodes_node_rank_arithmetic(tmp_path: Path) -> None:
    sync_dir = tmp_path / "shared" / "sync"
    code, out, err, _ = run_launch(
        [
            "--nproc",
            "2",
            "--nnodes",
            "3",
            "--node-rank",
            "1",
            "--run-id",
            "job-7",
            "--sync-dir",
            str(sync_dir),
            str(SCRIPTS / "print_env.py"),
        ]
    )
    # The test's directory is on this host alone (where /tmp is not on NFS): a mistake
    # on real nodes, said so.
    warning = (
        f"gradsync launch: WARNING: --sync-dir {sync_dir} is on a filesystem of this host "
        f"({_transport.filesystem_type(sync_dir)}): the other nodes see its files only if "
        "they mount it too (exported over NFS, say)\n"
    )
    assert (code, err) == (0, warning if _transport.local_filesystem(sync_dir) else "")
    reports = env_reports(out)
    assert sorted(reports) == ["[rank 2]", "[rank 3]"]
    for rank, local_rank in ((2, 0), (3, 1)):
        env = reports[f"[rank {rank}]"]["env"]
        assert isinstance(env, dict)
        assert env["GRADSYNC_RANK"] == env["RANK"] == str(rank)
        assert env["GRADSYNC_WORLD_SIZE"] == env["WORLD_SIZE"] == "6"
        assert env["LOCAL_RANK"] == str(local_rank)
        assert env["LOCAL_WORLD_SIZE"] == "2"
        assert env["GRADSYNC_RUN_ID"] == "job-7"
        assert env["GRADSYNC_SYNC_DIR"] == str(sync_dir)


def test_output_prefixed_streams_apart_partial_lines_and_bad_bytes() -> None:
    code, out, err, _ = run_launch(["--nproc", "2", str(SCRIPTS / "output.py")])
    assert code == 0
    for rank in (0, 1):
        rank_out = [line for line in out.splitlines() if line.startswith(f"[rank {rank}] ")]
        rank_err = [line for line in err.splitlines() if line.startswith(f"[rank {rank}] ")]
        assert rank_out == [
            f"[rank {rank}] out line 1 of rank {rank}",
            f"[rank {rank}] out line 2 of rank {rank}",
            f"[rank {rank}] bytes \ufffd\ufffd end",
            f"[rank {rank}] out partial of rank {rank}",
        ]
        assert rank_err == [
            f"[rank {rank}] err line 1 of rank {rank}",
            f"[rank {rank}] err partial of rank {rank}",
        ]
    assert len(out.splitlines()) == 8
    assert len(unannounced(err).splitlines()) == 4


# ---------------------------------------------------------------------------- sync dir


def test_default_sync_dir_exists_during_run_and_is_removed_after() -> None:
    code, out, _, _ = run_launch(["--nproc", "2", str(SCRIPTS / "print_env.py")])
    assert code == 0
    reports = env_reports(out)
    assert [r["sync_dir_is_dir"] for r in reports.values()] == [True, True]
    sync_dir = Path(str(reports["[rank 0]"]["env"]["GRADSYNC_SYNC_DIR"]))
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK | os.X_OK):
        assert sync_dir.parent == Path("/dev/shm")
    assert sync_dir.name.startswith("gradsync-")
    assert not sync_dir.exists()


def test_gradsync_status_without_a_dir_shows_the_jobs_of_default_sync_dirs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The launcher says where the directory it made is, and `gradsync status` finds it.
    with launcher(["--nproc", "2", str(SCRIPTS / "average_forever.py"), str(tmp_path)]) as proc:
        assert proc.stderr is not None
        assert select.select([proc.stderr], [], [], TIMEOUT_S)[0], "the launcher said nothing"
        said = re.fullmatch(
            r"gradsync launch: sync dir (\S+) \(run id (\w+), 2 ranks\); "
            r"see it with: gradsync status (\S+)\n",
            proc.stderr.readline(),
        )
        assert said is not None
        assert said[1] == said[3]
        wait_for_files(tmp_path, ["ready-0", "ready-1"], proc)
        # A directory of this user's named the same way, where no ranks met (a venv,
        # say): not a sync dir, never listed nor walked.
        other = Path(tempfile.mkdtemp(prefix="gradsync-not-a-job-", dir=Path(said[1]).parent))
        try:
            assert main(["status"]) == 0
            text = capsys.readouterr().out
            assert main(["status", "--json"]) == 0
            reports = json.loads(capsys.readouterr().out)
        finally:
            other.rmdir()
        assert str(other) not in text
    shown = re.search(rf"^{re.escape(said[1])}: 1 job\(s\).*?(?=\n\n|\Z)", text, re.M | re.S)
    assert shown is not None, text
    assert f"(run id '{said[2]}'): running" in shown[0]
    for rank in (0, 1):
        pid = (tmp_path / f"ready-{rank}").read_text()
        assert re.search(rf"rank {rank}: pid {pid} on \S+, alive", shown[0]), shown[0]
    (report,) = [r for r in reports if r["sync_dir"] == said[1]]
    assert [job["run_id"] for job in report["jobs"]] == [said[2]]


def test_a_sync_dir_under_home_given_with_equals_is_expanded(tmp_path: Path) -> None:
    # The shell leaves "--sync-dir=~/x" alone: it used to become ./~/x.
    code, out, _, _ = run_launch(
        ["--nproc", "1", "--sync-dir=~/x", str(SCRIPTS / "print_env.py")],
        env={**os.environ, "HOME": str(tmp_path)},
        cwd=tmp_path,
    )
    assert code == 0
    assert env_reports(out)["[rank 0]"]["env"]["GRADSYNC_SYNC_DIR"] == str(tmp_path / "x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x"]


def test_a_job_stopped_by_a_signal_leaves_nothing_in_a_given_sync_dir(tmp_path: Path) -> None:
    # Ranks killed by SIGTERM never close their session; the launcher removes what they
    # left once they are gone, instead of leaving it to the next job.
    sync_dir = tmp_path / "sync"
    args = ["--nproc", "2", "--sync-dir", str(sync_dir), str(SCRIPTS / "average_forever.py")]
    with launcher([*args, str(tmp_path)]) as proc:
        wait_for_files(tmp_path, ["ready-0", "ready-1"], proc)
        assert any(p.name.startswith("gen-") for p in sync_dir.iterdir())
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == 130, err
    assert [str(p.relative_to(sync_dir)) for p in sync_dir.rglob("*")] == ["rdzv"]


@contextmanager
def two_node_job(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], subprocess.Popen[str]]]:
    """Launchers of node 0 (its rank taking itself for one of another host) and node 1,
    one rank each averaging forever with a 20 s heartbeat timeout, once both are ready."""
    job = ["--nnodes", "2", "--nproc", "1", "--sync-dir", str(tmp_path / "sync")]
    job += ["--run-id", "split", "--grace-period-s", "0.5"]
    script = [str(SCRIPTS / "average_forever.py"), str(tmp_path), "--heartbeat-timeout-s", "20"]
    with (
        launcher([*job, "--node-rank", "0", *script, "--elsewhere"]) as far,
        launcher([*job, "--node-rank", "1", *script]) as near,
    ):
        wait_for_files(tmp_path, ["ready-0", "ready-1"], near)
        yield far, near


def assert_told_far_away(tmp_path: Path, far_err: str, reason: str) -> None:
    """Node 0's rank failed naming node 1's rank gone for ``reason``, and the job's files
    are removed (both ranks have left, one through its launcher)."""
    pid = int((tmp_path / "ready-1").read_text())
    lost = re.search(r"PeerLostError: step \d+: (rank 1 .*) before publishing", far_err)
    assert lost is not None, far_err
    assert lost[1] == f"rank 1 (pid {pid} on {socket.gethostname()}) {reason}"
    assert not [p.name for p in (tmp_path / "sync").iterdir() if p.name.startswith("gen-")]


def test_a_rank_stopped_by_its_launcher_is_known_at_once_to_peers_on_other_hosts(
    tmp_path: Path,
) -> None:
    # A peer on another host sees neither the stopped rank's process nor, for
    # heartbeat_timeout_s (20 s here), the end of its heartbeat: its launcher leaves the
    # job on its behalf, and the peer's next liveness check finds that.
    with two_node_job(tmp_path) as (far, near):
        near.send_signal(signal.SIGTERM)
        _, near_err = near.communicate(timeout=TIMEOUT_S)
        assert near.returncode == 143, near_err
        _, far_err = far.communicate(timeout=TIMEOUT_S)
    assert far.returncode == 1, far_err
    assert_told_far_away(tmp_path, far_err, "was stopped by its launcher (killed by SIGTERM)")


def test_a_rank_that_ended_while_waiting_to_join_is_named_by_the_rank_0_waiting_for_it(
    tmp_path: Path,
) -> None:
    # Node 1's rank joins, and is stopped before node 0 starts: node 0's rank 0 could
    # only ask whether it runs at all.
    sync_dir = tmp_path / "sync"
    job = ["--nnodes", "2", "--nproc", "1", "--sync-dir", str(sync_dir), "--run-id", "split"]
    script = [str(SCRIPTS / "average_forever.py"), str(tmp_path)]
    with launcher([*job, "--node-rank", "1", *script]) as near:
        deadline = time.monotonic() + TIMEOUT_S
        while not list((sync_dir / "rdzv").glob("join-1-*.json")):
            assert time.monotonic() < deadline, "rank 1 never joined"
            time.sleep(0.02)
        near.send_signal(signal.SIGTERM)
        near.communicate(timeout=TIMEOUT_S)
    # Its join is gone (the launcher removes dead processes' joins): its note is not.
    assert not list((sync_dir / "rdzv").glob("join-1-*.json"))
    (note,) = (sync_dir / "rdzv").glob("ended-1-*.json")
    pid = json.loads(note.read_text())["member"]["pid"]
    code = (
        "import numpy as np, gradsync\n"
        f"cfg = gradsync.FileGradSyncConfig(2, 0, {str(sync_dir)!r}, run_id='split', "
        "max_wait_s=1.2, warn_after_s=0.5)\n"
        "gradsync.average_grads_file_sync([np.ones(4)], None, cfg, 0)\n"
    )
    rank_0 = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT_S, check=False
    )
    said = (
        re.escape(
            f"; rank 1 (pid {pid} on {socket.gethostname()}) was stopped by its launcher (killed "
            "by SIGTERM) while waiting to join (noted "
        )
        + r"\d+ s ago\)"
    )
    warning = r"rank 0 has waited \d\.\d s for ranks \[1\] to join .*\?\)"
    assert re.search(warning + said + "\n", rank_0.stderr), rank_0.stderr
    timeout = r"PeerTimeoutError: rendezvous: ranks \[1\] did not join .*\?\)"
    assert re.search(timeout + said + "\n", rank_0.stderr), rank_0.stderr


def test_how_a_rank_ended_is_noted_unless_it_exited_0(tmp_path: Path) -> None:
    # Exit code 0 is no note: peers still in its last call may not see yet what it
    # published there (a shared filesystem's listing lags); its heartbeat tells.
    noted: list[tuple[Any, ...]] = []
    job = Job(SignalCatcher(), 1.0, tmp_path, own_dir=False, leave=lambda *a: noted.append(a))
    proc: Any = types.SimpleNamespace(pid=42)
    for code, stopped in [(0, False), (0, True), (-15, True), (-9, True), (-15, False), (1, True)]:
        job.leave_for(Rank(3, 0, proc, returncode=code, stopped=stopped))
    job.wait_for_helpers()
    assert [how for *_, how in noted] == [
        "was stopped by its launcher (killed by SIGTERM)",
        "was stopped by its launcher (killed by SIGKILL)",
        "has ended (killed by SIGTERM)",
        "has ended (exit code 1)",
    ]
    assert {tuple(args) for *args, _ in noted} == {(tmp_path, 3, 42)}


def test_output_ending_in_a_cut_off_character_is_not_lost(tmp_path: Path) -> None:
    script = tmp_path / "cut.py"
    script.write_text('import sys\nsys.stdout.buffer.write(b"hello \\xe2\\x82")\n')
    code, out, _, _ = run_launch(["--nproc", "1", str(script)])
    assert code == 0
    assert out == "[rank 0] hello \ufffd\n"


def test_a_line_split_at_64_kib_keeps_every_character(tmp_path: Path) -> None:
    script = tmp_path / "long.py"
    script.write_text('import sys\nsys.stdout.write("a" + "\\u00e9" * 40000 + "\\n")\n')
    code, out, _, _ = run_launch(["--nproc", "1", str(script)])
    assert code == 0
    pieces = [line.removeprefix("[rank 0] ") for line in out.splitlines()]
    assert len(pieces) == 2  # 80001 bytes: split once, at 64 KiB
    assert "".join(pieces) == "a" + "\u00e9" * 40000


def test_a_line_of_exactly_64_kib_adds_no_empty_line(tmp_path: Path) -> None:
    script = tmp_path / "exact.py"
    script.write_text(
        "import sys\n"
        "sys.stdout.buffer.write(b'a' * 65536 + b'\\n' + b'b' * 65535 + b'\\r\\n' + b'\\n')\n"
    )
    code, out, _, _ = run_launch(["--nproc", "1", str(script)])
    assert code == 0
    assert out.splitlines() == [f"[rank 0] {'a' * 65536}", f"[rank 0] {'b' * 65535}", "[rank 0] "]


def _output_around_a_pause(tmp_path: Path, before: str, after: str) -> tuple[bytes, bytes]:
    """Launch one rank that runs ``before``, waits until told, then runs ``after``;
    return the launcher's stdout and stderr together, in bytes (text mode would turn
    every "\\r" into "\\n"), up to the first "\\r", and the rest."""
    script = tmp_path / "bar.py"
    script.write_text(
        "import sys, time\n"
        "from pathlib import Path\n"
        f"{before}\n"
        "deadline = time.monotonic() + 60\n"
        "while not Path(sys.argv[1]).exists() and time.monotonic() < deadline:\n"
        "    time.sleep(0.01)\n"
        f"{after}\n"
    )
    go = tmp_path / "go"
    proc = subprocess.Popen(
        [*LAUNCH, "--nproc", "1", "--sync-dir", str(tmp_path / "sync"), str(script), str(go)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        assert proc.stdout is not None
        seen = b""
        deadline = time.monotonic() + TIMEOUT_S
        while b"\r" not in seen and time.monotonic() < deadline:
            seen += os.read(proc.stdout.fileno(), 4096)
        go.touch()
        rest, _ = proc.communicate(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0
    return seen, rest


def test_progress_bar_redraws_are_forwarded_as_they_come(tmp_path: Path) -> None:
    # tqdm redraws its line after a "\r" and writes a newline only at the end: the
    # launcher forwarded whole lines, so a progress bar showed nothing until it ended.
    seen, rest = _output_around_a_pause(
        tmp_path,
        "sys.stderr.write('\\rone 10%')\nsys.stderr.write('\\rtwo 20%')\nsys.stderr.flush()",
        "sys.stderr.write('\\rthree 100%\\n' + 'crlf\\r\\n' + 'last\\r')",
    )
    # A redraw shows once the next starts: before, its line's end is not known.
    assert seen == b"[rank 0] one 10%\r"
    assert seen + rest == (
        b"[rank 0] one 10%\r[rank 0] two 20%\r[rank 0] three 100%\n[rank 0] crlf\n"
        b"[rank 0] last\r\n"  # the last redraw stays on screen
    )


def test_a_line_after_a_redraw_of_another_stream_starts_on_a_line_of_its_own(
    tmp_path: Path,
) -> None:
    # tqdm on stderr, print on stdout, one terminal: the line overwrote the bar's start
    # and left its end behind ("loss 0.4225%|###").
    seen, rest = _output_around_a_pause(
        tmp_path,
        "sys.stderr.write('\\repoch 1: 25%|#####   |\\repoch 1: 50%')\nsys.stderr.flush()",
        # Alive a while after: at its exit the bar's unfinished redraw is flushed by the
        # stderr reader, which could forward it before the stdout reader forwards this.
        "print('loss 0.42', flush=True)\ntime.sleep(1)",
    )
    assert seen + rest == (
        b"[rank 0] epoch 1: 25%|#####   |\r\n[rank 0] loss 0.42\n[rank 0] epoch 1: 50%\n"
    )


def test_given_sync_dir_is_created_and_kept(tmp_path: Path) -> None:
    sync_dir = tmp_path / "a" / "b"
    code, out, _, _ = run_launch(
        ["--nproc", "2", "--sync-dir", str(sync_dir), str(SCRIPTS / "print_env.py")]
    )
    assert code == 0
    assert [r["sync_dir_is_dir"] for r in env_reports(out).values()] == [True, True]
    assert sync_dir.is_dir()


# ---------------------------------------------------------------------------- failures


def test_failing_rank_stops_peers_and_is_summarized() -> None:
    code, out, err, seconds = run_launch(["--nproc", "3", str(SCRIPTS / "fail.py"), "exit3"])
    assert code == 3
    assert seconds < 10
    assert "[rank 1] out line before exit\n" in out
    sync_dir = Path(out.split("[rank 1] sync dir ")[1].splitlines()[0])
    assert not sync_dir.exists()  # removed after a failure too
    assert "gradsync launch: rank 1 failed first: exit code 3 (local rank 1, pid " in err
    assert (
        "gradsync launch: other ranks: rank 0: stopped by the launcher (SIGTERM); "
        "rank 2: stopped by the launcher (SIGTERM)\n"
    ) in err
    tail = "".join(f"    err line {i}\n" for i in range(2, 12))
    assert f"gradsync launch: last 10 lines of rank 1's stderr:\n{tail}" in err
    assert err.endswith(tail)
    assert "    err line 1\n" not in err


def test_the_exception_a_rank_failed_with_heads_the_summary() -> None:
    # Its message alone outgrows the lines of stderr shown.
    code, _, err, _ = run_launch(["--nproc", "2", str(SCRIPTS / "fail.py"), "raise"])
    assert code == 1
    headline = re.search(r"gradsync launch: rank 1 failed first: (.*)\n", err)
    assert headline is not None, err
    assert re.fullmatch(
        r"exit code 1 \(local rank 1, pid \d+\), raising ValueError: bad batch 7", headline[1]
    )
    assert "    detail 14\n" in err
    assert "    ValueError: bad batch 7\n" not in err  # beyond the last 10 lines


HANDLED = (
    "import logging\ntry:\n    raise ValueError('bad batch, skipped')\n"
    "except ValueError:\n    logging.exception('skipping a batch')\n"
)
HEADLINES = {
    # A traceback logged before carrying on is not what the rank died of.
    "logged-then-killed": (
        HANDLED + "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n",
        None,
    ),
    "logged-then-exit-1-later": (
        HANDLED + "import sys, time\ntime.sleep(4)\nsys.exit(1)\n",
        None,
    ),
    # A group's members are indented under it: no headline, not its context's.
    "exception-group": (
        "try:\n    raise KeyError('ctx')\nexcept KeyError:\n"
        "    raise ExceptionGroup('eg', [ValueError('a')])\n",
        None,
    ),
    # What the interpreter reports and goes on after is no cause.
    "del-at-shutdown": (
        "class Leak:\n    def __del__(self):\n        raise OSError('in del')\n"
        "leak = Leak()\nraise ValueError('real cause')\n",
        "ValueError: real cause",
    ),
    "atexit-raising": (
        "import atexit\ndef fail():\n    raise OSError('atexit fail')\n"
        "atexit.register(fail)\nraise ValueError('real cause')\n",
        "ValueError: real cause",
    ),
}


@pytest.mark.parametrize("case", sorted(HEADLINES))
def test_the_summary_names_an_exception_only_if_the_rank_died_of_it(
    tmp_path: Path, case: str
) -> None:
    code, expected = HEADLINES[case]
    script = tmp_path / "rank.py"
    script.write_text(code)
    _, _, err, _ = run_launch(["--nproc", "1", str(script)])
    headline = re.search(r"gradsync launch: rank 0 failed first: (.*)\n", err)
    assert headline is not None, err
    raised = headline[1].partition(", raising ")[2]
    assert raised == (expected or ""), err


def test_a_gradsync_error_heads_the_summary_whole_and_its_frames_are_hidden_below(
    tmp_path: Path,
) -> None:
    # Rank 1 stops averaging; rank 0 times out waiting for it, its message naming a
    # step directory deep in a long sync dir: well over 200 characters.
    script = tmp_path / "train.py"
    script.write_text(
        "import time\n"
        "import numpy as np\n"
        "import gradsync\n"
        "cfg = gradsync.FileGradSyncConfig.from_env()\n"
        "for step in range(2):\n"
        "    if cfg.rank == 1 and step == 1:\n"
        "        time.sleep(30)\n"
        "    gradsync.average_grads_file_sync([np.ones(4)], None, cfg, step)\n"
    )
    sync_dir = tmp_path / ("d" * 150)
    code, _, err, _ = run_launch(
        ["--nproc", "2", "--max-wait-s", "1", "--sync-dir", str(sync_dir), str(script)]
    )
    assert code == 1, err
    raised = re.search(r"^\[rank 0\] (gradsync\._errors\.PeerTimeoutError: .*)$", err, re.M)
    assert raised is not None, err
    assert len(raised[1]) > 300
    assert "rank 0 failed first: exit code 1 (local rank 0, pid " in err
    assert f"), raising {raised[1]}\n" in err  # whole
    assert "gradsync launch: other ranks: rank 1: stopped by the launcher (SIGTERM)\n" in err
    # The rank's own output keeps every frame; the excerpt keeps the user's.
    assert re.search(r'^\[rank 0\]   File ".*/gradsync/_api\.py", line \d+', err, re.M)
    excerpt = err.split("lines of rank 0's stderr:\n")[1].splitlines()
    assert excerpt[0] == "    Traceback (most recent call last):", err
    assert excerpt[1] == f'      File "{script}", line 8, in <module>'
    assert excerpt[2] == "        gradsync.average_grads_file_sync([np.ones(4)], None, cfg, step)"
    assert re.fullmatch(r"      \(\d+ gradsync frames hidden\)", excerpt[3]), err
    assert excerpt[4:] == [f"    {raised[1]}"]


def test_rank_killed_by_signal_is_reported_with_its_name() -> None:
    code, _, err, seconds = run_launch(["--nproc", "2", str(SCRIPTS / "fail.py"), "sigkill"])
    assert code == 128 + signal.SIGKILL
    assert seconds < 10
    assert "gradsync launch: rank 1 failed first: killed by SIGKILL" in err
    assert "gradsync launch: rank 1 wrote nothing to stderr\n" in err


def test_missing_script_in_rank_is_a_rank_failure(tmp_path: Path) -> None:
    script = tmp_path / "broken.py"
    script.write_text("raise RuntimeError('boom in rank')\n")
    code, _, err, _ = run_launch(["--nproc", "2", str(script)])
    assert code == 1
    assert "failed first: exit code 1" in err
    assert "    RuntimeError: boom in rank\n" in err
    code, _, err, _ = run_launch(["--nproc", "1", str(script)])
    assert code == 1
    assert "WARNING: rank 0 failed (exit code 1); no other rank is still running\n" in err
    assert ", raising RuntimeError: boom in rank\n" in err


def test_the_group_of_a_rank_long_gone_is_never_signalled(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Rank 1 exits at once and its group empties: its pid is free, and once the pids wrap
    # around (32768 of them on many hosts) it may lead an unrelated group, such as a rank
    # of another launcher. When rank 0 then fails, the launcher must not signal that pid;
    # the group of rank 0, where a process it started lives on, it does signal.
    script = tmp_path / "early.py"
    script.write_text(
        "import os, subprocess, sys, time\n"
        "if os.environ['RANK'] == '1':\n"
        "    print('PID', os.getpid(), flush=True)\n"
        "    sys.exit(0)\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "time.sleep(1.0)\n"
        "sys.exit(3)\n"
    )
    sent: list[tuple[int, int]] = []

    def killpg(pgid: int, signum: int) -> None:
        sent.append((pgid, signum))
        os.killpg(pgid, signum)

    job = Job(SignalCatcher(), 0.5, tmp_path, own_dir=False, killpg=killpg)
    envs = rank_envs(
        nproc=2, nnodes=1, node_rank=0, sync_dir=tmp_path, run_id="gone", max_wait_s=None
    )
    assert run_job(job, [sys.executable, str(script)], envs) == 3
    assert (job.ranks[0].pid, signal.SIGTERM) in sent
    out = capsys.readouterr().out
    pid = int(out.split("[rank 1] PID ")[1].split()[0])
    assert [s for p, s in sent if p == pid and s != 0] == []


@pytest.mark.parametrize("reaped", [True, False], ids=["reaped", "not-yet-reaped"])
def test_a_rank_that_failed_on_its_own_as_stopping_began_is_not_called_stopped(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
    reaped: bool,
) -> None:
    # Rank 1 fails at once, but its exit reaches the launcher's loop only after rank 0's
    # (the order in which two exits of one moment are queued), or its waiter thread has
    # not even reaped it yet: it has exited all the same, so the launcher must neither
    # count it as still running nor say that it stopped it.
    script = tmp_path / "both_fail.py"
    script.write_text(
        "import os, sys, time\n"
        "if os.environ['RANK'] == '1':\n"
        "    sys.exit(4)\n"
        "time.sleep(0.5)\n"
        "sys.exit(3)\n"
    )

    def late_news_of_rank_1(info: Rank) -> int:
        if info.local_rank == 1:
            if reaped:
                info.proc.wait()
            time.sleep(1.5)
        return info.proc.wait()

    job = Job(SignalCatcher(), 5.0, tmp_path, own_dir=False, reap=late_news_of_rank_1)
    envs = rank_envs(
        nproc=2, nnodes=1, node_rank=0, sync_dir=tmp_path, run_id="late", max_wait_s=None
    )
    with caplog.at_level(logging.WARNING, logger="gradsync.launch"):
        assert run_job(job, [sys.executable, str(script)], envs) == 3
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "rank 0 failed (exit code 3); no other rank is still running" in warnings
    err = capsys.readouterr().err
    assert "gradsync launch: rank 0 failed first: exit code 3" in err
    assert "gradsync launch: other ranks: rank 1: exit code 4\n" in err


# ---------------------------------------------------------------------------- signals


@pytest.mark.parametrize(("signum", "expected_code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_to_launcher_stops_ranks_and_removes_sync_dir(
    tmp_path: Path, signum: int, expected_code: int
) -> None:
    with launcher(["--nproc", "2", str(SCRIPTS / "sleep.py"), str(tmp_path)]) as proc:
        wait_for_files(tmp_path, ["rank-0.json", "rank-1.json"], proc)
        start = time.monotonic()
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == expected_code
    assert time.monotonic() - start < 5
    assert "[rank 0] rank 0 got SIGTERM\n" in out
    assert "[rank 1] rank 1 got SIGTERM\n" in out
    name = signal.Signals(signum).name
    assert f"gradsync launch: WARNING: received {name}; stopping ranks" in err
    assert "failed first" not in err
    infos = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1)]
    for info in infos:
        assert_gone(info["pid"])
    assert not Path(infos[0]["sync_dir"]).exists()


def test_ranks_ignoring_sigterm_get_sigkill_after_grace_period(tmp_path: Path) -> None:
    args = ["--nproc", "2", "--grace-period-s", "0.5", str(SCRIPTS / "sleep.py"), str(tmp_path)]
    with launcher([*args, "--ignore-sigterm"]) as proc:
        wait_for_files(tmp_path, ["rank-0.json", "rank-1.json"], proc)
        start = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == 130
    assert 0.4 < time.monotonic() - start < 5
    assert "sent SIGKILL (grace period over); ranks still running: 0, 1\n" in err
    for r in (0, 1):
        assert_gone(json.loads((tmp_path / f"rank-{r}.json").read_text())["pid"])


def wait_gone(pid: int, timeout_s: float) -> None:
    """Wait until ``pid`` has exited (a zombie counts: its parent died, and whoever
    inherited it may not reap at once)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return
        if state in ("Z", "X"):
            return
        assert time.monotonic() < deadline, f"pid {pid} still running ({state})"
        time.sleep(0.02)


@pytest.mark.parametrize("ignore_sigterm", [False, True], ids=["sigterm", "sigkill"])
def test_the_ranks_of_a_launcher_killed_with_sigkill_are_stopped(
    tmp_path: Path, ignore_sigterm: bool
) -> None:
    # Ranks run in sessions of their own: a launcher killed by SIGKILL left them running
    # (quiet ones to the end, holding their GPU). Its watchdog stops them.
    args = ["--nproc", "2", "--grace-period-s", "0.5", str(SCRIPTS / "sleep.py"), str(tmp_path)]
    with launcher(args + ["--ignore-sigterm"] * ignore_sigterm) as proc:
        wait_for_files(tmp_path, ["rank-0.json", "rank-1.json"], proc)
        proc.kill()
        start = time.monotonic()
        # The watchdog writes to the launcher's stderr: EOF once it is done.
        _, err = proc.communicate(timeout=TIMEOUT_S)
    assert unannounced(err) == (
        f"gradsync launch: the launcher (pid {proc.pid}) ended without stopping its ranks; "
        "stopping ranks 0, 1 (SIGTERM, SIGKILL after 0.5 s)\n"
    )
    infos = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1)]
    for info in infos:
        wait_gone(info["pid"], 5.0)
    assert time.monotonic() - start < 5
    # The directory the launcher made for the job goes too (the watchdog holds the
    # launcher's stderr: at its EOF the watchdog is done).
    assert not Path(infos[0]["sync_dir"]).exists()


def test_the_ranks_of_a_launcher_killed_with_sigkill_are_known_at_once_to_peers_elsewhere(
    tmp_path: Path,
) -> None:
    # Its watchdog, once it has stopped them, leaves their jobs for them too.
    with two_node_job(tmp_path) as (far, near):
        near.kill()
        _, far_err = far.communicate(timeout=TIMEOUT_S)
        near.communicate(timeout=TIMEOUT_S)
    reason = "was stopped by its launcher's watchdog (the launcher died)"
    assert_told_far_away(tmp_path, far_err, reason)


def test_the_watchdog_signals_only_the_groups_left_and_only_without_done(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    sent: list[tuple[int, int]] = []
    alive = {101: True, 102: False}

    def killpg(pgid: int, signum: int) -> None:
        sent.append((pgid, signum))
        if signum == 0 and not alive[pgid]:
            raise ProcessLookupError(pgid)

    monkeypatch.setattr(os, "killpg", killpg)
    said = [b"add 101 10\n", b"add 102 2\n", b"add 103 3\n", b"\n", b"junk\n"]
    assert _watchdog.watch([*said, b"gone 103\n", b"done\n"], 7, 0.0) == 0
    assert sent == []
    assert _watchdog.watch([*said, b"gone 103\n"], 7, 0.2) == 1
    assert (101, signal.SIGKILL) in sent
    assert (102, signal.SIGKILL) not in sent  # seen gone during the grace period
    assert [s for s in sent if s[1] == signal.SIGTERM] == [
        (101, signal.SIGTERM),
        (102, signal.SIGTERM),
    ]
    assert capsys.readouterr().err == (
        "gradsync launch: the launcher (pid 7) ended without stopping its ranks; stopping "
        "ranks 2, 10 (SIGTERM, SIGKILL after 0.2 s)\n"
    )


def test_the_watchdog_removes_the_launchers_own_sync_dir_once_every_rank_ended(
    tmp_path: Path,
) -> None:
    # With no group left to stop it returned at once and left the directory behind.
    own = tmp_path / "gradsync-own"
    own.mkdir()
    (own / "left.txt").write_text("x")
    said = [b"add 101 0\n", b"gone 101\n"]
    assert _watchdog.watch(said, 7, 0.0, str(own), own_dir=True) == 1
    assert not own.exists()
    given = tmp_path / "given"
    given.mkdir()
    assert _watchdog.watch(said, 7, 0.0, str(given), own_dir=False) == 1
    assert given.exists()


def test_the_watchdog_leaves_only_for_the_ranks_it_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Rank 1 runs when the launcher dies; rank 2 has ended before (how, the watchdog
    # cannot know: nothing is said for it). Nobody reaps either (the launcher is gone,
    # and a container's init may never): zombies count as gone.
    def start(code: str) -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, "-c", code], start_new_session=True)

    running, ended = start("import time; time.sleep(60)"), start("pass")
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while _watchdog._process_alive(ended.pid):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        left: list[dict[int, str]] = []
        monkeypatch.setattr(_watchdog, "_leave_for", lambda sync_dir, ranks: left.append(ranks))
        said = [f"add {running.pid} 1\n".encode(), f"add {ended.pid} 2\n".encode()]
        with contextlib.redirect_stderr(None):
            assert _watchdog.watch(said, 7, 5.0, str(tmp_path)) == 1
        assert left == [{running.pid: "1"}]
        assert _watchdog.group_alive(running.pid)  # a zombie, signal 0 still reaches it
    finally:
        for proc in (running, ended):
            proc.kill()
            proc.wait()


def test_a_rank_whose_main_thread_ended_is_still_stopped_by_the_watchdog() -> None:
    # Its leader shows as a zombie in /proc while another thread runs (and ignores
    # SIGTERM): only SIGKILL ends it.
    code = (
        "import ctypes, signal, threading, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: None)\n"
        "def spin():\n    while True:\n        ctypes.CDLL(None).pause()\n"
        "threading.Thread(target=spin).start()\n"
        "time.sleep(0.2)\nctypes.CDLL(None).pthread_exit(None)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while Path(f"/proc/{proc.pid}/stat").read_text().rpartition(") ")[2][0] != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert _watchdog._live({proc.pid: "0"}) == {proc.pid: "0"}
        with contextlib.redirect_stderr(None):
            _watchdog.watch([f"add {proc.pid} 0\n".encode()], os.getpid(), 0.3)
        assert proc.wait(timeout=TIMEOUT_S) == -signal.SIGKILL
    finally:
        proc.kill()
        proc.wait()


def test_the_watchdog_trusts_no_proc_of_another_pid_namespace(tmp_path: Path) -> None:
    # In a new pid namespace without its own /proc, /proc shows another's pids: a
    # running rank missing there is not taken for gone.
    (tmp_path / "1" / "task").mkdir(parents=True)  # another namespace's pid 1
    (tmp_path / "1" / "stat").write_text("1 (init) S 0 1 1")
    (tmp_path / "self").symlink_to("1")  # not this process's pid
    _proc.set_root(tmp_path)
    try:
        assert _watchdog._process_alive(os.getpid())
        assert _watchdog._live({os.getpgrp(): "0"}) == {os.getpgrp(): "0"}
    finally:
        _proc.set_root(None)


def test_the_watchdog_leaves_for_ranks_without_importing_numpy(tmp_path: Path) -> None:
    # python -I hides PYTHONPATH, where clusters' environment modules put numpy.
    code = (
        "import pathlib, runpy, sys\n"
        f"ns = runpy.run_path({str(Path(_watchdog.__file__))!r}, run_name='watchdog')\n"
        f"ns['_leave_for'](pathlib.Path({str(tmp_path)!r}), {{}})\n"
        "print(sorted(m for m in ('numpy', 'gradsync._job.reaping') if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-I", "-c", code], capture_output=True, text=True, check=False
    )
    assert out.stdout.strip() == "['gradsync._job.reaping']", (out.stdout, out.stderr)


def test_a_launch_that_ends_normally_leaves_no_watchdog(capsys: pytest.CaptureFixture[str]) -> None:
    # In this process, as a library call: its watchdog must be told to go and be reaped,
    # not linger (or stop the next job's ranks) until this process exits.
    assert main(["launch", "--nproc", "1", str(SCRIPTS / "print_env.py")]) == 0
    assert unannounced(capsys.readouterr().err) == ""
    ours = f"{_watchdog.__file__}\0{os.getpid()}\0".encode()
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            assert ours not in cmdline.read_bytes(), cmdline


# ---------------------------------------------------------------------------- bad arguments


def test_bad_argument_exits_2_with_message() -> None:
    code, out, err, _ = run_launch(["--nproc", "0", str(SCRIPTS / "print_env.py")])
    assert (code, out) == (2, "")
    assert err.startswith("usage: gradsync launch ")
    assert err.endswith("gradsync launch: error: --nproc must be >= 1, got 0\n")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nproc", "0"], "--nproc must be >= 1, got 0"),
        (["--nproc", "100000000"], "--nproc must be <= 4096, got 100000000"),
        (["--nproc", "1", "--sync-dir", ""], "--sync-dir must be a non-empty path, got ''"),
        (
            ["--nproc", "1", "--run-id", "abc\n"],
            "--run-id must be 1-64 characters from [A-Za-z0-9._-], got 'abc\\n'",
        ),
        (["--nproc", "two"], "argument --nproc: invalid int value: 'two'"),
        (["--nproc", "1", "--nnodes", "0"], "--nnodes must be >= 1, got 0"),
        (["--nproc", "1", "--node-rank", "-1"], "--node-rank must be >= 0, got -1"),
        (
            ["--nproc", "1", "--nnodes", "2", "--node-rank", "2", "--run-id", "j"],
            "--node-rank must be < --nnodes (2), got 2",
        ),
        (
            ["--nproc", "1", "--nnodes", "2", "--sync-dir", "/tmp/x"],
            "--nnodes 2 needs --run-id: pass the same id to the launcher on every node",
        ),
        (
            ["--nproc", "1", "--nnodes", "2", "--run-id", "j"],
            "--nnodes 2 needs --sync-dir: a directory on a filesystem every node shares",
        ),
        (
            ["--nproc", "1", "--run-id", "a b"],
            "--run-id must be 1-64 characters from [A-Za-z0-9._-], got 'a b'",
        ),
        (
            ["--nproc", "1", "--max-wait-s", "0"],
            "--max-wait-s must be a finite number of seconds > 0, got 0.0",
        ),
        (
            ["--nproc", "1", "--max-wait-s", "nan"],
            "--max-wait-s must be a finite number of seconds > 0, got nan",
        ),
        (
            ["--nproc", "1", "--grace-period-s", "-1"],
            "--grace-period-s must be a finite number of seconds >= 0, got -1.0",
        ),
        (["--nproc", "1", "--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_bad_arguments(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launch", *args, str(SCRIPTS / "print_env.py")]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.endswith(f"gradsync launch: error: {message}\n")


def test_missing_or_nonexistent_script(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launch", "--nproc", "1"]) == 2
    assert "gradsync launch: error: the following arguments are required: SCRIPT\n" in (
        capsys.readouterr().err
    )
    missing = str(tmp_path / "nope.py")
    assert main(["launch", "--nproc", "1", missing]) == 2
    assert capsys.readouterr().err.endswith(
        f"gradsync launch: error: SCRIPT {missing!r} is not a file, nor a directory with "
        "__main__.py\n"
    )


def test_unusable_sync_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert (
        main(["launch", "--nproc", "1", "--sync-dir", str(blocker), str(SCRIPTS / "print_env.py")])
        == 2
    )
    assert capsys.readouterr().err.endswith(
        f"gradsync launch: error: --sync-dir {str(blocker)!r} is not a directory\n"
    )


def test_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launch", "--help"]) == 0
    assert capsys.readouterr().out.startswith(
        "usage: gradsync launch [-h] --nproc N [--sync-dir DIR] [--max-wait-s S]"
    )


def test_second_signal_skips_the_grace_period(tmp_path: Path) -> None:
    args = ["--nproc", "2", "--grace-period-s", "60", str(SCRIPTS / "sleep.py"), str(tmp_path)]
    with launcher([*args, "--ignore-sigterm"]) as proc:
        wait_for_files(tmp_path, ["rank-0.json", "rank-1.json"], proc)
        start = time.monotonic()
        proc.send_signal(signal.SIGINT)
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == 130
    assert time.monotonic() - start < 5
    assert "sent SIGKILL (launcher signalled again); ranks still running: 0, 1\n" in err


def test_ignored_sighup_stays_ignored(tmp_path: Path) -> None:
    """Under ``nohup`` (SIGHUP ignored) a hangup must not stop the job."""
    args = [*LAUNCH, "--nproc", "1", str(SCRIPTS / "sleep.py"), str(tmp_path)]
    with subprocess.Popen(
        ["/bin/sh", "-c", 'trap "" HUP; exec "$@"', "sh", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        try:
            wait_for_files(tmp_path, ["rank-0.json"], proc)
            proc.send_signal(signal.SIGHUP)
            time.sleep(0.3)
            assert proc.poll() is None
            proc.send_signal(signal.SIGTERM)
            proc.communicate(timeout=TIMEOUT_S)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert proc.returncode == 143
