"""gradsync's whole step on GPU buffers against the raw device<->host copies it wraps.

Every rank (a spawned process, all sharing one GPU unless several are found) holds
float32 gradient buffers of the given size and, per step:

- raw naive:  ``queue.read_buffer`` + ``queue.write_buffer`` of every buffer (what a
              straightforward port would do, before any averaging);
- raw staged: the fastest plain copies: one persistent MAP_READ buffer + one map,
              and one persistent MAP_WRITE buffer + one copy back;
- gradsync:   ``average_grads_file_sync(buffers, device, cfg, step)``: download,
              the file protocol across ranks, upload; buffers change every step.
              "(host sync)" is the file protocol's share (``StepStats.total_s``).

All ranks start each of the three together (a barrier), so ranks that share a GPU
contend alike in all of them.

Reported per size: medians over steps of the slowest rank, and ratios.
Run: ``python benchmarks/wgpu_step.py --world-sizes 2 4 --sizes-mib 1 16 256``.
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
from typing import Any

import numpy as np


def _rank(
    rank: int,
    world: int,
    sync_dir: str,
    sizes: list[int],
    steps: int,
    report: Any,
    barrier: Any,
    threads: int | None,
) -> None:
    import wgpu  # noqa: PLC0415 - only ranks need a GPU

    import gradsync  # noqa: PLC0415

    bu = wgpu.BufferUsage
    dev = gradsync.request_device_for_rank(local_rank=rank, backend=os.environ.get("BACKEND"))
    info = dict(dev.adapter.info)
    cfg = gradsync.FileGradSyncConfig(world, rank, sync_dir, max_wait_s=120, threads=threads)
    fence = dev.create_buffer(size=4, usage=bu.COPY_SRC)
    rows = []
    step_no = 0
    with gradsync.GradSync(cfg) as gs:
        for nbytes in sizes:
            n = nbytes // 4
            host = np.random.default_rng(rank).standard_normal(n).astype(np.float32)
            buf = dev.create_buffer(size=nbytes, usage=bu.STORAGE | bu.COPY_SRC | bu.COPY_DST)
            rd = dev.create_buffer(size=nbytes, usage=bu.MAP_READ | bu.COPY_DST)
            wr = dev.create_buffer(size=nbytes, usage=bu.MAP_WRITE | bu.COPY_SRC)
            out = np.empty_like(host)
            times: dict[str, list[float]] = {"naive": [], "staged": [], "gradsync": [], "host": []}
            for i in range(steps + 1):
                host[:8] = rank + i  # inputs change every step
                dev.queue.write_buffer(buf, 0, host)
                dev.queue.read_buffer(fence, 0, 4)
                # Every phase starts on all ranks together, as a step does after backward():
                # ranks sharing a GPU then contend the same way in all three.
                barrier.wait()
                t0 = time.perf_counter()
                np.copyto(out, np.frombuffer(dev.queue.read_buffer(buf), np.float32))
                dev.queue.write_buffer(buf, 0, out)
                dev.queue.read_buffer(fence, 0, 4)
                t0_end = time.perf_counter()
                barrier.wait()
                t1 = time.perf_counter()
                enc = dev.create_command_encoder()
                enc.copy_buffer_to_buffer(buf, 0, rd, 0, nbytes)
                dev.queue.submit([enc.finish()])
                rd.map_sync(wgpu.MapMode.READ)
                np.copyto(out, np.frombuffer(rd.read_mapped(0, nbytes, copy=False), np.float32))
                rd.unmap()
                wr.map_sync(wgpu.MapMode.WRITE)
                wr.write_mapped(out, 0)
                wr.unmap()
                enc = dev.create_command_encoder()
                enc.copy_buffer_to_buffer(wr, 0, buf, 0, nbytes)
                dev.queue.submit([enc.finish()])
                dev.queue.read_buffer(fence, 0, 4)
                t1_end = time.perf_counter()
                barrier.wait()
                t2 = time.perf_counter()
                stats = gs.average([buf], step=step_no, device=dev)
                t3 = time.perf_counter()
                step_no += 1
                if i:  # the first round allocates staging buffers and files
                    times["naive"].append(t0_end - t0)
                    times["staged"].append(t1_end - t1)
                    times["gradsync"].append(t3 - t2)
                    times["host"].append(stats.total_s)
            check = np.frombuffer(dev.queue.read_buffer(buf, 0, 32), np.float32)
            want = np.float32(np.mean([r + steps for r in range(world)]))
            rows.append({"bytes": nbytes, "times": times, "ok": bool(np.all(check == want))})
            for b in (buf, rd, wr):
                b.destroy()
    report.put((rank, info, rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 16, 256])
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--json", default=None, help="write all rows here")
    ap.add_argument(
        "--threads", default="auto", help="gradsync threads per rank: auto (default) or N"
    )
    ap.add_argument("--timeout-s", type=float, default=300.0, help="per world size")
    args = ap.parse_args()
    sizes = [max(4, int(m * 2**20) // 4 * 4) for m in args.sizes_mib]
    threads = None if args.threads == "auto" else int(args.threads)
    ctx = mp.get_context("spawn")
    report = []
    for world in args.world_sizes:
        q = ctx.Queue()
        barrier = ctx.Barrier(world)
        sync_root = "/dev/shm" if os.path.isdir("/dev/shm") else None
        with tempfile.TemporaryDirectory(dir=sync_root) as d:
            procs = [
                ctx.Process(
                    target=_rank, args=(r, world, d, sizes, args.steps, q, barrier, threads)
                )
                for r in range(world)
            ]
            for p in procs:
                p.start()
            results = [q.get(timeout=args.timeout_s) for _ in procs]
            for p in procs:
                p.join(60)
        infos = {r: info for r, info, _ in results}
        print(
            f"\nW={world}, threads {args.threads}: adapters "
            + "; ".join(
                f"rank {r}: {i.get('device')} ({i.get('backend_type')})"
                for r, i in sorted(infos.items())
            )
        )
        print(
            f"{'MiB':>6} {'raw naive ms':>13} {'raw staged ms':>14} {'gradsync ms':>12} "
            f"{'(host sync)':>12} {'gs/naive':>9} {'gs/staged':>10} {'correct':>8}"
        )
        for k, nbytes in enumerate(sizes):
            per = [rows[k] for _, _, rows in results]
            slowest = {
                name: [max(p["times"][name][s] for p in per) for s in range(args.steps)]
                for name in ("naive", "staged", "gradsync", "host")
            }
            med = {name: statistics.median(v) for name, v in slowest.items()}
            ok = all(p["ok"] for p in per)
            print(
                f"{nbytes / 2**20:>6g} {med['naive'] * 1e3:>13.2f} {med['staged'] * 1e3:>14.2f} "
                f"{med['gradsync'] * 1e3:>12.2f} {med['host'] * 1e3:>12.2f} "
                f"{med['gradsync'] / med['naive']:>9.2f} "
                f"{med['gradsync'] / med['staged']:>10.2f} {ok!s:>8}"
            )
            report.append(
                {
                    "world": world,
                    "threads": args.threads,
                    "bytes": nbytes,
                    "median_s": med,
                    "correct": ok,
                    "adapters": infos,
                }
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2, default=str)
    sys.exit(0 if all(r["correct"] for r in report) else 1)


if __name__ == "__main__":
    main()
