"""``benchmarks/wgpu_step.py`` with the first liveness check of a wait made at once
(GS_OLD_LIVENESS=1, as before 15:40), for a same-host A/B against the 10 ms grace."""

from __future__ import annotations

import os
import sys
from typing import Any

sys.path.insert(0, "benchmarks")
import wgpu_step

_original_rank = wgpu_step._rank


def _rank(*args: Any) -> None:
    if os.environ.get("GS_OLD_LIVENESS"):
        import gradsync._protocol as p  # noqa: PLC0415

        p._FIRST_LIVENESS_CHECK_S = 0.0
    _original_rank(*args)


wgpu_step._rank = _rank

if __name__ == "__main__":
    wgpu_step.main()
