"""Ask an upstream whether an effect exists (the probe), and carry out what its answer comes to.

A probe runs under a take-over of the record, as a send does: its answer is written fenced on that
attempt. "Found" completes the record with the probe's answer; "not found" sends the effect once the
probe can be trusted to have looked (:func:`gateway.decision.after_probe`), else leaves it in doubt or
to an operator; a failed probe leaves it in doubt, to be probed again. A completed effect whose
response was purged is only ever restored from a probe, never sent again.
"""

from __future__ import annotations

import logging
from typing import assert_never

from gateway import trail
from gateway.attempts import Attempts, first_sent
from gateway.decision import Send, Settlement, TakeOver, TooSoon, after_probe, carried_by, restore
from gateway.endings import AwaitsOperator, Ending, Fenced, ProbeTooSoon, ProbeUnavailable, ResponseGone
from gateway.errors import ProbeFailed
from gateway.inbound import Inbound
from gateway.outcome import Found, NotFound, ProbeError, ProbeResult
from gateway.policy import UpstreamPolicy
from gateway.record import EffectRecord
from gateway.replays import Replays
from gateway.replies import Reply
from gateway.seams import EffectProbe, EffectStore
from gateway.states import State
from gateway.telemetry import Telemetry

log = logging.getLogger("effect_gateway")


class Probing:
    """Probe under a take-over, settle what the probe says, and restore purged responses."""

    def __init__(
        self,
        store: EffectStore,
        prober: EffectProbe,
        attempts: Attempts,
        replays: Replays,
        telemetry: Telemetry,
    ) -> None:
        self._store = store
        self._prober = prober
        self._attempts = attempts
        self._replays = replays
        self._telemetry = telemetry

    async def look(self, policy: UpstreamPolicy, record: EffectRecord) -> ProbeResult:
        """Ask the upstream whether the effect exists, by the key stamped into it."""
        with self._telemetry.probe(policy.name) as probing:
            try:
                found = await self._prober.probe(policy, record.derived_key)
            except ProbeFailed as exc:
                return ProbeError(str(exc))
            probing.result = "not_found" if found is None else "found"
            return NotFound() if found is None else Found(found)

    async def probe_under(self, record: EffectRecord, inbound: Inbound) -> Reply | Ending:
        """Probe under the take-over ``record`` holds, and carry out what the probe's answer comes to."""
        policy = inbound.upstream
        asked_at = record.as_of  # the take-over's clock: the probe leaves after it
        result = await self.look(policy, record)
        step = after_probe(record, result, asked_at, policy.decision)
        if isinstance(step, TakeOver):
            # Taken again once the probe has answered: the new attempt's lease covers the send (the
            # probe may have used up most of the old one), and the take-over reads the database's clock
            # after the probe, which is when "not found" must still be within the probe's horizon.
            carriers = carried_by(record, policy.decision, None)
            found_nothing = "the probe found nothing"
            held = await self._attempts.renew(
                record, policy, found_nothing, carriers, "probing", found_nothing
            )
            if isinstance(held, Fenced):
                return held
            record = held.record
            step = after_probe(record, result, asked_at, policy.decision, retaken_at=record.as_of)
            if isinstance(step, Send):
                log.info("probe: effect %s not found upstream, sending", record.id)
                return await self._attempts.send(held, policy, first_sent(inbound, record), reason=None)
        match step:
            case TooSoon():
                return await self._too_soon(record, step)
            case Settlement():
                return await self._settle_probe(record, step, result)
            case Send() | TakeOver():
                raise AssertionError("a probe sends only once taken again, and is taken again once")
            case _:
                assert_never(step)

    async def _settle_probe(
        self, record: EffectRecord, verdict: Settlement, result: ProbeResult
    ) -> Reply | Ending:
        """Write down what the probe came to (fenced): completed with its answer, in review, or in doubt."""
        found = result.response if isinstance(result, Found) else None
        note = {
            State.COMPLETED: "found by probe",
            State.IN_DOUBT: f"probe failed: {result.reason if isinstance(result, ProbeError) else ''}",
            State.NEEDS_REVIEW: "the probe found nothing, but the effect is older than the probe's horizon",
        }[verdict.state]
        saved = await self._attempts.settle(
            record, verdict, found, recovered_by="probe" if found else None, note=note
        )
        if saved is None:
            return await self._attempts.fenced(record, note, "probing")
        match verdict.state:
            case State.COMPLETED:
                assert found is not None
                trail.recovered("probe")
                self._replays.remember(saved, found, self._attempts.clock())
                return Reply(found, replayed=True, effect_id=record.id)
            case State.NEEDS_REVIEW:
                log.warning("effect %s needs review: %s", record.id, note)
                return AwaitsOperator(record.id, record.attempt)
        return ProbeUnavailable(record.id, f"{note}; the record is unchanged, retry later")

    async def _too_soon(self, record: EffectRecord, early: TooSoon) -> Ending:
        """The probe found nothing before its search could list the latest attempt: in doubt, nothing sent.

        Written under the probe's take-over, which left the send times as they were: the next probe
        judges the lag from the same attempt, so waiting it out ends.
        """
        note = "the probe found nothing, but too soon after the latest attempt for its search to list it"
        saved = await self._attempts.settle(record, early.settlement, None, recovered_by=None, note=note)
        if saved is None:
            return await self._attempts.fenced(record, note, "probing")
        return ProbeTooSoon(record.id, note, early.retry_after)

    async def restore(self, record: EffectRecord, policy: UpstreamPolicy) -> Reply | Ending:
        """Ask the probe for the response of a completed effect whose response was purged; never send."""
        looked = await self.look(policy, record)
        match looked:
            case Found(response=response):
                # A probe's answer may differ from one search to the next: only the first stored is
                # given, to this request and every other, from Postgres or any worker's memory.
                stored, restored = await self._store.restore(record, restore(record), response)
                trail.saw(stored)
                if stored.response is None:
                    return ResponseGone(record.id, "the answer restored for it was dropped again")
                if restored:
                    trail.recovered("probe")
                self._replays.remember(stored, stored.response, self._attempts.clock())
                return Reply(stored.response, replayed=True, effect_id=record.id)
            case NotFound():
                return ResponseGone(record.id, "the probe no longer finds it")
            case ProbeError(reason=reason):
                return ProbeUnavailable(
                    record.id,
                    f"probe failed: {reason}; the effect happened and nothing will be sent again, retry "
                    "later for its response",
                )
            case _:
                assert_never(looked)
