"""A rank of an elastic job: the first process of each rank named in argv exits at the
call given there (default: rank 2 at its 10th); the launcher starts it again, it
rejoins, and broadcast gives it the others' state. Prints a digest.

    elastic_rejoin.py [LAST_STEP [RANK:CALL ...]]
"""

import hashlib
import os
import sys
import time

import numpy as np

from gradsync import FileGradSyncConfig, GradSync

LAST_STEP = int(sys.argv[1]) if len(sys.argv) > 1 else 39
EXITS = dict(map(int, a.split(":")) for a in sys.argv[2:]) if len(sys.argv) > 2 else {2: 10}
cfg = FileGradSyncConfig.from_env(elastic=True, min_world_size=2, heartbeat_timeout_s=3.0)
restart = int(os.environ["GRADSYNC_RESTART_COUNT"])
rng = np.random.default_rng(cfg.rank * 100 + restart)
state = np.arange(1000, dtype=np.float64) * (cfg.rank + 1)  # differs until broadcast
with GradSync(cfg) as gs:
    gs.broadcast([state])
    calls = 0
    while True:
        grad = rng.standard_normal(1000)
        stats = gs.average([grad])
        state -= 0.01 * grad
        calls += 1
        if restart == 0 and EXITS.get(cfg.rank) == calls:
            os._exit(3)
        if stats.joined:
            gs.broadcast([state])
        if stats.step >= LAST_STEP:
            break
        time.sleep(0.05)  # room for the restarted rank to join before the others end
    digest = hashlib.sha256(state.tobytes()).hexdigest()
    print(f"rank {cfg.rank} restart {restart} world {gs.world_size} digest {digest}", flush=True)
