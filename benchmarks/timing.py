"""The one timer the micro-benchmarks share."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_ms(run: Callable[[], object], repeats: int) -> float:
    """The median wall time of ``repeats`` calls of ``run``, in milliseconds."""
    took = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        took.append(time.perf_counter() - start)
    return statistics.median(took) * 1e3
