"""Drive the simulated multi-host cluster of ``rig/`` (this directory) from Python.

Used by ``test_multihost.py`` and ``benchmarks/multihost.py``. The rig's scripts
(``rig/up.sh``, ``rig/on.sh``, ``rig/down.sh``) need root, /dev/fuse and what
``rig/deps.sh`` lists as missing (``rig/deps.sh --install`` installs it).

Everything here has a timeout; a job that overruns is stopped by killing its
``on.sh`` (nsenter), which makes the launcher inside the host get SIGTERM
(``setpriv --pdeathsig``) and stop its ranks.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
RIG = Path(__file__).resolve().parent / "rig"
WORKER = Path(__file__).resolve().parent / "worker.py"
MOUNT = os.environ.get("MH_MOUNT", "/mnt/shared")  # where the rig mounts the volume in each host
PRIVATE_TO_HOSTS = ("/tmp", "/dev/shm")  # each simulated host has its own


def _under(path: str | Path, roots: tuple[str, ...]) -> bool:
    p = os.path.realpath(path)
    return any(p == r or p.startswith(r + "/") for r in roots)


def _run_quiet(argv: list[str]) -> tuple[int, str]:
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return 1, str(exc)
    return r.returncode, (r.stdout + r.stderr).strip()


def unavailable_reason() -> str | None:
    """What the simulated cluster lacks here and how to get it, or None if it (probably) runs."""
    if os.environ.get("GRADSYNC_MULTIHOST", "") == "0":
        return "GRADSYNC_MULTIHOST=0"
    if not sys.platform.startswith("linux"):
        return f"needs Linux namespaces, this is {sys.platform}"
    deps = RIG.relative_to(REPO) / "deps.sh"
    problems = []
    if os.geteuid() != 0:
        problems.append(
            f"needs root for namespaces and FUSE mounts (running as uid {os.geteuid()})"
        )
    if not os.path.exists("/dev/fuse"):
        problems.append("no /dev/fuse (a container needs --device /dev/fuse)")
    rc, missing = _run_quiet(["bash", str(RIG / "deps.sh")])
    if rc != 0:
        problems.append(f"`bash {deps}` failed: {missing[:200]}")
    elif missing:
        problems.append(f"missing {', '.join(missing.split())}: `sudo bash {deps} --install`")
    if not problems:
        probes = (
            ["ip", "netns", "list"],
            ["unshare", "--mount", "--uts", "--ipc", "--pid", "--fork", "true"],
        )
        for argv in probes:
            rc, text = _run_quiet(argv)
            if rc != 0:
                problems.append(f"`{' '.join(argv)}` failed (needs CAP_SYS_ADMIN): {text[:200]}")
    return "; ".join(problems) or None


def results_root() -> Path:
    """Where ranks write results: visible to the test and to every host (not /tmp)."""
    env = os.environ.get("GRADSYNC_MULTIHOST_RESULTS")
    return Path(env) if env else Path("/var/tmp")


@dataclass
class Job:
    """One ``gradsync launch`` per host, running in the background."""

    name: str
    out: Path
    sync_dir: str
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    logs: dict[str, Path] = field(default_factory=dict)

    def wait_until(
        self, cond: Callable[[], bool], timeout_s: float, what: str, *, launchers_live: bool = True
    ) -> None:
        """Poll ``cond`` until true; fail the test (stopping the job) after ``timeout_s``, or
        as soon as a launcher exits if ``launchers_live``."""
        import pytest  # noqa: PLC0415 (the rig's scripts use this module without pytest)

        deadline = time.monotonic() + timeout_s
        while not cond():
            if time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"timed out after {timeout_s} s waiting for {what}\n{self.log_text()}")
            if launchers_live and any(p.poll() is not None for p in self.procs.values()):
                self.stop()
                pytest.fail(f"a launcher exited while waiting for {what}\n{self.log_text()}")
            time.sleep(0.05)

    def wait(self, timeout_s: float) -> dict[str, int]:
        """Exit codes by host; on timeout every launcher is stopped and TimeoutError raised."""
        deadline = time.monotonic() + timeout_s
        codes: dict[str, int] = {}
        try:
            for host, proc in self.procs.items():
                codes[host] = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.stop()
            raise TimeoutError(
                f"job {self.name} did not finish within {timeout_s} s\n{self.log_text()}"
            ) from None
        return codes

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)  # nsenter dies -> launcher gets SIGTERM
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)

    def log_text(self, tail: int = 40) -> str:
        parts = []
        for host, path in self.logs.items():
            try:
                lines = path.read_text(errors="replace").splitlines()[-tail:]
            except OSError:
                lines = ["(no log)"]
            parts.append(f"--- launcher on {host} ---\n" + "\n".join(lines))
        return "\n".join(parts)


class Cluster:
    """up.sh / on.sh / down.sh with timeouts and environment handled."""

    def __init__(self, hosts: int = 2, extra_env: dict[str, str] | None = None) -> None:
        self.dir = RIG
        self.hosts = [f"h{i}" for i in range(1, hosts + 1)]
        self.env = dict(os.environ)
        self.env.update(extra_env or {})
        self.notes: list[str] = []
        self.base = results_root()  # new_out() makes result directories in here
        # Each host has a private /tmp and /dev/shm; if this checkout, the interpreter
        # or the results directory live there, the hosts would not see them.
        needed = [REPO, sys.executable, sys.prefix, results_root()]
        if any(_under(p, PRIVATE_TO_HOSTS) for p in needed):
            self.env["MH_PRIVATE_TMP"] = "0"
            self.notes.append("MH_PRIVATE_TMP=0: the checkout/venv/results are under /tmp")

    def _script(self, name: str, *args: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", str(self.dir / name), *args],
            capture_output=True,
            text=True,
            env=self.env,
            timeout=timeout_s,
            check=False,
        )

    def up(self, fresh: bool = False) -> None:
        """Start the hosts (keeping a healthy cluster as it is unless ``fresh``)."""
        if fresh:
            self.down()  # also what a killed earlier run left running in the hosts
        r = self._script("up.sh", str(len(self.hosts)), timeout_s=120)
        if r.returncode != 0:
            raise RuntimeError(f"up.sh failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")

    def down(self) -> str:
        r = self._script("down.sh", timeout_s=120)
        if r.returncode != 0:
            raise RuntimeError(f"down.sh failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
        return r.stderr

    def on(self, host: str, *argv: str, timeout_s: float = 30) -> subprocess.CompletedProcess[str]:
        """Run a short command inside ``host`` and wait for it."""
        return subprocess.run(
            ["bash", str(self.dir / "on.sh"), host, *argv],
            capture_output=True,
            text=True,
            env=self.env,
            cwd=REPO,
            timeout=timeout_s,
            check=False,
        )

    def start_on(self, host: str, argv: list[str], log: Path) -> subprocess.Popen[bytes]:
        with log.open("wb") as f:
            return subprocess.Popen(
                ["bash", str(self.dir / "on.sh"), host, *argv],
                stdout=f,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                cwd=REPO,
            )

    def new_out(self, label: str) -> Path:
        out = self.base / f"gradsync-mh-{label}-{uuid.uuid4().hex[:8]}"
        out.mkdir(parents=True)
        return out

    def launch(
        self,
        placement: dict[str, int],
        nproc: int,
        sync_dir: str,
        run_id: str,
        worker_args: list[str],
        out: Path,
        *,
        script: Path = WORKER,
        max_wait_s: float = 60.0,
        launcher_args: tuple[str, ...] = (),
    ) -> Job:
        """Start ``gradsync launch`` with node rank ``placement[host]`` on each host
        (``launcher_args``: more of its options, e.g. ``--elastic``)."""
        job = Job(run_id, out, sync_dir)
        nnodes = len(placement)
        for host, node_rank in placement.items():
            argv = [
                sys.executable, "-m", "gradsync", "launch",
                "--nnodes", str(nnodes), "--node-rank", str(node_rank), "--nproc", str(nproc),
                "--sync-dir", sync_dir, "--run-id", run_id,
                "--max-wait-s", str(max_wait_s), "--grace-period-s", "2", *launcher_args,
                str(script), "--out", str(out), *worker_args,
            ]  # fmt: skip
            job.logs[host] = out / f"launch-{host}.log"
            job.procs[host] = self.start_on(host, argv, job.logs[host])
        return job

    def kill_in_host(self, host: str, pids: list[int]) -> None:
        """SIGKILL these pids (as numbered inside ``host``'s PID namespace); gone ones are fine."""
        r = self.on(host, "kill", "-KILL", *map(str, pids), timeout_s=30)
        # A rank may be gone already: a killed launcher's watchdog stops its ranks at once.
        errors = [line for line in r.stderr.splitlines() if not line.endswith("No such process")]
        if r.returncode != 0 and (errors or not r.stderr.strip()):
            raise RuntimeError(f"kill in {host} failed ({r.returncode}): {r.stderr}")

    def juicefs_pids(self, host: str) -> list[int]:
        """Root-namespace pids of ``host``'s JuiceFS client (found in its network namespace)."""
        r = subprocess.run(
            ["ip", "netns", "pids", f"{self.env.get('MH_NS', 'gsmh')}-{host}"],
            capture_output=True, text=True, timeout=20, check=True,
        )  # fmt: skip
        pids = []
        for word in r.stdout.split():
            try:
                comm = Path(f"/proc/{word}/comm").read_text().strip()
            except OSError:
                continue
            if comm == "juicefs":
                pids.append(int(word))
        return pids


@contextlib.contextmanager
def running_cluster(hosts: int, label: str) -> Iterator[Cluster]:
    """A fresh cluster of ``hosts`` hosts whose results go to an emptied ``label``
    directory, brought down after; skipped where none can start (failed under
    GRADSYNC_MULTIHOST=require)."""
    import pytest  # noqa: PLC0415 (the rig's scripts use this module without pytest)

    reason = unavailable_reason()
    if reason is not None:
        message = f"multihost cluster unavailable: {reason}"
        if os.environ.get("GRADSYNC_MULTIHOST") == "require":
            pytest.fail(message)
        print(f"\nSKIP {message}")
        pytest.skip(message)
    c = Cluster(hosts)
    # One fixed directory, emptied once the fresh cluster has stopped a killed run's ranks.
    base = c.base = results_root() / label
    try:
        for note in c.notes:
            print(f"\nmultihost: {note}")
        c.up(fresh=True)
        shutil.rmtree(base, ignore_errors=True)
        base.mkdir(parents=True)
        yield c
    finally:
        try:
            c.down()
        finally:
            if os.environ.get("GRADSYNC_MULTIHOST_KEEP") != "1":
                shutil.rmtree(base, ignore_errors=True)


def steps_of(out: Path, rank: int) -> list[dict[str, Any]]:
    """The steps ``rank`` logged in ``out`` (worker.py's steps-<rank>.jsonl), whole lines only."""
    try:
        text = (out / f"steps-{rank}.jsonl").read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.endswith("}")]
