"""Overlapping the backward pass with averaging: ``GradSync.average_async`` on one host.

W rank processes (spawned) each run a training loop of ``--layers`` layers whose
backward pass yields one gradient per layer, last layer first, as DDP's buckets do.
Three loops, interleaved round by round in the same run:

- ``compute``  the backward pass alone (P per step);
- ``sync``     the averages alone, one ``average`` per layer (C per step);
- ``overlap``  each layer's gradient handed to ``average_async`` as soon as it is
               computed, every handle waited for at the end of the step.

A row's step time is the slowest rank's, median over steps of all rounds. The target:
``overlap <= max(P, C) + 0.25 * min(P, C)``. ``--compute sleep`` (default) stands for
work done elsewhere (a GPU, another process): the CPU is free meanwhile; ``--compute
numpy`` computes on this CPU (matrix products, which release the GIL), which a machine
with fewer free cores than ranks cannot overlap with the copies of the averaging.

Run: ``python benchmarks/overlap.py [--world 2] [--layers 8] [--mib 64] [--compute-ms 40]``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from typing import Any

# One BLAS thread per rank: --compute numpy measures one core's work per rank.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np

import gradsync


def _compute(args: argparse.Namespace, work: tuple[np.ndarray, ...] | None) -> None:
    """One layer's share of the backward pass."""
    if work is None:
        time.sleep(args.compute_ms / 1e3 / args.layers)
        return
    a, b, c = work
    for _ in range(args.matmuls):
        np.matmul(a, b, out=c)


def _loop(kind: str, gs: gradsync.GradSync, grads: list[np.ndarray], args: argparse.Namespace,
          work: tuple[np.ndarray, ...] | None, step: int) -> float:  # fmt: skip
    t0 = time.perf_counter()
    handles = []
    for layer in reversed(range(args.layers)):
        if kind != "sync":
            _compute(args, work)
        grads[layer].fill(step + layer)  # this step's gradient of the layer
        if kind == "sync":
            gs.average([grads[layer]])
        elif kind == "overlap":
            handles.append(gs.average_async([grads[layer]]))
    for h in handles:
        h.wait()
    return time.perf_counter() - t0


def worker(rank: int, args: argparse.Namespace, sync_dir: str, out: Any) -> None:
    cfg = gradsync.FileGradSyncConfig(args.world, rank, sync_dir, max_wait_s=120)
    n = args.mib * 2**20 // 4 // args.layers
    grads = [np.zeros(n, np.float32) for _ in range(args.layers)]
    work = None
    if args.compute == "numpy":
        rng = np.random.default_rng(rank)
        a, b = rng.standard_normal((2, 192, 192))
        work = (a, b, np.empty_like(a))
    times: dict[str, list[float]] = {"compute": [], "sync": [], "overlap": []}
    with gradsync.GradSync(cfg) as gs:
        step = 0
        for rnd in range(args.rounds + 1):  # round 0 warms up
            for kind, kept in times.items():
                gs.average([np.zeros(1, np.float32)])  # every rank starts the loop together
                for _ in range(args.steps if rnd else 2):
                    took = _loop(kind, gs, grads, args, work, step)
                    step += 1
                    if rnd:
                        kept.append(took)
    out.put((rank, times))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--mib", type=int, default=64, help="gradient MiB per rank per step")
    p.add_argument("--compute", choices=["sleep", "numpy"], default="sleep")
    p.add_argument("--compute-ms", type=float, default=40.0, help="P, with --compute sleep")
    p.add_argument("--matmuls", type=int, default=4, help="per layer, with --compute numpy")
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="gradsync-overlap-", dir="/dev/shm") as tmp:
        procs = [ctx.Process(target=worker, args=(r, args, tmp, out)) for r in range(args.world)]
        for proc in procs:
            proc.start()
        try:
            results = [out.get(timeout=600)[1] for _ in procs]
        finally:
            for proc in procs:
                proc.join(10)
                if proc.is_alive():
                    proc.kill()
    med = {
        kind: statistics.median(max(r[kind][i] for r in results) for i in range(len(ts)))
        for kind, ts in results[0].items()
    }
    p_s, c_s, o_s = med["compute"], med["sync"], med["overlap"]
    bound = max(p_s, c_s) + 0.25 * min(p_s, c_s)
    print(
        f"overlap: W={args.world}, {args.layers} layers, {args.mib} MiB/rank/step, compute "
        f"{args.compute}, {args.rounds}x{args.steps} steps, load {os.getloadavg()[0]:.2f}"
    )
    print(f"  compute alone P {p_s * 1e3:8.2f} ms/step (slowest rank, median)")
    print(f"  sync alone    C {c_s * 1e3:8.2f} ms/step")
    print(f"  overlapped      {o_s * 1e3:8.2f} ms/step (P + C = {(p_s + c_s) * 1e3:.2f} ms)")
    verdict = "met" if o_s <= bound else "NOT met"
    print(f"  target max(P, C) + 0.25 min(P, C) = {bound * 1e3:.2f} ms: {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
