"""Time partitions of the audit (by month) and of the bodies (by day): made ahead, dropped by the retention.

Part of the store's seam: everything here runs on an asyncpg connection the store hands over. The
retention never updates rows: a day of bodies is detached CONCURRENTLY (reads and writes go on; only
DDL waits) and dropped, after the bodies of effects still open that day are carried into today.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TypeAlias

import asyncpg

# The store's pooled connections or the retention's own (gateway.store.Store.maintain).
AnyConn: TypeAlias = "asyncpg.Connection[asyncpg.Record] | asyncpg.pool.PoolConnectionProxy[asyncpg.Record]"

AUDIT = "effects"
BODIES = "effect_bodies"
# Made ahead of need, so that an insert never finds no partition for its row even if making them fails
# for a while: the coming two weeks of days, and the current and next month (at least 28 days more).
# Every gateway makes them at start and every purge_interval, so the days left stay at 14 to 15; the
# warning below comes once a week has passed without any made, and leaves a week to find out why. Each
# day made ahead is an empty table and its index, 16 KB, and plans prune it away.
BODY_DAYS_AHEAD = 14
AUDIT_MONTHS_AHEAD = 1
# Health and the log warn when rows stored from now on have partitions for fewer days than this: a
# week, so that a warning raised on a Friday evening still leaves days after a long weekend to act.
WARN_DAYS = 7
# A day of bodies is named by its first day (see _ENSURE).
_BODY_DAY = re.compile(r"effect_bodies_(\d{4})_(\d{2})_(\d{2})")


# A partition up to this size is counted exactly (a few milliseconds to read); above it, Postgres's
# row estimate stands in (before the first ANALYZE there is none: the size over a guessed row size).
EXACT_COUNT_BYTES = 8 * 1024 * 1024
# An audit row with its indexes' share, rounded up from the growth benchmark's (about 510 bytes a row).
ROW_BYTES_GUESS = 600
# A detach that loses a deadlock is finished by the next try; three losses in a row mean something
# holds the table on purpose, and the next round of the retention tries again.
DETACH_TRIES = 3


@dataclass(frozen=True, slots=True)
class Partition:
    name: str
    lower: datetime
    upper: datetime
    rows: int  # counted when small, else Postgres's estimate: counting would read the whole partition
    bytes: int
    detaching: bool = False  # a detach of it was begun and not finished


Progress = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


# Making a partition waits for the lock on its parent. A day of bodies being detached holds that lock
# while it waits for every older transaction to end, the one making the partition included: a deadlock,
# which Postgres breaks after deadlock_timeout (1 s by default) by aborting one side, perhaps the detach,
# which it leaves half done. So making partitions gives up well within that second; the maintainer, the
# only one that detaches, makes them itself before it detaches anything.
MAKE_LOCK_WAIT = "250ms"


async def make_ahead(conn: AnyConn) -> bool:
    """Make the partitions that rows stored now and in the coming days go into, as the tables' owner.

    Through migration 014's function, so any role granted EXECUTE on it may, the runtime role included.
    False when they could not be made now: the retention is detaching a day, or another session is
    making them (either holds the table's lock for a moment).
    """
    try:
        async with conn.transaction():
            await conn.execute(f"set local lock_timeout = '{MAKE_LOCK_WAIT}'")
            await conn.execute(
                "select effect_gateway_make_partitions($1, $2)", BODY_DAYS_AHEAD, AUDIT_MONTHS_AHEAD
            )
    except asyncpg.exceptions.LockNotAvailableError:
        return False
    return True


async def ensure(conn: AnyConn, at: datetime | None = None) -> bool:
    """The partitions that rows stored now (or at ``at``) and soon will go into, made with the
    connection's own privileges (the owner's: tests and tools that store rows in the past).

    False when they could not be made now because the retention is detaching a day (it makes them).
    """
    try:
        async with conn.transaction():
            await conn.execute(f"set local lock_timeout = '{MAKE_LOCK_WAIT}'")
            await conn.fetch(_ENSURE, at, BODY_DAYS_AHEAD, AUDIT_MONTHS_AHEAD)
    except asyncpg.exceptions.LockNotAvailableError:
        return False
    return True


_ENSURE = """
select effect_gateway_partition(
    p.parent, p.lower, p.upper,
    p.parent || '_' || to_char(p.lower at time zone 'UTC', case when p.parent = 'effects' then 'YYYY_MM'
                                                               else 'YYYY_MM_DD' end))
from (
    select 'effect_bodies' as parent, d at time zone 'UTC' as lower,
           (d + interval '1 day') at time zone 'UTC' as upper
    from generate_series(date_trunc('day', coalesce($1, now()) at time zone 'UTC'),
                         date_trunc('day', coalesce($1, now()) at time zone 'UTC') + $2 * interval '1 day',
                         interval '1 day') as d
    union all
    select 'effects', m at time zone 'UTC', (m + interval '1 month') at time zone 'UTC'
    from generate_series(date_trunc('month', coalesce($1, now()) at time zone 'UTC'),
                         date_trunc('month', coalesce($1, now()) at time zone 'UTC')
                             + $3 * interval '1 month',
                         interval '1 month') as m
) as p
"""


async def listed(conn: AnyConn, parent: str) -> list[Partition]:
    """The partitions of ``parent``, oldest first."""
    rows = await conn.fetch(
        """
        select c.relname as name, pg_get_expr(c.relpartbound, c.oid) as bound,
               c.reltuples::bigint as estimate, pg_relation_size(c.oid) as heap,
               pg_total_relation_size(c.oid) as bytes, i.inhdetachpending as detaching
        from pg_inherits i join pg_class c on c.oid = i.inhrelid
        where i.inhparent = $1::regclass
        order by c.relname
        """,
        parent,
    )
    found = []
    for r in rows:
        count = await row_count(conn, f'"{r["name"]}"', r["estimate"], r["heap"])
        found.append(
            Partition(
                r["name"], *bounds_of(r["bound"]), rows=count, bytes=r["bytes"], detaching=r["detaching"]
            )
        )
    return found


async def row_count(conn: AnyConn, table: str, estimate: int, heap_bytes: int, where: str = "true") -> int:
    """Rows of ``table`` (matching ``where``): counted when the table is small, else estimated."""
    if heap_bytes <= EXACT_COUNT_BYTES:
        return int(await conn.fetchval(f"select count(*) from {table} where {where}"))
    return estimate if estimate >= 0 else heap_bytes // ROW_BYTES_GUESS


@dataclass(frozen=True, slots=True)
class Ahead:
    """How long rows stored from now on still have partitions to go into, in each table."""

    audit: timedelta
    bodies: timedelta

    @property
    def days_left(self) -> float:
        """Days until the first row with no partition to go into (0: rows stored now have none)."""
        return min(self.audit, self.bodies) / timedelta(days=1)

    def warning(self) -> str | None:
        """What to tell an operator when fewer than WARN_DAYS are left; None when more are."""
        if self.days_left >= WARN_DAYS:
            return None
        return (
            f"the partitions for new rows run out in {self.days_left:.1f} days (audit {_days(self.audit)}, "
            f"bodies {_days(self.bodies)}): gateways make them every purge_interval, so making them has "
            "failed for a while; see the log, and check that the gateway's role may execute "
            "effect_gateway_make_partitions (effect-gateway migrate --grant-to ROLE)"
        )


def _days(span: timedelta) -> str:
    return f"{span / timedelta(days=1):.1f} days"


_BOUNDS = """
    select now() as now, array_agg(p.relname order by c.relname) as parents,
           array_agg(pg_get_expr(c.relpartbound, c.oid) order by c.relname) as bounds
    from pg_inherits i join pg_class c on c.oid = i.inhrelid join pg_class p on p.oid = i.inhparent
    where i.inhparent in ('effects'::regclass, 'effect_bodies'::regclass) and not i.inhdetachpending
"""


async def ahead(conn: AnyConn) -> Ahead:
    """How far ahead of now (Postgres's clock) the partitions of each table reach without a gap.

    Reads the catalog only: no effect table, and no privilege on any partition.
    """
    row = await conn.fetchrow(_BOUNDS)
    assert row is not None  # an aggregate without group by returns its one row
    spans: dict[str, list[tuple[datetime, datetime]]] = {AUDIT: [], BODIES: []}
    for parent, bound in zip(row["parents"] or (), row["bounds"] or (), strict=True):
        spans[parent].append(bounds_of(bound))
    return Ahead(audit=reach(spans[AUDIT], row["now"]), bodies=reach(spans[BODIES], row["now"]))


def reach(spans: list[tuple[datetime, datetime]], now: datetime) -> timedelta:
    """How long after ``now`` the ``spans`` (partitions' [lower, upper)) cover every moment; 0 when none
    covers ``now`` itself."""
    until = now
    for lower, upper in sorted(spans):
        if lower <= until < upper:
            until = upper
    return until - now


def month_of(at: datetime) -> tuple[datetime, datetime]:
    """The bounds of the audit's partition that holds a row created at ``at`` (a UTC month)."""
    lower = at.astimezone(UTC).replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    upper = (
        lower.replace(year=lower.year + 1, month=1)
        if lower.month == 12
        else lower.replace(month=lower.month + 1)
    )
    return lower, upper


def day_of(at: datetime) -> tuple[datetime, datetime]:
    """The bounds of the bodies' partition that holds a body stored at ``at`` (a UTC day)."""
    lower = at.astimezone(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    return lower, lower + timedelta(days=1)


def within(column: str, bounds: tuple[datetime, datetime]) -> str:
    """SQL keeping ``column`` within ``bounds``, as constants: the plan then names one partition.

    A statement that finds its row by a parameter leaves the partition to be picked when it runs, and a
    generic plan (the store's pools use them) must then open and lock every partition of the table and
    each of their indexes, on every execution: a hundred and more locks per statement after a few months,
    past the few a backend keeps cheaply. With the row's own partition bounds written in as constants,
    Postgres prunes the others when it plans. The text differs per month or day, so each bound gets a
    prepared statement of its own; detaching a partition makes Postgres plan them again. The bounds are
    the only values the store writes into SQL: datetimes from month_of or day_of, whose isoformat has
    no quote in it.
    """
    lower, upper = bounds
    return f"{column} >= '{lower.isoformat()}' and {column} < '{upper.isoformat()}'"


def bounds_of(bound: str) -> tuple[datetime, datetime]:
    """[lower, upper) of a partition, from its bound as pg_get_expr writes it."""
    # "FOR VALUES FROM ('2026-12-02 00:00:00+00') TO ('2026-12-03 00:00:00+00')"
    lower, upper = (part.split("'")[1] for part in bound.split(" TO "))
    return datetime.fromisoformat(lower), datetime.fromisoformat(upper)


async def drop_expired_bodies(
    conn: AnyConn, retention: timedelta, progress: Progress = _quiet
) -> list[Partition]:
    """Drop every day of bodies wholly older than the retention; returns what was dropped.

    Bodies of effects not yet completed that day are carried into today first: an effect waiting for an
    operator keeps what it asked for. Each day is detached concurrently (other sessions go on reading
    and writing the table) and then dropped.
    """
    cutoff = await conn.fetchval("select now() - $1::interval", retention)
    dropped = await finish_interrupted(conn, progress)
    for name in await _cut_short(conn, cutoff):
        await conn.execute(f'drop table "{name}"')
        progress(f"dropped {name}: a day of bodies an earlier round detached and did not drop")
    for part in await listed(conn, BODIES):
        if part.upper > cutoff:
            break
        await _drop(conn, part, progress)
        dropped.append(part)
    return dropped


async def finish_interrupted(conn: AnyConn, progress: Progress = _quiet) -> list[Partition]:
    """Finish (and drop) a day whose detach was cut short: a gateway stopped mid-way, or a deadlock lost.

    Postgres allows one such day per table and no other detach while it lasts; its rows are already out
    of sight of new statements. It was judged past the retention when its detach began.
    """
    interrupted = [part for part in await listed(conn, BODIES) if part.detaching]
    for part in interrupted:
        await _drop(conn, part, progress)
    return interrupted


async def _drop(conn: AnyConn, part: Partition, progress: Progress) -> None:
    # An open effect's request is carried into today, and its response if it is the latest attempt's
    # answer (stored since its claim): its new time is later than the answer was, which only makes a
    # probe's lag count from later. An earlier attempt's answer is not carried, and the record stops
    # pointing at it: carried to now it would pass for the answer of the attempt under way, and a
    # probe's lag would count from now instead of from that attempt's lease (gateway.decision.after_probe).
    # The record is changed only while it is still open and still points at that very answer: a settle
    # that completes it meanwhile wrote an answer of its own, which must stand.
    #
    # The open effects with bodies in the day are found by a statement of their own: inside the statement that
    # carries the bodies forward, Postgres misjudged how many there are and merged the day with the whole
    # audit in id order, which grew with the audit and with each day dropped (bench.growth). The bodies are
    # then carried forward effect by effect (see _carry); one that has completed since is left where it is.
    #
    # The day's rows are matched by effect alone, and take their scope from the open effect: a day whose
    # detach was left pending before migration 020 never got the scope column.
    found = await conn.fetchrow(
        f"""
        select array_agg(o.id), array_agg(o.created_at), array_agg(o.scope) from open_effects o
        where exists (select from "{part.name}" b where b.effect_id = o.id)
        """
    )
    assert found is not None  # an aggregate without group by returns its one row
    ids, created, scopes = found
    kept = await _carry(conn, part.name, ids, created, scopes) if ids else 0
    await _detach(conn, part.name)
    await conn.execute(f'drop table "{part.name}"')
    progress(f"dropped {part.name}: about {part.rows} bodies" + (f", {kept} carried forward" if kept else ""))


async def _carry(
    conn: AnyConn, day: str, ids: list[int], created: list[datetime], scopes: list[uuid.UUID]
) -> int:
    """Carry the bodies the open effects ``ids`` (created at ``created``, of ``scopes``) keep from
    ``day`` into today.

    With the generic plan: it cannot know the list's length, so it looks each effect up in its month.
    A plan for the given list, thousands long, could again merge the day with the whole audit.
    """
    async with conn.transaction():
        await conn.execute("set local plan_cache_mode = force_generic_plan")
        kept: int = await conn.fetchval(carry_statement(day), ids, created, scopes)
    return kept


def carry_statement(day: str) -> str:
    """The statement carrying bodies out of the partition ``day`` for the open effects $1 (created $2,
    of the scopes $3), returning how many it carried."""
    return f"""
        with open as (
            select * from unnest($1::bigint[], $2::timestamptz[], $3::uuid[]) as o(id, created_at, scope)
        ), day as (
            select b.effect_id, o.scope, b.stored_at, b.kind, b.headers, b.coding, b.content, o.created_at,
                   b.kind = 'request'
                   or (b.stored_at = e.response_at and b.stored_at >= coalesce(e.last_sent_at, e.created_at))
                       as kept
            from "{day}" b
            join open o on o.id = b.effect_id
            join effects e on e.id = o.id and e.created_at = o.created_at and e.scope = o.scope
                and e.state <> 'completed'
        ), moved as (
            insert into effect_bodies (effect_id, scope, stored_at, kind, headers, coding, content)
            select effect_id, scope, now(), kind, headers, coding, content from day where kept
            on conflict do nothing
            returning effect_id
        ), pointed as (
            -- Judged again on the row as it is now (a take-over that committed since this statement
            -- began moved last_sent_at, and Postgres re-checks the row it updates, not the day CTE).
            update effects e set response_at = case when d.stored_at >= coalesce(e.last_sent_at, e.created_at)
                                                    then now() end
            from day d
            where d.kind = 'response' and e.id = d.effect_id and e.created_at = d.created_at
              and e.scope = d.scope and e.response_at = d.stored_at and e.state <> 'completed'
            returning e.id
        )
        select count(*) from moved
        """


async def _cut_short(conn: AnyConn, cutoff: datetime) -> list[str]:
    """Days of bodies past ``cutoff`` that a round detached and then never dropped.

    A gateway stopped between a day's detach and its drop (SIGTERM cancels the round) leaves the day as
    a table of its own: no longer a partition, so no later round lists it, its bodies outlive the
    retention, and the day can never be made again (the name is taken). Its open effects' bodies were
    carried into today before the detach.
    """
    rows = await conn.fetch(
        """
        select relname from pg_class
        where relkind = 'r' and not relispartition and pg_table_is_visible(oid)
              and relname like 'effect\\_bodies\\_%'
        order by relname
        """
    )
    found = []
    for row in rows:
        day = _BODY_DAY.fullmatch(row["relname"])
        if day is None:
            continue
        year, month, first = (int(part) for part in day.groups())
        if datetime(year, month, first, tzinfo=UTC) + timedelta(days=1) <= cutoff:
            found.append(row["relname"])
    return found


async def _detach(conn: AnyConn, name: str) -> None:
    for _ in range(DETACH_TRIES):
        pending = await conn.fetchval(
            "select inhdetachpending from pg_inherits where inhrelid = $1::regclass", name
        )
        try:
            if pending:  # an earlier detach was interrupted between its two transactions
                await conn.execute(f'alter table effect_bodies detach partition "{name}" finalize')
            else:
                await conn.execute(f'alter table effect_bodies detach partition "{name}" concurrently')
            return
        except asyncpg.exceptions.DeadlockDetectedError:
            # Postgres broke a deadlock by aborting the detach's wait: the detach is left pending, and
            # the other side has gone on, so finishing it now can succeed.
            continue
    raise asyncpg.exceptions.DeadlockDetectedError(f"detaching {name} lost {DETACH_TRIES} deadlocks in a row")


def in_month(created_at: datetime) -> str:
    """SQL keeping ``e`` (the audit) to the month's partition that holds a row created at ``created_at``."""
    return within("e.created_at", month_of(created_at))
