"""What one request to an upstream came to: noted by the driver as it goes, read once at the end.

The HTTP edge (:mod:`gateway.app`) starts a trail for each request to an upstream; the driver
(:mod:`gateway.service`) notes on it the effect it found or made, the state it left it in and what
recovered it. At the end the edge turns it into the request's metrics, its log line and its span's
attributes (:mod:`gateway.telemetry`). It lives in a context variable: every log line written while the
request runs carries its trace id, and the driver's task (which copies the context) notes on the same
trail. Outside a request (the simulator, the CLI) there is none, and noting is a no-op.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass

from gateway import problems
from gateway.record import EffectRecord
from gateway.states import State

# Problems that are an outcome of the idempotency decision, or an answer the gateway would not relay,
# rather than a refusal or a failure: an alert on outcome="failed" should not fire for them.
_OUTCOME_OF_PROBLEM = {
    problems.InFlight.type: "in_flight",
    problems.KeyReused.type: "key_reused",
    problems.OutcomeUnknown.type: "needs_review",
    problems.ResponsePurged.type: "purged",
    problems.Fenced.type: "fenced",
    problems.ProbeTooSoon.type: "too_soon",
    problems.UpstreamRedirected.type: "redirected",
}


@dataclass(slots=True)
class Trail:
    method: str
    started: float  # time.perf_counter() when the request came in
    trace_id: str | None = None
    upstream: str = ""  # empty until the request names a configured upstream
    # After the upstream's name, without the query (which may carry credentials); the whole path when the
    # request names no configured upstream.
    path: str = ""
    # A browser's own fetch (its icon, a crawler's robots.txt): never an upstream, and left out of the
    # request metrics, where it would pass for agents' refused requests.
    browser_noise: bool = False
    tenant: str | None = None
    key_hash: str | None = None
    run_id: str | None = None
    step: str | None = None
    effect_id: int | None = None
    # The state the request found the record in (None: it made the record, or there is none) and the
    # state it left it in.
    found: State | None = None
    left: State | None = None
    attempt: int | None = None
    recovered_by: str | None = None  # what recovered the effect during this request
    replayed: bool = False
    status: int | None = None
    problem: str | None = None  # the problem type of the gateway's own answer

    def saw(self, record: EffectRecord, *, created: bool = False) -> None:
        if self.effect_id is None:
            self.effect_id = record.id
            self.found = None if created else record.state
        self.left = record.state
        self.attempt = record.attempt

    @property
    def outcome(self) -> str:
        """What came of the request, in the words of ``effect_gateway_requests_total``'s outcome label."""
        if self.problem is not None:
            named = _OUTCOME_OF_PROBLEM.get(self.problem)
            if named is not None:
                return named
            return "refused" if self.status is not None and self.status < 500 else "failed"
        if self.status is None:
            return "failed"  # ended by an exception no problem was made of
        if self.recovered_by is not None:
            return f"recovered_{self.recovered_by}"
        return "replayed" if self.replayed else "sent"


CURRENT: ContextVar[Trail | None] = ContextVar("effect_gateway_trail", default=None)


def saw(record: EffectRecord, *, created: bool = False) -> None:
    """Note the record as this request read or wrote it."""
    if (trail := CURRENT.get()) is not None:
        trail.saw(record, created=created)


def recovered(by: str) -> None:
    """Note that this request completed the effect by recovering it (native key, probe, a re-send)."""
    if (trail := CURRENT.get()) is not None:
        trail.recovered_by = by


def replayed_from_memory(effect_id: int) -> None:
    """Note a replay of a completed effect kept in this process's memory (no record was read)."""
    if (trail := CURRENT.get()) is not None:
        trail.effect_id = effect_id
        trail.found = trail.left = State.COMPLETED
