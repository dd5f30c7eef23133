"""``launch()``: one node's job, from the launcher's arguments to its exit code."""

from __future__ import annotations

import logging
import os
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path

from gradsync._job.reaping import remove_dead_jobs

from .args import (
    make_default_sync_dir,
    prepare_sync_dir,
    rank_envs,
    remove_tree,
    validate,
    warn_if_unshared,
)
from .job import Job
from .report import announce
from .signals import SignalCatcher
from .supervise import run

__all__ = ["launch"]

logger = logging.getLogger("gradsync.launch")


def launch(
    script_argv: Sequence[str],
    *,
    nproc: int,
    sync_dir: str | os.PathLike[str] | None = None,
    max_wait_s: float | None = None,
    nnodes: int = 1,
    node_rank: int = 0,
    python: str = sys.executable,
    grace_period_s: float = 5.0,
    run_id: str | None = None,
    module: bool = False,
    max_restarts: int = 0,
    elastic: bool = False,
) -> int:
    """Run ``nproc`` ranks of ``python SCRIPT ARGS`` on this node and wait for all of them.

    Rank ``local_rank`` of node ``node_rank`` gets global rank
    ``node_rank * nproc + local_rank`` in a world of ``nnodes * nproc`` ranks, and sees
    it in ``GRADSYNC_RANK``/``RANK``, ``GRADSYNC_WORLD_SIZE``/``WORLD_SIZE``,
    ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``, along with ``GRADSYNC_SYNC_DIR``,
    ``GRADSYNC_RUN_ID``, ``GRADSYNC_MAX_WAIT_S`` (if given) and ``PYTHONUNBUFFERED=1``.
    Each line a rank writes is copied to the launcher's stdout or stderr (the same one)
    prefixed with ``[rank N] ``. When a rank fails, the others get SIGTERM, then SIGKILL
    after ``grace_period_s``, and a summary of the first failure goes to stderr. SIGINT,
    SIGTERM and SIGHUP to the launcher stop the ranks the same way (when called from
    the main thread, which is where signal handlers can be installed), and so does a
    watchdog process if the launcher ends without stopping them (killed by SIGKILL).
    When a rank fails or is stopped without closing its gradsync session, the launcher
    (or its watchdog) leaves its job in ``GRADSYNC_SYNC_DIR`` on its behalf, saying how
    it ended: its peers on other nodes learn it at once instead of after their heartbeat
    timeout.

    A rank that fails with restarts left (``max_restarts``, counted per rank) is started
    again instead, alone, with the same environment and ``GRADSYNC_RESTART_COUNT`` one
    more; the others go on.

    Args:
        script_argv: ``SCRIPT`` (a path, or a module name if ``module``) and its arguments.
        nproc: Ranks to start on this node, >= 1.
        sync_dir: Directory shared by all ranks; created if missing and never removed.
            ``None``: a fresh directory under ``/dev/shm`` (else the temp dir), removed
            when the job ends. Required when ``nnodes > 1``.
        max_wait_s: Exported as ``GRADSYNC_MAX_WAIT_S``; ``None`` leaves it unset.
        nnodes: Nodes in the job, each running its own launcher, >= 1.
        node_rank: This node's index, ``0 <= node_rank < nnodes``.
        python: Interpreter that runs the ranks.
        grace_period_s: Seconds between SIGTERM and SIGKILL when stopping ranks, >= 0.
        run_id: Job name shared by all nodes (required when ``nnodes > 1``);
            ``None``: a fresh random one.
        module: Run ``python -m SCRIPT`` instead of ``python SCRIPT``.
        max_restarts: Times each rank of this node may be restarted after failing, >= 0;
            more than 0 needs ``elastic``.
        elastic: Export ``GRADSYNC_ELASTIC=1`` and ``GRADSYNC_RESTART_COUNT=0`` to the
            ranks: their job goes on without a lost rank, and a restarted one rejoins it.

    Returns:
        The launcher's exit code: 0 if every rank exited 0 (its last process, when
        restarted); else the exit code of the
        rank that failed first, or 128 + N if signal N killed it; 128 + N if the launcher
        itself was stopped by signal N (130 for SIGINT, 143 for SIGTERM).

    Raises:
        ConfigError: an argument is invalid, or ``sync_dir`` cannot be created.
        OSError: a rank could not be started (the ranks already started are stopped).
    """
    script_argv = list(script_argv)
    validate(
        script_argv,
        nproc=nproc,
        max_wait_s=max_wait_s,
        nnodes=nnodes,
        node_rank=node_rank,
        python=python,
        grace_period_s=grace_period_s,
        run_id=run_id,
        sync_dir=sync_dir,
        module=module,
        max_restarts=max_restarts,
        elastic=elastic,
    )
    if run_id is None:
        run_id = uuid.uuid4().hex[:16]
    signals = SignalCatcher()
    signals.install()
    own_dir: Path | None = None
    try:
        directory, own_dir = _sync_dir(sync_dir, run_id, nproc, nnodes)
        envs = rank_envs(
            nproc=nproc,
            nnodes=nnodes,
            node_rank=node_rank,
            sync_dir=directory,
            run_id=run_id,
            max_wait_s=max_wait_s,
            elastic=elastic,
        )
        argv = [python, "-m", *script_argv] if module else [python, *script_argv]
        first = node_rank * nproc
        logger.info(
            "starting ranks %d-%d of %d: run id %s, sync dir %s",
            *(first, first + nproc - 1, nnodes * nproc, run_id, directory),
        )
        job = Job(
            signals,
            grace_period_s,
            directory,
            own_dir=own_dir is not None,
            max_restarts=max_restarts,
        )
        code = run(job, argv, envs)
        if own_dir is None:
            # Ranks stopped by a signal or a peer's failure leave their files; ranks that
            # finished removed theirs. What is left of dead ranks of this host goes now,
            # not when the next job's rank 0 gets to it.
            remove_dead_jobs(directory)
        return code
    finally:
        # Remove the directory before restoring the signal handlers, so that a second
        # Ctrl-C cannot interrupt the removal halfway.
        if own_dir is not None:
            remove_tree(own_dir)
        signals.restore()


def _sync_dir(
    sync_dir: str | os.PathLike[str] | None, run_id: str, nproc: int, nnodes: int
) -> tuple[Path, Path | None]:
    """The job's sync dir, and it again if the launcher made it (and removes it)."""
    if sync_dir is None:
        own = make_default_sync_dir(run_id)
        announce(own, run_id, nproc)
        return own, own
    directory = prepare_sync_dir(sync_dir)
    if nnodes > 1:
        warn_if_unshared(directory)
    return directory, None
