"""H200 micro: the liveness probe, write_buffer pieces vs the mapped upload (us)."""
import os, statistics, time
import numpy as np
import wgpu, gradsync
from gradsync._wgpu import WgpuBridge
dev = gradsync.request_device_for_rank(local_rank=0, backend=os.environ.get("BACKEND"))
bu = wgpu.BufferUsage
n = 1 << 20
buf = dev.create_buffer(size=n, usage=bu.STORAGE | bu.COPY_SRC | bu.COPY_DST)
f32 = [np.dtype(np.float32)]
host = np.random.rand(n // 4).astype(np.float32)
bridge = WgpuBridge(dev)
bridge.download([buf], f32)
def med(f, k=200):
    ts = []
    for _ in range(k):
        t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
        bridge._fence()
    return statistics.median(ts) * 1e6
print(f"probe (failing 1-byte write_buffer): {med(lambda: bridge._check_alive(0, buf)):.0f} us")
half = n // 8
pieces = [(0, 0, host[:half]), (0, half, host[half:])]
import gradsync._wgpu as w
for mode in ("direct", "mapped", "direct", "mapped"):
    w.DIRECT_MAX_BYTES = (32 << 20) if mode == "direct" else 0
    print(f"upload 2 x 0.5 MiB pieces, {mode}, queued: {med(lambda: bridge._upload_pieces([buf], f32, pieces)):.0f} us")
for mode in ("direct", "mapped"):
    w.DIRECT_MAX_BYTES = (32 << 20) if mode == "direct" else 0
    def both():
        bridge._upload_pieces([buf], f32, pieces); bridge._fence()
    print(f"upload 2 x 0.5 MiB pieces, {mode}, + fence: {med(both):.0f} us")
print(f"download 1 MiB: {med(lambda: bridge.download([buf], f32)):.0f} us")
