import cProfile, multiprocessing as mp, os, pstats, shutil, sys, time
from pathlib import Path
import numpy as np

def rank_main(rank, world, sync_dir, nbytes, steps, q):
    import wgpu, gradsync
    dev = gradsync.request_device_for_rank(local_rank=rank, backend="Vulkan")
    bu = wgpu.BufferUsage
    buf = dev.create_buffer(size=nbytes, usage=bu.STORAGE | bu.COPY_SRC | bu.COPY_DST)
    cfg = gradsync.FileGradSyncConfig(world_size=world, rank=rank, sync_dir=Path(sync_dir), max_wait_s=60)
    with gradsync.GradSync(cfg) as gs:
        for s in range(30):
            gs.average([buf], step=s, device=dev)
        pr = cProfile.Profile()
        pr.enable()
        for s in range(30, 30 + steps):
            gs.average([buf], step=s, device=dev)
        pr.disable()
        if rank == 1:
            pstats.Stats(pr).sort_stats("tottime").print_stats(30); pstats.Stats(pr).sort_stats("cumtime").print_stats(40)
    q.put(rank)

if __name__ == "__main__":
    d = "/dev/shm/wprof"; shutil.rmtree(d, ignore_errors=True)
    ctx = mp.get_context("spawn"); q = ctx.Queue()
    ps = [ctx.Process(target=rank_main, args=(r, 2, d, 1 << 20, 300, q)) for r in range(2)]
    for p in ps: p.start()
    for _ in ps: q.get(timeout=300)
    for p in ps: p.join(60)
