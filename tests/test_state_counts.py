"""State counts on Postgres past the bound to which each open state is counted exactly."""

from __future__ import annotations

from collections.abc import AsyncIterator

import asyncpg
import pytest

from gateway.store import Store, opened


@pytest.fixture
async def store(dsn: str) -> AsyncIterator[Store]:
    async with opened(dsn) as store:
        yield store


async def test_a_tenants_count_of_many_open_effects_is_a_floor_that_other_tenants_do_not_move(
    dsn: str, store: Store
) -> None:
    """Past 1,000 open effects in a state, a tenant reads 1,000 (or more), whatever other tenants hold.

    An estimate (the state's share times the tenant's) read 2,842 for a tenant with 1,500 pending, and
    moved when another tenant's backlog grew: a tenant learnt a little of another's volume.
    """
    conn = await asyncpg.connect(dsn)
    try:
        for tenant, offset, count in (("a", 0, 1500), ("b", 10_000, 4500)):
            await conn.execute(
                "insert into open_effects (state, id, created_at, tenant)"
                " select 'pending', $1 + n, now(), $2 from generate_series(1, $3) as n",
                offset,
                tenant,
                count,
            )
        await conn.execute("analyze open_effects")
    finally:
        await conn.close()
    assert (await store.state_counts(tenant="a"))["pending"] == 1000
    assert (await store.state_counts(tenant="b"))["pending"] == 1000
    assert (await store.state_counts())["pending"] >= 5000  # the whole gateway's: estimated past 1,000
