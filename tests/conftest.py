"""Fixtures every test folder shares."""

from __future__ import annotations

import pytest


@pytest.fixture
def anyio_backend() -> str:
    # asyncio only: aiohttp (the HTTP engine) and the test servers are asyncio code
    return "asyncio"
