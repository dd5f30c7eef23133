"""Rank 1 fails (``exit3``: 12 stderr lines then exit code 3; ``sigkill``: SIGKILLs
itself; ``raise``: an uncaught ValueError whose message has 16 lines); the other ranks
sleep until they are stopped."""

import os
import signal
import sys
import time

mode = sys.argv[1]
print("sync dir", os.environ["GRADSYNC_SYNC_DIR"], flush=True)
if os.environ["RANK"] == "1":
    time.sleep(0.2)  # let the peers start sleeping first
    if mode == "exit3":
        for i in range(12):
            print(f"err line {i}", file=sys.stderr)
        print("out line before exit", flush=True)
        sys.exit(3)
    if mode == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "raise":

        def deep(n: int) -> None:
            if n == 0:
                raise ValueError("bad batch 7\n" + "\n".join(f"detail {i}" for i in range(15)))
            deep(n - 1)

        deep(5)
    raise SystemExit(f"unknown mode {mode!r}")
time.sleep(30)
