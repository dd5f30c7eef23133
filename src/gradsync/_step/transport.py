"""Moving bytes between arrays and the reused data files: ``pread``/``pwrite`` or ``mmap``.

On a filesystem local to this host (tmpfs above all) every rank maps the data files
once and then copies straight between its arrays and the page cache: writing is a
memory copy, and a peer's shard is added from the mapping without being read into
a buffer first. Across hosts (NFS, Lustre, FUSE) mappings are not kept coherent, so
data goes through ``pwrite``/``pread`` and close-to-open consistency instead, and a
reader first drops what this host cached of a peer's file (``Transport.open``).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import stat
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from gradsync import _proc
from gradsync._names import is_call_data_name
from gradsync._store.api import store
from gradsync._store.files import write_in_place

from .datafile import ChecksumError, DataReader, open_data, shared_target

__all__ = [
    "ChecksumError",
    "DataReader",
    "Transport",
    "filesystem_type",
    "local_filesystem",
    "shared_target",
]


# Filesystems whose pages every process of this host shares, so mappings are coherent.
_LOCAL_FS = frozenset(
    {"tmpfs", "ramfs", "ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "zfs", "overlay"}
)


def local_filesystem(path: Path) -> bool:
    """Whether ``path`` lives on a filesystem of this host only (by /proc/self/mounts)."""
    return filesystem_type(path) in _LOCAL_FS


def filesystem_type(path: Path) -> str | None:
    """The type of the filesystem ``path`` is on ("tmpfs", "nfs4"); None where that
    cannot be read (not Linux)."""
    return _proc.filesystem_type(path)


# A kept mapping of this rank's own file shrinks after this many calls in a row that
# needed at most half of it.
SHRINK_AFTER_CALLS = 8


class Transport:
    """Writes and opens data files; keeps their mappings when ``mapped``."""

    def __init__(
        self, *, mapped: bool, head_bytes: int, shared: bool = False, dir_fd: int | None = None
    ) -> None:
        self.mapped = mapped
        # The directory of every file it handles, opened without following links: each
        # is opened by its name relative to it.
        self._dir_fd = dir_fd
        # Files live on a filesystem other hosts write: what this host sees of them may
        # lag behind (see Transport.open), so its cached pages are dropped before reading.
        self.shared = shared
        self._head_bytes = head_bytes
        self._drop_cached = shared
        self._maps: dict[Path, tuple[int, int, mmap.mmap, np.ndarray]] = {}
        # Files this rank maps for writing: only it writes them, so reading one back
        # needs no stat to tell whether its mapping is still the file's.
        self._own: set[Path] = set()
        # Unmapped: the first head_bytes and the size of what this rank last wrote to
        # each of its files, so reading its own header back costs no round trips.
        self._written: dict[Path, tuple[bytes, int]] = {}
        # Calls in a row that used at most half of an own file's mapping.
        self._slack_calls: dict[Path, int] = {}

    def write(
        self,
        path: Path,
        chunks: Sequence[bytes | memoryview | int],
        midway: Callable[[], None] | None,
        copy: Callable[[Sequence[tuple[np.ndarray, np.ndarray]]], None],
    ) -> None:
        """Overwrite ``path`` with ``chunks`` (readers wait for a marker before looking);
        an int chunk is that many bytes nobody reads, left as they are.

        ``copy`` copies (destination, source) pairs into a mapping (the caller's
        workers); ``midway`` runs with half the chunks written.

        Raises:
            OSError: as the system reported it, ENOSPC included: mapped files are
                allocated up front, so a full tmpfs never turns into SIGBUS.
        """
        if not self.mapped:
            self._written.pop(path, None)
            size = write_in_place(path, chunks, midway=midway, dir_fd=self._dir_fd)
            self._written[path] = (_first_bytes(chunks, self._head_bytes), size)
            return
        sizes = [c if isinstance(c, int) else memoryview(c).nbytes for c in chunks]
        buf = self._writable(path, sum(sizes))
        pairs: list[tuple[np.ndarray, np.ndarray]] = []
        offset = 0
        for chunk, size in zip(chunks, sizes, strict=True):
            if not isinstance(chunk, int):
                pairs.append((buf[offset : offset + size], np.frombuffer(chunk, np.uint8)))
            offset += size
        half = len(chunks) // 2
        for i, part in enumerate((pairs[:half], pairs[half:])):
            if i == 1 and midway is not None:
                midway()
            copy(part)

    def reserve(self, path: Path, size: int) -> np.ndarray:
        """A writable view of ``size`` bytes mapped from ``path`` (mapped transports only).

        Raises:
            OSError: the file could not be sized (ENOSPC) or mapped.
        """
        assert self.mapped
        return self._writable(path, size)

    def _writable(self, path: Path, size: int) -> np.ndarray:
        """``size`` bytes of a mapping of ``path``, which may be longer (readers go by
        the header): calls whose layouts alternate, as DDP's buckets do, then reuse the
        file's pages instead of resizing and faulting them in again every call."""
        cached = self._maps.get(path)
        if cached is not None and path in self._own and size <= cached[1]:
            slack = self._slack_calls.get(path, 0) + 1 if 2 * size <= cached[1] else 0
            self._slack_calls[path] = slack
            if slack < SHRINK_AFTER_CALLS:
                return cached[3][:size]
        self.forget(path)
        active = store()
        fd, st = active.open_own(self._dir_fd, path, os.O_RDWR)
        try:
            mm = active.map(fd, size, writable=True)
        finally:
            active.close(fd)
        buf = (
            np.frombuffer(mm, dtype=np.uint8, count=size)
            if mm is not None
            else np.empty(0, np.uint8)
        )
        if mm is not None:
            self._maps[path] = (st.st_ino, size, mm, buf)
            self._own.add(path)
        return buf

    def open(self, path: Path) -> DataReader:
        """Open a published file: its first bytes (the header) and a way to read the rest.

        With ``shared``, pages this host holds of the file are dropped before it is
        read: another host rewrote it in place, and close-to-open consistency does not
        always hold (benchmarks/RESULTS.md, "Stale pages on JuiceFS"). A header still
        showing an earlier call is looked at again (``PeerFiles``); a stale payload
        under a fresh header only ``checksums`` catch: a block failing its CRC is read
        once more, its pages dropped first.

        Raises:
            NotAFileError: ``path`` is not a regular file. OSError: as the system
                reported it.
        """
        if path in self._own:
            _, size, _, buf = self._maps[path]
            return DataReader(path, bytes(buf[: self._head_bytes]), size, None, buf)
        written = self._written.get(path)
        if written is not None:
            return DataReader(path, written[0], written[1], None, None, dir_fd=self._dir_fd)
        active = store()
        if self.mapped:
            # A kept mapping is reused when the name still leads to the same inode of
            # the same size: one stat instead of open, fstat and close every step. A
            # link is looked through only where it is d-<rank>.in's, checked first.
            st = active.stat(self._dir_fd, path)
            if stat.S_ISLNK(st.st_mode):
                st = active.stat(self._dir_fd, shared_target(path, self._dir_fd))
            kept = self._maps.get(path)
            if kept is not None and kept[:2] == (st.st_ino, st.st_size):
                buf = kept[3]
                return DataReader(path, bytes(buf[: self._head_bytes]), st.st_size, None, buf)
        fd, st = open_data(path, self._dir_fd)
        try:
            if not self.mapped or st.st_size == 0:
                if self._drop_cached:
                    active.drop_cached(fd, 0, 0)
                head = active.read_at(fd, self._head_bytes, 0)
                reader = DataReader(path, head, st.st_size, fd, None, drop_cached=self._drop_cached)
                fd = -1  # the reader owns it now
                return reader
            cached = self._maps.get(path)
            if cached is None or cached[:2] != (st.st_ino, st.st_size):
                self.forget(path)
                mm = active.map(fd, st.st_size, writable=False)
                assert mm is not None  # the file is not empty
                cached = (st.st_ino, st.st_size, mm, np.frombuffer(mm, dtype=np.uint8))
                # A file of one call is read in that call only: its mapping is not kept.
                if not is_call_data_name(path.name):
                    self._maps[path] = cached
        finally:
            if fd >= 0:
                active.close(fd)
        buf = cached[3]
        return DataReader(path, bytes(buf[: self._head_bytes]), st.st_size, None, buf)

    def forget(self, path: Path) -> None:
        """Drop the mapping kept for ``path`` (it stays valid while views of it live)."""
        self._own.discard(path)
        self._slack_calls.pop(path, None)
        self._written.pop(path, None)
        cached = self._maps.pop(path, None)
        if cached is not None:
            with contextlib.suppress(BufferError):
                cached[2].close()

    def close(self) -> None:
        for path in list(self._maps):
            self.forget(path)
        self._written.clear()


def _first_bytes(chunks: Sequence[bytes | memoryview | int], nbytes: int) -> bytes:
    """The first ``nbytes`` bytes of ``chunks`` joined (all of them if fewer; those
    before the first skipped bytes)."""
    out: list[bytes] = []
    left = nbytes
    for chunk in chunks:
        if isinstance(chunk, int):
            break
        view = memoryview(chunk).cast("B")[:left]
        out.append(view.tobytes())
        left -= len(view)
        if not left:
            break
    return b"".join(out)
