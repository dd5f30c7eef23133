"""Choosing a rank's GPU: on a host with several, each local rank takes its own.

Adapters are ranked (one backend, real GPUs before software ones, the preferred
adapter type first, then by vendor and device id, so every rank of a host sorts them
alike) and local rank r takes the (r mod n)-th.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from gradsync._errors import ConfigError, WgpuBridgeError

from .wait import import_wgpu, wgpu_errors

if TYPE_CHECKING:
    import wgpu

__all__ = ["choose_adapter_index", "request_device_for_rank", "select_adapter"]

_log = logging.getLogger("gradsync")

_BACKEND_ORDER = ("Vulkan", "Metal", "D3D12", "OpenGL")
_TYPE_ORDER = {
    "high-performance": ("DiscreteGPU", "IntegratedGPU", "VirtualGPU", "Unknown", "CPU"),
    "low-power": ("IntegratedGPU", "DiscreteGPU", "VirtualGPU", "Unknown", "CPU"),
}


def choose_adapter_index(
    infos: Sequence[Mapping[str, Any]],
    *,
    local_rank: int,
    power_preference: str | None = "high-performance",
    backend: str | None = None,
) -> int:
    """Pick the adapter for ``local_rank`` from adapter-info dicts; return its index.

    ``infos`` are ``GPUAdapter.info`` mappings in enumeration order (keys used:
    ``backend_type``, ``adapter_type``, ``vendor_id``, ``device_id``, ``device``).
    With ``backend`` (case-insensitive, e.g. ``"Vulkan"``) only that backend is
    kept; without it, only the first of Vulkan, Metal, D3D12, OpenGL present, so a
    GPU seen through two backends counts once. CPU (software) adapters are dropped
    when any other adapter remains. ``power_preference`` (``"high-performance"``,
    ``"low-power"`` or ``None``) orders adapter types; the sort is stable, so equal
    GPUs keep the driver's order. The result is ``candidates[local_rank % n]``.

    Raises:
        ConfigError: ``local_rank`` is negative, or an option is unknown.
        WgpuBridgeError: no adapter matches.
    """
    if local_rank < 0:
        raise ConfigError(f"local_rank must be >= 0, got {local_rank!r}")
    if power_preference is not None and power_preference not in _TYPE_ORDER:
        raise ConfigError(
            "power_preference must be 'high-performance', 'low-power' or None, got "
            f"{power_preference!r}"
        )
    idx = list(range(len(infos)))
    if not idx:
        raise WgpuBridgeError("no wgpu adapter found (no GPU driver and no software one)")
    present = [str(infos[i].get("backend_type", "")) for i in idx]
    if backend is not None:
        want = backend.lower()
        idx = [i for i in idx if present[i].lower() == want]
        if not idx:
            raise WgpuBridgeError(
                f"no wgpu adapter with backend {backend!r}; available backends: "
                f"{sorted(set(present))}"
            )
    else:
        ranked = sorted(
            set(present),
            key=lambda b: _BACKEND_ORDER.index(b) if b in _BACKEND_ORDER else len(_BACKEND_ORDER),
        )
        idx = [i for i in idx if present[i] == ranked[0]]
    real = [i for i in idx if infos[i].get("adapter_type") != "CPU"]
    if real:
        idx = real
    order = _TYPE_ORDER[power_preference or "high-performance"]

    def key(i: int) -> tuple[int, int, int, str, int]:
        info = infos[i]
        typ = str(info.get("adapter_type", "Unknown"))
        type_rank = order.index(typ) if power_preference and typ in order else 0
        vendor = int(info.get("vendor_id", 0) or 0)
        dev = int(info.get("device_id", 0) or 0)
        return (type_rank, vendor, dev, str(info.get("device", "")), i)

    idx.sort(key=key)
    return idx[local_rank % len(idx)]


def _local_rank_from_env() -> int:
    raw = os.environ.get("LOCAL_RANK", "").strip()
    if not raw:
        return 0
    try:
        rank = int(raw)
    except ValueError:
        raise ConfigError(f"LOCAL_RANK must be an integer, got {raw!r}") from None
    if rank < 0:  # named here: the caller passed no local_rank of its own
        raise ConfigError(f"LOCAL_RANK must be >= 0, got {raw!r}")
    return rank


def select_adapter(
    *,
    local_rank: int | None = None,
    power_preference: str | None = "high-performance",
    backend: str | None = None,
) -> wgpu.GPUAdapter:
    """Return this rank's wgpu adapter (see :func:`choose_adapter_index` for the rule).

    ``local_rank`` defaults to the ``LOCAL_RANK`` environment variable, then 0.
    Logs the chosen adapter's info at INFO on the ``gradsync`` logger.

    Raises:
        ConfigError: ``LOCAL_RANK`` is not an integer, or an option is invalid.
        WgpuBridgeError: no adapter matches.
    """
    wgpu = import_wgpu()

    if local_rank is None:
        rank = _local_rank_from_env()
    elif isinstance(local_rank, bool) or not isinstance(local_rank, int) or local_rank < 0:
        raise ConfigError(f"local_rank must be an int >= 0 or None, got {local_rank!r}")
    else:
        rank = local_rank
    adapters = wgpu.gpu.enumerate_adapters_sync()
    infos = [dict(a.info) for a in adapters]
    i = choose_adapter_index(
        infos, local_rank=rank, power_preference=power_preference, backend=backend
    )
    _log.info("local_rank %d uses wgpu adapter %d of %d: %s", rank, i, len(infos), infos[i])
    return adapters[i]


def request_device_for_rank(
    *,
    local_rank: int | None = None,
    power_preference: str | None = "high-performance",
    backend: str | None = None,
    required_limits: Mapping[str, int] | None = None,
    label: str = "gradsync",
) -> wgpu.GPUDevice:
    """Select this rank's adapter (:func:`select_adapter`) and request a device on it.

    ``max-buffer-size`` and ``max-storage-buffer-binding-size`` are raised to the
    adapter's maxima unless ``required_limits`` sets them.

    Raises:
        ConfigError, WgpuBridgeError: as :func:`select_adapter`; WgpuBridgeError also
            when the device request fails.
    """
    adapter = select_adapter(
        local_rank=local_rank, power_preference=power_preference, backend=backend
    )
    limits: dict[str, int] = {}
    for name in ("max-buffer-size", "max-storage-buffer-binding-size"):
        if name in adapter.limits:
            limits[name] = int(adapter.limits[name])
    # wgpu spells limits with hyphens, and also takes them with underscores.
    limits.update({k.replace("_", "-"): v for k, v in (required_limits or {}).items()})
    try:
        with wgpu_errors("requesting a wgpu device"):
            return adapter.request_device_sync(label=label, required_limits=limits)
    except KeyError as exc:  # wgpu-py's word for an unknown limit name
        raise ConfigError(
            f"required_limits: {exc.args[0]}; this adapter's limits are {sorted(adapter.limits)}"
        ) from exc
