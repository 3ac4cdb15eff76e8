"""The writes of the idempotency phases as Postgres statements, each a function of its connection.

:class:`gateway.store.Store` runs each on a pooled connection, retries what Postgres says is
retryable, and maps asyncpg's errors to the gateway's own; here is only what each one writes and
reads. A write that moves a record (take over, settle, review, restore, resolve) is fenced by the
state and attempt it was read in, so that it changes nothing once another attempt took the record (a
restore, which changes neither, also by the response it was read with);
one that only adds to it (a fenced-out holder's note, replay counts) is not. Each is kept to the one
month of the audit that holds the row: a statement that may touch every month locks them all.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

from gateway import packing, partitions
from gateway.audit_query import RECORD_COLUMNS
from gateway.decision import Settlement
from gateway.errors import StoreRejected
from gateway.keys import key_digest
from gateway.lost_writes import Witness
from gateway.record import EffectRecord, KeyCarriers, NewEffect, RowKey, StoredResponse, head_bytes
from gateway.rows import Conn, read_with_response, record_of, reread
from gateway.states import State, Transition


def _fenced(record: EffectRecord, scope_param: int) -> str:
    """The where clause of a write fenced on the attempt and state ``record`` was read in ($1 to $4),
    naming its scope (parameter ``scope_param``) and kept to its month of the audit."""
    month = partitions.in_month(record.created_at)
    fence = "id = $1 and created_at = $2 and attempt = $3 and state = $4"
    return f"where {fence} and scope = ${scope_param} and {month}"


async def _one(conn: Conn, sql: str, *args: Any) -> EffectRecord | None:
    """One statement that returns at most one effect row (None: no row matched, e.g. fenced out)."""
    row = await conn.fetchrow(sql, *args)
    return record_of(row) if row is not None else None


def _event(kind: str, **data: Any) -> list[dict[str, Any]]:
    """One entry of a row's history, as an array to append; the SQL stamps it with the database's time."""
    return [{"event": kind, **{k: v for k, v in data.items() if v is not None}}]


def _stamped(param: int) -> str:
    """SQL for history entry ``$param`` with the database's time added (``at``)."""
    return f"jsonb_set(${param}::jsonb, '{{0,at}}', to_jsonb(now()))"


def _open_moved(source: str, target: str) -> str:
    """CTEs keeping open_effects in step with the audit row that the CTE ``e`` just moved.

    ``source`` and ``target`` are SQL for the states before and after (parameters or literals). The
    effect leaves open_effects when it completes and changes its row there when it moves between open
    states; a move from a state to itself writes nothing.
    """
    return f"""
        o_gone as (
            delete from open_effects o using e
            where {target} = 'completed' and o.state = {source} and o.id = e.id and o.scope = e.scope
        ), o_moved as (
            update open_effects o set state = {target} from e
            where {target} <> 'completed' and {target} <> {source} and o.state = {source} and o.id = e.id
              and o.scope = e.scope
        )"""


def _settled_into_chain(rows: str, where: str, outcome: str, digest: str, by: str) -> str:
    """A CTE adding settlements to those the chainer puts into the audit's chain (gateway.chaining):
    one row each, and no lock that another request's settle would wait for.

    ``rows``: what they are read from, whose effect rows just written are ``e``; ``where``: which of
    them settled; the others, SQL for the outcome, the response's digest and who resolved it.
    """
    return f"""
        chained as (
            insert into unchained (scope, effect_id, attempt, tenant, upstream, method, path, fingerprint,
                outcome, status, response, recovered_by, by, run_id, step, created_at)
            select e.scope, e.id, e.attempt, e.tenant, e.upstream, e.method, e.path, e.fingerprint,
                {outcome}, e.response_status, decode({digest}, 'hex'), e.recovered_by, {by}, e.run_id, e.step,
                e.created_at
            from {rows}
            where {where}
        )"""


# The claims' columns as arrays, one element per new effect, made rows again by unnest.
_CLAIMS = """
    select * from unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[],
           $8::text[], $9::bytea[], $10::bytea[], $11::interval[], $12::text[], $13::text[],
           $14::boolean[], $15::text[], $16::jsonb[], $17::uuid[], $18::text[])
        as c(tenant, upstream, key, derived_key, method, path, query, fingerprint, headers, content,
             lease, run_id, step, keyless, coding, key_carriers, scope, tool)
"""


async def claim_many(
    conn: Conn, claims: Sequence[tuple[NewEffect, timedelta]], witness: Witness | None = None
) -> list[EffectRecord | None]:
    """The statement of :meth:`gateway.store.Store.claim`, for many new effects at once.

    Returns each claim's new record, in their order, or None where its key was taken already:
    :func:`holder_of_key` reads that one. No two claims may share a key (:func:`claim_batch_key`).
    ``witness``: an effect this worker claimed before (gateway.lost_writes); nothing is claimed when
    the database no longer holds it, nor while the lost-writes alarm is raised.
    """
    columns = _as_columns(_claim_row(new, lease) for new, lease in claims)
    effect_id, tenant, upstream, scope = witness or (None, None, None, None)
    # One round trip for all of them. A key taken already is read by statements of their own, which
    # find its partitions first: a read joined into this statement would lock every partition of the
    # audit on each claim (see partitions.within). They also run after this statement, so they see
    # the row of another request with the same key that committed while this one waited for it.
    rows = await conn.fetch(
        f"""
        with c as ({_CLAIMS}), k as (
            -- In the key's order in every worker: two batches that share keys then wait for each
            -- other in one order, where in the order their requests came they could deadlock.
            insert into effect_keys (scope, tenant, upstream, effect_id, created_at)
            select scope, tenant, upstream, nextval('effect_ids'), now() from c
            -- Nothing new while the database is known to have lost writes (gateway.lost_writes): a
            -- worker that has not heard yet claims nothing, and finds the alarm when it asks why.
            -- Nor once it has forgotten the witness, this worker's newest claim: checked here, in
            -- every claim, and not only on new connections, which a pooler keeps across a failover.
            where not exists (select from effect_gateway_alarms)
              and ($19::bigint is null or exists (
                  select from effect_keys w
                  where w.scope = $22 and w.tenant = $20 and w.upstream = $21 and w.effect_id = $19))
            order by scope, tenant, upstream
            on conflict do nothing
            returning scope, tenant, upstream, effect_id, created_at
        ), n as (
            select * from k join c using (scope, tenant, upstream)
        ), e as (
            insert into effects (id, created_at, scope, tenant, upstream, key, derived_key, method, path,
                query, fingerprint, state, lease_expires_at, first_sent_at, last_sent_at, run_id,
                step, keyless, key_carriers, send_lease, tool)
            select effect_id, created_at, scope, tenant, upstream, key, derived_key, method, path, query,
                fingerprint, 'pending', now() + lease, now(), now(), run_id, step, keyless,
                key_carriers, lease, tool
            from n
            returning *
        ), b as (
            insert into effect_bodies (effect_id, scope, stored_at, kind, headers, coding, content)
            select effect_id, scope, created_at, 'request', headers, coding, content from n
        ), o as (
            insert into open_effects (state, id, scope, created_at, tenant, upstream)
            select 'pending', effect_id, scope, created_at, tenant, upstream from n
        )
        select {RECORD_COLUMNS}, null::bytea as r_headers, null::bytea as r_content, null as r_coding
        from e
        """,
        *columns,
        effect_id,
        tenant,
        upstream,
        scope,
    )
    made = {(r["tenant"], r["upstream"], r["key"]): record_of(r, response=True) for r in rows}
    return [made.get(claim_batch_key(claim)) for claim in claims]


def _claim_row(new: NewEffect, lease: timedelta) -> tuple[Any, ...]:
    """One claim's values, in the order of _CLAIMS's arrays."""
    request_coding, request_body = packing.pack(new.request_body)
    return (
        new.tenant,
        new.upstream,
        new.key,
        new.derived_key,
        new.method,
        new.path,
        new.query,
        new.fingerprint,
        head_bytes(new.request_headers),
        request_body,
        lease,
        new.run_id,
        new.step,
        new.keyless,
        request_coding,
        new.key_carriers.as_json(),
        key_digest(new.key),
        new.tool,
    )


def _as_columns(rows: Iterable[tuple[Any, ...]]) -> list[list[Any]]:
    """Rows of values as one list per column: the arrays a statement unnests into those rows again."""
    return [list(column) for column in zip(*rows, strict=True)]


def claim_size(claim: tuple[NewEffect, timedelta]) -> int:
    """The bytes a claim carries to Postgres: its request's body and headers."""
    new, _ = claim
    return len(new.request_body) + sum(len(name) + len(value) for name, value in new.request_headers.items())


def claim_batch_key(claim: tuple[NewEffect, timedelta]) -> tuple[str, str, str]:
    """What two claims of one statement may not share: the key, within its tenant and upstream."""
    new, _ = claim
    return new.tenant, new.upstream, new.key


async def holder_of_key(conn: Conn, new: NewEffect) -> EffectRecord | None:
    """The record that holds ``new``'s key, which a claim found taken; None when its month of the
    audit was archived (detached)."""
    known = await conn.fetchrow(
        """
        select effect_id, created_at, scope from effect_keys
        where scope = $3::uuid and tenant = $1 and upstream = $2
        """,
        new.tenant,
        new.upstream,
        key_digest(new.key),
    )
    if known is None:
        # The insert found the key taken, and keys are never deleted.
        raise StoreRejected(f"the key {new.key!r} was taken but is not on record")
    row = await conn.fetchrow(
        f"select {RECORD_COLUMNS} from effects e where e.id = $1 and e.created_at = $2 and e.scope = $3 "
        f"and {partitions.in_month(known['created_at'])}",
        known["effect_id"],
        known["created_at"],
        known["scope"],
    )
    if row is None:
        return None
    if row["key"] != new.key:
        # Two keys with one digest: never by chance (see migration 005), so refuse rather than
        # answer for another effect.
        raise StoreRejected(f"the key {new.key!r} shares its digest with the key {row['key']!r}")
    return await read_with_response(conn, row)


async def reclaim(
    conn: Conn,
    record: EffectRecord,
    move: Transition,
    lease: timedelta,
    reason: str,
    *,
    sends: bool,
    renew: bool = False,
    carriers: KeyCarriers | None = None,
) -> EffectRecord | None:
    """The statement of :meth:`gateway.store.Store.reclaim`."""
    return await _one(
        conn,
        f"""
        with e as (
            update effects e set
                attempt = attempt + 1,
                state = 'pending',
                -- a pending record whose lease ran out may have been sent by the gateway that held it
                may_have_sent = may_have_sent or (state = 'pending' and not $8),
                lease_expires_at = now() + $5::interval,
                last_sent_at = case when $6 then now() else last_sent_at end,
                first_sent_at = coalesce(first_sent_at, now()),
                -- what the attempt that sends is given, and what carries the key in every attempt that
                -- may have acted; a take-over that only probes sends nothing, and changes neither
                send_lease = case when $6 then $5::interval else send_lease end,
                key_carriers = case when $6 then $9::jsonb else key_carriers end,
                history = history || {_stamped(7)}
            {_fenced(record, 10)}
            returning {RECORD_COLUMNS}
        ), {_open_moved("$4", "'pending'")}
        select * from e
        """,
        record.id,
        record.created_at,
        record.attempt,
        move.fenced_on(record.state).value,
        lease,
        sends,
        _event("reclaimed", attempt=record.attempt + 1, reason=reason, was=record.state.value),
        renew,
        carriers.as_json() if carriers is not None else None,
        record.scope,
    )


@dataclass(frozen=True, slots=True)
class Settling:
    """One settle's arguments (see :meth:`gateway.store.Store.settle`)."""

    record: EffectRecord
    settlement: Settlement
    response: StoredResponse | None
    recovered_by: str | None
    note: str | None = None
    # The response's digest for the audit's chain (gateway.chain.response_digest), when it completes
    # the effect: made by the store before the statement, off the event loop for a large body.
    digest: str | None = None


async def settle_many(conn: Conn, settles: Sequence[Settling]) -> list[EffectRecord | None]:
    """What :meth:`gateway.store.Store.settle` writes, for many records at once, in one transaction.

    A statement for each month of the audit the records were created in (nearly always one: each
    statement names its month's partition, see partitions.within). Returns each record as settled, in
    their order, or None where a newer attempt fenced it out. The records must be distinct
    (:func:`settle_batch_key`): two updates of one row in one statement would meet.
    """
    months: dict[str, list[int]] = {}
    for i, one in enumerate(settles):
        months.setdefault(partitions.in_month(one.record.created_at), []).append(i)
    settled: dict[int, EffectRecord] = {}
    if len(months) == 1:
        [(month, _)] = months.items()
        settled = await _settle_in(conn, month, list(settles))
    else:
        # One transaction for all of them: a statement tried again, or refused, must find every row
        # as it was, and not the rows of an earlier month already settled (and so fenced out).
        async with conn.transaction():
            for month, indexes in months.items():
                settled.update(await _settle_in(conn, month, [settles[i] for i in indexes]))
    return [settled.get(one.record.id) for one in settles]


def _settle_row(one: Settling) -> tuple[Any, ...]:
    """One settle's values, in the order of the arrays _settle_in unnests."""
    record, settlement, response = one.record, one.settlement, one.response
    coding, body = packing.pack(response.body) if response else (None, None)
    return (
        record.id,
        record.created_at,
        record.attempt,
        settlement.transition.fenced_on(record.state).value,
        settlement.state.value,
        settlement.may_have_sent,
        settlement.ends_lease,
        response.status if response else None,
        head_bytes(response.headers) if response else None,
        body,
        one.recovered_by,
        # An entry, not an array of one: asyncpg would take a list of lists for a 2-D array.
        _event(
            "settled",
            attempt=record.attempt,
            state=settlement.state.value,
            status=response.status if response else None,
            recovered_by=one.recovered_by,
            note=one.note,
        )[0],
        coding,
        record.scope,
        one.digest,
    )


def settle_size(one: Settling) -> int:
    """The bytes a settle carries to Postgres: the answer's body and headers, if any."""
    response = one.response
    if response is None:
        return 0
    return len(response.body) + sum(len(name) + len(value) for name, value in response.headers)


def settle_batch_key(one: Settling) -> int:
    """What two settles of one statement may not share: the record."""
    return one.record.id


async def _settle_in(conn: Conn, month: str, settles: list[Settling]) -> dict[int, EffectRecord]:
    columns = _as_columns(_settle_row(one) for one in settles)
    rows = await conn.fetch(
        f"""
        with s as (
            select * from unnest($1::bigint[], $2::timestamptz[], $3::integer[], $4::text[], $5::text[],
                                 $6::boolean[], $7::boolean[], $8::integer[], $9::bytea[], $10::bytea[],
                                 $11::text[], $12::jsonb[], $13::text[], $14::uuid[], $15::text[])
                as s(id, created_at, attempt, source, target, may_have_sent, ends_lease, status, headers,
                     content, recovered_by, event, coding, scope, digest)
        ), e as (
            update effects e set
                state = s.target,
                may_have_sent = s.may_have_sent,
                lease_expires_at = case when s.ends_lease then least(e.lease_expires_at, now())
                                        else e.lease_expires_at end,
                response_status = coalesce(s.status, e.response_status),
                response_at = case when s.headers is null then e.response_at else now() end,
                recovered_by = coalesce(s.recovered_by, e.recovered_by),
                completed_at = case when s.target = 'completed' then now() else e.completed_at end,
                history = e.history || jsonb_build_array(s.event || jsonb_build_object('at', now()))
            from s
            -- "any" lets the plan look each row up by its key: joined to s alone, a generic plan may
            -- hash the whole month's partition instead (it cannot know how many rows s holds). Not
            -- the creation times: with them the audit's index by time served as well, and it leaves
            -- the scope out of the lookup (the month's bounds below bound the times anyway).
            where e.id = any($1::bigint[]) and e.scope = any($14::uuid[])
              and e.id = s.id and e.created_at = s.created_at and e.scope = s.scope
              and e.attempt = s.attempt and e.state = s.source and {month}
            returning {RECORD_COLUMNS}, s.source
        ), stored as (
            insert into effect_bodies (effect_id, scope, stored_at, kind, headers, coding, content)
            select s.id, s.scope, now(), 'response', s.headers, s.coding, s.content
            from e join s on s.id = e.id
            where s.headers is not null
        ), {
            _settled_into_chain(
                "e join s on s.id = e.id",
                "e.source <> 'completed' and e.state = 'completed'",
                "'completed'",
                "s.digest",
                "null",
            )
        },
        {_open_moved("e.source", "e.state")}
        select * from e
        """,
        *columns,
    )
    return {row["id"]: record_of(row) for row in rows}


async def note_fenced(conn: Conn, record: EffectRecord, saw: str) -> None:
    """The statement of :meth:`gateway.store.Store.note_fenced`."""
    await conn.execute(
        f"update effects e set history = history || {_stamped(3)} "
        f"where id = $1 and created_at = $2 and scope = $4 and {partitions.in_month(record.created_at)}",
        record.id,
        record.created_at,
        _event("fenced", attempt=record.attempt, saw=saw),
        record.scope,
    )


async def send_to_review(conn: Conn, record: EffectRecord, move: Transition, why: str) -> EffectRecord | None:
    """The statement of :meth:`gateway.store.Store.send_to_review`."""
    return await _one(
        conn,
        f"""
        -- No new attempt: the operator judges the latest one, under the number every view shows.
        -- Its holder, should it wake up now, is fenced out all the same (each of its writes is
        -- fenced on pending), and what it saw goes to the history instead of over their head.
        with e as (
            update effects e set state = 'needs_review',
                lease_expires_at = least(lease_expires_at, now()),
                history = history || {_stamped(5)}
            {_fenced(record, 6)}
            returning {RECORD_COLUMNS}
        ), {_open_moved("$4", "'needs_review'")}
        select * from e
        """,
        record.id,
        record.created_at,
        record.attempt,
        move.fenced_on(record.state).value,
        _event("needs_review", attempt=record.attempt, why=why),
        record.scope,
    )


async def add_replays(conn: Conn, counts: Mapping[RowKey, int]) -> None:
    """The statement of :meth:`gateway.store.Store.add_replays` (which sends no empty ``counts``)."""
    # In one order in every worker: the update looks each count's row up in the order given (its plan
    # on an audit of any size; a few rows may be hashed in the order they lie, which is one order too),
    # so two flushes that share effects lock them alike and one waits for the other, where in the
    # order each first counted them they could deadlock. Should a plan still cross them, Postgres
    # breaks the deadlock and the store tries again.
    ids, times, scopes, ns = zip(*((*row, n) for row, n in sorted(counts.items())), strict=True)
    await conn.execute(
        """
        update effects e set replays = replays + c.n
        from unnest($1::bigint[], $2::timestamptz[], $3::uuid[], $4::int[]) as c(id, created_at, scope, n)
        where e.id = c.id and e.created_at = c.created_at and e.scope = c.scope
        """,
        list(ids),
        list(times),
        list(scopes),
        list(ns),
    )


async def restore(
    conn: Conn, record: EffectRecord, move: Transition, response: StoredResponse
) -> tuple[EffectRecord, bool]:
    """The statement of :meth:`gateway.store.Store.restore`."""
    coding, body = packing.pack(response.body)
    row = await conn.fetchrow(
        f"""
        with e as (
            update effects e set response_status = $5, response_at = now(),
                history = history || {_stamped(8)}
            {_fenced(record, 11)}
              -- Fenced on the response as read, which a restore changes: one that waited for another's
              -- row lock then finds the row changed and writes nothing. The subquery below cannot see
              -- that: it reads the bodies as they were when this statement began (READ COMMITTED).
              and response_at is not distinct from $10
              and not exists (select from effect_bodies r where r.effect_id = e.id and r.kind = 'response'
                              and r.stored_at = e.response_at and r.scope = e.scope)
            returning {RECORD_COLUMNS}
        ), stored as (
            insert into effect_bodies (effect_id, scope, stored_at, kind, headers, coding, content)
            select id, scope, now(), 'response', $6, $9, $7 from e
        )
        select * from e
        """,
        record.id,
        record.created_at,
        record.attempt,
        move.fenced_on(record.state).value,
        response.status,
        head_bytes(response.headers),
        body,
        _event("restored", status=response.status, note="the probe found the effect"),
        coding,
        record.response_at,
        record.scope,
    )
    if row is not None:
        return replace(record_of(row), response=response, response_read=True), True
    # Another request restored it first (or it was never purged): the answer on record is the one.
    return await reread(conn, record), False


async def resolve(
    conn: Conn,
    record: EffectRecord,
    move: Transition,
    response: StoredResponse | None,
    by: str | None,
    digest: str | None,
) -> EffectRecord | None:
    """The statement of :meth:`gateway.store.Store.resolve` (``digest``: the response's, for the chain)."""
    happened = move.target is State.COMPLETED
    coding, body = packing.pack(response.body) if response else (packing.AS_SENT, b"")
    return await _one(
        conn,
        f"""
        with e as (
            update effects e set
                state = $5,
                -- "did not happen" is the operator's word that no attempt reached the upstream
                may_have_sent = $6,
                lease_expires_at = least(lease_expires_at, now()),
                response_status = $7,
                response_at = case when $6 then now() end,
                recovered_by = 'operator',
                completed_at = case when $6 then now() end,
                history = history || {_stamped(10)}
            {_fenced(record, 12)}
              and (lease_expires_at is null or lease_expires_at <= now())
            returning {RECORD_COLUMNS}
        ), stored as (
            insert into effect_bodies (effect_id, scope, stored_at, kind, headers, coding, content)
            select id, scope, now(), 'response', $8, $11, $9 from e where $6
        ), {
            _settled_into_chain(
                "e", "true", "case when $6 then 'completed' else 'not_happened' end", "$13", "$14"
            )
        },
        {_open_moved("$4", "$5")}
        select * from e
        """,
        record.id,
        record.created_at,
        record.attempt,
        move.fenced_on(record.state).value,
        move.target.value,
        happened,
        response.status if response else None,
        head_bytes(response.headers) if response else b"",
        body,
        _event("resolved", attempt=record.attempt, happened=happened, by=by, was=record.state.value),
        coding,
        record.scope,
        digest,
        by,
    )
