"""DiLoCo with PyTorch (CPU): each rank trains alone with AdamW, gradsync syncs every H steps.

Run it alone (one rank, no environment needed)::

    python examples/train_torch_diloco.py

or as N ranks::

    gradsync launch --nproc 2 examples/train_torch_diloco.py --diloco-every 20

Each rank trains on its own shard of every global batch with its own inner optimizer
(AdamW, as in the DiLoCo paper, or ``--optimizer sgd``). ``gradsync.DiLoCo`` holds numpy
views of the parameters (``p.detach().numpy()`` shares the tensor's memory): every H
inner steps it averages the ranks' progress through gradsync and takes the outer
Nesterov step in place, so the model and the optimizer keep working on the same
tensors. If ``--steps`` is not a multiple of H, a last sync ends the run, so that every
rank ends with the same parameters, bit for bit. See docs/diloco.md.

torch is only needed by this example, not by gradsync.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

import gradsync


def gradsync_config() -> gradsync.FileGradSyncConfig:
    """The job's config from the environment; run directly, a world of one rank."""
    env = dict(os.environ)
    if "GRADSYNC_WORLD_SIZE" not in env and "WORLD_SIZE" not in env:
        env.update(GRADSYNC_WORLD_SIZE="1", GRADSYNC_RANK="0")
    return gradsync.FileGradSyncConfig.from_env(env)


def load_digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """scikit-learn's 8x8 digits in [0, 1]: train and test sets (a fixed quarter held out)."""
    from sklearn.datasets import load_digits as sk_digits  # noqa: PLC0415 (slow import)

    digits = sk_digits()
    x = torch.from_numpy((digits.data / 16.0).astype(np.float32))
    y = torch.from_numpy(digits.target.astype(np.int64))
    perm = torch.from_numpy(np.random.default_rng(1234).permutation(len(y)))
    test, train = perm[: len(y) // 4], perm[len(y) // 4 :]
    return x[train], y[train], x[test], y[test]


def batch_indices(step: int, global_batch: int, n: int, seed: int) -> npt.NDArray[np.int64]:
    """The global batch of ``step``, the same whatever the rank and world size."""
    per_epoch = n // global_batch
    if per_epoch == 0:
        raise ValueError(f"global batch {global_batch} is larger than the data ({n} samples)")
    epoch, k = divmod(step, per_epoch)
    perm = np.random.default_rng([seed, epoch]).permutation(n)
    return perm[k * global_batch : (k + 1) * global_batch]


def param_views(model: nn.Module) -> list[np.ndarray]:
    """numpy views sharing the memory of the model's (CPU, contiguous) parameters."""
    views = []
    for name, p in model.named_parameters():
        view = p.detach().numpy()
        if view.ctypes.data != p.data_ptr() or not view.flags.c_contiguous:
            raise TypeError(f"{name}: expected a contiguous CPU parameter viewed in place")
        views.append(view)
    return views


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="inner steps (default 200)")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per rank per step")
    parser.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    parser.add_argument("--lr", type=float, default=3e-3, help="inner lr (default 3e-3)")
    parser.add_argument("--diloco-every", type=int, default=20, help="sync every H steps (20)")
    parser.add_argument("--outer-lr", type=float, default=0.7, help="outer lr (default 0.7)")
    parser.add_argument("--outer-momentum", type=float, default=0.9, help="outer Nesterov (0.9)")
    parser.add_argument("--hidden", type=int, default=64, help="hidden units (default 64)")
    parser.add_argument("--seed", type=int, default=0, help="init and data order (default 0)")
    parser.add_argument("--log-every", type=int, default=20, help="0: only the summary")
    parser.add_argument("--save", type=Path, help="write SAVE-rankR.npz")
    args = parser.parse_args(argv)
    for name in ("steps", "batch_size", "hidden", "diloco_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def train(
    args: argparse.Namespace,
    model: nn.Module,
    inner: torch.optim.Optimizer,
    sync: gradsync.GradSync,
    x: torch.Tensor,
    y: torch.Tensor,
) -> list[int]:
    """Inner steps with a DiLoCo sync every H of them; the steps after which it synced."""
    rank, world = sync.cfg.rank, sync.cfg.world_size
    diloco = gradsync.DiLoCo(
        param_views(model),
        sync,
        every=args.diloco_every,
        outer_lr=args.outer_lr,
        outer_momentum=args.outer_momentum,
    )
    loss_fn = nn.CrossEntropyLoss()
    global_batch = world * args.batch_size
    synced_at: list[int] = []
    for step in range(1, args.steps + 1):
        batch = batch_indices(step - 1, global_batch, len(y), args.seed)
        mine = torch.from_numpy(batch[gradsync.shard_indices(global_batch, rank, world)])
        inner.zero_grad()
        loss = loss_fn(model(x[mine]), y[mine])
        loss.backward()
        inner.step()
        if diloco.step():  # every H steps: the same parameters on every rank
            synced_at.append(step)
        if args.log_every and (step % args.log_every == 0 or step == args.steps):
            print(f"step {step:4d}  loss {loss.item():.4f}  syncs {diloco.syncs}", flush=True)
    if diloco.calls % diloco.every:  # steps since the last sync: end on one model
        diloco.sync()
        synced_at.append(args.steps)
    return synced_at


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    x, y, x_test, y_test = load_digits()
    torch.manual_seed(args.seed)  # the same initial parameters on every rank
    model = nn.Sequential(nn.Linear(64, args.hidden), nn.Tanh(), nn.Linear(args.hidden, 10))
    inner: torch.optim.Optimizer
    if args.optimizer == "adamw":
        inner = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    else:
        inner = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    start = time.perf_counter()
    with gradsync.GradSync(gradsync_config()) as sync:
        rank = sync.cfg.rank
        synced_at = train(args, model, inner, sync, x, y)
    elapsed = time.perf_counter() - start
    with torch.no_grad():
        logits = model(x_test)
        test_loss = nn.functional.cross_entropy(logits, y_test).item()
        test_acc = (logits.argmax(dim=1) == y_test).double().mean().item()
    steps = [str(s) for s in synced_at]
    shown = ", ".join(steps if len(steps) <= 6 else [*steps[:3], "...", *steps[-2:]])
    print(
        f"done: {args.steps} inner steps, {len(synced_at)} syncs (after steps {shown}) "
        f"in {elapsed:.2f} s; test loss {test_loss:.4f}, test acc {test_acc:.3f}",
        flush=True,
    )
    if args.save is not None:
        path = args.save.with_name(f"{args.save.name}-rank{rank}.npz")
        np.savez(path, **{n: p.detach().numpy() for n, p in model.named_parameters()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
