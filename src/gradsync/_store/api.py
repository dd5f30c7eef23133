"""The storage seam: every operation gradsync does on its sync dir, and the store that
does them for this process.

Everything is relative to a directory handle the store gave out (:meth:`Store.open_root`,
:meth:`Store.open_dir`), or to ``None``, the path as given. A handle is a small int: a
directory descriptor in :class:`~gradsync._store.posix.PosixStore`; a store of objects
(S3) would hand out its own, each standing for a key prefix. Files opened for reading
are small ints too. Failures are ``OSError`` with the errno a filesystem would give
(ENOENT for a missing name, ENOSPC, EACCES...): callers translate them into
:class:`~gradsync._errors.SyncDirError` by that errno.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Protocol

from .posix import NotAFileError, PosixStore

__all__ = ["Name", "NotAFileError", "Store", "store", "use_store"]

# A file's name in its directory, or with the directory ``None`` its path.
Name = str | os.PathLike[str]


class Store(Protocol):
    """What gradsync needs of the place its ranks share files in."""

    # Directories.
    def make_root(self, path: Path) -> None:
        """Make the sync dir and its missing parents, unless it is there (``mkdir -p``)."""

    def open_root(self, path: Path) -> int:
        """A handle of the sync dir itself, by its path (links above it are the user's)."""

    def open_dir(self, parent: int, name: str, shown: Path) -> int:
        """A handle of directory ``name`` in ``parent``, never through a link (ELOOP, named
        ``shown`` in the error)."""

    def close_dir(self, handle: int) -> None:
        """Let go of a directory handle."""

    def make_dir(self, parent: int, name: str, *, own: bool) -> None:
        """Make directory ``name`` (FileExistsError if there); ``own``: marked as
        gradsync's, or not made at all."""

    def is_own(self, handle: int, *, strict: bool = False) -> bool:
        """Whether the directory bears gradsync's mark (``strict``: errors other than a
        missing mark are raised)."""

    def remove_own_dir(self, parent: int, name: str) -> bool:
        """Remove directory ``name`` and all it holds, past errors, if it bears the mark:
        whether it did. Never through a link."""

    def remove_dir(self, parent: int, name: str, names: Iterable[str] = ()) -> None:
        """Remove directory ``name``, its ``names`` first, then whatever else it holds, as
        far as it goes; never through a link."""

    def list(self, handle: int) -> set[str]:
        """The names in a directory."""

    # Files.
    def stat(self, dir_fd: int | None, name: Name) -> os.stat_result:
        """What ``name`` is, not following a link."""

    def publish(
        self, dir_fd: int | None, name: Name, chunks: Sequence[bytes | memoryview], mode: int
    ) -> int:
        """Write ``chunks`` to ``name`` so that readers see all of it or nothing; the
        number of bytes."""

    def create(self, dir_fd: int | None, name: Name) -> None:
        """Create the empty file ``name``, which must not exist."""

    def move(self, src_dir: int | None, src: Name, dst_dir: int | None, dst: Name) -> None:
        """Rename ``src`` to ``dst``, atomically, replacing it."""

    def remove(self, dir_fd: int | None, name: Name) -> None:
        """Remove the file ``name``."""

    def symlink(self, dir_fd: int | None, target: str, name: Name) -> None:
        """Make ``name`` a symbolic link to ``target`` (FileExistsError if there)."""

    def write_in_place(
        self,
        dir_fd: int | None,
        name: Name,
        chunks: Sequence[bytes | memoryview | int],
        midway: Callable[[], None] | None,
    ) -> int:
        """Overwrite this rank's own file ``name`` (created if missing) with ``chunks``:
        readers wait for a marker. An int chunk is that many bytes nobody reads, left as
        they are (zeros past the old end). The number of bytes."""

    def open_own(self, dir_fd: int | None, name: Name, access: int) -> tuple[int, os.stat_result]:
        """Open (creating it) this rank's own file ``name`` for ``access``: a plain file
        of one link, never a link, FIFO or device."""

    def open_read(
        self, dir_fd: int | None, name: Name, *, follow: bool = True
    ) -> tuple[int, os.stat_result]:
        """Open the regular file ``name`` for reading (NotAFileError otherwise)."""

    def write_at(self, fd: int, data: bytes, offset: int) -> int:
        """Write ``data`` into an open own file at ``offset`` (a heartbeat's counter)."""

    def read_at(self, fd: int, size: int, offset: int) -> bytes:
        """Up to ``size`` bytes of an open file from ``offset``."""

    def read_into(self, fd: int, offset: int, buf: memoryview, shown: Name) -> None:
        """Fill ``buf`` from ``offset`` (EOFError, naming ``shown``, where the file ends)."""

    def drop_cached(self, fd: int, offset: int, length: int) -> None:
        """Forget what this host cached of an open file's bytes, so they are read anew."""

    def close(self, fd: int) -> None:
        """Close an open file."""

    def map(self, fd: int, size: int, *, writable: bool) -> mmap.mmap | None:
        """Map ``size`` bytes of an open file (only where the sync dir is host-local; None
        for 0); ``writable``: sized to ``size`` and its blocks allocated first, so a full
        disk is ENOSPC, not SIGBUS at a write through the mapping."""

    def link_target(self, dir_fd: int | None, name: Name) -> str:
        """What the symbolic link ``name`` says (EINVAL for no link)."""


_active: list[Store] = [PosixStore()]


def store() -> Store:
    """The store this process's gradsync uses."""
    return _active[-1]


@contextlib.contextmanager
def use_store(replacement: Store) -> Iterator[Store]:
    """Run gradsync in this process on ``replacement`` until the block ends (tests)."""
    _active.append(replacement)
    try:
        yield replacement
    finally:
        _active.remove(replacement)
