"""One process: the destroyed-buffer probe, and a 1 MiB mean in 2 pieces queued by
``write_buffer`` or through the mapped upload buffer (median us; BACKEND=Vulkan)."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

import numpy as np
import wgpu

import gradsync
import gradsync._wgpu as bridge_module
from gradsync._wgpu import WgpuBridge


def main() -> None:
    dev = gradsync.request_device_for_rank(local_rank=0, backend=os.environ.get("BACKEND"))
    usage = wgpu.BufferUsage
    n = 1 << 20
    buf = dev.create_buffer(size=n, usage=usage.STORAGE | usage.COPY_SRC | usage.COPY_DST)
    f32 = [np.dtype(np.float32)]
    host = np.random.default_rng(0).random(n // 4, dtype=np.float32)
    bridge = WgpuBridge(dev)
    bridge.download([buf], f32)

    def med(f: Callable[[], object], k: int = 200) -> float:
        ts = []
        for _ in range(k):
            t = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t)
            bridge._fence()
        return statistics.median(ts) * 1e6

    print(f"probe (failing 1-byte write_buffer): {med(lambda: bridge._check_alive(0, buf)):.0f} us")
    half = n // 8
    pieces = [(0, 0, host[:half]), (0, half, host[half:])]

    def upload() -> None:
        bridge._upload_pieces([buf], f32, pieces)

    def upload_fenced() -> None:
        upload()
        bridge._fence()

    for what, f in (("queued", upload), ("queued", upload), ("+ fence", upload_fenced)):
        for mode in ("direct", "mapped"):
            bridge_module.DIRECT_MAX_BYTES = (32 << 20) if mode == "direct" else 0
            print(f"upload 2 x 0.5 MiB pieces, {mode}, {what}: {med(f):.0f} us")
    print(f"download 1 MiB: {med(lambda: bridge.download([buf], f32)):.0f} us")


if __name__ == "__main__":
    main()
