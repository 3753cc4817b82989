"""Fixtures every test folder shares."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def anyio_backend() -> str:
    # asyncio only: aiohttp (the HTTP engine) and the test servers are asyncio code
    return "asyncio"


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[str]:
    """A real PostgreSQL server's admin URL: BATCHRUN_TEST_POSTGRES_URL, or a throwaway cluster
    (tests/postgres.py). Where none can be had the test skips, saying why, unless
    BATCHRUN_REQUIRE_POSTGRES=1 (set by .ci/run), which makes it fail."""
    given = os.environ.get("BATCHRUN_TEST_POSTGRES_URL")
    if given:
        yield given
        return
    try:
        from tests.postgres import throwaway_server

        with throwaway_server() as url:
            yield url
    except Exception as exc:  # no binaries, no psycopg, initdb refused...
        reason = f"no PostgreSQL server for the tests: {type(exc).__name__}: {exc}"
        if os.environ.get("BATCHRUN_REQUIRE_POSTGRES") == "1":
            pytest.fail(reason)
        pytest.skip(reason)


@pytest.fixture(params=["sqlite", "postgresql"])
def ledger_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A new, empty ledger's URL, on each engine the ledger supports."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'ledger.db'}"
        return
    from tests.postgres import fresh_database

    with fresh_database(request.getfixturevalue("postgres_server")) as url:
        yield url
