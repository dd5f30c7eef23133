"""``gradsync status``: which rank is everyone waiting for?"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import gradsync
import workers
from ranks import run_ranks


def _status(sync_dir: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gradsync", "status", str(sync_dir), *extra],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _stuck(rank: int, world: int, sync_dir: str, big: bool) -> object:
    """Ranks 0 and 1 average two steps; rank 2 stops after one and idles, alive."""
    gs = gradsync.GradSync(gradsync.FileGradSyncConfig(world, rank, sync_dir, max_wait_s=4.0))
    shapes = workers.SHAPES_BIG if big else workers.SHAPES
    gs.average(workers.grads_for(rank, 0, shapes), step=7)
    if rank == 2:
        time.sleep(5.0)
        return None
    try:
        gs.average(workers.grads_for(rank, 1, shapes), step=8)
    except gradsync.PeerTimeoutError:
        return "timed out"
    return "averaged"


@pytest.mark.parametrize("big", [False, True], ids=["two-slots", "one-slot"])
def test_status_names_the_rank_everyone_waits_for(tmp_path: Path, big: bool) -> None:
    # Small gradients alternate two data files per rank, large ones reuse one: the
    # step of every rank's last call is read from whichever holds that call.
    box: dict[str, object] = {}
    thread = threading.Thread(
        target=lambda: box.update(run_ranks(_stuck, 3, (3, str(tmp_path), big), timeout_s=60))
    )
    thread.start()
    try:
        deadline = 30
        text = ""
        start = time.monotonic()
        while time.monotonic() - start < deadline:
            result = _status(tmp_path)
            text = result.stdout
            if "are waiting for ranks [2]" in text:
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
        thread.join(60)
    assert {r: o.value for r, o in box.items()} == {0: "timed out", 1: "timed out", 2: None}  # type: ignore[attr-defined]


def test_status_of_a_missing_directory(tmp_path: Path) -> None:
    result = _status(tmp_path / "nope")
    assert result.returncode == 1
    assert result.stderr == f"gradsync status: {tmp_path / 'nope'} is not a directory\n"
