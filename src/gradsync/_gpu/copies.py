"""The bridge's copies through its staging buffers: one command buffer, one submit and
one mapping per direction."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from gradsync._step.parallel import Workers

from .layout import StagingLayout, write_staging
from .wait import import_wgpu, map_for_reading, release, wait_for

__all__ = ["Fence", "download_staged", "upload_staged"]


def download_staged(
    device: Any,
    buffers: Sequence[Any],
    layout: StagingLayout,
    into: Sequence[npt.NDArray[Any]] | None,
    workers: Workers,
    spin_s: float,
) -> None:
    """Copy every buffer into ``layout``'s read buffers, then to the host: ``into``, or
    the layout's host mirror."""
    wgpu = import_wgpu()
    for ch in layout.chunks:
        if ch.read is None:
            ch.read = device.create_buffer(
                label="gradsync-download",
                size=ch.nbytes,
                usage=wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST,
            )
    enc = device.create_command_encoder(label="gradsync-download")
    for buf, (c, off, size) in zip(buffers, layout.slots, strict=True):
        if size:  # an empty buffer has nothing to copy (and cannot be probed)
            enc.copy_buffer_to_buffer(buf, 0, layout.chunks[c].read, off, size)
    device.queue.submit([enc.finish()])
    for c, ch in enumerate(layout.chunks):
        map_for_reading(ch.read, device, spin_s)
        try:
            mapped = np.frombuffer(ch.read.read_mapped(0, ch.nbytes, copy=False), np.uint8)
            if into is None:
                pairs = [(ch.host, mapped)]
            else:
                pairs = [
                    (dst.reshape(-1).view(np.uint8), mapped[off : off + size])
                    for dst, (cc, off, size) in zip(into, layout.slots, strict=True)
                    if cc == c
                ]
            workers.copy(pairs)
            # No numpy view of mapped memory may outlive unmap().
            del mapped, pairs
        finally:
            ch.read.unmap()


def upload_staged(
    device: Any,
    buffers: Sequence[Any],
    layout: StagingLayout,
    writes: Sequence[tuple[int, int, npt.NDArray[Any]]],
    workers: Workers,
    spin_s: float,
    *,
    wait: bool = True,
) -> None:
    """Upload through ``layout``'s mapped staging buffers: each ``(chunk, byte
    offset, array)`` of ``writes`` is copied there, then every buffer from its slot.
    Without ``wait``, return once the copies are submitted; the staging buffers
    are mapped again in the background and waited for at their next use."""
    wgpu = import_wgpu()
    for ch in layout.chunks:
        if ch.write is None:
            ch.write = device.create_buffer(
                label="gradsync-upload",
                size=ch.nbytes,
                usage=wgpu.BufferUsage.MAP_WRITE | wgpu.BufferUsage.COPY_SRC,
                mapped_at_creation=True,
            )
        if ch.remap is not None:
            remap, ch.remap = ch.remap, None
            wait_for(remap, device, spin_s)
        if str(ch.write.map_state) != "mapped":
            ch.write.map_sync(wgpu.MapMode.WRITE)
    write_staging(layout, writes, workers)
    for ch in layout.chunks:
        ch.write.unmap()
    enc = device.create_command_encoder(label="gradsync-upload")
    for buf, (c, off, size) in zip(buffers, layout.slots, strict=True):
        if size:
            enc.copy_buffer_to_buffer(layout.chunks[c].write, off, buf, 0, size)
    device.queue.submit([enc.finish()])
    # Mapping again waits for the copies (no separate fence needed) and leaves the
    # buffer ready for the next upload; asked for now and waited for at the next
    # upload, it costs the step no round trip to the GPU.
    for ch in layout.chunks:
        if wait:
            ch.write.map_sync(wgpu.MapMode.WRITE)
        else:
            ch.remap = ch.write.map_async(wgpu.MapMode.WRITE)


class Fence:
    """Waits for all work submitted to a device's queue so far."""

    def __init__(self, device: Any) -> None:
        self._device = device
        self._src: Any = None
        self._dst: Any = None

    def wait(self, spin_s: float) -> None:
        # queue.on_submitted_work_done_sync() raises a cffi TypeError in wgpu-py 0.32;
        # mapping a buffer written by a later submit waits for all earlier work.
        wgpu = import_wgpu()
        if self._src is None:
            self._src = self._device.create_buffer(
                label="gradsync-fence-src", size=8, usage=wgpu.BufferUsage.COPY_SRC
            )
            self._dst = self._device.create_buffer(
                label="gradsync-fence",
                size=8,
                usage=wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST,
            )
        enc = self._device.create_command_encoder(label="gradsync-fence")
        enc.copy_buffer_to_buffer(self._src, 0, self._dst, 0, 8)
        self._device.queue.submit([enc.finish()])
        map_for_reading(self._dst, self._device, spin_s)
        self._dst.unmap()

    def close(self) -> None:
        for buf in (self._src, self._dst):
            if buf is not None:
                release(buf)
        self._src = self._dst = None
