"""GPU buffers downloaded straight into this rank's data file (docs/gpu.md), so that
publishing copies nothing: from the second step on, and again after other buffers."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import gradsync
from ranks import config, run_ranks


def _linked_per_step(rank: int, world: int, sync_dir: str) -> tuple[list[bool], list[float]]:
    """Steps of a big buffer, a small one between: whether each step's input file was the
    shared one (its name links to it), and the big buffer's mean."""
    import wgpu  # noqa: PLC0415

    dev = gradsync.request_device_for_rank(local_rank=rank)
    usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
    big, small = (
        [dev.create_buffer_with_data(data=np.full(n, rank + 1.0, np.float32), usage=usage)]
        for n in (100_000, 100)
    )
    linked = []
    with gradsync.GradSync(config(rank, world, sync_dir)) as gs:
        for step, bufs in enumerate([big, big, small, big, big]):
            gs.average(bufs, step=step, device=dev)
            assert gs.generation_dir is not None
            linked.append(os.path.islink(os.path.join(gs.generation_dir, f"d-{rank}.in")))
    mean = np.frombuffer(dev.queue.read_buffer(big[0]), np.float32)
    return linked, sorted(set(mean.tolist()))


@pytest.mark.wgpu
def test_gpu_buffers_are_published_in_place_again_after_a_step_of_others(
    tmp_path: Path,
) -> None:
    # After one step of a small buffer (copied: sharing saves nothing there), the big
    # one was copied into the file for the rest of the session.
    out = run_ranks(_linked_per_step, 2, (2, str(tmp_path)), timeout_s=120)
    for r in range(2):
        assert out[r].ok, out[r].value
        assert out[r].value == ([False, True, False, True, True], [1.5]), (r, out[r].value)
