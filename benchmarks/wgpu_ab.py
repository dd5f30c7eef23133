"""``wgpu_step.py`` with module constants of gradsync patched in every rank, for
same-host A/B runs of one change (every lent GPU machine is another host).

``GS_PATCH="gradsync._gpu.bridge.SPIN_S=0.0,gradsync._gpu.bridge.DIRECT_MAX_BYTES=0"`` sets each
``module.NAME`` to the Python literal after ``=`` before the rank starts; unset or
empty, this is ``wgpu_step.py`` itself. Run it like ``wgpu_step.py``, alternating
patched and plain invocations:
``GS_PATCH=gradsync._gpu.bridge.SPIN_S=0.0 python benchmarks/wgpu_ab.py --world-sizes 2 4
--sizes-mib 1 16 --steps 30 --profile``.
"""

from __future__ import annotations

import ast
import importlib
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
import wgpu_step

_plain_rank = wgpu_step._rank


def _apply_patches(spec: str) -> None:
    for item in filter(None, (part.strip() for part in spec.split(","))):
        target, _, literal = item.partition("=")
        module_name, _, attr = target.rpartition(".")
        module = importlib.import_module(module_name)
        if not hasattr(module, attr):
            raise SystemExit(f"GS_PATCH: {module_name} has no {attr}")
        setattr(module, attr, ast.literal_eval(literal))


def _rank(*args: Any) -> None:
    _apply_patches(os.environ.get("GS_PATCH", ""))
    _plain_rank(*args)


wgpu_step._rank = _rank

if __name__ == "__main__":
    _apply_patches(os.environ.get("GS_PATCH", ""))  # a bad patch fails here, not in ranks
    wgpu_step.main()
