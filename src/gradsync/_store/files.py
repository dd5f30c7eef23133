"""File primitives safe on tmpfs and on shared filesystems (NFS, Lustre, JuiceFS).

Publication is always write-to-temp, close, rename within one directory, so a
reader sees a whole file or none. Readers poll by listing or opening, never by
``exists()``, which NFS answers from a negative-lookup cache.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import stat
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from gradsync._errors import SyncDirError

_log = logging.getLogger("gradsync")

__all__ = [
    "DIR_MODE",
    "FILE_MODE",
    "Backoff",
    "NotAFileError",
    "atomic_write_bytes",
    "create_marker",
    "list_names",
    "open_own",
    "open_regular",
    "place_marker",
    "read_exact_into",
    "read_small",
    "translate_oserror",
    "wait_for_path",
    "warn_if_open",
    "write_atomic",
    "write_in_place",
    "write_note",
]

_IOV_BATCH = 512  # well under IOV_MAX (1024 on Linux)

# Modes of what gradsync creates (the umask still applies): gradients can reveal the
# training data, so nothing is readable by other users; a group keeps what the umask
# gives it, for a job whose ranks run as several users of one group.
DIR_MODE = 0o770
FILE_MODE = 0o640


def warn_if_open(directory: Path) -> None:
    """Log a warning if every user may write ``directory`` (a sync dir): any of them
    can then read, replace or delete the job's files, or plant names in it. Not an
    error: a job of several users may have chosen it, but it should be their group's."""
    try:
        st = os.stat(directory)
    except OSError:
        return
    if st.st_mode & stat.S_IWOTH:
        _log.warning(
            "sync dir %s is writable by every user (mode %03o, owner uid %d): any of them "
            "can read, alter or delete this job's gradients; use a directory that only "
            "the job's users (or their group) can write",
            directory,
            stat.S_IMODE(st.st_mode),
            st.st_uid,
        )


_READS = frozenset({"listing", "looking up", "opening", "reading"})


def translate_oserror(
    exc: OSError, what: str, path: str | Path, *, step: int | None = None
) -> SyncDirError:
    """Turn an ``OSError`` into a :class:`SyncDirError` saying what was being done."""
    reason = exc.strerror or str(exc)
    hint = ""
    if exc.errno == errno.ENOSPC:
        hint = f" (the sync directory's filesystem is {_what_is_out(Path(path))})"
    elif exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        access = "readable" if what in _READS else "writable"
        hint = f" (the sync directory is not {access} by this process)"
    elif exc.errno == errno.ELOOP:
        hint = " (a symbolic link where gradsync writes a file of its own: refused)"
    elif exc.errno == errno.EEXIST and (link := _dangling_link(Path(path))) is not None:
        hint = f" ({link} is a symbolic link to {os.readlink(link)}, which does not exist)"
    prefix = "" if step is None else f"step {step}: "
    return SyncDirError(
        f"{prefix}{what} {path} failed: {reason}{hint}", errno=exc.errno, step=step, path=path
    )


def _what_is_out(path: Path) -> str:
    """What a filesystem that refused to grow (ENOSPC) at ``path`` has run out of: its
    inodes (every file takes one, however small) or its blocks."""
    for p in (path, *path.parents):
        try:
            st = os.statvfs(p)
        except OSError:
            continue
        if st.f_files and st.f_favail == 0:
            return "out of inodes: remove files from it"
        break
    return "full"


def _dangling_link(path: Path) -> Path | None:
    """The first of ``path`` and its parents that is a symbolic link to nothing."""
    for p in (path, *path.parents):
        with contextlib.suppress(OSError):
            if p.is_symlink() and not p.exists():
                return p
    return None


def _at(path: str | os.PathLike[str], dir_fd: int | None) -> str | os.PathLike[str]:
    """What a system call is given for ``path``: its last name, relative to ``dir_fd``
    (a directory opened without following links), or else the path itself."""
    return path if dir_fd is None else os.path.basename(path)


def write_atomic(
    path: Path,
    chunks: Sequence[bytes | memoryview],
    mode: int = FILE_MODE,
    *,
    dir_fd: int | None = None,
) -> int:
    """Write ``chunks`` to ``path`` so that readers see all of it or nothing.

    The data goes to a hidden temporary file in the same directory, which is
    closed (surfacing deferred write errors, e.g. NFS's ENOSPC at close) and then
    renamed over ``path``, with ``mode`` (less the umask). Returns the number of bytes
    written. With ``dir_fd`` (the directory of ``path``), each is done relative to it.

    Raises:
        OSError: as the system reported it; the temporary file is removed.
    """
    tmp = _at(path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"), dir_fd)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
    fd = os.open(tmp, flags, mode, dir_fd=dir_fd)
    total = 0
    try:
        try:
            total = _writev_all(fd, chunks)
        finally:
            os.close(fd)
        os.rename(tmp, _at(path, dir_fd), src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise
    return total


def write_note(path: Path, data: bytes, *, dir_fd: int | None = None) -> None:
    """Write the small note ``path`` (an abort or leave note) atomically, or, where the
    filesystem has no room for its bytes, at least the empty file: a full disk still
    has room for a name, and a reader takes an empty note for one it cannot read,
    which is what it would decide without the reason. Raises the first OSError when
    not even the empty file could be made. ``dir_fd``: as for :func:`write_atomic`."""
    try:
        write_atomic(path, [data], dir_fd=dir_fd)
    except OSError as exc:
        try:
            os.close(open_own(path, os.O_WRONLY, dir_fd=dir_fd))
        except OSError:
            raise exc from None
        _log.debug("wrote %s empty: %s", path, exc)


def write_in_place(
    path: Path,
    chunks: Sequence[bytes | memoryview],
    *,
    midway: Callable[[], None] | None = None,
    dir_fd: int | None = None,
) -> int:
    """Overwrite ``path`` from byte 0 with ``chunks`` (creating it), then close it.

    Reusing one file per slot keeps its tmpfs pages: a fresh file every step costs a
    page fault and a zeroed page per 4 KiB. Readers must not look at the file until
    a marker says it is complete. The file is truncated to the written length.
    Returns the number of bytes written.

    Raises:
        OSError: as the system reported it (ENOSPC may only surface at close on NFS).
    """
    fd, found = _open_own(path, os.O_WRONLY, dir_fd)
    try:
        if midway is None:
            total = _writev_all(fd, chunks, 0)
        else:
            half = len(chunks) // 2
            total = _writev_all(fd, chunks[:half], 0)
            midway()
            total += _writev_all(fd, chunks[half:], total)
        # The size as found, not a new fstat: on a shared filesystem that is a round trip
        # to the server after every write.
        if found.st_size > total:
            os.ftruncate(fd, total)
    finally:
        os.close(fd)
    return total


def create_marker(path: Path, *, dir_fd: int | None = None) -> None:
    """Create the empty file ``path``; it must not exist (``O_EXCL``, atomic on NFS too)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
    os.close(os.open(_at(path, dir_fd), flags, FILE_MODE, dir_fd=dir_fd))


def place_marker(
    path: Path, reuse: str | None, *, dir_fd: int | None = None, reuse_dir_fd: int | None = None
) -> None:
    """Make the empty file ``path`` appear, atomically: by moving the finished marker
    ``reuse`` there if it exists, else by creating it.

    A rename is one system call that allocates nothing; a create is two (open, close)
    and allocates an inode that someone later unlinks. ``path`` must not exist
    (a rename would replace it). Raises OSError as the system reported it. ``dir_fd``
    and ``reuse_dir_fd``: the directories of ``path`` and ``reuse``, to work relative to.
    """
    if reuse is not None:
        try:
            os.rename(
                _at(reuse, reuse_dir_fd),
                _at(path, dir_fd),
                src_dir_fd=reuse_dir_fd,
                dst_dir_fd=dir_fd,
            )
            return
        except FileNotFoundError:
            pass  # the first calls, a plan that had no such marker, or a pruned step
    create_marker(path, dir_fd=dir_fd)


def _writev_all(fd: int, chunks: Sequence[bytes | memoryview], offset: int | None = None) -> int:
    views = [memoryview(c).cast("B") for c in chunks if len(c)]
    total = 0
    first = 0  # views[first:] are still to be written
    while first < len(views):
        batch = views[first : first + _IOV_BATCH]
        n = os.writev(fd, batch) if offset is None else os.pwritev(fd, batch, offset + total)
        total += n
        # Skip what was written; a short write leaves the rest of the batch to go again.
        # (An index, not views.pop(0): that moves the whole list, so a gradient of a
        # hundred thousand params took seconds to write.)
        for view in batch:
            if n < len(view):
                if n:
                    views[first] = view[n:]
                break
            n -= len(view)
            first += 1
    return total


def read_exact_into(fd: int, offset: int, buf: memoryview, path: str | Path) -> None:
    """Fill ``buf`` from ``fd`` starting at byte ``offset``.

    Raises:
        EOFError: the file ends before ``buf`` is full (a truncated file).
        OSError: as the system reported it.
    """
    view = buf.cast("B") if buf.format != "B" or buf.ndim != 1 else buf
    got = 0
    size = len(view)
    while got < size:
        n = os.preadv(fd, [view[got:]], offset + got)
        if n == 0:
            raise EOFError(f"{path} ends at byte {offset + got}, expected {offset + size}")
        got += n


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


def open_regular(
    path: str | os.PathLike[str], *, dir_fd: int | None = None, follow: bool = True
) -> tuple[int, os.stat_result]:
    """Open ``path`` for reading, which must be a regular file: the descriptor and its
    ``fstat``.

    Opened with ``O_NONBLOCK``, which a regular file's reads ignore but which keeps a
    FIFO in its place from blocking the open until a writer comes (forever, past any
    wait limit), then cleared again. Without ``follow``, a symbolic link is refused
    (ELOOP); with ``dir_fd``, ``path``'s name is opened relative to it.

    Raises:
        NotAFileError: a FIFO, directory, socket or device ("<path> is a FIFO, not a
            regular file"). OSError: as the system reported it (FileNotFoundError...).
    """
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | (0 if follow else os.O_NOFOLLOW)
    fd = os.open(_at(path, dir_fd), flags, dir_fd=dir_fd)
    return fd, _checked_regular(fd, path, one_link=False)


def open_own(path: str | os.PathLike[str], access: int, *, dir_fd: int | None = None) -> int:
    """Open (creating it) a file that this rank writes in place, by ``path``.

    The name lives in a directory other users may be able to write (a group's shared
    sync dir, or one someone else created first): whatever is found there must be a
    plain file of one link, which gradsync made, never a symbolic link
    (``O_NOFOLLOW``), another name of some other file (a hard link), a FIFO (whose
    write-only open would block until a reader came: ``O_NONBLOCK``) or a device.
    Otherwise a rank would truncate and overwrite whatever file of its user that
    name was made to lead to.

    Raises:
        OSError: as the system reported it (ELOOP for a symbolic link);
            :class:`NotAFileError` for a FIFO, directory, device; EMLINK for a file of
            several links.
    """
    return _open_own(path, access, dir_fd)[0]


def _open_own(
    path: str | os.PathLike[str], access: int, dir_fd: int | None = None
) -> tuple[int, os.stat_result]:
    """:func:`open_own`, and the file's ``fstat`` as found."""
    flags = access | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
    fd = os.open(_at(path, dir_fd), flags, FILE_MODE, dir_fd=dir_fd)
    return fd, _checked_regular(fd, path, one_link=True)


def _checked_regular(fd: int, path: str | os.PathLike[str], *, one_link: bool) -> os.stat_result:
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


def read_small(path: Path, limit: int = 1 << 20, *, dir_fd: int | None = None) -> bytes | None:
    """Read a whole small file, or return ``None`` if it does not exist. A symbolic link
    in its place is not followed (ELOOP); with ``dir_fd``, its name is opened relative
    to that directory.

    Raises:
        OSError: it could not be read, is larger than ``limit`` bytes, or is not a
            regular file (a FIFO in its place would otherwise block the open forever).
    """
    try:
        fd, _ = open_regular(path, dir_fd=dir_fd, follow=False)
    except FileNotFoundError:
        return None
    try:
        parts = []
        size = 0
        while True:
            part = os.read(fd, 65536)
            if not part:
                break
            parts.append(part)
            size += len(part)
            if size > limit:
                raise OSError(errno.EFBIG, f"file is larger than {limit} bytes", str(path))
        return b"".join(parts)
    finally:
        os.close(fd)


def list_names(directory: Path, *, step: int | None = None) -> set[str]:
    """Names in ``directory``; empty if it does not exist (yet, or any more).

    Raises:
        SyncDirError: it cannot be listed (no permission, a stale NFS handle...).
    """
    try:
        return set(os.listdir(directory))
    except FileNotFoundError:
        return set()
    except OSError as exc:
        raise translate_oserror(exc, "listing", directory, step=step) from exc


class Backoff:
    """Polling cadence: yield the CPU for about a millisecond, then sleep with backoff.

    Yielding first reacts within microseconds when the peer is about to publish
    without stealing its core on a busy machine; the sleeps keep an idle wait
    around a thousand cheap wake-ups per second, and far fewer after a while.
    """

    def __init__(self, *, spin_s: float = 0.001, first_sleep_s: float = 5e-5) -> None:
        self._start = time.monotonic()
        self._spin_s = spin_s
        self._sleep_s = first_sleep_s

    def elapsed_s(self) -> float:
        return time.monotonic() - self._start

    def pause(self) -> None:
        elapsed = self.elapsed_s()
        if elapsed < self._spin_s:
            os.sched_yield()
            return
        # Sub-millisecond reaction for the first second, then gentler polling for
        # long waits (stragglers, slow starts): 5 ms is still invisible next to them.
        cap = 0.0005 if elapsed < 1.0 else 0.005
        self._sleep_s = min(self._sleep_s * 1.5, cap)
        time.sleep(self._sleep_s)


def _poll(deadline_s: float) -> Iterator[None]:
    backoff = Backoff()
    while True:
        yield
        if backoff.elapsed_s() >= deadline_s:
            return
        backoff.pause()


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` atomically: readers see the old file, or all of ``data``.

    Parent directories are created. The temporary file lives beside ``path`` (a
    rename is only atomic within one filesystem) and is removed on failure.

    Raises:
        SyncDirError: (an ``OSError``) naming the path, with the system's errno.
    """
    target = Path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(target, [data], 0o644)  # the user's file: its mode as it always was
    except OSError as exc:
        raise translate_oserror(exc, "writing", target) from exc


def wait_for_path(path: str | os.PathLike[str], max_wait_s: float) -> bool:
    """Wait until ``path`` can be opened; ``True`` if it could within ``max_wait_s`` seconds.

    Polls by opening the file (not ``exists()``), yielding the CPU for the first
    millisecond and then sleeping at most 0.5 ms between tries for the first
    second and 5 ms after that. ``max_wait_s`` may be 0 (one try).
    """
    # The config's own check: any number it takes for max_wait_s (numpy's too), or 0.
    # Imported here: the watchdog imports this module and must not load numpy.
    from gradsync._config import check_seconds  # noqa: PLC0415

    max_wait_s = check_seconds("max_wait_s", max_wait_s, zero_ok=True)
    target = os.fspath(path)
    for _ in _poll(max_wait_s):
        try:
            # O_NONBLOCK: a FIFO there can be opened too, at once, not when a writer comes.
            fd = os.open(target, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except (FileNotFoundError, NotADirectoryError):
            continue
        os.close(fd)
        return True
    return False
