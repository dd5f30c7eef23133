"""The ``gradsync`` command line: ``gradsync launch`` and ``gradsync status``."""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from collections.abc import Iterator, Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TypeAlias

from gradsync._errors import ConfigError

from .launch import launch

__all__ = ["main"]

_Commands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"

_LAUNCH_DESCRIPTION = """\
Start N ranks of `python SCRIPT ARGS` on this node, in the spirit of torchrun.
Each rank sees GRADSYNC_RANK, GRADSYNC_WORLD_SIZE, GRADSYNC_SYNC_DIR, GRADSYNC_RUN_ID,
GRADSYNC_MAX_WAIT_S (if given), RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE.
Their output lines are prefixed with `[rank N] `. When a rank fails, the others are
stopped (SIGTERM, then SIGKILL after the grace period) and the failure is summarized,
unless it has restarts left (--max-restarts, with --elastic): then it alone is started
again, with GRADSYNC_RESTART_COUNT one more, and rejoins the job.
Everything from SCRIPT on is passed to the script untouched; `--` may precede SCRIPT."""

_LAUNCH_EPILOG = """\
exit status: 0 if every rank exited 0 (its last run, if restarted); else the exit code
of the rank that failed first, or 128+N if signal N killed it; 128+N if the launcher got
signal N (SIGINT: 130, SIGTERM: 143, SIGHUP: 129); 2 for invalid arguments; 1 if the
ranks could not be started (the Python interpreter could not be run, no temporary sync
directory)."""


def _build_parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """Return the top-level parser and its ``launch`` subparser."""
    parser = argparse.ArgumentParser(
        prog="gradsync",
        description="Data-parallel gradient averaging through files in a shared directory.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    launch = _add_launch(commands)
    _add_status(commands)
    return parser, launch


def _add_launch(commands: _Commands) -> argparse.ArgumentParser:
    launch = commands.add_parser(
        "launch",
        help="start the ranks of a job on this node",
        description=_LAUNCH_DESCRIPTION,
        epilog=_LAUNCH_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    launch.add_argument(
        "--nproc", type=int, required=True, metavar="N", help="ranks to start on this node"
    )
    launch.add_argument(
        "--sync-dir",
        type=str,  # not Path: Path("") would be the current directory
        metavar="DIR",
        help="directory shared by all ranks, created if missing and kept "
        "(default: a fresh directory under /dev/shm, else the temp dir, removed at the end)",
    )
    launch.add_argument(
        "--max-wait-s",
        type=float,
        metavar="S",
        help="seconds ranks wait for live peers (sets GRADSYNC_MAX_WAIT_S)",
    )
    launch.add_argument(
        "--nnodes", type=int, default=1, metavar="M", help="nodes in the job (default: 1)"
    )
    launch.add_argument(
        "--node-rank",
        type=int,
        default=0,
        metavar="K",
        help="index of this node, 0 <= K < M (default: 0)",
    )
    launch.add_argument(
        "--run-id",
        metavar="ID",
        help="job id, the same on every node; required with --nnodes > 1 "
        "(default: a fresh random id)",
    )
    launch.add_argument(
        "--grace-period-s",
        type=float,
        default=5.0,
        metavar="S",
        help="seconds between SIGTERM and SIGKILL when stopping ranks (default: 5)",
    )
    launch.add_argument(
        "--elastic",
        action="store_true",
        help="the job goes on without a lost rank and lets a restarted one rejoin "
        "(sets GRADSYNC_ELASTIC=1 and GRADSYNC_RESTART_COUNT)",
    )
    launch.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="N",
        help="times each rank may be restarted after failing; needs --elastic (default: 0)",
    )
    launch.add_argument(
        "-m", "--module", action="store_true", help="run SCRIPT as a module (python -m SCRIPT)"
    )
    launch.add_argument(
        "-v", "--verbose", action="count", default=0, help="log more (-v: info, -vv: debug)"
    )
    launch.add_argument("script", metavar="SCRIPT", help="the training script")
    launch.add_argument(
        "args", nargs="*", default=[], metavar="ARGS", help="arguments passed to SCRIPT"
    )
    return launch


def _add_status(commands: _Commands) -> None:
    status = commands.add_parser(
        "status",
        help="show the state of a sync directory",
        description="Show the state of the jobs in a sync directory, or in each of yours "
        "that `gradsync launch` made.",
    )
    status.add_argument(
        "dir",
        type=Path,
        nargs="?",
        metavar="DIR",
        help="the sync directory (default: your sync dirs that `gradsync launch` made "
        "without --sync-dir, in /dev/shm or the temp dir)",
    )
    status.add_argument("--json", action="store_true", help="print JSON instead of text")


def _version() -> str:
    try:
        return version("gradsync")
    except PackageNotFoundError:
        return "unknown"


def _split_launch_argv(
    argv: Sequence[str], launch: argparse.ArgumentParser
) -> tuple[list[str], list[str]]:
    """Split ``launch``'s arguments into the launcher's options and ``SCRIPT ARGS``.

    SCRIPT is the first argument that is neither an option, nor the value of an option
    that takes one, nor ``--``; nothing from SCRIPT on is parsed by the launcher, so the
    script's own options (even ``--nproc`` or ``--``) reach it untouched.
    """
    takes_value = {
        option
        for action in launch._actions
        if action.nargs != 0
        for option in action.option_strings
    }
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            return list(argv[:i]), list(argv[i + 1 :])
        if not arg.startswith("-") or arg == "-":
            break
        i += 2 if arg in takes_value else 1
    return list(argv[:i]), list(argv[i:])


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``gradsync`` command line with ``argv`` (default ``sys.argv[1:]``).

    Returns:
        The exit code; 2 for invalid arguments, 1 if the ranks could not be started.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    parser, launch_parser = _build_parser()
    script_argv: list[str] = []
    try:
        if args and args[0] == "launch":
            own, script_argv = _split_launch_argv(args[1:], launch_parser)
            # SCRIPT goes after `--` so that argparse never reads it as an option.
            ns, extra = parser.parse_known_args(
                ["launch", *own, *(["--", script_argv[0]] if script_argv else [])]
            )
            if extra:
                launch_parser.error(f"unrecognized arguments: {' '.join(extra)}")
        else:
            ns = parser.parse_args(args)
    except SystemExit as exc:  # argparse's --help, --version and errors
        return exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1

    if ns.command == "status":
        # Imported here: the status command is optional and written separately.
        from .status import status_main  # noqa: PLC0415

        code: int = status_main(ns.dir, as_json=ns.json)
        return code
    with _log_to_stderr(ns.verbose):
        return _launch(ns, script_argv, launch_parser)


@contextlib.contextmanager
def _log_to_stderr(verbose: int) -> Iterator[None]:
    """Show gradsync's log on stderr for the launch: warnings, or more with ``-v``/``-vv``."""
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("gradsync launch: %(levelname)s: %(message)s"))
    log = logging.getLogger("gradsync")
    previous_level = log.level
    log.addHandler(handler)
    log.setLevel(level)
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(previous_level)


def _launch(ns: argparse.Namespace, script_argv: list[str], parser: argparse.ArgumentParser) -> int:
    """Run ``gradsync launch``: its exit code, 2 for invalid arguments, 1 if it could not start."""
    try:
        return launch(
            script_argv,
            nproc=ns.nproc,
            sync_dir=ns.sync_dir,
            max_wait_s=ns.max_wait_s,
            nnodes=ns.nnodes,
            node_rank=ns.node_rank,
            grace_period_s=ns.grace_period_s,
            run_id=ns.run_id,
            module=ns.module,
            max_restarts=ns.max_restarts,
            elastic=ns.elastic,
        )
    except ConfigError as exc:
        parser.print_usage(sys.stderr)
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"{parser.prog}: error: cannot start the ranks: {exc}", file=sys.stderr)
        return 1
