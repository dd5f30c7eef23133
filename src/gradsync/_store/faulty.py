"""A store for tests: every operation goes to another store, is recorded, and fails where
the test says (ENOSPC, EIO, a denied listing, a stale handle). Use it through
:func:`gradsync._testing.use_store`."""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from .api import Name, Store
from .posix import PosixStore

__all__ = ["FaultyStore"]

# (operation, name) -> what to raise, or None to let it through.
Fault = Callable[[str, str], BaseException | None]


def _never(op: str, name: str) -> BaseException | None:
    return None


class FaultyStore:
    """``inner`` (a :class:`PosixStore` by default), recording each operation as
    ``(method name, name acted on)`` in :attr:`calls` and first raising what
    ``fail(method name, name)`` returns, if anything. An operation on a handle is
    recorded under the name it was opened by (a directory's last name, or a file's)."""

    def __init__(self, fail: Fault = _never, inner: Store | None = None) -> None:
        self.inner: Store = PosixStore() if inner is None else inner
        self.fail = fail
        self.calls: list[tuple[str, str]] = []
        self._names: dict[int, str] = {}

    def name_of(self, handle: int) -> str:
        """The name an open directory or file was opened by ("?" if unknown)."""
        return self._names.get(handle, "?")

    def _check(self, op: str, name: Name | int) -> None:
        shown = self._names.get(name, "?") if isinstance(name, int) else os.path.basename(name)
        self.calls.append((op, shown))
        exc = self.fail(op, shown)
        if exc is not None:
            raise exc

    def _opened(self, handle: int, name: Name) -> int:
        self._names[handle] = os.path.basename(name)
        return handle

    def make_root(self, path: Path) -> None:
        self._check("make_root", path)
        self.inner.make_root(path)

    def open_root(self, path: Path) -> int:
        self._check("open_root", path)
        return self._opened(self.inner.open_root(path), path)

    def open_dir(self, parent: int, name: str, shown: Path) -> int:
        self._check("open_dir", name)
        return self._opened(self.inner.open_dir(parent, name, shown), name)

    def close_dir(self, handle: int) -> None:
        self._names.pop(handle, None)
        self.inner.close_dir(handle)

    def make_dir(self, parent: int, name: str, *, own: bool) -> None:
        self._check("make_dir", name)
        self.inner.make_dir(parent, name, own=own)

    def is_own(self, handle: int, *, strict: bool = False) -> bool:
        self._check("is_own", handle)
        return self.inner.is_own(handle, strict=strict)

    def remove_own_dir(self, parent: int, name: str) -> bool:
        self._check("remove_own_dir", name)
        return self.inner.remove_own_dir(parent, name)

    def remove_dir(self, parent: int, name: str, names: Iterable[str] = ()) -> None:
        self._check("remove_dir", name)
        self.inner.remove_dir(parent, name, names)

    def list(self, handle: int) -> set[str]:
        self._check("list", handle)
        return self.inner.list(handle)

    def stat(self, dir_fd: int | None, name: Name) -> os.stat_result:
        self._check("stat", name)
        return self.inner.stat(dir_fd, name)

    def publish(
        self, dir_fd: int | None, name: Name, chunks: Sequence[bytes | memoryview], mode: int
    ) -> int:
        self._check("publish", name)
        return self.inner.publish(dir_fd, name, chunks, mode)

    def create(self, dir_fd: int | None, name: Name) -> None:
        self._check("create", name)
        self.inner.create(dir_fd, name)

    def move(self, src_dir: int | None, src: Name, dst_dir: int | None, dst: Name) -> None:
        self._check("move", dst)
        self.inner.move(src_dir, src, dst_dir, dst)

    def remove(self, dir_fd: int | None, name: Name) -> None:
        self._check("remove", name)
        self.inner.remove(dir_fd, name)

    def symlink(self, dir_fd: int | None, target: str, name: Name) -> None:
        self._check("symlink", name)
        self.inner.symlink(dir_fd, target, name)

    def write_in_place(
        self,
        dir_fd: int | None,
        name: Name,
        chunks: Sequence[bytes | memoryview | int],
        midway: Callable[[], None] | None,
    ) -> int:
        self._check("write_in_place", name)
        return self.inner.write_in_place(dir_fd, name, chunks, midway)

    def open_own(self, dir_fd: int | None, name: Name, access: int) -> tuple[int, os.stat_result]:
        self._check("open_own", name)
        fd, st = self.inner.open_own(dir_fd, name, access)
        return self._opened(fd, name), st

    def open_read(
        self, dir_fd: int | None, name: Name, *, follow: bool = True
    ) -> tuple[int, os.stat_result]:
        self._check("open_read", name)
        fd, st = self.inner.open_read(dir_fd, name, follow=follow)
        return self._opened(fd, name), st

    def write_at(self, fd: int, data: bytes, offset: int) -> int:
        self._check("write_at", fd)
        return self.inner.write_at(fd, data, offset)

    def read_at(self, fd: int, size: int, offset: int) -> bytes:
        self._check("read_at", fd)
        return self.inner.read_at(fd, size, offset)

    def read_into(self, fd: int, offset: int, buf: memoryview, shown: Name) -> None:
        self._check("read_into", fd)
        self.inner.read_into(fd, offset, buf, shown)

    def drop_cached(self, fd: int, offset: int, length: int) -> None:
        self._check("drop_cached", fd)
        self.inner.drop_cached(fd, offset, length)

    def close(self, fd: int) -> None:
        self._names.pop(fd, None)
        self.inner.close(fd)

    def map(self, fd: int, size: int, *, writable: bool) -> mmap.mmap | None:
        self._check("map", fd)
        return self.inner.map(fd, size, writable=writable)

    def link_target(self, dir_fd: int | None, name: Name) -> str:
        self._check("link_target", name)
        return self.inner.link_target(dir_fd, name)


if TYPE_CHECKING:
    _conforms: Store = FaultyStore()  # mypy checks it is a whole Store
