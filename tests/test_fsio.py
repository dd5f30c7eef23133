"""File primitives: atomic writes, waiting for a path, polling backoff, exact reads."""

from __future__ import annotations

import errno
import itertools
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gradsync
import workers
from gradsync import ConfigError, SyncDirError, atomic_write_bytes, wait_for_path
from gradsync._job.liveness import Heartbeat, MemberInfo
from gradsync._job.rendezvous import Generation, leave
from gradsync._step.transport import Transport
from gradsync._store.files import (
    Backoff,
    list_names,
    place_marker,
    read_exact_into,
    read_small,
    translate_oserror,
    warn_if_open,
    write_atomic,
    write_in_place,
    write_note,
)
from gradsync._testing import FaultyStore, use_store
from ranks import run_ranks

IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


def exact(message: str) -> str:
    return f"^{re.escape(message)}$"


def temp_files(directory: Path) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.endswith(".tmp"))


# --- ported from the Rust reference -------------------------------------------------------


def test_wait_for_path_times_out(tmp_path: Path) -> None:
    missing = tmp_path / "missing_marker_should_not_exist"
    start = time.monotonic()
    assert wait_for_path(missing, 0.04) is False
    took = time.monotonic() - start
    assert took >= 0.04
    assert took < 2.0  # generous: a loaded 2-core CI machine


def test_atomic_write_and_ready_marker_roundtrip(tmp_path: Path) -> None:
    marker = tmp_path / "sync" / ".ready"
    atomic_write_bytes(marker, b"1")
    assert wait_for_path(marker, 0.1) is True
    assert marker.read_bytes() == b"1"


# --- atomic_write_bytes --------------------------------------------------------------------


def test_atomic_write_creates_parents(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b" / "c" / "file.bin"
    atomic_write_bytes(str(target), b"payload")  # str paths too
    assert target.read_bytes() == b"payload"
    assert os.listdir(target.parent) == ["file.bin"]


def test_atomic_write_empty_data(tmp_path: Path) -> None:
    target = tmp_path / "empty"
    atomic_write_bytes(target, b"")
    assert target.read_bytes() == b""
    assert temp_files(tmp_path) == []


def test_atomic_write_replaces_by_rename(tmp_path: Path) -> None:
    target = tmp_path / "f"
    atomic_write_bytes(target, b"old contents")
    old_inode = target.stat().st_ino
    with open(target, "rb") as held:  # a reader holding the old file keeps the old bytes
        atomic_write_bytes(target, b"new")
        assert held.read() == b"old contents"
    assert target.read_bytes() == b"new"
    assert target.stat().st_ino != old_inode
    assert os.listdir(tmp_path) == ["f"]


def test_atomic_write_readers_never_see_partial_file(tmp_path: Path) -> None:
    target = tmp_path / "f"
    size = 1 << 20
    versions = [bytes([v]) * size for v in (1, 2)]
    atomic_write_bytes(target, versions[0])
    stop = threading.Event()
    reading = threading.Event()
    bad: list[str] = []
    reads = 0

    def reader() -> None:
        nonlocal reads
        while not stop.is_set():
            data = target.read_bytes()
            reads += 1
            reading.set()
            if data not in versions:
                bad.append(f"read {len(data)} bytes, first {data[:1]!r} last {data[-1:]!r}")
                return

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        assert reading.wait(10)
        for i in range(30):
            atomic_write_bytes(target, versions[i % 2])
    finally:
        stop.set()
        thread.join(10)
    assert not thread.is_alive()
    assert bad == []
    assert reads > 0
    assert temp_files(tmp_path) == []


def test_atomic_write_failure_when_target_is_directory(tmp_path: Path) -> None:
    target = tmp_path / "dir"
    target.mkdir()
    (target / "inside").write_bytes(b"x")
    with pytest.raises(
        SyncDirError, match=exact(f"writing {target} failed: Is a directory")
    ) as info:
        atomic_write_bytes(target, b"data")
    assert info.value.errno == errno.EISDIR
    assert info.value.path == str(target)
    assert isinstance(info.value.__cause__, IsADirectoryError)
    assert sorted(os.listdir(tmp_path)) == ["dir"]  # the temp file is gone
    assert os.listdir(target) == ["inside"]


def test_atomic_write_failure_under_regular_file(tmp_path: Path) -> None:
    blocker = tmp_path / "plain"
    blocker.write_bytes(b"not a dir")
    target = blocker / "sub" / "f"
    with pytest.raises(
        SyncDirError, match=exact(f"writing {target} failed: Not a directory")
    ) as info:
        atomic_write_bytes(target, b"data")
    assert info.value.errno == errno.ENOTDIR
    assert info.value.filename == str(target)
    assert isinstance(info.value, OSError)
    assert os.listdir(tmp_path) == ["plain"]
    assert blocker.read_bytes() == b"not a dir"


def test_atomic_write_failure_parent_is_regular_file(tmp_path: Path) -> None:
    blocker = tmp_path / "plain"
    blocker.write_bytes(b"")
    target = blocker / "f"
    with pytest.raises(SyncDirError, match=exact(f"writing {target} failed: File exists")) as info:
        atomic_write_bytes(target, b"data")
    assert info.value.errno == errno.EEXIST
    assert os.listdir(tmp_path) == ["plain"]


def test_atomic_write_failure_mid_write_removes_temp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "f"
    atomic_write_bytes(target, b"old")

    def full(fd: int, buffers: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "writev", full)
    with pytest.raises(
        SyncDirError,
        match=exact(
            f"writing {target} failed: No space left on device "
            "(the sync directory's filesystem is full)"
        ),
    ) as info:
        atomic_write_bytes(target, b"new data")
    monkeypatch.undo()
    assert info.value.errno == errno.ENOSPC
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["f"]


def test_a_sync_dir_that_links_to_nothing_is_named(tmp_path: Path) -> None:
    link = tmp_path / "sync"
    link.symlink_to(tmp_path / "gone")
    cfg = gradsync.FileGradSyncConfig(2, 0, link, max_wait_s=5)
    # mkdir(parents=True) reports only "File exists" for the link itself.
    with pytest.raises(
        SyncDirError,
        match=exact(
            f"sync_dir {link} cannot be created: {link} is a symbolic link to "
            f"{tmp_path}/gone, which does not exist"
        ),
    ):
        gradsync.average_grads_file_sync([np.ones(2)], None, cfg, 0)


def _full(op: str, name: str) -> OSError | None:
    """A filesystem with room for names but not for bytes."""
    return OSError(errno.ENOSPC, "No space left on device") if op == "publish" else None


def test_a_note_without_room_for_its_bytes_is_written_empty(tmp_path: Path) -> None:
    write_note(tmp_path / "roomy", b'{"calls": 3}')
    assert (tmp_path / "roomy").read_bytes() == b'{"calls": 3}'
    with use_store(FaultyStore(_full)):
        write_note(tmp_path / "full", b'{"calls": 3}')
    assert (tmp_path / "full").read_bytes() == b""
    assert sorted(os.listdir(tmp_path)) == ["full", "roomy"]
    # Not even a name: the first error, as the system reported it.
    with pytest.raises(FileNotFoundError, match=r"/gone/\.note\.\d+\.[0-9a-f]+\.tmp'$"):
        write_note(tmp_path / "gone" / "note", b"{}")


def test_write_atomic_interrupted_removes_temp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(fd: int, buffers: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "writev", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_atomic(tmp_path / "f", [b"abc"])
    monkeypatch.undo()
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(IS_ROOT, reason="root bypasses directory permissions")
def test_atomic_write_unwritable_dir(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        target = locked / "f"
        with pytest.raises(
            SyncDirError,
            match=exact(
                f"writing {target} failed: Permission denied "
                "(the sync directory is not writable by this process)"
            ),
        ) as info:
            atomic_write_bytes(target, b"x")
        assert info.value.errno == errno.EACCES
        assert os.listdir(locked) == []
    finally:
        locked.chmod(0o700)


# --- translate_oserror ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "hint"),
    [
        (errno.ENOSPC, " (the sync directory's filesystem is full)"),
        (errno.EACCES, " (the sync directory is not writable by this process)"),
        (errno.EPERM, " (the sync directory is not writable by this process)"),
        (errno.EROFS, " (the sync directory is not writable by this process)"),
        (errno.EIO, ""),
    ],
)
def test_translate_oserror(code: int, hint: str) -> None:
    exc = OSError(code, os.strerror(code))
    err = translate_oserror(exc, "publishing", Path("/gs/in-0"), step=5)
    assert type(err) is SyncDirError
    assert str(err) == f"step 5: publishing /gs/in-0 failed: {os.strerror(code)}{hint}"
    assert (err.errno, err.step, err.path) == (code, 5, "/gs/in-0")
    plain = translate_oserror(exc, "reading", "/gs/x")
    read_hint = hint.replace("not writable", "not readable")
    assert str(plain) == f"reading /gs/x failed: {os.strerror(code)}{read_hint}"
    assert plain.step is None


def test_a_directory_that_cannot_be_listed_is_a_sync_dir_error(tmp_path: Path) -> None:
    assert list_names(tmp_path / "not-yet") == set()

    def stale(op: str, name: str) -> OSError | None:
        return OSError(errno.ESTALE, os.strerror(errno.ESTALE)) if op == "list" else None

    with (
        use_store(FaultyStore(stale)),
        pytest.raises(
            SyncDirError,
            match=exact(f"step 7: listing {tmp_path} failed: {os.strerror(errno.ESTALE)}"),
        ) as info,
    ):
        list_names(tmp_path, step=7)
    assert (info.value.errno, info.value.step) == (errno.ESTALE, 7)


def test_translate_oserror_without_strerror() -> None:
    err = translate_oserror(OSError("weird"), "listing", "/gs")
    assert str(err) == "listing /gs failed: weird"
    assert err.errno is None


# --- wait_for_path -------------------------------------------------------------------------


def test_wait_for_path_existing(tmp_path: Path) -> None:
    target = tmp_path / "here"
    target.write_bytes(b"")
    start = time.monotonic()
    assert wait_for_path(target, 5.0) is True
    assert wait_for_path(str(target), 0) is True
    assert time.monotonic() - start < 1.0


def test_wait_for_path_missing_parent(tmp_path: Path) -> None:
    assert wait_for_path(tmp_path / "no" / "such" / "dir" / "f", 0.01) is False
    blocker = tmp_path / "plain"
    blocker.write_bytes(b"")
    assert wait_for_path(blocker / "f", 0.01) is False  # ENOTDIR counts as "not there yet"


def test_wait_for_path_sees_file_created_later(tmp_path: Path) -> None:
    target = tmp_path / "later" / "f"
    timer = threading.Timer(0.05, atomic_write_bytes, args=(target, b"done"))
    start = time.monotonic()
    timer.start()
    try:
        assert wait_for_path(target, 10.0) is True
    finally:
        timer.join(10)
    took = time.monotonic() - start
    assert 0.04 <= took < 5.0
    assert target.read_bytes() == b"done"


@pytest.fixture
def open_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    real_open = os.open

    def counting_open(path: str, flags: int, *args: object, **kwargs: object) -> int:
        calls.append(os.fspath(path))
        return real_open(path, flags, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", counting_open)
    return calls


def test_wait_for_path_zero_wait_tries_once(tmp_path: Path, open_calls: list[str]) -> None:
    missing = tmp_path / "missing"
    assert wait_for_path(missing, 0) is False
    assert open_calls == [str(missing)]
    with pytest.raises(
        ConfigError, match=r"^max_wait_s must be a finite number of seconds >= 0, got -1\.0$"
    ):
        wait_for_path(missing, -1.0)


def test_wait_for_path_takes_what_the_config_takes(tmp_path: Path) -> None:
    # numpy numbers are seconds to the config, so they are here too; a bool is not.
    target = tmp_path / "there"
    target.write_bytes(b"")
    assert wait_for_path(target, np.float32(0.5)) is True
    assert wait_for_path(tmp_path / "missing", np.float64(0.01)) is False
    assert wait_for_path(target, np.int64(0)) is True
    with pytest.raises(ConfigError, match=r"^max_wait_s must be a number of seconds, got True$"):
        wait_for_path(target, True)


def test_wait_for_path_polls_repeatedly(tmp_path: Path, open_calls: list[str]) -> None:
    assert wait_for_path(tmp_path / "missing", 0.02) is False
    assert len(open_calls) >= 3


def test_wait_for_path_nan_does_not_hang(tmp_path: Path) -> None:
    code = (
        "import sys; from gradsync import wait_for_path\n"
        "try:\n"
        "    wait_for_path(sys.argv[1], float('nan'))\n"
        "except ValueError:\n"
        "    pass\n"
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "missing")], check=True, timeout=3)


# --- Backoff -------------------------------------------------------------------------------


class FakeTime:
    """A clock for Backoff, and its sleeps."""

    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_backoff_yields_then_sleeps_with_growing_caps() -> None:
    clock = FakeTime()
    yields: list[None] = []
    backoff = Backoff(
        spin_s=0.001,
        first_sleep_s=5e-5,
        clock=clock.monotonic,
        sleep=clock.sleep,
        give_way=lambda: yields.append(None),
    )
    # Within the spin window: yield the CPU, never sleep.
    for _ in range(5):
        backoff.pause()
        clock.now += 0.0001
    assert (len(yields), clock.sleeps) == (5, [])
    clock.now += 0.001
    for _ in range(20):
        backoff.pause()
    assert len(yields) == 5
    sleeps = clock.sleeps
    assert sleeps[0] == pytest.approx(7.5e-5)
    assert all(b >= a for a, b in itertools.pairwise(sleeps))  # never shrinks
    assert max(sleeps) == pytest.approx(0.0005)  # sub-millisecond during the first second
    assert backoff.elapsed_s() < 1.0
    clock.now += 1.0
    clock.sleeps.clear()
    for _ in range(30):
        backoff.pause()
    assert all(s <= 0.005 + 1e-12 for s in clock.sleeps)
    assert clock.sleeps[-1] == pytest.approx(0.005)  # gentler polling for long waits


def test_backoff_pauses_at_least_as_asked_even_while_spinning() -> None:
    # Across hosts a look costs a round trip: the wait asks for a pause of 4 looks.
    clock = FakeTime()
    yields: list[None] = []
    backoff = Backoff(
        clock=clock.monotonic, sleep=clock.sleep, give_way=lambda: yields.append(None)
    )
    backoff.pause()  # spinning: yields
    backoff.pause(0.002)  # spinning still, but asked to sleep
    clock.now += 0.5
    backoff.pause(1e-5)  # its own backoff is longer
    assert yields == [None]
    assert clock.sleeps[0] == pytest.approx(0.002)
    assert 1e-5 < clock.sleeps[1] <= 0.0005


def test_backoff_real_clock_sanity() -> None:
    backoff = Backoff()
    start = time.monotonic()
    for _ in range(200):
        backoff.pause()
    took = time.monotonic() - start
    assert 0 <= backoff.elapsed_s() < 5.0
    assert took < 5.0  # 200 pauses of at most 0.5 ms each, plus scheduling slack


# --- read_exact_into / read_small / list_names ---------------------------------------------


def test_read_exact_into(tmp_path: Path) -> None:
    path = tmp_path / "f"
    values = np.arange(10, dtype=np.float32)
    path.write_bytes(b"HEAD" + values.tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        out = np.empty((2, 5), dtype=np.float32)
        read_exact_into(fd, 4, memoryview(out), path)
        np.testing.assert_array_equal(out.reshape(-1), values)
        raw = bytearray(4)
        read_exact_into(fd, 0, memoryview(raw), path)
        assert raw == b"HEAD"
        read_exact_into(fd, 44, memoryview(bytearray()), path)  # nothing to read at EOF
    finally:
        os.close(fd)


def test_read_exact_into_short_file(tmp_path: Path) -> None:
    path = tmp_path / "short"
    path.write_bytes(bytes(10))
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(EOFError, match=exact(f"{path} ends at byte 10, expected 13")):
            read_exact_into(fd, 5, memoryview(bytearray(8)), path)
        with pytest.raises(EOFError, match=exact("label ends at byte 10, expected 14")):
            read_exact_into(fd, 10, memoryview(np.zeros(1, np.float32)), "label")
    finally:
        os.close(fd)


def test_read_small(tmp_path: Path) -> None:
    assert read_small(tmp_path / "missing") is None
    path = tmp_path / "f"
    path.write_bytes(b"x" * 70000)
    assert read_small(path) == b"x" * 70000
    with pytest.raises(OSError, match=re.escape("file is larger than 1000 bytes")) as info:
        read_small(path, limit=1000)
    assert info.value.errno == errno.EFBIG


def test_list_names(tmp_path: Path) -> None:
    assert list_names(tmp_path / "missing") == set()
    (tmp_path / "a").write_bytes(b"")
    (tmp_path / ".b").mkdir()
    assert list_names(tmp_path) == {"a", ".b"}


# --- write_atomic --------------------------------------------------------------------------


def mixed_chunks(count: int) -> list[bytes | memoryview]:
    rng = np.random.default_rng(1234)
    dtypes = [np.float16, np.float32, np.float64, np.int8, np.uint16, np.int64, np.complex64]
    chunks: list[bytes | memoryview] = []
    for i in range(count):
        kind = i % 5
        if kind == 0:
            chunks.append(rng.bytes(int(rng.integers(0, 40))))
        elif kind == 1:
            chunks.append(b"")
        else:
            dtype = dtypes[i % len(dtypes)]
            shape = (int(rng.integers(0, 7)),) if kind != 4 else (2, int(rng.integers(1, 4)))
            arr = (rng.standard_normal(shape) * 1000).astype(dtype)
            chunks.append(memoryview(arr))
    return chunks


def as_bytes(chunk: bytes | memoryview) -> bytes:
    return chunk.tobytes() if isinstance(chunk, memoryview) else bytes(chunk)


@pytest.mark.parametrize("count", [0, 1, 511, 512, 513, 1500])
def test_write_atomic_many_chunks(tmp_path: Path, count: int) -> None:
    chunks = mixed_chunks(count)
    expected = b"".join(as_bytes(c) for c in chunks)
    target = tmp_path / "out"
    assert write_atomic(target, chunks) == len(expected)
    assert target.read_bytes() == expected
    assert os.listdir(tmp_path) == ["out"]


def test_write_atomic_batches_stay_under_iov_max(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_writev = os.writev
    batch_sizes: list[int] = []

    def spy(fd: int, buffers: list[memoryview]) -> int:
        batch_sizes.append(len(buffers))
        return real_writev(fd, buffers)

    monkeypatch.setattr(os, "writev", spy)
    chunks = [bytes([i % 256]) * 3 for i in range(1300)]
    assert write_atomic(tmp_path / "out", chunks) == 3900
    monkeypatch.undo()
    assert batch_sizes == [512, 512, 276]
    assert (tmp_path / "out").read_bytes() == b"".join(chunks)


@pytest.mark.parametrize("limit", [1, 7, 64, 1000])
def test_write_atomic_survives_short_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, limit: int
) -> None:
    """``writev`` may write less than asked (pipes, signals, NFS): the rest must follow."""

    def short_writev(fd: int, buffers: list[memoryview]) -> int:
        data = b""
        for buf in buffers:
            data += bytes(buf[: limit - len(data)])
            if len(data) >= limit:
                break
        return os.write(fd, data)

    monkeypatch.setattr(os, "writev", short_writev)
    chunks = mixed_chunks(700)
    expected = b"".join(as_bytes(c) for c in chunks)
    assert write_atomic(tmp_path / "out", chunks) == len(expected)
    monkeypatch.undo()
    assert (tmp_path / "out").read_bytes() == expected


@pytest.mark.parametrize(
    "dtype",
    [np.float16, np.float32, np.float64, np.int32, np.uint8, np.complex128, np.bool_],
)
def test_write_atomic_numpy_memoryviews(tmp_path: Path, dtype: type[np.generic]) -> None:
    rng = np.random.default_rng(7)
    arrays = [(rng.standard_normal(n) * 100).astype(dtype) for n in (0, 1, 17, 4096)]
    matrix = (rng.standard_normal((3, 4)) * 100).astype(dtype)
    chunks: list[bytes | memoryview] = [b"hdr", *(a.data for a in arrays), memoryview(matrix)]
    expected = b"hdr" + b"".join(a.tobytes() for a in arrays) + matrix.tobytes()
    target = tmp_path / "grads"
    assert write_atomic(target, chunks) == len(expected)
    assert target.read_bytes() == expected
    back = np.frombuffer(target.read_bytes(), dtype=dtype, offset=3 + arrays[0].nbytes)
    np.testing.assert_array_equal(back[: arrays[1].size], arrays[1])


def test_write_atomic_temp_name_is_hidden_and_in_same_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_rename = os.rename
    renames: list[tuple[str, str]] = []

    def spy(src: str, dst: str, **kw: Any) -> None:
        renames.append((os.fspath(src), os.fspath(dst)))
        real_rename(src, dst, **kw)

    monkeypatch.setattr(os, "rename", spy)
    write_atomic(tmp_path / "target", [b"x"])
    monkeypatch.undo()
    [(src, dst)] = renames
    assert dst == str(tmp_path / "target")
    assert os.path.dirname(src) == str(tmp_path)
    name = os.path.basename(src)
    assert name.startswith(f".target.{os.getpid()}.")
    assert name.endswith(".tmp")


def test_write_in_place_midway_hook_and_truncation(tmp_path: Path) -> None:
    target = tmp_path / "out"
    target.write_bytes(b"z" * 500)  # a longer earlier content must not survive
    chunks = [b"a" * 10, b"b" * 20, b"c" * 30, b"d" * 40]
    seen: list[bytes] = []

    def midway() -> None:
        seen.append(target.read_bytes()[:30])

    assert write_in_place(target, chunks, midway=midway) == 100
    assert seen == [b"a" * 10 + b"b" * 20]  # the first half of the chunks, in place
    assert target.read_bytes() == b"".join(chunks)
    assert os.listdir(tmp_path) == ["out"]


@pytest.mark.parametrize("before", [0, 99, 100, 101, 500])
def test_write_in_place_truncates_by_the_size_it_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, before: int
) -> None:
    # One fstat, at the open: a second after writing was a round trip to the server of
    # a shared filesystem for every data file written.
    target = tmp_path / "out"
    if before:
        target.write_bytes(b"z" * before)
    stats: list[int] = []
    real_fstat = os.fstat
    monkeypatch.setattr(os, "fstat", lambda fd: stats.append(fd) or real_fstat(fd))
    assert write_in_place(target, [b"a" * 40, b"b" * 60]) == 100
    assert target.read_bytes() == b"a" * 40 + b"b" * 60
    assert len(stats) == 1


@pytest.mark.parametrize("before", [b"", b"z" * 30, b"z" * 80])
@pytest.mark.parametrize("last", [[], [b""]])
def test_write_in_place_leaves_skipped_bytes_as_they_are(
    tmp_path: Path, before: bytes, last: list[bytes]
) -> None:
    # An int chunk: bytes only their writer reads (a compressed input's own shard).
    target = tmp_path / "out"
    target.write_bytes(before)
    assert write_in_place(target, [b"a" * 10, 20, b"b" * 10, 15, *last]) == 55
    old = before.ljust(55, b"\0")
    assert target.read_bytes() == b"a" * 10 + old[10:30] + b"b" * 10 + old[40:55]


def test_write_in_place_failure_midway_propagates(tmp_path: Path) -> None:
    target = tmp_path / "out"

    def boom() -> None:
        raise OSError(errno.EIO, "Input/output error")

    with pytest.raises(OSError, match=r"Input/output error"):
        write_in_place(target, [b"x" * 100, b"y" * 100], midway=boom)
    # Half-written, as readers never see it: only a marker, created after, publishes it.
    assert target.read_bytes() == b"x" * 100


def test_write_in_place_of_a_chunk_per_param_of_a_large_model(tmp_path: Path) -> None:
    """A step without mmap (a shared filesystem) writes a chunk per param. (Removing each
    written chunk from the front of the list made this quadratic: 400,000 chunks took
    about 10 s on the 2-core machine, 0.5 s now; speed is the benchmarks' business, not
    an assertion here.)"""
    count = 400_000
    data = np.arange(count, dtype=np.uint32).astype(np.uint8)
    chunks = [memoryview(data[i : i + 1]) for i in range(count)]
    target = tmp_path / "out"
    assert write_in_place(target, chunks) == count
    assert target.read_bytes() == data.tobytes()


# --- markers --------------------------------------------------------------------------------


def test_place_marker_moves_the_old_marker(tmp_path: Path) -> None:
    (tmp_path / "s-1").mkdir()
    (tmp_path / "s-3").mkdir()
    old = tmp_path / "s-1" / "in-0"
    old.touch()
    inode = old.stat().st_ino
    place_marker(tmp_path / "s-3" / "in-0", str(old))
    assert not old.exists()
    assert (tmp_path / "s-3" / "in-0").stat().st_ino == inode


@pytest.mark.parametrize("reuse", [None, "s-1/in-0", "gone/in-0"])
def test_place_marker_creates_when_there_is_nothing_to_move(
    tmp_path: Path, reuse: str | None
) -> None:
    (tmp_path / "s-1").mkdir()
    target = tmp_path / "in-0"
    place_marker(target, None if reuse is None else str(tmp_path / reuse))
    assert target.is_file()
    assert target.stat().st_size == 0


def test_place_marker_refuses_an_existing_marker_it_would_create(tmp_path: Path) -> None:
    target = tmp_path / "in-0"
    target.touch()
    with pytest.raises(FileExistsError):
        place_marker(target, str(tmp_path / "absent"))


def test_place_marker_into_a_missing_directory_fails(tmp_path: Path) -> None:
    old = tmp_path / "in-0"
    old.touch()
    with pytest.raises(FileNotFoundError):
        place_marker(tmp_path / "gone" / "in-0", str(old))
    assert old.exists()  # nothing moved


def test_the_last_rank_to_leave_does_not_raise(tmp_path: Path) -> None:
    members = (MemberInfo.for_self(0, "ab" * 8),)
    gen = Generation(tmp_path, "ab" * 8, members, 0)
    leave(gen, 3)  # the last rank to leave removes the generation: must not raise
    assert (tmp_path / "left-0").read_bytes() == b'{"calls": 3}'


def test_leaving_a_directory_that_cannot_be_listed_does_not_raise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def denied(path: object) -> list[str]:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

    monkeypatch.setattr(os, "listdir", denied)
    gen = Generation(tmp_path, "ab" * 8, (MemberInfo.for_self(0, "ab" * 8),), 0)
    leave(gen, 1)  # cannot tell whether it is the last: leaves the directory in place
    assert (tmp_path / "left-0").read_bytes() == b'{"calls": 1}'


# -- names other users may have planted in a shared sync dir ----------------------------


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A file of the user's own outside the sync dir, which planted names lead to."""
    path = tmp_path / "precious.txt"
    path.write_bytes(b"not gradients")
    return path


def _plant_symlink(sync: Path, name: str, victim: Path) -> Path:
    sync.mkdir(exist_ok=True)
    (sync / name).symlink_to(victim)
    return sync / name


def test_write_in_place_refuses_a_symbolic_link(tmp_path: Path, victim: Path) -> None:
    path = _plant_symlink(tmp_path / "sync", "d-0-1.in", victim)
    with pytest.raises(OSError, match="symbolic links") as info:
        write_in_place(path, [b"gradients"])
    assert info.value.errno == errno.ELOOP
    assert victim.read_bytes() == b"not gradients"
    assert "a symbolic link where gradsync writes a file of its own" in str(
        translate_oserror(info.value, "writing", path)
    )


def test_write_in_place_refuses_a_hard_link(tmp_path: Path, victim: Path) -> None:
    (tmp_path / "sync").mkdir()
    path = tmp_path / "sync" / "d-0-1.in"
    os.link(victim, path)
    with pytest.raises(OSError, match="has 2 links: not a file gradsync made") as info:
        write_in_place(path, [b"gradients"])
    assert info.value.errno == errno.EMLINK
    assert victim.read_bytes() == b"not gradients"


def test_write_in_place_refuses_a_fifo_without_blocking(tmp_path: Path) -> None:
    path = tmp_path / "d-0-1.in"
    os.mkfifo(path)
    # Write-only opens of a FIFO without a reader fail at once (ENXIO) rather than wait.

    def blocked(signum: int, frame: object) -> None:
        raise AssertionError("write_in_place blocked on a FIFO")  # not hang the suite

    previous = signal.signal(signal.SIGALRM, blocked)
    signal.alarm(60)
    try:
        with pytest.raises(OSError, match="No such device or address") as info:
            write_in_place(path, [b"gradients"])
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert info.value.errno == errno.ENXIO


def test_a_note_is_not_written_through_a_symbolic_link(tmp_path: Path, victim: Path) -> None:
    path = _plant_symlink(tmp_path / "sync", "abort-0", victim)
    # No room for its bytes: the fallback opens the name itself.
    with use_store(FaultyStore(_full)), pytest.raises(OSError, match="No space left") as info:
        write_note(path, b"{}")
    assert info.value.errno == errno.ENOSPC
    assert victim.read_bytes() == b"not gradients"


def test_a_mapped_data_file_is_not_opened_through_a_symbolic_link(
    tmp_path: Path, victim: Path
) -> None:
    path = _plant_symlink(tmp_path / "sync", "d-0.in", victim)
    with pytest.raises(OSError, match="symbolic links") as info:
        Transport(mapped=True, head_bytes=64).reserve(path, 4096)
    assert info.value.errno == errno.ELOOP
    assert victim.read_bytes() == b"not gradients"


def test_a_heartbeat_is_not_written_through_a_symbolic_link(tmp_path: Path, victim: Path) -> None:
    path = _plant_symlink(tmp_path / "sync", "hb-0123456789abcdef", victim)
    Heartbeat(path, 3600.0).stop()  # its failures are only logged
    assert victim.read_bytes() == b"not gradients"


def test_what_a_job_creates_is_not_readable_by_other_users(tmp_path: Path) -> None:
    sync = tmp_path / "sync"  # created by the ranks
    results = run_ranks(workers.modes_of_what_a_job_creates, 2, (2, str(sync)))
    assert all(r.ok for r in results.values()), results
    modes = results[0].value
    gens = [name for name in modes if name.startswith("gen-") and "/" not in name]
    assert len(gens) == 1, modes
    # The group keeps what the umask (002) gives it; other users get nothing.
    assert modes["."] == modes["rdzv"] == modes[gens[0]] == 0o770, modes
    files = {name: mode for name, mode in modes.items() if "/d-" in name}
    assert files, modes
    assert all(mode == 0o640 for mode in files.values()), modes
    assert all(mode & 0o007 == 0 for mode in modes.values()), modes


def test_a_sync_dir_every_user_can_write_is_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    shared = tmp_path / "group"
    shared.mkdir()
    shared.chmod(0o2770)  # a group's directory: no warning
    with caplog.at_level("WARNING", logger="gradsync"):
        warn_if_open(shared)
    assert caplog.records == []
    shared.chmod(0o1777)
    with caplog.at_level("WARNING", logger="gradsync"):
        warn_if_open(shared)
    (record,) = caplog.records
    assert f"sync dir {shared} is writable by every user (mode 1777" in record.getMessage()
