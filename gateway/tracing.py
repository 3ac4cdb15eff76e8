"""W3C trace context, and OpenTelemetry spans when the ``otel`` extra is installed.

The agent's ``traceparent`` and ``tracestate`` reach the upstream unchanged (gateway.upstream forwards
them as it forwards any end-to-end header), and the gateway's log lines carry the trace id. With
opentelemetry-api installed and a tracer provider set up (by ``opentelemetry-instrument``, or by a
program that embeds the gateway), each request to an upstream is a span whose parent is the incoming
``traceparent``, with a child span for each store statement, the upstream call and the probe. Without
opentelemetry, or without a provider, no span object is made at all.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from contextlib import AbstractContextManager
from importlib.metadata import PackageNotFoundError, version
from typing import Any

try:
    from opentelemetry import trace as otel
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError:  # the otel extra is not installed: the gateway runs without spans
    otel = None  # type: ignore[assignment]

# RFC: W3C Trace Context, section 3.2. Lower-case hex only; a version after 00 may add fields.
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")
_NO_TRACE = "0" * 32
_NO_PARENT = "0" * 16

Attributes = Mapping[str, str | int | bool]


def trace_id_of(traceparent: str | None) -> str | None:
    """The trace id of a valid ``traceparent`` header value, else None."""
    if traceparent is None:
        return None
    match = _TRACEPARENT.fullmatch(traceparent.strip(" \t"))
    if match is None:
        return None
    release, trace_id, parent, _, more = match.groups()
    if release == "ff" or (release == "00" and more) or trace_id == _NO_TRACE or parent == _NO_PARENT:
        return None
    return trace_id


def _our_version() -> str:
    try:
        return version("effect-gateway")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "0"


class Tracer:
    """The gateway's spans: real ones when OpenTelemetry is installed and set up, else none at all.

    ``provider`` is an OpenTelemetry ``TracerProvider``; by default the global one.
    """

    def __init__(self, provider: Any = None) -> None:
        self._tracer: Any = None
        if otel is None:
            return
        provider = provider if provider is not None else otel.get_tracer_provider()
        if isinstance(provider, otel.ProxyTracerProvider | otel.NoOpTracerProvider):
            return  # nothing was set up to receive spans: make none
        self._tracer = provider.get_tracer("effect_gateway", _our_version())
        self._propagator = TraceContextTextMapPropagator()

    @property
    def on(self) -> bool:
        return self._tracer is not None

    def request(
        self, name: str, headers: Mapping[str, str], attributes: Attributes
    ) -> AbstractContextManager[Any]:
        """A server span for a request, its parent the trace context the agent sent (if any)."""
        parent = self._propagator.extract(headers)
        return self._tracer.start_as_current_span(  # type: ignore[no-any-return]
            name, context=parent, kind=otel.SpanKind.SERVER, attributes=attributes, record_exception=False
        )

    def child(self, name: str, attributes: Attributes) -> AbstractContextManager[Any]:
        """A client span under the current one: a statement, an upstream call, a probe."""
        return self._tracer.start_as_current_span(  # type: ignore[no-any-return]
            name, kind=otel.SpanKind.CLIENT, attributes=attributes, record_exception=False
        )


def trace_id_of_span(span: Any) -> str | None:
    """The trace id of an OpenTelemetry span, as a traceparent writes it."""
    context = span.get_span_context()
    return otel.format_trace_id(context.trace_id) if context.is_valid else None
