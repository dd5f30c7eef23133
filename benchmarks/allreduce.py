"""Gradient allreduce on one machine: gradsync vs torch.distributed gloo vs MPI vs memcpy.

Every peer averages the same float32 gradients, with the same per-rank inputs, in the
same invocation:

- ``gradsync``  ``GradSync(cfg).average(grads)`` (strategy "sharded"; add "root" with
                ``--strategies sharded,root``), sync dir on tmpfs and/or disk. With
                ``--buffers``, also ``gradsync-buf``: the gradients are arrays from
                ``GradSync.buffers_like`` (allocated once, before the baseline, like
                the other peers' gradients), published without a copy. With
                ``--wide-sum``, also rows ``*-f64``: ``wide_sum=True`` (float32
                summed in float64; the default sums in float32 in rank order, as
                gloo and MPI do).
- ``gloo``      ``torch.distributed.all_reduce`` (SUM, then ``div_(W)``) of one flat
                float32 buffer (multi-tensor workloads are copied into and out of it,
                as DDP's buckets are). torch is imported only inside this peer.
- ``mpi``       mpi4py ``Allreduce(IN_PLACE, SUM)`` + divide, launched with ``mpirun``;
                skipped with a note when Open MPI or mpi4py is missing.
- ``memcpy``    one process, ``np.copyto`` of the same bytes: the physical reference.
- ``naive``     the "reference design": one file per param, 25 ms polls, rank 0 reads
                every file and writes the mean.

Each worker warms up, meets the others at a barrier, then runs the timed steps. Before
every step the inputs are rewritten with rank- and step-dependent values (so a stale
result fails the check); only the averaging call is timed. A row's step time is the
*slowest rank's* time per step (max over ranks), summarised by median and p90 over steps.
Peak RSS (``VmHWM``, reset per workload through ``/proc/self/clear_refs``) is reported
minus the RSS once the gradients are allocated and written ("extra RSS": what the peer
needs beyond the gradients it is handed); PSS likewise, after the timed steps. gradsync
opens a new session for every workload, so no earlier workload's mappings are counted
in the baseline.

This machine's speed drifts by tens of percent within a minute, and peers run one after
another: ``--rounds N`` runs every peer N times per W, interleaved, and reports per row
the median over rounds and, as ratios, the median of the same-round ratios.

Run: ``python benchmarks/allreduce.py [--quick] [--rounds 3] [--world-sizes 2,3,4]
[--dirs tmpfs,disk] [--workloads 4KiB,1MiB,16MiB,64MiB,100x16MiB] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import hashlib
import importlib.metadata
import json
import multiprocessing as mp
import os
import platform
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from gradsync import FileGradSyncConfig, GradSync

KIB = 1024
MIB = 1024 * KIB
F32 = np.dtype(np.float32)
CHECK_SAMPLES = 4096  # elements checked after every step (all of them after the last)
FULL_CHECK_CHUNK = 1 << 20
RTOL_GRADSYNC = 2e-6
NAIVE_POLL_S = 0.025
WORKER_TIMEOUT_S = 900.0
ALL_WORKLOADS = ("4KiB", "1MiB", "16MiB", "64MiB", "100x16MiB")
ALL_PEERS = ("gradsync", "gloo", "mpi", "memcpy", "naive")


# -- workloads and inputs ----------------------------------------------------------------


def workload_sizes(name: str) -> list[int]:
    """Element counts (float32) of the tensors of workload ``name``."""
    if name == "100x16MiB":
        return mixed_sizes(100, 16 * MIB // 4)
    units = {"KiB": KIB, "MiB": MIB}
    for suffix, unit in units.items():
        if name.endswith(suffix) and name[: -len(suffix)].isdigit():
            return [int(name[: -len(suffix)]) * unit // 4]
    raise SystemExit(f"unknown workload {name!r}; known: {', '.join(ALL_WORKLOADS)}")


def mixed_sizes(count: int, total: int) -> list[int]:
    """``count`` deterministic tensor sizes from 1 element up, summing to ``total``."""
    weights = np.random.default_rng(20240601).lognormal(mean=0.0, sigma=2.0, size=count)
    sizes = np.maximum(1, np.floor(weights / weights.sum() * total)).astype(np.int64)
    sizes[int(np.argmax(sizes))] += total - int(sizes.sum())
    return [int(s) for s in sizes]


def base_values(idx: np.ndarray) -> np.ndarray:
    """The shared float32 base value of every flat element index in ``idx`` (in [1, 2))."""
    return (1.0 + (idx.astype(np.int64) * 40503 % 65521) / 65521.0).astype(np.float32)


def rank_scale(rank: int) -> np.float32:
    return np.float32(1.0 + 0.25 * rank)  # type: ignore[no-any-return]


def step_offset(rank: int, step: int) -> np.float32:
    return np.float32(0.5 * rank + 0.01 * (step + 1))  # type: ignore[no-any-return]


def rank_inputs(base: np.ndarray, rank: int, step: int) -> np.ndarray:
    """Rank ``rank``'s float32 input at ``step`` for elements with base values ``base``.

    Exactly the float32 operations a worker uses to fill its gradients, so any rank can
    reproduce any other rank's inputs bit for bit.
    """
    return base * rank_scale(rank) + step_offset(rank, step)


def expected_mean(base: np.ndarray, world: int, step: int) -> np.ndarray:
    """The float64 mean over ranks of the float32 inputs, computed independently."""
    acc = np.zeros(base.shape, dtype=np.float64)
    for q in range(world):
        acc += rank_inputs(base, q, step)
    return acc / world


def max_rel_err(got: np.ndarray, want: np.ndarray) -> float:
    if got.size == 0:
        return 0.0
    return float(np.max(np.abs(got.astype(np.float64) - want) / np.abs(want)))


# -- RSS -----------------------------------------------------------------------------------


def maxrss_bytes() -> int:
    """This process's peak RSS in bytes, resettable by :func:`reset_peak_rss`.

    Reads ``VmHWM`` (the address space's high-water mark). ``getrusage().ru_maxrss`` is
    max(VmHWM, signal->maxrss), and signal->maxrss is not resettable: exec copies the
    spawning parent's peak into it (multiprocessing spawns through vfork+exec) and every
    exiting thread raises it, so it hides per-workload peaks. It is the fallback only.
    """
    with contextlib.suppress(OSError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * KIB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * KIB


def malloc_trim() -> None:
    """Give free heap memory back to the OS, so reused heap pages count as new RSS.

    glibc raises its mmap threshold after large frees, so later arrays may come from
    already-resident heap pages; without a trim they would not show up as extra RSS.
    """
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def pss_bytes() -> int | None:
    """This process's proportional set size: shared pages divided among their mappers.

    RSS counts a page of a file that W ranks map W times; PSS counts 1/W in each, so
    summed over ranks it is the memory really used. None where the kernel lacks it.
    """
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * KIB
    except OSError:
        return None
    return None


def reset_peak_rss() -> bool:
    """Reset the peak RSS to the current RSS (Linux >= 4.0); False if unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


# -- peers (run inside the workers) ------------------------------------------------------


class Peer(Protocol):
    def prepare(self, grads: list[np.ndarray]) -> None: ...

    def step(self) -> dict[str, float] | None: ...

    def barrier(self) -> None: ...

    def release(self) -> None: ...

    def close(self) -> None: ...


class GradSyncPeer:
    def __init__(self, rank: int, world: int, spec: dict[str, Any], barrier: Any) -> None:
        cfg = FileGradSyncConfig(
            world_size=world,
            rank=rank,
            sync_dir=Path(spec["sync_dir"]),
            max_wait_s=300.0,
            strategy=spec["strategy"],
            threads=spec.get("threads"),
            wide_sum=spec.get("wide_sum", False),
        )
        self._cfg = cfg
        self.sync = GradSync(cfg)
        self._barrier = barrier
        self.grads: list[np.ndarray] = []
        # Averages arrays from GradSync.buffers_like (published without a copy).
        self.buffers = bool(spec.get("buffers"))

    def prepare(self, grads: list[np.ndarray]) -> None:
        self.grads = grads

    def step(self) -> dict[str, float]:
        s = self.sync.average(self.grads)
        return {
            "publish": s.publish_s,
            "wait_inputs": s.wait_inputs_s,
            "reduce": s.reduce_s,
            "wait_outputs": s.wait_outputs_s,
            "gather": s.gather_s,
            "total": s.total_s,
        }

    def barrier(self) -> None:
        self._barrier.wait(timeout=WORKER_TIMEOUT_S)

    def release(self) -> None:
        self.grads = []
        # A new session per workload: the last one's mappings, still resident in a kept
        # session, would be in the next workload's RSS baseline (and, when unmapped for
        # new sizes, make its extra RSS come out near zero or negative).
        self.sync.close()
        self.sync = GradSync(self._cfg)

    def close(self) -> None:
        self.sync.close()


class _FlatBuffer:
    """Copies a list of arrays into one flat float32 buffer and back (DDP-style bucket)."""

    def __init__(self, grads: list[np.ndarray]) -> None:
        self.grads = grads
        self.single = len(grads) == 1
        self.flat = grads[0] if self.single else np.empty(sum(g.size for g in grads), F32)
        self.slices: list[slice] = []
        off = 0
        for g in grads:
            self.slices.append(slice(off, off + g.size))
            off += g.size

    def pack(self) -> None:
        if not self.single:
            for g, sl in zip(self.grads, self.slices, strict=True):
                np.copyto(self.flat[sl], g)

    def unpack(self) -> None:
        if not self.single:
            for g, sl in zip(self.grads, self.slices, strict=True):
                np.copyto(g, self.flat[sl])


class GlooPeer:
    def __init__(self, rank: int, world: int, spec: dict[str, Any], barrier: Any) -> None:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(spec["port"])
        if Path("/sys/class/net/lo").exists():
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        import torch  # noqa: PLC0415  (a benchmark extra: only this peer loads it)
        import torch.distributed as dist  # noqa: PLC0415

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", rank=rank, world_size=world, timeout=timedelta(seconds=WORKER_TIMEOUT_S)
        )
        self.torch = torch
        self.dist = dist
        self.world = world
        self.bucket: _FlatBuffer | None = None
        self.tensor: Any = None

    def prepare(self, grads: list[np.ndarray]) -> None:
        self.bucket = _FlatBuffer(grads)
        self.tensor = self.torch.from_numpy(self.bucket.flat)

    def step(self) -> None:
        assert self.bucket is not None
        self.bucket.pack()
        self.dist.all_reduce(self.tensor, op=self.dist.ReduceOp.SUM)
        self.tensor.div_(self.world)
        self.bucket.unpack()

    def barrier(self) -> None:
        self.dist.barrier()

    def release(self) -> None:
        self.bucket = None
        self.tensor = None

    def close(self) -> None:
        self.dist.destroy_process_group()


class MpiPeer:
    def __init__(self, rank: int, world: int) -> None:
        from mpi4py import MPI  # noqa: PLC0415  (only this peer needs it)

        self.mpi = MPI
        self.comm = MPI.COMM_WORLD
        if self.comm.Get_rank() != rank or self.comm.Get_size() != world:
            raise RuntimeError(
                f"mpirun gave rank {self.comm.Get_rank()}/{self.comm.Get_size()}, "
                f"expected {rank}/{world}"
            )
        self.world = world
        self.bucket: _FlatBuffer | None = None

    def prepare(self, grads: list[np.ndarray]) -> None:
        self.bucket = _FlatBuffer(grads)

    def step(self) -> None:
        assert self.bucket is not None
        self.bucket.pack()
        self.comm.Allreduce(self.mpi.IN_PLACE, self.bucket.flat, op=self.mpi.SUM)
        np.divide(self.bucket.flat, np.float32(self.world), out=self.bucket.flat)
        self.bucket.unpack()

    def barrier(self) -> None:
        self.comm.Barrier()

    def release(self) -> None:
        self.bucket = None

    def close(self) -> None:
        pass


class NaivePeer:
    """The reference design: one file per param, 25 ms polls, rank 0 reduces everything."""

    def __init__(self, rank: int, world: int, spec: dict[str, Any], barrier: Any) -> None:
        self.rank = rank
        self.world = world
        self.root = Path(spec["sync_dir"])
        self.root.mkdir(parents=True, exist_ok=True)
        self._barrier = barrier
        self.seq = 0
        self.grads: list[np.ndarray] = []

    def prepare(self, grads: list[np.ndarray]) -> None:
        self.grads = grads

    @staticmethod
    def _write(path: Path, data: np.ndarray) -> None:
        tmp = path.with_name(f".{path.name}.tmp")
        with open(tmp, "wb") as f:
            f.write(data.data.cast("B"))
        os.rename(tmp, path)

    @staticmethod
    def _wait(paths: Sequence[Path]) -> None:
        deadline = time.monotonic() + WORKER_TIMEOUT_S
        while not all(p.exists() for p in paths):
            if time.monotonic() > deadline:
                raise TimeoutError(f"naive peer: {paths[0].parent} never completed")
            time.sleep(NAIVE_POLL_S)

    def step(self) -> None:
        self.seq += 1
        d = self.root / f"s-{self.seq}"
        d.mkdir(exist_ok=True)
        for i, g in enumerate(self.grads):
            self._write(d / f"in-{self.rank}-{i}", g)
        if self.rank == 0:
            self._wait(
                [d / f"in-{q}-{i}" for q in range(self.world) for i in range(len(self.grads))]
            )
            # Everyone published this step, so everyone has read the previous one.
            shutil.rmtree(self.root / f"s-{self.seq - 1}", ignore_errors=True)
            for i, g in enumerate(self.grads):
                acc = np.zeros(g.size, dtype=np.float64)
                for q in range(self.world):
                    acc += np.fromfile(d / f"in-{q}-{i}", dtype=F32)
                mean = (acc / self.world).astype(F32)
                self._write(d / f"out-{i}", mean)
                g.reshape(-1)[:] = mean
            self._write(d / "done", np.zeros(1, F32))
        else:
            self._wait([d / "done"])
            for i, g in enumerate(self.grads):
                with open(d / f"out-{i}", "rb") as f:
                    f.readinto(g.data.cast("B"))

    def barrier(self) -> None:
        self._barrier.wait(timeout=WORKER_TIMEOUT_S)

    def release(self) -> None:
        self.grads = []

    def close(self) -> None:
        pass


# -- the per-workload loop (inside every worker) --------------------------------------


@dataclass
class _Sample:
    """Flat element indices checked after every step, and where they live."""

    idx: np.ndarray
    base: np.ndarray
    where: list[tuple[int, np.ndarray]]  # (tensor, local indices), in idx order


def _make_sample(sizes: list[int]) -> _Sample:
    total = sum(sizes)
    idx = np.unique(
        np.concatenate(
            [np.linspace(0, total - 1, min(CHECK_SAMPLES, total)).astype(np.int64), [total - 1]]
        )
    )
    offsets = np.cumsum([0, *sizes])
    tensor = np.searchsorted(offsets, idx, side="right") - 1
    where = [(int(t), idx[tensor == t] - offsets[t]) for t in np.unique(tensor)]
    return _Sample(idx=idx, base=base_values(idx), where=where)


def _fill(grads: list[np.ndarray], scaled: np.ndarray, rank: int, step: int) -> None:
    off = 0
    b = step_offset(rank, step)
    for g in grads:
        np.add(scaled[off : off + g.size], b, out=g)
        off += g.size


def _check_sample(grads: list[np.ndarray], sample: _Sample, world: int, step: int) -> float:
    got = np.concatenate([grads[t][local] for t, local in sample.where])
    return max_rel_err(got, expected_mean(sample.base, world, step))


def _check_full(grads: list[np.ndarray], world: int, step: int) -> float:
    worst = 0.0
    off = 0
    for g in grads:
        for lo in range(0, g.size, FULL_CHECK_CHUNK):
            hi = min(lo + FULL_CHECK_CHUNK, g.size)
            want = expected_mean(base_values(np.arange(off + lo, off + hi)), world, step)
            worst = max(worst, max_rel_err(g[lo:hi], want))
        off += g.size
    return worst


def _digest(grads: list[np.ndarray]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for g in grads:
        h.update(g.data.cast("B"))
    return h.hexdigest()


def run_workload(
    peer: Peer, rank: int, world: int, sizes: list[int], warmup: int, steps: int
) -> dict[str, Any]:
    gc.collect()
    total = sum(sizes)
    # Harness memory, allocated before the baseline: this rank's scaled base values.
    scaled = np.empty(total, F32)
    for lo in range(0, total, FULL_CHECK_CHUNK):
        hi = min(lo + FULL_CHECK_CHUNK, total)
        scaled[lo:hi] = base_values(np.arange(lo, hi)) * rank_scale(rank)
    sample = _make_sample(sizes)
    # The gradients are the training loop's memory, not the allreduce's: resident
    # (written once) before the baseline. With buffers, the loop keeps them in
    # gradsync's arrays (a training loop allocates those once, like any gradients).
    if isinstance(peer, GradSyncPeer) and peer.buffers:
        grads = peer.sync.buffers_like([np.empty(n, F32) for n in sizes])
    else:
        grads = [np.empty(n, F32) for n in sizes]
    _fill(grads, scaled, rank, 0)
    malloc_trim()
    rss_reset = reset_peak_rss()
    rss_base = maxrss_bytes()
    pss_base = pss_bytes()
    peer.prepare(grads)
    sample_err = 0.0
    step = 0
    for _ in range(warmup):
        _fill(grads, scaled, rank, step)
        peer.step()
        sample_err = max(sample_err, _check_sample(grads, sample, world, step))
        step += 1
    peer.barrier()
    times: list[float] = []
    phases: list[dict[str, float]] = []
    for _ in range(steps):
        _fill(grads, scaled, rank, step)
        t0 = time.perf_counter()
        split = peer.step()
        t1 = time.perf_counter()
        times.append(t1 - t0)
        if split is not None:
            phases.append(split)
        sample_err = max(sample_err, _check_sample(grads, sample, world, step))
        step += 1
    rss_peak = maxrss_bytes()
    pss_end = pss_bytes()  # mappings are still held: the steady state of a training loop
    full_err = _check_full(grads, world, step - 1) if rank == 0 else None
    digest = _digest(grads)
    del grads, scaled  # before release: buffers_like arrays are views of the session's file
    peer.release()
    return {
        "times": times,
        "phases": phases,
        "rss_base": rss_base,
        "rss_peak": rss_peak,
        "rss_reset": rss_reset,
        "pss_base": pss_base,
        "pss_end": pss_end,
        "sample_err": sample_err,
        "full_err": full_err,
        "digest": digest,
    }


def _make_peer(kind: str, rank: int, world: int, spec: dict[str, Any], barrier: Any) -> Peer:
    if kind == "gradsync":
        return GradSyncPeer(rank, world, spec, barrier)
    if kind == "gloo":
        return GlooPeer(rank, world, spec, barrier)
    if kind == "naive":
        return NaivePeer(rank, world, spec, barrier)
    if kind == "mpi":
        return MpiPeer(rank, world)
    raise ValueError(f"unknown peer {kind!r}")


def worker_main(kind: str, rank: int, spec: dict[str, Any], barrier: Any, out_dir: str) -> None:
    """Entry point of one rank: run every workload, write ``rank-<r>.json``."""
    out = Path(out_dir)
    world = int(spec["world"])
    try:
        peer = _make_peer(kind, rank, world, spec, barrier)
        results: dict[str, Any] = {"pid": os.getpid()}
        for wl in spec["workloads"]:
            results[wl["name"]] = run_workload(
                peer, rank, world, wl["sizes"], wl["warmup"], wl["steps"]
            )
        peer.close()
        (out / f"rank-{rank}.json").write_text(json.dumps(results))
    except BaseException:
        (out / f"rank-{rank}.err").write_text(traceback.format_exc())
        raise


def mpi_worker_entry(spec_path: str, out_dir: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    worker_main("mpi", rank, spec, None, out_dir)


# -- launching (in the parent) -----------------------------------------------------------


@dataclass
class Launch:
    ok: bool
    ranks: list[dict[str, Any]] = field(default_factory=list)
    error: str = ""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _collect(out_dir: Path, world: int, note: str) -> Launch:
    errors = [p.read_text() for p in sorted(out_dir.glob("rank-*.err"))]
    files = [out_dir / f"rank-{r}.json" for r in range(world)]
    if errors or not all(f.exists() for f in files):
        return Launch(False, error=(errors[0] if errors else note) or "a worker produced no result")
    return Launch(True, ranks=[json.loads(f.read_text()) for f in files])


def launch_spawn(kind: str, world: int, spec: dict[str, Any]) -> Launch:
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(world)
    with tempfile.TemporaryDirectory(prefix="allreduce-bench-") as tmp:
        procs = [
            ctx.Process(target=worker_main, args=(kind, r, spec, barrier, tmp), daemon=True)
            for r in range(world)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + WORKER_TIMEOUT_S
        note = ""
        failed_at: float | None = None
        while any(p.is_alive() for p in procs):
            now = time.monotonic()
            if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
                failed_at = now
            if (failed_at is not None and now - failed_at > 10) or now > deadline:
                note = "timed out" if now > deadline else "a peer failed; stopped the others"
                for p in procs:
                    if p.is_alive():
                        p.kill()
                break
            time.sleep(0.05)
        for p in procs:
            p.join()
        return _collect(Path(tmp), world, note or f"exit codes {[p.exitcode for p in procs]}")


def mpi_unavailable() -> str | None:
    if shutil.which("mpirun") is None:
        return "mpirun not found (apt-get install openmpi-bin libopenmpi-dev)"
    try:
        importlib.metadata.version("mpi4py")
    except importlib.metadata.PackageNotFoundError:
        return "mpi4py not installed (pip install mpi4py)"
    return None


def launch_mpi(world: int, spec: dict[str, Any]) -> Launch:
    with tempfile.TemporaryDirectory(prefix="allreduce-bench-mpi-") as tmp:
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        cmd = [
            "mpirun",
            "--allow-run-as-root",
            "--oversubscribe",
            "-np",
            str(world),
            sys.executable,
            str(Path(__file__).resolve()),
            "--_mpi-worker",
            str(spec_path),
            tmp,
        ]
        try:
            proc = subprocess.run(
                cmd, capture_output=True, text=True, timeout=WORKER_TIMEOUT_S, check=False
            )
            note = f"mpirun exited {proc.returncode}: {proc.stderr[-2000:]}"
        except subprocess.TimeoutExpired:
            note = "mpirun timed out"
        return _collect(Path(tmp), world, note)


# -- summarising -----------------------------------------------------------------------


@dataclass
class Row:
    dir_kind: str  # tmpfs / disk / "-" (peers that use no files)
    world: int
    workload: str
    peer: str  # gradsync, gradsync-root, gloo, mpi, memcpy, naive
    nbytes: int
    ok: bool = True
    error: str = ""
    steps: int = 0
    median_ms: float = float("nan")
    p90_ms: float = float("nan")
    gbps: float = float("nan")
    extra_rss: int | None = None  # bytes, max over ranks
    extra_pss: int | None = None  # bytes, max over ranks, after the timed steps
    max_rel_err: float | None = None
    identical: bool | None = None  # every rank got the same bits
    split_ms: dict[str, float] = field(default_factory=dict)  # mean over ranks and steps
    vs_gloo: float | None = None
    vs_mpi: float | None = None
    vs_memcpy: float | None = None
    vs_one_tensor: float | None = None  # 100x16MiB rows: / the same peer's 16MiB row
    slowest_ms: list[float] = field(default_factory=list)


def summarise(
    launch: Launch, dir_kind: str, world: int, peer: str, workloads: list[dict[str, Any]]
) -> list[Row]:
    rows = []
    for wl in workloads:
        row = Row(dir_kind, world, wl["name"], peer, 4 * sum(wl["sizes"]))
        rows.append(row)
        if not launch.ok:
            row.ok, row.error = False, launch.error
            continue
        res = [r[wl["name"]] for r in launch.ranks]
        slowest = np.max(np.array([r["times"] for r in res]), axis=0)
        row.steps = len(slowest)
        row.slowest_ms = [float(t) * 1e3 for t in slowest]
        row.median_ms = float(np.median(slowest)) * 1e3
        row.p90_ms = float(np.percentile(slowest, 90)) * 1e3
        row.gbps = row.nbytes / (row.median_ms * 1e-3) / 1e9
        row.extra_rss = max(r["rss_peak"] - r["rss_base"] for r in res)
        if all(r.get("pss_end") is not None and r.get("pss_base") is not None for r in res):
            row.extra_pss = max(r["pss_end"] - r["pss_base"] for r in res)
        errs = [r["sample_err"] for r in res] + [r["full_err"] for r in res if r["full_err"]]
        row.max_rel_err = max(errs)
        row.identical = len({r["digest"] for r in res}) == 1
        if res[0]["phases"]:
            keys = res[0]["phases"][0].keys()
            row.split_ms = {
                k: 1e3 * statistics.fmean(p[k] for r in res for p in r["phases"]) for k in keys
            }
    return rows


def memcpy_rows(workloads: list[dict[str, Any]]) -> list[Row]:
    rows = []
    for wl in workloads:
        src = [np.full(n, 1.5, F32) for n in wl["sizes"]]
        dst = [np.empty(n, F32) for n in wl["sizes"]]
        times = []
        for i in range(wl["warmup"] + wl["steps"]):
            for s in src:
                s[0] = i
            t0 = time.perf_counter()
            for d, s in zip(dst, src, strict=True):
                np.copyto(d, s)
            t1 = time.perf_counter()
            if i >= wl["warmup"]:
                times.append(t1 - t0)
        row = Row("-", 1, wl["name"], "memcpy", 4 * sum(wl["sizes"]), steps=len(times))
        row.median_ms = statistics.median(times) * 1e3
        row.p90_ms = float(np.percentile(times, 90)) * 1e3
        row.gbps = row.nbytes / (row.median_ms * 1e-3) / 1e9
        row.max_rel_err = (
            0.0 if all(np.array_equal(d, s) for d, s in zip(dst, src, strict=True)) else 1.0
        )
        rows.append(row)
    return rows


def add_ratios(rows: list[Row]) -> None:
    ref: dict[tuple[str, int, str], Row] = {
        (r.peer, r.world, r.workload): r for r in rows if r.ok and r.dir_kind == "-"
    }
    for r in rows:
        if r.dir_kind == "-" or not r.ok:
            continue
        for attr, peer, world in (
            ("vs_gloo", "gloo", r.world),
            ("vs_mpi", "mpi", r.world),
            ("vs_memcpy", "memcpy", 1),
        ):
            other = ref.get((peer, world, r.workload))
            if other is not None:
                setattr(r, attr, r.median_ms / other.median_ms)
    one = {(r.dir_kind, r.world, r.peer): r for r in rows if r.ok and r.workload == "16MiB"}
    for r in rows:
        single = one.get((r.dir_kind, r.world, r.peer))
        if r.ok and r.workload == "100x16MiB" and single is not None:
            r.vs_one_tensor = r.median_ms / single.median_ms


def combine_rounds(rounds: list[list[Row]]) -> list[Row]:
    """One row per (dir, W, workload, peer) from the rows of several rounds, each round's
    ratios already added: times and ratios are medians over rounds (a ratio within one
    round compares runs made seconds apart), memory and errors the worst round's."""
    if len(rounds) == 1:
        return rounds[0]
    groups: dict[tuple[str, int, str, str], list[Row]] = {}
    for rows in rounds:
        for r in rows:
            groups.setdefault((r.dir_kind, r.world, r.workload, r.peer), []).append(r)

    def med(values: list[float | None]) -> float | None:
        present = [v for v in values if v is not None]
        return statistics.median(present) if present else None

    out = []
    for same in groups.values():
        ok = [r for r in same if r.ok]
        row = Row(same[0].dir_kind, same[0].world, same[0].workload, same[0].peer, same[0].nbytes)
        out.append(row)
        if len(ok) < len(same):
            row.ok, row.error = False, next(r.error for r in same if not r.ok)
            continue
        row.steps = sum(r.steps for r in ok)
        row.slowest_ms = [t for r in ok for t in r.slowest_ms]
        row.median_ms = statistics.median(r.median_ms for r in ok)
        row.p90_ms = statistics.median(r.p90_ms for r in ok)
        row.gbps = row.nbytes / (row.median_ms * 1e-3) / 1e9
        rss = [r.extra_rss for r in ok if r.extra_rss is not None]
        pss = [r.extra_pss for r in ok if r.extra_pss is not None]
        row.extra_rss = max(rss) if rss else None
        row.extra_pss = max(pss) if len(pss) == len(ok) else None
        errs = [r.max_rel_err for r in ok if r.max_rel_err is not None]
        row.max_rel_err = max(errs) if errs else None
        same_bits = [r.identical for r in ok if r.identical is not None]
        row.identical = all(same_bits) if same_bits else None
        if ok[0].split_ms:
            row.split_ms = {k: statistics.fmean(r.split_ms[k] for r in ok) for k in ok[0].split_ms}
        row.vs_gloo = med([r.vs_gloo for r in ok])
        row.vs_mpi = med([r.vs_mpi for r in ok])
        row.vs_memcpy = med([r.vs_memcpy for r in ok])
        row.vs_one_tensor = med([r.vs_one_tensor for r in ok])
    return out


# -- targets -------------------------------------------------------------------------


@dataclass
class Target:
    name: str
    passed: bool | None  # None: not measured
    detail: str


def _fmt_x(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}x"


def check_targets(rows: list[Row], workloads: list[str], peer: str = "gradsync") -> list[Target]:
    """The issue's targets, judged on ``peer``'s rows (correctness: on every gradsync row)."""
    gs = {
        (r.dir_kind, r.world, r.workload): r
        for r in rows
        if r.peer == peer and r.ok and r.dir_kind != "-"
    }
    targets: list[Target] = []

    def ratio_target(
        name: str, keys: Sequence[tuple[str, int, str]], attr: str, limit: float
    ) -> None:
        vals: list[tuple[tuple[str, int, str], float | None]] = [
            (k, getattr(gs[k], attr) if k in gs else None) for k in keys
        ]
        if not keys or any(v is None for _, v in vals):
            missing = [f"W={k[1]} {k[2]}" for k, v in vals if v is None]
            targets.append(Target(name, None, f"not measured: {', '.join(missing) or 'no rows'}"))
            return
        bad = [(k, v) for k, v in vals if v is not None and v > limit]
        detail = ", ".join(f"W={k[1]} {k[2]} {v or 0:.2f}x" for k, v in vals)
        targets.append(Target(name, not bad, detail))

    w2 = [("tmpfs", 2, w) for w in workloads]
    ratio_target(f"tmpfs W=2: {peer} <= 0.5x gloo at every size", w2, "vs_gloo", 0.5)
    big = [("tmpfs", 2, w) for w in ("16MiB", "64MiB", "100x16MiB") if w in workloads]
    ratio_target(
        f"tmpfs W=2: {peer} <= 1.0x MPI at 16 MiB, 64 MiB, 100 tensors", big, "vs_mpi", 1.0
    )
    small = gs.get(("tmpfs", 2, "4KiB"))
    targets.append(
        Target(f"tmpfs W=2: {peer} 4 KiB step <= 0.5 ms", None, "not measured")
        if small is None
        else Target(
            f"tmpfs W=2: {peer} 4 KiB step <= 0.5 ms",
            small.median_ms <= 0.5,
            f"median {small.median_ms:.3f} ms (p90 {small.p90_ms:.3f} ms)",
        )
    )
    w34 = [("tmpfs", w, n) for w in (3, 4) for n in workloads if ("tmpfs", w, n) in gs]
    ratio_target(f"tmpfs W=3,4: {peer} <= 0.5x gloo", w34, "vs_gloo", 0.5)
    rss_rows = [r for r in gs.values() if r.extra_rss is not None]
    big_rss = [r for r in rss_rows if r.nbytes >= MIB]
    bad = [r for r in big_rss if r.extra_rss is not None and r.extra_rss > 2 * r.nbytes]
    worst = max(big_rss, key=lambda r: (r.extra_rss or 0) / r.nbytes, default=None)
    tiny = [
        f"{r.dir_kind} W={r.world} {r.workload}: {(r.extra_rss or 0) / KIB:.0f} KiB"
        for r in rss_rows
        if r.nbytes < MIB
    ]
    targets.append(
        Target(
            f"extra RSS per rank <= 2x gradient bytes ({peer}, workloads >= 1 MiB)",
            None if not big_rss else not bad,
            (
                "worst "
                + (
                    f"{worst.dir_kind} W={worst.world} {worst.workload}: "
                    f"{(worst.extra_rss or 0) / worst.nbytes:.2f}x"
                    if worst
                    else "n/a"
                )
                + (f"; below RSS resolution, not judged: {', '.join(tiny)}" if tiny else "")
            ),
        )
    )
    pss_rows = [r for r in big_rss if r.extra_pss is not None]
    if pss_rows:
        worst_pss = max(pss_rows, key=lambda r: (r.extra_pss or 0) / r.nbytes)
        targets.append(
            Target(
                f"extra PSS per rank <= 2x gradient bytes ({peer}; shared mapped pages "
                "counted once)",
                all((r.extra_pss or 0) <= 2 * r.nbytes for r in pss_rows),
                f"worst {worst_pss.dir_kind} W={worst_pss.world} {worst_pss.workload}: "
                f"{(worst_pss.extra_pss or 0) / worst_pss.nbytes:.2f}x",
            )
        )
    pairs = [
        (gs.get(("tmpfs", w, "100x16MiB")), gs.get(("tmpfs", w, "16MiB")), w)
        for w in sorted({k[1] for k in gs})
    ]
    ratios = [(a.vs_one_tensor, w) for a, b, w in pairs if a and b and a.vs_one_tensor]
    targets.append(
        Target(
            f"tmpfs: {peer} 100-tensor workload within 1.25x of one 16 MiB tensor",
            None if not ratios else all(x <= 1.25 for x, _ in ratios),
            ", ".join(f"W={w} {x:.2f}x" for x, w in ratios) or "not measured",
        )
    )
    if peer != "gradsync":
        return targets
    errs = [r.max_rel_err for r in rows if r.peer.startswith("gradsync") and r.ok]
    bad_bits = [
        f"{r.dir_kind} W={r.world} {r.workload}"
        for r in rows
        if r.peer.startswith("gradsync") and r.ok and not r.identical
    ]
    failed = [
        f"{r.peer} {r.dir_kind} W={r.world} {r.workload}"
        for r in rows
        if r.peer.startswith("gradsync") and not r.ok
    ]
    targets.append(
        Target(
            f"gradsync correct: max rel err <= {RTOL_GRADSYNC:g}, same bits on every rank",
            None if not errs else (max(e or 0 for e in errs) <= RTOL_GRADSYNC and not bad_bits),
            (f"max rel err {max(e or 0 for e in errs):.2e}" if errs else "no rows")
            + (f"; ranks differ: {', '.join(bad_bits)}" if bad_bits else "")
            + (f"; failed runs: {', '.join(failed)}" if failed else ""),
        )
    )
    return targets


# -- printing ------------------------------------------------------------------------


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "n/a"
    if abs(n) >= MIB:
        return f"{n / MIB:.1f}M"
    return f"{n / KIB:.0f}K"


def format_table(rows: list[Row]) -> str:
    head = (
        f"{'dir':5} {'W':>1} {'workload':9} {'peer':13} {'median ms':>9} {'p90 ms':>8} "
        f"{'GB/s':>6} {'xRSS':>7} {'xRSS/B':>6} {'max rel err':>11} {'/gloo':>6} "
        f"{'/MPI':>6} {'/cpy':>6}  publish/waitIn/reduce/waitOut/gather ms"
    )
    lines = [head, "-" * len(head)]
    prev: tuple[str, int] | None = None
    for r in rows:
        if prev is not None and prev != (r.dir_kind, r.world):
            lines.append("")
        prev = (r.dir_kind, r.world)
        if not r.ok:
            first = r.error.strip().splitlines()[-1] if r.error.strip() else "failed"
            lines.append(
                f"{r.dir_kind:5} {r.world:>1} {r.workload:9} {r.peer:13} FAILED: {first[:90]}"
            )
            continue
        split = (
            "/".join(
                f"{r.split_ms[k]:.2f}"
                for k in ("publish", "wait_inputs", "reduce", "wait_outputs", "gather")
            )
            if r.split_ms
            else ""
        )
        rss_ratio = "" if r.extra_rss is None else f"{r.extra_rss / r.nbytes:.2f}"
        err = "n/a" if r.max_rel_err is None else f"{r.max_rel_err:.1e}"
        lines.append(
            f"{r.dir_kind:5} {r.world:>1} {r.workload:9} {r.peer:13} {r.median_ms:9.3f} "
            f"{r.p90_ms:8.3f} {r.gbps:6.2f} {_fmt_bytes(r.extra_rss):>7} {rss_ratio:>6} "
            f"{err:>11} {_fmt_x(r.vs_gloo) if r.vs_gloo else '':>6} "
            f"{_fmt_x(r.vs_mpi) if r.vs_mpi else '':>6} "
            f"{_fmt_x(r.vs_memcpy) if r.vs_memcpy else '':>6}  {split}"
        )
    return "\n".join(lines)


# -- environment ------------------------------------------------------------------------


def fs_type(path: Path) -> str:
    """The filesystem type mounted at ``path`` (longest mount-point prefix in /proc/mounts)."""
    best, kind = "", "unknown"
    real = os.path.realpath(path)
    with contextlib.suppress(OSError), open("/proc/self/mounts") as f:
        for line in f:
            parts = line.split()
            mnt = parts[1]
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                best, kind = mnt, parts[2]
    return kind


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def machine_info() -> dict[str, str]:
    cpu = "unknown"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    ompi = "not installed"
    if shutil.which("mpirun"):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(
                ["mpirun", "--version"], capture_output=True, text=True, timeout=30, check=False
            ).stdout
            ompi = out.splitlines()[0].strip() if out else "unknown"
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "nproc": str(os.cpu_count()),
        "cpu": cpu,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "torch": _version("torch"),
        "mpi4py": _version("mpi4py"),
        "openmpi": ompi,
        "gradsync": _version("gradsync"),
        "loadavg": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }


# -- main ------------------------------------------------------------------------------


def _csv(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--world-sizes", default="2,3,4", help="comma-separated W (default 2,3,4)")
    p.add_argument("--workloads", default=",".join(ALL_WORKLOADS))
    p.add_argument("--dirs", default="tmpfs,disk", help="sync dirs for file-based peers")
    p.add_argument("--tmpfs-dir", default="/dev/shm", type=Path)
    p.add_argument("--disk-dir", default="/var/tmp", type=Path)
    p.add_argument("--peers", default=",".join(ALL_PEERS), help="subset of " + ",".join(ALL_PEERS))
    p.add_argument("--strategies", default="sharded", help="gradsync strategies: sharded,root")
    p.add_argument(
        "--threads",
        default="auto",
        help="gradsync threads per rank, comma-separated: auto (the config's default) "
        "and/or numbers; each number adds rows named gradsync-t<N>",
    )
    p.add_argument(
        "--buffers",
        action="store_true",
        help="also run gradsync on GradSync.buffers_like arrays (rows gradsync-buf)",
    )
    p.add_argument(
        "--wide-sum",
        action="store_true",
        help="also run gradsync with wide_sum=True (float32 summed in float64; rows *-f64)",
    )
    p.add_argument("--steps", type=int, default=30, help="timed steps, workloads >= 16 MiB")
    p.add_argument("--small-steps", type=int, default=200, help="timed steps, workloads < 16 MiB")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--naive-steps", type=int, default=10, help="timed steps of the naive peer")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every peer this many times per W, interleaved; a row is then the median "
        "over rounds, and its ratios the median of the same-round ratios",
    )
    p.add_argument("--quick", action="store_true", help="few steps (smoke test)")
    p.add_argument("--json", type=Path, help="write every row (and machine info) here")
    p.add_argument("--_mpi-worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.small_steps, args.warmup, args.naive_steps = 5, 30, 2, 3
    return args


def build_workloads(names: list[str], steps: int, small: int, warmup: int) -> list[dict[str, Any]]:
    out = []
    for name in names:
        sizes = workload_sizes(name)
        n = steps if 4 * sum(sizes) >= 16 * MIB else small
        out.append({"name": name, "sizes": sizes, "steps": n, "warmup": warmup})
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args._mpi_worker:
        mpi_worker_entry(*args._mpi_worker)
        return 0
    worlds = [int(w) for w in _csv(args.world_sizes)]
    names = _csv(args.workloads)
    peers = _csv(args.peers)
    dirs = _csv(args.dirs)
    strategies = _csv(args.strategies)
    unknown = set(peers) - set(ALL_PEERS)
    if unknown or set(dirs) - {"tmpfs", "disk"} or set(strategies) - {"sharded", "root"}:
        raise SystemExit(f"bad --peers/--dirs/--strategies: {args.peers} {args.dirs}")
    workloads = build_workloads(names, args.steps, args.small_steps, args.warmup)
    naive_workloads = build_workloads(names, args.naive_steps, args.naive_steps, 2)
    info = machine_info()
    command = " ".join([Path(sys.executable).name, *sys.argv])
    dir_paths = {"tmpfs": args.tmpfs_dir, "disk": args.disk_dir}
    print(f"# {info['date']}  {info['nproc']} CPUs  {info['cpu']}  Linux {info['kernel']}")
    print(
        f"# python {info['python']}, numpy {info['numpy']}, torch {info['torch']}, "
        f"mpi4py {info['mpi4py']}, {info['openmpi']}"
    )
    for d in dirs:
        kind = fs_type(dir_paths[d])
        print(f"# sync dir {d}: {dir_paths[d]} ({kind})")
        if (d == "tmpfs") != (kind == "tmpfs"):
            print(f"#   WARNING: {dir_paths[d]} is {kind}, not what --dirs {d} implies")
    mpi_note = mpi_unavailable() if "mpi" in peers else None
    if mpi_note:
        print(f"# mpi skipped: {mpi_note}")
        peers = [p for p in peers if p != "mpi"]
    print(f"# command: {command}", flush=True)

    t_start = time.monotonic()

    def run(label: str, kind: str, world: int, spec: dict[str, Any]) -> Launch:
        def once() -> Launch:
            return launch_mpi(world, spec) if kind == "mpi" else launch_spawn(kind, world, spec)

        t0 = time.monotonic()
        launch = once()
        if not launch.ok and kind == "gradsync":
            print(f"  {label} FAILED, re-running once:\n{launch.error}", flush=True)
            launch = once()
        status = "ok" if launch.ok else "FAILED:\n" + launch.error
        print(f"  {label}: {time.monotonic() - t0:.1f} s {status}", flush=True)
        return launch

    rounds: list[list[Row]] = [[] for _ in range(args.rounds)]
    for rnd, world in ((rnd, w) for w in worlds for rnd in range(args.rounds)):
        measured = rounds[rnd]  # this round's rows, appended to
        if args.rounds > 1:
            print(f"  round {rnd + 1} of {args.rounds}, W={world}:", flush=True)
        if "memcpy" in peers and not any(r.peer == "memcpy" for r in measured):
            measured += memcpy_rows(workloads)
        base_spec = {"world": world, "workloads": workloads}
        if "gloo" in peers:
            spec = {**base_spec, "port": _free_port()}
            launch = run(f"gloo W={world}", "gloo", world, spec)
            measured += summarise(launch, "-", world, "gloo", workloads)
        if "mpi" in peers:
            launch = run(f"mpi W={world}", "mpi", world, base_spec)
            measured += summarise(launch, "-", world, "mpi", workloads)
        for d in dirs:
            root = dir_paths[d] / f"gradsync-bench-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            try:
                variants = [
                    (s, t, b, w)
                    for s in strategies
                    for t in _csv(args.threads)
                    for b in ((False, True) if args.buffers else (False,))
                    for w in ((False, True) if args.wide_sum else (False,))
                ]
                for strategy, threads, buffers, wide in variants if "gradsync" in peers else []:
                    spec = {
                        **base_spec,
                        "sync_dir": str(root / f"{strategy}-{threads}-{int(buffers)}-{int(wide)}"),
                        "strategy": strategy,
                        "threads": None if threads == "auto" else int(threads),
                        "buffers": buffers,
                        "wide_sum": wide,
                    }
                    label = f"gradsync[{strategy}, threads {threads}"
                    label += ", buffers" if buffers else ""
                    label += ", float64 sum] " if wide else "] "
                    launch = run(f"{label}{d} W={world}", "gradsync", world, spec)
                    peer = "gradsync" if strategy == "sharded" else f"gradsync-{strategy}"
                    peer += "-buf" if buffers else ""
                    peer += "-f64" if wide else ""
                    peer += "" if threads == "auto" else f"-t{threads}"
                    measured += summarise(launch, d, world, peer, workloads)
                if "naive" in peers:
                    spec = {"world": world, "workloads": naive_workloads}
                    spec["sync_dir"] = str(root / "naive")
                    launch = run(f"naive {d} W={world}", "naive", world, spec)
                    measured += summarise(launch, d, world, "naive", naive_workloads)
            finally:
                shutil.rmtree(root, ignore_errors=True)

    for round_rows in rounds:
        add_ratios(round_rows)
    per_round = rounds if args.rounds > 1 else []
    rows = combine_rounds(rounds)
    order = {n: i for i, n in enumerate(names)}
    peer_order = {p: i for i, p in enumerate(("gradsync", "gradsync-root", "naive"))}
    file_rows = sorted(
        (r for r in rows if r.dir_kind != "-"),
        key=lambda r: (
            dirs.index(r.dir_kind),
            r.world,
            order[r.workload],
            peer_order.get(r.peer.split("-t")[0], 9),
            r.peer,
        ),
    )
    ref_rows = sorted(
        (r for r in rows if r.dir_kind == "-"),
        key=lambda r: (r.world, order[r.workload], r.peer),
    )
    rows = file_rows + ref_rows
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    info["loadavg_end"] = load
    print(f"\n# total {time.monotonic() - t_start:.0f} s; load average at start {info['loadavg']},")
    print(f"# at end {load}. Step time = slowest rank's time per step; xRSS = extra peak RSS")
    print("# (max over ranks); /gloo, /MPI, /cpy: median over that peer's median (same W).")
    if args.rounds > 1:
        print(
            f"# {args.rounds} rounds per W, interleaved: times are medians over rounds, ratios"
            "\n# the median of the same-round ratios, xRSS the worst round's."
        )
    print(format_table(rows))
    targets = check_targets(rows, names)
    if args.buffers:
        targets += check_targets(rows, names, peer="gradsync-buf")
    if args.wide_sum:
        targets += check_targets(rows, names, peer="gradsync-f64")
        if args.buffers:
            targets += check_targets(rows, names, peer="gradsync-buf-f64")
    print("\n# targets")
    for t in targets:
        verdict = "n/a " if t.passed is None else ("PASS" if t.passed else "FAIL")
        print(f"{verdict}  {t.name}: {t.detail}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "machine": info,
                    "command": command,
                    "rows": [asdict(r) for r in rows],
                    "rounds": [[asdict(r) for r in rr] for rr in per_round],
                    "targets": [asdict(t) for t in targets],
                },
                indent=1,
            )
        )
        print(f"# rows written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
