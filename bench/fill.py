"""Fill the effect tables with realistic rows, fast: server-side ``insert .. select generate_series``.

This module is the one place that knows the columns of ``effect_keys``, ``effects``,
``open_effects`` and ``effect_bodies``; the growth benchmark calls only :func:`fill`. :func:`fill`
reads each table's columns from the catalog first and stops with the name of any column it would leave
without a value or any it names that the table no longer has, so a stale fill fails loudly instead of
measuring the wrong rows. When the schema changes, adapt ``TABLES``.

The rows, as a gateway that has served agents for 60 days would have them: ids in time order; 4
tenants; 3 upstreams; random keys (agents' UUIDs, so the key table's unique index is filled at random
places, as in production); 20 calls per run with random run ids; 1 KB request and response bodies of
random hex (which Postgres's pglz cannot shrink at all and deflate only halves; real JSON shrinks
more), kept as the gateway keeps them (gateway.packing), each in the day partition of when it was
stored; 1% needs_review, some in_doubt, retryable and pending (their leases long expired), the rest
completed with the settling in their history; a tenth of them replayed once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import asyncpg

from gateway import packing, partitions

# Rows per batch: each batch is its own transaction, so progress shows and a failure loses one batch.
BATCH = 100_000
# Distinct bodies the rows draw from: enough that no two neighbouring rows share one, few to build.
BODIES = 1024
# Each body is 31 md5 digests of hex: 992 characters plus its JSON, i.e. about 1 KB.
DIGESTS_PER_BODY = 31
DAYS = 60
# A completed effect's answer came back this long after its claim (the trivial upstream's figure).
ANSWERED_AFTER = "interval '180 milliseconds'"

# The state of row i, from i % 10000: 1% needs_review, 0.2% in_doubt, 0.5% retryable, 0.05% pending.
_STATE = """case
    when i % 10000 < 100 then 'needs_review'
    when i % 10000 < 120 then 'in_doubt'
    when i % 10000 < 170 then 'retryable'
    when i % 10000 < 175 then 'pending'
    else 'completed' end"""

# The generated rows g: i, id, created_at, state, done (completed, with a response on record), and the
# identity of the effect (tenant, upstream, key), which two tables share.
_ROWS = f"""
    select i, n.id, s.state, s.state = 'completed' as done, t.created_at, 't' || (1 + i % 4) as tenant,
        (array['shop', 'mail', 'payments'])[1 + (i / 7) % 3] as upstream,
        md5('key' || n.id)::uuid::text as key
    from generate_series($1::bigint, $2::bigint) i,
         lateral (select $4::bigint + i as id) n,
         lateral (select {_STATE} as state) s,
         lateral (select now() - interval '{DAYS} days' * (1 - i::float8 / $3) as created_at) t
"""

KEY_COLUMNS: dict[str, str] = {
    "scope": "effect_key_digest(g.key)",
    "tenant": "g.tenant",
    "upstream": "g.upstream",
    "effect_id": "g.id",
    "created_at": "g.created_at",
}

# Column -> SQL over g (above); columns left out must have a default.
AUDIT_COLUMNS: dict[str, str] = {
    "id": "g.id",
    "created_at": "g.created_at",
    "scope": "effect_key_digest(g.key)",
    "tenant": "g.tenant",
    "upstream": "g.upstream",
    "key": "g.key",
    "derived_key": "'eg_' || md5('derived' || g.id)",
    "method": "'POST'",
    "path": "(array['/orders', '/send', '/v1/charges'])[1 + (g.i / 7) % 3]",
    "query": "''",
    "fingerprint": "md5('fp' || g.id) || md5('fp.' || g.id)",
    "state": "g.state",
    "attempt": "case when g.state = 'completed' then 1 else 2 end",
    "may_have_sent": "g.state <> 'retryable'",
    "lease_expires_at": "g.created_at + interval '35 seconds'",
    "response_status": "case when g.done then 201 end",
    "response_at": f"case when g.done then g.created_at + {ANSWERED_AFTER} end",
    "recovered_by": "case when g.i % 1000 = 500 and g.done then 'probe' end",
    "run_id": "'run-' || md5('run' || g.id / 20)",
    "step": "'step-' || g.id % 20",
    "first_sent_at": "g.created_at",
    "last_sent_at": "g.created_at",
    "completed_at": f"case when g.done then g.created_at + {ANSWERED_AFTER} end",
    "replays": "(g.i % 10 = 0)::int",
    "keyless": "false",
    # As the gateway writes it: the settling only (the claim is the row's created_at).
    "history": f"""jsonb_build_array(
        jsonb_build_object('event', 'settled', 'attempt', 1, 'state', g.state, 'status', 201,
            'note', 'answered 201', 'at', g.created_at + {ANSWERED_AFTER}))""",
}

# An effect not completed has its row in open_effects too.
OPEN_COLUMNS: dict[str, str] = {
    "state": "g.state",
    "id": "g.id",
    "created_at": "g.created_at",
    "scope": "effect_key_digest(g.key)",
    "tenant": "g.tenant",
    "upstream": "g.upstream",
}

# Column -> SQL over g and b (the row's bodies); one row per request, and one per response on record.
BODY_COLUMNS: dict[str, str] = {
    "effect_id": "g.id",
    "scope": "effect_key_digest(g.key)",
    "stored_at": f"case when r.kind = 'request' then g.created_at else g.created_at + {ANSWERED_AFTER} end",
    "kind": "r.kind",
    "headers": "case when r.kind = 'request' then b.request_headers else b.response_headers end",
    "coding": "case when r.kind = 'request' then b.request_coding else b.response_coding end",
    "content": "case when r.kind = 'request' then b.request_body else b.response_body end",
}


TABLES = {
    "effect_keys": KEY_COLUMNS,
    "effects": AUDIT_COLUMNS,
    "open_effects": OPEN_COLUMNS,
    "effect_bodies": BODY_COLUMNS,
}


async def check_columns(conn: asyncpg.Connection) -> None:
    rows = await conn.fetch(
        """select table_name, column_name,
                  is_nullable = 'YES' or column_default is not null or is_identity = 'YES'
                  or is_generated <> 'NEVER' as optional
           from information_schema.columns
           where table_schema = current_schema()
             and table_name = any($1::text[])""",
        list(TABLES),
    )
    problems = []
    for table, columns in TABLES.items():
        have = {r["column_name"]: r["optional"] for r in rows if r["table_name"] == table}
        if not have:
            raise RuntimeError(f"no table {table}: run the migrations first")
        missing = [c for c, optional in have.items() if not optional and c not in columns]
        unknown = [c for c in columns if c not in have]
        if missing or unknown:
            problems.append(f"{table}: no value for {missing}, no such column {unknown}")
    if problems:
        raise RuntimeError("bench/fill.py is out of date with the schema: " + "; ".join(problems))


def _insert(table: str, columns: dict[str, str], source: str) -> str:
    return f"insert into {table} ({', '.join(columns)}) select {', '.join(columns.values())} {source}"


_SQL = (
    _insert("effect_keys", KEY_COLUMNS, f"from ({_ROWS}) g"),
    _insert("effects", AUDIT_COLUMNS, f"from ({_ROWS}) g"),
    _insert("open_effects", OPEN_COLUMNS, f"from ({_ROWS}) g where not g.done"),
    _insert(
        "effect_bodies",
        BODY_COLUMNS,
        f"""from ({_ROWS}) g
            join bench_bodies b on b.n = g.i % {BODIES}
            join (values ('request'), ('response')) as r(kind) on r.kind = 'request' or g.done""",
    ),
)


async def make_partitions(conn: asyncpg.Connection) -> None:
    """The day and month partitions for 60 days back to today (the gateway makes only the coming ones)."""
    today = datetime.now(UTC)
    for back in range(DAYS + 1):
        await partitions.ensure(conn, today - timedelta(days=back))


async def fill(
    dsn: str, rows: int, *, connections: int = 2, progress: Callable[[int, float], None] | None = None
) -> None:
    """Add ``rows`` effects (key, audit row and bodies), created over the last 60 days in id order.

    Batches go to ``connections`` sessions at once: the work is Postgres's (heap, WAL and the indexes of
    three tables per effect), so one session per core fills about that many times faster.
    """
    conn = await asyncpg.connect(dsn)
    try:
        await check_columns(conn)
        await make_partitions(conn)
        # The ids: a block taken from the gateway's sequence, so the gateway's own go on after them.
        first_id = int(await conn.fetchval("select nextval('effect_ids')"))
        await conn.execute(f"select setval('effect_ids', {first_id + rows})")
    finally:
        await conn.close()
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
            await _pack_bodies(conn)
            for first in batches:
                last = min(rows, first + BATCH) - 1
                async with conn.transaction():
                    for sql in _SQL:
                        await conn.execute(sql, first, last, rows, first_id)
                done += last - first + 1
                if progress is not None:
                    progress(done, time.monotonic() - start)
        finally:
            await conn.close()

    await asyncio.gather(*(session() for _ in range(connections)))


async def _pack_bodies(conn: asyncpg.Connection) -> None:
    """Each of bench_bodies' bodies as the gateway stores it, with its coding beside it."""
    await conn.execute("alter table bench_bodies add request_coding text, add response_coding text")
    rows = await conn.fetch("select n, request_body, response_body from bench_bodies")
    await conn.executemany(
        "update bench_bodies set request_coding = $2, request_body = $3, response_coding = $4,"
        " response_body = $5 where n = $1",
        [(r["n"], *packing.pack(r["request_body"]), *packing.pack(r["response_body"])) for r in rows],
    )


# Headers as the gateway stores them: "Name: value" lines joined by CRLF (request headers redacted).
_BODIES_SQL = f"""
    create temp table bench_bodies as
    select n,
        convert_to('Content-Type: application/json' || chr(13) || chr(10) || 'Accept: */*' || chr(13)
            || chr(10) || 'User-Agent: Python/3.11 aiohttp/3.14.5' || chr(13) || chr(10)
            || 'Host: 127.0.0.1:9001', 'UTF8') as request_headers,
        convert_to('{{"client_reference": "ref-' || n || '", "items": "'
            || (select string_agg(md5('req' || n || '.' || k), '')
                from generate_series(1, {DIGESTS_PER_BODY}) k) || '"}}', 'UTF8') as request_body,
        convert_to('Content-Type: application/json; charset=utf-8' || chr(13) || chr(10)
            || 'Date: Thu, 03 Dec 2026 06:00:00 GMT' || chr(13) || chr(10)
            || 'Server: Python/3.11 aiohttp/3.14.5', 'UTF8') as response_headers,
        convert_to('{{"order": "O-' || n || '", "status": "placed", "detail": "'
            || (select string_agg(md5('resp' || n || '.' || k), '')
                from generate_series(1, {DIGESTS_PER_BODY}) k) || '"}}', 'UTF8') as response_body
    from generate_series(0, {BODIES - 1}) n
"""
