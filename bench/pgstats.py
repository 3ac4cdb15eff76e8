"""Two counters of a Postgres that say what a stretch of load cost it: WAL written and WAL flushes."""

from __future__ import annotations

import asyncio

import asyncpg


async def _value(dsn: str, sql: str) -> int:
    conn = await asyncpg.connect(dsn)
    try:
        return int(await conn.fetchval(sql) or 0)
    finally:
        await conn.close()


def wal_position(dsn: str) -> int:
    """Bytes of WAL inserted since the cluster began: the difference of two readings is what was written."""
    return asyncio.run(_value(dsn, "select pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '0/0')::bigint"))


# Postgres 18 counts WAL flushes in pg_stat_io; 14 to 17 in pg_stat_wal.wal_sync.
_SYNCS_18 = "select sum(fsyncs)::bigint from pg_stat_io where object = 'wal'"
_SYNCS_OLDER = "select wal_sync from pg_stat_wal"
# A backend sends its counts to the shared statistics once it has been idle this long (seconds); a
# reading sooner after a load misses some of its flushes.
STATS_SETTLE = 11.0


def wal_syncs(dsn: str) -> int:
    """WAL flushes to disk (fsync or fdatasync) since the statistics were last reset."""

    async def read() -> int:
        conn = await asyncpg.connect(dsn)
        try:
            version = int(await conn.fetchval("show server_version_num"))
            return int(await conn.fetchval(_SYNCS_18 if version >= 180000 else _SYNCS_OLDER) or 0)
        finally:
            await conn.close()

    return asyncio.run(read())
