"""Data-parallel PyTorch (CPU) training with gradsync, or with DDP over gloo to compare.

Run it alone (one rank, no environment needed)::

    python examples/train_torch.py

as N ranks averaging gradients through gradsync::

    gradsync launch --nproc 2 examples/train_torch.py

or as N ranks of DistributedDataParallel over gloo, for comparison (the launcher sets
RANK and WORLD_SIZE; MASTER_ADDR defaults to 127.0.0.1 and MASTER_PORT to 29500)::

    gradsync launch --nproc 2 examples/train_torch.py --ddp

or of DistributedDataParallel over the "gradsync" backend (``gradsync.torch``), under
either launcher (torchrun needs ``GRADSYNC_SYNC_DIR``)::

    gradsync launch --nproc 2 examples/train_torch.py --ddp --backend gradsync
    GRADSYNC_SYNC_DIR=/dev/shm/my-job torchrun --standalone --nproc-per-node 2 \
        examples/train_torch.py --ddp --backend gradsync

With gradsync, after ``loss.backward()`` every ``p.grad`` is averaged in place through
``p.grad.numpy()``, a numpy view sharing the tensor's memory; then the optimizer steps
as usual. Both modes shard each global batch the same way, so with the same seed they
end with the same parameters (bit for bit with 2 ranks: both compute the correctly
rounded mean of two float32 numbers).

torch is only needed by this example, not by gradsync.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch
import torch.distributed as dist
from torch import nn

import gradsync


def gradsync_config() -> gradsync.FileGradSyncConfig:
    """The job's config from the environment, as ``gradsync launch`` (or torchrun) sets it.

    Run directly without it, the script is a world of one rank: averaging is a no-op
    and needs no sync directory.
    """
    env = dict(os.environ)
    if "GRADSYNC_WORLD_SIZE" not in env and "WORLD_SIZE" not in env:
        env.update(GRADSYNC_WORLD_SIZE="1", GRADSYNC_RANK="0")
    return gradsync.FileGradSyncConfig.from_env(env)


def _env_int(env: Mapping[str, str], *names: str, default: int | None = None) -> int | None:
    for name in names:
        if name in env:
            try:
                return int(env[name])
            except ValueError:
                return None
    return default


def load_data(dataset: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``digits``: scikit-learn's bundled 8x8 digits; ``synthetic``: a random teacher."""
    if dataset == "digits":
        from sklearn.datasets import load_digits  # noqa: PLC0415 (optional, slow import)

        digits = load_digits()
        x = digits.data / 16.0
        y = digits.target
    else:
        rng = np.random.default_rng([seed, 1234])
        x = rng.standard_normal((2048, 64))
        teacher = rng.standard_normal((64, 10))
        y = (np.tanh(x @ teacher) + 0.5 * rng.standard_normal((2048, 10))).argmax(axis=1)
    return (
        torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)),
        torch.from_numpy(np.asarray(y, dtype=np.int64)),
    )


def batch_indices(step: int, global_batch: int, n: int, seed: int) -> npt.NDArray[np.int64]:
    """The global batch of ``step``, the same whatever the rank and world size."""
    per_epoch = n // global_batch
    if per_epoch == 0:
        raise ValueError(f"global batch {global_batch} is larger than the data ({n} samples)")
    epoch, k = divmod(step, per_epoch)
    perm = np.random.default_rng([seed, epoch]).permutation(n)
    return perm[k * global_batch : (k + 1) * global_batch]


def grad_views(model: nn.Module) -> list[np.ndarray]:
    """numpy views of every ``p.grad``, which gradsync can average in place.

    A view is only useful if it shares the tensor's memory, so each grad must be a
    dense, contiguous float32 CPU tensor; a missing grad (unused parameter) becomes
    zeros, as DDP would treat it.
    """
    views = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
        elif p.grad.is_sparse or p.grad.device.type != "cpu":
            raise TypeError(f"{name}: gradsync needs dense CPU grads, got {p.grad.layout}")
        elif not p.grad.is_contiguous():
            p.grad = p.grad.contiguous()
        view = p.grad.numpy()  # shares memory with p.grad: no copy
        if p.grad.dtype != torch.float32 or view.ctypes.data != p.grad.data_ptr():
            raise TypeError(f"{name}: expected a float32 grad viewed in place, got {p.grad.dtype}")
        views.append(view)
    return views


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps (default 100)")
    parser.add_argument(
        "--batch-size", type=int, default=32, help="samples per rank per step (default 32)"
    )
    parser.add_argument("--lr", type=float, default=0.1, help="learning rate (default 0.1)")
    parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (default 0.9)")
    parser.add_argument("--hidden", type=int, default=32, help="hidden units (default 32)")
    parser.add_argument("--seed", type=int, default=0, help="init and data order (default 0)")
    parser.add_argument("--dataset", choices=["digits", "synthetic"], default="digits")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads per rank (default 1)"
    )
    parser.add_argument(
        "--log-every", type=int, default=10, help="print every N steps, 0: never (default 10)"
    )
    parser.add_argument(
        "--ddp",
        action="store_true",
        help="average with torch DistributedDataParallel instead of gradsync's numpy views",
    )
    parser.add_argument(
        "--backend",
        choices=["gloo", "gradsync"],
        default="gloo",
        help="with --ddp, the torch.distributed backend (default gloo)",
    )
    parser.add_argument(
        "--save", type=Path, help="rank 0 writes the final parameters here (np.savez)"
    )
    args = parser.parse_args(argv)
    if args.backend != "gloo" and not args.ddp:
        parser.error("--backend needs --ddp")
    for name in ("steps", "batch_size", "hidden", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    x, y = load_data(args.dataset, args.seed)
    torch.manual_seed(args.seed)  # the same initial parameters on every rank
    model = nn.Sequential(nn.Linear(x.shape[1], args.hidden), nn.Tanh(), nn.Linear(args.hidden, 10))
    if args.ddp:
        rank = _env_int(os.environ, "RANK", "GRADSYNC_RANK", default=0)
        world = _env_int(os.environ, "WORLD_SIZE", "GRADSYNC_WORLD_SIZE", default=1)
        if rank is None or world is None:
            raise SystemExit("RANK and WORLD_SIZE must be integers")
        init_ddp(args.backend, rank, world)
        try:
            ddp = nn.parallel.DistributedDataParallel(model)
            train(args, ddp, model, None, x, y, rank, world)
            # Left to interpreter exit, torch's gloo teardown aborted about one
            # 2-rank run in seven here ("terminate called without an active
            # exception"); freeing DDP and meeting at a barrier before destroying
            # the group avoided it in 40 runs out of 40.
            del ddp
            gc.collect()
            dist.barrier()
        finally:
            dist.destroy_process_group()
    else:
        with gradsync.GradSync(gradsync_config()) as sync:
            rank, world = sync.cfg.rank, sync.cfg.world_size
            train(args, model, model, sync, x, y, rank, world)

    if rank == 0 and args.save is not None:
        np.savez(args.save, **{name: p.detach().numpy() for name, p in model.named_parameters()})
        print(f"saved parameters to {args.save}", flush=True)
    return 0


def init_ddp(backend: str, rank: int, world: int) -> None:
    """The default process group: gloo meets at MASTER_ADDR; gradsync at its sync dir,
    needing a torch store only to satisfy torch (torchrun's, or one of its own)."""
    if backend == "gloo":
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        dist.init_process_group("gloo", rank=rank, world_size=world)
        return
    import gradsync.torch  # noqa: F401, PLC0415 (registers the backend)

    if "MASTER_ADDR" in os.environ:  # torchrun
        dist.init_process_group("gradsync", rank=rank, world_size=world)
    else:
        dist.init_process_group("gradsync", store=dist.HashStore(), rank=rank, world_size=world)


def train(
    args: argparse.Namespace,
    net: nn.Module,
    model: nn.Module,
    sync: gradsync.GradSync | None,
    x: torch.Tensor,
    y: torch.Tensor,
    rank: int,
    world: int,
) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    loss_fn = nn.CrossEntropyLoss()  # mean over the local batch; shards are equal in size
    global_batch = world * args.batch_size
    how = f"DDP/{dist.get_backend()}" if sync is None else "gradsync"
    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters())
        print(
            f"{how}: world size {world}, batch {args.batch_size} per rank "
            f"({global_batch} global), {n_params} params, {x.shape[0]} samples",
            flush=True,
        )
    start = time.perf_counter()
    loss_value = float("nan")
    for step in range(args.steps):
        batch = batch_indices(step, global_batch, x.shape[0], args.seed)
        mine = torch.from_numpy(batch[gradsync.shard_indices(global_batch, rank, world)])
        xb, yb = x[mine], y[mine]
        optimizer.zero_grad()
        logits = net(xb)
        loss = loss_fn(logits, yb)
        accuracy = (logits.argmax(dim=1) == yb).double().mean()
        t0 = time.perf_counter()
        loss.backward()  # with DDP, the allreduce overlaps the backward pass
        metrics = np.array([loss.item(), accuracy.item()], dtype=np.float64)
        if sync is None:  # DDP averaged the grads during backward()
            dist.all_reduce(torch.from_numpy(metrics))  # sums in place
            metrics /= world
            sync_ms = (time.perf_counter() - t0) * 1e3
            label = "backward+allreduce"
        else:
            stats = sync.average([*grad_views(model), metrics], step=step)
            sync_ms = stats.total_s * 1e3
            label = "sync"
        optimizer.step()
        loss_value = float(metrics[0])
        if args.log_every and (step % args.log_every == 0 or step == args.steps - 1):
            print(
                f"step {step:4d}  loss {metrics[0]:.6f}  acc {metrics[1]:.3f}  "
                f"{label} {sync_ms:.2f} ms",
                flush=True,
            )
    if rank == 0:
        print(
            f"done: {args.steps} steps in {time.perf_counter() - start:.2f} s, "
            f"final loss {loss_value:.6f}",
            flush=True,
        )


if __name__ == "__main__":
    sys.exit(main())
