from __future__ import annotations

import pytest


@pytest.fixture
def anyio_backend() -> str:
    # grpclib only runs on asyncio (design §3); pure parts are backend-free.
    return "asyncio"
