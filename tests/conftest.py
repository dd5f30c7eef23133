from __future__ import annotations

import sys
from pathlib import Path

import pytest

# Spawned rank processes import helpers from this directory by module name.
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session", autouse=True)
def _rank_fork_server() -> None:
    import ranks  # noqa: PLC0415  (after the sys.path entry above)

    ranks.start_fork_server()
