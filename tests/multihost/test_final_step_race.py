"""A rank that finishes its last step and closes must not make a slower peer fail.

Needs no cluster: two ranks on this machine (``gradsync launch --nproc 2``, tmpfs).
It lives here because the multi-host work found it (the benchmark's one-host
tmpfs run failed on its last step); it belongs with the protocol tests.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).resolve().parent / "race_worker.py"


def test_peer_closing_after_last_step_is_not_lost() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "gradsync", "launch", "--nproc", "2", str(WORKER)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert "RACE" not in proc.stderr, proc.stderr
    assert proc.returncode == 0, proc.stderr
