"""The ranks' output: each line read from a rank's pipe, prefixed with ``[rank N] ``, and
written to the launcher's stdout or stderr, one line at a time."""

from __future__ import annotations

import codecs
import os
import re
import sys
import threading
from typing import IO

from .report import Tail

__all__ = ["Output", "pump"]

_SETTLE_WAIT_S = 0.2  # how long settle() waits for a write of another thread
_MAX_LINE_BYTES = 64 * 1024  # longer lines are split, so one rank cannot exhaust memory
_LINE_END = re.compile(rb"\r\n|\r|\n")


class Output:
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
        self.written = 0  # lines written so far: the ranks' output still flows while it grows

    def write(self, dest: str, text: str, source: str = "") -> None:
        """Write ``text`` to ``sys.stdout`` (``dest="stdout"``) or ``sys.stderr`` and
        flush; ``source`` names the writer (a rank's prefix) whose redraws it may
        overwrite."""
        with self._lock:
            if self._redraw is not None and self._redraw != (dest, source):
                self._emit(self._redraw[0], "\n")
            self._redraw = (dest, source) if text.endswith("\r") else None
            self._emit(dest, text)
            self.written += 1

    def settle(self, dest: str | None = None, source: str = "") -> None:
        """End the redraw on screen (only ``source``'s on ``dest``, if given) with a
        newline; skipped while a write is stuck on a stream nobody reads: the launcher
        must go on stopping its ranks."""
        if not self._lock.acquire(timeout=_SETTLE_WAIT_S):
            return
        try:
            if self._redraw is not None and (dest is None or self._redraw == (dest, source)):
                self._emit(self._redraw[0], "\n")
                self._redraw = None
        finally:
            self._lock.release()

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


def pump(pipe: IO[bytes], prefix: str, dest: str, output: Output, tail: Tail | None) -> None:
    """Copy ``pipe`` to ``dest`` with ``prefix`` before every line, until EOF.

    A line ends at ``\\n``, ``\\r\\n`` or a lone ``\\r``, which is forwarded as it
    is: progress bars (tqdm) redraw their line after a ``\\r``, and each redraw then
    shows (as the next one starts) instead of all of them at the next newline. Lines
    longer than ``_MAX_LINE_BYTES`` are split, so one rank cannot exhaust memory.
    ``tail`` gets the newline-ended lines, and the last redraw if the output ends on one.
    """
    lines = _Lines(prefix, dest, output, tail)
    fd = pipe.fileno()
    with pipe:
        while True:
            data = os.read(fd, _MAX_LINE_BYTES)
            lines.feed(data)
            if not data:
                lines.end()
                return


class _Lines:
    """Cuts one pipe's bytes into lines and forwards each, decoded and prefixed."""

    def __init__(self, prefix: str, dest: str, output: Output, tail: Tail | None) -> None:
        self._prefix = prefix
        self._dest = dest
        self._output = output
        self._tail = tail
        # Incremental: a line split at _MAX_LINE_BYTES may split a character too.
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = bytearray()
        self._cut = False  # the last line written was cut at _MAX_LINE_BYTES
        self._redraw: str | None = None  # the last line written, if it was a redraw

    def feed(self, data: bytes) -> None:
        """Forward every line ``data`` completes; empty ``data`` is the end of the pipe."""
        pending = self._pending
        # Only the new bytes, and a "\r" held back before them, can end a line: a rank
        # writing a long line a byte at a time must not cost a rescan a byte.
        scan_from = max(len(pending) - 1, 0)
        pending += data
        start = 0
        for match in _LINE_END.finditer(pending, scan_from):
            if data and match.group() == b"\r" and match.end() == len(pending):
                break  # perhaps the first half of "\r\n"
            line, start = pending[start : match.start()], match.end()
            while len(line) > _MAX_LINE_BYTES:
                self._forward(line[:_MAX_LINE_BYTES], b"")
                line = line[_MAX_LINE_BYTES:]
            self._forward(line, match.group())
        del pending[:start]
        while len(pending) - pending.endswith(b"\r") >= _MAX_LINE_BYTES:
            self._forward(pending[:_MAX_LINE_BYTES], b"")
            del pending[:_MAX_LINE_BYTES]

    def end(self) -> None:
        """Forward what the pipe's last line left, after :meth:`feed` of its end."""
        if self._pending or self._decoder.getstate()[0]:
            self._forward(self._pending, b"", final=True)
        if self._redraw is not None:
            self._output.settle(self._dest, self._prefix)  # the last redraw stays on screen
            if self._tail is not None:
                self._tail.append(self._redraw)
        if self._tail is not None:
            self._tail.end()

    def _forward(self, raw: bytes | bytearray, end: bytes, *, final: bool = False) -> None:
        # Decoded with its terminator: invalid bytes just before it become U+FFFD on
        # this line instead of waiting in the decoder for the next.
        text = self._decoder.decode(bytes(raw) + end, final=final)
        line = text[: len(text) - len(end)]
        was_cut, self._cut = self._cut, bool(raw) and not end
        if end == b"\r":
            if line:
                self._redraw = line
                self._output.write(self._dest, f"{self._prefix}{line}\r", self._prefix)
            return
        if not line and was_cut and end:
            return  # the newline of a line cut exactly at its end: no empty line after it
        self._redraw = None
        if self._tail is not None:
            self._tail.append(line)
        self._output.write(self._dest, f"{self._prefix}{line}\n", self._prefix)
