"""Soak test: W ranks average small gradients for many steps; nothing may leak.

Each rank reports, after a short warm-up and again after the last step, its open file
descriptors (``/proc/self/fd``), its resident set size and the size of the sync
directory (apparent bytes, disk blocks, file count); the run fails if any grew beyond
noise. Every 100th step's result is also checked bit for bit against
``gradsync.average_host_grads``.

    python benchmarks/soak.py                      # W=4, 10,000 steps
    python benchmarks/soak.py --world 2 --steps 300

Not run in CI; tests/test_faults.py runs a short version through :func:`run`.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

import gradsync

WARMUP_STEPS = 20
CHECK_EVERY = 100
SHAPES: list[tuple[tuple[int, ...], str]] = [
    ((257,), "float32"),
    ((33,), "float16"),
    ((4, 4), "float64"),
]
# Growth allowed between the two samples.
RSS_SLACK_KIB = 4096
# A step's files: every rank's input and shard plus headers (4 KiB each, generously).
HEADER_SLACK = 4096


def inputs(rank: int, step: int) -> list[np.ndarray]:
    rng = np.random.default_rng([rank, step, 7])
    return [rng.standard_normal(shape).astype(dtype) for shape, dtype in SHAPES]


def dir_usage(path: Path) -> dict[str, int]:
    """Like ``du``: apparent bytes, allocated bytes and number of files under ``path``."""
    apparent = blocks = files = 0
    for root, dirs, names in os.walk(path):
        for name in names + dirs:
            try:
                st = os.lstat(os.path.join(root, name))
            except FileNotFoundError:  # removed by a peer while walking
                continue
            apparent += st.st_size
            blocks += st.st_blocks * 512
            files += name in names
    return {"bytes": apparent, "disk_bytes": blocks, "files": files}


def sample(sync_dir: Path) -> dict[str, int]:
    rss_kib = 0
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss_kib = int(line.split()[1])
    return {"fds": len(os.listdir("/proc/self/fd")), "rss_kib": rss_kib, **dir_usage(sync_dir)}


def rank_main(rank: int, world: int, sync_dir: str, steps: int) -> dict[str, Any]:
    """One rank: warm up, sample, average ``steps`` times, sample again."""
    cfg = gradsync.FileGradSyncConfig(world, rank, sync_dir, max_wait_s=60.0)
    t0 = time.monotonic()
    with gradsync.GradSync(cfg) as gs:
        for step in range(WARMUP_STEPS):
            gs.average(inputs(rank, step), step=step)
        start = sample(Path(sync_dir))
        t1 = time.monotonic()
        peak_bytes = peak_files = 0
        for step in range(WARMUP_STEPS, WARMUP_STEPS + steps):
            grads = inputs(rank, step)
            gs.average(grads, step=step)
            if step % CHECK_EVERY == 0:
                want = gradsync.average_host_grads([inputs(q, step) for q in range(world)])
                for i, (got, exp) in enumerate(zip(grads, want, strict=True)):
                    if got.tobytes() != exp.tobytes():
                        raise AssertionError(f"rank {rank} step {step} param {i}: wrong mean")
                usage = dir_usage(Path(sync_dir))
                peak_bytes = max(peak_bytes, usage["bytes"])
                peak_files = max(peak_files, usage["files"])
        t2 = time.monotonic()
        end = sample(Path(sync_dir))
    return {
        "rank": rank,
        "start": start,
        "end": end,
        "peak_bytes": peak_bytes,
        "peak_files": peak_files,
        "steps_per_s": steps / (t2 - t1),
        "wall_s": time.monotonic() - t0,
    }


def _child(rank: int, world: int, sync_dir: str, steps: int, out: Any) -> None:
    try:
        out.put((rank, True, rank_main(rank, world, sync_dir, steps)))
    except BaseException:
        out.put((rank, False, traceback.format_exc()))


def run(
    world: int, steps: int, sync_dir: str | Path, timeout_s: float = 900.0
) -> list[dict[str, Any]]:
    """Run ``world`` rank processes (spawned); return each rank's report, by rank."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_child, args=(r, world, str(sync_dir), steps, out)) for r in range(world)
    ]
    reports: dict[int, dict[str, Any]] = {}
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        while len(reports) < world:
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks {sorted(set(range(world)) - set(reports))} hung")
            try:
                rank, ok, value = out.get(timeout=1.0)
            except queue.Empty:
                dead = [
                    r for r, p in enumerate(procs) if p.exitcode is not None and r not in reports
                ]
                if dead:
                    raise RuntimeError(f"ranks {dead} died without a report") from None
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            reports[rank] = value
        for p in procs:
            p.join(30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        out.close()
        out.join_thread()
    return [reports[r] for r in range(world)]


def step_bytes(world: int) -> int:
    """An upper bound on the bytes one step leaves on disk."""
    payload = sum(int(np.prod(s)) * np.dtype(d).itemsize for s, d in SHAPES)
    return world * (2 * payload + 2 * HEADER_SLACK) + world * 256  # + abort notes, never


def check(reports: list[dict[str, Any]]) -> list[str]:
    """What grew beyond noise (empty when nothing did)."""
    world = len(reports)
    # At most three steps on disk, plus rendezvous/heartbeat files (a few per rank).
    max_bytes = 3 * step_bytes(world) + world * 1024
    max_files = 3 * (2 * world) + 4 * world + 4
    problems = []
    for rep in reports:
        r, start, end = rep["rank"], rep["start"], rep["end"]
        if end["fds"] > start["fds"]:
            problems.append(f"rank {r}: open fds grew {start['fds']} -> {end['fds']}")
        if end["rss_kib"] > start["rss_kib"] + RSS_SLACK_KIB:
            problems.append(f"rank {r}: RSS grew {start['rss_kib']} -> {end['rss_kib']} KiB")
        for key, bound in (("bytes", max_bytes), ("files", max_files)):
            if max(end[key], rep[f"peak_{key}"]) > bound:
                problems.append(
                    f"rank {r}: sync dir {key} {end[key]} (peak {rep[f'peak_{key}']}) "
                    f"exceeds {bound}"
                )
    return problems


def table(reports: list[dict[str, Any]]) -> str:
    rows = [
        "rank  fds start/end  RSS KiB start/end   dir bytes start/end  disk bytes start/end"
        "  files start/end  peak bytes/files  steps/s"
    ]
    for rep in reports:
        s, e = rep["start"], rep["end"]
        rows.append(
            f"{rep['rank']:>4}  {s['fds']:>5}/{e['fds']:<5}  {s['rss_kib']:>8}/{e['rss_kib']:<8}  "
            f"{s['bytes']:>9}/{e['bytes']:<9}  {s['disk_bytes']:>9}/{e['disk_bytes']:<9}  "
            f"{s['files']:>6}/{e['files']:<6}  {rep['peak_bytes']:>9}/{rep['peak_files']:<5}  "
            f"{rep['steps_per_s']:>7.0f}"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--sync-dir", type=Path, default=None, help="default: a fresh temp dir")
    args = parser.parse_args(argv)
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(prefix="gradsync-soak-", dir=base) as tmp:
        sync_dir = args.sync_dir or Path(tmp)
        t0 = time.monotonic()
        reports = run(args.world, args.steps, sync_dir)
        wall = time.monotonic() - t0
        after = dir_usage(sync_dir)
    print(f"soak: world {args.world}, {args.steps} steps (+{WARMUP_STEPS} warm-up), {wall:.1f} s")
    print(table(reports))
    print(f"sync dir after every rank closed: {after}")
    problems = check(reports)
    if after["files"]:
        problems.append(f"{after['files']} files left in the sync dir after a clean close")
    for line in problems:
        print("FAIL:", line)
    if not problems:
        print("OK: no growth in fds, RSS or sync-dir size")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
