from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fixtures import SysfsTrees, scratch_dir, sysfs_trees

TESTS = Path(__file__).resolve().parent
# Tests that start `dracpu run` as a process (with the simulator's peers): marked `daemon`, so
# that `pytest -m "not daemon"` runs the fast set alone.
DAEMON_TESTS = (TESTS / "integration", TESTS / "sim" / "test_node_sim.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        path = Path(str(item.path))
        if any(path == p or p in path.parents for p in DAEMON_TESTS):
            item.add_marker(pytest.mark.daemon)


@pytest.fixture
def anyio_backend() -> str:
    # grpclib only runs on asyncio; the tests of the tasks that need only anyio run on trio too.
    return "asyncio"


@pytest.fixture(scope="module")
def trees() -> Iterator[SysfsTrees]:
    """Every named fake machine's sysfs tree, written once per test module."""
    with sysfs_trees() as written:
        yield written


@pytest.fixture
def scratch() -> Iterator[Path]:
    """An empty directory, on tmpfs when there is one."""
    with scratch_dir() as path:
        yield path
