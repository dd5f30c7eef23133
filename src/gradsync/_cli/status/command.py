"""The ``gradsync status`` command: print a sync dir's state, or each of this user's, and
exit 1 where one cannot be read."""

from __future__ import annotations

import errno
import json
import sys
from pathlib import Path
from typing import Any

from gradsync._cli.defaultdir import default_places, own_default_dirs

from .generation import Listdir, list_dir
from .read import describe
from .text import render

__all__ = ["status_main"]

# What makes Path.is_dir() false rather than raise: no directory there to read.
_NOT_A_DIRECTORY = (errno.ENOENT, errno.ENOTDIR, errno.ELOOP)


def status_main(sync_dir: Path | None, *, as_json: bool, listdir: Listdir = list_dir) -> int:
    """Print the state of ``sync_dir`` (None: of this user's sync dirs that ``gradsync
    launch`` made); 0 if every job could be read, 1 if the directory does not exist or
    it, or a job in it, cannot be read. ``listdir``: see :func:`describe`."""
    if sync_dir is None:
        return _status_of_own(as_json, listdir)
    report = _read(sync_dir, listdir)
    if report is None:
        return 1
    print(json.dumps(report, indent=2) if as_json else render(report))
    return 1 if _failed(report) else 0


def _read(sync_dir: Path, listdir: Listdir) -> dict[str, Any] | None:
    """:func:`describe` ``sync_dir``, or say on stderr why it cannot be read."""
    try:
        return describe(sync_dir, listdir=listdir)
    except OSError as exc:
        if exc.errno in _NOT_A_DIRECTORY and exc.filename == str(sync_dir):
            print(f"gradsync status: {sync_dir} is not a directory", file=sys.stderr)
        else:
            where = exc.filename or sync_dir
            print(f"gradsync status: cannot read {where}: {exc.strerror or exc}", file=sys.stderr)
        return None


def _failed(report: dict[str, Any]) -> bool:
    unreadable = any(job["state"] == "unreadable" for job in report["jobs"])
    return unreadable or bool(report.get("error"))


def _status_of_own(as_json: bool, listdir: Listdir) -> int:
    """Print the state of this user's sync dirs that ``gradsync launch`` made."""
    reports = [_read(d, listdir) for d in own_default_dirs()]
    shown = [r for r in reports if r is not None]
    if as_json:
        print(json.dumps(shown, indent=2))
    elif shown:
        print("\n\n".join(render(r) for r in shown))
    elif not reports:
        print(
            f"gradsync status: no sync dir of yours in {' or '.join(default_places())} (where "
            "`gradsync launch` without --sync-dir makes one); for a job given --sync-dir DIR, "
            "run: gradsync status DIR"
        )
    return 1 if any(r is None or _failed(r) for r in reports) else 0
