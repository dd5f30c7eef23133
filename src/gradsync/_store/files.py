"""gradsync's file operations by path and descriptor, over the active store
(:func:`gradsync._store.api.store`), and what turns their errors into messages.

Readers poll by listing or opening, never by ``exists()``, which NFS answers from a
negative-lookup cache.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from gradsync._errors import SyncDirError

from .api import store
from .posix import DIR_MODE, FILE_MODE, NotAFileError

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


def write_atomic(
    path: Path,
    chunks: Sequence[bytes | memoryview],
    mode: int = FILE_MODE,
    *,
    dir_fd: int | None = None,
) -> int:
    """Write ``chunks`` to ``path`` so that readers see all of it or nothing, with
    ``mode`` (less the umask): :meth:`Store.publish`. Returns the number of bytes
    written. With ``dir_fd`` (the directory of ``path``), relative to it.

    Raises:
        OSError: as the system reported it; nothing is left behind.
    """
    return store().publish(dir_fd, path, chunks, mode)


def write_note(path: Path, data: bytes, *, dir_fd: int | None = None) -> None:
    """Write the small note ``path`` (an abort or leave note) atomically, or, where the
    filesystem has no room for its bytes, at least the empty file: a full disk still
    has room for a name, and a reader takes an empty note for one it cannot read,
    which is what it would decide without the reason. Raises the first OSError when
    not even the empty file could be made. ``dir_fd``: as for :func:`write_atomic`."""
    active = store()
    try:
        active.publish(dir_fd, path, [data], FILE_MODE)
    except OSError as exc:
        try:
            active.close(active.open_own(dir_fd, path, os.O_WRONLY)[0])
        except OSError:
            raise exc from None
        _log.debug("wrote %s empty: %s", path, exc)


def write_in_place(
    path: Path,
    chunks: Sequence[bytes | memoryview | int],
    *,
    midway: Callable[[], None] | None = None,
    dir_fd: int | None = None,
) -> int:
    """Overwrite ``path`` from byte 0 with ``chunks`` (creating it, truncated to them),
    ``midway`` run with half of them written; an int chunk is that many bytes left as
    they are (nobody reads them). Reusing one file per slot keeps its
    tmpfs pages; readers must not look at it until a marker says it is complete.
    Returns the number of bytes written.

    Raises:
        OSError: as the system reported it (ENOSPC may only surface at close on NFS).
    """
    return store().write_in_place(dir_fd, path, chunks, midway)


def create_marker(path: Path, *, dir_fd: int | None = None) -> None:
    """Create the empty file ``path``; it must not exist (``O_EXCL``, atomic on NFS too)."""
    store().create(dir_fd, path)


def place_marker(
    path: Path, reuse: str | None, *, dir_fd: int | None = None, reuse_dir_fd: int | None = None
) -> None:
    """Make the empty file ``path`` appear, atomically: by moving the finished marker
    ``reuse`` there if it exists (one rename, nothing allocated), else by creating it.
    ``path`` must not exist. Raises OSError as the system reported it. ``dir_fd`` and
    ``reuse_dir_fd``: the directories of ``path`` and ``reuse``, to work relative to.
    """
    if reuse is not None:
        try:
            store().move(reuse_dir_fd, reuse, dir_fd, path)
            return
        except FileNotFoundError:
            pass  # the first calls, a plan that had no such marker, or a pruned step
    create_marker(path, dir_fd=dir_fd)


def read_exact_into(fd: int, offset: int, buf: memoryview, path: str | Path) -> None:
    """Fill ``buf`` from ``fd`` starting at byte ``offset``.

    Raises:
        EOFError: the file ends before ``buf`` is full (a truncated file).
        OSError: as the system reported it.
    """
    store().read_into(fd, offset, buf, path)


def open_regular(
    path: str | os.PathLike[str], *, dir_fd: int | None = None, follow: bool = True
) -> tuple[int, os.stat_result]:
    """Open ``path`` for reading, which must be a regular file (a FIFO in its place
    never blocks the open): the descriptor and its ``fstat``. Without ``follow``, a
    symbolic link is refused (ELOOP); with ``dir_fd``, relative to it.

    Raises:
        NotAFileError: a FIFO, directory, socket or device ("<path> is a FIFO, not a
            regular file"). OSError: as the system reported it (FileNotFoundError...).
    """
    return store().open_read(dir_fd, path, follow=follow)


def open_own(path: str | os.PathLike[str], access: int, *, dir_fd: int | None = None) -> int:
    """Open (creating it) a file that this rank writes in place, by ``path``.

    Its directory may be writable by other users: whatever is found there must be a
    plain file of one link, never a symbolic link, a hard link, a FIFO or a device,
    or a rank would overwrite whatever file of its user that name was made to lead to.

    Raises:
        OSError: as the system reported it (ELOOP for a symbolic link);
            :class:`NotAFileError` for a FIFO, directory, device; EMLINK for a file of
            several links.
    """
    return store().open_own(dir_fd, path, access)[0]


def read_small(path: Path, limit: int = 1 << 20, *, dir_fd: int | None = None) -> bytes | None:
    """Read a whole small file, or return ``None`` if it does not exist. A symbolic link
    in its place is not followed (ELOOP); with ``dir_fd``, its name is opened relative
    to that directory.

    Raises:
        OSError: it could not be read, is larger than ``limit`` bytes, or is not a
            regular file (a FIFO in its place would otherwise block the open forever).
    """
    active = store()
    try:
        fd, _ = active.open_read(dir_fd, path, follow=False)
    except FileNotFoundError:
        return None
    try:
        parts = []
        size = 0
        while True:
            part = active.read_at(fd, 65536, size)
            if not part:
                break
            parts.append(part)
            size += len(part)
            if size > limit:
                raise OSError(errno.EFBIG, f"file is larger than {limit} bytes", str(path))
        return b"".join(parts)
    finally:
        active.close(fd)


def list_names(directory: Path, *, step: int | None = None) -> set[str]:
    """Names in ``directory`` (by its path); empty if it does not exist (yet, or any more).

    Raises:
        SyncDirError: it cannot be listed (no permission, a stale NFS handle...).
    """
    active = store()
    try:
        handle = active.open_root(directory)
        try:
            return active.list(handle)
        finally:
            active.close_dir(handle)
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

    def __init__(
        self,
        *,
        spin_s: float = 0.001,
        first_sleep_s: float = 5e-5,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        give_way: Callable[[], None] = os.sched_yield,
    ) -> None:
        self._clock = clock
        self._sleep = sleep
        self._give_way = give_way
        self._start = clock()
        self._spin_s = spin_s
        self._sleep_s = first_sleep_s

    def elapsed_s(self) -> float:
        return self._clock() - self._start

    def pause(self, at_least_s: float = 0.0) -> None:
        """Wait before the next look: for ``at_least_s`` at least (no yielding then)."""
        elapsed = self.elapsed_s()
        if elapsed < self._spin_s and at_least_s <= 0:
            self._give_way()
            return
        # Sub-millisecond reaction for the first second, then gentler polling for
        # long waits (stragglers, slow starts): 5 ms is still invisible next to them.
        cap = 0.0005 if elapsed < 1.0 else 0.005
        self._sleep_s = min(self._sleep_s * 1.5, cap)
        self._sleep(max(self._sleep_s, at_least_s))


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
