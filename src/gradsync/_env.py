"""Reading a job's configuration from the environment a launcher sets."""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

from ._errors import ConfigError

__all__ = ["from_environment", "parse_float"]

_INT_RE = re.compile(r"[+-]?[0-9]+")


def from_environment(
    source: Mapping[str, str], overrides: Mapping[str, object]
) -> tuple[dict[str, object], list[str]]:
    """The fields ``source`` sets, but those in ``overrides``, and the ``NAME='value'``
    of each variable read (for the error message)."""
    values: dict[str, object] = {}
    used: list[str] = []
    for key, names in (
        ("world_size", ("GRADSYNC_WORLD_SIZE", "WORLD_SIZE")),
        ("rank", ("GRADSYNC_RANK", "RANK")),
    ):
        if key in overrides:
            continue
        name, raw = _first(source, names)
        values[key] = _parse_int(name, raw)
        used.append(f"{name}={raw!r}")
    if "sync_dir" in overrides:
        pass
    elif values.get("world_size", overrides.get("world_size")) == 1 and not source.get(
        "GRADSYNC_SYNC_DIR"
    ):
        # One rank never touches the directory: running a script alone needs no setup.
        values["sync_dir"] = Path(tempfile.gettempdir()) / "gradsync-single-rank"
    else:
        values["sync_dir"] = _sync_dir_var(source)
    for key, name, parse in _OPTIONAL_VARS:
        if name in source and key not in overrides:
            values[key] = parse(name, source[name])
            used.append(f"{name}={source[name]!r}")
    for name in ("GRADSYNC_RUN_ID", "TORCHELASTIC_RUN_ID"):
        if source.get(name) and "run_id" not in overrides:
            values["run_id"] = source[name]
            used.append(f"{name}={source[name]!r}")
            break
    return values, used


def _sync_dir_var(source: Mapping[str, str]) -> str:
    name, raw = _first(source, ("GRADSYNC_SYNC_DIR",))
    if not raw.strip():
        raise ConfigError(f"environment variable {name} is empty")
    if raw != raw.strip():
        raise ConfigError(
            f"environment variable {name} starts or ends with whitespace, got {raw!r}"
        )
    # A quoted "~/dir" reaches us unexpanded; no directory is named "~" on purpose.
    return os.path.expanduser(raw)


def _first(source: Mapping[str, str], names: tuple[str, ...]) -> tuple[str, str]:
    for name in names:
        if name in source:
            return name, source[name]
    raise ConfigError(f"environment variable {' or '.join(names)} is not set")


def _parse_int(name: str, raw: str) -> int:
    # int() alone also takes "1_0" (10) and non-ASCII digits: not what anyone meant.
    if not raw.isascii() or not _INT_RE.fullmatch(raw.strip()):
        raise ConfigError(f"environment variable {name} must be an integer, got {raw!r}")
    return int(raw.strip())


def parse_float(name: str, raw: str) -> float:
    try:
        if not raw.isascii() or "_" in raw:
            raise ValueError(raw)
        return float(raw.strip())
    except ValueError:
        raise ConfigError(f"environment variable {name} must be a number, got {raw!r}") from None


_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def _parse_bool(name: str, raw: str) -> bool:
    word = raw.strip().lower()
    if word in _TRUE or word in _FALSE:
        return word in _TRUE
    raise ConfigError(
        f"environment variable {name} must be one of 1, 0, true, false, yes, no, on, off; "
        f"got {raw!r}"
    )


def _parse_str(name: str, raw: str) -> str:
    return raw  # checked by the field's own rule, which names the variable's value


def _parse_compression(name: str, raw: str) -> str | None:
    return None if raw.strip().lower() in ("", "none") else raw


# (field, environment variable, parser) for each field a launcher may set, beyond
# world size, rank, sync dir and run id.
_OPTIONAL_VARS: tuple[tuple[str, str, Callable[[str, str], object]], ...] = (
    ("max_wait_s", "GRADSYNC_MAX_WAIT_S", parse_float),
    ("strategy", "GRADSYNC_STRATEGY", _parse_str),
    ("heartbeat_interval_s", "GRADSYNC_HEARTBEAT_INTERVAL_S", parse_float),
    ("heartbeat_timeout_s", "GRADSYNC_HEARTBEAT_TIMEOUT_S", parse_float),
    ("warn_after_s", "GRADSYNC_WARN_AFTER_S", parse_float),
    ("check_finite", "GRADSYNC_CHECK_FINITE", _parse_bool),
    ("use_mmap", "GRADSYNC_USE_MMAP", _parse_bool),
    ("checksums", "GRADSYNC_CHECKSUMS", _parse_bool),
    ("threads", "GRADSYNC_THREADS", _parse_int),
    ("wide_sum", "GRADSYNC_WIDE_SUM", _parse_bool),
    ("compression", "GRADSYNC_COMPRESSION", _parse_compression),
    ("error_feedback", "GRADSYNC_ERROR_FEEDBACK", _parse_bool),
    ("compress_local", "GRADSYNC_COMPRESS_LOCAL", _parse_bool),
    ("elastic", "GRADSYNC_ELASTIC", _parse_bool),
    ("min_world_size", "GRADSYNC_MIN_WORLD_SIZE", _parse_int),
)
