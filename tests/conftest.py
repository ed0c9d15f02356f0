from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fixtures import SysfsTrees, scratch_dir, sysfs_trees


@pytest.fixture
def anyio_backend() -> str:
    # grpclib only runs on asyncio (design §3); pure parts are backend-free.
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
