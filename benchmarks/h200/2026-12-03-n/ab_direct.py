"""``benchmarks/wgpu_step.py`` with every step's mean uploaded through the mapped
staging buffer (GS_ALL_MAPPED=1: DIRECT_MAX_BYTES = 0), for a same-host A/B against
one queue.write_buffer per piece."""

from __future__ import annotations

import os
import sys
from typing import Any

sys.path.insert(0, "benchmarks")
import wgpu_step

_original_rank = wgpu_step._rank


def _rank(*args: Any) -> None:
    if os.environ.get("GS_ALL_MAPPED"):
        import gradsync._wgpu as w  # noqa: PLC0415

        w.DIRECT_MAX_BYTES = 0
    _original_rank(*args)


wgpu_step._rank = _rank

if __name__ == "__main__":
    wgpu_step.main()
