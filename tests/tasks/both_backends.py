"""The ``anyio_backend`` fixture of the tests of the tasks that need only anyio (state owner,
signals, CDI watcher, NRI plugin): they run on both backends, asyncio and trio. (The daemon runs
asyncio, because grpclib does.) Import it into a test module to use it."""

from __future__ import annotations

import pytest

__all__ = ["anyio_backend"]


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    backend: str = request.param
    return backend
