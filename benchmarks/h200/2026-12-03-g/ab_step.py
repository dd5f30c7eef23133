"""``benchmarks/wgpu_step.py`` with the gathered upload staged on the host first.

With ``GS_HOST_STAGED=1`` every rank takes the path gradsync falls back to where wgpu-py
gives no writable view of a mapping, for a same-host A/B against the default. Run from
the repository root: ``GS_HOST_STAGED=1 python benchmarks/h200/2026-12-03-g/ab_step.py
--world-sizes 2 --sizes-mib 64``.
"""

from __future__ import annotations

import os
import sys
from typing import Any

sys.path.insert(0, "benchmarks")
import wgpu_step

_original_rank = wgpu_step._rank


def _rank(*args: Any) -> None:
    if os.environ.get("GS_HOST_STAGED"):
        import gradsync._wgpu  # noqa: PLC0415 - in the spawned rank, before it averages

        gradsync._wgpu._writable_mapping = lambda buf, nbytes: None  # type: ignore[assignment]
    _original_rank(*args)


wgpu_step._rank = _rank  # the rank processes are spawned with this function

if __name__ == "__main__":
    wgpu_step.main()
