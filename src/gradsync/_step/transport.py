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
import errno
import mmap
import os
import re
import stat
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gradsync import _proc
from gradsync._store.files import open_own, open_regular, read_exact_into, write_in_place

from .header import CRC_BLOCK

__all__ = [
    "ChecksumError",
    "DataReader",
    "Transport",
    "filesystem_type",
    "local_filesystem",
    "shared_target",
]


class ChecksumError(Exception):
    """A block of a published file does not match its CRC (translated by the caller)."""


# Filesystems whose pages every process of this host shares, so mappings are coherent.
_LOCAL_FS = frozenset(
    {"tmpfs", "ramfs", "ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "zfs", "overlay"}
)

# The one link a reader follows: a rank's input name to its shared arrays' file.
_SHARED_NAME = re.compile(r"d-(\d+)-b\d+\.in")


def local_filesystem(path: Path) -> bool:
    """Whether ``path`` lives on a filesystem of this host only (by /proc/self/mounts)."""
    return filesystem_type(path) in _LOCAL_FS


def filesystem_type(path: Path) -> str | None:
    """The type of the filesystem ``path`` is on ("tmpfs", "nfs4"); None where that
    cannot be read (not Linux)."""
    return _proc.filesystem_type(path)


class DataReader:
    """One peer's published data file, open for one step."""

    def __init__(
        self,
        path: Path,
        head: bytes,
        size: int,
        fd: int | None,
        buf: Any,
        *,
        drop_cached: bool = False,
        dir_fd: int | None = None,
    ) -> None:
        self.path = path
        self._dir_fd = dir_fd
        self.head = head
        self.size = size
        self._fd = fd  # neither fd nor buf: opened when first read (Transport.open)
        self._buf = buf  # a uint8 array over a mapping, or None
        # Another host wrote the file: a block failing its CRC is read once more past
        # this host's cached pages before it counts as corrupt (Transport.open).
        self._drop_cached = drop_cached
        self._crcs: list[int] | None = None
        self._payload_offset = 0
        self._payload_len = 0
        self._verified: set[int] = set()

    def expect_crcs(self, crc_hex: str, payload_offset: int, payload_len: int) -> None:
        """Check every block of the payload against ``crc_hex`` before it is first used."""
        self._crcs = [int(crc_hex[i : i + 8], 16) for i in range(0, len(crc_hex), 8)]
        self._payload_offset = payload_offset
        self._payload_len = payload_len

    def _verify(self, offset: int, nbytes: int) -> None:
        if self._crcs is None or nbytes == 0:
            return
        first = (offset - self._payload_offset) // CRC_BLOCK
        last = (offset + nbytes - 1 - self._payload_offset) // CRC_BLOCK
        for block in range(max(first, 0), last + 1):
            if block in self._verified:
                continue
            start = self._payload_offset + block * CRC_BLOCK
            size = min(CRC_BLOCK, self._payload_len - block * CRC_BLOCK)
            if block >= len(self._crcs) or size <= 0:
                raise ChecksumError(f"{self.path} has no checksum for bytes {start}..")
            if self._buf is not None:
                data: Any = self._buf[start : start + size]
            else:
                data = np.empty(size, dtype=np.uint8)
                read_exact_into(self._file(), start, data.data, self.path)
            again = ""
            if zlib.crc32(data) != self._crcs[block] and self._buf is None and self._drop_cached:
                with contextlib.suppress(OSError):
                    os.posix_fadvise(self._file(), start, size, os.POSIX_FADV_DONTNEED)
                read_exact_into(self._file(), start, data.data, self.path)
                again = ", read again past this host's cache"
            if zlib.crc32(data) != self._crcs[block]:
                raise ChecksumError(
                    f"{self.path} fails its checksum in bytes {start}..{start + size}{again}"
                )
            self._verified.add(block)

    def head_of(self, nbytes: int) -> bytes:
        """The file's first ``nbytes`` bytes (fewer if the file is shorter): :attr:`head`
        when it holds them, otherwise read now.

        Raises:
            OSError: reading failed.
        """
        if nbytes <= len(self.head) or len(self.head) >= self.size:
            return self.head
        buf = np.empty(min(nbytes, self.size), dtype=np.uint8)
        self.read_into(0, buf)
        return buf.tobytes()

    def _check_mapped_end(self, offset: int, nbytes: int) -> None:
        # A read past the end of a mapping would be SIGBUS, not an error: check first.
        if offset + nbytes > self.size:
            raise EOFError(f"{self.path} ends at byte {self.size}, expected {offset + nbytes}")

    def view(self, offset: int, count: int, dtype: np.dtype[Any]) -> np.ndarray | None:
        """``count`` elements at byte ``offset`` without copying, if the file is mapped.

        Raises:
            EOFError: the file is shorter. ChecksumError: a block fails its CRC.
        """
        if self._buf is None:
            return None
        self._check_mapped_end(offset, count * dtype.itemsize)
        self._verify(offset, count * dtype.itemsize)
        return np.frombuffer(self._buf, dtype=dtype, count=count, offset=offset)

    def read_into(self, offset: int, dst: np.ndarray) -> None:
        """Fill ``dst`` from byte ``offset``.

        Raises:
            EOFError: the file is shorter. ChecksumError: a block fails its CRC.
            OSError: reading failed.
        """
        if self._buf is not None:
            self._check_mapped_end(offset, dst.nbytes)
        self._verify(offset, dst.nbytes)
        if self._buf is not None:
            np.copyto(dst.reshape(-1).view(np.uint8), self._buf[offset : offset + dst.nbytes])
            return
        read_exact_into(self._file(), offset, dst.data, self.path)

    def _file(self) -> int:
        if self._fd is None:
            try:
                self._fd, _ = open_regular(self.path, dir_fd=self._dir_fd, follow=False)
            except OSError as exc:
                if exc.errno != errno.ELOOP:
                    raise
                target = shared_target(self.path, self._dir_fd)
                self._fd, _ = open_regular(target, dir_fd=self._dir_fd, follow=False)
        return self._fd

    def close(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None


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
        self._drop_cached = shared and hasattr(os, "posix_fadvise")
        self._maps: dict[Path, tuple[int, int, mmap.mmap, np.ndarray]] = {}
        # Files this rank maps for writing: only it writes them, so reading one back
        # needs no stat to tell whether its mapping is still the file's.
        self._own: set[Path] = set()
        # Unmapped: the first head_bytes and the size of what this rank last wrote to
        # each of its files. Reading its own header back cost an open, a read and a
        # close, each a round trip to the server of a shared filesystem (2 of 8 ms of
        # a small step on JuiceFS).
        self._written: dict[Path, tuple[bytes, int]] = {}

    def write(
        self,
        path: Path,
        chunks: Sequence[bytes | memoryview],
        midway: Callable[[], None] | None,
        copy: Callable[[Sequence[tuple[np.ndarray, np.ndarray]]], None],
    ) -> None:
        """Overwrite ``path`` with ``chunks`` (readers wait for a marker before looking).

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
        sizes = [memoryview(c).nbytes for c in chunks]
        buf = self._writable(path, sum(sizes))
        pairs: list[tuple[np.ndarray, np.ndarray]] = []
        offset = 0
        for chunk, size in zip(chunks, sizes, strict=True):
            pairs.append((buf[offset : offset + size], np.frombuffer(chunk, dtype=np.uint8)))
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
        cached = self._maps.get(path)
        if cached is not None and cached[1] == size:
            return cached[3]
        self.forget(path)
        fd = open_own(path, os.O_RDWR, dir_fd=self._dir_fd)
        try:
            os.ftruncate(fd, size)
            if size:
                _allocate(fd, size)
            ino = os.fstat(fd).st_ino
            mm = mmap.mmap(fd, max(size, 1)) if size else None
        finally:
            os.close(fd)
        buf = (
            np.frombuffer(mm, dtype=np.uint8, count=size)
            if mm is not None
            else np.empty(0, np.uint8)
        )
        if mm is not None:
            self._maps[path] = (ino, size, mm, buf)
            self._own.add(path)
        return buf

    def open(self, path: Path) -> DataReader:
        """Open a published file: its first bytes (the header) and a way to read the rest.

        With ``shared``, pages this host holds of the file are dropped before it
        is read: another host rewrote it in place, and close-to-open consistency
        does not always hold. JuiceFS 1.4 served ranks of one host that opened a
        rewritten file at the same moment the previous contents, or a mix of both
        (``benchmarks/cache_probe.py``: 5 of 14,000 opens; none of 16,000 with the
        pages dropped). A header still showing an earlier call is looked at again
        (``PeerFiles``); a stale payload under a fresh header only ``checksums`` catch:
        a block failing its CRC is read once more, its pages dropped first.

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
        if self.mapped:
            # A kept mapping is reused when the name still leads to the same inode of
            # the same size: one stat instead of open, fstat and close every step. A
            # link is looked through only where it is d-<rank>.in's, checked first.
            st = os.stat(self._name(path), dir_fd=self._dir_fd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                st = os.stat(
                    self._name(self._linked(path)), dir_fd=self._dir_fd, follow_symlinks=False
                )
            kept = self._maps.get(path)
            if kept is not None and kept[:2] == (st.st_ino, st.st_size):
                buf = kept[3]
                return DataReader(path, bytes(buf[: self._head_bytes]), st.st_size, None, buf)
        # Never a plain open: a FIFO in a data file's place would block it forever.
        try:
            fd, st = open_regular(path, dir_fd=self._dir_fd, follow=False)
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            fd, st = open_regular(self._linked(path), dir_fd=self._dir_fd, follow=False)
        try:
            if not self.mapped or st.st_size == 0:
                if self._drop_cached:
                    with contextlib.suppress(OSError):  # advice: a refusal only costs that
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                head = os.pread(fd, self._head_bytes, 0)
                reader = DataReader(path, head, st.st_size, fd, None, drop_cached=self._drop_cached)
                fd = -1  # the reader owns it now
                return reader
            cached = self._maps.get(path)
            if cached is None or cached[:2] != (st.st_ino, st.st_size):
                self.forget(path)
                mm = mmap.mmap(fd, st.st_size, prot=mmap.PROT_READ)
                cached = (st.st_ino, st.st_size, mm, np.frombuffer(mm, dtype=np.uint8))
                self._maps[path] = cached
        finally:
            if fd >= 0:
                os.close(fd)
        buf = cached[3]
        return DataReader(path, bytes(buf[: self._head_bytes]), st.st_size, None, buf)

    def _name(self, path: Path) -> str | Path:
        return path if self._dir_fd is None else path.name

    def _linked(self, path: Path) -> Path:
        """:func:`shared_target` of ``path`` in this transport's directory."""
        return shared_target(path, self._dir_fd)

    def forget(self, path: Path) -> None:
        """Drop the mapping kept for ``path`` (it stays valid while views of it live)."""
        self._own.discard(path)
        self._written.pop(path, None)
        cached = self._maps.pop(path, None)
        if cached is not None:
            with contextlib.suppress(BufferError):
                cached[2].close()

    def close(self) -> None:
        for path in list(self._maps):
            self.forget(path)
        self._written.clear()


def shared_target(path: Path, dir_fd: int | None = None) -> Path:
    """The file that the symbolic link ``path`` (in directory ``dir_fd``) leads to, which
    must be its rank's shared arrays beside it (``d-<rank>.in`` -> ``d-<rank>-b<n>.in``:
    what ``buffers_like`` makes); no other link is followed.

    Raises:
        OSError: ELOOP for a link anywhere else; as the system reported it.
    """
    target = os.readlink(path if dir_fd is None else path.name, dir_fd=dir_fd)
    found = _SHARED_NAME.fullmatch(target)
    if found is None or path.name != f"d-{found.group(1)}.in":
        raise OSError(
            errno.ELOOP,
            f"{path} is a symbolic link to {target!r}, not to its rank's shared arrays "
            "beside it (d-<rank>-b<n>.in): refused",
            str(path),
        )
    return path.with_name(target)


def _allocate(fd: int, size: int) -> None:
    """Give the file's first ``size`` bytes their blocks now: on a full filesystem a
    write through a mapping into a hole is SIGBUS, where this is an OSError (ENOSPC).

    Raises:
        OSError: as the system reported it.
    """
    if hasattr(os, "posix_fallocate"):
        os.posix_fallocate(fd, 0, size)
        return
    # macOS has none: writing zeros allocates the blocks too (once per file and size).
    zeros = memoryview(bytes(min(size, 1 << 20)))
    offset = 0
    while offset < size:
        offset += os.pwrite(fd, zeros[: size - offset], offset)


def _first_bytes(chunks: Sequence[bytes | memoryview], nbytes: int) -> bytes:
    """The first ``nbytes`` bytes of ``chunks`` joined (all of them if fewer)."""
    out: list[bytes] = []
    left = nbytes
    for chunk in chunks:
        view = memoryview(chunk).cast("B")[:left]
        out.append(view.tobytes())
        left -= len(view)
        if not left:
            break
    return b"".join(out)
