"""A real DDP training step on CPU: the "gradsync" torch backend against gloo, one run.

W rank processes (spawned) each build the same model twice: one DDP over the default
process group ("gradsync", from ``import gradsync.torch``) and one over a gloo group of
the same ranks (``dist.new_group(backend="gloo")``). Rounds alternate between the two
(so both see the same drift of this shared machine); each step is forward, backward
(DDP's bucket allreduces overlapping it) and an SGD step, timed on every rank; a row's
step time is the slowest rank's, median over steps of all rounds. ``none`` is the same
step without DDP (the compute alone). ``allreduce`` rows time ``dist.all_reduce`` (SUM,
as DDP's default hook makes) of one float32 tensor of the model's size over each
group, no model. DDP's own buckets (without ``--bucket-cap-mb``) cut the MLP in two after
its first step (a first bucket of about 1 MiB, allreduced while the backward pass goes
on, holds the 4 MiB weight it reaches first); ``--bucket-cap-mb 25`` makes one bucket of
everything, whose communication is the ``allreduce`` row plus DDP's own work around it.

Run: ``python benchmarks/ddp.py [--world 2] [--model cnn|mlp] [--steps 40] [--rounds 3]
[--bucket-cap-mb 25] [--switch-interval 0.005]``.
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


def build(kind: str) -> Any:
    import torch  # noqa: PLC0415

    torch.manual_seed(0)
    nn = torch.nn
    if kind == "mlp":
        return nn.Sequential(
            nn.Flatten(), nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
            nn.Linear(1024, 10),
        )  # fmt: skip
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 7 * 7, 256), nn.ReLU(), nn.Linear(256, 10),
    )  # fmt: skip


def worker(rank: int, args: argparse.Namespace, tmp: str, out: Any) -> None:
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    import gradsync.torch  # noqa: F401, PLC0415

    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world))
    os.environ["GRADSYNC_SYNC_DIR"] = os.path.join(tmp, "sync")
    init = f"file://{os.path.join(tmp, 'store')}"
    dist.init_process_group("gradsync", init_method=init, rank=rank, world_size=args.world)
    groups = {"gradsync": None, "gloo": dist.new_group(backend="gloo")}
    models: dict[str, Any] = {name: build(args.model) for name in ("none", *groups)}
    # DDP's own buckets unless asked: its first (1 MiB) is allreduced during the backward.
    bucket = {} if args.bucket_cap_mb is None else {"bucket_cap_mb": args.bucket_cap_mb}
    for name, group in groups.items():
        models[name] = torch.nn.parallel.DistributedDataParallel(
            models[name], process_group=group, **bucket
        )
    opts = {name: torch.optim.SGD(m.parameters(), lr=0.01) for name, m in models.items()}
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, 1, 28, 28, generator=gen)
    y = torch.randint(0, 10, (args.batch,), generator=gen)
    start = torch.randn(sum(p.numel() for p in models["none"].parameters()), generator=gen)
    flat = start.clone()
    times: dict[str, list[float]] = {name: [] for name in (*models, *(f"ar-{g}" for g in groups))}
    for rnd in range(args.rounds + 1):  # round 0 warms up
        for name, group in groups.items():
            for _ in range(args.steps if rnd else 3):
                flat.copy_(start)  # a SUM in place doubles it: 128 calls would overflow
                dist.barrier(group=group)
                t0 = time.perf_counter()
                dist.all_reduce(flat, group=group)
                if rnd:
                    times[f"ar-{name}"].append(time.perf_counter() - t0)
        for name, model in models.items():
            dist.barrier()
            for _ in range(args.steps if rnd else 3):
                t0 = time.perf_counter()
                opts[name].zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                opts[name].step()
                if rnd:
                    times[name].append(time.perf_counter() - t0)
    params = sum(p.numel() for p in models["none"].parameters())
    dist.destroy_process_group()
    out.put((rank, times, params))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--model", choices=["cnn", "mlp"], default="cnn")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--bucket-cap-mb", type=float, default=None, help="DDP's (default: DDP's own buckets)"
    )
    p.add_argument(
        "--switch-interval", type=float, default=0.0, help="sys.setswitchinterval in the ranks"
    )
    args = p.parse_args(argv)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="gradsync-ddp-", dir="/dev/shm") as tmp:
        procs = [ctx.Process(target=worker, args=(r, args, tmp, out)) for r in range(args.world)]
        for proc in procs:
            proc.start()
        try:
            results = [out.get(timeout=600) for _ in procs]
        finally:
            for proc in procs:
                proc.join(10)
                if proc.is_alive():
                    proc.kill()
    slowest = {
        name: [max(r[1][name][i] for r in results) for i in range(len(results[0][1][name]))]
        for name in results[0][1]
    }
    report(args, results[0][2], {n: statistics.median(ts) for n, ts in slowest.items()})
    return 0


def report(args: argparse.Namespace, params: int, med: dict[str, float]) -> None:
    """Print the medians (seconds) and the ratios."""
    print(
        f"DDP step, {args.model} ({params} float32 params, {params * 4 / 2**20:.2f} MiB), "
        f"batch {args.batch}/rank, W={args.world}, {args.rounds}x{args.steps} steps, "
        f"bucket_cap_mb {'DDP default' if args.bucket_cap_mb is None else args.bucket_cap_mb}, "
        f"switch interval {args.switch_interval or sys.getswitchinterval():g} s, "
        f"load {os.getloadavg()[0]:.2f}"
    )
    for name in ("none", "gloo", "gradsync"):
        print(f"  {name:9s} {med[name] * 1e3:8.2f} ms/step (slowest rank, median)")
    comm_gs, comm_gloo = med["gradsync"] - med["none"], med["gloo"] - med["none"]
    print(f"  gradsync / gloo step: {med['gradsync'] / med['gloo']:.2f}x")
    for name in ("gloo", "gradsync"):
        ms = med[f"ar-{name}"] * 1e3
        print(f"  allreduce {name:9s} {ms:8.2f} ms (one tensor of the model's size)")
    print(f"  gradsync / gloo allreduce: {med['ar-gradsync'] / med['ar-gloo']:.2f}x")
    print(f"  best possible step ratio (compute / gloo step): {med['none'] / med['gloo']:.2f}x")
    print(
        f"  over the compute alone: gradsync +{comm_gs * 1e3:.2f}, gloo +{comm_gloo * 1e3:.2f} ms"
    )


if __name__ == "__main__":
    sys.exit(main())
