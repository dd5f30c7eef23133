"""The store of a POSIX filesystem (tmpfs, NFS, Lustre, JuiceFS): directory descriptors
opened ``O_DIRECTORY | O_NOFOLLOW`` below the sync dir, and system calls relative to them.

Publication is write-to-temp, close, rename within one directory, so a reader sees a
whole file or none. A directory gradsync makes holds the mark :data:`OWN_MARK`, written
right after its ``mkdir``; only a marked one is ever removed.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import secrets
import stat
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path, PurePath

from gradsync._errors import SyncDirError
from gradsync._names import OWN_MARK

from .writes import write_runs, writev_all

__all__ = ["DIR_MODE", "FILE_MODE", "NotAFileError", "PosixStore", "link_error"]

_log = logging.getLogger("gradsync")

# Modes of what gradsync creates (the umask still applies): gradients can reveal the
# training data, so nothing is readable by other users; a group keeps what the umask
# gives it, for a job whose ranks run as several users of one group.
DIR_MODE = 0o770
FILE_MODE = 0o640

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW

_Name = str | os.PathLike[str]


class NotAFileError(OSError):
    """A name leads to something other than a regular file (a FIFO, a directory, a
    device): nothing gradsync wrote."""


_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
}


def _at(path: _Name, dir_fd: int | None) -> _Name:
    """What a system call is given for ``path``: its last name, relative to ``dir_fd``,
    or else the path itself."""
    if dir_fd is None:
        return path
    return path.name if isinstance(path, PurePath) else os.path.basename(path)


class PosixStore:
    """Today's store: system calls on a filesystem this host mounts."""

    def make_root(self, path: Path) -> None:
        path.mkdir(DIR_MODE, parents=True, exist_ok=True)

    def open_root(self, path: Path) -> int:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)

    def open_dir(self, parent: int, name: str, shown: Path) -> int:
        if "/" in name or name in ("", ".", ".."):  # one name below, nothing else
            raise OSError(errno.EINVAL, "not a plain name", os.fspath(shown))
        try:
            return os.open(name, _DIR_FLAGS, dir_fd=parent)
        except OSError as exc:
            if exc.errno in (errno.ENOTDIR, errno.ELOOP) and _is_link(parent, name):
                raise link_error(shown, _readlink(name, parent)) from exc
            raise

    def close_dir(self, handle: int) -> None:
        os.close(handle)

    def make_dir(self, parent: int, name: str, *, own: bool) -> None:
        os.mkdir(name, DIR_MODE, dir_fd=parent)
        if not own:
            return
        try:
            fd = self.open_dir(parent, name, Path(name))
            try:
                os.close(os.open(OWN_MARK, _NEW | os.O_EXCL, FILE_MODE, dir_fd=fd))
            finally:
                os.close(fd)
        except BaseException:
            # Empty, and just made by this process: nobody else's to lose.
            with contextlib.suppress(OSError):
                os.rmdir(name, dir_fd=parent)
            raise

    def is_own(self, handle: int, *, strict: bool = False) -> bool:
        try:
            st = os.stat(OWN_MARK, dir_fd=handle, follow_symlinks=False)
        except FileNotFoundError:
            return False
        except OSError:
            if strict:
                raise
            return False
        return stat.S_ISREG(st.st_mode)

    def remove_own_dir(self, parent: int, name: str) -> bool:
        # Ranks may remove the same tree at once: the removal goes on past every error.
        top = os.open(name, _DIR_FLAGS, dir_fd=parent)
        try:
            if not self.is_own(top):
                return False
            seen = os.fstat(top)  # removed: only the one whose mark was seen, not a swap
        finally:
            os.close(top)
        _rmtree_at(parent, name, seen)
        return True

    def remove_dir(self, parent: int, name: str, names: Iterable[str] = ()) -> None:
        try:
            os.rmdir(name, dir_fd=parent)
            return
        except FileNotFoundError:
            return
        except OSError:
            pass
        try:
            sub = os.open(name, _DIR_FLAGS, dir_fd=parent)
        except OSError:
            return  # not a directory (a link is never followed): not this job's to remove
        try:
            for entry in names:
                with contextlib.suppress(OSError):
                    os.unlink(entry, dir_fd=sub)
        finally:
            os.close(sub)
        try:
            os.rmdir(name, dir_fd=parent)
        except FileNotFoundError:
            pass
        except OSError:
            _rmtree_at(parent, name)

    def list(self, handle: int) -> set[str]:
        return set(os.listdir(handle))

    def stat(self, dir_fd: int | None, name: _Name) -> os.stat_result:
        return os.stat(_at(name, dir_fd), dir_fd=dir_fd, follow_symlinks=False)

    def publish(
        self, dir_fd: int | None, name: _Name, chunks: Sequence[bytes | memoryview], mode: int
    ) -> int:
        path = Path(name)
        tmp = _at(path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"), dir_fd)
        fd = os.open(tmp, _NEW | os.O_EXCL, mode, dir_fd=dir_fd)
        total = 0
        try:
            try:
                total = writev_all(fd, chunks)
            finally:
                os.close(fd)  # surfaces deferred write errors (NFS's ENOSPC at close)
            os.rename(tmp, _at(path, dir_fd), src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dir_fd)
            raise
        return total

    def create(self, dir_fd: int | None, name: _Name) -> None:
        os.close(os.open(_at(name, dir_fd), _NEW | os.O_EXCL, FILE_MODE, dir_fd=dir_fd))

    def move(self, src_dir: int | None, src: _Name, dst_dir: int | None, dst: _Name) -> None:
        os.rename(_at(src, src_dir), _at(dst, dst_dir), src_dir_fd=src_dir, dst_dir_fd=dst_dir)

    def remove(self, dir_fd: int | None, name: _Name) -> None:
        os.unlink(_at(name, dir_fd), dir_fd=dir_fd)

    def symlink(self, dir_fd: int | None, target: str, name: _Name) -> None:
        os.symlink(target, _at(name, dir_fd), dir_fd=dir_fd)

    def write_in_place(
        self,
        dir_fd: int | None,
        name: _Name,
        chunks: Sequence[bytes | memoryview | int],
        midway: Callable[[], None] | None,
    ) -> int:
        fd, found = self.open_own(dir_fd, name, os.O_WRONLY)
        try:
            if midway is None:
                total, end = write_runs(fd, chunks, 0)
            else:
                half = len(chunks) // 2
                total, end = write_runs(fd, chunks[:half], 0)
                midway()
                total, end = write_runs(fd, chunks[half:], total, end)
            # The size as found, not a new fstat: on a shared filesystem that is a round
            # trip to the server after every write.
            if max(found.st_size, end) != total:
                os.ftruncate(fd, total)
        finally:
            os.close(fd)
        return total

    def open_own(self, dir_fd: int | None, name: _Name, access: int) -> tuple[int, os.stat_result]:
        # O_NONBLOCK: a FIFO planted there would block a write-only open until a reader came.
        flags = access | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
        fd = os.open(_at(name, dir_fd), flags, FILE_MODE, dir_fd=dir_fd)
        return fd, _checked_regular(fd, name, one_link=True)

    def open_read(
        self, dir_fd: int | None, name: _Name, *, follow: bool = True
    ) -> tuple[int, os.stat_result]:
        # O_NONBLOCK: a FIFO in a file's place would block the open until a writer came.
        flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | (0 if follow else os.O_NOFOLLOW)
        fd = os.open(_at(name, dir_fd), flags, dir_fd=dir_fd)
        return fd, _checked_regular(fd, name, one_link=False)

    def write_at(self, fd: int, data: bytes, offset: int) -> int:
        return os.pwrite(fd, data, offset)

    def read_at(self, fd: int, size: int, offset: int) -> bytes:
        return os.pread(fd, size, offset)

    def read_into(self, fd: int, offset: int, buf: memoryview, shown: _Name) -> None:
        view = buf.cast("B") if buf.format != "B" or buf.ndim != 1 else buf
        got = 0
        size = len(view)
        while got < size:
            n = os.preadv(fd, [view[got:]], offset + got)
            if n == 0:
                raise EOFError(f"{shown} ends at byte {offset + got}, expected {offset + size}")
            got += n

    def drop_cached(self, fd: int, offset: int, length: int) -> None:
        if hasattr(os, "posix_fadvise"):
            with contextlib.suppress(OSError):  # advice: a refusal only costs that
                os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)

    def close(self, fd: int) -> None:
        os.close(fd)

    def map(self, fd: int, size: int, *, writable: bool) -> mmap.mmap | None:
        if not writable:
            return mmap.mmap(fd, size, prot=mmap.PROT_READ) if size else None
        os.ftruncate(fd, size)
        _allocate(fd, size)
        return mmap.mmap(fd, size) if size else None

    def link_target(self, dir_fd: int | None, name: _Name) -> str:
        return os.readlink(_at(name, dir_fd), dir_fd=dir_fd)


def _checked_regular(fd: int, path: _Name, *, one_link: bool) -> os.stat_result:
    """The ``fstat`` of ``fd``, just opened from ``path`` with ``O_NONBLOCK``, which it
    clears, if ``fd`` is a regular file (of one link, with ``one_link``); otherwise
    ``fd`` is closed and NotAFileError (or OSError EMLINK) raised."""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = _KINDS.get(stat.S_IFMT(st.st_mode), "not a file")
            raise NotAFileError(
                errno.EINVAL, f"{os.fspath(path)} is {kind}, not a regular file", os.fspath(path)
            )
        if one_link and st.st_nlink != 1:
            raise OSError(
                errno.EMLINK,
                f"{os.fspath(path)} has {st.st_nlink} links: not a file gradsync made",
                os.fspath(path),
            )
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return st


def _allocate(fd: int, size: int) -> None:
    """Give the file's first ``size`` bytes their blocks now: on a full filesystem a
    write through a mapping into a hole is SIGBUS, where this is an OSError (ENOSPC)."""
    if not size:
        return
    if hasattr(os, "posix_fallocate"):
        os.posix_fallocate(fd, 0, size)
        return
    # macOS has none: writing zeros allocates the blocks too (once per file and size).
    zeros = memoryview(bytes(min(size, 1 << 20)))
    offset = 0
    while offset < size:
        offset += os.pwrite(fd, zeros[: size - offset], offset)


def _is_link(parent_fd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=parent_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _readlink(name: str, parent_fd: int | None) -> str | None:
    try:
        return os.readlink(name, dir_fd=parent_fd)
    except OSError:
        return None


def link_error(shown: Path, target: str | None) -> SyncDirError:
    """The error of a symbolic link ``shown`` (to ``target``) where gradsync expects a
    directory of its own."""
    to = "" if target is None else f" (to {target})"
    return SyncDirError(
        f"{shown} is a symbolic link{to} where gradsync expects a directory of its own: "
        "refused (gradsync follows no link below its sync dir); remove it",
        errno=errno.ELOOP,
        path=shown,
    )


def _rmtree_at(parent: int, name: str, expect: os.stat_result | None = None) -> None:
    """Remove directory ``name`` of ``parent`` and all it holds, as far as it goes, by
    descriptors: a link inside is unlinked, never followed. With ``expect``, only if it
    is still that directory, whose mark goes last: a file written into it meanwhile (a
    late note) is removed on another pass, or else the mark is put back, so that it
    never stays unmarked."""
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
            os.close(os.open(OWN_MARK, _NEW, FILE_MODE, dir_fd=fd))
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
