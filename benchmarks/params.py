"""Step time against the number of params: what a step costs per gradient array.

Two ranks average 4 MiB of float32 split into 1, 100, 1,000 and 10,000 arrays (sync dir
on tmpfs) and report the median of the slower rank's ``StepStats.total_s``. With several
``--src`` trees (``src`` folders of gradsync checkouts) the runs alternate between them
round by round, and the last line gives each tree's ratio to the first, as the median
of the same-round ratios: this machine's speed drifts between runs.

Run: ``python benchmarks/params.py [--src A/src --src B/src] [--rounds 3] [--steps 300]
[--counts 1,100,1000,10000] [--check-finite]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

TOTAL_ELEMS = 1 << 20  # 4 MiB of float32
WARMUP = 20

RANK = """
import json, sys
import numpy as np
import gradsync
rank, sync_dir, steps, counts, finite = sys.argv[1:6]
cfg = gradsync.FileGradSyncConfig(
    world_size=2, rank=int(rank), sync_dir=sync_dir, max_wait_s=60, check_finite=finite == "1"
)
rng = np.random.default_rng(int(rank))
out = {}
with gradsync.GradSync(cfg) as gs:
    for n in map(int, counts.split(",")):
        sizes = [TOTAL // n] * n
        sizes[-1] += TOTAL - sum(sizes)
        grads = [rng.standard_normal(s, dtype=np.float32) for s in sizes]
        times = [gs.average(grads).total_s for _ in range(int(steps) + WARMUP)]
        out[n] = times[WARMUP:]
print(json.dumps(out))
""".replace("TOTAL", str(TOTAL_ELEMS)).replace("WARMUP", str(WARMUP))


def run(src: str, args: argparse.Namespace) -> dict[int, float]:
    """One two-rank run with gradsync from ``src``: median step (s) per param count."""
    sync_dir = tempfile.mkdtemp(dir="/dev/shm", prefix="gradsync-params-")
    env = dict(os.environ, PYTHONPATH=os.path.abspath(src))
    argv = [args.steps, args.counts, "1" if args.check_finite else "0"]
    try:
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", RANK, str(r), sync_dir, *map(str, argv)],
                env=env,
                stdout=subprocess.PIPE,
                text=True,
            )
            for r in range(2)
        ]
        try:
            outs = [json.loads(p.communicate(timeout=600)[0]) for p in procs]
        finally:
            for p in procs:
                p.kill()
                p.wait()
        if any(p.returncode not in (0, -9) for p in procs):
            raise SystemExit(f"a rank failed with gradsync from {src}")
    finally:
        shutil.rmtree(sync_dir, ignore_errors=True)
    counts = [int(c) for c in args.counts.split(",")]
    slowest = {n: map(max, zip(*(o[str(n)] for o in outs), strict=True)) for n in counts}
    return {n: statistics.median(times) for n, times in slowest.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--src", action="append", help="a gradsync src folder (repeatable)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--counts", default="1,100,1000,10000")
    parser.add_argument("--check-finite", action="store_true")
    args = parser.parse_args()
    srcs = args.src or [os.path.join(os.path.dirname(__file__), "..", "src")]
    counts = [int(c) for c in args.counts.split(",")]
    results: dict[str, list[dict[int, float]]] = {s: [] for s in srcs}
    for r in range(args.rounds):
        for src in srcs if r % 2 == 0 else srcs[::-1]:
            got = run(src, args)
            results[src].append(got)
            figures = "  ".join(f"{n}: {got[n] * 1e3:.3f}" for n in counts)
            print(f"round {r + 1} {src}: ms a step by params  {figures}", flush=True)
    for src in srcs:
        medians = "  ".join(
            f"{n}: {statistics.median(m[n] for m in results[src]) * 1e3:.3f}" for n in counts
        )
        print(f"median over rounds, {src}: {medians}")
    for src in srcs[1:]:
        pairs = list(zip(results[srcs[0]], results[src], strict=True))
        ratios = "  ".join(
            f"{n}: {statistics.median(b[n] / a[n] for a, b in pairs):.2f}" for n in counts
        )
        print(f"{src} / {srcs[0]} (median of same-round ratios): {ratios}")


if __name__ == "__main__":
    main()
