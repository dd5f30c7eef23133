"""FileGradSyncConfig: validation (exact messages), immutability and ``from_env``."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import math
import os
import re
import textwrap
import typing
from pathlib import Path

import numpy as np
import pytest

import gradsync
from gradsync import ConfigError, FileGradSyncConfig

SECONDS_FIELDS = ("max_wait_s", "heartbeat_interval_s", "heartbeat_timeout_s", "warn_after_s")
ENV_NAMES = (
    "GRADSYNC_WORLD_SIZE",
    "GRADSYNC_RANK",
    "WORLD_SIZE",
    "RANK",
    "GRADSYNC_SYNC_DIR",
    "GRADSYNC_MAX_WAIT_S",
    "GRADSYNC_THREADS",
    "GRADSYNC_WIDE_SUM",
    "GRADSYNC_RUN_ID",
    "TORCHELASTIC_RUN_ID",
    "GRADSYNC_STRATEGY",
    "GRADSYNC_HEARTBEAT_INTERVAL_S",
    "GRADSYNC_HEARTBEAT_TIMEOUT_S",
    "GRADSYNC_WARN_AFTER_S",
    "GRADSYNC_CHECK_FINITE",
    "GRADSYNC_USE_MMAP",
    "GRADSYNC_CHECKSUMS",
)


def make(**kwargs: object) -> FileGradSyncConfig:
    args: dict[str, object] = {"world_size": 2, "rank": 1, "sync_dir": "/tmp/gs"}
    args.update(kwargs)
    return FileGradSyncConfig(**args)  # type: ignore[arg-type]


def raises_config(message: str) -> pytest.RaisesExc[ConfigError]:
    """``pytest.raises`` matching the whole message exactly."""
    return pytest.raises(ConfigError, match=f"^{re.escape(message)}$")


# --- ported from the Rust reference: config_rejects_invalid_rank -------------------------


def test_config_rejects_invalid_rank() -> None:
    with raises_config("rank must satisfy 0 <= rank < world_size, got rank=2 with world_size=2"):
        FileGradSyncConfig(2, 2, "/tmp/x")
    with raises_config("world_size must be >= 1, got 0"):
        FileGradSyncConfig(0, 0, "/tmp/x")
    cfg = FileGradSyncConfig(2, 1, "/tmp/x")
    assert (cfg.world_size, cfg.rank) == (2, 1)


# --- defaults, types, immutability ---------------------------------------------------------


def test_defaults() -> None:
    cfg = FileGradSyncConfig(world_size=1, rank=0, sync_dir=Path("/tmp/gs"))
    assert cfg.max_wait_s == 600.0
    assert cfg.strategy == "sharded"
    assert cfg.heartbeat_interval_s == 1.0
    assert cfg.heartbeat_timeout_s == 15.0
    assert cfg.warn_after_s == 10.0
    assert cfg.check_finite is False
    assert cfg.wide_sum is False
    assert cfg.use_mmap is None
    assert cfg.checksums is False
    assert cfg.run_id is None
    assert cfg.enabled is False
    assert make(world_size=2).enabled is True


def test_sync_dir_is_typed_as_what_it_takes() -> None:
    # Documented and accepted as a str or path-like (and kept as a Path): typed so.
    init = inspect.signature(FileGradSyncConfig).parameters["sync_dir"]
    assert init.annotation == "str | os.PathLike[str]"
    assert typing.get_type_hints(FileGradSyncConfig)["sync_dir"] is Path


def test_the_typed_init_takes_every_field_in_order() -> None:
    # Type checkers read a hand-written __init__ (for sync_dir): it must not drift.
    tree = ast.parse(textwrap.dedent(inspect.getsource(FileGradSyncConfig)))
    (init,) = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "__init__"]
    fields = dataclasses.fields(FileGradSyncConfig)
    assert [a.arg for a in init.args.args[1:]] == [f.name for f in fields]
    with_default = [f.name for f in fields if f.default is not dataclasses.MISSING]
    assert [a.arg for a in init.args.args[-len(init.args.defaults) :]] == with_default


@pytest.mark.parametrize("sync_dir", ["/tmp/gs", Path("/tmp/gs")])
def test_sync_dir_becomes_path(sync_dir: str | Path) -> None:
    cfg = make(sync_dir=sync_dir)
    assert type(cfg.sync_dir) is type(Path())
    assert cfg.sync_dir == Path("/tmp/gs")


def test_sync_dir_is_made_absolute_when_the_config_is_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Resolved at each use, a relative path followed a later os.chdir: that rank then
    # wrote into another directory than its peers.
    monkeypatch.chdir(tmp_path)
    cfg = make(sync_dir="runs/../gs")
    monkeypatch.chdir("/")
    assert cfg.sync_dir == tmp_path / "runs" / ".." / "gs"
    monkeypatch.setenv("HOME", "/home/someone")
    assert make(sync_dir="~/gs").sync_dir == Path("/home/someone/gs")
    assert make(sync_dir=Path("~")).sync_dir == Path("/home/someone")


def test_a_relative_sync_dir_needs_a_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    with raises_config(
        "sync_dir 'gs' is relative, and the current directory it would be taken from is "
        "unusable: No such file or directory"
    ):
        make(sync_dir="gs")
    assert make(sync_dir="/tmp/gs").sync_dir == Path("/tmp/gs")


def test_numpy_numbers_are_taken_and_stored_as_python_numbers() -> None:
    cfg = make(
        world_size=np.int64(4),
        rank=np.int32(3),
        threads=np.uint8(2),
        max_wait_s=np.float32(2.5),
        heartbeat_interval_s=1,
        heartbeat_timeout_s=np.int64(5),
    )
    assert (cfg.world_size, cfg.rank, cfg.threads) == (4, 3, 2)
    flags = make(check_finite=np.bool_(True), use_mmap=np.bool_(False))
    assert (flags.check_finite, flags.use_mmap) == (True, False)
    assert type(flags.check_finite) is type(flags.use_mmap) is bool
    assert (cfg.max_wait_s, cfg.heartbeat_interval_s, cfg.heartbeat_timeout_s) == (2.5, 1.0, 5.0)
    assert [type(v) for v in (cfg.world_size, cfg.rank, cfg.threads)] == [int] * 3
    assert type(cfg.max_wait_s) is type(cfg.heartbeat_interval_s) is float
    # Shown as numpy shows them: np.True_ and np.float32(nan) since numpy 2.
    true, nan = np.bool_(True), np.float32("nan")
    with raises_config(f"rank must be an int, got {true!r}"):
        make(rank=true)
    with raises_config(f"max_wait_s must be a finite number of seconds > 0, got {nan!r}"):
        make(max_wait_s=nan)


def test_sync_dir_accepts_any_pathlike() -> None:
    class Where(os.PathLike[str]):
        def __fspath__(self) -> str:
            return "/tmp/elsewhere"

    assert make(sync_dir=Where()).sync_dir == Path("/tmp/elsewhere")


def test_frozen() -> None:
    cfg = make()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.rank = 0  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.sync_dir = Path("/elsewhere")  # type: ignore[misc]
    assert cfg == make()
    assert hash(cfg) == hash(make())


def test_valid_extremes_accepted() -> None:
    cfg = make(
        world_size=1,
        rank=0,
        max_wait_s=1e-9,
        heartbeat_interval_s=2,  # ints are numbers of seconds too
        heartbeat_timeout_s=4,  # exactly twice the interval is enough
        warn_after_s=1e12,
        strategy="root",
        check_finite=True,
        run_id="A" * 64,
    )
    assert cfg.heartbeat_timeout_s == 2 * cfg.heartbeat_interval_s
    floors = make(heartbeat_interval_s=0.01, heartbeat_timeout_s=0.1, warn_after_s=0.1)
    assert (floors.heartbeat_interval_s, floors.heartbeat_timeout_s) == (0.01, 0.1)
    assert cfg.strategy == "root"
    assert make(run_id="run-1.2_x").run_id == "run-1.2_x"


def test_config_error_is_value_error() -> None:
    with pytest.raises(ValueError, match=r"^world_size must be >= 1, got -3$"):
        make(world_size=-3)


# --- every validation rule, with its message -----------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 2.0}, "world_size must be an int, got 2.0"),
        ({"world_size": "2"}, "world_size must be an int, got '2'"),
        ({"world_size": True}, "world_size must be an int, got True"),
        ({"world_size": None}, "world_size must be an int, got None"),
        ({"world_size": 0, "rank": 0}, "world_size must be >= 1, got 0"),
        ({"world_size": -1, "rank": 0}, "world_size must be >= 1, got -1"),
        ({"rank": 1.0}, "rank must be an int, got 1.0"),
        ({"rank": False}, "rank must be an int, got False"),
        ({"rank": -1}, "rank must be >= 0, got -1"),
        (
            {"world_size": 2, "rank": 2},
            "rank must satisfy 0 <= rank < world_size, got rank=2 with world_size=2",
        ),
        (
            {"world_size": 3, "rank": 7},
            "rank must satisfy 0 <= rank < world_size, got rank=7 with world_size=3",
        ),
        ({"sync_dir": ""}, "sync_dir must be a non-empty path, got ''"),
        ({"sync_dir": None}, "sync_dir must be a non-empty path, got None"),
        ({"sync_dir": b"/tmp/gs"}, "sync_dir must be a non-empty path, got b'/tmp/gs'"),
        ({"sync_dir": 5}, "sync_dir must be a non-empty path, got 5"),
        ({"sync_dir": "/tmp/a\0b"}, "sync_dir must not contain a NUL byte, got '/tmp/a\\x00b'"),
        (
            {"heartbeat_interval_s": 1e10, "heartbeat_timeout_s": 3e10},
            "heartbeat_interval_s must be at most 1e+09 s, got 10000000000.0",
        ),
        (
            {"heartbeat_timeout_s": 2e9},
            "heartbeat_timeout_s must be at most 1e+09 s, got 2000000000.0",
        ),
        (
            {"heartbeat_interval_s": 1.0, "heartbeat_timeout_s": 1.5},
            "heartbeat_timeout_s must be at least twice heartbeat_interval_s, got "
            "heartbeat_timeout_s=1.5 and heartbeat_interval_s=1.0",
        ),
        (
            {"heartbeat_interval_s": 10, "heartbeat_timeout_s": 19.999},
            "heartbeat_timeout_s must be at least twice heartbeat_interval_s, got "
            "heartbeat_timeout_s=19.999 and heartbeat_interval_s=10.0",
        ),
        # Floors a real job never meets: below them a heartbeat thread or a warning loop spins.
        (
            {"heartbeat_interval_s": 1e-9},
            "heartbeat_interval_s must be at least 0.01 s, got 1e-09",
        ),
        (
            {"heartbeat_interval_s": 1e-9, "heartbeat_timeout_s": 1e-9},
            "heartbeat_interval_s must be at least 0.01 s, got 1e-09",
        ),
        (
            {"heartbeat_interval_s": 0.01, "heartbeat_timeout_s": 0.05},
            "heartbeat_timeout_s must be at least 0.1 s, got 0.05",
        ),
        ({"warn_after_s": 1e-9}, "warn_after_s must be at least 0.1 s, got 1e-09"),
        (
            {"warn_after_s": np.float32(0.05)},
            f"warn_after_s must be at least 0.1 s, got {np.float32(0.05)!r}",
        ),
        ({"strategy": "ring"}, "strategy must be one of ('sharded', 'root'), got 'ring'"),
        ({"strategy": "Root"}, "strategy must be one of ('sharded', 'root'), got 'Root'"),
        ({"check_finite": 1}, "check_finite must be a bool, got 1"),
        ({"check_finite": "yes"}, "check_finite must be a bool, got 'yes'"),
        ({"check_finite": None}, "check_finite must be a bool, got None"),
        ({"wide_sum": 0}, "wide_sum must be a bool, got 0"),
        ({"wide_sum": "false"}, "wide_sum must be a bool, got 'false'"),
        ({"checksums": 1}, "checksums must be a bool, got 1"),
        ({"use_mmap": "no"}, "use_mmap must be a bool or None, got 'no'"),
        ({"run_id": ""}, "run_id must be 1-64 characters from [A-Za-z0-9._-] or None, got ''"),
        (
            {"run_id": "a b"},
            "run_id must be 1-64 characters from [A-Za-z0-9._-] or None, got 'a b'",
        ),
        (
            {"run_id": "x/y"},
            "run_id must be 1-64 characters from [A-Za-z0-9._-] or None, got 'x/y'",
        ),
        (
            {"run_id": "é"},
            "run_id must be 1-64 characters from [A-Za-z0-9._-] or None, got 'é'",
        ),
        (
            {"run_id": "a" * 65},
            f"run_id must be 1-64 characters from [A-Za-z0-9._-] or None, got {'a' * 65!r}",
        ),
        ({"run_id": 5}, "run_id must be 1-64 characters from [A-Za-z0-9._-] or None, got 5"),
        ({"threads": 0}, "threads must be >= 1, got 0"),
        ({"threads": -2}, "threads must be >= 1, got -2"),
        ({"threads": 2.0}, "threads must be an int, got 2.0"),
        ({"threads": True}, "threads must be an int, got True"),
        ({"threads": 257}, "threads must be <= 256 or None, got 257"),
    ],
)
def test_validation_messages(kwargs: dict[str, object], message: str) -> None:
    with raises_config(message):
        make(**kwargs)


@pytest.mark.parametrize("name", SECONDS_FIELDS)
@pytest.mark.parametrize(
    ("value", "template"),
    [
        ("1", "{name} must be a number of seconds, got '1'"),
        (None, "{name} must be a number of seconds, got None"),
        (True, "{name} must be a number of seconds, got True"),
        (0, "{name} must be a finite number of seconds > 0, got 0"),
        (0.0, "{name} must be a finite number of seconds > 0, got 0.0"),
        (-1.5, "{name} must be a finite number of seconds > 0, got -1.5"),
        (math.nan, "{name} must be a finite number of seconds > 0, got nan"),
        (math.inf, "{name} must be a finite number of seconds > 0, got inf"),
        (-math.inf, "{name} must be a finite number of seconds > 0, got -inf"),
    ],
)
def test_seconds_validation(name: str, value: object, template: str) -> None:
    kwargs: dict[str, object] = {name: value}
    if name == "heartbeat_interval_s" and value is not None:
        # keep the heartbeat ratio rule out of the way where it could apply
        kwargs["heartbeat_timeout_s"] = 1e9
    with raises_config(template.format(name=name)):
        make(**kwargs)


def test_run_id_with_trailing_newline_rejected() -> None:
    with raises_config("run_id must be 1-64 characters from [A-Za-z0-9._-] or None, got 'abc\\n'"):
        make(run_id="abc\n")


def test_huge_int_seconds_is_config_error() -> None:
    with pytest.raises(ConfigError, match=r"^max_wait_s must be"):
        make(max_wait_s=10**400)


# --- from_env ------------------------------------------------------------------------------


def base_env(**extra: str) -> dict[str, str]:
    env = {"GRADSYNC_WORLD_SIZE": "4", "GRADSYNC_RANK": "3", "GRADSYNC_SYNC_DIR": "/tmp/gs-env"}
    env.update(extra)
    return env


def test_from_env_gradsync_vars() -> None:
    cfg = FileGradSyncConfig.from_env(env=base_env())
    assert (cfg.world_size, cfg.rank, cfg.sync_dir) == (4, 3, Path("/tmp/gs-env"))
    assert cfg.max_wait_s == 600.0
    assert cfg.run_id is None


def test_from_env_falls_back_to_torchrun_vars() -> None:
    env = {"WORLD_SIZE": "3", "RANK": "2", "GRADSYNC_SYNC_DIR": "/tmp/gs-env"}
    cfg = FileGradSyncConfig.from_env(env=env)
    assert (cfg.world_size, cfg.rank) == (3, 2)


def test_from_env_gradsync_vars_win_over_torchrun_vars() -> None:
    cfg = FileGradSyncConfig.from_env(env=base_env(WORLD_SIZE="9", RANK="8"))
    assert (cfg.world_size, cfg.rank) == (4, 3)


def test_from_env_strips_whitespace() -> None:
    env = base_env(GRADSYNC_WORLD_SIZE=" 4\n", GRADSYNC_RANK="\t0 ", GRADSYNC_MAX_WAIT_S=" 2.5 ")
    cfg = FileGradSyncConfig.from_env(env=env)
    assert (cfg.world_size, cfg.rank, cfg.max_wait_s) == (4, 0, 2.5)


@pytest.mark.parametrize(
    ("drop", "message"),
    [
        (
            "GRADSYNC_WORLD_SIZE",
            "environment variable GRADSYNC_WORLD_SIZE or WORLD_SIZE is not set",
        ),
        ("GRADSYNC_RANK", "environment variable GRADSYNC_RANK or RANK is not set"),
        ("GRADSYNC_SYNC_DIR", "environment variable GRADSYNC_SYNC_DIR is not set"),
    ],
)
def test_from_env_missing_variable_named(drop: str, message: str) -> None:
    env = base_env()
    del env[drop]
    with raises_config(message):
        FileGradSyncConfig.from_env(env=env)


def test_from_env_empty_env() -> None:
    with raises_config("environment variable GRADSYNC_WORLD_SIZE or WORLD_SIZE is not set"):
        FileGradSyncConfig.from_env(env={})


@pytest.mark.parametrize("value", ["", "   "])
def test_from_env_empty_sync_dir(value: str) -> None:
    with raises_config("environment variable GRADSYNC_SYNC_DIR is empty"):
        FileGradSyncConfig.from_env(env=base_env(GRADSYNC_SYNC_DIR=value))


def test_from_env_sync_dir_expands_home_and_refuses_surrounding_blanks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HOME", "/home/someone")
    cfg = FileGradSyncConfig.from_env(env=base_env(GRADSYNC_SYNC_DIR="~/gs"))
    assert cfg.sync_dir == Path("/home/someone/gs")
    with raises_config(
        "environment variable GRADSYNC_SYNC_DIR starts or ends with whitespace, got ' /tmp/gs '"
    ):
        FileGradSyncConfig.from_env(env=base_env(GRADSYNC_SYNC_DIR=" /tmp/gs "))


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            base_env(GRADSYNC_WORLD_SIZE="four"),
            "environment variable GRADSYNC_WORLD_SIZE must be an integer, got 'four'",
        ),
        (
            base_env(GRADSYNC_WORLD_SIZE="2.0"),
            "environment variable GRADSYNC_WORLD_SIZE must be an integer, got '2.0'",
        ),
        (
            base_env(GRADSYNC_RANK=""),
            "environment variable GRADSYNC_RANK must be an integer, got ''",
        ),
        (
            {"WORLD_SIZE": "2", "RANK": "one", "GRADSYNC_SYNC_DIR": "/tmp/x"},
            "environment variable RANK must be an integer, got 'one'",
        ),
        (
            base_env(GRADSYNC_WORLD_SIZE="1_0"),
            "environment variable GRADSYNC_WORLD_SIZE must be an integer, got '1_0'",
        ),
        (
            base_env(GRADSYNC_RANK="\u0663"),
            "environment variable GRADSYNC_RANK must be an integer, got '\u0663'",
        ),
        (
            base_env(GRADSYNC_RANK="\u20033"),
            "environment variable GRADSYNC_RANK must be an integer, got '\\u20033'",
        ),
        (
            base_env(GRADSYNC_MAX_WAIT_S="1_0"),
            "environment variable GRADSYNC_MAX_WAIT_S must be a number, got '1_0'",
        ),
        (
            base_env(GRADSYNC_MAX_WAIT_S="soon"),
            "environment variable GRADSYNC_MAX_WAIT_S must be a number, got 'soon'",
        ),
        (
            base_env(GRADSYNC_THREADS="auto"),
            "environment variable GRADSYNC_THREADS must be an integer, got 'auto'",
        ),
        (
            base_env(GRADSYNC_WIDE_SUM="float32"),
            "environment variable GRADSYNC_WIDE_SUM must be one of 1, 0, true, false, yes, "
            "no, on, off; got 'float32'",
        ),
    ],
)
def test_from_env_bad_number_named_with_value(env: dict[str, str], message: str) -> None:
    with raises_config(message):
        FileGradSyncConfig.from_env(env=env)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            base_env(GRADSYNC_WORLD_SIZE="2", GRADSYNC_RANK="2"),
            "invalid configuration from the environment (GRADSYNC_WORLD_SIZE='2', "
            "GRADSYNC_RANK='2'): rank must satisfy 0 <= rank < world_size, got rank=2 "
            "with world_size=2",
        ),
        (
            {"WORLD_SIZE": "2", "RANK": "-1", "GRADSYNC_SYNC_DIR": "/tmp/x"},
            "invalid configuration from the environment (WORLD_SIZE='2', RANK='-1'): "
            "rank must be >= 0, got -1",
        ),
        (
            base_env(GRADSYNC_WORLD_SIZE="0", GRADSYNC_RANK="0"),
            "invalid configuration from the environment (GRADSYNC_WORLD_SIZE='0', "
            "GRADSYNC_RANK='0'): world_size must be >= 1, got 0",
        ),
        (
            base_env(GRADSYNC_MAX_WAIT_S="0"),
            "invalid configuration from the environment (GRADSYNC_WORLD_SIZE='4', "
            "GRADSYNC_RANK='3', GRADSYNC_MAX_WAIT_S='0'): max_wait_s must be a finite "
            "number of seconds > 0, got 0.0",
        ),
        (
            base_env(GRADSYNC_MAX_WAIT_S="inf"),
            "invalid configuration from the environment (GRADSYNC_WORLD_SIZE='4', "
            "GRADSYNC_RANK='3', GRADSYNC_MAX_WAIT_S='inf'): max_wait_s must be a finite "
            "number of seconds > 0, got inf",
        ),
        (
            base_env(GRADSYNC_THREADS="0"),
            "invalid configuration from the environment (GRADSYNC_WORLD_SIZE='4', "
            "GRADSYNC_RANK='3', GRADSYNC_THREADS='0'): threads must be >= 1, got 0",
        ),
        (
            base_env(GRADSYNC_RUN_ID="my run"),
            "invalid configuration from the environment (GRADSYNC_WORLD_SIZE='4', "
            "GRADSYNC_RANK='3', GRADSYNC_RUN_ID='my run'): run_id must be 1-64 characters "
            "from [A-Za-z0-9._-] or None, got 'my run'",
        ),
        (
            base_env(TORCHELASTIC_RUN_ID="a:b"),
            "invalid configuration from the environment (GRADSYNC_WORLD_SIZE='4', "
            "GRADSYNC_RANK='3', TORCHELASTIC_RUN_ID='a:b'): run_id must be 1-64 characters "
            "from [A-Za-z0-9._-] or None, got 'a:b'",
        ),
    ],
)
def test_from_env_invalid_values_name_the_variables(env: dict[str, str], message: str) -> None:
    with raises_config(message) as info:
        FileGradSyncConfig.from_env(env=env)
    assert isinstance(info.value.__cause__, ConfigError)


def test_from_env_threads() -> None:
    assert FileGradSyncConfig.from_env(env=base_env(GRADSYNC_THREADS=" 4 ")).threads == 4
    assert FileGradSyncConfig.from_env(env=base_env()).threads is None


@pytest.mark.parametrize(
    ("raw", "value"),
    [("0", False), (" false ", False), ("No", False), ("off", False), ("1", True), ("TRUE", True)],
)
def test_from_env_wide_sum(raw: str, value: bool) -> None:
    assert FileGradSyncConfig.from_env(env=base_env(GRADSYNC_WIDE_SUM=raw)).wide_sum is value
    assert FileGradSyncConfig.from_env(env=base_env()).wide_sum is False


def test_from_env_max_wait() -> None:
    cfg = FileGradSyncConfig.from_env(env=base_env(GRADSYNC_MAX_WAIT_S="12.5"))
    assert cfg.max_wait_s == 12.5
    assert FileGradSyncConfig.from_env(env=base_env(GRADSYNC_MAX_WAIT_S="1e-3")).max_wait_s == 1e-3


def test_from_env_every_knob_a_launcher_may_set() -> None:
    env = base_env(
        GRADSYNC_STRATEGY="root",
        GRADSYNC_HEARTBEAT_INTERVAL_S="2",
        GRADSYNC_HEARTBEAT_TIMEOUT_S="30.5",
        GRADSYNC_WARN_AFTER_S="7",
        GRADSYNC_CHECK_FINITE="yes",
        GRADSYNC_USE_MMAP="0",
        GRADSYNC_CHECKSUMS="true",
    )
    cfg = FileGradSyncConfig.from_env(env=env)
    assert (cfg.strategy, cfg.heartbeat_interval_s, cfg.heartbeat_timeout_s) == ("root", 2.0, 30.5)
    assert (cfg.warn_after_s, cfg.check_finite, cfg.use_mmap, cfg.checksums) == (
        7.0,
        True,
        False,
        True,
    )
    # An override wins, and the variable it replaces is not even read.
    cfg = FileGradSyncConfig.from_env(env=base_env(GRADSYNC_STRATEGY="ring"), strategy="sharded")
    assert cfg.strategy == "sharded"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            {"GRADSYNC_CHECK_FINITE": "2"},
            "environment variable GRADSYNC_CHECK_FINITE must be one of 1, 0, true, false, yes, "
            "no, on, off; got '2'",
        ),
        (
            {"GRADSYNC_HEARTBEAT_TIMEOUT_S": "15s"},
            "environment variable GRADSYNC_HEARTBEAT_TIMEOUT_S must be a number, got '15s'",
        ),
        (
            {"GRADSYNC_STRATEGY": "ring"},
            "invalid configuration from the environment (GRADSYNC_WORLD_SIZE='4', "
            "GRADSYNC_RANK='3', GRADSYNC_STRATEGY='ring'): strategy must be one of "
            "('sharded', 'root'), got 'ring'",
        ),
        (
            {"GRADSYNC_WARN_AFTER_S": "0.001"},
            "invalid configuration from the environment (GRADSYNC_WORLD_SIZE='4', "
            "GRADSYNC_RANK='3', GRADSYNC_WARN_AFTER_S='0.001'): warn_after_s must be at "
            "least 0.1 s, got 0.001",
        ),
    ],
)
def test_from_env_bad_knob_names_the_variable(extra: dict[str, str], message: str) -> None:
    with raises_config(message):
        FileGradSyncConfig.from_env(env=base_env(**extra))


@pytest.mark.parametrize(
    ("extra", "run_id"),
    [
        ({"GRADSYNC_RUN_ID": "job-1"}, "job-1"),
        ({"TORCHELASTIC_RUN_ID": "elastic.7"}, "elastic.7"),
        ({"GRADSYNC_RUN_ID": "job-1", "TORCHELASTIC_RUN_ID": "elastic.7"}, "job-1"),
        ({"GRADSYNC_RUN_ID": "", "TORCHELASTIC_RUN_ID": "elastic.7"}, "elastic.7"),
        ({"GRADSYNC_RUN_ID": "", "TORCHELASTIC_RUN_ID": ""}, None),
        ({}, None),
    ],
)
def test_from_env_run_id(extra: dict[str, str], run_id: str | None) -> None:
    assert FileGradSyncConfig.from_env(env=base_env(**extra)).run_id == run_id


def test_from_env_overrides_win() -> None:
    cfg = FileGradSyncConfig.from_env(
        env=base_env(GRADSYNC_MAX_WAIT_S="5", GRADSYNC_RUN_ID="envrun"),
        rank=1,
        max_wait_s=7.0,
        strategy="root",
        check_finite=True,
        run_id="override",
        sync_dir="/tmp/override",
    )
    assert cfg.world_size == 4
    assert cfg.rank == 1
    assert cfg.max_wait_s == 7.0
    assert cfg.strategy == "root"
    assert cfg.check_finite is True
    assert cfg.run_id == "override"
    assert cfg.sync_dir == Path("/tmp/override")


def test_from_env_invalid_override_reported() -> None:
    with raises_config(
        "invalid configuration from the environment (GRADSYNC_WORLD_SIZE='4', "
        "GRADSYNC_RANK='3') and the overrides (strategy='ring'): strategy must be one of "
        "('sharded', 'root'), got 'ring'"
    ):
        FileGradSyncConfig.from_env(env=base_env(), strategy="ring")


def test_from_env_unknown_override_is_type_error() -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'colour'"):
        FileGradSyncConfig.from_env(env=base_env(), colour="red")


def test_from_env_override_supplies_missing_variable() -> None:
    env = {"GRADSYNC_WORLD_SIZE": "2", "GRADSYNC_RANK": "0"}
    cfg = FileGradSyncConfig.from_env(env=env, sync_dir="/tmp/gs-override")
    assert cfg.sync_dir == Path("/tmp/gs-override")
    cfg = FileGradSyncConfig.from_env(env={}, world_size=3, rank=2, sync_dir=Path("/tmp/o"))
    assert (cfg.world_size, cfg.rank, cfg.sync_dir) == (3, 2, Path("/tmp/o"))
    # An overridden variable may even be malformed in the environment: it is not read.
    cfg = FileGradSyncConfig.from_env(env=base_env(GRADSYNC_RANK="junk"), rank=0)
    assert cfg.rank == 0
    with raises_config(
        "invalid configuration from the environment (GRADSYNC_WORLD_SIZE='4') and the "
        "overrides (rank=4): rank must satisfy 0 <= rank < world_size, got rank=4 with "
        "world_size=4"
    ):
        FileGradSyncConfig.from_env(env=base_env(), rank=4)


def test_from_env_names_only_the_overrides_when_nothing_came_from_the_environment() -> None:
    with raises_config(
        "invalid configuration from the overrides (world_size=2, rank=2, sync_dir='/tmp/o'): "
        "rank must satisfy 0 <= rank < world_size, got rank=2 with world_size=2"
    ):
        FileGradSyncConfig.from_env(env={}, world_size=2, rank=2, sync_dir="/tmp/o")


def test_from_env_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENV_NAMES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "5")
    monkeypatch.setenv("RANK", "4")
    monkeypatch.setenv("GRADSYNC_SYNC_DIR", "/tmp/gs-os-env")
    monkeypatch.setenv("GRADSYNC_MAX_WAIT_S", "30")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "te-run")
    cfg = FileGradSyncConfig.from_env()
    assert (cfg.world_size, cfg.rank, cfg.sync_dir) == (5, 4, Path("/tmp/gs-os-env"))
    assert (cfg.max_wait_s, cfg.run_id) == (30.0, "te-run")
    monkeypatch.setenv("GRADSYNC_RANK", "0")
    assert FileGradSyncConfig.from_env().rank == 0
    # an explicit mapping ignores os.environ entirely
    with raises_config("environment variable GRADSYNC_WORLD_SIZE or WORLD_SIZE is not set"):
        FileGradSyncConfig.from_env(env={"GRADSYNC_SYNC_DIR": "/tmp/x"})


@pytest.mark.parametrize(
    ("cfg", "name"), [({"world_size": 2, "rank": 0}, "dict"), (None, "NoneType"), ("2", "str")]
)
def test_both_forms_name_a_cfg_that_is_not_a_config(cfg: object, name: str) -> None:
    # A dict is unhashable: the function form must check before its session registry.
    with raises_config(f"cfg must be a FileGradSyncConfig, got {name}"):
        gradsync.average_grads_file_sync([np.zeros(3)], None, cfg, 0)  # type: ignore[arg-type]
    with raises_config(f"cfg must be a FileGradSyncConfig, got {name}"):
        gradsync.GradSync(cfg)  # type: ignore[arg-type]
