"""What a numpy add costs when another core wrote its input or read its output last.

Usage: ``python xcore.py NBYTES``. A forked child on another CPU writes a shared
mapping's "peer" half, or reads its "out" half, between the parent's timed adds; the
parent's medians over 300 rounds show what moving those cache lines between cores
costs against data only the parent touched.
"""

from __future__ import annotations

import mmap
import os
import sys
import time

import numpy as np

n = int(sys.argv[1]) // 4
fd = os.open("/dev/shm/xc", os.O_RDWR | os.O_CREAT, 0o644)
os.ftruncate(fd, n * 4 * 2)
shared = np.frombuffer(mmap.mmap(fd, n * 4 * 2), np.float32)
out, peer_part = shared[:n], shared[n:]
x = np.ones(n, np.float32)
private = np.zeros(n, np.float32)
sink = np.zeros(n, np.float32)
to_child_r, to_child_w = os.pipe()
to_parent_r, to_parent_w = os.pipe()
cpus = sorted(os.sched_getaffinity(0))
mine, theirs = (cpus[1], cpus[3]) if len(cpus) >= 4 else (cpus[0], cpus[-1])
pid = os.fork()
if pid == 0:
    os.sched_setaffinity(0, {theirs})
    while (order := os.read(to_child_r, 1)) != b"q":
        if order == b"r":
            np.copyto(sink, out)  # the peer reads this rank's output (its gather)
        else:
            peer_part[:] = 1.5  # the peer writes its input
        os.write(to_parent_w, b"x")
    os._exit(0)
os.sched_setaffinity(0, {mine})
times: dict[str, list[float]] = {
    "add local": [],
    "add peer-written src": [],
    "write out peer had read": [],
    "write out nobody read": [],
}


def timed(label: str, a: np.ndarray, b: np.ndarray, dst: np.ndarray) -> None:
    start = time.perf_counter()
    np.add(a, b, out=dst)
    times[label].append(time.perf_counter() - start)


def ask(order: bytes) -> None:
    os.write(to_child_w, order)
    os.read(to_parent_r, 1)


for _ in range(300):
    timed("add local", x, private, private)
    ask(b"w")
    timed("add peer-written src", x, peer_part, private)
    ask(b"r")
    timed("write out peer had read", x, x, out)
    timed("write out nobody read", x, x, out)
os.write(to_child_w, b"q")
os.waitpid(pid, 0)
print(f"{n * 4 >> 10} KiB", {k: round(float(np.median(v)) * 1e6, 1) for k, v in times.items()})
