"""Two ranks averaging numpy arrays in a loop, one gradsync source tree against another,
in interleaved rounds; prints each round's median step of the slower rank.

Usage: ``oldnew_h200.py OLD_SRC NEW_SRC SIZES_ELEMS ROUNDS STEPS`` (sizes in float32
elements, comma-separated); every size runs with plain arrays and ``buffers_like`` ones.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile

RANK = r"""
import json, sys, time
import numpy as np
import gradsync
r, d, n, steps = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
buf = sys.argv[5] == "1"
gs = gradsync.GradSync(gradsync.FileGradSyncConfig(2, r, d))
g = [np.empty(n, np.float32)]
if buf:
    g = gs.buffers_like(g)
t = []
for i in range(steps + 50):
    g[0][:] = r + i
    t0 = time.perf_counter()
    gs.average(g)
    t.append(time.perf_counter() - t0)
gs.close()
print(json.dumps(t[50:]))
"""


def run(src: str, n: int, steps: int, buf: str) -> float:
    d = tempfile.mkdtemp(dir="/dev/shm")
    env = dict(os.environ, PYTHONPATH=src)
    cmd = [sys.executable, "-c", RANK]
    args = [[*cmd, str(r), d, str(n), str(steps), buf] for r in range(2)]
    procs = [subprocess.Popen(a, env=env, stdout=subprocess.PIPE) for a in args]
    times = [json.loads(p.communicate()[0]) for p in procs]
    return statistics.median(max(a, b) for a, b in zip(*times, strict=True)) * 1e6


def main() -> None:
    old, new, sizes = sys.argv[1], sys.argv[2], sys.argv[3]
    rounds, steps = int(sys.argv[4]), int(sys.argv[5])
    for n in map(int, sizes.split(",")):
        for buf in ("0", "1"):
            res: dict[str, list[float]] = {"old": [], "new": []}
            for _ in range(rounds):
                for key, src in (("old", old), ("new", new)):
                    res[key].append(run(src, n, steps, buf))
            print(
                f"{n * 4} B {'buf' if buf == '1' else 'copy'}: old "
                + " ".join(f"{x:.0f}" for x in res["old"])
                + " | new "
                + " ".join(f"{x:.0f}" for x in res["new"])
                + " us",
                flush=True,
            )


if __name__ == "__main__":
    main()
