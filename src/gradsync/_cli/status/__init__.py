"""``gradsync status DIR``: who is in a sync directory, and which rank is everyone waiting for."""

from .command import status_main
from .read import describe
from .text import render

__all__ = ["describe", "render", "status_main"]
