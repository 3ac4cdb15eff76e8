"""The audit at volume: rows written straight in SQL, and what a query's plan read when it ran."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import asyncpg

from gateway.store import StoreLimits, session_settings


def _literal(value: Any) -> str:
    """``value`` as SQL text, for an EXECUTE of a prepared statement (Postgres coerces it to the type)."""
    if isinstance(value, list):
        return "array[" + ", ".join(_literal(v) for v in value) + "]"
    if value is None:
        return "null"
    if isinstance(value, bool | int):
        return str(value).lower()
    text = value.isoformat() if isinstance(value, datetime) else str(value)
    return "'" + text.replace("'", "''") + "'"


async def plan_run(dsn: str, sql: str, args: list[Any]) -> dict[str, Any]:
    """The plan of ``sql`` as the store's connections run it (their session settings, so the generic
    plan), executed with ``args``: EXPLAIN (ANALYZE, BUFFERS)'s top node."""
    conn = await asyncpg.connect(dsn, server_settings=session_settings(StoreLimits()))
    try:
        await conn.execute(f"prepare measured as {sql}")
        literals = ", ".join(_literal(arg) for arg in args)
        doc = await conn.fetchval(f"explain (analyze, buffers, format json) execute measured({literals})")
    finally:
        await conn.close()
    plan: dict[str, Any] = json.loads(doc)[0]["Plan"]
    return plan


def rows_read(plan: dict[str, Any], relation: str) -> int:
    """Rows (or index entries) the plan's scans of ``relation`` (a table or its partitions) looked at:
    those they returned and those their filters threw away."""
    read = 0
    name = plan.get("Relation Name", "")
    if "Scan" in plan["Node Type"] and (name == relation or name.startswith(relation + "_")):
        per_loop = plan["Actual Rows"] + plan.get("Rows Removed by Filter", 0)
        read += round(per_loop * plan["Actual Loops"])
    return read + sum(rows_read(child, relation) for child in plan.get("Plans", ()))


def pages_read(plan: dict[str, Any]) -> int:
    """Pages of tables and indexes the plan read (EXPLAIN's shared buffers, found in memory or not):
    also those of index entries that the index's own conditions passed over, which no row count shows."""
    return int(plan.get("Shared Hit Blocks", 0) + plan.get("Shared Read Blocks", 0))


async def fill_effects(
    dsn: str,
    tenant: str,
    first_id: int,
    count: int,
    state: str = "completed",
    audit: bool = True,
    upstream: str = "shop",
) -> None:
    """``count`` effects of ``tenant`` written straight in SQL (a few seconds for 100,000s), ids from
    ``first_id``, made a millisecond apart from now; the open ones listed in open_effects too, and only
    there unless ``audit``."""
    conn = await asyncpg.connect(dsn)
    try:
        async with conn.transaction():
            if audit:
                await conn.execute(
                    """insert into effects (id, created_at, scope, tenant, upstream, key, derived_key, method,
                                            path, fingerprint, state)
                       select $1 + n, now() + n * interval '1 millisecond',
                              effect_key_digest('fill-' || ($1 + n)), $2, $5, 'fill-' || ($1 + n), 'eg_fill',
                              'POST', '/orders', 'fp', $4
                       from generate_series(0, $3 - 1) as n""",
                    first_id,
                    tenant,
                    count,
                    state,
                    upstream,
                )
            if state != "completed":
                await conn.execute(
                    """insert into open_effects (state, id, created_at, scope, tenant, upstream)
                       select $4, $1 + n, now() + n * interval '1 millisecond',
                              effect_key_digest('fill-' || ($1 + n)), $2, $5
                       from generate_series(0, $3 - 1) as n""",
                    first_id,
                    tenant,
                    count,
                    state,
                    upstream,
                )
        await conn.execute("analyze effects, open_effects")
    finally:
        await conn.close()
