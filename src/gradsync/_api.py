"""The public entry points: :class:`GradSync` and :func:`average_grads_file_sync`."""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from ._async import Background, StepHandle
from ._config import FileGradSyncConfig
from ._errors import ConfigError, GradSyncError, InvalidGradsError, clip, name_the_step
from ._job.rendezvous import Generation, leave, rendezvous
from ._stats import StepStats
from ._step.buffers import SharedBuffers
from ._step.engine import Deliver, StepEngine, nonfinite_params, validate_grads
from ._step.header import Layout
from ._step.peers import nonfinite_error
from ._step.reduce import check_dtype
from ._testing import fixed_wait

if TYPE_CHECKING:
    from ._gpu.bridge import WgpuBridge

__all__ = ["GradSync", "average_grads_file_sync"]

_log = logging.getLogger("gradsync")


# How long a rank whose first call has bad input waits to meet its peers and tell
# them, before it raises anyway: started together, they are there within seconds.
# GRADSYNC_TEST_WAIT_S shortens it (see _testing.py).
TELL_WAIT_S = 10.0

# Forks this process's line has been through: a GradSync made before the last one
# belongs to an ancestor. Counted by a hook rather than compared by pid, which would
# be a system call in every step.
_forks_seen = 0


def _count_fork() -> None:
    global _forks_seen
    _forks_seen += 1


os.register_at_fork(after_in_child=_count_fork)


class GradSync:
    """Averages gradients with the other ranks of a job, once per optimizer step.

    The ranks meet on the first :meth:`average` call (a rendezvous that ignores
    files of earlier runs in ``cfg.sync_dir``). Use as a context manager, or call
    :meth:`close`, so that the run's files are removed when every rank is done. An
    instance dropped unclosed leaves the job when it is collected, or at exit.

    After any failed step the instance is unusable (its peers have given up on the
    step too) and has left the job: every rank must create a new one. It belongs to
    the process that created it: a forked child can neither use nor close it (closing
    it there, even at exit, leaves the parent's session alone).
    """

    def __init__(self, cfg: FileGradSyncConfig) -> None:
        _check_config(cfg)
        self.cfg = cfg
        self.last_stats: StepStats | None = None
        self._pid = os.getpid()
        # What the session holds in the job; a finalizer leaves it if this instance is
        # dropped unclosed (it must not hold the instance, or it would never run).
        self._session = _Session(_forks_seen)
        self._finalizer = weakref.finalize(self, self._session.abandon)
        # GPU gradients are downloaded straight into shared arrays of the engine's
        # (publishing them then copies nothing), kept per buffer layout.
        self._device_layout: Layout | None = None
        self._device_shared: SharedBuffers | None = None
        self._failure: BaseException | None = None
        self._closed = False
        self._next_step = 0
        self._lock = threading.Lock()
        self._inside = threading.local()  # .active: this thread is in a call (or waits for one)
        self._close_requested = False  # close() re-entered that call (a signal handler)
        # Set by close(): a call waiting for peers in another thread gives up.
        self._closing = threading.Event()
        self._background = Background(f"gradsync rank {cfg.rank}")  # average_async's thread

    def __enter__(self) -> GradSync:
        """Enter a block at whose end it closes.

        Raises:
            GradSyncError: it is closed (a failed one is entered: leaving closes it).
        """
        if self._closed:
            raise GradSyncError(f"this GradSync (rank {self.cfg.rank}) is closed")
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._close(_closing_reason(exc))

    def __repr__(self) -> str:
        state = "closed" if self._closed else "failed" if self._failure else "open"
        return (
            f"GradSync(rank={self.cfg.rank}, world_size={self.cfg.world_size}, "
            f"sync_dir={str(self.cfg.sync_dir)!r}, {state})"
        )

    @property
    def generation_dir(self) -> str | None:
        """This job's directory inside ``sync_dir``, once the ranks have met."""
        return None if self._session.gen is None else str(self._session.gen.path)

    def average(
        self,
        grads: Sequence[Any],
        *,
        step: int | None = None,
        device: Any = None,
        dtype: npt.DTypeLike | Sequence[npt.DTypeLike] | None = None,
    ) -> StepStats:
        """Replace every gradient with its mean over all ranks, in place.

        Args:
            grads: numpy arrays (float16/32/64, C-contiguous, writeable) when
                ``device`` is None; wgpu ``GPUBuffer``s when ``device`` is a wgpu
                ``GPUDevice``. Every rank passes the same shapes and dtypes in the
                same order.
            step: The optimizer step; every rank must pass the same number. Default:
                0, 1, 2... counted by this instance.
            device: A wgpu ``GPUDevice`` owning the buffers in ``grads``, or None.
                The copies of the mean into the buffers are queued on its queue before
                this returns, not waited for: work submitted later sees the mean.
            dtype: Element type of GPU buffers (one for all, or one per buffer);
                float32 by default. Ignored for numpy arrays.

        Returns:
            The step's timings (also kept in :attr:`last_stats`).

        Raises (every one a :class:`GradSyncError`):
            ConfigError: ``step`` is not an int in the signed 64-bit range.
            InvalidGradsError: the gradients cannot be averaged in place.
            MismatchError: ranks passed different layouts or step numbers, or (first
                call) were configured with different world sizes, strategy, wide_sum,
                check_finite or checksums.
            NonFiniteGradError: with ``check_finite``, a rank's gradients hold NaN/Inf.
            PeerLostError: a peer died; PeerTimeoutError: live peers did not publish
                within ``max_wait_s``; PeerAbortedError: a peer failed the step.
            RendezvousError: (first call) the ranks could not form a job.
            SyncDirError: the sync directory could not be read or written.
            CorruptFileError: a peer's file failed its header or checksum checks.
            WgpuBridgeError: a GPU copy failed (the device was lost, say).
            GradSyncError: this instance is closed or an earlier step failed.
        """
        self._check_process()
        if self._background.busy() and not self._background.on_thread():
            # Behind the steps still in flight: calls complete in the order they are made.
            return self.average_async(grads, step=step, device=device, dtype=dtype).wait()
        with self._call():
            self._check_usable()
            with self._before_step():  # peers would wait max_wait_s for a rank failing here
                step = _checked_step(self._next_step if step is None else step)
            self._next_step = step + 1
            try:
                if device is None:
                    stats = self._average_host(grads, step)
                else:
                    stats = self._average_device(grads, device, dtype, step)
            except BaseException as exc:
                if self._session.gen is not None or isinstance(exc, GradSyncError):
                    self._fail(exc)
                if isinstance(exc, GradSyncError):
                    # After the peers were told: their message names the step already.
                    name_the_step(exc, step, self.cfg.rank)
                raise
            self.last_stats = stats
            return stats

    def average_async(
        self,
        grads: Sequence[Any],
        *,
        step: int | None = None,
        device: Any = None,
        dtype: npt.DTypeLike | Sequence[npt.DTypeLike] | None = None,
    ) -> StepHandle:
        """Start :meth:`average` on this GradSync's background thread; its handle.

        Calls complete in the order they were made (``average`` too waits for those
        before it); ``grads`` belong to gradsync until ``handle.wait()`` returns, which
        gives the step's timings or raises its error (``handle.done()``: whether it is
        over). :meth:`close` ends them: the step waiting for peers gives up, as a call of
        another thread does, and those not started fail.

        Raises:
            GradSyncError: this instance is closed, or belongs to another process.
        """
        self._check_process()
        if self._closed or self._closing.is_set():
            raise GradSyncError(f"this GradSync (rank {self.cfg.rank}) is closed")
        return self._background.submit(
            lambda: self.average(grads, step=step, device=device, dtype=dtype)
        )

    def buffers_like(self, like: Sequence[Any]) -> list[np.ndarray]:
        """Zero-filled gradient arrays shaped like ``like`` that :meth:`average` publishes
        without copying them.

        Averaging exactly these arrays (or any views of all their memory, such as
        ``tensor.numpy()`` of ``torch.from_numpy(buffer)``) skips the copy of each
        step's gradients into this rank's data file: the arrays are that file, mapped.
        Other arrays can still be averaged; they never touch these. Where the copy
        cannot be skipped (a sync dir on a filesystem shared between hosts,
        gradients under 256 KiB in all, ``strategy="root"``, one rank), the arrays
        are ordinary ones. They stay usable after :meth:`close`, no longer shared.

        Like :meth:`average`, the first call meets the other ranks: call it on every
        rank. A later call allocates new arrays (the earlier ones stop being shared).
        A step given these arrays with nothing written into them since the last one
        (torch's ``zero_grad()`` default dropped them as ``p.grad``) raises
        :class:`InvalidGradsError`: zero them with ``zero_grad(set_to_none=False)``.

        Args:
            like: numpy arrays (or array-likes) of float16/32/64; only their shapes and
                dtypes are used. For torch: ``[p.detach().numpy() for p in params]``.

        Raises:
            InvalidGradsError: ``like`` is empty, not a sequence, or has an unsupported
                dtype (naming the param).
            SyncDirError: the file could not be created or sized.
            GradSyncError: this instance is closed or an earlier step failed; or the
                rendezvous failed (see :meth:`average`).
        """
        self._check_process()
        with self._call():
            self._check_usable()
            # Only a first call is collective: a later one with bad input fails alone.
            with self._before_step() if self._session.engine is None else contextlib.nullcontext():
                value: object = like  # checked at run time: callers are not type-checked
                if isinstance(value, np.ndarray) or not isinstance(value, Sequence):
                    raise InvalidGradsError(
                        "like must be a sequence (list or tuple) of arrays, got "
                        f"{type(value).__name__}"
                    )
                if not like:
                    raise InvalidGradsError("like is empty: pass at least one array")
                arrays = [_as_array(x, i) for i, x in enumerate(like)]
                layout = tuple(
                    (check_dtype(a.dtype, f"param {i}").str, a.shape)  # as the step's layout
                    for i, a in enumerate(arrays)
                )
            if not self.cfg.enabled:
                return [np.zeros(shape, dtype=np.dtype(dtype)) for dtype, shape in layout]
            try:
                return self._started().buffers_like(layout)
            except BaseException as exc:
                if self._session.gen is not None or isinstance(exc, GradSyncError):
                    self._fail(exc)
                raise

    @contextlib.contextmanager
    def _call(self, *, closing: bool = False) -> Iterator[None]:
        """Hold the lock for one call; a close() that a signal handler made during it
        (re-entering this thread) is carried out once it is over."""
        if getattr(self._inside, "active", False):
            # A signal handler's call during a call of its own thread would wait for the
            # lock that thread holds, forever.
            raise GradSyncError(
                f"GradSync (rank {self.cfg.rank}) was called from within one of its own calls "
                "on this thread (a signal handler?); only close() may be called there",
                ranks=[self.cfg.rank],
            )
        # Marked before the lock is taken and cleared after it is let go: a handler
        # that runs anywhere in between must not wait for the lock its thread holds.
        self._inside.active = True
        try:
            with self._lock:
                self._session.busy = not closing
                try:
                    yield
                finally:
                    self._session.busy = False
        finally:
            self._inside.active = False
            if self._close_requested and not closing:
                self._close_requested = False
                self.close()

    def _check_process(self) -> None:
        # Checked before taking the lock: a fork copies it held if a thread of the
        # parent was inside a call at that moment.
        if _forks_seen != self._session.forks:
            raise GradSyncError(
                f"this GradSync (rank {self.cfg.rank}) belongs to process {self._pid}; "
                f"process {os.getpid()} is a fork of it and cannot average with it "
                "(create a GradSync in the child, as a rank of its own)",
                ranks=[self.cfg.rank],
            )

    def _check_usable(self) -> None:
        # Closing (from another thread, with this call racing it for the lock), or left
        # without a failure (abandoned at exit): no new call starts.
        abandoned = self._session.left and self._failure is None
        if self._closed or self._closing.is_set() or abandoned:
            raise GradSyncError(f"this GradSync (rank {self.cfg.rank}) is closed")
        if self._failure is not None:
            raise GradSyncError(
                f"an earlier step of this GradSync (rank {self.cfg.rank}) failed "
                f"({self._failure}); every rank must create a new GradSync",
                ranks=[self.cfg.rank],
            ) from self._failure

    def _started(self, max_wait_s: float | None = None) -> StepEngine:
        """The step engine, meeting the other ranks first if this is the first call
        (waiting ``max_wait_s`` for them, default ``cfg.max_wait_s``)."""
        if self._session.engine is None:
            cfg = self.cfg
            if max_wait_s is not None and max_wait_s < cfg.max_wait_s:
                cfg = dataclasses.replace(cfg, max_wait_s=max_wait_s)
            self._session.gen = rendezvous(cfg, self._closing)
            # From here on, a failure (an interrupt too) leaves the generation.
            self._session.engine = StepEngine(self.cfg, self._session.gen, self._closing)
        return self._session.engine

    def _average_host(
        self, grads: Sequence[Any], step: int, deliver: Deliver | None = None
    ) -> StepStats:
        if self._session.engine is None:
            # Checked before the session starts: one rank has nothing to meet.
            with self._before_step():
                arrays = validate_grads(grads)
            if not self.cfg.enabled:
                # One rank: nothing to average, but check_finite still stops a step with
                # NaN/Inf, as it would with peers (a job debugged alone sees the same).
                if self.cfg.check_finite:
                    self._check_finite_alone(arrays, step)
                nbytes = sum(a.nbytes for a in arrays)
                return StepStats(step=step, world_size=1, bytes_per_rank=nbytes)
        return self._started().step(grads, step, deliver)

    @contextlib.contextmanager
    def _before_step(self) -> Iterator[None]:
        """Work of a call before its step: a failure tells the peers, which would wait
        ``max_wait_s`` for this rank otherwise. In a first call, bad input still meets
        them (for up to ``TELL_WAIT_S``), to tell them; an interrupt there does not."""
        try:
            yield
        except BaseException as exc:
            if self.cfg.enabled and (
                self._session.engine is not None or isinstance(exc, GradSyncError)
            ):
                try:
                    self._started(max_wait_s=fixed_wait(TELL_WAIT_S)).give_up(exc)
                    self._fail(exc)
                except GradSyncError as unmet:
                    _log.warning(
                        "rank %d could not tell its peers why it failed: %s", self.cfg.rank, unmet
                    )
            raise

    def _check_finite_alone(self, arrays: Sequence[np.ndarray], step: int) -> None:
        """Raise the NonFiniteGradError peers would for NaN/Inf in this lone rank's
        ``arrays``."""
        bad = nonfinite_params(arrays)
        if bad:
            raise nonfinite_error([(self.cfg.rank, i) for i in bad], step, None)

    def _average_device(
        self, buffers: Sequence[Any], device: Any, dtype: Any, step: int
    ) -> StepStats:
        # Imported here: importing gradsync or averaging numpy arrays never loads wgpu.
        from ._gpu.bridge import WgpuBridge, import_wgpu  # noqa: PLC0415

        with self._before_step():
            # As validate_grads would at the step: checked first, because one rank has no
            # step, and more ranks would otherwise copy nothing from the GPU to find out.
            if isinstance(buffers, list | tuple) and not buffers:
                raise InvalidGradsError("grads is empty: pass at least one gradient buffer")
            if self._session.bridge is None or self._session.bridge.device is not device:
                if not isinstance(device, import_wgpu().GPUDevice):
                    raise InvalidGradsError(
                        "device must be a wgpu GPUDevice (or None for numpy arrays), got "
                        f"{type(device).__name__}"
                    )
                if self._session.bridge is not None:
                    self._session.bridge.close()
                self._session.bridge = WgpuBridge(device)
            dtypes = self._session.bridge._resolve(buffers, np.float32 if dtype is None else dtype)
            bridge = self._session.bridge
            if not self.cfg.enabled:
                # One rank: the mean is the input; still check the buffers, copy nothing.
                bridge._check_without_copying(buffers)
                if self.cfg.check_finite:
                    # Except to look for NaN/Inf, which stop the step as they would with
                    # peers (and as _average_host does for arrays).
                    self._check_finite_alone(bridge._download(buffers, dtypes, None), step)
                nbytes = sum(int(b.size) for b in buffers)
                return StepStats(step=step, world_size=1, bytes_per_rank=nbytes)
            bridge._check_upload_target(buffers)  # before the step, which the peers join
            shared = self._device_arrays(bridge, buffers, dtypes)
            t0 = time.perf_counter()
            host = bridge._download(buffers, dtypes, shared)
            download_s = time.perf_counter() - t0
        # The mean goes from the shared files to the GPU (queued, not waited for),
        # without first being copied into the host arrays.
        stats = self._average_host(
            host, step, lambda pieces: bridge._upload_pieces(buffers, dtypes, pieces)
        )
        if self._session.engine is not None:
            # Known once the peers are met (threads depend on the ranks on this host).
            bridge.threads = self._session.engine.workers.threads
        return dataclasses.replace(stats, download_s=download_s, total_s=stats.total_s + download_s)

    def _device_arrays(
        self, bridge: WgpuBridge, buffers: Sequence[Any], dtypes: list[np.dtype[Any]]
    ) -> list[np.ndarray] | None:
        """Shared host arrays for these GPU buffers, or None: on the first step (the
        ranks have not met), where sharing saves nothing, or where the caller's own
        :meth:`buffers_like` arrays hold the engine's one shared set (never taken over)."""
        engine = self._session.engine
        if engine is None:
            return None
        layout = bridge._get_layout(buffers, dtypes).host_layout
        if layout != self._device_layout:
            previous, current = self._device_shared, engine.shared
            self._device_layout, self._device_shared = layout, None
            if current is None or current is previous:
                try:
                    # Plain arrays (dropped) where nothing is saved; unwatched: a step
                    # delivers the mean to the GPU, never into them.
                    engine.buffers_like(layout, watch=False)
                except GradSyncError as exc:
                    # Outside a step no peer would hear of it: copy as before, and let the
                    # step itself fail (telling the peers) if the sync dir is unusable.
                    _log.warning("rank %d: GPU gradients will be copied: %s", self.cfg.rank, exc)
                if engine.shared is not current:
                    self._device_shared = engine.shared
        shared = self._device_shared
        if shared is None or engine.shared is not shared:
            return None
        return list(shared.arrays)

    def close(self) -> None:
        """Leave the job. The last rank to close removes the job's directory. Idempotent.

        No call starts once it is called. A call of another thread that is waiting for
        peers (or meeting them) gives up at once with :class:`GradSyncError`; one that is
        copying or reducing ends first.
        Called from a signal handler during a call of the same thread, it takes effect
        when that call returns or raises. In a forked child (at exit too) this only
        marks the child's copy closed: the session, its files and its peers belong to
        the parent process.
        """
        self._close(None)

    def _close(self, why: str | None) -> None:
        """close(), telling peers that still wait for this rank ``why`` it closed
        ("raising ZeroDivisionError: division by zero"), if it is the first close."""
        if _forks_seen != self._session.forks:
            self._closed = True
            return
        self._closing.set()  # a call waiting for peers gives up
        if getattr(self._inside, "active", False):
            # Re-entered from a call of this thread (a signal handler ran during it):
            # closed as soon as that call is over.
            self._close_requested = True
            return
        # Interrupted, it still counts as called: no call starts (and other threads'
        # closes, which share the flag, still end their waits).
        with self._call(closing=True):
            if self._closed:
                return
            self._closed = True
            self._session.leave(why)
            _registry_forget(self)
        self._background.close()  # the steps still queued fail: this instance is closed

    def _fail(self, exc: BaseException) -> None:
        """End the session after a failed call (its peers give up on it too). It leaves
        the job at once: a new session of the same job may start before this instance
        is closed, or even if it never is."""
        self._failure = exc
        self._session.leave()


class _Session:
    """What a GradSync holds in its job: the generation, the step engine, the GPU bridge."""

    def __init__(self, forks: int) -> None:
        self.gen: Generation | None = None
        self.engine: StepEngine | None = None
        self.bridge: WgpuBridge | None = None
        self.forks = forks
        self.left = False
        self.busy = False  # a call of the GradSync is in progress

    def abandon(self) -> None:
        """Leave, for a GradSync dropped without close() or still open at exit, unless a
        call (in a daemon thread, at exit) is still using the session."""
        if not self.busy:
            self.leave(_uncaught_at_exit())

    def leave(self, why: str | None = None) -> None:
        """Leave the job and free what the session holds; only once, and never from a
        fork (at a forked child's exit the session is the parent's). ``why``: what
        made the rank close its session, for peers that still wait for it."""
        if self.left or _forks_seen != self.forks:
            return
        self.left = True
        try:
            if self.engine is not None:
                self.engine.close()  # joins threads: a Ctrl-C can land in it
            elif self.gen is not None and self.gen.heartbeat is not None:
                self.gen.heartbeat.stop()  # met the peers, but the engine never started
        finally:
            # Only once (above): the peers must learn that this rank left even so.
            try:
                if self.gen is not None:
                    calls = 0 if self.engine is None else self.engine.completed
                    leave(self.gen, calls, f"closed its gradsync session ({why})" if why else None)
            finally:
                if self.bridge is not None:
                    self.bridge.close()


# The function form's sessions, one per job and rank this process averages as.
_registry: dict[tuple[str, str | None, int, int], GradSync] = {}
# Re-entrant: a signal handler's close() may run while its thread holds it.
_registry_lock = threading.RLock()


def _job_key(cfg: FileGradSyncConfig) -> tuple[str, str | None, int, int]:
    return (os.path.abspath(cfg.sync_dir), cfg.run_id, cfg.world_size, cfg.rank)


def _registry_forget(sync: GradSync) -> None:
    key = _job_key(sync.cfg)
    with _registry_lock:
        if _registry.get(key) is sync:
            del _registry[key]


@atexit.register
def _close_all() -> None:
    why = _uncaught_at_exit()
    with _registry_lock:
        syncs = list(_registry.values())
    for sync in syncs:
        try:
            sync._close(why)
        except Exception:  # at exit, one failure must not hide the others
            _log.exception("closing %r at exit failed", sync)


def _closing_reason(exc: BaseException | None) -> str | None:
    """What peers are told of an exception leaving a ``with`` block: nothing for none,
    for ``sys.exit(0)`` or for a generator closed (ends, not failures)."""
    if exc is None or isinstance(exc, GeneratorExit):
        return None
    if isinstance(exc, SystemExit):
        return None if exc.code in (None, 0) else f"raising SystemExit({exc.code!r})"
    return f"raising {_exception_text(exc)}"


def _uncaught_at_exit() -> str | None:
    """What ends this program, if an uncaught exception does: the interpreter keeps
    the one it printed in ``sys.last_value``. Others keep theirs there too (pytest a
    failed test's, a REPL or notebook any statement's), so it counts only when its
    traceback runs through the main module's top level, outside a REPL or notebook."""
    if hasattr(sys, "ps1") or sys.flags.interactive or "IPython" in sys.modules:
        return None
    exc = getattr(sys, "last_value", None)
    if not isinstance(exc, BaseException):
        return None
    tb = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__main__":
            return f"at exit, after an uncaught {_exception_text(exc)}"
        tb = tb.tb_next
    return None


def _exception_text(exc: BaseException) -> str:
    """``ZeroDivisionError: division by zero``: its type and its message's first line,
    at most 200 characters, for a one-line message of a peer (a gradsync error's type
    only: its message, about other ranks, is this rank's to show)."""
    if isinstance(exc, GradSyncError):
        return type(exc).__name__
    try:
        lines = str(exc).strip().splitlines()
    except Exception:  # a broken __str__ must not replace the exception being raised
        lines = []
    return clip(f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__)


def _checked_step(step: object) -> int:
    """``step`` as an int, or ConfigError: headers keep it as a signed 64-bit integer."""
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
        raise ConfigError(f"step must be an int, got {step!r}")
    value = int(step)
    if not -(2**63) <= value < 2**63:
        raise ConfigError(f"step must fit in a signed 64-bit integer, got {value}")
    return value


def _as_array(x: object, i: int) -> np.ndarray:
    """``buffers_like``'s param ``i`` as an array (only its shape and dtype are used)."""
    try:
        return np.asarray(x)
    except Exception as exc:  # torch: a tensor that requires grad, a bfloat16 tensor
        raise InvalidGradsError(
            f"param {i} ({type(x).__name__}) cannot be read as a numpy array: "
            f"{type(exc).__name__}: {exc} (for torch: p.detach().numpy() of a float16/32/64 "
            "tensor)"
        ) from exc


def _check_config(cfg: object) -> None:
    if not isinstance(cfg, FileGradSyncConfig):
        raise ConfigError(f"cfg must be a FileGradSyncConfig, got {type(cfg).__name__}")


def average_grads_file_sync(
    grads: Sequence[Any],
    device: Any,
    cfg: FileGradSyncConfig,
    step: int,
    *,
    dtype: npt.DTypeLike | Sequence[npt.DTypeLike] | None = None,
) -> StepStats:
    """Average ``grads`` in place over all ranks of ``cfg``'s job; call once per step.

    The first call for a given ``cfg`` meets the other ranks; later calls reuse
    that session, which is closed at interpreter exit. After a call that failed, the
    next call for ``cfg`` meets the other ranks anew (each of them must call again).
    ``device`` is None for numpy arrays, or the wgpu ``GPUDevice`` that owns the
    ``GPUBuffer``s in ``grads``. See :meth:`GradSync.average` for arguments, return
    value and errors.
    """
    _check_config(cfg)  # before the registry: an unhashable cfg would raise TypeError
    key = _job_key(cfg)
    with _registry_lock:
        sync = _registry.get(key)
        if sync is not None and sync.cfg != cfg:
            # A second session of the same rank would meet itself as a rival.
            changed = ", ".join(
                f"{f.name} {getattr(sync.cfg, f.name)!r} then {getattr(cfg, f.name)!r}"
                for f in dataclasses.fields(cfg)
                if getattr(sync.cfg, f.name) != getattr(cfg, f.name)
            )
            raise ConfigError(
                f"rank {cfg.rank} of the job in {cfg.sync_dir} (run_id {cfg.run_id!r}) is "
                f"averaged in this process with another config ({changed}): pass the same "
                "config on every call"
            )
        if sync is None:
            sync = _registry[key] = GradSync(cfg)
    try:
        return sync.average(grads, step=step, device=device, dtype=dtype)
    except BaseException:
        if sync._failure is not None:
            _registry_forget(sync)  # ended: the next call starts a new session
        raise
