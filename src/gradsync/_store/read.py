"""Reading a job's files and directories below the sync directory, never through a link.

Each goes through its directory's descriptor (held by the caller, or opened below the
sync dir by :mod:`gradsync._store.dirs`), and the file's own name is opened or looked at
without following a link either.
"""

from __future__ import annotations

import stat
from pathlib import Path

from gradsync._errors import SyncDirError

from .api import store
from .dirs import dir_below, job_dir
from .files import read_small, translate_oserror

__all__ = ["file_below", "names_below", "read_below"]


def read_below(path: Path, limit: int = 1 << 20, *, dir_fd: int | None = None) -> bytes | None:
    """:func:`read_small` of the job's file ``path`` (``sync_dir/<dir>/<name>``) through
    ``dir_fd`` (its directory) or else its directory opened below the sync dir: no link
    followed, in the file's place or the directory's. None if either is not there.

    Raises:
        SyncDirError (ELOOP): a link in place of its directory. OSError: as
            :func:`read_small` (ELOOP for a link in the file's place).
    """
    if dir_fd is not None:
        return read_small(path, limit, dir_fd=dir_fd)
    try:
        with job_dir(path) as fd:
            return read_small(path, limit, dir_fd=fd)
    except FileNotFoundError:
        return None


def names_below(directory: Path, *, step: int | None = None) -> set[str]:
    """The names in ``directory`` (``sync_dir/<name>``: ``rdzv`` or a generation), opened
    below the sync dir without following a link; empty if it is not there.

    Raises:
        SyncDirError: a link in its place (ELOOP), or it cannot be listed.
    """
    try:
        with dir_below(directory.parent, directory.name) as fd:
            return store().list(fd)
    except FileNotFoundError:
        return set()
    except SyncDirError as exc:
        exc.step = step
        raise
    except OSError as exc:
        raise translate_oserror(exc, "listing", directory, step=step) from exc


def file_below(path: Path, *, dir_fd: int | None = None) -> bool:
    """Whether the job's file ``path`` (as for :func:`read_below`) is there as a regular
    file: a link in its place or its directory's is not followed, and counts as none.
    False where it cannot be told."""
    try:
        if dir_fd is not None:
            st = store().stat(dir_fd, path.name)
        else:
            with job_dir(path) as fd:
                st = store().stat(fd, path.name)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode)
