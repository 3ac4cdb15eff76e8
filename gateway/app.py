"""The aiohttp wiring, kept thin: the two applications (the agents' listener and the operators'), their
middlewares, and the parts they share. The proxy's handler is :mod:`gateway.proxy`."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.typedefs import Middleware

from gateway import admin, audit_routes, openapi, problems, replies
from gateway.errors import ClientGone, GatewayError
from gateway.parts import running
from gateway.proxy import PROXY_ROUTE, proxy
from gateway.runtime import RUNTIME, check_headers, check_host
from gateway.settings import ErrorFormat, Settings
from gateway.trail import CURRENT, Trail

log = logging.getLogger("effect_gateway")

# After refusing a request whose body has not all come (408, 413), aiohttp reads and drops the rest
# for this long so the agent can read the answer: a live agent sends even max_body_bytes far faster,
# and a stalled one would otherwise hold the socket for aiohttp's default of 10 s.
LINGER_SECONDS = 2.0
# The one gateway path on the agents' listener: what a load balancer or an orchestrator polls.
READINESS = "/_gateway/health"


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
    """Start the gateway's parts and set up its two applications; on the way out stop both, then the parts.

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
    for stream in list(runtime.streams):  # what an MCP server streams to its agents, unrecorded
        stream.cancel()
    await runtime.service.drain(timeout=runtime.longest_lease)


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
        return _render(request, problem)
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
        if told.status >= 500:
            # The gateway's own failures; a request it refuses (a 4xx) is in the request's log line.
            log.error("%s %s: %s", request.method, request.path, exc)
        return _render(request, told)
    except web.HTTPException:
        raise
    except Exception:
        log.exception("unexpected error on %s %s", request.method, request.path)
        return _render(request, problems.Problem("the gateway failed unexpectedly; see its log"))


def _render(request: web.Request, problem: problems.Problem) -> web.Response:
    # Named by the request it answers (RFC 9457 instance), when its target is ASCII as it should be.
    instance = request.path_qs if request.path_qs.isascii() else None
    return problems.render(problem, instance, _error_format(request))


def _error_format(request: web.Request) -> ErrorFormat:
    """The error format of the upstream the request is addressed to (problem+json for every other route)."""
    runtime = request.app.get(RUNTIME)
    name = request.raw_path[1:].partition("/")[0].partition("?")[0]
    policy = runtime.policies.get(name) if runtime is not None else None
    return policy.error_format if policy is not None else "problem+json"


async def ready(request: web.Request) -> web.Response:
    """Up (200) when this worker serves and Postgres answers, for a load balancer or an orchestrator."""
    # Not down when the database has lost writes: an orchestrator would restart the worker for it, and
    # nothing would be gained (the refusal is kept in the database, gateway.lost_writes).
    await request.app[RUNTIME].store.ping()  # down (503) when the store is
    return web.json_response({"status": "ok"})
