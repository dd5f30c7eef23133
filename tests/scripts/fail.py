"""Rank 1 fails (``exit3``: 12 stderr lines then exit code 3; ``sigkill``: SIGKILLs
itself); the other ranks sleep until they are stopped."""

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
    raise SystemExit(f"unknown mode {mode!r}")
time.sleep(30)
