"""The statements of the notifications (migration 022), each a method of :class:`Notifications`.

:class:`gateway.store.Store` runs them as it runs the phases. None of them is on the hot path: the
claim and the settle write nothing here, and a sweep finds the waits afterwards in open_effects.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta
from typing import Protocol, TypeVar
from uuid import UUID

from gateway import locks, notifications
from gateway.notifications import Notice
from gateway.rows import Conn

T = TypeVar("T")

# One sweep at a time among all workers and gateways on the database: the others skip their round
# (the insert's "on conflict do nothing" keeps a wait told once either way; the lock saves the others
# the same reads). Transaction-level, so that it holds through a pooler in transaction mode.
NOTICE_LOCK = locks.NOTICE

# Each wait that is told (notifications.WAITS) with its threshold; the open effects in each state
# waiting that long, each looked up in the audit by its primary key (a lateral lookup: as a join,
# Postgres could hash the whole audit), and still in that state. The wait began when the latest
# attempt ended: its lease ran out, or was cut short when its answer came or it went to review.
_NOTICE = """
    with w as (
        select * from unnest($1::text[], $2::text[], $3::interval[]) as w(state, event, after)
    )
    insert into effect_notifications (scope, effect_id, event, attempt, state, tenant, upstream, method,
        path, created_at, run_id, step, waiting_since)
    select e.scope, e.id, w.event, e.attempt, e.state, e.tenant, e.upstream, e.method, e.path,
           e.created_at, e.run_id, e.step, e.since
    from w
    join open_effects o on o.state = w.state and o.created_at <= now() - w.after
    cross join lateral (
        select e.*, least(coalesce(e.lease_expires_at, e.created_at), now()) as since from effects e
        where e.id = o.id and e.scope = o.scope and e.created_at = o.created_at and e.state = o.state
    ) e
    where e.since <= now() - w.after
    on conflict do nothing
"""

# Notifications whose delivery ended a retention ago, of effects no longer open: nobody will look.
# (One of an effect still open stays, so that its wait is not told again.)
_FORGET = """
    delete from effect_notifications n
    where coalesce(n.delivered_at, n.gave_up_at) < now() - $1::interval
      and not exists (select from open_effects o
                      where o.state in ('pending', 'retryable', 'in_doubt', 'needs_review')
                        and o.id = n.effect_id and o.scope = n.scope)
"""

# The notification due longest, taken for one delivery: its next try moves ``$1`` on (a lease longer
# than the delivery may take), so no other worker takes it meanwhile, and one that died holding it
# leaves it to be taken again. SKIP LOCKED: two workers taking at once each get a different one.
_TAKE = """
    update effect_notifications n set tries = tries + 1, next_try_at = now() + $1::interval,
        last_try_at = now()
    from (select effect_id, event, attempt, scope from effect_notifications
          where delivered_at is null and gave_up_at is null and next_try_at <= now()
          order by next_try_at limit 1 for update skip locked) due
    where n.effect_id = due.effect_id and n.event = due.event and n.attempt = due.attempt
      and n.scope = due.scope
    returning n.*, now() as now
"""

# What came of a delivery, fenced on the try that made it: a worker that stalled past its lease, while
# another took the notification again, changes nothing.
_DELIVERED = """
    update effect_notifications set delivered_at = now(), last_status = $6, last_error = null
    where effect_id = $1 and event = $2 and attempt = $3 and scope = $4 and tries = $5
      and delivered_at is null and gave_up_at is null
"""
_FAILED = """
    update effect_notifications set last_status = $6, last_error = $7,
        next_try_at = case when $8::interval is null then next_try_at else now() + $8::interval end,
        gave_up_at = case when $8::interval is null then now() end
    where effect_id = $1 and event = $2 and attempt = $3 and scope = $4 and tries = $5
      and delivered_at is null and gave_up_at is null
"""


class Runner(Protocol):
    """How the store runs a statement function of ours: timed under its name, retried as its own are
    (gateway.store.Store._run)."""

    async def __call__(self, kind: str, op: Callable[[Conn], Awaitable[T]]) -> T: ...


class Notifications:
    """A [webhook]'s statements, run by the store's runner (gateway.store.Store.notifications): apart
    from the store's own methods, which the simulator's store mirrors, since no simulation sends any."""

    def __init__(self, run: Runner) -> None:
        self._run = run

    async def notice_waits(self, in_doubt_after: timedelta, retention: timedelta) -> int | None:
        """Record a notification for every wait not yet told; None when another worker's sweep is under
        way. Returns how many were new. Also forgets the notifications nobody needs any more."""
        states, events, afters = zip(*notifications.waits_told(in_doubt_after), strict=True)

        async def op(conn: Conn) -> int | None:
            async with conn.transaction():
                if not await conn.fetchval("select pg_try_advisory_xact_lock($1)", NOTICE_LOCK):
                    return None
                done = await conn.execute(_NOTICE, list(states), list(events), list(afters))
                await conn.execute(_FORGET, retention)
            return int(done.rsplit(" ", 1)[1])

        return await self._run("notice", op)

    async def take_notification(self, lease: timedelta) -> tuple[Notice, datetime, UUID] | None:
        """The notification due longest, taken for a delivery under ``lease``, the database's clock, and
        its key for :meth:`record_delivery`; None when none is due."""

        async def op(conn: Conn) -> tuple[Notice, datetime, UUID] | None:
            row = await conn.fetchrow(_TAKE, lease)
            if row is None:
                return None
            notice = Notice(
                id=str(row["id"]),
                event=row["event"],
                effect_id=row["effect_id"],
                attempt=row["attempt"],
                state=row["state"],
                tenant=row["tenant"],
                upstream=row["upstream"],
                method=row["method"],
                path=row["path"],
                created_at=row["created_at"],
                run_id=row["run_id"],
                step=row["step"],
                waiting_since=row["waiting_since"],
                noticed_at=row["noticed_at"],
                tries=row["tries"],
            )
            return notice, row["now"], row["scope"]

        return await self._run("take_notification", op)

    async def record_delivery(
        self,
        notice: Notice,
        scope: UUID,
        *,
        status: int | None,
        error: str | None,
        retry: timedelta | None,
        delivered: bool,
    ) -> bool:
        """What came of ``notice``'s latest try: delivered, or failed (``retry``: the wait before the
        next, None: given up). False when another try took it meanwhile (nothing written)."""
        key = (notice.effect_id, notice.event, notice.attempt, scope, notice.tries)

        async def op(conn: Conn) -> bool:
            if delivered:
                done = await conn.execute(_DELIVERED, *key, status)
            else:
                done = await conn.execute(_FAILED, *key, status, error, retry)
            return done != "UPDATE 0"

        return await self._run("record_delivery", op)
