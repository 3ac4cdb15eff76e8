"""State counts on Postgres past the bound to which each open state is counted exactly."""

from __future__ import annotations

from collections.abc import AsyncIterator

import asyncpg
import pytest

from gateway.audit_query import EXACT_OPEN_COUNT, OPEN_STATES, count_statement
from gateway.store import Store, opened
from tests.plans import fill_effects, plan_run, rows_read


@pytest.fixture
async def store(dsn: str) -> AsyncIterator[Store]:
    async with opened(dsn) as store:
        yield store


async def test_a_tenants_counts_read_only_its_own_open_effects(dsn: str, store: Store) -> None:
    """A tenant with 10 open effects beside another's 300,000 is counted from its own 10 index entries.

    The count, one statement for every viewer, read "tenant = $2 or $2 is null" in the plan the pool's
    generic plans give it: it stepped through the other tenant's 300,000 pending effects to find 10
    (174 ms at 1M), on every health request with a token.
    """
    await fill_effects(dsn, "busy", 1, 300_000, "pending", audit=False)
    await fill_effects(dsn, "quiet", 1_000_000, 10, "pending", audit=False)
    plan = await plan_run(dsn, *count_statement("quiet"))
    assert rows_read(plan, "open_effects") <= 10
    assert (await store.state_counts("quiet"))["pending"] == 10
    # The admin's and the busy tenant's counts stop at the bound: they read no more than it per state.
    for viewer in (None, "busy"):
        plan = await plan_run(dsn, *count_statement(viewer))
        assert rows_read(plan, "open_effects") <= EXACT_OPEN_COUNT * len(OPEN_STATES)
    assert (await store.state_counts("busy"))["pending"] == EXACT_OPEN_COUNT


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
                "insert into open_effects (state, id, created_at, scope, tenant, upstream)"
                " select 'pending', $1 + n, now(), gen_random_uuid(), $2, 'shop'"
                " from generate_series(1, $3) as n",
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
