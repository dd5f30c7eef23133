"""Broadcast on one host: ``GradSync.broadcast`` against the torch backend's former way
(the root's bytes as 32-bit words in float64 slots, averaged, then decoded).

W rank processes (spawned) broadcast N bytes from rank 0, both ways interleaved round by
round in the same run; a row gives the slowest rank's time per call, median over calls,
and the ratio native / former.

Run: ``python benchmarks/broadcast.py [--world 2] [--sizes-kib 4,1024,16384] [--calls 30]``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import tempfile
import time
from typing import Any

import numpy as np

import gradsync


def _former(gs: gradsync.GradSync, payload: np.ndarray, rank: int, world: int) -> np.ndarray:
    """The torch backend's broadcast before: encode, average, decode (torch.py)."""
    n = max(1, -(-payload.size // 4))
    words = np.zeros(n, np.uint32)
    if rank == 0:
        words.view(np.uint8)[: payload.size] = payload
    buf = words.astype(np.float64)
    gs.average([buf])
    got = np.rint(buf * world).astype(np.uint32).view(np.uint8)[: payload.size]
    payload[:] = got
    return payload


def _rank(rank: int, world: int, sync_dir: str, sizes: list[int], calls: int, out: Any) -> None:
    cfg = gradsync.FileGradSyncConfig(world, rank, sync_dir, max_wait_s=120.0)
    times: dict[tuple[str, int], list[float]] = {}
    with gradsync.GradSync(cfg) as gs:
        for size in sizes:
            payload = np.full(size, 7 if rank == 0 else 0, np.uint8)
            for _ in range(calls):
                for way in ("native", "former"):
                    payload[:] = 7 if rank == 0 else 0
                    gs.average([np.zeros(1, np.float32)])  # start together
                    t0 = time.perf_counter()
                    if way == "native":
                        gs.broadcast([payload])
                    else:
                        _former(gs, payload, rank, world)
                    times.setdefault((way, size), []).append(time.perf_counter() - t0)
                    assert (payload == 7).all()
    out.put((rank, times))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--sizes-kib", default="4,1024,16384")
    parser.add_argument("--calls", type=int, default=30)
    args = parser.parse_args()
    sizes = [int(k) * 1024 for k in args.sizes_kib.split(",")]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory(dir="/dev/shm") as sync_dir:
        procs = [
            ctx.Process(target=_rank, args=(r, args.world, sync_dir, sizes, args.calls, out))
            for r in range(args.world)
        ]
        for p in procs:
            p.start()
        results = dict(out.get() for _ in procs)
        for p in procs:
            p.join()
    print(f"world {args.world}, {args.calls} calls per row; ms per call (slowest rank, median)")
    print(f"{'bytes':>10} {'native':>9} {'former':>9} {'ratio':>6}")
    for size in sizes:
        row = {}
        for way in ("native", "former"):
            per_rank = [results[r][(way, size)] for r in results]
            slowest = [max(c) for c in zip(*per_rank, strict=True)]
            row[way] = statistics.median(slowest) * 1e3
        ratio = row["native"] / row["former"]
        print(f"{size:>10} {row['native']:>9.3f} {row['former']:>9.3f} {ratio:>6.2f}")


if __name__ == "__main__":
    main()
