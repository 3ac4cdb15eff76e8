"""The driver: carries out what :mod:`gateway.decision` says, against the store and the upstream.

It claims a request's key and follows the record to its end. Each action of the decision has one
handler here, which returns the agent's reply, how the request ended without one
(:mod:`gateway.endings`), or the record to decide on next; sending and settling an attempt are
:mod:`gateway.attempts`', probing :mod:`gateway.probing`'s, waiting for another request with the same
key :mod:`gateway.waiting`'s. None of them knows HTTP: :mod:`gateway.proxy` turns a request into an
:class:`~gateway.inbound.Inbound`, and :mod:`gateway.replies` turns what comes back into a response or
a problem.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Coroutine
from datetime import timedelta
from typing import Any, TypeVar, assert_never

from gateway import replies, trail
from gateway.attempts import Attempts, Held, first_sent
from gateway.decision import (
    Busy,
    Mismatch,
    Policy,
    Probe,
    Purged,
    Replay,
    Request,
    Resend,
    Restore,
    Review,
    SendReason,
    Unknown,
    carried_by,
    decide,
    review,
    why_not_probed,
)
from gateway.endings import (
    AwaitsOperator,
    Ending,
    InFlight,
    KeyMissing,
    KeyReused,
    ResponseGone,
)
from gateway.fingerprint import fingerprint
from gateway.inbound import Inbound, to_record, to_send
from gateway.keys import ScopedKey
from gateway.policy import keyless_mode
from gateway.probing import Probing
from gateway.record import EffectRecord
from gateway.replays import Completed, Replays
from gateway.replies import Reply
from gateway.seams import EffectProbe, EffectStore, Sender
from gateway.settings import SAFE_METHODS
from gateway.states import State
from gateway.telemetry import Telemetry
from gateway.waiting import Wait, WaitingRoom

log = logging.getLogger("effect_gateway")

T = TypeVar("T")

# What a handler comes to: the agent's answer, or the record to decide on again.
Step = Reply | Ending | EffectRecord


class EffectService:
    """Carry each request with a key to its end: claim it, send it, record what came of it, or replay,
    recover or refuse it."""

    def __init__(
        self,
        store: EffectStore,
        client: Sender,
        prober: EffectProbe,
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
        self._tasks: set[asyncio.Task[Any]] = set()
        self._replays = Replays(replay_cache_bytes, retention, store.add_replays, self._spawn)
        self._room = WaitingRoom(waiters_per_key)
        self._attempts = Attempts(store, client, self._room, self._replays, self._telemetry)
        self._probing = Probing(store, prober, self._attempts, self._replays, self._telemetry)

    async def handle(self, inbound: Inbound) -> Reply | Ending:
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

    def waiting(self, effect_id: int) -> int:
        """How many requests in this worker wait for the effect's call in flight."""
        return self._room.seated(effect_id)

    async def drain(self, timeout: float) -> None:
        """At shutdown: let calls under way finish and record, so none is left pending for nothing."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout)

    async def _handle(self, inbound: Inbound) -> Reply | Ending:
        if inbound.key is None:
            return await self._keyless(inbound)
        policy = inbound.upstream
        request = Request(
            fingerprint(
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
        known = self._replays.known(scope, self._attempts.clock())
        self._telemetry.replay_cache(hit=known is not None)
        if known is not None:
            return self._replay_known(known, request)
        derived = ScopedKey(*scope).derived(self._key_secret)
        # Built before the claim: a request that cannot be sent must leave no record behind.
        outbound = to_send(inbound, derived)
        took = self._attempts.clock()
        new = to_record(inbound, inbound.key, derived, request.fingerprint)
        record, created = await self._store.claim(new, policy.lease)
        if record is None:
            # Its month was archived: whatever state it was left in (completed, or even open) is not
            # here to decide on, and sending again could repeat it.
            return ResponseGone(None, "this key's audit row has been archived; nothing is sent for it again")
        trail.saw(record, created=created)
        if created:
            return await self._attempts.send(Held(record, took), policy, outbound, reason=None)
        wait = Wait(self._attempts.clock() + inbound.wait, inbound.client_left)
        try:
            return await self._follow(record, request, inbound, wait)
        finally:
            self._room.unseat(record.id, wait)

    def _replay_known(self, known: Completed, request: Request) -> Reply | Ending:
        trail.replayed_from_memory(known.id)
        if known.fingerprint != request.fingerprint:
            return KeyReused(known.id)
        self._replays.count(known.row_key)
        return Reply(known.response, replayed=True, effect_id=known.id)

    async def _keyless(self, inbound: Inbound) -> Reply | Ending:
        """Pass a request without an Idempotency-Key through, audit it once, or refuse it."""
        policy = inbound.upstream
        outbound = to_send(inbound, None)
        mode = "forward" if inbound.method in SAFE_METHODS else keyless_mode(policy, inbound.method)
        if mode == "refuse":
            return KeyMissing(inbound.method, policy.name)
        if mode == "forward":
            outcome = await self._client.send(outbound, policy.timeout.total_seconds())
            redirect = None
            if inbound.method not in SAFE_METHODS:
                redirect = replies.redirected(outcome, policy, None, inbound.method)
            return redirect or replies.reply(outcome, None)
        # "audit": one row for the audit, under a made-up key that no request can ever present again.
        took = self._attempts.clock()
        new = to_record(inbound, f"keyless:{uuid.uuid4().hex}", "", "", keyless=True)
        record, created = await self._store.claim(new, policy.lease)
        assert record is not None, "a made-up key of 128 random bits is new"
        assert created
        trail.saw(record, created=True)
        return await self._attempts.send(Held(record, took), policy, outbound, reason=None)

    async def _follow(
        self, record: EffectRecord, request: Request, inbound: Inbound, wait: Wait
    ) -> Reply | Ending:
        """Decide on the record, carry out the action, and again on the record it leads to, until done."""
        policy = inbound.upstream.decision
        while True:
            action = decide(record, request, record.as_of, policy)
            if not isinstance(action, Busy):
                self._room.unseat(record.id, wait)
            step: Step
            match action:
                case Replay():
                    step = self._replay(record)
                case Mismatch():
                    step = KeyReused(record.id)
                case Busy(retry_after=retry_after):
                    step = await self._wait_for_holder(record, retry_after, wait)
                case Resend(reason=reason):
                    step = await self._resend(record, inbound, reason)
                case Probe():
                    step = await self._probe(record, inbound)
                case Review():
                    step = await self._review(record, policy)
                case Unknown():
                    step = AwaitsOperator(record.id, record.attempt)
                case Restore():
                    step = await self._probing.restore(record, inbound.upstream)
                case Purged():
                    step = _unprobed(record, policy)
                case _:
                    assert_never(action)
            if not isinstance(step, EffectRecord):
                return step
            record = step

    # --- one handler for each action of decide() ------------------------------------------------------

    def _replay(self, record: EffectRecord) -> Reply:
        assert record.response is not None, "decide replays only a response on record"
        self._replays.remember(record, record.response, self._attempts.clock())
        self._replays.count(record.row_key)
        return Reply(record.response, replayed=True, effect_id=record.id)

    async def _wait_for_holder(self, record: EffectRecord, retry_after: timedelta, wait: Wait) -> Step:
        """Wait a little for the request that holds the key, then read the record again.

        Stops in flight when the wait is over, when its client has left (it reads the record at most
        once after), or when the key has as many waiters here as it may have.
        """
        # A request in flight ends within a second or so; a lease to wait out is told as is.
        told = timedelta(seconds=1) if record.state is State.PENDING else retry_after
        remaining = wait.deadline - self._attempts.clock()
        if remaining <= 0:
            return InFlight(record.id, told, "wait over")
        if wait.client_left():
            return InFlight(record.id, told, "client left")
        if (waiting := self._room.seat(record.id, wait)) is not None:
            return InFlight(record.id, told, "no seat", waiting)
        await self._room.nap(record.id, wait, min(remaining, retry_after.total_seconds()))
        return await self._attempts.reread(record)

    async def _resend(self, record: EffectRecord, inbound: Inbound, reason: SendReason) -> Step:
        """Take the record over and send the request it was first sent with."""
        policy = inbound.upstream
        carriers = carried_by(record, policy.decision, reason)
        taken = await self._attempts.take_over(record, policy, reason, sends=True, carriers=carriers)
        if isinstance(taken, EffectRecord):
            return taken  # another took it first: decide on it as it is now
        return await self._attempts.send(taken, policy, first_sent(inbound, taken.record), reason)

    async def _probe(self, record: EffectRecord, inbound: Inbound) -> Step:
        """Take the record over and ask the upstream whether the effect exists; then send, complete, or
        leave it for later."""
        taken = await self._attempts.take_over(record, inbound.upstream, "probe", sends=False)
        if isinstance(taken, EffectRecord):
            return taken  # another took it first: decide on it as it is now
        return await self._probing.probe_under(taken.record, inbound)

    async def _review(self, record: EffectRecord, policy: Policy) -> Step:
        """Give the record to an operator: nothing can tell whether the effect happened."""
        why = (
            f"no native key it was sent with within its TTL, and {why_not_probed(record, policy)}: "
            "nothing can tell if it happened"
        )
        try:
            reviewed = await self._store.send_to_review(record, review(record), why)
        finally:
            self._room.wake(record.id)
        if reviewed is None:
            return await self._attempts.reread(record)
        self._attempts.took(record, reviewed)
        log.warning("effect %s needs review (%s %s)", record.id, record.upstream, record.path)
        return AwaitsOperator(reviewed.id, reviewed.attempt)


def _unprobed(record: EffectRecord, policy: Policy) -> ResponseGone:
    """Say why nothing can supply the purged response of a completed effect: no probe is asked for it."""
    return ResponseGone(record.id, f"no probe is asked for it: {why_not_probed(record, policy)}")
