"""Step time across two simulated hosts (JuiceFS) against one host (tmpfs), W = 4.

Uses the simulated cluster of ``tests/multihost/rig`` (root, /dev/fuse; see
tests/multihost/mh_cluster.py for what it needs). For each gradient size
(one float32 array) it runs the same job three ways:

- ``2 hosts x 2, JuiceFS``: ``gradsync launch --nnodes 2 --nproc 2`` in h1 and h2,
  sync dir on /mnt/shared (each host its own JuiceFS client);
- ``1 host x 4, JuiceFS``: ``--nproc 4`` in h1 on /mnt/shared (FS cost without
  crossing hosts);
- ``1 host x 4, tmpfs``: ``--nproc 4`` in h1 on h1's /dev/shm (the baseline);
- ``2 hosts x 2, JuiceFS, checksums``: the first with ``checksums=True``: what payload
  checksums cost there.

A step's time is the longest ``GradSync.average`` call of the 4 ranks for that
step (the slowest rank gates the next optimizer step); the table shows its median
and p90 over the measured steps (after warm-up), plus the median phases of the
slowest rank (publish / wait for inputs / reduce / wait for shards / gather), and
the CPU a step costs: the ranks' together, and the JuiceFS clients' (ms per step;
on 2 shared cores CPU, not bandwidth, bounds the step), and the MiB per step the
clients fetched from and stored in the object store (what a real network carries).

    sudo python benchmarks/multihost.py                   # 4 KiB, 1 MiB, 16 MiB
    sudo python benchmarks/multihost.py --sizes 4096 --steps 100 --json
    MH_JFS_OPTS="--entry-cache 0 --attr-cache 0 --dir-entry-cache 0" \\
        sudo -E python benchmarks/multihost.py           # JuiceFS caches off
    sudo python benchmarks/multihost.py --sizes 16777216 --compression none,bf16,int8 \\
        --limit-mbps 500                                  # a 500 Mbit/s storage network

The same file, run with ``--worker`` by ``gradsync launch``, is one rank.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

PHASES = ("publish_s", "wait_inputs_s", "reduce_s", "wait_outputs_s", "gather_s")


# ---------------------------------------------------------------- one rank


def worker(argv: list[str]) -> int:
    import numpy as np  # noqa: PLC0415

    import gradsync  # noqa: PLC0415

    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--bytes", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--checksums", action="store_true")
    p.add_argument("--compression", default=None)
    args = p.parse_args(argv)
    cfg = gradsync.FileGradSyncConfig.from_env(
        checksums=args.checksums, compression=args.compression
    )
    rng = np.random.default_rng(cfg.rank)
    base = rng.standard_normal(args.bytes // 4).astype(np.float32)
    grads = [base.copy()]
    records = []
    with gradsync.GradSync(cfg) as gs:
        for step in range(args.steps):
            grads[0][:] = base
            c0, t0 = time.process_time(), time.perf_counter()
            stats = gs.average(grads, step=step)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            records.append({"wall_s": wall, "cpu_s": cpu, **{k: getattr(stats, k) for k in PHASES}})
        # Work-around for a race in gradsync: a rank that closes right after the last
        # step can make a slower peer raise a false PeerLostError for that step
        # (see tests/multihost/test_final_step_race.py).
        time.sleep(1.0)
    (args.out / f"bench-{cfg.rank}.json").write_text(json.dumps(records))
    return 0


# ---------------------------------------------------------------- driver


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def _run_config(
    cluster: Any, name: str, placement: dict[str, int], nproc: int, sync_root: str,
    nbytes: int, steps: int, warmup: int, timeout_s: float, extra: list[str],
) -> dict[str, Any]:  # fmt: skip
    run_id = f"bench-{uuid.uuid4().hex[:10]}"
    out = cluster.new_out(run_id)
    clients_before = _clients_cpu_s(cluster, cluster.hosts)
    moved_before = _object_bytes(cluster, sync_root)
    job = cluster.launch(
        placement, nproc, f"{sync_root}/{run_id}", run_id,
        ["--worker", "--bytes", str(nbytes), "--steps", str(steps + warmup), *extra],
        out, script=Path(__file__).resolve(), max_wait_s=120.0,
    )  # fmt: skip
    codes = job.wait(timeout_s)
    # Both hosts' clients: each serves the other's reads of the files it wrote.
    clients_s = _clients_cpu_s(cluster, cluster.hosts) - clients_before
    moved = _object_bytes(cluster, sync_root) - moved_before
    if any(codes.values()):
        raise RuntimeError(f"{name}: exit codes {codes}\n{job.log_text()}")
    world = nproc * len(placement)
    per_rank = [json.loads((out / f"bench-{r}.json").read_text()) for r in range(world)]
    slowest_wall, slowest_phases = [], []
    for s in range(warmup, warmup + steps):
        r = max(range(world), key=lambda q: per_rank[q][s]["wall_s"])
        slowest_wall.append(per_rank[r][s]["wall_s"])
        slowest_phases.append(per_rank[r][s])
    # Clean up the sync dir from inside a host (the root namespace has no such mount).
    host = next(iter(placement))
    cluster.on(host, "rm", "-rf", f"{sync_root}/{run_id}", timeout_s=120)
    shutil.rmtree(out, ignore_errors=True)
    return {
        "config": name,
        "bytes": nbytes,
        "steps": steps,
        "median_ms": 1e3 * statistics.median(slowest_wall),
        "p90_ms": 1e3 * _quantile(slowest_wall, 0.9),
        "phases_ms": {k: 1e3 * statistics.median(p[k] for p in slowest_phases) for k in PHASES},
        # All ranks' CPU per step (median), the clients' (mean over the run, start-up too).
        "ranks_cpu_ms": 1e3
        * statistics.median(
            sum(per_rank[q][s]["cpu_s"] for q in range(world))
            for s in range(warmup, warmup + steps)
        ),
        "clients_cpu_ms": 1e3 * clients_s / (steps + warmup),
        # Objects the clients fetched and stored (mean over the run, start-up too).
        "object_mib": moved / (1 << 20) / (steps + warmup),
    }


def _clients_cpu_s(cluster: Any, hosts: list[str]) -> float:
    """CPU time the JuiceFS clients of ``hosts`` have used so far (user + system)."""
    ticks = 0
    for host in hosts:
        for pid in cluster.juicefs_pids(host):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def _object_bytes(cluster: Any, sync_root: str) -> int:
    """Bytes the hosts' JuiceFS clients have fetched from and stored in the object store
    so far, from the ``.stats`` at the root of the volume (0 for a sync dir elsewhere)."""
    total = 0
    for host in cluster.hosts:
        stats = cluster.on(host, "cat", f"{sync_root}/.stats")
        for line in stats.stdout.splitlines():
            if line.startswith("juicefs_object_request_data_bytes_"):
                total += int(float(line.rsplit(None, 1)[1]))
    return total


def _size(n: int) -> str:
    return f"{n // (1 << 20)} MiB" if n >= 1 << 20 else f"{n // 1024} KiB"


def main() -> int:
    if "--worker" in sys.argv[1:]:  # a rank, started by gradsync launch
        return worker([a for a in sys.argv[1:] if a != "--worker"])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[4096, 1 << 20, 16 << 20])
    p.add_argument("--steps", type=int, nargs="+", default=[100, 50, 20],
                   help="measured steps per size (one value, or one per size)")  # fmt: skip
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--keep-up", action="store_true", help="leave the cluster up afterwards")
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--limit-mbps",
        type=int,
        help="cap each host's object traffic at this many Mbit/s a direction (JuiceFS "
        "--upload-limit / --download-limit), as a network to the object store would",
    )
    p.add_argument(
        "--compression",
        help="comma-separated, e.g. none,bf16,fp16,int8: instead of the default configs, "
        "each of these on 2 hosts x 2 (JuiceFS) and 1 host x 2 (tmpfs), in the same run",
    )
    args = p.parse_args()
    steps = args.steps * len(args.sizes) if len(args.steps) == 1 else args.steps
    if len(steps) != len(args.sizes):
        p.error("--steps takes one value or one per size")

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "multihost"))
    from mh_cluster import MOUNT, Cluster, unavailable_reason  # noqa: PLC0415

    reason = unavailable_reason()
    if reason is not None:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    opts = os.environ.get("MH_JFS_OPTS", "")
    if args.limit_mbps:
        opts += f" --upload-limit {args.limit_mbps} --download-limit {args.limit_mbps}"
    opts = opts.strip()
    cluster = Cluster(2, {"MH_JFS_OPTS": opts})
    configs = [
        ("2 hosts x 2, JuiceFS", {"h1": 0, "h2": 1}, 2, MOUNT, []),
        ("1 host x 4, JuiceFS", {"h1": 0}, 4, MOUNT, []),
        ("1 host x 4, tmpfs", {"h1": 0}, 4, "/dev/shm", []),
        ("2 hosts x 2, JuiceFS, checksums", {"h1": 0, "h2": 1}, 2, MOUNT, ["--checksums"]),
    ]
    mount = os.environ.get("MH_MOUNT", MOUNT)
    if args.compression:
        configs = []
        for codec in args.compression.split(","):
            extra = [] if codec == "none" else ["--compression", codec]
            configs += [
                (f"2 hosts x 2, JuiceFS, {codec}", {"h1": 0, "h2": 1}, 2, mount, extra),
                (f"1 host x 2, tmpfs, {codec}", {"h1": 0}, 2, "/dev/shm", extra),
            ]
    rows = []
    try:
        cluster.up()
        for nbytes, n in zip(args.sizes, steps, strict=True):
            for name, placement, nproc, root, extra in configs:
                timeout_s = 60 + 2.0 * (n + args.warmup)
                rows.append(
                    _run_config(
                        cluster,
                        name,
                        placement,
                        nproc,
                        root,
                        nbytes,
                        n,
                        args.warmup,
                        timeout_s,
                        extra,
                    )
                )
                print(f"  done: {_size(nbytes)} {name}", file=sys.stderr)
    finally:
        if not args.keep_up:
            cluster.down()
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"W=4, {len(args.sizes)} sizes; step time = slowest rank's GradSync.average per step")
    if opts:
        print(f"JuiceFS mount options: {opts}")
    head = (
        "| size | config | steps | median ms | p90 ms "
        "| publish | wait in | reduce | wait out | gather | ranks' CPU | FS clients' CPU "
        "| objects MiB |"
    )
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for r in rows:
        ph = r["phases_ms"]
        print(
            f"| {_size(r['bytes'])} | {r['config']} | {r['steps']} | {r['median_ms']:.1f} "
            f"| {r['p90_ms']:.1f} | "
            + " | ".join(f"{ph[k]:.1f}" for k in PHASES)
            + f" | {r['ranks_cpu_ms']:.0f} | {r['clients_cpu_ms']:.0f} | {r['object_mib']:.1f} |"
        )
    _print_ratios(rows)
    return 0


def _print_ratios(rows: list[dict[str, Any]]) -> None:
    """Each compressed config's step and objects against float32's across hosts, per size
    (issue 27's goals: bf16 <= 0.6x, int8 <= 0.35x the float32 step)."""
    plain = "2 hosts x 2, JuiceFS, none"
    for r in rows:
        base = next((b for b in rows if b["bytes"] == r["bytes"] and b["config"] == plain), None)
        if base is None or r is base or not r["config"].startswith("2 hosts x 2, JuiceFS, "):
            continue
        codec = r["config"].rsplit(", ", 1)[1]
        objects = r["object_mib"] / base["object_mib"] if base["object_mib"] else float("nan")
        print(
            f"{_size(r['bytes'])} across hosts, {codec} / float32: step "
            f"{r['median_ms'] / base['median_ms']:.2f}x, objects {objects:.2f}x"
        )


if __name__ == "__main__":
    raise SystemExit(main())
