"""Device<->host copy speed of one float32 gradient buffer, per size.

Paths, each a download (device->host) plus an upload (host->device), timed until the
GPU has finished:

- naive:        ``queue.read_buffer`` + ``queue.write_buffer`` (read_buffer makes,
                maps and destroys a staging buffer per call: wgpu-py issue #727)
- staged:       persistent MAP_READ staging buffer, one copy, map, ``np.copyto``;
                upload through a persistent MAP_WRITE buffer kept mapped while idle
- bridge:       ``WgpuBridge.download`` + ``upload`` (upload_mode "write_buffer")
- bridge_mapped ``WgpuBridge`` with upload_mode "mapped"

Run: ``python benchmarks/wgpu_copy.py --sizes-mib 1 16 256 --repeats 5 [--json]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import wgpu

from gradsync import WgpuBridge, request_device_for_rank

BU = wgpu.BufferUsage


def _median_s(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: first-use allocations are not what a training loop sees
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _fence(dev: Any) -> None:
    # on_submitted_work_done_sync() is broken in wgpu-py 0.32; a tiny read waits too.
    dev.queue.read_buffer(_fence.buf, 0, 4)  # type: ignore[attr-defined]


def bench_size(dev: Any, nbytes: int, repeats: int) -> dict[str, float]:
    n = nbytes // 4
    host = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    buf = dev.create_buffer(size=nbytes, usage=BU.STORAGE | BU.COPY_SRC | BU.COPY_DST)
    dev.queue.write_buffer(buf, 0, host)
    out = np.empty_like(host)

    def naive_down() -> None:
        np.copyto(out, np.frombuffer(dev.queue.read_buffer(buf), np.float32))

    def naive_up() -> None:
        dev.queue.write_buffer(buf, 0, out)
        _fence(dev)

    rd = dev.create_buffer(size=nbytes, usage=BU.MAP_READ | BU.COPY_DST)
    wr = dev.create_buffer(size=nbytes, usage=BU.MAP_WRITE | BU.COPY_SRC, mapped_at_creation=True)

    def staged_down() -> None:
        enc = dev.create_command_encoder()
        enc.copy_buffer_to_buffer(buf, 0, rd, 0, nbytes)
        dev.queue.submit([enc.finish()])
        rd.map_sync(wgpu.MapMode.READ)
        m = rd.read_mapped(0, nbytes, copy=False)
        np.copyto(out, np.frombuffer(m, np.float32))
        del m
        rd.unmap()

    def staged_up() -> None:
        wr.write_mapped(out, 0)
        wr.unmap()
        enc = dev.create_command_encoder()
        enc.copy_buffer_to_buffer(wr, 0, buf, 0, nbytes)
        dev.queue.submit([enc.finish()])
        wr.map_sync(wgpu.MapMode.WRITE)  # waits for the copy

    res: dict[str, float] = {}
    res["naive_down"] = _median_s(naive_down, repeats)
    res["naive_up"] = _median_s(naive_up, repeats)
    res["staged_down"] = _median_s(staged_down, repeats)
    res["staged_up"] = _median_s(staged_up, repeats)
    wr.unmap()
    for b in (rd, wr):
        b.destroy()
    f32 = [np.dtype(np.float32)]
    for name, mode in (("bridge", "write_buffer"), ("bridge_mapped", "mapped")):
        with WgpuBridge(dev) as bridge:
            bridge.upload_mode = mode
            arrays = bridge.download([buf], f32)
            res[f"{name}_down"] = _median_s(lambda b=bridge: b.download([buf], f32), repeats)
            res[f"{name}_up"] = _median_s(lambda b=bridge, a=arrays: b.upload([buf], a), repeats)
    buf.destroy()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 16, 256])
    ap.add_argument("--repeats", type=int, default=5, help="median of this many runs")
    ap.add_argument("--backend", default=None, help="wgpu backend, e.g. Vulkan")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = ap.parse_args()
    dev = request_device_for_rank(local_rank=0, backend=args.backend)
    _fence.buf = dev.create_buffer(size=4, usage=BU.COPY_SRC)  # type: ignore[attr-defined]
    rows = []
    for mib in args.sizes_mib:
        nbytes = max(4, int(mib * 2**20) // 4 * 4)
        rows.append({"size_mib": mib, "bytes": nbytes, **bench_size(dev, nbytes, args.repeats)})
    info = dict(dev.adapter.info)
    if args.json:
        print(json.dumps({"adapter": info, "results": rows}, indent=2))
        return
    print(f"adapter: {info.get('device')} via {info.get('backend_type')}; median ms (GB/s)")
    paths = ("naive", "staged", "bridge", "bridge_mapped")
    cols = [f"{p}_{d}" for p in paths for d in ("down", "up")]
    print(f"{'MiB':>7} " + " ".join(f"{c:>20}" for c in cols))
    for r in rows:
        cells = [f"{r[c] * 1e3:9.2f} ({r['bytes'] / r[c] / 1e9:6.2f})" for c in cols]
        print(f"{r['size_mib']:>7g} " + " ".join(f"{c:>20}" for c in cells))


if __name__ == "__main__":
    main()
