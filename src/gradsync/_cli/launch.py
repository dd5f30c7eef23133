"""``gradsync launch``: start one node's ranks, prefix their output, stop them together.

POSIX only: each rank runs in its own session (process group), which the launcher
signals with :func:`os.killpg`.
"""

from __future__ import annotations

import codecs
import contextlib
import logging
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO, Any

from gradsync._config import check_int, check_run_id, check_seconds
from gradsync._errors import ConfigError, SyncDirError
from gradsync._job.reaping import leave_for_ended, remove_dead_jobs
from gradsync._step.transport import filesystem_type, local_filesystem
from gradsync._store.makedir import make_sync_dir

from .defaultdir import DEFAULT_PREFIX, default_base
from .report import Tail, announce, failure_summary, stopped_by_launcher
from .report import describe as _describe
from .report import signal_name as _signal_name
from .watchdog import group_alive

__all__ = ["launch"]

logger = logging.getLogger("gradsync.launch")

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_MAX_LINE_BYTES = 64 * 1024  # longer lines are split, so one rank cannot exhaust memory
_LINE_END = re.compile(rb"\r\n|\r|\n")
_POLL_S = 0.05  # how often the supervisor looks at launcher signals and deadlines
_DRAIN_S = 2.0  # after the ranks exit, how long to wait for their pipes to reach EOF
_ABANDON_S = 10.0  # after SIGKILL, how long to wait for ranks before giving up on them
_LEAVE_S = 5.0  # after the ranks exit, how long to wait for their jobs to be left for them
# Each rank costs the launcher a copy of the environment and three threads before any
# starts; no host runs more ranks than this usefully.
_MAX_NPROC = 4096


def launch(
    script_argv: Sequence[str],
    *,
    nproc: int,
    sync_dir: str | os.PathLike[str] | None = None,
    max_wait_s: float | None = None,
    nnodes: int = 1,
    node_rank: int = 0,
    python: str = sys.executable,
    grace_period_s: float = 5.0,
    run_id: str | None = None,
    module: bool = False,
) -> int:
    """Run ``nproc`` ranks of ``python SCRIPT ARGS`` on this node and wait for all of them.

    Rank ``local_rank`` of node ``node_rank`` gets global rank
    ``node_rank * nproc + local_rank`` in a world of ``nnodes * nproc`` ranks, and sees
    it in ``GRADSYNC_RANK``/``RANK``, ``GRADSYNC_WORLD_SIZE``/``WORLD_SIZE``,
    ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``, along with ``GRADSYNC_SYNC_DIR``,
    ``GRADSYNC_RUN_ID``, ``GRADSYNC_MAX_WAIT_S`` (if given) and ``PYTHONUNBUFFERED=1``.
    Each line a rank writes is copied to the launcher's stdout or stderr (the same one)
    prefixed with ``[rank N] ``. When a rank fails, the others get SIGTERM, then SIGKILL
    after ``grace_period_s``, and a summary of the first failure goes to stderr. SIGINT,
    SIGTERM and SIGHUP to the launcher stop the ranks the same way (when called from
    the main thread, which is where signal handlers can be installed), and so does a
    watchdog process if the launcher ends without stopping them (killed by SIGKILL).
    When a rank fails or is stopped without closing its gradsync session, the launcher
    (or its watchdog) leaves its job in ``GRADSYNC_SYNC_DIR`` on its behalf, saying how
    it ended: its peers on other nodes learn it at once instead of after their heartbeat
    timeout.

    Args:
        script_argv: ``SCRIPT`` (a path, or a module name if ``module``) and its arguments.
        nproc: Ranks to start on this node, >= 1.
        sync_dir: Directory shared by all ranks; created if missing and never removed.
            ``None``: a fresh directory under ``/dev/shm`` (else the temp dir), removed
            when the job ends. Required when ``nnodes > 1``.
        max_wait_s: Exported as ``GRADSYNC_MAX_WAIT_S``; ``None`` leaves it unset.
        nnodes: Nodes in the job, each running its own launcher, >= 1.
        node_rank: This node's index, ``0 <= node_rank < nnodes``.
        python: Interpreter that runs the ranks.
        grace_period_s: Seconds between SIGTERM and SIGKILL when stopping ranks, >= 0.
        run_id: Job name shared by all nodes (required when ``nnodes > 1``);
            ``None``: a fresh random one.
        module: Run ``python -m SCRIPT`` instead of ``python SCRIPT``.

    Returns:
        The launcher's exit code: 0 if every rank exited 0; else the exit code of the
        rank that failed first, or 128 + N if signal N killed it; 128 + N if the launcher
        itself was stopped by signal N (130 for SIGINT, 143 for SIGTERM).

    Raises:
        ConfigError: an argument is invalid, or ``sync_dir`` cannot be created.
        OSError: a rank could not be started (the ranks already started are stopped).
    """
    script_argv = list(script_argv)
    _validate(
        script_argv,
        nproc=nproc,
        max_wait_s=max_wait_s,
        nnodes=nnodes,
        node_rank=node_rank,
        python=python,
        grace_period_s=grace_period_s,
        run_id=run_id,
        sync_dir=sync_dir,
        module=module,
    )
    if run_id is None:
        run_id = uuid.uuid4().hex[:16]
    signals = _SignalCatcher()
    signals.install()
    own_dir: Path | None = None
    try:
        if sync_dir is None:
            own_dir = _make_default_sync_dir(run_id)
            directory = own_dir
            announce(directory, run_id, nproc)
        else:
            directory = _prepare_sync_dir(sync_dir)
        if nnodes > 1 and local_filesystem(directory):
            logger.warning(
                "--sync-dir %s is on a filesystem of this host (%s): the other nodes see "
                "its files only if they mount it too (exported over NFS, say)",
                directory,
                filesystem_type(directory),
            )
        world_size = nnodes * nproc
        envs = []
        for local_rank in range(nproc):
            env = dict(os.environ)
            rank = node_rank * nproc + local_rank
            env.update(
                GRADSYNC_RANK=str(rank),
                GRADSYNC_WORLD_SIZE=str(world_size),
                GRADSYNC_SYNC_DIR=str(directory),
                GRADSYNC_RUN_ID=run_id,
                RANK=str(rank),
                WORLD_SIZE=str(world_size),
                LOCAL_RANK=str(local_rank),
                LOCAL_WORLD_SIZE=str(nproc),
                PYTHONUNBUFFERED="1",
            )
            if max_wait_s is not None:
                env["GRADSYNC_MAX_WAIT_S"] = repr(float(max_wait_s))
            envs.append((rank, env))
        argv = [python, "-m", *script_argv] if module else [python, *script_argv]
        first = node_rank * nproc
        logger.info(
            "starting ranks %d-%d of %d: run id %s, sync dir %s",
            first,
            first + nproc - 1,
            world_size,
            run_id,
            directory,
        )
        job = _Job(signals, grace_period_s, directory, own_dir=own_dir is not None)
        done = False
        try:
            job.start(argv, envs)
            code = job.supervise()
            done = True
        finally:
            # Not done (an error of the launcher's own): the watchdog stops the ranks.
            job.release_watchdog(done=done)
        if own_dir is None:
            # Ranks stopped by a signal or a peer's failure leave their files; ranks that
            # finished removed theirs. What is left of dead ranks of this host goes now,
            # not when the next job's rank 0 gets to it.
            remove_dead_jobs(directory)
        return code
    finally:
        # Remove the directory before restoring the signal handlers, so that a second
        # Ctrl-C cannot interrupt the removal halfway.
        if own_dir is not None:
            _remove_tree(own_dir)
        signals.restore()


def _validate(
    script_argv: list[str],
    *,
    nproc: int,
    max_wait_s: float | None,
    nnodes: int,
    node_rank: int,
    python: str,
    grace_period_s: float,
    run_id: str | None,
    sync_dir: str | os.PathLike[str] | None,
    module: bool,
) -> None:
    """Raise :class:`ConfigError` naming the first invalid argument and its value."""
    # The config's own checks: a value the launcher passes on is one the ranks accept.
    check_int("--nproc", nproc, minimum=1)
    if nproc > _MAX_NPROC:
        raise ConfigError(f"--nproc must be <= {_MAX_NPROC}, got {nproc!r}")
    check_int("--nnodes", nnodes, minimum=1)
    check_int("--node-rank", node_rank, minimum=0)
    if node_rank >= nnodes:
        raise ConfigError(f"--node-rank must be < --nnodes ({nnodes}), got {node_rank!r}")
    if max_wait_s is not None:
        check_seconds("--max-wait-s", max_wait_s)
    check_seconds("--grace-period-s", grace_period_s, zero_ok=True)
    if run_id is not None:
        check_run_id("--run-id", run_id)
    if nnodes > 1 and run_id is None:
        raise ConfigError(
            f"--nnodes {nnodes} needs --run-id: pass the same id to the launcher on every node"
        )
    if nnodes > 1 and sync_dir is None:
        raise ConfigError(
            f"--nnodes {nnodes} needs --sync-dir: a directory on a filesystem every node shares"
        )
    if sync_dir is not None and not os.fspath(sync_dir):
        raise ConfigError(f"--sync-dir must be a non-empty path, got {sync_dir!r}")
    if not python or shutil.which(python) is None:
        raise ConfigError(f"python interpreter {python!r} is not an executable")
    if not script_argv:
        raise ConfigError("SCRIPT is missing: give the script to run, then its arguments")
    script = script_argv[0]
    if module:
        if not script or script.startswith("-"):
            raise ConfigError(f"SCRIPT must be a module name with --module, got {script!r}")
    elif not os.path.isfile(script):
        raise ConfigError(f"SCRIPT {script!r} is not a file")


def _make_default_sync_dir(run_id: str) -> Path:
    """Create a fresh private directory on tmpfs if possible, else in the temp dir."""
    return Path(tempfile.mkdtemp(prefix=f"{DEFAULT_PREFIX}{run_id}-", dir=default_base()))


def _prepare_sync_dir(sync_dir: str | os.PathLike[str]) -> Path:
    """Create ``sync_dir`` if missing and return its absolute path."""
    path = Path(os.path.abspath(os.path.expanduser(sync_dir)))  # "--sync-dir=~/x" too
    try:
        make_sync_dir(path, f"--sync-dir {os.fspath(sync_dir)!r}")
    except SyncDirError as exc:
        raise ConfigError(str(exc)) from exc
    return path


def _remove_tree(path: Path) -> None:
    try:
        shutil.rmtree(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.warning("could not remove sync dir %s: %s", path, exc)
    else:
        logger.info("removed sync dir %s", path)


class _SignalCatcher:
    """Records SIGINT/SIGTERM/SIGHUP sent to the launcher instead of dying of them.

    Signals the launcher already ignores (``nohup``, ``cmd &``) stay ignored.

    The handler only appends to a list: it runs between bytecodes of the main thread,
    possibly while that thread holds a lock, so it must not take any.
    """

    def __init__(self) -> None:
        self.received: list[int] = []
        self._previous: dict[int, Callable[[int, FrameType | None], Any] | int | None] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            logger.debug("not in the main thread: launcher signals are not handled")
            return
        for signum in _STOP_SIGNALS:
            # Keep ignoring what the launcher was told to ignore (`nohup`, `cmd &`).
            if signal.getsignal(signum) != signal.SIG_IGN:
                self._previous[signum] = signal.signal(signum, self._handle)

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received.append(signum)


class _Output:
    """Writes the ranks' lines to the launcher's stdout or stderr, one at a time.

    A line ending in ``\\r`` (a progress bar's redraw) leaves the cursor at the start
    of a full line: the next line of another rank or stream would overwrite its start
    and leave the rest of the bar behind it ("loss 0.4225%|###"), so that line is
    ended first (the bar stays on screen, above it).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._broken: set[str] = set()
        self._redraw: tuple[str, str] | None = None  # (dest, source) of a redraw on screen

    def write(self, dest: str, text: str, source: str = "") -> None:
        """Write ``text`` to ``sys.stdout`` (``dest="stdout"``) or ``sys.stderr`` and
        flush; ``source`` names the writer (a rank's prefix) whose redraws it may
        overwrite."""
        with self._lock:
            if self._redraw is not None and self._redraw != (dest, source):
                self._emit(self._redraw[0], "\n")
            self._redraw = (dest, source) if text.endswith("\r") else None
            self._emit(dest, text)

    def settle(self, dest: str | None = None, source: str = "") -> None:
        """End the redraw on screen (only ``source``'s on ``dest``, if given) with a newline."""
        with self._lock:
            if self._redraw is not None and (dest is None or self._redraw == (dest, source)):
                self._emit(self._redraw[0], "\n")
                self._redraw = None

    def _emit(self, dest: str, text: str) -> None:
        stream = sys.stdout if dest == "stdout" else sys.stderr
        if dest in self._broken:
            return
        try:
            try:
                stream.write(text)
            except UnicodeEncodeError:
                encoding = stream.encoding or "utf-8"
                stream.write(text.encode(encoding, "replace").decode(encoding))
            stream.flush()
        except (OSError, ValueError):
            # Closed or broken (e.g. `gradsync launch ... | head`): keep draining the
            # ranks' pipes so they never block, but drop their output.
            self._broken.add(dest)


@dataclass
class _Rank:
    rank: int
    local_rank: int
    proc: subprocess.Popen[bytes]
    stderr_tail: Tail = field(default_factory=Tail)
    readers: list[threading.Thread] = field(default_factory=list)
    returncode: int | None = None
    stopped: bool = False  # still running when the launcher began stopping the job
    # Its leader was reaped and its group seen empty: the pid may now be reused by an
    # unrelated process group, which must never be signalled.
    group_gone: bool = False

    @property
    def pid(self) -> int:
        return self.proc.pid

    def exited(self) -> bool:
        """Whether its process has exited, reaped or not: one not yet reaped by its
        waiter thread has ended on its own all the same."""
        if self.returncode is not None or self.proc.returncode is not None:
            return True
        try:
            return (
                os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
            )
        except ChildProcessError:
            return True  # reaped by its waiter thread meanwhile
        except (AttributeError, OSError):
            return False  # no waitid here: it looks running


def _pump(
    pipe: IO[bytes],
    prefix: str,
    dest: str,
    output: _Output,
    tail: Tail | None,
) -> None:
    """Copy ``pipe`` to ``dest`` with ``prefix`` before every line, until EOF.

    A line ends at ``\\n``, ``\\r\\n`` or a lone ``\\r``, which is forwarded as it
    is: progress bars (tqdm) redraw their line after a ``\\r``, and each redraw then
    shows (as the next one starts) instead of all of them at the next newline. Lines
    longer than ``_MAX_LINE_BYTES`` are split, so one rank cannot exhaust memory.
    ``tail`` gets the newline-ended lines, and the last redraw if the output ends on one.
    """
    # Incremental: a line split at _MAX_LINE_BYTES may split a character too.
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    fd = pipe.fileno()
    pending = bytearray()
    cut = False  # the last line written was cut at _MAX_LINE_BYTES
    redraw: str | None = None  # the last line written, if it was a redraw

    def forward(raw: bytes | bytearray, end: bytes, *, final: bool = False) -> None:
        nonlocal cut, redraw
        # Decoded with its terminator: invalid bytes just before it become U+FFFD on
        # this line instead of waiting in the decoder for the next.
        text = decoder.decode(bytes(raw) + end, final=final)
        line = text[: len(text) - len(end)]
        was_cut, cut = cut, bool(raw) and not end
        if end == b"\r":
            if line:
                redraw = line
                output.write(dest, f"{prefix}{line}\r", prefix)
            return
        if not line and was_cut and end:
            return  # the newline of a line cut exactly at its end: no empty line after it
        redraw = None
        if tail is not None:
            tail.append(line)
        output.write(dest, f"{prefix}{line}\n", prefix)

    with pipe:
        while True:
            data = os.read(fd, _MAX_LINE_BYTES)
            # Only the new bytes, and a "\r" held back before them, can end a line: a
            # rank writing a long line a byte at a time must not cost a rescan a byte.
            scan_from = max(len(pending) - 1, 0)
            pending += data
            start = 0
            for match in _LINE_END.finditer(pending, scan_from):
                if data and match.group() == b"\r" and match.end() == len(pending):
                    break  # perhaps the first half of "\r\n"
                line, start = pending[start : match.start()], match.end()
                while len(line) > _MAX_LINE_BYTES:
                    forward(line[:_MAX_LINE_BYTES], b"")
                    line = line[_MAX_LINE_BYTES:]
                forward(line, match.group())
            del pending[:start]
            while len(pending) - pending.endswith(b"\r") >= _MAX_LINE_BYTES:
                forward(pending[:_MAX_LINE_BYTES], b"")
                del pending[:_MAX_LINE_BYTES]
            if not data:
                if pending or decoder.getstate()[0]:
                    forward(pending, b"", final=True)
                if redraw is not None:
                    output.settle(dest, prefix)  # the last redraw stays on screen
                    if tail is not None:
                        tail.append(redraw)
                if tail is not None:
                    tail.end()
                return


def _killpg(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        pass
    except PermissionError as exc:
        logger.debug("cannot send %s to process group %d: %s", _signal_name(signum), pgid, exc)


class _Job:
    """The ranks of one node: starts them, watches them, stops them together."""

    def __init__(
        self, signals: _SignalCatcher, grace_period_s: float, sync_dir: Path, *, own_dir: bool
    ) -> None:
        self._signals = signals
        self._grace_period_s = grace_period_s
        self._sync_dir = sync_dir
        self._own_dir = own_dir  # made for this job: removed after it
        self._leaving: list[threading.Thread] = []  # threads of _leave_for
        self._output = _Output()
        self._exits: queue.Queue[tuple[int, int]] = queue.Queue()
        self.ranks: list[_Rank] = []
        self._watchdog: subprocess.Popen[bytes] | None = None

    def _start_watchdog(self) -> None:
        """Start the process that stops the ranks if this launcher dies (``watchdog.py``)."""
        script = Path(__file__).with_name("watchdog.py")
        try:
            self._watchdog = subprocess.Popen(
                [
                    sys.executable,
                    "-I",
                    str(script),
                    str(os.getpid()),
                    repr(self._grace_period_s),
                    str(self._sync_dir),
                    *(["own"] if self._own_dir else []),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                start_new_session=True,  # out of reach of a Ctrl-C meant for the launcher
            )
        except OSError as exc:
            logger.warning(
                "could not start the watchdog (%s): if this launcher is killed with "
                "SIGKILL, its ranks will keep running",
                exc,
            )

    def _tell_watchdog(self, message: str) -> None:
        watchdog = self._watchdog
        if watchdog is None or watchdog.stdin is None or watchdog.stdin.closed:
            return
        try:
            watchdog.stdin.write(f"{message}\n".encode())
            watchdog.stdin.flush()
        except OSError as exc:
            logger.warning(
                "the watchdog (pid %d) is gone (%s): if this launcher is killed with "
                "SIGKILL, its ranks will keep running",
                watchdog.pid,
                exc,
            )
            with contextlib.suppress(OSError):
                watchdog.stdin.close()

    def release_watchdog(self, *, done: bool) -> None:
        """Let the watchdog go: with ``done``, the ranks are stopped or finished and it
        exits; otherwise it stops what is left of them, as after this launcher's death."""
        watchdog = self._watchdog
        if watchdog is None:
            return
        if done:
            self._tell_watchdog("done")
        self._watchdog = None
        with contextlib.suppress(OSError):
            assert watchdog.stdin is not None
            watchdog.stdin.close()
        try:
            # It exits at once after "done"; else after its grace period.
            watchdog.wait(timeout=1.0 if done else self._grace_period_s + _ABANDON_S)
        except subprocess.TimeoutExpired:
            logger.warning("the watchdog (pid %d) did not exit; leaving it", watchdog.pid)

    def start(self, argv: list[str], envs: list[tuple[int, dict[str, str]]]) -> None:
        """Start one rank per ``(rank, env)``; stop early if the launcher got a signal."""
        self._start_watchdog()
        for local_rank, (rank, env) in enumerate(envs):
            if self._signals.received:
                return
            try:
                # Each rank gets its own session, hence its own process group, so that:
                # - Ctrl-C in a terminal (SIGINT to the foreground group) reaches only the
                #   launcher, which then stops every rank in one orderly way (SIGTERM,
                #   SIGKILL after the grace period) instead of N ranks each raising
                #   KeyboardInterrupt wherever they happen to be and printing N tracebacks;
                # - killpg() reaches what a rank started itself (data loader workers...);
                # - ranks never touch the terminal (stdin is /dev/null), so they cannot be
                #   stopped by SIGTTIN.
                # The cost: a launcher killed by SIGKILL cannot stop the ranks; its
                # watchdog, told of every rank's group, does (_watchdog).
                proc = subprocess.Popen(
                    argv,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    start_new_session=True,
                )
            except OSError:
                logger.error("could not start rank %d; stopping the ranks already started", rank)
                self._stop_now()
                self.release_watchdog(done=True)
                raise
            self._tell_watchdog(f"add {proc.pid} {rank}")
            info = _Rank(rank=rank, local_rank=local_rank, proc=proc)
            prefix = f"[rank {rank}] "
            assert proc.stdout is not None
            assert proc.stderr is not None
            for pipe, dest, tail in (
                (proc.stdout, "stdout", None),
                (proc.stderr, "stderr", info.stderr_tail),
            ):
                reader = threading.Thread(
                    target=_pump,
                    args=(pipe, prefix, dest, self._output, tail),
                    name=f"gradsync-launch-rank{rank}-{dest}",
                    daemon=True,
                )
                reader.start()
                info.readers.append(reader)
            threading.Thread(
                target=self._wait,
                args=(local_rank, proc),
                name=f"gradsync-launch-rank{rank}-wait",
                daemon=True,
            ).start()
            self.ranks.append(info)
            logger.debug("started rank %d as pid %d", rank, proc.pid)

    def _wait(self, index: int, proc: subprocess.Popen[bytes]) -> None:
        self._exits.put((index, proc.wait()))

    def _note_gone_groups(self) -> None:
        """Mark the groups of reaped ranks that have no process left. Linux reuses no pid
        still naming a group, so a group seen empty here (every _POLL_S) can only come
        back as an unrelated process that got the pid after the pids wrapped around."""
        for info in self.ranks:
            # returncode first: a leader not yet reaped keeps its group alive.
            if not info.group_gone and info.proc.returncode is not None:
                info.group_gone = not group_alive(info.proc.pid)
                if info.group_gone:
                    self._tell_watchdog(f"gone {info.proc.pid}")

    def _signal_all(self, signum: int) -> None:
        # Also the groups whose leader already exited: what the rank started may live on.
        self._note_gone_groups()
        for info in self.ranks:
            if not info.group_gone:
                _killpg(info.proc.pid, signum)

    def _stop_now(self) -> None:
        """SIGKILL every rank started so far and reap them (used when starting fails)."""
        self._signal_all(signal.SIGKILL)
        for info in self.ranks:
            try:
                info.proc.wait(timeout=_ABANDON_S)
            except subprocess.TimeoutExpired:
                logger.warning("rank %d (pid %d) survived SIGKILL", info.rank, info.proc.pid)

    def supervise(self) -> int:
        """Wait for every rank, stopping all of them at the first failure or signal.

        Returns:
            The launcher's exit code, as documented in :func:`launch`.
        """
        running = {info.local_rank for info in self.ranks}
        first_failure: _Rank | None = None
        stop_signal: int | None = None
        stopping = False
        signals_seen = 0
        kill_at = 0.0
        abandon_at: float | None = None

        def begin_stop(reason: str) -> None:
            nonlocal stopping, kill_at, signals_seen
            stopping = True
            signals_seen = len(self._signals.received)
            kill_at = time.monotonic() + self._grace_period_s
            for info in self.ranks:
                # A rank that exited on its own a moment ago may not be reaped, or its
                # exit may still be queued: it was not running.
                info.stopped = not info.exited()
            names = ", ".join(str(i.rank) for i in self.ranks if i.stopped)
            self._output.settle()  # the launcher's own lines must not overwrite a bar
            if names:
                logger.warning(
                    "%s; stopping ranks (still running: %s) with SIGTERM, SIGKILL after %g s",
                    reason,
                    names,
                    self._grace_period_s,
                )
            else:  # what they started may still run: it is stopped all the same
                other = "other " if first_failure is not None else ""
                logger.warning("%s; no %srank is still running", reason, other)
            self._signal_all(signal.SIGTERM)

        if self._signals.received:
            # A signal arrived while the ranks were starting.
            stop_signal = self._signals.received[0]
            begin_stop(f"received {_signal_name(stop_signal)}")
        while True:
            if not stopping and self._signals.received:
                stop_signal = self._signals.received[0]
                begin_stop(f"received {_signal_name(stop_signal)}")
            try:
                index, returncode = self._exits.get(timeout=_POLL_S)
            except queue.Empty:
                pass
            else:
                info = self.ranks[index]
                info.returncode = returncode
                running.discard(index)
                logger.info("rank %d exited: %s", info.rank, _describe(returncode))
                if returncode != 0 and not stopping:
                    first_failure = info
                    begin_stop(f"rank {info.rank} failed ({_describe(returncode)})")
                self._leave_for(info)
                continue  # collect every exit already queued before looking at the clock
            self._note_gone_groups()
            now = time.monotonic()
            if not stopping:
                if not running:
                    break
                continue
            if abandon_at is None:
                hurry = len(self._signals.received) > signals_seen
                if not running and all(i.group_gone for i in self.ranks):
                    break
                if hurry or now >= kill_at:
                    left = ", ".join(str(self.ranks[i].rank) for i in sorted(running))
                    self._output.settle()
                    logger.warning(
                        "sending SIGKILL (%s); ranks still running: %s",
                        "launcher signalled again" if hurry else "grace period over",
                        left or "none, only processes they started",
                    )
                    self._signal_all(signal.SIGKILL)
                    abandon_at = now + _ABANDON_S
            elif not running:
                break
            elif now >= abandon_at:
                left = ", ".join(str(self.ranks[i].rank) for i in sorted(running))
                self._output.settle()
                logger.error("ranks %s survived SIGKILL; leaving them behind", left)
                break

        drain_until = time.monotonic() + _DRAIN_S
        for info in self.ranks:
            for reader in info.readers:
                reader.join(timeout=max(0.0, drain_until - time.monotonic()))
        leave_until = time.monotonic() + _LEAVE_S
        for thread in self._leaving:
            thread.join(timeout=max(0.0, leave_until - time.monotonic()))

        if first_failure is not None:
            self._output.write("stderr", failure_summary(first_failure, self.ranks))
            code = first_failure.returncode
            assert code is not None
            return code if code > 0 else 128 - code
        if stop_signal is not None:
            return 128 + stop_signal
        return 0

    def _leave_for(self, info: _Rank) -> None:
        """Leave the rank's jobs on its behalf, saying how it ended (unless it exited 0,
        below; a job whose session it closed itself keeps its own note): its peers on
        other hosts learn of it at once, not after their heartbeat timeout. In a
        thread: a hung shared filesystem must not keep the launcher from stopping the
        other ranks."""
        code = info.returncode
        assert code is not None
        if code == 0:
            # It finished (os._exit, say, skips closing): peers still in its last call
            # may not see yet, on a shared filesystem, what it published; told it is
            # gone they would fail that call. Its heartbeat tells, as before.
            return
        if stopped_by_launcher(info.stopped, code):
            how = f"was stopped by its launcher ({_describe(code)})"
        else:
            how = f"has ended ({_describe(code)})"
        thread = threading.Thread(
            target=leave_for_ended,
            args=(self._sync_dir, info.rank, info.proc.pid, how),
            name=f"gradsync-launch-rank{info.rank}-leave",
            daemon=True,
        )
        thread.start()
        self._leaving.append(thread)
