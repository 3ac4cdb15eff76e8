"""The hot path's statements lock the partitions they touch, not every month of the audit and day of bodies.

A statement that locks every partition (and each one's indexes) on each execution costs more with every
month the audit keeps, and past sixteen locks a backend leaves Postgres's fast path for the shared lock
table, which all cores contend for. So the number of locks a new effect, its settle and a replay take must
not grow with the number of partitions.

A phase's first run on a connection also plans its statement (the store's pools use generic plans, made
once per connection and again after each change of schema, such as a new partition); planning locks the
indexes the planner weighs, and its count varies by one between plannings for reasons of Postgres's own
(18 or 19 for a settle). What every request pays is the cached plan's locks, so those are compared exactly,
and the planning ones are held to what they were.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import timedelta
from typing import TypeVar

import asyncpg
import pytest

from gateway.decision import settle
from gateway.outcome import Answered
from gateway.record import StoredResponse
from gateway.schema import migrate
from gateway.store import Conn, Store
from tests.database import other_database
from tests.factories import new_effect

T = TypeVar("T")
OK = StoredResponse(201, (("Content-Type", "application/json"),), b'{"id": "o1"}')
_keys = itertools.count()


class LockCounting(Store):
    """The store, each phase run in a transaction that counts its relation locks before it commits."""

    locks: list[int]

    async def _attempts(self, op: Callable[[Conn], Awaitable[T]]) -> T:
        conn = await self._pool.acquire()
        try:
            async with conn.transaction():
                result = await op(conn)
                self.locks.append(
                    await conn.fetchval(
                        "select count(*) from pg_locks where pid = pg_backend_pid() and locktype = 'relation'"
                    )
                )
                return result
        finally:
            await self._pool.release(conn)


@pytest.fixture
async def database(postgres_dsn: str) -> AsyncIterator[str]:
    """A migrated database of its own: the test adds partitions the others must not see."""
    admin = await asyncpg.connect(postgres_dsn)
    await admin.execute("drop database if exists partition_locks")
    await admin.execute("create database partition_locks")
    dsn = other_database(postgres_dsn, "partition_locks")
    await migrate(dsn)
    try:
        yield dsn
    finally:
        await admin.execute("drop database partition_locks with (force)")
        await admin.close()


async def _locks_of_an_effect(store: LockCounting) -> dict[str, int]:
    """Locks taken by each phase of one effect: its claim, settle, a retry's read and a reread."""
    key = f"locks-{next(_keys)}"
    effect = new_effect(key, tenant="t", derived_key="d-" + key, fingerprint="f" * 64)
    taken: dict[str, int] = {}
    store.locks = []
    record, created = await store.claim(effect, timedelta(seconds=30))
    assert created
    assert record is not None
    taken["claim"] = store.locks[-1]
    done = settle(Answered(201, OK.headers, OK.body), earlier_doubt=False)
    settled = await store.settle(record, done, response=OK, recovered_by=None)
    assert settled is not None
    taken["settle"] = store.locks[-1]
    again, created = await store.claim(effect, timedelta(seconds=30))
    assert again is not None
    assert not created
    assert again.response == OK
    taken["claim of a known key"] = store.locks[-1]
    await store.reread(settled)
    taken["reread"] = store.locks[-1]
    return taken


async def test_a_new_effect_and_its_replay_lock_no_more_with_more_partitions(database: str) -> None:
    """Adding fourteen months of audit and seventy days of bodies leaves each phase's locks on its cached
    plan as they were, and its locks while planning within one of what they were."""
    # One connection: the first effect of each round plans every phase, the second reuses the plans.
    store = await LockCounting.connect(database, min_size=1, max_size=1)
    try:
        few_planning = await _locks_of_an_effect(store)
        few = await _locks_of_an_effect(store)
        conn = await asyncpg.connect(database)
        try:
            await conn.execute(
                """
                select effect_gateway_partition('effect_bodies', d, d + interval '1 day',
                                                'effect_bodies_' || to_char(d, 'YYYY_MM_DD'))
                from generate_series(date_trunc('day', now(), 'UTC') - interval '70 days',
                                     date_trunc('day', now(), 'UTC') - interval '1 day',
                                     interval '1 day') as d;
                select effect_gateway_partition('effects', m, m + interval '1 month',
                                                'effects_' || to_char(m, 'YYYY_MM'))
                from generate_series(date_trunc('month', now(), 'UTC') - interval '14 months',
                                     date_trunc('month', now(), 'UTC') - interval '1 month',
                                     interval '1 month') as m;
                """
            )
            parts = await conn.fetchval(
                "select count(*) from pg_inherits "
                "where inhparent in ('effects'::regclass, 'effect_bodies'::regclass)"
            )
        finally:
            await conn.close()
        assert parts >= 84
        many_planning = await _locks_of_an_effect(store)
        many = await _locks_of_an_effect(store)
    finally:
        await store.close()
    # Each phase locks its tables and the one partition of each it touches (a settle 8 relations on its
    # cached plan, 19 while planning); before, every partition and index: 107 for a settle with these
    # partitions.
    assert many == few
    assert all(many_planning[phase] <= few_planning[phase] + 1 for phase in few_planning), (
        many_planning,
        few_planning,
    )
