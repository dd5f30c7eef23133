"""The README's and docs/'s examples and commands, run as written; their links lead somewhere."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
DOCS = {path.name: path.read_text() for path in sorted((ROOT / "docs").glob("*.md"))}
_PYTHON_BLOCK = re.compile(r"```python\n(.*?)```", re.S)
_HEADING = re.compile(r"^#+ (.*)$", re.M)


def _readme_example() -> str:
    """The ten-line example at the top of the README."""
    code = _PYTHON_BLOCK.search(README)
    assert code is not None
    return code.group(1)


def _torch_recipes() -> list[str]:
    """The README's DDP and ``p.grad.numpy()`` recipes, then docs/pytorch.md's
    ``buffers_like`` one: all three train the same model."""
    ddp = [b for b in _PYTHON_BLOCK.findall(README) if "DistributedDataParallel" in b]
    views = [b for b in _PYTHON_BLOCK.findall(README) if "p.grad.numpy()" in b]
    buffers = [b for b in _PYTHON_BLOCK.findall(DOCS["pytorch.md"]) if "buffers_like" in b]
    assert len(ddp) == 1, "the README no longer shows the DDP recipe"
    assert len(views) == 1, "the README no longer shows the p.grad.numpy() recipe"
    assert len(buffers) == 1, "docs/pytorch.md no longer shows the buffers_like recipe"
    return [ddp[0], views[0], buffers[0]]


def _buffers_example() -> str:
    """docs/api.md's numpy ``buffers_like`` example."""
    section = DOCS["api.md"].split("## Gradients that need no copy", 1)[1]
    code = _PYTHON_BLOCK.search(section)
    assert code is not None
    return code.group(1)


def _launch(args: list[str], cwd: Path, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gradsync", "launch", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def _run_on_two_ranks(code: str, tmp_path: Path) -> str:
    """Run ``code`` on 2 ranks; its output, rank-prefixed."""
    script = tmp_path / "example.py"
    script.write_text(code)
    result = _launch(["--nproc", "2", str(script)], tmp_path)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_readme_example_runs_on_two_ranks_and_agrees(tmp_path: Path) -> None:
    out = _run_on_two_ranks(_readme_example(), tmp_path)
    lines = dict(re.findall(r"^\[rank (\d)\] rank \d: w = (.*)$", out, re.M))
    assert set(lines) == {"0", "1"}, out
    assert lines["0"] == lines["1"]
    w = [float(x) for x in lines["0"].strip("[]").split()]
    assert w == pytest.approx([1.0, -2.0, 0.5], abs=1e-3)


def test_torch_recipes_run_on_two_ranks_and_agree(tmp_path: Path) -> None:
    # DDP over "gradsync", the views of p.grad (function form) and the buffers_like
    # recipe: one model on both ranks, and the same one from every recipe. The three
    # launches (each its own sync dir) run at once: most of their time is importing torch.
    pytest.importorskip("torch")
    launches = []
    for i, block in enumerate(_torch_recipes()):
        script = tmp_path / f"torch_{i}.py"
        script.write_text(block)
        launches.append(
            subprocess.Popen(
                [sys.executable, "-m", "gradsync", "launch", "--nproc", "2", str(script)],
                cwd=tmp_path,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    try:
        outs = [p.communicate(timeout=120) for p in launches]
    finally:
        for p in launches:
            p.kill()
            p.wait()
    weights: list[str] = []
    for p, (stdout, stderr) in zip(launches, outs, strict=True):
        assert p.returncode == 0, stderr
        lines = dict(re.findall(r"^\[rank (\d)\] rank \d: (.*)$", stdout, re.M))
        assert set(lines) == {"0", "1"}, stdout
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
    (tmp_path / "example.py").write_text(_readme_example())
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


def test_docs_buffers_example_runs_on_two_ranks(tmp_path: Path) -> None:
    out = _run_on_two_ranks(_buffers_example(), tmp_path)
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
    docs = [README, *DOCS.values()]
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


def test_every_python_block_of_the_readme_and_docs_is_run_by_these_tests() -> None:
    # A python block is a promise that it runs; snippets that cannot run alone are text.
    blocks = {b for text in [README, *DOCS.values()] for b in _PYTHON_BLOCK.findall(text)}
    assert blocks == {_readme_example(), *_torch_recipes(), _buffers_example()}


def _anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_relative_link_of_the_readme_and_docs_leads_to_a_file_and_heading() -> None:
    pages = {ROOT / "README.md": README}
    pages.update((ROOT / "docs" / name, text) for name, text in DOCS.items())
    broken = []
    for page, text in pages.items():
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            file, _, anchor = target.partition("#")
            path = (page.parent / file).resolve() if file else page
            if not path.exists():
                broken.append(f"{page.name}: {target}")
            elif anchor not in ["", *map(_anchor, _HEADING.findall(path.read_text()))]:
                broken.append(f"{page.name}: {target} (no such heading)")
    assert broken == []


def test_the_readme_links_every_docs_page() -> None:
    linked = set(re.findall(r"\]\(docs/([\w.-]+\.md)", README))
    assert linked == set(DOCS)
