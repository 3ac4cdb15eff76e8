"""What a page of the audit reads on Postgres at volume: about its own rows, whatever lies around them."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from datetime import UTC, datetime

import asyncpg
import pytest

from gateway.audit_query import EffectFilter, find_statement
from gateway.states import State
from gateway.store import opened
from tests.database import empty_effects
from tests.plans import fill_effects, pages_read, plan_run, rows_read

EVER = {"since": datetime(1, 1, 1, tzinfo=UTC), "until": datetime(9999, 12, 31, tzinfo=UTC)}


async def test_a_page_of_the_widest_span_reads_about_its_own_rows(dsn: str) -> None:
    """A page of 50 from since=0001-01-01 until=9999-12-31 over 200,000 effects reads about 50 rows,
    and so does the next page, from the answer's last id.

    The span's ids were all read before the page's newest were picked: 270 ms at 1.2M effects.
    """
    await fill_effects(dsn, "t", 1, 200_000)
    first = EffectFilter(**EVER, limit=50)
    plan = await plan_run(dsn, *find_statement(first))
    assert rows_read(plan, "effects") <= 100
    async with opened(dsn) as store:
        page = await store.find(first)
        assert [r.id for r in page] == list(range(200_000, 199_950, -1))
        after = EffectFilter(**EVER, before_id=page[-1].id, limit=50)
        assert [r.id for r in await store.find(after)] == list(range(199_950, 199_900, -1))
    plan = await plan_run(dsn, *find_statement(after))
    assert rows_read(plan, "effects") <= 100
    # Deep down, with the span's end given too (a second upper bound beside the cursor), the page is
    # entered at the cursor: it reads about the pages of the same page without the end, and a few more
    # than the span's first page (the cursor's own lookup probes each month's primary key), not the
    # span's newest down to the cursor (100,000 index entries, hundreds of pages). Index entries skipped
    # by the page's own bounds are not counted as rows, so pages are what tell.
    for ended in (EffectFilter(**EVER), EffectFilter(tenant="t", **EVER)):
        deep = replace(ended, before_id=100_000)
        first_pages = pages_read(await plan_run(dsn, *find_statement(ended)))
        open_ended = pages_read(await plan_run(dsn, *find_statement(replace(deep, until=None))))
        deep_pages = pages_read(await plan_run(dsn, *find_statement(deep)))
        assert deep_pages <= open_ended * 1.25, (deep, deep_pages, open_ended)
        assert deep_pages <= first_pages * 4, (deep, deep_pages, first_pages)


async def test_a_tenants_list_of_an_open_state_reads_only_its_own_open_effects(dsn: str) -> None:
    """The audit filtered by an open state, for a tenant with 10 beside another's 300,000, reads its 10.

    It read the state's range of open_effects' key and threw the other tenant's rows away.
    """
    await fill_effects(dsn, "busy", 1, 300_000, "pending")
    await fill_effects(dsn, "quiet", 1_000_000, 10, "pending")
    plan = await plan_run(dsn, *find_statement(EffectFilter(tenant="quiet", state=State.PENDING)))
    assert rows_read(plan, "open_effects") <= 10


async def test_an_upstreams_list_of_pending_effects_reads_the_ones_in_flight_not_a_backlog(dsn: str) -> None:
    """An upstream's list of pending effects reads the pending ones (as many as requests in flight), and
    its list of a backlog state reads its own: with 300,000 of another upstream's waiting for review.
    The indexes by upstream hold no pending effect, so that a claim writes two index entries fewer."""
    await fill_effects(dsn, "busy", 1, 300_000, "needs_review")
    await fill_effects(dsn, "busy", 1_000_000, 200, "pending")
    await fill_effects(dsn, "quiet", 2_000_000, 10, "pending", upstream="mail")
    await fill_effects(dsn, "quiet", 3_000_000, 10, "needs_review", upstream="mail")
    await fill_effects(dsn, "quiet", 4_000_000, 5, "pending")
    conn = await asyncpg.connect(dsn)
    try:
        for index in ("open_effects_waiting_by_upstream", "open_effects_waiting_by_tenant_upstream"):
            made = await conn.fetchval("select indexdef from pg_indexes where indexname = $1", index)
            assert made.endswith("WHERE (state <> 'pending'::text)"), made
    finally:
        await conn.close()
    lists = {
        EffectFilter(upstream="mail", state=State.PENDING): 215,
        EffectFilter(tenant="quiet", upstream="mail", state=State.PENDING): 15,
        EffectFilter(upstream="mail", state=State.NEEDS_REVIEW): 10,
        EffectFilter(tenant="quiet", upstream="mail", state=State.NEEDS_REVIEW): 10,
    }
    async with opened(dsn) as store:
        for where, most in lists.items():
            plan = await plan_run(dsn, *find_statement(where))
            assert rows_read(plan, "open_effects") <= most, (where, rows_read(plan, "open_effects"))
            first = 2_000_000 if where.state is State.PENDING else 3_000_000
            assert [r.id for r in await store.find(where)] == list(range(first + 9, first - 1, -1))
            after = replace(where, before_id=first + 5)
            assert [r.id for r in await store.find(after)] == list(range(first + 4, first - 1, -1))


async def test_a_quiet_tenants_pages_read_only_its_own_effects(dsn: str) -> None:
    """A tenant with 10 effects beside another's 300,000: its first page, with or without a span, and the
    page after a cursor read its own rows, and so do a quiet upstream's page of a span and the pages of
    a tenant's 10 effects at one upstream beside its own 100,000 at another.

    A span was read down the index on (created_at, id) and every other tenant's rows in it thrown away.
    """
    await fill_effects(dsn, "busy", 1, 300_000)
    await fill_effects(dsn, "quiet", 1_000_000, 10, upstream="mail")
    # A tenant busy at one upstream and quiet at another: read at the quiet one, it read all the rest.
    await fill_effects(dsn, "both", 2_000_000, 10, upstream="mail")
    await fill_effects(dsn, "both", 3_000_000, 100_000)
    pages = [
        EffectFilter(tenant="quiet", **EVER),
        EffectFilter(tenant="quiet"),
        EffectFilter(tenant="quiet", before_id=1_000_005),
        EffectFilter(upstream="mail", **EVER),
        EffectFilter(tenant="quiet", upstream="mail", since=EVER["since"]),
        EffectFilter(tenant="both", upstream="mail"),
        EffectFilter(tenant="both", upstream="mail", **EVER),
        EffectFilter(tenant="both", upstream="mail", before_id=2_000_005),
    ]
    for where in pages:
        plan = await plan_run(dsn, *find_statement(where))
        assert rows_read(plan, "effects") <= 20, (where, rows_read(plan, "effects"))
    async with opened(dsn) as store:
        assert [r.id for r in await store.find(pages[0])] == list(range(1_000_009, 999_999, -1))
        assert [r.id for r in await store.find(pages[2])] == list(range(1_000_004, 999_999, -1))
        assert [r.id for r in await store.find(pages[5])] == list(range(2_000_009, 1_999_999, -1))
        assert [r.id for r in await store.find(pages[7])] == list(range(2_000_004, 1_999_999, -1))


@pytest.fixture(scope="module")
def backlog(postgres_dsn: str) -> str:
    """The test database holding the backlog below, filled once for the tests of this module that read
    it (the last ones in the file: none of them changes it for good)."""
    asyncio.run(empty_effects(postgres_dsn))
    asyncio.run(fill_backlog(postgres_dsn))
    return postgres_dsn


async def fill_backlog(dsn: str) -> None:
    """200,000 completed effects of tenant t and 60,030 waiting for review: 40,000 of t's and 20,000 of
    u's at upstream shop, u's 30 at mail (ids 500,000 to 500,029), and a run r with two of t's waiting."""
    await fill_effects(dsn, "t", 1, 200_000)
    await fill_effects(dsn, "u", 500_000, 30, "needs_review", upstream="mail")
    await fill_effects(dsn, "t", 1_000_000, 40_000, "needs_review")
    await fill_effects(dsn, "u", 2_000_000, 20_000, "needs_review")
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("update effects set run_id = 'r' where id in (1000005, 1000006)")
        await conn.execute("analyze effects")
    finally:
        await conn.close()


BACKLOG_LISTS = {
    "the gateway's": EffectFilter(state=State.NEEDS_REVIEW),
    "a tenant's": EffectFilter(tenant="u", state=State.NEEDS_REVIEW),
    "a run's": EffectFilter(run_id="r", state=State.NEEDS_REVIEW),
    "an upstream's": EffectFilter(upstream="mail", state=State.NEEDS_REVIEW),
    "a tenant's at one upstream": EffectFilter(tenant="u", upstream="mail", state=State.NEEDS_REVIEW),
}


async def test_a_backlog_of_an_open_state_is_listed_a_page_at_a_time(backlog: str) -> None:
    """The audit filtered by needs_review, with 60,000 of them among 260,000 effects, reads about its
    page of 50 rows: the gateway's list, a tenant's, a run's, an upstream's with few waiting, and a
    tenant's at that upstream.

    Postgres guessed the join of open_effects with the audit at one row (nothing tells it that an open
    effect has exactly one audit row), so the page's limit could not stop the read early: with 170,000
    waiting among 1M effects, it hashed every row of the audit for each page (540 ms). An upstream's
    list then stepped through the whole state's backlog, looking up every other upstream's audit row
    (195 ms with 95,000 waiting at another upstream); a tenant's at one upstream, through the tenant's
    (20,030 rows read here; 33 ms with 95,000).
    """
    for name, where in BACKLOG_LISTS.items():
        plan = await plan_run(backlog, *find_statement(where))
        read = rows_read(plan, "effects") + rows_read(plan, "open_effects")
        assert read <= 100, (name, read)


async def test_a_page_deep_in_an_open_list_costs_what_the_first_page_does(backlog: str) -> None:
    """A page of a tenant's, an upstream's or a tenant's-at-one-upstream needs_review list after a cursor
    40,000 entries down reads about as many pages as the list's first page.

    The cursor was a separate "id <" beside the list's range, and Postgres read down from the list's
    newest entry to it: 557 pages against 205.
    """
    # 40,000 more of u's waiting at mail, newer than the rest: taken out again after, for the next test.
    await fill_effects(backlog, "u", 3_000_000, 40_000, "needs_review", upstream="mail")
    try:
        for first, cursor in (
            (EffectFilter(tenant="t", state=State.NEEDS_REVIEW), 1_000_100),
            (EffectFilter(upstream="shop", state=State.NEEDS_REVIEW), 1_000_100),
            (EffectFilter(tenant="u", upstream="mail", state=State.NEEDS_REVIEW), 500_020),
        ):
            deep = replace(first, before_id=cursor)
            first_pages = pages_read(await plan_run(backlog, *find_statement(first)))
            assert pages_read(await plan_run(backlog, *find_statement(deep))) <= first_pages * 1.25, deep
    finally:
        conn = await asyncpg.connect(backlog)
        try:
            await conn.execute("delete from open_effects where id >= 3000000")
            await conn.execute("delete from effects where id >= 3000000")
            await conn.execute("analyze effects, open_effects")
        finally:
            await conn.close()


async def test_a_backlog_lists_the_rows_of_its_page(backlog: str) -> None:
    """Each list of the needs_review backlog answers its own effects, newest first, and a page after a
    cursor goes on from it: within an upstream's list, a tenant's, and a tenant's across its upstreams."""
    mail = list(range(500_029, 499_999, -1))
    async with opened(backlog) as store:
        page = await store.find(EffectFilter(state=State.NEEDS_REVIEW, limit=3))
        assert [(r.id, r.tenant) for r in page] == [(2_019_999, "u"), (2_019_998, "u"), (2_019_997, "u")]
        assert [r.id for r in await store.find(BACKLOG_LISTS["a run's"])] == [1_000_006, 1_000_005]
        assert [r.id for r in await store.find(BACKLOG_LISTS["an upstream's"])] == mail
        assert [r.id for r in await store.find(BACKLOG_LISTS["a tenant's at one upstream"])] == mail
        at_mail = replace(BACKLOG_LISTS["a tenant's at one upstream"], before_id=500_010, limit=3)
        assert [r.id for r in await store.find(at_mail)] == [500_009, 500_008, 500_007]
        assert await store.find(EffectFilter(tenant="t", upstream="mail", state=State.NEEDS_REVIEW)) == []
        shop = await store.find(EffectFilter(upstream="shop", state=State.NEEDS_REVIEW, limit=2))
        assert [r.id for r in shop] == [2_019_999, 2_019_998]
        deep = EffectFilter(upstream="shop", state=State.NEEDS_REVIEW, before_id=1_000_100, limit=3)
        assert [r.id for r in await store.find(deep)] == [1_000_099, 1_000_098, 1_000_097]
        deep = EffectFilter(tenant="u", state=State.NEEDS_REVIEW, before_id=2_000_001, limit=3)
        assert [r.id for r in await store.find(deep)] == [2_000_000, 500_029, 500_028]
