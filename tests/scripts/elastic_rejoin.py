"""A rank of an elastic job: rank 2's first process exits at its 10th step; the launcher
starts it again, it rejoins, and broadcast gives it the others' state. Prints a digest."""

import hashlib
import os
import time

import numpy as np

from gradsync import FileGradSyncConfig, GradSync

LAST_STEP = 39
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
        if cfg.rank == 2 and restart == 0 and calls == 10:
            os._exit(3)
        if stats.joined:
            gs.broadcast([state])
        if stats.step >= LAST_STEP:
            break
        time.sleep(0.05)  # room for the restarted rank to join before the others end
    digest = hashlib.sha256(state.tobytes()).hexdigest()
    print(f"rank {cfg.rank} restart {restart} world {gs.world_size} digest {digest}", flush=True)
