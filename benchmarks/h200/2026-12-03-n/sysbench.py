"""Per-call cost of the file operations a step makes on /dev/shm, and of Python and
memory for scale (median us)."""

from __future__ import annotations

import os
import shutil
import statistics
import time
from collections.abc import Callable

import numpy as np

D = "/dev/shm/sysbench"


def bench(name: str, f: Callable[[int], object], n: int = 2000) -> None:
    ts = []
    for i in range(n):
        t = time.perf_counter()
        f(i)
        ts.append(time.perf_counter() - t)
    print(f"{name:28s} {statistics.median(ts) * 1e6:7.2f} us")


def main() -> None:
    shutil.rmtree(D, ignore_errors=True)
    os.mkdir(D)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    bench("mkdir+rmdir", lambda i: (os.mkdir(f"{D}/x"), os.rmdir(f"{D}/x")))
    bench("create marker (O_EXCL)+close", lambda i: os.close(os.open(f"{D}/m{i}", flags, 0o644)))
    bench("unlink", lambda i: os.unlink(f"{D}/m{i}"))
    for i in range(8):
        open(f"{D}/f{i}", "w").close()
    bench("listdir (8 names)", lambda i: os.listdir(D))
    bench("stat", lambda i: os.stat(f"{D}/f0"))
    bench("getpid", lambda i: os.getpid())
    bench("python loop 1000", lambda i: sum(range(1000)))
    a = np.zeros(1 << 18, np.float32)
    b = np.ones(1 << 18, np.float32)
    bench("np.add 1 MiB f32", lambda i: np.add(a, b, out=a), 500)
    bench("np.copyto 1 MiB", lambda i: np.copyto(a, b), 500)
    shutil.rmtree(D, ignore_errors=True)


if __name__ == "__main__":
    main()
