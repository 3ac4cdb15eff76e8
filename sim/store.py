"""The simulated store: the contract of :class:`gateway.store.Store`, kept in memory.

:class:`SimDatabase` is a small database with the same semantics as the SQL in gateway/phases.py,
gateway/store.py and gateway/partitions.py: one row per effect, a key table that keeps keys unique,
bodies stored by time and dropped by whole days by the retention, and every statement applied at one
instant of the database's clock. Each write is fenced exactly as its SQL is (``id``, ``created_at``,
``attempt`` and ``state``; the lease for an operator's verdict; the response as read for a restore).
It is not a mock: it answers what the data says, and tests/test_store_contract.py runs the same tests
against it and against Postgres.

Where the two differ on purpose, the contract holds only what both promise: the admin's count of an
open state above EXACT_OPEN_COUNT is Postgres's estimate there and exact here; the retention reports
every day it dropped there, empty ones too, and here only the days that held bodies; a filter by
key finds the effect through the key table there and by the row's key here; and there, rows go into
partitions made ahead by time, where here every time has a home (and one role owns everything).

:class:`SimStore` is one connection's view of it, with the same methods as ``Store``: each statement
travels to the database (a delay), is applied there atomically (or not: an outage), and its answer
travels back (a delay, or lost after the commit). The :class:`Weather` decides those delays and
faults; the calm default has none. A gateway that dies while its statement travels does not stop the
statement: the database applies what it received.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Literal, Protocol, TypeVar, cast

from gateway import chain, partitions
from gateway.audit_query import EXACT_OPEN_COUNT, EffectFilter, by_time
from gateway.batches import Batches
from gateway.chain import ROUND, Round, Signer
from gateway.decision import Settlement
from gateway.errors import CursorUnknown, StoreRejected, StoreUnavailable
from gateway.keys import key_digest
from gateway.phases import Settling, claim_batch_key, claim_size, settle_batch_key, settle_size
from gateway.record import (
    EffectRecord,
    KeyCarriers,
    NewEffect,
    RowKey,
    StoredResponse,
    head_bytes,
    head_pairs,
)
from gateway.states import State, Transition
from sim.loop import OWNER, REQUEST

T = TypeVar("T")
Scope = tuple[str, str, str]  # (tenant, upstream, key)
BodyKey = tuple[int, str, datetime]  # (effect_id, kind, stored_at), the primary key of effect_bodies
TICK = timedelta(microseconds=1)  # Postgres's resolution: no two statements share an instant
DAY = timedelta(days=1)


@dataclass
class Row:
    """One row of ``effects`` (all its columns)."""

    id: int
    created_at: datetime
    tenant: str
    upstream: str
    key: str
    derived_key: str
    method: str
    path: str
    query: str
    fingerprint: str
    state: State
    attempt: int
    may_have_sent: bool
    lease_expires_at: datetime | None
    first_sent_at: datetime | None
    last_sent_at: datetime | None
    run_id: str | None
    step: str | None
    keyless: bool
    response_status: int | None = None
    response_at: datetime | None = None
    recovered_by: str | None = None
    completed_at: datetime | None = None
    replays: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    # None on a row as migration 015 found it (tests/test_store_contract.py makes such rows).
    key_carriers: KeyCarriers | None = None
    send_lease: timedelta | None = None
    tool: str | None = None

    @property
    def scope(self) -> Scope:
        return (self.tenant, self.upstream, self.key)


@dataclass(frozen=True, slots=True)
class Write:
    """A write the database applied, as the invariants see it."""

    op: str  # claim, reclaim, settle, send_to_review, resolve, restore
    source: State | None  # the row's state before (None: the claim made it)
    row: Row  # after
    now: datetime
    who: str
    note: str | None = None
    request: int = 0  # the simulator's number of the client request whose handling sent the statement


def _least(a: datetime | None, b: datetime) -> datetime:
    # Postgres's least() ignores nulls.
    return b if a is None else min(a, b)


def _event(kind: str, now: datetime, **data: Any) -> dict[str, Any]:
    """One history entry, as gateway.phases's ``_event`` + ``_stamped`` write it (or HISTORY reads it)."""
    return {"event": kind, **{k: v for k, v in data.items() if v is not None}, "at": now.isoformat()}


def _with_claim(row: Row) -> list[dict[str, Any]]:
    """As gateway.rows's HISTORY reads it: the claim first (not kept in the row), then the row's events."""
    history = [dict(entry) for entry in row.history]
    if history and history[0].get("event") == "claimed":
        return history  # a row written as earlier versions wrote them
    return [_event("claimed", row.created_at, attempt=1), *history]


class SimDatabase:
    """The tables and the statements; each method is one statement, applied at ``now``."""

    def __init__(self, clock: Callable[[], datetime], key_secret: bytes = b"sim-derived-keys") -> None:
        self._clock = clock
        self._last: datetime | None = None
        self._next_id = 0
        self.keys: dict[Scope, tuple[int, datetime]] = {}
        self.rows: dict[int, Row] = {}
        self.bodies: dict[BodyKey, tuple[bytes, bytes]] = {}
        self.key_secret = key_secret
        # The audit's chain (gateway.chaining's tables): settlements waiting, each tenant's entries and
        # signed heads.
        self.unchained: list[chain.Settled] = []
        self.chain: dict[str, list[chain.Entry]] = {}
        self.heads: dict[str, list[chain.Head]] = {}
        # Called with every write the database applied (the simulator's invariants listen here).
        self.observers: list[Callable[[Write], None]] = []
        # Who sent the statement being applied (for the trace), and for which client request (0: none),
        # set by the connection.
        self.caller = ""
        self.request = 0

    def now(self) -> datetime:
        """The database's clock: never the same instant twice, as clock_timestamp() at microseconds."""
        now = self._clock()
        if self._last is not None and now <= self._last:
            now = self._last + TICK
        self._last = now
        return now

    def _wrote(self, op: str, source: State | None, row: Row, now: datetime, note: str | None = None) -> None:
        write = Write(op, source, row, now, self.caller, note, self.request)
        for observer in self.observers:
            observer(write)

    def _row(self, record: EffectRecord) -> Row | None:
        row = self.rows.get(record.id)
        return row if row is not None and row.created_at == record.created_at else None

    def _response(self, row: Row) -> StoredResponse | None:
        if row.response_status is None or row.response_at is None:
            return None
        stored = self.bodies.get((row.id, "response", row.response_at))
        if stored is None:
            return None
        return StoredResponse(row.response_status, head_pairs(stored[0]), stored[1])

    def record(
        self, row: Row, now: datetime, *, response: bool = False, full: bool = False, sent: bool = False
    ) -> EffectRecord:
        """The row as gateway.rows' ``record_of`` builds it from the statement's columns; ``sent``: with
        the request body it was claimed with, as gateway.rows' ``with_request`` adds it."""
        request: tuple[bytes, bytes] | None = None
        unreadable: dict[str, str] = {}
        if full or sent:
            kept = sorted(
                (at, v) for (i, kind, at), v in self.bodies.items() if i == row.id and kind == "request"
            )
            request = kept[-1][1] if kept else None
            if request is None and sent:
                unreadable["request"] = "no request body is on record"
        return EffectRecord(
            id=row.id,
            tenant=row.tenant,
            upstream=row.upstream,
            key=row.key,
            derived_key=row.derived_key,
            method=row.method,
            path=row.path,
            query=row.query,
            fingerprint=row.fingerprint,
            state=row.state,
            attempt=row.attempt,
            may_have_sent=row.may_have_sent,
            lease_expires_at=row.lease_expires_at,
            first_sent_at=row.first_sent_at,
            last_sent_at=row.last_sent_at,
            completed_at=row.completed_at,
            created_at=row.created_at,
            response=self._response(row) if response else None,
            response_status=row.response_status,
            response_at=row.response_at,
            response_read=response,
            recovered_by=row.recovered_by,
            replays=row.replays,
            run_id=row.run_id,
            step=row.step,
            request_headers=dict(head_pairs(request[0])) if request is not None and full else {},
            request_body=request[1] if request is not None else None,
            history=_with_claim(row) if full else [],
            read_at=now,
            keyless=row.keyless,
            key_carriers=row.key_carriers,
            send_lease=row.send_lease,
            tool=row.tool,
            unreadable=unreadable,
        )

    def _store_body(self, at: BodyKey, headers: bytes, body: bytes) -> None:
        if at in self.bodies:
            # effect_bodies' primary key: Postgres refuses the whole statement.
            raise StoreRejected("Postgres refused the write: UniqueViolationError")
        self.bodies[at] = (headers, body)

    # --- the idempotency phases (gateway.phases's statements) ---------------------------------------

    def claim_many(self, claims: Sequence[tuple[NewEffect, timedelta]]) -> list[EffectRecord | None]:
        """gateway.phases.claim_many: a new record for each claim whose key is free, None for the others."""
        now = self.now()  # one statement, one instant: Postgres's now() is the transaction's
        return [self._claim(new, lease, now) for new, lease in claims]

    def _claim(self, new: NewEffect, lease: timedelta, now: datetime) -> EffectRecord | None:
        scope = (new.tenant, new.upstream, new.key)
        if scope in self.keys:
            return None
        self._next_id += 1
        row = Row(
            id=self._next_id,
            created_at=now,
            tenant=new.tenant,
            upstream=new.upstream,
            key=new.key,
            derived_key=new.derived_key,
            method=new.method,
            path=new.path,
            query=new.query,
            fingerprint=new.fingerprint,
            state=State.PENDING,
            attempt=1,
            may_have_sent=False,
            lease_expires_at=now + lease,
            first_sent_at=now,
            last_sent_at=now,
            run_id=new.run_id,
            step=new.step,
            keyless=new.keyless,
            key_carriers=new.key_carriers,
            send_lease=lease,
            tool=new.tool,
        )
        self._store_body((row.id, "request", now), head_bytes(new.request_headers), new.request_body)
        self.keys[scope] = (row.id, now)
        self.rows[row.id] = row
        self._wrote("claim", None, row, now)
        return self.record(row, now, response=True)

    def holder_of_key(self, new: NewEffect) -> EffectRecord | None:
        """gateway.phases.holder_of_key: the record that holds a key a claim found taken."""
        now = self.now()
        row = self.rows.get(self.keys[(new.tenant, new.upstream, new.key)][0])
        return self.record(row, now, response=True) if row is not None else None

    def _holds(self, row: Row | None, record: EffectRecord, source: State) -> bool:
        """The fence of every write after a claim: ``where attempt = $3 and state = $4``."""
        return row is not None and row.attempt == record.attempt and row.state is source

    def _settle_holds(self, row: Row | None, record: EffectRecord, source: State) -> bool:
        """Settle's fence (apart so that a mutation can drop it from settle alone)."""
        return self._holds(row, record, source)

    def reclaim(
        self,
        record: EffectRecord,
        source: State,
        lease: timedelta,
        reason: str,
        *,
        sends: bool,
        renew: bool = False,
        carriers: KeyCarriers | None = None,
    ) -> EffectRecord | None:
        now = self.now()
        row = self._row(record)
        if row is None or not self._holds(row, record, source):
            return None
        was = row.state
        # a pending record whose lease ran out may have been sent by the gateway that held it
        row.may_have_sent = row.may_have_sent or (was is State.PENDING and not renew)
        row.attempt += 1
        row.state = State.PENDING
        row.lease_expires_at = now + lease
        if sends:
            row.last_sent_at = now
            row.send_lease = lease
            row.key_carriers = carriers
        row.first_sent_at = row.first_sent_at or now
        row.history.append(
            _event("reclaimed", now, attempt=record.attempt + 1, reason=reason, was=record.state.value)
        )
        self._wrote("reclaim", was, row, now, reason)
        return self.record(row, now, sent=sends)

    def settle(
        self,
        record: EffectRecord,
        settlement: Settlement,
        source: State,
        *,
        response: StoredResponse | None,
        recovered_by: str | None,
        note: str | None = None,
        now: datetime | None = None,
    ) -> EffectRecord | None:
        now = now or self.now()
        row = self._row(record)
        if row is None or not self._settle_holds(row, record, source):
            return None
        if response is not None:
            self._store_body((row.id, "response", now), head_bytes(response.headers), response.body)
        was = row.state
        row.state = settlement.state
        row.may_have_sent = settlement.may_have_sent
        if settlement.ends_lease:
            row.lease_expires_at = _least(row.lease_expires_at, now)
        if response is not None:
            row.response_status = response.status
            row.response_at = now
        row.recovered_by = recovered_by or row.recovered_by
        if settlement.state is State.COMPLETED:
            row.completed_at = now
        row.history.append(
            _event(
                "settled",
                now,
                attempt=record.attempt,
                state=settlement.state.value,
                status=response.status if response else None,
                recovered_by=recovered_by,
                note=note,
            )
        )
        if was is not State.COMPLETED and row.state is State.COMPLETED:
            self._settled(row, "completed", chain.response_digest(response) if response else None, None, now)
        self._wrote("settle", was, row, now, note)
        return self.record(row, now)

    def settle_many(self, settles: Sequence[Settling]) -> list[EffectRecord | None]:
        """gateway.phases.settle_many: each record as settled, or None where it was fenced out."""
        now = self.now()
        return [
            self.settle(
                one.record,
                one.settlement,
                one.settlement.transition.fenced_on(one.record.state),
                response=one.response,
                recovered_by=one.recovered_by,
                note=one.note,
                now=now,
            )
            for one in settles
        ]

    def note_fenced(self, record: EffectRecord, saw: str) -> None:
        now = self.now()
        row = self._row(record)
        if row is not None:
            row.history.append(_event("fenced", now, attempt=record.attempt, saw=saw))

    def send_to_review(self, record: EffectRecord, source: State, why: str) -> EffectRecord | None:
        now = self.now()
        row = self._row(record)
        if row is None or not self._holds(row, record, source):
            return None
        was = row.state
        # No new attempt; a stalled holder that wakes up now is fenced out by the state.
        row.state = State.NEEDS_REVIEW
        row.lease_expires_at = _least(row.lease_expires_at, now)
        row.history.append(_event("needs_review", now, attempt=record.attempt, why=why))
        self._wrote("send_to_review", was, row, now, why)
        return self.record(row, now)

    def add_replays(self, counts: Mapping[RowKey, int]) -> None:
        self.now()
        for (effect_id, created_at, scope), n in counts.items():
            row = self.rows.get(effect_id)
            if row is not None and row.created_at == created_at and key_digest(row.key) == scope:
                row.replays += n

    def restore(
        self, record: EffectRecord, source: State, response: StoredResponse
    ) -> tuple[EffectRecord, bool]:
        now = self.now()
        row = self._row(record)
        assert row is not None, "effects are never deleted while in use"
        if (
            not self._holds(row, record, source)
            or row.response_at != record.response_at  # another restore stored its answer first
            or self._response_kept(row)
        ):
            return self.record(row, now, response=True), False
        self._store_body((row.id, "response", now), head_bytes(response.headers), response.body)
        was = row.state
        row.response_status = response.status
        row.response_at = now
        row.history.append(_event("restored", now, status=response.status, note="the probe found the effect"))
        self._wrote("restore", was, row, now)
        return self.record(row, now, response=True), True

    def _response_kept(self, row: Row) -> bool:
        return row.response_at is not None and (row.id, "response", row.response_at) in self.bodies

    def _resolvable(self, row: Row, now: datetime) -> bool:
        """An operator's verdict waits for the lease: ``lease_expires_at is null or <= now()``."""
        return row.lease_expires_at is None or row.lease_expires_at <= now

    def resolve(
        self,
        record: EffectRecord,
        move: Transition,
        source: State,
        response: StoredResponse | None,
        by: str | None,
    ) -> EffectRecord | None:
        now = self.now()
        row = self._row(record)
        if row is None or not self._holds(row, record, source) or not self._resolvable(row, now):
            return None
        happened = move.target is State.COMPLETED
        if happened:
            self._store_body(
                (row.id, "response", now),
                head_bytes(response.headers) if response else b"",
                response.body if response else b"",
            )
        was = row.state
        row.state = move.target
        # "did not happen" is the operator's word that no attempt reached the upstream
        row.may_have_sent = happened
        row.lease_expires_at = _least(row.lease_expires_at, now)
        row.response_status = response.status if response else None
        row.response_at = now if happened else None
        row.recovered_by = "operator"
        row.completed_at = now if happened else None
        row.history.append(
            _event("resolved", now, attempt=record.attempt, happened=happened, by=by, was=record.state.value)
        )
        digest = chain.response_digest(response) if response else None
        self._settled(row, "completed" if happened else "not_happened", digest, by, now)
        self._wrote("resolve", was, row, now)
        return self.record(row, now)

    def _settled(self, row: Row, outcome: str, digest: str | None, by: str | None, now: datetime) -> None:
        """gateway.phases._settled_into_chain: the settlement waits for the chain."""
        self.unchained.append(
            chain.Settled(
                row.tenant, row.id, row.attempt, str(key_digest(row.key)), row.upstream, row.method, row.path,
                row.fingerprint, outcome, row.response_status, digest, row.recovered_by, by, row.run_id,
                row.step, row.created_at, now,
            )
        )  # fmt: skip

    def chain_round(self, signer: Signer | None, sign_now: bool) -> Round:
        """gateway.chaining.chain_round, in one statement."""
        now = self.now()
        self.unchained.sort(key=chain.order)
        taken, self.unchained = self.unchained[:ROUND], self.unchained[ROUND:]
        for tenant, settlements in chain.by_tenant(taken).items():
            entries = self.chain.setdefault(tenant, [])
            seq, prev = (entries[-1].seq, entries[-1].hash) if entries else (0, chain.GENESIS)
            entries += chain.link(seq, prev, settlements)
        return Round(len(taken), self._sign_due(signer, sign_now, now) if signer is not None else [])

    def _sign_due(self, signer: Signer, sign_now: bool, now: datetime) -> list[chain.Head]:
        """gateway.chaining._sign_due: each tip that is due (chain.due)."""
        signed = []
        for tenant, entries in self.chain.items():
            heads = self.heads.setdefault(tenant, [])
            last = (heads[-1].seq, heads[-1].signed_at) if heads else None
            if chain.due(entries[-1].seq, last, now, signer.every, sign_now):
                heads.append(chain.sign(signer.key, tenant, entries[-1].seq, entries[-1].hash, now))
                signed.append(heads[-1])
        return signed

    # --- reading ------------------------------------------------------------------------------------

    def get(self, effect_id: int, tenant: str | None = None) -> EffectRecord | None:
        now = self.now()
        row = self.rows.get(effect_id)
        if row is None or (tenant is not None and row.tenant != tenant):
            return None
        return self.record(row, now, response=True, full=True)

    def reread(self, record: EffectRecord) -> EffectRecord:
        now = self.now()
        row = self._row(record)
        assert row is not None, "effects are never deleted while in use"
        return self.record(row, now, response=True)

    def find(self, where: EffectFilter) -> list[EffectRecord]:
        now = self.now()
        found = [
            row
            for row in self.rows.values()
            if (where.tenant is None or row.tenant == where.tenant)
            and (where.state is None or row.state is where.state)
            and (where.upstream is None or row.upstream == where.upstream)
            and (where.run_id is None or row.run_id == where.run_id)
            and (where.key is None or row.key == where.key)
            and (where.since is None or row.created_at >= where.since)
            and (where.until is None or row.created_at < where.until)
        ]
        if not by_time(where):
            found = [row for row in found if where.before_id is None or row.id < where.before_id]
            found.sort(key=lambda row: row.id, reverse=True)
            return [self.record(row, now) for row in found[: where.limit]]
        # As gateway.audit_query's: newest by creation time, going on from the page before's last effect.
        if where.before_id is not None and where.before_at is not None:
            cursor = (where.before_at, where.before_id)
            found = [row for row in found if (row.created_at, row.id) < cursor]
        elif where.before_id is not None:
            ended = self.rows.get(where.before_id)
            if ended is None or (where.tenant is not None and ended.tenant != where.tenant):
                raise CursorUnknown(f"before={where.before_id} is no effect you can see")
            found = [row for row in found if (row.created_at, row.id) < (ended.created_at, ended.id)]
        found.sort(key=lambda row: (row.created_at, row.id), reverse=True)
        return [self.record(row, now) for row in found[: where.limit]]

    def state_counts(self, tenant: str | None = None) -> dict[str, int]:
        self.now()
        counts = {state.value: 0 for state in State}
        for row in self.rows.values():
            if row.state is State.COMPLETED or tenant is None or row.tenant == tenant:
                counts[row.state.value] += 1
        if tenant is not None:  # as gateway.store's: a tenant's open states counted up to the bound only
            del counts[State.COMPLETED.value]
            counts = {state: min(n, EXACT_OPEN_COUNT) for state, n in counts.items()}
        return counts

    def oldest_waiting(self, tenant: str | None = None) -> dict[str, int]:
        now = self.now()
        ages = {}
        for state in (State.IN_DOUBT, State.NEEDS_REVIEW):
            rows = [r for r in self.rows.values() if r.state is state and tenant in (None, r.tenant)]
            oldest = min(rows, key=lambda r: r.id, default=None)
            ages[state.value] = max(0, int((now - oldest.created_at).total_seconds())) if oldest else 0
        return ages

    # --- retention (gateway.partitions.drop_expired_bodies) ------------------------------------------

    def maintain(self, retention: timedelta, progress: partitions.Progress) -> list[partitions.Partition]:
        """Drop every day of bodies wholly older than the retention, carrying open effects' forward."""
        now = self.now()
        cutoff = now - retention
        days = sorted({_day(at) for (_, _, at) in self.bodies})
        dropped = []
        for lower in days:
            upper = lower + DAY
            if upper > cutoff:
                break
            in_day = sorted((k, v) for k, v in self.bodies.items() if lower <= k[2] < upper)
            carried = 0
            for (effect_id, kind, at), (headers, body) in in_day:
                row = self.rows.get(effect_id)
                if row is None or row.state is State.COMPLETED:
                    continue
                # As gateway.partitions._drop: an earlier attempt's answer is not carried, and the
                # record stops pointing at it.
                claimed = row.last_sent_at or row.created_at
                kept = kind == "request" or (at == row.response_at and at >= claimed)
                if kept and (effect_id, kind, now) not in self.bodies:  # "on conflict do nothing"
                    self.bodies[(effect_id, kind, now)] = (headers, body)
                    carried += 1
                if kind == "response" and row.response_at == at:
                    row.response_at = now if kept else None
            for key, _ in in_day:
                del self.bodies[key]
            name = f"effect_bodies_{lower:%Y_%m_%d}"
            size = sum(len(h) + len(b) for _, (h, b) in in_day)
            dropped.append(partitions.Partition(name, lower, upper, rows=len(in_day), bytes=size))
            progress(
                f"dropped {name}: about {len(in_day)} bodies"
                + (f", {carried} carried forward" if carried else "")
            )
        return dropped

    # --- for tests: what tests/database.py's backdate_bodies does in SQL -------------------------------

    def backdate_bodies(self, days: int) -> None:
        """Time passes for the stored bodies: they move ``days`` back, into a day the retention will drop."""
        back = timedelta(days=days)
        self.bodies = {(i, kind, at - back): v for (i, kind, at), v in self.bodies.items()}
        for row in self.rows.values():
            if row.response_at is not None:
                # The attempt that stored an answer moves with it, as in tests/database.py.
                if row.last_sent_at is not None and row.last_sent_at <= row.response_at:
                    row.last_sent_at -= back
                row.response_at -= back


def _day(at: datetime) -> datetime:
    utc = at.astimezone(UTC)
    return datetime(utc.year, utc.month, utc.day, tzinfo=UTC)


# --- the connection -------------------------------------------------------------------------------


Fault = Literal["down", "lost", "refused"] | None


@dataclass(frozen=True, slots=True)
class Trip:
    """How one statement goes: its delay to the database and back, and what fails, if anything.

    ``down``: the database is unreachable and the statement is not applied; ``lost``: it is applied
    and committed, and the answer is lost on the way back; ``refused``: Postgres refuses it (data it
    cannot hold) and nothing is applied.
    """

    there: float = 0.0
    back: float = 0.0
    fault: Fault = None


class Weather(Protocol):
    def trip(self, statement: str, who: str, refusable: Sequence[tuple[int, int]]) -> Trip:
        """``refusable``: (effect id, attempt) of each write in the statement that carries a response
        Postgres may refuse."""
        ...


class Calm:
    """No delay, no fault."""

    def trip(self, statement: str, who: str, refusable: Sequence[tuple[int, int]]) -> Trip:
        return Trip()


# Statements are applied here: in no gateway's context, so a gateway's crash or pause cannot stop
# one that already reached the database.
DATABASE = contextvars.Context()


class SimStore:
    """One gateway's (or operator's) connection to the database: gateway.store.Store's methods."""

    def __init__(self, db: SimDatabase, weather: Weather | None = None, who: str = "") -> None:
        self.db = db
        self._weather: Weather = weather or Calm()
        self._who = who
        # Claims and settles that arrive together share a statement, as gateway.store.Store's do.
        self._claims = Batches(self._claim_many, distinct=claim_batch_key, size=claim_size)
        self._settles = Batches(self._settle_many, distinct=settle_batch_key, size=settle_size)

    async def _statement(
        self, name: str, apply: Callable[[], T], *, refusable: Sequence[tuple[int, int]] = ()
    ) -> T:
        loop = asyncio.get_running_loop()
        owner = OWNER.get()
        caller = owner.name if owner is not None else self._who
        request = REQUEST.get()
        trip = self._weather.trip(name, caller, refusable)
        answer: asyncio.Future[T] = loop.create_future()

        def reply(result: T | None, error: Exception | None) -> None:
            if answer.done():
                return
            if error is not None:
                answer.set_exception(error)
            else:
                answer.set_result(cast(T, result))  # None only when there is an error

        def at_database() -> None:
            result: T | None = None
            error: Exception | None = None
            if trip.fault == "down":
                error = StoreUnavailable("Postgres is unavailable: ConnectionRefusedError (simulated outage)")
            elif trip.fault == "refused":
                error = StoreRejected("Postgres refused the write: DataError (simulated)")
            else:
                try:
                    self.db.caller, self.db.request = caller, request
                    result = apply()
                except (StoreRejected, StoreUnavailable, CursorUnknown) as exc:
                    error = exc
                if trip.fault == "lost" and error is None:
                    error = StoreUnavailable("Postgres is unavailable: ConnectionResetError (answer lost)")
            loop.call_later(trip.back, reply, result, error, context=DATABASE)

        loop.call_later(trip.there, at_database, context=DATABASE)
        return await answer

    # --- gateway.store.Store's surface (tests/test_store_contract.py checks the signatures) ---------

    async def close(self) -> None:
        pass

    async def claim(self, new: NewEffect, lease: timedelta) -> tuple[EffectRecord | None, bool]:
        record = await self._claims.write((new, lease))
        if record is not None:
            return record, True
        return await self._statement("holder_of_key", lambda: self.db.holder_of_key(new)), False

    async def _claim_many(self, claims: Sequence[tuple[NewEffect, timedelta]]) -> list[EffectRecord | None]:
        return await self._statement("claim", lambda: self.db.claim_many(claims))

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
        source = move.fenced_on(record.state)
        return await self._statement(
            "reclaim",
            lambda: self.db.reclaim(
                record, source, lease, reason, sends=sends, renew=renew, carriers=carriers
            ),
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
        return await self._settles.write(Settling(record, settlement, response, recovered_by, note))

    async def _settle_many(self, settles: Sequence[Settling]) -> list[EffectRecord | None]:
        return await self._statement(
            "settle",
            lambda: self.db.settle_many(settles),
            refusable=[(one.record.id, one.record.attempt) for one in settles if one.response is not None],
        )

    async def note_fenced(self, record: EffectRecord, saw: str) -> None:
        await self._statement("note_fenced", lambda: self.db.note_fenced(record, saw))

    async def send_to_review(self, record: EffectRecord, move: Transition, why: str) -> EffectRecord | None:
        source = move.fenced_on(record.state)
        return await self._statement("send_to_review", lambda: self.db.send_to_review(record, source, why))

    async def add_replays(self, counts: Mapping[RowKey, int]) -> None:
        if not counts:
            return
        await self._statement("add_replays", lambda: self.db.add_replays(counts))

    async def restore(
        self, record: EffectRecord, move: Transition, response: StoredResponse
    ) -> tuple[EffectRecord, bool]:
        source = move.fenced_on(record.state)
        return await self._statement(
            "restore",
            lambda: self.db.restore(record, source, response),
            refusable=[(record.id, record.attempt)],
        )

    async def resolve(
        self, record: EffectRecord, move: Transition, response: StoredResponse | None, by: str | None
    ) -> EffectRecord | None:
        source = move.fenced_on(record.state)
        return await self._statement("resolve", lambda: self.db.resolve(record, move, source, response, by))

    async def key_secret(self) -> bytes:
        return await self._statement("key_secret", lambda: self.db.key_secret)

    async def chain(self, signer: Signer | None, *, sign_now: bool = False) -> Round:
        return await self._statement("chain", lambda: self.db.chain_round(signer, sign_now))

    async def get(self, effect_id: int, tenant: str | None = None) -> EffectRecord | None:
        return await self._statement("get", lambda: self.db.get(effect_id, tenant))

    async def reread(self, record: EffectRecord) -> EffectRecord:
        return await self._statement("reread", lambda: self.db.reread(record))

    async def find(self, where: EffectFilter) -> list[EffectRecord]:
        return await self._statement("find", lambda: self.db.find(where))

    async def state_counts(self, tenant: str | None = None) -> dict[str, int]:
        return await self._statement("state_counts", lambda: self.db.state_counts(tenant))

    async def oldest_waiting(self, tenant: str | None = None) -> dict[str, int]:
        return await self._statement("oldest_waiting", lambda: self.db.oldest_waiting(tenant))

    async def partitions_ahead(self) -> partitions.Ahead:
        # Bodies here are kept by time with no table per day: a row stored at any time has a home.
        return await self._statement(
            "partitions_ahead", lambda: partitions.Ahead(audit=timedelta.max, bodies=timedelta.max)
        )

    async def ping(self) -> None:
        await self._statement("ping", lambda: None)

    async def failover_warning(self) -> str | None:
        # One simulated database, with no standby a failover could go to: nothing it could lose.
        return await self._statement("failover_warning", lambda: None)

    async def maintain(
        self, retention: timedelta, progress: partitions.Progress = partitions._quiet, *, purge: bool = False
    ) -> list[partitions.Partition]:
        # One role here, which owns everything: purge or not, the retention runs.
        return await self._statement("maintain", lambda: self.db.maintain(retention, progress))
