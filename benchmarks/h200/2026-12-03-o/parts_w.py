"""Where a 2-rank wgpu step of one 1 MiB buffer goes, function by function: each
listed gradsync function wrapped in a timer (median us a call, calls a step), and the
step's own phase medians (``StepStats``). BACKEND (default Vulkan) picks the backend."""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/
from spawned import run_spawned

SYNC_DIR = "/dev/shm/partsw"
STEPS = 400


def _timed(acc: dict[str, list[float]], key: str, f: Callable[..., Any]) -> Callable[..., Any]:
    def timed(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            acc.setdefault(key, []).append(time.perf_counter() - t)

    return timed


def rank_main(rank: int, backend: str, q: Any) -> None:
    import wgpu  # noqa: PLC0415

    import gradsync  # noqa: PLC0415
    from gradsync import _api, _protocol, _wgpu  # noqa: PLC0415

    acc: dict[str, list[float]] = {}
    wrapped = {
        _protocol.StepEngine: (
            "_publish _header _write _link_input _plan_for _reduce _await _open _pieces "
            "_reduce_and_publish"
        ),
        # place_marker since the next session (markers moved, not created); before:
        # create_marker. Whichever this gradsync has is timed.
        _protocol: "_prune_step_dir place_marker create_marker validate_grads list_names",
        _wgpu.WgpuBridge: "_check_buffers _upload_pieces download _download _get_layout",
        _wgpu: "_map_for_reading",
        _api.GradSync: "_device_arrays",
    }
    for owner, names in wrapped.items():
        for name in names.split():
            if hasattr(owner, name):
                setattr(owner, name, _timed(acc, name, getattr(owner, name)))
    os.mkdir = _timed(acc, "os.mkdir", os.mkdir)  # type: ignore[assignment]
    dev = gradsync.request_device_for_rank(local_rank=rank, backend=backend)
    usage = wgpu.BufferUsage
    buf = dev.create_buffer(size=1 << 20, usage=usage.STORAGE | usage.COPY_SRC | usage.COPY_DST)
    cfg = gradsync.FileGradSyncConfig(2, rank, Path(SYNC_DIR), max_wait_s=60)
    with gradsync.GradSync(cfg) as gs:
        for s in range(50):
            gs.average([buf], step=s, device=dev)
        acc.clear()
        t0 = time.perf_counter()
        stats = [gs.average([buf], step=s, device=dev) for s in range(50, 50 + STEPS)]
        total = (time.perf_counter() - t0) / STEPS
    out: dict[str, Any] = {
        k: (round(statistics.median(v) * 1e6, 1), round(len(v) / STEPS, 2)) for k, v in acc.items()
    }
    for phase in ("publish_s", "wait_inputs_s", "reduce_s", "wait_outputs_s", "gather_s"):
        out[phase] = round(statistics.median(getattr(s, phase) for s in stats) * 1e6, 1)
    out["step (mean)"] = round(total * 1e6, 1)
    q.put((rank, out))


def main() -> None:
    shutil.rmtree(SYNC_DIR, ignore_errors=True)
    backend = os.environ.get("BACKEND", "Vulkan")
    res = run_spawned(rank_main, [(r, backend) for r in range(2)])
    for key in sorted(set(res[0][1]) | set(res[1][1])):
        print(f"{key:24s} " + "   ".join(f"rank {r}: {o.get(key)}" for r, o in res))


if __name__ == "__main__":
    main()
