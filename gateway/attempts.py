"""Send under an attempt the gateway holds, and write down what came of it, fenced on that attempt.

An attempt is held from the statement that took the record (a claim or a take-over) until its
settlement is written. If another gateway takes the record over meanwhile, every write of this one is
refused (fenced) and the request ends :class:`~gateway.endings.Fenced`.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

from gateway import replies, trail
from gateway.decision import (
    Late,
    Refuse,
    Send,
    SendReason,
    Settlement,
    before_sending,
    settle,
    take_over,
    unrecorded,
)
from gateway.endings import AwaitsOperator, Ending, Fenced, FencedDuring, Unrecorded
from gateway.errors import NotAsFirstSent, StoreRejected, StoreUnavailable
from gateway.faults import fault
from gateway.inbound import Inbound, as_first_sent
from gateway.outcome import NotSent, Outcome
from gateway.policy import UpstreamPolicy
from gateway.record import EffectRecord, KeyCarriers, StoredResponse
from gateway.replays import Replays
from gateway.replies import Reply
from gateway.seams import EffectStore, Sender
from gateway.states import State
from gateway.telemetry import Telemetry
from gateway.upstream import Outbound
from gateway.waiting import WaitingRoom

log = logging.getLogger("effect_gateway")

# Times a gateway that fell behind its lease before sending takes the record again; more means it is
# too overloaded to keep any lease, and the request is settled as never sent.
RENEWALS = 3


@dataclass(frozen=True, slots=True)
class Held:
    """An attempt this gateway holds: its record, and this process's clock from just before the
    statement that took it (how long it has held the record, for the lease)."""

    record: EffectRecord
    took: float


class Attempts:
    """Take records over, send under the attempt held, and settle it; wake the requests waiting here
    whenever a write to the record ends."""

    def __init__(
        self, store: EffectStore, client: Sender, room: WaitingRoom, replays: Replays, telemetry: Telemetry
    ) -> None:
        self._store = store
        self._client = client
        self._room = room
        self._replays = replays
        self._telemetry = telemetry
        self._loop: asyncio.AbstractEventLoop | None = None

    def clock(self) -> float:
        """Return the event loop's monotonic clock: only for how long this process itself has waited.

        The loop is looked up once: asyncio.get_running_loop() asks the kernel for the process id on
        every call (CPython 3.11), and a new effect reads the clock nine times.
        """
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop.time()

    async def take_over(
        self,
        record: EffectRecord,
        policy: UpstreamPolicy,
        why: str,
        *,
        sends: bool,
        carriers: KeyCarriers | None = None,
    ) -> Held | EffectRecord:
        """Take the record over for a new attempt (``sends``: to send, else to probe); if another did
        first, return the record as it is now."""
        took = self.clock()
        claimed = await self._store.reclaim(
            record, take_over(record), policy.lease, why, sends=sends, carriers=carriers
        )
        if claimed is None:
            return await self.reread(record)
        self.took(record, claimed)
        return Held(claimed, took)

    async def send(
        self, held: Held, policy: UpstreamPolicy, outbound: Outbound | Refuse, reason: SendReason | None
    ) -> Reply | Ending:
        """Send under the attempt ``held``, and write down what came of it (fenced).

        ``outbound`` is a Refuse when the request cannot be built: it is settled as never sent.
        """
        fault("after-claim", policy.name)
        ready = await self._keep_lease(held, policy, reason)
        if not isinstance(ready, tuple):
            return ready
        held, check = ready
        outcome: Outcome
        match check, outbound:
            case Send(), Outbound():
                window = _left_to_leave(policy, self.clock() - held.took)
                outcome = await self._client.send(outbound, policy.timeout.total_seconds(), window)
            case (Refuse() as refused, _) | (Send(), Refuse() as refused):
                log.warning("effect %s: %s", held.record.id, refused.reason)
                outcome = NotSent(refused.reason)
        fault("after-upstream", policy.name)
        try:
            return await self._record(held.record, policy, outcome, reason)
        except (StoreUnavailable, StoreRejected) as exc:
            # What came of a request that may have left could not be written (here or in the fallback
            # to review): the record stays as it was until its lease runs out, and the retry recovers it
            # like a gateway crash at this very point. Never "nothing was sent".
            seen = replies.describe(outcome)
            log.error("effect %s: %s; could not record it: %s", held.record.id, seen, exc)
            return Unrecorded(held.record.id, seen, str(exc), policy.lease)

    async def _keep_lease(
        self, held: Held, policy: UpstreamPolicy, reason: SendReason | None
    ) -> tuple[Held, Send | Refuse] | Fenced:
        """Say whether the request may leave under ``held``, taking the record again first when this
        gateway fell behind its lease (the returned attempt is the one to send under)."""
        for _ in range(RENEWALS):
            waited = timedelta(seconds=self.clock() - held.took)
            check = before_sending(held.record, held.record.as_of, waited, policy.decision, reason)
            if not isinstance(check, Late):
                return held, check
            log.warning(
                "effect %s: %.1fs late to send; taking it again", held.record.id, waited.total_seconds()
            )
            # Its own request, with what carried the key as the take-over it renews recorded.
            carriers = held.record.key_carriers
            seen = f"not sent: {waited.total_seconds():.1f}s late, and another attempt took over"
            renewed = await self.renew(held.record, policy, "late to send", carriers, "late to send", seen)
            if isinstance(renewed, Fenced):
                return renewed
            held = renewed
        return held, Refuse("not sent: the gateway kept falling behind its lease before sending")

    async def renew(
        self,
        record: EffectRecord,
        policy: UpstreamPolicy,
        why: str,
        carriers: KeyCarriers | None,
        during: Literal["late to send", "probing"],
        seen: str,
    ) -> Held | Fenced:
        """Take the record this gateway holds again, for a fresh lease before its request leaves; fenced
        (``seen`` noted in its history) when a newer attempt took it over meanwhile. No attempt of this
        one reached the upstream, so the renewal adds no doubt."""
        took = self.clock()
        renewed = await self._store.reclaim(
            record, take_over(record), policy.lease, why, sends=True, renew=True, carriers=carriers
        )
        if renewed is None:
            return await self.fenced(record, seen, during)
        trail.saw(renewed)
        return Held(renewed, took)

    async def _record(
        self, record: EffectRecord, policy: UpstreamPolicy, outcome: Outcome, reason: SendReason | None
    ) -> Reply | Ending:
        """Write down what the attempt ``record`` holds came to (fenced), and answer with it."""
        recovered_by = None if reason in (None, "retryable") else reason
        settled = settle(outcome, earlier_doubt=record.may_have_sent, method=record.method)
        response = replies.stored(outcome)  # None when nothing answered
        completed = settled.state is State.COMPLETED
        seen = replies.describe(outcome)
        try:
            saved = await self.settle(
                record, settled, response, recovered_by=recovered_by if completed else None, note=seen
            )
        except StoreRejected as exc:
            return await self._unrecorded(record, settled, outcome, exc)
        if saved is None:
            return await self.fenced(record, seen, "recording")
        fault("after-record", policy.name)
        if completed and recovered_by is not None:
            trail.recovered(recovered_by)
        if completed and response is not None:
            self._replays.remember(saved, response, self.clock())
        return replies.redirected(outcome, policy, record.id, record.method) or replies.reply(
            outcome, record.id
        )

    async def _unrecorded(
        self, record: EffectRecord, settled: Settlement, outcome: Outcome, exc: StoreRejected
    ) -> Reply | Ending:
        """Postgres is up but refused what the upstream answered: never leave the record pending.

        A pending record would be taken over when its lease runs out and, lacking an answer, sent again
        (possibly forever). It goes to review instead, with what the gateway saw in its history.
        """
        answered = replies.describe(outcome)
        seen = f"{answered}, but the answer could not be recorded: {exc}"
        log.error("effect %s: %s", record.id, seen)
        instead = unrecorded(settled)
        saved = await self.settle(record, instead, None, recovered_by=None, note=seen)
        if instead.state is not State.NEEDS_REVIEW:
            if saved is None:
                await self._store.note_fenced(record, seen)
            return replies.reply(outcome, record.id)  # nothing reached the upstream: say what stopped it
        if saved is None:
            return await self.fenced(record, seen, "recording", answer=answered)
        return AwaitsOperator(record.id, record.attempt, answered, str(exc))

    async def settle(
        self,
        record: EffectRecord,
        settlement: Settlement,
        response: StoredResponse | None,
        *,
        recovered_by: str | None,
        note: str,
    ) -> EffectRecord | None:
        """Write the settlement under the attempt ``record`` holds, then wake the requests waiting for it
        here, whatever came of the write."""
        try:
            saved = await self._store.settle(
                record, settlement, response=response, recovered_by=recovered_by, note=note
            )
        finally:
            self._room.wake(record.id)
        if saved is not None:
            trail.saw(saved)
        return saved

    async def fenced(
        self,
        record: EffectRecord,
        seen: str,
        during: FencedDuring,
        *,
        answer: str | None = None,
    ) -> Fenced:
        """Note in the history what this gateway saw after a newer attempt took the record over from it,
        and end the request fenced."""
        await self._store.note_fenced(record, seen)
        return Fenced(record.id, during, answer)

    async def reread(self, record: EffectRecord) -> EffectRecord:
        """Read the record again, as it is now."""
        fresh = await self._store.reread(record)
        trail.saw(fresh)
        return fresh

    def took(self, record: EffectRecord, taken: EffectRecord) -> None:
        """Note that ``record`` as read was taken (again, or for review); count a lease that ran out as
        taken over."""
        trail.saw(taken)
        if record.state is State.PENDING:
            self._telemetry.taken_over(record.upstream)


def first_sent(inbound: Inbound, record: EffectRecord) -> Outbound | Refuse:
    """Return the request a take-over sends: the one the effect was first sent with
    (inbound.as_first_sent), or a refusal saying why it cannot be sent again."""
    try:
        return as_first_sent(inbound, record)
    except NotAsFirstSent as exc:
        return Refuse(f"not sent: {exc}")


def _left_to_leave(policy: UpstreamPolicy, held_for: float) -> float | None:
    """Return what is left of the send window after holding the record ``held_for`` seconds: the request
    must leave by then, or not at all.

    The lease covers the upstream's timeout from a departure within the window. A request that waits
    for a pooled connection past it would reach the upstream too late for the lease to cover its work,
    and a retry after the lease could probe, find nothing yet, and send it again.
    """
    window = policy.decision.send_window
    # At least a millisecond: aiohttp reads a timeout of 0 as none at all.
    return None if window is None else max(0.001, window.total_seconds() - held_for)
