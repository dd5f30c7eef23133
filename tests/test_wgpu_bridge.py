"""Tests of the wgpu bridge (gradsync._gpu.bridge) on whatever adapter exists, lavapipe in CI."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gradsync
from gradsync import average_host_grads
from gradsync._errors import ConfigError, GradSyncError, InvalidGradsError
from gradsync._gpu.adapters import choose_adapter_index, request_device_for_rank, select_adapter
from gradsync._gpu.bridge import WgpuBridge, WgpuBridgeError, resolve_dtypes

wgpu = pytest.importorskip("wgpu")

REPO = Path(__file__).resolve().parents[1]


def _adapter_reason() -> str | None:
    try:
        if not wgpu.gpu.enumerate_adapters_sync():
            return "no wgpu adapter (install mesa-vulkan-drivers: .ci/install-wgpu-deps.sh)"
    except Exception as exc:
        return f"enumerating wgpu adapters failed: {exc}"
    return None


@pytest.fixture(scope="session")
def device() -> Any:
    reason = _adapter_reason()
    if reason is not None:
        pytest.skip(reason)
    return request_device_for_rank(local_rank=0)


@pytest.fixture
def bridge(device: Any) -> Iterator[WgpuBridge]:
    with WgpuBridge(device) as b:
        yield b


def _usage(src: bool = True, dst: bool = True) -> int:
    u = wgpu.BufferUsage.STORAGE
    if src:
        u |= wgpu.BufferUsage.COPY_SRC
    if dst:
        u |= wgpu.BufferUsage.COPY_DST
    return int(u)


def _buffer(device: Any, data: np.ndarray, label: str = "", **kw: bool) -> Any:
    buf = device.create_buffer(size=data.nbytes, usage=_usage(**kw), label=label)
    if kw.get("dst", True) and data.nbytes:
        device.queue.write_buffer(buf, 0, data)
    return buf


def _read(device: Any, buf: Any, dtype: Any) -> np.ndarray:
    if not buf.size:
        return np.empty(0, dtype)
    return np.frombuffer(device.queue.read_buffer(buf), dtype).copy()


def _mapped_for_writing(device: Any, size: int) -> Any:
    return device.create_buffer(
        size=size,
        usage=wgpu.BufferUsage.MAP_WRITE | wgpu.BufferUsage.COPY_SRC,
        mapped_at_creation=True,
    )


# -- pure logic, no adapter ------------------------------------------------------


class _FakeBuf:
    def __init__(self, size: int, label: str = "") -> None:
        self.size = size
        self.label = label


def test_import_gradsync_does_not_import_wgpu() -> None:
    code = "import sys, gradsync, gradsync._gpu.bridge; assert 'wgpu' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_resolve_dtypes_default_and_per_buffer() -> None:
    bufs = [_FakeBuf(8), _FakeBuf(6)]
    assert resolve_dtypes(bufs[:1]) == [np.dtype(np.float32)]
    assert resolve_dtypes(bufs, [np.float64, "float16"]) == [
        np.dtype(np.float64),
        np.dtype(np.float16),
    ]
    assert resolve_dtypes(bufs, np.float16) == [np.dtype(np.float16)] * 2
    # None is the default, float32, in a list too (numpy would take it for float64).
    assert resolve_dtypes(bufs[:1], None) == [np.dtype(np.float32)]
    assert resolve_dtypes(bufs, [None, "float16"]) == [np.dtype(np.float32), np.dtype(np.float16)]


def test_resolve_dtypes_errors() -> None:
    with pytest.raises(InvalidGradsError, match=r"^param 1 \(label 'b'\): unsupported dtype int32"):
        resolve_dtypes([_FakeBuf(8), _FakeBuf(8, "b")], [np.float32, np.int32])
    with pytest.raises(
        InvalidGradsError,
        match=r"^param 0: buffer size 6 bytes is not a whole number of float32 elements "
        r"\(4 bytes each\)$",
    ):
        resolve_dtypes([_FakeBuf(6)], np.float32)
    with pytest.raises(InvalidGradsError, match=r"^got 1 dtypes for 2 buffers"):
        resolve_dtypes([_FakeBuf(8), _FakeBuf(8)], [np.float32])
    with pytest.raises(InvalidGradsError, match=r"^param 0: unsupported dtype >f4"):
        resolve_dtypes([_FakeBuf(8)], ">f4" if sys.byteorder == "little" else "<f4")
    string_dtype = getattr(getattr(np, "dtypes", None), "StringDType", None)  # numpy >= 2
    if string_dtype is not None:
        with pytest.raises(InvalidGradsError, match=r"^param 0: unsupported dtype StringDType"):
            resolve_dtypes([_FakeBuf(8)], string_dtype())


def _info(backend: str, typ: str, device: str = "gpu", device_id: int = 1) -> dict[str, Any]:
    return {
        "backend_type": backend,
        "adapter_type": typ,
        "device": device,
        "vendor_id": 0x10DE,
        "device_id": device_id,
    }


def test_choose_adapter_prefers_one_backend_and_real_gpus() -> None:
    infos = [
        _info("Vulkan", "CPU", "llvmpipe"),
        _info("Vulkan", "DiscreteGPU", "H200 a"),
        _info("OpenGL", "DiscreteGPU", "H200 a"),
        _info("Vulkan", "DiscreteGPU", "H200 b"),
    ]
    # Each physical GPU once (Vulkan only), CPU dropped, driver order kept for equal GPUs.
    assert [choose_adapter_index(infos, local_rank=r) for r in range(4)] == [1, 3, 1, 3]
    assert choose_adapter_index(infos, local_rank=1, backend="opengl") == 2


def test_choose_adapter_power_preference_and_cpu_fallback() -> None:
    infos = [_info("Vulkan", "IntegratedGPU", "igpu", 2), _info("Vulkan", "DiscreteGPU", "dgpu", 9)]
    assert choose_adapter_index(infos, local_rank=0) == 1
    assert choose_adapter_index(infos, local_rank=0, power_preference="low-power") == 0
    soft = [_info("OpenGL", "CPU", "llvmpipe"), _info("Vulkan", "CPU", "llvmpipe")]
    assert choose_adapter_index(soft, local_rank=5) == 1


def test_choose_adapter_errors() -> None:
    with pytest.raises(WgpuBridgeError, match=r"^no wgpu adapter found"):
        choose_adapter_index([], local_rank=0)
    with pytest.raises(
        WgpuBridgeError,
        match=r"^no wgpu adapter with backend 'Metal'; available backends: \['Vulkan'\]$",
    ):
        choose_adapter_index([_info("Vulkan", "CPU")], local_rank=0, backend="Metal")
    with pytest.raises(ConfigError, match=r"^local_rank must be >= 0, got -1$"):
        choose_adapter_index([_info("Vulkan", "CPU")], local_rank=-1)
    with pytest.raises(ConfigError, match=r"^power_preference must be"):
        choose_adapter_index([_info("Vulkan", "CPU")], local_rank=0, power_preference="fast")


def test_wgpu_bridge_error_is_gradsync_error() -> None:
    assert issubclass(WgpuBridgeError, GradSyncError)
    assert issubclass(WgpuBridgeError, RuntimeError)


# -- on a real (software) adapter ------------------------------------------------


@pytest.mark.wgpu
def test_select_adapter_uses_local_rank_env(monkeypatch: pytest.MonkeyPatch) -> None:
    if (reason := _adapter_reason()) is not None:
        pytest.skip(reason)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert select_adapter().info["device"]
    monkeypatch.setenv("LOCAL_RANK", "x")
    with pytest.raises(ConfigError, match=r"^LOCAL_RANK must be an integer, got 'x'$"):
        select_adapter()
    monkeypatch.setenv("LOCAL_RANK", "-1")  # the variable is named, not an argument never passed
    with pytest.raises(ConfigError, match=r"^LOCAL_RANK must be >= 0, got '-1'$"):
        select_adapter()


@pytest.mark.parametrize("bad", ["x", 1.5, True, -1])
def test_select_adapter_refuses_a_local_rank_that_is_not_one(bad: object) -> None:
    with pytest.raises(
        ConfigError, match=rf"^local_rank must be an int >= 0 or None, got {re.escape(repr(bad))}$"
    ):
        select_adapter(local_rank=bad)  # type: ignore[arg-type]


def test_request_device_names_an_unknown_limit() -> None:
    if (reason := _adapter_reason()) is not None:
        pytest.skip(reason)
    with pytest.raises(
        ConfigError,
        match=r"^required_limits: Unknown limit name 'max-bogus'; this adapter's limits are \[",
    ):
        request_device_for_rank(local_rank=0, required_limits={"max-bogus": 1})
    # Underscores name the same limits as hyphens, and override the defaults.
    small = request_device_for_rank(local_rank=0, required_limits={"max_buffer_size": 1 << 20})
    assert small.limits["max-buffer-size"] == 1 << 20


@pytest.mark.wgpu
def test_roundtrip_mixed_sizes_and_dtypes(device: Any, bridge: WgpuBridge) -> None:
    rng = np.random.default_rng(0)
    specs = [
        (np.float32, 1),
        (np.float32, 3),  # 12 bytes: not a multiple of 8
        (np.float16, 2),
        (np.float16, 6),  # 12 bytes
        (np.float64, 5),
        (np.float32, 100_003),
        (np.float16, 10),
    ]
    data = [rng.standard_normal(n).astype(dt) for dt, n in specs]
    bufs = [_buffer(device, d, f"p{i}") for i, d in enumerate(data)]
    dts = [np.dtype(dt) for dt, _ in specs]
    for _ in range(2):
        host = bridge.download(bufs, dts)
        for h, d in zip(host, data, strict=True):
            assert h.dtype == d.dtype
            assert h.flags.c_contiguous
            assert h.flags.writeable
            assert h.ndim == 1
            np.testing.assert_array_equal(h, d)
            assert h.ctypes.data % h.itemsize == 0
        for arr in host:
            np.multiply(arr, 2, out=arr)  # averaging is in place on the bridge's arrays
        bridge.upload(bufs, host)
        data = [d * 2 for d in data]
        for buf, d in zip(bufs, data, strict=True):
            np.testing.assert_array_equal(_read(device, buf, d.dtype), d)


@pytest.mark.wgpu
def test_download_into_given_arrays(device: Any, bridge: WgpuBridge) -> None:
    rng = np.random.default_rng(2)
    data = [rng.standard_normal(n).astype(dt) for n, dt in ((3, np.float32), (70_002, np.float16))]
    bufs = [_buffer(device, d, f"p{i}") for i, d in enumerate(data)]
    dts = [d.dtype for d in data]
    into = [np.zeros_like(d) for d in data]
    got = bridge.download(bufs, dts, into)
    assert all(g is i for g, i in zip(got, into, strict=True))
    for i, d in zip(into, data, strict=True):
        np.testing.assert_array_equal(i, d)
    with pytest.raises(InvalidGradsError, match=r"^got 1 arrays to fill for 2 buffers$"):
        bridge.download(bufs, dts, into[:1])
    wrong = [into[0], np.zeros(70_002 // 2, np.float32)]
    with pytest.raises(
        InvalidGradsError,
        match=r"^param 1 \(label 'p1'\): into\[1\] is \(35001,\) float32, not a writeable, "
        r"contiguous array of 140004 bytes of float16$",
    ):
        bridge.download(bufs, dts, wrong)


@pytest.mark.wgpu
def test_a_tuple_of_arrays_to_fill_is_checked_again_for_other_buffers(
    device: Any, bridge: WgpuBridge
) -> None:
    # A step downloads into the same tuple of shared arrays every step: checked once
    # for a buffer set, and again for another.
    small = [_buffer(device, np.arange(4, dtype=np.float32))]
    into = (np.zeros(4, np.float32),)
    for _ in range(2):
        bridge.download(small, np.float32, into)
        np.testing.assert_array_equal(into[0], np.arange(4))
    bigger = [_buffer(device, np.arange(8, dtype=np.float32), "big")]
    with pytest.raises(InvalidGradsError, match=r"^param 0 \(label 'big'\): into\[0\] is \(4,\)"):
        bridge.download(bigger, np.float32, into)


@pytest.mark.wgpu
def test_upload_takes_arrays_or_pieces(device: Any, bridge: WgpuBridge) -> None:
    buf = _buffer(device, np.zeros(4, np.float32))
    with pytest.raises(InvalidGradsError, match=r"^upload needs arrays \(or pieces\)$"):
        bridge.upload([buf])
    with pytest.raises(InvalidGradsError, match=r"^upload takes arrays or pieces, not both$"):
        bridge.upload([buf], [np.ones(4, np.float32)], pieces=[])


@pytest.mark.wgpu
def test_check_names_a_buffer_a_step_could_not_copy_back(device: Any, bridge: WgpuBridge) -> None:
    wgpu = pytest.importorskip("wgpu")
    src_only = device.create_buffer(size=16, usage=wgpu.BufferUsage.COPY_SRC, label="ro")
    with pytest.raises(InvalidGradsError, match=r"^param 0 \(label 'ro'\): .*COPY_DST"):
        bridge.check([src_only], download=False)
    bridge.download([src_only])  # a download needs only COPY_SRC


@pytest.mark.wgpu
def test_threads_share_large_downloads(device: Any) -> None:
    # 3 MiB and more in one staging chunk: the host copy is cut into 3 pieces.
    rng = np.random.default_rng(1)
    data = [rng.standard_normal(n).astype(np.float32) for n in (800_001, 3, 200_000)]
    bufs = [_buffer(device, d, f"p{i}") for i, d in enumerate(data)]
    with WgpuBridge(device, threads=3) as bridge:
        assert bridge.threads == 3
        host = bridge.download(bufs, [np.dtype(np.float32)] * 3)
        for h, d in zip(host, data, strict=True):
            assert h.tobytes() == d.tobytes()
        bridge.threads = 1
        assert bridge.download(bufs, [np.dtype(np.float32)] * 3)[0].tobytes() == data[0].tobytes()
        for bad in (0, -1, 1.5, True):
            with pytest.raises(ConfigError, match=rf"^threads must be an int >= 1, got {bad!r}$"):
                bridge.threads = bad  # type: ignore[assignment]


@pytest.mark.wgpu
@pytest.mark.parametrize("mode", ["write_buffer", "mapped"])
def test_upload_modes_with_foreign_arrays(device: Any, bridge: WgpuBridge, mode: str) -> None:
    bridge.upload_mode = mode
    # An empty buffer too: nothing to copy in either mode.
    data = [np.arange(7, dtype=np.float32), np.arange(4, dtype=np.float16), np.ones(0, np.float32)]
    bufs = [_buffer(device, np.zeros_like(d)) for d in data]
    for _ in range(2):
        bridge.upload(bufs, data)
        for buf, d in zip(bufs, data, strict=True):
            np.testing.assert_array_equal(_read(device, buf, d.dtype), d)
        bridge.download(bufs, [d.dtype for d in data])
        data = [d + 1 for d in data]


@pytest.mark.wgpu
@pytest.mark.parametrize("mode", ["write_buffer", "mapping", "host-staged"])
def test_upload_pieces_queued_without_waiting(
    device: Any, bridge: WgpuBridge, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    # write_buffer: one queue.write_buffer a piece. Otherwise gathered into the mapped
    # upload buffer: straight into the mapping, or (a wgpu-py without a writable view
    # of it) into the host mirror first.
    if mode != "write_buffer":
        monkeypatch.setattr(gradsync._gpu.bridge, "DIRECT_MAX_PIECES", 0)
    if mode == "host-staged":
        monkeypatch.setattr(gradsync._gpu.layout, "writable_mapping", lambda buf, nbytes: None)
    dts = [np.dtype(np.float32), np.dtype(np.float16)]
    bufs = [_buffer(device, np.zeros(10, np.float32)), _buffer(device, np.zeros(4, np.float16))]
    for k in range(3):
        host = bridge.download(bufs, dts)
        downloaded = host[0].copy()
        want = [np.arange(10, dtype=np.float32) + k, np.arange(4, dtype=np.float16) - k]
        # Pieces of a param in any order; the float16 one starts 4 bytes in.
        pieces = [
            (0, 6, want[0][6:]),
            (1, 2, want[1][2:]),
            (0, 0, want[0][:6]),
            (1, 0, want[1][:2]),
        ]
        bridge.upload(bufs, dtypes=dts, pieces=pieces)
        chunk = bridge._layout.chunks[0] if bridge._layout else None
        assert chunk is not None
        # Gathered: the staging buffer is being mapped again in the background, not
        # waited for; only the host-staged path goes through the host mirror.
        assert (chunk.remap is not None) == (mode != "write_buffer")
        np.testing.assert_array_equal(host[0], want[0] if mode == "host-staged" else downloaded)
        for buf, w in zip(bufs, want, strict=True):
            np.testing.assert_array_equal(_read(device, buf, w.dtype), w)
    bridge.close()  # with a mapping still pending when gathered
    assert bridge._layout is None


@pytest.mark.wgpu
def test_writable_mapping_is_the_mapped_memory(device: Any) -> None:
    # What the gathered upload relies on: the view writes the buffer's mapped bytes.
    buf = _mapped_for_writing(device, 16)
    view = gradsync._gpu.wait.writable_mapping(buf, 16)
    assert view is not None
    assert view.flags.writeable
    assert view.size == 16
    view[:] = np.arange(16, dtype=np.uint8)
    del view
    buf.unmap()
    dst = _buffer(device, np.zeros(16, np.uint8))
    enc = device.create_command_encoder()
    enc.copy_buffer_to_buffer(buf, 0, dst, 0, 16)
    device.queue.submit([enc.finish()])
    np.testing.assert_array_equal(_read(device, dst, np.uint8), np.arange(16))
    assert gradsync._gpu.wait.writable_mapping(object(), 16) is None  # no such wgpu-py API


class _StrictModes:
    """A buffer as a wgpu-py that knows no "READ_NOSYNC" has it."""

    def __init__(self, buffer: Any) -> None:
        self._buffer = buffer

    def map_async(self, mode: Any) -> Any:
        if mode == "READ_NOSYNC":
            raise ValueError("unknown map mode 'READ_NOSYNC'")
        return self._buffer.map_async(mode)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._buffer, name)


@pytest.mark.wgpu
@pytest.mark.parametrize("spin_s", [0.0, 1.0], ids=["blocking", "polled"])
@pytest.mark.parametrize("nosync", [True, False], ids=["read-nosync", "map-sync"])
def test_map_for_reading_sees_the_copy_submitted_before(
    device: Any, monkeypatch: pytest.MonkeyPatch, nosync: bool, spin_s: float
) -> None:
    # The download's map skips wgpu-py's empty submit ("READ_NOSYNC"), or, where
    # wgpu-py refuses that mode, falls back to map_sync for good; waiting either way.
    monkeypatch.setattr(gradsync._gpu.wait, "_nosync_reads", True)
    staging = device.create_buffer(
        size=64, usage=wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST
    )
    for k in range(3):
        src = _buffer(device, np.arange(16, dtype=np.float32) * (k + 1))
        enc = device.create_command_encoder()
        enc.copy_buffer_to_buffer(src, 0, staging, 0, 64)
        device.queue.submit([enc.finish()])
        gradsync._gpu.wait.map_for_reading(
            staging if nosync else _StrictModes(staging), device, spin_s
        )
        got = np.frombuffer(staging.read_mapped(0, 64), np.float32).copy()
        staging.unmap()
        np.testing.assert_array_equal(got, np.arange(16, dtype=np.float32) * (k + 1))
    assert gradsync._gpu.wait._nosync_reads is nosync


class _FakePromise:
    def __init__(self, resolve_after_polls: int | None) -> None:
        self._state = "pending"
        self.left = resolve_after_polls
        self.polls = 0
        self.waits = 0

    def poll(self) -> None:
        # As wgpu-py 0.27-0.28's device._poll: no argument (0.29 on: block=False by
        # default). A blocking poll here stalled H200 steps (see _wait).
        self.polls += 1
        if self.left is not None and self.polls >= self.left:
            self._state = "fulfilled"

    def sync_wait(self) -> None:
        self.waits += 1


class _FakeDevice:
    def __init__(self, promise: _FakePromise) -> None:
        self._poll = promise.poll


def test_wait_polls_until_the_promise_resolves() -> None:
    promise = _FakePromise(resolve_after_polls=3)
    gradsync._gpu.wait.wait_for(promise, _FakeDevice(promise), 10.0)
    assert (promise.polls, promise.waits) == (3, 1)


def test_wait_polls_for_at_most_spin_s_then_blocks() -> None:
    promise = _FakePromise(resolve_after_polls=None)
    t0 = time.perf_counter()
    gradsync._gpu.wait.wait_for(promise, _FakeDevice(promise), 0.02)
    assert time.perf_counter() - t0 >= 0.02
    assert promise.polls > 0
    assert promise.waits == 1


def test_wait_without_spin_or_poll_api_only_blocks() -> None:
    promise = _FakePromise(resolve_after_polls=1)
    gradsync._gpu.wait.wait_for(promise, _FakeDevice(promise), 0.0)
    gradsync._gpu.wait.wait_for(promise, object(), 1.0)  # a wgpu-py without device._poll
    assert (promise.polls, promise.waits) == (0, 2)


def test_adapter_type_unknown_without_adapter_info() -> None:
    assert gradsync._gpu.wait.adapter_type(object()) is None


@pytest.mark.wgpu
def test_bridge_polls_only_on_gpus(device: Any) -> None:
    # A CPU adapter's "GPU" work runs on the cores a polling wait would take.
    with WgpuBridge(device) as bridge:
        cpu = device.adapter.info["adapter_type"] == "CPU"
        assert bridge._spin_s == (0.0 if cpu else gradsync._gpu.bridge.SPIN_S)


@pytest.mark.wgpu
def test_polled_waits_roundtrip(device: Any) -> None:
    # Download, queued upload (float16 from element 1: gathered, its staging buffer
    # remapped in the background and waited for next time), upload with its fence.
    with WgpuBridge(device) as bridge:
        bridge._spin_s = 1.0
        f16 = [np.dtype(np.float16)]
        start = np.arange(300, dtype=np.float16)
        buf = _buffer(device, start)
        for k in range(3):
            (h,) = bridge.download([buf], f16)
            np.testing.assert_array_equal(h, start * 2**k)
            bridge.upload([buf], dtypes=f16, pieces=[(0, 1, h[1:] * 2), (0, 0, h[:1] * 2)])
            assert bridge._layout is not None
            assert bridge._layout.chunks[0].remap is not None
        bridge.upload([buf], [np.full(300, 7, np.float16)])
        np.testing.assert_array_equal(_read(device, buf, np.float16), np.full(300, 7))


@pytest.mark.wgpu
def test_unaligned_piece_goes_through_the_staging_buffer(device: Any, bridge: WgpuBridge) -> None:
    # write_buffer moves whole 4-byte words: a float16 piece starting at element 1
    # cannot be written directly, so the mean is gathered and uploaded mapped.
    dts = [np.dtype(np.float16)]
    buf = _buffer(device, np.zeros(4, np.float16))
    bridge.download([buf], dts)
    want = np.array([1, 2, 3, 4], np.float16)
    bridge.upload([buf], dtypes=dts, pieces=[(0, 0, want[:1]), (0, 1, want[1:])])
    assert bridge._layout is not None
    assert bridge._layout.chunks[0].remap is not None
    np.testing.assert_array_equal(_read(device, buf, np.float16), want)


@pytest.mark.wgpu
def test_average_checks_copy_dst_before_its_step(device: Any, tmp_path: Path) -> None:
    no_dst = device.create_buffer(size=16, usage=_usage(dst=False), label="g")
    # Checked before the step: the rank tries to meet its peer to tell it (for
    # max_wait_s here), then raises its own error, not the rendezvous's.
    cfg = gradsync.FileGradSyncConfig(2, 0, tmp_path, max_wait_s=0.5)
    with gradsync.GradSync(cfg) as gs:
        with pytest.raises(
            InvalidGradsError,
            match=r"^step 0: param 0 \(label 'g'\): buffer usage lacks COPY_DST; create it with "
            r"usage=\.\.\. \| wgpu\.BufferUsage\.COPY_DST$",
        ):
            gs.average([no_dst], device=device)
        assert gs.generation_dir is None  # the peer never came


@pytest.mark.wgpu
def test_download_takes_one_dtype_for_all_buffers(device: Any, bridge: WgpuBridge) -> None:
    # As average(dtype=...) does; it raised a bare TypeError (len() of a dtype).
    data = [np.arange(n, dtype=np.float16) for n in (2, 6)]
    bufs = [_buffer(device, d) for d in data]
    per_param = {"a": np.float16, "b": np.float16}
    specs = (np.float16, "float16", np.dtype(np.float16), [np.float16] * 2, per_param.values())
    for spec in (*specs, np.array([np.dtype(np.float16)] * 2, dtype=object)):
        assert [h.tobytes() for h in bridge.download(bufs, spec)] == [d.tobytes() for d in data]
    f32 = [_buffer(device, np.full(3, 2.5, np.float32))]
    assert bridge.download(f32)[0].tolist() == [2.5] * 3  # float32 by default
    with pytest.raises(InvalidGradsError, match=r"^got 1 dtypes for 2 buffers; pass one dtype"):
        bridge.download(bufs, [np.float16])


@pytest.mark.wgpu
def test_a_bridge_needs_a_device(device: Any) -> None:
    with pytest.raises(InvalidGradsError, match=r"^device must be a wgpu GPUDevice, got NoneType$"):
        WgpuBridge(None)  # type: ignore[arg-type]


@pytest.mark.wgpu
def test_host_arrays_are_not_mapped_memory(device: Any, bridge: WgpuBridge) -> None:
    buf = _buffer(device, np.ones(16, np.float32))
    (h,) = bridge.download([buf], [np.dtype(np.float32)])
    layout = bridge._layout
    assert layout is not None
    assert layout.chunks[0].read.map_state == "unmapped"
    assert np.shares_memory(h, layout.chunks[0].host)


@pytest.mark.wgpu
def test_staging_reused_for_same_set_recreated_for_new_set(device: Any, bridge: WgpuBridge) -> None:
    a = _buffer(device, np.ones(4, np.float32))
    b = _buffer(device, np.ones(8, np.float32))
    f32 = np.dtype(np.float32)
    bridge.download([a, b], [f32, f32])
    first = bridge._layout
    assert first is not None
    staging = first.chunks[0].read
    bridge.download([a, b], [f32, f32])
    assert bridge._layout is first
    assert first.chunks[0].read is staging
    c = _buffer(device, np.ones(8, np.float32))
    (hc,) = bridge.download([c], [f32])
    assert bridge._layout is not first
    np.testing.assert_array_equal(hc, np.ones(8, np.float32))
    bridge.download([a, b], [f32, np.dtype(np.float16)])  # same buffers, new dtypes
    assert bridge._layout is not first


@pytest.mark.wgpu
def test_resolve_remembers_the_last_buffer_set(device: Any, bridge: WgpuBridge) -> None:
    a = _buffer(device, np.ones(4, np.float32))
    b = _buffer(device, np.ones(8, np.float32))
    f32, f16 = np.dtype(np.float32), np.dtype(np.float16)
    first = bridge.resolve([a, b], np.float32)
    assert first == [f32, f32]
    assert bridge.resolve([a, b], np.float32) is first  # a training loop's every step
    assert bridge.resolve((a, b), f32) is first  # an equal dtype, a tuple of the same buffers
    assert bridge.resolve([a, b], first) is first  # download() handed the result back
    # A list of dtypes is compared by value: changed in place, it is resolved again.
    spec: list[Any] = [np.float32, np.float32]
    assert bridge.resolve([a, b], spec) == [f32, f32]
    spec[1] = np.float16
    assert bridge.resolve([a, b], spec) == [f32, f16]
    assert bridge.resolve([b, a], np.float16) == [f16, f16]  # another set
    with pytest.raises(InvalidGradsError, match=r"^param 1: unsupported dtype int32"):
        bridge.resolve([a, b], [np.float32, np.int32])


@pytest.mark.wgpu
def test_resolve_never_takes_none_for_a_remembered_float64(device: Any, bridge: WgpuBridge) -> None:
    # None is float32 here, but numpy reads it as float64: np.dtype("f8") == None, and
    # so (None,) == (np.dtype("f8"),). Either way round, the same buffer set must get
    # the dtypes asked for, not the last call's.
    buf = _buffer(device, np.arange(4, dtype=np.float32))
    f32, f64 = np.dtype(np.float32), np.dtype(np.float64)
    assert bridge.resolve([buf], [f64]) == [f64]
    assert bridge.resolve([buf], [None]) == [f32]
    assert bridge.resolve([buf], [f64]) == [f64]
    assert bridge.resolve([buf], f64) == [f64]
    assert bridge.resolve([buf], None) == [f32]
    # numpy also takes some tuples for one dtype: np.dtype("f4") == ("f4", "f4").
    two = [buf, _buffer(device, np.ones(4, np.float32))]
    assert bridge.resolve(two, f32) == [f32, f32]
    with pytest.raises(InvalidGradsError, match=r"^param 1: unsupported dtype int32"):
        bridge.resolve(two, ("float32", "int32"))
    (host,) = bridge.download([buf], [None])
    np.testing.assert_array_equal(host, np.arange(4, dtype=np.float32))


@pytest.mark.wgpu
def test_an_array_among_the_buffers_after_a_first_call_is_named(
    device: Any, bridge: WgpuBridge
) -> None:
    # The last buffer set is remembered; the new one must be compared with it by
    # identity: GPUBuffer == ndarray is an array, whose truth value is a ValueError.
    a = _buffer(device, np.ones(4, np.float32))
    b = _buffer(device, np.ones(4, np.float32))
    assert bridge.resolve([a, b], np.float32) == [np.dtype(np.float32)] * 2
    with pytest.raises(InvalidGradsError, match=r"^param 1 is a ndarray, not a wgpu GPUBuffer"):
        bridge.resolve([a, np.ones(4, np.float32)], np.float32)


@pytest.mark.wgpu
def test_upload_names_what_is_not_a_gpu_buffer(device: Any, bridge: WgpuBridge) -> None:
    # A numpy array has a size too (in elements): it must not be taken for the buffer's.
    ok = _buffer(device, np.ones(4, np.float32))
    for bad in (np.zeros(4, np.float32), None):
        with pytest.raises(
            InvalidGradsError, match=rf"^param 1 is a {type(bad).__name__}, not a wgpu GPUBuffer"
        ):
            bridge.upload([ok, bad], [np.zeros(4, np.float32)] * 2)


@pytest.mark.wgpu
def test_layout_found_without_a_key_for_the_same_set(device: Any, bridge: WgpuBridge) -> None:
    a = _buffer(device, np.ones(4, np.float32))
    b = _buffer(device, np.ones(6, np.float16))
    dtypes = bridge.resolve([a, b], [np.float32, np.float16])
    layout = bridge._get_layout([a, b], dtypes)
    assert layout.host_layout == (("<f4", (4,)), ("<f2", (6,)))
    assert bridge._get_layout([a, b], dtypes) is layout
    # Another spelling of the same set finds it by its key, and is remembered instead.
    again = [np.dtype(np.float32), np.dtype(np.float16)]
    assert bridge._get_layout((a, b), again) is layout
    assert layout.dtypes is again
    bridge.close()
    assert bridge._resolved is None  # no buffer is kept alive by a closed bridge


@pytest.mark.wgpu
def test_layout_tells_buffers_apart_by_identity(bridge: WgpuBridge) -> None:
    # Of a buffer the layout reads only its size: GPUBuffer.uid is wgpu-py >= 0.30.
    a, b = _FakeBuf(16), _FakeBuf(16)
    f32 = np.dtype(np.float32)
    layout = bridge._get_layout([a, b], [f32, f32])
    assert layout.host_layout == (("<f4", (4,)), ("<f4", (4,)))
    assert bridge._get_layout((a, b), [f32, f32]) is layout
    assert bridge._get_layout([b, a], [f32, f32]) is not layout


@pytest.mark.wgpu
def test_staging_splits_at_max_buffer_size(device: Any) -> None:
    small = device.adapter.request_device_sync(required_limits={"max-buffer-size": 256})
    with WgpuBridge(small) as bridge:
        data = [np.full(40, i, np.float32) for i in range(3)]  # 160 bytes each
        bufs = [
            small.create_buffer_with_data(
                data=d, usage=wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
            )
            for d in data
        ]
        host = bridge.download(bufs, [np.dtype(np.float32)] * 3)
        assert bridge._layout is not None
        assert len(bridge._layout.chunks) == 3
        for h, d in zip(host, data, strict=True):
            np.testing.assert_array_equal(h, d)


def test_staging_chunks_end_at_a_limit_that_is_not_a_multiple_of_8(device: Any) -> None:
    # Two buffers that fill the limit exactly: the second starts at an 8-byte boundary
    # and ends at the limit, so the staging buffer must not be rounded up past it.
    small = device.adapter.request_device_sync(required_limits={"max-buffer-size": 65540})
    with WgpuBridge(small) as bridge:
        data = [np.full(8192, 1.0, np.float32), np.full(8193, 2.0, np.float32)]
        bufs = [
            small.create_buffer_with_data(
                data=d, usage=wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
            )
            for d in data
        ]
        host = bridge.download(bufs, [np.dtype(np.float32)] * 2)
        for h, d in zip(host, data, strict=True):
            np.testing.assert_array_equal(h, d)


@pytest.mark.wgpu
def test_closing_after_the_device_was_lost_neither_hangs_nor_raises(device: Any) -> None:
    # 20 buffers go up through the mapped upload buffer, whose next mapping is left
    # pending; a lost device never resolves it.
    lost = device.adapter.request_device_sync()
    bufs = [_buffer(lost, np.full(16, i, np.float32)) for i in range(20)]
    bridge = WgpuBridge(lost)
    host = bridge.download(bufs, [np.dtype(np.float32)] * 20)
    bridge.upload(bufs, pieces=[(i, 0, h) for i, h in enumerate(host)])
    lost.destroy()
    failed: list[BaseException] = []

    def close() -> None:
        try:
            bridge.close()
        except BaseException as exc:
            failed.append(exc)

    closer = threading.Thread(target=close, daemon=True)
    closer.start()
    closer.join(20)
    assert not closer.is_alive(), "close() hung on the lost device"
    assert failed == []


@pytest.mark.wgpu
def test_a_destroyed_empty_buffer_does_not_abort_the_process(tmp_path: Path) -> None:
    # Submitting a destroyed buffer aborts the process in wgpu-native; an empty one
    # cannot be probed, and has nothing to copy: it is left out of the commands.
    script = tmp_path / "empty.py"
    script.write_text(
        textwrap.dedent(
            """
            import numpy as np, wgpu
            from gradsync._gpu.adapters import request_device_for_rank
            from gradsync._gpu.bridge import WgpuBridge
            device = request_device_for_rank(local_rank=0)
            usage = wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
            full = device.create_buffer_with_data(data=np.ones(4, np.float32), usage=usage)
            empty = device.create_buffer(size=0, usage=usage, label="empty")
            empty.destroy()
            with WgpuBridge(device) as bridge:
                host = bridge.download([full, empty], [np.dtype(np.float32)] * 2)
                bridge.upload([full, empty], host)
            print("ok", host[0].tolist(), host[1].size)
            """
        )
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "ok [1.0, 1.0, 1.0, 1.0] 0"


# -- error cases --------------------------------------------------------------------


@pytest.mark.wgpu
def test_missing_copy_src_and_copy_dst(device: Any, bridge: WgpuBridge) -> None:
    ok = _buffer(device, np.ones(4, np.float32))
    no_src = _buffer(device, np.ones(4, np.float32), "w", src=False)
    no_dst = device.create_buffer(size=16, usage=_usage(dst=False))
    f32 = np.dtype(np.float32)
    with pytest.raises(
        InvalidGradsError,
        match=r"^param 1 \(label 'w'\): buffer usage lacks COPY_SRC; create it with "
        r"usage=\.\.\. \| wgpu\.BufferUsage\.COPY_SRC$",
    ):
        bridge.download([ok, no_src], [f32, f32])
    with pytest.raises(
        InvalidGradsError,
        match=r"^param 0: buffer usage lacks COPY_DST; create it with "
        r"usage=\.\.\. \| wgpu\.BufferUsage\.COPY_DST$",
    ):
        bridge.upload([no_dst], [np.ones(4, np.float32)])


@pytest.mark.wgpu
def test_destroyed_buffer(device: Any, bridge: WgpuBridge) -> None:
    a = _buffer(device, np.ones(4, np.float32))
    dead = _buffer(device, np.ones(4, np.float32), "bias")
    dead.destroy()
    f32 = np.dtype(np.float32)
    msg = r"^param 1 \(label 'bias'\): buffer has been destroyed$"
    with pytest.raises(InvalidGradsError, match=msg):
        bridge.download([a, dead], [f32, f32])
    with pytest.raises(InvalidGradsError, match=msg):
        bridge.upload([a, dead], [np.ones(4, np.float32)] * 2)
    # The bridge stays usable afterwards.
    np.testing.assert_array_equal(bridge.download([a], [f32])[0], np.ones(4, np.float32))


@pytest.mark.wgpu
@pytest.mark.parametrize(
    ("grads", "where", "message"),
    [
        (
            "array",
            "grads",
            r"^step 0: param 0 is a ndarray, not a wgpu GPUBuffer \(numpy arrays are ",
        ),
        ("none", "grads", r"^step 0: param 1 is a NoneType, not a wgpu GPUBuffer "),
        (
            "no device",
            "device",
            r"^step 0: param 0 is a wgpu GPUBuffer, not a numpy array: GPU buffers are averaged "
            r"with device=<the GPUDevice that owns them>$",
        ),
        (
            "generator",
            "grads",
            r"^step 0: grads must be a list or tuple of wgpu GPUBuffers, got generator$",
        ),
        (
            "one buffer",
            "grads",
            r"^step 0: grads must be a list or tuple of wgpu GPUBuffers, got GPUBuffer$",
        ),
        (
            "list",
            "device",
            r"^step 0: device must be a wgpu GPUDevice \(or None for numpy arrays\), got str$",
        ),
    ],
)
def test_what_is_not_a_gpu_buffer_or_device_is_named(
    device: Any, tmp_path: Path, grads: str, where: str, message: str
) -> None:
    # One rank (nothing to meet): the arguments are checked all the same.
    buf = _buffer(device, np.ones(4, np.float32))
    given: Any = {
        "array": [np.ones(4, np.float32)],
        "none": [buf, None],
        "generator": (b for b in [buf]),
        "one buffer": buf,
        "list": [buf],
        "no device": [buf],
    }[grads]
    cfg = gradsync.FileGradSyncConfig(1, 0, tmp_path)
    given_device = {"list": "gpu", "no device": None}.get(grads, device)
    with gradsync.GradSync(cfg) as gs, pytest.raises(InvalidGradsError, match=message):
        gs.average(given, device=given_device)


@pytest.mark.wgpu
def test_one_rank_checks_the_buffers_as_more_ranks_would(device: Any, tmp_path: Path) -> None:
    # Nothing is copied with one rank, but code that works there must work with more.
    no_dst = device.create_buffer(size=16, usage=_usage(dst=False), label="g")
    dead = _buffer(device, np.ones(4, np.float32), "h")
    dead.destroy()
    for buf, problem in ((no_dst, "buffer usage lacks COPY_DST"), (dead, "buffer has been")):
        cfg = gradsync.FileGradSyncConfig(1, 0, tmp_path)
        with gradsync.GradSync(cfg) as gs, pytest.raises(InvalidGradsError, match=problem):
            gs.average([buf], device=device)


@pytest.mark.wgpu
def test_the_same_buffer_twice_is_invalid_grads(device: Any, tmp_path: Path) -> None:
    # Averaged in place, the one buffer would get the mean of whichever param came last.
    a, b = _buffer(device, np.ones(4, np.float32)), _buffer(device, np.ones(2, np.float32))
    message = (
        "step 0: params 0 and 2 are the same GPUBuffer: averaging is in place, so each "
        "gradient must be passed once, in memory of its own"
    )
    cfg = gradsync.FileGradSyncConfig(1, 0, tmp_path)
    with (
        gradsync.GradSync(cfg) as gs,
        pytest.raises(InvalidGradsError, match=f"^{re.escape(message)}$"),
    ):
        gs.average([a, b, a], device=device)
    with gradsync.GradSync(cfg) as gs:
        gs.average([a, b], device=device)  # each once: fine


@pytest.mark.wgpu
def test_one_rank_refuses_an_empty_buffer_list_as_more_ranks_would(
    device: Any, tmp_path: Path
) -> None:
    cfg = gradsync.FileGradSyncConfig(1, 0, tmp_path)
    with (
        gradsync.GradSync(cfg) as gs,
        pytest.raises(InvalidGradsError, match=r"^step 0: grads is empty"),
    ):
        gs.average([], device=device)


@pytest.mark.wgpu
def test_one_rank_check_finite_stops_a_gpu_step_with_nan(device: Any, tmp_path: Path) -> None:
    # As for numpy arrays with one rank, and for GPU buffers with more: a job debugged
    # alone sees the same.
    cfg = gradsync.FileGradSyncConfig(1, 0, tmp_path, check_finite=True)
    bufs = [_buffer(device, np.ones(4, np.float32)), _buffer(device, np.array([1, np.nan]))]
    nan_in_param_1 = r"^step 7: non-finite gradients \(NaN or Inf\) in rank 0 param 1$"
    with (
        gradsync.GradSync(cfg) as gs,
        pytest.raises(gradsync.NonFiniteGradError, match=nan_in_param_1),
    ):
        gs.average(bufs, step=7, device=device, dtype=["float32", "float64"])
    with gradsync.GradSync(cfg) as gs:
        gs.average(bufs[:1], device=device)  # finite: nothing to stop


@pytest.mark.wgpu
def test_buffer_from_another_device(device: Any, bridge: WgpuBridge) -> None:
    other = request_device_for_rank(local_rank=0)
    buf = _buffer(other, np.ones(4, np.float32), "emb")
    with pytest.raises(
        InvalidGradsError,
        match=r"^param 0 \(label 'emb'\): buffer belongs to another GPUDevice than the bridge's$",
    ):
        bridge.download([buf], [np.dtype(np.float32)])


@pytest.mark.wgpu
def test_size_not_multiple_of_4_bytes(device: Any, bridge: WgpuBridge) -> None:
    # 3 float16 = 6 bytes: WebGPU cannot copy the last 2 bytes of such a buffer.
    buf = device.create_buffer(size=6, usage=_usage())
    with pytest.raises(
        InvalidGradsError,
        match=r"^param 0: buffer size 6 bytes is not a multiple of 4; wgpu copies whole "
        r"4-byte words, so allocate the buffer with its size rounded up to 8 bytes$",
    ):
        bridge.download([buf], [np.dtype(np.float16)])


@pytest.mark.wgpu
def test_size_not_multiple_of_element_and_bad_dtype(device: Any, bridge: WgpuBridge) -> None:
    buf = device.create_buffer(size=12, usage=_usage())
    with pytest.raises(
        InvalidGradsError,
        match=r"^param 0: buffer size 12 bytes is not a whole number of float64 elements",
    ):
        bridge.download([buf], [np.dtype(np.float64)])
    with pytest.raises(InvalidGradsError, match=r"^param 0: unsupported dtype int32;"):
        bridge.download([buf], [np.dtype(np.int32)])
    with pytest.raises(InvalidGradsError, match=r"^param 0: unsupported dtype int32;"):
        bridge.upload([buf], [np.zeros(3, np.int32)])
    with pytest.raises(
        InvalidGradsError,
        match=r"^param 0: array has 16 bytes \(4 x float32\) but the buffer has 12 bytes$",
    ):
        bridge.upload([buf], [np.zeros(4, np.float32)])


@pytest.mark.wgpu
def test_size_above_device_limit(device: Any, bridge: WgpuBridge) -> None:
    buf = device.create_buffer(size=64, usage=_usage())
    bridge._max_buffer_size = 32  # a real over-limit buffer cannot even be created
    with pytest.raises(
        InvalidGradsError,
        match=r"^param 0: buffer size 64 bytes exceeds the device's max-buffer-size limit 32$",
    ):
        bridge.download([buf], [np.dtype(np.float32)])


@pytest.mark.wgpu
def test_mapped_buffer_and_closed_bridge(device: Any) -> None:
    buf = _mapped_for_writing(device, 16)
    bridge = WgpuBridge(device)
    with pytest.raises(InvalidGradsError, match=r"^param 0: buffer is mapped; unmap it"):
        bridge.download([buf], [np.dtype(np.float32)])
    bridge.close()
    bridge.close()
    with pytest.raises(WgpuBridgeError, match=r"^WgpuBridge is closed$"):
        bridge.download([], [])


@pytest.mark.wgpu
def test_wgpu_exceptions_are_translated(
    device: Any, bridge: WgpuBridge, monkeypatch: pytest.MonkeyPatch
) -> None:
    buf = _buffer(device, np.ones(4, np.float32))

    def boom(*args: object, **kwargs: object) -> None:
        raise wgpu.GPUValidationError("synthetic failure")

    monkeypatch.setattr(type(device.queue), "submit", boom)
    with pytest.raises(
        WgpuBridgeError, match=r"^wgpu failed while downloading gradients: synthetic failure$"
    ) as info:
        bridge.download([buf], [np.dtype(np.float32)])
    assert isinstance(info.value.__cause__, wgpu.GPUValidationError)


# -- multi-process averaging through the core (when it exists) ----------------------


def _core_api_missing() -> str | None:
    for name in ("average_grads_file_sync", "FileGradSyncConfig"):
        if not hasattr(gradsync, name):
            return f"gradsync.{name} does not exist yet"
    return None


# (element count, dtype): byte sizes 4, 12, 4000, 280004 (big enough to be reduced in
# shards), 12 and 16 bytes: several are not multiples of 8.
_WGPU_LAYOUT = [
    (1, "float32"),
    (3, "float32"),
    (1000, "float32"),
    (70_001, "float32"),
    (6, "float16"),
    (2, "float64"),
]


def _wgpu_inputs(rank: int, step: int) -> list[np.ndarray]:
    rng = np.random.default_rng([rank, step, 7])
    return [rng.standard_normal(n).astype(dt) for n, dt in _WGPU_LAYOUT]


_WORKER = textwrap.dedent(
    """
    import os
    import sys
    import numpy as np
    import wgpu
    import gradsync
    from test_wgpu_bridge import _WGPU_LAYOUT, _wgpu_inputs

    world, rank, sync_dir, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    mode = sys.argv[5]
    if mode == "gathered":  # the mean is gathered on the host, then uploaded mapped
        gradsync._gpu.bridge.DIRECT_MAX_PIECES = 0
    mapped_uploads = []
    upload_staged = gradsync._gpu.bridge.upload_staged
    def counted(*args, **kwargs):
        mapped_uploads.append(kwargs)
        return upload_staged(*args, **kwargs)
    gradsync._gpu.bridge.upload_staged = counted
    dev = gradsync.request_device_for_rank(local_rank=rank)
    usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
    dtypes = [dt for _, dt in _WGPU_LAYOUT]
    cfg = gradsync.FileGradSyncConfig(
        world, rank, sync_dir, max_wait_s=60, use_mmap=mode != "unmapped"
    )
    results = []
    bufs = None
    for step in range(3):
        data = _wgpu_inputs(rank, step)
        if bufs is None:
            bufs = [dev.create_buffer_with_data(data=d, usage=usage) for d in data]
        else:
            for b, d in zip(bufs, data):
                dev.queue.write_buffer(b, 0, d)
        stats = gradsync.average_grads_file_sync(bufs, dev, cfg, step, dtype=dtypes)
        # The download is timed and counted in the total, which is every phase's sum.
        phases = (stats.download_s, stats.publish_s, stats.wait_inputs_s, stats.reduce_s,
                  stats.wait_outputs_s, stats.gather_s)
        assert stats.download_s > 0 and abs(stats.total_s - sum(phases)) < 1e-9, stats
        results.append(b"".join(bytes(dev.queue.read_buffer(b)) for b in bufs))
        # From the second step on, the buffers are downloaded into arrays mapped from
        # this rank's data file (280 KiB: reduced in shards), which is then published
        # without a copy: the rank's input-file name links to that file.
        gen = gradsync._session.registry[gradsync._session.job_key(cfg)].generation_dir
        linked = os.path.islink(os.path.join(gen, f"d-{rank}.in"))
        assert linked == (step > 0 and mode != "unmapped"), (step, linked)
    assert mapped_uploads == ([{"wait": False}] * 3 if mode == "gathered" else []), mapped_uploads
    with open(out, "wb") as f:
        f.write(b"".join(results))
    """
)


@pytest.mark.wgpu
@pytest.mark.slow
# How the mean reaches the GPU: "direct", one write_buffer per piece from the mapped
# files; "gathered", copied into the staging arrays first; "unmapped", read from files
# that are not mapped (as on a shared filesystem).
@pytest.mark.parametrize("mode", ["direct", "gathered", "unmapped"])
def test_two_ranks_average_wgpu_buffers_bit_for_bit_like_numpy(tmp_path: Path, mode: str) -> None:
    if (reason := _core_api_missing() or _adapter_reason()) is not None:
        pytest.skip(reason)
    world = 2
    outs = _run_rank_scripts(tmp_path, _WORKER, world, [mode])
    want = b"".join(
        b"".join(
            a.tobytes() for a in average_host_grads([_wgpu_inputs(r, step) for r in range(world)])
        )
        for step in range(3)
    )
    for r in range(world):
        assert outs[r].read_bytes() == want, f"rank {r} differs from the numpy path"


def _run_rank_scripts(
    tmp_path: Path,
    script: str,
    world: int,
    extra: list[str],
    *,
    fault: str = "",
    returncodes: dict[int, int] | None = None,
) -> list[Path]:
    """Run ``script`` as ``world`` rank processes (argv: world, rank, sync dir, output
    file, *extra; ``fault`` as GRADSYNC_TEST_FAULT), wait for all of them (killing any
    left after a failure), check their exit codes (0 unless ``returncodes`` says
    otherwise), and return the output files by rank."""
    path = os.pathsep.join(
        [str(REPO / "src"), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]
    )
    env = {**os.environ, "PYTHONPATH": path, "GRADSYNC_TEST_FAULT": fault}
    expected = returncodes or {}
    outs = [tmp_path / f"rank{r}.bin" for r in range(world)]
    sync = str(tmp_path / "sync")
    argv = [[str(world), str(r), sync, str(outs[r]), *extra] for r in range(world)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, *argv[r]],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    try:
        for r, p in enumerate(procs):
            _, err = p.communicate(timeout=100)
            assert p.returncode == expected.get(r, 0), err
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return outs


# Buffer sets of a run whose gradients change shape from call to call (under 256 KiB:
# every rank reduces all; over: in shards; many buffers: the mapped upload).
_SETS: dict[str, list[tuple[int, str]]] = {
    "small": [(1000, "float32"), (37, "float16")],
    "pair": [(333, "float32"), (4001, "float16")],  # as many buffers as "small", other sizes
    "big": [(70001, "float32"), (5, "float32"), (30001, "float16")],
    "many": [(int(n), "float32") for n in np.random.default_rng(1).integers(1, 20000, 40)],
}


def _set_inputs(plan: str, rank: int, call: int) -> list[np.ndarray]:
    rng = np.random.default_rng([rank, call, 3])
    return [rng.standard_normal(n).astype(dt) for n, dt in _SETS[plan]]


_SHIFTING_WORKER = textwrap.dedent(
    """
    import sys
    import numpy as np
    import wgpu
    import gradsync
    from test_wgpu_bridge import _SETS, _set_inputs

    world, rank, sync_dir, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    plans = sys.argv[5].split(",")
    dev = gradsync.request_device_for_rank(local_rank=rank)
    usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
    rng = np.random.default_rng(rank)
    bufsets = {}
    results = []
    cfg = gradsync.FileGradSyncConfig(world, rank, sync_dir, max_wait_s=60)
    with gradsync.GradSync(cfg) as gs:
        for call, plan in enumerate(plans):
            data = _set_inputs(plan, rank, call)
            if plan not in bufsets or rng.random() < 0.3:  # now and then new buffers
                bufsets[plan] = [
                    dev.create_buffer(size=-(-d.nbytes // 4) * 4, usage=usage) for d in data
                ]
            bufs = bufsets[plan]
            for b, d in zip(bufs, data):
                dev.queue.write_buffer(b, 0, d.tobytes() + bytes(int(b.size) - d.nbytes))
            gs.average(bufs, step=call, device=dev, dtype=[dt for _, dt in _SETS[plan]])
            results.append(
                b"".join(bytes(dev.queue.read_buffer(b))[: d.nbytes] for b, d in zip(bufs, data))
            )
    with open(out, "wb") as f:
        f.write(b"".join(results))
    """
)


@pytest.mark.wgpu
@pytest.mark.slow
def test_two_ranks_whose_buffer_sets_change_from_call_to_call(tmp_path: Path) -> None:
    # The bridge remembers the last buffer set's dtypes and staging layout: a new set,
    # or new buffers of the same shapes, must never be read through the old ones.
    if (reason := _core_api_missing() or _adapter_reason()) is not None:
        pytest.skip(reason)
    plans = np.random.default_rng(5).choice(list(_SETS), size=16).tolist()
    outs = _run_rank_scripts(tmp_path, _SHIFTING_WORKER, 2, [",".join(plans)])
    want = b"".join(
        b"".join(a.tobytes() for a in average_host_grads([_set_inputs(p, r, c) for r in range(2)]))
        for c, p in enumerate(plans)
    )
    for r in range(2):
        assert outs[r].read_bytes() == want, f"rank {r} differs from the numpy path"


_FAILING_WORKER = textwrap.dedent(
    """
    import sys
    import numpy as np
    import wgpu
    import gradsync
    from test_wgpu_bridge import _set_inputs

    world, rank, sync_dir, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    dev = gradsync.request_device_for_rank(local_rank=rank)
    usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
    data = _set_inputs("big", rank, 0)
    bufs = [dev.create_buffer(size=-(-d.nbytes // 4) * 4, usage=usage) for d in data]
    cfg = gradsync.FileGradSyncConfig(world, rank, sync_dir, max_wait_s=60)
    with gradsync.GradSync(cfg) as gs:
        for call in range(2):
            data = _set_inputs("big", rank, call)
            for b, d in zip(bufs, data):
                dev.queue.write_buffer(b, 0, d.tobytes() + bytes(int(b.size) - d.nbytes))
            try:
                gs.average(bufs, step=call, device=dev, dtype=["float32", "float32", "float16"])
            except gradsync.PeerLostError as exc:
                got = [bytes(dev.queue.read_buffer(b))[: d.nbytes] for b, d in zip(bufs, data)]
                kept = got == [d.tobytes() for d in data]
                with open(out, "w") as f:
                    f.write(f"call {call}: {type(exc).__name__}; buffers kept: {kept}")
                sys.exit(0)
    with open(out, "w") as f:
        f.write("no error")
    """
)


@pytest.mark.wgpu
@pytest.mark.slow
# Killed after publishing its input, or half-way through its shard of the mean (after
# publishing that, it would have left rank 0 all it needs: that step succeeds).
@pytest.mark.parametrize("phase", ["after_publish", "mid_output"])
def test_a_failed_step_leaves_the_gpu_buffers_as_they_were(tmp_path: Path, phase: str) -> None:
    # Rank 1 dies in its second call; rank 0 may have reduced and published its own
    # shard by then, but nothing of the mean reaches its buffers before every shard is in.
    if (reason := _core_api_missing() or _adapter_reason()) is not None:
        pytest.skip(reason)
    outs = _run_rank_scripts(
        tmp_path, _FAILING_WORKER, 2, [], fault=f"{phase}@1@2=sigkill", returncodes={1: -9}
    )
    assert outs[0].read_text() == "call 1: PeerLostError; buffers kept: True"


_BAD_BUFFER_WORKER = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    import wgpu
    import gradsync
    from workers import linger, mark_done

    world, rank, sync_dir, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    dev = gradsync.request_device_for_rank(local_rank=rank)
    usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
    bufs = [dev.create_buffer(size=64, usage=usage, label=f"w{i}") for i in range(2)]
    cfg = gradsync.FileGradSyncConfig(world, rank, sync_dir, max_wait_s=30)
    with gradsync.GradSync(cfg) as gs:
        gs.average(bufs, device=dev)
        if rank == 1:
            bufs[1].destroy()
        start = time.monotonic()
        try:
            gs.average(bufs, device=dev)
            result = "no error"
        except gradsync.GradSyncError as exc:
            result = f"{type(exc).__name__}: {exc}"
        result += f" ({time.monotonic() - start:.0f} s)"
        if rank == 0:
            mark_done(sync_dir, 0)
        else:
            linger(sync_dir, [0], 3)  # alive: its peer must learn of the failure from its note
    with open(out, "w") as f:
        f.write(result)
    """
)


@pytest.mark.wgpu
@pytest.mark.slow
def test_a_bad_buffer_after_the_first_call_fails_the_peers_fast(tmp_path: Path) -> None:
    # Rank 1's buffers are checked before its step begins: the failure must still reach
    # rank 0, which would otherwise wait max_wait_s for a rank that stays alive.
    if (reason := _core_api_missing() or _adapter_reason()) is not None:
        pytest.skip(reason)
    outs = _run_rank_scripts(tmp_path, _BAD_BUFFER_WORKER, 2, [])
    assert outs[1].read_text() == (
        "InvalidGradsError: step 1: param 1 (label 'w1'): buffer has been destroyed (0 s)"
    )
    assert re.fullmatch(
        r"PeerAbortedError: step 1: rank 1 \(pid \d+ on \S+\) gave up on this step: "
        r"param 1 \(label 'w1'\): buffer has been destroyed \(\d s\)",
        outs[0].read_text(),
    ), outs[0].read_text()
    assert int(outs[0].read_text().split("(")[-1].split()[0]) < 10


@pytest.mark.wgpu
def test_example_trains_single_rank(tmp_path: Path) -> None:
    if (reason := _core_api_missing() or _adapter_reason()) is not None:
        pytest.skip(reason)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADSYNC_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])
    # One rank needs no sync directory: the example made one per run and left it.
    env["TMPDIR"] = str(tmp_path)
    out = subprocess.run(
        [sys.executable, str(REPO / "examples" / "train_wgpu_logreg.py"), "--steps", "3"],
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
        check=True,
    ).stdout
    losses = [float(line.split()[-1]) for line in out.splitlines() if " loss " in line]
    assert len(losses) == 3
    assert losses[2] < losses[0]
    assert list(tmp_path.iterdir()) == []
