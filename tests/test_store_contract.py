"""One contract, two stores: every test runs against Postgres (gateway.store) and the simulator's store.

The simulator (sim/) is only worth what its store is: if the two disagreed, it would explore a
database that does not exist. Each test states a behaviour of the store that the gateway relies on.
"""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest

from gateway import chain
from gateway.audit_query import EffectFilter
from gateway.chain import Round, Signer
from gateway.decision import Policy, Send, Settlement, TooSoon, after_probe, review, settle, take_over
from gateway.errors import CursorUnknown, StoreRejected
from gateway.outcome import Answered, Found, NoAnswer, NotFound, NotSent, ProbeError
from gateway.record import EffectRecord, KeyCarriers, NewEffect, StoredResponse
from gateway.routes import Route
from gateway.seams import Database
from gateway.states import State, Transition
from gateway.store import Store, opened
from sim.store import Row, SimDatabase, SimStore
from tests.database import backdate_bodies, empty_effects
from tests.factories import new_effect

# The requests of the effects below, and what their probe searches.
ORDERS = (Route.parse("POST /orders"),)

LEASE = timedelta(seconds=30)
# What carries the effects' keys below: a native header and a JSON stamp.
CARRIED = KeyCarriers("Idempotency-Key", ("json_field", "client_reference"))
EXPIRED = timedelta(0)
# Bodies as long as an agent's everyday JSON: Postgres's store keeps them deflated (gateway.packing), so
# each test reads back what that store had to unpack (the simulator's keeps them as they are).
BASKET = b'{"items": [' + b", ".join(b'"atta %d kg"' % n for n in range(1, 31)) + b"]}"
LINES = b'"lines": [' + b", ".join(b'{"sku": "atta-%d", "qty": 1}' % n for n in range(1, 11)) + b"]"
OK = StoredResponse(201, (("Content-Type", "application/json"),), b'{"order": 1, ' + LINES + b"}")
LATER = StoredResponse(201, (("Content-Type", "application/json"),), b'{"order": 2, ' + LINES + b"}")
DONE = settle(Answered(OK.status, OK.headers, OK.body), earlier_doubt=False)
TIMED_OUT = settle(NoAnswer("no answer within 1s", timed_out=True), earlier_doubt=False)
RETENTION = timedelta(days=7)
# The simulated database's clock runs this far behind the machine's: a store that stamped a time from
# the caller's clock instead of its own would be told apart.
SIM_CLOCK_BEHIND = timedelta(hours=5)


def effect(
    key: str = "k", tenant: str = "default", upstream: str = "shop", run_id: str | None = None
) -> NewEffect:
    """Return the effect both stores claim: a JSON basket to upstream ``upstream``, with a query."""
    return new_effect(
        key,
        tenant=tenant,
        upstream=upstream,
        query="a=1",
        request_headers={"Content-Type": "application/json"},
        request_body=BASKET,
        run_id=run_id,
        key_carriers=CARRIED,
    )


@dataclass
class Subject:
    store: Database
    # Moves every stored body ``days`` back in time, as tests/database.py's backdate_bodies does.
    backdate: Callable[[int], Awaitable[None]]
    # The database's own clock, read apart from any statement of the store.
    clock: Callable[[], Awaitable[datetime]]
    # Writes audit rows as given (id, created_at, tenant), as claims that raced could have left them.
    rows: Callable[[list[tuple[int, datetime, str]]], Awaitable[None]]


@pytest.fixture(params=["postgres", "simulated"])
def which(request: pytest.FixtureRequest) -> tuple[str, str | None]:
    """Only the Postgres half starts a database."""
    if request.param == "postgres":
        return "postgres", request.getfixturevalue("postgres_dsn")
    return "simulated", None


@pytest.fixture
async def subject(which: tuple[str, str | None]) -> AsyncIterator[Subject]:
    _, dsn = which
    if dsn is None:
        db = SimDatabase(clock=lambda: datetime.now(UTC) - SIM_CLOCK_BEHIND)

        async def sim_backdate(days: int) -> None:
            db.backdate_bodies(days)

        async def sim_clock() -> datetime:
            return db.now()

        async def sim_rows(rows: list[tuple[int, datetime, str]]) -> None:
            for id_, created_at, tenant in rows:
                db.rows[id_] = Row(
                    id=id_,
                    created_at=created_at,
                    tenant=tenant,
                    upstream="shop",
                    key=f"raced-{id_}",
                    derived_key="eg_raced",
                    method="POST",
                    path="/orders",
                    query="",
                    fingerprint="fp",
                    state=State.COMPLETED,
                    attempt=1,
                    may_have_sent=True,
                    lease_expires_at=None,
                    first_sent_at=None,
                    last_sent_at=None,
                    run_id=None,
                    step=None,
                    keyless=False,
                )

        yield Subject(SimStore(db), sim_backdate, sim_clock, sim_rows)
        return
    await empty_effects(dsn)

    async def pg_backdate(days: int) -> None:
        await backdate_bodies(dsn, days)

    async def pg_clock() -> datetime:
        conn = await asyncpg.connect(dsn)
        try:
            now: datetime = await conn.fetchval("select clock_timestamp()")
            return now
        finally:
            await conn.close()

    async def pg_rows(rows: list[tuple[int, datetime, str]]) -> None:
        conn = await asyncpg.connect(dsn)
        try:
            await conn.executemany(
                """insert into effects (id, created_at, scope, tenant, upstream, key, derived_key, method,
                                        path, fingerprint, state, may_have_sent)
                   values ($1::bigint, $2, effect_key_digest('raced-' || $1::bigint), $3, 'shop',
                           'raced-' || $1::bigint, 'eg_raced', 'POST', '/orders', 'fp', 'completed', true)""",
                rows,
            )
        finally:
            await conn.close()

    async with opened(dsn) as store:
        yield Subject(store, pg_backdate, pg_clock, pg_rows)


async def claimed(store: Database, key: str = "k", lease: timedelta = LEASE, **kw: str) -> EffectRecord:
    record, created = await store.claim(effect(key, **kw), lease)
    assert record is not None
    assert created
    return record


async def completed(store: Database, key: str = "k") -> EffectRecord:
    record = await claimed(store, key)
    assert await store.settle(record, DONE, response=OK, recovered_by=None) is not None
    return await store.reread(record)


# --- the claim -----------------------------------------------------------------------------------------


async def test_a_new_key_is_claimed_pending_at_attempt_one(subject: Subject) -> None:
    """The claim inserts a pending record holding attempt 1 under a lease, read with its (no) response."""
    record = await claimed(subject.store)
    assert (record.state, record.attempt, record.may_have_sent) == (State.PENDING, 1, False)
    assert record.response is None
    assert record.response_read
    assert record.read_at is not None
    assert record.lease_expires_at is not None
    assert abs(record.lease_expires_at - (record.read_at + LEASE)) < timedelta(seconds=1)
    assert record.first_sent_at is not None
    assert record.first_sent_at == record.last_sent_at
    assert (record.key, record.derived_key, record.fingerprint) == ("k", "eg_k", "fp")


async def test_a_known_key_reads_the_record_that_holds_it(subject: Subject) -> None:
    """A second claim of the key creates nothing and reads the record, with its response once stored."""
    first = await completed(subject.store)
    again, created = await subject.store.claim(effect(), LEASE)
    assert not created
    assert again is not None
    assert (again.id, again.state, again.attempt) == (first.id, State.COMPLETED, 1)
    assert again.response == OK
    other, created = await subject.store.claim(effect(tenant="other"), LEASE)
    assert created
    assert other is not None
    assert other.id != first.id


async def test_claims_that_arrive_together_each_get_their_own_record_and_a_key_only_one(
    subject: Subject,
) -> None:
    """Claims sent at once share statements; each new key gets its own record, a key claimed twice one."""
    keys = ["a", "b", "a", "c", "b", "d", "a"]
    claims = await asyncio.gather(*(subject.store.claim(effect(key), LEASE) for key in keys))
    records = {key: [] for key in keys}
    for key, (record, created) in zip(keys, claims, strict=True):
        assert record is not None
        assert record.key == key
        records[key].append((record.id, created))
    for key, claimed_as in records.items():
        assert len({effect_id for effect_id, _ in claimed_as}) == 1, key
        assert [created for _, created in claimed_as].count(True) == 1, key
    assert len({claimed_as[0][0] for claimed_as in records.values()}) == 4
    for key in records:
        again, created = await subject.store.claim(effect(key), LEASE)
        assert again is not None
        assert not created
        assert (again.state, again.attempt, again.request_body) == (State.PENDING, 1, None)


async def test_settles_that_arrive_together_are_each_fenced_on_their_own_record(subject: Subject) -> None:
    """Settles sent at once share statements: each stands or is fenced out by its own record alone."""
    store = subject.store
    fresh = [await claimed(store, key) for key in ("a", "b", "c")]
    stale = await claimed(store, "d", lease=EXPIRED)
    newer = await store.reclaim(stale, take_over(stale), LEASE, "test", sends=True)
    assert newer is not None
    results = await asyncio.gather(
        *(store.settle(record, DONE, response=OK, recovered_by=None) for record in fresh),
        store.settle(stale, DONE, response=OK, recovered_by=None),
        store.settle(newer, DONE, response=LATER, recovered_by=None),
        store.settle(fresh[0], DONE, response=LATER, recovered_by=None),
    )
    assert [r is not None for r in results] == [True, True, True, False, True, False]
    for record in fresh:
        final = await store.reread(record)
        assert (final.state, final.response) == (State.COMPLETED, OK)
    final = await store.reread(newer)
    assert (final.state, final.attempt, final.response) == (State.COMPLETED, 2, LATER)
    state_counts = await store.state_counts()
    assert state_counts[State.PENDING.value] == 0
    assert state_counts[State.COMPLETED.value] == 4


async def test_every_time_on_record_is_the_databases_clock(subject: Subject) -> None:
    """Claim, take-over and settle stamp their times, leases and history with the database's clock."""
    store = subject.store
    before = await subject.clock()
    record = await claimed(store, lease=EXPIRED)
    taken = await store.reclaim(record, take_over(record), LEASE, "native_key", sends=True)
    assert taken is not None
    done = await store.settle(taken, DONE, response=OK, recovered_by="native_key")
    assert done is not None
    after = await subject.clock()
    assert record.read_at is not None
    assert taken.read_at is not None
    assert done.read_at is not None
    assert before <= record.created_at <= record.read_at <= taken.read_at <= done.read_at <= after
    assert record.first_sent_at == record.created_at
    assert record.lease_expires_at == record.created_at + EXPIRED
    assert taken.last_sent_at is not None
    assert taken.lease_expires_at is not None
    assert record.created_at < taken.last_sent_at <= taken.read_at
    assert taken.lease_expires_at == taken.last_sent_at + LEASE
    assert done.completed_at is not None
    assert done.response_at == done.completed_at
    assert taken.read_at < done.completed_at <= done.read_at
    assert done.lease_expires_at == done.completed_at, "the answer ends the lease at the settle's clock"
    full = await store.get(record.id)
    assert full is not None
    stamped = [datetime.fromisoformat(entry["at"]) for entry in full.history]
    assert stamped == sorted(stamped)
    assert before <= stamped[0]
    assert stamped[-1] <= after


# --- fences --------------------------------------------------------------------------------------------


async def test_only_the_current_attempt_may_settle(subject: Subject) -> None:
    """After a take-over the older attempt's settle is refused and the newer one's stands."""
    store = subject.store
    first = await claimed(store, lease=EXPIRED)
    second = await store.reclaim(first, take_over(first), LEASE, "test", sends=True)
    assert second is not None
    assert second.attempt == 2
    assert await store.settle(second, DONE, response=LATER, recovered_by=None) is not None
    assert await store.settle(first, DONE, response=OK, recovered_by=None) is None
    assert await store.reclaim(first, take_over(first), LEASE, "test", sends=True) is None
    final = await store.reread(first)
    assert final.response == LATER


async def test_a_take_over_from_a_stale_read_is_fenced_by_state(subject: Subject) -> None:
    """A late holder completes at its own attempt; another request that read the record pending cannot
    take over."""
    store = subject.store
    record = await claimed(store, lease=EXPIRED)
    done = await store.settle(record, DONE, response=OK, recovered_by=None)
    assert done is not None
    assert done.attempt == record.attempt
    assert await store.reclaim(record, take_over(record), LEASE, "t", sends=True) is None
    assert await store.send_to_review(record, review(record), "t") is None
    assert (await store.reread(record)).state is State.COMPLETED


async def test_of_two_take_overs_from_one_read_only_the_first_holds(subject: Subject) -> None:
    """Two gateways that read the same in-doubt record: one takes it over, the other's take-over, review
    and settle are refused, and the record is the winner's."""
    store = subject.store
    record = await claimed(store, lease=EXPIRED)
    doubt = await store.settle(record, TIMED_OUT, response=None, recovered_by=None)
    assert doubt is not None
    first = await store.reclaim(doubt, take_over(doubt), LEASE, "native_key", sends=True)
    assert first is not None
    assert (first.state, first.attempt, first.may_have_sent) == (State.PENDING, 2, True)
    assert await store.reclaim(doubt, take_over(doubt), LEASE, "native_key", sends=True) is None
    assert await store.send_to_review(doubt, review(doubt), "nothing can tell") is None
    assert await store.resolve(doubt, Transition(State.IN_DOUBT, State.RETRYABLE), None, "op") is None
    now = await store.reread(record)
    assert (now.state, now.attempt, now.lease_expires_at) == (State.PENDING, 2, first.lease_expires_at)


async def test_a_move_from_another_state_than_the_one_read_raises(subject: Subject) -> None:
    """A write whose transition does not start from the state the record was read in is a bug: it raises."""
    record = await claimed(subject.store)
    with pytest.raises(ValueError, match="asked of a record in pending"):
        await subject.store.reclaim(record, Transition(State.IN_DOUBT, State.PENDING), LEASE, "t", sends=True)


async def test_taking_over_an_expired_pending_record_adds_doubt_and_renewing_does_not(
    subject: Subject,
) -> None:
    """A pending record whose lease ran out may have been sent; the holder renewing its own adds nothing."""
    store = subject.store
    mine = await claimed(store, "renewed", lease=EXPIRED)
    renewed = await store.reclaim(mine, take_over(mine), LEASE, "late to send", sends=True, renew=True)
    assert renewed is not None
    assert (renewed.attempt, renewed.may_have_sent) == (2, False)
    theirs = await claimed(store, "taken", lease=EXPIRED)
    taken = await store.reclaim(theirs, take_over(theirs), LEASE, "native_key", sends=True)
    assert taken is not None
    assert (taken.state, taken.attempt, taken.may_have_sent) == (State.PENDING, 2, True)
    assert taken.lease_expires_at is not None
    assert taken.read_at is not None
    assert taken.lease_expires_at > taken.read_at
    assert taken.first_sent_at == theirs.first_sent_at


async def test_a_take_over_of_a_retryable_record_adds_no_doubt(subject: Subject) -> None:
    """Nothing happened upstream for a retryable record: taking it over leaves may_have_sent false."""
    store = subject.store
    record = await claimed(store)
    refused = await store.settle(
        record, settle(NotSent("refused"), earlier_doubt=False), response=None, recovered_by=None
    )
    assert refused is not None
    assert refused.state is State.RETRYABLE
    again = await store.reclaim(refused, take_over(refused), LEASE, "retryable", sends=True)
    assert again is not None
    assert (again.state, again.attempt, again.may_have_sent) == (State.PENDING, 2, False)


async def test_a_probe_take_over_keeps_the_send_times(subject: Subject) -> None:
    """A take-over that only probes leaves last_sent_at as it was; one that sends moves it."""
    store = subject.store
    record = await claimed(store, lease=EXPIRED)
    probing = await store.reclaim(record, take_over(record), EXPIRED, "probe", sends=False)
    assert probing is not None
    assert probing.last_sent_at == record.last_sent_at
    sending = await store.reclaim(probing, take_over(probing), LEASE, "the probe found nothing", sends=True)
    assert sending is not None
    assert sending.last_sent_at is not None
    assert record.last_sent_at is not None
    assert sending.last_sent_at > record.last_sent_at


async def test_the_claim_records_what_carried_the_key_and_the_lease(subject: Subject) -> None:
    """The claim keeps what carried the effect's key and the lease its attempt was given, and every read
    of the record gives them back."""
    store = subject.store
    record = await claimed(store)
    assert (record.key_carriers, record.send_lease) == (CARRIED, LEASE)
    again, created = await store.claim(effect(), timedelta(seconds=1))
    assert again is not None
    assert not created
    assert (again.key_carriers, again.send_lease) == (CARRIED, LEASE)
    kept = await store.get(record.id)
    assert kept is not None
    assert (kept.key_carriers, kept.send_lease) == (CARRIED, LEASE)
    keyless, _ = await store.claim(replace(effect("keyless"), key_carriers=KeyCarriers()), LEASE)
    assert keyless is not None
    assert keyless.key_carriers == KeyCarriers()


async def test_a_take_over_that_sends_records_its_lease_and_carriers_and_a_probe_keeps_them(
    subject: Subject,
) -> None:
    """A take-over that sends records the lease it was given and what carries the key as told (unknown
    when not told); one that only probes leaves both as they were."""
    store = subject.store
    record = await claimed(store, lease=EXPIRED)
    probing = await store.reclaim(
        record, take_over(record), LEASE, "probe", sends=False, carriers=KeyCarriers()
    )
    assert probing is not None
    assert (probing.key_carriers, probing.send_lease) == (CARRIED, EXPIRED)
    stamped = KeyCarriers(None, ("json_field", "client_reference"))
    longer = timedelta(minutes=5)
    sending = await store.reclaim(
        probing, take_over(probing), longer, "native_key", sends=True, renew=True, carriers=stamped
    )
    assert sending is not None
    assert (sending.key_carriers, sending.send_lease) == (stamped, longer)
    settled = await store.settle(sending, TIMED_OUT, response=None, recovered_by=None)
    assert settled is not None
    assert (settled.key_carriers, settled.send_lease) == (stamped, longer)
    unknown = await store.reclaim(settled, take_over(settled), LEASE, "harmless", sends=True)
    assert unknown is not None
    assert (unknown.key_carriers, unknown.send_lease) == (None, LEASE)


async def test_a_take_over_that_sends_reads_back_the_request_it_was_claimed_with(subject: Subject) -> None:
    """A take-over that sends returns the request body the effect was claimed with, to send it again; one
    that only probes does not read it; and after the retention carried it forward it is still there."""
    store = subject.store
    record = await claimed(store, lease=EXPIRED)
    assert record.request_body is None
    probing = await store.reclaim(record, take_over(record), EXPIRED, "probe", sends=False)
    assert probing is not None
    assert probing.request_body is None
    await subject.backdate(10)
    await store.maintain(RETENTION)  # the effect is open: its request is carried into today
    sending = await store.reclaim(probing, take_over(probing), LEASE, "native_key", sends=True)
    assert sending is not None
    assert sending.request_body == BASKET
    assert "request" not in sending.unreadable


async def test_a_row_from_before_the_carriers_were_recorded_reads_as_unknown(subject: Subject) -> None:
    """A row written without what carried its key and its attempt's lease (by a gateway before migration
    015) reads with neither, never as a row that carried nothing."""
    store = subject.store
    created = await subject.clock()
    await subject.rows([(1000, created, "default")])
    record = await store.get(1000)
    assert record is not None
    assert (record.key_carriers, record.send_lease) == (None, None)


# --- settle --------------------------------------------------------------------------------------------


async def test_settle_with_a_response_stores_it_for_replay_and_ends_the_lease(subject: Subject) -> None:
    """A completed attempt's response is replayed byte for byte, and its lease is over."""
    store = subject.store
    record = await claimed(store)
    saved = await store.settle(record, DONE, response=OK, recovered_by="native_key", note="answered 201")
    assert saved is not None
    assert (saved.state, saved.attempt, saved.may_have_sent) == (State.COMPLETED, 1, True)
    assert saved.response_status == 201
    assert saved.recovered_by == "native_key"
    assert saved.completed_at is not None
    assert saved.lease_expires_at is not None
    assert saved.read_at is not None
    assert saved.lease_expires_at <= saved.read_at
    again = await store.reread(record)
    assert again.response == OK
    assert not again.purged


async def test_settle_without_a_response_keeps_the_lease_of_a_call_that_may_still_run(
    subject: Subject,
) -> None:
    """A timeout leaves the record in doubt with no response, its lease still running."""
    store = subject.store
    record = await claimed(store)
    saved = await store.settle(record, TIMED_OUT, response=None, recovered_by=None, note="timed out")
    assert saved is not None
    assert (saved.state, saved.may_have_sent) == (State.IN_DOUBT, True)
    assert saved.lease_expires_at == record.lease_expires_at
    again = await store.reread(record)
    assert (again.response, again.response_status) == (None, None)
    assert not again.purged


async def test_a_fenced_out_holder_adds_to_the_history_only(subject: Subject) -> None:
    """note_fenced appends what the holder saw and changes nothing else."""
    store = subject.store
    record = await claimed(store, lease=EXPIRED)
    newer = await store.reclaim(record, take_over(record), LEASE, "t", sends=True)
    assert newer is not None
    await store.note_fenced(record, "answered 201")
    full = await store.get(record.id)
    assert full is not None
    assert (full.state, full.attempt) == (State.PENDING, 2)
    assert [e["event"] for e in full.history] == ["claimed", "reclaimed", "fenced"]
    assert (full.history[-1]["attempt"], full.history[-1]["saw"]) == (1, "answered 201")


async def test_send_to_review_is_fenced_and_fences_out_the_holder(subject: Subject) -> None:
    """Review keeps the attempt an operator judges, and the holder of that attempt can no longer settle."""
    store = subject.store
    record = await claimed(store, lease=EXPIRED)
    reviewed = await store.send_to_review(record, review(record), "nothing can tell")
    assert reviewed is not None
    assert (reviewed.state, reviewed.attempt) == (State.NEEDS_REVIEW, 1)
    assert await store.send_to_review(record, review(record), "again") is None
    assert await store.settle(record, DONE, response=OK, recovered_by=None) is None
    assert (await store.reread(record)).state is State.NEEDS_REVIEW


async def test_a_probe_that_failed_puts_a_take_over_back_in_doubt(subject: Subject) -> None:
    """after_probe's verdict is written like any settle, under the take-over's attempt."""
    store = subject.store
    record = await claimed(store, lease=EXPIRED)
    probing = await store.reclaim(record, take_over(record), LEASE, "probe", sends=False)
    assert probing is not None
    assert probing.read_at is not None
    verdict = after_probe(probing, ProbeError("down"), probing.read_at, Policy(lease=LEASE, has_probe=True))
    assert isinstance(verdict, Settlement)
    saved = await store.settle(probing, verdict, response=None, recovered_by=None)
    assert saved is not None
    assert (saved.state, saved.attempt, saved.may_have_sent) == (State.IN_DOUBT, 2, True)


async def test_a_probe_that_found_the_effect_completes_the_take_over_with_its_answer(
    subject: Subject,
) -> None:
    """after_probe's Found is written under the take-over: completed, by the probe, its answer replayed."""
    store = subject.store
    record = await claimed(store, lease=EXPIRED)
    probing = await store.reclaim(record, take_over(record), LEASE, "probe", sends=False)
    assert probing is not None
    assert probing.read_at is not None
    verdict = after_probe(probing, Found(OK), probing.read_at, Policy(lease=LEASE, has_probe=True))
    assert isinstance(verdict, Settlement)
    saved = await store.settle(probing, verdict, response=OK, recovered_by="probe", note="found by probe")
    assert saved is not None
    assert (saved.state, saved.attempt, saved.recovered_by) == (State.COMPLETED, 2, "probe")
    assert (await store.reread(record)).response == OK


async def test_a_probe_that_found_nothing_sends_under_a_re_take_or_goes_to_review(subject: Subject) -> None:
    """Within the horizon, "not found" re-takes the record (a fresh lease, its clock) and sends; past the
    horizon less a lease, as read at that re-take, it goes to review."""
    store = subject.store
    lease = timedelta(seconds=1)
    for key, horizon, sends in (("young", timedelta(hours=1), True), ("old", timedelta(seconds=1), False)):
        record = await claimed(store, key, lease=EXPIRED)
        probing = await store.reclaim(record, take_over(record), lease, "probe", sends=False)
        assert probing is not None
        again = await store.reclaim(
            probing,
            take_over(probing),
            lease,
            "the probe found nothing",
            sends=True,
            renew=True,
            carriers=CARRIED,
        )
        assert again is not None
        assert (again.attempt, again.may_have_sent) == (3, True)
        assert again.read_at is not None
        assert probing.read_at is not None
        assert again.read_at > probing.read_at
        probed = Policy(
            lease=lease, has_probe=True, probe_horizon=horizon, probe_routes=ORDERS, key_carriers=CARRIED
        )
        verdict = after_probe(again, NotFound(), probing.read_at, probed, retaken_at=again.read_at)
        assert isinstance(verdict, Send) == sends
        if isinstance(verdict, Settlement):
            saved = await store.settle(again, verdict, response=None, recovered_by=None)
            assert saved is not None
            assert (saved.state, saved.attempt) == (State.NEEDS_REVIEW, 3)
            assert await store.settle(probing, DONE, response=OK, recovered_by=None) is None


async def test_a_probe_too_soon_after_an_answer_waits_from_that_answer_and_not_again(
    subject: Subject,
) -> None:
    """The lag is read from the latest answer's time at the probe's take-over; the wait leaves it as it was.

    The take-over to probe keeps the send times; so does putting the record back in doubt: every probe
    in between judges the lag from the same answer, and waiting it out ends.
    """
    store = subject.store
    lagged = Policy(lease=LEASE, has_probe=True, probe_lag=timedelta(hours=1))
    record = await claimed(store, lease=EXPIRED)
    failed = settle(Answered(500, (), b"{}"), earlier_doubt=False)
    answered = await store.settle(record, failed, response=StoredResponse(500, (), b"{}"), recovered_by=None)
    assert answered is not None
    assert answered.response_at is not None
    assert answered.last_sent_at is not None
    assert answered.response_at >= answered.last_sent_at
    for attempt in (2, 3):
        probing = await store.reclaim(answered, take_over(answered), LEASE, "probe", sends=False)
        assert probing is not None
        assert probing.attempt == attempt
        assert (probing.last_sent_at, probing.response_at) == (answered.last_sent_at, answered.response_at)
        assert probing.read_at is not None
        early = after_probe(probing, NotFound(), probing.read_at, lagged)
        assert isinstance(early, TooSoon)
        assert early.retry_after == answered.response_at + timedelta(hours=1) - probing.read_at
        back = await store.settle(probing, early.settlement, response=None, recovered_by=None)
        assert back is not None
        assert (back.state, back.lease_expires_at is not None) == (State.IN_DOUBT, True)
        assert back.lease_expires_at is not None
        assert back.read_at is not None
        assert back.lease_expires_at <= back.read_at  # the next request probes at once, no lease to wait
        answered = back


# --- operators -----------------------------------------------------------------------------------------


async def test_an_operator_cannot_resolve_while_a_lease_runs(subject: Subject) -> None:
    """The store refuses a verdict on a record whose lease runs: the upstream may still act on it."""
    store = subject.store
    record = await claimed(store)
    assert await store.resolve(record, Transition(State.PENDING, State.RETRYABLE), None, "op") is None
    assert (await store.reread(record)).state is State.PENDING


async def test_an_operator_verdict_that_it_happened_completes_with_the_response(subject: Subject) -> None:
    """Resolved as happened: completed by the operator, the response replayed, under the attempt judged."""
    store = subject.store
    record = await claimed(store, lease=EXPIRED)
    resolved = await store.resolve(record, Transition(State.PENDING, State.COMPLETED), OK, "op")
    assert resolved is not None
    assert (resolved.state, resolved.attempt, resolved.may_have_sent) == (State.COMPLETED, 1, True)
    assert resolved.recovered_by == "operator"
    again = await store.reread(record)
    assert again.response == OK
    full = await store.get(record.id)
    assert full is not None
    assert full.history[-1]["event"] == "resolved"
    last = full.history[-1]
    assert (last["attempt"], last["happened"], last["by"], last["was"]) == (1, True, "op", "pending")


async def test_an_operator_verdict_that_it_did_not_happen_makes_it_retryable(subject: Subject) -> None:
    """Resolved as not happened: retryable, no doubt left, no response."""
    store = subject.store
    record = await claimed(store, lease=EXPIRED)
    reviewed = await store.send_to_review(record, review(record), "t")
    assert reviewed is not None
    resolved = await store.resolve(reviewed, Transition(State.NEEDS_REVIEW, State.RETRYABLE), None, "op")
    assert resolved is not None
    assert (resolved.state, resolved.may_have_sent, resolved.response_status) == (
        State.RETRYABLE,
        False,
        None,
    )
    assert resolved.completed_at is None


async def test_an_operator_resolves_a_pending_record_only_once_its_lease_is_over(subject: Subject) -> None:
    """A pending record whose holder died is resolved once its lease ran out, as "did not happen" too."""
    store = subject.store
    alive = await claimed(store, "alive")
    assert await store.resolve(alive, Transition(State.PENDING, State.RETRYABLE), None, "op") is None
    dead = await claimed(store, "dead", lease=EXPIRED)
    resolved = await store.resolve(dead, Transition(State.PENDING, State.RETRYABLE), None, "op")
    assert resolved is not None
    assert (resolved.state, resolved.attempt, resolved.may_have_sent) == (State.RETRYABLE, 1, False)
    assert resolved.recovered_by == "operator"
    assert await store.settle(dead, DONE, response=OK, recovered_by=None) is None, "the holder is fenced out"


async def test_an_operator_waits_for_the_lease_of_a_call_in_doubt(subject: Subject) -> None:
    """A timed-out call keeps its lease: no verdict on it until the lease is over, then one is taken."""
    store = subject.store
    running = await claimed(store, "running")
    in_doubt = await store.settle(running, TIMED_OUT, response=None, recovered_by=None)
    assert in_doubt is not None
    assert await store.resolve(in_doubt, Transition(State.IN_DOUBT, State.COMPLETED), OK, "op") is None
    over = await claimed(store, "over", lease=EXPIRED)
    expired = await store.settle(over, TIMED_OUT, response=None, recovered_by=None)
    assert expired is not None
    resolved = await store.resolve(expired, Transition(State.IN_DOUBT, State.COMPLETED), OK, "op")
    assert resolved is not None
    assert resolved.state is State.COMPLETED
    assert (await store.reread(over)).response == OK


async def test_an_operator_verdict_is_fenced_by_the_attempt_read(subject: Subject) -> None:
    """A verdict on a stale read of the record is refused."""
    store = subject.store
    record = await claimed(store, lease=EXPIRED)
    newer = await store.reclaim(record, take_over(record), EXPIRED, "t", sends=True)
    assert newer is not None
    assert await store.resolve(record, Transition(State.PENDING, State.RETRYABLE), None, "op") is None
    assert await store.resolve(newer, Transition(State.PENDING, State.RETRYABLE), None, "op") is not None


# --- replays and retention -----------------------------------------------------------------------------


async def test_replays_are_counted_in_batches(subject: Subject) -> None:
    """add_replays adds each count to its effect, and counts for no effect are dropped."""
    store = subject.store
    one = await completed(store, "one")
    two = await completed(store, "two")
    await store.add_replays({one.row_key: 3, two.row_key: 1})
    await store.add_replays({one.row_key: 2})
    await store.add_replays({})
    # No such effect, the same id in another partition (another creation time), and in another scope:
    # nothing to count.
    await store.add_replays(
        {
            (two.id + 100, two.created_at, two.scope): 7,
            (one.id, one.created_at - timedelta(days=1), one.scope): 9,
            (one.id, one.created_at, two.scope): 11,
        }
    )
    assert (await store.reread(one)).replays == 5
    assert (await store.reread(two)).replays == 1


async def test_the_retention_purges_a_completed_response_and_keeps_the_row(subject: Subject) -> None:
    """After the retention a completed effect keeps its audit row and loses its bodies: it reads purged."""
    store = subject.store
    record = await completed(store)
    assert not (await store.reread(record)).purged
    await store.maintain(RETENTION)
    assert not (await store.reread(record)).purged, "nothing is dropped within the retention"
    await subject.backdate(10)
    await store.maintain(RETENTION)
    after = await store.reread(record)
    assert after.purged
    assert (after.state, after.response_status) == (State.COMPLETED, 201)
    full = await store.get(record.id)
    assert full is not None
    assert full.request_body is None
    assert [e["event"] for e in full.history] == ["claimed", "settled"]


async def test_the_retention_drops_whole_days_only(subject: Subject) -> None:
    """A body older than the retention stays while its day is not wholly older; then the whole day goes."""
    store = subject.store
    record = await completed(store)
    await subject.backdate(RETENTION.days)  # just past the retention, in a day that ends after it
    assert await store.maintain(RETENTION) == []
    assert not (await store.reread(record)).purged
    await subject.backdate(1)
    dropped = await store.maintain(RETENTION)
    cutoff = await subject.clock() - RETENTION
    assert dropped
    assert all(day.upper <= cutoff for day in dropped)
    assert (await store.reread(record)).purged


async def test_a_purged_effect_keeps_its_key(subject: Subject) -> None:
    """After the retention the key still names the effect: a claim reads it, purged, and creates nothing."""
    store = subject.store
    record = await completed(store)
    await subject.backdate(10)
    await store.maintain(RETENTION)
    again, created = await store.claim(effect(), LEASE)
    assert not created
    assert again is not None
    assert (again.id, again.state, again.response, again.purged) == (record.id, State.COMPLETED, None, True)


async def test_the_retention_carries_the_bodies_of_open_effects_forward(subject: Subject) -> None:
    """An effect still open keeps its request (and the response it has) past the retention."""
    store = subject.store
    doubt = await claimed(store, "doubt")
    oops = StoredResponse(500, (), b'{"error": "' + b"the shop is busy, " * 10 + b'"}')
    failed = settle(Answered(oops.status, oops.headers, oops.body), earlier_doubt=False)
    assert await store.settle(doubt, failed, response=oops, recovered_by=None)
    waiting = await claimed(store, "waiting")
    await subject.backdate(10)
    await store.maintain(RETENTION)
    for record in (doubt, waiting):
        full = await store.get(record.id)
        assert full is not None
        assert full.request_body == BASKET
        assert full.request_headers == {"Content-Type": "application/json"}
    kept = await store.reread(doubt)
    assert kept.response == oops


async def test_the_retention_never_passes_an_earlier_answer_off_as_the_attempt_under_ways(
    subject: Subject,
) -> None:
    """An earlier attempt's answer is not carried past the retention: a probe's lag still counts from the
    attempt under way's lease, not from when the retention ran (which would trust a lagging search early).
    """
    store = subject.store
    lagged = Policy(lease=LEASE, has_probe=True, probe_lag=timedelta(seconds=5))
    record = await claimed(store, lease=EXPIRED)
    failed = settle(Answered(500, (), b"busy"), earlier_doubt=False)
    answered = await store.settle(
        record, failed, response=StoredResponse(500, (), b"busy"), recovered_by=None
    )
    assert answered is not None
    await subject.backdate(10)
    sending = await store.reclaim(
        await store.reread(answered), take_over(answered), LEASE, "probe", sends=True
    )
    assert sending is not None
    assert sending.last_sent_at is not None
    await store.maintain(RETENTION)  # while the new attempt is under way
    now = await store.reread(sending)
    assert now.response is None
    probed_at = sending.last_sent_at + timedelta(seconds=1)
    early = after_probe(now, NotFound(), probed_at, lagged)
    assert isinstance(early, TooSoon)
    assert early.retry_after == sending.last_sent_at + LEASE + timedelta(seconds=5) - probed_at
    full = await store.get(record.id)
    assert full is not None
    assert full.request_body == BASKET  # what it asked for is carried


async def test_restore_puts_back_only_a_purged_response(subject: Subject) -> None:
    """A probe's answer replaces nothing that is still stored; after the purge it is replayed."""
    store = subject.store
    record = await completed(store)
    fresh = await store.reread(record)
    kept, restored = await store.restore(fresh, Transition(State.COMPLETED, State.COMPLETED), LATER)
    assert (kept.response, restored) == (OK, False)
    assert (await store.reread(record)).response == OK
    await subject.backdate(10)
    await store.maintain(RETENTION)
    purged = await store.reread(record)
    assert purged.purged
    put_back, restored = await store.restore(purged, Transition(State.COMPLETED, State.COMPLETED), LATER)
    assert (put_back.response, restored) == (LATER, True)
    again = await store.reread(record)
    assert again.response == LATER
    assert again.state is State.COMPLETED
    assert put_back.response_at == again.response_at  # the retention of the copy counts from here


async def test_a_second_restore_of_one_purge_returns_the_first_ones_answer(subject: Subject) -> None:
    """Two requests that read the same purge and restore it: the first answer stays, both are given it."""
    store = subject.store
    record = await completed(store)
    await subject.backdate(10)
    await store.maintain(RETENTION)
    purged = await store.reread(record)
    same = Transition(State.COMPLETED, State.COMPLETED)
    first, restored_first = await store.restore(purged, same, LATER)
    second, restored_second = await store.restore(purged, same, OK)
    assert (restored_first, restored_second) == (True, False)
    assert first.response == second.response == LATER
    assert (await store.reread(record)).response == LATER
    full = await store.get(record.id)
    assert full is not None
    assert [event["event"] for event in full.history].count("restored") == 1


# --- reading -------------------------------------------------------------------------------------------


async def test_get_returns_the_whole_effect_and_hides_other_tenants(subject: Subject) -> None:
    """get reads request, response and history; a tenant sees only its own effects."""
    store = subject.store
    record = await completed(store)
    full = await store.get(record.id)
    assert full is not None
    assert full.request_body == BASKET
    assert full.request_headers == {"Content-Type": "application/json"}
    assert full.response == OK
    claim = full.history[0]
    assert (claim["event"], claim["attempt"]) == ("claimed", 1)
    assert datetime.fromisoformat(claim["at"]) == full.created_at
    assert [event["event"] for event in full.history].count("claimed") == 1
    assert (await store.get(record.id, tenant="default")) is not None
    assert (await store.get(record.id, tenant="other")) is None
    assert (await store.get(record.id + 1000)) is None


async def test_find_filters_and_pages_newest_first(subject: Subject) -> None:
    """find applies each filter given and pages newest first."""
    store = subject.store
    a = await completed(store, "a")
    b = await claimed(store, "b", run_id="run-1")
    c = await claimed(store, "c", tenant="other", upstream="mail")
    ids = [r.id for r in await store.find(EffectFilter())]
    assert ids == [c.id, b.id, a.id]
    assert [r.id for r in await store.find(EffectFilter(state=State.PENDING))] == [c.id, b.id]
    assert [r.id for r in await store.find(EffectFilter(state=State.COMPLETED))] == [a.id]
    assert [r.id for r in await store.find(EffectFilter(tenant="other"))] == [c.id]
    assert [r.id for r in await store.find(EffectFilter(upstream="shop"))] == [b.id, a.id]
    assert [r.id for r in await store.find(EffectFilter(run_id="run-1"))] == [b.id]
    assert [r.id for r in await store.find(EffectFilter(key="a"))] == [a.id]
    assert [r.id for r in await store.find(EffectFilter(before_id=c.id, limit=1))] == [b.id]
    assert await store.find(EffectFilter(since=datetime.now(UTC) + timedelta(days=1))) == []
    assert [r.id for r in await store.find(EffectFilter(since=b.created_at))] == [c.id, b.id]
    assert [r.id for r in await store.find(EffectFilter(until=c.created_at))] == [b.id, a.id]
    assert [r.id for r in await store.find(EffectFilter(since=b.created_at, until=c.created_at))] == [b.id]
    assert [
        r.id for r in await store.find(EffectFilter(since=a.created_at, until=c.created_at, limit=1))
    ] == [b.id]
    assert [r.id for r in await store.find(EffectFilter(until=b.created_at, upstream="shop"))] == [a.id]
    # A cursor after the span's end gives the span's first page: the end still bounds it.
    assert [r.id for r in await store.find(EffectFilter(until=b.created_at, before_id=c.id))] == [a.id]
    late = EffectFilter(until=b.created_at, before_id=c.id, upstream="shop")
    assert [r.id for r in await store.find(late)] == [a.id]
    # An open state with each other filter: the state's list, or the run's rows with their state checked.
    with_state = [
        ({"upstream": "mail"}, [c.id]),
        ({"run_id": "run-1"}, [b.id]),
        ({"run_id": "run-1", "tenant": "other"}, []),
        ({"since": c.created_at}, [c.id]),
        ({"until": c.created_at}, [b.id]),
        ({"tenant": "other", "upstream": "shop"}, []),
        ({"tenant": "default", "upstream": "shop", "before_id": c.id}, [b.id]),
        ({"tenant": "default", "upstream": "shop", "before_id": b.id}, []),
        ({"upstream": "shop", "before_id": c.id}, [b.id]),
        ({"upstream": "shop", "before_id": b.id}, []),
        ({"upstream": "mail", "until": c.created_at}, []),
        ({"until": b.created_at, "before_id": c.id}, []),
        ({"tenant": "other", "before_id": c.id + 1}, [c.id]),
    ]
    for given, expected in with_state:
        assert [r.id for r in await store.find(EffectFilter(state=State.PENDING, **given))] == expected, given
    assert await store.find(EffectFilter(state=State.COMPLETED, run_id="run-1")) == []
    page = await store.find(EffectFilter(limit=2))
    assert [r.id for r in page] == [c.id, b.id]
    assert not page[0].response_read


async def test_pages_of_a_span_show_each_effect_once_newest_first_when_ids_and_times_disagree(
    subject: Subject,
) -> None:
    """Paging through a span of time, or the whole audit, with each answer's last id as ``before`` shows
    every effect in it exactly once, newest by creation time first, though claims that raced took ids out
    of the order of their times (and some at one instant); a tenant pages through its own alike."""
    base = await subject.clock() + timedelta(seconds=1)
    rows = []
    for i in range(1, 41):
        at = base + timedelta(milliseconds=10 * i)
        if i % 3 == 0:  # claimed just before the one before it, its id taken after
            at -= timedelta(milliseconds=15)
        if i % 7 == 0:  # the same instant as the one before it
            at = rows[-1][1]
        rows.append((i, at, "other" if i % 4 == 0 else "default"))
    await subject.rows(rows)
    newest_first = sorted(rows, key=lambda row: (row[1], row[0]), reverse=True)
    end = base + timedelta(hours=1)
    for since, until in ((base, end), (base, None), (None, end), (None, None)):
        for tenant in (None, "default"):
            seen = await paged(subject.store, EffectFilter(tenant=tenant, since=since, until=until, limit=3))
            assert seen == [id_ for id_, _, who in newest_first if tenant in (None, who)], (
                since,
                until,
                tenant,
            )
    with pytest.raises(CursorUnknown):  # no such effect
        await subject.store.find(EffectFilter(since=base, before_id=1000))
    with pytest.raises(CursorUnknown):  # another tenant's
        await subject.store.find(EffectFilter(tenant="default", since=base, before_id=4))
    # A cursor before the span: a next link of since=1h followed later, when its span has moved on.
    # The page is empty; it is not refused.
    assert await subject.store.find(EffectFilter(since=rows[20][1], before_id=1)) == []
    with pytest.raises(CursorUnknown):  # another tenant's, on a tenant's page of the whole audit
        await subject.store.find(EffectFilter(tenant="default", before_id=4))
    # Another tenant's cursor with its time given (a reader of both tenants' pages, gateway.scopes):
    # the page goes on from that place in the order, without looking the cursor up.
    given = EffectFilter(tenant="default", before_id=4, before_at=rows[3][1], limit=50)
    older = [id_ for id_, at, who in newest_first if who == "default" and (at, id_) < (rows[3][1], 4)]
    assert [r.id for r in await subject.store.find(given)] == older


async def test_a_tenants_page_of_an_open_state_pages_on_past_an_effect_that_left_it(subject: Subject) -> None:
    """A tenant's list of its pending effects pages newest first with the last one's id as ``before``,
    each shown once, though an operator settled that last one (it left the list) before the next page was
    asked for; any id serves as ``before`` there, another tenant's too, and lists none of theirs."""
    store = subject.store
    older = await claimed(store, "theirs-older", tenant="other")
    mine = [await claimed(store, f"open-{i}") for i in range(7)]
    theirs = await claimed(store, "theirs", tenant="other")
    await completed(store, "done")
    pending = EffectFilter(tenant="default", state=State.PENDING, limit=3)
    first = await store.find(pending)
    assert [r.id for r in first] == [r.id for r in mine[6:3:-1]]
    assert await store.settle(first[-1], DONE, response=OK, recovered_by=None) is not None
    rest = await paged(store, replace(pending, before_id=first[-1].id))
    assert [r.id for r in first] + rest == [r.id for r in reversed(mine)]
    # Read by id, the list needs of its cursor only the number (a page by time refuses another tenant's).
    past_theirs = await paged(store, replace(pending, before_id=theirs.id))
    assert past_theirs == [r.id for r in reversed(mine) if r.id != first[-1].id]
    assert [r.id for r in await store.find(replace(pending, tenant="other"))] == [theirs.id, older.id]


async def paged(store: Database, where: EffectFilter) -> list[int]:
    """The ids of every page from ``where`` on, each next page before the last one's last effect."""
    seen: list[int] = []
    for _ in range(1000):  # more pages than any test has effects: it went round in circles
        page = await store.find(where)
        seen += [r.id for r in page]
        if len(page) < where.limit:
            return seen
        where = replace(where, before_id=page[-1].id)
    raise AssertionError(f"still paging after 1000 pages: {seen[:20]}...")


async def test_state_counts_count_every_state(subject: Subject) -> None:
    """state_counts has every state; a tenant's counts leave completed out."""
    store = subject.store
    await completed(store, "a")
    await claimed(store, "b")
    doubt = await claimed(store, "c", tenant="other")
    assert await store.settle(doubt, TIMED_OUT, response=None, recovered_by=None)
    counts = await store.state_counts()
    assert counts == {"pending": 1, "completed": 1, "retryable": 0, "in_doubt": 1, "needs_review": 0}
    assert await store.state_counts("other") == {
        "pending": 0,
        "retryable": 0,
        "in_doubt": 1,
        "needs_review": 0,
    }


async def test_an_effect_is_listed_and_counted_under_the_state_it_is_in_after_every_move(
    subject: Subject,
) -> None:
    """Through claim, doubt, take-over, review, a verdict and completion, find and counts follow each move."""
    store = subject.store
    await completed(store, "done")

    async def where(record: EffectRecord, state: State) -> None:
        listed = {s: [r.id for r in await store.find(EffectFilter(state=s))] for s in State}
        assert {s for s, ids in listed.items() if record.id in ids} == {state}
        counts = await store.state_counts()
        assert counts[state.value] == (2 if state is State.COMPLETED else 1)
        tenant = await store.state_counts("default")
        assert sum(tenant.values()) == (0 if state is State.COMPLETED else 1)

    record = await claimed(store, "moved", lease=EXPIRED)
    await where(record, State.PENDING)
    doubt = await store.settle(record, TIMED_OUT, response=None, recovered_by=None)
    assert doubt is not None
    await where(doubt, State.IN_DOUBT)
    doubt = await store.reread(doubt)
    again = await store.reclaim(doubt, take_over(doubt), EXPIRED, "probe", sends=False)
    assert again is not None
    await where(again, State.PENDING)
    renewed = await store.reclaim(again, take_over(again), EXPIRED, "renew", sends=False, renew=True)
    assert renewed is not None
    await where(renewed, State.PENDING)
    reviewed = await store.send_to_review(renewed, review(renewed), "nothing can tell")
    assert reviewed is not None
    await where(reviewed, State.NEEDS_REVIEW)
    retry = await store.resolve(reviewed, Transition(State.NEEDS_REVIEW, State.RETRYABLE), None, "op")
    assert retry is not None
    await where(retry, State.RETRYABLE)
    sending = await store.reclaim(retry, take_over(retry), LEASE, "retry", sends=True)
    assert sending is not None
    done = await store.settle(sending, DONE, response=OK, recovered_by=None)
    assert done is not None
    await where(done, State.COMPLETED)


async def test_the_key_secret_is_stable_and_ping_answers(subject: Subject) -> None:
    """The secret of derived keys is the same on every read; ping answers while the database is up."""
    await subject.store.ping()
    first = await subject.store.key_secret()
    assert isinstance(first, bytes)
    assert len(first) >= 16
    assert await subject.store.key_secret() == first


def test_the_simulated_store_has_the_same_surface() -> None:
    """Every public method of Store has a counterpart in SimStore with the same signature (and no more)."""

    def surface(cls: type) -> dict[str, str]:
        return {
            name: str(inspect.signature(member))
            for name, member in vars(cls).items()
            if not name.startswith("_") and inspect.iscoroutinefunction(member)
        }

    assert surface(SimStore) == surface(Store)


async def test_a_key_whose_digest_leads_to_another_keys_effect_is_refused(dsn: str) -> None:
    """Postgres only: were two keys to share a digest, the claim refuses rather than answer for the other."""
    async with opened(dsn) as store:
        first = await claimed(store, "first")
        conn = await asyncpg.connect(dsn)
        try:
            # What a collision would look like: the digest of "second" naming the effect of "first",
            # whose rows name that digest as their scope, since it is the digest of "first" too.
            await conn.execute(
                """insert into effect_keys (scope, tenant, upstream, effect_id, created_at)
                   values (effect_key_digest('second'), 'default', 'shop', $1, $2)""",
                first.id,
                first.created_at,
            )
            await conn.execute(
                "update effects set scope = effect_key_digest('second') where id = $1", first.id
            )
        finally:
            await conn.close()
        with pytest.raises(StoreRejected, match="shares its digest"):
            await store.claim(effect("second"), LEASE)


async def test_a_row_stores_no_claim_event_and_an_older_rows_stored_one_is_read_once(dsn: str) -> None:
    """Postgres only: the claim is read from the row's creation rather than kept in its history (which
    each update of the row writes again); a row written by an earlier version, which kept it, reads the
    same."""
    async with opened(dsn) as store:
        record = await completed(store)
        before = await store.get(record.id)
        conn = await asyncpg.connect(dsn)
        try:
            stored = json.loads(await conn.fetchval("select history from effects where id = $1", record.id))
            # What an earlier version wrote: the claim, stamped with now() in the claiming statement,
            # which is the row's created_at.
            await conn.execute(
                """update effects set history = jsonb_build_array(jsonb_build_object(
                       'event', 'claimed', 'attempt', 1, 'at', created_at)) || history
                   where id = $1""",
                record.id,
            )
        finally:
            await conn.close()
        after = await store.get(record.id)
    assert stored
    assert "claimed" not in [event["event"] for event in stored]
    assert before is not None
    assert after is not None
    assert [event["event"] for event in before.history] == ["claimed", *(e["event"] for e in stored)]
    assert after.history == before.history


async def test_settles_of_two_months_in_one_batch_stand_or_fall_together(dsn: str) -> None:
    """Postgres only: a batch of settles for effects of two months is one transaction. When Postgres
    refuses the second month's statement, the first month's is undone too, so that settling the rows
    one by one finds each as it was: the good one settles, not "fenced out" by its own earlier write."""
    now = datetime.now(UTC)
    month = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    last = (month - timedelta(days=1)).replace(day=1)
    conn = await asyncpg.connect(dsn)
    try:
        # Another test of this worker's database may have made that month already; then it stays.
        made = await conn.fetchval("select to_regclass($1)", f"effects_{last:%Y_%m}") is None
        await conn.execute(
            f"create table if not exists effects_{last:%Y_%m} partition of effects "
            f"for values from ('{last.isoformat()}') to ('{month.isoformat()}')"
        )
        old_id = await conn.fetchval(
            """insert into effects (id, created_at, scope, tenant, upstream, key, derived_key, method, path,
                                    fingerprint, state, lease_expires_at, first_sent_at, last_sent_at)
               values (nextval('effect_ids'), $1, effect_key_digest('last-month'), 'default', 'shop',
                       'last-month', 'eg_last', 'POST', '/orders', 'fp', 'pending', now() + interval '30 s',
                       $1, $1)
               returning id""",
            last + timedelta(days=3),
        )
    finally:
        await conn.close()
    try:
        await _settle_two_months(dsn, old_id)
    finally:
        conn = await asyncpg.connect(dsn)
        try:
            if made:  # as the other tests found the audit
                await conn.execute(f"drop table effects_{last:%Y_%m}")
            else:
                await conn.execute("delete from effects where id = $1", old_id)
        finally:
            await conn.close()


async def _settle_two_months(dsn: str, old_id: int) -> None:
    async with opened(dsn) as store:
        old = await store.get(old_id)
        assert old is not None
        first, this_month = await claimed(store, "first"), await claimed(store, "this-month")
        # A status no integer column holds: Postgres refuses the statement it is in.
        absurd = replace(OK, status=2**40)
        results = await asyncio.gather(
            store.settle(first, DONE, response=OK, recovered_by=None),
            # These two arrive while the first is written, and go together in the next batch.
            store.settle(old, DONE, response=OK, recovered_by=None),
            store.settle(this_month, DONE, response=absurd, recovered_by=None),
            return_exceptions=True,
        )
        assert results[0] is not None
        assert isinstance(results[1], EffectRecord)
        assert results[1].state is State.COMPLETED
        assert isinstance(results[2], StoreRejected)
        assert (await store.reread(old)).response == OK
        assert (await store.reread(this_month)).state is State.PENDING


async def test_the_oldest_waiting_effects_are_aged_per_state_and_per_tenant(subject: Subject) -> None:
    """The age of the oldest effect in doubt and of the oldest waiting for review, 0 for a state with
    none; a tenant sees only its own."""
    store = subject.store
    record = await claimed(store, "waits", lease=EXPIRED, tenant="t1")
    assert await store.send_to_review(record, review(record), "nothing can tell") is not None
    ages = await store.oldest_waiting()
    assert set(ages) == {"in_doubt", "needs_review"}
    assert ages["in_doubt"] == 0
    assert 0 <= ages["needs_review"] < 60
    assert await store.oldest_waiting("t2") == {"in_doubt": 0, "needs_review": 0}


async def test_each_settlement_enters_its_tenants_chain_and_moved_heads_are_signed_when_due(
    subject: Subject,
) -> None:
    """Completions and verdicts, not other moves, enter the chain; each tenant's head is signed at once
    the first time, then only when it moved and the interval passed or an export asks."""
    store = subject.store
    signer = Signer(chain.signing_key("11" * 32), timedelta(hours=1))
    await completed(store, "a-1")
    await completed(store, "b-1")
    b_2 = await claimed(store, "b-2", lease=EXPIRED, tenant="b")
    doubt = await store.settle(await claimed(store, "a-2"), TIMED_OUT, response=None, recovered_by=None)
    assert doubt is not None  # in doubt: not settled, so not in the chain
    assert await store.resolve(b_2, Transition(State.PENDING, State.RETRYABLE), None, "op") is not None
    first = await store.chain(signer)
    assert (first.chained, sorted((h.tenant, h.seq) for h in first.signed)) == (3, [("b", 1), ("default", 2)])
    assert await store.chain(signer) == Round(0, [])
    await completed(store, "a-3")
    assert await store.chain(signer) == Round(1, [])  # moved, but signed less than an hour ago
    asked = await store.chain(signer, sign_now=True)
    assert (asked.chained, [(h.tenant, h.seq) for h in asked.signed]) == (0, [("default", 3)])
