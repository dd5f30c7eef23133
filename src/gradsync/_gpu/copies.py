"""The bridge's copies through its staging buffers: a command buffer, a submit and a
mapping per staging chunk and direction."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from gradsync._step.parallel import Workers

from .layout import StagingChunk, StagingLayout, write_staging
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
    the layout's host mirrors. One submit a chunk: the host copies a chunk out while
    the GPU fills the next one."""
    wgpu = import_wgpu()
    for ch in layout.chunks:
        if ch.read is None:
            ch.read = device.create_buffer(
                label="gradsync-download",
                size=ch.nbytes,
                usage=wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST,
            )
    _submit_download(device, buffers, layout.chunks[0])
    flats = None if into is None else [a.reshape(-1).view(np.uint8) for a in into]
    for k, ch in enumerate(layout.chunks):
        map_for_reading(ch.read, device, spin_s)
        # The next chunk is submitted only now: a blocking wait for a mapping (wgpu-py's
        # poll thread) waits for everything submitted before it.
        if k + 1 < len(layout.chunks):
            _submit_download(device, buffers, layout.chunks[k + 1])
        try:
            mapped = np.frombuffer(ch.read.read_mapped(0, ch.nbytes, copy=False), np.uint8)
            if flats is None:
                pairs = [(ch.host, mapped)]
            else:
                pairs = [
                    (flats[param][at : at + size], mapped[staged_at : staged_at + size])
                    for param, at, staged_at, size in ch.copies
                ]
            workers.copy(pairs)
            # No numpy view of mapped memory may outlive unmap().
            del mapped, pairs
        finally:
            ch.read.unmap()


def _submit_download(device: Any, buffers: Sequence[Any], ch: StagingChunk) -> None:
    enc = device.create_command_encoder(label="gradsync-download")
    for param, at, staged_at, size in ch.copies:
        enc.copy_buffer_to_buffer(buffers[param], at, ch.read, staged_at, size)
    device.queue.submit([enc.finish()])


def upload_staged(
    device: Any,
    buffers: Sequence[Any],
    layout: StagingLayout,
    writes: Sequence[Sequence[tuple[int, npt.NDArray[np.uint8]]]],
    workers: Workers,
    spin_s: float,
    *,
    wait: bool = True,
) -> None:
    """Upload through ``layout``'s mapped staging buffers: each chunk's ``(byte offset,
    bytes)`` of ``writes`` are copied there, then the chunk's copies into the buffers
    are submitted before the next chunk is written. Without ``wait``, return once the
    copies are submitted; the staging buffers are mapped again in the background and
    waited for at their next use."""
    wgpu = import_wgpu()
    for ch, chunk_writes in zip(layout.chunks, writes, strict=True):
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
        write_staging(ch, chunk_writes, workers)
        ch.write.unmap()
        enc = device.create_command_encoder(label="gradsync-upload")
        for param, at, staged_at, size in ch.copies:
            enc.copy_buffer_to_buffer(ch.write, staged_at, buffers[param], at, size)
        device.queue.submit([enc.finish()])
        # Mapping again waits for the copies (no separate fence needed) and leaves the
        # buffer ready for the next upload; asked for now and waited for at the next
        # upload, it costs the step no round trip to the GPU.
        if not wait:
            ch.remap = ch.write.map_async(wgpu.MapMode.WRITE)
    if wait:
        for ch in layout.chunks:
            ch.write.map_sync(wgpu.MapMode.WRITE)


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
