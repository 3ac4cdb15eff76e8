"""The embedded Postgres: started in the data folder, tuned for the gateway's writes, stopped by its owner."""

from __future__ import annotations

from pathlib import Path

import asyncpg

from gateway.embedded import EmbeddedPostgres


async def test_the_embedded_postgres_is_tuned_for_the_gateways_writes(tmp_path: Path) -> None:
    """Checkpoints are spaced out and full-page images compressed, which keeps WAL per effect small."""
    server = EmbeddedPostgres(tmp_path / "data")
    dsn = server.start()
    try:
        conn = await asyncpg.connect(dsn)
        try:
            shown = {
                name: await conn.fetchval(f"show {name}")
                for name in ("wal_compression", "checkpoint_timeout", "max_wal_size")
            }
        finally:
            await conn.close()
    finally:
        server.stop()
    assert shown == {"wal_compression": "pglz", "checkpoint_timeout": "15min", "max_wal_size": "4GB"}
