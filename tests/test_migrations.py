"""Schema migrations: versioned, applied once, safe when several replicas start at the same moment."""

from __future__ import annotations

import asyncio

import asyncpg

from gateway.store import migrate, migration_files
from tests.support import other_database


async def test_replicas_starting_at_once_apply_each_migration_exactly_once(postgres_dsn: str) -> None:
    """Eight concurrent migrate() calls on a fresh database: no error, each version recorded once."""
    admin = await asyncpg.connect(postgres_dsn)
    await admin.execute("drop database if exists replicas")
    await admin.execute("create database replicas")
    dsn = other_database(postgres_dsn, "replicas")
    try:
        results = await asyncio.gather(*(migrate(dsn) for _ in range(8)))
        applied = [names for names in results if names]
        assert applied == [[name for _, name, _ in migration_files()]], "exactly one replica applied them"
        conn = await asyncpg.connect(dsn)
        try:
            versions = await conn.fetch("select version from effect_gateway_migrations order by version")
            assert [r["version"] for r in versions] == [v for v, _, _ in migration_files()]
            assert await conn.fetchval("select count(*) from effects") == 0
        finally:
            await conn.close()
        assert await migrate(dsn) == []  # and a later start has nothing to do
    finally:
        await admin.execute("drop database replicas with (force)")
        await admin.close()
