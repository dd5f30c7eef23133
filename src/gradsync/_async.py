"""Steps run in the background: one thread per GradSync runs its calls in the order made."""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

from ._errors import GradSyncError
from ._stats import StepStats

__all__ = ["Background", "StepHandle"]

_log = logging.getLogger("gradsync")
T = TypeVar("T")

# How long the thread waits for a next step before it ends (the next one starts another).
IDLE_S = 5.0


class StepHandle:
    """A step :meth:`GradSync.average_async` started: its arrays belong to gradsync until
    :meth:`wait` returns."""

    def __init__(self, background: Background, seq: int) -> None:
        self._background = background
        self._seq = seq  # its place in the order the steps were started
        self._finished = threading.Event()
        self._stats: StepStats | None = None
        self._error: BaseException | None = None
        # Each callback with the last step started when it was added.
        self._callbacks: list[tuple[Callable[[StepHandle], None], int]] = []
        self._lock = threading.Lock()

    def done(self) -> bool:
        """Whether the step is over (averaged, or failed); :meth:`wait` then returns at once."""
        return self._finished.is_set()

    def wait(self) -> StepStats:
        """Wait for the step; its timings, or the step's error raised here.

        Never call it from a callback of an earlier step for a step started after that
        callback was added (it runs on the thread that would have to finish this one).
        """
        self._finished.wait()
        if self._error is not None:
            raise self._error
        assert self._stats is not None
        return self._stats

    def add_done_callback(self, fn: Callable[[StepHandle], None]) -> None:
        """Call ``fn(handle)`` once the step is over: on gradsync's thread, or here and now
        if it is over already. A step ``fn`` starts takes this call's place in the order:
        after every step started before it, before any started after it, on every rank
        alike however the timing falls."""
        bg = self._background
        with bg.guard(self._lock):
            at = bg.last_seq
            if not self._finished.is_set():
                self._callbacks.append((fn, at))
                return
        bg.run_placed(at, functools.partial(fn, self))

    def _finish(self, stats: StepStats | None, error: BaseException | None) -> None:
        with self._background.guard(self._lock):
            self._stats, self._error = stats, error
            callbacks, self._callbacks = self._callbacks, []
            self._finished.set()
        for fn, at in callbacks:
            try:
                self._background.run_placed(at, functools.partial(fn, self))
            except BaseException:  # SystemExit too: the thread must live for later steps
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
        self.last_seq = 0  # of the last step started
        # .holding: this thread holds (or is taking) one of the locks here; .place: the
        # place in the order of the callback running on this thread.
        self._local = threading.local()

    @contextlib.contextmanager
    def guard(self, lock: threading.Lock | threading.Condition) -> Iterator[None]:
        """Hold ``lock``, marked first: a signal handler's close() meanwhile must not wait
        for the thread, which may be waiting for this very lock."""
        self._local.holding = getattr(self._local, "holding", 0) + 1
        try:
            with lock:
                yield
        finally:
            self._local.holding -= 1

    def submit(self, step: Callable[[], StepStats]) -> StepHandle:
        """Queue ``step`` after every step submitted before it; its handle.

        From a step's callback (this thread) it runs at once, once the steps started
        before the callback was added have: where the callback was added, on every rank
        alike (waiting for it there would wait for this thread itself).
        """
        with self.guard(self._cond):
            if self._closed:
                raise GradSyncError(f"{self._name} is closed")
            self.last_seq += 1
            handle = StepHandle(self, self.last_seq)
            self._pending += 1
            inline = self.on_thread()
            if not inline:
                self._queue.append((step, handle))
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                    self._thread.start()
                self._cond.notify()
        if inline:
            self._run_queued_to(getattr(self._local, "place", 0))
            self._run_one(step, handle)
        return handle

    def run_placed(self, at: int, call: Callable[[], T]) -> T:
        """``call()``, a step it starts on this thread taking place ``at`` (the last step
        started when the callback it makes was added)."""
        outer = getattr(self._local, "place", 0)
        self._local.place = at
        try:
            return call()
        finally:
            self._local.place = outer

    def busy(self) -> bool:
        """Whether a submitted step is queued or running."""
        with self.guard(self._cond):
            return self._pending > 0

    def on_thread(self) -> bool:
        """Whether the caller is this background thread (a step's callback)."""
        return self._thread is not None and threading.current_thread() is self._thread

    def close(self) -> None:
        """Accept no more steps, let the queued ones run (or fail) and stop the thread.

        From the thread itself (a callback closing the GradSync), or from a signal
        handler that interrupted this thread holding a lock here, it does not wait."""
        reentered = getattr(self._local, "holding", 0) > 0
        with self.guard(self._cond):
            self._closed = True
            self._cond.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread() and not reentered:
            thread.join()

    def _run(self) -> None:
        while True:
            with self.guard(self._cond):
                if not self._queue and not self._closed:
                    self._cond.wait(IDLE_S)
                if not self._queue:
                    # Closed, or idle: a GradSync dropped unclosed leaves no thread behind.
                    self._thread = None
                    return
                step, handle = self._queue.popleft()
            self._run_one(step, handle)

    def _run_queued_to(self, place: int) -> None:
        """Run, on this thread, the queued steps started at or before ``place``."""
        while True:
            with self.guard(self._cond):
                if not self._queue or self._queue[0][1]._seq > place:
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
            with self.guard(self._cond):
                self._pending -= 1
