"""Exceptions raised by gradsync.

Every runtime failure of an averaging call is a :class:`GradSyncError`. Each
subclass also inherits the built-in exception a caller would naturally catch
(``TimeoutError``, ``ValueError``, ``OSError``...), so ``except TimeoutError``
keeps working for code that does not know about gradsync.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

__all__ = [
    "ConfigError",
    "CorruptFileError",
    "GradSyncError",
    "InvalidGradsError",
    "MismatchError",
    "NonFiniteGradError",
    "PeerAbortedError",
    "PeerLostError",
    "PeerTimeoutError",
    "RendezvousError",
    "SyncDirError",
    "WgpuBridgeError",
]


class GradSyncError(Exception):
    """Base class of every error gradsync raises.

    ``step`` is the caller's step number, ``ranks`` the ranks the error is about
    (a tuple), ``path`` the file or directory involved (a str); where one does not
    apply, ``step`` and ``path`` are ``None`` and ``ranks`` is empty.
    """

    def __init__(
        self,
        message: str,
        *,
        step: int | None = None,
        ranks: Sequence[int] = (),
        path: str | Path | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.step = step
        self.ranks: tuple[int, ...] = tuple(ranks)
        self.path: str | None = None if path is None else str(path)

    def __str__(self) -> str:
        return self.message

    def __reduce__(self) -> tuple[object, ...]:
        # Keep the keyword attributes when an error crosses a process boundary.
        return (_rebuild, (type(self), self.message, self.step, self.ranks, self.path))


def _rebuild(
    cls: type[GradSyncError],
    message: str,
    step: int | None,
    ranks: tuple[int, ...],
    path: str | None,
) -> GradSyncError:
    return cls(message, step=step, ranks=ranks, path=path)


class ConfigError(GradSyncError, ValueError):
    """A configuration value (argument or environment variable) is invalid."""


class InvalidGradsError(GradSyncError, ValueError):
    """The gradients handed to this rank cannot be averaged (dtype, layout...)."""


class MismatchError(GradSyncError, ValueError):
    """Ranks disagree on what they average: param count, shapes, dtypes, step or world size."""


class NonFiniteGradError(GradSyncError, FloatingPointError):
    """A rank published NaN or Inf while the finite-check was enabled."""


class CorruptFileError(GradSyncError, ValueError):
    """A file in the sync directory is not a valid gradsync file (truncated, garbled)."""


class PeerTimeoutError(GradSyncError, TimeoutError):
    """Live peers did not publish within ``max_wait_s``."""


class PeerLostError(GradSyncError, ConnectionError):
    """A peer's process exited, or its host stopped beating, before the step completed."""


class PeerAbortedError(GradSyncError, RuntimeError):
    """A peer gave up on the step and said why; its reason is in the message."""


class RendezvousError(GradSyncError, RuntimeError):
    """Ranks could not form a job: a rank claimed twice, or another job holds the directory."""


class SyncDirError(GradSyncError, OSError):
    """Reading or writing the sync directory failed (missing, unwritable, disk full...).

    ``errno`` is that of the underlying ``OSError`` (``ENOSPC``, ``EACCES``...).
    """

    def __init__(
        self,
        message: str,
        *,
        errno: int | None = None,
        step: int | None = None,
        ranks: Sequence[int] = (),
        path: str | Path | None = None,
    ) -> None:
        super().__init__(message, step=step, ranks=ranks, path=path)
        self.errno = errno
        self.strerror = None if errno is None else os.strerror(errno)
        self.filename = self.path

    def __reduce__(self) -> tuple[object, ...]:
        return (
            _rebuild_oserror,
            (type(self), self.message, self.errno, self.step, self.ranks, self.path),
        )


def _rebuild_oserror(
    cls: type[SyncDirError],
    message: str,
    errno: int | None,
    step: int | None,
    ranks: tuple[int, ...],
    path: str | None,
) -> SyncDirError:
    return cls(message, errno=errno, step=step, ranks=ranks, path=path)


class WgpuBridgeError(GradSyncError, RuntimeError):
    """wgpu failed while copying gradients, or no usable adapter exists.

    Raised ``from`` the original wgpu exception, which stays in ``__cause__``.
    """


def name_the_step(exc: GradSyncError, step: int, rank: int) -> None:
    """Name ``step`` and ``rank`` in a rank's own error about its gradients (bad input,
    a failed GPU copy) raised without them: sets ``step``, ``ranks`` if empty, and
    prefixes ``step <step>: `` to the message. In place, so the traceback and the error
    kept as the session's failure stay the same object. Other errors are left as they
    are (a rendezvous failure concerns the job, not a step)."""
    if exc.step is not None or not isinstance(exc, InvalidGradsError | WgpuBridgeError):
        return
    exc.step = step
    exc.ranks = exc.ranks or (rank,)
    if not exc.message.startswith(f"step {step}: "):
        exc.message = f"step {step}: {exc.message}"
        exc.args = (exc.message, *exc.args[1:])


def error_note(exc: BaseException) -> dict[str, object]:
    """What a rank tells its peers when it gives up: the error's type, message and ranks."""
    if isinstance(exc, GradSyncError):
        return {"type": type(exc).__name__, "message": str(exc), "ranks": list(exc.ranks)}
    text = str(exc)  # empty for a KeyboardInterrupt
    message = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return {"type": "", "message": message, "ranks": []}


# Errors about the whole job, which every rank would find itself (a lost peer, a
# mismatch, a damaged file): a peer's report of one is raised as the same error.
_JOB_WIDE: dict[str, type[GradSyncError]] = {
    cls.__name__: cls
    for cls in (
        PeerLostError,
        PeerTimeoutError,
        MismatchError,
        NonFiniteGradError,
        CorruptFileError,
        RendezvousError,
        PeerAbortedError,
    )
}


def parse_note(raw: bytes) -> object:
    """A peer's note as :func:`note_reason` and :func:`job_wide_error` take it: its JSON
    value, ``b""`` if it is empty (all a full disk had room for), None if unreadable."""
    if not raw:
        return b""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return None


def clip(text: str, limit: int = 200) -> str:
    """``text`` cut to ``limit`` characters, ending in "..." where it was cut: one
    process's line quoted in another's message."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def note_reason(note: object) -> str:
    """The message of a peer's note, or a placeholder if the note is unreadable
    (``b""``: an empty note, all a peer could write on a full disk)."""
    if note == b"":
        return "(its note is empty: no room for the reason; is the sync directory's disk full?)"
    message = note.get("message") if isinstance(note, dict) else None
    return message if isinstance(message, str) else "(its reason is unreadable)"


def job_wide_error(
    note: object, *, step: int | None, path: str | Path | None
) -> GradSyncError | None:
    """The error a peer's note (see :func:`error_note`) reports, if it concerns the job."""
    if not isinstance(note, dict) or not isinstance(note.get("message"), str):
        return None
    cls = _JOB_WIDE.get(str(note.get("type")))
    if cls is None:
        return None
    raw = note.get("ranks")
    ranks = [r for r in raw if type(r) is int] if isinstance(raw, list) else []
    return cls(note["message"], step=step, ranks=ranks, path=path)
