"""One rank of a multi-host test job; started by ``python -m gradsync launch ... worker.py``.

Every rank averages ``--steps`` rounds of :func:`mh_data.grads_for` and writes, to
``--out`` (a directory the test can read: never the per-host /tmp):

    pid-<rank>.json      at start: pid and parent (launcher) pid as the host sees them,
                         host name; the test kills ranks by these ids
    steps-<rank>.jsonl   one line per finished step: sha256 of the mean, timings,
                         the generation directory, the codec the step used
    raw-<rank>-<step>    the mean's raw bytes (param after param), with --raw
    error-<rank>.json    the GradSyncError that ended the job (type, ranks, message, time)
    done-<rank>.json     the job finished

With ``--expect-loss`` a GradSyncError is recorded and the rank exits 0, so that
its launcher does not stop the host's other ranks before they record theirs.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

from mh_data import digest, grads_for

import gradsync


def _write_json(path: Path, data: dict[str, object]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layout", default="mixed")
    p.add_argument("--raw", action="store_true")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds before every step")
    p.add_argument("--stall", default="", help="RANK:STEP:SECONDS, one rank sleeps before a step")
    p.add_argument("--hb-interval", type=float, default=0.5)
    p.add_argument("--hb-timeout", type=float, default=5.0)
    p.add_argument("--expect-loss", action="store_true")
    p.add_argument("--linger", type=float, default=0.0, help="seconds before closing")
    p.add_argument("--compression", default=None, help="bf16, fp16 or int8")
    p.add_argument("--compress-local", action="store_true", help="compress on one host too")
    args = p.parse_args()

    cfg = gradsync.FileGradSyncConfig.from_env(
        heartbeat_interval_s=args.hb_interval,
        heartbeat_timeout_s=args.hb_timeout,
        compression=args.compression,
        compress_local=args.compress_local,
    )
    rank = cfg.rank
    out: Path = args.out
    _write_json(
        out / f"pid-{rank}.json",
        {"rank": rank, "pid": os.getpid(), "ppid": os.getppid(), "host": socket.gethostname()},
    )
    stall = {}
    if args.stall:
        r, s, secs = args.stall.split(":")
        stall = {(int(r), int(s)): float(secs)}

    steps_log = (out / f"steps-{rank}.jsonl").open("a", buffering=1)
    step = -1
    try:
        with gradsync.GradSync(cfg) as gs:
            for step in range(args.steps):
                if args.step_sleep:
                    time.sleep(args.step_sleep)
                if (rank, step) in stall:
                    time.sleep(stall[(rank, step)])
                grads = grads_for(args.seed, rank, step, args.layout)
                t0 = time.perf_counter()
                stats = gs.average(grads, step=step)
                wall = time.perf_counter() - t0
                if args.raw:
                    (out / f"raw-{rank}-{step}").write_bytes(b"".join(g.tobytes() for g in grads))
                steps_log.write(
                    json.dumps(
                        {
                            "step": step,
                            "sha256": digest(grads),
                            "wall_s": wall,
                            "total_s": stats.total_s,
                            "t": time.time(),
                            "gen": gs.generation_dir,
                            "compression": stats.compression,
                            "members": list(stats.members),  # elastic: who took part
                            "lost": list(stats.lost),
                            "epoch": stats.epoch,
                        }
                    )
                    + "\n"
                )
                if step == args.steps - 1 and args.linger:
                    # Once a work-around: a rank closing right after the last step made a
                    # slower peer raise a false PeerLostError (test_final_step_race.py);
                    # now its left-<rank> file says it finished the step. Default 0.
                    time.sleep(args.linger)
    except gradsync.GradSyncError as exc:
        _write_json(
            out / f"error-{rank}.json",
            {
                "type": type(exc).__name__,
                "mro": [c.__name__ for c in type(exc).__mro__],
                "message": str(exc),
                "ranks": list(getattr(exc, "ranks", []) or []),
                "step": step,
                "t": time.time(),
            },
        )
        print(f"rank {rank}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 0 if args.expect_loss else 1
    finally:
        steps_log.close()
    _write_json(out / f"done-{rank}.json", {"rank": rank, "t": time.time()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
