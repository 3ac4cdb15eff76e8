"""The stubbed model: answers deterministically and counts its calls in Postgres, across processes.

Durability does not depend on which model is used; a stub lets the demo count exactly how often it is
called, even by an agent process that was killed halfway.
"""

from __future__ import annotations

from typing import Any

import asyncpg

SCHEMA = """
create table if not exists demo_model_calls (
    id      bigint generated always as identity primary key,
    run_id  text not null,
    step    integer not null,
    prompt  text not null,
    at      timestamptz not null default now()
)
"""


async def model(
    conn: asyncpg.Connection | asyncpg.Pool, run_id: str, step: int, prompt: str
) -> dict[str, Any]:
    await conn.execute(
        "insert into demo_model_calls (run_id, step, prompt) values ($1, $2, $3)", run_id, step, prompt
    )
    return {"prompt": prompt, "answer": f"(model) {prompt}"}


async def calls(conn: asyncpg.Connection, run_id: str) -> int:
    return int(await conn.fetchval("select count(*) from demo_model_calls where run_id = $1", run_id))
