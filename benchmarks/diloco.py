"""DiLoCo against every-step gradient averaging: test loss and accuracy against wall time.

Runs ``examples/train_numpy_mlp.py`` (digits MLP, a quarter of the data held out) as
``gradsync launch --nproc 2`` on this host, once with every-step averaging and once per
DiLoCo period H, for several seeds. Wall time is the training loop's, evaluations
excluded. Prints a markdown table (time to the target test accuracy, final accuracy),
and writes the curves as CSV and an SVG picture (no matplotlib needed)::

    python benchmarks/diloco.py                       # H = 1 5 20 50, 3 seeds
    python benchmarks/diloco.py --every 20 --seeds 0 --out /tmp/dl
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_numpy_mlp.py"
COLORS = ["#000000", "#d62728", "#ff7f0e", "#2ca02c", "#1f77b4", "#9467bd"]


def run(every: int, seed: int, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """One job of 2 ranks; rank 0's JSON (with its evaluations)."""
    out = tmp / f"h{every}-s{seed}.json"
    eval_every = every if every >= 5 else 10  # DiLoCo: the synced model, just after a sync
    argv = [
        sys.executable, "-m", "gradsync", "launch", "--nproc", str(args.nproc), str(EXAMPLE),
        "--steps", str(args.steps), "--seed", str(seed), "--log-every", "0",
        "--test-fraction", "0.25", "--eval-every", str(eval_every),
        "--diloco-every", str(every), "--outer-lr", str(args.outer_lr),
        "--outer-momentum", str(args.outer_momentum), "--json-out", str(out),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} exited {done.returncode}:\n{done.stdout}{done.stderr}")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def time_to(evals: list[dict[str, float]], target: float) -> float:
    """Wall time of the first evaluation at or above ``target`` accuracy (inf: never)."""
    return next((e["time_s"] for e in evals if e["acc"] >= target), math.inf)


def label(every: int) -> str:
    return "every-step averaging" if every == 0 else f"DiLoCo H={every}"


def summarize(runs: dict[int, list[dict[str, Any]]], target: float) -> str:
    base = statistics.median(time_to(r["evals"], target) for r in runs[0])
    lines = [
        f"| mode | time to {target:.0%} test acc (median) | vs every-step | "
        "final test acc (mean) | train time (median) |",
        "|---|---|---|---|---|",
    ]
    for every, rs in runs.items():
        t = statistics.median(time_to(r["evals"], target) for r in rs)
        acc = statistics.mean(r["evals"][-1]["acc"] for r in rs)
        total = statistics.median(r["train_s"] for r in rs)
        lines.append(
            f"| {label(every)} | {t:.3f} s | {t / base:.2f}x | {acc:.2%} | {total:.3f} s |"
        )
    return "\n".join(lines)


def write_csv(runs: dict[int, list[dict[str, Any]]], path: Path) -> None:
    rows = ["every,seed,step,time_s,test_loss,test_acc"]
    for every, rs in runs.items():
        for seed, r in enumerate(rs):
            rows += [
                f"{every},{seed},{e['step']},{e['time_s']:.6f},{e['loss']:.6f},{e['acc']:.4f}"
                for e in r["evals"]
            ]
    path.write_text("\n".join(rows) + "\n")


def write_svg(runs: dict[int, list[dict[str, Any]]], path: Path, title: str) -> None:
    """Test loss (log scale, clipped to [0.03, 3]) against wall time, first seed's run."""
    w, h, left, right, top, bottom = 720, 420, 70, 190, 40, 50
    curves = {k: [(e["time_s"], e["loss"]) for e in rs[0]["evals"]] for k, rs in runs.items()}
    t_max = max(t for c in curves.values() for t, _ in c)
    lo, hi = math.log10(0.03), math.log10(3.0)

    def xy(t: float, loss: float) -> str:
        y = min(max(math.log10(max(loss, 1e-9)), lo), hi)
        px = left + (w - left - right) * t / t_max
        py = top + (h - top - bottom) * (hi - y) / (hi - lo)
        return f"{px:.1f},{py:.1f}"

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
        'font-family="sans-serif" font-size="12">',
        f'<rect width="{w}" height="{h}" fill="white"/>',
        f'<text x="{w / 2}" y="22" text-anchor="middle" font-size="14">{title}</text>',
        f'<path d="M{left},{top} V{h - bottom} H{w - right}" stroke="black" fill="none"/>',
        f'<text x="{(w - right + left) / 2}" y="{h - 12}" text-anchor="middle">'
        "wall time of training (s)</text>",
        f'<text x="16" y="{h / 2}" transform="rotate(-90 16 {h / 2})" text-anchor="middle">'
        "test loss (log)</text>",
    ]
    for loss in (0.03, 0.1, 0.3, 1.0, 3.0):
        x, y = xy(0, loss).split(",")
        parts.append(f'<text x="{float(x) - 6}" y="{float(y) + 4}" text-anchor="end">{loss}</text>')
    for i in range(5):
        t = t_max * i / 4
        x = xy(t, 3.0).split(",")[0]
        parts.append(f'<text x="{x}" y="{h - bottom + 16}" text-anchor="middle">{t:.2f}</text>')
    for i, (every, curve) in enumerate(curves.items()):
        color = COLORS[i % len(COLORS)]
        points = " ".join(xy(t, loss) for t, loss in curve)
        parts.append(f'<polyline points="{points}" fill="none" stroke="{color}" stroke-width="2"/>')
        ly = top + 10 + 20 * i
        parts.append(
            f'<line x1="{w - right + 10}" y1="{ly}" x2="{w - right + 30}" y2="{ly}" '
            f'stroke="{color}" stroke-width="2"/>'
        )
        parts.append(f'<text x="{w - right + 36}" y="{ly + 4}">{label(every)}</text>')
    parts.append("</svg>")
    path.write_text("\n".join(parts) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--every", type=int, nargs="+", default=[1, 5, 20, 50])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=600, help="inner steps (default 600)")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--target", type=float, default=0.95, help="test accuracy (0.95)")
    parser.add_argument("--outer-lr", type=float, default=0.7)
    parser.add_argument("--outer-momentum", type=float, default=0.9)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "diloco", help="prefix")
    args = parser.parse_args()
    runs: dict[int, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for every in [0, *args.every]:
            runs[every] = [run(every, seed, args, Path(tmp)) for seed in args.seeds]
    print(summarize(runs, args.target))
    write_csv(runs, args.out.with_suffix(".csv"))
    title = (
        f"digits MLP, {args.nproc} ranks on one host: DiLoCo (outer lr {args.outer_lr}, "
        f"momentum {args.outer_momentum}) vs every-step averaging"
    )
    write_svg(runs, args.out.with_suffix(".svg"), title)
    print(f"wrote {args.out.with_suffix('.csv')} and {args.out.with_suffix('.svg')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
