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

With ``--hosts 2`` the ranks run across two simulated hosts of ``tests/multihost/rig``
(``--world`` ranks each, sync dir on their shared JuiceFS volume; needs root and
/dev/fuse, see tests/multihost/mh_cluster.py); there the same file, run with
``--worker`` by ``gradsync launch``, is one rank::

    sudo python benchmarks/overlap.py --hosts 2 --mib 4 --compute-ms 200
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
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


def measure(cfg: gradsync.FileGradSyncConfig, args: argparse.Namespace) -> dict[str, list[float]]:
    """This rank's step times of each loop, round 0 (warm-up) left out."""
    n = args.mib * 2**20 // 4 // args.layers
    grads = [np.zeros(n, np.float32) for _ in range(args.layers)]
    work = None
    if args.compute == "numpy":
        rng = np.random.default_rng(cfg.rank)
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
    return times


def worker(rank: int, args: argparse.Namespace, sync_dir: str, out: Any) -> None:
    cfg = gradsync.FileGradSyncConfig(args.world, rank, sync_dir, max_wait_s=120)
    out.put((rank, measure(cfg, args)))


def run_one_host(args: argparse.Namespace) -> list[dict[str, list[float]]]:
    """``--world`` spawned ranks on this host, sync dir on tmpfs."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="gradsync-overlap-", dir="/dev/shm") as tmp:
        procs = [ctx.Process(target=worker, args=(r, args, tmp, out)) for r in range(args.world)]
        for proc in procs:
            proc.start()
        try:
            return [out.get(timeout=600)[1] for _ in procs]
        finally:
            for proc in procs:
                proc.join(10)
                if proc.is_alive():
                    proc.kill()


def run_hosts(args: argparse.Namespace, argv: list[str]) -> list[dict[str, list[float]]]:
    """``--world`` ranks on each of ``--hosts`` simulated hosts, sync dir on JuiceFS."""
    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "tests" / "multihost"))
    from mh_cluster import MOUNT, Cluster, unavailable_reason  # noqa: PLC0415

    reason = unavailable_reason()
    if reason is not None:
        raise SystemExit(f"cannot run across simulated hosts: {reason}")
    cluster = Cluster(args.hosts, extra_env={"PYTHONPATH": str(root / "src")})
    cluster.up()
    run_id = f"overlap-{uuid.uuid4().hex[:10]}"
    out = cluster.new_out(run_id)
    placement = {f"h{i + 1}": i for i in range(args.hosts)}
    job = cluster.launch(
        placement, args.world, f"{MOUNT}/{run_id}", run_id, ["--worker", *argv], out,
        script=Path(__file__).resolve(), max_wait_s=120.0,
    )  # fmt: skip
    try:
        codes = job.wait(590)
        if any(codes.values()):
            raise SystemExit(f"exit codes {codes}\n{job.log_text()}")
        world = args.world * args.hosts
        return [json.loads((out / f"overlap-{r}.json").read_text()) for r in range(world)]
    finally:
        cluster.on("h1", "rm", "-rf", f"{MOUNT}/{run_id}", timeout_s=120)
        if not args.keep_up:
            cluster.down()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--world", type=int, default=2, help="ranks (per host with --hosts)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--mib", type=int, default=64, help="gradient MiB per rank per step")
    p.add_argument("--compute", choices=["sleep", "numpy"], default="sleep")
    p.add_argument("--compute-ms", type=float, default=40.0, help="P, with --compute sleep")
    p.add_argument("--matmuls", type=int, default=4, help="per layer, with --compute numpy")
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--hosts", type=int, default=0, help="simulated hosts (default 0: none)")
    p.add_argument("--keep-up", action="store_true", help="--hosts: leave the cluster up")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:  # a rank on a simulated host, started by gradsync launch
        cfg = gradsync.FileGradSyncConfig.from_env()
        times = measure(cfg, args)
        (args.out / f"overlap-{cfg.rank}.json").write_text(json.dumps(times))
        return 0
    if args.hosts:
        names = ("world", "layers", "mib", "compute", "compute_ms", "matmuls", "steps", "rounds")
        same = [x for k in names for x in (f"--{k.replace('_', '-')}", str(getattr(args, k)))]
        results = run_hosts(args, same)
    else:
        results = run_one_host(args)
    med = {
        kind: statistics.median(max(r[kind][i] for r in results) for i in range(len(ts)))
        for kind, ts in results[0].items()
    }
    p_s, c_s, o_s = med["compute"], med["sync"], med["overlap"]
    bound = max(p_s, c_s) + 0.25 * min(p_s, c_s)
    where = f"{args.hosts} hosts x {args.world} (JuiceFS)" if args.hosts else f"W={args.world}"
    print(
        f"overlap: {where}, {args.layers} layers, {args.mib} MiB/rank/step, compute "
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
