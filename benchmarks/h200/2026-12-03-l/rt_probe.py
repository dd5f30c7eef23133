"""GPU round trip of a 1 MiB download: wgpu-py's wait vs polling the device.

Modes (interleaved blocks; median and p90 in us):
  wait     copy, submit, map_async("READ_NOSYNC").sync_wait()  (gradsync before 16:50)
  spin     the same, polling the device without blocking from this thread until mapped
  spinY    the same, with os.sched_yield() between polls
  naive    queue.read_buffer (a staging buffer created per call)
Run: python rt_probe.py [--procs N] [--mib 1] (BACKEND=Vulkan picks the backend).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/
from spawned import run_spawned

MODES = ("wait", "spin", "spinY", "naive")


def worker(idx: int, mib: float, rounds: int, per: int, q: Any) -> None:
    import wgpu  # noqa: PLC0415

    backend = os.environ.get("BACKEND")
    adapters = [
        a
        for a in wgpu.gpu.enumerate_adapters_sync()
        if not backend or a.info["backend_type"] == backend
    ]
    dev = adapters[0].request_device_sync()
    n = int(mib * 2**20)
    usage = wgpu.BufferUsage
    src = dev.create_buffer(size=n, usage=usage.STORAGE | usage.COPY_SRC | usage.COPY_DST)
    dev.queue.write_buffer(src, 0, np.arange(n // 4, dtype=np.float32).tobytes())
    rd = dev.create_buffer(size=n, usage=usage.MAP_READ | usage.COPY_DST)
    host = np.empty(n, np.uint8)

    def roundtrip(mode: str) -> float:
        t = time.perf_counter()
        if mode == "naive":
            np.copyto(host, np.frombuffer(dev.queue.read_buffer(src), np.uint8))
            return time.perf_counter() - t
        enc = dev.create_command_encoder()
        enc.copy_buffer_to_buffer(src, 0, rd, 0, n)
        dev.queue.submit([enc.finish()])
        promise = rd.map_async("READ_NOSYNC")
        while mode != "wait" and promise._state == "pending":
            dev._poll(False)
            if mode == "spinY":
                os.sched_yield()
        promise.sync_wait()
        np.copyto(host, np.frombuffer(rd.read_mapped(0, n, copy=False), np.uint8))
        rd.unmap()
        return time.perf_counter() - t

    for mode in MODES:
        for _ in range(20):
            roundtrip(mode)
    res: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(rounds):
        for mode in MODES:
            res[mode] += [roundtrip(mode) for _ in range(per)]
    q.put(
        (
            idx,
            {
                m: (statistics.median(v) * 1e6, sorted(v)[int(len(v) * 0.9)] * 1e6)
                for m, v in res.items()
            },
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--procs", type=int, default=1)
    ap.add_argument("--mib", type=float, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--per", type=int, default=40)
    a = ap.parse_args()
    out = run_spawned(worker, [(i, a.mib, a.rounds, a.per) for i in range(a.procs)])
    for idx, r in out:
        cells = "  ".join(f"{m} {med:.0f}/{p90:.0f}" for m, (med, p90) in r.items())
        print(f"procs={a.procs} {a.mib} MiB proc {idx}: {cells}  (median/p90 us)")


if __name__ == "__main__":
    main()
