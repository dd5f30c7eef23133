"""One rank of the chaos run (benchmarks/chaos.py starts it under ``gradsync launch
--elastic``): the digits MLP of examples/train_numpy_mlp.py, a fixed global batch split
among the ranks of the moment, and after every (re)join ``broadcast`` of the parameters,
the momentum and the step count from rank 0.

Writes into ``--out``: ``pid-<rank>`` (for the killer), ``progress-<rank>`` (the last
step done), ``events-<rank>-<restart>.jsonl`` (joins, losses, re-form times) and, at the
end, ``final-<rank>-<restart>.json`` (test accuracy and a hash of the whole state). After
the last step the ranks wait (up to ``--end-wait-s``) for ranks still restarting.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

import gradsync

STARTED = time.time()
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import train_numpy_mlp as mlp  # noqa: E402


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


class Log:
    """The events of this process, one JSON line each, flushed at once (it may be killed)."""

    def __init__(self, out: Path, rank: int, restart: int) -> None:
        self._file = (out / f"events-{rank}-{restart}.jsonl").open("a")
        self.rank, self.restart = rank, restart

    def __call__(self, event: str, **fields: Any) -> None:
        rec = {"event": event, "rank": self.rank, "restart": self.restart, "t": time.time()}
        self._file.write(json.dumps({**rec, **fields}) + "\n")
        self._file.flush()


def wait_for_restarted(gs: gradsync.GradSync, state: list[np.ndarray], wait_s: float) -> int:
    """After the last step, calls that admit ranks still restarting (one coming later
    would find no job and wait for a new one in vain), until every rank is a member or
    ``wait_s`` is over on some rank: a flag averaged over the ranks makes them agree.
    The number of calls."""
    flag = np.zeros(1)
    deadline = time.monotonic() + wait_s
    calls = 0
    while gs.world_size < gs.cfg.world_size:
        flag[0] = float(time.monotonic() > deadline)
        stats = gs.average([flag])
        calls += 1
        if stats.joined:
            gs.broadcast(state)
        if flag[0] > 0:
            break
        time.sleep(0.05)
    return calls


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--global-batch", type=int, default=120)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sleep-ms", type=float, default=20.0, help="compute time per step")
    p.add_argument("--min-world-size", type=int, default=1)
    p.add_argument("--heartbeat-timeout-s", type=float, default=3.0)
    p.add_argument("--end-wait-s", type=float, default=30.0, help="for restarted ranks")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    cfg = gradsync.FileGradSyncConfig.from_env(
        min_world_size=args.min_world_size, heartbeat_timeout_s=args.heartbeat_timeout_s
    )
    restart = int(os.environ.get("GRADSYNC_RESTART_COUNT", "0"))
    write_atomic(args.out / f"pid-{cfg.rank}", f"{os.getpid()} {restart}")
    log = Log(args.out, cfg.rank, restart)
    x, y, x_test, y_test = mlp.split_data(*mlp.load_data(np.float64), 0.25)
    params = mlp.init_params([x.shape[1], args.hidden, 10], args.seed, np.float64)
    velocity = [np.zeros_like(p) for p in params]
    clock = np.zeros(1)  # the next step, so that a joiner knows where the job is
    state = [*params, *velocity, clock]
    gb = args.global_batch
    with gradsync.GradSync(cfg) as gs:
        log("formed", t_start=STARTED, world=gs.world_size, epoch=gs.epoch)
        gs.broadcast(state)
        step = int(clock[0])
        log("joined", step=step, world=gs.world_size, epoch=gs.epoch, members=gs.members)
        while step < args.steps:
            batch = mlp.batch_indices(step, gb, x.shape[0], args.seed)
            mine = batch[gradsync.shard_indices(gb, gs.rank, gs.world_size)]
            _, _, grads = mlp.loss_and_grads(params, x[mine], y[mine])
            stats = gs.average(grads)
            if stats.step != step:
                raise RuntimeError(f"rank {cfg.rank}: average() did step {stats.step}, not {step}")
            mlp.sgd_momentum(params, velocity, grads, args.lr, args.momentum)
            if stats.lost or stats.joined:
                log(
                    "change",
                    step=step,
                    lost=list(stats.lost),
                    joined=list(stats.joined),
                    members=list(stats.members),
                    epoch=stats.epoch,
                    total_s=stats.total_s,
                )
            step += 1
            clock[0] = step
            if stats.joined:
                gs.broadcast(state)
            if step % 10 == 0:
                write_atomic(args.out / f"progress-{cfg.rank}", str(step))
            time.sleep(args.sleep_ms / 1e3)
        waits = wait_for_restarted(gs, state, args.end_wait_s)
        test_loss, test_acc, _ = mlp.loss_and_grads(params, x_test, y_test)
        digest = hashlib.sha256(b"".join(a.tobytes() for a in state)).hexdigest()
        final = {
            "rank": cfg.rank,
            "restart": restart,
            "step": step,
            "world": gs.world_size,
            "epoch": gs.epoch,
            "members": list(gs.members),
            "test_acc": test_acc,
            "test_loss": test_loss,
            "end_waits": waits,
            "sha256": digest,
        }
    write_atomic(args.out / f"final-{cfg.rank}-{restart}.json", json.dumps(final))
    return 0


if __name__ == "__main__":
    sys.exit(main())
