"""``benchmarks/wgpu_step.py`` with polled waits off (GS_NO_SPIN=1: SPIN_S = 0, as
before), for a same-host A/B of the polled GPU waits."""

from __future__ import annotations

import os
import sys
from typing import Any

sys.path.insert(0, "benchmarks")
import wgpu_step

_original_rank = wgpu_step._rank


def _rank(*args: Any) -> None:
    if os.environ.get("GS_NO_SPIN"):
        import gradsync._wgpu as w  # noqa: PLC0415

        w.SPIN_S = 0.0
    _original_rank(*args)


wgpu_step._rank = _rank

if __name__ == "__main__":
    wgpu_step.main()
