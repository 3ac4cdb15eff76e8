"""Fill the effects table with realistic rows, fast: server-side ``insert .. select generate_series``.

This module is the one place that knows the columns of ``effects``; the growth benchmark calls only
:func:`fill`. When the schema is reshaped (partitioned tables, bodies in a table of their own), adapt
``COLUMNS`` (and :func:`fill`, if a row goes to several tables). :func:`fill` reads the table's columns
from the catalog first and stops with the name of any column it would leave without a value or any
it names that the table no longer has, so a stale fill fails loudly instead of measuring the wrong rows.

The rows, as a gateway that has served agents for 60 days would have them: ids in about time order; 4
tenants; 3 upstreams; random keys (agents' UUIDs, so the unique index is filled at random places, as in
production); 20 calls per run with random run ids; 1 KB request and response bodies of random hex
(they compress as badly as real JSON with ids and tokens in it, i.e. hardly); 1% needs_review, some
in_doubt, retryable and pending (their leases long expired), the rest completed with a two-entry
history; a tenth of them replayed once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import asyncpg

# Rows per statement: each is its own transaction, so progress shows and a failure loses one batch.
BATCH = 100_000
# Distinct bodies the rows draw from: enough that no two neighbouring rows share one, few to build.
BODIES = 1024
# Each body is 31 md5 digests of hex: 992 characters plus its JSON, i.e. about 1 KB.
DIGESTS_PER_BODY = 31
DAYS = 60

# The state of row i, from i % 10000: 1% needs_review, 0.2% in_doubt, 0.5% retryable, 0.05% pending.
_STATE = """case
    when i % 10000 < 100 then 'needs_review'
    when i % 10000 < 120 then 'in_doubt'
    when i % 10000 < 170 then 'retryable'
    when i % 10000 < 175 then 'pending'
    else 'completed' end"""

# Column -> SQL over g (i, created_at, state, done) and b (the row's bodies). Columns left out must have
# a default (id is an identity column).
COLUMNS: dict[str, str] = {
    "tenant": "'t' || (1 + g.i % 4)",
    "upstream": "(array['shop', 'mail', 'payments'])[1 + (g.i / 7) % 3]",
    "key": "md5('key' || g.i)::uuid::text",
    "derived_key": "'eg_' || md5('derived' || g.i)",
    "method": "'POST'",
    "path": "(array['/orders', '/send', '/v1/charges'])[1 + (g.i / 7) % 3]",
    "query": "''",
    "fingerprint": "md5('fp' || g.i) || md5('fp.' || g.i)",
    "request_headers": """jsonb_build_object('Content-Type', 'application/json', 'Accept', '*/*',
        'User-Agent', 'Python/3.11 aiohttp/3.14.5', 'Host', '127.0.0.1:9001')""",
    "request_body": "b.request_body",
    "state": "g.state",
    "attempt": "case when g.state = 'completed' then 1 else 2 end",
    "may_have_sent": "g.state <> 'retryable'",
    "lease_expires_at": "g.created_at + interval '35 seconds'",
    "response_status": "case when g.done then 201 end",
    "response_headers": """case when g.done then jsonb_build_array(
        jsonb_build_array('Content-Type', 'application/json; charset=utf-8'),
        jsonb_build_array('Date', to_char(g.created_at, 'Dy, DD Mon YYYY HH24:MI:SS "GMT"')),
        jsonb_build_array('Server', 'Python/3.11 aiohttp/3.14.5')) end""",
    "response_body": "case when g.done then b.response_body end",
    "recovered_by": "case when g.i % 1000 = 500 and g.done then 'probe' end",
    "run_id": "'run-' || md5('run' || g.i / 20)",
    "step": "'step-' || g.i % 20",
    "created_at": "g.created_at",
    "first_sent_at": "g.created_at",
    "last_sent_at": "g.created_at",
    "completed_at": "case when g.done then g.created_at + interval '180 milliseconds' end",
    "replays": "(g.i % 10 = 0)::int",
    "purged_at": "null::timestamptz",
    "history": """jsonb_build_array(
        jsonb_build_object('event', 'claimed', 'attempt', 1, 'at', g.created_at),
        jsonb_build_object('event', 'settled', 'attempt', 1, 'state', g.state, 'status', 201,
            'note', 'answered 201', 'at', g.created_at + interval '180 milliseconds'))""",
}


async def check_columns(conn: asyncpg.Connection) -> None:
    rows = await conn.fetch(
        """select column_name, is_nullable = 'YES' or column_default is not null or is_identity = 'YES'
                  or is_generated <> 'NEVER' as optional
           from information_schema.columns
           where table_schema = current_schema() and table_name = 'effects'"""
    )
    if not rows:
        raise RuntimeError("no table effects: run the migrations first")
    have = {r["column_name"]: r["optional"] for r in rows}
    missing = [c for c, optional in have.items() if not optional and c not in COLUMNS]
    unknown = [c for c in COLUMNS if c not in have]
    if missing or unknown:
        raise RuntimeError(
            f"bench/fill.py is out of date with the schema: no value for {missing}, no such column {unknown}"
        )


async def fill(
    dsn: str, rows: int, *, connections: int = 2, progress: Callable[[int, float], None] | None = None
) -> None:
    """Add ``rows`` rows, created over the last 60 days in id order (the newest now).

    Batches go to ``connections`` sessions at once: the work is Postgres's (heap, TOAST, WAL and six
    indexes per row), so one session per core fills about that many times faster.
    """
    conn = await asyncpg.connect(dsn)
    try:
        await check_columns(conn)
    finally:
        await conn.close()
    names = ", ".join(COLUMNS)
    values = ",\n".join(COLUMNS.values())
    sql = f"""
        insert into effects ({names})
        select {values}
        from (
            select i, s.state, s.state = 'completed' as done,
                now() - interval '{DAYS} days' * (1 - i::float8 / $3) as created_at
            from generate_series($1::bigint, $2::bigint) i,
                 lateral (select {_STATE} as state) s
        ) g
        join bench_bodies b on b.n = g.i % {BODIES}
    """
    batches = iter(range(0, rows, BATCH))
    done = 0
    start = time.monotonic()

    async def session() -> None:
        nonlocal done
        conn = await asyncpg.connect(dsn)
        try:
            # Durability of the filling itself is of no interest, and it halves the time on a slow disk.
            await conn.execute("set synchronous_commit = off")
            await conn.execute(_BODIES_SQL)
            for first in batches:
                last = min(rows, first + BATCH) - 1
                await conn.execute(sql, first, last, rows)
                done += last - first + 1
                if progress is not None:
                    progress(done, time.monotonic() - start)
        finally:
            await conn.close()

    await asyncio.gather(*(session() for _ in range(connections)))


_BODIES_SQL = f"""
    create temp table bench_bodies as
    select n,
        convert_to('{{"client_reference": "ref-' || n || '", "items": "'
            || (select string_agg(md5('req' || n || '.' || k), '')
                from generate_series(1, {DIGESTS_PER_BODY}) k) || '"}}', 'UTF8') as request_body,
        convert_to('{{"order": "O-' || n || '", "status": "placed", "detail": "'
            || (select string_agg(md5('resp' || n || '.' || k), '')
                from generate_series(1, {DIGESTS_PER_BODY}) k) || '"}}', 'UTF8') as response_body
    from generate_series(0, {BODIES - 1}) n
"""
