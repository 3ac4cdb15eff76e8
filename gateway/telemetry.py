"""Where the seams and the driver report what they did: metrics, spans and the line per decision.

The store times each statement, the upstream client each call, the driver each probe, its replays from
memory and the leases it takes over; the HTTP edge each whole request. They report to a
:class:`Telemetry`: the base records nothing (the simulator, the command line), :class:`Observed` is the
running gateway's (its :class:`~gateway.metrics.Metrics`, its :class:`~gateway.tracing.Tracer` and its
log). What a request came to is read from its :class:`~gateway.trail.Trail`, which the driver fills in.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from types import TracebackType
from typing import Any

from gateway import logs
from gateway.metrics import Metrics
from gateway.outcome import Answered, Outcome
from gateway.tracing import Tracer, trace_id_of, trace_id_of_span
from gateway.trail import Trail

_NOTHING: AbstractContextManager[None] = nullcontext()
STORE_SPAN = {"db.system.name": "postgresql"}


class Call:
    """One call to an upstream under way; its outcome is set by the caller once known."""

    __slots__ = ("outcome",)

    def __init__(self) -> None:
        self.outcome: Outcome | None = None


class Probing:
    """One probe under way; its result (found, not_found, failed) is set by the caller once known."""

    __slots__ = ("result",)

    def __init__(self) -> None:
        self.result = "failed"  # unless the caller says otherwise, the probe could not tell


class Telemetry:
    """Records nothing: for the parts of the gateway run outside a serving process."""

    def statement(self, kind: str) -> AbstractContextManager[None]:
        """Around one store statement (``kind``: claim, settle, ... as in gateway.metrics.STATEMENTS)."""
        return _NOTHING

    def upstream_call(self, upstream: str, method: str) -> AbstractContextManager[Call]:
        return nullcontext(Call())

    def probe(self, upstream: str) -> AbstractContextManager[Probing]:
        return nullcontext(Probing())

    def replay_cache(self, hit: bool) -> None:
        """A keyed request was (hit) or was not (miss) answered from the completed effects in memory."""

    def taken_over(self, upstream: str) -> None:
        """A pending record whose lease ran out was taken over."""

    def notification(self, event: str, outcome: str) -> None:
        """A delivery to the webhook was made: ``outcome`` delivered, failed (tried again) or gave_up."""


class Observed(Telemetry):
    """The running gateway's metrics, spans and decision log."""

    def __init__(self, metrics: Metrics, tracer: Tracer) -> None:
        self.metrics = metrics
        self.tracer = tracer

    def statement(self, kind: str) -> AbstractContextManager[None]:
        histogram = self.metrics.statements.get(kind) or self.metrics.statement_seconds.labels(kind)
        span = (
            self.tracer.child(f"store {kind}", {**STORE_SPAN, "db.operation.name": kind})
            if self.tracer.on
            else None
        )
        return _Timed(histogram, span)

    @contextmanager
    def upstream_call(self, upstream: str, method: str) -> Iterator[Call]:
        call = Call()
        histogram = self.metrics.upstream(upstream).send_seconds
        started = time.perf_counter()
        if not self.tracer.on:
            try:
                yield call
            finally:
                histogram.observe(time.perf_counter() - started)
            return
        attributes = {"effect_gateway.upstream": upstream, "http.request.method": method}
        with self.tracer.child("upstream send", attributes) as span:
            try:
                yield call
            finally:
                histogram.observe(time.perf_counter() - started)
                if isinstance(call.outcome, Answered):
                    span.set_attribute("http.response.status_code", call.outcome.status)

    @contextmanager
    def probe(self, upstream: str) -> Iterator[Probing]:
        probing = Probing()
        bound = self.metrics.upstream(upstream)
        started = time.perf_counter()
        span_cm = (
            self.tracer.child("upstream probe", {"effect_gateway.upstream": upstream})
            if self.tracer.on
            else None
        )
        with span_cm or nullcontext() as span:
            try:
                yield probing
            finally:
                bound.probe_seconds.observe(time.perf_counter() - started)
                bound.probes[probing.result].inc()
                if span is not None:
                    span.set_attribute("effect_gateway.probe.result", probing.result)

    def replay_cache(self, hit: bool) -> None:
        (self.metrics.cache_hit if hit else self.metrics.cache_miss).inc()

    def taken_over(self, upstream: str) -> None:
        self.metrics.upstream(upstream).taken_over.inc()

    def notification(self, event: str, outcome: str) -> None:
        self.metrics.notifications.labels(event, outcome).inc()

    def verdict(self, upstream: str, happened: bool) -> None:
        """An operator resolved an effect through the gateway."""
        self.metrics.verdicts.labels(upstream, "happened" if happened else "did_not_happen").inc()

    def request(self, trail: Trail, headers: Mapping[str, str]) -> AbstractContextManager[None]:
        """Around one request to an upstream: on the way out, its metrics, its log line and its span."""
        return _Request(self, trail, headers)

    def account(self, trail: Trail, span: Any) -> None:
        """What came of the request, as its trail says: counted, timed, logged, and on its span."""
        seconds = time.perf_counter() - trail.started
        outcome = trail.outcome
        if not trail.browser_noise:
            counter, histogram = self.metrics.upstream(trail.upstream).request(outcome, trail.problem or "")
            counter.inc()
            histogram.observe(seconds)
        logs.decision(trail, outcome, seconds)
        if span is not None:
            span.update_name(f"{trail.method} {trail.upstream or 'effect-gateway'}")
            span.set_attributes(_span_attributes(trail, outcome))


def _span_attributes(trail: Trail, outcome: str) -> dict[str, str | int]:
    """What a span says of a request: never the key (only its keyed hash), never a header."""
    attributes: dict[str, str | int] = {"effect_gateway.outcome": outcome}
    for name, value in (
        ("effect_gateway.upstream", trail.upstream),
        ("effect_gateway.tenant", trail.tenant),
        ("effect_gateway.effect_id", trail.effect_id),
        ("effect_gateway.state", trail.left.value if trail.left else None),
        ("effect_gateway.state_before", trail.found.value if trail.found else None),
        ("effect_gateway.attempt", trail.attempt),
        ("effect_gateway.recovered_by", trail.recovered_by),
        ("effect_gateway.key_hash", trail.key_hash),
        ("effect_gateway.problem", trail.problem),
        ("http.response.status_code", trail.status),
    ):
        if value:
            attributes[name] = value
    return attributes


class _Request:
    """The span of a request when tracing (the agent's trace context its parent), and its accounting."""

    __slots__ = ("_active", "_headers", "_observed", "_span", "_trail")

    def __init__(self, observed: Observed, trail: Trail, headers: Mapping[str, str]) -> None:
        self._observed = observed
        self._trail = trail
        self._headers = headers
        self._span: AbstractContextManager[Any] | None = None
        self._active: Any = None

    def __enter__(self) -> None:
        trail, tracer = self._trail, self._observed.tracer
        if not tracer.on:
            trail.trace_id = trace_id_of(self._headers.get("traceparent"))
            return
        self._span = tracer.request(
            f"{trail.method} effect-gateway", self._headers, {"http.request.method": trail.method}
        )
        self._active = self._span.__enter__()
        trail.trace_id = trace_id_of_span(self._active)

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._span is None:
            self._observed.account(self._trail, None)
            return
        try:
            self._observed.account(self._trail, self._active)
        finally:
            self._span.__exit__(kind, exc, tb)


class _Timed:
    """A store statement: its time to a histogram child, and its span when tracing."""

    __slots__ = ("_histogram", "_span", "_started")

    def __init__(self, histogram: Any, span: AbstractContextManager[Any] | None) -> None:
        self._histogram = histogram
        self._span = span
        self._started = 0.0

    def __enter__(self) -> None:
        if self._span is not None:
            self._span.__enter__()
        self._started = time.perf_counter()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._histogram.observe(time.perf_counter() - self._started)
        if self._span is not None:
            self._span.__exit__(kind, exc, tb)
