"""Data-parallel training of a small numpy MLP on scikit-learn's digits, with gradsync.

Run it alone (one rank, no environment needed)::

    python examples/train_numpy_mlp.py

or as N ranks::

    gradsync launch --nproc 2 examples/train_numpy_mlp.py --batch-size 32

Every step draws one *global* batch of ``world_size * batch_size`` samples from a
permutation that depends only on ``--seed`` and the epoch, and rank r trains on the
samples ``r, r + W, r + 2W, ...`` of it. Each rank computes the mean gradient of its
shard; gradsync averages those means (all shards have the same size), which gives the
gradient of the mean loss over the global batch. So N ranks with ``--batch-size B``
follow the same trajectory as one rank with ``--batch-size N*B``, up to rounding.

The printed loss and accuracy are those of the global batch: they travel through
gradsync as one extra float64 array of two elements.

With ``--diloco-every H`` the ranks do not average gradients: each trains on its own
shard and ``gradsync.DiLoCo`` averages their progress every H steps and takes an outer
Nesterov step (see docs/diloco.md); the printed loss and accuracy are then rank 0's own.
``--test-fraction`` holds out part of the data, evaluated every ``--eval-every`` steps.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import numpy.typing as npt

import gradsync

Array = npt.NDArray[np.floating]


def gradsync_config(compression: str | None = None) -> gradsync.FileGradSyncConfig:
    """The job's config from the environment, as ``gradsync launch`` (or torchrun) sets it.

    Run directly without it, the script is a world of one rank: averaging is a no-op
    and needs no sync directory.
    """
    env = dict(os.environ)
    if "GRADSYNC_WORLD_SIZE" not in env and "WORLD_SIZE" not in env:
        env.update(GRADSYNC_WORLD_SIZE="1", GRADSYNC_RANK="0")
    if compression is not None:
        env["GRADSYNC_COMPRESSION"] = compression
    return gradsync.FileGradSyncConfig.from_env(env)


def load_data(dtype: npt.DTypeLike) -> tuple[Array, npt.NDArray[np.int64]]:
    """The 1797 8x8 digits (bundled with scikit-learn), scaled to [0, 1]."""
    from sklearn.datasets import load_digits  # noqa: PLC0415 (slow import, after arg parsing)

    digits = load_digits()
    x = (digits.data / 16.0).astype(dtype)
    y = digits.target.astype(np.int64)
    return x, y


def init_params(sizes: list[int], seed: int, dtype: npt.DTypeLike) -> list[Array]:
    """Weights and biases ``[W1, b1, W2, b2, ...]``; the same on every rank for one seed."""
    rng = np.random.default_rng(seed)
    params: list[Array] = []
    for fan_in, fan_out in itertools.pairwise(sizes):
        params.append((rng.standard_normal((fan_in, fan_out)) / np.sqrt(fan_in)).astype(dtype))
        params.append(np.zeros(fan_out, dtype=dtype))
    return params


def loss_and_grads(
    params: list[Array], x: Array, y: npt.NDArray[np.int64]
) -> tuple[float, float, list[Array]]:
    """Mean softmax cross-entropy over ``x``, accuracy, and the gradients of that mean.

    Hidden layers use tanh. Gradients come back as fresh C-contiguous arrays of the
    parameters' dtype, ready to be averaged in place.
    """
    n = x.shape[0]
    acts = [x]
    h = x
    n_layers = len(params) // 2
    for i in range(n_layers):
        z = h @ params[2 * i] + params[2 * i + 1]
        h = np.tanh(z) if i < n_layers - 1 else z
        acts.append(h)
    logits = acts[-1]
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    rows = np.arange(n)
    loss = float(-log_probs[rows, y].mean())
    accuracy = float((logits.argmax(axis=1) == y).mean())

    delta = np.exp(log_probs)
    delta[rows, y] -= 1.0
    delta /= n  # gradient of the *mean* loss w.r.t. the logits
    grads: list[Array] = [np.empty(0)] * len(params)
    for i in reversed(range(n_layers)):
        grads[2 * i] = np.ascontiguousarray(acts[i].T @ delta)
        grads[2 * i + 1] = np.ascontiguousarray(delta.sum(axis=0))
        if i > 0:
            delta = (delta @ params[2 * i].T) * (1.0 - acts[i] ** 2)
    return loss, accuracy, grads


def batch_indices(step: int, global_batch: int, n: int, seed: int) -> npt.NDArray[np.int64]:
    """The global batch of ``step``: consecutive slices of a per-epoch permutation.

    Depends only on the step, the global batch size, the data size and the seed, never
    on the rank or world size. A batch never straddles two epochs: the last
    ``n % global_batch`` samples of each epoch's permutation are dropped.
    """
    per_epoch = n // global_batch
    if per_epoch == 0:
        raise ValueError(f"global batch {global_batch} is larger than the data ({n} samples)")
    epoch, k = divmod(step, per_epoch)
    perm = np.random.default_rng([seed, epoch]).permutation(n)
    return perm[k * global_batch : (k + 1) * global_batch]


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
    parser.add_argument("--dtype", choices=["float64", "float32"], default="float64")
    parser.add_argument(
        "--log-every", type=int, default=10, help="print every N steps, 0: never (default 10)"
    )
    parser.add_argument(
        "--json-out", type=Path, help="write per-step losses as JSON here (rank 0 only)"
    )
    parser.add_argument(
        "--diloco-every", type=int, default=0, help="DiLoCo: sync every H steps (default 0: off)"
    )
    parser.add_argument("--outer-lr", type=float, default=0.7, help="DiLoCo outer lr (0.7)")
    parser.add_argument(
        "--outer-momentum", type=float, default=0.9, help="DiLoCo outer Nesterov momentum (0.9)"
    )
    parser.add_argument(
        "--compression",
        choices=["none", "bf16", "fp16", "int8"],
        help="compress the published gradients (docs/compression.md; default: the environment;"
        " a job on one host compresses only with GRADSYNC_COMPRESS_LOCAL=1)",
    )
    parser.add_argument(
        "--test-fraction", type=float, default=0.0, help="held-out share of the data (default 0)"
    )
    parser.add_argument(
        "--eval-every", type=int, default=0, help="evaluate every N steps, 0: never (default 0)"
    )
    args = parser.parse_args(argv)
    if not 0 <= args.test_fraction < 1:
        parser.error("--test-fraction must be in [0, 1)")
    if args.eval_every and not args.test_fraction:
        parser.error("--eval-every needs --test-fraction")
    for name in ("diloco_every", "eval_every"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0")
    for name in ("steps", "batch_size", "hidden"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def split_data(
    x: Array, y: npt.NDArray[np.int64], test_fraction: float
) -> tuple[Array, npt.NDArray[np.int64], Array, npt.NDArray[np.int64]]:
    """Train and test sets: the test set is the same for every ``--seed``."""
    n_test = round(x.shape[0] * test_fraction)
    perm = np.random.default_rng(1234).permutation(x.shape[0])
    train, test = np.sort(perm[n_test:]), np.sort(perm[:n_test])
    return x[train], y[train], x[test], y[test]


def sgd_momentum(
    params: list[Array], velocity: list[Array], grads: list[Array], lr: float, momentum: float
) -> None:
    """Heavy-ball momentum SGD, in place."""
    for p, v, g in zip(params, velocity, grads, strict=True):
        np.multiply(v, momentum, out=v)
        np.add(v, g, out=v)
        np.subtract(p, lr * v, out=p)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dtype = np.dtype(args.dtype)
    x, y, x_test, y_test = split_data(*load_data(dtype), args.test_fraction)
    params = init_params([x.shape[1], args.hidden, 10], args.seed, dtype)
    velocity = [np.zeros_like(p) for p in params]

    with gradsync.GradSync(gradsync_config(args.compression)) as sync:
        rank, world = sync.cfg.rank, sync.cfg.world_size
        global_batch = world * args.batch_size
        # Every rank starts from rank 0's parameters; meeting the peers here also keeps
        # their start-up out of the timed loop, in either mode.
        sync.broadcast(params)
        diloco = None
        if args.diloco_every:
            diloco = gradsync.DiLoCo(
                params,
                sync,
                every=args.diloco_every,
                outer_lr=args.outer_lr,
                outer_momentum=args.outer_momentum,
            )
        if rank == 0:
            mode = f", DiLoCo every {args.diloco_every}" if diloco else ""
            print(
                f"world size {world}, batch {args.batch_size} per rank ({global_batch} global), "
                f"{sum(p.size for p in params)} {dtype} params, {x.shape[0]} samples{mode}",
                flush=True,
            )
        losses: list[float] = []
        accuracies: list[float] = []
        sync_ms: list[float] = []
        evals: list[dict[str, float]] = []
        train_s = 0.0  # wall time outside evaluations
        for step in range(args.steps):
            start = time.perf_counter()
            batch = batch_indices(step, global_batch, x.shape[0], args.seed)
            mine = batch[gradsync.shard_indices(global_batch, rank, world)]
            loss, accuracy, grads = loss_and_grads(params, x[mine], y[mine])
            metrics = np.array([loss, accuracy], dtype=np.float64)
            if diloco is None:
                sync.average([*grads, metrics], step=step)
                sgd_momentum(params, velocity, grads, args.lr, args.momentum)
                synced = True
            else:  # each rank steps alone; DiLoCo averages their progress every H steps
                sgd_momentum(params, velocity, grads, args.lr, args.momentum)
                synced = diloco.step()
            train_s += time.perf_counter() - start
            ms = sync.last_stats.total_s * 1e3 if synced and sync.last_stats else 0.0
            losses.append(float(metrics[0]))
            accuracies.append(float(metrics[1]))
            sync_ms.append(ms)
            if args.log_every and (step % args.log_every == 0 or step == args.steps - 1):
                print(
                    f"step {step:4d}  loss {metrics[0]:.6f}  acc {metrics[1]:.3f}  "
                    f"sync {ms:.2f} ms",
                    flush=True,
                )
            if args.eval_every and ((step + 1) % args.eval_every == 0 or step == args.steps - 1):
                test_loss, test_acc, _ = loss_and_grads(params, x_test, y_test)
                evals.append(
                    {"step": step + 1, "time_s": train_s, "loss": test_loss, "acc": test_acc}
                )
                if rank == 0 and args.log_every:
                    print(f"eval {step + 1:4d}  test loss {test_loss:.6f}  test acc {test_acc:.3f}")
        elapsed = train_s

    if rank == 0:
        print(
            f"done: {args.steps} steps in {elapsed:.2f} s, final loss {losses[-1]:.6f}, "
            f"mean sync {np.mean(sync_ms):.2f} ms/step",
            flush=True,
        )
        if args.json_out is not None:
            args.json_out.write_text(
                json.dumps(
                    {
                        "world_size": world,
                        "batch_size": args.batch_size,
                        "dtype": str(dtype),
                        "diloco_every": args.diloco_every,
                        "losses": losses,
                        "accuracies": accuracies,
                        "sync_ms": sync_ms,
                        "train_s": train_s,
                        "evals": evals,
                    }
                )
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
