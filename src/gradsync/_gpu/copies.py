"""The bridge's copies through its staging buffers: per direction and part of a chunk
(see ``layout.PART_BYTES``) one command buffer, one submit and one mapping."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from gradsync._step.parallel import Workers

from .layout import StagingChunk, StagingLayout, part_writes, write_staging
from .wait import import_wgpu, map_for_reading, release, wait_for

__all__ = ["DOWNLOAD_AHEAD", "Fence", "download_staged", "upload_staged"]

# Parts of a download submitted ahead of the one the host copies: each part is its own
# submit, so its mapping resolves once its own copies are done.
DOWNLOAD_AHEAD = 1


def download_staged(
    device: Any,
    buffers: Sequence[Any],
    layout: StagingLayout,
    into: Sequence[npt.NDArray[Any]] | None,
    workers: Workers,
    spin_s: float,
) -> None:
    """Copy every buffer into ``layout``'s read buffers, then to the host: ``into``, or
    the layout's host mirror; part by part, the host copying one part while the GPU
    copies the next."""
    parts = [(c, p) for c, ch in enumerate(layout.chunks) for p in range(len(ch.parts))]
    for k in range(min(DOWNLOAD_AHEAD, len(parts))):
        _submit_download(device, buffers, layout, *parts[k])
    for k, (c, p) in enumerate(parts):
        if k + DOWNLOAD_AHEAD < len(parts):
            _submit_download(device, buffers, layout, *parts[k + DOWNLOAD_AHEAD])
        ch = layout.chunks[c]
        a, b = ch.parts[p]
        buf = ch.reads[p]
        map_for_reading(buf, device, spin_s)
        try:
            mapped = np.frombuffer(buf.read_mapped(0, b - a, copy=False), np.uint8)
            if into is None:
                pairs = [(ch.host[a:b], mapped)]
            else:
                pairs = [
                    (into[param].reshape(-1).view(np.uint8)[at : at + n], mapped[off : off + n])
                    for param, off, at, n in layout.part_copies[c][p]
                ]
            workers.copy(pairs)
            # No numpy view of mapped memory may outlive unmap().
            del mapped, pairs
        finally:
            buf.unmap()


def _submit_download(
    device: Any, buffers: Sequence[Any], layout: StagingLayout, c: int, p: int
) -> None:
    """Submit the GPU copies of part ``p`` of chunk ``c`` into its read buffer (made if new)."""
    ch = layout.chunks[c]
    a, b = ch.parts[p]
    if ch.reads[p] is None:
        wgpu = import_wgpu()
        ch.reads[p] = device.create_buffer(
            label="gradsync-download",
            size=b - a,
            usage=wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST,
        )
    enc = device.create_command_encoder(label="gradsync-download")
    for param, off, at, n in layout.part_copies[c][p]:
        enc.copy_buffer_to_buffer(buffers[param], at, ch.reads[p], off, n)
    device.queue.submit([enc.finish()])


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
    offset, array)`` of ``writes`` is copied there, then every buffer from its slot,
    part by part (the GPU copies a part while the host writes the next).
    Without ``wait``, return once the copies are submitted; the staging buffers
    are mapped again in the background and waited for at their next use."""
    copies = layout.part_copies
    for c, ch in enumerate(layout.chunks):
        for p, (a, b) in enumerate(ch.parts):
            buf = _ready_part(device, ch, p, b - a, spin_s)
            write_staging(buf, ch.host[a:b], part_writes(writes, c, a, b), workers)
            buf.unmap()
            enc = device.create_command_encoder(label="gradsync-upload")
            for param, src_off, dst_off, size in copies[c][p]:
                enc.copy_buffer_to_buffer(buf, src_off, buffers[param], dst_off, size)
            device.queue.submit([enc.finish()])
    # Mapping again waits for the copies (no separate fence needed) and leaves the
    # buffer ready for the next upload; asked for now and waited for at the next
    # upload, it costs the step no round trip to the GPU.
    mode = import_wgpu().MapMode.WRITE
    for ch in layout.chunks:
        for p, buf in enumerate(ch.writes):
            if wait:
                buf.map_sync(mode)
            else:
                ch.remaps[p] = buf.map_async(mode)


def _ready_part(device: Any, ch: StagingChunk, p: int, nbytes: int, spin_s: float) -> Any:
    """Upload part ``p``'s staging buffer of ``ch``, created or waited for until mapped."""
    wgpu = import_wgpu()
    if ch.writes[p] is None:
        ch.writes[p] = device.create_buffer(
            label="gradsync-upload",
            size=nbytes,
            usage=wgpu.BufferUsage.MAP_WRITE | wgpu.BufferUsage.COPY_SRC,
            mapped_at_creation=True,
        )
    buf = ch.writes[p]
    if ch.remaps[p] is not None:
        remap, ch.remaps[p] = ch.remaps[p], None
        wait_for(remap, device, spin_s)
    if str(buf.map_state) != "mapped":
        buf.map_sync(wgpu.MapMode.WRITE)
    return buf


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
