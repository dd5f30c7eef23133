"""Time a W=2 gradsync loop on the host CPU alone, phase by phase and function by function.

Usage: ``python loop3.py RANK WORLD NBYTES STEPS buf|copy SYNC_DIR`` in WORLD processes.
Wraps the step engine's methods with timers (a few us of overhead each), runs 300
warm-up steps, then STEPS timed ones, and prints the mean time per step of every
phase (StepStats) and of every wrapped function.
"""

from __future__ import annotations

import collections
import functools
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import gradsync._peers as peers_mod
import gradsync._protocol as protocol
import gradsync._reduce as reduce_mod
import gradsync._transport as transport
from gradsync import FileGradSyncConfig, GradSync

spent: collections.Counter[str] = collections.Counter()
calls: collections.Counter[str] = collections.Counter()


def timed(owner: Any, name: str) -> None:
    inner: Callable[..., Any] = getattr(owner, name)
    label = f"{getattr(owner, '__name__', owner)}.{name}"

    @functools.wraps(inner)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[label] += time.perf_counter() - start
            calls[label] += 1

    setattr(owner, name, wrapper)


ENGINE = ["_reduce_and_publish", "_reduce", "_header", "_write", "_publish", "_gather"]
ENGINE += ["_plan_for", "_link_input", "_publishes_in_place", "_pieces"]
for method in ENGINE:
    timed(protocol.StepEngine, method)
for function in ["check_inputs", "validate_grads", "_prune_step_dir", "mean_into", "place_marker"]:
    timed(protocol, function)
timed(reduce_mod, "_float32_chunk")
for method in ["wait_for", "_open_published", "_look_up"]:
    timed(peers_mod.PeerFiles, method)
timed(transport.Transport, "open")

rank, world, nbytes, steps = (int(a) for a in sys.argv[1:5])
mode, sync_dir = sys.argv[5], Path(sys.argv[6])
PHASES = ("publish_s", "wait_inputs_s", "reduce_s", "wait_outputs_s", "gather_s", "total_s")
cfg = FileGradSyncConfig(world_size=world, rank=rank, sync_dir=sync_dir, max_wait_s=60)
with GradSync(cfg) as gs:
    grads = [np.full(nbytes // 4, rank, np.float32)]
    if mode == "buf":
        grads = gs.buffers_like(grads)
    for _ in range(300):
        gs.average(grads)
    spent.clear()
    calls.clear()
    phases: collections.Counter[str] = collections.Counter()
    t0 = time.perf_counter()
    for _ in range(steps):
        grads[0][:8] = rank
        stats = gs.average(grads)
        for phase in PHASES:
            phases[phase] += getattr(stats, phase)
    wall_us = (time.perf_counter() - t0) / steps * 1e6
    means = {p[:-2]: round(v / steps * 1e6, 1) for p, v in phases.items()}
    print(f"rank {rank} {mode} {nbytes >> 10} KiB: wall/step {wall_us:.1f} us", means)
    for label, seconds in spent.most_common():
        per_step, count = seconds / steps * 1e6, calls[label] / steps
        print(f"   {rank} {label:45s} {per_step:8.1f} us/step  calls/step {count:.2f}")
