"""Directories below the sync directory, reached only through directory descriptors.

The sync directory itself is opened by its path (the user chose it: links above it
are theirs). Every directory below it is opened relative to its parent's descriptor
with ``O_NOFOLLOW``, so no symbolic link below the sync directory is ever followed,
whoever planted it and whenever. A directory gradsync makes holds the mark
:data:`OWN_MARK`, written right after its ``mkdir``; gradsync removes a directory only
where it finds that mark, and never anything else of that name (a user's ``gen-x``).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

from gradsync._errors import SyncDirError
from gradsync._names import OWN_MARK

from .files import DIR_MODE, FILE_MODE

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


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _open_sub(parent_fd: int, name: str, shown: Path) -> int:
    """The descriptor of directory ``name`` in ``parent_fd``, never through a link.

    Raises:
        SyncDirError (ELOOP): ``name`` is a symbolic link (naming ``shown``).
        OSError: as the system reported it (ENOTDIR for a file, ENOENT...).
    """
    if "/" in name or name in ("", ".", ".."):  # one name below, nothing else
        raise OSError(errno.EINVAL, "not a plain name", os.fspath(shown))
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except OSError as exc:
        if exc.errno in (errno.ENOTDIR, errno.ELOOP) and _is_link(parent_fd, name):
            raise _link_error(shown, parent_fd) from exc
        raise


def _is_link(parent_fd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=parent_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _link_error(shown: Path, parent_fd: int | None = None) -> SyncDirError:
    try:
        link = shown if parent_fd is None else shown.name
        target = f" (to {os.readlink(link, dir_fd=parent_fd)})"
    except OSError:
        target = ""
    return SyncDirError(
        f"{shown} is a symbolic link{target} where gradsync expects a directory of its own: "
        "refused (gradsync follows no link below its sync dir); remove it",
        errno=errno.ELOOP,
        path=shown,
    )


def open_below(sync_dir: Path, *names: str) -> int:
    """A descriptor of ``sync_dir/names...``: the sync dir by its path, each name below it
    relative to the last with ``O_NOFOLLOW``. The caller closes it.

    Raises:
        SyncDirError (ELOOP): one of ``names`` is a symbolic link.
        OSError: as the system reported it.
    """
    fd = os.open(sync_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    shown = sync_dir
    for name in names:
        shown = shown / name
        try:
            sub = _open_sub(fd, name, shown)
        finally:
            os.close(fd)
        fd = sub
    return fd


@contextlib.contextmanager
def dir_below(sync_dir: Path, *names: str) -> Iterator[int]:
    """:func:`open_below` as a context that closes the descriptor."""
    fd = open_below(sync_dir, *names)
    try:
        yield fd
    finally:
        os.close(fd)


def _marked(fd: int) -> bool:
    try:
        st = os.stat(OWN_MARK, dir_fd=fd, follow_symlinks=False)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode)


def make_own_dir(sync_dir: Path, name: str) -> None:
    """Make the directory ``sync_dir/name`` and mark it as gradsync's.

    A crash between the two leaves an empty unmarked directory for good: one inode,
    where removing unmarked ones could remove a user's.

    Raises:
        OSError: as the system reported it (EEXIST, ENOSPC...); nothing is left.
    """
    with dir_below(sync_dir) as parent:
        os.mkdir(name, DIR_MODE, dir_fd=parent)
        try:
            fd = _open_sub(parent, name, sync_dir / name)
            try:
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
                os.close(os.open(OWN_MARK, flags, FILE_MODE, dir_fd=fd))
            finally:
                os.close(fd)
        except BaseException:
            # Empty, and just made by this process: nobody else's to lose.
            with contextlib.suppress(OSError):
                os.rmdir(name, dir_fd=parent)
            raise


def is_own_dir(sync_dir: Path, name: str, *, strict: bool = False) -> bool:
    """Whether ``sync_dir/name`` is a directory gradsync made (not a link). ``strict``:
    an error that leaves it untold (EACCES) is raised, not taken for a no."""
    try:
        with dir_below(sync_dir, name) as fd:
            if not strict:
                return _marked(fd)
            try:
                return stat.S_ISREG(os.stat(OWN_MARK, dir_fd=fd, follow_symlinks=False).st_mode)
            except FileNotFoundError:
                return False
    except OSError as exc:
        if strict and not isinstance(exc, SyncDirError) and exc.errno not in _NOT_OWN:
            raise
        return False


# Errors that say a name is no directory of gradsync's: missing, a file, a link.
_NOT_OWN = (errno.ENOENT, errno.ENOTDIR, errno.ELOOP)


def remove_own_dir(sync_dir: Path, name: str) -> bool:
    """Remove the directory ``sync_dir/name`` (a generation) and all it holds, if it
    bears gradsync's mark: never an unmarked one, never through a link. Whether it was
    removed. Never raises.

    Ranks may remove the same tree at once: the removal goes on past every error (on
    JuiceFS an ``fstat`` of a directory another host removed meanwhile raised
    FileNotFoundError in ``shutil.rmtree``).
    """
    try:
        with dir_below(sync_dir) as base:
            top = _open_sub(base, name, sync_dir / name)
            try:
                if not _marked(top):
                    _log.debug("not removing %s: gradsync did not make it", sync_dir / name)
                    return False
                seen = os.fstat(top)  # removed: only the one whose mark was seen, not a swap
            finally:
                os.close(top)
            _rmtree_at(base, name, seen)
    except OSError as exc:
        _log.debug("not removing %s: %s", sync_dir / name, exc)
        return False
    return True


def _rmtree_at(parent: int, name: str, expect: os.stat_result | None = None) -> None:
    """Remove directory ``name`` of ``parent`` and all it holds, as far as it goes, by
    descriptors: a link inside is unlinked, never followed (``shutil.rmtree`` has no
    ``dir_fd`` before Python 3.11). With ``expect``, only if it is still that directory,
    whose mark goes last: a file written into it meanwhile (a late note) is removed on
    another pass, or else the mark is put back, so that it never stays unmarked."""
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
    except OSError:
        return
    try:
        if expect is not None and not os.path.samestat(os.fstat(fd), expect):
            return
        for _ in range(3 if expect is not None else 1):
            _empty(fd, keep=OWN_MARK if expect is not None else None)
            if expect is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(OWN_MARK, dir_fd=fd)
            try:
                os.rmdir(name, dir_fd=parent)
                return
            except OSError as exc:
                if expect is None or exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    return
            flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
            os.close(os.open(OWN_MARK, flags, FILE_MODE, dir_fd=fd))
    except OSError:
        pass
    finally:
        os.close(fd)


def _empty(fd: int, keep: str | None) -> None:
    """Remove what directory ``fd`` holds but ``keep``, as far as it goes."""
    for entry in os.listdir(fd):
        if entry == keep:
            continue
        try:
            st = os.stat(entry, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                _rmtree_at(fd, entry)
            else:
                os.unlink(entry, dir_fd=fd)
        except OSError:
            continue


class GenDir:
    """A generation's directory and its recent step directories ``s-<seq>``, held open:
    what a rank writes in them goes through these descriptors, never the paths."""

    def __init__(self, gen_path: Path) -> None:
        self.path = gen_path
        self.fd = open_below(gen_path.parent, gen_path.name)
        self._steps: dict[int, int] = {}

    def step_path(self, seq: int) -> Path:
        """For messages only."""
        return self.path / f"s-{seq}"

    def step_fd(self, seq: int, *, make: bool = False) -> int:
        """The descriptor of ``s-<seq>`` (made first with ``make``, if no peer has).

        Raises:
            SyncDirError (ELOOP): a link is there. OSError: as the system reported it.
        """
        fd = self._steps.get(seq)
        if fd is not None:
            return fd
        name = f"s-{seq}"
        if make:
            with contextlib.suppress(FileExistsError):  # a peer was first
                os.mkdir(name, DIR_MODE, dir_fd=self.fd)
        fd = self._steps[seq] = _open_sub(self.fd, name, self.step_path(seq))
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
                return set(os.listdir(self.step_fd(seq)))
            fd = _open_sub(self.fd, f"s-{seq}", self.step_path(seq))
        except FileNotFoundError:
            return set()
        try:
            return set(os.listdir(fd))
        finally:
            os.close(fd)

    def has_step(self, seq: int, step: int | None = None) -> bool:
        """Whether ``s-<seq>`` is still a directory here (True where that cannot be told).

        Raises:
            SyncDirError (ELOOP): a link is there instead, naming it.
        """
        try:
            st = os.stat(f"s-{seq}", dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        except OSError:
            return True
        if stat.S_ISLNK(st.st_mode):
            exc = _link_error(self.step_path(seq), self.fd)
            exc.step = step
            raise exc
        return stat.S_ISDIR(st.st_mode)

    def held_step_fd(self, seq: int) -> int | None:
        """The descriptor of ``s-<seq>`` if this rank holds it open, else None."""
        return self._steps.get(seq)

    def release_before(self, seq: int) -> None:
        """Close the descriptors of steps before ``seq``."""
        for old in [k for k in self._steps if k < seq]:
            os.close(self._steps.pop(old))

    def prune(self, seq: int, names: Iterable[str]) -> None:
        """Remove ``s-<seq>``, a finished step's directory: normally empty (one rmdir),
        else its ``names`` are unlinked first, else the rest goes too."""
        name = f"s-{seq}"
        try:
            os.rmdir(name, dir_fd=self.fd)
            return
        except FileNotFoundError:
            return
        except OSError:
            pass
        try:
            sub = _open_sub(self.fd, name, self.step_path(seq))
        except OSError:
            return  # not a directory (a link is never followed): not this job's to remove
        try:
            for entry in names:
                with contextlib.suppress(OSError):
                    os.unlink(entry, dir_fd=sub)
        finally:
            os.close(sub)
        try:
            os.rmdir(name, dir_fd=self.fd)
        except FileNotFoundError:
            pass
        except OSError:
            _rmtree_at(self.fd, name)

    def close(self) -> None:
        self.release_before(sys.maxsize)
        with contextlib.suppress(OSError):
            os.close(self.fd)


def refuse_link(path: Path, *, step: int | None = None) -> None:
    """Raise SyncDirError (ELOOP) naming ``path`` if it is a symbolic link: one put where
    gradsync's own directory was after it opened it, which its descriptors never see."""
    try:
        is_link = stat.S_ISLNK(os.lstat(path).st_mode)
    except OSError:
        return
    if is_link:
        exc = _link_error(path)
        exc.step = step
        raise exc


def job_dir(path: Path) -> contextlib.AbstractContextManager[int]:
    """The descriptor of the directory of ``path``, a job's file (``sync_dir/rdzv/x`` or
    ``sync_dir/gen-*/x``), that directory opened below the sync dir without following
    a link."""
    return dir_below(path.parent.parent, path.parent.name)
