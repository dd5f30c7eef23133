"""The README's example and commands, run as written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _launch(args: list[str], cwd: Path, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gradsync", "launch", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def _run_first_python_block(text: str, tmp_path: Path) -> str:
    """Run the first python block of ``text`` on 2 ranks; its output, rank-prefixed."""
    code = re.search(r"```python\n(.*?)```", text, re.S)
    assert code is not None
    script = tmp_path / "example.py"
    script.write_text(code.group(1))
    result = _launch(["--nproc", "2", str(script)], tmp_path)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_readme_example_runs_on_two_ranks_and_agrees(tmp_path: Path) -> None:
    out = _run_first_python_block(README, tmp_path)
    lines = dict(re.findall(r"^\[rank (\d)\] rank \d: w = (.*)$", out, re.M))
    assert set(lines) == {"0", "1"}, out
    assert lines["0"] == lines["1"]
    w = [float(x) for x in lines["0"].strip("[]").split()]
    assert w == pytest.approx([1.0, -2.0, 0.5], abs=1e-3)


def test_readme_torch_examples_run_on_two_ranks_and_agree(tmp_path: Path) -> None:
    # The views of p.grad (function form) and the buffers_like recipe: one model on
    # both ranks, and the same one from both recipes.
    pytest.importorskip("torch")
    blocks = [b for b in re.findall(r"```python\n(.*?)```", README, re.S) if "import torch" in b]
    assert len(blocks) == 2, "the README no longer shows both torch recipes"
    weights = []
    for i, block in enumerate(blocks):
        script = tmp_path / f"torch_{i}.py"
        script.write_text(block)
        result = _launch(["--nproc", "2", str(script)], tmp_path)
        assert result.returncode == 0, result.stderr
        lines = dict(re.findall(r"^\[rank (\d)\] rank \d: (.*)$", result.stdout, re.M))
        assert set(lines) == {"0", "1"}, result.stdout
        weights += lines.values()
    assert len(set(weights)) == 1, weights


def test_the_two_node_commands_run_as_written(tmp_path: Path) -> None:
    # Both "nodes" on this host, the shared directory a temporary one.
    commands = re.findall(r"^# on node \d:\n(gradsync launch .*)$", README, re.M)
    assert len(commands) == 2, "the README no longer shows one command per node"
    shared = re.search(r"--sync-dir (\S+)", commands[0])
    assert shared is not None
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                *command.replace(shared[1], str(tmp_path / "sync")).split(),
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for command in commands
    ]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert [p.returncode for p in procs] == [0, 0], outs
    steps = re.findall(r"^\[rank (\d)\] step +(\d+) +loss (\S+)", outs[0][0] + outs[1][0], re.M)
    last = {rank: max((int(step), loss) for r, step, loss in steps if r == rank) for rank in "0123"}
    assert len(set(last.values())) == 1, last  # one model on all 4 ranks of both nodes
    assert re.search(r"^\[rank 0\] done: ", outs[0][0], re.M), outs[0]


def test_readme_example_runs_alone_as_the_readme_says(tmp_path: Path) -> None:
    command = re.search(r"`(GRADSYNC_WORLD_SIZE=1 GRADSYNC_RANK=0) python example\.py`", README)
    assert command is not None, "the README no longer says how to run the example alone"
    code = re.search(r"```python\n(.*?)```", README, re.S)
    assert code is not None
    (tmp_path / "example.py").write_text(code.group(1))
    env = {k: v for k, v in os.environ.items() if "WORLD_SIZE" not in k and "RANK" not in k}
    env.pop("GRADSYNC_SYNC_DIR", None)
    env.update(item.split("=") for item in command.group(1).split())
    result = subprocess.run(
        [sys.executable, "example.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "rank 0: w = [ 1.  -2.   0.5]\n"


def test_readme_buffers_example_runs_on_two_ranks(tmp_path: Path) -> None:
    out = _run_first_python_block(README.split("### Gradients that need no copy", 1)[1], tmp_path)
    found = sorted(re.findall(r"^\[rank \d\] (rank \d: .*)$", out, re.M))
    assert found == ["rank 0: 9.5", "rank 1: 9.5"], out


def test_readme_main_job_command_runs() -> None:
    match = re.search(
        r"^python3 -m pip install .*? && python3 -m gradsync (launch .*)$", README, re.M
    )
    assert match is not None, "the README's main-job command is gone"
    pytest.importorskip("sklearn", reason="the main job needs the examples extra")
    args = match.group(1).split()[1:]
    result = _launch(args, ROOT)
    assert result.returncode == 0, result.stderr
    assert re.search(r"^\[rank 0\] done: 100 steps", result.stdout, re.M)
    assert re.search(r"^\[rank 1\] step   99  loss", result.stdout, re.M)


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    # The set-up line of "Try it" that ends in the test run: CI's last line.
    commands = [line for line in README.splitlines() if line.endswith("&& python3 -m pytest")]
    assert len(commands) == 1, commands
    assert ci[-1] == commands[0]
    assert "bash .ci/test-floors.sh" in ci[-2]  # after the suite at the dependency floors


def test_every_test_the_readme_names_exists() -> None:
    # The guarantees point at the tests that hold them up; a renamed test must not
    # leave the README or docs/ pointing at nothing. ``::name`` continues the last named
    # file of the same document.
    docs = [README, *(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))]
    refs = [
        (doc_index, file, name)
        for doc_index, text in enumerate(docs)
        for file, name in re.findall(r"`((?:[\w/]*test_\w+\.py)?)::(\w+)(?:\[[^\]`]*\])?`", text)
    ]
    assert len(refs) >= 30, refs
    missing = []
    current = ""
    last_doc = -1
    for doc_index, file, name in refs:
        if doc_index != last_doc:
            current, last_doc = "", doc_index
        current = file or current
        path = ROOT / "tests" / Path(current).name
        if not path.exists():
            path = ROOT / "tests" / "multihost" / Path(current).name
        if not re.search(rf"^def {name}\(", path.read_text(), re.M):
            missing.append(f"{current}::{name}")
    assert missing == []
