"""aiohttp wiring, kept thin: HTTP in, :class:`gateway.inbound.Inbound` to the service, HTTP out."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.typedefs import Middleware

from gateway import admin, audit_routes, browser, codings, legible, openapi, problems, replies
from gateway.body import RequestBody, read_body
from gateway.errors import GatewayError
from gateway.fingerprint import covered
from gateway.headers import UNSTORED_RESPONSE_HEADERS
from gateway.inbound import Inbound
from gateway.jsonbody import JsonRefused
from gateway.keys import MAX_LABEL, KeySyntaxError, looks_made_up, parse_key
from gateway.parts import longest_lease, running
from gateway.policy import UpstreamPolicy
from gateway.record import StoredResponse
from gateway.replies import Reply
from gateway.runtime import (
    RUNTIME,
    ClientGone,
    check_headers,
    check_host,
    read_request_body,
    tenant_of,
)
from gateway.settings import ErrorFormat, Settings
from gateway.stamp import reserved_use
from gateway.trail import CURRENT, Trail
from gateway.urlencoded import FormRefused
from gateway.wire import HeaderRefused, RawHeadResponse

log = logging.getLogger("effect_gateway")

# An encoded slash, backslash, dot or NUL lets a path mean one thing to us and another upstream.
_ENCODED_TRICKS = re.compile(r"%(2f|5c|2e|00)", re.IGNORECASE)
# A request target is printable ASCII (RFC 9112 section 3.2); anything else is percent-encoded by a
# client that means it, and would be re-encoded on the way upstream, differently by each library.
_TARGET = re.compile(r"[\x21-\x7e]*")
# After refusing a request whose body has not all come (408, 413), aiohttp reads and drops the rest
# for this long so the agent can read the answer: a live agent sends even max_body_bytes far faster,
# and a stalled one would otherwise hold the socket for aiohttp's default of 10 s.
LINGER_SECONDS = 2.0
# Past this size a body is parsed off the event loop: the parse then takes milliseconds, which the
# other requests in flight should not wait for. An encoded body is always read off the loop: its size
# says nothing of its decoded size (a kilobyte of gzip inflates to a megabyte in 2 to 3 ms here), and
# zlib lets go of the interpreter while it inflates, so the loop runs meanwhile.
OFF_LOOP_BYTES = 64 * 1024
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
# The one gateway path on the agents' listener: what a load balancer or an orchestrator polls.
READINESS = "/_gateway/health"
_PREFER_WAIT = re.compile(r"(?:^|[,;\s])wait\s*=\s*(\d+)", re.IGNORECASE)


def _application(settings: Settings, *middlewares: Middleware) -> web.Application:
    return web.Application(
        client_max_size=settings.max_body_bytes,
        middlewares=middlewares,
        # Options of the HTTP server under the app, whichever runner serves it (cli, tests, bench).
        handler_args={
            # Bodies are decoded by gateway.codings, which knows the gateway's rule and its limits.
            "auto_decompress": False,
            # aiohttp closes a connection that has not delivered a whole request head this long after
            # it opened or after its previous answer: the head timeout (see the setting).
            "keepalive_timeout": settings.request_head_timeout.total_seconds(),
            "lingering_time": LINGER_SECONDS,
            "logger": ServerLog(logging.getLogger("aiohttp.server")),
        },
    )


def make_proxy_app(settings: Settings) -> web.Application:
    """The agents' side: every upstream under /<upstream>/, and the readiness probe. Nothing else.

    The admin routes are not here at all (see :func:`make_admin_app`): an upstream's answer, relayed on
    this origin, may hold a script, and a script on the operator's origin acts with their session.
    """
    checks = _request_checks(loopback_host=not settings.tenants)
    app = _application(settings, observe_middleware, problem_middleware, checks)
    app.on_shutdown.append(_finish_calls)
    app.router.add_get(READINESS, ready)
    # Every path, line breaks included: aiohttp matches the decoded path, and "." stops at an encoded %0A,
    # which would leave such a request to a 404 of the router instead of the proxy's own rules.
    app.router.add_route("*", PROXY_ROUTE, proxy)
    return app


def make_admin_app(settings: Settings) -> web.Application:
    """The operators' side, on ``admin_listen``: health with counts, metrics, the effects and the audit."""
    # Open to whoever reaches it only without an admin token and tenants: then, as for the agents'
    # listener without tenants, only a loopback name may be asked for (see runtime.check_host).
    app = _application(settings, problem_middleware, _request_checks(loopback_host=settings.admin_open))
    admin.add_routes(app)
    audit_routes.add_routes(app)
    app.router.add_get(openapi.PATH, openapi.serve)
    return app


@dataclass(frozen=True, slots=True)
class Runners:
    """The two listeners' applications, set up: add a site to each to serve it."""

    proxy: web.AppRunner
    admin: web.AppRunner


@asynccontextmanager
async def runners(
    settings: Settings,
    dsn: str,
    *,
    metrics_dir: str | None = None,
    tracer_provider: Any = None,
    shutdown_timeout: float = 60.0,
) -> AsyncIterator[Runners]:
    """The gateway running and its two applications set up; on the way out both stop, then its parts.

    ``shutdown_timeout``: how long aiohttp lets a client take its answer at shutdown (see gateway.serve).
    """
    async with running(settings, dsn, metrics_dir=metrics_dir, tracer_provider=tracer_provider) as runtime:
        proxy_app, admin_app = make_proxy_app(settings), make_admin_app(settings)
        proxy_app[RUNTIME] = admin_app[RUNTIME] = runtime
        proxy_runner, admin_runner = (
            web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=shutdown_timeout)
            for app in (proxy_app, admin_app)
        )
        await proxy_runner.setup()
        try:
            await admin_runner.setup()
            try:
                yield Runners(proxy_runner, admin_runner)
            finally:
                await admin_runner.cleanup()
        finally:
            # Stops taking requests, then lets the calls under way finish and record (_finish_calls).
            await proxy_runner.cleanup()


async def _finish_calls(app: web.Application) -> None:
    """At shutdown, once no connection takes new requests: the calls under way finish and record.

    Their agents then get their answers in the runner's short shutdown timeout (see gateway.serve),
    instead of aiohttp waiting that long for handlers that may still be calling their upstream.
    """
    runtime = app[RUNTIME]
    await runtime.service.drain(timeout=longest_lease(runtime.policies))


class ServerLog(logging.LoggerAdapter[logging.Logger]):
    """aiohttp's server log, less the tracebacks of other peers' mistakes.

    aiohttp logs a request it cannot parse (a bad header, a bad Content-Length) at ERROR with a
    traceback, as if the gateway had failed; one line at INFO says what the peer did. Everything else
    it logs, the gateway's real failures among them, is passed on as it is.
    """

    def exception(self, msg: object, *args: object, exc_info: Any = True, **kwargs: Any) -> None:
        exc = exc_info if isinstance(exc_info, BaseException) else sys.exc_info()[1]
        if isinstance(exc, HttpProcessingError):
            # Only the kind of mistake: after its first colon aiohttp quotes the peer's bytes (a line too
            # long: the start of that line, which may be a token or an Authorization header).
            kind = (exc.message or "").strip().split("\n", 1)[0].split(":", 1)[0]
            self.info("refused a malformed request (%s %s)", exc.code, kind)
            return
        super().exception(msg, *args, exc_info=exc_info, **kwargs)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _request_checks(*, loopback_host: bool) -> Middleware:
    """Refuse what no route should read: ambiguous headers, and (``loopback_host``) a non-loopback Host.

    Placed inside problem_middleware, which renders what it raises.
    """

    @web.middleware
    async def checks(request: web.Request, handler: Handler) -> web.StreamResponse:
        check_headers(request)
        if loopback_host:
            check_host(request)
        return await handler(request)

    return checks


@web.middleware
async def observe_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Each request to an upstream gets a trail, and on its way out its metrics, log line and span."""
    if request.match_info.handler is not proxy:
        return await handler(request)
    telemetry = request.app[RUNTIME].telemetry
    started = time.perf_counter()
    trail = Trail(request.method, started)
    token = CURRENT.set(trail)
    try:
        with telemetry.request(trail, request.headers):
            try:
                response = await handler(request)
            except web.HTTPException as exc:
                trail.status = exc.status
                raise
            trail.status = response.status
            trail.problem = response.get(problems.PROBLEM_TYPE)
            return response
    finally:
        CURRENT.reset(token)


@web.middleware
async def problem_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The one place where errors become problem+json (or the upstream's error format)."""
    try:
        return await handler(request)
    except problems.Problem as problem:
        instance = request.path_qs if request.path_qs.isascii() else None
        return problems.render(problem, instance, _error_format(request))
    except web.HTTPRequestEntityTooLarge as exc:
        return _render(request, problems.BodyTooLarge(exc.text or "the request body is too large"))
    except web.HTTPMethodNotAllowed as exc:
        allowed = {"Allow": ", ".join(sorted(exc.allowed_methods))}
        return _render(
            request,
            problems.MethodNotAllowed(f"{request.method} is not allowed on {request.path}", headers=allowed),
        )
    except web.HTTPNotFound:
        return _render(request, problems.NotFound(f"nothing at {request.path}"))
    except ClientGone as exc:
        # Not a failure of ours; the answer below goes nowhere and aiohttp drops it quietly.
        log.info(
            "%s %s: the client went away before its request was whole (%s)", request.method, request.path, exc
        )
        return _render(request, problems.BadRequest("the request was cut short"))
    except GatewayError as exc:
        told = replies.problem_of_error(exc)
        # The gateway's own failures are logged as errors; an operator's mistake (a 4xx) is not one.
        level = logging.ERROR if told.status >= 500 else logging.INFO
        log.log(level, "%s %s: %s", request.method, request.path, exc)
        return _render(request, told)
    except web.HTTPException:
        raise
    except Exception:
        log.exception("unexpected error on %s %s", request.method, request.path)
        return _render(request, problems.Problem("the gateway failed unexpectedly; see its log"))


def _render(request: web.Request, problem: problems.Problem) -> web.Response:
    return problems.render(problem, error_format=_error_format(request))


def _error_format(request: web.Request) -> ErrorFormat:
    """The error format of the upstream the request is addressed to (problem+json for every other route)."""
    runtime = request.app.get(RUNTIME)
    name = request.raw_path[1:].partition("/")[0].partition("?")[0]
    policy = runtime.policies.get(name) if runtime is not None else None
    return policy.error_format if policy is not None else "problem+json"


def split_target(raw_path: str) -> tuple[str, str, str]:
    """(upstream, path, query) from the raw request target; refuses anything that could escape."""
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
    runtime = request.app[RUNTIME]
    trail = CURRENT.get()
    assert trail is not None, "observe_middleware starts one for every request routed here"
    upstream_name, path, query = split_target(request.raw_path)
    if upstream_name == GATEWAY_PATHS:
        await _not_ours_to_forward(request)
    policy = runtime.policies.get(upstream_name)
    if policy is None:
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
    raw_key = request.headers.get("Idempotency-Key")
    key = None
    if raw_key is not None:
        try:
            key = parse_key(raw_key)
        except KeySyntaxError as exc:
            raise problems.KeyMalformed(str(exc)) from None
        trail.key_hash = runtime.log_hash.of(tenant, policy.name, key)
        if policy.refuse_random_keys and looks_made_up(key):
            raise problems.KeyRandom(
                f"{policy.name} takes step keys only, and this one ends in a UUID, as keys an SDK makes up "
                "for a single call do; a key made up per call is new on the agent's re-run, which would do "
                "the effect again. Send the step's key (run:step), e.g. from the journal"
            )
    run_id, step = _label(request, "Effect-Gateway-Run"), _label(request, "Effect-Gateway-Step")
    trail.run_id, trail.step = run_id, step
    body = await _body(request, runtime.settings, policy)
    if len(body.raw) > OFF_LOOP_BYTES:  # searched for the stamp's name: 6 ms a megabyte
        taken = await asyncio.to_thread(reserved_use, policy, request.headers, query, body)
    else:
        taken = reserved_use(policy, request.headers, query, body)
    if taken is not None:
        raise problems.StampReserved(
            f"{taken} is where the gateway puts its key for {policy.name}; the request may not set it"
        )
    result = await runtime.service.handle(
        Inbound(
            tenant=tenant,
            upstream=policy,
            method=request.method,
            path=path,
            query=query,
            headers=request.headers,
            body=body,
            key=key,
            wait=_wait(request, runtime.settings),
            run_id=run_id,
            step=step,
            client_left=lambda: _client_left(request),
        )
    )
    reply = replies.answer(result)
    trail.replayed = reply.replayed
    return to_response(reply)


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


async def ready(request: web.Request) -> web.Response:
    """Up (200) when this worker serves and Postgres answers, for a load balancer or an orchestrator."""
    await request.app[RUNTIME].store.ping()  # down (503) when the store is
    return web.json_response({"status": "ok"})


async def _body(request: web.Request, settings: Settings, policy: UpstreamPolicy) -> RequestBody:
    """The body as the gateway reads it: decoded of any Content-Encoding, parsed once."""
    raw = await read_request_body(request, settings)
    coded = codings.codings_of(request.headers.getall("Content-Encoding", ()))
    content_type = request.headers.get("Content-Type", "")
    try:
        if coded or _costly(raw):
            return await asyncio.to_thread(_read, raw, coded, content_type, settings, policy)
        return _read(raw, coded, content_type, settings, policy)
    except codings.UnsupportedCoding as exc:
        raise problems.EncodingUnsupported(str(exc)) from None
    except codings.DecodedTooLarge as exc:
        raise problems.BodyTooLarge(str(exc)) from None
    except codings.BadCoding as exc:
        raise problems.BodyMalformed(str(exc)) from None
    except (JsonRefused, FormRefused) as exc:
        raise problems.BodyMalformed(f"{exc}; nothing was sent") from None


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
    return response_of(reply.response, replayed=reply.replayed)


def response_of(stored: StoredResponse, *, replayed: bool) -> web.Response:
    """The stored answer with exactly the upstream's header bytes, on the first relay and every replay."""
    # Lengths are aiohttp's to write; stored rows from before this rule, or an operator's, may hold one.
    headers = [
        (name, value) for name, value in stored.headers if name.lower() not in UNSTORED_RESPONSE_HEADERS
    ]
    if replayed:
        headers.append(("Idempotent-Replayed", "true"))
    try:
        return RawHeadResponse(stored.status, headers, stored.body)
    except HeaderRefused as exc:
        raise problems.Problem(f"the stored answer cannot be written: {exc}") from None
