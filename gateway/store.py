"""The one Postgres seam: claim, re-claim, settle, read. asyncpg errors become StoreUnavailable here.

Every phase is one statement (so one transaction) and every write that follows a claim is fenced by
the attempt number: ``where id = $1 and attempt = $2``. Times that decide anything come from
Postgres's clock so that several gateways agree.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from importlib import resources
from typing import Any, TypeAlias, TypeVar

import asyncpg
import asyncpg.pool

from gateway.decision import Settlement
from gateway.errors import StoreRejected, StoreUnavailable
from gateway.record import EffectRecord, StoredResponse
from gateway.states import State, Transition

T = TypeVar("T")
Conn: TypeAlias = "asyncpg.pool.PoolConnectionProxy[asyncpg.Record]"

# Any constant will do, as long as no other application on the database uses it for another lock.
MIGRATION_LOCK = 0x65666665637473  # "effects"

_COLUMNS = """
    id, tenant, upstream, key, derived_key, method, path, query, fingerprint, request_headers,
    request_body, state, attempt, may_have_sent, lease_expires_at, response_status, response_headers,
    response_body, recovered_by, run_id, step, created_at, first_sent_at, last_sent_at, completed_at,
    replays, purged_at, history, keyless, clock_timestamp() as read_at
"""


@dataclass(frozen=True, slots=True)
class NewEffect:
    tenant: str
    upstream: str
    key: str
    derived_key: str
    method: str
    path: str
    query: str
    fingerprint: str
    request_headers: dict[str, str]
    request_body: bytes
    run_id: str | None
    step: str | None
    # Sent without a key under the upstream's "audit" policy: the key is made up and never looked up.
    keyless: bool = False


@dataclass(frozen=True, slots=True)
class EffectFilter:
    tenant: str | None = None
    state: State | None = None
    upstream: str | None = None
    run_id: str | None = None
    since: datetime | None = None
    before_id: int | None = None
    limit: int = 50


def _event(kind: str, **data: Any) -> list[dict[str, Any]]:
    """One entry of a row's history, as an array to append; the SQL stamps it with the database's time."""
    return [{"event": kind, **{k: v for k, v in data.items() if v is not None}}]


def _source(record: EffectRecord, move: Transition) -> str:
    """The state a write fences on: the one the record was read in, which the move must start from."""
    if move.source is not record.state:
        raise ValueError(f"a move from {move.source} was asked of a record in {record.state}")
    return record.state.value


def head_bytes(headers: tuple[tuple[str, str], ...]) -> bytes:
    """Response headers as stored: "Name: value" lines joined by CRLF, the upstream's bytes kept.

    Names and values arrive decoded 'utf-8'/'surrogateescape' (how aiohttp reads them), which this
    turns back into the exact bytes; no header may contain CR or LF, so the block splits unambiguously.
    """
    return b"\r\n".join(
        name.encode("utf-8", "surrogateescape") + b": " + value.encode("utf-8", "surrogateescape")
        for name, value in headers
    )


def head_pairs(block: bytes) -> tuple[tuple[str, str], ...]:
    """The inverse of :func:`head_bytes`."""
    pairs = []
    for line in block.split(b"\r\n") if block else ():
        name, _, value = line.partition(b": ")
        pairs.append((name.decode("utf-8", "surrogateescape"), value.decode("utf-8", "surrogateescape")))
    return tuple(pairs)


def _stamped(param: int) -> str:
    """SQL for history entry ``$param`` with the database's time added (``at``)."""
    return f"jsonb_set(${param}::jsonb, '{{0,at}}', to_jsonb(now()))"


async def _init_connection(conn: asyncpg.Connection) -> None:
    await conn.set_type_codec("jsonb", encoder=json.dumps, decoder=json.loads, schema="pg_catalog")


async def _keep_session(conn: asyncpg.Connection) -> None:
    """Skip asyncpg's reset query on release: it is a round trip per phase (a third of a replay's time).

    Safe because the gateway's pooled connections never LISTEN, take advisory locks, open cursors or SET
    session variables; asyncpg still rolls back a transaction left open before calling this.
    """


# The server went away under a statement: lost connection, or shut down or restarted by an operator (57P).
_OUTAGE = (
    OSError,
    asyncpg.PostgresConnectionError,
    asyncpg.ConnectionDoesNotExistError,
    asyncpg.exceptions.OperatorInterventionError,
    # what asyncpg raises when the server cuts a session in the middle of a message exchange
    asyncpg.exceptions.InternalClientError,
)
_RETRYABLE_SQLSTATES = (asyncpg.exceptions.SerializationError, asyncpg.exceptions.DeadlockDetectedError)


class Store:
    """The effects table. One Postgres implementation; tests run it against a real server."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    @classmethod
    async def connect(cls, dsn: str, *, min_size: int = 2, max_size: int = 20) -> Store:
        try:
            pool = await asyncpg.create_pool(
                dsn, min_size=min_size, max_size=max_size, init=_init_connection, reset=_keep_session
            )
        except (OSError, asyncpg.PostgresError) as exc:
            raise StoreUnavailable(f"cannot connect to Postgres: {exc}") from exc
        return cls(pool)

    async def close(self) -> None:
        await self._pool.close()

    async def _run(self, op: Callable[[Conn], Awaitable[T]]) -> T:
        """Run one phase; retry only what Postgres says is retryable, map the rest to our own error."""
        for attempt in range(3):
            try:
                conn = await self._pool.acquire()
            except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
                # Whatever stops a new connection (server gone, refusing, out of slots) is an outage.
                raise StoreUnavailable(f"Postgres is unavailable: {exc}") from exc
            try:
                return await op(conn)
            except _RETRYABLE_SQLSTATES:
                if attempt == 2:
                    raise
            except _OUTAGE as exc:
                raise StoreUnavailable(f"Postgres is unavailable: {exc}") from exc
            except asyncpg.PostgresError as exc:
                # Postgres is there but refused this statement (data it cannot hold, a check that
                # failed): retrying the same statement cannot help.
                raise StoreRejected(f"Postgres refused the write: {type(exc).__name__}: {exc}") from exc
            finally:
                await self._pool.release(conn)
        raise AssertionError("unreachable")  # pragma: no cover

    async def _one(self, sql: str, *args: Any) -> EffectRecord | None:
        """One statement that returns at most one effect row (None: no row matched, e.g. fenced out)."""

        async def op(conn: Conn) -> EffectRecord | None:
            row = await conn.fetchrow(sql, *args)
            return _record(row) if row is not None else None

        return await self._run(op)

    async def _execute(self, sql: str, *args: Any) -> str:
        async def op(conn: Conn) -> str:
            status: str = await conn.execute(sql, *args)
            return status

        return await self._run(op)

    # --- the idempotency phases -------------------------------------------------------------------

    async def claim(self, new: NewEffect, lease: timedelta) -> tuple[EffectRecord, bool]:
        """Insert a pending record holding attempt 1, or read the one that holds the key.

        Returns the record and whether this call created it. The insert is committed before it returns:
        the claim is durable before the request leaves.
        """

        async def op(conn: Conn) -> tuple[EffectRecord, bool]:
            # One round trip in the common cases: a new key inserts, a known key is read by the same
            # statement. The read shares the statement's snapshot, so a twin that committed its row
            # after that snapshot is not seen; then, and only then, a second read follows.
            row = await conn.fetchrow(
                f"""
                with claimed as (
                    insert into effects (tenant, upstream, key, derived_key, method, path, query,
                        fingerprint, request_headers, request_body, state, lease_expires_at, first_sent_at,
                        last_sent_at, run_id, step, keyless, history)
                    values ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, 'pending', now() + $11::interval,
                        now(), now(), $12, $13, $14, {_stamped(15)})
                    on conflict (tenant, upstream, key) do nothing
                    returning {_COLUMNS}, true as created
                )
                select * from claimed
                union all
                select {_COLUMNS}, false as created from effects
                where tenant = $1 and upstream = $2 and key = $3 and not exists (select from claimed)
                """,
                new.tenant,
                new.upstream,
                new.key,
                new.derived_key,
                new.method,
                new.path,
                new.query,
                new.fingerprint,
                new.request_headers,
                new.request_body,
                lease,
                new.run_id,
                new.step,
                new.keyless,
                _event("claimed", attempt=1),
            )
            if row is not None:
                return _record(row), row["created"]
            existing = await conn.fetchrow(
                f"select {_COLUMNS} from effects where tenant = $1 and upstream = $2 and key = $3",
                new.tenant,
                new.upstream,
                new.key,
            )
            assert existing is not None, "a conflicting row cannot disappear: effects are never deleted"
            return _record(existing), False

        return await self._run(op)

    async def reclaim(
        self, record: EffectRecord, move: Transition, lease: timedelta, reason: str, *, sends: bool
    ) -> EffectRecord | None:
        """Take the record over for a new attempt, if nobody has since ``record`` was read.

        ``sends`` is false for a take-over that only probes: the audit's send times stay as they were.
        """
        return await self._one(
            f"""
            update effects set
                attempt = attempt + 1,
                state = 'pending',
                -- a pending record whose lease ran out may have been sent by the gateway that held it
                may_have_sent = may_have_sent or state = 'pending',
                lease_expires_at = now() + $4::interval,
                last_sent_at = case when $5 then now() else last_sent_at end,
                first_sent_at = coalesce(first_sent_at, now()),
                history = history || {_stamped(6)}
            where id = $1 and attempt = $2 and state = $3
            returning {_COLUMNS}
            """,
            record.id,
            record.attempt,
            _source(record, move),
            lease,
            sends,
            _event("reclaimed", attempt=record.attempt + 1, reason=reason, was=record.state.value),
        )

    async def settle(
        self,
        record: EffectRecord,
        settlement: Settlement,
        *,
        response: StoredResponse | None,
        recovered_by: str | None,
        note: str | None = None,
    ) -> EffectRecord | None:
        """Write what the current attempt saw; None when a newer attempt fenced this one out."""
        completed = settlement.state is State.COMPLETED
        return await self._one(
            f"""
            update effects set
                state = $4,
                may_have_sent = $5,
                lease_expires_at = case when $6 then least(lease_expires_at, now())
                                        else lease_expires_at end,
                response_status = coalesce($7, response_status),
                response_headers = coalesce($8, response_headers),
                response_body = coalesce($9, response_body),
                recovered_by = coalesce($10, recovered_by),
                completed_at = case when $11 then now() else completed_at end,
                history = history || {_stamped(12)}
            where id = $1 and attempt = $2 and state = $3
            returning {_COLUMNS}
            """,
            record.id,
            record.attempt,
            _source(record, settlement.transition),
            settlement.state.value,
            settlement.may_have_sent,
            settlement.ends_lease,
            response.status if response else None,
            head_bytes(response.headers) if response else None,
            response.body if response else None,
            recovered_by,
            completed,
            _event(
                "settled",
                attempt=record.attempt,
                state=settlement.state.value,
                status=response.status if response else None,
                recovered_by=recovered_by,
                note=note,
            ),
        )

    async def note_fenced(self, record: EffectRecord, saw: str) -> None:
        """A fenced-out holder adds what it saw to the history, and changes nothing else."""

        await self._execute(
            f"update effects set history = history || {_stamped(2)} where id = $1",
            record.id,
            _event("fenced", attempt=record.attempt, saw=saw),
        )

    async def send_to_review(self, record: EffectRecord, move: Transition, why: str) -> EffectRecord | None:
        """Give up on recovery; fenced so that a record someone just re-claimed is left alone."""

        return await self._one(
            f"""
            -- A new attempt number: a stalled holder that wakes up now is fenced out, and what it
            -- saw goes to the history for the operator instead of over their head.
            update effects set state = 'needs_review', attempt = attempt + 1,
                lease_expires_at = least(lease_expires_at, now()),
                history = history || {_stamped(4)}
            where id = $1 and attempt = $2 and state = $3
            returning {_COLUMNS}
            """,
            record.id,
            record.attempt,
            _source(record, move),
            _event("needs_review", attempt=record.attempt, why=why),
        )

    async def count_replay(self, record: EffectRecord) -> None:
        await self._execute("update effects set replays = replays + 1 where id = $1", record.id)

    async def restore(self, record: EffectRecord, move: Transition, response: StoredResponse) -> None:
        """Put back the response of a completed effect whose response was purged (a probe found it)."""
        await self._execute(
            f"""
            update effects set response_status = $4, response_headers = $5, response_body = $6,
                purged_at = null, history = history || {_stamped(7)}
            where id = $1 and attempt = $2 and state = $3 and response_body is null
            """,
            record.id,
            record.attempt,
            _source(record, move),
            response.status,
            head_bytes(response.headers),
            response.body,
            _event("restored", status=response.status, note="the probe found the effect"),
        )

    async def resolve(
        self, record: EffectRecord, move: Transition, response: StoredResponse | None, by: str | None
    ) -> EffectRecord | None:
        """An operator's verdict: completed with a response to replay, or retryable (it did not happen).

        Fenced on the state and attempt the operator saw, and refused while a lease still runs.
        """
        happened = move.target is State.COMPLETED
        return await self._one(
            f"""
            update effects set
                state = $4,
                -- "did not happen" is the operator's word that no attempt reached the upstream
                may_have_sent = $5,
                lease_expires_at = least(lease_expires_at, now()),
                response_status = $6, response_headers = $7, response_body = $8,
                recovered_by = 'operator',
                attempt = attempt + 1,
                completed_at = case when $5 then now() else null end,
                history = history || {_stamped(9)}
            where id = $1 and attempt = $2 and state = $3
              and (lease_expires_at is null or lease_expires_at <= now())
            returning {_COLUMNS}
            """,
            record.id,
            record.attempt,
            _source(record, move),
            move.target.value,
            happened,
            response.status if response else None,
            head_bytes(response.headers) if response else None,
            response.body if response else None,
            _event("resolved", happened=happened, by=by, was=record.state.value),
        )

    async def key_secret(self) -> bytes:
        """The secret of the keyed MAC for derived keys, made once by the migrations."""

        async def op(conn: Conn) -> bytes:
            value = await conn.fetchval(
                "select value from effect_gateway_secrets where name = 'derived_keys'"
            )
            assert value is not None, "migration 002 makes the secret"
            return bytes(value)

        return await self._run(op)

    # --- reading ----------------------------------------------------------------------------------

    async def get(self, effect_id: int, tenant: str | None = None) -> EffectRecord | None:
        return await self._one(
            f"select {_COLUMNS} from effects where id = $1 and ($2::text is null or tenant = $2)",
            effect_id,
            tenant,
        )

    async def reread(self, record: EffectRecord) -> EffectRecord:
        fresh = await self.get(record.id)
        assert fresh is not None, "effects are never deleted"
        return fresh

    async def find(self, where: EffectFilter) -> list[EffectRecord]:
        async def op(conn: Conn) -> list[EffectRecord]:
            rows = await conn.fetch(
                f"""
                select {_COLUMNS} from effects
                where ($1::text is null or tenant = $1)
                  and ($2::text is null or state = $2)
                  and ($3::text is null or upstream = $3)
                  and ($4::text is null or run_id = $4)
                  and ($5::timestamptz is null or created_at >= $5)
                  and ($6::bigint is null or id < $6)
                order by id desc
                limit $7
                """,
                where.tenant,
                where.state.value if where.state else None,
                where.upstream,
                where.run_id,
                where.since,
                where.before_id,
                where.limit,
            )
            return [_record(row) for row in rows]

        return await self._run(op)

    async def state_counts(self, tenant: str | None = None) -> dict[str, int]:
        async def op(conn: Conn) -> dict[str, int]:
            rows = await conn.fetch(
                "select state, count(*) as n from effects where ($1::text is null or tenant = $1)"
                " group by state",
                tenant,
            )
            counts = {state.value: 0 for state in State}
            counts.update({row["state"]: row["n"] for row in rows})
            return counts

        return await self._run(op)

    async def purge(self, retention: timedelta) -> int:
        """Drop the bodies of completed effects older than the retention; the audit row stays."""

        status = await self._execute(
            f"""
            update effects set request_body = null, response_headers = null, response_body = null,
                purged_at = now(), history = history || {_stamped(2)}
            where state = 'completed' and purged_at is null and completed_at < now() - $1::interval
            """,
            retention,
            _event("purged"),
        )
        return int(status.split()[-1])


def _record(row: asyncpg.Record) -> EffectRecord:
    response = None
    if row["response_status"] is not None and row["response_body"] is not None:
        response = StoredResponse(
            status=row["response_status"],
            headers=head_pairs(bytes(row["response_headers"] or b"")),
            body=bytes(row["response_body"]),
        )
    return EffectRecord(
        id=row["id"],
        tenant=row["tenant"],
        upstream=row["upstream"],
        key=row["key"],
        derived_key=row["derived_key"],
        method=row["method"],
        path=row["path"],
        query=row["query"],
        fingerprint=row["fingerprint"],
        state=State(row["state"]),
        attempt=row["attempt"],
        may_have_sent=row["may_have_sent"],
        lease_expires_at=row["lease_expires_at"],
        first_sent_at=row["first_sent_at"],
        last_sent_at=row["last_sent_at"],
        completed_at=row["completed_at"],
        created_at=row["created_at"],
        response=response,
        purged_at=row["purged_at"],
        recovered_by=row["recovered_by"],
        replays=row["replays"],
        run_id=row["run_id"],
        step=row["step"],
        request_headers=row["request_headers"],
        request_body=bytes(row["request_body"]) if row["request_body"] is not None else None,
        history=row["history"],
        read_at=row["read_at"],
        keyless=row["keyless"],
    )


# --- migrations ---------------------------------------------------------------------------------------


def migration_files() -> list[tuple[int, str, str]]:
    """(version, name, sql) for every file in gateway/migrations, in order."""
    found = []
    for entry in (resources.files("gateway") / "migrations").iterdir():
        if entry.name.endswith(".sql"):
            version = int(entry.name.split("_", 1)[0])
            found.append((version, entry.name, entry.read_text()))
    return sorted(found)


async def migrate(dsn: str) -> list[str]:
    """Apply pending migrations under an advisory lock (replicas may start at once); returns the applied."""
    try:
        conn = await asyncpg.connect(dsn)
    except (OSError, asyncpg.PostgresError) as exc:
        raise StoreUnavailable(f"cannot connect to Postgres: {exc}") from exc
    applied: list[str] = []
    try:
        await conn.execute("select pg_advisory_lock($1)", MIGRATION_LOCK)
        try:
            await conn.execute(
                """create table if not exists effect_gateway_migrations (
                       version integer primary key, name text not null,
                       applied_at timestamptz not null default now())"""
            )
            done = {r["version"] for r in await conn.fetch("select version from effect_gateway_migrations")}
            for version, name, sql in migration_files():
                if version in done:
                    continue
                async with conn.transaction():
                    await conn.execute(sql)
                    await conn.execute(
                        "insert into effect_gateway_migrations (version, name) values ($1, $2)", version, name
                    )
                applied.append(name)
        finally:
            await conn.execute("select pg_advisory_unlock($1)", MIGRATION_LOCK)
    finally:
        await conn.close()
    return applied


@asynccontextmanager
async def opened(dsn: str) -> AsyncIterator[Store]:
    store = await Store.connect(dsn)
    try:
        yield store
    finally:
        await store.close()
