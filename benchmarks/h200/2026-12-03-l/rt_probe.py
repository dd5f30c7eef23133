"""GPU round trip of a 1 MiB download: wgpu-py's wait vs spinning on non-blocking polls.

Modes (interleaved blocks, medians and p90 in us):
  wait     copy, submit, map_async("READ_NOSYNC").sync_wait()  (gradsync today)
  spin     same, but poll the device without blocking from this thread until mapped
  spinY    same, with os.sched_yield() between polls
  naive    queue.read_buffer (staging created per call)
Run: python rt_probe.py [--procs N] [--mib 1]
"""
import argparse, multiprocessing as mp, os, statistics, time
import numpy as np

def worker(idx, mib, rounds, per, q):
    import wgpu
    backend = os.environ.get("BACKEND")
    ads = [a for a in wgpu.gpu.enumerate_adapters_sync() if not backend or a.info["backend_type"] == backend]
    dev = ads[0].request_device_sync()
    n = int(mib * 2**20)
    U = wgpu.BufferUsage
    src = dev.create_buffer(size=n, usage=U.STORAGE | U.COPY_SRC | U.COPY_DST)
    dev.queue.write_buffer(src, 0, np.arange(n // 4, dtype=np.float32).tobytes())
    rd = dev.create_buffer(size=n, usage=U.MAP_READ | U.COPY_DST)
    host = np.empty(n, np.uint8)
    def roundtrip(mode):
        t = time.perf_counter()
        if mode == "naive":
            data = dev.queue.read_buffer(src)
            np.copyto(host, np.frombuffer(data, np.uint8))
            return time.perf_counter() - t
        enc = dev.create_command_encoder()
        enc.copy_buffer_to_buffer(src, 0, rd, 0, n)
        dev.queue.submit([enc.finish()])
        p = rd.map_async("READ_NOSYNC")
        if mode == "spin":
            while p._state == "pending":
                dev._poll(False)
        elif mode == "spinY":
            while p._state == "pending":
                dev._poll(False)
                os.sched_yield()
        p.sync_wait()
        np.copyto(host, np.frombuffer(rd.read_mapped(0, n, copy=False), np.uint8))
        rd.unmap()
        return time.perf_counter() - t
    modes = ["wait", "spin", "spinY", "naive"]
    for m in modes:
        for _ in range(20): roundtrip(m)
    res = {m: [] for m in modes}
    for r in range(rounds):
        for m in modes:
            for _ in range(per):
                res[m].append(roundtrip(m))
    q.put((idx, {m: (statistics.median(v) * 1e6, sorted(v)[int(len(v) * 0.9)] * 1e6) for m, v in res.items()}))

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--procs", type=int, default=1)
    ap.add_argument("--mib", type=float, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--per", type=int, default=40)
    a = ap.parse_args()
    ctx = mp.get_context("spawn"); q = ctx.Queue()
    ps = [ctx.Process(target=worker, args=(i, a.mib, a.rounds, a.per, q)) for i in range(a.procs)]
    for p in ps: p.start()
    out = sorted(q.get(timeout=300) for _ in ps)
    for p in ps: p.join(30)
    for idx, r in out:
        print(f"procs={a.procs} {a.mib} MiB proc {idx}: " + "  ".join(f"{m} {med:.0f}/{p90:.0f}" for m, (med, p90) in r.items()) + "  (median/p90 us)")
