"""``gradsync launch``: start one node's ranks, prefix their output, stop them together.

POSIX only: each rank runs in its own session (process group), which the launcher
signals with :func:`os.killpg`.
"""

from .launcher import launch

__all__ = ["launch"]
