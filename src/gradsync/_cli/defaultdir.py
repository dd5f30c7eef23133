"""Where ``gradsync launch`` makes a sync dir when given none, and finding this user's."""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path

from gradsync._names import RDZV

__all__ = ["DEFAULT_PREFIX", "default_base", "default_places", "own_default_dirs"]

DEFAULT_PREFIX = "gradsync-"  # then the run id, "-" and mkdtemp's random part
_SHM = "/dev/shm"


def default_base() -> str:
    """tmpfs if this user may create there, else the temp dir."""
    usable = os.path.isdir(_SHM) and os.access(_SHM, os.W_OK | os.X_OK)
    return _SHM if usable else tempfile.gettempdir()


def default_places() -> list[str]:
    """Every place :func:`default_base` may choose, once each."""
    return list(dict.fromkeys([_SHM, tempfile.gettempdir()]))


def own_default_dirs() -> list[Path]:
    """This user's directories named as the launcher names its own, in every place it
    may make them, in which ranks have met (a launcher started with another ``TMPDIR``
    is not found)."""
    found = []
    for base in default_places():
        with contextlib.suppress(OSError):
            for name in sorted(os.listdir(base)):
                if not name.startswith(DEFAULT_PREFIX):
                    continue
                with contextlib.suppress(OSError):
                    # lstat: a link is nothing the launcher made.
                    st = os.lstat(os.path.join(base, name))
                    # rdzv/: ranks have met there (a venv named gradsync-* has none).
                    rdzv = os.lstat(os.path.join(base, name, RDZV))
                    if (
                        stat.S_ISDIR(st.st_mode)
                        and st.st_uid == os.getuid()
                        and stat.S_ISDIR(rdzv.st_mode)
                    ):
                        found.append(Path(base, name))
    return found
