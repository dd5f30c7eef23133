"""The stateful form: :class:`GradSync`."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from types import TracebackType
from typing import Any

import numpy as np
import numpy.typing as npt

from ._async import Background, StepHandle
from ._calls import alone, check_config, checked_step
from ._config import FileGradSyncConfig
from ._elastic import run_elastic
from ._errors import GradSyncError
from ._guard import CallGuard
from ._session import Session, closing_reason
from ._stats import StepStats
from ._step.broadcast import BroadcastView, broadcast_root, broadcast_view
from ._step.engine import StepEngine
from ._step.grads import host_view, layout_like
from ._testing import fixed_wait

__all__ = ["GradSync"]

_log = logging.getLogger("gradsync")


# How long a rank whose first call has bad input waits to meet its peers and tell
# them, before it raises anyway: started together, they are there within seconds.
# GRADSYNC_TEST_WAIT_S shortens it (see _testing.py).
TELL_WAIT_S = 10.0


class GradSync(CallGuard):
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
        check_config(cfg)
        self.cfg = cfg
        self.last_stats: StepStats | None = None
        self._pid = os.getpid()
        # What the session holds in the job; a finalizer leaves it if this instance is
        # dropped unclosed (it must not hold the instance, or it would never run).
        self._session = Session(cfg.rank)
        self._finalizer = weakref.finalize(self, self._session.abandon)
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
        self._close(closing_reason(exc))

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
        return self._average(grads, step, device, dtype, None)

    def _average(
        self,
        grads: Sequence[Any],
        step: int | None,
        device: Any,
        dtype: npt.DTypeLike | Sequence[npt.DTypeLike] | None,
        scale: int | None,
        exact: bool = False,
    ) -> StepStats:
        """:meth:`average`; with ``scale``, host arrays get the mean times ``scale``
        (written in one pass: the torch backend's SUM); ``exact``: never compressed (the
        torch backend's bytes in float64 words)."""
        self._check_process()
        if self._background.busy() and not self._background.on_thread():
            # Behind the steps still in flight: calls complete in the order they are made.
            again = functools.partial(self._average, grads, step, device, dtype, scale, exact)
            return self._submit(again).wait()
        with self._call():
            self._check_usable()
            if step is None and self.cfg.elastic and self.cfg.enabled:
                self._meet()  # a joiner's first step is the job's next one
            with self._before_step():  # peers would wait max_wait_s for a rank failing here
                step = checked_step(self._next_step if step is None else step)
            self._next_step = step + 1
            try:
                if device is None:
                    call = functools.partial(self._average_host, grads, step, scale, exact)
                else:
                    call = functools.partial(self._average_device, grads, device, dtype, step)
                if self.cfg.elastic and self.cfg.enabled:
                    stats = run_elastic(self._session, self.cfg, self._closing, call, step + 1)
                else:
                    stats = call()
            except BaseException as exc:
                self._failed(exc, step)
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
        return self._submit(lambda: self._average(grads, step, device, dtype, None))

    def _average_exact_async(self, arrays: Sequence[np.ndarray]) -> StepHandle:
        """:meth:`average_async` of arrays never compressed (bytes carried in float words,
        verdicts that must stay exactly 0)."""
        return self._submit(lambda: self._average(arrays, None, None, None, None, exact=True))

    def _submit(self, call: Callable[[], StepStats]) -> StepHandle:
        """Queue ``call`` (an :meth:`_average` or :meth:`_broadcast`) on the background
        thread; its handle."""
        self._check_process()
        if self._closed or self._closing.is_set():
            raise GradSyncError(f"this GradSync (rank {self.cfg.rank}) is closed")
        return self._background.submit(call)

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
        return self._buffers_like(like, watch=True)

    def _buffers_like(self, like: Sequence[Any], *, watch: bool) -> list[np.ndarray]:
        """:meth:`buffers_like`; without ``watch``, arrays left unwritten between steps
        are fine (DiLoCo writes each step's itself, and zeros may be its value)."""
        self._check_process()
        with self._call():
            self._check_usable()
            # Only a first call is collective: a later one with bad input fails alone.
            with self._before_step() if self._session.engine is None else contextlib.nullcontext():
                layout = layout_like(like)
            if not self.cfg.enabled:
                return [np.zeros(shape, dtype=np.dtype(dtype)) for dtype, shape in layout]
            try:
                return self._started().buffers_like(layout, watch=watch)
            except BaseException as exc:
                self._failed(exc, None)
                raise

    def broadcast(self, arrays: Sequence[np.ndarray], root: int | None = None) -> None:
        """Copy ``root``'s arrays (default: the lowest-numbered rank) bit for bit into every
        other rank's, in place: one call, ordered with :meth:`average` (docs/api.md)."""
        self._check_process()
        if self._background.busy() and not self._background.on_thread():
            self._broadcast_async(arrays, root).wait()  # behind the calls in flight
        else:
            self._broadcast(arrays, root)

    def _broadcast_async(self, arrays: Sequence[np.ndarray], root: int | None) -> StepHandle:
        return self._submit(lambda: self._broadcast(arrays, root))

    def _broadcast(self, arrays: Sequence[np.ndarray], root: int | None) -> StepStats:
        with self._call():
            self._check_usable()
            step = self._next_step  # the next average's: errors name it
            elastic = self.cfg.elastic and self.cfg.enabled
            if elastic:
                self._meet()  # a joiner meets the job first: ranks are its ranks
            with self._before_step():
                chosen = broadcast_root(root, range(self.world_size))
                view = broadcast_view(arrays, receiving=chosen != self.rank)
            if not self.cfg.enabled:
                return StepStats(step=step, world_size=1, bytes_per_rank=view.nbytes)
            try:
                if not elastic:
                    return self._started().broadcast(view, chosen, step)
                first = None if root is None else self._member_at(chosen)
                call = functools.partial(self._broadcast_elastic, view, first, step)
                return run_elastic(self._session, self.cfg, self._closing, call, None)
            except BaseException as exc:
                self._failed(exc, step)
                raise

    def _member_at(self, rank: int) -> tuple[str, int]:
        """The nonce of rank ``rank``'s process now, and the rank it was started as: two
        processes may have been started as one rank (a joiner takes any)."""
        membership = self._session.membership
        assert membership is not None
        return membership.gen.members[rank].nonce, self.members[rank]

    def _broadcast_elastic(
        self, view: BroadcastView, root: tuple[str, int] | None, step: int
    ) -> StepStats:
        """An elastic broadcast from the process ``root`` (its nonce and started rank;
        None: rank 0), which the survivors of a lost rank redo; a lost ``root`` fails it
        on every rank."""
        chosen = 0
        if root is not None:
            membership = self._session.membership
            nonces = [] if membership is None else [m.nonce for m in membership.gen.members]
            if root[0] not in nonces:
                raise GradSyncError(
                    f"broadcast at step {step}: its root (started as rank {root[1]}) was lost",
                    step=step,
                    ranks=[root[1]],
                )
            chosen = nonces.index(root[0])
        return self._started().broadcast(view, chosen, step)

    def _started(self, max_wait_s: float | None = None) -> StepEngine:
        """The step engine, meeting the other ranks first if this is the first call
        (waiting ``max_wait_s`` for them, default ``cfg.max_wait_s``)."""
        fresh = self._session.engine is None
        engine = self._session.start(self.cfg, self._closing, max_wait_s)
        joined = self._session.membership
        if fresh and joined is not None and joined.next_step is not None:
            self._next_step = joined.next_step  # it joined a running job
        return engine

    def _meet(self) -> None:
        """Meet the other ranks now (an elastic joiner learns the job's next step)."""
        if self._session.engine is None:
            try:
                self._started()
            except BaseException as exc:
                self._failed(exc, None)
                raise

    def _average_host(
        self, grads: Sequence[Any], step: int, scale: int | None, exact: bool
    ) -> StepStats:
        if self._session.engine is None:
            # Checked before the session starts: one rank has nothing to meet. Later
            # calls' steps check them (telling the peers of a failure).
            with self._before_step():
                view = host_view(grads)
            if not self.cfg.enabled:
                stats = alone(self.cfg, view.arrays, step, sum(a.nbytes for a in view.arrays))
                if scale is not None:
                    for a in view.arrays:
                        np.multiply(a, scale, out=a)
                return stats
            return self._started().step(view, step, scale=scale, exact=exact)
        return self._session.engine.step(grads, step, scale=scale, exact=exact)

    def _average_device(
        self, buffers: Sequence[Any], device: Any, dtype: Any, step: int
    ) -> StepStats:
        gpu = self._session.gpu
        with self._before_step():
            dtypes = gpu.dtypes(buffers, device, dtype)
            if not self.cfg.enabled:
                arrays = gpu.alone(buffers, dtypes, check_finite=self.cfg.check_finite)
                return alone(self.cfg, arrays, step, sum(int(b.size) for b in buffers))
            view, download_s = gpu.host_view(buffers, dtypes, self._session.engine)
        stats = self._started().step(view, step, gpu.sink(buffers, dtypes))
        return dataclasses.replace(stats, download_s=download_s, total_s=stats.total_s + download_s)

    @contextlib.contextmanager
    def _before_step(self) -> Iterator[None]:
        """Work of a call before its step: a failure tells the peers, which would wait
        ``max_wait_s`` for this rank otherwise. In a first call, an error (bad input, or
        one gradsync did not foresee) still meets them (for up to ``TELL_WAIT_S``), to
        tell them; an interrupt there does not."""
        try:
            yield
        except BaseException as exc:
            if self.cfg.enabled and (
                self._session.engine is not None or isinstance(exc, Exception)
            ):
                try:
                    self._started(max_wait_s=fixed_wait(TELL_WAIT_S)).give_up(exc)
                    self._fail(exc)
                except GradSyncError as unmet:
                    _log.warning(
                        "rank %d could not tell its peers why it failed: %s", self.cfg.rank, unmet
                    )
            raise
