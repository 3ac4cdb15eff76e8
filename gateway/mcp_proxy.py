"""An MCP server's endpoint behind the gateway: tool calls with side effects go through the driver as
effects; every other message, and every GET and DELETE of the transport, passes through unrecorded and
streamed, as the server answered it.

An agent's MCP client points at ``/<upstream>/<the server's endpoint path>`` instead of the server. A
``tools/call`` of a tool with side effects (gateway.mcp.kind_of) needs a key: in the call's
``params._meta["effect-gateway/idempotency-key"]`` or the POST's ``Idempotency-Key`` header. Its answer,
first or replayed, is the JSON-RPC response under the call's own id, as JSON when the agent takes JSON
(MCP clients take both) and as an event stream otherwise. Whatever the gateway refuses or waits for on a
tool call is a JSON-RPC error (code -32000) whose ``data`` is the problem it would answer over HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from gateway import browser, jsonbody, mcp, problems, replies
from gateway.body import RequestBody
from gateway.errors import GatewayError, JsonRefused, KeySyntaxError
from gateway.inbound import Inbound, refuse_reserved, step_key
from gateway.policy import UpstreamPolicy
from gateway.runtime import RUNTIME, Runtime
from gateway.trail import CURRENT
from gateway.upstream import build_outbound, storable_headers

T = TypeVar("T")

# The most of a tools/list answer read for its annotations (a server with thousands of tools lists
# them in pages); past it the tools keep what the operator or an earlier page said.
MOST_LISTED = 1024 * 1024


async def relay(
    request: web.Request,
    policy: UpstreamPolicy,
    tenant: str,
    path: str,
    query: str,
    read: Callable[[], Awaitable[RequestBody]],
    inbound: Callable[[RequestBody, str, str], Inbound],
) -> web.StreamResponse:
    """Answer one request to the MCP upstream ``policy``.

    ``read`` reads the body as the proxy reads any (decoded, parsed, its fingerprint built); ``inbound``
    makes the driver's request of it under a key, for a tool.
    """
    runtime = request.app[RUNTIME]
    try:
        body = await read()
    except (problems.Problem, GatewayError) as exc:
        if request.method != "POST":
            raise
        told = exc if isinstance(exc, problems.Problem) else replies.problem_of_error(exc)
        unread = mcp.Refused("null", f"the message cannot be read: {told.detail}", -32700)
        return _rpc(request, mcp.refused(unread))
    if request.method != "POST":
        return await _pass(request, runtime, policy, path, query, body)
    if body.json is None:
        why = "an MCP message is JSON, sent with Content-Type: application/json"
        return _rpc(request, mcp.refused(mcp.Refused("null", why, -32700)))
    message = mcp.message_of(body.json.value)
    match message:
        case mcp.Refused():
            return _rpc(request, mcp.refused(message))
        case mcp.PassThrough(method=method):
            listing = mcp.id_of(body.json.value) if method == "tools/list" else None
            return await _pass(request, runtime, policy, path, query, body, listing=listing)
    hints = runtime.tool_hints.get((policy.name, path), {})
    if mcp.kind_of(message.name, policy.tools, hints) == "read_only":
        return await _pass(request, runtime, policy, path, query, body)
    try:
        key = _key(message, request.headers.get("Idempotency-Key"), policy)
        if key is None:
            raise problems.KeyMissing(
                f"the tool {message.name!r} of {policy.name} is not known to be read-only, and its call "
                f"needs a key: in params._meta[{mcp.KEY_META!r}] (the journal's call_tool puts the step's "
                "key there) or an Idempotency-Key header; without one a retry would run the tool again. "
                f"A tool without side effects is named so in upstreams.{policy.name}.tools, or by the "
                "server's annotations in a tools/list this worker has passed on"
            )
        await refuse_reserved(policy, request.headers, query, body)
        trail = CURRENT.get()
        if trail is not None:
            trail.key_hash = runtime.log_hash.of(tenant, policy.name, key)
        result = await runtime.service.handle(inbound(body, key, message.name))
        reply = replies.answer(result)
    except (problems.Problem, GatewayError) as exc:
        told = exc if isinstance(exc, problems.Problem) else replies.problem_of_error(exc)
        _note(told)
        return _rpc(request, mcp.gateway_error(message.id_json, told.detail, told.body()), told.headers)
    stored = reply.response.body
    if not stored.startswith((b'{"result":', b'{"error":')):
        why = "the answer on record for this key is not an MCP server's answer to a tool call"
        return _rpc(request, mcp.gateway_error(message.id_json, why, {"status": reply.response.status}))
    trail = CURRENT.get()
    if trail is not None:
        trail.replayed = reply.replayed
    headers = {"Idempotent-Replayed": "true"} if reply.replayed else {}
    return _rpc(request, mcp.envelope(stored, message.id_json), headers)


def _key(call: mcp.ToolCall, header: str | None, policy: UpstreamPolicy) -> str | None:
    """The call's key: in its _meta or the POST's header (the same key where both are given)."""
    if call.key is not None and header is not None and call.key != header:
        raise problems.BadRequest(
            f'params._meta["{mcp.KEY_META}"] and the Idempotency-Key header name two different keys'
        )
    key = call.key if call.key is not None else header
    try:
        return step_key(key, policy) if key is not None else None
    except KeySyntaxError as exc:
        raise problems.KeyMalformed(str(exc)) from None


def _note(problem: problems.Problem) -> None:
    # The request's metrics and log line name the problem, as for an HTTP answer (gateway.telemetry).
    trail = CURRENT.get()
    if trail is not None:
        trail.problem = problem.type


def _rpc(request: web.Request, message: bytes, headers: dict[str, str] | None = None) -> web.Response:
    """One JSON-RPC message as the gateway's answer, in the framing the agent takes."""
    content_type, body = mcp.framed(message, mcp.framing(request.headers.get("Accept", "")))
    out = web.Response(status=200, body=body, headers=headers or {})
    out.content_type = content_type
    return out


async def _pass(
    request: web.Request,
    runtime: Runtime,
    policy: UpstreamPolicy,
    path: str,
    query: str,
    body: RequestBody,
    *,
    listing: str | None = None,
) -> web.StreamResponse:
    """Send the request on as it came (with the upstream's credentials) and stream the answer back, on
    connections apart from the effects' (gateway.upstream.UpstreamClient.passing), for as long as the
    agent stays.

    ``listing``: the id of a tools/list request, whose answer's annotations are kept for the next calls
    to this endpoint.
    """
    headers = browser.cookieless(request.headers)
    outbound = build_outbound(policy, None, request.method, path, query, headers, body)
    # No total: a GET's event stream lasts as long as the session does.
    timeout = aiohttp.ClientTimeout(total=None, connect=policy.connect_timeout.total_seconds())
    relayed: list[web.StreamResponse] = []
    try:
        async with runtime.client.passing(policy.name).request(
            outbound.method,
            outbound.url,
            headers=outbound.headers,
            data=outbound.body or None,
            timeout=timeout,
            allow_redirects=False,
        ) as resp:
            out = web.StreamResponse(
                status=resp.status, headers=CIMultiDict(storable_headers(resp.raw_headers))
            )
            relayed.append(out)
            await out.prepare(request)
            relaying = _relay(resp, out, listing is not None)
            listed = await _while_the_agent_stays(request, runtime.streams, relaying)
            if listing is not None and listed is not None and resp.status == 200:
                _learn(runtime, (policy.name, path), listing, resp.headers.get("Content-Type", ""), listed)
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        if not relayed:
            unreachable = problems.UpstreamUnreachable(
                f"{policy.name} could not be reached: {type(exc).__name__}: {exc}; nothing was recorded"
            )
            # A request gets a JSON-RPC error under its own id, which an MCP client raises, where the
            # HTTP problem would be a transport error; a GET or a notification gets the problem.
            request_id = mcp.id_of(body.json.value) if body.json is not None else None
            if request_id is None:
                raise unreachable from None
            _note(unreachable)
            return _rpc(request, mcp.gateway_error(request_id, unreachable.detail, unreachable.body()))
        # The answer was under way: the agent sees its stream end, as it would from the server.
    trail = CURRENT.get()
    if trail is not None:
        trail.status = relayed[0].status
    return relayed[0]


async def _relay(resp: aiohttp.ClientResponse, out: web.StreamResponse, keep: bool) -> bytes | None:
    """Write the server's answer to the agent as it comes; with ``keep``, return it too (None past
    MOST_LISTED bytes)."""
    kept: list[bytes] = []
    size = 0
    async for chunk in resp.content.iter_any():
        await out.write(chunk)
        size += len(chunk)
        if keep and size <= MOST_LISTED:
            kept.append(chunk)
    await out.write_eof()
    return b"".join(kept) if keep and size <= MOST_LISTED else None


# How often a stream passed through looks whether its agent has gone. aiohttp cancels no handler when
# a client hangs up (the gateway turns that off, so that an upstream call is never cut short): an event
# stream the server keeps quiet would otherwise hold its connection to the server for ever.
AGENT_CHECK_S = 1.0


async def _while_the_agent_stays(
    request: web.Request, streams: set[asyncio.Future[Any]], relaying: Coroutine[Any, Any, T]
) -> T | None:
    """Run ``relaying`` until it ends, the agent has hung up, or the gateway stops (which cancels the
    ``streams``): None but when it ended."""
    task = asyncio.ensure_future(relaying)
    streams.add(task)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=AGENT_CHECK_S)
            if done:
                return None if task.cancelled() else task.result()
            transport = request.transport
            if transport is None or transport.is_closing():
                return None
    finally:
        streams.discard(task)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task


def _learn(runtime: Runtime, endpoint: tuple[str, str], listing: str, content_type: str, body: bytes) -> None:
    """Keep what the answer to the tools/list ``listing`` says of each tool, for this endpoint alone."""
    answer = mcp.first_answer(mcp.messages_in(content_type, body), listing)
    if answer is None or answer.ran != "yes":
        return
    try:
        result = jsonbody.loads(answer.stored)["result"]
    except JsonRefused:
        return
    runtime.tool_hints.setdefault(endpoint, {}).update(mcp.hints_of(result))
