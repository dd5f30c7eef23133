"""cProfile of rank 1 of 2 over 300 steps averaging one 1 MiB wgpu buffer (Vulkan)."""

from __future__ import annotations

import cProfile
import multiprocessing as mp
import pstats
import shutil
from pathlib import Path
from typing import Any


def rank_main(rank: int, world: int, sync_dir: str, nbytes: int, steps: int, q: Any) -> None:
    import wgpu  # noqa: PLC0415

    import gradsync  # noqa: PLC0415

    dev = gradsync.request_device_for_rank(local_rank=rank, backend="Vulkan")
    usage = wgpu.BufferUsage
    buf = dev.create_buffer(size=nbytes, usage=usage.STORAGE | usage.COPY_SRC | usage.COPY_DST)
    cfg = gradsync.FileGradSyncConfig(world, rank, Path(sync_dir), max_wait_s=60)
    with gradsync.GradSync(cfg) as gs:
        for s in range(30):
            gs.average([buf], step=s, device=dev)
        profile = cProfile.Profile()
        profile.enable()
        for s in range(30, 30 + steps):
            gs.average([buf], step=s, device=dev)
        profile.disable()
        if rank == 1:
            pstats.Stats(profile).sort_stats("tottime").print_stats(30)
            pstats.Stats(profile).sort_stats("cumtime").print_stats(40)
    q.put(rank)


def main() -> None:
    sync_dir = "/dev/shm/wprof"
    shutil.rmtree(sync_dir, ignore_errors=True)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [
        ctx.Process(target=rank_main, args=(r, 2, sync_dir, 1 << 20, 300, q)) for r in range(2)
    ]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            q.get(timeout=300)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()


if __name__ == "__main__":
    main()
