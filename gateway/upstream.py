"""The one HTTP seam: build the outbound request, send it, and say what came of it.

aiohttp's exceptions end here: the rest of the gateway sees only :mod:`gateway.outcome` values. The
line between "nothing left" and "it may have arrived" is drawn by aiohttp's own trace signal that the
request headers were written, not by guessing from exception types.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import aiohttp
from multidict import CIMultiDict
from yarl import URL

from gateway import mcp
from gateway.body import RequestBody
from gateway.headers import (
    GATEWAY_REQUEST_HEADERS,
    HOP_BY_HOP,
    UNSTORED_RESPONSE_HEADERS,
    connection_scoped,
    same_header,
)
from gateway.outcome import Answered, NoAnswer, NotSent, Outcome
from gateway.policy import UpstreamPolicy
from gateway.stamp import stamp_request
from gateway.telemetry import Telemetry

# Re-exported: the service keeps them out of the audit.
__all__ = ["GATEWAY_REQUEST_HEADERS", "HOP_BY_HOP", "UNSTORED_RESPONSE_HEADERS", "Outbound", "UpstreamClient"]


@dataclass(frozen=True, slots=True)
class Outbound:
    upstream: str
    method: str
    url: URL
    headers: CIMultiDict[str]
    body: bytes
    # An MCP tool call's JSON-RPC id (gateway.mcp): the answer is the server's response to it, read as
    # it arrives; None: the HTTP answer, read whole.
    answer_to: str | None = None


def build_outbound(
    policy: UpstreamPolicy,
    derived_key: str | None,
    method: str,
    path: str,
    query: str,
    headers: Mapping[str, str],
    body: RequestBody,
) -> Outbound:
    """The request the upstream receives: the agent's, with the derived key, stamp and credentials.

    Repeated agent headers stay repeated (``headers`` may be a multidict, and its items() gives each).
    """
    dropped = connection_scoped(headers.items()) | GATEWAY_REQUEST_HEADERS
    out = CIMultiDict((name, value) for name, value in headers.items() if name.lower() not in dropped)
    raw = body.raw
    # Without a key (derived_key is None) the request is forwarded as it is: no derived key, no stamp.
    if derived_key is not None and policy.native_header:
        out[policy.native_header] = derived_key
    if derived_key is not None and policy.stamp is not None:
        kind, name = policy.stamp
        query, raw = stamp_request(kind, name, derived_key, query=query, headers=out, body=body)
    # Injected credentials replace whatever the agent sent under any spelling (``_`` for ``-`` too, which
    # CGI and WSGI servers read as the same header): agents hold no secrets.
    injected = {same_header(name) for name in policy.inject.headers}
    for name in [name for name in out if same_header(name) in injected]:
        out.popall(name, None)
    out.extend(policy.inject.headers)
    target = policy.base_url + path + (f"?{query}" if query else "")
    return Outbound(policy.name, method, URL(target, encoded=True), out, raw)


def storable_headers(raw_headers: Iterable[tuple[bytes, bytes]]) -> tuple[tuple[str, str], ...]:
    """End-to-end response headers as the upstream sent them, losslessly as text.

    Each name and value is the raw bytes decoded 'utf-8' with 'surrogateescape', so encoding it back the
    same way (gateway.wire) gives the upstream's exact bytes: a value such as ``caf\xe9`` survives.
    """
    decoded = [
        (name.decode("utf-8", "surrogateescape"), value.decode("utf-8", "surrogateescape"))
        for name, value in raw_headers
    ]
    unstored = connection_scoped(decoded) | UNSTORED_RESPONSE_HEADERS
    return tuple((name, value) for name, value in decoded if name.lower() not in unstored)


async def read_limited(resp: aiohttp.ClientResponse, limit: int) -> bytes | None:
    """The whole body, or None as soon as it passes ``limit`` bytes (the rest is never read)."""
    chunks: list[bytes] = []
    size = 0
    # 64 KiB: aiohttp's own read size; a chunk never overshoots the limit by more than that.
    async for chunk in resp.content.iter_chunked(64 * 1024):
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


async def _tool_answer(resp: aiohttp.ClientResponse, call: str, limit: int) -> Outcome:
    """An MCP server's answer to the tool call ``call``, read up to that answer (a stream of events may
    go on after it) and no further than ``limit`` bytes."""
    content_type = resp.headers.get("Content-Type", "")
    if resp.status == 200 and mcp.media_type(content_type) == "text/event-stream":
        events, size = mcp.SseReader(), 0
        async for chunk in resp.content.iter_any():
            size += len(chunk)
            if size > limit:
                why = f"the MCP server's stream passed {limit} bytes before answering"
                return NoAnswer(why, too_large=True)
            for text in events.feed(chunk):
                answer = mcp.response_in(text, call)
                if answer is not None:
                    resp.close()
                    return _answered(resp.status, answer)
        answer = mcp.first_answer(events.feed(b"", final=True), call)
    else:
        body = await read_limited(resp, limit)
        if body is None:
            return NoAnswer(f"the response is larger than {limit} bytes", too_large=True)
        answer = mcp.answer_of(resp.status, content_type, body, call)
    if answer is None:
        return NoAnswer(f"the MCP server's answer (HTTP {resp.status}) holds no response to the call")
    return _answered(resp.status, answer)


def _answered(status: int, answer: mcp.ToolAnswer) -> Answered:
    return Answered(status, mcp.STORED_HEADERS, answer.stored, ran=answer.ran)


def _headers_sent(_session: Any, ctx: SimpleNamespace, _params: Any) -> Any:
    # Requests of our own that need no such flag (probes) pass no trace context.
    if ctx.trace_request_ctx is not None:
        ctx.trace_request_ctx.sent = True
    return _noop()


async def _noop() -> None:
    return None


def _session(policy: UpstreamPolicy, traces: list[aiohttp.TraceConfig]) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        # Shorter than any common server's idle timeout, so a pooled connection is rarely found closed
        # by the peer; a POST on such a connection would be left in doubt.
        connector=aiohttp.TCPConnector(limit=policy.max_connections, keepalive_timeout=10),
        trace_configs=traces,
        # Bodies are stored and replayed byte for byte, so they are never decoded on the way.
        auto_decompress=False,
        # The upstream gets the agent's headers, not aiohttp's defaults for them (Accept: */* among
        # them): a header the agent did not send may change what the upstream does.
        skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
        cookie_jar=aiohttp.DummyCookieJar(),
    )


@dataclass(frozen=True, slots=True)
class _Pool:
    session: aiohttp.ClientSession
    connect_timeout: float


class UpstreamClient:
    """One aiohttp session per upstream, so one that hangs holds its own connections and no other's.

    Call :meth:`close` at shutdown.
    """

    def __init__(
        self,
        policies: Iterable[UpstreamPolicy],
        max_response_bytes: int,
        telemetry: Telemetry | None = None,
    ) -> None:
        self._telemetry = telemetry or Telemetry()
        trace = aiohttp.TraceConfig()
        trace.on_request_headers_sent.append(_headers_sent)
        self._pools = {
            policy.name: _Pool(_session(policy, [trace]), policy.connect_timeout.total_seconds())
            for policy in policies
        }
        # An MCP server's messages that pass through unrecorded (gateway.mcp_proxy) have connections of
        # their own: an event stream holds one for as long as its session lasts, and a hundred sessions
        # on the effects' connections would leave no connection for a tool call.
        self._passing = {policy.name: _session(policy, []) for policy in policies if policy.protocol == "mcp"}
        self.max_response_bytes = max_response_bytes

    async def close(self) -> None:
        for pool in self._pools.values():
            await pool.session.close()
        for session in self._passing.values():
            await session.close()

    def passing(self, upstream: str) -> aiohttp.ClientSession:
        """The MCP upstream's session for what passes through unrecorded."""
        return self._passing[upstream]

    def session(self, upstream: str) -> aiohttp.ClientSession:
        """The upstream's own session (probes use it too, so they count against its connections)."""
        return self._pools[upstream].session

    async def send(self, request: Outbound, timeout: float, leave_within: float | None = None) -> Outcome:
        """Send ``request``; it leaves within ``leave_within`` seconds (a pooled connection) or not at all.

        Says what came of it; never raises for anything the upstream did.
        """
        with self._telemetry.upstream_call(request.upstream, request.method) as call:
            outcome = await self._send(request, timeout, leave_within)
            call.outcome = outcome
            return outcome

    async def _send(self, request: Outbound, timeout: float, leave_within: float | None) -> Outcome:
        pool = self._pools[request.upstream]
        flag = SimpleNamespace(sent=False)
        connect = min(pool.connect_timeout, timeout, leave_within if leave_within is not None else timeout)
        try:
            async with pool.session.request(
                request.method,
                request.url,
                headers=request.headers,
                data=request.body or None,
                # connect covers the wait for a free pooled connection as well as making one: a request
                # that gets none in time never left, and the agent may simply retry it.
                timeout=aiohttp.ClientTimeout(total=timeout, connect=connect),
                allow_redirects=False,
                trace_request_ctx=flag,
            ) as resp:
                if resp.status < 200:
                    # A 1xx that aiohttp hands over as final (101 Switching Protocols) says nothing of
                    # the effect, and the connection is no longer HTTP: drop it.
                    resp.close()
                    return NoAnswer(f"the upstream answered {resp.status}, which is not a final answer")
                if request.answer_to is not None:
                    return await _tool_answer(resp, request.answer_to, self.max_response_bytes)
                body = await read_limited(resp, self.max_response_bytes)
                if body is None:
                    return NoAnswer(
                        f"the response is larger than {self.max_response_bytes} bytes", too_large=True
                    )
                return Answered(status=resp.status, headers=storable_headers(resp.raw_headers), body=body)
        except TimeoutError:
            if not flag.sent:
                return NotSent(f"could not connect within {connect:g}s")
            return NoAnswer(f"no answer within {timeout:g}s", timed_out=True)
        except (aiohttp.ClientError, OSError) as exc:
            if not flag.sent:
                return NotSent(f"could not send: {type(exc).__name__}: {exc}")
            return NoAnswer(f"the connection broke after sending: {type(exc).__name__}: {exc}")
