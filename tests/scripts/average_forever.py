"""Average a gradient step after step until stopped; after the first step, write DIR/ready-N.

SIGTERM (what the launcher sends) is left at its default: the process dies at once,
without closing its session, as a training script stopped that way would.
"""

import os
import sys

import numpy as np

import gradsync

out_dir = sys.argv[1]
cfg = gradsync.FileGradSyncConfig.from_env()
grads = [np.ones(1 << 17, np.float32)]  # 512 KiB: data files, sharded
gradsync.average_grads_file_sync(grads, None, cfg, 0)
with open(os.path.join(out_dir, f"ready-{cfg.rank}"), "w"):
    pass
step = 1
while True:
    gradsync.average_grads_file_sync(grads, None, cfg, step)
    step += 1
