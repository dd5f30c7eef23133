"""Making the sync directory: created where missing (with its parents, as ``mkdir -p``),
and refused with the reason where the name is taken by something else."""

from __future__ import annotations

import errno
import os
from pathlib import Path

from gradsync._errors import SyncDirError

from .api import store

__all__ = ["make_sync_dir"]


def make_sync_dir(path: Path, name: str) -> None:
    """Create the directory ``path`` and its missing parents, unless it exists.

    Raises:
        SyncDirError: starting with ``name`` (how the caller's user knows the path),
            when ``path`` is not a directory, a parent is not one, or it cannot be
            created (no permission, a read-only or full filesystem); ``errno`` kept.
    """
    try:
        store().make_root(path)
    except OSError as exc:
        why, code = _why(path, exc)
        raise SyncDirError(f"{name} {why}", errno=code, path=path) from exc


def _why(path: Path, exc: OSError) -> tuple[str, int | None]:
    """What is wrong with ``path``, and its errno, after ``mkdir -p`` failed with ``exc``."""
    if isinstance(exc, FileExistsError | NotADirectoryError):
        for p in (*reversed(path.parents), path):
            if p.is_symlink() and not p.exists():
                return (
                    f"cannot be created: {p} is a symbolic link to {os.readlink(p)}, which "
                    "does not exist",
                    exc.errno,
                )
            if p.exists() and not p.is_dir():
                if p == path:
                    return "is not a directory", errno.ENOTDIR
                return f"cannot be created: {p} is not a directory", errno.ENOTDIR
    return f"cannot be created: {exc.strerror or exc}", exc.errno
