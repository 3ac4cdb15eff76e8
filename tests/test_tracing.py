"""Traces: W3C trace context passed through to the upstream, and OpenTelemetry spans of a real gateway."""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from gateway.tracing import trace_id_of
from tests.database import runtime_url
from tests.gateways import gateway_server, start_gateway_process
from tests.support import PORT_ZERO
from tests.upstreams import ORDER_SEARCH, Upstream

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE}-{PARENT}-01"
TRACESTATE = "vendor=opaque-Value_1,other=x"
KEY = "run-42:4"
SEARCH = ORDER_SEARCH


async def _order(http: aiohttp.ClientSession, url: str, **headers: str) -> int:
    sent = {"Idempotency-Key": KEY, "Content-Type": "application/json", **headers}
    async with http.post(f"{url}/shop/orders", data=b'{"items":["atta"]}', headers=sent) as resp:
        await resp.read()
        return resp.status


@pytest.mark.parametrize(
    ("header", "trace_id"),
    [
        (TRACEPARENT, TRACE),
        (f" {TRACEPARENT} ", TRACE),
        (TRACEPARENT.upper(), None),  # hex is lower-case
        (f"ff-{TRACE}-{PARENT}-01", None),  # version ff is forbidden
        (f"00-{'0' * 32}-{PARENT}-01", None),
        (f"00-{TRACE}-{'0' * 16}-01", None),
        (f"00-{TRACE}-{PARENT}-01-more", None),  # version 00 has four fields
        (f"01-{TRACE}-{PARENT}-01-more", TRACE),  # a later version may add some
        (f"00-{TRACE[:-1]}-{PARENT}-01", None),
        ("", None),
        (None, None),
    ],
)
def test_the_trace_id_is_read_from_a_valid_traceparent_only(header: str | None, trace_id: str | None) -> None:
    """The log's trace id comes from a traceparent as W3C Trace Context defines it, or there is none."""
    assert trace_id_of(header) == trace_id


async def test_traceparent_and_tracestate_reach_the_upstream_unchanged(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """The agent's trace context goes to the upstream as it was sent, and is not part of the fingerprint."""
    async with gateway_server(dsn, upstreams={"shop": {"base_url": upstream.url}}) as gw:
        assert await _order(http, gw.url, traceparent=TRACEPARENT, tracestate=TRACESTATE) == 201
        # A retry in another trace is the same request: replayed, not refused as a reused key.
        assert await _order(http, gw.url, traceparent=f"00-{'1' * 32}-{PARENT}-01") == 201
    (call,) = upstream.calls
    assert [(n, v) for n, v in call.header_list if n.lower() in ("traceparent", "tracestate")] == [
        ("traceparent", TRACEPARENT),
        ("tracestate", TRACESTATE),
    ]


def _spans(exporter: InMemorySpanExporter) -> list[ReadableSpan]:
    return sorted(exporter.get_finished_spans(), key=lambda span: span.start_time or 0)


async def test_each_request_is_a_span_under_the_agents_with_its_statements_call_and_probe(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """OpenTelemetry: a server span per request, parented by traceparent; store, upstream and probe spans."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))

    async def create(request: web.Request) -> web.Response:
        if len(upstream.effects("/orders")) == 1:  # created, then answered as by a crashing upstream
            return web.json_response({"error": "lost"}, status=500)
        return web.json_response({"order": 2}, status=201)

    upstream.routes["/orders"] = create
    upstream.serve_search()
    cfg = {"shop": {"base_url": upstream.url, "stamp": {"json_field": "client_reference"}, "probe": SEARCH}}
    async with gateway_server(dsn, tracer_provider=provider, upstreams=cfg) as gw:
        assert await _order(http, gw.url, traceparent=TRACEPARENT) == 500
        first = _spans(exporter)
        exporter.clear()
        assert await _order(http, gw.url) == 201  # the probe finds it; a trace of its own
        second = _spans(exporter)
    provider.shutdown()

    (request,) = [span for span in first if span.kind is SpanKind.SERVER]
    assert request.name == "POST shop"
    assert request.context is not None
    assert request.context.trace_id == int(TRACE, 16)
    assert request.parent is not None
    assert request.parent.span_id == int(PARENT, 16)
    assert request.parent.is_remote
    attributes = dict(request.attributes or {})
    assert attributes["effect_gateway.upstream"] == "shop"
    assert attributes["http.request.method"] == "POST"
    assert attributes["effect_gateway.outcome"] == "sent"
    assert attributes["effect_gateway.state"] == "in_doubt"
    assert attributes["http.response.status_code"] == 500
    children = {
        span.name: span
        for span in first
        if span is not request and span.context is not None and span.context.trace_id == int(TRACE, 16)
    }
    assert set(children) == {"store claim", "upstream send", "store settle"}
    for child in children.values():
        assert child.parent is not None
        assert child.parent.span_id == request.context.span_id
        assert child.kind is SpanKind.CLIENT
    assert dict(children["upstream send"].attributes or {})["http.response.status_code"] == 500
    assert dict(children["store claim"].attributes or {})["db.operation.name"] == "claim"

    (retry,) = [span for span in second if span.kind is SpanKind.SERVER]
    assert retry.parent is None  # no traceparent came with it: a trace of its own
    assert dict(retry.attributes or {})["effect_gateway.outcome"] == "recovered_probe"
    (probe,) = [span for span in second if span.name == "upstream probe"]
    assert dict(probe.attributes or {})["effect_gateway.probe.result"] == "found"
    assert probe.parent is not None
    assert retry.context is not None
    assert probe.parent.span_id == retry.context.span_id
    for span in first + second:
        for value in (span.attributes or {}).values():
            assert KEY not in str(value)  # the key never, only its keyed hash
            assert "eg_" not in str(value)  # nor the key the upstream holds


async def test_without_opentelemetry_the_gateway_serves_and_logs_text_as_set(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """opentelemetry not importable: the gateway serves and scrapes; log_format = "text" gives text lines."""
    blocked = tmp_path / "blocked" / "opentelemetry"
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text('raise ImportError("opentelemetry is not installed here")\n')
    config = tmp_path / "gateway.toml"
    config.write_text(
        f'database_url = "{runtime_url(dsn)}"\n{PORT_ZERO}workers = 1\nlog_format = "text"\n'
        f'[upstreams.shop]\nbase_url = "{upstream.url}"\n'
    )
    gateway = start_gateway_process(config, {"PYTHONPATH": str(blocked.parent)})
    assert gateway.stderr is not None
    log = gateway.stderr
    try:
        assert await _order(http, gateway.url, traceparent=TRACEPARENT) == 201
        async with http.get(f"{gateway.admin_url}/_gateway/metrics") as resp:
            metrics = await resp.text()
    finally:
        gateway.stop()
    assert 'effect_gateway_requests_total{outcome="sent",problem="",upstream="shop"} 1.0' in metrics
    (decision,) = [line for line in log.whole() if "effect_gateway.decision" in line]
    assert " INFO effect_gateway.decision: POST shop/orders: sent, 201; effect 1 new -> completed" in decision
    assert decision.rstrip().endswith(f"trace={TRACE}")
    assert not any(line.startswith("{") for line in log.whole())
    with pytest.raises(json.JSONDecodeError):
        json.loads(decision)
