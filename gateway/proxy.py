"""The proxy's handler: an agent's request to ``/<upstream>/<path>``, checked, read, and handed to the
driver (:class:`gateway.service.EffectService`); its reply written back as the upstream's answer.

Every refusal here happens before anything is claimed or sent: a bad target, an unknown upstream, a
browser, a malformed or made-up key, a body that cannot be read, the gateway's stamp set by the agent.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re

from aiohttp import web

from gateway import browser, codings, legible, mcp_proxy, problems, replies
from gateway.auth import tenant_of
from gateway.body import RequestBody, read_body
from gateway.fingerprint import covered
from gateway.headers import UNSTORED_RESPONSE_HEADERS
from gateway.inbound import OFF_LOOP_BYTES, Inbound, refuse_reserved, step_key
from gateway.keys import MAX_LABEL
from gateway.policy import UpstreamPolicy
from gateway.record import StoredResponse
from gateway.replies import Reply
from gateway.runtime import RUNTIME, read_request_body
from gateway.settings import Settings
from gateway.trail import CURRENT
from gateway.wire import RawHeadResponse

# An encoded slash, backslash, dot or NUL lets a path mean one thing to us and another upstream.
_ENCODED_TRICKS = re.compile(r"%(2f|5c|2e|00)", re.IGNORECASE)


# A request target is printable ASCII (RFC 9112 section 3.2); anything else is percent-encoded by a
# client that means it, and would be re-encoded on the way upstream, differently by each library.
_TARGET = re.compile(r"[\x21-\x7e]*")


# Past this many elements, fields, containers and form escapes (counted by their separators, brackets,
# "%" and "+", which bytes.count finds at memory speed), a body is read off the event loop whatever its
# size: each costs up to a few microseconds to parse and put in canonical form, so 10,000 form fields
# in 40 KB held the loop for 30 ms, and one field of 21,000 escapes (%41, or + for a space) in 64 KB for
# 15 to 19 ms. A thousand is a few milliseconds at most, and more than an API call's body holds. A JSON
# body with many "%" or "+" (base64, phone numbers) is then read off the loop too, which costs it only
# the hand-over to a thread.
OFF_LOOP_ITEMS = 1000


_ITEM_MARKS = (b",", b"&", b"[", b"{", b"%", b"+")


PROXY_ROUTE = r"/{tail:[\s\S]*}"


# The first segment of the gateway's own paths (no upstream may be named so: see settings).
GATEWAY_PATHS = "_gateway"
# What browsers and crawlers fetch of any site by themselves (its icons, robots.txt): none can be an
# upstream's name (no dots), and counted, they would pass for agents asking for unknown upstreams.
BROWSER_FETCHES = frozenset(
    {"favicon.ico", "robots.txt", "apple-touch-icon.png", "apple-touch-icon-precomposed.png"}
)
# Enough of a path naming no upstream for its log line to say what was asked for, however long it is.
MAX_LOGGED_PATH = 200


_PREFER_WAIT = re.compile(r"(?:^|[,;\s])wait\s*=\s*(\d+)", re.IGNORECASE)


def split_target(raw_path: str) -> tuple[str, str, str]:
    """Split the raw request target into (upstream, path, query); refuse anything that could escape."""
    if not _TARGET.fullmatch(raw_path):
        raise problems.PathRefused("the request target must be printable ASCII; percent-encode other bytes")
    if "#" in raw_path:
        # A fragment is never sent to a server; one here would hide a query stamp added after it.
        raise problems.PathRefused("'#' is refused in the request target; percent-encode it as %23")
    path, _, query = raw_path.partition("?")
    if not path.startswith("/") or path.startswith("//") or "://" in path:
        raise problems.PathRefused("absolute URLs are not accepted; send /<upstream>/<path>")
    if "\\" in path or _ENCODED_TRICKS.search(path):
        raise problems.PathRefused("encoded slashes, backslashes, dots and NULs are refused in paths")
    upstream, _, rest = path[1:].partition("/")
    rest = "/" + rest
    if any(segment in (".", "..") for segment in rest.split("/")):
        raise problems.PathRefused("'.' and '..' are refused in paths")
    return upstream, rest, query


def _label(request: web.Request, header: str) -> str | None:
    """Return the agent's run or step label, held to the rule of operators' names (legible.flaw):
    people read both in the audit, where a right-to-left override or a zero-width space would make one
    run look like another."""
    value = request.headers.get(header)
    if value is None:
        return None
    if len(value) > MAX_LABEL:
        raise problems.BadRequest(f"{header} is longer than {MAX_LABEL} characters")
    why = legible.flaw(value)
    if why is not None:
        raise problems.BadRequest(f"{header} {why}")
    return value


def _wait(request: web.Request, settings: Settings) -> float:
    match = _PREFER_WAIT.search(request.headers.get("Prefer", ""))
    if not match:
        return 0.0
    return min(float(match.group(1)), settings.max_wait.total_seconds())


async def proxy(request: web.Request) -> web.StreamResponse:
    """Check the agent's request, hand it to the driver, and answer with what comes back."""
    runtime = request.app[RUNTIME]
    trail = CURRENT.get()
    assert trail is not None, "observe_middleware starts one for every request routed here"
    upstream_name, path, query = split_target(request.raw_path)
    if upstream_name == GATEWAY_PATHS:
        await _not_ours_to_forward(request)
    policy = runtime.policies.get(upstream_name)
    if policy is None:
        trail.path = request.raw_path.partition("?")[0][:MAX_LOGGED_PATH]
        trail.browser_noise = upstream_name in BROWSER_FETCHES
        raise problems.UnknownUpstream(f"no upstream named {upstream_name!r} is configured")
    trail.upstream, trail.path = policy.name, path
    refused = browser.refusal(request.headers, policy.browser_origins)
    if refused is not None:
        raise problems.BrowserRefused(
            f"{refused}: a page in a browser may not call {policy.name} through the gateway, which would add "
            f"the credentials it injects; list the page's origin in upstreams.{policy.name}.browser_origins "
            "to allow it"
        )
    tenant = tenant_of(request, runtime.settings)
    trail.tenant = tenant
    if policy.protocol == "mcp":
        return await _mcp(request, policy, tenant, path, query)
    raw_key = request.headers.get("Idempotency-Key")
    key = None
    if raw_key is not None:
        key = step_key(raw_key, policy)
        trail.key_hash = runtime.log_hash.of(tenant, policy.name, key)
    run_id, step = _labels(request)
    body = await _body(request, runtime.settings, policy)
    await refuse_reserved(policy, request.headers, query, body)
    result = await runtime.service.handle(
        _inbound(request, policy, tenant, path, query, body, key, run_id, step)
    )
    reply = replies.answer(result)
    trail.replayed = reply.replayed
    return to_response(reply)


async def _mcp(
    request: web.Request, policy: UpstreamPolicy, tenant: str, path: str, query: str
) -> web.StreamResponse:
    """A request to an MCP server: its body read as any other's, its tool calls made effects."""
    runtime = request.app[RUNTIME]
    run_id, step = _labels(request)

    def inbound(body: RequestBody, key: str, tool: str) -> Inbound:
        return _inbound(request, policy, tenant, path, query, body, key, run_id, step, tool)

    return await mcp_proxy.relay(
        request, policy, tenant, path, query, lambda: _body(request, runtime.settings, policy), inbound
    )


def _labels(request: web.Request) -> tuple[str | None, str | None]:
    """The agent's run and step labels, noted on the request's trail."""
    run_id, step = _label(request, "Effect-Gateway-Run"), _label(request, "Effect-Gateway-Step")
    trail = CURRENT.get()
    if trail is not None:
        trail.run_id, trail.step = run_id, step
    return run_id, step


def _inbound(
    request: web.Request,
    policy: UpstreamPolicy,
    tenant: str,
    path: str,
    query: str,
    body: RequestBody,
    key: str | None,
    run_id: str | None,
    step: str | None,
    tool: str | None = None,
) -> Inbound:
    """The driver's request: what the agent sent, as read and checked here."""
    return Inbound(
        tenant=tenant,
        upstream=policy,
        method=request.method,
        path=path,
        query=query,
        headers=request.headers,
        body=body,
        key=key,
        wait=_wait(request, request.app[RUNTIME].settings),
        run_id=run_id,
        step=step,
        client_left=lambda: _client_left(request),
        tool=tool,
    )


def _client_left(request: web.Request) -> bool:
    """Whether the agent has hung up. aiohttp cancels no handler when it does (handler_cancellation is
    off: an upstream call must not be cut short), and drops the connection's transport instead."""
    transport = request.transport
    return transport is None or transport.is_closing()


async def _not_ours_to_forward(request: web.Request) -> None:
    """A path under /_gateway/ that no route of ours serves for this method: 405 or 404, never forwarded.

    The router hands it to the proxy (the catch-all takes every method); no upstream can have the name.
    """
    allowed: set[str] = set()
    for resource in request.app.router.resources():
        if resource is not request.match_info.route.resource:
            _, methods = await resource.resolve(request)
            allowed |= methods
    if allowed:
        raise problems.MethodNotAllowed(
            f"{request.method} is not allowed on {request.path}",
            headers={"Allow": ", ".join(sorted(allowed))},
        )
    raise problems.NotFound(
        f"nothing at {request.path} here: the audit, the effects API and the metrics are served on the "
        "admin listener (the admin_listen setting), never beside the upstreams"
    )


async def _body(request: web.Request, settings: Settings, policy: UpstreamPolicy) -> RequestBody:
    """Return the body as the gateway reads it: decoded of any Content-Encoding, parsed once.

    A body it cannot read raises one of the gateway's errors (a coding it does not know, one that
    inflates past the limit, bytes that are not their coding or their content type), each a 4xx
    through replies.problem_of_error.
    """
    raw = await read_request_body(request, settings)
    coded = codings.codings_of(request.headers.getall("Content-Encoding", ()))
    content_type = request.headers.get("Content-Type", "")
    if coded or _costly(raw):
        return await asyncio.to_thread(_read, raw, coded, content_type, settings, policy)
    return _read(raw, coded, content_type, settings, policy)


def _costly(raw: bytes) -> bool:
    """Whether reading ``raw`` may take longer than the event loop should wait for."""
    if len(raw) > OFF_LOOP_BYTES:
        return True
    return sum(raw.count(mark) for mark in _ITEM_MARKS) > OFF_LOOP_ITEMS


def _read(
    raw: bytes, coded: list[str], content_type: str, settings: Settings, policy: UpstreamPolicy
) -> RequestBody:
    """Decode ``raw`` of its codings, parse it and put it in the fingerprint's canonical form.

    These are the parts of reading a body whose time grows with it, done together so that a large body
    has them all off the event loop.
    """
    if coded:
        raw = codings.decode(raw, coded, settings.max_body_bytes, settings.max_content_codings)
    body = read_body(raw, content_type, policy.json_stamp_path)
    fields = policy.fingerprint_body
    return dataclasses.replace(body, covered=(fields, covered(body, fields)))


def to_response(reply: Reply) -> web.Response:
    """Write the reply as the upstream's answer, marked Idempotent-Replayed when it is a replay."""
    return response_of(reply.response, replayed=reply.replayed)


def response_of(stored: StoredResponse, *, replayed: bool) -> web.Response:
    """Write the stored answer with exactly the upstream's header bytes, on the first relay and every
    replay. A stored header that cannot be written raises HeaderRefused (a 500)."""
    # Lengths are aiohttp's to write; stored rows from before this rule, or an operator's, may hold one.
    headers = [
        (name, value) for name, value in stored.headers if name.lower() not in UNSTORED_RESPONSE_HEADERS
    ]
    if replayed:
        headers.append(("Idempotent-Replayed", "true"))
    return RawHeadResponse(stored.status, headers, stored.body)  # HeaderRefused: a 500
