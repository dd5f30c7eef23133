"""``benchmarks/wgpu_step.py`` with the bridge's maps made by ``map_sync`` (GS_MAP_SYNC=1),
for a same-host A/B against ``_map_now`` (wait on this thread, no empty submit)."""

from __future__ import annotations

import os
import sys
from typing import Any

sys.path.insert(0, "benchmarks")
import wgpu_step

_original_rank = wgpu_step._rank


def _rank(*args: Any) -> None:
    if os.environ.get("GS_MAP_SYNC"):
        import gradsync._wgpu as w  # noqa: PLC0415

        w._nosync_reads = False  # map_sync: an empty submit before every read map
    _original_rank(*args)


wgpu_step._rank = _rank

if __name__ == "__main__":
    wgpu_step.main()
