"""The launcher's arguments: their checks (the config's own), each rank's environment,
and the sync dir the ranks share."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

from gradsync._cli.defaultdir import DEFAULT_PREFIX, default_base
from gradsync._config import check_int, check_path, check_run_id, check_seconds
from gradsync._errors import ConfigError, SyncDirError
from gradsync._step.transport import filesystem_type, local_filesystem
from gradsync._store.makedir import make_sync_dir

__all__ = [
    "make_default_sync_dir",
    "prepare_sync_dir",
    "rank_envs",
    "remove_tree",
    "validate",
    "warn_if_unshared",
]

logger = logging.getLogger("gradsync.launch")

# Each rank costs the launcher a copy of the environment and three threads before any
# starts; no host runs more ranks than this usefully.
_MAX_NPROC = 4096


def validate(
    script_argv: list[str],
    *,
    nproc: int,
    max_wait_s: float | None,
    nnodes: int,
    node_rank: int,
    python: str,
    grace_period_s: float,
    run_id: str | None,
    sync_dir: str | os.PathLike[str] | None,
    module: bool,
    max_restarts: int = 0,
    elastic: bool = False,
) -> None:
    """Raise :class:`ConfigError` naming the first invalid argument and its value."""
    # The config's own checks: a value the launcher passes on is one the ranks accept.
    check_int("--nproc", nproc, minimum=1, maximum=_MAX_NPROC)
    check_int("--nnodes", nnodes, minimum=1)
    check_int("--node-rank", node_rank, minimum=0)
    if node_rank >= nnodes:
        raise ConfigError(f"--node-rank must be < --nnodes ({nnodes}), got {node_rank!r}")
    if max_wait_s is not None:
        check_seconds("--max-wait-s", max_wait_s)
    check_seconds("--grace-period-s", grace_period_s, zero_ok=True)
    if run_id is not None:
        check_run_id("--run-id", run_id)
    if nnodes > 1 and run_id is None:
        raise ConfigError(
            f"--nnodes {nnodes} needs --run-id: pass the same id to the launcher on every node"
        )
    if nnodes > 1 and sync_dir is None:
        raise ConfigError(
            f"--nnodes {nnodes} needs --sync-dir: a directory on a filesystem every node shares"
        )
    if sync_dir is not None:
        check_path("--sync-dir", sync_dir)
    check_int("--max-restarts", max_restarts, minimum=0)
    if max_restarts and not elastic:
        # A restarted rank can only rejoin a job whose survivors went on without it.
        raise ConfigError(
            f"--max-restarts {max_restarts} needs --elastic: a restarted rank rejoins "
            "only an elastic job"
        )
    _check_command(script_argv, python, module=module)


def _check_command(script_argv: list[str], python: str, *, module: bool) -> None:
    if not python or shutil.which(python) is None:
        raise ConfigError(f"python interpreter {python!r} is not an executable")
    if not script_argv:
        raise ConfigError("SCRIPT is missing: give the script to run, then its arguments")
    script = script_argv[0]
    if module:
        if not script or script.startswith("-"):
            raise ConfigError(f"SCRIPT must be a module name with --module, got {script!r}")
    elif not os.path.isfile(script) and not os.path.isfile(os.path.join(script, "__main__.py")):
        # python runs a directory (or zip) holding __main__.py as it runs a script.
        raise ConfigError(f"SCRIPT {script!r} is not a file, nor a directory with __main__.py")


def rank_envs(
    *,
    nproc: int,
    nnodes: int,
    node_rank: int,
    sync_dir: Path,
    run_id: str,
    max_wait_s: float | None,
    elastic: bool = False,
) -> list[tuple[int, dict[str, str]]]:
    """``(global rank, environment)`` of each rank of this node, by local rank."""
    world_size = nnodes * nproc
    envs = []
    for local_rank in range(nproc):
        env = dict(os.environ)
        rank = node_rank * nproc + local_rank
        env.update(
            GRADSYNC_RANK=str(rank),
            GRADSYNC_WORLD_SIZE=str(world_size),
            GRADSYNC_SYNC_DIR=str(sync_dir),
            GRADSYNC_RUN_ID=run_id,
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(local_rank),
            LOCAL_WORLD_SIZE=str(nproc),
            PYTHONUNBUFFERED="1",
        )
        if max_wait_s is not None:
            env["GRADSYNC_MAX_WAIT_S"] = repr(float(max_wait_s))
        if elastic:
            env.update(GRADSYNC_ELASTIC="1", GRADSYNC_RESTART_COUNT="0")
        envs.append((rank, env))
    return envs


def make_default_sync_dir(run_id: str) -> Path:
    """Create a fresh private directory on tmpfs if possible, else in the temp dir."""
    return Path(tempfile.mkdtemp(prefix=f"{DEFAULT_PREFIX}{run_id}-", dir=default_base()))


def prepare_sync_dir(sync_dir: str | os.PathLike[str]) -> Path:
    """Create ``sync_dir`` if missing and return its absolute path."""
    path = Path(os.path.abspath(os.path.expanduser(sync_dir)))  # "--sync-dir=~/x" too
    try:
        make_sync_dir(path, f"--sync-dir {os.fspath(sync_dir)!r}")
    except SyncDirError as exc:
        raise ConfigError(str(exc)) from exc
    return path


def warn_if_unshared(sync_dir: Path) -> None:
    """Warn that the other nodes may not see ``sync_dir`` if it is local to this host."""
    if local_filesystem(sync_dir):
        logger.warning(
            "--sync-dir %s is on a filesystem of this host (%s): the other nodes see "
            "its files only if they mount it too (exported over NFS, say)",
            sync_dir,
            filesystem_type(sync_dir),
        )


def remove_tree(path: Path) -> None:
    """Remove the sync dir the launcher made, saying if it could not."""
    try:
        shutil.rmtree(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.warning("could not remove sync dir %s: %s", path, exc)
    else:
        logger.info("removed sync dir %s", path)
