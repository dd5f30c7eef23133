"""Does a peer polling a directory slow the file operations of a rank publishing in it?
A second process lists the directory (or stats a missing name in it) in a loop while
this one creates markers and makes directories there (median us)."""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import statistics
import time
from typing import Any

D = "/dev/shm/contend"


def spinner(mode: str, stop: Any) -> None:
    while not stop.is_set():
        if mode == "listdir":
            os.listdir(D)
        else:
            try:  # noqa: SIM105 (as measured: suppress() is a slower loop)
                os.stat(D + "/in-1")
            except FileNotFoundError:
                pass


def bench(label: str) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    creates, mkdirs = [], []
    for i in range(3000):
        t = time.perf_counter()
        os.close(os.open(f"{D}/m{i}", flags, 0o644))
        creates.append(time.perf_counter() - t)
    for i in range(3000):
        os.unlink(f"{D}/m{i}")
    for i in range(2000):
        t = time.perf_counter()
        os.mkdir(f"{D}/s{i}")
        mkdirs.append(time.perf_counter() - t)
    for i in range(2000):
        os.rmdir(f"{D}/s{i}")
    print(
        f"{label:10s} create marker {statistics.median(creates) * 1e6:6.2f} us   "
        f"mkdir {statistics.median(mkdirs) * 1e6:6.2f} us"
    )


def main() -> None:
    shutil.rmtree(D, ignore_errors=True)
    os.mkdir(D)
    ctx = mp.get_context("spawn")
    for mode in ("none", "listdir", "stat", "none", "listdir", "stat"):
        stop = ctx.Event()
        proc = None if mode == "none" else ctx.Process(target=spinner, args=(mode, stop))
        if proc is not None:
            proc.start()
            time.sleep(0.2)
        try:
            bench(mode)
        finally:
            stop.set()
            if proc is not None:
                proc.join(5)
    shutil.rmtree(D, ignore_errors=True)


if __name__ == "__main__":
    main()
