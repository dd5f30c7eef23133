"""What a GradSync holds in its job, and the machinery around it: leaving on drop or at
exit, forks, and the function form's registry of sessions."""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from ._config import FileGradSyncConfig
from ._elastic import member_config, start_elastic
from ._errors import ConfigError, GradSyncError, clip
from ._gpu.source import DeviceGrads
from ._job.ejoin import Membership, forget_job
from ._job.reform import Reformer
from ._job.rendezvous import Generation, leave, rendezvous
from ._step.engine import StepEngine

if TYPE_CHECKING:
    from ._api import GradSync
    from ._guard import CallGuard

__all__ = [
    "Session",
    "close_all",
    "closing_reason",
    "forget",
    "job_key",
    "registered",
    "registry",
]

_log = logging.getLogger("gradsync")

# Forks this process's line has been through: a GradSync made before the last one
# belongs to an ancestor. Counted by a hook rather than compared by pid, which would
# be a system call in every step.
_forks_seen = 0


def _count_fork() -> None:
    global _forks_seen
    _forks_seen += 1


os.register_at_fork(after_in_child=_count_fork)


class Session:
    """What a GradSync holds in its job: the generation, the step engine, the GPU bridge."""

    def __init__(self, rank: int) -> None:
        self.gen: Generation | None = None
        self.engine: StepEngine | None = None
        self.membership: Membership | None = None  # elastic only
        self._cfg: FileGradSyncConfig | None = None  # elastic only
        # Elastic: lost after the last averaging call (while joiners came in, or in a broadcast).
        self.lost_since: list[str] = []
        self.gpu = DeviceGrads(rank)
        self.forks = _forks_seen
        self.left = False
        self.busy = False  # a call of the GradSync is in progress

    @property
    def forked(self) -> bool:
        """Whether this process is a fork of the one that made the session."""
        return _forks_seen != self.forks

    def start(
        self, cfg: FileGradSyncConfig, closing: threading.Event, max_wait_s: float | None
    ) -> StepEngine:
        """The step engine, meeting the other ranks first if this is the first call
        (waiting ``max_wait_s`` for them, default ``cfg.max_wait_s``)."""
        if self.engine is None:
            meet = cfg
            if max_wait_s is not None and max_wait_s < cfg.max_wait_s:
                meet = dataclasses.replace(cfg, max_wait_s=max_wait_s)
            if cfg.elastic:
                self._cfg = cfg
                self.membership = start_elastic(meet, closing)
                self.gen = self.membership.gen
                self.engine = StepEngine(member_config(cfg, self.membership), self.gen, closing)
                return self.engine
            self.gen = rendezvous(meet, closing)
            # From here on, a failure (an interrupt too) leaves the generation.
            self.engine = StepEngine(cfg, self.gen, closing)
        return self.engine

    def reform(
        self,
        cfg: FileGradSyncConfig,
        closing: threading.Event,
        *,
        admit: bool,
        next_step: int | None = None,
        known_lost: dict[int, str] | None = None,
    ) -> Membership:
        """Elastic: go on in the next membership (leaving this one), as decided with the
        other members that go on; ``admit``: joiners come in; ``known_lost``: ranks
        found lost already, and why."""
        old, engine = self.membership, self.engine
        assert old is not None
        assert engine is not None
        reformer = Reformer(
            cfg,
            old,
            engine.completed,
            closing,
            admit=admit,
            next_step=next_step,
            known_lost=known_lost,
        )
        new = reformer.run()
        # Rank 0's hold on the run id stays with the process that is rank 0 again.
        lock = old.gen.lock if new.gen.rank == 0 else None
        self.engine = None
        engine.close()
        kept = dataclasses.replace(old.gen, lock=None) if lock is not None else old.gen
        leave(kept, engine.completed, f"went on in generation {new.gen.gen_id}")
        self.gen = dataclasses.replace(new.gen, lock=lock)
        self.membership = dataclasses.replace(new, gen=self.gen)
        self.engine = StepEngine(member_config(cfg, new), self.gen, closing)
        return new

    def abandon(self) -> None:
        """Leave, for a GradSync dropped without close() or still open at exit, unless a
        call (in a daemon thread, at exit) is still using the session."""
        if not self.busy:
            self.leave(_uncaught_at_exit())

    def leave(self, why: str | None = None) -> None:
        """Leave the job and free what the session holds; only once, and never from a
        fork (at a forked child's exit the session is the parent's). ``why``: what
        made the rank close its session, for peers that still wait for it."""
        if self.left or self.forked:
            return
        self.left = True
        try:
            if self.engine is not None:
                self.engine.close()  # joins threads: a Ctrl-C can land in it
            elif self.gen is not None and self.gen.heartbeat is not None:
                self.gen.heartbeat.stop()  # met the peers, but the engine never started
        finally:
            # Only once (above): the peers must learn that this rank left even so.
            try:
                if self.gen is not None:
                    calls = 0 if self.engine is None else self.engine.completed
                    leave(self.gen, calls, f"closed its gradsync session ({why})" if why else None)
                    if self._cfg is not None:
                        forget_job(self._cfg, self.gen)
            finally:
                self.gpu.close()


# The function form's sessions, one per job and rank this process averages as.
registry: dict[tuple[str, str | None, int, int], GradSync] = {}
# Re-entrant: a signal handler's close() may run while its thread holds it.
registry_lock = threading.RLock()


def job_key(cfg: FileGradSyncConfig) -> tuple[str, str | None, int, int]:
    return (os.path.abspath(cfg.sync_dir), cfg.run_id, cfg.world_size, cfg.rank)


def registered(cfg: FileGradSyncConfig, make: Callable[[FileGradSyncConfig], GradSync]) -> GradSync:
    """The function form's session for ``cfg``'s job and rank, made by ``make`` if new.

    Raises:
        ConfigError: this rank of the job is averaged with another config already.
    """
    key = job_key(cfg)
    with registry_lock:
        sync = registry.get(key)
        if sync is not None and sync.cfg != cfg:
            # A second session of the same rank would meet itself as a rival.
            changed = ", ".join(
                f"{f.name} {getattr(sync.cfg, f.name)!r} then {getattr(cfg, f.name)!r}"
                for f in dataclasses.fields(cfg)
                if getattr(sync.cfg, f.name) != getattr(cfg, f.name)
            )
            raise ConfigError(
                f"rank {cfg.rank} of the job in {cfg.sync_dir} (run_id {cfg.run_id!r}) is "
                f"averaged in this process with another config ({changed}): pass the same "
                "config on every call"
            )
        if sync is None:
            sync = registry[key] = make(cfg)
    return sync


def forget(sync: CallGuard) -> None:
    """Drop ``sync`` from the registry (the next call of its job starts a new one)."""
    key = job_key(sync.cfg)
    with registry_lock:
        if registry.get(key) is sync:
            del registry[key]


@atexit.register
def close_all() -> None:
    """Close every session of the registry, telling peers why the program ends."""
    why = _uncaught_at_exit()
    with registry_lock:
        syncs = list(registry.values())
    for sync in syncs:
        try:
            sync._close(why)
        except Exception:  # at exit, one failure must not hide the others
            _log.exception("closing %r at exit failed", sync)


def closing_reason(exc: BaseException | None) -> str | None:
    """What peers are told of an exception leaving a ``with`` block: nothing for none,
    for ``sys.exit(0)`` or for a generator closed (ends, not failures)."""
    if exc is None or isinstance(exc, GeneratorExit):
        return None
    if isinstance(exc, SystemExit):
        return None if exc.code in (None, 0) else f"raising SystemExit({exc.code!r})"
    return f"raising {_exception_text(exc)}"


def _uncaught_at_exit() -> str | None:
    """What ends this program, if an uncaught exception does: the interpreter keeps
    the one it printed in ``sys.last_value``. Others keep theirs there too (pytest a
    failed test's, a REPL or notebook any statement's), so it counts only when its
    traceback runs through the main module's top level, outside a REPL or notebook."""
    if hasattr(sys, "ps1") or sys.flags.interactive or "IPython" in sys.modules:
        return None
    exc = getattr(sys, "last_value", None)
    if not isinstance(exc, BaseException):
        return None
    tb = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__main__":
            return f"at exit, after an uncaught {_exception_text(exc)}"
        tb = tb.tb_next
    return None


def _exception_text(exc: BaseException) -> str:
    """``ZeroDivisionError: division by zero``: its type and its message's first line,
    at most 200 characters, for a one-line message of a peer (a gradsync error's type
    only: its message, about other ranks, is this rank's to show)."""
    if isinstance(exc, GradSyncError):
        return type(exc).__name__
    try:
        lines = str(exc).strip().splitlines()
    except Exception:  # a broken __str__ must not replace the exception being raised
        lines = []
    return clip(f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__)
