from __future__ import annotations

import sys
from pathlib import Path

import pytest

# Spawned rank processes import helpers from this directory by module name.
sys.path.insert(0, str(Path(__file__).parent))


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (``-n``), a file's tests run in one worker, in order, as alone;
    the multi-host files share one, since each brings up the one simulated cluster."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        path = item.path.relative_to(Path(__file__).parent)
        group = "multihost" if path.parts[0] == "multihost" else str(path)
        item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(scope="session", autouse=True)
def _rank_fork_server() -> None:
    import ranks  # noqa: PLC0415  (after the sys.path entry above)

    ranks.start_fork_server()
