"""Cost of ways to notice a destroyed GPUBuffer before a submit (which aborts in wgpu 0.32).

Run: ``BACKEND=Vulkan python probe_cost.py``; prints microseconds a buffer for 100 buffers.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from typing import Any

import wgpu

import gradsync

dev = gradsync.request_device_for_rank(local_rank=0, backend=os.environ.get("BACKEND"))
print(dev.adapter.info["device"], dev.adapter.info["backend_type"])
bu = wgpu.BufferUsage
bufs = [
    dev.create_buffer(size=1 << 16, usage=bu.STORAGE | bu.COPY_SRC | bu.COPY_DST)
    for _ in range(100)
]
limit = dev.limits.get("max-storage-buffers-per-shader-stage", 8)
print("max-storage-buffers-per-shader-stage", limit)


def layout(n: int) -> Any:
    entry = {"type": wgpu.BufferBindingType.read_only_storage}
    return dev.create_bind_group_layout(
        entries=[
            {"binding": i, "visibility": wgpu.ShaderStage.COMPUTE, "buffer": entry}
            for i in range(n)
        ]
    )


def entries(chunk: list[Any]) -> list[dict[str, Any]]:
    return [
        {"binding": i, "resource": {"buffer": b, "offset": 0, "size": 4}}
        for i, b in enumerate(chunk)
    ]


ONE = layout(1)
GROUP = min(limit, 8)
MANY = layout(GROUP)


def write_probe() -> None:
    for b in bufs:
        with contextlib.suppress(Exception):  # always rejected: 1 byte is unaligned
            dev.queue.write_buffer(b, 0, b"\0")


def bind_group_each() -> None:
    for b in bufs:
        dev.create_bind_group(layout=ONE, entries=entries([b]))


def bind_group_of_many() -> None:
    for s in range(0, len(bufs), GROUP):
        chunk = bufs[s : s + GROUP]
        lay = MANY if len(chunk) == GROUP else layout(len(chunk))
        dev.create_bind_group(layout=lay, entries=entries(chunk))


WAYS: list[tuple[str, Callable[[], None]]] = [
    ("write_buffer 1 byte", write_probe),
    ("bind group each", bind_group_each),
    (f"bind group of {GROUP}", bind_group_of_many),
]
for name, fn in WAYS:
    fn()
    times = []
    for _ in range(7):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    times.sort()
    print(f"{name:22s} {times[3] / len(bufs) * 1e6:8.1f} us a buffer (median of 7 x 100 buffers)")

bufs[3].destroy()
CHECKS: list[tuple[str, Callable[[], object]]] = [
    ("write_buffer 1 byte", lambda: dev.queue.write_buffer(bufs[3], 0, b"\0")),
    ("bind group", lambda: dev.create_bind_group(layout=ONE, entries=entries([bufs[3]]))),
]
for name, check in CHECKS:
    try:
        check()
    except Exception as exc:  # reporting whatever wgpu raises
        print(name, "->", type(exc).__name__, str(exc).replace("\n", " ")[:160])
    else:
        print(name, "did not see the destroyed buffer")
