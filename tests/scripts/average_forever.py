"""Average a gradient step after step until stopped; after the first step, write
DIR/ready-N holding the rank's pid.

Usage: average_forever.py DIR [--heartbeat-timeout-s S] [--elsewhere] [--end-by HOW]

``--elsewhere`` makes this rank take itself for a process of another host (its peers
here then see neither its process nor it theirs: only files and heartbeats tell).
SIGTERM (what the launcher sends) is left at its default: the process dies at once,
without closing its session, as a training script stopped that way would.
``--end-by exception`` ends the process after the first step with an uncaught
ZeroDivisionError, ``--end-by sys.exit`` with ``sys.exit(3)``.
"""

import argparse
import os
import sys

import numpy as np

import gradsync
from gradsync._job import liveness as _liveness

parser = argparse.ArgumentParser()
parser.add_argument("out_dir")
parser.add_argument("--heartbeat-timeout-s", type=float, default=None)
parser.add_argument("--elsewhere", action="store_true")
parser.add_argument("--end-by", choices=["exception", "sys.exit"])
args = parser.parse_args()
if args.elsewhere:
    _liveness._host_id = lambda: "elsewhere/boot/pidns"
overrides = {}
if args.heartbeat_timeout_s is not None:
    overrides["heartbeat_timeout_s"] = args.heartbeat_timeout_s
cfg = gradsync.FileGradSyncConfig.from_env(**overrides)
grads = [np.ones(1 << 17, np.float32)]  # 512 KiB: data files, sharded
gradsync.average_grads_file_sync(grads, None, cfg, 0)
with open(os.path.join(args.out_dir, f"ready-{cfg.rank}"), "w") as f:
    f.write(str(os.getpid()))
if args.end_by == "exception":
    print(1 / 0)
elif args.end_by == "sys.exit":
    sys.exit(3)
step = 1
while True:
    gradsync.average_grads_file_sync(grads, None, cfg, step)
    step += 1
