"""The driver: carries out what :func:`gateway.decision.decide` says, against the store and upstream.

This is the only module that sequences I/O for an effect: claim, send, settle, probe, wait. It knows
nothing about aiohttp's server side; :mod:`gateway.app` turns HTTP into an :class:`gateway.inbound.Inbound`
and a :class:`gateway.replies.Reply` back into HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar, assert_never

from gateway import problems, replies, trail
from gateway.decision import (
    Busy,
    Late,
    Mismatch,
    Probe,
    Purged,
    Refuse,
    Replay,
    Request,
    Resend,
    Restore,
    Review,
    Send,
    SendReason,
    Settlement,
    TakeOver,
    TooSoon,
    Unknown,
    after_probe,
    before_sending,
    carried_by,
    decide,
    restore,
    review,
    settle,
    take_over,
    unrecorded,
    why_not_probed,
)
from gateway.errors import ProbeFailed, StoreRejected, StoreUnavailable
from gateway.faults import fault
from gateway.fingerprint import fingerprint
from gateway.inbound import Inbound, NotAsFirstSent, as_first_sent, to_record, to_send
from gateway.keys import ScopedKey
from gateway.outcome import Found, NotFound, NotSent, Outcome, ProbeError, ProbeResult
from gateway.policy import UpstreamPolicy, keyless_mode
from gateway.probes import Prober
from gateway.record import EffectRecord
from gateway.replays import Completed, Replays
from gateway.replies import Reply
from gateway.settings import SAFE_METHODS
from gateway.states import State
from gateway.store import Store
from gateway.telemetry import Telemetry
from gateway.upstream import Outbound, UpstreamClient

log = logging.getLogger("effect_gateway")

T = TypeVar("T")

# Times a gateway that fell behind its lease before sending takes the record again; more means it is
# too overloaded to keep any lease, and the request is settled as never sent.
RENEWALS = 3
# Waiting for another request with the same key: start fast (most upstream calls end in tens of ms),
# back off to spare Postgres.
FIRST_POLL = 0.01
MAX_POLL = 0.2


@dataclass(slots=True)
class _Wait:
    """One request's wait for another with its key: until when, whether it has a place among the key's
    waiters, and how to tell that its client has left (then it has nothing to wait for)."""

    deadline: float
    client_left: Callable[[], bool]
    # Read when the wait starts, not when this module loads (a test may slow the polls down).
    poll: float = field(default_factory=lambda: FIRST_POLL)
    seated: bool = False


class EffectService:
    """Carry each request with a key to its end: claim it, send it, record what came of it, or replay,
    recover or refuse it."""

    def __init__(
        self,
        store: Store,
        client: UpstreamClient,
        prober: Prober,
        key_secret: bytes,
        *,
        retention: timedelta,
        replay_cache_bytes: int,
        waiters_per_key: int | None = None,
        telemetry: Telemetry | None = None,
    ) -> None:
        self._store = store
        self._telemetry = telemetry or Telemetry()
        self._key_secret = key_secret
        self._client = client
        self._prober = prober
        self._tasks: set[asyncio.Task[Any]] = set()
        self._replays = Replays(replay_cache_bytes, retention, store.add_replays, self._spawn)
        # Requests waiting in this process are woken as soon as the record is written here; those for a
        # request another gateway holds fall back to polling the row.
        self._waiters: dict[int, asyncio.Event] = {}
        # How many requests wait for each effect here: waiters_per_key at most (the setting
        # max_waiters_per_key says why), or any number when None.
        self._waiting: Counter[int] = Counter()
        self._waiters_per_key = waiters_per_key

    async def handle(self, inbound: Inbound) -> Reply:
        """Run the request to its end even if the client goes away: its result is recorded for the retry.

        A request that only waits for another with its key has nothing to record: it stops waiting once
        ``inbound.client_left()`` says so.
        """
        return await asyncio.shield(self._spawn(self._handle(inbound)))

    def _spawn(self, work: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        # Held here until done: the event loop keeps only weak references to tasks.
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def drain(self, timeout: float) -> None:
        """At shutdown: let calls under way finish and record, so none is left pending for nothing."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout)

    async def _handle(self, inbound: Inbound) -> Reply:
        if inbound.key is None:
            return await self._keyless(inbound)
        policy = inbound.upstream
        request = Request(
            fingerprint=fingerprint(
                inbound.method,
                inbound.path,
                inbound.query,
                inbound.body,
                inbound.headers,
                policy.fingerprint_headers,
                policy.never_stored,
                policy.fingerprint_body,
            )
        )
        scope = (inbound.tenant, policy.name, inbound.key)
        known = self._replays.known(scope, _clock())
        self._telemetry.replay_cache(hit=known is not None)
        if known is not None:
            return self._replay_known(known, request)
        derived = ScopedKey(*scope).derived(self._key_secret)
        # Built before the claim: a request that cannot be sent must leave no record behind.
        outbound = to_send(inbound, derived)
        took = _clock()
        record, created = await self._store.claim(
            to_record(inbound, inbound.key, derived, request.fingerprint), policy.lease
        )
        if record is None:
            # Its month was archived: whatever state it was left in (completed, or even open) is not
            # here to decide on, and sending again could repeat it.
            raise problems.ResponsePurged(
                "this key's audit row has been archived; nothing is sent for it again"
            )
        trail.saw(record, created=created)
        if created:
            return await self._attempt(record, took, policy, outbound, reason=None)
        wait = _Wait(asyncio.get_running_loop().time() + inbound.wait, inbound.client_left)
        return await self._follow(record, request, inbound, wait)

    def _replay_known(self, known: Completed, request: Request) -> Reply:
        trail.replayed_from_memory(known.id)
        if known.fingerprint != request.fingerprint:
            raise replies.key_reused(known.id)
        self._replays.count(known.id, known.created_at)
        return Reply(known.response, replayed=True, effect_id=known.id)

    async def _keyless(self, inbound: Inbound) -> Reply:
        """A request without an Idempotency-Key: passed through, audited once, or refused."""
        policy = inbound.upstream
        outbound = to_send(inbound, None)
        mode = "forward" if inbound.method in SAFE_METHODS else keyless_mode(policy, inbound.method)
        if mode == "refuse":
            raise problems.KeyMissing(
                f"{inbound.method} to {policy.name} needs an Idempotency-Key header: without one a retry "
                "would do the effect again"
            )
        if mode == "forward":
            outcome = await self._client.send(outbound, policy.timeout.total_seconds())
            if inbound.method not in SAFE_METHODS:
                replies.refuse_redirect(outcome, policy, None, inbound.method)
            return replies.reply(outcome, None)
        # "audit": one row for the audit, under a made-up key that no request can ever present again.
        took = _clock()
        record, created = await self._store.claim(
            to_record(inbound, f"keyless:{uuid.uuid4().hex}", "", "", keyless=True), policy.lease
        )
        assert record is not None, "a made-up key of 128 random bits is new"
        assert created
        trail.saw(record, created=True)
        return await self._attempt(record, took, policy, outbound, reason=None)

    async def _follow(self, record: EffectRecord, request: Request, inbound: Inbound, wait: _Wait) -> Reply:
        try:
            return await self._follow_until_done(record, request, inbound, wait)
        finally:
            self._unseat(record.id, wait)

    def _unseat(self, effect_id: int, wait: _Wait) -> None:
        """The request waits for the key no more (it answers, or goes on to send or probe itself): its
        place is another's, and the key's wake-up goes with the last waiter here."""
        if wait.seated:
            wait.seated = False
            self._waiting[effect_id] -= 1
            if not self._waiting[effect_id]:
                del self._waiting[effect_id]
        # A record another gateway wrote is never woken here: once nobody waits, drop the event, lest it
        # linger; while others wait, it is theirs.
        if effect_id not in self._waiting and (woken := self._waiters.get(effect_id)) and not woken.is_set():
            del self._waiters[effect_id]

    async def _follow_until_done(
        self, record: EffectRecord, request: Request, inbound: Inbound, wait: _Wait
    ) -> Reply:
        policy = inbound.upstream
        while True:
            assert record.read_at is not None
            action = decide(record, request, record.read_at, policy.decision)
            if not isinstance(action, Busy):
                self._unseat(record.id, wait)
            match action:
                case Replay():
                    assert record.response is not None
                    self._replays.remember(record, record.response, _clock())
                    self._replays.count(record.id, record.created_at)
                    return Reply(record.response, replayed=True, effect_id=record.id)
                case Mismatch():
                    raise replies.key_reused(record.id)
                case Busy(retry_after=retry_after):
                    record = await self._wait_for_holder(record, retry_after, wait)
                case Resend(reason=reason):
                    took = _clock()
                    claimed = await self._store.reclaim(
                        record,
                        take_over(record),
                        policy.lease,
                        reason,
                        sends=True,
                        carriers=carried_by(record, policy.decision, reason),
                    )
                    if claimed is None:
                        record = await self._reread(record)
                        continue
                    self._took(record, claimed)
                    return await self._attempt(claimed, took, policy, _first_sent(inbound, claimed), reason)
                case Probe():
                    claimed = await self._store.reclaim(
                        record, take_over(record), policy.lease, "probe", sends=False
                    )
                    if claimed is None:
                        record = await self._reread(record)
                        continue
                    self._took(record, claimed)
                    return await self._probe(claimed, inbound)
                case Review():
                    reviewed = await self._wake_after(
                        record,
                        self._store.send_to_review(
                            record,
                            review(record),
                            f"no native key it was sent with within its TTL, and "
                            f"{why_not_probed(record, policy.decision)}: nothing can tell if it happened",
                        ),
                    )
                    if reviewed is None:
                        record = await self._reread(record)
                        continue
                    self._took(record, reviewed)
                    log.warning("effect %s needs review (%s %s)", record.id, record.upstream, record.path)
                    raise replies.outcome_unknown(reviewed)
                case Unknown():
                    raise replies.outcome_unknown(record)
                case Restore():
                    return await self._restore(record, policy)
                case Purged():
                    raise replies.purged(
                        record, f"no probe is asked for it: {why_not_probed(record, policy.decision)}"
                    )
                case _:
                    assert_never(action)

    async def _wait_for_holder(
        self, record: EffectRecord, retry_after: timedelta, wait: _Wait
    ) -> EffectRecord:
        """Wait a little for the request that holds the key, then read the record again.

        Raises the 409 in-flight when the wait is over, when its client has left (it reads the record
        at most once after), or when the key has as many waiters here as it may have.
        """
        remaining = wait.deadline - asyncio.get_running_loop().time()
        if remaining <= 0:
            raise _in_flight(record, retry_after, "retry, or send Prefer: wait=N")
        if wait.client_left():
            raise _in_flight(record, retry_after, "the client went away while waiting for it")
        if not wait.seated:
            waiting = self._waiting[record.id]
            if self._waiters_per_key is not None and waiting >= self._waiters_per_key:
                raise _in_flight(record, retry_after, f"{waiting} requests wait for it already")
            self._waiting[record.id] += 1
            wait.seated = True
        woken = self._waiters.setdefault(record.id, asyncio.Event())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(woken.wait(), min(wait.poll, remaining, retry_after.total_seconds()))
        wait.poll = min(wait.poll * 2, MAX_POLL)
        return await self._reread(record)

    async def _settle(self, record: EffectRecord, settlement: Settlement, **what: Any) -> EffectRecord | None:
        saved = await self._wake_after(record, self._store.settle(record, settlement, **what))
        if saved is not None:
            trail.saw(saved)
        return saved

    async def _reread(self, record: EffectRecord) -> EffectRecord:
        fresh = await self._store.reread(record)
        trail.saw(fresh)
        return fresh

    def _took(self, record: EffectRecord, taken: EffectRecord) -> None:
        """``record`` as read was taken (again, for review): a lease that ran out is counted as taken over."""
        trail.saw(taken)
        if record.state is State.PENDING:
            self._telemetry.taken_over(record.upstream)

    async def _wake_after(self, record: EffectRecord, write: Awaitable[T]) -> T:
        """Carry out a write to the record, then wake the requests waiting on it here, whatever came of it."""
        try:
            return await write
        finally:
            if (woken := self._waiters.pop(record.id, None)) is not None:
                woken.set()

    async def _attempt(
        self,
        record: EffectRecord,
        took: float,
        policy: UpstreamPolicy,
        outbound: Outbound | Refuse,
        reason: SendReason | None,
    ) -> Reply:
        """Send under the attempt ``record`` holds, and write down what came of it (fenced).

        ``took`` is this process's clock from just before the statement that took the record. ``outbound``
        is a Refuse when the request cannot be built: it is settled as never sent.
        """
        fault("after-claim", policy.name)
        record, check, took = await self._ready_to_send(record, took, policy, reason)
        outcome: Outcome
        match check, outbound:
            case Send(), Outbound():
                outcome = await self._client.send(
                    outbound, policy.timeout.total_seconds(), leave_within=_left_to_leave(policy, took)
                )
            case (Refuse() as refused, _) | (Send(), Refuse() as refused):
                log.warning("effect %s: %s", record.id, refused.reason)
                outcome = NotSent(refused.reason)
        fault("after-upstream", policy.name)
        try:
            return await self._record(record, policy, outcome, reason)
        except (StoreUnavailable, StoreRejected) as exc:
            # What came of a request that may have left could not be written (here or in the fallback
            # to review): the record stays as it was until its lease runs out, and the retry recovers it
            # like a gateway crash at this very point. Never "nothing was sent".
            log.error("effect %s: %s; could not record it: %s", record.id, replies.describe(outcome), exc)
            raise problems.StoreDown(
                f"the upstream was called but its outcome could not be recorded ({exc}); retry with the same "
                "key to recover it",
                headers={"Retry-After": str(max(1, math.ceil(policy.lease.total_seconds())))},
                effect_id=record.id,
            ) from None

    async def _record(
        self, record: EffectRecord, policy: UpstreamPolicy, outcome: Outcome, reason: SendReason | None
    ) -> Reply:
        """Write down what the attempt ``record`` holds came to (fenced), and answer with it."""
        recovered_by = None if reason in (None, "retryable") else reason
        settled = settle(outcome, earlier_doubt=record.may_have_sent, method=record.method)
        response = replies.stored(outcome)  # None when nothing answered
        try:
            saved = await self._settle(
                record,
                settled,
                response=response,
                recovered_by=recovered_by if settled.state is State.COMPLETED else None,
                note=replies.describe(outcome),
            )
        except StoreRejected as exc:
            return await self._unrecorded(record, settled, outcome, exc)
        if saved is None:
            await self._store.note_fenced(record, replies.describe(outcome))
            raise problems.Fenced(
                "this gateway's attempt was taken over by a newer one; retry to get the recorded outcome",
                headers={"Retry-After": "1"},
                effect_id=record.id,
            )
        fault("after-record", policy.name)
        if settled.state is State.COMPLETED and recovered_by is not None:
            trail.recovered(recovered_by)
        if settled.state is State.COMPLETED and response is not None:
            self._replays.remember(saved, response, _clock())
        replies.refuse_redirect(outcome, policy, record.id, record.method)
        return replies.reply(outcome, record.id)

    async def _ready_to_send(
        self, record: EffectRecord, took: float, policy: UpstreamPolicy, reason: SendReason | None
    ) -> tuple[EffectRecord, Send | Refuse, float]:
        """The attempt to send under (taken again if this gateway fell behind its lease), and whether it
        may be sent.

        Also returns this process's clock from just before the statement that took the attempt.
        """
        for _ in range(RENEWALS):
            assert record.read_at is not None
            waited = timedelta(seconds=_clock() - took)
            check = before_sending(record, record.read_at, waited, policy.decision, reason)
            if not isinstance(check, Late):
                return record, check, took
            log.warning("effect %s: %.1fs late to send; taking it again", record.id, waited.total_seconds())
            took = _clock()
            renewed = await self._store.reclaim(
                record,
                take_over(record),
                policy.lease,
                "late to send",
                sends=True,
                renew=True,
                carriers=record.key_carriers,  # its own request, as the take-over it renews recorded
            )
            if renewed is not None:
                trail.saw(renewed)
            if renewed is None:
                seen = f"not sent: {waited.total_seconds():.1f}s late, and another attempt took over"
                await self._store.note_fenced(record, seen)
                raise problems.Fenced(
                    "this gateway's attempt was taken over while it was late to send; retry",
                    headers={"Retry-After": "1"},
                    effect_id=record.id,
                )
            record = renewed
        return record, Refuse("not sent: the gateway kept falling behind its lease before sending"), took

    async def _unrecorded(
        self, record: EffectRecord, settled: Settlement, outcome: Outcome, exc: StoreRejected
    ) -> Reply:
        """Postgres is up but refused what the upstream answered: never leave the record pending.

        A pending record would be taken over when its lease runs out and, lacking an answer, sent again
        (possibly forever). It goes to review instead, with what the gateway saw in its history.
        """
        seen = f"{replies.describe(outcome)}, but the answer could not be recorded: {exc}"
        log.error("effect %s: %s", record.id, seen)
        instead = unrecorded(settled)
        saved = await self._settle(record, instead, response=None, recovered_by=None, note=seen)
        if saved is None:
            await self._store.note_fenced(record, seen)
        if instead.state is not State.NEEDS_REVIEW:
            return replies.reply(outcome, record.id)  # nothing reached the upstream: say what stopped it
        if saved is None:
            # A newer attempt holds the record: a resolve command naming this one would be refused.
            raise problems.Fenced(
                f"the upstream {replies.describe(outcome)} but the answer could not be recorded, and a newer "
                "attempt has taken this key over; retry to get its outcome",
                headers={"Retry-After": "1"},
                effect_id=record.id,
            )
        raise problems.OutcomeUnknown(
            f"the upstream {replies.describe(outcome)} but the gateway could not record the answer ({exc}); "
            f"nothing will be sent again for this key until it is resolved: {replies.how_to_resolve(record)}",
            effect_id=record.id,
        )

    async def _look(self, policy: UpstreamPolicy, record: EffectRecord) -> ProbeResult:
        """Ask the upstream whether the effect exists, by the key stamped into it."""
        with self._telemetry.probe(policy.name) as probing:
            try:
                found = await self._prober.probe(policy, record.derived_key)
            except ProbeFailed as exc:
                return ProbeError(str(exc))
            probing.result = "not_found" if found is None else "found"
            return NotFound() if found is None else Found(found)

    async def _probe(self, record: EffectRecord, inbound: Inbound) -> Reply:
        """Probe under the take-over ``record`` holds; then send, complete, or leave it for later."""
        policy = inbound.upstream
        asked_at = record.read_at  # the take-over's clock: the probe leaves after it
        assert asked_at is not None
        result = await self._look(policy, record)
        step = after_probe(record, result, asked_at, policy.decision)
        if isinstance(step, TakeOver):
            # Taken again once the probe has answered: the new attempt's lease covers the send (the
            # probe may have used up most of the old one), and the take-over reads the database's clock
            # after the probe, which is when "not found" must still be within the probe's horizon.
            took = _clock()
            again = await self._store.reclaim(
                record,
                take_over(record),
                policy.lease,
                "the probe found nothing",
                sends=True,
                renew=True,
                carriers=carried_by(record, policy.decision, None),
            )
            if again is None:
                await self._store.note_fenced(record, "the probe found nothing")
                raise problems.Fenced("a newer attempt took over while probing; retry", effect_id=record.id)
            record = again
            trail.saw(record)
            step = after_probe(record, result, asked_at, policy.decision, retaken_at=record.read_at)
        match step:
            case Send():  # only ever after the take-over above, which set `took`
                log.info("probe: effect %s not found upstream, sending", record.id)
                return await self._attempt(record, took, policy, _first_sent(inbound, record), reason=None)
            case TooSoon():
                return await self._too_soon(record, step)
            case Settlement():
                return await self._settle_probe(record, step, result)
            case TakeOver():
                raise AssertionError("judged after the take-over")  # pragma: no cover
            case _:
                assert_never(step)

    async def _settle_probe(self, record: EffectRecord, verdict: Settlement, result: ProbeResult) -> Reply:
        """Write down what the probe came to (fenced): completed with its answer, in review, or in doubt."""
        found = result.response if isinstance(result, Found) else None
        note = {
            State.COMPLETED: "found by probe",
            State.IN_DOUBT: f"probe failed: {result.reason if isinstance(result, ProbeError) else ''}",
            State.NEEDS_REVIEW: "the probe found nothing, but the effect is older than the probe's horizon",
        }[verdict.state]
        saved = await self._settle(
            record, verdict, response=found, recovered_by="probe" if found else None, note=note
        )
        if saved is None:
            await self._store.note_fenced(record, note)
            raise problems.Fenced("a newer attempt took over while probing; retry", effect_id=record.id)
        match verdict.state:
            case State.COMPLETED:
                assert found is not None
                trail.recovered("probe")
                self._replays.remember(saved, found, _clock())
                return Reply(found, replayed=True, effect_id=record.id)
            case State.NEEDS_REVIEW:
                log.warning("effect %s needs review: %s", record.id, note)
                raise replies.outcome_unknown(record)
        raise problems.ProbeUnavailable(
            f"{note}; the record is unchanged, retry later", headers={"Retry-After": "5"}, effect_id=record.id
        )

    async def _too_soon(self, record: EffectRecord, early: TooSoon) -> Reply:
        """The probe found nothing before its search could list the latest attempt: in doubt, nothing sent.

        Written under the probe's take-over, which left the send times as they were: the next probe
        judges the lag from the same attempt, so waiting it out ends.
        """
        note = "the probe found nothing, but too soon after the latest attempt for its search to list it"
        saved = await self._settle(record, early.settlement, response=None, recovered_by=None, note=note)
        if saved is None:
            await self._store.note_fenced(record, note)
            raise problems.Fenced("a newer attempt took over while probing; retry", effect_id=record.id)
        wait = max(1, math.ceil(early.retry_after.total_seconds()))
        raise problems.ProbeTooSoon(
            f"{note} (the upstream's probe.lag); nothing was sent and the record is unchanged, retry in "
            f"{wait}s",
            headers={"Retry-After": str(wait)},
            effect_id=record.id,
        )

    async def _restore(self, record: EffectRecord, policy: UpstreamPolicy) -> Reply:
        """A completed effect whose response was purged: the probe may supply it; nothing is ever sent."""
        match await self._look(policy, record):
            case Found(response=response):
                # A probe's answer may differ from one search to the next: only the first stored is
                # given, to this request and every other, from Postgres or any worker's memory.
                stored, restored = await self._store.restore(record, restore(record), response)
                trail.saw(stored)
                if stored.response is None:
                    raise replies.purged(record, "the answer restored for it was dropped again")
                if restored:
                    trail.recovered("probe")
                self._replays.remember(stored, stored.response, _clock())
                return Reply(stored.response, replayed=True, effect_id=record.id)
            case NotFound():
                raise replies.purged(record, "the probe no longer finds it")
            case ProbeError(reason=reason):
                raise problems.ProbeUnavailable(
                    f"probe failed: {reason}; the effect happened and nothing will be sent again, retry "
                    "later for its response",
                    headers={"Retry-After": "5"},
                    effect_id=record.id,
                )
        raise AssertionError("unreachable")  # pragma: no cover


def _in_flight(record: EffectRecord, retry_after: timedelta, then: str) -> problems.Problem:
    # A request in flight ends within a second or so; a lease to wait out is told as is.
    hint = 1 if record.state is State.PENDING else math.ceil(retry_after.total_seconds())
    return problems.InFlight(
        f"another request with this key is in flight; {then}",
        headers={"Retry-After": str(max(1, hint))},
        effect_id=record.id,
    )


def _first_sent(inbound: Inbound, record: EffectRecord) -> Outbound | Refuse:
    """The request of a take-over that sends: the one the effect was first sent with (inbound.as_first_sent),
    or a refusal saying why it cannot be sent again."""
    try:
        return as_first_sent(inbound, record)
    except NotAsFirstSent as exc:
        return Refuse(f"not sent: {exc}")


def _clock() -> float:
    """This process's monotonic clock: only for how long this process itself has waited."""
    return asyncio.get_running_loop().time()


def _left_to_leave(policy: UpstreamPolicy, took: float) -> float | None:
    """What is left of the send window since ``took``: the request must leave by then, or not at all.

    The lease covers the upstream's timeout from a departure within the window. A request that waits
    for a pooled connection past it would reach the upstream too late for the lease to cover its work,
    and a retry after the lease could probe, find nothing yet, and send it again.
    """
    window = policy.decision.send_window
    # At least a millisecond: aiohttp reads a timeout of 0 as none at all.
    return None if window is None else max(0.001, window.total_seconds() - (_clock() - took))
