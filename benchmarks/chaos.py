"""Chaos run of an elastic job: the digits MLP (benchmarks/chaos_rank.py) trained by
``gradsync launch --elastic --max-restarts K --nproc 4`` while ranks chosen at random are
SIGKILLed at random moments; the launcher restarts them and they rejoin.

First an undisturbed run of the same steps, then the chaos run. The run passes if the
chaos run ends with every rank alive at the last step, the same state bits on all of
them, and a test accuracy near the undisturbed one. Prints kills, rejoins, re-form
times and kill-to-rejoin times.

    python benchmarks/chaos.py                       # 30 kills, 3500 steps: ~2 minutes
    python benchmarks/chaos.py --kills 4 --steps 400 # a short one

tests/test_elastic.py runs a short version through :func:`chaos_run`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RANK_SCRIPT = Path(__file__).resolve().parent / "chaos_rank.py"
ACC_SLACK = 0.02  # redone steps miss a lost rank's shard: a little noise, not divergence


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except FileNotFoundError:
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _progress(out: Path) -> int:
    steps = [int(t) for p in out.glob("progress-*") if (t := _read(p))]
    return max(steps, default=0)


class Killer(threading.Thread):
    """SIGKILLs a random live rank each time the job passes one of ``targets`` (steps),
    after a random delay, so that kills land in random phases of random steps."""

    def __init__(self, out: Path, nproc: int, targets: list[int], seed: int) -> None:
        super().__init__(daemon=True)
        self.out, self.nproc, self.targets = out, nproc, targets
        self.rng = random.Random(seed)
        self.kills: list[dict[str, Any]] = []
        self.stop = threading.Event()

    def _victim(self) -> tuple[int, int, int] | None:
        """A random live rank; never the last one that holds the job's state (with
        every member gone the restarted ranks would start the job over)."""
        live, joined = [], []
        for rank in range(self.nproc):
            text = _read(self.out / f"pid-{rank}")
            if text:
                pid, restart = map(int, text.split())
                if _alive(pid) and not any(k["pid"] == pid for k in self.kills):
                    live.append((rank, pid, restart))
                    events = _read(self.out / f"events-{rank}-{restart}.jsonl") or ""
                    if '"event": "joined"' in events:
                        joined.append((rank, pid, restart))
        if len(joined) < 2:
            live = [v for v in live if v not in joined]
        return self.rng.choice(live) if live else None

    def run(self) -> None:
        for target in self.targets:
            while _progress(self.out) < target:
                if self.stop.wait(0.02):
                    return
            time.sleep(self.rng.uniform(0.0, 0.3))
            victim = self._victim()
            if victim is None:
                continue
            rank, pid, restart = victim
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            self.kills.append({"rank": rank, "pid": pid, "restart": restart, "t": time.time()})


def launch(args: argparse.Namespace, out: Path, kills: int) -> dict[str, Any]:
    """One run of the job; kills ``kills`` times. Its outcome, checked and summed up."""
    out.mkdir(parents=True)
    command = [
        sys.executable,
        *("-m", "gradsync", "launch", "--elastic", "--max-restarts", str(kills)),
        *("--nproc", str(args.nproc), "--sync-dir", str(out / "sync")),
        *("--max-wait-s", str(args.max_wait_s), str(RANK_SCRIPT)),
        *("--out", str(out), "--steps", str(args.steps), "--sleep-ms", str(args.sleep_ms)),
        *("--seed", str(args.seed)),
    ]
    rng = random.Random(args.seed)
    targets = sorted(rng.randint(args.steps // 20, args.steps * 4 // 5) for _ in range(kills))
    killer = Killer(out, args.nproc, targets, args.seed)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    start = time.perf_counter()
    with (out / "launcher.log").open("w") as log:
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        killer.start()
        try:
            code = proc.wait(timeout=args.timeout_s)
        except subprocess.TimeoutExpired:
            print(f"  HANG: no end after {args.timeout_s} s (--keep DIR keeps its files)")
        finally:  # an interrupt too: the launcher stops its ranks
            killer.stop.set()
            killer.join()
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            code = proc.wait(timeout=60)
    wall_s = time.perf_counter() - start
    return summarize(out, code, wall_s, killer.kills, args.nproc, args.steps)


def _events(out: Path) -> list[dict[str, Any]]:
    texts = [p.read_text() for p in sorted(out.glob("events-*.jsonl"))]
    lines = [line for text in texts for line in text.splitlines(keepends=True)]
    return [json.loads(line) for line in lines if line.endswith("}\n")]  # whole ones only


def summarize(
    out: Path, code: int, wall_s: float, kills: list[dict[str, Any]], nproc: int, steps: int
) -> dict[str, Any]:
    finals = [json.loads(p.read_text()) for p in out.glob("final-*.json")]
    events = _events(out)
    log = (out / "launcher.log").read_text()
    joins = {(e["rank"], e["restart"]): e["t"] for e in events if e["event"] == "joined"}
    rejoin_s = [
        joins[(k["rank"], k["restart"] + 1)] - k["t"]
        for k in kills
        if (k["rank"], k["restart"] + 1) in joins
    ]
    ready = {(e["rank"], e["restart"]): e["t"] for e in events if e["event"] == "formed"}
    join_s = [t - ready[k] for k, t in joins.items() if k[1] and k in ready]
    # One re-form per lost rank per survivor: the call that lost it, with its redo.
    reform_s = [e["total_s"] for e in events if e["event"] == "change" and e["lost"]]
    problems = []
    if code != 0:
        problems.append(f"launcher exited {code}")
    if sorted(f["rank"] for f in finals) != list(range(nproc)):
        problems.append(f"final states from ranks {sorted(f['rank'] for f in finals)}")
    if len({f["sha256"] for f in finals}) > 1:
        problems.append("states differ: " + ", ".join(f["sha256"][:12] for f in finals))
    if any(f["step"] != steps for f in finals):
        problems.append(f"ended at steps {[f['step'] for f in finals]}")
    over = [e for e in events if e["event"] == "joined" and e["restart"] and not e["step"]]
    if over:  # every member was lost: the restarted ranks formed a new job
        problems.append(f"the job started over from step 0 ({len(over)} ranks)")
    return {
        "code": code,
        "wall_s": wall_s,
        "kills": len(kills),
        "restarts": log.count("restarting it"),
        "rejoins": len(rejoin_s),
        "unjoined": sum(1 for k in kills if (k["rank"], k["restart"]) not in joins),
        "rejoin_s": rejoin_s,
        "join_s": join_s,
        "reform_s": reform_s,
        "epoch": max((f["epoch"] for f in finals), default=-1),
        "test_acc": finals[0]["test_acc"] if finals else float("nan"),
        "test_loss": finals[0]["test_loss"] if finals else float("nan"),
        "tracebacks": log.count("Traceback"),
        "end_waits": max((f["end_waits"] for f in finals), default=0),
        "problems": problems,
    }


def _pct(xs: list[float]) -> str:
    if not xs:
        return "none"
    p = np.percentile(np.asarray(xs) * 1e3, [50, 90, 100])
    return f"median {p[0]:.0f} ms, p90 {p[1]:.0f} ms, max {p[2]:.0f} ms (n={len(xs)})"


def report(name: str, r: dict[str, Any]) -> None:
    print(
        f"{name}: exit {r['code']}, {r['wall_s']:.1f} s, "
        f"test acc {r['test_acc']:.4f}, test loss {r['test_loss']:.6f}"
    )
    if r["kills"]:
        print(
            f"  kills {r['kills']} ({r['unjoined']} before the victim had joined), "
            f"launcher restarts {r['restarts']}, rejoins {r['rejoins']}"
        )
        print(
            f"  memberships {r['epoch'] + 1}, tracebacks in the log {r['tracebacks']}, "
            f"calls after the last step waiting for restarted ranks {r['end_waits']}"
        )
        print(f"  kill -> rejoined (restart, imports, data, join): {_pct(r['rejoin_s'])}")
        print(
            f"  of which: ready to joined (join request, admission, broadcast): {_pct(r['join_s'])}"
        )
        print(f"  call that lost a rank, redo included (each survivor): {_pct(r['reform_s'])}")
    for problem in r["problems"]:
        print(f"  PROBLEM: {problem}")


def chaos_run(args: argparse.Namespace, work: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The undisturbed run (unless ``args.kills_only``) and the chaos run."""
    base = {} if args.kills_only else launch(args, work / "undisturbed", 0)
    chaos = launch(args, work / "chaos", args.kills)
    if base and not chaos["test_acc"] >= base["test_acc"] - ACC_SLACK:
        chaos["problems"].append(f"test accuracy more than {ACC_SLACK} below undisturbed")
    return base, chaos


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--kills", type=int, default=30)
    p.add_argument("--steps", type=int, default=3500)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--sleep-ms", type=float, default=20.0, help="compute time per step (20)")
    p.add_argument("--seed", type=int, default=0, help="kill schedule and training (0)")
    p.add_argument("--max-wait-s", type=float, default=60.0)
    p.add_argument("--timeout-s", type=float, default=600.0, help="a run's limit (600)")
    p.add_argument("--kills-only", action="store_true", help="skip the undisturbed run")
    p.add_argument("--keep", type=Path, help="keep the runs' files here")
    return p.parse_args(argv)


def main() -> int:
    args = parse_args()
    print(f"load average: {_read(Path('/proc/loadavg')) or '?'}".strip())
    with tempfile.TemporaryDirectory() as tmp:
        work = args.keep or Path(tmp)
        base, chaos = chaos_run(args, work)
        if base:
            report("undisturbed", base)
        report("chaos", chaos)
        if base:
            print(
                f"test accuracy: chaos {chaos['test_acc']:.4f} vs undisturbed "
                f"{base['test_acc']:.4f}; loss {chaos['test_loss']:.6f} vs {base['test_loss']:.6f}"
            )
    print(f"load average: {_read(Path('/proc/loadavg')) or '?'}".strip())
    return 1 if chaos["problems"] or base.get("problems") else 0


if __name__ == "__main__":
    sys.exit(main())
