"""The job's configuration: who this rank is, where ranks meet, how long to wait."""

from __future__ import annotations

import math
import numbers
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np

from ._env import from_environment
from ._errors import ConfigError

__all__ = ["Compression", "FileGradSyncConfig", "Strategy"]

Strategy = Literal["sharded", "root"]
_STRATEGIES: tuple[str, ...] = ("sharded", "root")
Compression = Literal["bf16", "fp16", "int8"]
_COMPRESSIONS: tuple[str | None, ...] = (None, "bf16", "fp16", "int8")
_MAX_THREADS = 256
_RUN_ID_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")
_MAX_WAIT_SECONDS = 1e9  # about 31 years
# Below these a heartbeat thread or a warning loop only burns CPU and fills logs.
_FLOOR_S = {"heartbeat_interval_s": 0.01, "heartbeat_timeout_s": 0.1, "warn_after_s": 0.1}
# Threads wait this long at a time; past ~9.2e9 s such a wait overflows.
_CEILING_S = {"heartbeat_interval_s": _MAX_WAIT_SECONDS, "heartbeat_timeout_s": _MAX_WAIT_SECONDS}


@dataclass(frozen=True)
class FileGradSyncConfig:
    """Where and how one rank averages gradients with its peers.

    Args:
        world_size: Number of ranks in the job, >= 1.
        rank: This process's rank, ``0 <= rank < world_size``.
        sync_dir: Directory every rank can read and write: tmpfs (``/dev/shm``) on one
            machine, a shared filesystem across machines. Created if missing, with its
            parents (a SyncDirError at the first call if it cannot be). Kept as
            an absolute path: a leading ``~`` is expanded, and a relative path is taken
            from the current directory when the config is made (a later ``os.chdir``
            does not move the job).
        max_wait_s: Seconds to wait for live peers before a step fails with
            :class:`PeerTimeoutError`. Dead peers are reported much sooner.
        strategy: ``"sharded"`` (each rank reduces 1/world_size of the elements) or
            ``"root"`` (rank 0 reduces everything). Both give the same bits.
        heartbeat_interval_s: Seconds between this rank's heartbeats, which tell peers
            on other hosts that it is alive; at least 0.01.
        heartbeat_timeout_s: A peer on another host whose heartbeat has not advanced
            for this many seconds (measured on this host's clock) is declared lost; at
            least 0.1 and twice ``heartbeat_interval_s``.
            Both heartbeat settings must be the same on every rank (the first call
            raises MismatchError otherwise).
        warn_after_s: While waiting, log a warning naming the slow ranks every this
            many seconds (at least 0.1).
        check_finite: Check every published gradient for NaN/Inf and fail the step on
            every rank, naming the rank and param, if one is found. Off by default:
            NaN/Inf then propagate into the mean as IEEE arithmetic says. Every rank
            must set the same (the first call raises MismatchError otherwise).
        use_mmap: Map the data files into memory (``True``) or use ``pread``/``pwrite``
            (``False``). ``None`` (default): map them when ``sync_dir`` is on a
            filesystem local to this host (tmpfs, ext4...), where every rank sees the
            same pages; never on NFS, Lustre or FUSE, whose mappings are not coherent.
        checksums: Give every published file a CRC-32 per MiB of data, checked by every
            reader before use: a truncated or garbled payload then fails the step on
            every rank (CorruptFileError naming the rank and file) instead of entering
            the mean. Off by default: about one more pass over the data per rank (see
            docs/performance.md). Headers are always checked. Every rank
            must set the same (the first call raises MismatchError otherwise).
        threads: Threads per rank for the copies and the reduction of large steps
            (pieces of at least 1 MiB; smaller steps always run on the calling
            thread). ``None`` (default): this process's usable CPUs divided by the
            ranks on this host, 1 to 8. The result does not depend on it, bit for bit.
        wide_sum: Sum float16 and float32 gradients in float64. ``False`` (default):
            float32 in float32,
            in rank order, as gloo, NCCL and MPI do; the error is then at most about
            W - 1 float32 roundings, and an element whose float32 sum overflows takes
            the float64 mean. ``True``: the mean is within one rounding of the exact
            mean and does not depend on which process has which rank, for 2.5-5x
            more CPU in the reduction at 3 or more ranks. With 2 ranks both give the
            same bits. Without it float16 is summed in float32; float64 is always
            summed in float64 (an element whose sum overflows is summed again scaled
            down by a power of two: a mean of finite values stays finite).
            Every rank must use the same value (the first call fails with
            MismatchError otherwise).
        compression: ``None`` (default), ``"bf16"``, ``"fp16"`` or ``"int8"``: what the
            published files hold of each float32/float64 gradient (and float16 under
            ``"int8"``), and of each shard of the mean: half the bytes, or a quarter
            plus a float32 scale per 256 elements. Lossy; every rank still gets the
            same bits (docs/compression.md). Every rank must use the same value (the
            first call raises MismatchError otherwise). Applied where bytes leave this
            host: a job whose ranks all run on one host averages uncompressed, where
            compressing would only cost time, unless ``compress_local``.
        error_feedback: With ``compression``, keep what compressing this rank's
            gradient (and its shards of the mean) lost, and add it to the next call's
            before compressing, so the losses do not add up over steps. Kept per
            layout: a call with another layout starts afresh.
        compress_local: With ``compression``, compress also where every rank runs on
            one host (to try a codec's effect on one machine).
            Every rank must use the same value.
        run_id: Optional name of the job. Ranks only join peers with the same run_id,
            so concurrent jobs sharing one sync_dir stay apart. ``gradsync launch`` sets
            one; without it, a fresh rendezvous still keeps earlier runs' files out.
        elastic: When a rank is lost, the others redo the step without it and go on,
            renumbered (``GradSync.rank``, ``GradSync.world_size``); a process started
            later with the same config joins at a step boundary. See docs/elastic.md.
            Every rank must set the same (the first call raises MismatchError otherwise).
        min_world_size: With ``elastic``, the fewest ranks the job goes on with, 1 to
            ``world_size``; below it, the survivors wait ``max_wait_s`` for ranks to
            join, then fail.

    Integer fields take any integer (``numpy.int64`` too), stored as ``int``; flags
    any bool (``numpy.bool_`` too), stored as ``bool``; seconds any ``numbers.Real``
    (``numpy.float32`` too, not ``Decimal``), stored as ``float``.

    Raises:
        ConfigError: (a ``ValueError``) naming the field and showing the bad value.
    """

    world_size: int
    rank: int
    sync_dir: Path
    max_wait_s: float = 600.0
    strategy: Strategy = "sharded"
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 15.0
    warn_after_s: float = 10.0
    check_finite: bool = False
    run_id: str | None = field(default=None)
    use_mmap: bool | None = None
    checksums: bool = False
    threads: int | None = None
    wide_sum: bool = False
    compression: Compression | None = None
    error_feedback: bool = False
    compress_local: bool = False
    elastic: bool = False
    min_world_size: int = 1

    if TYPE_CHECKING:
        # What __init__ takes: sync_dir as a str or path-like, kept as an absolute Path.
        def __init__(
            self,
            world_size: int,
            rank: int,
            sync_dir: str | os.PathLike[str],
            max_wait_s: float = ...,
            strategy: Strategy = ...,
            heartbeat_interval_s: float = ...,
            heartbeat_timeout_s: float = ...,
            warn_after_s: float = ...,
            check_finite: bool = ...,
            run_id: str | None = ...,
            use_mmap: bool | None = ...,
            checksums: bool = ...,
            threads: int | None = ...,
            wide_sum: bool = ...,
            compression: Compression | None = ...,
            error_feedback: bool = ...,
            compress_local: bool = ...,
            elastic: bool = ...,
            min_world_size: int = ...,
        ) -> None: ...

    def __post_init__(self) -> None:
        self._set("world_size", check_int("world_size", self.world_size, minimum=1))
        self._set("rank", check_int("rank", self.rank, minimum=0))
        if self.rank >= self.world_size:
            raise ConfigError(
                f"rank must satisfy 0 <= rank < world_size, got rank={self.rank!r} "
                f"with world_size={self.world_size!r}"
            )
        check_path("sync_dir", self.sync_dir)
        self._set("sync_dir", _absolute(self.sync_dir))
        for name in ("max_wait_s", "heartbeat_interval_s", "heartbeat_timeout_s", "warn_after_s"):
            floor, ceiling = _FLOOR_S.get(name, 0), _CEILING_S.get(name)
            self._set(name, check_seconds(name, getattr(self, name), floor=floor, ceiling=ceiling))
        if self.heartbeat_timeout_s < 2 * self.heartbeat_interval_s:
            raise ConfigError(
                "heartbeat_timeout_s must be at least twice heartbeat_interval_s, got "
                f"heartbeat_timeout_s={self.heartbeat_timeout_s!r} and "
                f"heartbeat_interval_s={self.heartbeat_interval_s!r}"
            )
        if self.strategy not in _STRATEGIES:
            raise ConfigError(f"strategy must be one of {_STRATEGIES}, got {self.strategy!r}")
        for name in (
            "check_finite",
            "checksums",
            "wide_sum",
            "error_feedback",
            "compress_local",
            "elastic",
        ):
            self._set(name, _check_bool(name, getattr(self, name)))
        if self.compression not in _COMPRESSIONS:
            raise ConfigError(
                f"compression must be one of {_COMPRESSIONS}, got {self.compression!r}"
            )
        if self.error_feedback and self.compression is None:
            raise ConfigError("error_feedback=True needs a compression, got compression=None")
        least = check_int("min_world_size", self.min_world_size, minimum=1)
        if least > self.world_size:
            raise ConfigError(
                f"min_world_size must be at most world_size, got min_world_size={least!r} "
                f"with world_size={self.world_size!r}"
            )
        self._set("min_world_size", least)
        if self.use_mmap is not None:
            self._set("use_mmap", _check_bool("use_mmap", self.use_mmap, " or None"))
        if self.threads is not None:
            threads = check_int(
                "threads", self.threads, minimum=1, maximum=_MAX_THREADS, alt=" or None"
            )
            self._set("threads", threads)
        if self.run_id is not None:
            check_run_id("run_id", self.run_id, " or None")

    def _set(self, name: str, value: object) -> None:
        # Frozen: __post_init__ stores normalised values through object.__setattr__.
        object.__setattr__(self, name, value)

    @classmethod
    def from_env(
        cls, env: Mapping[str, str] | None = None, **overrides: object
    ) -> FileGradSyncConfig:
        """Build a config from environment variables, as set by ``gradsync launch``.

        Reads ``GRADSYNC_WORLD_SIZE`` and ``GRADSYNC_RANK`` (falling back to torchrun's
        ``WORLD_SIZE`` and ``RANK``), ``GRADSYNC_SYNC_DIR`` (required), and optionally
        one variable per other field: ``GRADSYNC_MAX_WAIT_S``, ``GRADSYNC_STRATEGY``,
        ``GRADSYNC_HEARTBEAT_INTERVAL_S``, ``GRADSYNC_HEARTBEAT_TIMEOUT_S``,
        ``GRADSYNC_WARN_AFTER_S``, ``GRADSYNC_CHECK_FINITE``, ``GRADSYNC_USE_MMAP``,
        ``GRADSYNC_CHECKSUMS``, ``GRADSYNC_THREADS``, ``GRADSYNC_WIDE_SUM``,
        ``GRADSYNC_COMPRESSION`` (``none`` or empty: None), ``GRADSYNC_ERROR_FEEDBACK``,
        ``GRADSYNC_COMPRESS_LOCAL``, ``GRADSYNC_ELASTIC``, ``GRADSYNC_MIN_WORLD_SIZE`` (flags:
        ``1``/``0``, ``true``/``false``, ``yes``/``no``, ``on``/``off``) and
        ``GRADSYNC_RUN_ID`` (falling back to ``TORCHELASTIC_RUN_ID``). A leading ``~``
        of the sync dir is expanded. Keyword ``overrides`` win over the environment
        (a variable for an overridden field is not read).
        With a world size of 1, ``GRADSYNC_SYNC_DIR`` may be unset (it is never used).

        Raises:
            ConfigError: naming the variable that is missing or bad, and its value.
            TypeError: an override that is not a field (as for any unknown keyword).
        """
        values, used = from_environment(os.environ if env is None else env, overrides)
        values.update(overrides)
        try:
            return cls(**values)  # type: ignore[arg-type]
        except ConfigError as exc:
            given = ", ".join(f"{k}={v!r}" for k, v in overrides.items())
            sources = [f"the environment ({', '.join(used)})"] if used else []
            sources += [f"the overrides ({given})"] if given else []
            where = " and ".join(sources) or "the environment"
            raise ConfigError(f"invalid configuration from {where}: {exc}") from exc

    @property
    def enabled(self) -> bool:
        """Whether there is more than one rank (with one, averaging is a no-op)."""
        return self.world_size > 1


# The generated __init__ says what it stores (Path); help() should show what it takes.
FileGradSyncConfig.__init__.__annotations__["sync_dir"] = "str | os.PathLike[str]"


def check_int(
    name: str, value: object, *, minimum: int, maximum: int | None = None, alt: str = ""
) -> int:
    """``value`` as an int (numpy integers too, not bools) in ``[minimum, maximum]``, or
    raise ConfigError naming ``name`` (and ``alt``, what else it may be, past ``maximum``)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise ConfigError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value!r}")
    if maximum is not None and int(value) > maximum:
        raise ConfigError(f"{name} must be <= {maximum}{alt}, got {value!r}")
    return int(value)


def check_path(name: str, value: object) -> None:
    """Raise ConfigError naming ``name`` unless ``value`` is a non-empty path without NUL."""
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise ConfigError(f"{name} must be a non-empty path, got {value!r}")
    if "\0" in str(os.fspath(value)):
        raise ConfigError(f"{name} must not contain a NUL byte, got {value!r}")


def _absolute(sync_dir: str | os.PathLike[str]) -> Path:
    """``sync_dir`` with ``~`` expanded, taken from the current directory if relative."""
    # Every later use must name the same directory: a relative path resolved at each
    # use would follow an os.chdir and split the job. Not normalised (".." after a
    # symbolic link means what the kernel says).
    where = Path(os.path.expanduser(os.fspath(sync_dir)))
    if where.is_absolute():
        return where
    try:
        return Path(os.getcwd(), where)
    except OSError as exc:
        raise ConfigError(
            f"sync_dir {sync_dir!r} is relative, and the current directory it "
            f"would be taken from is unusable: {exc.strerror or exc}"
        ) from exc


def check_run_id(name: str, value: object, alternative: str = "") -> str:
    """``value`` as a run id (1-64 characters from [A-Za-z0-9._-]), or raise ConfigError."""
    if not isinstance(value, str) or not _RUN_ID_RE.fullmatch(value):
        raise ConfigError(
            f"{name} must be 1-64 characters from [A-Za-z0-9._-]{alternative}, got {value!r}"
        )
    return value


def _check_bool(name: str, value: object, alternative: str = "") -> bool:
    """``value`` as a bool (numpy bools too), or raise ConfigError."""
    if not isinstance(value, (bool, np.bool_)):
        raise ConfigError(f"{name} must be a bool{alternative}, got {value!r}")
    return bool(value)


def check_seconds(
    name: str,
    value: object,
    *,
    zero_ok: bool = False,
    floor: float = 0,
    ceiling: float | None = None,
) -> float:
    """``value`` as a float of seconds (numpy floats too), finite, > 0 (>= 0 if
    ``zero_ok``), >= ``floor`` and <= ``ceiling``, or raise ConfigError naming ``name``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise ConfigError(f"{name} must be a number of seconds, got {value!r}")
    try:
        seconds = float(value)
    except OverflowError:  # an int too large for a float is no usable number of seconds
        seconds = math.inf
    if not (math.isfinite(seconds) and (seconds > 0 or (zero_ok and seconds == 0))):
        bound = ">= 0" if zero_ok else "> 0"
        raise ConfigError(f"{name} must be a finite number of seconds {bound}, got {value!r}")
    if seconds < floor:
        raise ConfigError(f"{name} must be at least {floor:g} s, got {value!r}")
    if ceiling is not None and seconds > ceiling:
        raise ConfigError(f"{name} must be at most {ceiling:.0e} s, got {seconds!r}")
    return seconds
