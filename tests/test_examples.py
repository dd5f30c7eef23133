"""The examples, run for real: several ranks as separate processes on a pytest tmp_path."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
NUMPY_MLP = EXAMPLES / "train_numpy_mlp.py"
TORCH = EXAMPLES / "train_torch.py"
TORCH_DILOCO = EXAMPLES / "train_torch_diloco.py"
RUN_TIMEOUT_S = 45.0

try:
    import gradsync._cli.main  # noqa: F401
except Exception as exc:  # the launcher is optional for these tests
    CLI_IMPORT_ERROR: str | None = f"{type(exc).__name__}: {exc}"
else:
    CLI_IMPORT_ERROR = None

# Variables through which a rank learns its place in a job: never inherited from the
# environment pytest runs in, so that only what a test sets reaches the examples.
_JOB_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def clean_env(**extra: str) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("GRADSYNC_") and k not in _JOB_VARS
    }
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Make sure ``proc`` is gone and reaped: SIGTERM, then SIGKILL."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def processes(
    argvs: list[list[str]], envs: list[Mapping[str, str]], logs: Path
) -> Iterator[list[tuple[subprocess.Popen[bytes], Path]]]:
    """Start one process per argv (output to a file under ``logs``); reap them on exit."""
    logs.mkdir(parents=True, exist_ok=True)
    started: list[tuple[subprocess.Popen[bytes], Path]] = []
    try:
        for i, (argv, env) in enumerate(zip(argvs, envs, strict=True)):
            log = logs / f"proc{i}.log"
            with log.open("wb") as out:
                proc = subprocess.Popen(
                    argv, env=dict(env), stdin=subprocess.DEVNULL, stdout=out, stderr=out
                )
            started.append((proc, log))
        yield started
    finally:
        for proc, _ in started:
            _stop(proc)


def run_all(
    argvs: list[list[str]], envs: list[Mapping[str, str]], logs: Path
) -> list[tuple[int, str]]:
    """Run the processes concurrently to the end: (exit code, output) of each."""
    with processes(argvs, envs, logs) as procs:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        for proc, _ in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                outputs = "\n".join(f"--- {log.name}:\n{log.read_text()}" for _, log in procs)
                pytest.fail(f"processes still running after {RUN_TIMEOUT_S} s:\n{outputs}")
        return [(proc.returncode, log.read_text(errors="replace")) for proc, log in procs]


def run_ranks(
    script: Path, args: list[str], world: int, tmp_path: Path, name: str, **extra_env: str
) -> list[str]:
    """Run ``world`` ranks of ``script`` with gradsync's env vars; their outputs.

    With ``world == 1`` no job variables are set at all: the example's defaults apply.
    """
    sync_dir = tmp_path / f"{name}-sync"
    envs = [
        clean_env(**extra_env)
        if world == 1
        else clean_env(
            GRADSYNC_WORLD_SIZE=str(world),
            GRADSYNC_RANK=str(rank),
            GRADSYNC_SYNC_DIR=str(sync_dir),
            GRADSYNC_MAX_WAIT_S="30",
            **extra_env,
        )
        for rank in range(world)
    ]
    argvs = [[sys.executable, str(script), *args]] * world
    results = run_all(argvs, envs, tmp_path / f"{name}-logs")
    for rank, (code, out) in enumerate(results):
        assert code == 0, f"{name}: rank {rank} of {world} exited {code}:\n{out}"
    return [out for _, out in results]


_LOSS_LINE = re.compile(r"^(\[rank (\d+)\] )?step\s+(\d+)\s+loss (\S+)", re.MULTILINE)


def printed_losses(out: str) -> dict[int, str]:
    """{step: loss as printed} from one rank's output."""
    return {int(m[3]): m[4] for m in _LOSS_LINE.finditer(out)}


@pytest.mark.timeout(90)
def test_numpy_mlp_two_ranks_follow_the_one_rank_trajectory(tmp_path: Path) -> None:
    pytest.importorskip("sklearn", reason="the numpy MLP example trains on sklearn's digits")
    steps, batch = 20, 8
    common = ["--steps", str(steps), "--log-every", "1", "--seed", "3", "--dtype", "float64"]

    one_json = tmp_path / "one.json"
    (one_out,) = run_ranks(
        NUMPY_MLP,
        [*common, "--batch-size", str(2 * batch), "--json-out", str(one_json)],
        1,
        tmp_path,
        "one",
    )
    two_json = tmp_path / "two.json"
    two_outs = run_ranks(
        NUMPY_MLP,
        [*common, "--batch-size", str(batch), "--json-out", str(two_json)],
        2,
        tmp_path,
        "two",
    )

    one = json.loads(one_json.read_text())
    two = json.loads(two_json.read_text())
    assert (one["world_size"], one["batch_size"]) == (1, 2 * batch)
    assert (two["world_size"], two["batch_size"]) == (2, batch)
    assert len(one["losses"]) == len(two["losses"]) == steps
    np.testing.assert_allclose(two["losses"], one["losses"], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(two["accuracies"], one["accuracies"], rtol=0, atol=1e-12)
    assert one["losses"][-1] < one["losses"][0]  # it does learn

    # Every rank prints the same (global-batch) loss at every step.
    per_rank = [printed_losses(out) for out in two_outs]
    assert sorted(per_rank[0]) == list(range(steps)), two_outs[0]
    assert per_rank[0] == per_rank[1]
    assert per_rank[0] == printed_losses(one_out)


@pytest.mark.timeout(60)
@pytest.mark.skipif(
    CLI_IMPORT_ERROR is not None,
    reason=f"gradsync launch is unavailable: gradsync._cli.main fails ({CLI_IMPORT_ERROR})",
)
def test_numpy_mlp_under_gradsync_launch(tmp_path: Path) -> None:
    pytest.importorskip("sklearn", reason="the numpy MLP example trains on sklearn's digits")
    argv = [sys.executable, "-m", "gradsync", "launch", "--nproc", "2", str(NUMPY_MLP)]
    ((code, out),) = run_all(
        [[*argv, "--steps", "5", "--batch-size", "8"]], [clean_env()], tmp_path / "logs"
    )
    assert code == 0, out
    losses: dict[int, dict[int, str]] = {}
    for m in _LOSS_LINE.finditer(out):
        if m[1]:  # a "[rank N] " prefix
            losses.setdefault(int(m[2]), {})[int(m[3])] = m[4]
    assert sorted(losses) == [0, 1], f"expected [rank 0] and [rank 1] loss lines:\n{out}"
    assert losses[0] == losses[1], out
    assert sorted(losses[0]) == [0, 4], out  # --log-every 10: the first and last step
    assert re.search(r"^\[rank 0\] world size 2, batch 8 per rank", out, re.MULTILINE), out


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_torch_gradsync_matches_ddp_gloo(tmp_path: Path) -> None:
    pytest.importorskip("torch", reason="torch is only needed by examples/train_torch.py")
    args = ["--steps", "20", "--batch-size", "16", "--dataset", "synthetic", "--log-every", "5"]

    with_gradsync = tmp_path / "gradsync.npz"
    gs_outs = run_ranks(TORCH, [*args, "--save", str(with_gradsync)], 2, tmp_path, "gradsync")
    with_ddp = tmp_path / "ddp.npz"
    for attempt in range(3):  # the free port may be taken before rank 0 listens on it
        try:
            ddp_outs = run_ranks(
                TORCH,
                [*args, "--ddp", "--save", str(with_ddp)],
                2,
                tmp_path,
                f"ddp{attempt}",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(_free_port()),
            )
        except AssertionError as exc:
            if attempt == 2 or "EADDRINUSE" not in str(exc):
                raise
        else:
            break

    with np.load(with_gradsync) as a, np.load(with_ddp) as b:
        assert sorted(a.files) == sorted(b.files)
        assert a.files, "no parameters saved"
        for name in a.files:
            assert a[name].dtype == np.float32
            np.testing.assert_allclose(a[name], b[name], rtol=1e-6, atol=1e-7, err_msg=name)
    assert printed_losses(gs_outs[0]) == printed_losses(ddp_outs[0])
    assert printed_losses(gs_outs[0]) == printed_losses(gs_outs[1])


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_torch_ddp_over_the_gradsync_backend_under_torchrun_matches_gloo(tmp_path: Path) -> None:
    pytest.importorskip("torch", reason="torch is only needed by examples/train_torch.py")
    args = ["--steps", "20", "--batch-size", "16", "--dataset", "synthetic", "--log-every", "5"]
    saved, outputs = {}, {}
    for backend in ("gradsync", "gloo"):
        saved[backend] = tmp_path / f"{backend}.npz"
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        argv = [*torchrun, "--nproc-per-node", "2", str(TORCH), *args, "--ddp"]
        argv += ["--backend", backend, "--save", str(saved[backend])]
        env = clean_env(GRADSYNC_SYNC_DIR=str(tmp_path / "sync"), GRADSYNC_MAX_WAIT_S="30")
        ((code, out),) = run_all([argv], [env], tmp_path / f"{backend}-logs")
        assert code == 0, f"torchrun with {backend} exited {code}:\n{out}"
        assert f"DDP/{backend}: world size 2" in out, out
        outputs[backend] = out
    with np.load(saved["gradsync"]) as a, np.load(saved["gloo"]) as b:
        assert sorted(a.files) == sorted(b.files)
        assert a.files, "no parameters saved"
        for name in a.files:
            np.testing.assert_allclose(a[name], b[name], rtol=1e-6, atol=1e-7, err_msg=name)
    # Both ranks print each logged step's loss (torchrun interleaves them): one value a step.
    losses: dict[int, set[str]] = {}
    for m in _LOSS_LINE.finditer(outputs["gradsync"]):
        losses.setdefault(int(m[3]), set()).add(m[4])
    assert sorted(losses) == [0, 5, 10, 15, 19]
    assert all(len(v) == 1 for v in losses.values()), losses


@pytest.mark.timeout(60)
def test_numpy_mlp_diloco_syncs_every_h_steps(tmp_path: Path) -> None:
    pytest.importorskip("sklearn", reason="the numpy MLP example trains on sklearn's digits")
    out = tmp_path / "diloco.json"
    args = ["--steps", "20", "--diloco-every", "5", "--log-every", "0", "--json-out", str(out)]
    args += ["--test-fraction", "0.25", "--eval-every", "5"]
    run_ranks(NUMPY_MLP, args, 2, tmp_path, "diloco")
    result = json.loads(out.read_text())
    assert result["diloco_every"] == 5
    assert [i for i, ms in enumerate(result["sync_ms"]) if ms > 0] == [4, 9, 14, 19]
    assert [e["step"] for e in result["evals"]] == [5, 10, 15, 20]
    assert result["evals"][-1]["loss"] < result["evals"][0]["loss"]


@pytest.mark.timeout(90)
def test_torch_diloco_syncs_every_h_steps_and_ends_bit_identical(tmp_path: Path) -> None:
    pytest.importorskip("torch", reason="torch is only needed by examples/train_torch_diloco.py")
    pytest.importorskip("sklearn", reason="the torch DiLoCo example trains on sklearn's digits")
    save = tmp_path / "params"
    args = ["--steps", "23", "--diloco-every", "5", "--log-every", "1", "--save", str(save)]
    outs = run_ranks(TORCH_DILOCO, args, 2, tmp_path, "torch-diloco")
    for out in outs:  # every 5 steps, then once more so that the ranks end on one model
        assert "5 syncs (after steps 5, 10, 15, 20, 23)" in out, out
    # Each rank trains on its own shard between syncs, so their losses differ...
    assert printed_losses(outs[0]) != printed_losses(outs[1])
    # ...and the last sync leaves the same parameters on both, bit for bit.
    with np.load(f"{save}-rank0.npz") as a, np.load(f"{save}-rank1.npz") as b:
        assert sorted(a.files) == sorted(b.files) == ["0.bias", "0.weight", "2.bias", "2.weight"]
        for name in a.files:
            assert a[name].tobytes() == b[name].tobytes(), name
