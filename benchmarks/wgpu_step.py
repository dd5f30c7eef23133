"""gradsync's whole step on GPU buffers against the raw device<->host copies it wraps.

Every rank (a spawned process, all sharing one GPU unless several are found) holds
float32 gradients of the given size (in ``--params`` buffers of about equal size; one
by default) and, per step:

- raw naive:  ``queue.read_buffer`` + ``queue.write_buffer`` of every buffer (what a
              straightforward port would do, before any averaging), timed until the
              GPU has finished ("naive"), and until the upload is queued ("queued");
- raw staged: the fastest plain copies: one persistent MAP_READ buffer + one map,
              and one persistent MAP_WRITE buffer + one copy back, until finished;
- gradsync:   ``average_grads_file_sync(buffers, device, cfg, step)``: download,
              the file protocol across ranks, upload; buffers change every step.
              It returns with the upload queued ("gradsync"); "+fence" waits for the
              GPU after it. "(host sync)" is the file protocol's share
              (``StepStats.total_s - download_s``, which includes queueing the
              upload).

Like is compared with like: gradsync against naive-queued (both return with the
upload queued), gradsync+fence against naive (both wait for the GPU).

``--profile`` also prints where gradsync's step goes: download, each phase of the
host sync (gather: queueing the upload), and the rest (checks, Python), medians
over ranks and steps.

All ranks start each of the three together (a barrier), so ranks that share a GPU
contend alike in all of them.

Reported per size: medians over steps of the slowest rank, and ratios.
Run: ``python benchmarks/wgpu_step.py --world-sizes 2 4 --sizes-mib 1 16 256``;
``--rounds N`` repeats it N times, interleaved, and lists each round's ratios.
"""

from __future__ import annotations

import argparse
import itertools
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
    params: int,
) -> None:
    import wgpu  # noqa: PLC0415 - only ranks need a GPU

    import gradsync  # noqa: PLC0415
    from gradsync._gpu import bridge as _wgpu  # noqa: PLC0415

    # The bridge's two copies, timed from outside (the benchmark alone wraps them).
    spans: dict[str, float] = {}

    def timed(name: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spans[name] = time.perf_counter() - t

        return wrapper

    # A step downloads through _download (download() checks its arguments, then calls
    # it); gradsync trees older than 2026-12-03 18:30 UTC only have download.
    bridge_cls: Any = _wgpu.WgpuBridge
    name = "_download" if hasattr(bridge_cls, "_download") else "download"
    setattr(bridge_cls, name, timed("download", getattr(bridge_cls, name)))

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
            # ``params`` buffers of about equal size (whole float32s) totalling nbytes.
            cuts = [n * k // params for k in range(params + 1)]
            spans_el = [(a, b) for a, b in itertools.pairwise(cuts) if b > a]
            host = np.random.default_rng(rank).standard_normal(n).astype(np.float32)
            bufs = [
                dev.create_buffer(size=4 * (b - a), usage=bu.STORAGE | bu.COPY_SRC | bu.COPY_DST)
                for a, b in spans_el
            ]
            rd = dev.create_buffer(size=nbytes, usage=bu.MAP_READ | bu.COPY_DST)
            wr = dev.create_buffer(size=nbytes, usage=bu.MAP_WRITE | bu.COPY_SRC)
            out = np.empty_like(host)
            times: dict[str, list[float]] = {name: [] for name in _SERIES}
            for i in range(steps + 1):
                host[:8] = rank + i  # inputs change every step
                for buf, (a, b) in zip(bufs, spans_el, strict=True):
                    dev.queue.write_buffer(buf, 0, host[a:b])
                dev.queue.read_buffer(fence, 0, 4)
                # Every phase starts on all ranks together, as a step does after backward():
                # ranks sharing a GPU then contend the same way in all three.
                barrier.wait()
                t0 = time.perf_counter()
                for buf, (a, b) in zip(bufs, spans_el, strict=True):
                    np.copyto(out[a:b], np.frombuffer(dev.queue.read_buffer(buf), np.float32))
                for buf, (a, b) in zip(bufs, spans_el, strict=True):
                    dev.queue.write_buffer(buf, 0, out[a:b])
                t0_queued = time.perf_counter()
                dev.queue.read_buffer(fence, 0, 4)
                t0_end = time.perf_counter()
                barrier.wait()
                t1 = time.perf_counter()
                enc = dev.create_command_encoder()
                for buf, (a, b) in zip(bufs, spans_el, strict=True):
                    enc.copy_buffer_to_buffer(buf, 0, rd, 4 * a, 4 * (b - a))
                dev.queue.submit([enc.finish()])
                rd.map_sync(wgpu.MapMode.READ)
                np.copyto(out, np.frombuffer(rd.read_mapped(0, nbytes, copy=False), np.float32))
                rd.unmap()
                wr.map_sync(wgpu.MapMode.WRITE)
                wr.write_mapped(out, 0)
                wr.unmap()
                enc = dev.create_command_encoder()
                for buf, (a, b) in zip(bufs, spans_el, strict=True):
                    enc.copy_buffer_to_buffer(wr, 4 * a, buf, 0, 4 * (b - a))
                dev.queue.submit([enc.finish()])
                dev.queue.read_buffer(fence, 0, 4)
                t1_end = time.perf_counter()
                barrier.wait()
                t2 = time.perf_counter()
                stats = gs.average(bufs, step=step_no, device=dev)
                t3 = time.perf_counter()
                dev.queue.read_buffer(fence, 0, 4)
                t4 = time.perf_counter()
                step_no += 1
                if i:  # the first round allocates staging buffers and files
                    times["naive"].append(t0_end - t0)
                    times["queued"].append(t0_queued - t0)
                    times["staged"].append(t1_end - t1)
                    times["gradsync"].append(t3 - t2)
                    times["fenced"].append(t4 - t2)
                    # total_s includes the download since 2026-12-04 (download_s).
                    host_s = stats.total_s - getattr(stats, "download_s", 0.0)
                    times["host"].append(host_s)
                    times["download"].append(spans["download"])
                    for name in _HOST_PHASES:
                        times[name].append(getattr(stats, name + "_s"))
                    times["rest"].append(t3 - t2 - spans["download"] - host_s)
            check = np.frombuffer(dev.queue.read_buffer(bufs[0], 0, 32), np.float32)
            want = np.float32(np.mean([r + steps for r in range(world)]))
            rows.append({"bytes": nbytes, "times": times, "ok": bool(np.all(check == want))})
            for b in (*bufs, rd, wr):
                b.destroy()
    report.put((rank, info, rows))


_HOST_PHASES = ("publish", "wait_inputs", "reduce", "wait_outputs", "gather")
_SERIES = (
    "naive",
    "queued",
    "staged",
    "gradsync",
    "fenced",
    "host",
    "download",
    "rest",
    *_HOST_PHASES,
)


def _profile_line(per: list[dict[str, Any]]) -> str:
    """Median over ranks and steps of each part of gradsync's step, in ms."""

    def med(name: str) -> float:
        return statistics.median(v for p in per for v in p["times"][name]) * 1e3

    parts = {name: med(name) for name in ("download", *_HOST_PHASES, "rest")}
    return "  ".join(f"{k} {v:.3f}" for k, v in parts.items())


def _rounds_summary(report: list[dict[str, Any]]) -> str:
    """Per world size and gradient size: each round's ratios and their median."""
    lines = ["", "rounds: ratio per round (median)"]
    keys = sorted({(r["world"], r["bytes"]) for r in report})
    for world, nbytes in keys:
        rows = [r for r in report if (r["world"], r["bytes"]) == (world, nbytes)]
        for name, num, den in (
            ("gs/queued", "gradsync", "queued"),
            ("fenced/naive", "fenced", "naive"),
        ):
            ratios = [r["median_s"][num] / r["median_s"][den] for r in rows]
            lines.append(
                f"W={world} {nbytes / 2**20:g} MiB {name:>13}: "
                + ", ".join(f"{x:.2f}" for x in ratios)
                + f"  ({statistics.median(ratios):.2f})"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 16, 256])
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--json", default=None, help="write all rows here")
    ap.add_argument(
        "--threads", default="auto", help="gradsync threads per rank: auto (default) or N"
    )
    ap.add_argument(
        "--params",
        type=int,
        default=1,
        help="gradient buffers per rank, of about equal size, totalling each size (default 1)",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every world size this many times, interleaved, then summarise the "
        "ratios per round (hosts drift between runs: compare within a round)",
    )
    ap.add_argument("--timeout-s", type=float, default=300.0, help="per world size")
    ap.add_argument("--profile", action="store_true", help="also print where gradsync's step goes")
    args = ap.parse_args()
    sizes = [max(4, int(m * 2**20) // 4 * 4) for m in args.sizes_mib]
    threads = None if args.threads == "auto" else int(args.threads)
    ctx = mp.get_context("spawn")
    report = []
    for rnd, world in itertools.product(range(1, args.rounds + 1), args.world_sizes):
        if args.rounds > 1:
            print(f"\n=== round {rnd} of {args.rounds}")
        q = ctx.Queue()
        barrier = ctx.Barrier(world)
        sync_root = "/dev/shm" if os.path.isdir("/dev/shm") else None
        with tempfile.TemporaryDirectory(dir=sync_root) as d:
            procs = [
                ctx.Process(
                    target=_rank,
                    args=(r, world, d, sizes, args.steps, q, barrier, threads, args.params),
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
            f"\nW={world}, threads {args.threads}, {args.params} buffer(s) a rank: adapters "
            + "; ".join(
                f"rank {r}: {i.get('device')} ({i.get('backend_type')})"
                for r, i in sorted(infos.items())
            )
        )
        print(
            f"{'MiB':>6} {'naive ms':>9} {'queued':>7} {'staged':>7} {'gradsync':>9} "
            f"{'+fence':>7} {'(host sync)':>12} {'gs/queued':>10} {'fenced/naive':>13} "
            f"{'fenced/staged':>14} {'correct':>8}"
        )
        for k, nbytes in enumerate(sizes):
            per = [rows[k] for _, _, rows in results]
            slowest = {
                name: [max(p["times"][name][s] for p in per) for s in range(args.steps)]
                for name in ("naive", "queued", "staged", "gradsync", "fenced", "host")
            }
            med = {name: statistics.median(v) for name, v in slowest.items()}
            ok = all(p["ok"] for p in per)
            ms = {name: v * 1e3 for name, v in med.items()}
            print(
                f"{nbytes / 2**20:>6g} {ms['naive']:>9.2f} {ms['queued']:>7.2f} "
                f"{ms['staged']:>7.2f} {ms['gradsync']:>9.2f} {ms['fenced']:>7.2f} "
                f"{ms['host']:>12.2f} {med['gradsync'] / med['queued']:>10.2f} "
                f"{med['fenced'] / med['naive']:>13.2f} "
                f"{med['fenced'] / med['staged']:>14.2f} {ok!s:>8}"
            )
            if args.profile:
                print(f"{'':>6} profile ms: {_profile_line(per)}")
            report.append(
                {
                    "round": rnd,
                    "world": world,
                    "threads": args.threads,
                    "params": args.params,
                    "bytes": nbytes,
                    "median_s": med,
                    "correct": ok,
                    "adapters": infos,
                }
            )
    if args.rounds > 1:
        print(_rounds_summary(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2, default=str)
    sys.exit(0 if all(r["correct"] for r in report) else 1)


if __name__ == "__main__":
    main()
