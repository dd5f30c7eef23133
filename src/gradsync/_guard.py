"""A GradSync's calls one at a time, its close, and what a failed call leaves."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

from ._async import Background
from ._elastic import MembershipView
from ._errors import GradSyncError, name_the_step
from ._session import forget

__all__ = ["CallGuard"]


class CallGuard(MembershipView):
    """The lock, closing and failure state that every GradSync call goes through."""

    _pid: int
    _failure: BaseException | None
    _closed: bool
    _lock: threading.Lock
    _inside: threading.local
    _close_requested: bool
    _closing: threading.Event
    _background: Background

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
        if self._session.forked:
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
        if self._session.forked:
            self._closed = True
            return
        if getattr(self._inside, "closing", False):
            return  # a signal handler during this thread's own close(): that one finishes
        self._inside.closing = True
        try:
            self._close_once(why)
        finally:
            self._inside.closing = False

    def _close_once(self, why: str | None) -> None:
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
            forget(self)
        self._background.close()  # the steps still queued fail: this instance is closed

    def _failed(self, exc: BaseException, step: int | None) -> None:
        """A call failed: the session ends if it met the peers or the error is
        gradsync's own, and a gradsync error names the ``step``."""
        if self._session.gen is not None or isinstance(exc, GradSyncError):
            self._fail(exc)
        if step is not None and isinstance(exc, GradSyncError):
            # After the peers were told: their message names the step already.
            name_the_step(exc, step, self.cfg.rank)

    def _fail(self, exc: BaseException) -> None:
        """End the session after a failed call (its peers give up on it too). It leaves
        the job at once: a new session of the same job may start before this instance
        is closed, or even if it never is."""
        self._failure = exc
        self._session.leave()
