"""Record this rank's pid and sync dir in DIR/rank-N.json, then sleep until stopped.

On SIGTERM it prints ``rank N got SIGTERM`` and exits 0, or with ``--ignore-sigterm``
ignores it (so only SIGKILL stops it).
"""

import json
import os
import signal
import sys
import time

out_dir = sys.argv[1]
rank = os.environ["RANK"]


def on_sigterm(signum, frame):
    print(f"rank {rank} got SIGTERM", flush=True)
    sys.exit(0)


if "--ignore-sigterm" in sys.argv:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
else:
    signal.signal(signal.SIGTERM, on_sigterm)
info = {"pid": os.getpid(), "sync_dir": os.environ["GRADSYNC_SYNC_DIR"]}
tmp = os.path.join(out_dir, f".rank-{rank}.json")
with open(tmp, "w") as f:
    json.dump(info, f)
os.rename(tmp, os.path.join(out_dir, f"rank-{rank}.json"))
time.sleep(30)
