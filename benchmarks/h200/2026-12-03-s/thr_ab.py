"""A/B of ``gradsync._protocol.REPLICATE_BELOW_BYTES`` on the numpy path.

W ranks average one float32 gradient, sharded (256 KiB threshold) against every rank
reducing all (64 MiB threshold), in interleaved rounds; prints the median step of the
slowest rank. Usage: ``thr_ab.py SIZES_MIB WORLD_SIZES ROUNDS STEPS [buf]``
(sizes and world sizes comma-separated; ``buf``: ``GradSync.buffers_like`` arrays).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from spawned import run_spawned

import gradsync
from gradsync import _protocol


def rank(r: int, w: int, d: str, thr: int, n: int, steps: int, buf: bool, q: Any) -> None:
    _protocol.REPLICATE_BELOW_BYTES = thr
    cfg = gradsync.FileGradSyncConfig(sync_dir=d, rank=r, world_size=w, run_id=f"t{thr}{buf}")
    gs = gradsync.GradSync(cfg)
    g = [np.empty(n, np.float32)]
    if buf:
        g = gs.buffers_like(g)
    times = []
    for i in range(steps + 20):
        g[0][:] = r + i
        t0 = time.perf_counter()
        gs.average(g)
        times.append(time.perf_counter() - t0)
        assert g[0][0] == i + (w - 1) / 2, (g[0][0], i)
    gs.close()
    q.put((r, times[20:]))


def main() -> None:
    sizes = [int(float(s) * 2**20) for s in sys.argv[1].split(",")]
    worlds = [int(x) for x in sys.argv[2].split(",")]
    rounds, steps = int(sys.argv[3]), int(sys.argv[4])
    buf = len(sys.argv) > 5 and sys.argv[5] == "buf"
    for size in sizes:
        for w in worlds:
            res: dict[str, list[float]] = {"shard": [], "repl": []}
            for _ in range(rounds):
                for name, thr in (("shard", 256 * 1024), ("repl", 64 * 2**20)):
                    d = tempfile.mkdtemp(dir="/dev/shm")
                    args = [(r, w, d, thr, size // 4, steps, buf) for r in range(w)]
                    out = run_spawned(rank, args)
                    slow = [max(t) for t in zip(*(t for _, t in out), strict=True)]
                    res[name].append(statistics.median(slow) * 1e3)
            ratios = [b / a for a, b in zip(res["shard"], res["repl"], strict=True)]
            print(
                f"{size / 2**20:g} MiB W={w} {'buf' if buf else 'copy'}: sharded "
                + " ".join(f"{x:.3f}" for x in res["shard"])
                + " | replicated "
                + " ".join(f"{x:.3f}" for x in res["repl"])
                + " ms;  ratio per round "
                + " ".join(f"{x:.2f}" for x in ratios),
                flush=True,
            )


if __name__ == "__main__":
    main()
