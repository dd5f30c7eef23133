"""Steps run in the background: one thread per GradSync runs its calls in the order made."""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable

from ._errors import GradSyncError
from ._stats import StepStats

__all__ = ["Background", "StepHandle"]

_log = logging.getLogger("gradsync")

# How long the thread waits for a next step before it ends (the next one starts another).
IDLE_S = 5.0


class StepHandle:
    """A step :meth:`GradSync.average_async` started: its arrays belong to gradsync until
    :meth:`wait` returns."""

    def __init__(self) -> None:
        self._finished = threading.Event()
        self._stats: StepStats | None = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[StepHandle], None]] = []
        self._lock = threading.Lock()

    def done(self) -> bool:
        """Whether the step is over (averaged, or failed); :meth:`wait` then returns at once."""
        return self._finished.is_set()

    def wait(self) -> StepStats:
        """Wait for the step; its timings, or the step's error raised here.

        Never call it from a callback of an earlier step (it runs on the thread that
        would have to finish this one).
        """
        self._finished.wait()
        if self._error is not None:
            raise self._error
        assert self._stats is not None
        return self._stats

    def add_done_callback(self, fn: Callable[[StepHandle], None]) -> None:
        """Call ``fn(handle)`` once the step is over: on gradsync's thread, before any
        later step starts (or here and now, if it is over already)."""
        with self._lock:
            if not self._finished.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def _finish(self, stats: StepStats | None, error: BaseException | None) -> None:
        with self._lock:
            self._stats, self._error = stats, error
            callbacks, self._callbacks = self._callbacks, []
            self._finished.set()
        for fn in callbacks:
            try:
                fn(self)
            except Exception:  # one callback's failure must not stop the thread or the others
                _log.exception("a callback of a gradsync step raised")


class Background:
    """Runs step callables one at a time, in order, on one daemon thread started on demand.

    A step that raises has its error delivered to its handle; later steps still run (a
    failed GradSync makes each of them fail at once, with its own error).
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: collections.deque[tuple[Callable[[], StepStats], StepHandle]] = (
            collections.deque()
        )
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._pending = 0  # queued or running
        self._closed = False

    def submit(self, step: Callable[[], StepStats]) -> StepHandle:
        """Queue ``step`` after every step submitted before it; its handle.

        From a step's callback (this thread) it runs at once, before the steps queued:
        right after the step whose callback it is, on every rank alike (waiting for
        it there would wait for this thread itself).
        """
        handle = StepHandle()
        with self._cond:
            if self._closed:
                raise GradSyncError(f"{self._name} is closed")
            self._pending += 1
            inline = self.on_thread()
            if not inline:
                self._queue.append((step, handle))
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                    self._thread.start()
                self._cond.notify()
        if inline:
            self._run_one(step, handle)
        return handle

    def busy(self) -> bool:
        """Whether a submitted step is queued or running."""
        with self._cond:
            return self._pending > 0

    def on_thread(self) -> bool:
        """Whether the caller is this background thread (a step's callback)."""
        return self._thread is not None and threading.current_thread() is self._thread

    def close(self) -> None:
        """Accept no more steps, let the queued ones run (or fail) and stop the thread.

        From the thread itself (a callback closing the GradSync) it does not wait."""
        with self._cond:
            self._closed = True
            self._cond.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._queue and not self._closed:
                    self._cond.wait(IDLE_S)
                if not self._queue:
                    # Closed, or idle: a GradSync dropped unclosed leaves no thread behind.
                    self._thread = None
                    return
                step, handle = self._queue.popleft()
            self._run_one(step, handle)

    def _run_one(self, step: Callable[[], StepStats], handle: StepHandle) -> None:
        try:
            stats = step()
        except BaseException as exc:  # the caller's to see, in wait()
            self._done(handle, None, exc)
        else:
            self._done(handle, stats, None)

    def _done(
        self, handle: StepHandle, stats: StepStats | None, error: BaseException | None
    ) -> None:
        try:
            handle._finish(stats, error)
        finally:
            with self._cond:
                self._pending -= 1
