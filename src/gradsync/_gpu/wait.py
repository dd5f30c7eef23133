"""Waiting for wgpu: mapping buffers, resolving promises, translating wgpu's errors.

wgpu is imported lazily: ``import gradsync`` never loads it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import numpy.typing as npt

from gradsync._errors import GradSyncError, WgpuBridgeError

__all__ = [
    "SPIN_S",
    "adapter_type",
    "import_wgpu",
    "map_for_reading",
    "release",
    "wait_for",
    "wgpu_errors",
    "writable_mapping",
]

# Longest a wait for the GPU polls from the waiting thread (see wait_for); longer ones block.
SPIN_S = 0.005


@functools.cache
def import_wgpu() -> Any:
    # Deferred so that ``import gradsync`` works (and stays fast) without wgpu; cached
    # because the liveness probe asks once per buffer per step.
    return importlib.import_module("wgpu")


def adapter_type(device: Any) -> str | None:
    """``device``'s adapter type ("DiscreteGPU", "CPU"...), None where unknown."""
    try:
        return str(device.adapter.info["adapter_type"])
    except (AttributeError, KeyError, TypeError):
        return None


def map_for_reading(buffer: Any, device: Any, spin_s: float) -> None:
    """Map ``buffer`` for reading; return once it is mapped (see :func:`wait_for`).

    wgpu-py's ``map_sync`` for reading first submits an empty command buffer: a guard
    for a buffer written through its own mapping and mapped again with no submit in
    between, which reads zeros (wgpu-native#305, wgpu#5173). The bridge's read buffers
    are only ever written by copies it has submitted before mapping, so it skips the
    guard ("READ_NOSYNC"; plain ``map_sync`` where wgpu-py refuses that mode).
    :func:`wait_for` polls without blocking: a blocking poll beside wgpu-py's poll thread
    stalls steps.
    """
    global _nosync_reads
    if _nosync_reads:
        try:
            promise = buffer.map_async("READ_NOSYNC")
        except (KeyError, ValueError, TypeError):  # an unknown mode: checked before mapping
            _nosync_reads = False
        else:
            wait_for(promise, device, spin_s)
            return
    buffer.map_sync(import_wgpu().MapMode.READ)


def wait_for(promise: Any, device: Any, spin_s: float) -> None:
    """Wait for a wgpu-py promise, first polling ``device`` from this thread without
    blocking for up to ``spin_s`` seconds.

    wgpu-py resolves promises from a per-device thread that blocks in the driver until
    the GPU finishes, then wakes the waiting thread, which is slower for short round
    trips than polling from here. Polling burns this core meanwhile, so the spin is
    bounded, and off (``spin_s`` 0) on CPU adapters, whose "GPU" work runs on the
    cores it would take.
    ``device._poll`` and ``promise._state`` are wgpu-py's internals: without them
    this is a plain wait. ``_poll()`` does not block: wgpu-py 0.27-0.28 take no
    argument, 0.29 on a ``block`` that defaults to False.
    """
    poll = getattr(device, "_poll", None)
    if spin_s > 0 and poll is not None and getattr(promise, "_state", None) == "pending":
        deadline = time.perf_counter() + spin_s
        while promise._state == "pending" and time.perf_counter() < deadline:
            poll()
    promise.sync_wait()


# Whether this wgpu-py takes map_async("READ_NOSYNC"); cleared at the first refusal.


# Whether this wgpu-py takes map_async("READ_NOSYNC"); cleared at the first refusal.
_nosync_reads = True


def writable_mapping(buf: Any, nbytes: int) -> npt.NDArray[np.uint8] | None:
    """A writable uint8 view of the first ``nbytes`` of mapped ``buf``, or None.

    wgpu-py's public ``write_mapped`` copies from a host array on one thread: staging
    the mean there first costs a second pass over it. Its
    ``_experimental_get_mapped_range`` (wgpu-py 0.19 to 0.32 at least) is the only
    writable view of a mapping; without it (a later wgpu-py) this returns None.
    """
    get = getattr(buf, "_experimental_get_mapped_range", None)
    if get is None:
        return None
    view: npt.NDArray[np.uint8] = np.frombuffer(get(0, nbytes), np.uint8)
    return view if view.flags.writeable else None


@contextlib.contextmanager
def wgpu_errors(what: str) -> Iterator[None]:
    """The one place where wgpu exceptions become gradsync errors."""
    wgpu = import_wgpu()

    try:
        yield
    except GradSyncError:
        raise
    except (wgpu.GPUError, RuntimeError) as exc:
        raise WgpuBridgeError(f"wgpu failed while {what}: {exc}") from exc


def release(buf: Any) -> None:
    """Unmap and destroy a buffer of the bridge's own, on a lost device too."""
    with contextlib.suppress(Exception):  # a lost device: wgpu errors, nothing to free
        if str(buf.map_state) == "mapped":
            buf.unmap()
    with contextlib.suppress(Exception):
        buf.destroy()
