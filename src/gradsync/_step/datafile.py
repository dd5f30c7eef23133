"""A peer's published data file, open for one step: read through a handle or a kept
mapping, each block checked against its CRC before it is first used."""

from __future__ import annotations

import contextlib
import errno
import os
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gradsync._names import data_name, shared_input_rank
from gradsync._store.api import store

from .header import CRC_BLOCK

__all__ = ["ChecksumError", "DataReader", "open_data", "shared_target"]


class ChecksumError(Exception):
    """A block of a published file does not match its CRC (translated by the caller)."""


def open_data(path: Path, dir_fd: int | None) -> tuple[int, os.stat_result]:
    """Open the data file ``path`` in directory ``dir_fd`` for reading: never a plain
    open (a FIFO in its place would block it forever), and through no link but the one
    :func:`shared_target` allows.

    Raises:
        NotAFileError: not a regular file. OSError: as the system reported it.
    """
    try:
        return store().open_read(dir_fd, path, follow=False)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        return store().open_read(dir_fd, shared_target(path, dir_fd), follow=False)


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
        # A shard file (relocate): where each span of the whole payload lies in this file.
        self._spans: list[tuple[int, int, int]] = []

    def relocate(self, spans: Sequence[tuple[int, int]], payload_offset: int) -> None:
        """Read this file, which holds only ``spans`` of a whole input payload back to
        back, at the offsets of that whole file (``payload_offset`` + payload offset)."""
        at = payload_offset
        self._spans = []
        for a, b in spans:
            self._spans.append((payload_offset + a, payload_offset + b, at))
            at += b - a

    def _place(self, offset: int, nbytes: int) -> int:
        """Where bytes ``offset..offset + nbytes`` of the whole file lie in this one.

        Raises:
            EOFError: they lie outside the spans this file holds.
        """
        if not self._spans:
            return offset
        if nbytes == 0:  # an empty run (bf16 has no scales): nothing is read
            return self._spans[0][2]
        for a, b, at in self._spans:
            if a <= offset and offset + nbytes <= b:
                return at + offset - a
        raise EOFError(f"{self.path} holds no bytes {offset}..{offset + nbytes} of its input")

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
                store().read_into(self._file(), start, data.data, self.path)
            again = ""
            if zlib.crc32(data) != self._crcs[block] and self._buf is None and self._drop_cached:
                store().drop_cached(self._file(), start, size)
                store().read_into(self._file(), start, data.data, self.path)
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
        self._read_at(0, buf)
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
        offset = self._place(offset, count * dtype.itemsize)
        self._check_mapped_end(offset, count * dtype.itemsize)
        self._verify(offset, count * dtype.itemsize)
        return np.frombuffer(self._buf, dtype=dtype, count=count, offset=offset)

    def read_into(self, offset: int, dst: np.ndarray) -> None:
        """Fill ``dst`` from byte ``offset``.

        Raises:
            EOFError: the file is shorter. ChecksumError: a block fails its CRC.
            OSError: reading failed.
        """
        self._read_at(self._place(offset, dst.nbytes), dst)

    def _read_at(self, offset: int, dst: np.ndarray) -> None:
        if self._buf is not None:
            self._check_mapped_end(offset, dst.nbytes)
        self._verify(offset, dst.nbytes)
        if self._buf is not None:
            np.copyto(dst.reshape(-1).view(np.uint8), self._buf[offset : offset + dst.nbytes])
            return
        store().read_into(self._file(), offset, dst.data, self.path)

    def _file(self) -> int:
        if self._fd is None:
            self._fd, _ = open_data(self.path, self._dir_fd)
        return self._fd

    def close(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                store().close(self._fd)
            self._fd = None


def shared_target(path: Path, dir_fd: int | None = None) -> Path:
    """The file that the symbolic link ``path`` (in directory ``dir_fd``) leads to, which
    must be its rank's shared arrays beside it (``d-<rank>.in`` -> ``d-<rank>-b<n>.in``:
    what ``buffers_like`` makes); no other link is followed.

    Raises:
        OSError: ELOOP for a link anywhere else; as the system reported it.
    """
    target = store().link_target(dir_fd, path)
    rank = shared_input_rank(target)
    if rank is None or path.name != data_name(rank, "in"):
        raise OSError(
            errno.ELOOP,
            f"{path} is a symbolic link to {target!r}, not to its rank's shared arrays "
            "beside it (d-<rank>-b<n>.in): refused",
            str(path),
        )
    return path.with_name(target)
