"""Per-call cost of the file operations a step makes, on /dev/shm (median us)."""
import os, statistics, time, shutil
d = "/dev/shm/sysbench"; shutil.rmtree(d, ignore_errors=True); os.mkdir(d)
def bench(name, f, n=2000):
    ts = []
    for i in range(n):
        t = time.perf_counter(); f(i); ts.append(time.perf_counter() - t)
    print(f"{name:28s} {statistics.median(ts)*1e6:7.2f} us")
bench("mkdir+rmdir", lambda i: (os.mkdir(f"{d}/x"), os.rmdir(f"{d}/x")))
bench("create marker (O_EXCL)+close", lambda i: os.close(os.open(f"{d}/m{i}", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)))
bench("unlink", lambda i: os.unlink(f"{d}/m{i}"))
for i in range(8): open(f"{d}/f{i}", "w").close()
bench("listdir (8 names)", lambda i: os.listdir(d))
bench("stat", lambda i: os.stat(f"{d}/f0"))
bench("getpid", lambda i: os.getpid())
bench("python loop 1000", lambda i: sum(range(1000)))
import numpy as np
a = np.zeros(1 << 18, np.float32); b = np.ones(1 << 18, np.float32)
bench("np.add 1 MiB f32", lambda i: np.add(a, b, out=a), 500)
bench("np.copyto 1 MiB", lambda i: np.copyto(a, b), 500)
