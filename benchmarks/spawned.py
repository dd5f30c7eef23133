"""Run one spawned process per argument tuple and collect what each reports.

For the small probe scripts kept with benchmark runs (``benchmarks/h200/*/``): each
process gets its arguments and then a queue, puts one result on it, and exits.
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable, Sequence
from typing import Any


def run_spawned(
    target: Callable[..., None], args: Sequence[tuple[Any, ...]], *, timeout_s: float = 300.0
) -> list[Any]:
    """The results of ``target(*a, queue)`` for each ``a`` in ``args``, sorted.

    Waits up to ``timeout_s`` seconds for each result (``queue.Empty`` after that);
    every process is joined, and killed if it is still alive 30 s after the results.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*a, queue)) for a in args]
    for p in procs:
        p.start()
    try:
        return sorted(queue.get(timeout=timeout_s) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join(5)
