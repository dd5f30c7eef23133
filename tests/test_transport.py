"""The data-file transport: kept mappings are reused only while the file is the same."""

from __future__ import annotations

import os
import re
import zlib
from pathlib import Path

import numpy as np
import pytest

from gradsync._step.header import CRC_BLOCK
from gradsync._step.transport import SHRINK_AFTER_CALLS, ChecksumError, Transport
from gradsync._store.dirs import GenDir
from gradsync._testing import FaultyStore, PosixStore, use_store


def _write(path: Path, data: bytes) -> None:
    temp = path.with_name(path.name + ".tmp")
    temp.write_bytes(data)
    os.replace(temp, path)


def test_kept_mapping_is_reused_and_sees_rewrites_in_place(tmp_path: Path) -> None:
    path = tmp_path / "d-1-0.in"
    path.write_bytes(b"A" * 100)
    transport = Transport(mapped=True, head_bytes=16)
    first = transport.open(path)
    assert first.head == b"A" * 16
    with path.open("r+b") as f:  # a writer rewriting its file in place, same size
        f.write(b"B" * 100)
    second = transport.open(path)
    assert second.head == b"B" * 16
    assert second.size == 100
    view = second.view(0, 100, np.dtype(np.uint8))
    assert view is not None
    assert np.shares_memory(view, first.view(0, 100, np.dtype(np.uint8)))
    transport.close()


@pytest.mark.parametrize("size", [100, 300])
def test_replaced_or_resized_file_is_mapped_again(tmp_path: Path, size: int) -> None:
    path = tmp_path / "d-1-0.in"
    path.write_bytes(b"A" * 100)
    transport = Transport(mapped=True, head_bytes=16)
    old = transport.open(path).view(0, 100, np.dtype(np.uint8))
    assert old is not None
    # Same size but another inode, or another size: the kept mapping must not be used.
    _write(path, b"C" * size)
    reader = transport.open(path)
    assert reader.head == b"C" * 16
    assert reader.size == size
    data = reader.view(0, size, np.dtype(np.uint8))
    assert data is not None
    assert bytes(data) == b"C" * size
    transport.close()


def _copy(pairs: list[tuple[np.ndarray, np.ndarray]]) -> None:
    for dst, src in pairs:
        np.copyto(dst, src)


def test_own_file_keeps_its_pages_for_smaller_writes_until_small_for_long(
    tmp_path: Path,
) -> None:
    path = tmp_path / "d-0.in"
    writer, reader = Transport(mapped=True, head_bytes=4), Transport(mapped=True, head_bytes=4)
    writer.write(path, [b"A" * 8192], None, _copy)
    first = os.stat(path)
    peer = reader.open(path).view(0, 8192, np.dtype(np.uint8))
    for i in range(SHRINK_AFTER_CALLS - 1):
        writer.write(path, [bytes([66 + i]) * 3000], None, _copy)
        st = os.stat(path)
        assert (st.st_ino, st.st_size) == (first.st_ino, 8192)
        opened = reader.open(path)  # the peer's kept mapping still serves
        assert opened.size == 8192
        assert opened.head == bytes([66 + i]) * 4
        assert np.shares_memory(peer, opened.view(0, 3000, np.dtype(np.uint8)))
    del peer  # past byte 3000 it would fault once the file shrinks
    writer.write(path, [b"Z" * 3000], None, _copy)
    assert os.stat(path).st_size == 3000
    assert reader.open(path).size == 3000
    writer.close()
    reader.close()


@pytest.mark.parametrize("size", [1, (3 << 20) + 5])
def test_mapped_files_are_allocated_without_posix_fallocate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, size: int
) -> None:
    # macOS has no posix_fallocate: a mapped transport raised AttributeError there.
    monkeypatch.delattr(os, "posix_fallocate")
    path = tmp_path / "d-0.in"
    path.write_bytes(b"\xff" * 10)  # a file of an earlier size is resized
    transport = Transport(mapped=True, head_bytes=64)
    buf = transport.reserve(path, size)
    st = os.stat(path)
    assert (buf.size, st.st_size) == (size, size)
    assert st.st_blocks * 512 >= size  # no hole left to fault in later
    buf[-1] = 7
    transport.close()
    assert path.read_bytes()[-1] == 7


def test_unmapped_transport_reads_through_a_descriptor(tmp_path: Path) -> None:
    path = tmp_path / "d-1-0.in"
    path.write_bytes(bytes(range(100)))
    transport = Transport(mapped=False, head_bytes=16)
    reader = transport.open(path)
    assert reader.view(0, 4, np.dtype(np.uint8)) is None
    out = np.empty(4, np.uint8)
    reader.read_into(96, out)
    assert out.tolist() == [96, 97, 98, 99]
    reader.close()


def test_open_missing_file_raises(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        Transport(mapped=True, head_bytes=16).open(tmp_path / "absent")


def _prune(gen: Path, seq: int, world: int) -> None:
    held = GenDir(gen)
    try:
        held.prune(seq, (f"{p}-{q}" for p in ("in", "out") for q in range(world)))
    finally:
        held.close()


def test_prune_removes_an_emptied_step_dir(tmp_path: Path) -> None:
    step_dir = tmp_path / "s-3"
    step_dir.mkdir()
    _prune(tmp_path, 3, 3)
    assert not step_dir.exists()
    _prune(tmp_path, 3, 3)  # already gone: nothing to do


@pytest.mark.parametrize(
    "left",
    [
        ("in-0", "in-1", "in-2"),  # markers nobody moved on
        ("out-0", "out-1"),  # of a sharded call followed by a replicated one
        ("in-0", "out-0", "abort-1", "out-1"),  # an abort note: only rmtree gets it
    ],
)
def test_prune_removes_whatever_is_left(tmp_path: Path, left: tuple[str, ...]) -> None:
    step_dir = tmp_path / "s-3"
    step_dir.mkdir()
    for name in left:
        (step_dir / name).write_text("{}")
    _prune(tmp_path, 3, 3)
    assert not step_dir.exists()


@pytest.mark.parametrize("shared", [True, False])
def test_pages_cached_of_a_file_another_host_wrote_are_dropped_before_reading(
    tmp_path: Path, shared: bool
) -> None:
    path = tmp_path / "d-1.in"
    path.write_bytes(b"A" * 100)
    with use_store(FaultyStore()) as store:
        transport = Transport(mapped=False, head_bytes=16, shared=shared)
        reader = transport.open(path)
        assert reader.head == b"A" * 16
        reader.close()
    dropped = [("drop_cached", "d-1.in")] if shared else []
    assert store.calls == [("open_read", "d-1.in"), *dropped, ("read_at", "d-1.in")]


def _with_crcs(tmp_path: Path, payload: bytes, offset: int) -> tuple[Path, str]:
    path = tmp_path / "d-1.out"
    path.write_bytes(b"H" * offset + payload)
    crcs = "".join(
        f"{zlib.crc32(payload[i : i + CRC_BLOCK]):08x}" for i in range(0, len(payload), CRC_BLOCK)
    )
    return path, crcs


def test_pread_with_checksums_refuses_a_garbled_block(tmp_path: Path) -> None:
    payload = bytes(range(256)) * (CRC_BLOCK // 128)  # two blocks
    path, crcs = _with_crcs(tmp_path, payload, 8)
    with path.open("r+b") as f:
        f.seek(8 + CRC_BLOCK + 17)
        f.write(b"\xff")
    reader = Transport(mapped=False, head_bytes=16).open(path)
    reader.expect_crcs(crcs, 8, len(payload))
    first = np.empty(CRC_BLOCK, np.uint8)
    reader.read_into(8, first)  # the first block is intact
    assert first.tobytes() == payload[:CRC_BLOCK]
    message = f"{path} fails its checksum in bytes {8 + CRC_BLOCK}..{8 + 2 * CRC_BLOCK}"
    with pytest.raises(ChecksumError, match=f"^{re.escape(message)}$"):
        reader.read_into(8 + CRC_BLOCK - 2, np.empty(4, np.uint8))
    reader.close()


class _StalePages(PosixStore):
    """Shows the second CRC block of a file garbled ``left`` times, as a host's stale
    cached pages would; records the pages dropped."""

    def __init__(self, left: int) -> None:
        self.left = left
        self.advised: list[tuple[int, int]] = []

    def read_into(
        self, fd: int, offset: int, buf: memoryview, shown: str | os.PathLike[str]
    ) -> None:
        super().read_into(fd, offset, buf, shown)
        if offset == 8 + CRC_BLOCK and self.left:
            self.left -= 1
            buf[17] ^= 0xFF

    def drop_cached(self, fd: int, offset: int, length: int) -> None:
        self.advised.append((offset, length))


@pytest.mark.parametrize("stale_reads", [1, 2])
def test_a_block_failing_its_crc_on_a_shared_filesystem_is_read_again_past_the_cache(
    tmp_path: Path, stale_reads: int
) -> None:
    # A host may be shown a rewritten file's old pages (JuiceFS did): only the pages
    # this host cached can be dropped, so one more read, and a second failure counts.
    payload = bytes(range(256)) * (CRC_BLOCK // 128)  # two blocks
    path, crcs = _with_crcs(tmp_path, payload, 8)
    with use_store(_StalePages(stale_reads)) as store:
        reader = Transport(mapped=False, head_bytes=16, shared=True).open(path)
        reader.expect_crcs(crcs, 8, len(payload))
        out = np.empty(2 * CRC_BLOCK, np.uint8)
        if stale_reads == 1:
            reader.read_into(8, out)
            assert out.tobytes() == payload
        else:
            message = (
                f"{path} fails its checksum in bytes {8 + CRC_BLOCK}..{8 + 2 * CRC_BLOCK}, "
                "read again past this host's cache"
            )
            with pytest.raises(ChecksumError, match=f"^{re.escape(message)}$"):
                reader.read_into(8, out)
        reader.close()
    assert store.advised == [(0, 0), (8 + CRC_BLOCK, CRC_BLOCK)]


def test_its_own_file_is_read_back_without_opening_it_until_its_payload_is_needed(
    tmp_path: Path,
) -> None:
    # Unmapped (a shared filesystem): opening, reading and closing its own input to
    # check its header cost a rank three round trips to the server every step.
    path = tmp_path / "d-0.in"
    with use_store(FaultyStore()) as store:
        transport = Transport(mapped=False, head_bytes=16)
        transport.write(path, [b"H" * 10, b"P" * 30], None, lambda pairs: None)

        def opened() -> list[str]:
            return [name for op, name in store.calls if op == "open_read"]

        reader = transport.open(path)
        assert (reader.head, reader.size, opened()) == (b"H" * 10 + b"P" * 6, 40, [])
        dst = np.empty(30, np.uint8)
        reader.read_into(10, dst)  # the payload is read from the file, opened now
        assert (dst.tobytes(), opened()) == (b"P" * 30, ["d-0.in"])
        reader.close()
        transport.forget(path)
        again = transport.open(path)
        assert again.head == b"H" * 10 + b"P" * 6
        again.close()
        assert opened() == ["d-0.in"] * 2  # forgotten: opened to be read
