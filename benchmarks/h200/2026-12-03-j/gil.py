import time, statistics as st, numpy as np, sys, threading
import wgpu, gradsync
from gradsync._wgpu import WgpuBridge
import os
dev = gradsync.request_device_for_rank(local_rank=0, backend=os.environ.get("BACKEND"))
bu = wgpu.BufferUsage
buf = dev.create_buffer(size=1 << 20, usage=bu.STORAGE | bu.COPY_SRC | bu.COPY_DST)
br = WgpuBridge(dev)
dt = [np.dtype(np.float32)]
def pyloop():
    t = time.perf_counter()
    x = 0
    for i in range(2000):
        x += i * i
    return time.perf_counter() - t
res = {"plain": [], "after_download": [], "after_download_sleep1ms": []}
for r in range(300):
    res["plain"].append(pyloop())
    br.download([buf], dt)
    res["after_download"].append(pyloop())
    br.download([buf], dt)
    time.sleep(0.001)
    res["after_download_sleep1ms"].append(pyloop())
print(threading.enumerate())
for k, v in res.items(): print(k, "%.1f us" % (st.median(v[20:]) * 1e6))
