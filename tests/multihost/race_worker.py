"""Reproduces a false PeerLostError on the last step (run by test_final_step_race.py).

Two ranks, one step. Two delays, which a busy machine can produce by itself, make
the race deterministic:

- rank 1 reduces slowly (0.2 s), so rank 0 lists ``s-1/`` before ``out-1`` exists;
- rank 0 is descheduled (0.5 s) between that listing and its liveness check.

Meanwhile rank 1 publishes ``out-1``, gathers, and closes (``left-1``). Rank 0's
liveness check then sees ``left-1`` and raises PeerLostError ("closed its gradsync
session before publishing its shard"), although ``out-1`` is there.
"""

from __future__ import annotations

import sys
import time

import numpy as np

import gradsync
from gradsync._step import engine as _protocol
from gradsync._step import peers as _peers

cfg = gradsync.FileGradSyncConfig.from_env()
engine = _protocol.StepEngine
if cfg.rank == 0:
    peer_files = _peers.PeerFiles
    check_alive = peer_files._check_alive

    def slow_check_alive(self, missing, step, seq, step_dir, what, elapsed):  # type: ignore[no-untyped-def]
        if "shard" in what:
            time.sleep(0.5)
        return check_alive(self, missing, step, seq, step_dir, what, elapsed)

    peer_files._check_alive = slow_check_alive  # type: ignore[method-assign]
else:
    reduce = engine._reduce

    def slow_reduce(self, *args):  # type: ignore[no-untyped-def]
        time.sleep(0.2)
        return reduce(self, *args)

    engine._reduce = slow_reduce  # type: ignore[method-assign]

grads = [np.full(1024, float(cfg.rank), dtype=np.float32)]
try:
    with gradsync.GradSync(cfg) as gs:
        gs.average(grads, step=0)
except gradsync.PeerLostError as exc:
    print(f"RACE rank {cfg.rank}: {exc}", file=sys.stderr)
    raise SystemExit(3) from None
assert grads[0][0] == 0.5, grads[0][:4]
