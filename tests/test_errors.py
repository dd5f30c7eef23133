"""The exception hierarchy: built-in bases, attributes, pickling, and the public namespace."""

from __future__ import annotations

import copy
import errno
import inspect
import pickle
from pathlib import Path

import pytest

import gradsync
from gradsync import (
    ConfigError,
    CorruptFileError,
    GradSyncError,
    InvalidGradsError,
    MismatchError,
    NonFiniteGradError,
    PeerAbortedError,
    PeerLostError,
    PeerTimeoutError,
    RendezvousError,
    SyncDirError,
    WgpuBridgeError,
    _errors,
)

BUILTIN_BASE: dict[type[GradSyncError], type[BaseException]] = {
    ConfigError: ValueError,
    InvalidGradsError: ValueError,
    MismatchError: ValueError,
    NonFiniteGradError: FloatingPointError,
    CorruptFileError: ValueError,
    PeerTimeoutError: TimeoutError,
    PeerLostError: ConnectionError,
    PeerAbortedError: RuntimeError,
    RendezvousError: RuntimeError,
    SyncDirError: OSError,
    WgpuBridgeError: RuntimeError,
}
ALL_ERRORS = [GradSyncError, *BUILTIN_BASE]
PROTOCOLS = range(pickle.HIGHEST_PROTOCOL + 1)


def test_every_error_class_is_covered() -> None:
    defined = {
        obj
        for _, obj in inspect.getmembers(_errors, inspect.isclass)
        if issubclass(obj, GradSyncError)
    }
    assert defined == set(ALL_ERRORS)
    assert sorted(_errors.__all__) == sorted(cls.__name__ for cls in ALL_ERRORS)


@pytest.mark.parametrize(("cls", "base"), BUILTIN_BASE.items(), ids=lambda x: x.__name__)
def test_subclasses(cls: type[GradSyncError], base: type[BaseException]) -> None:
    assert issubclass(cls, GradSyncError)
    assert issubclass(cls, base)
    assert issubclass(cls, Exception)


def test_builtin_families() -> None:
    assert issubclass(PeerLostError, OSError)  # ConnectionError is an OSError
    assert issubclass(NonFiniteGradError, ArithmeticError)
    assert not issubclass(GradSyncError, (ValueError, OSError, RuntimeError, TimeoutError))


@pytest.mark.parametrize(("cls", "base"), BUILTIN_BASE.items(), ids=lambda x: x.__name__)
def test_caught_by_builtin(cls: type[GradSyncError], base: type[BaseException]) -> None:
    with pytest.raises(base, match=r"^boom at step 3$") as info:
        raise cls("boom at step 3", step=3)
    assert type(info.value) is cls
    with pytest.raises(GradSyncError, match=r"^boom$"):
        raise cls("boom")


def test_except_clauses_of_unaware_callers() -> None:
    caught: list[str] = []
    for exc, handler_name in [
        (PeerTimeoutError("slow"), "TimeoutError"),
        (PeerLostError("gone"), "ConnectionError"),
        (SyncDirError("full", errno=errno.ENOSPC), "OSError"),
        (ConfigError("bad"), "ValueError"),
        (NonFiniteGradError("nan"), "FloatingPointError"),
        (PeerAbortedError("stop"), "RuntimeError"),
    ]:
        try:
            raise exc
        except TimeoutError:
            caught.append("TimeoutError")
        except ConnectionError:
            caught.append("ConnectionError")
        except OSError:
            caught.append("OSError")
        except ValueError:
            caught.append("ValueError")
        except FloatingPointError:
            caught.append("FloatingPointError")
        except RuntimeError:
            caught.append("RuntimeError")
        assert caught[-1] == handler_name


@pytest.mark.parametrize("cls", ALL_ERRORS, ids=lambda c: c.__name__)
def test_attributes_kept(cls: type[GradSyncError]) -> None:
    exc = cls("ranks 1 and 3 disagree", step=7, ranks=[1, 3], path=Path("/tmp/gs/step-7"))
    assert str(exc) == "ranks 1 and 3 disagree"
    assert exc.message == "ranks 1 and 3 disagree"
    assert exc.args == ("ranks 1 and 3 disagree",)
    assert exc.step == 7
    assert exc.ranks == (1, 3)
    assert isinstance(exc.ranks, tuple)
    assert exc.path == "/tmp/gs/step-7"
    assert isinstance(exc.path, str)


@pytest.mark.parametrize("cls", ALL_ERRORS, ids=lambda c: c.__name__)
def test_attribute_defaults(cls: type[GradSyncError]) -> None:
    exc = cls("plain")
    assert (exc.step, exc.ranks, exc.path) == (None, (), None)
    assert str(exc) == "plain"


def test_ranks_accepts_any_sequence() -> None:
    assert GradSyncError("m", ranks=range(3)).ranks == (0, 1, 2)
    assert GradSyncError("m", ranks=(5,)).ranks == (5,)


def test_sync_dir_error_oserror_attributes() -> None:
    exc = SyncDirError("writing /x failed", errno=errno.EACCES, step=2, path="/x")
    assert type(exc) is SyncDirError  # not turned into PermissionError by OSError.__new__
    assert exc.errno == errno.EACCES
    assert exc.strerror is not None
    assert exc.filename == "/x"
    assert exc.path == "/x"
    assert str(exc) == "writing /x failed"
    plain = SyncDirError("no errno")
    assert (plain.errno, plain.strerror, plain.filename) == (None, None, None)


def _same(a: GradSyncError, b: GradSyncError) -> None:
    assert type(a) is type(b)
    assert str(a) == str(b)
    assert a.message == b.message
    assert a.args == b.args
    assert (a.step, a.ranks, a.path) == (b.step, b.ranks, b.path)


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("cls", ALL_ERRORS, ids=lambda c: c.__name__)
def test_pickle_round_trip(cls: type[GradSyncError], protocol: int) -> None:
    exc = cls("peer 2 timed out", step=11, ranks=(2, 0), path="/tmp/gs/gen-1/step-11")
    back = pickle.loads(pickle.dumps(exc, protocol=protocol))
    _same(back, exc)
    bare = pickle.loads(pickle.dumps(cls("bare"), protocol=protocol))
    _same(bare, cls("bare"))


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_pickle_sync_dir_error_keeps_errno(protocol: int) -> None:
    exc = SyncDirError("disk full", errno=errno.ENOSPC, step=4, ranks=[1], path="/tmp/gs")
    back = pickle.loads(pickle.dumps(exc, protocol=protocol))
    _same(back, exc)
    assert back.errno == errno.ENOSPC
    assert back.strerror == exc.strerror
    assert back.filename == "/tmp/gs"
    none = pickle.loads(pickle.dumps(SyncDirError("x"), protocol=protocol))
    assert none.errno is None


@pytest.mark.parametrize("cls", ALL_ERRORS, ids=lambda c: c.__name__)
def test_copy(cls: type[GradSyncError]) -> None:
    exc = cls("m", step=1, ranks=[0], path="/p")
    _same(copy.copy(exc), exc)
    _same(copy.deepcopy(exc), exc)


def test_pickled_error_still_caught_as_builtin() -> None:
    back = pickle.loads(pickle.dumps(PeerTimeoutError("late", step=1, ranks=[3])))
    with pytest.raises(TimeoutError, match=r"^late$"):
        raise back


# --- the public namespace -------------------------------------------------------------------


def test_public_all_sorted_and_importable() -> None:
    names = gradsync.__all__
    assert names == sorted(names)
    assert len(set(names)) == len(names)
    for name in names:
        assert hasattr(gradsync, name), name
    namespace: dict[str, object] = {}
    exec("from gradsync import *", namespace)
    assert set(names) <= set(namespace)


def test_public_all_exports_every_error() -> None:
    for cls in ALL_ERRORS:
        assert cls.__name__ in gradsync.__all__
        assert getattr(gradsync, cls.__name__) is cls


def test_version() -> None:
    assert gradsync.__version__ == "0.1.0"
