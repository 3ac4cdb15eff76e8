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
from collections.abc import Awaitable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar, assert_never

from gateway import problems
from gateway.body import RequestBody
from gateway.decision import (
    Busy,
    Mismatch,
    Probe,
    Purged,
    Replay,
    Request,
    Resend,
    Review,
    Unknown,
    decide,
    settle,
)
from gateway.errors import ProbeFailed, StoreUnavailable
from gateway.faults import fault
from gateway.fingerprint import NEVER_FINGERPRINTED, fingerprint
from gateway.keys import ScopedKey
from gateway.outcome import Answered, NoAnswer, NotSent, Outcome
from gateway.policy import UpstreamPolicy
from gateway.probes import Prober
from gateway.record import EffectRecord, StoredResponse
from gateway.stamp import StampError
from gateway.states import State
from gateway.store import NewEffect, Store
from gateway.upstream import GATEWAY_REQUEST_HEADERS, HOP_BY_HOP, Outbound, UpstreamClient, build_outbound

log = logging.getLogger("effect_gateway")

T = TypeVar("T")

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
    def __init__(self, store: Store, client: UpstreamClient, prober: Prober) -> None:
        self._store = store
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
        policy = inbound.upstream
        if inbound.key is None:
            outbound = build_outbound(
                policy,
                None,
                inbound.method,
                inbound.path,
                inbound.query,
                inbound.headers,
                inbound.body,
            )
            outcome = await self._client.send(outbound, policy.timeout.total_seconds())
            return _reply(outcome, None)

        scoped = ScopedKey(inbound.tenant, policy.name, inbound.key)
        try:
            # Built before the claim: a request that cannot be sent must leave no record behind.
            outbound = build_outbound(
                policy,
                scoped.derived(),
                inbound.method,
                inbound.path,
                inbound.query,
                inbound.headers,
                inbound.body,
            )
        except StampError as exc:
            raise problems.CannotStamp(str(exc)) from None
        request = Request(
            fingerprint=fingerprint(
                inbound.method,
                inbound.path,
                inbound.query,
                inbound.body,
                inbound.headers,
                policy.fingerprint_headers,
                policy.never_stored,
            )
        )
        record, created = await self._store.claim(
            NewEffect(
                tenant=inbound.tenant,
                upstream=policy.name,
                key=inbound.key,
                derived_key=scoped.derived(),
                method=inbound.method,
                path=inbound.path,
                query=inbound.query,
                fingerprint=request.fingerprint,
                request_headers=redacted(inbound.headers, policy),
                request_body=inbound.body.raw,
                run_id=inbound.run_id,
                step=inbound.step,
            ),
            policy.lease,
        )
        if created:
            return await self._attempt(record, policy, outbound, recovered_by=None)
        return await self._follow(record, request, policy, outbound, inbound.wait)

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
                    # Off the agent's path: the counter is for the audit, and its commit is most of a
                    # replay's time. drain() still waits for it at shutdown.
                    self._spawn(self._store.count_replay(record))
                    return Reply(record.response, replayed=True, effect_id=record.id)
                case Mismatch():
                    raise problems.KeyReused(
                        "this Idempotency-Key was first used with a different method, path, query or body",
                        effect_id=record.id,
                    )
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
                    record = await self._store.reread(record)
                case Resend(reason=reason):
                    claimed = await self._store.reclaim(record, policy.lease, reason)
                    if claimed is None:
                        record = await self._store.reread(record)
                        continue
                    recovered = None if reason == "retryable" else reason
                    return await self._attempt(claimed, policy, outbound, recovered_by=recovered)
                case Probe():
                    claimed = await self._store.reclaim(record, policy.lease, "probe")
                    if claimed is None:
                        record = await self._store.reread(record)
                        continue
                    return await self._probe(claimed, policy, outbound)
                case Review():
                    reviewed = await self._wake_after(
                        record,
                        self._store.send_to_review(
                            record, "no native key within its TTL, no probe: nothing can tell if it happened"
                        ),
                    )
                    if reviewed is None:
                        record = await self._store.reread(record)
                        continue
                    log.warning("effect %s needs review (%s %s)", record.id, record.upstream, record.path)
                    raise _outcome_unknown(record)
                case Unknown():
                    raise _outcome_unknown(record)
                case Purged():
                    raise problems.ResponsePurged(
                        "the effect happened; its response was dropped after the retention and this upstream "
                        "offers no native key or probe to recover it",
                        effect_id=record.id,
                    )
                case _:
                    assert_never(action)

    async def _settle(self, record: EffectRecord, state: State, **what: Any) -> EffectRecord | None:
        return await self._wake_after(record, self._store.settle(record, state, **what))

    async def _wake_after(self, record: EffectRecord, write: Awaitable[T]) -> T:
        """Carry out a write to the record, then wake the twins waiting on it here, whatever came of it."""
        try:
            return await write
        finally:
            if (woken := self._waiters.pop(record.id, None)) is not None:
                woken.set()

    async def _attempt(
        self, record: EffectRecord, policy: UpstreamPolicy, outbound: Outbound, recovered_by: str | None
    ) -> Reply:
        """Send under the attempt ``record`` holds, and write down what came of it (fenced)."""
        fault("after-claim", policy.name)
        outcome = await self._client.send(outbound, policy.timeout.total_seconds())
        fault("after-upstream", policy.name)
        settled = settle(outcome, earlier_doubt=record.may_have_sent)
        try:
            saved = await self._settle(
                record,
                settled.state,
                may_have_sent=settled.may_have_sent,
                ends_lease=settled.ends_lease,
                response=_stored(outcome),
                recovered_by=recovered_by if settled.state is State.COMPLETED else None,
                note=_describe(outcome),
            )
        except StoreUnavailable as exc:
            # The request left, and what came of it could not be written: the record stays pending until
            # its lease runs out, and the retry recovers it like a gateway crash at this very point.
            log.error("effect %s: %s; could not record it: %s", record.id, _describe(outcome), exc)
            raise problems.StoreDown(
                f"the upstream was called but its outcome could not be recorded ({exc}); retry with the same "
                "key to recover it",
                headers={"Retry-After": str(max(1, math.ceil(policy.lease.total_seconds())))},
                effect_id=record.id,
            ) from None
        if saved is None:
            await self._store.note_fenced(record, _describe(outcome))
            raise problems.Fenced(
                "this gateway's attempt was taken over by a newer one; retry to get the recorded outcome",
                headers={"Retry-After": "1"},
                effect_id=record.id,
            )
        fault("after-record", policy.name)
        return _reply(outcome, record.id)

    async def _probe(self, record: EffectRecord, policy: UpstreamPolicy, outbound: Outbound) -> Reply:
        try:
            found = await self._prober.probe(policy, record.derived_key)
        except ProbeFailed as exc:
            # Back to in doubt, exactly as it was: no request left, so no lease need be waited out.
            await self._settle(
                record,
                State.IN_DOUBT,
                may_have_sent=True,
                ends_lease=True,
                response=None,
                recovered_by=None,
                note=f"probe failed: {exc}",
            )
            raise problems.ProbeUnavailable(
                f"{exc}; the record is unchanged, retry later",
                headers={"Retry-After": "5"},
                effect_id=record.id,
            ) from None
        if found is None:
            log.info("probe: effect %s not found upstream, sending", record.id)
            return await self._attempt(record, policy, outbound, recovered_by=None)
        saved = await self._settle(
            record,
            State.COMPLETED,
            may_have_sent=True,
            ends_lease=True,
            response=found,
            recovered_by="probe",
            note="found by probe",
        )
        if saved is None:
            await self._store.note_fenced(record, "probe found the effect")
            raise problems.Fenced("a newer attempt took over while probing; retry", effect_id=record.id)
        return Reply(found, replayed=True, effect_id=record.id)


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
