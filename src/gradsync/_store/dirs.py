"""Directories below the sync directory, reached only through the store's handles.

The sync directory itself is opened by its path (the user chose it: links above it
are theirs). Every directory below it is opened relative to its parent's handle, never
through a symbolic link, whoever planted it and whenever. gradsync removes a directory
only where it finds its mark :data:`OWN_MARK`, never anything else of that name (a
user's ``gen-x``).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import stat
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

from gradsync._errors import SyncDirError
from gradsync._names import OWN_MARK, step_dir_name

from .api import Store, store
from .posix import link_error

__all__ = [
    "OWN_MARK",
    "GenDir",
    "dir_below",
    "is_own_dir",
    "job_dir",
    "make_own_dir",
    "open_below",
    "refuse_link",
    "remove_own_dir",
]

_log = logging.getLogger("gradsync")


def open_below(sync_dir: Path, *names: str) -> int:
    """A handle of ``sync_dir/names...``: the sync dir by its path, each name below it
    relative to the last, never through a link. The caller closes it.

    Raises:
        SyncDirError (ELOOP): one of ``names`` is a symbolic link.
        OSError: as the system reported it.
    """
    active = store()
    fd = active.open_root(sync_dir)
    shown = sync_dir
    for name in names:
        shown = shown / name
        try:
            sub = active.open_dir(fd, name, shown)
        finally:
            active.close_dir(fd)
        fd = sub
    return fd


@contextlib.contextmanager
def dir_below(sync_dir: Path, *names: str) -> Iterator[int]:
    """:func:`open_below` as a context that closes the handle."""
    fd = open_below(sync_dir, *names)
    try:
        yield fd
    finally:
        store().close_dir(fd)


def make_own_dir(sync_dir: Path, name: str) -> None:
    """Make the directory ``sync_dir/name`` and mark it as gradsync's.

    A crash between the two leaves an empty unmarked directory for good: one inode,
    where removing unmarked ones could remove a user's.

    Raises:
        OSError: as the system reported it (EEXIST, ENOSPC...); nothing is left.
    """
    with dir_below(sync_dir) as parent:
        store().make_dir(parent, name, own=True)


def is_own_dir(sync_dir: Path, name: str, *, strict: bool = False) -> bool:
    """Whether ``sync_dir/name`` is a directory gradsync made (not a link). ``strict``:
    an error that leaves it untold (EACCES) is raised, not taken for a no."""
    try:
        with dir_below(sync_dir, name) as fd:
            return store().is_own(fd, strict=strict)
    except OSError as exc:
        if strict and not isinstance(exc, SyncDirError) and exc.errno not in _NOT_OWN:
            raise
        return False


# Errors that say a name is no directory of gradsync's: missing, a file, a link.
_NOT_OWN = (errno.ENOENT, errno.ENOTDIR, errno.ELOOP)


def remove_own_dir(sync_dir: Path, name: str) -> bool:
    """Remove the directory ``sync_dir/name`` (a generation) and all it holds, if it
    bears gradsync's mark: never an unmarked one, never through a link. Whether it was
    removed. Never raises."""
    try:
        with dir_below(sync_dir) as base:
            if store().remove_own_dir(base, name):
                return True
            _log.debug("not removing %s: gradsync did not make it", sync_dir / name)
    except OSError as exc:
        _log.debug("not removing %s: %s", sync_dir / name, exc)
    return False


class GenDir:
    """A generation's directory and its recent step directories ``s-<seq>``, held open:
    what a rank writes in them goes through these descriptors, never the paths."""

    def __init__(self, gen_path: Path) -> None:
        self.path = gen_path
        self._store = store()  # the store it opened its handles in, until it closes them
        self.fd = open_below(gen_path.parent, gen_path.name)
        self._steps: dict[int, int] = {}

    def step_path(self, seq: int) -> Path:
        """For messages only."""
        return self.path / step_dir_name(seq)

    def step_fd(self, seq: int, *, make: bool = False) -> int:
        """The descriptor of ``s-<seq>`` (made first with ``make``, if no peer has).

        Raises:
            SyncDirError (ELOOP): a link is there. OSError: as the system reported it.
        """
        fd = self._steps.get(seq)
        if fd is not None:
            return fd
        name = step_dir_name(seq)
        if make:
            with contextlib.suppress(FileExistsError):  # a peer was first
                self._store.make_dir(self.fd, name, own=False)
        fd = self._steps[seq] = self._store.open_dir(self.fd, name, self.step_path(seq))
        return fd

    def step_names(self, seq: int, *, fresh: bool = False) -> set[str]:
        """The names in ``s-<seq>``, listed through its held descriptor or, ``fresh``, one
        opened anew (a shared filesystem's client may serve a held directory's listing
        from its cache); empty if it is not there.

        Raises:
            SyncDirError (ELOOP): a link is there. OSError: as the system reported it.
        """
        try:
            if not fresh:
                return self._store.list(self.step_fd(seq))
            fd = self._store.open_dir(self.fd, step_dir_name(seq), self.step_path(seq))
        except FileNotFoundError:
            return set()
        try:
            return self._store.list(fd)
        finally:
            self._store.close_dir(fd)

    def has_step(self, seq: int, step: int | None = None) -> bool:
        """Whether ``s-<seq>`` is still a directory here (True where that cannot be told).

        Raises:
            SyncDirError (ELOOP): a link is there instead, naming it.
        """
        name = step_dir_name(seq)
        try:
            st = self._store.stat(self.fd, name)
        except FileNotFoundError:
            return False
        except OSError:
            return True
        if stat.S_ISLNK(st.st_mode):
            exc = link_error(self.step_path(seq), _target(self._store, self.fd, name))
            exc.step = step
            raise exc
        return stat.S_ISDIR(st.st_mode)

    def held_step_fd(self, seq: int) -> int | None:
        """The descriptor of ``s-<seq>`` if this rank holds it open, else None."""
        return self._steps.get(seq)

    def release_before(self, seq: int) -> None:
        """Close the descriptors of steps before ``seq``."""
        for old in [k for k in self._steps if k < seq]:
            self._store.close_dir(self._steps.pop(old))

    def prune(self, seq: int, names: Iterable[str]) -> None:
        """Remove ``s-<seq>``, a finished step's directory: normally empty (one rmdir),
        else its ``names`` are unlinked first, else the rest goes too."""
        self._store.remove_dir(self.fd, step_dir_name(seq), names)

    def close(self) -> None:
        self.release_before(sys.maxsize)
        with contextlib.suppress(OSError):
            self._store.close_dir(self.fd)


def refuse_link(path: Path, *, step: int | None = None) -> None:
    """Raise SyncDirError (ELOOP) naming ``path`` if it is a symbolic link: one put where
    gradsync's own directory was after it opened it, which its descriptors never see."""
    try:
        is_link = stat.S_ISLNK(store().stat(None, path).st_mode)
    except OSError:
        return
    if is_link:
        exc = link_error(path, _target(store(), None, path))
        exc.step = step
        raise exc


def job_dir(path: Path) -> contextlib.AbstractContextManager[int]:
    """The descriptor of the directory of ``path``, a job's file (``sync_dir/rdzv/x`` or
    ``sync_dir/gen-*/x``), that directory opened below the sync dir without following
    a link."""
    return dir_below(path.parent.parent, path.parent.name)


def _target(active: Store, dir_fd: int | None, name: str | Path) -> str | None:
    """What the link ``name`` says, for a message; None where that cannot be read."""
    try:
        return active.link_target(dir_fd, name)
    except OSError:
        return None
