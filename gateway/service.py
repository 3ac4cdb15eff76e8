"""The driver: carries out what :func:`gateway.decision.decide` says, against the store and upstream.

This is the only module that sequences I/O for an effect: claim, send, settle, probe, wait. It knows
nothing about aiohttp's server side; :mod:`gateway.app` turns HTTP into an :class:`Inbound` and a
:class:`Reply` back into HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import uuid
from collections.abc import Awaitable, Coroutine, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, TypeVar, assert_never

from gateway import problems, trail
from gateway.body import RequestBody
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
    TooSoon,
    Unknown,
    before_sending,
    decide,
    repeats_request,
    restore,
    review,
    settle,
    settle_probe,
    take_over,
    too_soon,
    unrecorded,
)
from gateway.errors import ProbeFailed, StoreRejected, StoreUnavailable
from gateway.faults import fault
from gateway.fingerprint import NEVER_FINGERPRINTED, fingerprint
from gateway.keys import ScopedKey
from gateway.outcome import Answered, Found, NoAnswer, NotFound, NotSent, Outcome, ProbeError, ProbeResult
from gateway.policy import UpstreamPolicy, keyless_mode
from gateway.probes import Prober
from gateway.record import EffectRecord, StoredResponse
from gateway.replays import Completed, ReplayCache, ReplayTally
from gateway.settings import SAFE_METHODS
from gateway.stamp import StampError
from gateway.states import State
from gateway.store import NewEffect, Store
from gateway.telemetry import Telemetry
from gateway.upstream import GATEWAY_REQUEST_HEADERS, HOP_BY_HOP, Outbound, UpstreamClient, build_outbound

log = logging.getLogger("effect_gateway")

T = TypeVar("T")

# Times a gateway that fell behind its lease before sending takes the record again; more means it is
# too overloaded to keep any lease, and the request is settled as never sent.
RENEWALS = 3
# Replay counts gather this long before one statement writes them: a second of counts is what a crash
# can cost, and a busy key's replays cost Postgres one write a second instead of one each.
REPLAY_FLUSH = 1.0
# Waiting for a twin: start fast (most upstream calls end in tens of ms), back off to spare Postgres.
FIRST_POLL = 0.01
MAX_POLL = 0.2


@dataclass(frozen=True, slots=True)
class Inbound:
    tenant: str
    upstream: UpstreamPolicy
    method: str
    path: str  # as the agent sent it, still percent-encoded, starting with "/"
    query: str
    headers: Mapping[str, str]
    body: RequestBody
    key: str | None
    wait: float
    run_id: str | None = None
    step: str | None = None


@dataclass(frozen=True, slots=True)
class Reply:
    response: StoredResponse
    replayed: bool
    effect_id: int | None


class EffectService:
    def __init__(
        self,
        store: Store,
        client: UpstreamClient,
        prober: Prober,
        key_secret: bytes,
        *,
        retention: timedelta,
        replay_cache_bytes: int,
        telemetry: Telemetry | None = None,
    ) -> None:
        self._store = store
        self._telemetry = telemetry or Telemetry()
        self._retention = retention
        self._key_secret = key_secret
        self._cache = ReplayCache(replay_cache_bytes)
        self._tally = ReplayTally()
        self._flusher: asyncio.Task[None] | None = None
        self._client = client
        self._prober = prober
        self._tasks: set[asyncio.Task[Any]] = set()
        # Twins waiting in this process are woken as soon as the record is written here; twins of a
        # request another gateway holds fall back to polling the row.
        self._waiters: dict[int, asyncio.Event] = {}

    async def handle(self, inbound: Inbound) -> Reply:
        """Run the request to its end even if the client goes away: its result is recorded for the retry."""
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
        known = self._cache.get(scope, _clock())
        self._telemetry.replay_cache(hit=known is not None)
        if known is not None:
            return self._replay_known(known, request)
        derived = ScopedKey(*scope).derived(self._key_secret)
        # Built before the claim: a request that cannot be sent must leave no record behind.
        outbound = _outbound(inbound, derived)
        took = _clock()
        record, created = await self._store.claim(
            _new_effect(inbound, inbound.key, derived, request.fingerprint), policy.lease
        )
        if record is None:
            # Its month was archived: whatever state it was left in (completed, or even open) is not
            # here to decide on, and sending again could repeat it.
            raise problems.ResponsePurged(
                "this key's audit row has been archived; nothing is sent for it again"
            )
        trail.saw(record, created=created)
        if record.derived_key != derived:
            # First sent under another derived key (an older derivation, or another key_secret): every
            # attempt at one effect carries the key of its first, or the upstream and a probe could not
            # tell that they are the same effect.
            outbound = _outbound(inbound, record.derived_key)
        if created:
            return await self._attempt(record, took, policy, outbound, reason=None)
        return await self._follow(record, request, policy, outbound, inbound.wait)

    def _replay_known(self, known: Completed, request: Request) -> Reply:
        trail.replayed_from_memory(known.id)
        if known.fingerprint != request.fingerprint:
            raise _key_reused(known.id)
        self._count_replay(known.id, known.created_at)
        return Reply(known.response, replayed=True, effect_id=known.id)

    def _remember(
        self, record: EffectRecord, response: StoredResponse, *, stored: datetime | None = None
    ) -> None:
        """Keep a completed effect for replays from memory (a keyless one is never replayed).

        ``record`` is as read with (or just after) its response was stored, at ``stored`` (else its
        ``response_at``): the store keeps the response for the retention from then, and so does the copy.
        """
        if record.keyless or record.read_at is None:
            return
        stored = stored or record.response_at or record.read_at
        left = self._retention - (record.read_at - stored)
        now = _clock()
        self._cache.put(
            (record.tenant, record.upstream, record.key),
            Completed(record.id, record.created_at, record.fingerprint, response, now + left.total_seconds()),
            now,
        )

    def _count_replay(self, effect_id: int, created_at: datetime) -> None:
        # Off the agent's path: the counter is for the audit, and a commit of its own would be most of a
        # replay's time. Counts gather for a moment and go to Postgres in one statement.
        self._tally.add(effect_id, created_at)
        if self._flusher is None or self._flusher.done():
            self._flusher = self._spawn(self._flush_replays())

    async def _flush_replays(self) -> None:
        # Until none are left: replays counted while a batch was being written go in the next, and a
        # drain at shutdown waits for this task, so they are not left behind with nobody to write them.
        while self._tally:
            await asyncio.sleep(REPLAY_FLUSH)
            counts = self._tally.take()
            try:
                await self._store.add_replays(counts)
            except (StoreUnavailable, StoreRejected) as exc:
                log.warning("%d replay counts not written: %s", sum(counts.values()), exc)

    async def _keyless(self, inbound: Inbound) -> Reply:
        """A request without an Idempotency-Key: passed through, audited once, or refused."""
        policy = inbound.upstream
        outbound = _outbound(inbound, None)
        mode = "forward" if inbound.method in SAFE_METHODS else keyless_mode(policy, inbound.method)
        if mode == "refuse":
            raise problems.KeyMissing(
                f"{inbound.method} to {policy.name} needs an Idempotency-Key header: without one a retry "
                "would do the effect again"
            )
        if mode == "forward":
            outcome = await self._client.send(outbound, policy.timeout.total_seconds())
            if inbound.method not in SAFE_METHODS:
                _refuse_redirect(outcome, policy, None, inbound.method)
            return _reply(outcome, None)
        # "audit": one row for the audit, under a made-up key that no request can ever present again.
        took = _clock()
        record, created = await self._store.claim(
            _new_effect(inbound, f"keyless:{uuid.uuid4().hex}", "", "", keyless=True), policy.lease
        )
        assert record is not None, "a made-up key of 128 random bits is new"
        assert created
        trail.saw(record, created=True)
        return await self._attempt(record, took, policy, outbound, reason=None)

    async def _follow(
        self, record: EffectRecord, request: Request, policy: UpstreamPolicy, outbound: Outbound, wait: float
    ) -> Reply:
        try:
            return await self._follow_until_done(record, request, policy, outbound, wait)
        finally:
            # A record another gateway wrote is never woken here: drop the event, lest it linger.
            if (woken := self._waiters.get(record.id)) is not None and not woken.is_set():
                del self._waiters[record.id]

    async def _follow_until_done(
        self, record: EffectRecord, request: Request, policy: UpstreamPolicy, outbound: Outbound, wait: float
    ) -> Reply:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        poll = FIRST_POLL
        while True:
            assert record.read_at is not None
            action = decide(record, request, record.read_at, policy.decision)
            match action:
                case Replay():
                    assert record.response is not None
                    self._remember(record, record.response)
                    self._count_replay(record.id, record.created_at)
                    return Reply(record.response, replayed=True, effect_id=record.id)
                case Mismatch():
                    raise _key_reused(record.id)
                case Busy(retry_after=retry_after):
                    remaining = deadline - loop.time()
                    if remaining <= 0:
                        # A twin in flight ends within a second or so; a lease to wait out is told as is.
                        hint = 1 if record.state is State.PENDING else math.ceil(retry_after.total_seconds())
                        raise problems.InFlight(
                            "another request with this key is in flight; retry, or send Prefer: wait=N",
                            headers={"Retry-After": str(max(1, hint))},
                            effect_id=record.id,
                        )
                    woken = self._waiters.setdefault(record.id, asyncio.Event())
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(
                            woken.wait(), min(poll, remaining, retry_after.total_seconds())
                        )
                    poll = min(poll * 2, MAX_POLL)
                    record = await self._reread(record)
                case Resend(reason=reason):
                    took = _clock()
                    claimed = await self._store.reclaim(
                        record, take_over(record), policy.lease, reason, sends=True
                    )
                    if claimed is None:
                        record = await self._reread(record)
                        continue
                    self._took(record, claimed)
                    return await self._attempt(claimed, took, policy, outbound, reason=reason)
                case Probe():
                    claimed = await self._store.reclaim(
                        record, take_over(record), policy.lease, "probe", sends=False
                    )
                    if claimed is None:
                        record = await self._reread(record)
                        continue
                    self._took(record, claimed)
                    return await self._probe(claimed, policy, outbound)
                case Review():
                    reviewed = await self._wake_after(
                        record,
                        self._store.send_to_review(
                            record,
                            review(record),
                            "no native key within its TTL, no probe: nothing can tell if it happened",
                        ),
                    )
                    if reviewed is None:
                        record = await self._reread(record)
                        continue
                    self._took(record, reviewed)
                    log.warning("effect %s needs review (%s %s)", record.id, record.upstream, record.path)
                    raise _outcome_unknown(record)
                case Unknown():
                    raise _outcome_unknown(record)
                case Restore():
                    return await self._restore(record, policy)
                case Purged():
                    raise _purged(record, "this upstream has no probe to ask for it")
                case _:
                    assert_never(action)

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
        """Carry out a write to the record, then wake the twins waiting on it here, whatever came of it."""
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
        outbound: Outbound,
        reason: SendReason | None,
    ) -> Reply:
        """Send under the attempt ``record`` holds, and write down what came of it (fenced).

        ``took`` is this process's clock from just before the statement that took the record.
        """
        fault("after-claim", policy.name)
        record, refused, took = await self._ready_to_send(record, took, policy, reason)
        if refused is not None:
            log.warning("effect %s: %s", record.id, refused.reason)
            outcome: Outcome = NotSent(refused.reason)
        else:
            outcome = await self._client.send(
                outbound, policy.timeout.total_seconds(), leave_within=_left_to_leave(policy, took)
            )
        fault("after-upstream", policy.name)
        try:
            return await self._record(record, policy, outcome, reason)
        except (StoreUnavailable, StoreRejected) as exc:
            # What came of a request that may have left could not be written (here or in the fallback
            # to review): the record stays as it was until its lease runs out, and the retry recovers it
            # like a gateway crash at this very point. Never "nothing was sent".
            log.error("effect %s: %s; could not record it: %s", record.id, _describe(outcome), exc)
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
        try:
            saved = await self._settle(
                record,
                settled,
                response=_stored(outcome),
                recovered_by=recovered_by if settled.state is State.COMPLETED else None,
                note=_describe(outcome),
            )
        except StoreRejected as exc:
            return await self._unrecorded(record, settled, outcome, exc)
        if saved is None:
            await self._store.note_fenced(record, _describe(outcome))
            raise problems.Fenced(
                "this gateway's attempt was taken over by a newer one; retry to get the recorded outcome",
                headers={"Retry-After": "1"},
                effect_id=record.id,
            )
        fault("after-record", policy.name)
        if settled.state is State.COMPLETED and recovered_by is not None:
            trail.recovered(recovered_by)
        if settled.state is State.COMPLETED and isinstance(outcome, Answered):
            self._remember(saved, StoredResponse(outcome.status, outcome.headers, outcome.body))
        _refuse_redirect(outcome, policy, record.id, record.method)
        return _reply(outcome, record.id)

    async def _ready_to_send(
        self, record: EffectRecord, took: float, policy: UpstreamPolicy, reason: SendReason | None
    ) -> tuple[EffectRecord, Refuse | None, float]:
        """The attempt to send under (taken again if this gateway fell behind its lease), or a refusal.

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
                record, take_over(record), policy.lease, "late to send", sends=True, renew=True
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
        seen = f"{_describe(outcome)}, but the answer could not be recorded: {exc}"
        log.error("effect %s: %s", record.id, seen)
        instead = unrecorded(settled)
        saved = await self._settle(record, instead, response=None, recovered_by=None, note=seen)
        if saved is None:
            await self._store.note_fenced(record, seen)
        if instead.state is not State.NEEDS_REVIEW:
            return _reply(outcome, record.id)  # nothing reached the upstream: say what stopped it
        raise problems.OutcomeUnknown(
            f"the upstream {_describe(outcome)} but the gateway could not record the answer ({exc}); "
            f"nothing will be sent again for this key until an operator resolves effect {record.id}",
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

    async def _probe(self, record: EffectRecord, policy: UpstreamPolicy, outbound: Outbound) -> Reply:
        """Probe under the take-over ``record`` holds; then send, complete, or leave it for later."""
        asked_at = record.read_at  # the take-over's clock: the probe leaves after it
        assert asked_at is not None
        result = await self._look(policy, record)
        if isinstance(result, NotFound) and (early := too_soon(record, asked_at, policy.decision)):
            return await self._too_soon(record, early)
        if isinstance(result, NotFound):
            # Taken again once the probe has answered: the new attempt's lease covers the send (the
            # probe may have used up most of the old one), and the take-over reads the database's clock
            # after the probe, which is when "not found" must still be within the probe's horizon.
            took = _clock()
            again = await self._store.reclaim(
                record, take_over(record), policy.lease, "the probe found nothing", sends=True, renew=True
            )
            if again is None:
                await self._store.note_fenced(record, "the probe found nothing")
                raise problems.Fenced("a newer attempt took over while probing; retry", effect_id=record.id)
            record = again
            trail.saw(record)
            assert record.read_at is not None
            if isinstance(settle_probe(record, result, record.read_at, policy.decision), Send):
                log.info("probe: effect %s not found upstream, sending", record.id)
                return await self._attempt(record, took, policy, outbound, reason=None)
        assert record.read_at is not None
        verdict = settle_probe(record, result, record.read_at, policy.decision)
        assert isinstance(verdict, Settlement), "a send was decided above"
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
                self._remember(saved, found)
                return Reply(found, replayed=True, effect_id=record.id)
            case State.NEEDS_REVIEW:
                log.warning("effect %s needs review: %s", record.id, note)
                raise _outcome_unknown(record)
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
                await self._store.restore(record, restore(record), response)
                trail.recovered("probe")
                # Stored again just now: its retention starts over (from when the record was read, at
                # the latest), where the record still carries the time of the response it lost.
                self._remember(record, response, stored=record.read_at)
                return Reply(response, replayed=True, effect_id=record.id)
            case NotFound():
                raise _purged(record, "the probe no longer finds it")
            case ProbeError(reason=reason):
                raise problems.ProbeUnavailable(
                    f"probe failed: {reason}; the effect happened and nothing will be sent again, retry "
                    "later for its response",
                    headers={"Retry-After": "5"},
                    effect_id=record.id,
                )
        raise AssertionError("unreachable")  # pragma: no cover


def _key_reused(effect_id: int) -> problems.Problem:
    return problems.KeyReused(
        "this Idempotency-Key was first used with a different method, path, query or body",
        effect_id=effect_id,
    )


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


def _purged(record: EffectRecord, why: str) -> problems.Problem:
    return problems.ResponsePurged(
        f"the effect happened and is never sent again; its response was dropped after the retention and "
        f"{why}",
        effect_id=record.id,
    )


def _outbound(inbound: Inbound, derived_key: str | None) -> Outbound:
    try:
        return build_outbound(
            inbound.upstream,
            derived_key,
            inbound.method,
            inbound.path,
            inbound.query,
            inbound.headers,
            inbound.body,
        )
    except StampError as exc:
        raise problems.CannotStamp(str(exc)) from None


def _new_effect(
    inbound: Inbound, key: str, derived_key: str, fingerprint: str, *, keyless: bool = False
) -> NewEffect:
    return NewEffect(
        tenant=inbound.tenant,
        upstream=inbound.upstream.name,
        key=key,
        derived_key=derived_key,
        method=inbound.method,
        path=inbound.path,
        query=inbound.query,
        fingerprint=fingerprint,
        request_headers=redacted(inbound.headers, inbound.upstream),
        request_body=inbound.body.raw,
        run_id=inbound.run_id,
        step=inbound.step,
        keyless=keyless,
    )


def _outcome_unknown(record: EffectRecord) -> problems.Problem:
    return problems.OutcomeUnknown(
        "the effect may have happened and nothing can tell; resolve it with "
        f"`effect-gateway resolve {record.id}` or POST /_gateway/effects/{record.id}/resolve",
        effect_id=record.id,
    )


# Credentials, hop-by-hop headers and the gateway's own: never in the audit, whatever the upstream.
NEVER_AUDITED = NEVER_FINGERPRINTED | HOP_BY_HOP | GATEWAY_REQUEST_HEADERS


def redacted(headers: Mapping[str, str], policy: UpstreamPolicy) -> dict[str, str]:
    """Request headers as the audit keeps them: credentials and secrets never reach the database."""
    never = policy.never_stored
    return {
        name: value
        for name, value in headers.items()
        if name.lower() not in never and name.lower() not in NEVER_AUDITED
    }


def _stored(outcome: Outcome) -> StoredResponse | None:
    if isinstance(outcome, Answered):
        return StoredResponse(outcome.status, outcome.headers, outcome.body)
    return None


def _describe(outcome: Outcome) -> str:
    match outcome:
        case Answered(status=status):
            return f"answered {status}"
        case NotSent(reason=reason) | NoAnswer(reason=reason):
            return reason
    assert_never(outcome)


def _refuse_redirect(outcome: Outcome, policy: UpstreamPolicy, effect_id: int | None, method: str) -> None:
    """A redirect that keeps the method is never relayed for a request that may have an effect.

    A client that follows it (requests and aiohttp do by default) would send the request again to
    wherever Location points, past the gateway: on the first answer and on every replay, with the
    agent's Effect-Gateway-Token. The upstream did not act (the record is retryable): say so instead.
    """
    if not (isinstance(outcome, Answered) and repeats_request(outcome.status, method)):
        return
    location = next((value for name, value in outcome.headers if name.lower() == "location"), "")
    # Stored header text stands for the upstream's bytes (surrogate-escaped): shown here as text.
    shown = location.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    raise problems.UpstreamRedirected(
        f"the upstream answered {outcome.status} with Location {shown or '(none)'}: it did not act on the "
        "request and asks for it there. The gateway relays no redirect that repeats a request, which a "
        "client following it would send past the gateway. Nothing was done; once "
        f"upstreams.{policy.name}.base_url points where it moved, retry with the same key",
        effect_id=effect_id,
        location=shown,
    )


def _reply(outcome: Outcome, effect_id: int | None) -> Reply:
    match outcome:
        case Answered():
            return Reply(StoredResponse(outcome.status, outcome.headers, outcome.body), False, effect_id)
        case NotSent(reason=reason):
            raise problems.UpstreamUnreachable(
                f"{reason}; nothing was sent, retry with the same key",
                headers={"Retry-After": "1"},
                effect_id=effect_id,
            )
        case NoAnswer(reason=reason, too_large=True):
            raise problems.ResponseTooLarge(
                f"{reason}; the effect may have happened, retry with the same key to recover it",
                effect_id=effect_id,
            )
        case NoAnswer(reason=reason, timed_out=True):
            raise problems.UpstreamTimeout(
                f"{reason}; the effect may have happened, retry with the same key to recover it",
                effect_id=effect_id,
            )
        case NoAnswer(reason=reason):
            raise problems.UpstreamBroken(
                f"{reason}; the effect may have happened, retry with the same key to recover it",
                effect_id=effect_id,
            )
    assert_never(outcome)
