"""Fixtures: one real Postgres per test session (TEST_DATABASE_URL, or the embedded server)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterator

import asyncpg
import pytest

from gateway.embedded import EmbeddedPostgres
from gateway.store import migrate
from tests.support import Upstream, upstream_server


@pytest.fixture(scope="session")
def postgres_dsn(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A migrated database; the embedded server is stopped (by its pid) when the session ends."""
    given = os.environ.get("TEST_DATABASE_URL")
    embedded = None
    if given:
        dsn = given
    else:
        embedded = EmbeddedPostgres(tmp_path_factory.mktemp("pg"))
        dsn = embedded.start()
    try:
        asyncio.run(migrate(dsn))
        yield dsn
    finally:
        if embedded is not None:
            embedded.stop()


@pytest.fixture
async def dsn(postgres_dsn: str) -> str:
    """The test database with an empty effects table."""
    conn = await asyncpg.connect(postgres_dsn)
    try:
        await conn.execute("truncate effects restart identity")
    finally:
        await conn.close()
    return postgres_dsn


@pytest.fixture
async def upstream() -> AsyncIterator[Upstream]:
    async with upstream_server() as server:
        yield server
