"""Does a download through the bridge slow the Python that follows it (wgpu-py's poll
thread holding the GIL)? Times a pure-Python loop plainly, right after a download, and
1 ms after one. Run from the repository root with ``BACKEND=Vulkan``."""

from __future__ import annotations

import os
import statistics
import threading
import time

import numpy as np
import wgpu

import gradsync
from gradsync._wgpu import WgpuBridge


def python_loop_s() -> float:
    t = time.perf_counter()
    x = 0
    for i in range(2000):
        x += i * i
    return time.perf_counter() - t


def main() -> None:
    dev = gradsync.request_device_for_rank(local_rank=0, backend=os.environ.get("BACKEND"))
    usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
    buf = dev.create_buffer(size=1 << 20, usage=usage)
    bridge = WgpuBridge(dev)
    dtypes = [np.dtype(np.float32)]
    times: dict[str, list[float]] = {"plain": [], "after_download": [], "after_1ms": []}
    for _ in range(300):
        times["plain"].append(python_loop_s())
        bridge.download([buf], dtypes)
        times["after_download"].append(python_loop_s())
        bridge.download([buf], dtypes)
        time.sleep(0.001)
        times["after_1ms"].append(python_loop_s())
    print(threading.enumerate())
    for name, values in times.items():
        print(name, f"{statistics.median(values[20:]) * 1e6:.1f} us")


if __name__ == "__main__":
    main()
