"""The launcher's own stop signals (SIGINT, SIGTERM, SIGHUP), recorded instead of fatal."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

__all__ = ["SignalCatcher"]

logger = logging.getLogger("gradsync.launch")

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class SignalCatcher:
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
