"""The one Postgres seam: claim, take over, settle, read. asyncpg errors become the gateway's own here.

Each write is one statement, so one transaction (the writes are in gateway/phases.py; the claim of a
key already taken reads it with statements of their own), run on a pooled connection and retried only
when Postgres says so; the reads are here. Claims, and apart from them settles, that arrive while one
of their kind is being written go together in the next statement (gateway/batches.py): one commit
for all of them, each fenced on its own row. Times that decide anything come from Postgres's clock so
that several gateways agree.

The tables (gateway/migrations/003_partitioned.sql and after): ``effect_keys`` keeps each key unique for
ever (by a digest of the key, 005), ``effects`` is the audit (a row per effect, partitioned by month),
``open_effects`` lists the effects not completed (004), ``effect_bodies`` holds headers and bodies
(partitioned by day, dropped by the retention). A statement returns only what its caller uses: the
claim of a new key no bodies and no history, a take-over or settle only what the next step needs.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Self, TypeVar

import asyncpg
import asyncpg.pool

from gateway import chain, chaining, locks, notification_rows, partitions, phases, pooling, roles
from gateway.audit_query import (
    EXACT_OPEN_COUNT,
    OPEN_STATES,
    EffectFilter,
    by_time,
    count_statement,
    find_statement,
)
from gateway.batches import Batches
from gateway.chain import Round, Signer
from gateway.decision import Settlement
from gateway.errors import ConfigError, CursorUnknown, PrivilegesMissing, StoreRejected, StoreUnavailable
from gateway.inbound import OFF_LOOP_BYTES
from gateway.lost_writes import LostWrites, failover_warning
from gateway.pg_failures import FAILURES, connecting, kind
from gateway.record import EffectRecord, KeyCarriers, NewEffect, RowKey, StoredResponse
from gateway.rows import (
    HISTORY,
    RESPONSE,
    WITH_RESPONSE,
    Conn,
    record_of,
    reread,
    with_request,
)
from gateway.states import State, Transition
from gateway.telemetry import Telemetry

if TYPE_CHECKING:
    from gateway.settings import Settings

log = logging.getLogger("effect_gateway")
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class StoreLimits:
    """How long the gateway waits on Postgres before answering 503 instead of stalling."""

    # A free connection from the pool: all of them busy this long means Postgres is not keeping up.
    acquire: timedelta = timedelta(seconds=5)
    # One statement: the hot path's take well under 10 ms; seconds mean something is stuck.
    statement: timedelta = timedelta(seconds=10)
    # Waiting for a row lock: rows are locked for one statement at a time, never across a call.
    lock: timedelta = timedelta(seconds=2)

    @classmethod
    def of(cls, settings: Settings) -> StoreLimits:
        """The limits ``settings`` give."""
        return cls(
            acquire=settings.pool_timeout, statement=settings.statement_timeout, lock=settings.lock_timeout
        )

    @property
    def answer(self) -> float | None:
        """Seconds the gateway waits for Postgres to answer a statement, whatever the server does.

        statement_timeout is the server's own: a backend or a network that stops answering never fires
        it. This bound does, a second later, so that the server's timeout and its clearer message come
        first whenever the server can still give them. None when statement_timeout is 0 (no limit).
        """
        if not self.statement:
            return None
        return self.statement.total_seconds() + 1.0


# A database's own mark: when its first migration was applied, to the microsecond.
_IDENTITY = "select applied_at from effect_gateway_migrations where version = 1"


async def _same_database(pool: asyncpg.Pool, dsn: str) -> None:
    """Raise ConfigError unless the pooler leads to the database at ``dsn``: the workers would write
    their effects into one, and the migrations, the retention and the commands would see the other."""
    with connecting():
        direct = await asyncpg.connect(dsn)
    try:
        here = await direct.fetchval(_IDENTITY)
    finally:
        await direct.close()
    try:
        there = await pool.fetchval(_IDENTITY)
    except asyncpg.exceptions.UndefinedTableError:
        there = None
    if there != here:
        raise ConfigError(
            "database_url (the pooler) and database_direct_url lead to different databases: point the "
            "pooler at the database of database_direct_url"
        )


async def _init_connection(conn: asyncpg.Connection) -> None:
    await conn.set_type_codec("jsonb", encoder=json.dumps, decoder=json.loads, schema="pg_catalog")


async def _keep_session(conn: asyncpg.Connection) -> None:
    """Skip asyncpg's reset query on release: it is a round trip per phase (a third of a replay's time).

    Safe because the gateway's pooled connections never LISTEN, take session-level advisory locks (only
    a transaction's, gateway.locks), open cursors or SET session variables; asyncpg still rolls back a
    transaction left open before calling this.
    """


# Whether the effect a page read by time goes on from is one the viewer sees: asked only when the page
# is empty. One probe of the primary key in each partition of the audit.
_CURSOR = """
    select exists (select from effects c where c.id = $1 and ($2::text is null or c.tenant = $2))
"""
# The oldest effect of each state that waits for someone: the first of the state's range of open_effects'
# key (or of the tenant's index), since ids grow with time.
_OLDEST_WAITING = """
    select s.state, extract(epoch from now() - (
        select o.created_at from open_effects o where o.state = s.state order by o.id limit 1)) as age
    from unnest(array['in_doubt', 'needs_review']) as s(state)
"""
_OLDEST_WAITING_OF_TENANT = """
    select s.state, extract(epoch from now() - (
        select o.created_at from open_effects o where o.tenant = $1 and o.state = s.state
        order by o.id limit 1)) as age
    from unnest(array['in_doubt', 'needs_review']) as s(state)
"""
# Each month of the audit with Postgres's row estimate and its size: small ones are counted exactly,
# large ones estimated (partitions.row_count), so the counts never scan a large month. A month is
# counted through the audit with its bounds (pruned to that month when planned), not by its name:
# partitions do not take their parent's grants, and the gateway's role may read only the parent.
_PARTITION_SIZES = """
    select pg_get_expr(c.relpartbound, c.oid) as bound, c.reltuples::bigint as rows,
           pg_relation_size(c.oid) as bytes
    from pg_inherits i join pg_class c on c.oid = i.inhrelid
    where i.inhparent = 'effects'::regclass
"""
MAINTENANCE_LOCK = locks.MAINTENANCE
# How long a write that found no partition for its row waits for the table's lock to make one (seconds).
# Another gateway making them holds it for milliseconds, and the retention detaches a day only once the
# days ahead exist, so its long waits never meet a write that needs a partition; ten seconds is the
# statement bound's default, beyond which Postgres is not keeping up anyway.
PARTITIONS_WAIT = 10.0
# The first pause between tries while another session holds the table; it doubles up to a second.
PARTITIONS_PAUSE = 0.05


def session_settings(limits: StoreLimits) -> dict[str, str]:
    """The settings of every pooled connection's session (the plans its statements get depend on them)."""
    return {
        "statement_timeout": str(int(limits.statement.total_seconds() * 1000)),
        "lock_timeout": str(int(limits.lock.total_seconds() * 1000)),
        # The hot path's statements find their rows by key, so one plan per statement serves every
        # value. Left to choose, Postgres re-plans a statement on the partitioned tables at each
        # execution (a plan for the given values prunes partitions, so it looks cheaper): a third
        # of the CPU Postgres spent on a new effect went to planning its settle.
        "plan_cache_mode": "force_generic_plan",
    }


class Store:
    """The effect tables. One Postgres implementation; tests run it against a real server."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        limits: StoreLimits,
        dsn: str,
        lost_writes: LostWrites,
        telemetry: Telemetry | None = None,
    ) -> None:
        self._pool = pool
        self._limits = limits
        self._dsn = dsn
        self._telemetry = telemetry or Telemetry()
        self._retention_left = False  # said once: this role leaves the retention to the tables' owner
        self._claims = Batches(self._claim_many, distinct=phases.claim_batch_key, size=phases.claim_size)
        self.lost_writes = lost_writes
        self._settles = Batches(self._settle_many, distinct=phases.settle_batch_key, size=phases.settle_size)

    @classmethod
    async def connect(
        cls,
        dsn: str,
        *,
        pooler: str | None = None,
        min_size: int = 2,
        max_size: int = 20,
        limits: StoreLimits | None = None,
        telemetry: Telemetry | None = None,
    ) -> Self:
        """The store on Postgres at ``dsn``; its pool through ``pooler`` (a URL) when given.

        Behind a pooler the pool's connections hold nothing between transactions that the pooler could
        hand to another client: statements are not prepared by name, and the session's settings are the
        role's defaults (gateway.pooling), not sent at login. ``dsn`` keeps what needs a session of its
        own (the partitions' upkeep).
        """
        limits = limits or StoreLimits()
        settings = session_settings(limits)
        # Every connection the pool opens first checks that the database still holds what this worker
        # wrote: after a failover, they are all new (unless a pooler keeps them: the claims check too).
        lost_writes = LostWrites()
        checked = False

        async def init(conn: asyncpg.Connection) -> None:
            nonlocal checked
            await _init_connection(conn)
            await lost_writes.check(conn)
            if pooler is not None and not checked:
                checked = True  # once per worker: the role's defaults are the same for every session
                if (done := await pooling.make_defaults(conn, settings)) is not None:
                    log.warning("%s", done)

        with connecting():
            pool = await asyncpg.create_pool(
                pooler or dsn,
                min_size=min_size,
                max_size=max_size,
                init=init,
                reset=_keep_session,
                # A statement per month of the audit and per day of bodies (partitions.within), each
                # prepared once per connection: about nine per month still written, one per day of
                # bodies kept (a week by default, months for some), and fifty others. Each holds its
                # plan in that connection's backend, a few KB. None behind a pooler: a statement
                # prepared on one server connection is unknown to the next.
                statement_cache_size=0 if pooler else 512,
                server_settings=None if pooler else settings,
                command_timeout=limits.answer,
            )
        if pooler is not None:
            try:
                await _same_database(pool, dsn)
            except BaseException:
                pool.terminate()
                raise
        return cls(pool, limits, dsn, lost_writes, telemetry)

    async def close(self) -> None:
        try:
            await self._pool.close()
        except FAILURES:
            # A server that no longer answers cannot take a graceful goodbye: the gateway stops anyway.
            self._pool.terminate()

    async def _run(self, kind: str, op: Callable[[Conn], Awaitable[T]]) -> T:
        """Run one phase (``kind``: its name in the metrics and spans), retried as :meth:`_attempts` says."""
        with self._telemetry.statement(kind):
            return await self._attempts(op)

    async def _attempts(self, op: Callable[[Conn], Awaitable[T]]) -> T:
        """Retry only what Postgres says is retryable; map the rest to our own errors."""
        for attempt in range(3):
            conn = await self._acquire()
            behind = False
            try:
                return await op(conn)
            except asyncpg.exceptions.CheckViolationError as exc:
                if "no partition" not in str(exc):
                    raise StoreRejected(f"Postgres refused the write: {exc}") from exc
                # "no partition of relation ... found for row": none was made for this row's time (they
                # are made two weeks ahead; an operator dropped one, or making them has failed that
                # long). Make them (below, out of this handler, so that an outage there is mapped as
                # well) and try the statement again. Never a refusal: Postgres would take the row once
                # its partition exists, and a settle carrying the upstream's answer that was refused
                # would send the effect to review.
                if attempt == 2:
                    raise StoreUnavailable(f"no partition for the row after making them: {exc}") from exc
                behind = True
            except FAILURES as exc:
                why = f"{type(exc).__name__}: {exc}"
                match kind(exc):
                    case "retry" if attempt == 2:
                        # Each try was rolled back whole: nothing of it is stored, and a later may pass.
                        raise StoreUnavailable(f"Postgres aborted the statement 3 times: {why}") from exc
                    case "retry":
                        pass
                    case "outage":
                        if isinstance(exc, TimeoutError):
                            # Past the client-side bound: a server that does not answer will not confirm
                            # the cancellation either, and the release would wait for it as long again.
                            conn.terminate()
                        raise StoreUnavailable(f"Postgres is unavailable: {why}") from exc
                    case "refused":
                        # Postgres is there but refused this statement (data it cannot hold, a check
                        # that failed): retrying the same statement cannot help.
                        raise StoreRejected(f"Postgres refused the write: {why}") from exc
            finally:
                await self._release(conn)
            if behind:
                await self._catch_up_partitions()
        raise AssertionError("unreachable")  # pragma: no cover

    async def _acquire(self) -> Conn:
        try:
            # Bounded by asyncio.timeout, in this task: asyncpg's own timeout goes through wait_for,
            # which on Python 3.11 runs the acquire in a task of its own, twice per new effect.
            async with asyncio.timeout(self._limits.acquire.total_seconds()):
                conn: Conn = await self._pool.acquire()
        except TimeoutError:
            raise StoreUnavailable(
                f"no Postgres connection free within {self._limits.acquire.total_seconds():g}s"
            ) from None
        except FAILURES as exc:
            # Whatever stops a new connection (server gone, refusing, out of slots) is an outage.
            raise StoreUnavailable(f"Postgres is unavailable: {exc}") from exc
        return conn

    async def _release(self, conn: Conn) -> None:
        try:
            await self._pool.release(conn)
        except FAILURES:
            # A statement cut short by the client-side bound leaves a cancellation the server has to
            # confirm; one that never does has its connection closed here (the pool opens another).
            # What the statement returned or raised stands either way.
            log.debug("a Postgres connection could not be reset and was closed", exc_info=True)

    async def _catch_up_partitions(self) -> None:
        """Make the partitions for rows stored now, waiting up to PARTITIONS_WAIT for the table's lock.

        Any failure is StoreUnavailable, never StoreRejected: what was to be written is not at fault.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + PARTITIONS_WAIT
        pause = PARTITIONS_PAUSE
        while True:
            try:
                # Through _attempts, like any statement: its outages are mapped the same way.
                if await self._attempts(partitions.make_ahead):
                    return
            except StoreRejected as exc:
                raise StoreUnavailable(
                    f"the partitions for rows stored now could not be made: {exc}"
                ) from exc
            if loop.time() + pause > deadline:
                raise StoreUnavailable(
                    f"the partitions for rows stored now could not be made within {PARTITIONS_WAIT:g}s: "
                    "another session holds the table's lock; try again"
                )
            await asyncio.sleep(pause)
            pause = min(pause * 2, 1.0)

    # --- the idempotency phases -------------------------------------------------------------------

    async def claim(self, new: NewEffect, lease: timedelta) -> tuple[EffectRecord | None, bool]:
        """Insert a pending record holding attempt 1, or read the one that holds the key.

        Returns the record and whether this call created it; (None, False) when the key is known but its
        audit row was archived (its partition detached). The insert is committed before it returns: the
        claim is durable before the request leaves. Claims that arrive together share a statement.
        """
        if self.lost_writes.lost is not None:
            # Has an operator deleted the alarm? Asked at each refused claim, not only on a new
            # connection, which a pooler may never open: one read of a table of at most one row.
            await self._attempts(self.lost_writes.heed)
        if self.lost_writes.lost is not None:
            # Once the database has lost writes, a key it still holds is answered as before (a replay,
            # a wait, the recovery of a record that sends nothing); a key it does not is refused.
            try:
                held = await self._attempts(lambda conn: phases.holder_of_key(conn, new))
            except StoreRejected:  # the key is not on record
                held = None
            if held is not None:
                return held, False
            self.lost_writes.refuse_if_lost()
        with self._telemetry.statement("claim"):
            record = await self._claims.write((new, lease))
            if record is not None:
                return record, True
            try:
                return await self._attempts(lambda conn: phases.holder_of_key(conn, new)), False
            except StoreRejected:
                # Not inserted, and not on record: the alarm another worker raised held the claim back,
                # or the database has forgotten this worker's newest claim (raise the alarm then).
                await self._attempts(self.lost_writes.check)
                self.lost_writes.refuse_if_lost()
                raise

    async def reclaim(
        self,
        record: EffectRecord,
        move: Transition,
        lease: timedelta,
        reason: str,
        *,
        sends: bool,
        renew: bool = False,
        carriers: KeyCarriers | None = None,
    ) -> EffectRecord | None:
        """Take the record over for a new attempt, if nobody has since ``record`` was read.

        ``sends`` is false for a take-over that only probes: the audit's send times, the lease of the
        latest attempt that sent and what carried the key stay as they were. A take-over that sends
        records ``lease`` as its attempt's and ``carriers`` as what carried the key in every attempt
        that may have acted (None: not known, and then never relied on).
        ``renew`` is the holder taking its own record again before its request left: no attempt of its
        reached the upstream, so the take-over adds no doubt. A take-over that sends returns the record
        with the request body it was claimed with, to send again (rows.with_request).
        """

        async def op(conn: Conn) -> EffectRecord | None:
            if sends:
                # A take-over that sends could repeat what the lost writes had recorded (a re-send that
                # completed after the point the database went back to): refused, on each try.
                self.lost_writes.refuse_if_lost()
            taken = await phases.reclaim(
                conn, record, move, lease, reason, sends=sends, renew=renew, carriers=carriers
            )
            return await with_request(conn, taken) if taken is not None and sends else taken

        return await self._run("reclaim", op)

    async def settle(
        self,
        record: EffectRecord,
        settlement: Settlement,
        *,
        response: StoredResponse | None,
        recovered_by: str | None,
        note: str | None = None,
    ) -> EffectRecord | None:
        """Write what the current attempt saw; None when a newer attempt fenced this one out.

        Settles that arrive together share a statement."""
        with self._telemetry.statement("settle"):
            completes = response is not None and settlement.state is State.COMPLETED
            digest = await _digest(response) if completes and response is not None else None
            settling = phases.Settling(record, settlement, response, recovered_by, note, digest)
            return await self._settles.write(settling)

    async def _claim_many(self, claims: Sequence[tuple[NewEffect, timedelta]]) -> list[EffectRecord | None]:
        async def claim(conn: Conn) -> list[EffectRecord | None]:
            # Checked at each try: a claim retried across a failover must not land in a database that
            # forgot this worker's writes (the statement itself looks its witness up).
            self.lost_writes.refuse_if_lost()
            made = await phases.claim_many(conn, claims, self.lost_writes.newest)
            for record in made:
                if record is not None:
                    self.lost_writes.wrote(record)
            return made

        return await self._attempts(claim)

    async def _settle_many(self, settles: Sequence[phases.Settling]) -> list[EffectRecord | None]:
        return await self._attempts(lambda conn: phases.settle_many(conn, settles))

    async def note_fenced(self, record: EffectRecord, saw: str) -> None:
        """A fenced-out holder adds what it saw to the history, and changes nothing else."""
        await self._run("note_fenced", lambda conn: phases.note_fenced(conn, record, saw))

    async def send_to_review(self, record: EffectRecord, move: Transition, why: str) -> EffectRecord | None:
        """Give up on recovery; fenced so that a record someone just re-claimed is left alone."""
        return await self._run("send_to_review", lambda conn: phases.send_to_review(conn, record, move, why))

    async def add_replays(self, counts: Mapping[RowKey, int]) -> None:
        """Add to the replay counters of many effects at once (the counts are kept in memory between)."""
        if counts:
            await self._run("add_replays", lambda conn: phases.add_replays(conn, counts))

    async def restore(
        self, record: EffectRecord, move: Transition, response: StoredResponse
    ) -> tuple[EffectRecord, bool]:
        """Put back the response of a completed effect whose response was purged (a probe found it).

        Only the first restore of a purge is stored: returns the record with the response on record
        now (``response``, or the one another request stored first) and whether this call stored it.
        """
        return await self._run("restore", lambda conn: phases.restore(conn, record, move, response))

    async def resolve(
        self, record: EffectRecord, move: Transition, response: StoredResponse | None, by: str | None
    ) -> EffectRecord | None:
        """An operator's verdict: completed with a response to replay, or retryable (it did not happen).

        Fenced on the state and attempt the operator saw, and refused while a lease still runs.
        """
        digest = await _digest(response) if response is not None else None
        return await self._run(
            "resolve", lambda conn: phases.resolve(conn, record, move, response, by, digest)
        )

    async def key_secret(self) -> bytes:
        """The secret of the keyed MAC for derived keys, made once by the migrations."""

        async def op(conn: Conn) -> bytes:
            value = await conn.fetchval(
                "select value from effect_gateway_secrets where name = 'derived_keys'"
            )
            assert value is not None, "migration 002 makes the secret"
            return bytes(value)

        return await self._run("key_secret", op)

    # --- reading ----------------------------------------------------------------------------------

    async def get(self, effect_id: int, tenant: str | None = None) -> EffectRecord | None:
        """One effect in full: request and response, headers and bodies, and its history."""

        async def op(conn: Conn) -> EffectRecord | None:
            row = await conn.fetchrow(
                f"""
                select {WITH_RESPONSE}, ({HISTORY})::text as history, q.headers as q_headers,
                       q.content as q_content, q.coding as q_coding
                from effects e {RESPONSE}
                left join lateral (select headers, coding, content from effect_bodies q
                                   where q.effect_id = e.id and q.kind = 'request' and q.scope = e.scope
                                   order by stored_at desc limit 1) q on true
                where e.id = $1 and ($2::text is null or e.tenant = $2)
                """,
                effect_id,
                tenant,
            )
            # A body that cannot be read back is left out and said why (record.unreadable): an operator
            # must still see the effect, and resolve it if it waits for one.
            return record_of(row, response=True, full=True) if row is not None else None

        return await self._run("get", op)

    async def reread(self, record: EffectRecord) -> EffectRecord:
        """The record as it is now, with its response: what the decision needs to be taken again."""
        return await self._run("reread", lambda conn: reread(conn, record))

    async def find(self, where: EffectFilter) -> list[EffectRecord]:
        """A page of the audit, newest first, as :func:`find_statement` reads it.

        Raises CursorUnknown when a page read by time names as ``before`` no effect that
        the viewer sees: there is no place to go on from.
        """
        sql, args = find_statement(where)

        async def op(conn: Conn) -> list[EffectRecord]:
            rows = await conn.fetch(sql, *args)
            if not rows and where.before_id is not None and where.before_at is None and by_time(where):
                found = await conn.fetchval(_CURSOR, where.before_id, where.tenant)
                if not found:
                    raise CursorUnknown(f"before={where.before_id} is no effect you can see")
            return [record_of(row) for row in rows]

        return await self._run("find", op)

    async def oldest_waiting(self, tenant: str | None = None) -> dict[str, int]:
        """Seconds since the oldest effect in doubt, and the oldest waiting for review, were claimed (0
        for a state with none): the first entry of each state's range of open_effects, ids growing with
        time. With a tenant, its own."""

        async def op(conn: Conn) -> dict[str, int]:
            rows = await conn.fetch(
                _OLDEST_WAITING if tenant is None else _OLDEST_WAITING_OF_TENANT,
                *([tenant] if tenant is not None else []),
            )
            return {row["state"]: max(0, int(row["age"] or 0)) for row in rows}

        return await self._run("oldest_waiting", op)

    async def state_counts(self, tenant: str | None = None) -> dict[str, int]:
        """Effects by state: open ones from open_effects, completed ones estimated; no scan of the audit.

        Each open state is counted exactly up to EXACT_OPEN_COUNT (a bounded range of open_effects'
        key); above that, Postgres's estimate from its statistics stands in. Completed effects would
        take a read of the whole audit to count: partitions small enough to read in a few milliseconds
        are counted, larger ones give Postgres's row estimate, less the open effects. With a tenant,
        only the open states are counted, each up to EXACT_OPEN_COUNT and no further.
        """

        async def op(conn: Conn) -> dict[str, int]:
            sql, args = count_statement(tenant)
            rows = await conn.fetch(sql, *args)
            counts = {state.value: 0 for state in State}
            for row in rows:
                # A tenant's count stops at the bound (meaning that many or more): the estimate, the state's
                # share times the tenant's, would move with other tenants' volume and show them a little.
                many = row["n"] >= EXACT_OPEN_COUNT and tenant is None
                counts[row["state"]] = max(row["n"], row["estimate"]) if many else row["n"]
            if tenant is not None:
                del counts[State.COMPLETED.value]
                return counts
            estimated = 0
            for part in await conn.fetch(_PARTITION_SIZES):
                if part["bytes"] <= partitions.EXACT_COUNT_BYTES:
                    month = partitions.within("created_at", partitions.bounds_of(part["bound"]))
                    counts[State.COMPLETED.value] += await partitions.row_count(
                        conn,
                        partitions.AUDIT,
                        part["rows"],
                        part["bytes"],
                        f"{month} and state = 'completed'",
                    )
                else:
                    estimated += await partitions.row_count(
                        conn, partitions.AUDIT, part["rows"], part["bytes"]
                    )
            if estimated:
                # The open effects are nearly all in the large (older or current) partitions' estimate.
                open_ = sum(counts[s.value] for s in OPEN_STATES)
                counts[State.COMPLETED.value] += max(0, estimated - open_)
            return counts

        return await self._run("state_counts", op)

    async def partitions_ahead(self) -> partitions.Ahead:
        """How long rows stored from now on still have partitions to go into.

        When rows stored now have none, they are made first, as a write that found none would make them.
        """
        ahead = await self._run("partitions_ahead", partitions.ahead)
        if ahead.days_left <= 0:
            await self._catch_up_partitions()
            ahead = await self._run("partitions_ahead", partitions.ahead)
        return ahead

    async def failover_warning(self) -> str | None:
        """What a failover of this Postgres could lose (gateway.lost_writes.failover_warning)."""
        return await self._run("failover_warning", failover_warning)

    async def chain(self, signer: Signer | None, *, sign_now: bool = False) -> Round:
        """One round of the audit's chain: settlements linked into it, its due heads signed
        (gateway.chaining.chain_round)."""
        return await self._run("chain", lambda conn: chaining.chain_round(conn, signer, sign_now=sign_now))

    # --- notifications (gateway.webhooks): none of these runs without a [webhook] ---------------------

    @property
    def notifications(self) -> notification_rows.Notifications:
        """The statements of a [webhook]'s rounds, run on this store's connections as its own are."""
        return notification_rows.Notifications(self._run)

    async def ping(self) -> None:
        """Whether Postgres answers (health), without touching the effect tables."""

        async def op(conn: Conn) -> None:
            await conn.fetchval("select 1")

        await self._run("ping", op)

    # --- retention --------------------------------------------------------------------------------

    async def maintain(
        self, retention: timedelta, progress: partitions.Progress = partitions._quiet, *, purge: bool = False
    ) -> list[partitions.Partition]:
        """Make the coming partitions, and drop the days of bodies past the retention if this role may.

        Dropping a day takes the privileges of the owner of effect_bodies: a gateway running with the
        runtime role only makes the partitions, and says once that the retention is left to the owner
        (``effect-gateway purge`` on a schedule). ``purge``: the owner's command, which refuses instead.
        On a connection of its own without the pool's timeouts: detaching waits for transactions that
        may still read the partition (it blocks none of them).
        """
        with connecting():
            conn = await asyncpg.connect(self._dsn)
        try:
            await conn.execute("set statement_timeout = 0; set lock_timeout = '5s'")
            if not await roles.runs_retention(conn):
                owner = await roles.owner_of_tables(conn)
                if purge:
                    raise PrivilegesMissing(
                        f"dropping days of bodies takes the privileges of the owner of the tables ({owner}): "
                        f"run effect-gateway purge as {owner}"
                    )
                await self._make_ahead(conn)
                if not self._retention_left:
                    self._retention_left = True
                    log.info(
                        "this gateway's database role does not own the tables, so it leaves the retention "
                        "to `effect-gateway purge` run by their owner (%s) on a schedule "
                        "(docs/operations.md, Database roles); it makes the partitions ahead",
                        owner,
                    )
                return []
            # One maintainer at a time among all gateways on the database; the others skip this round.
            if not await conn.fetchval("select pg_try_advisory_lock($1)", MAINTENANCE_LOCK):
                log.debug("another gateway is maintaining the partitions; skipped")
                return []
            if not await self._make_ahead(conn):
                # A day is detached only once the days ahead exist: a write that finds no partition
                # then never waits for a detach (see PARTITIONS_WAIT).
                log.info("the partitions ahead could not be made now; the retention waits for the next round")
                return []
            return await partitions.drop_expired_bodies(conn, retention, progress)
        except FAILURES as exc:
            if kind(exc) != "outage":
                raise
            raise StoreUnavailable(f"Postgres is unavailable: {type(exc).__name__}: {exc}") from exc
        except asyncio.CancelledError:
            # A shutdown: this connection has no bound on its statements (a detach may wait long), so
            # a close, which waits for the server to confirm the cancelled one, could wait for ever.
            conn.terminate()
            raise
        finally:
            if not conn.is_closed():
                await conn.close()

    async def _make_ahead(self, conn: asyncpg.Connection) -> bool:
        """The partitions ahead made on the retention's connection; the log says why when they could not
        be, and warns when few days are left."""
        try:
            made = await partitions.make_ahead(conn)
        except FAILURES as exc:
            if kind(exc) == "outage":
                raise
            # EXECUTE revoked, the function dropped, a table in the way; or a deadlock: the next round
            log.warning("the partitions ahead could not be made: %s: %s", type(exc).__name__, exc)
            made = False
        warning = (await partitions.ahead(conn)).warning()
        if warning is not None:
            log.warning("%s", warning)
        return made


async def _digest(response: StoredResponse) -> str:
    """A response's digest for the audit's chain, off the event loop for a large body, as a request's
    is parsed (gateway.inbound.OFF_LOOP_BYTES): SHA-256 takes 6 ms for the 10 MiB an answer may hold."""
    if len(response.body) <= OFF_LOOP_BYTES:
        return chain.response_digest(response)
    return await asyncio.to_thread(chain.response_digest, response)


@asynccontextmanager
async def opened(dsn: str) -> AsyncIterator[Store]:
    store = await Store.connect(dsn)
    try:
        yield store
    finally:
        await store.close()
