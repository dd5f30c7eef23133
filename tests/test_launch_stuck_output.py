"""``gradsync launch`` whose own stdout drains slowly, or not at all: nothing is lost, and
stopping the ranks never waits for it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

LAUNCH = [sys.executable, "-m", "gradsync", "launch"]

# Prints LINES lines and a last one, then exits.
BURST = """\
for i in range(3000):
    print(f"line {i} " + "y" * 50)
print("LAST LINE")
"""

# Writes its pid, prints far more than a pipe holds, then sleeps.
CHATTY = """\
import os, sys, time
open(os.path.join(sys.argv[1], f"pid-{os.environ['RANK']}"), "w").write(str(os.getpid()))
for i in range(20000):
    print("chatter", i, "z" * 40)
sys.stdout.flush()
time.sleep(60)
"""


def test_a_slow_reader_of_the_launchers_output_gets_every_line(tmp_path: Path) -> None:
    # Two seconds after the rank ended, what was still in its pipe was dropped.
    script = tmp_path / "burst.py"
    script.write_text(BURST)
    proc = subprocess.Popen(
        [*LAUNCH, "--nproc", "1", str(script)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    assert proc.stdout is not None
    got = bytearray()
    with proc.stdout:
        while chunk := os.read(proc.stdout.fileno(), 4096):
            got += chunk
            time.sleep(0.1)  # 40 KB/s: the last 128 KiB take over 3 s
    assert proc.wait(timeout=30) == 0
    lines = got.decode().splitlines()
    assert len(lines) == 3001
    assert lines[-1] == "[rank 0] LAST LINE"


def test_sigterm_stops_the_ranks_while_the_launchers_stdout_is_stuck(tmp_path: Path) -> None:
    # The supervisor ended a progress bar's line before signalling, waiting for the lock
    # that a write to the full stdout held: the ranks ran on until someone read.
    script = tmp_path / "chatty.py"
    script.write_text(CHATTY)
    read_end, write_end = os.pipe()  # nobody reads it until the end
    proc = subprocess.Popen(
        [*LAUNCH, "--nproc", "2", "--grace-period-s", "1", str(script), str(tmp_path)],
        stdout=write_end,
        stderr=subprocess.DEVNULL,
    )
    os.close(write_end)
    try:
        deadline = time.monotonic() + 30
        while not all((tmp_path / f"pid-{r}").exists() for r in range(2)):
            assert time.monotonic() < deadline, "the ranks never started"
            time.sleep(0.05)
        pids = [int((tmp_path / f"pid-{r}").read_text()) for r in range(2)]
        time.sleep(1.0)  # both pipes full: the launcher's writer is stuck
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while any(os.path.exists(f"/proc/{pid}") for pid in pids):
            assert time.monotonic() < deadline, "the ranks still run 10 s after SIGTERM"
            time.sleep(0.05)
    finally:
        os.set_blocking(read_end, False)
        end = time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < end:
            try:
                os.read(read_end, 1 << 20)
            except BlockingIOError:
                time.sleep(0.05)
        os.close(read_end)
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
    assert proc.returncode == 143
