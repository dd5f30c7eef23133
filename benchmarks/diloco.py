"""DiLoCo against every-step gradient averaging: test loss and accuracy against wall time.

Runs ``examples/train_numpy_mlp.py`` (digits MLP, a quarter of the data held out) as
``gradsync launch --nproc 2`` on this host, once with every-step averaging and once per
DiLoCo period H, for several seeds. Wall time is rank 0's training loop, evaluations
excluded. Prints a markdown table (time to the target test accuracy, final accuracy),
and writes the curves as CSV and an SVG picture (no matplotlib needed)::

    python benchmarks/diloco.py                       # H = 1 5 20 50, 3 seeds
    python benchmarks/diloco.py --every 20 --seeds 0 --out /tmp/dl

With ``--hosts 2`` the same jobs run across two simulated hosts of ``tests/multihost/rig``
(``--nproc`` ranks each, sync dir on their shared JuiceFS volume; needs root and
/dev/fuse, see tests/multihost/mh_cluster.py), written to ``benchmarks/diloco-multihost.*``::

    sudo python benchmarks/diloco.py --hosts 2 --outer-momentum 0.5

The same file, run with ``--worker`` by ``gradsync launch`` there, is one rank.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import runpy
import shutil
import statistics
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_numpy_mlp.py"
COLORS = ["#000000", "#d62728", "#ff7f0e", "#2ca02c", "#1f77b4", "#9467bd"]


def example_args(every: int, seed: int, args: argparse.Namespace, out: Path) -> list[str]:
    """The example's arguments for one job; rank 0 writes its JSON to ``out``."""
    eval_every = every if every >= 5 else 10  # DiLoCo: the synced model, just after a sync
    return [
        "--steps", str(args.steps), "--seed", str(seed), "--log-every", "0",
        "--test-fraction", "0.25", "--eval-every", str(eval_every),
        "--diloco-every", str(every), "--outer-lr", str(args.outer_lr),
        "--outer-momentum", str(args.outer_momentum), "--json-out", str(out),
    ]  # fmt: skip


def run(every: int, seed: int, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """One job of ``--nproc`` ranks on this host; rank 0's JSON (with its evaluations)."""
    out = tmp / f"h{every}-s{seed}.json"
    argv = [
        sys.executable, "-m", "gradsync", "launch", "--nproc", str(args.nproc), str(EXAMPLE),
        *example_args(every, seed, args, out),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} exited {done.returncode}:\n{done.stdout}{done.stderr}")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def run_hosts(every: int, seed: int, args: argparse.Namespace, cluster: Any) -> dict[str, Any]:
    """One job of ``--nproc`` ranks on each simulated host; rank 0's JSON."""
    from mh_cluster import MOUNT  # noqa: PLC0415 (tests/multihost, on sys.path in this mode)

    run_id = f"diloco-{uuid.uuid4().hex[:10]}"
    out = cluster.new_out(run_id)
    placement = {f"h{i + 1}": i for i in range(args.hosts)}
    job = cluster.launch(
        placement, args.nproc, f"{MOUNT}/{run_id}", run_id,
        ["--worker", *example_args(every, seed, args, out / "rank0.json")], out,
        script=Path(__file__).resolve(), max_wait_s=120.0,
    )  # fmt: skip
    codes = job.wait(300)
    if any(codes.values()):
        raise SystemExit(f"H={every} seed {seed}: exit codes {codes}\n{job.log_text()}")
    result: dict[str, Any] = json.loads((out / "rank0.json").read_text())
    cluster.on("h1", "rm", "-rf", f"{MOUNT}/{run_id}", timeout_s=120)
    shutil.rmtree(out, ignore_errors=True)
    return result


def worker(argv: list[str]) -> int:
    """One rank on a simulated host: the example as a script, without the rig's ``--out``."""
    if argv[:1] == ["--out"]:
        argv = argv[2:]
    sys.argv = [str(EXAMPLE), *(a for a in argv if a != "--worker")]
    runpy.run_path(str(EXAMPLE), run_name="__main__")  # exits with the example's status
    return 0


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
        reached = f"{t:.3f} s" if math.isfinite(t) else "not reached"
        ratio = f"{t / base:.2f}x" if math.isfinite(t) and math.isfinite(base) else "-"
        lines.append(f"| {label(every)} | {reached} | {ratio} | {acc:.2%} | {total:.3f} s |")
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
    """Test loss against wall time, both log scale (loss clipped to [0.03, 3]), first seed."""
    w, h, left, right, top, bottom = 720, 420, 70, 190, 40, 50
    curves = {k: [(e["time_s"], e["loss"]) for e in rs[0]["evals"]] for k, rs in runs.items()}
    t_lo = math.log10(min(c[0][0] for c in curves.values()))
    t_hi = math.log10(max(t for c in curves.values() for t, _ in c))
    lo, hi = math.log10(0.03), math.log10(3.0)

    def xy(t: float, loss: float) -> tuple[float, float]:
        y = min(max(math.log10(max(loss, 1e-9)), lo), hi)
        px = left + (w - left - right) * (math.log10(t) - t_lo) / (t_hi - t_lo)
        return px, top + (h - top - bottom) * (hi - y) / (hi - lo)

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
        'font-family="sans-serif" font-size="12">',
        f'<rect width="{w}" height="{h}" fill="white"/>',
        f'<text x="{w / 2}" y="22" text-anchor="middle" font-size="14">{title}</text>',
        f'<path d="M{left},{top} V{h - bottom} H{w - right}" stroke="black" fill="none"/>',
        f'<text x="{(w - right + left) / 2}" y="{h - 12}" text-anchor="middle">'
        "wall time of training (s, log)</text>",
        f'<text x="16" y="{h / 2}" transform="rotate(-90 16 {h / 2})" text-anchor="middle">'
        "test loss (log)</text>",
    ]
    for loss in (0.03, 0.1, 0.3, 1.0, 3.0):
        y = xy(10**t_lo, loss)[1]
        parts.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{loss}</text>')
    ticks = [m * 10.0**e for e in range(-3, 4) for m in (1, 2, 5)]
    for t in (t for t in ticks if t_lo <= math.log10(t) <= t_hi):
        x = xy(t, 3.0)[0]
        parts.append(f'<text x="{x:.1f}" y="{h - bottom + 16}" text-anchor="middle">{t:g}</text>')
    for i, (every, curve) in enumerate(curves.items()):
        color = COLORS[i % len(COLORS)]
        points = " ".join("{:.1f},{:.1f}".format(*xy(t, loss)) for t, loss in curve)
        parts.append(f'<polyline points="{points}" fill="none" stroke="{color}" stroke-width="2"/>')
        ly = top + 10 + 20 * i
        parts.append(
            f'<line x1="{w - right + 10}" y1="{ly}" x2="{w - right + 30}" y2="{ly}" '
            f'stroke="{color}" stroke-width="2"/>'
        )
        parts.append(f'<text x="{w - right + 36}" y="{ly + 4}">{label(every)}</text>')
    parts.append("</svg>")
    path.write_text("\n".join(parts) + "\n")


def run_all(args: argparse.Namespace) -> dict[int, list[dict[str, Any]]]:
    """Every mode for every seed, seeds outermost so that load drifts hit all modes alike."""
    modes = [0, *args.every]
    runs: dict[int, list[dict[str, Any]]] = {every: [] for every in modes}
    if not args.hosts:
        with tempfile.TemporaryDirectory() as tmp:
            for seed in args.seeds:
                for every in modes:
                    runs[every].append(run(every, seed, args, Path(tmp)))
        return runs
    sys.path.insert(0, str(ROOT / "tests" / "multihost"))
    from mh_cluster import Cluster, unavailable_reason  # noqa: PLC0415

    reason = unavailable_reason()
    if reason is not None:
        raise SystemExit(f"cannot run across simulated hosts: {reason}")
    cluster = Cluster(args.hosts, extra_env={"PYTHONPATH": str(ROOT / "src")})
    cluster.up()
    try:
        for seed in args.seeds:
            for every in modes:
                runs[every].append(run_hosts(every, seed, args, cluster))
                print(f"  done: {label(every)}, seed {seed}", file=sys.stderr)
    finally:
        if not args.keep_up:
            cluster.down()
    return runs


def main() -> int:
    if "--worker" in sys.argv[1:]:  # a rank on a simulated host, started by gradsync launch
        return worker(sys.argv[1:])
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--every", type=int, nargs="+", default=[1, 5, 20, 50])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=600, help="inner steps (default 600)")
    parser.add_argument("--nproc", type=int, default=2, help="ranks (per host with --hosts)")
    parser.add_argument("--hosts", type=int, default=0, help="simulated hosts (default 0: none)")
    parser.add_argument("--keep-up", action="store_true", help="--hosts: leave the cluster up")
    parser.add_argument("--target", type=float, default=0.95, help="test accuracy (0.95)")
    parser.add_argument("--outer-lr", type=float, default=0.7)
    parser.add_argument("--outer-momentum", type=float, default=0.9)
    parser.add_argument("--out", type=Path, help="prefix (benchmarks/diloco[-multihost])")
    args = parser.parse_args()
    name = "diloco-multihost" if args.hosts else "diloco"
    out: Path = args.out or ROOT / "benchmarks" / name
    runs = run_all(args)
    print(f"load average {os.getloadavg()[0]:.2f} (1 min) after the runs")
    print(summarize(runs, args.target))
    write_csv(runs, out.with_suffix(".csv"))
    where = (
        f"{args.hosts} simulated hosts x {args.nproc} ranks (JuiceFS)"
        if args.hosts
        else f"{args.nproc} ranks on one host"
    )
    title = f"digits MLP, {where}: DiLoCo outer lr {args.outer_lr}, momentum {args.outer_momentum}"
    write_svg(runs, out.with_suffix(".svg"), title)
    print(f"wrote {out.with_suffix('.csv')} and {out.with_suffix('.svg')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
