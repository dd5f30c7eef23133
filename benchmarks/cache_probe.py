"""Does a shared filesystem show a reader a file's previous contents after close-to-open?

One writer rewrites a 2 MiB file in place every round, closes it and announces the
round with a new directory; READERS readers on another host wait for it, open the
file at the same moment and check the round number written at its start and at its
end. ``--drop`` makes each reader drop its host's cached pages of the file first, as
gradsync's readers do on a shared filesystem (``gradsync._step.transport.Transport.open``).

With the simulated cluster of ``tests/multihost`` (JuiceFS 1.4.2, 2026-12-04)::

    D=/mnt/shared/probe; tests/multihost/rig/on.sh h1 mkdir -p $D
    tests/multihost/rig/on.sh h2 env READERS=4 python3 benchmarks/cache_probe.py w $D 2000 &
    for k in 0 1 2 3; do
      tests/multihost/rig/on.sh h1 python3 benchmarks/cache_probe.py r$k $D 2000 [--drop] &
    done; wait

Figures: benchmarks/RESULTS.md ("Figures behind code choices").
"""

from __future__ import annotations

import os
import struct
import sys
import time

SIZE = 2 << 20


def _wait(path: str, timeout_s: float = 30.0) -> None:
    parent, name = os.path.split(path)
    deadline = time.monotonic() + timeout_s
    while name not in os.listdir(parent):
        if time.monotonic() > deadline:
            raise SystemExit(f"no {path} within {timeout_s} s")
        time.sleep(0.0005)


def main() -> None:
    role, directory, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
    drop = "--drop" in sys.argv[4:]
    path = os.path.join(directory, "F")
    if role == "w":
        readers = int(os.environ.get("READERS", "2"))
        body = bytearray(SIZE)
        for i in range(rounds):
            struct.pack_into("<q", body, 0, i)
            struct.pack_into("<q", body, SIZE - 8, i)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
            os.pwrite(fd, body, 0)
            os.close(fd)
            os.mkdir(os.path.join(directory, f"m{i}"))
            for k in range(readers):
                _wait(os.path.join(directory, f"a{i}r{k}"))
        print(f"writer: {rounds} rounds")
        return
    stale = 0
    for i in range(rounds):
        _wait(os.path.join(directory, f"m{i}"))
        fd = os.open(path, os.O_RDONLY)
        if drop:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        (head,) = struct.unpack_from("<q", os.pread(fd, 4096, 0))
        (tail,) = struct.unpack_from("<q", os.pread(fd, 8, SIZE - 8))
        os.close(fd)
        if (head, tail) != (i, i):
            stale += 1
            print(f"{role}: round {i}: start shows round {head}, end round {tail}", flush=True)
        os.mkdir(os.path.join(directory, f"a{i}{role}"))
    print(f"{role}: {stale} stale of {rounds} ({'pages dropped' if drop else 'plain'})")


if __name__ == "__main__":
    main()
